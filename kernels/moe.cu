// The Mixture-of-Experts feed-forward, correct before fast: the router's logits, each row's top-k and
// their weights on the device (nothing read back, so a decode pass captures into a graph), then each
// row's chosen experts' SwiGLU and their weighted sum onto the residual, reading only those experts'
// matrices. A warp computes one output value, each lane a strided part of the dot product read value by
// value through the format's value() (any format, any alignment), summed by warp_sum: a row's results
// depend on its own inputs only, so a stream's bits are the same in any batch. src/cpu/moe.rs is the
// same computation on the CPU (its choice and weights, its order of the experts' sum).
#include "formats.cuh"

namespace {

constexpr unsigned MOE_WARPS = 8;
constexpr unsigned MOE_THREADS = MOE_WARPS * 32;
constexpr unsigned ROUTE_THREADS = 64;
// Grid rows at most (the y dimension's limit); a launch of more rows loops over them.
constexpr unsigned MAX_GRID_Y = 65535;

// W[j] . x over `cols` values, W's row j at `row`: the warp's sum of its lanes' strided parts.
template <typename F>
__device__ __forceinline__ float warp_dot(const unsigned char *row, const float *x, unsigned cols) {
    float acc = 0.f;
    for (unsigned c = threadIdx.x % 32; c < cols; c += 32) acc = fmaf(F::value(row, c), x[c], acc);
    return he::warp_sum(acc);
}

template <typename F>
__global__ void __launch_bounds__(MOE_THREADS) router_kernel(const unsigned char *__restrict__ w, size_t rb,
                                                               unsigned experts, unsigned cols,
                                                               const float *__restrict__ x, unsigned n,
                                                               float *__restrict__ logits) {
    const unsigned j = blockIdx.x * MOE_WARPS + threadIdx.x / 32;
    if (j >= experts) return;
    for (unsigned r = blockIdx.y; r < n; r += gridDim.y) {
        const float v = warp_dot<F>(w + j * rb, x + (size_t)r * cols, cols);
        if (threadIdx.x % 32 == 0) logits[(size_t)r * experts + j] = v;
    }
}

// One thread a row: the k largest logits (ties to the lower index) kept in ids, best first, then their
// softmax weights in f64 and the ids in ascending order, as src/cpu/moe.rs's `choose`.
__global__ void route_kernel(const float *__restrict__ logits, unsigned experts, unsigned n, unsigned k, int norm_topk,
                             int *__restrict__ ids, float *__restrict__ weights) {
    const unsigned r = blockIdx.x * ROUTE_THREADS + threadIdx.x;
    if (r >= n) return;
    const float *l = logits + (size_t)r * experts;
    int *best = ids + (size_t)r * k;
    unsigned kept = 0;
    for (unsigned e = 0; e < experts; e++) {
        unsigned at = kept;
        for (unsigned b = 0; b < kept; b++) {
            if (l[e] > l[best[b]]) {
                at = b;
                break;
            }
        }
        if (at >= k) continue;
        const unsigned last = kept < k ? kept : k - 1;
        for (unsigned b = last; b > at; b--) best[b] = best[b - 1];
        best[at] = (int)e;
        if (kept < k) kept++;
    }
    const double max = l[best[0]];
    double total = 0.0;
    if (norm_topk) {
        for (unsigned b = 0; b < k; b++) total += exp((double)l[best[b]] - max);
    } else {
        for (unsigned e = 0; e < experts; e++) total += exp((double)l[e] - max);
    }
    for (unsigned b = 1; b < k; b++) {
        const int e = best[b];
        unsigned at = b;
        while (at > 0 && best[at - 1] > e) {
            best[at] = best[at - 1];
            at--;
        }
        best[at] = e;
    }
    for (unsigned b = 0; b < k; b++) weights[(size_t)r * k + b] = (float)(exp((double)l[best[b]] - max) / total);
}

template <typename F>
__global__ void __launch_bounds__(MOE_THREADS)
    gate_up_kernel(const unsigned char *__restrict__ gate, const unsigned char *__restrict__ up, size_t expert_bytes,
                   size_t rb, unsigned width, unsigned cols, const float *__restrict__ x, const int *__restrict__ ids,
                   unsigned slots, unsigned k, float *__restrict__ act) {
    const unsigned j = blockIdx.x * MOE_WARPS + threadIdx.x / 32;
    if (j >= width) return;
    for (unsigned s = blockIdx.y; s < slots; s += gridDim.y) {
        const size_t at = (size_t)ids[s] * expert_bytes + j * rb;
        const float *xr = x + (size_t)(s / k) * cols;
        const float g = warp_dot<F>(gate + at, xr, cols);
        const float u = warp_dot<F>(up + at, xr, cols);
        if (threadIdx.x % 32 == 0) act[(size_t)s * width + j] = he::silu(g) * u;
    }
}

template <typename F>
__global__ void __launch_bounds__(MOE_THREADS)
    down_kernel(const unsigned char *__restrict__ down, size_t expert_bytes, size_t rb, unsigned rows, unsigned cols,
                const float *__restrict__ act, const int *__restrict__ ids, const float *__restrict__ weights,
                unsigned n, unsigned k, float *__restrict__ x) {
    const unsigned j = blockIdx.x * MOE_WARPS + threadIdx.x / 32;
    if (j >= rows) return;
    for (unsigned r = blockIdx.y; r < n; r += gridDim.y) {
        float sum = 0.f;
        for (unsigned s = r * k; s < (r + 1) * k; s++) {
            const float o = warp_dot<F>(down + (size_t)ids[s] * expert_bytes + j * rb, act + (size_t)s * cols, cols);
            sum += o * weights[s];
        }
        if (threadIdx.x % 32 == 0) x[(size_t)r * rows + j] += sum;
    }
}

__global__ void widen_kernel(const unsigned short *__restrict__ x, int dtype, float *__restrict__ out, size_t len) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < len; i += (size_t)gridDim.x * blockDim.x)
        out[i] = dtype == HE_DTYPE_BF16 ? __uint_as_float((unsigned)x[i] << 16) : he::f16_bits_to_f32(x[i]);
}

