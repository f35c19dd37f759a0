// The half rows' decode product past 8 tokens on Hopper's warpgroup products (sm_90a): the same sums in
// the same order as mmv_half.cu's kernels, with the activations (B) read by the tensor cores from shared
// memory once a warpgroup instead of once a warp. At 64 tokens mma.sync's B fragments were 8 bytes of
// shared memory read a weight byte, 63% of the multiprocessor's shared bandwidth (the F16 product's
// profile), which bounded the product at a third of the copy bandwidth; here they are 2.
//
// A block of 8 warps is two warpgroups of 64 rows, each warp its 16 rows as in mmv_half.cu (the A
// fragment of wgmma is mma.sync's, so the weights load as they do there, a lane's 16 bytes a 32-column
// step). The activations are converted once by mmv_wg_prep_kernel into B's shared-memory layout and
// copied a chunk at a time with cp.async; every product of a k-step is hi then lo into one accumulator,
// in column order, F16's groups scaled as MmaF16 says: a token's bits are those of its 1-token product,
// since wgmma rounds as mma.sync does (mmv_warpgroup_kernel_gives_the_mma_kernels_bits checks it; it passed
// on an H100, and the kernel is the default there: BENCHMARKS.md, 2026-12-07).
#include <atomic>
#include "mmv.cuh"
#include "wgmma.cuh"

