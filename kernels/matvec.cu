// Matrix-vector products for decode, y[t] = W x[t] for up to 8 tokens per pass over W, f32 accumulation.
// Batch-1 decode is bound by reading W, so the layout serves that read: each row is read by one warp (or
// by `split` warps of one block, each taking every split-th stretch, when there are too few rows to keep
// every SM busy), the activations through the read-only cache, a warp reduction at the end.
// Two ways to read a row: the float formats (and Q8_0 rows only 2-byte aligned) load 16-byte chunks per
// lane straight into registers; the block formats stage stretches of whole blocks in shared memory with
// 16-byte cp.async copies, double-buffered per warp (the next stretch in flight while this one is
// decoded), and each lane decodes 32-value units from there with f32 FMAs.
#include "formats.cuh"

namespace {

constexpr int MV_WARPS = 8;
constexpr int MV_THREADS = MV_WARPS * 32;
constexpr unsigned int MV_MAX_TOKENS = 8;

// Loads in flight per lane: fewer when more tokens (and so more activation loads) share each weight.
template <int T, bool GLU>
__host__ __device__ constexpr int unroll_for() {
    return T == 1 ? (GLU ? 4 : 8) : T == 2 ? (GLU ? 2 : 4) : T == 4 ? (GLU ? 1 : 2) : 1;
}

// The activation row token slot t reads: slots past the last token repeat it (their sums are never
// written), which keeps the inner loops free of branches.
template <int T>
__device__ __forceinline__ unsigned int token_row(int t, unsigned int nt) {
    return T == 1 ? 0u : ((unsigned int)t < nt ? (unsigned int)t : nt - 1);
}

// Which row this warp works on and which of the row's `split` parts it takes.
struct RowPart {
    unsigned int row, part;
    bool valid;
};

__device__ __forceinline__ RowPart row_part(unsigned int rows, unsigned int split) {
    const unsigned int warp = threadIdx.x / 32;
    RowPart rp;
    rp.row = blockIdx.x * (MV_WARPS / split) + warp / split;
    rp.part = warp % split;
    rp.valid = rp.row < rows;
    return rp;
}

// Reduces the lanes' (and the split warps') sums and writes row `row` for every token: lane t writes
// token t. Every thread of the block must call it (it holds a barrier when split > 1).
template <int T, bool GLU>
__device__ __forceinline__ void finish_row(float *acc, float *acc2, RowPart rp, unsigned int split, unsigned int nt,
                                           const float *bias, const float *residual, float *y, unsigned int ldy) {
    __shared__ float partial[MV_WARPS][MV_MAX_TOKENS], partial2[MV_WARPS][MV_MAX_TOKENS];
    const unsigned int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int t = 0; t < T; t++) {
        acc[t] = he::warp_sum(acc[t]);
        if (GLU) acc2[t] = he::warp_sum(acc2[t]);
    }
    if (split > 1) {
        if (lane == 0) {
#pragma unroll
            for (int t = 0; t < T; t++) {
                partial[warp][t] = acc[t];
                if (GLU) partial2[warp][t] = acc2[t];
            }
        }
        __syncthreads();
        if (rp.part != 0) return;
#pragma unroll
        for (int t = 0; t < T; t++) {
            acc[t] = acc2[t] = 0.f;
            for (unsigned int j = 0; j < split; j++) {
                acc[t] += partial[warp + j][t];
                if (GLU) acc2[t] += partial2[warp + j][t];
            }
        }
    }
    if (!rp.valid) return;
#pragma unroll
    for (int t = 0; t < T; t++) {
        if ((unsigned int)t < nt && lane == (unsigned int)t) {
            const size_t at = (size_t)t * ldy + rp.row;
            if (GLU) {
                y[at] = he::silu(acc[t]) * acc2[t];
            } else {
                float v = acc[t];
                if (bias != nullptr) v += bias[rp.row];
                if (residual != nullptr) v += residual[at];
                y[at] = v;
            }
        }
    }
}