dim3 grid(unsigned outputs, size_t rows) {
    return dim3((outputs + MOE_WARPS - 1) / MOE_WARPS, (unsigned)(rows < MAX_GRID_Y ? rows : MAX_GRID_Y));
}

}  // namespace

extern "C" cudaError_t hostembed_moe_router(const void *router, int dtype, unsigned int experts, unsigned int cols,
                                            const float *x, unsigned int n, float *logits, cudaStream_t stream) {
    if (router == nullptr || x == nullptr || logits == nullptr || experts == 0 || cols == 0) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    cudaError_t err = cudaErrorInvalidValue;
    he::with_format(dtype, [&](auto f) {
        using F = decltype(f);
        if (he::row_bytes<F>(cols) == 0) return;
        router_kernel<F><<<grid(experts, n), MOE_THREADS, 0, stream>>>((const unsigned char *)router,
                                                                        he::row_bytes<F>(cols), experts, cols, x, n,
                                                                        logits);
        err = cudaGetLastError();
    });
    return err;
}

extern "C" cudaError_t hostembed_moe_route(const float *logits, unsigned int experts, unsigned int n, unsigned int k,
                                           int norm_topk, int *ids, float *weights, cudaStream_t stream) {
    if (logits == nullptr || ids == nullptr || weights == nullptr || k == 0 || k > experts) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    route_kernel<<<(n + ROUTE_THREADS - 1) / ROUTE_THREADS, ROUTE_THREADS, 0, stream>>>(logits, experts, n, k,
                                                                                        norm_topk, ids, weights);
    return cudaGetLastError();
}

extern "C" cudaError_t hostembed_moe_gate_up(const void *gate, const void *up, int dtype, size_t expert_bytes,
                                             unsigned int width, unsigned int cols, const float *x, const int *ids,
                                             unsigned int n, unsigned int k, float *act, cudaStream_t stream) {
    if (gate == nullptr || up == nullptr || x == nullptr || ids == nullptr || act == nullptr || width == 0 || cols == 0 ||
        k == 0)
        return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    cudaError_t err = cudaErrorInvalidValue;
    he::with_format(dtype, [&](auto f) {
        using F = decltype(f);
        if (he::row_bytes<F>(cols) == 0 || expert_bytes < he::row_bytes<F>(cols) * width) return;
        const size_t slots = (size_t)n * k;
        gate_up_kernel<F><<<grid(width, slots), MOE_THREADS, 0, stream>>>(
            (const unsigned char *)gate, (const unsigned char *)up, expert_bytes, he::row_bytes<F>(cols), width, cols, x,
            ids, (unsigned)slots, k, act);
        err = cudaGetLastError();
    });
    return err;
}

extern "C" cudaError_t hostembed_moe_down(const void *down, int dtype, size_t expert_bytes, unsigned int rows,
                                          unsigned int cols, const float *act, const int *ids, const float *weights,
                                          unsigned int n, unsigned int k, float *x, cudaStream_t stream) {
    if (down == nullptr || act == nullptr || ids == nullptr || weights == nullptr || x == nullptr || rows == 0 ||
        cols == 0 || k == 0)
        return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    cudaError_t err = cudaErrorInvalidValue;
    he::with_format(dtype, [&](auto f) {
        using F = decltype(f);
        if (he::row_bytes<F>(cols) == 0 || expert_bytes < he::row_bytes<F>(cols) * rows) return;
        down_kernel<F><<<grid(rows, n), MOE_THREADS, 0, stream>>>((const unsigned char *)down, expert_bytes,
                                                                   he::row_bytes<F>(cols), rows, cols, act, ids,
                                                                   weights, n, k, x);
        err = cudaGetLastError();
    });
    return err;
}

extern "C" cudaError_t hostembed_widen(const void *x, int dtype, float *out, size_t len, cudaStream_t stream) {
    if (x == nullptr || out == nullptr || (dtype != HE_DTYPE_BF16 && dtype != HE_DTYPE_F16)) return cudaErrorInvalidValue;
    if (len == 0) return cudaSuccess;
    size_t blocks = (len + 255) / 256;
    widen_kernel<<<(unsigned)(blocks < 65535 ? blocks : 65535), 256, 0, stream>>>((const unsigned short *)x, dtype, out,
                                                                                   len);
    return cudaGetLastError();
}
