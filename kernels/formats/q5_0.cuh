// GGUF Q5_0 (src/tensor/): blocks of 32 values, an f16 scale d, 4 bytes holding the fifth bit of each
// value (bit j for value j), then Q4_0's 16 bytes of nibbles; value = d * (nibble + 16 * bit - 16).
// 22 bytes, 2-byte aligned.
#pragma once
#include "formats/blocks.cuh"

namespace he {

struct FormatQ5_0 {
    static constexpr int ID = HE_DTYPE_Q5_0;
    static constexpr unsigned BLOCK_VALUES = 32, BLOCK_BYTES = 22, UNITS = 1;
    static constexpr bool HAS_MIN = false;
    static constexpr unsigned QH = 2, QS = 6;

    static __device__ __forceinline__ float value(const unsigned char *row, unsigned int v) {
        const unsigned char *block = row + (size_t)(v / BLOCK_VALUES) * BLOCK_BYTES;
        const unsigned int j = v % BLOCK_VALUES, byte = block[QS + j % 16];
        const unsigned int high = (u32_le(block + QH) >> j) & 1u;
        const int q = (int)((j < 16 ? byte & 0xFu : byte >> 4) | (high << 4)) - 16;
        return __fmul_rn((float)q, f16_bits_to_f32(u16_le(block)));
    }
    static __device__ __forceinline__ void parts(const unsigned char *block, unsigned int u, float *q, float *scale,
                                                 float *add) {
        scale[0] = scale[1] = load_f16(block);
        add[0] = add[1] = 0.f;
        unsigned int r[5];  // qh, then the four words of nibbles
        load_words<5, false>(block + QH, r);
        unsigned int w[8];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[i] = low_nibbles(r[1 + i]) | spread_bits(r[0], 4 * i, 4);
            w[4 + i] = high_nibbles(r[1 + i]) | spread_bits(r[0], 16 + 4 * i, 4);
        }
        words_to_floats(w, 16.f, q);
    }
};

}  // namespace he
