// The half rows' decode product (BF16 and F16 weights): mmv_kernel, the activations converted once a
// product past 8 tokens (mmv_prep_kernel), and their launcher. kernels/mmv_readers.cuh says the design.
#include "mmv.cuh"

namespace {

// One warp a token's 256-column group: its 8 columns a lane, as stage_scaled / stage do in a block.
template <typename R>
__global__ __launch_bounds__(MMV_THREADS) void mmv_prep_kernel(const float *__restrict__ x, unsigned int n,
                                                                unsigned int cols, uint4 *__restrict__ xp,
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
    uint4 *at = xp + ((size_t)tok * cols + c0) / 4 + 2 * lane;
    if constexpr (R::SCALED) {
        const int ex = mmv_group_exponent(amax);
        const float scale = mmv_pow2(ex);
        if (here) at[0] = mmv_quad_scaled<typename R::Op>(f, scale), at[1] = mmv_quad_scaled<typename R::Op>(f + 4, scale);
        if (lane == 0) xe[tok * groups + gi] = ex;
    } else {
        if (here) at[0] = mmv_quad_plain<typename R::Op>(f), at[1] = mmv_quad_plain<typename R::Op>(f + 4);
    }
}

// PREP: the activations come staged from mmv_prep_kernel (in the workspace after the split sums), in chunks
// of whole column groups copied a chunk ahead into two buffers; the streamed kernel only.
template <typename R, int NT, bool GLU, bool STAGED, bool PREP = false>
__global__ __launch_bounds__(MMV_THREADS, NT <= 2 ? MMV_SMALL_MIN_BLOCKS : 2) void mmv_kernel(const unsigned char *__restrict__ w,
                                                         const unsigned char *__restrict__ w2, unsigned int rows,
                                                         unsigned int cols, size_t row_bytes,
                                                         const float *__restrict__ x, unsigned int n,
                                                         const float *bias, const float *residual, float *y,
                                                         unsigned int ldy, float *partial, unsigned int *counters) {
    extern __shared__ __align__(16) unsigned char mmv_smem[];
    // PREP launches of 8 tiles take half the column group: two groups of weights in registers beside 8
    // tiles' sums spilled at 128 registers a thread (two blocks a multiprocessor).
    constexpr unsigned UNROLL = STAGED ? R::SUNROLL : PREP && NT >= 8 ? R::UNROLL / 2 : R::UNROLL;
    constexpr unsigned GROUP = UNROLL * R::STEP * R::TILE_STEPS;
    static_assert(!PREP || mmv_prep_chunk(NT, GROUP) == mmv_prep_chunk(NT, mmv_group<R, STAGED>()),
                  "the host sizes the chunks with the whole group");

    const unsigned int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
    he::pdl_launch_dependents();
    const MmvShape shape = mmv_shape(rows, cols, GLU, true);
    const unsigned int k_begin = blockIdx.y * shape.kr;
    const unsigned int k_end = min(cols, k_begin + shape.kr);
    static_assert(!(PREP && STAGED), "staged activations come with streamed weights");
    constexpr unsigned PREP_KCH = mmv_prep_chunk(NT, GROUP);
    const unsigned int kch = PREP ? PREP_KCH : mmv_chunk(n, shape.kr, 4, MMV_KC, MMV_BF16_STAGE_BUDGET);
    const unsigned int stride = mmv_stride(kch);
    const unsigned int groups = kch / MMV_KC;
    unsigned char *xs = mmv_smem;
    const unsigned char *xb = xs;  // the chunk the arithmetic reads (PREP: one of two buffers)
    int *xe = reinterpret_cast<int *>(xs + n * stride);  // scaled readers: [tok][group] exponents
    // PREP: the staged rows and every token's exponents of the whole row (mmv_prep_kernel's layout).
    const uint4 *xp = reinterpret_cast<const uint4 *>(partial + mmv_prep_offset(mmv_shape(rows, cols, GLU), GLU, n, rows));
    const int *xpe = reinterpret_cast<const int *>(xp) + (size_t)n * cols;
    const unsigned int row_groups = (cols + MMV_KC - 1) / MMV_KC;
    const MmvRows rw = mmv_rows<GLU>(w, w2, rows, row_bytes, warp, g);
    const unsigned char *wr[2] = {rw.wa, rw.wb};

    // One accumulator chain a token tile, hi then lo products in column order: the same sequence of
    // roundings for a token in any launch (a second chain for the lo products only at some token counts
    // broke that: measured by mmv_is_batch_invariant).
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[j][e] = 0.f;
#if MMV_HALF_TWO_CHAINS
    // The measured alternative: the lo products in a chain of their own at every token count, added to
    // the hi chain's sums once at the end (two independent chains, half the dependent latency; still the
    // same roundings for a token in any launch, but other bits than the one chain's).
    float acc_lo[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc_lo[j][e] = 0.f;
#endif

    // Activations of columns [c0, c0 + len) into shared memory, every load issued before the stores: 8
    // 16-byte loads a thread in flight where the weights stream for up to 16 tokens (8 streams 1,309 ->
    // 1,326 tok/s, 16: 2,159 -> 2,209), 4 elsewhere (8 cost the staged 1-token kernel 3.6%, 64 tokens 23%).
    constexpr int STAGE_LOADS = !STAGED && NT <= 2 ? 8 : 4;
    auto stage = [&](unsigned int c0, unsigned int len) {
        const unsigned int quads = len / 4, total = n * quads;
        for (unsigned int i0 = tid; i0 < total; i0 += STAGE_LOADS * MMV_THREADS) {
            float4 v[STAGE_LOADS];
#pragma unroll
            for (int u = 0; u < STAGE_LOADS; u++) {
                const unsigned int i = i0 + u * MMV_THREADS;
                if (i < total)
                    v[u] = __ldg(reinterpret_cast<const float4 *>(x + (size_t)(i / quads) * cols + c0) + i % quads);
            }
#pragma unroll
            for (int u = 0; u < STAGE_LOADS; u++) {
                const unsigned int i = i0 + u * MMV_THREADS;
                if (i >= total) break;
                const float f[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
                *reinterpret_cast<uint4 *>(xs + (i / quads) * stride + 16 * (i % quads)) = mmv_quad_plain<typename R::Op>(f);
            }
        }
    };
    // Scaled readers: a warp takes a token's 256-column group (8 columns a lane; lanes past a short last
    // group hold zeros), its exponent from a shuffled max, and stages the values times 2^e.
    auto stage_scaled = [&](unsigned int c0, unsigned int len) {
        const unsigned int units = (len + MMV_KC - 1) / MMV_KC * 32, total = n * units;
        for (unsigned int i = tid; i < total; i += MMV_THREADS) {
            const unsigned int tok = i / units, e = i % units;  // e: 8-column unit of the chunk
            const bool here = 8 * e < len;
            float f[8];
            const float amax = stage_unit(x, tok, cols, c0, e, here, f);
            const int ex = mmv_group_exponent(amax);
            const float scale = mmv_pow2(ex);
            if (here) {
#pragma unroll
                for (int q = 0; q < 2; q++)
                    *reinterpret_cast<uint4 *>(xs + tok * stride + 16 * (2 * e + q)) =
                        mmv_quad_scaled<typename R::Op>(f + 4 * q, scale);
            }
            if (lane == 0) xe[tok * groups + e / 32] = ex;
        }
    };
    auto stage_any = [&](unsigned int c0, unsigned int len) {
        if constexpr (R::SCALED) stage_scaled(c0, len);
        else stage(c0, len);
    };
    // A token's exponent of the group that holds column `col`, whose chunk starts at `c0`.
    auto exponent = [&](unsigned int tok, unsigned int col, unsigned int c0) { return xe[tok * groups + (col - c0) / MMV_KC]; };
    // PREP: the range's exponents, [group][token] (see mmv_prep_exponent_bytes), after the two buffers.
    int *xes = reinterpret_cast<int *>(xs + 2 * mmv_act_bytes(NT * 8, PREP_KCH, false));
    // Scaled readers: the lane's accumulators times 2^(sign e) of their tokens' group holding `col`.
    auto rescale = [&](unsigned int col, unsigned int c0, int sign) {
#pragma unroll
        for (int j = 0; j < NT; j++) {
            if (!PREP && 8 * j >= n) break;
            int e0, e1;
            if constexpr (PREP) {  // absent tokens' exponents are whatever the buffer holds, as their rows
                const int2 e = *reinterpret_cast<const int2 *>(xes + (col - k_begin) / MMV_KC * (NT * 8) + 8 * j + 2 * t);
                e0 = e.x, e1 = e.y;
            } else {
                e0 = exponent(min(8 * j + 2 * t, n - 1), col, c0), e1 = exponent(min(8 * j + 2 * t + 1, n - 1), col, c0);
            }
            const float f0 = mmv_pow2(sign * e0), f1 = mmv_pow2(sign * e1);
            acc[j][0] *= f0, acc[j][2] *= f0, acc[j][1] *= f1, acc[j][3] *= f1;
#if MMV_HALF_TWO_CHAINS
            acc_lo[j][0] *= f0, acc_lo[j][2] *= f0, acc_lo[j][1] *= f1, acc_lo[j][3] *= f1;
#endif
        }
    };

    using Raw = typename R::Raw;
    auto fetch_group = [&](Raw (&r)[UNROLL][2], unsigned int col) { fetch_rows<R, UNROLL>(r, wr, col, k_end, t); };

    // The steps of column group `col`, whose chunk starts at column `c0` of shared memory.
    auto compute = [&](const Raw (&r)[UNROLL][2], unsigned int col, unsigned int c0) {
#pragma unroll
        for (int u = 0; u < (int)UNROLL; u++) {
            if (col + u * R::STEP >= k_end) break;
            const unsigned int c = col + u * R::STEP - c0;  // column within the chunk
            // Groups start at multiples of MMV_KC in the row (k_begin is one, and so is a converted chunk).
            if constexpr (R::SCALED)
                if ((col + u * R::STEP) % MMV_KC == 0) rescale(col + u * R::STEP, c0, 1);
            unsigned int fa[R::KSTEPS][2], fb[R::KSTEPS][2];
            R::frag(r[u][0], fa);
            R::frag(r[u][1], fb);
#pragma unroll
            for (int j = 0; j < NT; j++) {
                // A whole tile of absent tokens; PREP launches compute every tile, so that the compiler may
                // interleave the tiles' dependent tensor-core chains.
                if (!PREP && 8 * j >= n) break;
                // Absent tokens reread the last one (PREP: their rows are staged, whatever they hold).
                const unsigned int tok = PREP ? 8 * j + g : min(8 * j + g, n - 1);
#pragma unroll
                for (int k = 0; k < (int)R::KSTEPS; k++) {
                    const unsigned int a[4] = {fa[k][0], fb[k][0], fa[k][1], fb[k][1]};
                    const uint4 v = *reinterpret_cast<const uint4 *>(xb + tok * stride + 4 * (c + R::group(t, k)));
                    R::Op::mma(acc[j], a, v.x, v.y);  // hi
#if MMV_HALF_TWO_CHAINS
                    R::Op::mma(acc_lo[j], a, v.z, v.w);  // lo
#else
                    R::Op::mma(acc[j], a, v.z, v.w);  // lo
#endif
                }
            }
            if constexpr (R::SCALED)
                if ((col + u * R::STEP + R::STEP) % MMV_KC == 0 || col + u * R::STEP + R::STEP >= k_end)
                    rescale(col + u * R::STEP, c0, -1);
        }
    };

    if constexpr (STAGED) {
        staged_groups<R, UNROLL, R::STEP, GLU>(xs + mmv_act_bytes(n, kch, R::SCALED), w, w2, rows, row_bytes, wr, warp,
                                               lane, k_begin, k_end, kch, stage_any, compute);
    } else if constexpr (PREP) {
        // Chunk ci's copies go out when every warp has left chunk ci - 1 (whose buffer they take) and are
        // waited for when the arithmetic enters chunk ci + 1: a whole chunk's arithmetic hides them.
        const unsigned int buf = mmv_act_bytes(NT * 8, PREP_KCH, false), chunks = (k_end - k_begin + kch - 1) / kch;
        auto issue = [&](unsigned int ci) {  // a warp a token, a lane 4 columns at a time
            if (ci < chunks) {
                const unsigned int c0 = k_begin + ci * kch, quads = min(kch, k_end - c0) / 4;
                unsigned char *dst = xs + (ci % 2) * buf;
                for (unsigned int tok = warp; tok < n; tok += MMV_WARPS)
                    for (unsigned int q = lane; q < quads; q += 32)
                        he::cp_async16(dst + tok * stride + 16 * q, xp + ((size_t)tok * cols + c0) / 4 + q, true);
            }
            he::cp_async_commit();
        };
        unsigned int entered = ~0u;
        // 8-tile launches read the weights two (half) groups ahead: one group's arithmetic did not hide a
        // load's latency (the profile's stalls on global loads).
        constexpr unsigned AHEAD = NT >= 8 ? 2 : 1;
        Raw cur[UNROLL][2], nxt[UNROLL][2], far[UNROLL][2];
        fetch_group(cur, k_begin);
        if (AHEAD == 2 && k_begin + GROUP < k_end) fetch_group(nxt, k_begin + GROUP);
        he::pdl_wait();  // the staged rows come from mmv_prep_kernel
        issue(0);
        if constexpr (R::SCALED) {  // read once the first chunk's barrier has passed
            const unsigned int range_groups = (k_end - k_begin + MMV_KC - 1) / MMV_KC, first = k_begin / MMV_KC;
            for (unsigned int i = tid; i < n * range_groups; i += MMV_THREADS) {
                const unsigned int tok = i / range_groups, gi = i % range_groups;
                xes[gi * (NT * 8) + tok] = __ldg(xpe + tok * row_groups + first + gi);
            }
        }
        for (unsigned int col = k_begin; col < k_end; col += GROUP) {
            if (col + AHEAD * GROUP < k_end) fetch_group(AHEAD == 2 ? far : nxt, col + AHEAD * GROUP);
            const unsigned int ci = (col - k_begin) / kch;
            if (ci != entered) {
                he::cp_async_wait<0>();
                __syncthreads();  // chunk ci is every thread's; every warp has left chunk ci - 1
                issue(ci + 1);
                entered = ci;
                xb = xs + (ci % 2) * buf;
            }
            compute(cur, col, k_begin + ci * kch);
#pragma unroll
            for (int u = 0; u < (int)UNROLL; u++) {
                cur[u][0] = nxt[u][0], cur[u][1] = nxt[u][1];
                if constexpr (AHEAD == 2) nxt[u][0] = far[u][0], nxt[u][1] = far[u][1];
            }
        }
    } else {
        unsigned int staged = ~0u;
        Raw cur[UNROLL][2], nxt[UNROLL][2];
        fetch_group(cur, k_begin);
        he::pdl_wait();
        for (unsigned int col = k_begin; col < k_end; col += GROUP) {
            if (col + GROUP < k_end) fetch_group(nxt, col + GROUP);
            compute(cur, col, enter_chunk(col, k_begin, k_end, kch, staged, stage_any));
#pragma unroll
            for (int u = 0; u < (int)UNROLL; u++) cur[u][0] = nxt[u][0], cur[u][1] = nxt[u][1];
        }
    }

#if MMV_HALF_TWO_CHAINS
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[j][e] += acc_lo[j][e];
#endif
    mmv_write_tiles<GLU, NT>(shape, n, rows, rw, bias, residual, y, ldy, partial, counters, acc, t);
}

template <typename R, bool GLU, bool STAGED>
cudaError_t launch_half(const he::mmv::Args &a) {
    const unsigned int rows = a.rows, cols = a.cols, n = a.n;
    const hostembed_tuning &tuning = a.tuning;
    const MmvShape shape = mmv_shape(rows, cols, GLU, true);
    const dim3 grid(shape.row_blocks, shape.splits);
    constexpr unsigned GROUP = mmv_group<R, STAGED>();
    constexpr unsigned WEIGHTS = STAGED ? WeightSlots<R, GROUP>::BLOCK_BYTES : 0;
    for (unsigned int t0 = 0; t0 < n; t0 += MMV_MAX_TOKENS) {
        const unsigned int nt = min(MMV_MAX_TOKENS, n - t0);
        const he::mmv::Args part = tokens_of(a, t0, nt);
        const bool prep = !STAGED && nt > MMV_PREP_AFTER && tuning.mmv_prep != 0;
        if (prep && he::mmv::warpgroup_ready(tuning)) {
            const cudaError_t e = he::mmv::warpgroup(GLU, part);
            if (e != cudaSuccess) return e;
            continue;
        }
        const int smem = (int)(mmv_half_smem(nt, shape.kr, GROUP, R::SCALED, prep) + WEIGHTS);
        if (prep) {
            float *staged = a.partial + mmv_prep_offset(mmv_shape(rows, cols, GLU), GLU, nt, rows);
            const unsigned int warps = nt * ((cols + MMV_KC - 1) / MMV_KC);
            const cudaError_t e = he::launch_overlapped(
                tuning, mmv_prep_kernel<R>, dim3((warps + MMV_WARPS - 1) / MMV_WARPS), dim3(MMV_THREADS), 0, a.stream,
                part.x, nt, cols, reinterpret_cast<uint4 *>(staged), reinterpret_cast<int *>(staged + (size_t)nt * cols));
            if (e != cudaSuccess) return e;
        }
        auto go = [&](auto kernel) { return launch_tokens(kernel, grid, smem, part); };
        cudaError_t e;
        if constexpr (!STAGED) {
            static_assert(MMV_PREP_AFTER == 8, "the first tile count that converts once");
            if (nt <= 8) e = go(mmv_kernel<R, 1, GLU, false>);
            else if (nt <= 16) e = prep ? go(mmv_kernel<R, 2, GLU, false, true>) : go(mmv_kernel<R, 2, GLU, false>);
            else if (nt <= 32) e = prep ? go(mmv_kernel<R, 4, GLU, false, true>) : go(mmv_kernel<R, 4, GLU, false>);
            else e = prep ? go(mmv_kernel<R, 8, GLU, false, true>) : go(mmv_kernel<R, 8, GLU, false>);
        } else {
            if (nt <= 8) e = go(mmv_kernel<R, 1, GLU, STAGED>);
            else if (nt <= 16) e = go(mmv_kernel<R, 2, GLU, STAGED>);
            else if (nt <= 32) e = go(mmv_kernel<R, 4, GLU, STAGED>);
            else e = go(mmv_kernel<R, 8, GLU, STAGED>);
        }
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

}  // namespace

cudaError_t he::mmv::half(bool glu, const Args &a) {
    return with_launch<false>(glu, a, [&](auto reader, auto g, auto staged) {
        return launch_half<decltype(reader), decltype(g)::value, decltype(staged)::value>(a);
    });
}
