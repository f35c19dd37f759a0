// What the decode products' kernels share (kernels/mmv_readers.cuh says the design): the staging
// budget, the write-out, the warp's rows, weights through shared memory, the activations' staged
// layouts, and the launchers each kernel file defines for the others.
#pragma once
#include "mmv_readers.cuh"

namespace {

// ---- shared by every kernel ----

// Bytes of shared memory the staged activations may take (the rest of a multiprocessor's goes to more
// blocks); a chunk is at least MMV_KC columns whatever the token count. The BF16 kernel's is a knob.
constexpr unsigned MMV_STAGE_BUDGET = 32 * 1024;
#ifndef MMV_BF16_STAGE_BUDGET
#define MMV_BF16_STAGE_BUDGET (32 * 1024)
#endif

// Columns staged at a time for n tokens of `bytes_per_col` each: as many whole `unit` pieces (a multiple
// of MMV_KC) of the column range as the budget takes, or the whole range.
__host__ __device__ constexpr unsigned int mmv_chunk(unsigned int n, unsigned int kr, unsigned int bytes_per_col,
                                                  unsigned int unit, unsigned int budget = MMV_STAGE_BUDGET) {
    unsigned int k = budget / (n * bytes_per_col) / unit * unit;
    k = k < unit ? unit : k;
    return k < kr ? k : kr;
}

// A lane's results to y: each(fn) calls fn(tok, va, vb) for every token the lane holds, va of its row a
// and vb of row b (GLU: the gate and up sums of output row a). One column range: the epilogue straight
// to y; several: the partial sums, and the last block of the row range to arrive adds them in split
// order and applies the epilogue.
// `mmv_write_rows` writes token tok to row out_row(tok) of y and of the split sums (which have partial_n
// rows a split), and returns whether this block wrote the final outputs of its rows (one column range, or
// the last block of the row range), the same in every thread; mmv_write is the products of tokens [0, n),
// each token its own row.
template <bool GLU, typename Each, typename OutRow>
__device__ __forceinline__ bool mmv_write_rows(const MmvShape &shape, unsigned int n, unsigned int partial_n,
                                               OutRow &&out_row, unsigned int rows, unsigned int row_a,
                                               unsigned int row_b, const float *bias, const float *residual, float *y,
                                               unsigned int ldy, float *partial, unsigned int *counters, Each &&each) {
    auto finish = [&](unsigned int tok, unsigned int r, float v, float v2) {
        const size_t at = (size_t)out_row(tok) * ldy + r;
        if (GLU) {
            y[at] = he::silu(v) * v2;
        } else {
            if (bias != nullptr) v += bias[r];
            if (residual != nullptr) v += residual[at];
            y[at] = v;
        }
    };
    if (shape.splits == 1) {
        each([&](unsigned int tok, float va, float vb) {
            if (GLU) {
                if (row_a < rows) finish(tok, row_a, va, vb);
            } else {
                if (row_a < rows) finish(tok, row_a, va, 0.f);
                if (row_b < rows) finish(tok, row_b, vb, 0.f);
            }
        });
        return true;
    }

    // Split: partial[((split * parts + part) * n + tok) * rows + row], parts 2 for GLU (gate, up).
    constexpr unsigned PARTS = GLU ? 2 : 1;
    auto slot = [&](unsigned int split, unsigned int part, unsigned int tok, unsigned int r) {
        return partial + ((size_t)(split * PARTS + part) * partial_n + out_row(tok)) * rows + r;
    };
    each([&](unsigned int tok, float va, float vb) {
        if (row_a < rows) *slot(blockIdx.y, 0, tok, row_a) = va;
        if (row_b < rows) *slot(blockIdx.y, GLU ? 1 : 0, tok, row_b) = vb;
    });
    __threadfence();
    __syncthreads();
    __shared__ unsigned int last;
    const unsigned int tid = threadIdx.x;
    if (tid == 0) last = atomicAdd(&counters[blockIdx.x], 1u) == shape.splits - 1;
    __syncthreads();
    if (!last) return false;
    __threadfence();  // the other blocks' partial sums are visible from here on
    const unsigned int first = GLU ? blockIdx.x * (MMV_BLOCK_ROWS / 2) : blockIdx.x * MMV_BLOCK_ROWS;
    const unsigned int block_rows = min(GLU ? MMV_BLOCK_ROWS / 2 : MMV_BLOCK_ROWS, rows - first);
    for (unsigned int i = tid; i < n * block_rows; i += blockDim.x) {  // the tile kernel may have more threads
        const unsigned int tok = i / block_rows, r = first + i % block_rows;
        // Every split's load in flight at once, then the sum in split order.
        float v[MMV_MAX_SPLITS], v2[MMV_MAX_SPLITS];
#pragma unroll
        for (unsigned int s = 0; s < MMV_MAX_SPLITS; s++) {
            v[s] = s < shape.splits ? __ldcg(slot(s, 0, tok, r)) : 0.f;
            v2[s] = GLU && s < shape.splits ? __ldcg(slot(s, 1, tok, r)) : 0.f;
        }
        float sum = 0.f, sum2 = 0.f;
#pragma unroll
        for (unsigned int s = 0; s < MMV_MAX_SPLITS; s++) {
            if (s < shape.splits) sum += v[s], sum2 += v2[s];
        }
        finish(tok, r, sum, sum2);
    }
    if (tid == 0) counters[blockIdx.x] = 0;  // ready for the next launch
    return true;
}
template <bool GLU, typename Each>
__device__ __forceinline__ void mmv_write(const MmvShape &shape, unsigned int n, unsigned int rows, unsigned int row_a,
                                          unsigned int row_b, const float *bias, const float *residual, float *y,
                                          unsigned int ldy, float *partial, unsigned int *counters, Each &&each) {
    mmv_write_rows<GLU>(shape, n, n, [](unsigned int tok) { return tok; }, rows, row_a, row_b, bias, residual, y, ldy,
                        partial, counters, each);
}

// The first of the warp's rows: of its 16 rows, or (GLU) of its 8 gate and 8 up rows.
template <bool GLU>
__device__ __forceinline__ unsigned int mmv_warp_row(unsigned int warp) {
    return GLU ? blockIdx.x * (MMV_BLOCK_ROWS / 2) + warp * 8 : blockIdx.x * MMV_BLOCK_ROWS + warp * 16;
}

// The warp's A rows: g and g + 8 of its 16 (GLU: gate row g and up row g of its 8). Rows past the matrix
// read its last row (never written out), so the loads need no tests.
struct MmvRows {
    unsigned int a, b;
    const unsigned char *wa, *wb;
};
template <bool GLU>
__device__ __forceinline__ MmvRows mmv_rows(const unsigned char *w, const unsigned char *w2, unsigned int rows,
                                            size_t row_bytes, unsigned int warp, unsigned int g) {
    const unsigned int base = mmv_warp_row<GLU>(warp);
    MmvRows r;
    r.a = base + g;
    r.b = GLU ? base + g : base + g + 8;
    r.wa = w + (size_t)min(r.a, rows - 1) * row_bytes;
    r.wb = (GLU ? w2 : w) + (size_t)min(r.b, rows - 1) * row_bytes;
    return r;
}

// The warp's two rows' raw weights of the UNROLL steps of the column group at `col` (steps past k_end
// left as they are): the streamed half kernels' loads.
template <typename R, unsigned UNROLL>
__device__ __forceinline__ void fetch_rows(typename R::Raw (&r)[UNROLL][2], const unsigned char *const (&wr)[2],
                                           unsigned int col, unsigned int k_end, unsigned int t) {
#pragma unroll
    for (int u = 0; u < (int)UNROLL; u++)
        if (col + u * R::STEP < k_end) {
            R::template fetch<false>(r[u][0], wr[0], col + u * R::STEP, t);
            R::template fetch<false>(r[u][1], wr[1], col + u * R::STEP, t);
        }
}

// A half kernel's results: lane (g, t) holds tokens 8j + 2t (+ 1) of rows a (acc[j][0], [1]) and b
// ([2], [3]), written out as mmv_write says.
template <bool GLU, int NT>
__device__ __forceinline__ void mmv_write_tiles(const MmvShape &shape, unsigned int n, unsigned int rows, const MmvRows &rw,
                                                const float *bias, const float *residual, float *y, unsigned int ldy,
                                                float *partial, unsigned int *counters, const float (&acc)[NT][4],
                                                unsigned int t) {
    mmv_write<GLU>(shape, n, rows, rw.a, rw.b, bias, residual, y, ldy, partial, counters, [&](auto &&fn) {
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const unsigned int tok = 8 * j + 2 * t + e;
                if (tok < n) fn(tok, acc[j][e], acc[j][2 + e]);
            }
    });
}

