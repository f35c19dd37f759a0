// Causal attention of a prompt chunk over its stream's pages of the KV pool on tensor cores (flash
// attention, FA2 order):
// a block takes 64 query tokens of one head; each of its 4 warps holds 16 queries' Q fragments, scores,
// online-softmax state and output in registers, while 64-position K and V tiles stream through a
// double-buffered pipeline in shared memory. Q K^T and P V are mma.sync m16n8k16 with f32 accumulators, in
// bf16 for a bf16 cache and in f16 for the others (KOp for K's type, VOp for V's); the score fragments
// become P's A fragments without leaving registers. Each row of a tile finds its page through the stream's
// page table. A tile in the operands' own format (bf16, f16) is copied by cp.async; an 8-bit one (Q8_0,
// FP8_E4M3) is loaded into registers while the tile before it computes, then decoded with its block scales
// (kernels/kv.cuh) and stored as f16, unless the chunk's stream was first decoded into a stage (below).
// An F32 cache is not read here: the host gives it to the split kernel, which keeps f32.
//
// The stage: every query block of a chunk reads its kv head's whole context, so an 8-bit tile decoded in
// the kernel is decoded again by each of a chunk's 64-query blocks (128 times for 2,048 queries over 4
// heads a kv head). hostembed_flash_stage decodes a stream's first positions once per chunk into f16 rows,
// the values the kernel's own decode gives; the kernel copies those tiles as it copies a 16-bit cache's
// and decodes in registers only the tiles past the stage.
#include "hostembed_kernels.cuh"
#include "kv.cuh"

namespace {

constexpr int FA_THREADS = 128, FA_BM = 64, FA_BN = 64;
// Scores in log2 units (q pre-scaled by scale * log2(e)): the exponentials are exp2.
constexpr float FA_LOG2E = 1.4426950408889634f;

template <int D>
constexpr int fa_stride() {
    return D + 8;  // padded rows: fragment reads of 8 rows land in distinct banks
}
template <int D>
constexpr int fa_smem() {
    return 2 /* buffers */ * 2 /* K, V */ * FA_BN * fa_stride<D>() * 2;
}

// Eight values of one row of a tile in the operands' own format (bf16, f16), copied into shared memory by
// cp.async; zeros where !ok.
__device__ __forceinline__ void copy_piece(unsigned short *dst, const unsigned char *slab, unsigned int row,
                                           unsigned int c, unsigned int d, bool ok) {
    he::cp_async16(dst, slab + ((size_t)row * d + c) * 2, ok);
}

// Eight values of one row of an 8-bit block type's tile, raw: the codes and their block's scale, loaded
// into registers a tile before they are decoded (a zero scale where !ok).
struct Raw8 {
    uint2 codes;
    float scale;
};
__device__ __forceinline__ Raw8 load_raw8(const unsigned char *slab, unsigned int row, unsigned int c, unsigned int d,
                                          int type, bool ok) {
    Raw8 r{make_uint2(0, 0), 0.f};
    if (ok) {
        r.codes = __ldg(reinterpret_cast<const uint2 *>(slab + (size_t)row * d + c));
        r.scale = type == HE_KV_Q8_0 ? he::kv::block_scale<false>(slab, row, c, d)
                                     : he::kv::block_scale<true>(slab, row, c, d);
    }
    return r;
}

// A raw piece decoded with its scale and stored as Op's halves, rounded once.
template <typename Op>
__device__ __forceinline__ void store_raw8(unsigned short *dst, const Raw8 &r, int type) {
    float f[8];
    if (type == HE_KV_Q8_0) he::kv::q8_to_floats(r.codes, f);
    else he::kv::fp8_to_floats(r.codes, f);
    const float k = r.scale;
    *reinterpret_cast<uint4 *>(dst) = make_uint4(Op::pack(f[0] * k, f[1] * k), Op::pack(f[2] * k, f[3] * k),
                                                 Op::pack(f[4] * k, f[5] * k), Op::pack(f[6] * k, f[7] * k));
}

// Tiles of the stage of a `ctx`-position context (every whole or partial tile of the first
// `stage_tokens` positions, a multiple of FA_BN): hostembed_flash_stage writes them, the kernel reads them.
__host__ __device__ __forceinline__ unsigned int stage_tiles(unsigned int ctx, unsigned int stage_tokens) {
    return min((ctx + FA_BN - 1) / FA_BN, stage_tokens / FA_BN);
}

// Where position p of kv head h's K (v false) or V rows starts in a stage of stage_tokens positions.
__device__ __forceinline__ size_t stage_row(unsigned int kv_heads, unsigned int stage_tokens, bool v, unsigned int h,
                                            unsigned int p, unsigned int d) {
    return (((size_t)v * kv_heads + h) * stage_tokens + p) * d;
}

// Stage rows [0, stage_tiles * FA_BN) of each 8-bit half: thread i decodes piece i (8 values) of
// [half][kv head][position][D / 8]; positions from ctx on are zeros.
__global__ void flash_stage_kernel(const unsigned char *__restrict__ kv_pool, const unsigned int *__restrict__ table,
                                   unsigned int pool_pages, int k_type, int v_type, unsigned int kv_heads,
                                   unsigned int d, unsigned int ctx, unsigned int rows, unsigned int stage_tokens,
                                   unsigned short *__restrict__ stage) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t per_half = (size_t)kv_heads * rows * (d / 8);
    if (i >= 2 * per_half) return;
    const bool v = i >= per_half;
    const int type = v ? v_type : k_type;
    if (!he::kv_is_block(type)) return;
    const size_t j = i - v * per_half;
    const unsigned int c = (unsigned int)(j % (d / 8)) * 8, p = (unsigned int)(j / (d / 8) % rows),
                       h = (unsigned int)(j / (d / 8) / rows);
    const unsigned int id = p < ctx ? table[p / HE_PAGE_TOKENS] : pool_pages;
    const bool ok = id < pool_pages;
    const unsigned char *page = kv_pool + (ok ? (size_t)id * he::kv_page_bytes(kv_heads, d, k_type, v_type) : 0);
    const Raw8 r = load_raw8(page + he::kv_slab_at(kv_heads, d, k_type, v_type, v, h), p % HE_PAGE_TOKENS, c, d,
                             type, ok);
    store_raw8<he::F16Op>(stage + stage_row(kv_heads, stage_tokens, v, h, p, d) + c, r, type);
}

