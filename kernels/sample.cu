// Token choice on the device: exactly the algorithm of src/sampler.rs's module comment (same ranking, same
// integer weights from the same f32 operations, same top-k, top-p and draw), so the same logits give the
// same token on both sides.
// Over 600 lines on purpose: one algorithm, read beside src/sampler.rs step for step, and its two
// launches (a row, every row of a pass) share all of it.
//
// Many blocks of one cooperative launch, each owning a contiguous chunk of the vocabulary (its keys kept in
// shared memory), separated by grid-wide barriers; only per-block totals, 256-bin histograms and a short
// candidate list cross blocks, through the scratch:
//   argmax:  per-block maxima of (key, -index), reduced by every block. Greedy stops here.
//   top-k:   a descent to the k-th largest key tau. Each pass is a grid-wide histogram (weight, smallest
//            and largest key per bin): the first bins x = (l_max - l) / T * log2(e) in steps of 1/8, the
//            later ones 8 bits of the key below the common prefix of the crossing bin's smallest and
//            largest key. It stops when that bin holds one key value: usually after one or two passes.
//   finish:  when the keys at or above tau number at most GATHER, they are appended to a list and block 0
//            alone sorts them into rank order, takes the first top_k, their weights, the top-p cut, sorts
//            the kept ones by index and draws.
//   Otherwise (no top-k, or a large one, or huge runs of ties at the cut):
//   totals:  per block the weight of the keys above tau and how many equal it (of which the first need_k
//            in index order are candidates); top-p's first histogram is built in the same sweep.
//   top-p:   the same descent weighted by the weights, the kept tau logits added as one virtual item.
//   draw:    per block the kept weight; prefix sums over blocks in index order; the one block whose range
//            holds r scans its chunk for the token.
// Equal keys mean equal logits and so equal weights: a cut inside a run of equal logits needs only how
// many of them come first, which per-block counts and a prefix over blocks give.
// On an H200 at vocab 128256: greedy about 5 us, temperature alone 11 us, top_k 40 + top_p 0.95 about
// 26-30 us, top-p alone 20-28 us, top_k 1000 + top_p 0.9 about 46-56 us (the sorts of a thousand keys).
// Vocabularies under ONE_BLOCK_BELOW (or a device without cooperative launch) run the same code in one
// block, with the workspace in shared memory instead of the scratch. hostembed_sample_rows runs the same
// code for every row of a pass in one launch (see "every row of a pass in one launch" below), a constrained
// row reading its mask's bit beside each logit (see sample_one).
#include <algorithm>
#include <atomic>

#include <cooperative_groups.h>

#include "hostembed_kernels.cuh"

namespace {

namespace cg = cooperative_groups;

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
constexpr unsigned int FULL = 0xffffffffu;
constexpr unsigned int BINS = 256;
constexpr unsigned int NO_BIN = 0xffffffffu;
constexpr int HIST_BUFFERS = 3;  // a pass fills one, the blocks read the previous one, one is being cleared
constexpr unsigned int ONE_BLOCK_BELOW = 4096;  // smaller vocabularies: one block, all keys in shared memory
constexpr unsigned int ITEMS_PER_BLOCK = 1024;
constexpr unsigned int MULTI_KEY_CACHE = 2048;  // keys a block keeps in shared memory (more: read again)
constexpr unsigned int MAX_VOCAB = (1u << 28) - 1;  // src/sampler.rs's MAX_VOCAB: weight sums fit in a u64
constexpr unsigned long long NONE_LEFT = ~0ull;     // "every one of them" for a count of equal keys

// Bits of src/sampler.rs's log2(e); its EXP2_TAYLOR coefficients are in exp2_weight.
constexpr unsigned int LOG2E_BITS = 0x3FB8AA3Bu;

// One histogram bin: summed weight (or count) and the range of keys that fell in it.
struct Bin {
    unsigned long long weight;
    unsigned int kmin, kmax;
};
static_assert(sizeof(Bin) == 16, "Bin is two u64 words");

constexpr size_t HIST_BYTES = HIST_BUFFERS * BINS * sizeof(Bin);
constexpr unsigned int GATHER = 2048;  // top-k candidates (ties at the cut included) one block finishes alone
// Scratch of the multi-block launch: the histograms, the gathered candidates and their count, then two
// alternating sets of per-block (sum, count).
constexpr size_t GATHER_OFFSET = HIST_BYTES / 8;  // in u64 words
constexpr size_t PART_OFFSET = GATHER_OFFSET + GATHER + 1;
constexpr size_t scratch_bytes(unsigned int blocks) { return (PART_OFFSET + 2ull * blocks * 2) * 8; }

struct Shared {
    Bin hist[BINS];
    unsigned long long red[WARPS];
    unsigned int cross_kmin, cross_kmax;
    unsigned long long cross_above, cross_weight;
    unsigned long long draw_before, draw_incl, draw_weight;
    unsigned int found;
};

// ---- the arithmetic shared with src/sampler.rs: one IEEE rounding per operation, no contraction ----

__device__ __forceinline__ float key_logit(unsigned int key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// src/sampler.rs exp2_weight: about 2^36 * 2^-x, 0 unless x < 40.
__device__ __forceinline__ unsigned long long exp2_weight(float x) {
    if (!(x < 40.f)) return 0;
    const float n = rintf(x);  // round half to even
    const float f = __fsub_rn(x, n);
    // Horner over f32((-ln 2)^k / k!), k = 7 down to 0.
    auto step = [f](float p, unsigned int c) { return __fadd_rn(__fmul_rn(p, f), __uint_as_float(c)); };
    float p = __uint_as_float(0xB77FE5FEu);
    p = step(p, 0x39218489u);
    p = step(p, 0xBAAEC3FFu);
    p = step(p, 0x3C1D955Bu);
    p = step(p, 0xBD635847u);
    p = step(p, 0x3E75FDF0u);
    p = step(p, 0xBF317218u);
    p = step(p, 0x3F800000u);
    const float scale = __uint_as_float((unsigned int)(127 + 36 - (int)n) << 23);
    return __float2ull_rn(__fmul_rn(p, scale));
}

__device__ __forceinline__ unsigned long long weight_of(float l, float l_max, float s) {
    return exp2_weight(__fmul_rn(__fsub_rn(l_max, l), s));
}

// floor(a * b / 2^24) and ceil(a * b / 2^24), for a <= 2^24.
__device__ __forceinline__ unsigned long long mul_shift24(unsigned long long a, unsigned long long b) {
    const unsigned long long lo = a * b, hi = __umul64hi(a, b);
    return (hi << 40) | (lo >> 24);
}
__device__ __forceinline__ unsigned long long mul_shift24_up(unsigned long long a, unsigned long long b) {
    return mul_shift24(a, b) + ((a * b) & 0xffffffull ? 1 : 0);
}

// ---- the workspace: scratch (many blocks, read past L1) or shared memory (one block) ----

template <bool MULTI>
__device__ __forceinline__ unsigned long long ld(const unsigned long long *p) {
    if constexpr (MULTI) return __ldcg(p);
    return *p;
}

template <bool MULTI>
__device__ __forceinline__ void grid_sync() {
    if constexpr (MULTI) {
        cg::this_grid().sync();
    } else {
        __syncthreads();
    }
}

__device__ __forceinline__ void clear_bins(Bin *h) {
    for (unsigned int b = threadIdx.x; b < BINS; b += THREADS) {
        h[b].weight = 0;
        h[b].kmin = FULL;
        h[b].kmax = 0;
    }
}

// ---- block primitives ----

__device__ __forceinline__ unsigned long long max_u64(unsigned long long a, unsigned long long b) {
    return a > b ? a : b;
}

// Sum (or max) over the block; every thread gets it. Contains barriers: call from all threads.
template <bool MAX>
__device__ unsigned long long block_reduce(Shared &sh, unsigned long long v) {
    const unsigned int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(FULL, v, o);
        v = MAX ? max_u64(v, other) : v + other;
    }
    __syncthreads();  // sh.red may still be read by the previous call
    if (lane == 0) sh.red[warp] = v;
    __syncthreads();
    unsigned long long r = sh.red[0];
#pragma unroll
    for (int w = 1; w < WARPS; w++) r = MAX ? max_u64(r, sh.red[w]) : r + sh.red[w];
    return r;
}

// The sum of v over the threads before this one, and over all of them. Contains barriers.
__device__ unsigned long long block_exclusive_scan(Shared &sh, unsigned long long v, unsigned long long &total) {
    const unsigned int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    unsigned long long incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long up = __shfl_up_sync(FULL, incl, o);
        if (lane >= (unsigned int)o) incl += up;
    }
    __syncthreads();
    if (lane == 31) sh.red[warp] = incl;
    __syncthreads();
    unsigned long long before = 0;
    total = 0;
#pragma unroll
    for (int w = 0; w < WARPS; w++) {
        before += (unsigned int)w < warp ? sh.red[w] : 0;
        total += sh.red[w];
    }
    return before + incl - v;
}