namespace {

// The converted activations of a launch of NT tiles (8 NT tokens, absent ones too): per 32-column step,
// for each of its two k-steps and each half (hi, lo), one B operand of m64n(8 NT)k16 as 8x16-byte core
// matrices, [token / 8][k / 8], each 8 tokens' rows of 8 k. A lane t's A fragment holds the step's columns
// 8t .. 8t + 7 (one 16-byte load): k-step s takes columns 8t + 4s, + 1 as k 2t, 2t + 1 and 8t + 4s + 2, + 3
// as k 8 + 2t, 9 + 2t, so the pair of columns 8t + 2q, + 1 is k-step q / 2, core matrix column q % 2, word t.
constexpr unsigned WG_CORE = 128, WG_LEAD = WG_CORE, WG_STRIDE = 2 * WG_CORE;
__host__ __device__ constexpr unsigned wg_operand_bytes(unsigned nt) { return nt * WG_STRIDE; }
__host__ __device__ constexpr unsigned wg_step_bytes(unsigned nt) { return 4 * wg_operand_bytes(nt); }
// Columns a staged chunk holds: 32 KiB, two chunks and the exponents beside two blocks a multiprocessor.
__host__ __device__ constexpr unsigned wg_chunk(unsigned nt) { return 32 * 1024 / (nt * 32); }

// One warp a token's 256-column group, as mmv_prep_kernel converts it, written in wgmma's layout.
template <typename R, int NT>
__global__ __launch_bounds__(MMV_THREADS) void mmv_wg_prep_kernel(const float *__restrict__ x, unsigned int n,
                                                                   unsigned int cols, unsigned int *__restrict__ xp,
                                                                   int *__restrict__ xe) {
    he::pdl_launch_dependents();
    const unsigned int groups = (cols + MMV_KC - 1) / MMV_KC, lane = threadIdx.x % 32;
    const unsigned int unit = blockIdx.x * MMV_WARPS + threadIdx.x / 32;
    he::pdl_wait();  // x comes from the kernel before; the product before may still read xp
    if (unit >= n * groups) return;  // a whole warp
    const unsigned int tok = unit / groups, gi = unit % groups, c0 = gi * MMV_KC;
    const bool here = c0 + 8 * lane < cols;
    float f[8];
    const float amax = stage_unit(x, tok, cols, c0, lane, here, f);
    uint4 q0, q1;  // columns 8t .. 8t + 3 and 8t + 4 .. 8t + 7: hi pairs in x, y, lo pairs in z, w
    if constexpr (R::SCALED) {
        const int ex = mmv_group_exponent(amax);
        const float scale = mmv_pow2(ex);
        q0 = mmv_quad_scaled<typename R::Op>(f, scale), q1 = mmv_quad_scaled<typename R::Op>(f + 4, scale);
        if (lane == 0) xe[tok * groups + gi] = ex;
    } else {
        q0 = mmv_quad_plain<typename R::Op>(f), q1 = mmv_quad_plain<typename R::Op>(f + 4);
    }
    if (!here) return;
    constexpr unsigned OPW = wg_operand_bytes(NT) / 4, LEAD = WG_LEAD / 4;  // in words
    unsigned int *at = xp + (size_t)((c0 + 8 * lane) / 32) * (wg_step_bytes(NT) / 4) + (tok / 8) * (WG_STRIDE / 4) +
                       (tok % 8) * 4 + lane % 4;
    // Operand (k-step s, half h) at (2s + h) OPW; core matrix column 1 at LEAD.
    at[0] = q0.x, at[LEAD] = q0.y, at[2 * OPW] = q1.x, at[2 * OPW + LEAD] = q1.y;
    at[OPW] = q0.z, at[OPW + LEAD] = q0.w, at[3 * OPW] = q1.z, at[3 * OPW + LEAD] = q1.w;
}

// PIPE: three chunk buffers and four groups of weight registers, a group's products left in flight while
// the next group's are issued (waits for all of them only at the end of a 256-column span).
template <typename R, int NT, bool GLU, bool PIPE>
__global__ __launch_bounds__(MMV_THREADS, 2) void mmv_wg_kernel(const unsigned char *__restrict__ w,
                                                                 const unsigned char *__restrict__ w2, unsigned int rows,
                                                                 unsigned int cols, size_t row_bytes,
                                                                 const float *__restrict__ x, unsigned int n,
                                                                 const float *bias, const float *residual, float *y,
                                                                 unsigned int ldy, float *partial, unsigned int *counters) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(128) unsigned char wg_smem[];
    constexpr unsigned UNROLL = PIPE ? 2 : R::UNROLL, GROUP = UNROLL * R::STEP, KCH = wg_chunk(NT);
    constexpr unsigned BUF = KCH / 32 * wg_step_bytes(NT), TOKENS = NT * 8, BUFS = PIPE ? 3 : 2;
    constexpr bool BF = R::Op::ID == HE_DTYPE_BF16;
    static_assert(R::STEP == 32 && R::KSTEPS == 2 && KCH % GROUP == 0 && MMV_KC % GROUP == 0, "whole groups a chunk");
    const unsigned int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
    he::pdl_launch_dependents();
    const MmvShape shape = mmv_shape(rows, cols, GLU, true);
    const unsigned int k_begin = blockIdx.y * shape.kr;
    const unsigned int k_end = min(cols, k_begin + shape.kr);
    const unsigned char *xp =
        reinterpret_cast<const unsigned char *>(partial + mmv_prep_offset(mmv_shape(rows, cols, GLU), GLU, n, rows));
    const int *xpe = reinterpret_cast<const int *>(xp) + (size_t)TOKENS * cols;
    const unsigned int row_groups = (cols + MMV_KC - 1) / MMV_KC;
    const MmvRows rw = mmv_rows<GLU>(w, w2, rows, row_bytes, warp, g);
    const unsigned char *wr[2] = {rw.wa, rw.wb};
    const uint32_t smem = (uint32_t)__cvta_generic_to_shared(wg_smem);
    int *xes = reinterpret_cast<int *>(wg_smem + BUFS * BUF);  // the range's exponents, [group][token]

    float acc[NT][4];  // mma.sync's layout, which wgmma's accumulators share (a tile of 8 tokens after another)
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[j][e] = 0.f;
    float(&flat)[NT * 4] = reinterpret_cast<float(&)[NT * 4]>(acc);

