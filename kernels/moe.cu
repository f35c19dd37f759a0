// The Mixture-of-Experts feed-forward: the router's logits, each row's top-k and their weights, the
// (row, slot) pairs grouped by expert, each chosen expert's SwiGLU and down product, and each row's
// weighted sum onto the residual, all on the device (nothing read back, so a decode pass captures into a
// graph), reading only the chosen experts' matrices: an expert's rows by the blocks of its group alone,
// which serve every row that chose it (its tiles of tokens after the first read them through the caches).
//
// Every product is one warp a matrix row: lane l takes the row's pieces l, l + 32, ... (a format's 16-byte
// chunks, or its 32-value units decoded in registers, or single values where the alignment allows neither),
// each piece's products added to one f32 chain a token in column order, then warp_sum. A block holds one
// read of a piece for up to TILE tokens of its group; each token's chain is the same instructions whatever
// the tile and the group hold, so a row's results depend on its own inputs and the shapes only, and a
// stream's bits are the same in any batch. src/cpu/moe.rs is the same computation on the CPU (its choice
// and weights, its order of the experts' sum).
#include "formats.cuh"
#include "moe.cuh"

namespace {

constexpr unsigned MOE_WARPS = 8;
constexpr unsigned MOE_THREADS = MOE_WARPS * 32;
// Tokens that share one read of a weight piece; a group's last tokens (fewer than a tile) go one at a time.
constexpr int TILE = 4;
// A group's slots a block takes (grid z cuts a group into slices of them, so an expert that many rows
// chose keeps many blocks busy).
constexpr unsigned SLICE = 256;
// The router's tokens a block: its tiles share each row's reads.
constexpr unsigned ROUTER_TOKENS = 16;
// Grid rows at most (the y dimension's limit); a launch of more loops over them.
constexpr unsigned MAX_GRID_Y = 65535;
// The route-and-group kernel is one block, its count and start tables in shared memory.
constexpr unsigned GROUP_THREADS = 1024;
constexpr unsigned MAX_EXPERTS = 1024;

// A row read in chunks (kernels/formats.cuh's Chunk readers, and ByValue for any format at any alignment).
template <typename F>
struct ChunkReader {
    using Raw = typename F::Chunk;
    static constexpr int N = F::CHUNK_VALUES;
    // Pieces a lane loads before their arithmetic (half of it when two matrices are read).
    static constexpr int U = N >= 8 ? 4 : 8;
    static __device__ __forceinline__ unsigned pieces(unsigned cols) { return F::slots(cols); }
    static __device__ __forceinline__ unsigned whole(unsigned cols) { return F::whole_slots(cols); }
    static __device__ __forceinline__ bool has(unsigned p, unsigned cols) { return F::has(p, cols); }
    static __device__ __forceinline__ size_t column(unsigned p) { return F::column(p); }
    static __device__ __forceinline__ Raw load(const unsigned char *row, unsigned p) { return F::load_chunk(row, p, 0); }
    static __device__ __forceinline__ void decode(const Raw &r, float *w) { F::decode(r, w); }
};

// A block format's row read a 32-value unit a lane straight from memory (blocks 2-byte aligned, 4-byte where
// the block size is a multiple of 4); each unit's values decoded as the staged matrix-vector product does.
template <typename F>
struct UnitReader {
    struct Raw {
        float v[he::UNIT_VALUES];
    };
    static constexpr int N = he::UNIT_VALUES;
    static constexpr int U = 1;  // a unit is 32 values in registers already
    static __device__ __forceinline__ unsigned pieces(unsigned cols) { return cols / he::UNIT_VALUES; }
    static __device__ __forceinline__ unsigned whole(unsigned cols) { return pieces(cols); }
    static __device__ __forceinline__ bool has(unsigned, unsigned) { return true; }
    static __device__ __forceinline__ size_t column(unsigned p) { return (size_t)p * he::UNIT_VALUES; }
    static __device__ __forceinline__ Raw load(const unsigned char *row, unsigned p) {
        Raw r;
        he::decode_unit<F>(row + (size_t)(p / F::UNITS) * F::BLOCK_BYTES, p % F::UNITS, r.v);
        return r;
    }
    static __device__ __forceinline__ void decode(const Raw &r, float *w) {
#pragma unroll
        for (int i = 0; i < N; i++) w[i] = r.v[i];
    }
};

// One piece of weights (w, and w2 for GLU) against T tokens' activations at column `col`: each token's
// chain takes the piece's values in order (4 at a time for every token, so few activations are live).
template <int N, int T, bool GLU>
__device__ __forceinline__ void piece_dot(const float *w, const float *w2, const float *const (&xs)[T], size_t col,
                                          float (&acc)[T], float (&acc2)[T]) {
    constexpr int STEP = N % 4 == 0 ? 4 : N;
#pragma unroll
    for (int i0 = 0; i0 < N; i0 += STEP) {
#pragma unroll
        for (int t = 0; t < T; t++) {
            float xf[STEP];
            he::load_x<STEP>(xs[t] + col + i0, xf);
#pragma unroll
            for (int i = 0; i < STEP; i++) {
                acc[t] = fmaf(w[i0 + i], xf[i], acc[t]);
                if (GLU) acc2[t] = fmaf(w2[i0 + i], xf[i], acc2[t]);
            }
        }
    }
}

// This lane's part of row . x[t] (and row2 . x[t] for GLU) for T tokens: pieces lane, lane + 32, ... in
// order, U of them loaded before their arithmetic, then the tail one at a time. The lane's sums only; the
// caller reduces the warp.
template <typename R, int T, bool GLU>
__device__ __forceinline__ void lane_dots(const unsigned char *row, const unsigned char *row2, unsigned cols,
                                          const float *const (&xs)[T], float (&acc)[T], float (&acc2)[T]) {
    constexpr int N = R::N, U = GLU ? (R::U / 2 > 0 ? R::U / 2 : 1) : R::U;
    using Raw = typename R::Raw;
    const unsigned whole = R::whole(cols), pieces = R::pieces(cols);
    unsigned p = threadIdx.x % 32;
    for (; p + 32 * (U - 1) < whole; p += 32 * U) {
        Raw raw[U], raw2[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            raw[u] = R::load(row, p + 32 * u);
            if (GLU) raw2[u] = R::load(row2, p + 32 * u);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            float w[N], w2[N];
            R::decode(raw[u], w);
            if (GLU) R::decode(raw2[u], w2);
            piece_dot<N, T, GLU>(w, w2, xs, R::column(p + 32 * u), acc, acc2);
        }
    }
    for (; p < pieces; p += 32) {
        if (!R::has(p, cols)) continue;
        float w[N], w2[N];
        R::decode(R::load(row, p), w);
        if (GLU) R::decode(R::load(row2, p), w2);
        piece_dot<N, T, GLU>(w, w2, xs, R::column(p), acc, acc2);
    }
}

// The warp's T sums of row . x[t] (and of row2's), in every lane.
template <typename R, int T, bool GLU>
__device__ __forceinline__ void warp_dots(const unsigned char *row, const unsigned char *row2, unsigned cols,
                                          const float *const (&xs)[T], float (&acc)[T], float (&acc2)[T]) {
#pragma unroll
    for (int t = 0; t < T; t++) acc[t] = acc2[t] = 0.f;
    lane_dots<R, T, GLU>(row, row2, cols, xs, acc, acc2);
#pragma unroll
    for (int t = 0; t < T; t++) {
        acc[t] = he::warp_sum(acc[t]);
        if (GLU) acc2[t] = he::warp_sum(acc2[t]);
    }
}

using Groups = he::MoeGroups;

// Warps a router row's columns are cut among (where the cut falls on whole blocks at the reader's
// alignment): one stream's 128 experts then fill 64 blocks, not 16.
constexpr unsigned ROUTER_PARTS = 4;

// One block: first each row's k largest logits (ties to the lower index) and their softmax weights in
// f64, as src/cpu/moe.rs's `choose` (a warp a row: k rounds of a warp arg-max over the lanes' experts
// lane, lane + 32, ...; lane b keeps the b-th pick), written in ascending expert order; then the slots
// grouped by expert (counts, their prefix sums, the slots scattered to their places). A slot's place
// within its group is the order of arrival: it changes no bits (see the file's note).
// PER: experts a lane holds (experts <= 32 * PER).
// THREADS: the block's (the loops' strides). The logits are read past L1 (the router's last block to
// finish reads the other blocks').
template <unsigned PER, unsigned THREADS>
__device__ __forceinline__ void route_rows(const float *logits, unsigned experts, unsigned n, unsigned k,
                                           int norm_topk, int *ids, float *__restrict__ weights,
                                           int *__restrict__ groups) {
    constexpr unsigned NONE = 0xFFFFFFFFu;
    const unsigned lane = threadIdx.x % 32;
    for (unsigned r = threadIdx.x / 32; r < n; r += THREADS / 32) {
        const float *l = logits + (size_t)r * experts;
        float v[PER];
#pragma unroll
        for (unsigned i = 0; i < PER; i++) v[i] = 32 * i + lane < experts ? __ldcg(l + 32 * i + lane) : 0.f;
        unsigned taken = 0, pick = NONE;
        float max = 0.f;
        for (unsigned b = 0; b < k; b++) {
            float bv = 0.f;
            unsigned be = NONE;
#pragma unroll
            for (unsigned i = 0; i < PER; i++) {
                const unsigned e = 32 * i + lane;
                if (e < experts && !(taken >> i & 1u) && (be == NONE || v[i] > bv)) bv = v[i], be = e;
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                const unsigned oe = __shfl_xor_sync(0xffffffffu, be, o);
                if (oe != NONE && (be == NONE || ov > bv || (ov == bv && oe < be))) bv = ov, be = oe;
            }
            if (lane == b) pick = be;
            if (be % 32 == lane) taken |= 1u << (be / 32);
            if (b == 0) max = bv;
        }
        // The softmax's terms in f64: the picks' (in pick order) or every expert's (each lane's, then the
        // warp's tree); the same order for a row in any batch.
        const double share = pick != NONE ? exp((double)__ldcg(l + pick) - (double)max) : 0.0;
        double total = 0.0;
        if (norm_topk) {
            for (unsigned b = 0; b < k; b++) total += __shfl_sync(0xffffffffu, share, b);
        } else {
#pragma unroll
            for (unsigned i = 0; i < PER; i++)
                if (32 * i + lane < experts) total += exp((double)v[i] - (double)max);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
        }
        // Lane b's place among the picks in ascending expert order.
        unsigned rank = 0;
        for (unsigned b = 0; b < k; b++) rank += __shfl_sync(0xffffffffu, pick, b) < pick;
        if (pick != NONE) {
            ids[(size_t)r * k + rank] = (int)pick;
            weights[(size_t)r * k + rank] = (float)(share / total);
        }
    }

    __shared__ unsigned count[MAX_EXPERTS], place[MAX_EXPERTS];
    const unsigned slots = n * k;
    for (unsigned e = threadIdx.x; e < experts; e += THREADS) count[e] = 0;
    __syncthreads();  // also: every row's ids are written (the block's global writes seen by the block)
    for (unsigned s = threadIdx.x; s < slots; s += THREADS) atomicAdd(&count[ids[s]], 1u);
    __syncthreads();
    if (threadIdx.x < 32) {
        // Lane l takes a run of experts: its sums, scanned across the warp, give each expert's first place
        // and each chosen expert's rank among the chosen.
        const unsigned lane = threadIdx.x, per = (experts + 31) / 32;
        const unsigned lo = min(lane * per, experts), hi = min(lo + per, experts);
        unsigned sum = 0, chosen = 0;
        for (unsigned e = lo; e < hi; e++) sum += count[e], chosen += count[e] != 0;
        unsigned sums = sum, chosens = chosen;
#pragma unroll
        for (unsigned d = 1; d < 32; d *= 2) {
            const unsigned a = __shfl_up_sync(0xffffffffu, sums, d), b = __shfl_up_sync(0xffffffffu, chosens, d);
            if (lane >= d) sums += a, chosens += b;
        }
        unsigned at = sums - sum, rank = chosens - chosen;
        for (unsigned e = lo; e < hi; e++) {
            place[e] = at;
            groups[1 + experts + e] = (int)at;
            groups[1 + 2 * experts + e] = (int)count[e];
            if (count[e] != 0) groups[1 + rank++] = (int)e;
            at += count[e];
        }
        if (lane == 31) groups[0] = (int)chosens;
    }
    __syncthreads();
    int *list = groups + 1 + 3 * experts;
    for (unsigned s = threadIdx.x; s < slots; s += THREADS) list[atomicAdd(&place[ids[s]], 1u)] = (int)s;
}

template <unsigned PER>
__global__ void __launch_bounds__(GROUP_THREADS)
    route_kernel(const float *__restrict__ logits, unsigned experts, unsigned n, unsigned k, int norm_topk,
                 int *ids, float *__restrict__ weights, int *__restrict__ groups) {
    route_rows<PER, GROUP_THREADS>(logits, experts, n, k, norm_topk, ids, weights, groups);
}

// What the router's last block to finish does after the logits (ROUTE_PER > 0): route_rows over rows
// [0, n) with `counter` (zero before, left zero) counting the blocks' arrivals.
struct RouteTail {
    unsigned n, k;
    int norm_topk;
    int *ids;
    float *weights;
    int *groups;
    unsigned *counter;
};

// logits[r][j] = row j . x[r]: warp w of a block takes part w % PARTS of row blockIdx.x * (MOE_WARPS /
// PARTS) + w / PARTS, and the part sums are added in part order (the cut depends on the shape alone).
// ROUTE_PER > 0: then the last block to finish routes the tail's rows (route_rows<ROUTE_PER>).
template <typename R, unsigned PARTS, unsigned ROUTE_PER>
__global__ void __launch_bounds__(MOE_THREADS, 2) router_kernel(const unsigned char *__restrict__ w, size_t rb,
                                                               unsigned experts, unsigned cols,
                                                               const float *__restrict__ x, unsigned n,
                                                               float *__restrict__ logits, RouteTail tail) {
    constexpr unsigned ROWS = MOE_WARPS / PARTS;
    __shared__ float sums[MOE_WARPS][TILE];
    const unsigned warp = threadIdx.x / 32, part = warp % PARTS, lane = threadIdx.x % 32;
    const unsigned j = blockIdx.x * ROWS + warp / PARTS, part_cols = cols / PARTS;
    const bool here = j < experts;
    const unsigned char *row = w + (size_t)(here ? j : 0) * rb + part * (rb / PARTS);
    // Every warp reaches the block's barriers; only rows of the matrix are written.
    auto finish = [&](unsigned r, unsigned count, const float *acc) {
        if (PARTS == 1) {
            if (here && lane == 0)
                for (unsigned t = 0; t < count; t++) logits[(size_t)(r + t) * experts + j] = acc[t];
            return;
        }
        if (lane == 0)
            for (unsigned t = 0; t < count; t++) sums[warp][t] = acc[t];
        __syncthreads();
        if (here && part == 0 && lane < count) {
            float v = sums[warp][lane];
            for (unsigned q = 1; q < PARTS; q++) v += sums[warp + q][lane];
            logits[(size_t)(r + lane) * experts + j] = v;
        }
        __syncthreads();
    };
    for (unsigned r0 = blockIdx.y * ROUTER_TOKENS; r0 < n; r0 += gridDim.y * ROUTER_TOKENS) {
        const unsigned end = min(n, r0 + ROUTER_TOKENS);
        unsigned r = r0;
        for (; r + TILE <= end; r += TILE) {
            const float *xs[TILE];
            float acc[TILE], none[TILE];
#pragma unroll
            for (int t = 0; t < TILE; t++) xs[t] = x + (size_t)(r + t) * cols + part * part_cols;
            warp_dots<R, TILE, false>(row, nullptr, part_cols, xs, acc, none);
            finish(r, TILE, acc);
        }
        for (; r < end; r++) {
            const float *xs[1] = {x + (size_t)r * cols + part * part_cols};
            float acc[1], none[1];
            warp_dots<R, 1, false>(row, nullptr, part_cols, xs, acc, none);
            finish(r, 1, acc);
        }
    }
    if constexpr (ROUTE_PER > 0) {
        __shared__ unsigned last;
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            last = atomicAdd(tail.counter, 1u) == gridDim.x * gridDim.y - 1;
            if (last) *tail.counter = 0;  // every block has arrived: ready for the next launch
        }
        __syncthreads();
        if (!last) return;
        __threadfence();  // the other blocks' logits are visible from here on
        route_rows<ROUTE_PER, MOE_THREADS>(logits, experts, tail.n, tail.k, tail.norm_topk, tail.ids, tail.weights,
                                           tail.groups);
    }
}