// Adds (weight w, key) to bin `bin` of the block's histogram (NO_BIN: nothing). All lanes call it. Lanes
// sharing a bin with 7 or more others add once for all of them, so a bin most items fall in costs no queue
// of atomics; the rest, with bins of their own, add directly (grouping them would serialize more than the
// atomics do). Weights are at most 2^36: summed as 24 low and 12 high bits, each sum within 32 bits.
__device__ __forceinline__ void hist_add(Bin *h, unsigned int bin, unsigned long long w, unsigned int key) {
    const unsigned int peers = __match_any_sync(FULL, bin);
    if (bin == NO_BIN) return;
    if (__popc(peers) >= 8) {
        const unsigned int low = __reduce_add_sync(peers, (unsigned int)(w & 0xffffffu));
        const unsigned int high = __reduce_add_sync(peers, (unsigned int)(w >> 24));
        const unsigned int kmin = __reduce_min_sync(peers, key), kmax = __reduce_max_sync(peers, key);
        if (threadIdx.x % 32 != (unsigned int)__ffs(peers) - 1) return;
        w = ((unsigned long long)high << 24) + low;
        atomicAdd(&h[bin].weight, w);
        atomicMin(&h[bin].kmin, kmin);
        atomicMax(&h[bin].kmax, kmax);
        return;
    }
    atomicAdd(&h[bin].weight, w);
    atomicMin(&h[bin].kmin, key);
    atomicMax(&h[bin].kmax, key);
}

// Adds the block's histogram (complete: after a barrier) into the workspace's.
__device__ __forceinline__ void hist_push(const Shared &sh, Bin *work) {
    for (unsigned int b = threadIdx.x; b < BINS; b += THREADS) {
        const Bin v = sh.hist[b];
        if (v.weight == 0) continue;
        atomicAdd(&work[b].weight, v.weight);
        atomicMin(&work[b].kmin, v.kmin);
        atomicMax(&work[b].kmax, v.kmax);
    }
}

// Warp 0, on a complete workspace histogram: walking the bins from the largest digit down with `above`
// already counted, the first bin at which the running weight reaches `target`; into sh.cross_* with the
// weight before it. The virtual item (vweight at key vkey) joins bin vbin (NO_BIN: none). Only a bug could
// leave the target unreached; then the last non-empty bin, so the descent still ends.
template <bool MULTI>
__device__ void find_crossing(Shared &sh, const Bin *hist, unsigned long long above, unsigned long long target,
                              unsigned int vbin, unsigned long long vweight, unsigned int vkey) {
    const unsigned int lane = threadIdx.x % 32;
    unsigned long long w[8];
    unsigned int mn[8], mx[8];
    unsigned long long own = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const unsigned int b = 255 - 8 * lane - j;
        w[j] = ld<MULTI>(&hist[b].weight);
        const unsigned long long range = ld<MULTI>(reinterpret_cast<const unsigned long long *>(&hist[b].kmin));
        mn[j] = (unsigned int)range;
        mx[j] = (unsigned int)(range >> 32);
        if (b == vbin) {
            w[j] += vweight;
            mn[j] = min(mn[j], vkey);
            mx[j] = max(mx[j], vkey);
        }
        own += w[j];
    }
    unsigned long long incl = own;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long up = __shfl_up_sync(FULL, incl, o);
        if (lane >= (unsigned int)o) incl += up;
    }
    const unsigned long long before = above + incl - own;
    const unsigned int crosses = __ballot_sync(FULL, own > 0 && before + own >= target);
    const unsigned int nonempty = __ballot_sync(FULL, own > 0);
    if (nonempty == 0) {
        if (lane == 0) {
            sh.cross_kmin = sh.cross_kmax = 0;
            sh.cross_above = above;
            sh.cross_weight = 0;
        }
        return;
    }
    const bool reached = crosses != 0;
    const unsigned int who = reached ? __ffs(crosses) - 1 : 31 - __clz(nonempty);
    if (lane != who) return;
    unsigned long long acc = before;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        if (w[j] > 0 && (!reached || acc + w[j] >= target)) {
            sh.cross_kmin = mn[j];
            sh.cross_kmax = mx[j];
            sh.cross_above = acc;
            sh.cross_weight = w[j];
            if (reached) break;
        }
        acc += w[j];
    }
}

