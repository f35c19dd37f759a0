// Token choice on the device, the algorithm of src/sampler.rs: greedy argmax at temperature <= 0; else the
// top_k largest logits (ties to the lower index), p = exp((l - l_max) / T), the shortest prefix of them
// (in logit order) holding top_p of the mass, and the first candidate whose running sum exceeds u times
// the kept mass, u drawn from (seed, stream, position).
//
// One block of 1024 threads does it all, with no sort: each cut is found by a radix descent over the
// logits' order-preserving keys (8 bits a pass), with per-bin counts or masses, then the tie among equal
// logits is resolved by index. Masses are fixed point (p * 2^36 as integers), so every sum is exact and
// independent of the order threads add in: the same logits always give the same token.
#include "hostembed_kernels.cuh"

namespace {

constexpr int S_THREADS = 1024;
constexpr int S_WARPS = S_THREADS / 32;
constexpr float Q_SCALE = 68719476736.0f;  // 2^36: p in (0, 1] becomes an integer up to 2^36
constexpr unsigned int NO_BIN = 0xffffffffu;

struct SampleShared {
    unsigned long long hist[256];
    unsigned int count[256];
    unsigned long long warp_u64[S_WARPS];
    unsigned int warp_u32[S_WARPS];
    unsigned int bin;
    unsigned long long above;
    unsigned int index;
    unsigned int running;
    unsigned int chunk_total;
};

__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ unsigned long long warp_max_u64(unsigned long long v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, v, o);
        v = other > v ? other : v;
    }
    return v;
}

__device__ unsigned long long block_sum_u64(SampleShared &sh, unsigned long long v) {
    const unsigned int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_sum_u64(v);
    __syncthreads();
    if (lane == 0) sh.warp_u64[warp] = v;
    __syncthreads();
    const unsigned long long total = warp_sum_u64(sh.warp_u64[lane]);
    __syncthreads();
    return total;
}

__device__ unsigned long long block_max_u64(SampleShared &sh, unsigned long long v) {
    const unsigned int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_max_u64(v);
    __syncthreads();
    if (lane == 0) sh.warp_u64[warp] = v;
    __syncthreads();
    const unsigned long long best = warp_max_u64(sh.warp_u64[lane]);
    __syncthreads();
    return best;
}

// Adds a thread's pending (bin, mass, count); a warp whose lanes all hold the same bin adds once.
__device__ __forceinline__ void flush_bin(SampleShared &sh, unsigned int bin, unsigned long long mass,
                                          unsigned int cnt) {
    const unsigned int lane = threadIdx.x % 32;
    const unsigned int peers = __match_any_sync(0xffffffffu, bin);
    if (peers == 0xffffffffu) {
        mass = warp_sum_u64(mass);
        cnt = __reduce_add_sync(0xffffffffu, cnt);
        if (lane == 0 && bin != NO_BIN) {
            atomicAdd(&sh.hist[bin], mass);
            atomicAdd(&sh.count[bin], cnt);
        }
    } else if (bin != NO_BIN) {
        atomicAdd(&sh.hist[bin], mass);
        atomicAdd(&sh.count[bin], cnt);
    }
}

// Warp 0: walks the bins from the largest key down, adding their masses to `above`, and stores in sh the
// first bin at which the running mass reaches `thresh`, with the mass of the bins before it. When the
// whole mass stays under thresh (only rounding can do that), the last non-empty bin.
__device__ void find_crossing(SampleShared &sh, unsigned long long above, unsigned long long thresh) {
    const unsigned int lane = threadIdx.x % 32;
    unsigned long long own = 0;  // lane l holds bins 255 - 8l down to 248 - 8l
#pragma unroll
    for (int j = 0; j < 8; j++) own += sh.hist[255 - 8 * lane - j];
    unsigned long long incl = own;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= (unsigned int)o) incl += v;
    }
    const unsigned long long before = above + incl - own;
    const unsigned int crosses = __ballot_sync(0xffffffffu, above + incl >= thresh && own > 0);
    if (crosses != 0) {
        if (lane == (unsigned int)(__ffs(crosses) - 1)) {
            unsigned long long acc = before;
            for (int j = 0; j < 8; j++) {
                const unsigned int b = 255 - 8 * lane - j;
                if (sh.hist[b] > 0 && acc + sh.hist[b] >= thresh) {
                    sh.bin = b;
                    sh.above = acc;
                    break;
                }
                acc += sh.hist[b];
            }
        }
        return;
    }
    const unsigned int nonempty = __ballot_sync(0xffffffffu, own > 0);
    if (nonempty == 0) {
        if (lane == 0) sh.bin = 0, sh.above = above;
        return;
    }
    if (lane == 31u - (unsigned int)__clz(nonempty)) {
        unsigned long long acc = before;
        for (int j = 0; j < 8; j++) {
            const unsigned int b = 255 - 8 * lane - j;
            if (sh.hist[b] > 0) sh.bin = b, sh.above = acc;
            acc += sh.hist[b];
        }
    }
}

