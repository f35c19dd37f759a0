// The weight formats on the device: one traits struct per format (kernels/formats/), and the one list
// that maps a runtime HE_DTYPE_* to its traits. A format's traits provide:
//   ID, BLOCK_VALUES, BLOCK_BYTES        the block layout (src/tensor/ has the same)
//   value(row, v)                        value v of a row at any alignment (the gather, odd shapes), as
//                                        the CPU decodes it, bit for bit
// and then one of two ways for the matrix-vector product to stream a row:
//   Chunk, CHUNK_VALUES, chunks_fit(w, cols), slots(cols), whole_slots(cols), has(slot, cols),
//   column(slot), load_chunk(row, first, ahead), decode(chunk, floats)
//                                        lane slots, each CHUNK_VALUES values from column(slot); slots
//                                        below whole_slots all exist, the others where has() says so
//                                        (the float formats, and Q8_0 on 2-byte aligned rows);
//   UNITS, unit(block, u, floats)        blocks of UNITS units of 32 values (kernels/formats/blocks.cuh),
//                                        decoded from rows staged in shared memory (every block format).
// The prompt path's conversion reads every format as 8-value pieces, through Pieces<F>
// (kernels/formats/pieces.cuh; a format without its own specialization converts through value()).
#pragma once
#include <type_traits>

#include "formats/float.cuh"
#include "formats/q2_k.cuh"
#include "formats/q3_k.cuh"
#include "formats/q4_0.cuh"
#include "formats/q4_1.cuh"
#include "formats/q4_k.cuh"
#include "formats/q5_0.cuh"
#include "formats/q5_1.cuh"
#include "formats/q5_k.cuh"
#include "formats/q6_k.cuh"
#include "formats/q8_0.cuh"

namespace he {

// Calls fn(Format{}) with the traits of format `dtype`; false when no format has that id.
template <typename Fn>
bool with_format(int dtype, Fn &&fn) {
    switch (dtype) {
    case FormatF32::ID: fn(FormatF32{}); return true;
    case FormatF16::ID: fn(FormatF16{}); return true;
    case FormatBF16::ID: fn(FormatBF16{}); return true;
    case FormatQ8_0::ID: fn(FormatQ8_0{}); return true;
    case FormatQ4_0::ID: fn(FormatQ4_0{}); return true;
    case FormatQ4_1::ID: fn(FormatQ4_1{}); return true;
    case FormatQ5_0::ID: fn(FormatQ5_0{}); return true;
    case FormatQ5_1::ID: fn(FormatQ5_1{}); return true;
    case FormatQ2_K::ID: fn(FormatQ2_K{}); return true;
    case FormatQ3_K::ID: fn(FormatQ3_K{}); return true;
    case FormatQ4_K::ID: fn(FormatQ4_K{}); return true;
    case FormatQ5_K::ID: fn(FormatQ5_K{}); return true;
    case FormatQ6_K::ID: fn(FormatQ6_K{}); return true;
    default: return false;
    }
}

// The largest block of any format in with_format's list: pieces of a row that are multiples of it are
// whole blocks in every format.
constexpr unsigned int LARGEST_BLOCK_VALUES = [] {
    unsigned int m = 0;
    for (unsigned int v : {FormatF32::BLOCK_VALUES, FormatF16::BLOCK_VALUES, FormatBF16::BLOCK_VALUES,
                           FormatQ8_0::BLOCK_VALUES, FormatQ4_0::BLOCK_VALUES, FormatQ4_1::BLOCK_VALUES,
                           FormatQ5_0::BLOCK_VALUES, FormatQ5_1::BLOCK_VALUES, FormatQ2_K::BLOCK_VALUES,
                           FormatQ3_K::BLOCK_VALUES, FormatQ4_K::BLOCK_VALUES, FormatQ5_K::BLOCK_VALUES,
                           FormatQ6_K::BLOCK_VALUES})
        m = v > m ? v : m;
    return m;
}();

// Whether F is a block format (has units of 32 values to decode).
template <typename F, typename = void>
struct HasUnits : std::false_type {};
template <typename F>
struct HasUnits<F, std::void_t<decltype(F::UNITS)>> : std::true_type {};

// Whether F streams rows in chunks (the matrix-vector product's direct path); a format with both readings
// takes that one for the product.
template <typename F, typename = void>
struct HasChunks : std::false_type {};
template <typename F>
struct HasChunks<F, std::void_t<decltype(F::CHUNK_VALUES)>> : std::true_type {};

// Bytes of a row of `cols` values; 0 when cols is not a whole number of blocks.
template <typename F>
size_t row_bytes(unsigned int cols) {
    return cols % F::BLOCK_VALUES == 0 ? (size_t)(cols / F::BLOCK_VALUES) * F::BLOCK_BYTES : 0;
}

// Any format read one value per slot through value(): for rows the chunked layout does not fit.
template <typename F>
struct ByValue {
    static constexpr int ID = F::ID;
    static constexpr unsigned BLOCK_VALUES = F::BLOCK_VALUES, BLOCK_BYTES = F::BLOCK_BYTES;
    using Chunk = float;
    static constexpr int CHUNK_VALUES = 1;
    static __device__ __forceinline__ unsigned int slots(unsigned int cols) { return cols; }
    static __device__ __forceinline__ unsigned int whole_slots(unsigned int cols) { return cols; }
    static __device__ __forceinline__ bool has(unsigned int, unsigned int) { return true; }
    static __device__ __forceinline__ size_t column(unsigned int slot) { return slot; }
    static __device__ __forceinline__ Chunk load_chunk(const unsigned char *row, unsigned int first, unsigned int ahead) {
        return F::value(row, first + ahead);
    }
    static __device__ __forceinline__ void decode(Chunk c, float *f) { f[0] = c; }
};

// N consecutive activations, read through the read-only path: as float4s when N is a multiple of 4 (xp
// then 16-byte aligned), else one at a time.
template <int N>
__device__ __forceinline__ void load_x(const float *xp, float *xf) {
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N / 4; i++) {
            const float4 v = __ldg(reinterpret_cast<const float4 *>(xp) + i);
            xf[4 * i] = v.x, xf[4 * i + 1] = v.y, xf[4 * i + 2] = v.z, xf[4 * i + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; i++) xf[i] = __ldg(xp + i);
    }
}

}  // namespace he