// How a kernel reads an 8-bit half (K or V of a block type): not at all (NONE: 16-bit halves only); from
// its pages, loaded into registers a tile ahead (a synchronous load there would stall every tile on its
// memory latency), except the tiles in a stage (RAW8); or, K and V both 8-bit, from a stage that holds
// every tile the launch reads (STAGED: no page is read, and the registers stay free as with NONE).
enum Read8 { NONE, RAW8, STAGED };

// STAGED: three blocks a multiprocessor (168 registers at D 128), as the 16-bit kernels take without a bound.
template <int D, typename Out, typename KOp, typename VOp, Read8 READ8>
__global__ __launch_bounds__(FA_THREADS, READ8 == STAGED ? 3 : 0) void flash_kernel(const float *__restrict__ q, unsigned int q_stride,
                                                           const unsigned char *__restrict__ kv_pool,
                                                           const unsigned int *__restrict__ table,
                                                           unsigned int pool_pages, int k_type, int v_type,
                                                           const int *__restrict__ pos, unsigned int n,
                                                           unsigned int heads, unsigned int kv_heads,
                                                           float scale_log2, unsigned int window,
                                                           typename Out::T *__restrict__ out,
                                                           unsigned int out_stride,
                                                           const unsigned short *__restrict__ stage,
                                                           unsigned int stage_tokens, unsigned int staged,
                                                           float *__restrict__ partial, unsigned int part_tiles) {
    constexpr int S = fa_stride<D>(), KSTEPS = D / 16, DT = D / 8;
    extern __shared__ __align__(16) unsigned short fa_smem_buf[];
    __shared__ int block_max_pos, block_min_pos;
    unsigned short *k_s = fa_smem_buf;               // [2][FA_BN][S]
    unsigned short *v_s = fa_smem_buf + 2 * FA_BN * S;  // [2][FA_BN][S]

    const unsigned int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t4 = lane % 4;
    const unsigned int h = blockIdx.y, kvh = h / (heads / kv_heads);
    const unsigned int q0 = blockIdx.x * FA_BM;

    if (tid == 0) block_max_pos = -1, block_min_pos = 0x7fffffff;
    __syncthreads();
    if (tid < FA_BM && q0 + tid < n) {
        atomicMax(&block_max_pos, pos[q0 + tid]);
        atomicMin(&block_min_pos, pos[q0 + tid]);
    }
    __syncthreads();
    const int p_max = block_max_pos, p_min = block_min_pos;
    const unsigned int ctx = p_max < 0 ? 0u : (unsigned int)p_max + 1;

    // This lane's two query rows: g and g + 8 of the warp's 16.
    const unsigned int r_lo = q0 + warp * 16 + g, r_hi = r_lo + 8;
    const int p_lo = r_lo < n ? pos[r_lo] : -1, p_hi = r_hi < n ? pos[r_hi] : -1;

    unsigned int qf[KSTEPS][4];
    {
        const float *q_lo = q + (size_t)r_lo * q_stride + (size_t)h * D;
        const float *q_hi = q + (size_t)r_hi * q_stride + (size_t)h * D;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk++) {
#pragma unroll
            for (int part = 0; part < 2; part++) {  // columns 16kk + 2t4 (+8 for part 1)
                const unsigned int c = kk * 16 + part * 8 + 2 * t4;
                float2 lo = make_float2(0.f, 0.f), hi = make_float2(0.f, 0.f);
                if (r_lo < n) lo = make_float2(q_lo[c], q_lo[c + 1]);
                if (r_hi < n) hi = make_float2(q_hi[c], q_hi[c + 1]);
                qf[kk][part * 2] = KOp::pack(lo.x * scale_log2, lo.y * scale_log2);
                qf[kk][part * 2 + 1] = KOp::pack(hi.x * scale_log2, hi.y * scale_log2);
            }
        }
    }

    float o[DT][4];