// act[s * width + j] = silu(G_e[j] . x[s / k]) * (U_e[j] . x[s / k]) for T slots of expert e's group.
template <typename R, int T>
__device__ __forceinline__ void gate_up_tile(const unsigned char *g, const unsigned char *u, unsigned cols,
                                             const float *x, const int *slots, unsigned k, unsigned width,
                                             unsigned j, float *act) {
    const float *xs[T];
    int s[T];
#pragma unroll
    for (int t = 0; t < T; t++) s[t] = slots[t], xs[t] = x + (size_t)((unsigned)s[t] / k) * cols;
    float gs[T], us[T];
    warp_dots<R, T, true>(g, u, cols, xs, gs, us);
    if (threadIdx.x % 32 == 0) {
#pragma unroll
        for (int t = 0; t < T; t++) act[(size_t)s[t] * width + j] = he::silu(gs[t]) * us[t];
    }
}

// Block (x, a, z): rows x * MOE_WARPS.. of the a-th chosen expert's gate and up, a warp a row, for slice z
// of its group.
template <typename R>
__global__ void __launch_bounds__(MOE_THREADS, 2)
    gate_up_kernel(const unsigned char *__restrict__ gate, const unsigned char *__restrict__ up, size_t expert_bytes,
                   size_t rb, unsigned width, unsigned cols, const float *__restrict__ x, const int *__restrict__ groups,
                   unsigned experts, unsigned k, float *__restrict__ act) {
    const Groups g{groups, experts};
    const unsigned j = blockIdx.x * MOE_WARPS + threadIdx.x / 32;
    if (blockIdx.y >= g.active() || j >= width) return;
    const unsigned e = g.expert(blockIdx.y), count = g.count(e);
    const int *slots = g.list() + g.start(e);
    const size_t at = (size_t)e * expert_bytes + j * rb;
    for (unsigned first = blockIdx.z * SLICE; first < count; first += gridDim.z * SLICE) {
        const unsigned end = min(count, first + SLICE);
        unsigned i = first;
        for (; i + TILE <= end; i += TILE) gate_up_tile<R, TILE>(gate + at, up + at, cols, x, slots + i, k, width, j, act);
        for (; i < end; i++) gate_up_tile<R, 1>(gate + at, up + at, cols, x, slots + i, k, width, j, act);
    }
}

