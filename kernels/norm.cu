// RMSNorm over rows of f32 activations, one block per row.
#include "hostembed_kernels.cuh"

namespace {

constexpr int NORM_THREADS = 256;

__global__ __launch_bounds__(NORM_THREADS) void rmsnorm_kernel(const float *x, const float *__restrict__ w, float eps,
                                                               float *out, unsigned int cols) {
    __shared__ float scratch[32];
    const float *xr = x + (size_t)blockIdx.x * cols;
    float *outr = out + (size_t)blockIdx.x * cols;
    const bool vec = (cols % 4 == 0) && ((reinterpret_cast<uintptr_t>(xr) | reinterpret_cast<uintptr_t>(outr) |
                                          reinterpret_cast<uintptr_t>(w)) % 16 == 0);
    float ss = 0.f;
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
            reinterpret_cast<float4 *>(outr)[c] =
                make_float4(v.x * inv * g.x, v.y * inv * g.y, v.z * inv * g.z, v.w * inv * g.w);
        }
    } else {
        for (unsigned int c = threadIdx.x; c < cols; c += NORM_THREADS) outr[c] = xr[c] * inv * w[c];
    }
}

}  // namespace

extern "C" cudaError_t hostembed_rmsnorm(const float *x, const float *w, float eps, float *out, unsigned int n,
                                         unsigned int cols, cudaStream_t stream) {
    if (x == nullptr || w == nullptr || out == nullptr || cols == 0) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    rmsnorm_kernel<<<n, NORM_THREADS, 0, stream>>>(x, w, eps, out, cols);
    return cudaGetLastError();
}