#pragma unroll
    for (int d = 0; d < DT; d++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[d][e] = 0.f;
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;

    const size_t page_bytes = he::kv_page_bytes(kv_heads, D, k_type, v_type);
    const size_t k_at = he::kv_slab_at(kv_heads, D, k_type, v_type, false, kvh);
    const size_t v_at = he::kv_slab_at(kv_heads, D, k_type, v_type, true, kvh);
    constexpr bool RAW8_ = READ8 == RAW8;
    const bool k8 = RAW8_ && he::kv_is_block(k_type), v8 = RAW8_ && he::kv_is_block(v_type);
    constexpr int PIECES = FA_BN * D / 8 / FA_THREADS;  // pieces of 8 values a thread takes of a K or V tile
    static_assert(PIECES * FA_THREADS == FA_BN * D / 8, "a tile is whole pieces for every thread");
    Raw8 k_raw[RAW8_ ? PIECES : 1], v_raw[RAW8_ ? PIECES : 1];
    // A thread's piece i is piece tid + i * FA_THREADS of the tile (D / 8 pieces a row): its row and first column.
    auto piece_row = [&](int i) { return (tid + i * FA_THREADS) / (D / 8); };
    auto piece_col = [&](int i) { return ((tid + i * FA_THREADS) % (D / 8)) * 8; };
    // The staged tiles' f16 rows of this kv head (stage_row's layout), as bytes for copy_piece.
    const unsigned int in_stage = READ8 != NONE && stage != nullptr ? stage_tiles(staged, stage_tokens) : 0;
    const unsigned char *k_stage = reinterpret_cast<const unsigned char *>(
        in_stage > 0 ? stage + stage_row(kv_heads, stage_tokens, false, kvh, 0, D) : nullptr);
    const unsigned char *v_stage = reinterpret_cast<const unsigned char *>(
        in_stage > 0 ? stage + stage_row(kv_heads, stage_tokens, true, kvh, 0, D) : nullptr);
    // Starts a tile's loads: pieces in the operands' format (and staged ones) by cp.async into shared
    // buffer `buf`, other 8-bit ones into k_raw / v_raw (stored by store_tile8 once they are needed).
    auto fetch_tile = [&](unsigned int buf, unsigned int tile) {
        const unsigned int base = tile * FA_BN;
        bool from_stage = false;
        if constexpr (READ8 != NONE) from_stage = tile < in_stage;
#pragma unroll
        for (int i = 0; i < PIECES; i++) {
            const unsigned int r = piece_row(i), c = piece_col(i);
            unsigned short *k_dst = k_s + (buf * FA_BN + r) * S + c, *v_dst = v_s + (buf * FA_BN + r) * S + c;
            if constexpr (READ8 == STAGED) {
                // A tile past the stage (a query past `staged`: outside the contract) reads zeros.
                const unsigned int p = from_stage ? base + r : 0;
                copy_piece(k_dst, k_stage, p, c, D, from_stage);
                copy_piece(v_dst, v_stage, p, c, D, from_stage);
                continue;
            }
            // Later rows (and a bad page id) are zeros: a zero V row times a zero weight. A row not read
            // still names a mapped address (page 0), as cp.async wants. A staged row past this block's
            // context holds its stream's value, or zero past the stream's: its weight is zero either way.
            const unsigned int p = base + r;
            const unsigned int id = p < ctx ? table[p / HE_PAGE_TOKENS] : pool_pages;
            const bool ok = id < pool_pages;
            const unsigned char *page = kv_pool + (ok ? (size_t)id * page_bytes : 0);
            const unsigned int row = p % HE_PAGE_TOKENS;
            if (k8 && from_stage) copy_piece(k_dst, k_stage, p, c, D, true);
            else if (k8) k_raw[RAW8_ ? i : 0] = load_raw8(page + k_at, row, c, D, k_type, ok);
            else copy_piece(k_dst, page + k_at, row, c, D, ok);
            if (v8 && from_stage) copy_piece(v_dst, v_stage, p, c, D, true);
            else if (v8) v_raw[RAW8_ ? i : 0] = load_raw8(page + v_at, row, c, D, v_type, ok);
            else copy_piece(v_dst, page + v_at, row, c, D, ok);
        }
    };
    auto store_tile8 = [&](unsigned int buf, unsigned int tile) {
        if constexpr (RAW8_) {
            if (tile < in_stage) return;  // copied by fetch_tile
#pragma unroll
            for (int i = 0; i < PIECES; i++) {
                const unsigned int r = piece_row(i), c = piece_col(i);
                if (k8) store_raw8<KOp>(k_s + (buf * FA_BN + r) * S + c, k_raw[i], k_type);
                if (v8) store_raw8<VOp>(v_s + (buf * FA_BN + r) * S + c, v_raw[i], v_type);
            }
        }
    };

    // Two buffers: tile t + 1's loads are in flight while tile t computes. With a window, from the tile
    // of the first position the block's first query sees.
    // With parts (grid z), this block's part of the tiles only: partial results, merged by flash_merge_kernel.
    const unsigned int all_tiles = (ctx + FA_BN - 1) / FA_BN;
    const unsigned int tiles = gridDim.z > 1 ? min(all_tiles, (blockIdx.z + 1) * part_tiles) : all_tiles;
    const unsigned int window_tile =
        window != 0 && p_min >= 0 && (unsigned int)p_min + 1 > window ? ((unsigned int)p_min + 1 - window) / FA_BN : 0u;
    const unsigned int first_tile = max(window_tile, blockIdx.z * part_tiles);
    if (tiles > first_tile) {
        fetch_tile(first_tile % 2, first_tile);
        store_tile8(first_tile % 2, first_tile);
    }
    he::cp_async_commit();
    for (unsigned int tile = first_tile; tile < tiles; tile++) {
        if (tile + 1 < tiles) fetch_tile((tile + 1) % 2, tile + 1);
        he::cp_async_commit();
        he::cp_async_wait<1>();  // every group but the newest: this tile's copies have landed
        __syncthreads();
        const unsigned short *ks = k_s + (tile % 2) * FA_BN * S;
        const unsigned short *vs = v_s + (tile % 2) * FA_BN * S;

        // Scores of 16 queries by 64 positions: 8 accumulators of 8 positions.
        float s[FA_BN / 8][4];
#pragma unroll
        for (int j = 0; j < FA_BN / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[j][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk++) {
#pragma unroll
            for (int j = 0; j < FA_BN / 8; j++) {
                const unsigned short *kr = ks + (j * 8 + g) * S + kk * 16 + 2 * t4;
                KOp::mma(s[j], qf[kk], *reinterpret_cast<const unsigned int *>(kr),
                         *reinterpret_cast<const unsigned int *>(kr + 8));
            }
        }
        // Positions past a query's own are masked; only tiles that reach past the block's first query need it.
        const unsigned int base = tile * FA_BN;
        if ((int)(base + FA_BN - 1) > p_min) {
#pragma unroll
            for (int j = 0; j < FA_BN / 8; j++) {
                const int key = (int)(base + j * 8 + 2 * t4);
                if (key > p_lo) s[j][0] = -INFINITY;
                if (key + 1 > p_lo) s[j][1] = -INFINITY;
                if (key > p_hi) s[j][2] = -INFINITY;
                if (key + 1 > p_hi) s[j][3] = -INFINITY;
            }
        }
        // Positions before a query's window are masked; only tiles that start before the block's last
        // query's window need it.
        if (window != 0 && p_max >= 0 && (int)base + (int)window <= p_max) {
            const int w = (int)window;
#pragma unroll
            for (int j = 0; j < FA_BN / 8; j++) {
                const int key = (int)(base + j * 8 + 2 * t4);
                if (key + w <= p_lo) s[j][0] = -INFINITY;
                if (key + 1 + w <= p_lo) s[j][1] = -INFINITY;
                if (key + w <= p_hi) s[j][2] = -INFINITY;
                if (key + 1 + w <= p_hi) s[j][3] = -INFINITY;
            }
        }
        float mx_lo = m_lo, mx_hi = m_hi;
#pragma unroll
        for (int j = 0; j < FA_BN / 8; j++) {
            mx_lo = fmaxf(mx_lo, fmaxf(s[j][0], s[j][1]));
            mx_hi = fmaxf(mx_hi, fmaxf(s[j][2], s[j][3]));
        }
#pragma unroll
        for (int o_ = 1; o_ < 4; o_ <<= 1) {  // the 4 lanes of a row
            mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, o_));
            mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, o_));
        }
        // A row with nothing unmasked yet (only rows past n) keeps zero weights instead of NaNs.
        const float base_lo = mx_lo == -INFINITY ? 0.f : mx_lo, base_hi = mx_hi == -INFINITY ? 0.f : mx_hi;
        const float corr_lo = exp2f(m_lo - base_lo), corr_hi = exp2f(m_hi - base_hi);
        m_lo = mx_lo, m_hi = mx_hi;
        float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
        for (int j = 0; j < FA_BN / 8; j++) {
            s[j][0] = exp2f(s[j][0] - base_lo), s[j][1] = exp2f(s[j][1] - base_lo);
            s[j][2] = exp2f(s[j][2] - base_hi), s[j][3] = exp2f(s[j][3] - base_hi);
            sum_lo += s[j][0] + s[j][1];
            sum_hi += s[j][2] + s[j][3];
        }
        l_lo = l_lo * corr_lo + sum_lo;  // this lane's share; the row's 4 lanes are summed at the end
        l_hi = l_hi * corr_hi + sum_hi;