// Sorts a[0..n) (n a power of 2) ascending or descending. All threads call it.
__device__ void bitonic_sort(unsigned long long *a, unsigned int n, bool descending) {
    for (unsigned int k = 2; k <= n; k <<= 1) {
        for (unsigned int j = k >> 1; j > 0; j >>= 1) {
            for (unsigned int t = threadIdx.x; t < n / 2; t += THREADS) {
                const unsigned int i = 2 * j * (t / j) + t % j, l = i + j;
                const bool ascending = ((i & k) == 0) != descending;
                const unsigned long long x = a[i], y = a[l];
                if ((x > y) == ascending) a[i] = y, a[l] = x;
            }
            __syncthreads();
        }
    }
}

// The first p < n at which the running sum of value(0..p) reaches target (strict: exceeds it); n if none.
// Each thread sums a contiguous run, one scan places the runs. All threads call it and get the answer.
template <typename Value>
__device__ unsigned int first_reaching(Shared &sh, unsigned int n, Value value, unsigned long long target,
                                       bool strict) {
    const unsigned int run = (n + THREADS - 1) / THREADS;
    const unsigned int p0 = min(n, threadIdx.x * run), p1 = min(n, p0 + run);
    unsigned long long own = 0;
    for (unsigned int p = p0; p < p1; p++) own += value(p);
    if (threadIdx.x == 0) sh.found = n;
    unsigned long long total;
    unsigned long long acc = block_exclusive_scan(sh, own, total);  // its barriers publish sh.found
    for (unsigned int p = p0; p < p1; p++) {
        acc += value(p);
        if (strict ? acc > target : acc >= target) {
            atomicMin(&sh.found, p);
            break;
        }
    }
    __syncthreads();
    const unsigned int found = sh.found;
    __syncthreads();
    return found;
}

// The first pass of a descent bins by x = (l_max - l) * s, 1/8 wide, instead of the key's top bits: x is
// monotone in the key, and the weights live in x < 40, so one pass usually isolates the cut. Larger keys get
// larger bins; the largest key alone would have x = 0, NaN or infinite in odd cases, so it is pinned to 255.
__device__ __forceinline__ unsigned int x_bin(unsigned int key, unsigned int key_max, float l_max, float s) {
    if (key == key_max) return 255;
    const float x = __fmul_rn(__fsub_rn(l_max, key_logit(key)), s);
    return x < 31.875f ? 255 - (unsigned int)(x * 8.f) : 0;
}

// The barrier across one launch's blocks (a cooperative grid, or the one block).
template <bool MULTI>
struct GridSync {
    __device__ __forceinline__ void operator()() const { grid_sync<MULTI>(); }
};

// A block's shared memory (declared by each kernel: shared variables of a device function would be
// counted against every kernel the device link holds).
template <bool MULTI>
struct BlockShared {
    static constexpr unsigned int CACHE = MULTI ? MULTI_KEY_CACHE : ONE_BLOCK_BELOW;
    Shared sh;
    unsigned int keys[CACHE];  // the chunk's keys, read once from the logits
    Bin one_block_hist[MULTI ? 1 : HIST_BUFFERS * BINS];
    unsigned long long one_block_part[MULTI ? 1 : 4];
    unsigned long long gathered[MULTI ? GATHER : 1];  // (key, -index), then (index, rank)
    unsigned long long gathered_weight[MULTI ? GATHER : 1];
};

