// Matrix-vector products for decode, y[t] = W x[t] for up to 8 tokens per pass over W, f32 accumulation.
// Batch-1 decode is bound by reading W, so the layout serves that read: each row is read by one warp (or
// by `split` warps of one block, each taking every split-th 512-byte stretch, when there are too few rows
// to keep every SM busy), 16 bytes per lane per load, several loads per lane before the arithmetic, the
// activations through the read-only cache, a warp reduction at the end.
#include "hostembed_kernels.cuh"

namespace {

constexpr int MV_WARPS = 8;
constexpr int MV_THREADS = MV_WARPS * 32;
constexpr unsigned int MV_MAX_TOKENS = 8;

// 16 bytes of weights as floats.
template <int DT>
struct Vec16;

template <>
struct Vec16<HE_DTYPE_BF16> {
    static constexpr int N = 8;
    static __device__ __forceinline__ void decode(uint4 v, float *f) {
        f[0] = he::bf16_lo(v.x), f[1] = he::bf16_hi(v.x), f[2] = he::bf16_lo(v.y), f[3] = he::bf16_hi(v.y);
        f[4] = he::bf16_lo(v.z), f[5] = he::bf16_hi(v.z), f[6] = he::bf16_lo(v.w), f[7] = he::bf16_hi(v.w);
    }
};

template <>
struct Vec16<HE_DTYPE_F16> {
    static constexpr int N = 8;
    static __device__ __forceinline__ float2 pair(unsigned int w) {
        __half2 h;
        memcpy(&h, &w, 4);
        return __half22float2(h);
    }
    static __device__ __forceinline__ void decode(uint4 v, float *f) {
        float2 a = pair(v.x), b = pair(v.y), c = pair(v.z), d = pair(v.w);
        f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y, f[4] = c.x, f[5] = c.y, f[6] = d.x, f[7] = d.y;
    }
};

template <>
struct Vec16<HE_DTYPE_F32> {
    static constexpr int N = 4;
    static __device__ __forceinline__ void decode(uint4 v, float *f) {
        f[0] = __uint_as_float(v.x), f[1] = __uint_as_float(v.y), f[2] = __uint_as_float(v.z),
        f[3] = __uint_as_float(v.w);
    }
};

// N consecutive activations (N a multiple of 4, xp 16-byte aligned), read through the read-only path.
template <int N>
__device__ __forceinline__ void load_x(const float *xp, float *xf) {
#pragma unroll
    for (int i = 0; i < N / 4; i++) {
        float4 v = __ldg(reinterpret_cast<const float4 *>(xp) + i);
        xf[4 * i] = v.x, xf[4 * i + 1] = v.y, xf[4 * i + 2] = v.z, xf[4 * i + 3] = v.w;
    }
}

// Loads in flight per lane: fewer when more tokens (and so more activation loads) share each weight.
template <int T, bool GLU>
__host__ __device__ constexpr int unroll_for() {
    return T == 1 ? (GLU ? 4 : 8) : T == 2 ? (GLU ? 2 : 4) : T == 4 ? (GLU ? 1 : 2) : 1;
}

// The activation row token slot t reads: slots past the last token repeat it (their sums are never
// written), which keeps the inner loops free of branches.
template <int T>
__device__ __forceinline__ unsigned int token_row(int t, unsigned int nt) {
    return T == 1 ? 0u : ((unsigned int)t < nt ? (unsigned int)t : nt - 1);
}

// Which row this warp works on and which of the row's `split` parts it takes.
struct RowPart {
    unsigned int row, part;
    bool valid;
};

__device__ __forceinline__ RowPart row_part(unsigned int rows, unsigned int split) {
    const unsigned int warp = threadIdx.x / 32;
    RowPart rp;
    rp.row = blockIdx.x * (MV_WARPS / split) + warp / split;
    rp.part = warp % split;
    rp.valid = rp.row < rows;
    return rp;
}

// Reduces the lanes' (and the split warps') sums and writes row `row` for every token: lane t writes
// token t. Every thread of the block must call it (it holds a barrier when split > 1).
template <int T, bool GLU>
__device__ __forceinline__ void finish_row(float *acc, float *acc2, RowPart rp, unsigned int split, unsigned int nt,
                                           const float *bias, const float *residual, float *y, unsigned int ldy) {
    __shared__ float partial[MV_WARPS][MV_MAX_TOKENS], partial2[MV_WARPS][MV_MAX_TOKENS];
    const unsigned int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int t = 0; t < T; t++) {
        acc[t] = he::warp_sum(acc[t]);
        if (GLU) acc2[t] = he::warp_sum(acc2[t]);
    }
    if (split > 1) {
        if (lane == 0) {
#pragma unroll
            for (int t = 0; t < T; t++) {
                partial[warp][t] = acc[t];
                if (GLU) partial2[warp][t] = acc2[t];
            }
        }
        __syncthreads();
        if (rp.part != 0) return;
#pragma unroll
        for (int t = 0; t < T; t++) {
            acc[t] = acc2[t] = 0.f;
            for (unsigned int j = 0; j < split; j++) {
                acc[t] += partial[warp + j][t];
                if (GLU) acc2[t] += partial2[warp + j][t];
            }
        }
    }
    if (!rp.valid) return;
#pragma unroll
    for (int t = 0; t < T; t++) {
        if ((unsigned int)t < nt && lane == (unsigned int)t) {
            const size_t at = (size_t)t * ldy + rp.row;
            if (GLU) {
                y[at] = he::silu(acc[t]) * acc2[t];
            } else {
                float v = acc[t];
                if (bias != nullptr) v += bias[rp.row];
                if (residual != nullptr) v += residual[at];
                y[at] = v;
            }
        }
    }
}