// out[s * rows + j] = D_e[j] . act[s * cols..] for T slots of expert e's group.
template <typename R, int T>
__device__ __forceinline__ void down_tile(const unsigned char *d, unsigned cols, const float *act, const int *slots,
                                          unsigned rows, unsigned j, float *out) {
    const float *xs[T];
    int s[T];
#pragma unroll
    for (int t = 0; t < T; t++) s[t] = slots[t], xs[t] = act + (size_t)s[t] * cols;
    float os[T], none[T];
    warp_dots<R, T, false>(d, nullptr, cols, xs, os, none);
    if (threadIdx.x % 32 == 0) {
#pragma unroll
        for (int t = 0; t < T; t++) out[(size_t)s[t] * rows + j] = os[t];
    }
}

template <typename R>
__global__ void __launch_bounds__(MOE_THREADS, 2)
    down_kernel(const unsigned char *__restrict__ down, size_t expert_bytes, size_t rb, unsigned rows, unsigned cols,
                const float *__restrict__ act, const int *__restrict__ groups, unsigned experts,
                float *__restrict__ out) {
    const Groups g{groups, experts};
    const unsigned j = blockIdx.x * MOE_WARPS + threadIdx.x / 32;
    if (blockIdx.y >= g.active() || j >= rows) return;
    const unsigned e = g.expert(blockIdx.y), count = g.count(e);
    const int *slots = g.list() + g.start(e);
    const unsigned char *row = down + (size_t)e * expert_bytes + j * rb;
    for (unsigned first = blockIdx.z * SLICE; first < count; first += gridDim.z * SLICE) {
        const unsigned end = min(count, first + SLICE);
        unsigned i = first;
        for (; i + TILE <= end; i += TILE) down_tile<R, TILE>(row, cols, act, slots + i, rows, j, out);
        for (; i < end; i++) down_tile<R, 1>(row, cols, act, slots + i, rows, j, out);
    }
}