struct Cut {
    unsigned int key;             // the key the crossing element has
    unsigned long long above;     // mass of the items with a larger key
    unsigned int count;           // items with exactly that key
    unsigned long long key_mass;  // their total mass
};

// Radix descent over the items (item(i, key, mass) says whether i takes part): the key at which the mass
// in descending key order first reaches thresh. All threads call it.
template <typename Item>
__device__ Cut radix_cut(SampleShared &sh, unsigned int vocab, Item item, unsigned long long thresh) {
    unsigned int prefix = 0, mask = 0;
    unsigned long long above = 0;
    Cut cut{};
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (unsigned int b = threadIdx.x; b < 256; b += S_THREADS) sh.hist[b] = 0, sh.count[b] = 0;
        __syncthreads();
        unsigned int cur = NO_BIN, cnt = 0;
        unsigned long long mass = 0;
        for (unsigned int i = threadIdx.x; i < vocab; i += S_THREADS) {
            unsigned int key;
            unsigned long long m;
            if (!item(i, key, m) || (key & mask) != prefix) continue;
            const unsigned int b = (key >> shift) & 0xffu;
            if (b != cur) {
                if (cur != NO_BIN) atomicAdd(&sh.hist[cur], mass), atomicAdd(&sh.count[cur], cnt);
                cur = b, mass = 0, cnt = 0;
            }
            mass += m, cnt++;
        }
        flush_bin(sh, cur, mass, cnt);
        __syncthreads();
        if (threadIdx.x < 32) find_crossing(sh, above, thresh);
        __syncthreads();
        const unsigned int b = sh.bin;
        above = sh.above;
        prefix |= b << shift;
        mask |= 0xffu << shift;
        if (shift == 0) cut.count = sh.count[b], cut.key_mass = sh.hist[b];
        __syncthreads();
    }
    cut.key = prefix;
    cut.above = above;
    return cut;
}

// The index of the j-th (1-based) smallest i with pred(i); `count` of them exist. All threads call it.
template <typename Pred>
__device__ unsigned int nth_index(SampleShared &sh, unsigned int vocab, Pred pred, unsigned int j,
                                  unsigned int count) {
    const unsigned int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (j <= 1 || j >= count) {  // the first or the last: a min or max over them
        const bool first = j <= 1;
        if (threadIdx.x == 0) sh.index = first ? 0xffffffffu : 0u;
        __syncthreads();
        for (unsigned int i = threadIdx.x; i < vocab; i += S_THREADS)
            if (pred(i)) first ? atomicMin(&sh.index, i) : atomicMax(&sh.index, i);
        __syncthreads();
        const unsigned int r = sh.index;
        __syncthreads();
        return r;
    }
    if (threadIdx.x == 0) sh.running = 0, sh.index = 0xffffffffu;
    __syncthreads();
    for (unsigned int base = 0; base < vocab; base += S_THREADS) {
        const unsigned int i = base + threadIdx.x;
        const bool f = i < vocab && pred(i);
        const unsigned int ballot = __ballot_sync(0xffffffffu, f);
        if (lane == 0) sh.warp_u32[warp] = __popc(ballot);
        __syncthreads();
        if (warp == 0) {
            const unsigned int own = sh.warp_u32[lane];
            unsigned int incl = own;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned int v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= (unsigned int)o) incl += v;
            }
            sh.warp_u32[lane] = incl - own;
            if (lane == 31) sh.chunk_total = incl;
        }
        __syncthreads();
        if (f) {
            const unsigned int rank = sh.running + sh.warp_u32[warp] + __popc(ballot & ((1u << lane) - 1u)) + 1;
            if (rank == j) sh.index = i;
        }
        __syncthreads();
        if (threadIdx.x == 0) sh.running += sh.chunk_total;
        const bool done = sh.index != 0xffffffffu;
        __syncthreads();
        if (done) break;
    }
    const unsigned int r = sh.index;
    __syncthreads();
    return r;
}

// How many items of mass `per_item` past `above` it takes to reach thresh, within [1, count].
__device__ __forceinline__ unsigned int items_to_reach(unsigned long long thresh, unsigned long long above,
                                                       unsigned long long per_item, unsigned int count) {
    if (per_item == 0 || thresh <= above) return 1;
    const unsigned long long need = (thresh - above + per_item - 1) / per_item;
    return (unsigned int)(need < 1 ? 1 : need > count ? count : need);
}