// One 16-byte chunk of weights (and of the up projection's, for GLU) against every token's activations
// at the same columns (xc: token 0's first column; tokens are `cols` apart).
template <typename V, int T, bool GLU>
__device__ __forceinline__ void vec_chunk(uint4 wv, uint4 wv2, const float *xc, unsigned int cols, unsigned int nt,
                                          float *acc, float *acc2) {
    float wf[V::N], wf2[V::N];
    V::decode(wv, wf);
    if (GLU) V::decode(wv2, wf2);
#pragma unroll
    for (int t = 0; t < T; t++) {
        float xf[V::N];
        load_x<V::N>(xc + (size_t)token_row<T>(t, nt) * cols, xf);
#pragma unroll
        for (int i = 0; i < V::N; i++) {
            acc[t] = fmaf(wf[i], xf[i], acc[t]);
            if (GLU) acc2[t] = fmaf(wf2[i], xf[i], acc2[t]);
        }
    }
}

// BF16/F16/F32 rows that are whole 16-byte chunks on 16-byte boundaries.
template <int DT, int T, bool GLU>
__global__ __launch_bounds__(MV_THREADS, 2) void matvec_vec_kernel(const unsigned char *__restrict__ w,
                                                                const unsigned char *__restrict__ w2,
                                                                unsigned int rows, unsigned int cols,
                                                                unsigned int split, const float *__restrict__ x,
                                                                unsigned int nt, const float *bias,
                                                                const float *residual, float *y, unsigned int ldy) {
    using V = Vec16<DT>;
    constexpr int U = unroll_for<T, GLU>();
    const RowPart rp = row_part(rows, split);
    const unsigned int lane = threadIdx.x % 32;
    float acc[T], acc2[T];
#pragma unroll
    for (int t = 0; t < T; t++) acc[t] = acc2[t] = 0.f;

    if (rp.valid) {
        const size_t row_bytes = (size_t)cols * (DT == HE_DTYPE_F32 ? 4 : 2);
        const uint4 *wr = reinterpret_cast<const uint4 *>(w + rp.row * row_bytes);
        const uint4 *wr2 = GLU ? reinterpret_cast<const uint4 *>(w2 + rp.row * row_bytes) : nullptr;
        const unsigned int nchunks = cols / V::N, stride = 32 * split;
        // Whole groups of U chunks with no bounds test between their loads, then the tail one at a time.
        unsigned int c0 = rp.part * 32 + lane;
        for (; c0 + stride * (U - 1) < nchunks; c0 += stride * U) {
            uint4 wv[U], wv2[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                wv[u] = he::load_stream16(wr + c0 + stride * u);
                if (GLU) wv2[u] = he::load_stream16(wr2 + c0 + stride * u);
            }
#pragma unroll
            for (int u = 0; u < U; u++)
                vec_chunk<V, T, GLU>(wv[u], wv2[u], x + (size_t)(c0 + stride * u) * V::N, cols, nt, acc, acc2);
        }
        for (; c0 < nchunks; c0 += stride) {
            const uint4 wv = he::load_stream16(wr + c0);
            const uint4 wv2 = GLU ? he::load_stream16(wr2 + c0) : make_uint4(0, 0, 0, 0);
            vec_chunk<V, T, GLU>(wv, wv2, x + (size_t)c0 * V::N, cols, nt, acc, acc2);
        }
    }
    finish_row<T, GLU>(acc, acc2, rp, split, nt, bias, residual, y, ldy);
}