// One chunk of weights (and of the up projection's, for GLU) against every token's activations at the
// same columns (xc: token 0's first column; tokens are `cols` apart).
template <typename F, int T, bool GLU>
__device__ __forceinline__ void chunk_dot(const typename F::Chunk &wv, const typename F::Chunk &wv2, const float *xc,
                                          unsigned int cols, unsigned int nt, float *acc, float *acc2) {
    constexpr int N = F::CHUNK_VALUES;
    float wf[N], wf2[N];
    F::decode(wv, wf);
    if (GLU) F::decode(wv2, wf2);
#pragma unroll
    for (int t = 0; t < T; t++) {
        float xf[N];
        he::load_x<N>(xc + (size_t)token_row<T>(t, nt) * cols, xf);
#pragma unroll
        for (int i = 0; i < N; i++) {
            acc[t] = fmaf(wf[i], xf[i], acc[t]);
            if (GLU) acc2[t] = fmaf(wf2[i], xf[i], acc2[t]);
        }
    }
}

// The one kernel body, for every format F (kernels/formats.cuh): each lane takes the row's slots
// part * 32 + lane, then every 32 * split-th, U of them loaded before their arithmetic.
template <typename F, int T, bool GLU>
__global__ __launch_bounds__(MV_THREADS, 2) void matvec_kernel(const unsigned char *__restrict__ w,
                                                            const unsigned char *__restrict__ w2, unsigned int rows,
                                                            unsigned int cols, unsigned int split,
                                                            const float *__restrict__ x, unsigned int nt,
                                                            const float *bias, const float *residual, float *y,
                                                            unsigned int ldy) {
    using Chunk = typename F::Chunk;
    constexpr int U = unroll_for<T, GLU>();
    const RowPart rp = row_part(rows, split);
    const unsigned int lane = threadIdx.x % 32;
    float acc[T], acc2[T];
#pragma unroll
    for (int t = 0; t < T; t++) acc[t] = acc2[t] = 0.f;

    if (rp.valid) {
        const size_t row_bytes = (size_t)cols / F::BLOCK_VALUES * F::BLOCK_BYTES;
        const unsigned char *wr = w + rp.row * row_bytes;
        const unsigned char *wr2 = GLU ? w2 + rp.row * row_bytes : nullptr;
        const unsigned int whole = F::whole_slots(cols), nslots = F::slots(cols), stride = 32 * split;
        // Whole groups of U slots with no bounds test between their loads, then the tail one at a time.
        unsigned int c0 = rp.part * 32 + lane;
        for (; c0 + stride * (U - 1) < whole; c0 += stride * U) {
            Chunk wv[U], wv2[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                wv[u] = F::load_chunk(wr, c0, stride * u);
                if (GLU) wv2[u] = F::load_chunk(wr2, c0, stride * u);
            }
#pragma unroll
            for (int u = 0; u < U; u++)
                chunk_dot<F, T, GLU>(wv[u], wv2[u], x + F::column(c0 + stride * u), cols, nt, acc, acc2);
        }
        for (; c0 < nslots; c0 += stride) {
            if (!F::has(c0, cols)) continue;
            const Chunk wv = F::load_chunk(wr, c0, 0);
            const Chunk wv2 = GLU ? F::load_chunk(wr2, c0, 0) : Chunk{};
            chunk_dot<F, T, GLU>(wv, wv2, x + F::column(c0), cols, nt, acc, acc2);
        }
    }
    finish_row<T, GLU>(acc, acc2, rp, split, nt, bias, residual, y, ldy);
}

constexpr unsigned MV_STAGE_BYTES = 48 * 1024 - 1024;  // static shared memory, less finish_row's partial sums
// Sums of the activations over each 16 columns, for formats with offsets at batch 1: scale * (q . x) +
// add * sum(x) per half unit, the sums shared by the block's rows. Rows of up to 32768 columns.
constexpr unsigned MV_XSUM_GROUPS = 2048;

