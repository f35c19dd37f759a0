// The embedding gather. One block per id stages its row in shared memory through 16-byte loads of
// the aligned granules that cover it, so every format (Q8_0 rows are only 2-byte aligned) and every
// placement takes the same wide path, and a whole row of up to 32 KiB is in flight at once: one
// PCIe round trip per row when the rows live in host memory.
#include "formats.cuh"
#include <stdint.h>

namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kLoadsPerThread = 8;
constexpr unsigned kStageGranules = kThreads * kLoadsPerThread;  // 2048 x 16 B = 32 KiB
constexpr unsigned kStageBytes = kStageGranules * 16;
// Granules covering a span start and end inside an aligned granule: up to 15 bytes more each side.
constexpr unsigned kChunkSpanBytes = kStageBytes - 32;

// Writes `count` values of a staged span to `o`, 16 bytes a store where the output allows it.
template <typename F, int OUT>
__device__ __forceinline__ void write_values(const unsigned char *s, void *o, unsigned count) {
    if constexpr (OUT == HE_DTYPE_F32) {
        float *of = (float *)o;
        if (((uintptr_t)of & 15) == 0 && count % 4 == 0) {
            for (unsigned g = threadIdx.x; g < count / 4; g += blockDim.x) {
                float4 x = make_float4(F::value(s, 4 * g), F::value(s, 4 * g + 1), F::value(s, 4 * g + 2),
                                       F::value(s, 4 * g + 3));
                ((float4 *)of)[g] = x;
            }
        } else {
            for (unsigned v = threadIdx.x; v < count; v += blockDim.x) of[v] = F::value(s, v);
        }
    } else {
        __nv_bfloat16 *ob = (__nv_bfloat16 *)o;
        if (((uintptr_t)ob & 15) == 0 && count % 8 == 0) {
            for (unsigned g = threadIdx.x; g < count / 8; g += blockDim.x) {
                unsigned short h[8];
#pragma unroll
                for (unsigned k = 0; k < 8; k++) h[k] = __bfloat16_as_ushort(__float2bfloat16_rn(F::value(s, 8 * g + k)));
                uint4 x;
                x.x = h[0] | ((unsigned)h[1] << 16);
                x.y = h[2] | ((unsigned)h[3] << 16);
                x.z = h[4] | ((unsigned)h[5] << 16);
                x.w = h[6] | ((unsigned)h[7] << 16);
                ((uint4 *)ob)[g] = x;
            }
        } else {
            for (unsigned v = threadIdx.x; v < count; v += blockDim.x) ob[v] = __float2bfloat16_rn(F::value(s, v));
        }
    }
}

template <int OUT> __device__ __forceinline__ void write_zeros(void *out, size_t row, unsigned cols, unsigned v0,
                                                            unsigned count) {
    if constexpr (OUT == HE_DTYPE_F32) {
        float *o = (float *)out + row * cols + v0;
        for (unsigned c = threadIdx.x; c < count; c += blockDim.x) o[c] = 0.0f;
    } else {
        __nv_bfloat16 *o = (__nv_bfloat16 *)out + row * cols + v0;
        for (unsigned c = threadIdx.x; c < count; c += blockDim.x) o[c] = __float2bfloat16_rn(0.0f);
    }
}

