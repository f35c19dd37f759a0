// The Mixture-of-Experts products of the tensor-core rows (prompt chunks of 16 tokens or more) as grouped
// products on tensor cores (mma.sync m16n8k16, sm_80 and newer): the slots hostembed_moe_route grouped by
// expert, each expert's group times its matrix, half-format operands, f32 accumulation.
//
// A block computes 64 slots of one expert's group by 128 rows of its matrix over 32-column slices (the
// product of kernels/gemm.cu, with the slot tile gathered through the group's list). The slots' half rows
// come through a 3-stage cp.async pipeline; the weights are read in their own format as 8-value pieces
// (kernels/formats/pieces.cuh, the conversion's reads and decode, so the values are the converted
// matrix's bit for bit) a slice ahead into registers, decoded and stored as halves into one of two shared
// slices while the other is multiplied: an expert's weights are read once a tile of its slots, never
// written out converted. Its (expert, tile) comes from the group counts on the device, so nothing is read
// back: the grid's x is an upper bound of the tiles, and blocks past the last tile return. There is no
// split of the columns: each output is one f32 chain over the columns in order, whatever else the tile
// holds (rows of other slots, or zeros), so a row's results depend on its own inputs and the shapes only,
// alone or in a batch.
#include "formats.cuh"
#include "formats/pieces.cuh"
#include "hostembed_kernels.cuh"
#include "moe.cuh"