// The sampler of one row of logits, run by `blocks` blocks together (this one is `blk`), `sync()` the
// barrier across them; `scratch` is the row's own workspace when MULTI, `smem` the block's shared memory.
// `allowed` (NULL: every id) is the row's constraint mask, one bit an id: a masked id takes key 0, below
// every allowed one (whose key is raised to 1 at least: only two NaN payloads of the same sign tell 0 and
// 1 apart), and key 0 is a NaN logit, which weighs 0. So every step below reads the allowed ids as
// src/sampler.rs sample_stream_masked does, and the argmax (greedy, or a draw whose weights are all 0) is
// the largest allowed logit.
template <bool MULTI, typename Sync>
__device__ __forceinline__ void sample_one(const float *__restrict__ logits, const unsigned int *__restrict__ allowed,
                                           unsigned int vocab, float temperature,
                                           unsigned int top_k, float top_p, float min_p, unsigned long long seed,
                                           unsigned int stream_index, unsigned long long position,
                                           unsigned long long *scratch, int *token, const unsigned int blk,
                                           const unsigned int blocks, Sync sync, BlockShared<MULTI> &smem) {
    constexpr unsigned int CACHE = BlockShared<MULTI>::CACHE;
    Shared &sh = smem.sh;
    unsigned int *const keys = smem.keys;
    Bin *const one_block_hist = smem.one_block_hist;
    unsigned long long *const one_block_part = smem.one_block_part;
    unsigned long long *const gathered = smem.gathered;
    unsigned long long *const gathered_weight = smem.gathered_weight;
    Bin *const work_hist = MULTI ? reinterpret_cast<Bin *>(scratch) : one_block_hist;
    unsigned long long *const work_part = MULTI ? scratch + PART_OFFSET : one_block_part;

    const unsigned int tid = threadIdx.x;
    const unsigned int chunk = (vocab + blocks - 1) / blocks;
    const unsigned int lo = min(vocab, blk * chunk), hi = min(vocab, lo + chunk);
    auto hist = [&](unsigned int n) { return work_hist + (n % HIST_BUFFERS) * BINS; };
    // The (sum, count) pair of block j in alternating set n: a set is written before a barrier and read
    // after it, while the next phase writes the other set.
    auto part = [&](unsigned int n, unsigned int j) { return work_part + ((n & 1) * blocks + j) * 2; };
    // Every item of the block's chunk, `valid` false past its end; the same trip count for every thread.
    auto for_items = [&](auto body) {
        for (unsigned int base = lo; base < hi; base += THREADS) body(base + tid, base + tid < hi);
    };
    auto load_key = [&](unsigned int i) {
        const unsigned int key = he::float_key(logits[i]);
        if (allowed == nullptr) return key;
        return (allowed[i / 32] >> (i % 32)) & 1u ? max(key, 1u) : 0u;
    };
    auto key_at = [&](unsigned int i) { return i - lo < CACHE ? keys[i - lo] : load_key(i); };

    const bool sampling = temperature > 0.f && top_k != 1;
    const bool use_top_k = top_k != 0 && top_k < vocab;
    const bool use_top_p = top_p > 0.f && top_p < 1.f;

    // ---- argmax: the largest key, then the lowest index ----
    unsigned long long best = 0;
    for_items([&](unsigned int i, bool valid) {
        if (!valid) return;
        const unsigned int key = load_key(i);
        if (i - lo < CACHE) keys[i - lo] = key;
        best = max_u64(best, ((unsigned long long)key << 32) | (FULL - i));
    });
    best = block_reduce<true>(sh, best);  // its barriers publish keys[]
    if (tid == 0) part(0, blk)[0] = best;
    if (blk == 0) clear_bins(hist(0));
    if (MULTI && blk == 0 && tid == 0) scratch[GATHER_OFFSET + GATHER] = 0;  // the gathered count
    sync();
    best = 0;
    for (unsigned int j = tid; j < blocks; j += THREADS) best = max_u64(best, ld<MULTI>(part(0, j)));
    best = block_reduce<true>(sh, best);
    const unsigned int arg = FULL - (unsigned int)best, key_max = (unsigned int)(best >> 32);
    if (!sampling) {
        if (blk == 0 && tid == 0) *token = (int)arg;
        return;
    }
    const float l_max = logits[arg];
    const float s = __fdiv_rn(__uint_as_float(LOG2E_BITS), temperature);
    // src/sampler.rs min_p_floor: weights below it count as 0 everywhere (the largest weighs 2^36 >= it).
    const unsigned long long floor_w =
        min_p > 0.f ? min(__float2ull_rn(__fmul_rn(min_p, 16777216.f)), 1ull << 24) << 12 : 0ull;
    auto weight_of_key = [&](unsigned int key) {
        const unsigned long long w = weight_of(key_logit(key), l_max, s);
        return w >= floor_w ? w : 0ull;
    };
    unsigned int ph = 1;  // the part set the next phase writes
    unsigned int hc = 0;  // the histogram buffer the next pass fills (cleared)

    // One pass of a descent over this block's items, `take(key, w)` saying whether an item counts, with
    // weight w. The first pass bins every item by x_bin; the later ones the items with keys in [klo, khi]
    // by the 8 bits of the key at `shift`. Fills hist(hc) and clears the buffer after it; the caller
    // crosses the grid barrier next.
    auto pass = [&](bool first, unsigned int klo, unsigned int khi, int shift, auto take) {
        clear_bins(sh.hist);
        __syncthreads();
        for_items([&](unsigned int i, bool valid) {
            unsigned int key = 0, bin = NO_BIN;
            unsigned long long w = 0;
            if (valid) {
                key = key_at(i);
                if ((first || (key >= klo && key <= khi)) && take(key, w) && w > 0)
                    bin = first ? x_bin(key, key_max, l_max, s) : (key >> shift) & 0xffu;
            }
            hist_add(sh.hist, bin, w, key);
        });
        __syncthreads();
        hist_push(sh, hist(hc));
        if (blk == 0) clear_bins(hist(hc + 1));
    };
    // A descent: the key theta at which the weight of the taken items (plus the virtual item vkey of
    // weight vweight), walked from the largest key down, reaches target, and the weight above theta.
    // `first_done`: the caller already ran the first pass and the barrier. Each bin narrows the keys to
    // its smallest and largest; the next pass splits them on the 8 bits below their common prefix, so
    // after the first pass at most 4 more end it.
    auto descend = [&](unsigned long long target, unsigned int vkey, unsigned long long vweight, bool first_done,
                       auto take, unsigned int &theta, unsigned long long &above, unsigned long long &at) {
        if (!first_done) {
            pass(true, 0, FULL, 0, take);
            sync();
        }
        above = 0;
        bool first = true;
        unsigned int klo = 0, khi = FULL;
        int shift = 0;
        for (int round = 0;; round++) {
            unsigned int vbin = NO_BIN;
            if (vweight > 0 && (first || (vkey >= klo && vkey <= khi)))
                vbin = first ? x_bin(vkey, key_max, l_max, s) : (vkey >> shift) & 0xffu;
            if (tid < 32) find_crossing<MULTI>(sh, hist(hc), above, target, vbin, vweight, vkey);
            __syncthreads();
            hc++;
            klo = sh.cross_kmin;
            khi = sh.cross_kmax;
            above = sh.cross_above;
            at = sh.cross_weight;
            __syncthreads();  // sh.cross_* is written again by the next crossing
            if (klo >= khi || round == 5) {
                theta = khi;
                return;
            }
            const int top = 31 - __clz(klo ^ khi);
            shift = top >= 7 ? top - 7 : 0;
            first = false;
            pass(false, klo, khi, shift, take);
            sync();
        }
    };

    // Appends every key of this block at or above `cut` to the scratch's list, as (key, -index), and counts
    // them; past GATHER only counted.
    auto gather = [&](unsigned int cut) {
        unsigned long long *const list = scratch + GATHER_OFFSET, *const count = list + GATHER;
        for_items([&](unsigned int i, bool valid) {
            if (!valid) return;
            const unsigned int key = key_at(i);
            if (key < cut) return;
            const unsigned long long slot = atomicAdd(count, 1ull);
            if (slot < GATHER) list[slot] = ((unsigned long long)key << 32) | (FULL - i);
        });
    };
    auto gathered_count = [&]() { return ld<MULTI>(scratch + GATHER_OFFSET + GATHER); };
    // Block 0 alone, on n gathered keys holding every top-k candidate: sorts them into rank order, takes the
    // first top_k, their weights, the top-p cut, then sorts the kept ones by index for the draw.
    auto finish = [&](unsigned long long count) {
        const unsigned long long *const list = scratch + GATHER_OFFSET;
        const unsigned int n = (unsigned int)min(count, (unsigned long long)GATHER);
        unsigned int pow2 = 1;
        while (pow2 < n) pow2 <<= 1;
        for (unsigned int p = tid; p < pow2; p += THREADS) gathered[p] = p < n ? ld<MULTI>(list + p) : 0;
        __syncthreads();
        bitonic_sort(gathered, pow2, true);  // rank order: key descending, index ascending
        const unsigned int k = min(top_k, n);
        unsigned long long cand_total = 0;
        for (unsigned int p = tid; p < k; p += THREADS) {
            gathered_weight[p] = weight_of_key((unsigned int)(gathered[p] >> 32));
            cand_total += gathered_weight[p];
        }
        cand_total = block_reduce<false>(sh, cand_total);  // its barriers publish gathered_weight
        if (cand_total == 0) {
            if (tid == 0) *token = (int)arg;
            return;
        }
        auto rank_weight = [&](unsigned int p) { return gathered_weight[p]; };
        unsigned int kept = k;
        if (use_top_p) {
            const unsigned long long p24 = __float2ull_rn(__fmul_rn(top_p, 16777216.f));
            unsigned long long thresh = mul_shift24_up(p24, cand_total);
            thresh = thresh < 1 ? 1 : thresh;
            if (thresh < cand_total) kept = first_reaching(sh, k, rank_weight, thresh, false) + 1;
        }
        // The kept candidates in index order, each with its rank to find its weight.
        unsigned int pow2_kept = 1;
        while (pow2_kept < kept) pow2_kept <<= 1;
        unsigned long long kept_weight = 0;
        for (unsigned int p = tid; p < pow2_kept; p += THREADS) {
            if (p < kept) {
                kept_weight += gathered_weight[p];
                gathered[p] = ((unsigned long long)(FULL - (unsigned int)gathered[p]) << 32) | p;
            } else {
                gathered[p] = ~0ull;
            }
        }
        kept_weight = block_reduce<false>(sh, kept_weight);  // its barriers publish gathered
        bitonic_sort(gathered, pow2_kept, false);
        const unsigned long long bits =
            he::splitmix64(seed ^ he::splitmix64(((unsigned long long)stream_index << 40) ^ position)) >> 40;
        const unsigned long long r = mul_shift24(bits, kept_weight);  // < kept_weight
        auto index_weight = [&](unsigned int q) { return gathered_weight[(unsigned int)gathered[q]]; };
        const unsigned int q = first_reaching(sh, kept, index_weight, r, true);
        if (tid == 0) *token = q < kept ? (int)(gathered[q] >> 32) : (int)arg;
    };

    // ---- top-k: the cut key tau, and how many logits equal to it are kept ----
    unsigned int tau = 0;  // with no top-k, key 0 (-NaN, weight 0) and all of its items
    unsigned long long need_k = NONE_LEFT;
    unsigned long long above_tau = 0, at_tau = 0;  // how many keys are above tau, and equal to it
    if (use_top_k) {
        descend(top_k, 0, 0, false, [](unsigned int, unsigned long long &w) { return w = 1, true; }, tau, above_tau,
                at_tau);
        need_k = top_k - above_tau;
    }
    const unsigned long long w_tau = weight_of_key(tau);

    // ---- few candidates: gathered, and block 0 finishes alone with a sort ----
    if constexpr (MULTI) {
        if (use_top_k && above_tau + at_tau <= GATHER) {
            gather(tau);
            sync();
            if (blk == 0) finish(gathered_count());
            return;
        }
    }

    // ---- totals over the candidates (keys above tau, plus need_k of the tau run); top-p's first pass ----
    // Per block: the weight of the keys above `cut` and how many keys equal it. Written to part(ph).
    auto sums_above = [&](unsigned int cut) {
        unsigned long long sum = 0, equal = 0;
        for_items([&](unsigned int i, bool valid) {
            if (!valid) return;
            const unsigned int key = key_at(i);
            if (key > cut) sum += weight_of_key(key);
            equal += key == cut;
        });
        sum = block_reduce<false>(sh, sum);
        equal = block_reduce<false>(sh, equal);
        if (tid == 0) part(ph, blk)[0] = sum, part(ph, blk)[1] = equal;
    };
    auto candidate = [&](unsigned int key, unsigned long long &w) {
        if (key <= tau) return false;
        w = weight_of_key(key);
        return true;
    };
    sums_above(tau);
    if (use_top_p) pass(true, 0, FULL, 0, candidate);
    sync();

    // Every block: the totals of all blocks.
    unsigned long long sum = 0, equal = 0;
    for (unsigned int j = tid; j < blocks; j += THREADS) {
        sum += ld<MULTI>(part(ph, j));
        equal += ld<MULTI>(part(ph, j) + 1);
    }
    sum = block_reduce<false>(sh, sum);
    equal = block_reduce<false>(sh, equal);
    const unsigned long long tau_kept = use_top_k ? min(need_k, equal) : 0;
    const unsigned long long total = sum + tau_kept * w_tau;
    if (total == 0) {
        if (blk == 0 && tid == 0) *token = (int)arg;
        return;
    }

    // The draw runs over: the keys above theta, and the first `need` (in index order) equal to theta.
    unsigned int theta = tau, sums_set = ph;
    unsigned long long need = need_k, w_theta = w_tau;
    ph++;

    // ---- top-p: the shortest prefix of the candidates in rank order reaching thresh ----
    if (use_top_p) {
        const unsigned long long p24 = __float2ull_rn(__fmul_rn(top_p, 16777216.f));
        unsigned long long thresh = mul_shift24_up(p24, total);
        thresh = thresh < 1 ? 1 : thresh;
        if (thresh < total) {
            // The kept tau logits (all one weight) join the histograms as one virtual item.
            unsigned long long above, at;
            descend(thresh, tau, tau_kept * w_tau, true, candidate, theta, above, at);
            w_theta = weight_of_key(theta);
            // The crossing bin reaches thresh, so theta's logits weigh more than 0.
            need = w_theta ? (thresh - above + w_theta - 1) / w_theta : 1;
            sums_above(theta);
            sync();
            sums_set = ph;
            ph++;
        }
    }

    // ---- the draw, in index order ----
    // Block j keeps the weight above theta plus its share of the first `need` theta logits. Each thread
    // takes a contiguous run of blocks so one scan gives the theta counts before each block.
    const unsigned int per = (blocks + THREADS - 1) / THREADS;
    const unsigned int j0 = min(blocks, tid * per), j1 = min(blocks, j0 + per);
    unsigned long long run_equal = 0;
    for (unsigned int j = j0; j < j1; j++) run_equal += ld<MULTI>(part(sums_set, j) + 1);
    unsigned long long all;
    unsigned long long equal_before = block_exclusive_scan(sh, run_equal, all);
    unsigned long long run_kept = 0;
    for (unsigned int j = j0; j < j1; j++) {
        const unsigned long long eq = ld<MULTI>(part(sums_set, j) + 1);
        const unsigned long long incl = need > equal_before ? min(need - equal_before, eq) : 0;
        const unsigned long long kept_j = ld<MULTI>(part(sums_set, j)) + incl * w_theta;
        if (j == blk) sh.draw_before = run_kept, sh.draw_incl = incl, sh.draw_weight = kept_j;
        run_kept += kept_j;
        equal_before += eq;
    }
    unsigned long long kept;
    const unsigned long long kept_before = block_exclusive_scan(sh, run_kept, kept);  // its barriers publish sh.draw_*
    if (blk >= j0 && blk < j1) sh.draw_before += kept_before;
    __syncthreads();
    const unsigned long long bits =
        he::splitmix64(seed ^ he::splitmix64(((unsigned long long)stream_index << 40) ^ position)) >> 40;
    const unsigned long long r = mul_shift24(bits, kept);  // < kept
    const unsigned long long mine_before = sh.draw_before, mine_incl = sh.draw_incl, mine = sh.draw_weight;
    if (!(mine > 0 && r >= mine_before && r - mine_before < mine)) return;

    // This block holds the token: each thread scans a contiguous run of the chunk.
    const unsigned long long target = r - mine_before;
    const unsigned int run = (hi - lo + THREADS - 1) / THREADS;
    const unsigned int i0 = min(hi, lo + tid * run), i1 = min(hi, i0 + run);
    unsigned long long own_equal = 0;
    for (unsigned int i = i0; i < i1; i++) own_equal += key_at(i) == theta;
    unsigned long long unused;
    const unsigned long long rank0 = block_exclusive_scan(sh, own_equal, unused);
    auto kept_weight = [&](unsigned int i, unsigned long long &rank) -> unsigned long long {
        const unsigned int key = key_at(i);
        if (key > theta) return weight_of_key(key);
        if (key == theta) return rank++ < mine_incl ? w_theta : 0;
        return 0;
    };
    unsigned long long own_kept = 0, rank = rank0;
    for (unsigned int i = i0; i < i1; i++) own_kept += kept_weight(i, rank);
    const unsigned long long before = block_exclusive_scan(sh, own_kept, unused);
    if (!(target >= before && target - before < own_kept)) return;
    unsigned long long acc = before;
    rank = rank0;
    for (unsigned int i = i0; i < i1; i++) {
        acc += kept_weight(i, rank);
        if (acc > target) {
            *token = (int)i;
            return;
        }
    }
}