// Block (x, y) gathers ids x, x + gridDim.x, ... and within each row the pieces of `piece_values` values
// y, y + gridDim.y, ...: a few ids spread each row over several SMs, so more of it is in flight at once.
template <typename F, int OUT>
__global__ void __launch_bounds__(kThreads) embed_gather(const unsigned char *__restrict__ rows, unsigned vocab,
                                                           unsigned cols, size_t row_bytes, unsigned piece_values,
                                                           const int *__restrict__ ids, unsigned n,
                                                           void *__restrict__ out, int *bad) {
    __shared__ uint4 stage[kStageGranules];
    constexpr unsigned unit_bytes = F::BLOCK_BYTES, unit_values = F::BLOCK_VALUES;
    const size_t out_size = OUT == HE_DTYPE_F32 ? 4 : 2;

    for (unsigned i = blockIdx.x; i < n; i += gridDim.x) {
        const int id = ids[i];
        const bool valid = id >= 0 && (unsigned)id < vocab;
        if (!valid && bad != nullptr && blockIdx.y == 0 && threadIdx.x == 0) *bad = 1;
        const unsigned char *row = rows + (valid ? (size_t)id * row_bytes : 0);
        for (unsigned v0 = blockIdx.y * piece_values; v0 < cols; v0 += gridDim.y * piece_values) {
            const unsigned count = min(piece_values, cols - v0);
            if (!valid) {
                write_zeros<OUT>(out, i, cols, v0, count);
                continue;
            }
            const uintptr_t start = (uintptr_t)(row + (size_t)(v0 / unit_values) * unit_bytes);
            const uintptr_t end = start + (size_t)(count / unit_values) * unit_bytes;
            // The aligned granules around the span never leave its pages: every placement maps whole pages.
            const uint4 *granules = (const uint4 *)(start & ~(uintptr_t)15);
            const unsigned ngranules = (unsigned)((((end + 15) & ~(uintptr_t)15) - (start & ~(uintptr_t)15)) / 16);
            uint4 r[kLoadsPerThread];
#pragma unroll
            for (unsigned k = 0; k < kLoadsPerThread; k++) {
                unsigned g = threadIdx.x + k * kThreads;
                if (g < ngranules) r[k] = __ldcg(granules + g);
            }
#pragma unroll
            for (unsigned k = 0; k < kLoadsPerThread; k++) {
                unsigned g = threadIdx.x + k * kThreads;
                if (g < ngranules) stage[g] = r[k];
            }
            __syncthreads();
            const unsigned char *s = (const unsigned char *)stage + (start & 15);
            write_values<F, OUT>(s, (unsigned char *)out + ((size_t)i * cols + v0) * out_size, count);
            __syncthreads();
        }
    }
}

// Fewer ids than this split their rows into pieces across blocks; more fill the card one row a block.
constexpr unsigned kSplitBelowIds = 64;
// A piece of a split row: 2 KiB, 128 loads of 16 bytes.
constexpr unsigned kSplitPieceBytes = 2048;

template <typename F>
cudaError_t launch(const void *rows, unsigned vocab, unsigned cols, size_t row_bytes, const int *ids, unsigned n,
                   void *out, int out_dtype, int *bad, cudaStream_t stream) {
    constexpr unsigned unit_bytes = F::BLOCK_BYTES, unit_values = F::BLOCK_VALUES;
    // Pieces are whole blocks of every format, and multiples of 8 values: 16-byte aligned outputs.
    constexpr unsigned piece_values = he::LARGEST_BLOCK_VALUES > 8 ? he::LARGEST_BLOCK_VALUES : 8;
    const unsigned max_piece = kChunkSpanBytes / unit_bytes * unit_values / piece_values * piece_values;
    unsigned piece = max_piece, pieces = 1;
    if (n < kSplitBelowIds && row_bytes > kSplitPieceBytes) {
        const unsigned want = (unsigned)((row_bytes + kSplitPieceBytes - 1) / kSplitPieceBytes);
        piece = (cols + want - 1) / want;
        piece = (piece + piece_values - 1) / piece_values * piece_values;
        if (piece > max_piece) piece = max_piece;
    }
    pieces = (cols + piece - 1) / piece;
    if (pieces > 65535u) return cudaErrorInvalidValue;
    const dim3 grid(n < 65535u ? n : 65535u, n < kSplitBelowIds ? pieces : 1);
    const unsigned char *r = (const unsigned char *)rows;
    if (out_dtype == HE_DTYPE_F32)
        embed_gather<F, HE_DTYPE_F32><<<grid, kThreads, 0, stream>>>(r, vocab, cols, row_bytes, piece, ids, n, out, bad);
    else
        embed_gather<F, HE_DTYPE_BF16><<<grid, kThreads, 0, stream>>>(r, vocab, cols, row_bytes, piece, ids, n, out, bad);
    return cudaGetLastError();
}

}  // namespace

extern "C" cudaError_t hostembed_embed_gather(const void *rows, int dtype, unsigned int vocab, unsigned int cols,
                                              const int *ids, unsigned int n, void *out, int out_dtype, int *bad,
                                              cudaStream_t stream) {
    if (n == 0) return cudaSuccess;
    if (rows == nullptr || ids == nullptr || out == nullptr || cols == 0) return cudaErrorInvalidValue;
    if (out_dtype != HE_DTYPE_F32 && out_dtype != HE_DTYPE_BF16) return cudaErrorInvalidValue;
    cudaError_t err = cudaErrorInvalidValue;
    he::with_format(dtype, [&](auto format) {
        using F = decltype(format);
        const size_t row_bytes = he::row_bytes<F>(cols);
        if (row_bytes != 0) err = launch<F>(rows, vocab, cols, row_bytes, ids, n, out, out_dtype, bad, stream);
    });
    return err;
}