namespace {

constexpr int MG_BM = 64, MG_BN = 128, MG_BK = 32, MG_STAGES = 3, MG_THREADS = 256;
// Padded shared rows (40 halves = 80 bytes): ldmatrix's 8 row reads land in 8 distinct bank groups.
constexpr int MG_STRIDE = MG_BK + 8;
// A thread's weight pieces a slice (128 rows x 4 pieces).
constexpr int MG_PIECES = MG_BN * MG_BK / 8 / MG_THREADS;
// Warps: 2 along the slots (32 each) by 4 along the weight rows (32 each).
constexpr int MG_WM = 32, MG_WN = 32, MG_MT = MG_WM / 16, MG_NT = MG_WN / 8;
constexpr unsigned MG_MAX_EXPERTS = 1024;
constexpr unsigned NONE = 0xFFFFFFFFu;

// Block `tile`'s expert and first place in that expert's group, counting each chosen expert's tiles of
// MG_BM slots in ascending expert order (warp 0 scans 32 experts at a time); expert NONE past the last tile.
__device__ __forceinline__ void find_tile(const he::MoeGroups &g, unsigned tile, unsigned &expert, unsigned &first) {
    __shared__ unsigned found_expert, found_first;
    if (threadIdx.x < 32) {
        const unsigned lane = threadIdx.x, active = g.active();
        unsigned base = 0, hit = NONE, at = 0;
        for (unsigned a0 = 0; a0 < active; a0 += 32) {
            const unsigned a = a0 + lane;
            const unsigned e = a < active ? g.expert(a) : 0;
            const unsigned tiles = a < active ? (g.count(e) + MG_BM - 1) / MG_BM : 0;
            unsigned incl = tiles;
#pragma unroll
            for (unsigned d = 1; d < 32; d *= 2) {
                const unsigned v = __shfl_up_sync(0xffffffffu, incl, d);
                if (lane >= d) incl += v;
            }
            const unsigned excl = incl - tiles;
            if (tile >= base + excl && tile < base + incl) hit = e, at = (tile - base - excl) * MG_BM;
            base += __shfl_sync(0xffffffffu, incl, 31);
            if (tile < base) break;  // base is the warp's: every lane leaves together
        }
        const unsigned who = __ballot_sync(0xffffffffu, hit != NONE);
        const unsigned src = who != 0 ? __ffs(who) - 1 : 0;
        const unsigned e = __shfl_sync(0xffffffffu, hit, src), f = __shfl_sync(0xffffffffu, at, src);
        if (lane == 0) found_expert = who != 0 ? e : NONE, found_first = f;
    }
    __syncthreads();
    expert = found_expert;
    first = found_first;
}

// Slot s of the tile of expert e (its group's places first.. first + fill): out[s * ldy + r] = W_e[r] .
// a[s / per] for rows r of W_e (rows x cols of format F, expert e's values right after expert e - 1's, so
// the stack is one run of pieces); with GLU, the half out[s * ldy + r] = silu(gate[s * ldy + r]) * that
// product instead.
template <typename F, typename Op, bool GLU>
__global__ __launch_bounds__(MG_THREADS) void grouped_kernel(const unsigned short *__restrict__ a, unsigned lda,
                                                             unsigned per, const unsigned char *__restrict__ w,
                                                             unsigned rows, unsigned cols,
                                                             const int *__restrict__ groups, unsigned experts,
                                                             const float *__restrict__ gate, void *__restrict__ out,
                                                             unsigned ldy) {
    using P = he::Pieces<F>;
    __shared__ __align__(16) unsigned short a_tiles[MG_STAGES][MG_BM * MG_STRIDE];
    __shared__ __align__(16) unsigned short w_tiles[2][MG_BN * MG_STRIDE];
    const he::MoeGroups g{groups, experts};
    unsigned e, first;
    find_tile(g, blockIdx.x, e, first);
    if (e == NONE) return;  // the block's, uniformly
    const unsigned tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const unsigned row0 = blockIdx.y * MG_BN;
    const unsigned wm = (warp / 4) * MG_WM, wn = (warp % 4) * MG_WN;
    const unsigned k_tiles = (cols + MG_BK - 1) / MG_BK;
    const int *slots = g.list() + g.start(e) + first;
    const unsigned fill = min(g.count(e) - first, (unsigned)MG_BM);
    // Expert e's first piece in the stack.
    const size_t w_first = (size_t)e * rows * (cols / 8);

    // A thread copies one 16-byte piece of the slot tile (64 rows x 4) a slice; its slot row's address is
    // found once.
    const unsigned ar = tid / 4, ac = (tid % 4) * 8;
    const bool a_in = ar < fill;
    const unsigned short *a_row = a_in ? a + (size_t)((unsigned)slots[ar] / per) * lda : a;
    auto load_a = [&](unsigned kt) {
        const unsigned k0 = kt * MG_BK;
        const bool ok = a_in && k0 + ac < cols;  // cols is a multiple of 8: a piece is all in or all out
        he::cp_async16(&a_tiles[kt % MG_STAGES][ar * MG_STRIDE + ac], ok ? a_row + k0 + ac : a, ok);
    };
    // Its weight pieces tid, tid + 256: loads only (in flight while a slice is multiplied), then decoded
    // and stored as halves, zeros past the matrix.
    typename P::Raw raw[MG_PIECES] = {};
    auto w_in = [&](int i, unsigned kt) {
        const unsigned piece = tid + i * MG_THREADS;
        return row0 + piece / 4 < rows && kt * MG_BK + (piece % 4) * 8 < cols;
    };
    auto load_w = [&](unsigned kt) {
#pragma unroll
        for (int i = 0; i < MG_PIECES; i++) {
            const unsigned piece = tid + i * MG_THREADS;
            const size_t at = w_first + (size_t)(row0 + piece / 4) * (cols / 8) + kt * (MG_BK / 8) + piece % 4;
            if (w_in(i, kt)) raw[i] = P::load(w, at);
        }
    };
    auto store_w = [&](unsigned kt) {
#pragma unroll
        for (int i = 0; i < MG_PIECES; i++) {
            const unsigned piece = tid + i * MG_THREADS;
            uint4 h = make_uint4(0u, 0u, 0u, 0u);
            if (w_in(i, kt)) {
                float v[8];
                P::decode(raw[i], v);
                h = make_uint4(Op::pack(v[0], v[1]), Op::pack(v[2], v[3]), Op::pack(v[4], v[5]), Op::pack(v[6], v[7]));
            }
            *reinterpret_cast<uint4 *>(&w_tiles[kt % 2][(piece / 4) * MG_STRIDE + (piece % 4) * 8]) = h;
        }
    };

    float acc[MG_MT][MG_NT][4];
#pragma unroll
    for (int i = 0; i < MG_MT; i++)
#pragma unroll
        for (int j = 0; j < MG_NT; j++)
#pragma unroll
            for (int v = 0; v < 4; v++) acc[i][j][v] = 0.f;

#pragma unroll
    for (unsigned s = 0; s < MG_STAGES - 1; s++) {
        if (s < k_tiles) load_a(s);
        he::cp_async_commit();
    }
    load_w(0);
    store_w(0);
    if (k_tiles > 1) load_w(1);

    for (unsigned kt = 0; kt < k_tiles; kt++) {
        he::cp_async_wait<MG_STAGES - 2>();
        // Slice kt is in (its weights stored by every thread); every warp is done with slice kt - 1, whose
        // buffers the stores and copies below overwrite.
        __syncthreads();
        if (kt + MG_STAGES - 1 < k_tiles) load_a(kt + MG_STAGES - 1);
        he::cp_async_commit();
        if (kt + 1 < k_tiles) {
            store_w(kt + 1);
            if (kt + 2 < k_tiles) load_w(kt + 2);
        }

        const unsigned short *as = a_tiles[kt % MG_STAGES];
        const unsigned short *bs = w_tiles[kt % 2];
        he::mma_warp_tile<Op, MG_MT, MG_NT, MG_BK, MG_STRIDE>(acc, as, bs, wm, wn, lane);
    }
    he::cp_async_wait<0>();

    // Accumulator (i, j): tile rows wm + 16i + lane/4 (+8), weight rows wn + 8j + 2(lane%4) (+1); pairs
    // of outputs stored together (ldy is even and the outputs aligned: the launcher checks).
#pragma unroll
    for (int i = 0; i < MG_MT; i++) {
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const unsigned t = wm + i * 16 + lane / 4 + hf * 8;
            if (t >= fill) continue;
            const size_t s = (unsigned)slots[t];
#pragma unroll
            for (int j = 0; j < MG_NT; j++) {
                const unsigned r = row0 + wn + j * 8 + 2 * (lane % 4);
                if (r >= rows) continue;
                const float v0 = acc[i][j][hf * 2], v1 = acc[i][j][hf * 2 + 1];
                const size_t at = s * ldy + r;
                const bool pair = r + 1 < rows;
                if constexpr (GLU) {
                    using T = typename Op::T;
                    T *o = static_cast<T *>(out) + at;
                    const float h0 = he::silu(gate[at]) * v0;
                    if (pair)
                        *reinterpret_cast<unsigned *>(o) = Op::pack(h0, he::silu(gate[at + 1]) * v1);
                    else
                        he::HalfOut<Op>::put(o, h0);
                } else {
                    float *o = static_cast<float *>(out) + at;
                    if (pair)
                        *reinterpret_cast<float2 *>(o) = make_float2(v0, v1);
                    else
                        *o = v0;
                }
            }
        }
    }
}