// x[r * rows + j] += the sum over the row's slots in order (ascending expert ids) of weight * output.
__global__ void sum_kernel(const float *__restrict__ out, const float *__restrict__ weights, unsigned rows, unsigned n,
                           unsigned k, float *__restrict__ x) {
    const size_t len = (size_t)n * rows;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < len; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / rows, j = i % rows;
        float sum = 0.f;
        for (unsigned s = 0; s < k; s++) sum = fmaf(out[(r * k + s) * rows + j], weights[r * k + s], sum);
        x[i] += sum;
    }
}

__global__ void widen_kernel(const unsigned short *__restrict__ x, int dtype, float *__restrict__ out, size_t len) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < len; i += (size_t)gridDim.x * blockDim.x)
        out[i] = dtype == HE_DTYPE_BF16 ? __uint_as_float((unsigned)x[i] << 16) : he::f16_bits_to_f32(x[i]);
}

bool aligned(const void *p, uintptr_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; }

// Calls fn(Reader{}) with the fastest reader of format F that the matrices at `w` and `w2` (w2 may be NULL),
// each a stack of experts `stride` bytes apart, and the activations at `x` (rows of `cols`) allow: chunks,
// else units, else one value at a time.
template <typename F, typename Fn>
void with_reader(const void *w, const void *w2, size_t stride, unsigned cols, const float *x, Fn &&fn) {
    const bool x_fits = aligned(x, 16) && cols % 4 == 0;
    auto every = [&](auto fits) {
        for (const void *m : {w, w2})
            if (m != nullptr && !(fits(m) && fits(static_cast<const unsigned char *>(m) + stride))) return false;
        return true;
    };
    if constexpr (he::HasChunks<F>::value) {
        if (x_fits && every([&](const void *m) { return F::chunks_fit(m, cols); })) return fn(ChunkReader<F>{});
    } else if constexpr (he::HasUnits<F>::value) {
        // A block format's fields sit at 4-byte boundaries in every block when its block is a multiple of 4.
        constexpr uintptr_t field_align = F::BLOCK_BYTES % 4 == 0 ? 4 : 2;
        if (x_fits && every([&](const void *m) { return aligned(m, field_align); })) return fn(UnitReader<F>{});
    }
    fn(ChunkReader<he::ByValue<F>>{});
}