// How a warp stages a block format's row: STRETCH_BLOCKS whole blocks at a time, copied as the aligned
// 16-byte granules that cover them (so a stretch sits in shared memory at its address's offset mod 16 and
// keeps its alignment); two stretch buffers per weight per warp, in what the sums leave of the budget.
template <typename F, bool GLU, bool XSUMS>
struct Staging {
    static constexpr unsigned WEIGHTS = GLU ? 2 : 1;
    static constexpr unsigned BUFFER_LIMIT =
        (MV_STAGE_BYTES - (XSUMS ? MV_XSUM_GROUPS * 4 : 0)) / (MV_WARPS * WEIGHTS * 2) / 16 * 16;
    // Up to 15 bytes before the stretch and 15 after, to the granules' edges.
    static constexpr unsigned STRETCH_BLOCKS = (BUFFER_LIMIT - 32) / F::BLOCK_BYTES;
    static constexpr unsigned BUFFER_BYTES = (STRETCH_BLOCKS * F::BLOCK_BYTES + 15) / 16 * 16 + 16;
    static constexpr unsigned STRETCH_UNITS = STRETCH_BLOCKS * F::UNITS;
    static constexpr unsigned UNIT_STEPS = (STRETCH_UNITS + 31) / 32;
    static constexpr unsigned LOADS = (BUFFER_BYTES / 16 + 31) / 32;
    static_assert(STRETCH_BLOCKS >= 1 && BUFFER_BYTES <= BUFFER_LIMIT, "a stretch holds a block");
};

// Queues the copies of the blocks b0 .. b0 + count of a row into `buf`: the aligned granules around them,
// one per lane per step.
template <unsigned LOADS>
__device__ __forceinline__ void stage_blocks(const unsigned char *row, size_t first_byte, size_t bytes,
                                             unsigned char *buf, unsigned int lane) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(row) + first_byte;
    const uintptr_t first = start & ~(uintptr_t)15;
    const unsigned int granules = (unsigned int)((((start + bytes + 15) & ~(uintptr_t)15) - first) / 16);
    const uint4 *src = reinterpret_cast<const uint4 *>(first);
#pragma unroll
    for (unsigned int i = 0; i < LOADS; i++) {
        const unsigned int g = lane + 32 * i;
        // The granules around valid bytes never leave their pages: whole granules, never past them.
        if (g < granules) he::cp_async16(buf + 16 * g, src + g, true);
    }
}

// One unit (32 values) at batch 1: the quants dotted with x per half, then scaled, and for formats with
// offsets the offsets times the block's shared sums of x added: one FMA per value, none for the scales.
template <typename F, bool GLU>
__device__ __forceinline__ void unit_dot1(const unsigned char *block, const unsigned char *block2, unsigned int u,
                                          const float *xc, const float *xsums, float &acc, float &acc2) {
    float q[he::UNIT_VALUES], scale[2], add[2], q2[he::UNIT_VALUES], scale2[2], add2[2];
    F::parts(block, u, q, scale, add);
    if (GLU) F::parts(block2, u, q2, scale2, add2);
    float dot[2] = {0.f, 0.f}, dot2[2] = {0.f, 0.f};
#pragma unroll
    for (int i4 = 0; i4 < (int)he::UNIT_VALUES / 4; i4++) {
        const float4 xv = __ldg(reinterpret_cast<const float4 *>(xc) + i4);
        const float xf[4] = {xv.x, xv.y, xv.z, xv.w};
        const int h = i4 / 4;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            dot[h] = fmaf(q[4 * i4 + e], xf[e], dot[h]);
            if (GLU) dot2[h] = fmaf(q2[4 * i4 + e], xf[e], dot2[h]);
        }
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        acc = fmaf(scale[h], dot[h], acc);
        if (GLU) acc2 = fmaf(scale2[h], dot2[h], acc2);
        if (F::HAS_MIN) {
            acc = fmaf(add[h], xsums[h], acc);
            if (GLU) acc2 = fmaf(add2[h], xsums[h], acc2);
        }
    }
}

