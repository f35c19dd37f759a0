// Element-wise activations: SwiGLU, GeGLU and the residual add, for the paths that do not fuse them, a
// scale, and the f32-to-half conversion of activations the tensor-core products read.
#include "hostembed_kernels.cuh"

namespace {

constexpr int ACT_THREADS = 256;

template <typename Out>
__global__ void swiglu_kernel(const float *gate, const float *up, typename Out::T *out, size_t len) {
    for (size_t i = (size_t)blockIdx.x * ACT_THREADS + threadIdx.x; i < len; i += (size_t)gridDim.x * ACT_THREADS)
        Out::put(out + i, he::silu(gate[i]) * up[i]);
}

// GELU's tanh approximation times up, each step as the CPU's `gelu_tanh_times` (tanhf for its tanh).
template <typename Out>
__global__ void geglu_kernel(const float *gate, const float *up, typename Out::T *out, size_t len) {
    for (size_t i = (size_t)blockIdx.x * ACT_THREADS + threadIdx.x; i < len; i += (size_t)gridDim.x * ACT_THREADS) {
        const float g = gate[i];
        const float inner = 0.7978846f * (g + 0.044715f * (g * g * g));
        Out::put(out + i, (0.5f * g * (1.f + tanhf(inner))) * up[i]);
    }
}

__global__ void scale_kernel(float *x, float factor, size_t len) {
    for (size_t i = (size_t)blockIdx.x * ACT_THREADS + threadIdx.x; i < len; i += (size_t)gridDim.x * ACT_THREADS)
        x[i] *= factor;
}

template <typename Out>
__global__ void convert_kernel(const float *__restrict__ x, typename Out::T *__restrict__ out, size_t len) {
    for (size_t i = (size_t)blockIdx.x * ACT_THREADS + threadIdx.x; i < len; i += (size_t)gridDim.x * ACT_THREADS)
        Out::put(out + i, x[i]);
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

extern "C" cudaError_t hostembed_swiglu_to(const float *gate, const float *up, void *out, int out_dtype, size_t len,
                                           cudaStream_t stream) {
    if (gate == nullptr || up == nullptr || out == nullptr) return cudaErrorInvalidValue;
    if (len == 0) return cudaSuccess;
    cudaError_t err = cudaErrorInvalidValue;
    he::with_out(out_dtype, [&](auto o) {
        using Out = decltype(o);
        swiglu_kernel<Out><<<grid_for(len), ACT_THREADS, 0, stream>>>(gate, up, static_cast<typename Out::T *>(out), len);
        err = cudaGetLastError();
    });
    return err;
}

extern "C" cudaError_t hostembed_swiglu(const float *gate, const float *up, float *out, size_t len,
                                        cudaStream_t stream) {
    return hostembed_swiglu_to(gate, up, out, HE_DTYPE_F32, len, stream);
}

extern "C" cudaError_t hostembed_geglu_to(const float *gate, const float *up, void *out, int out_dtype, size_t len,
                                          cudaStream_t stream) {
    if (gate == nullptr || up == nullptr || out == nullptr) return cudaErrorInvalidValue;
    if (len == 0) return cudaSuccess;
    cudaError_t err = cudaErrorInvalidValue;
    he::with_out(out_dtype, [&](auto o) {
        using Out = decltype(o);
        geglu_kernel<Out><<<grid_for(len), ACT_THREADS, 0, stream>>>(gate, up, static_cast<typename Out::T *>(out), len);
        err = cudaGetLastError();
    });
    return err;
}

extern "C" cudaError_t hostembed_scale(float *x, float factor, size_t len, cudaStream_t stream) {
    if (x == nullptr) return cudaErrorInvalidValue;
    if (len == 0) return cudaSuccess;
    scale_kernel<<<grid_for(len), ACT_THREADS, 0, stream>>>(x, factor, len);
    return cudaGetLastError();
}

extern "C" cudaError_t hostembed_convert(const float *x, void *out, int out_dtype, size_t len, cudaStream_t stream) {
    if (x == nullptr || out == nullptr) return cudaErrorInvalidValue;
    if (len == 0) return cudaSuccess;
    cudaError_t err = cudaErrorInvalidValue;
    he::with_half(out_dtype, [&](auto op) {
        using Out = he::HalfOut<decltype(op)>;
        convert_kernel<Out><<<grid_for(len), ACT_THREADS, 0, stream>>>(x, static_cast<typename Out::T *>(out), len);
        err = cudaGetLastError();
    });
    return err;
}

extern "C" cudaError_t hostembed_add(const float *a, const float *b, float *out, size_t len, cudaStream_t stream) {
    if (a == nullptr || b == nullptr || out == nullptr) return cudaErrorInvalidValue;
    if (len == 0) return cudaSuccess;
    add_kernel<<<grid_for(len), ACT_THREADS, 0, stream>>>(a, b, out, len);
    return cudaGetLastError();
}