unsigned blocks_for(unsigned outputs) { return (outputs + MOE_WARPS - 1) / MOE_WARPS; }

// A grouped product's grid: blocks of rows, by the experts chosen at most (n * k, or every expert), by
// slices of a group (a row chooses an expert once, so a group holds n slots at most).
dim3 groups_grid(unsigned outputs, unsigned n, unsigned k, unsigned experts) {
    const size_t chosen = (size_t)n * k;
    const unsigned slices = (n + SLICE - 1) / SLICE;
    return dim3(blocks_for(outputs), (unsigned)(chosen < experts ? chosen : experts),
                slices < MAX_GRID_Y ? slices : MAX_GRID_Y);
}

}  // namespace

namespace {

// The router's launch, with the route's tail where ROUTE_PER > 0.
template <unsigned ROUTE_PER>
cudaError_t launch_router(const void *router, int dtype, unsigned int experts, unsigned int cols, const float *x,
                          unsigned int n, float *logits, const RouteTail &tail, cudaStream_t stream) {
    cudaError_t err = cudaErrorInvalidValue;
    he::with_format(dtype, [&](auto f) {
        using F = decltype(f);
        const size_t rb = he::row_bytes<F>(cols);
        if (rb == 0) return;
        const unsigned tiles = (n + ROUTER_TOKENS - 1) / ROUTER_TOKENS;
        const unsigned grid_y = tiles < MAX_GRID_Y ? tiles : MAX_GRID_Y;
        // Parts of whole blocks whose starts keep a 16-byte chunk reader's alignment (else one part a row).
        const size_t part_bytes = rb / ROUTER_PARTS;
        if (cols % (ROUTER_PARTS * F::BLOCK_VALUES) == 0 && part_bytes % 16 == 0 && (cols / ROUTER_PARTS) % 4 == 0) {
            with_reader<F>(router, nullptr, rb, cols / ROUTER_PARTS, x, [&](auto r) {
                const dim3 grid((experts + MOE_WARPS / ROUTER_PARTS - 1) / (MOE_WARPS / ROUTER_PARTS), grid_y);
                router_kernel<decltype(r), ROUTER_PARTS, ROUTE_PER><<<grid, MOE_THREADS, 0, stream>>>(
                    (const unsigned char *)router, rb, experts, cols, x, n, logits, tail);
            });
        } else {
            with_reader<F>(router, nullptr, rb, cols, x, [&](auto r) {
                router_kernel<decltype(r), 1, ROUTE_PER><<<dim3(blocks_for(experts), grid_y), MOE_THREADS, 0, stream>>>(
                    (const unsigned char *)router, rb, experts, cols, x, n, logits, tail);
            });
        }
        err = cudaGetLastError();
    });
    return err;
}

// The experts a lane holds in the router's route tail (experts <= 32 * ROUTE_TAIL_PER).
constexpr unsigned ROUTE_TAIL_PER = 8;

}  // namespace