#pragma unroll
        for (int d = 0; d < DT; d++) o[d][0] *= corr_lo, o[d][1] *= corr_lo, o[d][2] *= corr_hi, o[d][3] *= corr_hi;

        // O += P V, 16 positions a step: two score accumulators make one A fragment.
#pragma unroll
        for (int ks_ = 0; ks_ < FA_BN / 16; ks_++) {
            const unsigned int pa[4] = {
                VOp::pack(s[2 * ks_][0], s[2 * ks_][1]), VOp::pack(s[2 * ks_][2], s[2 * ks_][3]),
                VOp::pack(s[2 * ks_ + 1][0], s[2 * ks_ + 1][1]), VOp::pack(s[2 * ks_ + 1][2], s[2 * ks_ + 1][3])};
#pragma unroll
            for (int dp = 0; dp < D / 16; dp++) {
                unsigned int vb[4];
                he::ldmatrix_x4_trans(vb, vs + (ks_ * 16 + lane % 8 + ((lane / 8) % 2) * 8) * S + dp * 16 + (lane / 16) * 8);
                VOp::mma(o[2 * dp], pa, vb[0], vb[1]);
                VOp::mma(o[2 * dp + 1], pa, vb[2], vb[3]);
            }
        }
        // The next tile's 8-bit pieces, loaded during this tile's products, into the buffer nobody reads now.
        if (tile + 1 < tiles) store_tile8((tile + 1) % 2, tile + 1);
        __syncthreads();  // the next iteration's load overwrites this buffer
    }
    he::cp_async_wait<0>();

