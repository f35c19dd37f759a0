// The block formats' decode product past 8 tokens a launch (mmvt_kernel: every token of the launch
// against one read of the weights, the activations converted once a product by mmvt_prep_kernel).
// kernels/mmv_readers.cuh says the design.
#include "mmv.cuh"

namespace {

// ---- the tile kernel (block formats, more than MMV_PREP_AFTER tokens a launch) ----
// The integer kernel (mmv_int.cu) holds every token tile's sums at once, so it takes 16 tokens a launch and
// reads (and decodes) the weights again for each 16; each block also converts its chunk's activations
// itself. The tile kernel computes the same integers and the same float epilogue, in the same order
// (so the same bits, for any token count), arranged for many tokens: the activations are converted once
// a product (mmvt_prep_kernel, into the workspace after the split sums); a block takes every token of
// the launch (up to 64) against its 128 rows, one 256-column chunk (an activation group) at a time: the
// chunk's weight bytes (each warp's 16 rows, as WeightStage lays them out) and its converted activations
// are copied with cp.async into one of three buffers, two chunks ahead of the arithmetic; a warp decodes its
// rows' quants of the chunk into registers once, then runs them against its token tiles one after the
// other, each tile's sub-block sums and epilogue finished before the next tile starts (so a lane holds
// one float a row and token across chunks, not the integer kernel's five). One block a multiprocessor
// at most (up to 255 registers a thread: a warp's decoded quants and scales stay in registers).

// Words of a token's record a 256-column group: the activation scale (then 3 unused, for 16-byte copies)
// and, for readers with minimums, the group's sums of v per minimum (ints for k-quants, floats else).
template <typename R>
__host__ __device__ constexpr unsigned mmvt_meta() {
    return 4 + (R::HAS_MIN ? MMV_KC / R::STEP : 0);
}
// A token's converted row in the workspace: per 32-column step 32 hi bytes then 32 lo bytes (the
// integer kernel's shared-memory layout), 2 bytes a column.
__host__ __device__ inline size_t mmvt_prep_bytes(unsigned int n, unsigned int cols) { return (size_t)n * cols * 2; }
// Bytes of shared memory a staged chunk's activations take: each token's 512 bytes and 64 of padding
// (mmvq_stride: two tokens a half warp reads in distinct banks), then the tokens' records.
template <typename R>
__host__ __device__ constexpr unsigned mmvt_act_bytes(unsigned n) {
    return n * mmvq_stride(MMV_KC) + n * mmvt_meta<R>() * 4;
}
template <typename R>
__host__ __device__ constexpr unsigned mmvt_stage_bytes(unsigned n) {
    return mmvt_act_bytes<R>(n) + MMV_WARPS * WeightSlots<R, MMV_KC>::SLOT;
}
// The converted activations fit the workspace hostembed_mmv_workspace gives launches of more than
// MMV_PREP_AFTER tokens after the split sums (a token's cols + groups words): a token's cols / 2 words of
// quantized row and META words a group, so cols / 2 >= (META - 1) groups. The tightest case of each
// record size: 32 columns (one group) for 12-word records (16 >= 11), 256 for the 20-word records of the
// 16-column k-quants, whose rows are whole super-blocks.
static_assert(mmvt_meta<QQ4_1>() - 1 <= 32 / 2 && mmvt_meta<QQ2_K>() - 1 <= 256 / 2, "the workspace holds it");
// Chunks in flight: copies of the next two while one computes.
constexpr unsigned MMVT_STAGES = 3;

// One warp a token's 256-column group, converted as the integer kernel's `stage` does: v = rn(x 32639 /
// max|x|) as hi and lo bytes, the group's scale and (readers with minimums) its sums of v.
template <typename R>
__global__ __launch_bounds__(MMV_THREADS) void mmvt_prep_kernel(const float *__restrict__ x, unsigned int n,
                                                                 unsigned int cols, unsigned char *__restrict__ xq,
                                                                 int *__restrict__ meta) {
    he::pdl_launch_dependents();
    constexpr unsigned META = mmvt_meta<R>(), MIN_LANES = R::STEP / 8;
    const unsigned int groups = (cols + MMV_KC - 1) / MMV_KC, lane = threadIdx.x % 32;
    const unsigned int unit = blockIdx.x * MMV_WARPS + threadIdx.x / 32;
    he::pdl_wait();  // x comes from the kernel before; the product before may still read the workspace
    if (unit >= n * groups) return;  // a whole warp
    const unsigned int tok = unit / groups, gi = unit % groups, c0 = gi * MMV_KC;
    const bool here = c0 + 8 * lane < cols;
    float f[8];
    const float amax = stage_unit(x, tok, cols, c0, lane, here, f);
    uint2 hi, lo;
    int sum = mmvq_split8(f, amax > 0.f ? (float)MMVQ_RANGE / amax : 0.f, hi, lo);
    if (here) {
        unsigned char *at = xq + (size_t)tok * cols * 2 + (size_t)(c0 + 8 * lane) / 32 * 64 + 8 * (lane % 4);
        *reinterpret_cast<uint2 *>(at) = hi;
        *reinterpret_cast<uint2 *>(at + 32) = lo;
    }
    int *rec = meta + (size_t)(tok * groups + gi) * META;
    if (lane == 0) rec[0] = __float_as_int(amax / (float)MMVQ_RANGE);
    if constexpr (R::HAS_MIN) {
#pragma unroll
        for (unsigned o = 1; o < MIN_LANES; o *= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);
        // k-quants multiply the sums as integers; block readers take them as floats (exact: |sum| < 2^24).
        if (here && lane % MIN_LANES == 0) rec[4 + lane / MIN_LANES] = R::SUPER ? sum : __float_as_int((float)sum);
    }
}

// The block readers' (not k-quants') step sums d enter the float epilogue as the integer kernel's
// (float)(d_hi 256 + d_lo), which is fmaf((float)d_hi, 256, (float)d_lo) (both exact: |d| <= 32 128 128 =
// 2^19, so the one rounding is of the same integer). Each (float)d is taken without the conversion unit
// (a quarter of the FMA rate): the product adds MMVT_MAGIC, the bits of 1.5 2^23, whose float then holds
// 1.5 2^23 + d exactly for |d| < 2^22, less 1.5 2^23.
constexpr int MMVT_MAGIC = 0x4B400000;
__device__ __forceinline__ float mmvt_float(int biased) { return __int_as_float(biased) - 12582912.f; }

// NT4 token tiles of 4 (4 * NT4 tokens at most). HALVES 2 (hostembed_tuning's mmv_tc_blocks 2, in a build
// with -DMMV_TUNING_KERNELS=1): twice the warps, each row set's tiles taken alternately by two warps (4
// warps a scheduler instead of 2, at most 128 registers a thread); every output is still computed by one
// lane in the same order: the same bits.
template <typename R, int NT4, bool GLU, int HALVES>
__global__ __launch_bounds__(MMV_THREADS * HALVES, 1) void mmvt_kernel(
    const unsigned char *__restrict__ w, const unsigned char *__restrict__ w2, unsigned int rows, unsigned int cols,
    size_t row_bytes, unsigned int n, const float *bias, const float *residual, float *y, unsigned int ldy,
    float *partial, unsigned int *counters) {
    extern __shared__ __align__(16) unsigned char mmv_smem[];
    using WS = WeightSlots<R, MMV_KC>;
    using Raw = typename R::Raw;
    constexpr unsigned TILE = R::STEP * R::TILE_STEPS, TPC = MMV_KC / TILE;
    constexpr unsigned KW = R::STEP / 16, META = mmvt_meta<R>(), XSTRIDE = mmvq_stride(MMV_KC);
    static_assert(MMV_KC % TILE == 0, "whole tiles in a chunk");
    static_assert(WS::BLOCK_BYTES == MMV_WARPS * WS::WARP_BYTES && WS::WARP_BYTES == WS::STAGES * WS::SLOT,
                  "a warp's rows of a chunk fill one of WeightSlots' slots");

    static_assert(HALVES == 1 || (HALVES == 2 && NT4 % 2 == 0), "whole tiles a warp");
    constexpr int NTW = NT4 / HALVES;  // a warp's token tiles: tiles half, half + HALVES, ...
    const unsigned int tid = threadIdx.x, lane = tid % 32, g = lane / 4, t = lane % 4;
    // The warp's row set (its weight slot) and which of the set's tiles it takes.
    const unsigned int warp = (tid / 32) % MMV_WARPS, half = tid / 32 / MMV_WARPS;
    he::pdl_launch_dependents();
    const MmvShape shape = mmv_shape(rows, cols, GLU, true);
    const unsigned int k_begin = blockIdx.y * shape.kr;
    const unsigned int k_end = min(cols, k_begin + shape.kr);
    const unsigned int chunks = (k_end - k_begin + MMV_KC - 1) / MMV_KC, groups = (cols + MMV_KC - 1) / MMV_KC;
    // The converted activations (mmvt_prep_kernel's), after the split sums of the non-rounded shape.
    const unsigned char *xq =
        reinterpret_cast<const unsigned char *>(partial + mmv_prep_offset(mmv_shape(rows, cols, GLU), GLU, n, rows));
    const unsigned char *xmeta = xq + mmvt_prep_bytes(n, cols);
    const unsigned int act = mmvt_act_bytes<R>(n), stage_bytes = act + MMV_WARPS * WS::SLOT;
    const MmvRows rw = mmv_rows<GLU>(w, w2, rows, row_bytes, warp, g);

    // Chunk ci's copies into buffer ci % MMVT_STAGES: each warp its rows' weight bytes, every thread a
    // share of the activations (512 bytes and the record a token; 32-column steps past the range as zeros).
    auto issue_weights = [&](unsigned int ci) {
        if (ci < chunks && half == 0) {
            const unsigned int c0 = k_begin + ci * MMV_KC;
            const unsigned int len = (min(c0 + MMV_KC, k_end) - c0) / R::BLOCK_COLS * R::BYTES;
            copy_rows<WS, GLU>(mmv_smem + (ci % MMVT_STAGES) * stage_bytes + act + warp * WS::SLOT, w, w2, rows,
                               row_bytes, warp, lane, (size_t)(c0 / R::BLOCK_COLS) * R::BYTES, len);
        }
    };
    // A warp a token: lane p its 16-byte piece p of the row (4 a step: hi, then lo), the first lanes the
    // record (a division by the pieces a token took more instructions than the copies).
    auto issue_acts = [&](unsigned int ci) {
        if (ci < chunks) {
            const unsigned int c0 = k_begin + ci * MMV_KC;
            constexpr unsigned PIECES = MMV_KC * 2 / 16, MPIECES = META / 4;
            static_assert(PIECES == 32 && MPIECES <= 32, "a lane a piece");
            unsigned char *buf = mmv_smem + (ci % MMVT_STAGES) * stage_bytes;
            const bool valid = c0 + 32 * (lane / 4) < k_end;  // 32-column steps past the range as zeros
            for (unsigned int tok = tid / 32; tok < n; tok += MMV_WARPS * HALVES) {
                const unsigned char *row = xq + (size_t)tok * cols * 2;
                he::cp_async16(buf + tok * XSTRIDE + 16 * lane, valid ? row + (size_t)c0 * 2 + 16 * lane : row, valid);
                if (lane < MPIECES)
                    he::cp_async16(buf + n * XSTRIDE + (tok * META + 4 * lane) * 4,
                                   xmeta + ((size_t)tok * groups + c0 / MMV_KC) * META * 4 + 16 * lane, true);
            }
        }
    };

    float out[NTW][2];
#pragma unroll
    for (int j = 0; j < NTW; j++) out[j][0] = out[j][1] = 0.f;

    // The warp's rows against its token tiles over one chunk (`len` columns from c0) in buffer `buf`. FULL
    // (len == MMV_KC, known when compiling): without a test of len between steps, whose branches kept the
    // compiler from overlapping one step's loads and products with the step before (Q8_0's 8 steps a tile ran
    // load, product and sums one after another).
    auto compute = [&](const unsigned char *buf, unsigned int c0, unsigned int len, auto full) {
        constexpr bool FULL = decltype(full)::value;
        const unsigned char *xs = buf;
        const int *meta = reinterpret_cast<const int *>(buf + n * XSTRIDE);
        const unsigned char *slot = buf + act + warp * WS::SLOT;
        const size_t start = (size_t)(c0 / R::BLOCK_COLS) * R::BYTES;
        const unsigned char *sa = slot + g * WS::ROW + ((reinterpret_cast<uintptr_t>(rw.wa) + start) & 15);
        const unsigned char *sb = slot + (8 + g) * WS::ROW + ((reinterpret_cast<uintptr_t>(rw.wb) + start) & 15);
        Raw r[TPC][2];
#pragma unroll
        for (int u = 0; u < (int)TPC; u++)
            if (FULL || u * TILE < len) {
                R::template fetch<true>(r[u][0], sa, u * TILE, t);
                R::template fetch<true>(r[u][1], sb, u * TILE, t);
            }
        // The chunk's A words and scales, decoded once for every token tile.
        unsigned int wa[TPC][R::TILE_STEPS][KW], wb[TPC][R::TILE_STEPS][KW];
        // Each format uses some of these (k-quants the integer sub-scales, block formats the float scales).
        [[maybe_unused]] int isa[TPC][R::TILE_STEPS], isb[TPC][R::TILE_STEPS], ima[TPC][R::TILE_STEPS],
            imb[TPC][R::TILE_STEPS];
        [[maybe_unused]] float fsa[TPC], fsb[TPC], fmn_a[TPC], fmn_b[TPC];
#pragma unroll
        for (int u = 0; u < (int)TPC; u++) {
#pragma unroll
            for (int s = 0; s < (int)R::TILE_STEPS; s++) {
                R::a(r[u][0], s, wa[u][s], t);
                R::a(r[u][1], s, wb[u][s], t);
                if constexpr (R::SUPER) {
                    isa[u][s] = R::isc(r[u][0], s), isb[u][s] = R::isc(r[u][1], s);
                    if constexpr (R::HAS_MIN) ima[u][s] = R::imin(r[u][0], s), imb[u][s] = R::imin(r[u][1], s);
                }
            }
            if constexpr (!R::SUPER) {
                fsa[u] = R::fsc(r[u][0], 0), fsb[u] = R::fsc(r[u][1], 0);
                if constexpr (R::HAS_MIN) fmn_a[u] = R::fmin(r[u][0], 0), fmn_b[u] = R::fmin(r[u][1], 0);
            }
        }
        [[maybe_unused]] float da = 1.f, db = 1.f, ma = 0.f, mb = 0.f;
        if constexpr (R::SUPER) {
            R::tile(r[TPC - 1][0], da, ma);
            R::tile(r[TPC - 1][1], db, mb);
        }
#pragma unroll
        for (int j = 0; j < NTW; j++) {
            const unsigned int tb = 4 * (j * HALVES + half);
            // Absent tokens four tiles at a time: a branch between every two tiles kept the scheduler from
            // overlapping one tile's sums with the next tile's tensor-core products.
            if (j % (4 / HALVES) == 0 && tb >= n) break;
            // B column g: token tb + g / 2 (absent ones reread the last), its hi (even g) or lo half; the
            // lane's outputs are token tb + t's.
            const unsigned char *xb = xs + min(tb + g / 2, n - 1) * XSTRIDE + (g % 2) * 32 + (R::STEP / 4) * t;
            const int *rec = meta + min(tb + t, n - 1) * META;
            [[maybe_unused]] int ihi[2] = {0, 0}, ilo[2] = {0, 0}, mins[2] = {0, 0};  // k-quants' sums
            float acc[2] = {0.f, 0.f};
#pragma unroll
            for (int u = 0; u < (int)TPC; u++) {
                if (!FULL && u * TILE >= len) break;
#pragma unroll
                for (int s = 0; s < (int)R::TILE_STEPS; s++) {
                    const unsigned int c = u * TILE + s * R::STEP;  // column within the chunk
                    const unsigned char *bp = xb + (c / 32) * 64 + c % 32;
                    int d[4];
                    if constexpr (R::STEP == 32) {
                        const uint2 b = *reinterpret_cast<const uint2 *>(bp);
                        mma_k32<R::SIGNED>(d, wa[u][s][0], wb[u][s][0], wa[u][s][KW - 1], wb[u][s][KW - 1], b.x, b.y,
                                           R::SUPER ? 0 : MMVT_MAGIC);
                    } else {
                        const unsigned int b = *reinterpret_cast<const unsigned int *>(bp);
                        mma_k16<R::SIGNED>(d, wa[u][s][0], wb[u][s][0], b);
                    }
                    // As the integer kernel: d[0], d[1] row a's hi and lo sums, d[2], d[3] row b's.
                    if constexpr (R::SUPER) {
                        ihi[0] += isa[u][s] * d[0], ilo[0] += isa[u][s] * d[1];
                        ihi[1] += isb[u][s] * d[2], ilo[1] += isb[u][s] * d[3];
                        if constexpr (R::HAS_MIN) {
                            const int xs_sum = rec[4 + c / R::STEP];
                            mins[0] += ima[u][s] * xs_sum;
                            mins[1] += imb[u][s] * xs_sum;
                        }
                    } else {
                        static_assert(R::STEP == 32, "block readers take 32-column steps");
                        acc[0] = fmaf(fsa[u], fmaf(mmvt_float(d[0]), 256.f, mmvt_float(d[1])), acc[0]);
                        acc[1] = fmaf(fsb[u], fmaf(mmvt_float(d[2]), 256.f, mmvt_float(d[3])), acc[1]);
                        if constexpr (R::HAS_MIN) {
                            const float xs_sum = __int_as_float(rec[4 + c / R::STEP]);
                            acc[0] = fmaf(fmn_a[u], xs_sum, acc[0]);
                            acc[1] = fmaf(fmn_b[u], xs_sum, acc[1]);
                        }
                    }
                }
            }
            // The group ends with the chunk: its scales into the sum, as the integer kernel's epilogue.
            const float sc = __int_as_float(rec[0]);
            if constexpr (R::SUPER) {
#pragma unroll
                for (int e = 0; e < 2; e++) acc[e] = fmaf((float)ihi[e], 256.f, (float)ilo[e]);
            }
            out[j][0] = fmaf(da * sc, acc[0], out[j][0]);
            out[j][1] = fmaf(db * sc, acc[1], out[j][1]);
            if constexpr (R::SUPER && R::HAS_MIN) {
                out[j][0] = fmaf(ma * sc, (float)mins[0], out[j][0]);
                out[j][1] = fmaf(mb * sc, (float)mins[1], out[j][1]);
            }
        }
    };

    // MMVT_STAGES buffers, a commit group a chunk: chunk ci + STAGES - 1's copies go out once every warp
    // has left chunk ci - 1, whose buffer they take (the barrier that also makes chunk ci's copies every
    // thread's), so the arithmetic of the chunks before hides them.
    static_assert(MMVT_STAGES >= 2, "a chunk ahead at least");
    issue_weights(0);  // the weights do not depend on the kernel before
    he::pdl_wait();     // the converted activations come from mmvt_prep_kernel
    issue_acts(0);
    he::cp_async_commit();
#pragma unroll
    for (unsigned int ci = 1; ci + 1 < MMVT_STAGES; ci++) {
        issue_weights(ci);
        issue_acts(ci);
        he::cp_async_commit();
    }
    for (unsigned int ci = 0; ci < chunks; ci++) {
        he::cp_async_wait<MMVT_STAGES - 2>();
        __syncthreads();
        issue_weights(ci + MMVT_STAGES - 1);
        issue_acts(ci + MMVT_STAGES - 1);
        he::cp_async_commit();
        const unsigned int c0 = k_begin + ci * MMV_KC, len = min(c0 + MMV_KC, k_end) - c0;
        const unsigned char *buf = mmv_smem + (ci % MMVT_STAGES) * stage_bytes;
        if (len == MMV_KC) compute(buf, c0, len, std::true_type{});
        else compute(buf, c0, len, std::false_type{});
    }

    mmv_write<GLU>(shape, n, rows, rw.a, rw.b, bias, residual, y, ldy, partial, counters, [&](auto &&fn) {
#pragma unroll
        for (int j = 0; j < NTW; j++) {
            const unsigned int tok = 4 * (j * HALVES + half) + t;
            if (tok < n) fn(tok, out[j][0], out[j][1]);
        }
    });
}

// Whether this device gives a block the tile kernel's shared memory for `n` tokens (3 x 75 KiB at most,
// at 64 tokens: sm_90's 227 KiB holds every reader's; smaller cards' launches stay on the integer kernel,
// which gives the same bits).
template <typename R>
bool mmvt_fits(unsigned int n) {
    int dev = 0, most = 0;
    return cudaGetDevice(&dev) == cudaSuccess &&
           cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess &&
           (size_t)MMVT_STAGES * mmvt_stage_bytes<R>(n) <= (size_t)most;
}

// A launch of `n` (MMV_PREP_AFTER < n <= MMV_MAX_TOKENS) tokens on the tile kernel: the conversion,
// then the product.
template <typename R, bool GLU, int HALVES>
cudaError_t launch_mmvt(const unsigned char *w, const unsigned char *w2, unsigned int rows, unsigned int cols,
                        size_t row_bytes, const float *x, unsigned int n, const float *bias, const float *residual,
                        float *y, unsigned int ldy, float *partial, unsigned int *counters,
                        const hostembed_tuning &tuning, cudaStream_t stream) {
    const MmvShape shape = mmv_shape(rows, cols, GLU, true);
    unsigned char *xq = reinterpret_cast<unsigned char *>(partial + mmv_prep_offset(mmv_shape(rows, cols, GLU), GLU, n, rows));
    const unsigned int units = n * ((cols + MMV_KC - 1) / MMV_KC);
    cudaError_t e = he::launch_overlapped(tuning, mmvt_prep_kernel<R>, dim3((units + MMV_WARPS - 1) / MMV_WARPS),
                                          dim3(MMV_THREADS), 0, stream, x, n, cols, xq,
                                          reinterpret_cast<int *>(xq + mmvt_prep_bytes(n, cols)));
    if (e != cudaSuccess) return e;
    const int smem = (int)(MMVT_STAGES * mmvt_stage_bytes<R>(n));
    auto go = [&](auto kernel) {
        cudaError_t err = he::allow_smem(kernel, smem);
        if (err != cudaSuccess) return err;
        return he::launch_overlapped(tuning, kernel, dim3(shape.row_blocks, shape.splits), dim3(MMV_THREADS * HALVES),
                                     (size_t)smem,
                                     stream, w, w2, rows, cols, row_bytes, n, bias, residual, y, ldy, partial,
                                     counters);
    };
    if (n <= 16) return go(mmvt_kernel<R, 4, GLU, HALVES>);
    if (n <= 32) return go(mmvt_kernel<R, 8, GLU, HALVES>);
    return go(mmvt_kernel<R, 16, GLU, HALVES>);
}

}  // namespace

cudaError_t he::mmv::tile(bool glu, const Args &a) {
    cudaError_t err = cudaErrorNotSupported;
    with_reader(a.dtype, [&](auto reader) {
        using R = decltype(reader);
        if constexpr (R::INT) {
            auto go = [&](auto g) {
                auto launch = launch_mmvt<R, decltype(g)::value, 1>;
                // Two warps a row set only in a build with the tuning kernels: they double this file's build.
                if constexpr (MMV_TUNING_KERNELS)
                    if (a.tuning.mmv_tc_blocks == 2) launch = launch_mmvt<R, decltype(g)::value, 2>;
                err = launch(a.w, a.w2, a.rows, a.cols, a.row_bytes, a.x, a.n, a.bias, a.residual, a.y, a.ldy,
                             a.partial, a.counters, a.tuning, a.stream);
            };
            if (glu) go(std::true_type{});
            else go(std::false_type{});
        }
    });
    return err;
}

bool he::mmv::tile_fits(int dtype, unsigned int n) {
    bool fits = false;
    with_reader(dtype, [&](auto reader) {
        using R = decltype(reader);
        if constexpr (R::INT) fits = mmvt_fits<R>(n);
    });
    return fits;
}
