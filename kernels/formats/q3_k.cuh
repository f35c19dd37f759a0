// GGUF Q3_K (src/tensor/): super-blocks of 256 values: 32 bytes of high bits, 64 bytes of 2-bit quants,
// 12 bytes packing sixteen 6-bit scales, f16 d. Group g of 16 values takes the 2-bit quants of half g % 2
// of the 32 bytes at 32 * (g / 8), bit 2 * ((g % 8) / 2), and bit 4 * (g / 8) + (g % 8) / 2 of the same
// half of the high bits; value = d * (scale - 32) * (q + 4 * high - 4). 110 bytes, 2-byte aligned.
#pragma once
#include "formats/blocks.cuh"

namespace he {

struct FormatQ3_K {
    static constexpr int ID = HE_DTYPE_Q3_K;
    static constexpr unsigned BLOCK_VALUES = 256, BLOCK_BYTES = 110, UNITS = 8;
    static constexpr bool HAS_MIN = false;
    static constexpr unsigned HMASK = 0, QS = 32, SCALES = 96, D = 108;

    // Scale g, less 32, as llama.cpp unpacks the 12 bytes.
    static __device__ __forceinline__ int scale_of(const unsigned char *block, unsigned int g) {
        const unsigned int lo = (block[SCALES + g % 8] >> (4 * (g / 8))) & 0xFu;
        const unsigned int hi = (block[SCALES + 8 + g % 4] >> (2 * (g / 4))) & 3u;
        return (int)(lo | (hi << 4)) - 32;
    }
    static __device__ __forceinline__ float value(const unsigned char *row, unsigned int v) {
        const unsigned char *block = row + (size_t)(v / BLOCK_VALUES) * BLOCK_BYTES;
        const unsigned int j = v % BLOCK_VALUES, g = j / 16, l = j % 16, n = g / 8, pair = (g % 8) / 2;
        const unsigned int byte = 16 * (g % 2) + l;
        const int q = (int)((block[QS + 32 * n + byte] >> (2 * pair)) & 3u) -
                      ((block[HMASK + byte] >> (4 * n + pair)) & 1u ? 0 : 4);
        const float dl = __fmul_rn(f16_bits_to_f32(u16_le(block + D)), (float)scale_of(block, g));
        return __fmul_rn(dl, (float)q);
    }
    // Unit u: groups 2u and 2u + 1.
    // Unit u: groups 2u and 2u + 1.
    static __device__ __forceinline__ void parts(const unsigned char *block, unsigned int u, float *q, float *scale,
                                                 float *add) {
        const float d = load_f16(block + D);
        scale[0] = d * (float)scale_of(block, 2 * u);
        scale[1] = d * (float)scale_of(block, 2 * u + 1);
        add[0] = add[1] = 0.f;
        const unsigned int n = u / 4, pair = u % 4;
        unsigned int qs[8], hm[8];
        load_words<8, false>(block + QS + 32 * n, qs);
        load_words<8, false>(block + HMASK, hm);
#pragma unroll
        for (int i = 0; i < 8; i++)
            qs[i] = ((qs[i] >> (2 * pair)) & 0x03030303u) | (((hm[i] >> (4 * n + pair)) & 0x01010101u) << 2);
        words_to_floats(qs, 4.f, q);
    }
};

}  // namespace he