// One quarter (8 values) of a Q8_0 block: the f16 scale and 8 int8 as two words. `blk` is 2-byte aligned.
__device__ __forceinline__ void load_q8_quarter(const unsigned char *blk, unsigned int quarter, unsigned int &lo,
                                                unsigned int &hi, float &scale) {
    scale = he::f16_bits_to_f32(__ldg(reinterpret_cast<const unsigned short *>(blk)));
    const unsigned char *d = blk + 2 + 8 * quarter;
    if ((reinterpret_cast<uintptr_t>(d) & 3) == 0) {
        lo = __ldg(reinterpret_cast<const unsigned int *>(d));
        hi = __ldg(reinterpret_cast<const unsigned int *>(d + 4));
    } else {
        const unsigned int a = __ldg(reinterpret_cast<const unsigned short *>(d));
        const unsigned int m = __ldg(reinterpret_cast<const unsigned int *>(d + 2));
        const unsigned int c = __ldg(reinterpret_cast<const unsigned short *>(d + 6));
        lo = a | (m << 16);
        hi = (m >> 16) | (c << 16);
    }
}

__device__ __forceinline__ float q8_dot(unsigned int lo, unsigned int hi, const float *xf) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++) s = fmaf((float)(signed char)(lo >> (8 * i)), xf[i], s);
#pragma unroll
    for (int i = 0; i < 4; i++) s = fmaf((float)(signed char)(hi >> (8 * i)), xf[4 + i], s);
    return s;
}

