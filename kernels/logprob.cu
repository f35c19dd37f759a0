// The log-probability of a chosen token under each row of logits, for engine_score: one block a row,
// the max in f32, the sum of exp(l - max) in f64, log p = l[target] - (max + log(sum)) as src/backend.rs's
// log_prob computes it on the host.
#include <math.h>

#include "hostembed_kernels.cuh"

namespace {

constexpr int LOGPROB_THREADS = 256;
constexpr int LOGPROB_WARPS = LOGPROB_THREADS / 32;

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__global__ void __launch_bounds__(LOGPROB_THREADS)
    row_logprob_kernel(const float *__restrict__ logits, unsigned int vocab, const int *__restrict__ targets,
                       float *__restrict__ out) {
    __shared__ float max_part[LOGPROB_WARPS];
    __shared__ int nan_part[LOGPROB_WARPS];
    __shared__ double sum_part[LOGPROB_WARPS];
    const float *row = logits + (size_t)blockIdx.x * vocab;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    float m = -INFINITY;
    int nan = 0;
    for (unsigned int i = threadIdx.x; i < vocab; i += LOGPROB_THREADS) {
        const float l = row[i];
        nan |= isnan(l);
        m = fmaxf(m, l);
    }
    m = he::warp_max(m);
    nan = __any_sync(0xffffffffu, nan);
    if (lane == 0) {
        max_part[warp] = m;
        nan_part[warp] = nan;
    }
    __syncthreads();
    m = -INFINITY;
    nan = 0;
#pragma unroll
    for (int w = 0; w < LOGPROB_WARPS; w++) {
        m = fmaxf(m, max_part[w]);
        nan |= nan_part[w];
    }
    // No distribution (a NaN, or no finite logit): NaN, as the host's log_prob answers.
    if (nan || !isfinite(m)) {
        if (threadIdx.x == 0) out[blockIdx.x] = nanf("");
        return;
    }

    const double md = (double)m;
    double sum = 0.0;
    for (unsigned int i = threadIdx.x; i < vocab; i += LOGPROB_THREADS) sum += exp((double)row[i] - md);
    sum = warp_sum_f64(sum);
    if (lane == 0) sum_part[warp] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
#pragma unroll
        for (int w = 0; w < LOGPROB_WARPS; w++) total += sum_part[w];
        const int t = targets[blockIdx.x];
        out[blockIdx.x] = (t < 0 || (unsigned int)t >= vocab) ? nanf("")
                                                                : (float)((double)row[t] - (md + log(total)));
    }
}

}  // namespace

extern "C" cudaError_t hostembed_row_logprobs(const float *logits, unsigned int vocab, unsigned int rows,
                                              const int *targets, float *out, cudaStream_t stream) {
    if (logits == nullptr || targets == nullptr || out == nullptr || vocab == 0) return cudaErrorInvalidValue;
    if (rows == 0) return cudaSuccess;
    if (rows > 65535u) return cudaErrorInvalidValue;
    row_logprob_kernel<<<rows, LOGPROB_THREADS, 0, stream>>>(logits, vocab, targets, out);
    return cudaGetLastError();
}
