// The block formats' decode product (integer mma on the quants, the activations as 16-bit integers in two
// int8 halves) as a device function: kernels/mmv_int.cu's kernel over tokens [0, n) of one matrix, and
// kernels/moe_mmv.cu's over the slots of one chosen expert. kernels/mmv_readers.cuh says the design.
#pragma once
#include "mmv.cuh"

namespace {

// The tokens a block of an integer decode product takes: tokens [0, n) of x and y, or (`slots` given) n
// slots of one expert, token i's activations row slots[i] / x_div of x and its outputs row slots[i] of y
// and of the split sums (partial_n rows a split). n_stage: the tokens the launch's shared memory holds.
struct MmvTokens {
    const float *x;
    unsigned int cols;
    const int *slots;
    unsigned int x_div;
    unsigned int n, n_stage, partial_n;
    __device__ __forceinline__ const float *x_row(unsigned int tok) const {
        return x + (size_t)(slots != nullptr ? (unsigned int)slots[tok] / x_div : tok) * cols;
    }
    __device__ __forceinline__ unsigned int out_row(unsigned int tok) const {
        return slots != nullptr ? (unsigned int)slots[tok] : tok;
    }
};

// Lane (g, t) of warp w takes rows g and g + 8 of the warp's 16 (mmv_rows) and tokens 4j + t of tile j.
// Returns mmv_write_rows's answer: whether this block wrote its rows' final outputs.
template <typename R, int NT4, bool GLU, bool STAGED>
__device__ __forceinline__ bool mmvq_body(const unsigned char *__restrict__ w, const unsigned char *__restrict__ w2,
                                          unsigned int rows, unsigned int cols, size_t row_bytes, const MmvShape shape,
                                          const MmvTokens &tk, const float *bias, const float *residual, float *y,
                                          unsigned int ldy, float *partial, unsigned int *counters) {
    extern __shared__ __align__(16) unsigned char mmv_smem[];
    constexpr unsigned UNROLL = STAGED ? R::SUNROLL : R::UNROLL;
    constexpr unsigned TILE = R::STEP * R::TILE_STEPS, GROUP = mmv_group<R, STAGED>(), KW = R::STEP / 16;
    static_assert(MMV_KC % TILE == 0 && (GROUP % MMV_KC == 0 || MMV_KC % GROUP == 0), "tiles within an activation group");

    const unsigned int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
    const unsigned int n = tk.n, ns = tk.n_stage;
    const unsigned int k_begin = blockIdx.y * shape.kr;
    const unsigned int k_end = min(cols, k_begin + shape.kr);
    const unsigned int kch = mmv_chunk(ns, shape.kr, 2, mmvq_unit(GROUP)), stride = mmvq_stride(kch);
    constexpr unsigned MIN_LANES = R::STEP / 8;  // the staging lanes (8 columns each) a minimum spans
    const unsigned int groups = kch / MMV_KC, blocks = kch / R::STEP;
    unsigned char *xs = mmv_smem;
    float *sx = reinterpret_cast<float *>(mmv_smem + ns * stride);  // [tok][group]: the activation scales
    int *xv = reinterpret_cast<int *>(sx + ns * groups);           // [tok][32-column block]: sums of v
    const MmvRows rw = mmv_rows<GLU>(w, w2, rows, row_bytes, warp, g);
    const unsigned char *wr[2] = {rw.wa, rw.wb};

    // Lane (g, t) holds token 4j + t of rows a ([0]) and b ([1]) in tile j: `out` the sum so far, and the
    // current activation group's: `acc` (block formats), or (k-quants) the hi and lo halves' integer sums
    // times the sub-scales in `ihi` and `ilo` (exact: at most 16 steps of 16 x 32 x 128 x 128 < 2^31, two
    // integer multiply-adds a row a step instead of a conversion and a float add), and `mins`.
    float out[NT4][2], acc[NT4][2];
    int ihi[NT4][2], ilo[NT4][2], mins[NT4][2];
#pragma unroll
    for (int j = 0; j < NT4; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) out[j][e] = 0.f, acc[j][e] = 0.f, ihi[j][e] = ilo[j][e] = mins[j][e] = 0;

    // Columns [c0, c0 + len) as 16-bit integers: a warp takes a token's 256-column group (8 columns a
    // lane; lanes past a short last group hold zeros), its scale from a shuffled max.
    auto stage = [&](unsigned int c0, unsigned int len) {
        const unsigned int units = (len + MMV_KC - 1) / MMV_KC * 32, total = n * units;
        for (unsigned int i = tid; i < total; i += MMV_THREADS) {
            const unsigned int tok = i / units, e = i % units;  // e: 8-column unit of the chunk
            const bool here = 8 * e < len;
            float f[8];
            const float amax = stage_unit_row(tk.x_row(tok), c0, e, here, f);
            uint2 hi, lo;
            int sum = mmvq_split8(f, amax > 0.f ? (float)MMVQ_RANGE / amax : 0.f, hi, lo);
            if (here) {
                unsigned char *at = xs + tok * stride + (e / 4) * 64 + 8 * (e % 4);
                *reinterpret_cast<uint2 *>(at) = hi;
                *reinterpret_cast<uint2 *>(at + 32) = lo;
            }
            if (lane == 0) sx[tok * groups + e / 32] = amax / (float)MMVQ_RANGE;
            if constexpr (R::HAS_MIN) {
#pragma unroll
                for (unsigned o = 1; o < MIN_LANES; o *= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);
                if (here && lane % MIN_LANES == 0) xv[tok * blocks + e / MIN_LANES] = sum;
            }
        }
    };

    using Raw = typename R::Raw;
    auto fetch_group = [&](Raw (&r)[UNROLL][2], unsigned int col) {
#pragma unroll
        for (int u = 0; u < (int)UNROLL; u++)
            if (col + u * TILE < k_end) {
                R::template fetch<false>(r[u][0], wr[0], col + u * TILE, t);
                R::template fetch<false>(r[u][1], wr[1], col + u * TILE, t);
            }
    };

    // The tiles of column group `col`, whose chunk starts at column `c0` of shared memory; streamed, each
    // tile's registers are refilled with the next group's tile as soon as it is used.
    auto compute = [&](Raw (&r)[UNROLL][2], unsigned int col, unsigned int c0) {
#pragma unroll
        for (int u = 0; u < (int)UNROLL; u++) {
            const unsigned int tc = col + u * TILE;
            if (tc >= k_end) break;
#pragma unroll
            for (int s = 0; s < (int)R::TILE_STEPS; s++) {
                const unsigned int c = tc + s * R::STEP - c0;  // column within the chunk
                unsigned int wa[KW], wb[KW];
                R::a(r[u][0], s, wa, t);
                R::a(r[u][1], s, wb, t);
                int isa = 1, isb = 1, ima = 0, imb = 0;
                float fsa = 1.f, fsb = 1.f;
                if constexpr (R::SUPER) {
                    isa = R::isc(r[u][0], s), isb = R::isc(r[u][1], s);
                    if constexpr (R::HAS_MIN) ima = R::imin(r[u][0], s), imb = R::imin(r[u][1], s);
                } else {
                    fsa = R::fsc(r[u][0], s), fsb = R::fsc(r[u][1], s);
                }
#pragma unroll
                for (int j = 0; j < NT4; j++) {
                    if (4 * j >= n) break;  // a whole tile of absent tokens
                    // B column g: token 4j + g / 2 (absent ones reread the last), its hi (even g) or lo half.
                    const unsigned int tok = min(4 * j + g / 2, n - 1);
                    const unsigned char *bp = xs + tok * stride + (c / 32) * 64 + (g % 2) * 32 + c % 32 + (R::STEP / 4) * t;
                    int d[4];
                    if constexpr (R::STEP == 32) {
                        const uint2 b = *reinterpret_cast<const uint2 *>(bp);
                        mma_k32<R::SIGNED>(d, wa[0], wb[0], wa[KW - 1], wb[KW - 1], b.x, b.y);
                    } else {
                        const unsigned int b = *reinterpret_cast<const unsigned int *>(bp);
                        mma_k16<R::SIGNED>(d, wa[0], wb[0], b);
                    }
                    // d[0], d[1]: row a, token 4j + t's hi and lo sums; d[2], d[3]: row b.
                    if constexpr (R::SUPER) {
                        ihi[j][0] += isa * d[0], ilo[j][0] += isa * d[1];
                        ihi[j][1] += isb * d[2], ilo[j][1] += isb * d[3];
                        if constexpr (R::HAS_MIN) {
                            const int xs_sum = xv[min(4 * j + t, n - 1) * blocks + c / R::STEP];
                            mins[j][0] += ima * xs_sum;
                            mins[j][1] += imb * xs_sum;
                        }
                    } else {
                        acc[j][0] = fmaf(fsa, (float)(d[0] * 256 + d[1]), acc[j][0]);
                        acc[j][1] = fmaf(fsb, (float)(d[2] * 256 + d[3]), acc[j][1]);
                        if constexpr (R::HAS_MIN) {
                            const float xs_sum = (float)xv[min(4 * j + t, n - 1) * blocks + c / R::STEP];
                            acc[j][0] = fmaf(R::fmin(r[u][0], s), xs_sum, acc[j][0]);
                            acc[j][1] = fmaf(R::fmin(r[u][1], s), xs_sum, acc[j][1]);
                        }
                    }
                }
            }
            // An activation group (a super-block) ends: its scales into the sum, in column order.
            if ((tc + TILE) % MMV_KC == 0 || tc + TILE >= k_end) {
                float da = 1.f, db = 1.f, ma = 0.f, mb = 0.f;
                if constexpr (R::SUPER) {
                    R::tile(r[u][0], da, ma);
                    R::tile(r[u][1], db, mb);
                }
#pragma unroll
                for (int j = 0; j < NT4; j++) {
                    if (4 * j >= n) break;
                    const float s = sx[min(4 * j + t, n - 1) * groups + (tc - c0) / MMV_KC];
                    if constexpr (R::SUPER) {
#pragma unroll
                        for (int e = 0; e < 2; e++) {
                            acc[j][e] = fmaf((float)ihi[j][e], 256.f, (float)ilo[j][e]);
                            ihi[j][e] = ilo[j][e] = 0;
                        }
                    }
                    out[j][0] = fmaf(da * s, acc[j][0], out[j][0]);
                    out[j][1] = fmaf(db * s, acc[j][1], out[j][1]);
                    if constexpr (R::SUPER && R::HAS_MIN) {
                        out[j][0] = fmaf(ma * s, (float)mins[j][0], out[j][0]);
                        out[j][1] = fmaf(mb * s, (float)mins[j][1], out[j][1]);
                    }
                    acc[j][0] = acc[j][1] = 0.f;
                    mins[j][0] = mins[j][1] = 0;
                }
            }
            if (!STAGED && tc + GROUP < k_end) {
                R::template fetch<false>(r[u][0], wr[0], tc + GROUP, t);
                R::template fetch<false>(r[u][1], wr[1], tc + GROUP, t);
            }
        }
    };

    if constexpr (STAGED) {
        staged_groups<R, UNROLL, TILE, GLU>(mmv_smem + mmvq_act_bytes(ns, kch, mmvq_min_cols<R>()), w, w2, rows, row_bytes, wr,
                                            warp, lane, k_begin, k_end, kch, stage, compute);
    } else {
        unsigned int staged = ~0u;
        Raw r[UNROLL][2];
        fetch_group(r, k_begin);
        he::pdl_wait();
        for (unsigned int col = k_begin; col < k_end; col += GROUP)
            compute(r, col, enter_chunk(col, k_begin, k_end, kch, staged, stage));
    }

    auto out_row = [&](unsigned int tok) { return tk.out_row(tok); };
    auto each = [&](auto &&fn) {
#pragma unroll
        for (int j = 0; j < NT4; j++) {
            const unsigned int tok = 4 * j + t;
            if (tok < n) fn(tok, out[j][0], out[j][1]);
        }
    };
    return mmv_write_rows<GLU>(shape, n, tk.partial_n, out_row, rows, rw.a, rw.b, bias, residual, y, ldy, partial,
                               counters, each);
}

}  // namespace