#pragma unroll
    for (int o_ = 1; o_ < 4; o_ <<= 1) {
        l_lo += __shfl_xor_sync(0xffffffffu, l_lo, o_);
        l_hi += __shfl_xor_sync(0xffffffffu, l_hi, o_);
    }
    if (gridDim.z > 1) {
        // Unnormalized: [part][row][head] of D values, the row's max (log2 units) and its sum of weights.
        const size_t rows_pad = (size_t)gridDim.x * FA_BM;
        float *lo = partial + (((size_t)blockIdx.z * rows_pad + r_lo) * heads + h) * (D + 2);
        float *hi = partial + (((size_t)blockIdx.z * rows_pad + r_hi) * heads + h) * (D + 2);
#pragma unroll
        for (int d = 0; d < DT; d++) {
            const unsigned int c = d * 8 + 2 * t4;
            if (r_lo < n) *reinterpret_cast<float2 *>(lo + c) = make_float2(o[d][0], o[d][1]);
            if (r_hi < n) *reinterpret_cast<float2 *>(hi + c) = make_float2(o[d][2], o[d][3]);
        }
        if (t4 == 0 && r_lo < n) lo[D] = m_lo, lo[D + 1] = l_lo;
        if (t4 == 0 && r_hi < n) hi[D] = m_hi, hi[D + 1] = l_hi;
        return;
    }
    const float inv_lo = l_lo > 0.f ? 1.f / l_lo : 0.f, inv_hi = l_hi > 0.f ? 1.f / l_hi : 0.f;
    typename Out::T *out_lo = out + (size_t)r_lo * out_stride + (size_t)h * D;
    typename Out::T *out_hi = out + (size_t)r_hi * out_stride + (size_t)h * D;