template <bool MULTI>
__global__ __launch_bounds__(THREADS) void sample_kernel(const float *__restrict__ logits, unsigned int vocab,
                                                         float temperature, unsigned int top_k, float top_p,
                                                         float min_p, unsigned long long seed, unsigned int stream_index,
                                                         unsigned long long position, unsigned long long *scratch,
                                                         int *token) {
    __shared__ BlockShared<MULTI> smem;
    sample_one<MULTI>(logits, nullptr, vocab, temperature, top_k, top_p, min_p, seed, stream_index, position, scratch,
                      token, blockIdx.x, gridDim.x, GridSync<MULTI>{}, smem);
}

// Blocks of `kernel` that fit on the current device at once; 0 where it has no cooperative launch. Asked
// once per device (`known`: one cache per kernel).
template <typename Kernel>
unsigned int resident_blocks_of(Kernel kernel, std::atomic<int> (&known)[64]) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 0;
    if (dev >= 0 && dev < 64) {
        const int k = known[dev].load(std::memory_order_relaxed);
        if (k != 0) return k > 0 ? (unsigned int)k : 0;
    }
    int coop = 0, sms = 0, per_sm = 0;
    int n = -1;
    if (cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess &&
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, THREADS, 0) == cudaSuccess && coop &&
        sms * per_sm > 0)
        n = sms * per_sm;
    (void)cudaGetLastError();  // a failed query here is no launch error; the launch reports its own
    if (dev >= 0 && dev < 64) known[dev].store(n, std::memory_order_relaxed);
    return n > 0 ? (unsigned int)n : 0;
}

