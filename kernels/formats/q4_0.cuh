// GGUF Q4_0 (src/tensor/): blocks of 32 values, an f16 scale d then 16 bytes of nibbles (value j < 16 the
// low nibble of byte j, value j + 16 its high nibble); value = d * (nibble - 8). 18 bytes, 2-byte aligned.
#pragma once
#include "formats/blocks.cuh"

namespace he {

struct FormatQ4_0 {
    static constexpr int ID = HE_DTYPE_Q4_0;
    static constexpr unsigned BLOCK_VALUES = 32, BLOCK_BYTES = 18, UNITS = 1;
    static constexpr bool HAS_MIN = false;
    static constexpr unsigned QS = 2;

    static __device__ __forceinline__ float value(const unsigned char *row, unsigned int v) {
        const unsigned char *block = row + (size_t)(v / BLOCK_VALUES) * BLOCK_BYTES;
        const unsigned int j = v % BLOCK_VALUES, byte = block[QS + j % 16];
        const int q = (int)(j < 16 ? byte & 0xFu : byte >> 4) - 8;
        return __fmul_rn((float)q, f16_bits_to_f32(u16_le(block)));
    }
    static __device__ __forceinline__ void parts(const unsigned char *block, unsigned int u, float *q, float *scale,
                                                 float *add) {
        scale[0] = scale[1] = load_f16(block);
        add[0] = add[1] = 0.f;
        unsigned int qs[4];
        load_words<4, false>(block + QS, qs);
        const unsigned int w[8] = {low_nibbles(qs[0]),  low_nibbles(qs[1]),  low_nibbles(qs[2]),  low_nibbles(qs[3]),
                                   high_nibbles(qs[0]), high_nibbles(qs[1]), high_nibbles(qs[2]), high_nibbles(qs[3])};
        words_to_floats(w, 8.f, q);
    }
};

}  // namespace he