    const unsigned int chunks = (k_end - k_begin + KCH - 1) / KCH;
    auto issue = [&](unsigned int ci) {  // chunk ci's bytes are contiguous in xp
        if (ci < chunks) {
            const unsigned int c0 = k_begin + ci * KCH, bytes = min(KCH, k_end - c0) / 32 * wg_step_bytes(NT);
            const unsigned char *src = xp + (size_t)(c0 / 32) * wg_step_bytes(NT);
            unsigned char *dst = wg_smem + (ci % BUFS) * BUF;
            for (unsigned int i = tid; i < bytes / 16; i += MMV_THREADS) he::cp_async16(dst + 16 * i, src + 16 * i, true);
        }
        he::cp_async_commit();
    };
    // Scaled readers: the lane's accumulators times 2^(sign e) of their tokens' group holding `col`.
    auto rescale = [&](unsigned int col, int sign) {
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const int2 e = *reinterpret_cast<const int2 *>(xes + (col - k_begin) / MMV_KC * TOKENS + 8 * j + 2 * t);
            const float f0 = mmv_pow2(sign * e.x), f1 = mmv_pow2(sign * e.y);
            acc[j][0] *= f0, acc[j][2] *= f0, acc[j][1] *= f1, acc[j][3] *= f1;
        }
    };
    using Raw = typename R::Raw;
    auto fetch_group = [&](Raw (&r)[UNROLL][2], unsigned int col) { fetch_rows<R, UNROLL>(r, wr, col, k_end, t); };
    // The steps of column group `col` on the chunk at shared address `buf` starting at column `c0`; returns
    // with every product done (their A registers free for the next group's weights), or (PIPE) in flight.
    auto compute = [&](const Raw (&r)[UNROLL][2], unsigned int col, uint32_t buf, unsigned int c0) {
#pragma unroll
        for (int u = 0; u < (int)UNROLL; u++) {
            const unsigned int cu = col + u * R::STEP;
            if (cu >= k_end) break;
            if constexpr (R::SCALED && !PIPE)
                if (cu % MMV_KC == 0) rescale(cu, 1);
            unsigned int fa[R::KSTEPS][2], fb[R::KSTEPS][2];
            R::frag(r[u][0], fa);
            R::frag(r[u][1], fb);
            const uint32_t step = buf + (cu - c0) / 32 * wg_step_bytes(NT);
            he::wg::fence();  // the weights' registers and rescaled accumulators before the products
#pragma unroll
            for (int k = 0; k < (int)R::KSTEPS; k++) {
                const unsigned int a[4] = {fa[k][0], fb[k][0], fa[k][1], fb[k][1]};
                const uint32_t op = step + 2 * k * wg_operand_bytes(NT);
                he::wg::mma<NT, BF>(flat, a, he::wg::desc(op, WG_LEAD, WG_STRIDE));  // hi
                he::wg::mma<NT, BF>(flat, a, he::wg::desc(op + wg_operand_bytes(NT), WG_LEAD, WG_STRIDE));  // lo
            }
            he::wg::commit();
            if constexpr (R::SCALED && !PIPE)
                if ((cu + R::STEP) % MMV_KC == 0 || cu + R::STEP >= k_end) {
                    he::wg::wait<0>();
                    rescale(cu, -1);
                }
        }
        if constexpr (!PIPE) he::wg::wait<0>();
    };

    // Chunk ci enters: its copies are waited for and seen by every thread, and chunk ci + 1's go out into
    // the buffer chunk ci + 1 - BUFS took, whose products every warp has finished.
    unsigned int entered = ~0u;
    auto enter = [&](unsigned int col) {
        const unsigned int ci = (col - k_begin) / KCH;
        if (ci != entered) {
            he::cp_async_wait<0>();
            he::wg::fence_shared();  // the copies, seen by the tensor cores' reads
            __syncthreads();
            issue(ci + 1);
            entered = ci;
        }
        return ci;
    };
    auto start = [&]() {
        he::pdl_wait();  // the converted activations come from mmv_wg_prep_kernel
        issue(0);
        if constexpr (R::SCALED) {  // read once the first chunk's barrier has passed
            const unsigned int range_groups = (k_end - k_begin + MMV_KC - 1) / MMV_KC, first = k_begin / MMV_KC;
            for (unsigned int i = tid; i < n * range_groups; i += MMV_THREADS) {
                const unsigned int tok = i / range_groups, gi = i % range_groups;
                xes[gi * TOKENS + tok] = __ldg(xpe + tok * row_groups + first + gi);
            }
        }
    };
    if constexpr (PIPE) {
        // A 256-column span at a time (4 groups; k_begin is a multiple of 256): group g's weights in r[g % 4],
        // fetched three groups ahead once the group before g is done, so F16's scaling (before and after
        // the span, all products done) sits where every wait is unconditional.
        static_assert(MMV_KC == 4 * GROUP, "four groups a span");
        Raw r[4][UNROLL][2];
#pragma unroll
        for (int q = 0; q < 3; q++)
            if (k_begin + q * GROUP < k_end) fetch_group(r[q], k_begin + q * GROUP);
        start();
        for (unsigned int span = k_begin; span < k_end; span += MMV_KC) {
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const unsigned int col = span + q * GROUP;
                if (col >= k_end) break;
                const unsigned int ci = enter(col);
                // After the barrier: the first span's exponents are written by other threads in start().
                if constexpr (R::SCALED)
                    if (q == 0) rescale(span, 1);
                compute(r[q], col, smem + (ci % BUFS) * BUF, k_begin + ci * KCH);
                he::wg::wait<1>();  // the group before this one is done: r[(q + 3) % 4] is free
                if (col + 3 * GROUP < k_end) fetch_group(r[(q + 3) % 4], col + 3 * GROUP);
            }
            he::wg::wait<0>();
            if constexpr (R::SCALED) rescale(span, -1);
        }
    } else {
        Raw cur[UNROLL][2], nxt[UNROLL][2];
        fetch_group(cur, k_begin);
        start();
        for (unsigned int col = k_begin; col < k_end; col += GROUP) {
            if (col + GROUP < k_end) fetch_group(nxt, col + GROUP);
            const unsigned int ci = enter(col);
            compute(cur, col, smem + (ci % BUFS) * BUF, k_begin + ci * KCH);
#pragma unroll
            for (int u = 0; u < (int)UNROLL; u++) cur[u][0] = nxt[u][0], cur[u][1] = nxt[u][1];
        }
    }

    mmv_write_tiles<GLU, NT>(shape, n, rows, rw, bias, residual, y, ldy, partial, counters, acc, t);