// The multi-block kernel's resident blocks: 0: not asked yet, -1: none.
std::atomic<int> known_single[64];
unsigned int resident_blocks() { return resident_blocks_of(sample_kernel<true>, known_single); }

// src/sampler.rs penalize: one f32 operation, NaN kept.
__device__ __forceinline__ float penalized(float l, float penalty) {
    return l > 0.f ? __fdiv_rn(l, penalty) : (l <= 0.f ? __fmul_rn(l, penalty) : l);
}

// src/sampler.rs step P on the n distinct ids ids[0..n): saves their logits to saved[0..n) and writes
// the penalized values; restore_penalized puts the saved ones back after the draw. Ids outside the
// vocabulary are skipped.
__global__ void penalize(float *logits, unsigned int vocab, const int *ids, float *saved, unsigned int n,
                         float penalty) {
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int id = ids[i];
        if (id < 0 || (unsigned int)id >= vocab) continue;
        const float l = logits[id];
        saved[i] = l;
        logits[id] = penalized(l, penalty);
    }
}

__global__ void restore_penalized(float *logits, unsigned int vocab, const int *ids, const float *saved,
                                  unsigned int n) {
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int id = ids[i];
        if (id >= 0 && (unsigned int)id < vocab) logits[id] = saved[i];
    }
}

// The draw itself, on logits already penalized.
cudaError_t launch_sample(const float *logits, unsigned int vocab, float temperature, unsigned int top_k,
                          float top_p, float min_p, uint64_t seed, unsigned int stream_index, uint64_t position,
                          void *scratch, int *token, cudaStream_t stream) {
    unsigned long long seed_arg = seed, position_arg = position;
    unsigned long long *work = static_cast<unsigned long long *>(scratch);
    unsigned int blocks = 1;
    if (vocab >= ONE_BLOCK_BELOW) {
        blocks = (vocab + ITEMS_PER_BLOCK - 1) / ITEMS_PER_BLOCK;
        blocks = std::min(blocks, resident_blocks());
        // The scratch holds 8 * vocab bytes.
        while (blocks > 1 && scratch_bytes(blocks) > 8ull * vocab) blocks--;
    }
    if (blocks > 1) {
        void *args[] = {&logits,   &vocab,        &temperature,  &top_k, &top_p, &min_p,
                        &seed_arg, &stream_index, &position_arg, &work,  &token};
        const cudaError_t e = cudaLaunchCooperativeKernel(reinterpret_cast<const void *>(&sample_kernel<true>),
                                                          dim3(blocks), dim3(THREADS), args, 0, stream);
        if (e != cudaErrorCooperativeLaunchTooLarge && e != cudaErrorNotSupported) {
            return e != cudaSuccess ? e : cudaGetLastError();
        }
        (void)cudaGetLastError();  // fewer resources than asked for (another process, MPS): one block instead
    }
    sample_kernel<false><<<1, THREADS, 0, stream>>>(logits, vocab, temperature, top_k, top_p, min_p, seed_arg,
                                                    stream_index, position_arg, work, token);
    return cudaGetLastError();
}

