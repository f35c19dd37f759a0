// Rotary embedding of q and k (with Qwen3's per-head RMSNorm before it) and the KV-cache append into the
// paged pool, one warp per head of one token: the head's values stay in registers from the norm to the
// rotation, then pass through the warp's row of shared memory to the store, which rounds them to the
// cache's type once (src/kv.rs's rounding, operation for operation: a block type's scale from the warp's
// max of 32 values). Each token finds its page through its own stream's page table, so one launch serves
// the tokens of every stream in a batch.
#include "hostembed_kernels.cuh"

namespace {

constexpr int ROPE_WARPS = 4;
// Pairs per lane: head_dim up to 256 is 128 pairs over 32 lanes.
constexpr int ROPE_PAIRS = 4;
constexpr int ROPE_MAX_DIM = 64 * ROPE_PAIRS;

// x rounded to E4M3 as src/kv.rs's e4m3_from_f32: nearest even, saturating at 448, NaN kept.
__device__ __forceinline__ unsigned int e4m3_from_f32(float x) {
    const unsigned int sign = (__float_as_uint(x) >> 24) & 0x80u;
    if (x != x) return sign | 0x7Fu;
    const float a = fabsf(x);
    if (a >= 448.f) return sign | 0x7Eu;
    if (a < 0.015625f) return sign | (unsigned int)rintf(a * 512.f);
    const int e = (int)(__float_as_uint(a) >> 23) - 127;
    const int steps = (int)rintf(a * __uint_as_float((unsigned int)(127 + 3 - e) << 23));
    return sign | (unsigned int)(((e + 7) << 3) + steps - 8);
}

// x (already divided by the scale) as a Q8_0 quant, as src/tensor/q8_0.rs rounds it: half away from zero,
// clamped to [-127, 127], NaN as 0 (Rust's float-to-int cast).
__device__ __forceinline__ unsigned int q8_from_f32(float x) {
    float r = roundf(x);
    if (r != r) r = 0.f;
    r = fminf(fmaxf(r, -127.f), 127.f);
    return (unsigned int)(unsigned char)(signed char)(int)r;
}

// Stores one head's row (`row`, d values in shared memory, written by this warp) at slot `slot` of its
// slab in `type`. Called by the whole warp.
__device__ __forceinline__ void store_row(int type, unsigned char *slab, unsigned int slot, const float *row,
                                          unsigned int d, unsigned int lane) {
    switch (type) {
    case HE_KV_BF16: {
        unsigned short *dst = reinterpret_cast<unsigned short *>(slab) + (size_t)slot * d;
        for (unsigned int i = lane; i < d; i += 32) dst[i] = he::f32_to_bf16_bits(row[i]);
        break;
    }
    case HE_KV_F16: {
        unsigned short *dst = reinterpret_cast<unsigned short *>(slab) + (size_t)slot * d;
        for (unsigned int i = lane; i < d; i += 32) dst[i] = __half_as_ushort(__float2half_rn(row[i]));
        break;
    }
    case HE_KV_F32: {
        float *dst = reinterpret_cast<float *>(slab) + (size_t)slot * d;
        for (unsigned int i = lane; i < d; i += 32) dst[i] = row[i];
        break;
    }
    default: {  // a block type: lane i takes value i of each block
        const bool q8 = type == HE_KV_Q8_0;
        unsigned short *scales = reinterpret_cast<unsigned short *>(slab + (size_t)HE_PAGE_TOKENS * d);
        for (unsigned int b = 0; b < d / HE_KV_BLOCK; b++) {
            const float v = row[b * HE_KV_BLOCK + lane];
            // max|x| from 0, a NaN ignored (Rust's f32::max).
            const float amax = he::warp_max(fmaxf(0.f, fabsf(v)));
            unsigned int code, bits;
            if (q8) {  // Q8_0::encode_block: the unrounded scale's inverse, the scale stored as f16
                const float scale = amax / 127.f;
                const float inv = scale > 0.f ? 1.f / scale : 0.f;
                code = q8_from_f32(v * inv);
                bits = __half_as_ushort(__float2half_rn(scale));
            } else {  // kv::fp8_block: the bf16 scale's inverse, 0 where the scale is not normal
                bits = he::f32_to_bf16_bits(amax / 448.f);
                const float s = __uint_as_float(bits << 16);
                const float inv = s >= 1.17549435e-38f ? 1.f / s : 0.f;
                code = e4m3_from_f32(v * inv);
            }
            slab[(size_t)slot * d + b * HE_KV_BLOCK + lane] = (unsigned char)code;
            if (lane == 0) scales[(size_t)slot * (d / HE_KV_BLOCK) + b] = (unsigned short)bits;
        }
        break;
    }
    }
}

__global__ __launch_bounds__(ROPE_WARPS * 32) void rope_kv_kernel(
    float *qkv, unsigned int qkv_stride, unsigned int n, const int *__restrict__ pos, unsigned int heads,
    unsigned int kv_heads, unsigned int head_dim, const float *__restrict__ inv_freq, int interleaved,
    const float *__restrict__ q_norm, const float *__restrict__ k_norm, float eps, unsigned char *kv_pool,
    const unsigned int *const *__restrict__ tables, unsigned int pool_pages, int k_type, int v_type) {
    // Launched overlapped: what the step's uploads and the model give (positions, page tables, the
    // rotation's angles) is read before waiting for qkv from the kernel before (he::pdl_wait below).
    he::pdl_launch_dependents();
    __shared__ float stage_all[ROPE_WARPS][ROPE_MAX_DIM];
    const unsigned int slots = heads + 2 * kv_heads;
    const size_t item = (size_t)blockIdx.x * ROPE_WARPS + threadIdx.x / 32;
    const unsigned int lane = threadIdx.x % 32;
    if (item >= (size_t)n * slots) return;  // the whole warp: one item per warp
    float *stage = stage_all[threadIdx.x / 32];
    const unsigned int t = (unsigned int)(item / slots), slot = (unsigned int)(item % slots);
    const int p = pos[t];
    // The token's page, or none: no pool, a negative position, or a table entry past the pool.
    unsigned char *page = nullptr;
    if (kv_pool != nullptr && p >= 0) {
        const unsigned int id = tables[t][(unsigned int)p / HE_PAGE_TOKENS];
        if (id < pool_pages) page = kv_pool + (size_t)id * he::kv_page_bytes(kv_heads, head_dim, k_type, v_type);
    }
    const unsigned int slot_in_page = (unsigned int)p % HE_PAGE_TOKENS;
    const bool cache_ok = page != nullptr;
    float *head = qkv + (size_t)t * qkv_stride + (size_t)slot * head_dim;
    const unsigned int half = head_dim / 2;

    if (slot >= heads + kv_heads) {  // a v head: stored as it is
        if (!cache_ok) return;
        const unsigned int kvh = slot - heads - kv_heads;
        he::pdl_wait();
        for (unsigned int i = lane; i < head_dim; i += 32) stage[i] = head[i];
        __syncwarp();
        unsigned char *slab = page + he::kv_slab_at(kv_heads, head_dim, k_type, v_type, true, kvh);
        store_row(v_type, slab, slot_in_page, stage, head_dim, lane);
        return;
    }

    const bool is_q = slot < heads;
    // Pair j rotates (j, j + half) or (2j, 2j + 1) by p * inv_freq[j].
    float sin_j[ROPE_PAIRS], cos_j[ROPE_PAIRS];
#pragma unroll
    for (int k = 0; k < ROPE_PAIRS; k++) {
        const unsigned int j = lane + 32 * k;
        if (j < half) sincosf((float)p * inv_freq[j], &sin_j[k], &cos_j[k]);
    }
    he::pdl_wait();
    float a[ROPE_PAIRS], b[ROPE_PAIRS];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < ROPE_PAIRS; k++) {
        const unsigned int j = lane + 32 * k;
        a[k] = b[k] = 0.f;
        if (j < half) {
            const unsigned int ia = interleaved ? 2 * j : j, ib = interleaved ? 2 * j + 1 : j + half;
            a[k] = head[ia];
            b[k] = head[ib];
            ss += a[k] * a[k] + b[k] * b[k];
        }
    }
    const float *norm = is_q ? q_norm : k_norm;
    if (norm != nullptr) {
        ss = he::warp_sum(ss);
        const float inv = rsqrtf(ss / (float)head_dim + eps);
#pragma unroll
        for (int k = 0; k < ROPE_PAIRS; k++) {
            const unsigned int j = lane + 32 * k;
            if (j < half) {
                const unsigned int ia = interleaved ? 2 * j : j, ib = interleaved ? 2 * j + 1 : j + half;
                a[k] = a[k] * inv * norm[ia];
                b[k] = b[k] * inv * norm[ib];
            }
        }
    }
    const bool store = !is_q && cache_ok;
#pragma unroll
    for (int k = 0; k < ROPE_PAIRS; k++) {
        const unsigned int j = lane + 32 * k;
        if (j < half) {
            const unsigned int ia = interleaved ? 2 * j : j, ib = interleaved ? 2 * j + 1 : j + half;
            const float s = sin_j[k], c = cos_j[k];
            const float ra = a[k] * c - b[k] * s, rb = a[k] * s + b[k] * c;
            head[ia] = ra;
            head[ib] = rb;
            if (store) stage[ia] = ra, stage[ib] = rb;
        }
    }
    if (store) {  // the whole warp: `store` depends on the item only
        __syncwarp();
        unsigned char *slab = page + he::kv_slab_at(kv_heads, head_dim, k_type, v_type, false, slot - heads);
        store_row(k_type, slab, slot_in_page, stage, head_dim, lane);
    }
}

}  // namespace