// The weights stream one column group ahead of the arithmetic; the chunk of activations column `col`
// enters is staged (between two barriers every warp of the block reaches together) when the group
// enters it. Returns the chunk's first column.
template <typename Stage>
__device__ __forceinline__ unsigned int enter_chunk(unsigned int col, unsigned int k_begin, unsigned int k_end,
                                                    unsigned int kch, unsigned int &staged, Stage &&stage) {
    const unsigned int chunk = (col - k_begin) / kch, c0 = k_begin + chunk * kch;
    if (chunk != staged) {
        __syncthreads();
        stage(c0, min(kch, k_end - c0));
        __syncthreads();
        staged = chunk;
    }
    return c0;
}

// ---- weights through shared memory (the staged kernels) ----
// A warp copies its 16 weight rows' bytes of a column group (the aligned 16-byte chunks that hold them,
// so a 2-byte aligned block format copies as well as any) into its own slots with cp.async, STAGES - 1
// groups ahead of the arithmetic: the loads in flight hold no registers, and the lane readers then take
// their narrow or misaligned pieces from shared memory, where they cost one request a warp instead of
// one per row touched (what bounds the formats whose blocks are 2-byte aligned when read from memory).
template <typename R, unsigned GROUP>
struct WeightSlots {
    static constexpr unsigned BYTES = GROUP / R::BLOCK_COLS * R::BYTES;  // a row's bytes of a group
    static constexpr unsigned CHUNKS = (BYTES + 16 - R::ALIGN + 15) / 16;  // any start the alignment allows
    // A row's stride: the chunks, then padding to the next stride the reader's pattern reads without
    // bank conflicts (`bank_ok` of the stride in 4-byte words).
    static constexpr unsigned row_stride() {
        unsigned pad = 0;
        while (!R::bank_ok((CHUNKS * 4 + pad) % 32)) pad += 4;
        return CHUNKS * 16 + pad * 4;
    }
    static constexpr unsigned ROW = row_stride();
    static constexpr unsigned SLOT = 16 * ROW;
    // Three slots where a block's eight warps' take at most 78 KiB (two blocks a multiprocessor with the
    // staged activations beside them), else two.
    static constexpr unsigned STAGES = 3 * SLOT * MMV_WARPS <= 78 * 1024 ? 3 : 2;
    static constexpr unsigned WARP_BYTES = STAGES * SLOT;
    static constexpr unsigned BLOCK_BYTES = MMV_WARPS * WARP_BYTES;
};

