// Matrix products of prompt chunks on tensor cores (mma.sync m16n8k16, sm_80 and newer), the weight
// conversion that feeds them formats they cannot read (8-value pieces, one 16-byte store a lane), and the
// bias add of the paths that do not fuse it.
//
// The product: a block computes a 128-token by 128-weight-row tile of y = a W^T, streaming 32-column
// slices of both operands through a 3-stage cp.async pipeline in shared memory; 8 warps of 64 x 32 each
// read their fragments with ldmatrix. Rows past the matrix and tokens past n are zero-filled, never read.
#include "formats.cuh"
#include "formats/pieces.cuh"
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
        he::mma_warp_tile<Op, GM_MT, GM_NT, GM_BK, GM_STRIDE>(acc, as, bs, wm, wn, lane);
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

// The conversion: the matrix as one run of 8-value pieces (kernels/formats/pieces.cuh), a lane's piece
// one 16-byte store. A block takes CV_THREADS * CV_UNROLL consecutive pieces; each thread issues the
// loads of its CV_UNROLL pieces (one warp-wide stretch each) before it decodes the first, so every thread
// keeps several loads in flight. `values` is rows * cols; a float format's last values % 8 (no whole
// piece) are the last block's, one value at a time.
constexpr unsigned int CV_THREADS = 256, CV_UNROLL = 4, CV_TILE = CV_THREADS * CV_UNROLL;

template <typename F, typename Op>
__global__ __launch_bounds__(CV_THREADS) void convert_pieces_kernel(const unsigned char *__restrict__ w, size_t values,
                                                                   typename Op::T *__restrict__ out) {
    using P = he::Pieces<F>;
    const size_t pieces = values / 8, first = (size_t)blockIdx.x * CV_TILE + threadIdx.x;
    typename P::Raw raw[CV_UNROLL];
#pragma unroll
    for (unsigned int u = 0; u < CV_UNROLL; u++) {
        const size_t piece = first + u * CV_THREADS;
        if (piece < pieces) raw[u] = P::load(w, piece);
    }
#pragma unroll
    for (unsigned int u = 0; u < CV_UNROLL; u++) {
        const size_t piece = first + u * CV_THREADS;
        if (piece >= pieces) continue;
        float v[8];
        P::decode(raw[u], v);
        *reinterpret_cast<uint4 *>(out + 8 * piece) =
            make_uint4(Op::pack(v[0], v[1]), Op::pack(v[2], v[3]), Op::pack(v[4], v[5]), Op::pack(v[6], v[7]));
    }
    if constexpr (F::BLOCK_VALUES == 1) {  // block formats have whole pieces: rows are whole blocks of 32
        if (blockIdx.x == gridDim.x - 1 && threadIdx.x < values % 8) {
            const size_t i = 8 * pieces + threadIdx.x;
            he::HalfOut<Op>::put(out + i, F::value(w + i * F::BLOCK_BYTES, 0));
        }
    }
}

// Any alignment (what the pieces' loads or the 16-byte stores cannot take): one value per thread step,
// decoded by the format's own value().
template <typename F, typename Op>
__global__ void convert_values_kernel(const unsigned char *__restrict__ w, unsigned int rows, unsigned int cols,
                                      size_t row_bytes, typename Op::T *__restrict__ out) {
    const size_t total = (size_t)rows * cols;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const unsigned int r = (unsigned int)(i / cols), c = (unsigned int)(i % cols);
        he::HalfOut<Op>::put(out + i, F::value(w + (size_t)r * row_bytes, c));
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

// What the conversion costs: it reads the matrix's bytes, writes 2 bytes a value and computes a few
// operations a value, so it is bound by memory, at the copy bandwidth (bytes read + written; 4,258 GB/s
// measured on the H200) when its loads and stores are wide and enough are in flight. For the 4096 x 14336
// matrices of a Llama-3-8B layer (58.7M values, 117.4 MB of halves written):
//   Q4_K: 33.0 MB read (144 bytes a 256-value block), 150.5 MB moved: 35 us at the copy bandwidth;
//   Q8_0: 62.4 MB read (34 bytes a 32-value block), 179.8 MB moved: 42 us.
// (The unit kernel this replaced moved Q4_K_M's matrices at about 0.5 TB/s and Q8_0's at 1.6: ~300 and
// ~110 us for these.) A 512-token chunk of the 8B shape converts 6.98G values, 13.96 GB written: in the
// Q4_K_M mix about 18.6 GB moved, 4.4 ms at the copy bandwidth beside a chunk's 13.9 ms of BF16 work.
extern "C" cudaError_t hostembed_convert_matrix(const void *w, int w_dtype, unsigned int rows, unsigned int cols,
                                                void *out, int out_dtype, cudaStream_t stream) {
    if (w == nullptr || out == nullptr || reinterpret_cast<uintptr_t>(out) % 2 != 0) return cudaErrorInvalidValue;
    cudaError_t err = cudaErrorInvalidValue;
    he::with_format(w_dtype, [&](auto format) {
        using F = decltype(format);
        he::with_half(out_dtype, [&](auto op) {
            using Op = decltype(op);
            if (rows == 0 || cols == 0) {
                err = cudaSuccess;
                return;
            }
            const size_t row_bytes = he::row_bytes<F>(cols);
            if (row_bytes == 0) return;  // rows are not whole blocks
            const size_t values = (size_t)rows * cols;
            const unsigned char *wb = static_cast<const unsigned char *>(w);
            typename Op::T *ob = static_cast<typename Op::T *>(out);
            const bool pieces = reinterpret_cast<uintptr_t>(w) % he::Pieces<F>::ALIGN == 0 &&
                                reinterpret_cast<uintptr_t>(out) % 16 == 0;
            if (pieces) {
                const size_t blocks = (values / 8 + CV_TILE - 1) / CV_TILE;
                if (blocks > 0x7FFFFFFFu) return;
                convert_pieces_kernel<F, Op><<<(unsigned int)(blocks == 0 ? 1 : blocks), CV_THREADS, 0, stream>>>(
                    wb, values, ob);
            } else {
                convert_values_kernel<F, Op><<<grid_of(values, 256), 256, 0, stream>>>(wb, rows, cols, row_bytes, ob);
            }
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