#pragma unroll
    for (int d = 0; d < DT; d++) {
        const unsigned int c = d * 8 + 2 * t4;
        if (r_lo < n) *reinterpret_cast<unsigned int *>(out_lo + c) = Out::pack(o[d][0] * inv_lo, o[d][1] * inv_lo);
        if (r_hi < n) *reinterpret_cast<unsigned int *>(out_hi + c) = Out::pack(o[d][2] * inv_hi, o[d][3] * inv_hi);
    }
}

// Row `blockIdx.x`, head `blockIdx.y` of a launch cut in `parts`: the parts' partial results merged in
// part order (each rescaled to the largest max; a part that saw no position weighs nothing), a thread two
// values.
template <int D, typename Out>
__global__ void flash_merge_kernel(const float *__restrict__ partial, unsigned int parts, unsigned int rows_pad,
                                   unsigned int heads, typename Out::T *__restrict__ out, unsigned int out_stride) {
    const unsigned int r = blockIdx.x, h = blockIdx.y, c = threadIdx.x * 2;
    auto at = [&](unsigned int p) { return partial + (((size_t)p * rows_pad + r) * heads + h) * (D + 2); };
    float m = -INFINITY;
    for (unsigned int p = 0; p < parts; p++)
        if (at(p)[D + 1] > 0.f) m = fmaxf(m, at(p)[D]);
    float l = 0.f, o0 = 0.f, o1 = 0.f;
    for (unsigned int p = 0; p < parts; p++) {
        const float *q = at(p);
        const float w = q[D + 1] > 0.f ? exp2f(q[D] - m) : 0.f;
        l += q[D + 1] * w;
        const float2 v = *reinterpret_cast<const float2 *>(q + c);
        o0 += v.x * w, o1 += v.y * w;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    *reinterpret_cast<unsigned int *>(out + (size_t)r * out_stride + (size_t)h * D + c) = Out::pack(o0 * inv, o1 * inv);
}

// Calls fn(std::integral_constant<int, D>) for a head size with a kernel; false for any other.
template <typename Fn>
bool with_head_dim(unsigned int head_dim, Fn &&fn) {
    switch (head_dim) {
    case 16: fn(std::integral_constant<int, 16>{}); return true;
    case 32: fn(std::integral_constant<int, 32>{}); return true;
    case 64: fn(std::integral_constant<int, 64>{}); return true;
    case 128: fn(std::integral_constant<int, 128>{}); return true;
    case 256: fn(std::integral_constant<int, 256>{}); return true;
    default: return false;
    }
}

}  // namespace