// Issues the copies of the warp's rows' bytes [start, start + len) into `slot` (row i of the warp at
// i * ROW, its first byte at the offset its address has in a 16-byte chunk); rows as mmv_rows names them.
template <typename WS, bool GLU>
__device__ __forceinline__ void copy_rows(unsigned char *slot, const unsigned char *w, const unsigned char *w2,
                                          unsigned int rows, size_t row_bytes, unsigned int warp, unsigned int lane,
                                          size_t start, unsigned int len) {
    const unsigned int base = mmv_warp_row<GLU>(warp);
#pragma unroll
    for (unsigned int j = 0; j < (16 * WS::CHUNKS + 31) / 32; j++) {
        const unsigned int idx = lane + 32 * j, i = idx / WS::CHUNKS, c = idx % WS::CHUNKS;
        const unsigned int r = GLU ? base + i % 8 : base + i;
        const unsigned char *p = (GLU && i >= 8 ? w2 : w) + (size_t)min(r, rows - 1) * row_bytes + start;
        const unsigned char *src =
            reinterpret_cast<const unsigned char *>(reinterpret_cast<uintptr_t>(p) & ~(uintptr_t)15) + 16 * c;
        // A chunk holding a byte of the range lies in the same mapped page as that byte.
        if (idx < 16 * WS::CHUNKS && src < p + len) he::cp_async16(slot + i * WS::ROW + 16 * c, src, true);
    }
}

