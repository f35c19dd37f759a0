// A Mixture-of-Experts layer's decode rows on the integer decode product (kernels/mmv_int.cuh): a block
// takes 128 rows (GLU: 64 gate and the same 64 up rows) of one chosen expert, one of its column ranges,
// and up to MOE_MMV_TOKENS of the slots that chose it (blocks past an expert's slots, or past the experts
// chosen, return at once). Each slot stages its activation row as one token of the dense product does,
// and a token's chain never depends on the others', so a slot's outputs are the same bits in any batch;
// the cut of an expert's matrix (moe_mmv_shape) depends on its shape, the experts a token chooses and the
// cut setting only.
// The block formats only (the half formats keep kernels/moe.cu's kernels).
#include "mmv_int.cuh"
#include "moe.cuh"

namespace {

// A block's slots a pass over its weights (four tiles of four tokens).
constexpr unsigned MOE_MMV_TOKENS = 16;
constexpr int MOE_MMV_TILES = MOE_MMV_TOKENS / 4;

// One expert's matrix cut into row blocks and column ranges by `cut` (HE_MOE_CUT_*): FILL as many ranges as
// fill MMV_TARGET_BLOCKS when one token's k experts each take their row blocks, rounded up (Qwen3-30B-A3B's
// gate and up: 12 row blocks x 8 experts x 3 = 288 blocks, one wave and a bit); WAVES rounded down, as the
// dense products' whole_waves (2 ranges, 192 blocks); ONE a single range. FILL takes the most ranges, so the
// workspace is sized by it.
__host__ __device__ inline MmvShape moe_mmv_shape(unsigned rows, unsigned cols, bool glu, unsigned k,
                                                  int cut = HE_MOE_CUT_FILL) {
    const unsigned out_rows = glu ? MMV_BLOCK_ROWS / 2 : MMV_BLOCK_ROWS;
    MmvShape s;
    s.row_blocks = (rows + out_rows - 1) / out_rows;
    const unsigned per = s.row_blocks * k, chunks = (cols + MMV_KC - 1) / MMV_KC;
    unsigned splits = cut == HE_MOE_CUT_ONE     ? 1
                      : cut == HE_MOE_CUT_WAVES ? max(1u, MMV_TARGET_BLOCKS / per)
                      : per >= MMV_TARGET_BLOCKS ? 1
                                                 : (MMV_TARGET_BLOCKS + per - 1) / per;
    splits = splits < chunks ? splits : chunks;
    splits = splits < MMV_MAX_SPLITS ? splits : MMV_MAX_SPLITS;
    s.kr = (chunks + splits - 1) / splits * MMV_KC;
    s.splits = (cols + s.kr - 1) / s.kr;
    return s;
}

// What a down product's blocks do once their rows' outputs are final (x != NULL): each row of the layer
// adds the weighted sum of its k slots' outputs, in slot order, to its row of x (hostembed_moe_sum's
// arithmetic, so the same bits). `counters` (rows x row blocks, zero before, left zero) counts a row's
// slots done for a row block; the k-th (its last expert's block) adds the row's sums for that row block.
struct SumTail {
    const float *weights;
    float *x;
    unsigned k;
    unsigned *counters;
};

// The tail's part for this block's n slots (`slots`), whose outputs (rows of y, `rows` apart) are final.
__device__ __forceinline__ void add_row_sums(const SumTail &tail, const int *slots, unsigned n, const float *y,
                                             unsigned rows) {
    __shared__ unsigned done[MOE_MMV_TOKENS];
    constexpr unsigned NONE = 0xFFFFFFFFu;
    const unsigned tid = threadIdx.x, k = tail.k;
    __threadfence();
    __syncthreads();
    if (tid < n) {
        const unsigned r = (unsigned)slots[tid] / k;
        unsigned *count = tail.counters + (size_t)r * gridDim.x + blockIdx.x;
        const bool last = atomicAdd(count, 1u) == k - 1;
        if (last) *count = 0;  // the row's k slots have arrived: ready for the next launch
        done[tid] = last ? r : NONE;
    }
    __syncthreads();
    __threadfence();  // the row's other slots' outputs are visible from here on
    const unsigned first = blockIdx.x * MMV_BLOCK_ROWS, block_rows = min(MMV_BLOCK_ROWS, rows - first);
    for (unsigned i = 0; i < n; i++) {
        const unsigned r = done[i];
        if (r == NONE) continue;
        for (unsigned j = first + tid; j < first + block_rows; j += MMV_THREADS) {
            float sum = 0.f;
            for (unsigned s = 0; s < k; s++)
                sum = fmaf(__ldcg(y + ((size_t)r * k + s) * rows + j), tail.weights[(size_t)r * k + s], sum);
            tail.x[(size_t)r * rows + j] += sum;
        }
    }
}

// Hints L2 to fetch the rows a down product's block will read (its row block and column range of its
// chosen expert) before its wait: with `early`, the gate and up product's blocks let the down product start
// only after their own wait, so the route two launches back has finished and the experts read here are
// final while the gate and up product still runs. Only a hint: what is read here is clamped into the stack,
// and the product reads everything again after its wait.
template <typename R>
__device__ __forceinline__ void prefetch_expert_rows(const unsigned char *w, size_t expert_bytes, unsigned rows,
                                                     unsigned cols, size_t row_bytes, const MmvShape &shape,
                                                     const he::MoeGroups &g, unsigned a) {
    if (a >= min(g.active(), g.experts)) return;
    const unsigned e = min(g.expert(a), g.experts - 1);
    const unsigned r0 = blockIdx.x * MMV_BLOCK_ROWS;
    if (r0 >= rows) return;
    const unsigned block_rows = min(MMV_BLOCK_ROWS, rows - r0);
    const unsigned k0 = blockIdx.y * shape.kr, k1 = min(cols, k0 + shape.kr);
    const size_t b0 = (size_t)(k0 / R::BLOCK_COLS) * R::BYTES;
    const size_t b1 = (size_t)((k1 + R::BLOCK_COLS - 1) / R::BLOCK_COLS) * R::BYTES;
    constexpr unsigned LINE = 128;
    const unsigned lines = (unsigned)((b1 - b0) / LINE) + 2;  // a row's range may straddle one more line
    const unsigned char *base = w + (size_t)e * expert_bytes + (size_t)r0 * row_bytes;
    for (unsigned i = threadIdx.x; i < block_rows * lines; i += blockDim.x) {
        const unsigned char *row = base + (size_t)(i / lines) * row_bytes;
        const uintptr_t first = reinterpret_cast<uintptr_t>(row + b0) & ~(uintptr_t)(LINE - 1);
        const uintptr_t at = first + (uintptr_t)(i % lines) * LINE;
        if (at < reinterpret_cast<uintptr_t>(row + b1)) asm volatile("prefetch.global.L2 [%0];" ::"l"(at));
    }
}

// Block (x, y, z): row block x, column range y, pass z % passes over chosen expert z / passes's slots.
// Slot s's activations are row s / x_div of x, its outputs row s of y (rows `rows` apart) and of the
// split sums (`slots` rows a split); each (expert, pass) keeps its own arrival counters.
template <typename R, bool GLU, bool STAGED>
__global__ __launch_bounds__(MMV_THREADS, MMVQ_MID_MIN_BLOCKS) void moe_mmvq_kernel(
    const unsigned char *__restrict__ w, const unsigned char *__restrict__ w2, size_t expert_bytes, unsigned rows,
    unsigned cols, size_t row_bytes, MmvShape shape, const float *__restrict__ x, unsigned x_div,
    const int *__restrict__ groups, unsigned experts, unsigned passes, unsigned slots, float *y, float *partial,
    unsigned *counters, SumTail tail, int early) {
    const he::MoeGroups g{groups, experts};
    const unsigned a = blockIdx.z / passes, first = blockIdx.z % passes * MOE_MMV_TOKENS;
    if (GLU && early) {
        // The down product after this one reads the experts before its wait: it starts after the route.
        he::pdl_wait();  // which experts, and which slots, come from the kernel before
        he::pdl_launch_dependents();
    } else {
        he::pdl_launch_dependents();
        if (!GLU && early) prefetch_expert_rows<R>(w, expert_bytes, rows, cols, row_bytes, shape, g, a);
        he::pdl_wait();  // which experts, and which slots, come from the kernel before
    }
    if (a >= g.active()) return;
    const unsigned e = g.expert(a), count = g.count(e);
    if (first >= count) return;
    const unsigned n = min(MOE_MMV_TOKENS, count - first);
    const MmvTokens tk{x, cols, g.list() + g.start(e) + first, x_div, n, MOE_MMV_TOKENS, slots};
    const size_t at = (size_t)e * expert_bytes;
    const bool final = mmvq_body<R, MOE_MMV_TILES, GLU, STAGED>(w + at, GLU ? w2 + at : nullptr, rows, cols, row_bytes,
                                                                shape, tk, nullptr, nullptr, y, rows, partial,
                                                                counters + (size_t)blockIdx.z * shape.row_blocks);
    if (!GLU && tail.x != nullptr && final) add_row_sums(tail, tk.slots, n, y, rows);
}

// The experts a launch may find chosen, and the passes over the most slots one expert can hold (a row
// chooses an expert once, so n).
struct MoeMmvGrid {
    unsigned chosen, passes;
};
inline MoeMmvGrid moe_mmv_grid(unsigned experts, unsigned n, unsigned k) {
    const size_t slots = (size_t)n * k;
    return {(unsigned)(slots < experts ? slots : experts), (n + MOE_MMV_TOKENS - 1) / MOE_MMV_TOKENS};
}

// Whether a stack of experts (each `expert_bytes` after the one before) takes reader R: the dense
// product's shape and alignment for the first, and every expert's rows at the reader's alignment.
template <typename R>
bool moe_mmv_fits(int dtype, const void *w, size_t expert_bytes, unsigned cols) {
    return mmv_fits<R>(dtype, w, cols) && expert_bytes % R::ALIGN == 0;
}

// Calls fn(R{}) for the integer reader of dtype; false where dtype has none.
template <typename Fn>
bool with_int_reader(int dtype, Fn &&fn) {
    bool found = false;
    with_reader(dtype, [&](auto reader) {
        if constexpr (decltype(reader)::INT) {
            found = true;
            fn(reader);
        }
    });
    return found;
}

}  // namespace

