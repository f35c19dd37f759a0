// Element-wise activations: SwiGLU and the residual add, for the paths that do not fuse them.
#include "hostembed_kernels.cuh"

namespace {

constexpr int ACT_THREADS = 256;

__global__ void swiglu_kernel(const float *gate, const float *up, float *out, size_t len) {
    for (size_t i = (size_t)blockIdx.x * ACT_THREADS + threadIdx.x; i < len; i += (size_t)gridDim.x * ACT_THREADS)
        out[i] = he::silu(gate[i]) * up[i];
}

__global__ void add_kernel(const float *a, const float *b, float *out, size_t len) {
    for (size_t i = (size_t)blockIdx.x * ACT_THREADS + threadIdx.x; i < len; i += (size_t)gridDim.x * ACT_THREADS)
        out[i] = a[i] + b[i];
}

unsigned int grid_for(size_t len) {
    size_t blocks = (len + ACT_THREADS - 1) / ACT_THREADS;
    return (unsigned int)(blocks < 65535 ? blocks : 65535);
}

}  // namespace

extern "C" cudaError_t hostembed_swiglu(const float *gate, const float *up, float *out, size_t len,
                                        cudaStream_t stream) {
    if (gate == nullptr || up == nullptr || out == nullptr) return cudaErrorInvalidValue;
    if (len == 0) return cudaSuccess;
    swiglu_kernel<<<grid_for(len), ACT_THREADS, 0, stream>>>(gate, up, out, len);
    return cudaGetLastError();
}

extern "C" cudaError_t hostembed_add(const float *a, const float *b, float *out, size_t len, cudaStream_t stream) {
    if (a == nullptr || b == nullptr || out == nullptr) return cudaErrorInvalidValue;
    if (len == 0) return cudaSuccess;
    add_kernel<<<grid_for(len), ACT_THREADS, 0, stream>>>(a, b, out, len);
    return cudaGetLastError();
}
