// Decode attention over the paged KV pool, split along the context (flash-decoding): block (part, kv
// head and group of query heads, token) runs an online softmax over its part of the token's context for up
// to HB query heads that share one kv head (GQA: each K and V row is read once for all of them), and leaves
// (max, sum, unnormalised output) per head; a second kernel combines the parts in order. Each token reads
// its own stream's pages through its page table, so one launch serves tokens of many streams. A token's
// parts depend only on its context length and the launch's part count, never on the other tokens: a
// stream's result is the same bits alone or in any batch launched with the same part count.
//
// K and V are read in their cache types (kernels/kv.cuh) and decoded in registers; a block type's scale
// multiplies a K chunk's dot product and a V row's weight. K and V of one type take a kernel built for it;
// any other pair (F32, or K and V apart) takes the one that reads the types at run time.
#include "hostembed_kernels.cuh"
#include "kv.cuh"

namespace {

constexpr int AT_THREADS = 128;
constexpr int AT_WARPS = AT_THREADS / 32;
// Positions per tile: one per thread for the scores.
constexpr int AT_TILE = AT_THREADS;
// Parts of a context are whole units of this many positions (a multiple of the page size).
constexpr unsigned int AT_UNIT = 32;
static_assert(AT_UNIT % HE_PAGE_TOKENS == 0 && AT_UNIT == 2 * HE_PAGE_TOKENS, "a warp's V positions span two pages");

// Tuning knobs, fixed at build time, for benchmark builds (HOSTEMBED_KERNEL_DEFINES); the defaults are the
// measured choice: blocks a multiprocessor the registers are capped for, and the most 16-byte K or V loads
// a thread keeps in flight.
#ifndef AT_MIN_BLOCKS
#define AT_MIN_BLOCKS 2
#endif
#ifndef AT_WIDE_BLOCKS
#define AT_WIDE_BLOCKS 4
#endif
#ifndef AT_MAX_BATCH
#define AT_MAX_BATCH 16
#endif

// Scores are kept in log2 units (q pre-scaled by scale * log2(e)) so the exponentials are exp2.
constexpr float LOG2E = 1.4426950408889634f;

// Positions a token at `pos` attends to (none for a pad row, pos -1).
__device__ __forceinline__ unsigned int context_of(int pos) { return pos < 0 ? 0u : (unsigned int)pos + 1; }

// Positions a part of a `ctx`-position context takes, cut in at most `splits` parts: whole 32-position
// units (every warp's 32 positions of a tile lie in two whole pages), at least a tile each (a shorter
// part costs a block as much time and leaves threads idle).
__device__ __forceinline__ unsigned int part_positions(unsigned int ctx, unsigned int splits) {
    const unsigned int units = (ctx + AT_UNIT - 1) / AT_UNIT;
    return max((units + splits - 1) / splits, (unsigned int)(AT_TILE / AT_UNIT)) * AT_UNIT;
}

// How the split kernel cuts a context and the combine reads it: positions a part, and the parts the
// context fills (never more than `splits`: a part is at least ceil(units / splits) units), the only
// parts written.
// The first position a query at context ctx sees (its window's), and that position rounded down to a
// warp's unit, where its parts' cut starts: tiles and warps stay unit-aligned (a warp's V positions span
// two pages). window 0: every position.
struct Seen {
    unsigned int first, from;
};
__device__ __forceinline__ Seen seen_of(unsigned int ctx, unsigned int window) {
    const unsigned int first = window != 0 && ctx > window ? ctx - window : 0u;
    return Seen{first, first / AT_UNIT * AT_UNIT};
}

struct ContextCut {
    unsigned int chunk, used;
};
__device__ __forceinline__ ContextCut context_cut(unsigned int ctx, unsigned int splits) {
    const unsigned int chunk = part_positions(ctx, splits);
    return ContextCut{chunk, (ctx + chunk - 1) / chunk};
}

// out[t][h] = sum over parts of acc * 2^(m - M) / sum over parts of l * 2^(m - M), in part order, by one
// block: the parts' (m, l) are loaded together into shared memory first (CombineSmem), and only the `used`
// parts the split kernel filled for this context are read (it writes no others), so a short context
// costs one part. The parts are read past L1: the split kernel's last block to finish reads the other
// blocks' parts (`combine_parts`' callers in either kernel run the same arithmetic).
constexpr unsigned int AT_MAX_SPLITS = 1024;
struct CombineSmem {
    float w[AT_MAX_SPLITS], l[AT_MAX_SPLITS];
    float inv;
};
__device__ __forceinline__ void combine_parts(const float *partial, unsigned int heads, unsigned int d,
                                              unsigned int splits, unsigned int used, unsigned int t, unsigned int h,
                                              float *out, CombineSmem &sm) {
    const size_t pstride = (size_t)d + 2;
    const float *base = partial + ((size_t)t * heads + h) * splits * pstride;
    float *w_s = sm.w;
    for (unsigned int s = threadIdx.x; s < used; s += blockDim.x) {
        w_s[s] = __ldcg(base + s * pstride);
        sm.l[s] = __ldcg(base + s * pstride + 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float m_all = -INFINITY;
        for (unsigned int s = 0; s < used; s++) m_all = fmaxf(m_all, w_s[s]);
        float l_all = 0.f;
        for (unsigned int s = 0; s < used; s++) {
            const float m = w_s[s];
            const float wt = m != -INFINITY ? exp2f(m - m_all) : 0.f;
            if (m != -INFINITY) l_all += sm.l[s] * wt;
            w_s[s] = wt;
        }
        sm.inv = 1.f / l_all;
    }
    __syncthreads();
    const float inv = sm.inv;
    for (unsigned int c = threadIdx.x; c < d; c += blockDim.x) {
        float o = 0.f;
#pragma unroll 8
        for (unsigned int s = 0; s < used; s++) {
            if (w_s[s] != 0.f) o += __ldcg(base + s * pstride + 2 + c) * w_s[s];
        }
        out[((size_t)t * heads + h) * d + c] = o * inv;
    }
    __syncthreads();  // the shared values are rewritten by the next head's
}

// BLOCKS: the blocks a multiprocessor the registers are capped for. AT_MIN_BLOCKS keeps a thread's 16 K
// or V loads in flight (the most bytes a block, for few blocks: one stream's long context);
// AT_WIDE_BLOCKS halves them for twice the blocks, where a launch has many (many streams' short
// contexts: each block's loads, softmax and V pass run one after another, and other blocks fill the gaps).
// The same products in the same order either way: the same bits.
template <int D, int HB, int KT, int VT, int BLOCKS = AT_MIN_BLOCKS>
__global__ __launch_bounds__(AT_THREADS, BLOCKS) void attention_split_kernel(
    const float *__restrict__ q, unsigned int q_stride, const unsigned char *__restrict__ kv_pool,
    const unsigned int *const *__restrict__ tables, unsigned int pool_pages, int k_type, int v_type,
    const int *__restrict__ pos, unsigned int heads, unsigned int kv_heads, unsigned int d, float scale_log2,
    unsigned int window, unsigned int splits, float *__restrict__ partial, float *__restrict__ out,
    unsigned int *__restrict__ counters) {
    using KR = he::kv::Reader<KT>;
    using VR = he::kv::Reader<VT>;
    const KR kr(k_type);
    const VR vr_(v_type);
    // Raw chunks wider than 16 bytes (the run-time reader) halve the loads in flight, for registers.
    constexpr int K_WIDE = sizeof(typename KR::Raw) > 16 ? 2 : 1, V_WIDE = sizeof(typename VR::Raw) > 16 ? 2 : 1;
    // K: a thread's row chunks (8 values each) in flight at once.
    constexpr int MAX_BATCH = BLOCKS > AT_MIN_BLOCKS ? AT_MAX_BATCH / 2 : AT_MAX_BATCH;
    constexpr int K_BATCH_BASE = HB >= 8 ? 8 : (D / 8 < MAX_BATCH ? D / 8 : MAX_BATCH);
    constexpr int K_BATCH = K_BATCH_BASE / K_WIDE;
    // V: each lane reads 8 dims of a row, so a warp reads V_ROWS rows per load and requests
    // the warp's 32 rows as 32 / V_ROWS loads per lane, V_BATCH at a time (fewer where the accumulators
    // already take the registers). Measured: 16k-cache decode 168.5 -> 175.1 tok/s on the 8B shape.
    constexpr int V_LANES = D / 8, V_ROWS = 32 / V_LANES, V_STEPS = 32 / V_ROWS;
    constexpr int V_BATCH_BASE = (HB >= 8 || D > 128) ? 8 : (V_STEPS < MAX_BATCH ? V_STEPS : MAX_BATCH);
    constexpr int V_BATCH = V_BATCH_BASE / V_WIDE > 0 ? V_BATCH_BASE / V_WIDE : 1;
    __shared__ __align__(16) float q_s[HB][D];
    __shared__ float p_s[HB][AT_TILE];
    __shared__ float red_max[AT_WARPS][HB], red_sum[AT_WARPS][HB];
    __shared__ float acc_s[AT_WARPS][HB][D];
    __shared__ CombineSmem combine_sm;  // with counters: the last block's combine
    const unsigned int t = blockIdx.z;
    const unsigned int group = heads / kv_heads;
    const unsigned int hgroups = (group + HB - 1) / HB;
    const unsigned int kvh = blockIdx.y / hgroups, hg = blockIdx.y % hgroups;
    const unsigned int h0 = kvh * group + hg * HB;
    const unsigned int nh = min((unsigned int)HB, group - hg * HB);
    const unsigned int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

    // Positions are the step's upload, complete before the pass's first kernel: read before the wait.
    const unsigned int ctx = context_of(pos[t]);
    // A windowed query's parts cut the positions from its window's unit on; those before the window
    // score as past the context.
    const auto [first, from] = seen_of(ctx, window);
    const auto [chunk, used] = context_cut(ctx - from, splits);
    // Block x takes parts x, x + gridDim.x, ...: the launch's grid (as few blocks as its longest context
    // needs, so a short context costs no empty blocks) changes which block computes a part, never its bits.
    // A block with no part writes nothing (the combine reads only the parts a context fills) and leaves at
    // once; block 0 waits even then (a pad row's), so that this launch never ends before the kernel before it.
    if (blockIdx.x >= used) {
        if (blockIdx.x == 0) {
            he::pdl_wait();
            // No part at all (a pad row's): the combine's result of none, by the one block that waits.
            if (counters != nullptr && used == 0) {
                for (unsigned int h = 0; h < nh; h++)
                    combine_parts(partial, heads, d, splits, 0, t, h0 + h, out, combine_sm);
            }
        }
        return;
    }
    he::pdl_wait();  // q and the cache come from the kernel before (launched overlapped)
    he::pdl_launch_dependents();

    const size_t pstride = (size_t)d + 2;
    for (unsigned int i = tid; i < HB * D; i += AT_THREADS) {
        const unsigned int h = i / D, c = i % D;
        q_s[h][c] = (h < nh && c < d) ? q[(size_t)t * q_stride + (size_t)(h0 + h) * d + c] * scale_log2 : 0.f;
    }
    __syncthreads();

    for (unsigned int split = blockIdx.x; split < used; split += gridDim.x) {
        const unsigned int start = from + split * chunk, end = min(ctx, start + chunk);
        float *part_of = partial + (((size_t)t * heads + h0) * splits + split) * pstride;  // head h0; next head +splits*pstride
        float m_run[HB], l_run[HB], acc[HB][8];
#pragma unroll
        for (int h = 0; h < HB; h++) {
            m_run[h] = -INFINITY;
            l_run[h] = 0.f;
#pragma unroll
            for (int k = 0; k < 8; k++) acc[h][k] = 0.f;
        }
        const unsigned int *table = tables[t];
        const size_t page_bytes = he::kv_page_bytes(kv_heads, d, k_type, v_type);
        const size_t k_at = he::kv_slab_at(kv_heads, d, k_type, v_type, false, kvh);
        const size_t v_at = he::kv_slab_at(kv_heads, d, k_type, v_type, true, kvh);
        // This kv head's K or V slab in page `id` (a bad id reads page 0: wrong, never out of bounds).
        auto slab = [&](unsigned int id, size_t at) {
            return kv_pool + (size_t)(id < pool_pages ? id : 0u) * page_bytes + at;
        };
        const unsigned int v_row = lane / V_LANES, v_col = (lane % V_LANES) * 8;
        const bool lane_has_dims = v_col < d;

        for (unsigned int tile = start; tile < end; tile += AT_TILE) {
            // Scores: one position per thread, all heads of the group.
            const unsigned int p = tile + tid;
            const bool valid = p < end && p >= first;
            float sc[HB];
#pragma unroll
            for (int h = 0; h < HB; h++) sc[h] = 0.f;
            if (valid) {
                const unsigned char *ks = slab(table[p / HE_PAGE_TOKENS], k_at);
                const unsigned int row = p % HE_PAGE_TOKENS;
                // Chunks of 8 values: a block of 32 is 4 chunks, and K_BATCH is a multiple of 4.
                constexpr int BLOCK_CHUNKS = HE_KV_BLOCK / 8;
                static_assert(K_BATCH % BLOCK_CHUNKS == 0, "a batch of K chunks is whole blocks");
#pragma unroll
                for (int c0 = 0; c0 < D / 8; c0 += K_BATCH) {
                    typename KR::Raw kv[K_BATCH];
                    float kscale[K_BATCH / BLOCK_CHUNKS];
#pragma unroll
                    for (int c = 0; c < K_BATCH; c++) {
                        if ((c0 + c) * 8 < (int)d) {
                            kv[c] = kr.load(ks, row, (c0 + c) * 8, d);
                            if (KR::SCALED && c % BLOCK_CHUNKS == 0)
                                kscale[c / BLOCK_CHUNKS] = kr.scale(ks, row, (c0 + c) * 8, d);
                        }
                    }
#pragma unroll
                    for (int c = 0; c < K_BATCH; c++) {
                        if ((c0 + c) * 8 < (int)d) {
                            float kf[8];
                            kr.decode(kv[c], kf);
#pragma unroll
                            for (int h = 0; h < HB; h++) {
                                const float4 qa = *reinterpret_cast<const float4 *>(&q_s[h][(c0 + c) * 8]);
                                const float4 qb = *reinterpret_cast<const float4 *>(&q_s[h][(c0 + c) * 8 + 4]);
                                const float dot = qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] +
                                                  qb.x * kf[4] + qb.y * kf[5] + qb.z * kf[6] + qb.w * kf[7];
                                if (KR::SCALED)
                                    sc[h] = fmaf(kscale[c / BLOCK_CHUNKS], dot, sc[h]);
                                else
                                    sc[h] += dot;
                            }
                        }
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < HB; h++) {
                if (!valid) sc[h] = -INFINITY;
                const float mx = he::warp_max(sc[h]);
                if (lane == 0) red_max[warp][h] = mx;
            }
            __syncthreads();
            float m_new[HB];
#pragma unroll
            for (int h = 0; h < HB; h++) {
                float mx = red_max[0][h];
#pragma unroll
                for (int w = 1; w < AT_WARPS; w++) mx = fmaxf(mx, red_max[w][h]);
                m_new[h] = fmaxf(m_run[h], mx);  // finite: every tile has a valid position
                const float pr = valid ? exp2f(sc[h] - m_new[h]) : 0.f;
                p_s[h][tid] = pr;
                const float sum = he::warp_sum(pr);
                if (lane == 0) red_sum[warp][h] = sum;
            }
            __syncthreads();
#pragma unroll
            for (int h = 0; h < HB; h++) {
                float sum = 0.f;
#pragma unroll
                for (int w = 0; w < AT_WARPS; w++) sum += red_sum[w][h];
                const float corr = exp2f(m_run[h] - m_new[h]);  // 0 on the first tile (m_run = -inf)
                l_run[h] = l_run[h] * corr + sum;
#pragma unroll
                for (int k = 0; k < 8; k++) acc[h][k] *= corr;
                m_run[h] = m_new[h];
            }
            // V: warp w takes positions tile + 32w .. +32; the lane reads 8 dims of rows v_row + V_ROWS * i.
            const unsigned int pw = tile + 32 * warp;
            const unsigned int jmax = pw < end ? min(32u, end - pw) : 0u;
            if (lane_has_dims && jmax > 0) {
                // pw is a multiple of 32: its positions lie in two whole pages.
                const unsigned char *v_lo = slab(table[pw / HE_PAGE_TOKENS], v_at);
                const unsigned char *v_hi = jmax > HE_PAGE_TOKENS ? slab(table[pw / HE_PAGE_TOKENS + 1], v_at) : v_lo;
#pragma unroll
                for (int i0 = 0; i0 < V_STEPS; i0 += V_BATCH) {
                    typename VR::Raw vr[V_BATCH];
                    float vscale[V_BATCH];
#pragma unroll
                    for (int i = 0; i < V_BATCH; i++) {
                        const unsigned int j = v_row + V_ROWS * (i0 + i);
                        if (j < jmax) {
                            const unsigned char *vs = j < HE_PAGE_TOKENS ? v_lo : v_hi;
                            vr[i] = vr_.load(vs, j % HE_PAGE_TOKENS, v_col, d);
                            if (VR::SCALED) vscale[i] = vr_.scale(vs, j % HE_PAGE_TOKENS, v_col, d);
                        }
                    }
#pragma unroll
                    for (int i = 0; i < V_BATCH; i++) {
                        const unsigned int j = v_row + V_ROWS * (i0 + i);
                        if (j < jmax) {
                            float vf[8];
                            vr_.decode(vr[i], vf);
#pragma unroll
                            for (int h = 0; h < HB; h++) {
                                const float pr = VR::SCALED ? p_s[h][32 * warp + j] * vscale[i] : p_s[h][32 * warp + j];
#pragma unroll
                                for (int k = 0; k < 8; k++) acc[h][k] = fmaf(pr, vf[k], acc[h][k]);
                            }
                        }
                    }
                }
            }
            __syncthreads();  // p_s and the reductions are rewritten by the next tile
        }

        // Sum the warps' outputs and write this part.
        // Lanes that read the same dims of other rows hold partial sums: fold them onto the lanes of row 0.
#pragma unroll
        for (int off = V_LANES; off < 32; off *= 2)
#pragma unroll
            for (int h = 0; h < HB; h++)
#pragma unroll
                for (int k = 0; k < 8; k++) acc[h][k] += __shfl_xor_sync(0xffffffffu, acc[h][k], off);
        if (v_row == 0)
#pragma unroll
            for (int h = 0; h < HB; h++)
#pragma unroll
                for (int k = 0; k < 8; k++) acc_s[warp][h][v_col + k] = acc[h][k];
        // With counters, a context of one part is its own combine: out = acc * (1 / l), the combine's
        // arithmetic for one part (weight exp2(m - m) = 1), written here instead of the part. m_run/l_run
        // are the same in every thread: thread h stores head h's, indexing the registers with compile-time
        // constants only.
        const bool direct = counters != nullptr && used == 1;
        if (direct) {
#pragma unroll
            for (int h = 0; h < HB; h++)
                if (tid == (unsigned int)h && (unsigned int)h < nh) combine_sm.l[h] = 1.f / l_run[h];
        }
        __syncthreads();
        for (unsigned int i = tid; i < nh * d; i += AT_THREADS) {
            const unsigned int h = i / d, c = i % d;
            float s = 0.f;
#pragma unroll
            for (int w = 0; w < AT_WARPS; w++) s += acc_s[w][h][c];
            if (direct) out[((size_t)t * heads + h0 + h) * d + c] = s * combine_sm.l[h];
            else part_of[(size_t)h * splits * pstride + 2 + c] = s;
        }
#pragma unroll
        for (int h = 0; h < HB; h++) {
            if (!direct && tid == (unsigned int)h && (unsigned int)h < nh) {
                part_of[(size_t)h * splits * pstride] = m_run[h];
                part_of[(size_t)h * splits * pstride + 1] = l_run[h];
            }
        }
        // The block's parts end together (acc_s needs no barrier here: the next part's tiles pass one
        // before they write it).
        __syncthreads();
    }
    if (counters == nullptr || used == 1) return;  // attention_combine_kernel follows, or out is written

    // With counters: the last of this token's and head group's blocks to finish combines their heads'
    // parts, which it reads from L2 (its own threads' writes fenced there too).
    const unsigned int arrivals = min(gridDim.x, used);
    __shared__ unsigned int last;
    __threadfence();
    __syncthreads();
    if (arrivals > 1) {
        if (tid == 0) {
            unsigned int *count = counters + (size_t)t * gridDim.y + blockIdx.y;
            last = atomicAdd(count, 1u) == arrivals - 1;
            if (last) *count = 0;  // every block of the group has arrived: ready for the next launch
        }
        __syncthreads();
        if (!last) return;
        __threadfence();  // the other blocks' parts are visible from here on
    }
    for (unsigned int h = 0; h < nh; h++) combine_parts(partial, heads, d, splits, used, t, h0 + h, out, combine_sm);
}

// The parts' combine as a kernel of its own (a launch without arrival counters): block (h, t).
__global__ void attention_combine_kernel(const float *__restrict__ partial, unsigned int heads, unsigned int d,
                                         unsigned int window, unsigned int splits, const int *__restrict__ pos,
                                         float *__restrict__ out) {
    __shared__ CombineSmem sm;
    he::pdl_wait();  // the parts come from the split kernel (launched overlapped)
    he::pdl_launch_dependents();
    const unsigned int h = blockIdx.x, t = blockIdx.y;
    // The split kernel's cut: the parts past the context are empty (min: w_s's bound, whatever the cut).
    const unsigned int ctx = context_of(pos[t]);
    const unsigned int used = min(splits, context_cut(ctx - seen_of(ctx, window).from, splits).used);
    combine_parts(partial, heads, d, splits, used, t, h, out, sm);
}

// One launch's arguments, passed down to the kernel chosen for them.
struct SplitArgs {
    const float *q;
    unsigned int q_stride;
    const unsigned char *pool;
    const unsigned int *const *tables;
    unsigned int pool_pages;
    int k_type, v_type;
    const int *pos;
    unsigned int heads, kv_heads, d;
    float scale_log2;
    unsigned int window;
    unsigned int splits;
    float *partial;
    float *out;
    unsigned int *counters;
    hostembed_tuning tuning;
};

// Launches of at least this many blocks whose grid gives a token fewer blocks than parts (a short longest
// context: at most 2,048 positions with 32 parts, parts of 128) take the kernel capped for AT_WIDE_BLOCKS
// blocks a multiprocessor; hostembed_tuning's attention_blocks 1 never, 2 always, to measure. H100,
// Llama-3-8B shape in F16 (BENCHMARKS.md): 64 streams at 512-token caches (2,048 blocks of 128
// positions) at least 3,684 -> 3,807 tok/s; one stream at a 16,384-token cache (256 blocks of 512
// positions) 131.4 -> 122.5 on the wide kernel, so long parts keep the other.
constexpr unsigned long long AT_WIDE_AFTER = 1024;
// Launches of fewer blocks than this split their query heads further (hostembed_attention).
constexpr size_t AT_FEW_BLOCKS = 64;

template <int D, int HB, int KT, int VT>
cudaError_t launch_split(dim3 grid, const SplitArgs &a, cudaStream_t stream) {
    const unsigned long long blocks = (unsigned long long)grid.x * grid.y * grid.z;
    const bool wide = a.tuning.attention_blocks == 0 ? blocks >= AT_WIDE_AFTER && grid.x < a.splits
                                                     : a.tuning.attention_blocks == 2;
    auto go = [&](auto kernel) {
        return he::launch_overlapped(a.tuning, kernel, grid, dim3(AT_THREADS), 0, stream, a.q, a.q_stride, a.pool,
                                     a.tables, a.pool_pages, a.k_type, a.v_type, a.pos, a.heads, a.kv_heads, a.d,
                                     a.scale_log2, a.window, a.splits, a.partial, a.out, a.counters);
    };
    // The wide kernel for the head sizes and head groups whose registers fit its cap without spilling.
    if constexpr (D <= 128 && HB <= 4)
        if (wide) return go(attention_split_kernel<D, HB, KT, VT, AT_WIDE_BLOCKS>);
    return go(attention_split_kernel<D, HB, KT, VT>);
}

// The kernel for K and V of one type, or the run-time reader's (Reader<0>) for any other pair.
template <int D, int HB>
cudaError_t launch_types(dim3 grid, const SplitArgs &a, cudaStream_t stream) {
    const int pair = a.k_type == a.v_type ? a.k_type : 0;
    switch (pair) {
    case HE_KV_BF16: return launch_split<D, HB, HE_KV_BF16, HE_KV_BF16>(grid, a, stream);
    case HE_KV_F16: return launch_split<D, HB, HE_KV_F16, HE_KV_F16>(grid, a, stream);
    case HE_KV_Q8_0: return launch_split<D, HB, HE_KV_Q8_0, HE_KV_Q8_0>(grid, a, stream);
    case HE_KV_FP8_E4M3: return launch_split<D, HB, HE_KV_FP8_E4M3, HE_KV_FP8_E4M3>(grid, a, stream);
    default: return launch_split<D, HB, 0, 0>(grid, a, stream);
    }
}

template <int D>
cudaError_t launch_d(unsigned int hb, unsigned int n, unsigned int grid_parts, const SplitArgs &a,
                     cudaStream_t stream) {
    const unsigned int group = a.heads / a.kv_heads;
    const dim3 grid(grid_parts, a.kv_heads * ((group + hb - 1) / hb), n);
    switch (hb) {
    case 1: return launch_types<D, 1>(grid, a, stream);
    case 2: return launch_types<D, 2>(grid, a, stream);
    case 4: return launch_types<D, 4>(grid, a, stream);
    default: return launch_types<D, (D > 128 ? 4 : 8)>(grid, a, stream);
    }
}

}  // namespace

extern "C" cudaError_t hostembed_attention_combined(const float *q, unsigned int q_stride, const void *kv_pool,
                                                    const unsigned int *const *tables, unsigned int pool_pages,
                                                    int k_type, int v_type, const int *pos, unsigned int n,
                                                    unsigned int heads, unsigned int kv_heads, unsigned int head_dim,
                                                    float scale, unsigned int window, unsigned int splits,
                                                    unsigned int grid_parts, float *partial, float *out,
                                                    unsigned int *counters, hostembed_tuning tuning,
                                                    cudaStream_t stream) {
    if (q == nullptr || kv_pool == nullptr || tables == nullptr || pos == nullptr || partial == nullptr ||
        out == nullptr)
        return cudaErrorInvalidValue;
    if (heads == 0 || kv_heads == 0 || heads % kv_heads != 0 || head_dim == 0 || head_dim % 8 != 0 ||
        head_dim > 256 || pool_pages == 0 || splits == 0 || splits > AT_MAX_SPLITS || grid_parts == 0 ||
        grid_parts > splits || n > 65535)
        return cudaErrorInvalidValue;
    if (!he::kv_type_ok(k_type, head_dim) || !he::kv_type_ok(v_type, head_dim)) return cudaErrorInvalidValue;
    if ((size_t)q_stride < (size_t)heads * head_dim) return cudaErrorInvalidValue;
    if (reinterpret_cast<uintptr_t>(kv_pool) % 16 != 0) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    const unsigned int group = heads / kv_heads;
    const unsigned int cap = head_dim > 128 ? 4 : 8;  // heads per block: keeps HB * D * 4 warps of smem at 16 KB
    unsigned int hb = 1;
    while (hb < group && hb < cap) hb *= 2;
    // A launch of few blocks (one stream's short context: one part of each kv head) takes fewer query heads
    // a block, down to one, so that more multiprocessors share its latency: each head's products, softmax
    // and sums are the same instructions in any group, so the same bits.
    auto blocks = [&](unsigned int h) { return (size_t)kv_heads * ((group + h - 1) / h) * n * grid_parts; };
    while (hb > 1 && blocks(hb) < AT_FEW_BLOCKS) hb /= 2;
    if ((size_t)kv_heads * ((group + hb - 1) / hb) > 65535) return cudaErrorInvalidValue;
    const SplitArgs a{q,        q_stride, static_cast<const unsigned char *>(kv_pool), tables, pool_pages, k_type,
                      v_type,   pos,      heads,    kv_heads,        head_dim,    scale * LOG2E, window,
                      splits,   partial,  out,      counters,        tuning};
    const cudaError_t err = head_dim <= 64    ? launch_d<64>(hb, n, grid_parts, a, stream)
                            : head_dim <= 128 ? launch_d<128>(hb, n, grid_parts, a, stream)
                                              : launch_d<256>(hb, n, grid_parts, a, stream);
    if (err != cudaSuccess || counters != nullptr) return err;
    return he::launch_overlapped(tuning, attention_combine_kernel, dim3(heads, n), dim3(128), 0, stream, partial,
                                 heads, head_dim, window, splits, pos, out);
}

extern "C" cudaError_t hostembed_attention(const float *q, unsigned int q_stride, const void *kv_pool,
                                           const unsigned int *const *tables, unsigned int pool_pages, int k_type,
                                           int v_type, const int *pos, unsigned int n, unsigned int heads,
                                           unsigned int kv_heads, unsigned int head_dim, float scale,
                                           unsigned int window, unsigned int splits, unsigned int grid_parts,
                                           float *partial, float *out, hostembed_tuning tuning, cudaStream_t stream) {
    return hostembed_attention_combined(q, q_stride, kv_pool, tables, pool_pages, k_type, v_type, pos, n, heads,
                                        kv_heads, head_dim, scale, window, splits, grid_parts, partial, out, nullptr,
                                        tuning, stream);
}