extern "C" cudaError_t hostembed_moe_router(const void *router, int dtype, unsigned int experts, unsigned int cols,
                                            const float *x, unsigned int n, float *logits, cudaStream_t stream) {
    if (router == nullptr || x == nullptr || logits == nullptr || experts == 0 || cols == 0) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    return launch_router<0>(router, dtype, experts, cols, x, n, logits, RouteTail{}, stream);
}

extern "C" cudaError_t hostembed_moe_router_route(const void *router, int dtype, unsigned int experts,
                                                  unsigned int cols, const float *x, unsigned int n, float *logits,
                                                  unsigned int route_n, unsigned int k, int norm_topk, int *ids,
                                                  float *weights, int *groups, unsigned int *counter,
                                                  cudaStream_t stream) {
    if (router == nullptr || x == nullptr || logits == nullptr || experts == 0 || cols == 0 || ids == nullptr ||
        weights == nullptr || groups == nullptr || counter == nullptr || k == 0 || k > experts || k > 32 ||
        route_n > n)
        return cudaErrorInvalidValue;
    if (experts > 32 * ROUTE_TAIL_PER) return cudaErrorNotSupported;
    if (n == 0) return cudaSuccess;
    const RouteTail tail{route_n, k, norm_topk, ids, weights, groups, counter};
    return launch_router<ROUTE_TAIL_PER>(router, dtype, experts, cols, x, n, logits, tail, stream);
}

