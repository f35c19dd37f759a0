// RMSNorm over rows of f32 activations, one block per row, written as f32 or as a half format (the
// tensor-core products' input), and optionally the half rounding's residue (products refined to f32).
#include "hostembed_kernels.cuh"

namespace {

constexpr int NORM_THREADS = 256;
constexpr int NORM_KEEP = 4;  // float4s a thread keeps: rows up to 4,096 values in one read

template <typename Out>
__global__ __launch_bounds__(NORM_THREADS) void rmsnorm_kernel(const float *x, const float *__restrict__ w, float eps,
                                                               typename Out::T *out, typename Out::T *residue,
                                                               unsigned int cols) {
    he::pdl_launch_dependents();
    __shared__ float scratch[32];
    const float *xr = x + (size_t)blockIdx.x * cols;
    typename Out::T *outr = out + (size_t)blockIdx.x * cols;
    typename Out::T *resr = residue != nullptr ? residue + (size_t)blockIdx.x * cols : nullptr;
    const bool vec = (cols % 4 == 0) && ((reinterpret_cast<uintptr_t>(xr) | reinterpret_cast<uintptr_t>(outr) |
                                          reinterpret_cast<uintptr_t>(resr) | reinterpret_cast<uintptr_t>(w)) %
                                             16 ==
                                         0);
    float ss = 0.f;
    if (vec && cols / 4 <= NORM_KEEP * NORM_THREADS) {
        // The row (and the weights) in registers: every load issued at once, x read once; the same sums
        // in the same order as the loop below.
        const float4 *x4 = reinterpret_cast<const float4 *>(xr), *w4 = reinterpret_cast<const float4 *>(w);
        float4 v[NORM_KEEP], g[NORM_KEEP];
        // The weights are the model's: loaded before waiting for x (launched overlapped, x comes from the
        // kernel before).
#pragma unroll
        for (int k = 0; k < NORM_KEEP; k++) {
            const unsigned int c = threadIdx.x + k * NORM_THREADS;
            g[k] = c < cols / 4 ? __ldg(w4 + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        he::pdl_wait();
#pragma unroll
        for (int k = 0; k < NORM_KEEP; k++) {
            const unsigned int c = threadIdx.x + k * NORM_THREADS;
            v[k] = c < cols / 4 ? x4[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int k = 0; k < NORM_KEEP; k++)
            if (threadIdx.x + k * NORM_THREADS < cols / 4)
                ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
        ss = he::block_sum<NORM_THREADS>(ss, scratch);
        const float inv = rsqrtf(ss / (float)cols + eps);
#pragma unroll
        for (int k = 0; k < NORM_KEEP; k++) {
            const unsigned int c = threadIdx.x + k * NORM_THREADS;
            if (c < cols / 4) {
                const float4 y = make_float4(v[k].x * inv * g[k].x, v[k].y * inv * g[k].y, v[k].z * inv * g[k].z,
                                             v[k].w * inv * g[k].w);
                Out::put4(outr + 4 * c, y);
                if (resr != nullptr) Out::put4_residue(resr + 4 * c, y);
            }
        }
        return;
    }
    he::pdl_wait();
    if (vec) {
        for (unsigned int c = threadIdx.x; c < cols / 4; c += NORM_THREADS) {
            float4 v = reinterpret_cast<const float4 *>(xr)[c];
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (unsigned int c = threadIdx.x; c < cols; c += NORM_THREADS) ss += xr[c] * xr[c];
    }
    ss = he::block_sum<NORM_THREADS>(ss, scratch);
    const float inv = rsqrtf(ss / (float)cols + eps);
    if (vec) {
        for (unsigned int c = threadIdx.x; c < cols / 4; c += NORM_THREADS) {
            float4 v = reinterpret_cast<const float4 *>(xr)[c];
            float4 g = reinterpret_cast<const float4 *>(w)[c];
            const float4 y = make_float4(v.x * inv * g.x, v.y * inv * g.y, v.z * inv * g.z, v.w * inv * g.w);
            Out::put4(outr + 4 * c, y);
            if (resr != nullptr) Out::put4_residue(resr + 4 * c, y);
        }
    } else {
        for (unsigned int c = threadIdx.x; c < cols; c += NORM_THREADS) {
            const float y = xr[c] * inv * w[c];
            Out::put(outr + c, y);
            if (resr != nullptr) Out::put_residue(resr + c, y);
        }
    }
}

// x += RMSNorm(y) * w, one block a row: Gemma's norm of a block's output before the residual add.
__global__ __launch_bounds__(NORM_THREADS) void rmsnorm_add_kernel(const float *__restrict__ y,
                                                                   const float *__restrict__ w, float eps, float *x,
                                                                   unsigned int cols) {
    __shared__ float scratch[32];
    const float *yr = y + (size_t)blockIdx.x * cols;
    float *xr = x + (size_t)blockIdx.x * cols;
    float ss = 0.f;
    for (unsigned int c = threadIdx.x; c < cols; c += NORM_THREADS) ss += yr[c] * yr[c];
    ss = he::block_sum<NORM_THREADS>(ss, scratch);
    const float inv = rsqrtf(ss / (float)cols + eps);
    for (unsigned int c = threadIdx.x; c < cols; c += NORM_THREADS) xr[c] += yr[c] * inv * w[c];
}

}  // namespace

extern "C" cudaError_t hostembed_rmsnorm_add(const float *y, const float *w, float eps, float *x, unsigned int n,
                                             unsigned int cols, cudaStream_t stream) {
    if (y == nullptr || w == nullptr || x == nullptr || cols == 0) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    rmsnorm_add_kernel<<<n, NORM_THREADS, 0, stream>>>(y, w, eps, x, cols);
    return cudaGetLastError();
}

extern "C" cudaError_t hostembed_rmsnorm_to(const float *x, const float *w, float eps, void *out, void *residue,
                                            int out_dtype, unsigned int n, unsigned int cols, hostembed_tuning tuning,
                                            cudaStream_t stream) {
    if (x == nullptr || w == nullptr || out == nullptr || cols == 0) return cudaErrorInvalidValue;
    if (residue != nullptr && out_dtype == HE_DTYPE_F32) return cudaErrorInvalidValue;  // f32 has none
    if (n == 0) return cudaSuccess;
    cudaError_t err = cudaErrorInvalidValue;
    he::with_out(out_dtype, [&](auto o) {
        using Out = decltype(o);
        err = he::launch_overlapped(tuning, rmsnorm_kernel<Out>, dim3(n), dim3(NORM_THREADS), 0, stream, x, w, eps,
                                    static_cast<typename Out::T *>(out), static_cast<typename Out::T *>(residue),
                                    cols);
    });
    return err;
}

extern "C" cudaError_t hostembed_rmsnorm(const float *x, const float *w, float eps, float *out, unsigned int n,
                                         unsigned int cols, hostembed_tuning tuning, cudaStream_t stream) {
    return hostembed_rmsnorm_to(x, w, eps, out, nullptr, HE_DTYPE_F32, n, cols, tuning, stream);
}