// ---- every row of a pass in one launch ----
//
// hostembed_sample_rows runs sample_one for each row of a pass at once: row r is grid row blockIdx.y, its
// logits, settings, token and workspace its own. Where the vocabulary takes several blocks a row, a row's
// blocks meet at barriers of their own (RowSync), so rows that take different paths (greedy, a top-k
// descent of a different depth) never wait on each other; the launch is cooperative, so every block is
// resident and a barrier always completes. The per-row work is the single-row kernel's code, so each row
// draws what hostembed_sample draws from the same logits: the algorithm's sums are exact integers, so the
// token does not depend on how many blocks share a row.

// The scratch of a rows launch, in order: the rows' settings, two barrier words a row, the penalized ids
// and their saved logits, then one workspace a row (each 256-byte aligned).
struct RowsLayout {
    size_t barriers, ids, saved, work, work_bytes;
    RowsLayout(unsigned int rows, unsigned int n_ids, unsigned int per_row) {
        auto up = [](size_t v, size_t a) { return (v + a - 1) / a * a; };
        barriers = up((size_t)rows * sizeof(hostembed_sample_row), 16);
        ids = up(barriers + 8ull * rows, 16);
        saved = ids + 4ull * n_ids;
        work = up(saved + 4ull * n_ids, 256);
        work_bytes = per_row > 1 ? up(scratch_bytes(per_row), 256) : 0;
    }
    size_t total(unsigned int rows) const { return work + rows * work_bytes; }
};

// The barrier of one row's blocks: an arrival count and a generation, two words of the row's own.
struct RowSync {
    unsigned int *bar;
    unsigned int blocks;
    __device__ __forceinline__ void operator()() const {
        __syncthreads();
        if (threadIdx.x == 0) {
            volatile unsigned int *generation = bar + 1;
            const unsigned int g = *generation;  // read before arriving: it cannot move until this block arrives
            __threadfence();                     // the block's writes (ordered before by the barrier above) first
            if (atomicAdd(bar, 1u) == blocks - 1) {
                atomicExch(bar, 0u);
                __threadfence();
                atomicAdd(bar + 1, 1u);
            } else {
                while (*generation == g) __nanosleep(32);
            }
            __threadfence();
        }
        __syncthreads();
    }
};

__device__ __forceinline__ bool row_penalizes(const hostembed_sample_row &p) {
    return p.n_penalty > 0 && p.repeat_penalty == p.repeat_penalty && p.repeat_penalty != 1.f;
}

// Grid row blockIdx.y samples row blockIdx.y: gridDim.x blocks a row (MULTI), or one (its workspace in
// shared memory); a row with a mask_row draws among the ids of that row of `masks`.
template <bool MULTI>
__global__ __launch_bounds__(THREADS) void sample_rows_kernel(const float *__restrict__ logits, unsigned int vocab,
                                                              const hostembed_sample_row *__restrict__ rows,
                                                              const unsigned int *__restrict__ masks,
                                                              unsigned int *barriers, unsigned long long *work,
                                                              size_t work_words, int *tokens) {
    const unsigned int r = blockIdx.y;
    const hostembed_sample_row p = rows[r];
    const float *row = logits + (size_t)r * vocab;
    const unsigned int *allowed =
        p.mask_row == HOSTEMBED_NO_MASK ? nullptr : masks + (size_t)p.mask_row * ((vocab + 31) / 32);
    __shared__ BlockShared<MULTI> smem;
    if constexpr (MULTI)
        sample_one<true>(row, allowed, vocab, p.temperature, p.top_k, p.top_p, p.min_p, p.seed, p.stream_index,
                         p.position, work + r * work_words, tokens + r, blockIdx.x, gridDim.x,
                         RowSync{barriers + 2 * r, gridDim.x}, smem);
    else
        sample_one<false>(row, allowed, vocab, p.temperature, p.top_k, p.top_p, p.min_p, p.seed, p.stream_index,
                          p.position, work, tokens + r, 0, 1, GridSync<false>{}, smem);
}

std::atomic<int> known_rows[64];
unsigned int resident_rows_blocks() { return resident_blocks_of(sample_rows_kernel<true>, known_rows); }

// Before a rows launch: the barrier words zeroed, and step P on each row's ids (row blockIdx.y's
// ids[penalty_at..], their logits saved beside them, as penalize does for one row).
__global__ void prepare_rows(float *logits, unsigned int vocab, const hostembed_sample_row *rows, const int *ids,
                             float *saved, unsigned int *barriers) {
    const unsigned int r = blockIdx.y;
    if (blockIdx.x == 0 && threadIdx.x < 2) barriers[2 * r + threadIdx.x] = 0;
    const hostembed_sample_row p = rows[r];
    if (!row_penalizes(p)) return;
    float *row = logits + (size_t)r * vocab;
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n_penalty; i += gridDim.x * blockDim.x) {
        const unsigned int at = p.penalty_at + i;
        const int id = ids[at];
        if (id < 0 || (unsigned int)id >= vocab) continue;
        saved[at] = row[id];
        row[id] = penalized(saved[at], p.repeat_penalty);
    }
}

__global__ void restore_rows(float *logits, unsigned int vocab, const hostembed_sample_row *rows, const int *ids,
                             const float *saved) {
    const unsigned int r = blockIdx.y;
    const hostembed_sample_row p = rows[r];
    if (!row_penalizes(p)) return;
    float *row = logits + (size_t)r * vocab;
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n_penalty; i += gridDim.x * blockDim.x) {
        const int id = ids[p.penalty_at + i];
        if (id >= 0 && (unsigned int)id < vocab) row[id] = saved[p.penalty_at + i];
    }
}

}  // namespace

