// GGUF Q5_1 (src/tensor/): blocks of 32 values, f16 scale d and offset m, Q5_0's fifth bits and nibbles;
// value = (nibble + 16 * bit) * d + m. 24 bytes, 8-byte aligned wherever the row is.
#pragma once
#include "formats/blocks.cuh"

namespace he {

struct FormatQ5_1 {
    static constexpr int ID = HE_DTYPE_Q5_1;
    static constexpr unsigned BLOCK_VALUES = 32, BLOCK_BYTES = 24, UNITS = 1;
    static constexpr bool HAS_MIN = true;
    static constexpr unsigned M = 2, QH = 4, QS = 8;

    static __device__ __forceinline__ float value(const unsigned char *row, unsigned int v) {
        const unsigned char *block = row + (size_t)(v / BLOCK_VALUES) * BLOCK_BYTES;
        const unsigned int j = v % BLOCK_VALUES, byte = block[QS + j % 16];
        const unsigned int high = (u32_le(block + QH) >> j) & 1u;
        const float q = (float)((j < 16 ? byte & 0xFu : byte >> 4) | (high << 4));
        return __fadd_rn(__fmul_rn(q, f16_bits_to_f32(u16_le(block))), f16_bits_to_f32(u16_le(block + M)));
    }
    static __device__ __forceinline__ void parts(const unsigned char *block, unsigned int u, float *q, float *scale,
                                                 float *add) {
        scale[0] = scale[1] = load_f16(block);
        add[0] = add[1] = load_f16(block + M);
        unsigned int r[5];  // qh, then the four words of nibbles
        load_words<5, true>(block + QH, r);
        unsigned int w[8];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[i] = low_nibbles(r[1 + i]) | spread_bits(r[0], 4 * i, 4);
            w[4 + i] = high_nibbles(r[1 + i]) | spread_bits(r[0], 16 + 4 * i, 4);
        }
        words_to_floats(w, 0.f, q);
    }
};

}  // namespace he