extern "C" cudaError_t hostembed_moe_route(const float *logits, unsigned int experts, unsigned int n, unsigned int k,
                                           int norm_topk, int *ids, float *weights, int *groups, cudaStream_t stream) {
    if (logits == nullptr || ids == nullptr || weights == nullptr || groups == nullptr || k == 0 || k > experts ||
        k > 32 || experts > MAX_EXPERTS)
        return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    // Each lane's experts in registers: as few as the count needs.
    auto kernel = experts <= 128 ? route_kernel<4> : experts <= 256 ? route_kernel<8> : route_kernel<MAX_EXPERTS / 32>;
    kernel<<<1, GROUP_THREADS, 0, stream>>>(logits, experts, n, k, norm_topk, ids, weights, groups);
    return cudaGetLastError();
}

extern "C" cudaError_t hostembed_moe_gate_up(const void *gate, const void *up, int dtype, size_t expert_bytes,
                                             unsigned int width, unsigned int cols, const float *x, const int *groups,
                                             unsigned int experts, unsigned int n, unsigned int k, float *act,
                                             cudaStream_t stream) {
    if (gate == nullptr || up == nullptr || x == nullptr || groups == nullptr || act == nullptr || width == 0 ||
        cols == 0 || k == 0 || k > experts || experts > MAX_EXPERTS)
        return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    cudaError_t err = cudaErrorInvalidValue;
    he::with_format(dtype, [&](auto f) {
        using F = decltype(f);
        const size_t rb = he::row_bytes<F>(cols);
        if (rb == 0 || expert_bytes < rb * width) return;
        const dim3 grid = groups_grid(width, n, k, experts);
        with_reader<F>(gate, up, expert_bytes, cols, x, [&](auto r) {
            gate_up_kernel<decltype(r)><<<grid, MOE_THREADS, 0, stream>>>((const unsigned char *)gate,
                                                                          (const unsigned char *)up, expert_bytes, rb,
                                                                          width, cols, x, groups, experts, k, act);
        });
        err = cudaGetLastError();
    });
    return err;
}