bool aligned(const void *p, uintptr_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; }

}  // namespace

extern "C" cudaError_t hostembed_moe_grouped(const void *a, unsigned int lda, unsigned int per, int dtype,
                                             const void *w, int w_dtype, unsigned int rows, unsigned int cols,
                                             const int *groups, unsigned int experts, unsigned int slots,
                                             const float *gate, void *out, unsigned int ldy, cudaStream_t stream) {
    // w at 16 bytes: the widest alignment any format's pieces ask for.
    if (a == nullptr || w == nullptr || groups == nullptr || out == nullptr || rows == 0 || cols == 0 || per == 0 ||
        cols % 8 != 0 || lda % 8 != 0 || lda < cols || ldy < rows || ldy % 2 != 0 || experts == 0 ||
        experts > MG_MAX_EXPERTS || !aligned(a, 16) || !aligned(w, 16) || !aligned(out, 8))
        return cudaErrorInvalidValue;
    if (slots == 0) return cudaSuccess;
    // Tiles at most: every slot in a tile of its own expert's, one part-filled tile an expert chosen.
    const size_t tiles = ((size_t)slots + MG_BM - 1) / MG_BM + (slots < experts ? slots : experts);
    const size_t row_tiles = ((size_t)rows + MG_BN - 1) / MG_BN;
    if (tiles > 0x7FFFFFFFu || row_tiles > 65535) return cudaErrorInvalidValue;
    const dim3 grid((unsigned)tiles, (unsigned)row_tiles);
    cudaError_t err = cudaErrorInvalidValue;
    he::with_format(w_dtype, [&](auto format) {
        using F = decltype(format);
        if (he::row_bytes<F>(cols) == 0) return;  // rows are not whole blocks
        he::with_half(dtype, [&](auto op) {
            using Op = decltype(op);
            auto kernel = gate != nullptr ? grouped_kernel<F, Op, true> : grouped_kernel<F, Op, false>;
            kernel<<<grid, MG_THREADS, 0, stream>>>(static_cast<const unsigned short *>(a), lda, per,
                                                    static_cast<const unsigned char *>(w), rows, cols, groups,
                                                    experts, gate, out, ldy);
            err = cudaGetLastError();
        });
    });
    return err;
}
