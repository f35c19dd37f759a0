// Element-wise activations: the gated feed-forward's (SwiGLU, GeGLU, one launcher) and the residual add, for
// the paths that do not fuse them, a scale, and the f32-to-half conversion of activations the tensor-core
// products read.
#include "hostembed_kernels.cuh"

namespace {

constexpr int ACT_THREADS = 256;

// The gate's activation times up, each step as the CPU's `silu_times` / `gelu_tanh_times` (tanhf for its
// tanh).
template <int Act>
__device__ __forceinline__ float glu(float g, float u) {
    if constexpr (Act == HE_ACT_SILU) {
        return he::silu(g) * u;
    } else {
        static_assert(Act == HE_ACT_GELU_TANH, "an activation glu has no body for");
        const float inner = 0.7978846f * (g + 0.044715f * (g * g * g));
        return (0.5f * g * (1.f + tanhf(inner))) * u;
    }
}

template <int Act, typename Out>
__global__ void glu_kernel(const float *gate, const float *up, typename Out::T *out, size_t len) {
    for (size_t i = (size_t)blockIdx.x * ACT_THREADS + threadIdx.x; i < len; i += (size_t)gridDim.x * ACT_THREADS)
        Out::put(out + i, glu<Act>(gate[i], up[i]));
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

extern "C" cudaError_t hostembed_glu_to(const float *gate, const float *up, void *out, int out_dtype, int act,
                                        size_t len, cudaStream_t stream) {
    if (gate == nullptr || up == nullptr || out == nullptr) return cudaErrorInvalidValue;
    if (act != HE_ACT_SILU && act != HE_ACT_GELU_TANH) return cudaErrorInvalidValue;
    if (len == 0) return cudaSuccess;
    cudaError_t err = cudaErrorInvalidValue;
    he::with_out(out_dtype, [&](auto o) {
        using Out = decltype(o);
        auto *to = static_cast<typename Out::T *>(out);
        if (act == HE_ACT_SILU)
            glu_kernel<HE_ACT_SILU, Out><<<grid_for(len), ACT_THREADS, 0, stream>>>(gate, up, to, len);
        else
            glu_kernel<HE_ACT_GELU_TANH, Out><<<grid_for(len), ACT_THREADS, 0, stream>>>(gate, up, to, len);
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
