// GGUF Q4_K (src/tensor/): super-blocks of 256 values: f16 d and dmin, 12 bytes packing eight 6-bit scales
// and mins, 128 bytes of nibbles. Sub-block s (32 values) is the low (s even) or high nibbles of the 32
// bytes at 32 * (s / 2); value = d * scale * q - dmin * min. 144 bytes, 16-byte aligned wherever the row is.
#pragma once
#include "formats/blocks.cuh"

namespace he {

struct FormatQ4_K {
    static constexpr int ID = HE_DTYPE_Q4_K;
    static constexpr unsigned BLOCK_VALUES = 256, BLOCK_BYTES = 144, UNITS = 8;
    static constexpr bool HAS_MIN = true;
    static constexpr unsigned D = 0, DMIN = 2, SCALES = 4, QS = 16;

    static __device__ __forceinline__ float value(const unsigned char *row, unsigned int v) {
        const unsigned char *block = row + (size_t)(v / BLOCK_VALUES) * BLOCK_BYTES;
        const unsigned int j = v % BLOCK_VALUES, s = j / 32, l = j % 32;
        unsigned int sc, m;
        scale_min_k4(block + SCALES, (int)s, sc, m);
        const unsigned int byte = block[QS + 32 * (s / 2) + l];
        const float q = (float)(s % 2 ? byte >> 4 : byte & 0xFu);
        const float d1 = __fmul_rn(f16_bits_to_f32(u16_le(block + D)), (float)sc);
        const float m1 = __fmul_rn(f16_bits_to_f32(u16_le(block + DMIN)), (float)m);
        return __fsub_rn(__fmul_rn(d1, q), m1);
    }
    static __device__ __forceinline__ void parts(const unsigned char *block, unsigned int u, float *q, float *scale,
                                                 float *add) {
        unsigned int sc, m;
        scale_min_k4(block + SCALES, (int)u, sc, m);
        scale[0] = scale[1] = load_f16(block + D) * (float)sc;
        add[0] = add[1] = -(load_f16(block + DMIN) * (float)m);
        unsigned int r[8];
        load_words<8, true>(block + QS + 32 * (u / 2), r);
#pragma unroll
        for (int i = 0; i < 8; i++) r[i] = u % 2 ? high_nibbles(r[i]) : low_nibbles(r[i]);
        words_to_floats(r, 0.f, q);
    }
};

}  // namespace he