extern "C" cudaError_t hostembed_moe_down(const void *down, int dtype, size_t expert_bytes, unsigned int rows,
                                          unsigned int cols, const float *act, const int *groups, unsigned int experts,
                                          unsigned int n, unsigned int k, float *out, cudaStream_t stream) {
    if (down == nullptr || act == nullptr || groups == nullptr || out == nullptr || rows == 0 || cols == 0 || k == 0 ||
        k > experts || experts > MAX_EXPERTS)
        return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    cudaError_t err = cudaErrorInvalidValue;
    he::with_format(dtype, [&](auto f) {
        using F = decltype(f);
        const size_t rb = he::row_bytes<F>(cols);
        if (rb == 0 || expert_bytes < rb * rows) return;
        const dim3 grid = groups_grid(rows, n, k, experts);
        with_reader<F>(down, nullptr, expert_bytes, cols, act, [&](auto r) {
            down_kernel<decltype(r)><<<grid, MOE_THREADS, 0, stream>>>((const unsigned char *)down, expert_bytes, rb,
                                                                       rows, cols, act, groups, experts, out);
        });
        err = cudaGetLastError();
    });
    return err;
}

extern "C" cudaError_t hostembed_moe_sum(const float *out, const float *weights, unsigned int rows, unsigned int n,
                                         unsigned int k, float *x, cudaStream_t stream) {
    if (out == nullptr || weights == nullptr || x == nullptr || rows == 0 || k == 0) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    const size_t blocks = ((size_t)n * rows + 255) / 256;
    sum_kernel<<<(unsigned)(blocks < 65535 ? blocks : 65535), 256, 0, stream>>>(out, weights, rows, n, k, x);
    return cudaGetLastError();
}

extern "C" cudaError_t hostembed_widen(const void *x, int dtype, float *out, size_t len, cudaStream_t stream) {
    if (x == nullptr || out == nullptr || (dtype != HE_DTYPE_BF16 && dtype != HE_DTYPE_F16)) return cudaErrorInvalidValue;
    if (len == 0) return cudaSuccess;
    size_t blocks = (len + 255) / 256;
    widen_kernel<<<(unsigned)(blocks < 65535 ? blocks : 65535), 256, 0, stream>>>((const unsigned short *)x, dtype, out,
                                                                                   len);
    return cudaGetLastError();
}