#else
    __trap();  // launched only where the card is sm_90 (he::mmv::warpgroup_ready)
#endif
}

template <typename R, int NT, bool GLU, bool PIPE>
cudaError_t launch_wg(const he::mmv::Args &a) {
    const unsigned int rows = a.rows, cols = a.cols, n = a.n;
    const MmvShape shape = mmv_shape(rows, cols, GLU, true);
    float *staged = a.partial + mmv_prep_offset(mmv_shape(rows, cols, GLU), GLU, n, rows);
    const unsigned int warps = n * ((cols + MMV_KC - 1) / MMV_KC);
    cudaError_t e = he::launch_overlapped(a.tuning, mmv_wg_prep_kernel<R, NT>, dim3((warps + MMV_WARPS - 1) / MMV_WARPS),
                                          dim3(MMV_THREADS), 0, a.stream, a.x, n, cols,
                                          reinterpret_cast<unsigned int *>(staged),
                                          reinterpret_cast<int *>(staged + (size_t)NT * 8 * cols));
    if (e != cudaSuccess) return e;
    const int smem = (int)((PIPE ? 3 : 2) * (wg_chunk(NT) / 32) * wg_step_bytes(NT) + mmv_prep_exponent_bytes(NT, shape.kr));
    return launch_tokens(mmv_wg_kernel<R, NT, GLU, PIPE>, dim3(shape.row_blocks, shape.splits), smem, a);
}

}  // namespace

bool he::mmv::warpgroup_ready(const hostembed_tuning &tuning) {
    if (tuning.mmv_wgmma == 0) return false;
    // Each device's answer, asked once (0 not asked, 1 no, 2 yes): a launch then costs one runtime call.
    static std::atomic<unsigned char> sm90a[64];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (dev >= 0 && dev < 64 && sm90a[dev].load(std::memory_order_relaxed) != 0)
        return sm90a[dev].load(std::memory_order_relaxed) == 2;
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
        return false;
    const bool yes = major == 9 && minor == 0;
    if (dev >= 0 && dev < 64) sm90a[dev].store(yes ? 2 : 1, std::memory_order_relaxed);
    return yes;
}

cudaError_t he::mmv::warpgroup(bool glu, const Args &a) {
    if (a.n <= MMV_PREP_AFTER || a.n > MMV_MAX_TOKENS) return cudaErrorInvalidValue;
    cudaError_t err = cudaErrorNotSupported;
    with_reader(a.dtype, [&](auto reader) {
        using R = decltype(reader);
        if constexpr (!R::INT) {
            auto go = [&](auto g) {
                constexpr bool GLU = decltype(g)::value;
                const unsigned nt = mmv_prep_tiles(a.n);
                auto pick = [&](auto pipe) {
                    constexpr bool P = decltype(pipe)::value;
                    return nt == 2 ? launch_wg<R, 2, GLU, P>(a) : nt == 4 ? launch_wg<R, 4, GLU, P>(a) : launch_wg<R, 8, GLU, P>(a);
                };
                err = a.tuning.mmv_wgmma == 2 ? pick(std::true_type{}) : pick(std::false_type{});
            };
            if (glu) go(std::true_type{});
            else go(std::false_type{});
        }
    });
    return err;
}
