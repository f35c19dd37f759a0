// The one header every kernel file shares: the C launchers Rust calls (src/kernels.rs repeats
// them, and build.rs checks the two agree), and the device helpers the kernels have in common.
#pragma once
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

// Row and weight formats, the values of src/tensor/'s DType; kernels/formats.cuh has their traits.
#define HE_DTYPE_F32 0
#define HE_DTYPE_F16 1
#define HE_DTYPE_BF16 2
#define HE_DTYPE_Q8_0 3

#ifdef __cplusplus
extern "C" {
#endif

// ---- embed.cu: the embedding gather ----
// Gathers rows[ids[i]] (vocab rows of cols values in `dtype`) into row i of `out` (HE_DTYPE_F32 or
// HE_DTYPE_BF16). An id outside [0, vocab) is never read: its row is written as zeros and *bad
// (when bad != NULL) is set to 1. `rows` may be device memory or mapped host memory.
cudaError_t hostembed_embed_gather(const void *rows, int dtype, unsigned int vocab, unsigned int cols,
                                   const int *ids, unsigned int n, void *out, int out_dtype, int *bad,
                                   cudaStream_t stream);

// ---- decode kernels (norm.cu, matvec.cu, rope.cu, attention.cu, act.cu, sample.cu) ----
// Activations are f32 [n][cols] rows, the KV cache bf16 [kv_heads][window][head_dim] per layer and
// per K or V. Every launcher checks its arguments (cudaErrorInvalidValue) and returns the launch error.

// out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * w, for n rows of cols values (out may be x).
cudaError_t hostembed_rmsnorm(const float *x, const float *w, float eps, float *out, unsigned int n, unsigned int cols,
                              cudaStream_t stream);

// y[t*ldy + r] = sum_c W[r][c] * x[t*cols + c] (+ bias[r]) (+ residual[t*ldy + r]) for r < rows, t < n.
// W is rows x cols in `dtype` (HE_DTYPE_*), each weight read once per 8 tokens; bias and residual may be
// NULL, residual may equal y.
cudaError_t hostembed_matvec(const void *w, int dtype, unsigned int rows, unsigned int cols, const float *x,
                             unsigned int n, const float *bias, const float *residual, float *y, unsigned int ldy,
                             cudaStream_t stream);

// y[t*rows + r] = silu(G[r].x[t]) * (U[r].x[t]): gate and up projections and SwiGLU in one pass.
cudaError_t hostembed_matvec_swiglu(const void *w_gate, const void *w_up, int dtype, unsigned int rows,
                                    unsigned int cols, const float *x, unsigned int n, float *y, cudaStream_t stream);

// In each row t of qkv (stride qkv_stride floats: heads q heads, then kv_heads k heads, then kv_heads v
// heads, head_dim each): RMSNorm of every q/k head when q_norm/k_norm are not NULL, then the rotation at
// position pos[t] with inv_freq[head_dim/2] (interleaved pairs or halves), in place. When k_cache is not
// NULL, the rotated k and the v heads are also stored as bf16 at position pos[t] of the caches
// ([kv_heads][window][head_dim]). head_dim even and at most 256.
cudaError_t hostembed_rope_kv(float *qkv, unsigned int qkv_stride, unsigned int n, const int *pos,
                              unsigned int heads, unsigned int kv_heads, unsigned int head_dim,
                              const float *inv_freq, int interleaved, const float *q_norm, const float *k_norm,
                              float eps, void *k_cache, void *v_cache, unsigned int window, cudaStream_t stream);

// Attention of query token t (q + t*q_stride, heads x head_dim) over cache positions [0, pos[t]] with
// GQA (query head h reads kv head h / (heads / kv_heads)), softmax(q.k * scale) v into
// out[t][heads*head_dim]. The context is split in `splits` parts computed by separate blocks and
// combined after; partial holds n*heads*splits*(head_dim+2) floats. head_dim a multiple of 8, <= 256.
cudaError_t hostembed_attention(const float *q, unsigned int q_stride, const void *k_cache, const void *v_cache,
                                unsigned int window, const int *pos, unsigned int n, unsigned int heads,
                                unsigned int kv_heads, unsigned int head_dim, float scale, unsigned int splits,
                                float *partial, float *out, cudaStream_t stream);

// out[i] = silu(gate[i]) * up[i].
cudaError_t hostembed_swiglu(const float *gate, const float *up, float *out, size_t len, cudaStream_t stream);

// out[i] = a[i] + b[i] (out may be a or b).
cudaError_t hostembed_add(const float *a, const float *b, float *out, size_t len, cudaStream_t stream);

// Picks the next token from logits[vocab] exactly as src/sampler.rs does (temperature <= 0: argmax,
// lowest index on ties; else integer weights, top-k, top-p, one draw from (seed, stream_index,
// position)) and writes it to *token. scratch holds 8*vocab bytes (8-byte aligned); vocab < 2^28 so
// the integer weights' sums fit in 64 bits.
cudaError_t hostembed_sample(const float *logits, unsigned int vocab, float temperature, unsigned int top_k,
                             float top_p, uint64_t seed, unsigned int stream_index, uint64_t position,
                             void *scratch, int *token, cudaStream_t stream);

// ---- device.cu ----
// Writes the device's name (NUL-terminated, truncated to len) without exposing cudaDeviceProp to Rust.
cudaError_t hostembed_device_name(int device, char *name, size_t len);

#ifdef __cplusplus
}
#endif

#ifdef __CUDACC__
// ---- device helpers shared by the decode kernels ----
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace he {

// The low and high bf16 of a 32-bit word.
__device__ __forceinline__ float bf16_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float f16_bits_to_f32(unsigned int h) {
    return __half2float(__ushort_as_half((unsigned short)h));
}
__device__ __forceinline__ unsigned short f32_to_bf16_bits(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of THREADS threads (a multiple of 32); `scratch` holds 32 floats. Every thread gets
// the sum. Contains barriers: call from all threads.
template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float *scratch) {
    constexpr int WARPS = THREADS / 32;
    v = warp_sum(v);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < WARPS ? scratch[lane] : 0.f;
    return warp_sum(t);
}

// 16 bytes of weights that are read once: through the non-coherent path, not kept in L1. Not volatile:
// the weights never change while a kernel runs, so the scheduler may move it.
__device__ __forceinline__ uint4 load_stream16(const void *p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
    unsigned long long z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// A key whose unsigned order is the float order (larger float, larger key); 0 is only a negative NaN.
__device__ __forceinline__ unsigned int float_key(float f) {
    unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

}  // namespace he
#endif