__global__ __launch_bounds__(S_THREADS) void sample_kernel(const float *__restrict__ logits, unsigned int vocab,
                                                           float temperature, unsigned int top_k, float top_p,
                                                           unsigned long long seed, unsigned int stream_index,
                                                           unsigned long long position,
                                                           unsigned long long *__restrict__ mass, int *token) {
    __shared__ SampleShared sh;
    const unsigned int tid = threadIdx.x;

    // Argmax: the largest key, then the lowest index (packed so one max does both).
    unsigned long long best = 0;
    for (unsigned int i = tid; i < vocab; i += S_THREADS) {
        const unsigned long long packed =
            ((unsigned long long)he::float_key(logits[i]) << 32) | (unsigned long long)(0xffffffffu - i);
        best = packed > best ? packed : best;
    }
    best = block_max_u64(sh, best);
    const unsigned int arg = 0xffffffffu - (unsigned int)(best & 0xffffffffu);
    if (!(temperature > 0.f) || top_k == 1) {
        if (tid == 0) *token = (int)arg;
        return;
    }
    const float l_max = logits[arg];

    // The top_k candidates: keys above tau, and the lowest-index ties at tau up to k in all.
    unsigned int tau = 0, tau_cut = 0xffffffffu;
    if (top_k != 0 && top_k < vocab) {
        auto all = [&](unsigned int i, unsigned int &key, unsigned long long &m) {
            key = he::float_key(logits[i]);
            m = 1;
            return true;
        };
        const Cut c = radix_cut(sh, vocab, all, top_k);
        tau = c.key;
        const unsigned int ties = items_to_reach(top_k, c.above, 1, c.count);
        if (ties < c.count)
            tau_cut = nth_index(sh, vocab, [&](unsigned int i) { return he::float_key(logits[i]) == tau; }, ties,
                                c.count);
    }

    // Fixed-point masses of the candidates (0 for the rest) and their total.
    unsigned long long local = 0;
    for (unsigned int i = tid; i < vocab; i += S_THREADS) {
        const float l = logits[i];
        const unsigned int key = he::float_key(l);
        unsigned long long m = 0;
        if (key > tau || (key == tau && i <= tau_cut)) m = __float2ull_rn(expf((l - l_max) / temperature) * Q_SCALE);
        mass[i] = m;
        local += m;
    }
    const unsigned long long total = block_sum_u64(sh, local);  // its barriers also publish mass[]

    // top_p: the shortest prefix whose mass reaches top_p of the total.
    unsigned int theta = 0, theta_cut = 0xffffffffu;
    unsigned long long kept = total;
    if (top_p > 0.f && top_p < 1.f) {
        unsigned long long thresh = (unsigned long long)ceil((double)top_p * (double)total);
        thresh = thresh < 1 ? 1 : thresh > total ? total : thresh;
        auto candidates = [&](unsigned int i, unsigned int &key, unsigned long long &m) {
            m = mass[i];
            if (m == 0) return false;
            key = he::float_key(logits[i]);
            return true;
        };
        const Cut c = radix_cut(sh, vocab, candidates, thresh);
        theta = c.key;
        const unsigned long long per = c.count ? c.key_mass / c.count : 0;
        const unsigned int take = items_to_reach(thresh, c.above, per, c.count);
        kept = c.above + (unsigned long long)take * per;
        if (take < c.count)
            theta_cut = nth_index(
                sh, vocab, [&](unsigned int i) { return mass[i] != 0 && he::float_key(logits[i]) == theta; }, take,
                c.count);
    }

    // The draw: the first kept candidate whose running mass exceeds u * kept.
    const unsigned long long bits =
        he::splitmix64(seed ^ he::splitmix64(((unsigned long long)stream_index << 40) ^ position)) >> 40;
    const unsigned long long lo = bits * kept, hi = __umul64hi(bits, kept);
    const unsigned long long r = (hi << 40) | (lo >> 24);  // floor(bits * kept / 2^24), exactly
    auto kept_item = [&](unsigned int i, unsigned int &key, unsigned long long &m) {
        m = mass[i];
        if (m == 0) return false;
        key = he::float_key(logits[i]);
        return key > theta || (key == theta && i <= theta_cut);
    };
    const Cut c = radix_cut(sh, vocab, kept_item, r + 1);
    const unsigned int rho = c.key;
    const unsigned long long per = c.count ? c.key_mass / c.count : 0;
    const unsigned int nth = items_to_reach(r + 1, c.above, per, c.count);
    const unsigned int pick = nth_index(
        sh, vocab,
        [&](unsigned int i) {
            unsigned int key;
            unsigned long long m;
            return kept_item(i, key, m) && key == rho;
        },
        nth, c.count);
    if (tid == 0) *token = (int)pick;
}

}  // namespace

extern "C" cudaError_t hostembed_sample(const float *logits, unsigned int vocab, float temperature,
                                        unsigned int top_k, float top_p, uint64_t seed, unsigned int stream_index,
                                        uint64_t position, void *scratch, int *token, cudaStream_t stream) {
    if (logits == nullptr || token == nullptr || vocab == 0 || vocab > 0x7fffffffu) return cudaErrorInvalidValue;
    if (scratch == nullptr || reinterpret_cast<uintptr_t>(scratch) % 8 != 0) return cudaErrorInvalidValue;
    sample_kernel<<<1, S_THREADS, 0, stream>>>(logits, vocab, temperature, top_k, top_p, seed, stream_index,
                                               position, static_cast<unsigned long long *>(scratch), token);
    return cudaGetLastError();
}