extern "C" cudaError_t hostembed_sample(float *logits, unsigned int vocab, float temperature, unsigned int top_k,
                                        float top_p, float min_p, float repeat_penalty, int *penalty,
                                        unsigned int n_penalty, uint64_t seed, unsigned int stream_index,
                                        uint64_t position, void *scratch, int *token, cudaStream_t stream) {
    if (logits == nullptr || token == nullptr || vocab == 0 || vocab > MAX_VOCAB) return cudaErrorInvalidValue;
    if (scratch == nullptr || reinterpret_cast<uintptr_t>(scratch) % 8 != 0) return cudaErrorInvalidValue;
    if (n_penalty > 0 && (penalty == nullptr || reinterpret_cast<uintptr_t>(penalty) % 4 != 0))
        return cudaErrorInvalidValue;
    // The same condition as src/sampler.rs Sampling::penalizes (the caller sends no ids otherwise).
    const bool penalize_ids = n_penalty > 0 && repeat_penalty == repeat_penalty && repeat_penalty != 1.f;
    float *saved = reinterpret_cast<float *>(penalty + n_penalty);
    const unsigned int grid = std::min(64u, (n_penalty + THREADS - 1) / THREADS);
    if (penalize_ids) {
        penalize<<<grid, THREADS, 0, stream>>>(logits, vocab, penalty, saved, n_penalty, repeat_penalty);
        const cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
    const cudaError_t drawn =
        launch_sample(logits, vocab, temperature, top_k, top_p, min_p, seed, stream_index, position, scratch, token,
                      stream);
    if (penalize_ids) {
        // Restored even after a failed draw, so the caller's logits are never left penalized.
        restore_penalized<<<grid, THREADS, 0, stream>>>(logits, vocab, penalty, saved, n_penalty);
        const cudaError_t e = cudaGetLastError();
        if (drawn == cudaSuccess && e != cudaSuccess) return e;
    }
    return drawn;
}

// Rows launch: validates the settings on the host, copies them and the ids into the scratch, then at most
// three launches (the penalty and barrier reset, the draw, the restore).
extern "C" cudaError_t hostembed_sample_rows(float *logits, unsigned int vocab, unsigned int rows,
                                             const hostembed_sample_row *settings, const int *ids,
                                             unsigned int n_ids, const unsigned int *masks, void *scratch,
                                             size_t scratch_size, int *tokens, cudaStream_t stream) {
    if (logits == nullptr || tokens == nullptr || scratch == nullptr || vocab == 0 || vocab > MAX_VOCAB ||
        rows > 65535 || (rows > 0 && settings == nullptr) || (n_ids > 0 && ids == nullptr) ||
        reinterpret_cast<uintptr_t>(scratch) % 256 != 0)
        return cudaErrorInvalidValue;
    if (rows == 0) return cudaSuccess;
    bool any_penalty = false;
    unsigned int most_ids = 0;
    for (unsigned int r = 0; r < rows; r++) {
        const hostembed_sample_row &p = settings[r];
        if (p.n_penalty > n_ids || p.penalty_at > n_ids - p.n_penalty) return cudaErrorInvalidValue;
        if (p.mask_row != HOSTEMBED_NO_MASK && (masks == nullptr || reinterpret_cast<uintptr_t>(masks) % 4 != 0))
            return cudaErrorInvalidValue;
        if (p.n_penalty > 0 && p.repeat_penalty == p.repeat_penalty && p.repeat_penalty != 1.f) {
            any_penalty = true;
            most_ids = std::max(most_ids, p.n_penalty);
        }
    }
    // Blocks a row: as the single-row launch takes them, shared among the rows the card holds at once and
    // the workspaces the scratch holds.
    unsigned int per_row = 1;
    if (vocab >= ONE_BLOCK_BELOW) {
        per_row = std::max(1u, std::min((vocab + ITEMS_PER_BLOCK - 1) / ITEMS_PER_BLOCK, resident_rows_blocks() / rows));
        while (per_row > 1 && RowsLayout(rows, n_ids, per_row).total(rows) > scratch_size) per_row--;
    }
    RowsLayout at(rows, n_ids, per_row);
    if (at.total(rows) > scratch_size) return cudaErrorInvalidValue;  // not even the settings and ids fit

    unsigned char *base = static_cast<unsigned char *>(scratch);
    auto *rows_dev = reinterpret_cast<hostembed_sample_row *>(base);
    auto *barriers = reinterpret_cast<unsigned int *>(base + at.barriers);
    auto *ids_dev = reinterpret_cast<int *>(base + at.ids);
    auto *saved = reinterpret_cast<float *>(base + at.saved);
    auto *work = reinterpret_cast<unsigned long long *>(base + at.work);
    // Pageable host memory: both copies are staged before they return, so the caller may reuse its arrays.
    cudaError_t e = cudaMemcpyAsync(rows_dev, settings, rows * sizeof(hostembed_sample_row), cudaMemcpyHostToDevice,
                                    stream);
    if (e == cudaSuccess && n_ids > 0)
        e = cudaMemcpyAsync(ids_dev, ids, n_ids * sizeof(int), cudaMemcpyHostToDevice, stream);
    if (e != cudaSuccess) return e;
    const unsigned int pen_blocks = std::max(1u, std::min(64u, (most_ids + THREADS - 1) / THREADS));
    if (any_penalty || per_row > 1) {
        prepare_rows<<<dim3(pen_blocks, rows), THREADS, 0, stream>>>(logits, vocab, rows_dev, ids_dev, saved, barriers);
        e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
    cudaError_t drawn = cudaErrorInvalidValue;
    bool done = false;
    if (per_row > 1) {
        const float *logits_arg = logits;
        size_t work_words = at.work_bytes / 8;
        void *args[] = {&logits_arg, &vocab, &rows_dev, &masks, &barriers, &work, &work_words, &tokens};
        drawn = cudaLaunchCooperativeKernel(reinterpret_cast<const void *>(&sample_rows_kernel<true>),
                                            dim3(per_row, rows), dim3(THREADS), args, 0, stream);
        done = drawn != cudaErrorCooperativeLaunchTooLarge && drawn != cudaErrorNotSupported;
        if (done && drawn == cudaSuccess) drawn = cudaGetLastError();
        if (!done) (void)cudaGetLastError();  // fewer resources than asked for: one block a row instead
    }
    if (!done) {
        sample_rows_kernel<false><<<dim3(1, rows), THREADS, 0, stream>>>(logits, vocab, rows_dev, masks, barriers,
                                                                         work, 0, tokens);
        drawn = cudaGetLastError();
    }
    if (any_penalty) {
        // Restored even after a failed draw, so the caller's logits are never left penalized.
        restore_rows<<<dim3(pen_blocks, rows), THREADS, 0, stream>>>(logits, vocab, rows_dev, ids_dev, saved);
        e = cudaGetLastError();
        if (drawn == cudaSuccess && e != cudaSuccess) return e;
    }
    return drawn;
}