// The staged product's body for a block format F: a warp's stretches part, part + split, ... of its row,
// each decoded a unit per lane step.
template <typename F, int T, bool GLU>
__global__ __launch_bounds__(MV_THREADS, 2) void matvec_staged_kernel(
    const unsigned char *__restrict__ w, const unsigned char *__restrict__ w2, unsigned int rows, unsigned int cols,
    unsigned int split, const float *__restrict__ x, unsigned int nt, const float *bias, const float *residual,
    float *y, unsigned int ldy) {
    constexpr bool XSUMS = T == 1 && F::HAS_MIN;
    using S = Staging<F, GLU, XSUMS>;
    constexpr unsigned WEIGHTS = S::WEIGHTS;
    __shared__ __align__(16) unsigned char stage[MV_WARPS][2][WEIGHTS][S::BUFFER_BYTES];
    __shared__ float xsum[XSUMS ? MV_XSUM_GROUPS : 1];
    const RowPart rp = row_part(rows, split);
    const unsigned int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float acc[T], acc2[T];
#pragma unroll
    for (int t = 0; t < T; t++) acc[t] = acc2[t] = 0.f;

    if (XSUMS) {  // the launcher sends wider rows to the T = 2 instantiation
        for (unsigned int g = threadIdx.x; g < cols / 16; g += MV_THREADS) {
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float4 v = __ldg(reinterpret_cast<const float4 *>(x + 16 * (size_t)g) + i);
                s += (v.x + v.y) + (v.z + v.w);
            }
            xsum[g] = s;
        }
        __syncthreads();
    }

    if (rp.valid) {
        const unsigned int nblocks = cols / F::BLOCK_VALUES;
        const size_t row_bytes = (size_t)nblocks * F::BLOCK_BYTES;
        const unsigned char *wr = w + rp.row * row_bytes;
        const unsigned char *wr2 = GLU ? w2 + rp.row * row_bytes : nullptr;
        const unsigned int nstretches = (nblocks + S::STRETCH_BLOCKS - 1) / S::STRETCH_BLOCKS;
        auto stage_stretch = [&](unsigned int s, unsigned int buffer) {
            const unsigned int b0 = s * S::STRETCH_BLOCKS;
            const size_t first = (size_t)b0 * F::BLOCK_BYTES;
            const size_t bytes = (size_t)min(S::STRETCH_BLOCKS, nblocks - b0) * F::BLOCK_BYTES;
            stage_blocks<S::LOADS>(wr, first, bytes, stage[warp][buffer][0], lane);
            if (GLU) stage_blocks<S::LOADS>(wr2, first, bytes, stage[warp][buffer][WEIGHTS - 1], lane);
        };
        unsigned int s = rp.part;
        if (s < nstretches) stage_stretch(s, 0);
        he::cp_async_commit();
        for (unsigned int i = 0; s < nstretches; s += split, i ^= 1) {
            if (s + split < nstretches) stage_stretch(s + split, i ^ 1);
            he::cp_async_commit();
            he::cp_async_wait<1>();  // this lane's copies of stretch s are in
            __syncwarp();            // and so are every other lane's

            const unsigned int b0 = s * S::STRETCH_BLOCKS;
            const unsigned int units = min(S::STRETCH_BLOCKS, nblocks - b0) * F::UNITS;
            const unsigned int offset =
                (unsigned int)((reinterpret_cast<uintptr_t>(wr) + (size_t)b0 * F::BLOCK_BYTES) & 15);
            const unsigned char *st = stage[warp][i][0] + offset;
            const unsigned char *st2 = stage[warp][i][WEIGHTS - 1] + offset;
            // Unrolled only while the registers of several units' weights and activations fit.
#pragma unroll(T <= 2 ? S::UNIT_STEPS : 1)
            for (unsigned int k = 0; k < S::UNIT_STEPS; k++) {
                const unsigned int unit = lane + 32 * k;
                if (unit >= units) break;
                const unsigned int blk = unit / F::UNITS, u = unit % F::UNITS;
                const size_t col = (size_t)(b0 + blk) * F::BLOCK_VALUES + he::UNIT_VALUES * u;
                if constexpr (T == 1) {
                    unit_dot1<F, GLU>(st + blk * F::BLOCK_BYTES, st2 + blk * F::BLOCK_BYTES, u, x + col,
                                      xsum + col / 16, acc[0], acc2[0]);
                } else {
                    float wv[he::UNIT_VALUES], wv2[he::UNIT_VALUES];
                    he::decode_unit<F>(st + blk * F::BLOCK_BYTES, u, wv);
                    if (GLU) he::decode_unit<F>(st2 + blk * F::BLOCK_BYTES, u, wv2);
#pragma unroll
                    for (int t = 0; t < T; t++) {
                        const float *xt = x + col + (size_t)token_row<T>(t, nt) * cols;
#pragma unroll
                        for (int i4 = 0; i4 < (int)he::UNIT_VALUES / 4; i4++) {
                            const float4 xv = __ldg(reinterpret_cast<const float4 *>(xt) + i4);
                            const float xf[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
                            for (int e = 0; e < 4; e++) {
                                acc[t] = fmaf(wv[4 * i4 + e], xf[e], acc[t]);
                                if (GLU) acc2[t] = fmaf(wv2[4 * i4 + e], xf[e], acc2[t]);
                            }
                        }
                    }
                }
            }
            __syncwarp();  // every lane is done with buffer i before the next step's copies refill it
        }
        he::cp_async_wait<0>();
    }
    finish_row<T, GLU>(acc, acc2, rp, split, nt, bias, residual, y, ldy);
}