extern "C" cudaError_t hostembed_rope_kv(float *qkv, unsigned int qkv_stride, unsigned int n, const int *pos,
                                         unsigned int heads, unsigned int kv_heads, unsigned int head_dim,
                                         const float *inv_freq, int interleaved, const float *q_norm,
                                         const float *k_norm, float eps, void *kv_pool,
                                         const unsigned int *const *tables, unsigned int pool_pages, int k_type,
                                         int v_type, hostembed_tuning tuning, cudaStream_t stream) {
    if (qkv == nullptr || pos == nullptr || inv_freq == nullptr) return cudaErrorInvalidValue;
    if (head_dim == 0 || head_dim % 2 != 0 || head_dim > ROPE_MAX_DIM || heads == 0 || kv_heads == 0)
        return cudaErrorInvalidValue;
    if ((size_t)qkv_stride < (size_t)(heads + 2 * kv_heads) * head_dim) return cudaErrorInvalidValue;
    if (kv_pool != nullptr && (tables == nullptr || pool_pages == 0)) return cudaErrorInvalidValue;
    // A pool's slabs hold whole 16-byte pieces and whole blocks.
    if (kv_pool != nullptr && (head_dim % 8 != 0 || !he::kv_type_ok(k_type, head_dim) ||
                               !he::kv_type_ok(v_type, head_dim) || reinterpret_cast<uintptr_t>(kv_pool) % 16 != 0))
        return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    const size_t items = (size_t)n * (heads + 2 * kv_heads);
    const size_t blocks = (items + ROPE_WARPS - 1) / ROPE_WARPS;
    if (blocks > 0x7fffffffu) return cudaErrorInvalidValue;
    return he::launch_overlapped(tuning, rope_kv_kernel, dim3((unsigned int)blocks), dim3(ROPE_WARPS * 32), 0, stream,
                                 qkv, qkv_stride, n, pos, heads, kv_heads, head_dim, inv_freq, interleaved, q_norm,
                                 k_norm, eps, static_cast<unsigned char *>(kv_pool), tables, pool_pages, k_type,
                                 v_type);
}

extern "C" cudaError_t hostembed_kv_page_tokens(unsigned int *page_tokens) {
    if (page_tokens == nullptr) return cudaErrorInvalidValue;
    *page_tokens = HE_PAGE_TOKENS;
    return cudaSuccess;
}