// The staged weights of a launch: a warp's slots, its groups, and the shared-memory view of its rows.
template <typename R, unsigned GROUP, bool GLU>
struct WeightStage {
    using WS = WeightSlots<R, GROUP>;
    unsigned char *slots;
    const unsigned char *w, *w2;
    unsigned int rows, warp, lane, k_begin, k_end, groups;
    size_t row_bytes;

    __device__ __forceinline__ size_t start_of(unsigned int gi) const {
        return (size_t)((k_begin + gi * GROUP) / R::BLOCK_COLS) * R::BYTES;
    }
    // Copies of group gi (if there is one) into its slot, then a commit (every call commits one group, so
    // the waits count groups).
    __device__ __forceinline__ void issue(unsigned int gi) const {
        if (gi < groups) {
            const unsigned int col = k_begin + gi * GROUP;
            const unsigned int len = (min(col + GROUP, k_end) - col) / R::BLOCK_COLS * R::BYTES;
            copy_rows<WS, GLU>(slots + (gi % WS::STAGES) * WS::SLOT, w, w2, rows, row_bytes, warp, lane, start_of(gi),
                               len);
        }
        he::cp_async_commit();
    }
    __device__ __forceinline__ void begin() const {
#pragma unroll
        for (unsigned int s = 0; s + 1 < WS::STAGES; s++) issue(s);
    }
    // Group gi's copies by every lane of the warp are in its slot (the slot of gi - 1 is free: the warp
    // left it at the __syncwarp that ended its arithmetic), with the copies of gi + STAGES - 1 in flight.
    __device__ __forceinline__ void wait(unsigned int gi) const {
        issue(gi + WS::STAGES - 1);
        he::cp_async_wait<WS::STAGES - 1>();
        __syncwarp();
    }
    // Row i of the warp in group gi's slot, where `row` (its address in memory) starts; columns from the
    // group's first.
    __device__ __forceinline__ const unsigned char *row(unsigned int gi, unsigned int i, const unsigned char *at) const {
        return slots + (gi % WS::STAGES) * WS::SLOT + i * WS::ROW +
               ((reinterpret_cast<uintptr_t>(at) + start_of(gi)) & 15);
    }
};

// The staged kernels' loop over their column groups: each group's weights wait in the warp's slots,
// the lane's raw bits of its tiles (UNROLL tiles of TILE columns) are read from there, and
// compute(r, col, c0) takes them with the activation chunk staged from column c0.
template <typename R, unsigned UNROLL, unsigned TILE, bool GLU, typename Stage, typename Compute>
__device__ __forceinline__ void staged_groups(unsigned char *slots, const unsigned char *w, const unsigned char *w2,
                                              unsigned int rows, size_t row_bytes, const unsigned char *const (&wr)[2],
                                              unsigned int warp, unsigned int lane, unsigned int k_begin,
                                              unsigned int k_end, unsigned int kch, Stage &&stage, Compute &&compute) {
    constexpr unsigned GROUP = UNROLL * TILE;
    const unsigned int g = lane / 4, t = lane % 4;
    const WeightStage<R, GROUP, GLU> ws{slots + warp * WeightSlots<R, GROUP>::WARP_BYTES,
                                        w, w2, rows, warp, lane, k_begin, k_end,
                                        (k_end - k_begin + GROUP - 1) / GROUP, row_bytes};
    ws.begin();
    he::pdl_wait();  // the weights' first groups are in flight; the activations come from the kernel before
    unsigned int staged = ~0u;
    for (unsigned int gi = 0; gi < ws.groups; gi++) {
        const unsigned int col = k_begin + gi * GROUP;
        const unsigned int c0 = enter_chunk(col, k_begin, k_end, kch, staged, stage);
        ws.wait(gi);
        const unsigned char *sa = ws.row(gi, g, wr[0]), *sb = ws.row(gi, 8 + g, wr[1]);
        typename R::Raw r[UNROLL][2];
#pragma unroll
        for (int u = 0; u < (int)UNROLL; u++)
            if (col + u * TILE < k_end) {
                R::template fetch<true>(r[u][0], sa, u * TILE, t);
                R::template fetch<true>(r[u][1], sb, u * TILE, t);
            }
        compute(r, col, c0);
        __syncwarp();
    }
}