bool aligned(const void *p, uintptr_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; }

// Warps per row: enough warps in all to keep ~48 per SM of a 132-SM card busy when rows are few.
unsigned int split_for(unsigned int rows) { return rows >= 6144 ? 1 : rows >= 3072 ? 2 : rows >= 1536 ? 4 : 8; }

// The chunked kernel for F, or the staged one for Staged<F>.
template <typename F>
struct Staged {};
template <typename F>
struct KernelOf {
    template <int T, bool GLU>
    static constexpr auto get() { return matvec_kernel<F, T, GLU>; }
};
template <typename F>
struct KernelOf<Staged<F>> {
    template <int T, bool GLU>
    static constexpr auto get() { return matvec_staged_kernel<F, T, GLU>; }
};

// Whether the batch-1 instantiation takes rows of `cols`: a format with offsets needs its sums table.
template <typename K>
struct Batch1 {
    static bool fits(unsigned int) { return true; }
};
template <typename F>
struct Batch1<Staged<F>> {
    static bool fits(unsigned int cols) { return !F::HAS_MIN || cols / 16 <= MV_XSUM_GROUPS; }
};

// Warps per row for kernel K: the staged kernel gives a row no more warps than it has stretches.
template <typename K>
struct SplitOf {
    template <int T, bool GLU>
    static unsigned int of(unsigned int split, unsigned int) { return split; }
};
template <typename F>
struct SplitOf<Staged<F>> {
    template <int T, bool GLU>
    static unsigned int of(unsigned int split, unsigned int cols) {
        using S = Staging<F, GLU, T == 1 && F::HAS_MIN>;
        const unsigned int stretches = (cols / F::BLOCK_VALUES + S::STRETCH_BLOCKS - 1) / S::STRETCH_BLOCKS;
        while (split > 1 && split > stretches) split /= 2;
        return split;
    }
};

template <typename K, int T, bool GLU>
void launch_tile(const unsigned char *w, const unsigned char *w2, unsigned int rows, unsigned int cols,
                 unsigned int split, const float *x, unsigned int nt, const float *bias, const float *residual,
                 float *y, unsigned int ldy, cudaStream_t stream) {
    split = SplitOf<K>::template of<T, GLU>(split, cols);
    const unsigned int per_block = MV_WARPS / split;
    const unsigned int grid = (rows + per_block - 1) / per_block;
    KernelOf<K>::template get<T, GLU>()<<<grid, MV_THREADS, 0, stream>>>(w, w2, rows, cols, split, x, nt, bias,
                                                                        residual, y, ldy);
}