extern "C" cudaError_t hostembed_flash_head_dim(unsigned int head_dim) {
    size_t smem = 0;
    if (!with_head_dim(head_dim, [&](auto dim) { smem = fa_smem<decltype(dim)::value>(); })) return cudaErrorInvalidValue;
    // Head size 256's tiles take 132 KiB: more than a block of sm_86 or sm_89 may have, which then has no kernel.
    // (Every card from sm_80 gives a block the 99 KiB the smaller head sizes take.)
    if (smem > 99 * 1024) {
        int dev = 0, optin = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess ||
            (size_t)optin < smem)
            return cudaErrorInvalidValue;
    }
    return cudaSuccess;
}

extern "C" cudaError_t hostembed_flash_attention_parts(
    const float *q, unsigned int q_stride, const void *kv_pool, const unsigned int *table, unsigned int pool_pages,
    int k_type, int v_type, const int *pos, unsigned int n, unsigned int heads, unsigned int kv_heads,
    unsigned int head_dim, float scale, unsigned int window, void *out, int out_dtype, unsigned int out_stride,
    const void *stage, unsigned int stage_tokens, unsigned int staged, unsigned int parts, unsigned int part_tiles,
    float *partial, size_t partial_floats, cudaStream_t stream) {
    const size_t rows_pad = (size_t)(n + FA_BM - 1) / FA_BM * FA_BM;
    if (parts == 0 || (parts > 1 && (partial == nullptr || part_tiles == 0 || reinterpret_cast<uintptr_t>(partial) % 8 != 0 ||
                                     parts > 65535 || (size_t)parts * rows_pad * heads * (head_dim + 2) > partial_floats)))
        return cudaErrorInvalidValue;
    if (q == nullptr || kv_pool == nullptr || table == nullptr || pos == nullptr || out == nullptr || heads == 0 ||
        kv_heads == 0 || heads % kv_heads != 0 || pool_pages == 0 || q_stride < heads * head_dim ||
        out_stride < heads * head_dim || out_stride % 2 != 0 || reinterpret_cast<uintptr_t>(out) % 4 != 0 ||
        reinterpret_cast<uintptr_t>(kv_pool) % 16 != 0 || stage_tokens % FA_BN != 0 ||
        reinterpret_cast<uintptr_t>(stage) % 16 != 0)
        return cudaErrorInvalidValue;
    // Every type but F32, in whole blocks.
    for (const int type : {k_type, v_type})
        if (type == HE_KV_F32 || !he::kv_type_ok(type, head_dim)) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    if (heads > 65535) return cudaErrorInvalidValue;
    cudaError_t err = cudaErrorInvalidValue;
    // The operands' format for each of K and V: bf16 for a bf16 cache, f16 for the others.
    const int k_op = k_type == HE_KV_BF16 ? HE_DTYPE_BF16 : HE_DTYPE_F16;
    const int v_op = v_type == HE_KV_BF16 ? HE_DTYPE_BF16 : HE_DTYPE_F16;
    const bool raw8 = he::kv_is_block(k_type) || he::kv_is_block(v_type);
    // K and V 8-bit and every tile the queries read in the stage: the kernel that reads no page.
    const bool all_staged =
        he::kv_is_block(k_type) && he::kv_is_block(v_type) && stage != nullptr && staged > 0 && staged <= stage_tokens;
    with_head_dim(head_dim, [&](auto dim) {
        constexpr int D = decltype(dim)::value;
        he::with_half(out_dtype, [&](auto op) {
            using Out = decltype(op);
            he::with_half(k_op, [&](auto kop) {
                he::with_half(v_op, [&](auto vop) {
                    using KOp = decltype(kop);
                    using VOp = decltype(vop);
                    auto kernel = flash_kernel<D, Out, KOp, VOp, NONE>;
                    // An 8-bit type takes f16 operands: two bf16 ones never need the 8-bit kernels. Head size
                    // 256 has none (their registers spill a kilobyte and more a thread): the host gives an
                    // 8-bit cache of that size to the split kernel.
                    if constexpr (D > 128) {
                        if (raw8) return;
                    } else if constexpr (!std::is_same_v<KOp, he::Bf16Op> || !std::is_same_v<VOp, he::Bf16Op>) {
                        if (raw8) kernel = all_staged ? flash_kernel<D, Out, KOp, VOp, STAGED>
                                                      : flash_kernel<D, Out, KOp, VOp, RAW8>;
                    }
                    err = he::allow_smem(kernel, fa_smem<D>());
                    if (err != cudaSuccess) return;
                    const dim3 grid((n + FA_BM - 1) / FA_BM, heads, parts);
                    kernel<<<grid, FA_THREADS, fa_smem<D>(), stream>>>(
                        q, q_stride, static_cast<const unsigned char *>(kv_pool), table, pool_pages, k_type, v_type,
                        pos, n, heads, kv_heads, scale * FA_LOG2E, window, static_cast<typename Out::T *>(out), out_stride,
                        static_cast<const unsigned short *>(stage), stage_tokens, staged, partial, part_tiles);
                    err = cudaGetLastError();
                    if (err != cudaSuccess || parts == 1) return;
                    flash_merge_kernel<D, Out><<<dim3(n, heads), D / 2, 0, stream>>>(
                        partial, parts, (unsigned int)rows_pad, heads, static_cast<typename Out::T *>(out), out_stride);
                    err = cudaGetLastError();
                });
            });
        });
    });
    return err;
}