// The columns a kernel takes a step of its main loop: its reader's tiles of a group, staged or streamed.
template <typename R, bool STAGED>
__host__ __device__ constexpr unsigned mmv_group() {
    return (STAGED ? R::SUNROLL : R::UNROLL) * R::STEP * R::TILE_STEPS;
}

// Whether a launch of `n` tokens stages its weights: where the reader measured faster so (its
// STAGE_TOKENS), or as hostembed_tuning's mmv_stage says, to measure. Both ways give the same bits: only
// where the weights wait differs.
template <typename R>
bool mmv_staged(const hostembed_tuning &tuning, unsigned int n) {
    return tuning.mmv_stage == HE_MMV_STAGE_ALWAYS || (tuning.mmv_stage != HE_MMV_STAGE_NEVER && n <= R::STAGE_TOKENS);
}

// ---- the half kernels' staged activations (mmv_half.cu; stage_unit the integer kernels' too) ----

// One token's staged row of `kch` columns: groups of 4 columns, hi[4] then lo[4] (16 bytes), then padding
// that puts a quarter warp's 16-byte reads (tokens g and g + 1, lanes t = 0..3) in distinct banks.
__host__ __device__ constexpr unsigned mmv_stride(unsigned kch) { return kch / 4 * 16 + 16; }
// The staged activations' bytes: the rows, then (scaled readers) each token's group exponents, rounded up
// so that the weight slots after them are 16-byte aligned.
__host__ __device__ constexpr unsigned mmv_act_bytes(unsigned n, unsigned kch, bool scaled) {
    return (n * mmv_stride(kch) + (scaled ? n * (kch / MMV_KC) * 4 : 0) + 15) / 16 * 16;
}
// The exponent e of a scaled group (see MmaF16) whose max|x| is `amax`: amax 2^e in [2^14, 2^15), within
// [-64, 64] so that neither the staged values nor the scaled accumulators leave their ranges.
__device__ __forceinline__ int mmv_group_exponent(float amax) {
    const int biased = (int)((__float_as_uint(amax) >> 23) & 0xFFu);  // floor(log2 amax) + 127 (normal amax)
    return biased == 0 ? 64 : max(-64, min(64, 14 - (biased - 127)));
}
// A warp staging a token's 256-column group: the lane's 8 columns from 8e of the chunk at c0 (zeros where
// not `here`, past a short last group), and the group's max|x| over the warp.
__device__ __forceinline__ float stage_unit_row(const float *row, unsigned int c0, unsigned int e, bool here,
                                                float (&f)[8]) {
    if (here) {
        const float4 *xp = reinterpret_cast<const float4 *>(row + c0 + 8 * e);
        const float4 p = __ldg(xp), q = __ldg(xp + 1);
        f[0] = p.x, f[1] = p.y, f[2] = p.z, f[3] = p.w, f[4] = q.x, f[5] = q.y, f[6] = q.z, f[7] = q.w;
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++) f[k] = 0.f;
    }
    float amax = 0.f;
#pragma unroll
    for (int k = 0; k < 8; k++) amax = fmaxf(amax, fabsf(f[k]));