// Up to MV_MAX_TOKENS tokens a launch, each launch instantiated for the next power of two of its tokens.
template <typename F, bool GLU>
cudaError_t launch_tiles(const unsigned char *w, const unsigned char *w2, unsigned int rows, unsigned int cols,
                         const float *x, unsigned int n, const float *bias, const float *residual, float *y,
                         unsigned int ldy, cudaStream_t stream) {
    const unsigned int split = split_for(rows);
    for (unsigned int t0 = 0; t0 < n; t0 += MV_MAX_TOKENS) {
        const unsigned int nt = n - t0 < MV_MAX_TOKENS ? n - t0 : MV_MAX_TOKENS;
        const float *xt = x + (size_t)t0 * cols;
        const float *rt = residual != nullptr ? residual + (size_t)t0 * ldy : nullptr;
        float *yt = y + (size_t)t0 * ldy;
        if (nt == 1 && Batch1<F>::fits(cols))
            launch_tile<F, 1, GLU>(w, w2, rows, cols, split, xt, nt, bias, rt, yt, ldy, stream);
        else if (nt <= 2)
            launch_tile<F, 2, GLU>(w, w2, rows, cols, split, xt, nt, bias, rt, yt, ldy, stream);
        else if (nt <= 4)
            launch_tile<F, 4, GLU>(w, w2, rows, cols, split, xt, nt, bias, rt, yt, ldy, stream);
        else
            launch_tile<F, 8, GLU>(w, w2, rows, cols, split, xt, nt, bias, rt, yt, ldy, stream);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
}

template <bool GLU>
cudaError_t launch_matvec(const void *w, const void *w2, int dtype, unsigned int rows, unsigned int cols,
                          const float *x, unsigned int n, const float *bias, const float *residual, float *y,
                          unsigned int ldy, cudaStream_t stream) {
    if (w == nullptr || (GLU && w2 == nullptr) || x == nullptr || y == nullptr) return cudaErrorInvalidValue;
    if (rows == 0 || cols == 0 || ldy < rows) return cudaErrorInvalidValue;
    const unsigned char *wb = static_cast<const unsigned char *>(w);
    const unsigned char *wb2 = static_cast<const unsigned char *>(w2);
    cudaError_t err = cudaErrorInvalidValue;
    he::with_format(dtype, [&](auto format) {
        using F = decltype(format);
        if (he::row_bytes<F>(cols) == 0) return;
        // A block format's fields sit at 4-byte boundaries in every block when its block is a multiple of 4.
        constexpr uintptr_t field_align = F::BLOCK_BYTES % 4 == 0 ? 4 : 2;
        if (n == 0) {
            err = cudaSuccess;
        } else if constexpr (he::HasUnits<F>::value && !he::HasChunks<F>::value) {
            if (aligned(w, field_align) && (!GLU || aligned(w2, field_align)) && aligned(x, 16))
                err = launch_tiles<Staged<F>, GLU>(wb, wb2, rows, cols, x, n, bias, residual, y, ldy, stream);
            else
                err = launch_tiles<he::ByValue<F>, GLU>(wb, wb2, rows, cols, x, n, bias, residual, y, ldy, stream);
        } else if (F::chunks_fit(w, cols) && (!GLU || F::chunks_fit(w2, cols)) && aligned(x, 16)) {
            err = launch_tiles<F, GLU>(wb, wb2, rows, cols, x, n, bias, residual, y, ldy, stream);
        } else {
            // Odd shapes and alignments, one value per lane at a time: correct, not fast.
            err = launch_tiles<he::ByValue<F>, GLU>(wb, wb2, rows, cols, x, n, bias, residual, y, ldy, stream);
        }
    });
    return err;
}

}  // namespace

extern "C" cudaError_t hostembed_matvec(const void *w, int dtype, unsigned int rows, unsigned int cols,
                                        const float *x, unsigned int n, const float *bias, const float *residual,
                                        float *y, unsigned int ldy, cudaStream_t stream) {
    return launch_matvec<false>(w, nullptr, dtype, rows, cols, x, n, bias, residual, y, ldy, stream);
}

extern "C" cudaError_t hostembed_matvec_swiglu(const void *w_gate, const void *w_up, int dtype, unsigned int rows,
                                               unsigned int cols, const float *x, unsigned int n, float *y,
                                               cudaStream_t stream) {
    return launch_matvec<true>(w_gate, w_up, dtype, rows, cols, x, n, nullptr, nullptr, y, rows, stream);
}