// GGUF Q8_0 rows (34-byte blocks, 2-byte aligned): four lanes per block, 8 values each. A warp step takes
// 8 blocks of one parity out of a group of 16, so whether a lane's 8 bytes sit on a 4-byte boundary is the
// same for the whole warp and the aligned/unaligned load choice never diverges.
template <int T, bool GLU>
__global__ __launch_bounds__(MV_THREADS, 2) void matvec_q8_kernel(const unsigned char *__restrict__ w,
                                                               const unsigned char *__restrict__ w2,
                                                               unsigned int rows, unsigned int cols,
                                                               unsigned int split, const float *__restrict__ x,
                                                               unsigned int nt, const float *bias,
                                                               const float *residual, float *y, unsigned int ldy) {
    constexpr int U = T == 1 ? (GLU ? 2 : 4) : T == 2 ? 2 : 1;
    const RowPart rp = row_part(rows, split);
    const unsigned int lane = threadIdx.x % 32;
    float acc[T], acc2[T];
#pragma unroll
    for (int t = 0; t < T; t++) acc[t] = acc2[t] = 0.f;

    if (rp.valid) {
        const unsigned int nb = cols / 32;
        const size_t row_bytes = (size_t)nb * 34;
        const unsigned char *wr = w + rp.row * row_bytes;
        const unsigned char *wr2 = GLU ? w2 + rp.row * row_bytes : nullptr;
        const unsigned int quarter = lane & 3, slot = lane >> 2;
        // Groups of 16 blocks: this warp takes groups part, part + split, ...
        for (unsigned int g0 = rp.part; g0 * 16 < nb; g0 += split * U) {
            unsigned int lo[U][2], hi[U][2], lo2[U][2], hi2[U][2];
            float sc[U][2], sc2[U][2];
#pragma unroll
            for (int u = 0; u < U; u++) {
#pragma unroll
                for (int par = 0; par < 2; par++) {
                    const unsigned int b = (g0 + split * u) * 16 + 2 * slot + par;
                    lo[u][par] = hi[u][par] = lo2[u][par] = hi2[u][par] = 0;
                    sc[u][par] = sc2[u][par] = 0.f;
                    if (b < nb) {
                        load_q8_quarter(wr + (size_t)b * 34, quarter, lo[u][par], hi[u][par], sc[u][par]);
                        if (GLU)
                            load_q8_quarter(wr2 + (size_t)b * 34, quarter, lo2[u][par], hi2[u][par], sc2[u][par]);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
#pragma unroll
                for (int par = 0; par < 2; par++) {
                    const unsigned int b = (g0 + split * u) * 16 + 2 * slot + par;
                    if (b < nb) {
#pragma unroll
                        for (int t = 0; t < T; t++) {
                            float xf[8];
                            load_x<8>(x + (size_t)token_row<T>(t, nt) * cols + (size_t)b * 32 + 8 * quarter, xf);
                            acc[t] = fmaf(sc[u][par], q8_dot(lo[u][par], hi[u][par], xf), acc[t]);
                            if (GLU) acc2[t] = fmaf(sc2[u][par], q8_dot(lo2[u][par], hi2[u][par], xf), acc2[t]);
                        }
                    }
                }
            }
        }
    }
    finish_row<T, GLU>(acc, acc2, rp, split, nt, bias, residual, y, ldy);
}

// One weight of any format, read byte by byte: no alignment assumed.
__device__ __forceinline__ float load_weight(const unsigned char *row, int dtype, unsigned int c) {
    switch (dtype) {
    case HE_DTYPE_F32: {
        const unsigned char *p = row + 4 * (size_t)c;
        return __uint_as_float((unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16) |
                               ((unsigned int)p[3] << 24));
    }
    case HE_DTYPE_F16:
        return he::f16_bits_to_f32((unsigned int)row[2 * (size_t)c] | ((unsigned int)row[2 * (size_t)c + 1] << 8));
    case HE_DTYPE_BF16:
        return he::bf16_bits_to_f32((unsigned int)row[2 * (size_t)c] | ((unsigned int)row[2 * (size_t)c + 1] << 8));
    default: {  // Q8_0
        const unsigned char *blk = row + (size_t)(c / 32) * 34;
        const float scale = he::f16_bits_to_f32((unsigned int)blk[0] | ((unsigned int)blk[1] << 8));
        return scale * (float)(signed char)blk[2 + c % 32];
    }
    }
}

// Any shape and alignment, one element per lane at a time: the path for odd shapes, not for speed.
template <int T, bool GLU>
__global__ __launch_bounds__(MV_THREADS, 2) void matvec_any_kernel(const unsigned char *__restrict__ w,
                                                                const unsigned char *__restrict__ w2, int dtype,
                                                                size_t row_bytes, unsigned int rows,
                                                                unsigned int cols, unsigned int split,
                                                                const float *__restrict__ x, unsigned int nt,
                                                                const float *bias, const float *residual, float *y,
                                                                unsigned int ldy) {
    const RowPart rp = row_part(rows, split);
    const unsigned int lane = threadIdx.x % 32;
    float acc[T], acc2[T];
#pragma unroll
    for (int t = 0; t < T; t++) acc[t] = acc2[t] = 0.f;
    if (rp.valid) {
        const unsigned char *wr = w + rp.row * row_bytes;
        const unsigned char *wr2 = GLU ? w2 + rp.row * row_bytes : nullptr;
        for (unsigned int c = rp.part * 32 + lane; c < cols; c += 32 * split) {
            const float wv = load_weight(wr, dtype, c);
            const float wv2 = GLU ? load_weight(wr2, dtype, c) : 0.f;
#pragma unroll
            for (int t = 0; t < T; t++) {
                const float xv = x[(size_t)token_row<T>(t, nt) * cols + c];
                acc[t] = fmaf(wv, xv, acc[t]);
                if (GLU) acc2[t] = fmaf(wv2, xv, acc2[t]);
            }
        }
    }
    finish_row<T, GLU>(acc, acc2, rp, split, nt, bias, residual, y, ldy);
}

enum class Path { Vec, Q8, Any };

template <int T, bool GLU>
void launch_tile(Path path, int dtype, const unsigned char *w, const unsigned char *w2, size_t row_bytes,
                 unsigned int rows, unsigned int cols, unsigned int split, const float *x, unsigned int nt,
                 const float *bias, const float *residual, float *y, unsigned int ldy, cudaStream_t stream) {
    const unsigned int per_block = MV_WARPS / split;
    const unsigned int grid = (rows + per_block - 1) / per_block;
    if (path == Path::Q8) {
        matvec_q8_kernel<T, GLU>
            <<<grid, MV_THREADS, 0, stream>>>(w, w2, rows, cols, split, x, nt, bias, residual, y, ldy);
    } else if (path == Path::Any) {
        matvec_any_kernel<T, GLU><<<grid, MV_THREADS, 0, stream>>>(w, w2, dtype, row_bytes, rows, cols, split, x,
                                                                   nt, bias, residual, y, ldy);
    } else if (dtype == HE_DTYPE_BF16) {
        matvec_vec_kernel<HE_DTYPE_BF16, T, GLU>
            <<<grid, MV_THREADS, 0, stream>>>(w, w2, rows, cols, split, x, nt, bias, residual, y, ldy);
    } else if (dtype == HE_DTYPE_F16) {
        matvec_vec_kernel<HE_DTYPE_F16, T, GLU>
            <<<grid, MV_THREADS, 0, stream>>>(w, w2, rows, cols, split, x, nt, bias, residual, y, ldy);
    } else {
        matvec_vec_kernel<HE_DTYPE_F32, T, GLU>
            <<<grid, MV_THREADS, 0, stream>>>(w, w2, rows, cols, split, x, nt, bias, residual, y, ldy);
    }
}

bool aligned(const void *p, uintptr_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; }

// Warps per row: enough warps in all to keep ~48 per SM of a 132-SM card busy when rows are few.
unsigned int split_for(unsigned int rows) { return rows >= 6144 ? 1 : rows >= 3072 ? 2 : rows >= 1536 ? 4 : 8; }

template <bool GLU>
cudaError_t launch_matvec(const void *w, const void *w2, int dtype, unsigned int rows, unsigned int cols,
                          const float *x, unsigned int n, const float *bias, const float *residual, float *y,
                          unsigned int ldy, cudaStream_t stream) {
    if (w == nullptr || (GLU && w2 == nullptr) || x == nullptr || y == nullptr) return cudaErrorInvalidValue;
    if (rows == 0 || cols == 0 || ldy < rows) return cudaErrorInvalidValue;
    size_t row_bytes;
    switch (dtype) {
    case HE_DTYPE_F32: row_bytes = (size_t)cols * 4; break;
    case HE_DTYPE_F16:
    case HE_DTYPE_BF16: row_bytes = (size_t)cols * 2; break;
    case HE_DTYPE_Q8_0:
        if (cols % 32 != 0) return cudaErrorInvalidValue;
        row_bytes = (size_t)cols / 32 * 34;
        break;
    default: return cudaErrorInvalidValue;
    }
    if (n == 0) return cudaSuccess;

    Path path = Path::Any;
    if (dtype == HE_DTYPE_Q8_0) {
        if (aligned(w, 2) && (!GLU || aligned(w2, 2)) && aligned(x, 16)) path = Path::Q8;
    } else {
        const unsigned int per_chunk = dtype == HE_DTYPE_F32 ? 4 : 8;
        if (cols % per_chunk == 0 && aligned(w, 16) && (!GLU || aligned(w2, 16)) && aligned(x, 16)) path = Path::Vec;
    }
    const unsigned int split = split_for(rows);

    const unsigned char *wb = static_cast<const unsigned char *>(w);
    const unsigned char *wb2 = static_cast<const unsigned char *>(w2);
    for (unsigned int t0 = 0; t0 < n; t0 += MV_MAX_TOKENS) {
        const unsigned int nt = n - t0 < MV_MAX_TOKENS ? n - t0 : MV_MAX_TOKENS;
        const float *xt = x + (size_t)t0 * cols;
        const float *rt = residual != nullptr ? residual + (size_t)t0 * ldy : nullptr;
        float *yt = y + (size_t)t0 * ldy;
        if (nt == 1)
            launch_tile<1, GLU>(path, dtype, wb, wb2, row_bytes, rows, cols, split, xt, nt, bias, rt, yt, ldy, stream);
        else if (nt == 2)
            launch_tile<2, GLU>(path, dtype, wb, wb2, row_bytes, rows, cols, split, xt, nt, bias, rt, yt, ldy, stream);
        else if (nt <= 4)
            launch_tile<4, GLU>(path, dtype, wb, wb2, row_bytes, rows, cols, split, xt, nt, bias, rt, yt, ldy, stream);
        else
            launch_tile<8, GLU>(path, dtype, wb, wb2, row_bytes, rows, cols, split, xt, nt, bias, rt, yt, ldy, stream);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
}

}  // namespace

extern "C" cudaError_t hostembed_matvec(const void *w, int dtype, unsigned int rows, unsigned int cols,
                                        const float *x, unsigned int n, const float *bias, const float *residual,
                                        float *y, unsigned int ldy, cudaStream_t stream) {
    return launch_matvec<false>(w, nullptr, dtype, rows, cols, x, n, bias, residual, y, ldy, stream);
}

extern "C" cudaError_t hostembed_matvec_swiglu(const void *w_gate, const void *w_up, int dtype, unsigned int rows,
                                               unsigned int cols, const float *x, unsigned int n, float *y,
                                               cudaStream_t stream) {
    return launch_matvec<true>(w_gate, w_up, dtype, rows, cols, x, n, nullptr, nullptr, y, rows, stream);
}