extern "C" cudaError_t hostembed_moe_mmv_supports(int dtype, const void *w, size_t expert_bytes, unsigned int cols) {
    bool ok = false;
    const bool has = with_int_reader(dtype, [&](auto r) { ok = moe_mmv_fits<decltype(r)>(dtype, w, expert_bytes, cols); });
    return has && ok ? cudaSuccess : cudaErrorNotSupported;
}

extern "C" cudaError_t hostembed_moe_mmv_workspace(unsigned int rows, unsigned int cols, int glu, unsigned int experts,
                                                   unsigned int n, unsigned int k, size_t *partial_floats,
                                                   unsigned int *counters) {
    if (partial_floats == nullptr || counters == nullptr || rows == 0 || cols == 0 || k == 0 || k > experts)
        return cudaErrorInvalidValue;
    const MmvShape s = moe_mmv_shape(rows, cols, glu != 0, k);
    const MoeMmvGrid grid = moe_mmv_grid(experts, n, k);
    *partial_floats = s.splits > 1 ? (size_t)s.splits * (glu ? 2 : 1) * n * k * rows : 0;
    *counters = s.splits > 1 ? grid.chosen * grid.passes * s.row_blocks : 0;
    return cudaSuccess;
}

namespace {

cudaError_t moe_mmv(const void *w, const void *w2, int dtype, size_t expert_bytes, unsigned int rows, unsigned int cols,
                    const float *x, unsigned int x_div, const int *groups, unsigned int experts, unsigned int n,
                    unsigned int k, float *y, float *partial, unsigned int *counters, const SumTail &tail,
                    hostembed_tuning tuning, cudaStream_t stream) {
    if (w == nullptr || x == nullptr || groups == nullptr || y == nullptr || rows == 0 || cols == 0 || k == 0 ||
        k > experts || x_div == 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0)
        return cudaErrorInvalidValue;
    if (hostembed_moe_mmv_supports(dtype, w, expert_bytes, cols) != cudaSuccess ||
        (w2 != nullptr && hostembed_moe_mmv_supports(dtype, w2, expert_bytes, cols) != cudaSuccess))
        return cudaErrorNotSupported;
    if (n == 0) return cudaSuccess;
    const bool glu = w2 != nullptr;
    const MmvShape shape = moe_mmv_shape(rows, cols, glu, k, tuning.moe_mmv_cut);
    if (shape.splits > 1 && (partial == nullptr || counters == nullptr)) return cudaErrorInvalidValue;
    const MoeMmvGrid mg = moe_mmv_grid(experts, n, k);
    if ((size_t)mg.chosen * mg.passes > 65535) return cudaErrorNotSupported;
    const dim3 grid(shape.row_blocks, shape.splits, mg.chosen * mg.passes);
    cudaError_t err = cudaErrorNotSupported;
    with_int_reader(dtype, [&](auto reader) {
        using R = decltype(reader);
        // Staged where the dense product stages a launch of this many tokens by default (the same bits).
        constexpr bool STAGED = R::STAGE_TOKENS >= MOE_MMV_TOKENS;
        constexpr unsigned GROUP = mmv_group<R, STAGED>();
        constexpr unsigned WEIGHTS = STAGED ? WeightSlots<R, GROUP>::BLOCK_BYTES : 0;
        const unsigned kch = mmv_chunk(MOE_MMV_TOKENS, shape.kr, 2, mmvq_unit(GROUP));
        const int smem = (int)(mmvq_act_bytes(MOE_MMV_TOKENS, kch, mmvq_min_cols<R>()) + WEIGHTS);
        size_t row_bytes = 0;
        he::with_format(dtype, [&](auto format) { row_bytes = he::row_bytes<decltype(format)>(cols); });
        auto go = [&](auto kernel) {
            err = he::allow_smem(kernel, smem);
            if (err != cudaSuccess) return;
            err = he::launch_overlapped(tuning, kernel, grid, dim3(MMV_THREADS), (size_t)smem, stream,
                                        (const unsigned char *)w, (const unsigned char *)w2, expert_bytes, rows, cols,
                                        row_bytes, shape, x, x_div, groups, experts, mg.passes,
                                        n * k, y, partial, counters, tail, tuning.moe_prefetch);
        };
        if (glu) go(moe_mmvq_kernel<R, true, STAGED>);
        else go(moe_mmvq_kernel<R, false, STAGED>);
    });
    return err;
}

}  // namespace

