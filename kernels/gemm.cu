// Matrix products of prompt chunks on tensor cores (mma.sync m16n8k16, sm_80 and newer), the weight
// conversion that feeds them formats they cannot read, and the bias add of the paths that do not fuse it.
//
// The product: a block computes a 128-token by 128-weight-row tile of y = a W^T, streaming 32-column
// slices of both operands through a 3-stage cp.async pipeline in shared memory; 8 warps of 64 x 32 each
// read their fragments with ldmatrix. Rows past the matrix and tokens past n are zero-filled, never read.
#include "formats.cuh"
#include "hostembed_kernels.cuh"

namespace {

constexpr int GM_BM = 128, GM_BN = 128, GM_BK = 32, GM_STAGES = 3, GM_THREADS = 256;
// Padded shared rows (40 halves = 80 bytes): ldmatrix's 8 row reads land in 8 distinct bank groups.
constexpr int GM_STRIDE = GM_BK + 8;
constexpr int GM_TILE_HALVES = (GM_BM + GM_BN) * GM_STRIDE;
constexpr int GM_SMEM = GM_STAGES * GM_TILE_HALVES * 2;
// Warps: 2 along the tokens (64 each) by 4 along the weight rows (32 each).
constexpr int GM_WM = 64, GM_WN = 32, GM_MT = GM_WM / 16, GM_NT = GM_WN / 8;

// A 16-byte piece at base + offset, or zeros (reading nothing) where !valid.
__device__ __forceinline__ void load_piece(unsigned short *dst, const unsigned short *base, size_t offset, bool valid) {
    he::cp_async16(dst, valid ? base + offset : base, valid);
}

template <typename Op>
__global__ __launch_bounds__(GM_THREADS) void gemm_kernel(const unsigned short *__restrict__ a, unsigned int lda,
                                                          const unsigned short *__restrict__ w, unsigned int rows,
                                                          unsigned int cols, unsigned int n,
                                                          const float *__restrict__ bias, const float *residual,
                                                          float *y, unsigned int ldy) {
    extern __shared__ __align__(16) unsigned short gm_smem[];
    const unsigned int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const unsigned int row0 = blockIdx.x * GM_BN, tok0 = blockIdx.y * GM_BM;
    const unsigned int wm = (warp / 4) * GM_WM, wn = (warp % 4) * GM_WN;
    const unsigned int k_tiles = (cols + GM_BK - 1) / GM_BK;

    // Each thread copies two 16-byte pieces of the token tile and two of the weight tile per stage.
    auto load_stage = [&](unsigned int stage, unsigned int kt) {
        unsigned short *as = gm_smem + stage * GM_TILE_HALVES;
        unsigned short *bs = as + GM_BM * GM_STRIDE;
        const unsigned int k0 = kt * GM_BK;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const unsigned int piece = tid + i * GM_THREADS;  // 512 pieces: 128 rows x 4
            const unsigned int r = piece / 4, c = (piece % 4) * 8;
            const bool kin = k0 + c < cols;  // cols is a multiple of 8: a piece is all in or all out
            const bool a_ok = kin && tok0 + r < n, w_ok = kin && row0 + r < rows;
            load_piece(as + r * GM_STRIDE + c, a, (size_t)(tok0 + r) * lda + k0 + c, a_ok);
            load_piece(bs + r * GM_STRIDE + c, w, (size_t)(row0 + r) * cols + k0 + c, w_ok);
        }
    };

