// GGUF Q2_K (src/tensor/): super-blocks of 256 values: 16 bytes of 4-bit scale / 4-bit min pairs, 64 bytes
// of 2-bit quants, f16 d and dmin. Group g of 16 values (scale byte g) sits in half g % 2 of the 32 bytes
// at 32 * (g / 8), at bit 2 * ((g % 8) / 2); value = d * (s & 15) * q - dmin * (s >> 4). 84 bytes.
#pragma once
#include "formats/blocks.cuh"

namespace he {

struct FormatQ2_K {
    static constexpr int ID = HE_DTYPE_Q2_K;
    static constexpr unsigned BLOCK_VALUES = 256, BLOCK_BYTES = 84, UNITS = 8;
    static constexpr bool HAS_MIN = true;
    static constexpr unsigned SCALES = 0, QS = 16, D = 80, DMIN = 82;

    static __device__ __forceinline__ float value(const unsigned char *row, unsigned int v) {
        const unsigned char *block = row + (size_t)(v / BLOCK_VALUES) * BLOCK_BYTES;
        const unsigned int j = v % BLOCK_VALUES, g = j / 16, l = j % 16;
        const unsigned int s = block[SCALES + g];
        const unsigned int q = (block[QS + 32 * (g / 8) + 16 * (g % 2) + l] >> (2 * ((g % 8) / 2))) & 3u;
        const float dl = __fmul_rn(f16_bits_to_f32(u16_le(block + D)), (float)(s & 0xFu));
        const float ml = __fmul_rn(f16_bits_to_f32(u16_le(block + DMIN)), (float)(s >> 4));
        return __fsub_rn(__fmul_rn(dl, (float)q), ml);
    }
    // Unit u: groups 2u and 2u + 1, the two halves of the 32 bytes at 32 * (u / 4), bit 2 * (u % 4).
    // Unit u: groups 2u and 2u + 1, the two halves of the 32 bytes at 32 * (u / 4), bit 2 * (u % 4).
    static __device__ __forceinline__ void parts(const unsigned char *block, unsigned int u, float *q, float *scale,
                                                 float *add) {
        const float d = load_f16(block + D), dmin = load_f16(block + DMIN);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const unsigned int s = block[SCALES + 2 * u + h];
            scale[h] = d * (float)(s & 0xFu);
            add[h] = -(dmin * (float)(s >> 4));
        }
        unsigned int r[8];
        load_words<8, true>(block + QS + 32 * (u / 4), r);
        const unsigned int shift = 2 * (u % 4);
#pragma unroll
        for (int i = 0; i < 8; i++) r[i] = (r[i] >> shift) & 0x03030303u;
        words_to_floats(r, 0.f, q);
    }
};

}  // namespace he