extern "C" cudaError_t hostembed_moe_mmv(const void *w, const void *w2, int dtype, size_t expert_bytes,
                                         unsigned int rows, unsigned int cols, const float *x, unsigned int x_div,
                                         const int *groups, unsigned int experts, unsigned int n, unsigned int k,
                                         float *y, float *partial, unsigned int *counters, hostembed_tuning tuning,
                                         cudaStream_t stream) {
    return moe_mmv(w, w2, dtype, expert_bytes, rows, cols, x, x_div, groups, experts, n, k, y, partial, counters,
                   SumTail{}, tuning, stream);
}

extern "C" cudaError_t hostembed_moe_mmv_sum(const void *w, int dtype, size_t expert_bytes, unsigned int rows,
                                             unsigned int cols, const float *x, const int *groups,
                                             unsigned int experts, unsigned int n, unsigned int k, float *y,
                                             float *partial, unsigned int *counters, const float *weights, float *sums,
                                             unsigned int *sum_counters, unsigned int sum_counter_count,
                                             hostembed_tuning tuning, cudaStream_t stream) {
    if (weights == nullptr || sums == nullptr || sum_counters == nullptr) return cudaErrorInvalidValue;
    if (rows == 0 || (size_t)n * ((rows + MMV_BLOCK_ROWS - 1) / MMV_BLOCK_ROWS) > sum_counter_count)
        return cudaErrorInvalidValue;
    return moe_mmv(w, nullptr, dtype, expert_bytes, rows, cols, x, 1, groups, experts, n, k, y, partial, counters,
                   SumTail{weights, sums, k, sum_counters}, tuning, stream);
}