extern "C" cudaError_t hostembed_flash_attention(const float *q, unsigned int q_stride, const void *kv_pool,
                                                 const unsigned int *table, unsigned int pool_pages, int k_type,
                                                 int v_type, const int *pos, unsigned int n, unsigned int heads,
                                                 unsigned int kv_heads, unsigned int head_dim, float scale,
                                                 unsigned int window, void *out, int out_dtype,
                                                 unsigned int out_stride, const void *stage,
                                                 unsigned int stage_tokens, unsigned int staged, cudaStream_t stream) {
    return hostembed_flash_attention_parts(q, q_stride, kv_pool, table, pool_pages, k_type, v_type, pos, n, heads,
                                           kv_heads, head_dim, scale, window, out, out_dtype, out_stride, stage,
                                           stage_tokens, staged, 1, 0, nullptr, 0, stream);
}

extern "C" cudaError_t hostembed_flash_stage(const void *kv_pool, const unsigned int *table, unsigned int pool_pages,
                                             int k_type, int v_type, unsigned int kv_heads, unsigned int head_dim,
                                             unsigned int ctx, void *stage, unsigned int stage_tokens,
                                             cudaStream_t stream) {
    if (kv_pool == nullptr || table == nullptr || stage == nullptr || kv_heads == 0 || pool_pages == 0 ||
        stage_tokens % FA_BN != 0 || !with_head_dim(head_dim, [](auto) {}) ||
        reinterpret_cast<uintptr_t>(kv_pool) % 16 != 0 || reinterpret_cast<uintptr_t>(stage) % 16 != 0)
        return cudaErrorInvalidValue;
    for (const int type : {k_type, v_type})
        if (type == HE_KV_F32 || !he::kv_type_ok(type, head_dim)) return cudaErrorInvalidValue;
    const unsigned int rows = stage_tiles(ctx, stage_tokens) * FA_BN;
    const size_t pieces = (size_t)2 * kv_heads * rows * (head_dim / 8);
    if (pieces == 0 || !(he::kv_is_block(k_type) || he::kv_is_block(v_type))) return cudaSuccess;
    constexpr unsigned int threads = 256;
    const size_t blocks = (pieces + threads - 1) / threads;
    if (blocks > 0x7fffffffu) return cudaErrorInvalidValue;
    flash_stage_kernel<<<(unsigned int)blocks, threads, 0, stream>>>(
        static_cast<const unsigned char *>(kv_pool), table, pool_pages, k_type, v_type, kv_heads, head_dim, ctx, rows,
        stage_tokens, static_cast<unsigned short *>(stage));
    return cudaGetLastError();
}
