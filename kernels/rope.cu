// Rotary embedding of q and k (with Qwen3's per-head RMSNorm before it) and the KV-cache append into the
// paged pool, one warp per head of one token: the head's values stay in registers from the norm to the
// store. Each token finds its page through its own stream's page table, so one launch serves the tokens
// of every stream in a batch.
#include "hostembed_kernels.cuh"

namespace {

constexpr int ROPE_WARPS = 4;
// Pairs per lane: head_dim up to 256 is 128 pairs over 32 lanes.
constexpr int ROPE_PAIRS = 4;

__global__ __launch_bounds__(ROPE_WARPS * 32) void rope_kv_kernel(
    float *qkv, unsigned int qkv_stride, unsigned int n, const int *__restrict__ pos, unsigned int heads,
    unsigned int kv_heads, unsigned int head_dim, const float *__restrict__ inv_freq, int interleaved,
    const float *__restrict__ q_norm, const float *__restrict__ k_norm, float eps, unsigned short *kv_pool,
    const unsigned int *const *__restrict__ tables, unsigned int pool_pages) {
    const unsigned int slots = heads + 2 * kv_heads;
    const size_t item = (size_t)blockIdx.x * ROPE_WARPS + threadIdx.x / 32;
    const unsigned int lane = threadIdx.x % 32;
    if (item >= (size_t)n * slots) return;
    const unsigned int t = (unsigned int)(item / slots), slot = (unsigned int)(item % slots);
    const int p = pos[t];
    // The token's page, or none: no pool, a negative position, or a table entry past the pool.
    unsigned short *page = nullptr;
    if (kv_pool != nullptr && p >= 0) {
        const unsigned int id = tables[t][(unsigned int)p / HE_PAGE_TOKENS];
        if (id < pool_pages) page = kv_pool + (size_t)id * he::page_values(kv_heads, head_dim);
    }
    const unsigned int slot_in_page = (unsigned int)p % HE_PAGE_TOKENS;
    const bool cache_ok = page != nullptr;
    float *head = qkv + (size_t)t * qkv_stride + (size_t)slot * head_dim;
    const unsigned int half = head_dim / 2;

    if (slot >= heads + kv_heads) {  // a v head: stored as it is
        if (!cache_ok) return;
        const unsigned int kvh = slot - heads - kv_heads;
        unsigned short *dst = he::page_v(page, kv_heads, head_dim) + ((size_t)kvh * HE_PAGE_TOKENS + slot_in_page) * head_dim;
        for (unsigned int i = lane; i < head_dim; i += 32) dst[i] = he::f32_to_bf16_bits(head[i]);
        return;
    }

    const bool is_q = slot < heads;
    // Pair j rotates (j, j + half) or (2j, 2j + 1).
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
    unsigned short *kdst = nullptr;
    if (!is_q && cache_ok) kdst = page + ((size_t)(slot - heads) * HE_PAGE_TOKENS + slot_in_page) * head_dim;
#pragma unroll
    for (int k = 0; k < ROPE_PAIRS; k++) {
        const unsigned int j = lane + 32 * k;
        if (j < half) {
            const unsigned int ia = interleaved ? 2 * j : j, ib = interleaved ? 2 * j + 1 : j + half;
            float s, c;
            sincosf((float)p * inv_freq[j], &s, &c);
            const float ra = a[k] * c - b[k] * s, rb = a[k] * s + b[k] * c;
            head[ia] = ra;
            head[ib] = rb;
            if (kdst != nullptr) {
                kdst[ia] = he::f32_to_bf16_bits(ra);
                kdst[ib] = he::f32_to_bf16_bits(rb);
            }
        }
    }
}

}  // namespace

extern "C" cudaError_t hostembed_rope_kv(float *qkv, unsigned int qkv_stride, unsigned int n, const int *pos,
                                         unsigned int heads, unsigned int kv_heads, unsigned int head_dim,
                                         const float *inv_freq, int interleaved, const float *q_norm,
                                         const float *k_norm, float eps, void *kv_pool,
                                         const unsigned int *const *tables, unsigned int pool_pages,
                                         cudaStream_t stream) {
    if (qkv == nullptr || pos == nullptr || inv_freq == nullptr) return cudaErrorInvalidValue;
    if (head_dim == 0 || head_dim % 2 != 0 || head_dim > 64 * ROPE_PAIRS || heads == 0 || kv_heads == 0)
        return cudaErrorInvalidValue;
    if ((size_t)qkv_stride < (size_t)(heads + 2 * kv_heads) * head_dim) return cudaErrorInvalidValue;
    if (kv_pool != nullptr && (tables == nullptr || pool_pages == 0)) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    const size_t items = (size_t)n * (heads + 2 * kv_heads);
    const size_t blocks = (items + ROPE_WARPS - 1) / ROPE_WARPS;
    if (blocks > 0x7fffffffu) return cudaErrorInvalidValue;
    rope_kv_kernel<<<(unsigned int)blocks, ROPE_WARPS * 32, 0, stream>>>(
        qkv, qkv_stride, n, pos, heads, kv_heads, head_dim, inv_freq, interleaved, q_norm, k_norm, eps,
        static_cast<unsigned short *>(kv_pool), tables, pool_pages);
    return cudaGetLastError();
}

extern "C" cudaError_t hostembed_kv_page_tokens(unsigned int *page_tokens) {
    if (page_tokens == nullptr) return cudaErrorInvalidValue;
    *page_tokens = HE_PAGE_TOKENS;
    return cudaSuccess;
}
