// GGUF Q4_1 (src/tensor/): blocks of 32 values, f16 scale d and f16 offset m, then 16 bytes of nibbles
// laid out as Q4_0's; value = nibble * d + m. 20 bytes, so 4-byte aligned wherever the row is.
#pragma once
#include "formats/blocks.cuh"

namespace he {

struct FormatQ4_1 {
    static constexpr int ID = HE_DTYPE_Q4_1;
    static constexpr unsigned BLOCK_VALUES = 32, BLOCK_BYTES = 20, UNITS = 1;
    static constexpr bool HAS_MIN = true;
    static constexpr unsigned M = 2, QS = 4;

    static __device__ __forceinline__ float value(const unsigned char *row, unsigned int v) {
        const unsigned char *block = row + (size_t)(v / BLOCK_VALUES) * BLOCK_BYTES;
        const unsigned int j = v % BLOCK_VALUES, byte = block[QS + j % 16];
        const float q = (float)(j < 16 ? byte & 0xFu : byte >> 4);
        return __fadd_rn(__fmul_rn(q, f16_bits_to_f32(u16_le(block))), f16_bits_to_f32(u16_le(block + M)));
    }
    static __device__ __forceinline__ void parts(const unsigned char *block, unsigned int u, float *q, float *scale,
                                                 float *add) {
        scale[0] = scale[1] = load_f16(block);
        add[0] = add[1] = load_f16(block + M);
        unsigned int qs[4];
        load_words<4, true>(block + QS, qs);
        const unsigned int w[8] = {low_nibbles(qs[0]),  low_nibbles(qs[1]),  low_nibbles(qs[2]),  low_nibbles(qs[3]),
                                   high_nibbles(qs[0]), high_nibbles(qs[1]), high_nibbles(qs[2]), high_nibbles(qs[3])};
        words_to_floats(w, 0.f, q);
    }
};

}  // namespace he
