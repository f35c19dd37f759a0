// The block formats' decode product up to 16 tokens a launch (mmvq_kernel: integer mma on the quants,
// the activations as 16-bit integers in two int8 halves) and the launcher of every block-format product,
// which hands launches past 8 tokens to the tile kernel (kernels/mmv_tile.cu) where it fits.
// kernels/mmv_readers.cuh says the design.
#include "mmv_int.cuh"

namespace {

template <typename R, int NT4, bool GLU, bool STAGED>
__global__ __launch_bounds__(MMV_THREADS, NT4 <= 2 ? MMV_SMALL_MIN_BLOCKS : NT4 <= 4 ? MMVQ_MID_MIN_BLOCKS : 1) void mmvq_kernel(
    const unsigned char *__restrict__ w, const unsigned char *__restrict__ w2, unsigned int rows, unsigned int cols,
    size_t row_bytes, const float *__restrict__ x, unsigned int n, const float *bias, const float *residual, float *y,
    unsigned int ldy, float *partial, unsigned int *counters) {
    he::pdl_launch_dependents();
    const MmvTokens tk{x, cols, nullptr, 1, n, n, n};
    mmvq_body<R, NT4, GLU, STAGED>(w, w2, rows, cols, row_bytes, mmv_shape(rows, cols, GLU, true), tk, bias, residual, y,
                                   ldy, partial, counters);
}

// Tokens an integer launch takes: MMVQ_LAUNCH_TOKENS, or hostembed_tuning's mmvq_tokens (1 to
// MMVQ_MAX_TOKENS), to measure. Any split gives a token the same bits.
inline unsigned int mmvq_launch_tokens(const hostembed_tuning &tuning) {
    const unsigned int t = tuning.mmvq_tokens;
    const unsigned int most = MMV_TUNING_KERNELS ? MMVQ_MAX_TOKENS : MMVQ_LAUNCH_TOKENS;
    return t >= 1 && t <= most ? t : MMVQ_LAUNCH_TOKENS;
}

template <typename R, bool GLU, bool STAGED>
cudaError_t launch_int(const he::mmv::Args &a) {
    const unsigned int rows = a.rows, cols = a.cols, n = a.n;
    const hostembed_tuning &tuning = a.tuning;
    const MmvShape shape = mmv_shape(rows, cols, GLU, true);
    const dim3 grid(shape.row_blocks, shape.splits);
    // The tile kernel (hostembed_tuning's mmv_tc_blocks, where the card has its shared memory) takes
    // launches of more than MMV_PREP_AFTER tokens, up to MMV_MAX_TOKENS at once; a launch of fewer takes
    // the integer kernel.
    const bool tile = tuning.mmv_tc_blocks != 0 && n > MMV_PREP_AFTER && he::mmv::tile_fits(a.dtype, min(n, MMV_MAX_TOKENS));
    const unsigned int MAX = tile ? MMV_MAX_TOKENS : mmvq_launch_tokens(tuning);
    constexpr unsigned GROUP = mmv_group<R, STAGED>();
    constexpr unsigned WEIGHTS = STAGED ? WeightSlots<R, GROUP>::BLOCK_BYTES : 0;
    for (unsigned int t0 = 0; t0 < n; t0 += MAX) {
        const unsigned int nt = min(MAX, n - t0);
        const he::mmv::Args part = tokens_of(a, t0, nt);
        if (tile && nt > MMV_PREP_AFTER) {
            const cudaError_t e = he::mmv::tile(GLU, part);
            if (e != cudaSuccess) return e;
            continue;
        }
        const int smem = (int)(mmvq_act_bytes(nt, mmv_chunk(nt, shape.kr, 2, mmvq_unit(GROUP)), mmvq_min_cols<R>()) + WEIGHTS);
        auto go = [&](auto kernel) { return launch_tokens(kernel, grid, smem, part); };
        cudaError_t e;
        if (nt <= 4) e = go(mmvq_kernel<R, 1, GLU, STAGED>);
        else if (nt <= 8) e = go(mmvq_kernel<R, 2, GLU, STAGED>);
        else if (nt <= 16) e = go(mmvq_kernel<R, 4, GLU, STAGED>);
        else if constexpr (MMV_TUNING_KERNELS) e = go(mmvq_kernel<R, 8, GLU, STAGED>);
        else e = cudaErrorNotSupported;  // mmvq_launch_tokens keeps these builds at 16
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

}  // namespace

cudaError_t he::mmv::integer(bool glu, const Args &a) {
    return with_launch<true>(glu, a, [&](auto reader, auto g, auto staged) {
        return launch_int<decltype(reader), decltype(g)::value, decltype(staged)::value>(a);
    });
}