#pragma unroll
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    return amax;
}
// stage_unit_row of token tok's row of x (rows `cols` apart).
__device__ __forceinline__ float stage_unit(const float *x, unsigned int tok, unsigned int cols, unsigned int c0,
                                            unsigned int e, bool here, float (&f)[8]) {
    return stage_unit_row(x + (size_t)tok * cols, c0, e, here, f);
}
// 2^e for e in [-126, 127].
__device__ __forceinline__ float mmv_pow2(int e) { return __uint_as_float((unsigned int)(e + 127) << 23); }

// Four columns as a half kernel stages them: hi[4] then lo[4], each pair packed. Plain (BF16): hi = bf16
// rn(x); scaled (F16): the reader's rn(x 2^e) of the group's exponent.
template <typename Op>
__device__ __forceinline__ uint4 mmv_quad_plain(const float *f) {
    float hi[4], lo[4];
#pragma unroll
    for (int e = 0; e < 4; e++) {
        hi[e] = __bfloat162float(__float2bfloat16_rn(f[e]));
        lo[e] = f[e] - hi[e];
    }
    return make_uint4(Op::pack(hi[0], hi[1]), Op::pack(hi[2], hi[3]), Op::pack(lo[0], lo[1]), Op::pack(lo[2], lo[3]));
}
template <typename Op>
__device__ __forceinline__ uint4 mmv_quad_scaled(const float *f, float scale) {
    float hi[4], lo[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float v = f[k] * scale;
        hi[k] = Op::unpack(Op::pack(v, 0.f));
        lo[k] = v - hi[k];
    }
    return make_uint4(Op::pack(hi[0], hi[1]), Op::pack(hi[2], hi[3]), Op::pack(lo[0], lo[1]), Op::pack(lo[2], lo[3]));
}

// ---- activations staged once a product (launches of more than MMV_PREP_AFTER tokens) ----
// Every row block of a product stages the same activations; past a few tokens, converting them in each
// block (a dependent global load and a warp's max a unit, repeated by 32-112 row blocks) cost more than the
// tensor cores' work. A launch of more tokens converts them once into the workspace, after the split
// sums: each token's row as the blocks' shared memory holds it (per 4 columns hi[4], lo[4]), then
// (scaled readers) each token's exponent a 256-column group; the blocks copy chunks of it with cp.async a
// chunk ahead of the arithmetic. Same values, so the same bits, as converting in the block.
constexpr unsigned MMV_PREP_AFTER = 8;

// Floats of the split sums of a launch of `n` tokens, rounded up to 16 bytes: where the staged rows start.
__host__ __device__ inline size_t mmv_prep_offset(const MmvShape &s, bool glu, unsigned int n, unsigned int rows) {
    const size_t sums = s.splits > 1 ? (size_t)s.splits * (glu ? 2 : 1) * n * rows : 0;
    return (sums + 3) / 4 * 4;
}
// Floats of the staged rows and exponents of `n` tokens.
__host__ __device__ inline size_t mmv_prep_floats(unsigned int n, unsigned int cols) {
    return (size_t)n * cols + (size_t)n * ((cols + MMV_KC - 1) / MMV_KC);
}

// PREP launches stage chunks of one width for a tile count (NT tiles of 8 tokens) and rows for all its
// tokens, absent ones too (never copied, never written out): a tile's rows then sit at offsets known when
// compiling, where computing each tile's address from the token count was most of the loop's instructions.
__host__ __device__ constexpr unsigned mmv_prep_chunk(unsigned nt, unsigned group) {
    return mmv_chunk(nt * 8, ~0u, 4, group, MMV_BF16_STAGE_BUDGET);
}
// Scaled PREP launches keep every exponent of their column range in shared memory, a group's tokens side by
// side (a lane's two tokens one 8-byte read, a tile's at a known offset): read from global memory, each took
// a 64-bit address of its own, twice a group.
__host__ __device__ constexpr unsigned mmv_prep_exponent_bytes(unsigned nt, unsigned kr) {
    return (kr + MMV_KC - 1) / MMV_KC * nt * 8 * 4;
}
// The tile count a PREP launch of `n` tokens takes (launch_half's choice).
__host__ __device__ constexpr unsigned mmv_prep_tiles(unsigned n) { return n <= 16 ? 2 : n <= 32 ? 4 : 8; }