    float acc[GM_MT][GM_NT][4];
#pragma unroll
    for (int i = 0; i < GM_MT; i++)
#pragma unroll
        for (int j = 0; j < GM_NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

#pragma unroll
    for (int s = 0; s < GM_STAGES - 1; s++) {
        if (s < (int)k_tiles) load_stage(s, s);
        he::cp_async_commit();
    }

    for (unsigned int kt = 0; kt < k_tiles; kt++) {
        he::cp_async_wait<GM_STAGES - 2>();
        __syncthreads();  // stage kt is in; every warp is done with the stage the next load overwrites
        const unsigned int next = kt + GM_STAGES - 1;
        if (next < k_tiles) load_stage(next % GM_STAGES, next);
        he::cp_async_commit();

        const unsigned short *as = gm_smem + (kt % GM_STAGES) * GM_TILE_HALVES;
        const unsigned short *bs = as + GM_BM * GM_STRIDE;
#pragma unroll
        for (int kk = 0; kk < GM_BK; kk += 16) {
            unsigned int af[GM_MT][4], bf[GM_NT / 2][4];
#pragma unroll
            for (int i = 0; i < GM_MT; i++)
                he::ldmatrix_x4(af[i], as + (wm + i * 16 + lane % 16) * GM_STRIDE + kk + (lane / 16) * 8);
#pragma unroll
            for (int j = 0; j < GM_NT / 2; j++)
                he::ldmatrix_x4(bf[j],
                                bs + (wn + j * 16 + lane % 8 + (lane / 16) * 8) * GM_STRIDE + kk + ((lane / 8) % 2) * 8);
#pragma unroll
            for (int i = 0; i < GM_MT; i++)
#pragma unroll
                for (int j = 0; j < GM_NT; j++)
                    Op::mma(acc[i][j], af[i], bf[j / 2][(j % 2) * 2], bf[j / 2][(j % 2) * 2 + 1]);
        }
    }
    he::cp_async_wait<0>();

    // Accumulator (i, j): tokens wm + 16i + lane/4 (+8), weight rows wn + 8j + 2(lane%4) (+1).
    const bool pairs = ldy % 2 == 0 && reinterpret_cast<uintptr_t>(y) % 8 == 0 &&
                       (residual == nullptr || reinterpret_cast<uintptr_t>(residual) % 8 == 0);
#pragma unroll
    for (int i = 0; i < GM_MT; i++) {
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const unsigned int t = tok0 + wm + i * 16 + lane / 4 + hf * 8;
            if (t >= n) continue;
#pragma unroll
            for (int j = 0; j < GM_NT; j++) {
                const unsigned int r = row0 + wn + j * 8 + 2 * (lane % 4);
                float v0 = acc[i][j][hf * 2], v1 = acc[i][j][hf * 2 + 1];
                const size_t at = (size_t)t * ldy + r;
                if (pairs && r + 1 < rows) {
                    if (bias != nullptr) v0 += bias[r], v1 += bias[r + 1];
                    if (residual != nullptr) {
                        const float2 res = *reinterpret_cast<const float2 *>(residual + at);
                        v0 += res.x, v1 += res.y;
                    }
                    *reinterpret_cast<float2 *>(y + at) = make_float2(v0, v1);
                } else {
                    if (r < rows) y[at] = v0 + (bias ? bias[r] : 0.f) + (residual ? residual[at] : 0.f);
                    if (r + 1 < rows) y[at + 1] = v1 + (bias ? bias[r + 1] : 0.f) + (residual ? residual[at + 1] : 0.f);
                }
            }
        }
    }
}

// One value per thread step, decoded by the format's own value() so every format converts alike.
template <typename F, typename Op>
__global__ void convert_matrix_kernel(const unsigned char *__restrict__ w, unsigned int rows, unsigned int cols,
                                      size_t row_bytes, typename Op::T *__restrict__ out) {
    const size_t total = (size_t)rows * cols;
    for (size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 2; i < total;
         i += (size_t)gridDim.x * blockDim.x * 2) {
        const unsigned int r = (unsigned int)(i / cols), c = (unsigned int)(i % cols);
        // cols is even, so a pair never straddles rows.
        const unsigned char *row = w + (size_t)r * row_bytes;
        *reinterpret_cast<unsigned int *>(out + i) = Op::pack(F::value(row, c), F::value(row, c + 1));
    }
}

// A block format a 32-value unit per thread step: the unit decoded once (its scales read once, not per
// value) with the CPU's roundings and written as four 16-byte stores.
template <typename F, typename Op>
__global__ void convert_units_kernel(const unsigned char *__restrict__ w, unsigned int rows, unsigned int cols,
                                     size_t row_bytes, typename Op::T *__restrict__ out) {
    const unsigned int row_units = cols / he::UNIT_VALUES;
    const size_t total = (size_t)rows * row_units;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const unsigned int r = (unsigned int)(i / row_units), k = (unsigned int)(i % row_units);
        const unsigned char *block = w + (size_t)r * row_bytes + (size_t)(k / F::UNITS) * F::BLOCK_BYTES;
        float v[he::UNIT_VALUES];
        he::decode_unit<F, true>(block, k % F::UNITS, v);
        uint4 *o = reinterpret_cast<uint4 *>(out + (size_t)r * cols + (size_t)k * he::UNIT_VALUES);
#pragma unroll
        for (unsigned int j = 0; j < he::UNIT_VALUES / 8; j++)
            o[j] = make_uint4(Op::pack(v[8 * j], v[8 * j + 1]), Op::pack(v[8 * j + 2], v[8 * j + 3]),
                              Op::pack(v[8 * j + 4], v[8 * j + 5]), Op::pack(v[8 * j + 6], v[8 * j + 7]));
    }
}