// The staged activations' bytes of a launch: one chunk converted in the block, or (PREP) two copied.
__host__ __device__ inline unsigned int mmv_half_smem(unsigned int n, unsigned int kr, unsigned int group, bool scaled,
                                                      bool prep) {
    if (!prep) return mmv_act_bytes(n, mmv_chunk(n, kr, 4, MMV_KC, MMV_BF16_STAGE_BUDGET), scaled);
    const unsigned nt = mmv_prep_tiles(n);
    return 2 * mmv_act_bytes(nt * 8, mmv_prep_chunk(nt, group), false) + (scaled ? mmv_prep_exponent_bytes(nt, kr) : 0);
}

// ---- the integer kernels' staged activations (mmv_int.cu, mmv_tile.cu) ----

constexpr int MMVQ_RANGE = 32639;  // the largest |v|: hi = (v + 128) >> 8 stays an int8, lo in [-128, 127]

// One token's staged row of `kch` columns: per 32-column step 32 hi bytes then 32 lo bytes, in column
// order; 64 bytes of padding put the two tokens a half warp reads in distinct banks.
__host__ __device__ constexpr unsigned mmvq_stride(unsigned kch) { return kch * 2 + 64; }

// The rows, each token's group scales and (readers with minimums, min_cols their STEP) its sums of v per
// min_cols columns.
__host__ __device__ constexpr unsigned mmvq_smem_bytes(unsigned n, unsigned kch, unsigned min_cols) {
    return n * mmvq_stride(kch) + n * (kch / MMV_KC) * 4 + (min_cols != 0 ? n * (kch / min_cols) * 4 : 0);
}
// The staged activations' bytes, rounded up so that the weight slots after them are 16-byte aligned.
__host__ __device__ constexpr unsigned mmvq_act_bytes(unsigned n, unsigned kch, unsigned min_cols) {
    return (mmvq_smem_bytes(n, kch, min_cols) + 15) / 16 * 16;
}
// The columns a reader's minimum spans (its step), or 0 for readers without one.
template <typename R>
__host__ __device__ constexpr unsigned mmvq_min_cols() {
    return R::HAS_MIN ? R::STEP : 0;
}
// The unit of staged activation chunks: whole column groups and whole activation groups.
__host__ __device__ constexpr unsigned mmvq_unit(unsigned group) { return group > MMV_KC ? group : MMV_KC; }

// Eight activations as v = rn(x inv) in two bytes, hi and lo (v = 256 hi + lo), four a word: the integer
// products' 16-bit activations (both kernels' conversions). Returns the sum of the eight v.
__device__ __forceinline__ int mmvq_split8(const float (&f)[8], float inv, uint2 &hi, uint2 &lo) {
    unsigned int hw[2] = {0u, 0u}, lw[2] = {0u, 0u};
    int sum = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int v = __float2int_rn(f[k] * inv);
        const int h = (v + 128) >> 8, l = v - 256 * h;
        hw[k / 4] |= ((unsigned int)h & 0xFFu) << (8 * (k % 4));
        lw[k / 4] |= ((unsigned int)l & 0xFFu) << (8 * (k % 4));
        sum += v;
    }
    hi = make_uint2(hw[0], hw[1]);
    lo = make_uint2(lw[0], lw[1]);
    return sum;
}

}  // namespace

// ---- the launchers each kernel file defines (named: called from the other files) ----

namespace he::mmv {

// One product as hostembed_mmv takes it (w2: a GLU launch's up rows), with its format's row bytes.
struct Args {
    int dtype;
    const unsigned char *w, *w2;
    unsigned int rows, cols;
    size_t row_bytes;
    const float *x;
    unsigned int n;
    const float *bias, *residual;
    float *y;
    unsigned int ldy;
    float *partial;
    unsigned int *counters;
    hostembed_tuning tuning;
    cudaStream_t stream;
};

// kernels/mmv_half.cu: BF16 and F16 weights.
cudaError_t half(bool glu, const Args &a);
// kernels/mmv_int.cu: the block formats (16 tokens a launch, or the tile kernel past 8 where it fits).
cudaError_t integer(bool glu, const Args &a);
// kernels/mmv_tile.cu: a block format's launch of MMV_PREP_AFTER < n <= MMV_MAX_TOKENS tokens on the tile
// kernel, and whether the card's shared memory takes it.
cudaError_t tile(bool glu, const Args &a);
bool tile_fits(int dtype, unsigned int n);
// kernels/mmv_wg.cu: a half format's launch of MMV_PREP_AFTER < n <= MMV_MAX_TOKENS tokens on the
// warpgroup products, and whether the card (sm_90) and the tuning take it.
cudaError_t warpgroup(bool glu, const Args &a);
bool warpgroup_ready(const hostembed_tuning &tuning);

}  // namespace he::mmv

namespace {

// Whether the tensor-core decode product takes this format and shape: a lane reader, whole tiles of
// columns, rows whose blocks keep the reader's alignment, and at least a column range per split.
template <typename R>
bool mmv_fits(int dtype, const void *w, unsigned int cols) {
    bool ok = false;
    he::with_format(dtype, [&](auto format) {
        using F = decltype(format);
        const size_t rb = he::row_bytes<F>(cols);
        unsigned int tile = R::STEP;
        if constexpr (R::INT) tile = R::STEP * R::TILE_STEPS;
        ok = rb != 0 && cols % tile == 0 && cols % 8 == 0 && rb % R::ALIGN == 0 &&
             reinterpret_cast<uintptr_t>(w) % R::ALIGN == 0;
    });
    return ok;
}

// Tokens [t0, t0 + nt) of `a` as a product of their own: their activations, residual rows and outputs.
inline he::mmv::Args tokens_of(const he::mmv::Args &a, unsigned int t0, unsigned int nt) {
    he::mmv::Args part = a;
    part.x = a.x + (size_t)t0 * a.cols;
    part.n = nt;
    part.residual = a.residual != nullptr ? a.residual + (size_t)t0 * a.ldy : nullptr;
    part.y = a.y + (size_t)t0 * a.ldy;
    return part;
}

// One launch of a streamed or staged product kernel for `part` (tokens_of's), on `grid` with `smem` bytes
// of shared memory.
template <typename Kernel>
cudaError_t launch_tokens(Kernel kernel, dim3 grid, int smem, const he::mmv::Args &part) {
    const cudaError_t e = he::allow_smem(kernel, smem);
    if (e != cudaSuccess) return e;
    return he::launch_overlapped(part.tuning, kernel, grid, dim3(MMV_THREADS), (size_t)smem, part.stream, part.w,
                                 part.w2, part.rows, part.cols, part.row_bytes, part.x, part.n, part.bias,
                                 part.residual, part.y, part.ldy, part.partial, part.counters);
}

// Calls fn(R{}, glu, staged) (std::bool_constant flags) for the reader of a.dtype when its kind is INT,
// staged where mmv_staged says (formats that never stage by default have their staged kernels in
// tuning builds only); cudaErrorNotSupported for the other readers and formats.
template <bool INT, typename Fn>
cudaError_t with_launch(bool glu, const he::mmv::Args &a, Fn &&fn) {
    cudaError_t err = cudaErrorNotSupported;
    with_reader(a.dtype, [&](auto reader) {
        using R = decltype(reader);
        if constexpr (R::INT == INT) {
            auto go = [&](auto g) {
                if constexpr (MMV_TUNING_KERNELS || R::STAGE_TOKENS > 0)
                    if (mmv_staged<R>(a.tuning, a.n)) return void(err = fn(reader, g, std::true_type{}));
                err = fn(reader, g, std::false_type{});
            };
            if (glu) go(std::true_type{});
            else go(std::false_type{});
        }
    });
    return err;
}

}  // namespace