__global__ void add_bias_kernel(float *y, unsigned int ldy, const float *__restrict__ bias, unsigned int rows,
                                unsigned int n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (size_t)rows * n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / rows, r = i % rows;
        y[t * ldy + r] += bias[r];
    }
}

unsigned int grid_of(size_t items, unsigned int threads) {
    const size_t blocks = (items + threads - 1) / threads;
    return (unsigned int)(blocks < 65535 ? (blocks == 0 ? 1 : blocks) : 65535);
}

}  // namespace

extern "C" cudaError_t hostembed_gemm(const void *a, unsigned int lda, const void *w, int dtype, unsigned int rows,
                                      unsigned int cols, unsigned int n, const float *bias, const float *residual,
                                      float *y, unsigned int ldy, cudaStream_t stream) {
    if (a == nullptr || w == nullptr || y == nullptr || rows == 0 || cols == 0 || cols % 8 != 0 || lda % 8 != 0 ||
        lda < cols || ldy < rows || reinterpret_cast<uintptr_t>(a) % 16 != 0 ||
        reinterpret_cast<uintptr_t>(w) % 16 != 0)
        return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    if ((n + GM_BM - 1) / GM_BM > 65535) return cudaErrorInvalidValue;
    cudaError_t err = cudaErrorInvalidValue;
    he::with_half(dtype, [&](auto op) {
        using Op = decltype(op);
        auto kernel = gemm_kernel<Op>;
        err = he::allow_smem(kernel, GM_SMEM);
        if (err != cudaSuccess) return;
        const dim3 grid((rows + GM_BN - 1) / GM_BN, (n + GM_BM - 1) / GM_BM);
        kernel<<<grid, GM_THREADS, GM_SMEM, stream>>>(static_cast<const unsigned short *>(a), lda,
                                                      static_cast<const unsigned short *>(w), rows, cols, n, bias,
                                                      residual, y, ldy);
        err = cudaGetLastError();
    });
    return err;
}

extern "C" cudaError_t hostembed_convert_matrix(const void *w, int w_dtype, unsigned int rows, unsigned int cols,
                                                void *out, int out_dtype, cudaStream_t stream) {
    if (w == nullptr || out == nullptr || cols % 2 != 0 || reinterpret_cast<uintptr_t>(out) % 4 != 0)
        return cudaErrorInvalidValue;
    if (rows == 0 || cols == 0) return cudaSuccess;
    cudaError_t err = cudaErrorInvalidValue;
    he::with_format(w_dtype, [&](auto format) {
        using F = decltype(format);
        const size_t row_bytes = he::row_bytes<F>(cols);
        if (row_bytes == 0) return;
        he::with_half(out_dtype, [&](auto op) {
            using Op = decltype(op);
            constexpr unsigned int threads = 256;
            const unsigned char *wb = static_cast<const unsigned char *>(w);
            typename Op::T *ob = static_cast<typename Op::T *>(out);
            bool by_unit = false;
            if constexpr (he::HasUnits<F>::value) {
                constexpr uintptr_t field_align = F::BLOCK_BYTES % 4 == 0 ? 4 : 2;
                by_unit = reinterpret_cast<uintptr_t>(w) % field_align == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
                if (by_unit)
                    convert_units_kernel<F, Op><<<grid_of((size_t)rows * (cols / he::UNIT_VALUES), threads), threads, 0,
                                                  stream>>>(wb, rows, cols, row_bytes, ob);
            }
            if (!by_unit)
                convert_matrix_kernel<F, Op><<<grid_of((size_t)rows * cols / 2, threads), threads, 0, stream>>>(
                    wb, rows, cols, row_bytes, ob);
            err = cudaGetLastError();
        });
    });
    return err;
}

extern "C" cudaError_t hostembed_add_bias(float *y, unsigned int ldy, const float *bias, unsigned int rows,
                                          unsigned int n, cudaStream_t stream) {
    if (y == nullptr || bias == nullptr || ldy < rows) return cudaErrorInvalidValue;
    if (rows == 0 || n == 0) return cudaSuccess;
    add_bias_kernel<<<grid_of((size_t)rows * n, 256), 256, 0, stream>>>(y, ldy, bias, rows, n);
    return cudaGetLastError();
}
