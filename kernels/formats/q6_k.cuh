// GGUF Q6_K (src/tensor/): super-blocks of 256 values: 128 bytes of low nibbles, 64 bytes of 2-bit high
// parts, sixteen int8 scales, f16 d. In each half n of 128 values, the 32 values at 32k take the low
// (k < 2) or high nibbles of the 32 bytes at 64n + 32(k % 2) and bits 2k of the 32 high bytes at 32n;
// value = d * scale * (q - 32), scale 8n + 2k + (l >= 16). 210 bytes, 2-byte aligned.
#pragma once
#include "formats/blocks.cuh"

namespace he {

struct FormatQ6_K {
    static constexpr int ID = HE_DTYPE_Q6_K;
    static constexpr unsigned BLOCK_VALUES = 256, BLOCK_BYTES = 210, UNITS = 8;
    static constexpr bool HAS_MIN = false;
    static constexpr unsigned QL = 0, QH = 128, SCALES = 192, D = 208;

    static __device__ __forceinline__ float value(const unsigned char *row, unsigned int v) {
        const unsigned char *block = row + (size_t)(v / BLOCK_VALUES) * BLOCK_BYTES;
        const unsigned int j = v % BLOCK_VALUES, n = j / 128, k = (j % 128) / 32, l = j % 32;
        const unsigned int low = block[QL + 64 * n + 32 * (k % 2) + l];
        const unsigned int q = (k < 2 ? low & 0xFu : low >> 4) | (((block[QH + 32 * n + l] >> (2 * k)) & 3u) << 4);
        const float scale = (float)(signed char)block[SCALES + 8 * n + 2 * k + l / 16];
        return __fmul_rn(__fmul_rn(f16_bits_to_f32(u16_le(block + D)), scale), (float)((int)q - 32));
    }
    static __device__ __forceinline__ void parts(const unsigned char *block, unsigned int u, float *q, float *scale,
                                                 float *add) {
        const float d = load_f16(block + D);
        const unsigned int n = u / 4, k = u % 4;
        scale[0] = d * (float)(signed char)block[SCALES + 8 * n + 2 * k];
        scale[1] = d * (float)(signed char)block[SCALES + 8 * n + 2 * k + 1];
        add[0] = add[1] = 0.f;
        unsigned int ql[8], qh[8];
        load_words<8, false>(block + QL + 64 * n + 32 * (k % 2), ql);
        load_words<8, false>(block + QH + 32 * n, qh);
#pragma unroll
        for (int i = 0; i < 8; i++)
            ql[i] = (k < 2 ? low_nibbles(ql[i]) : high_nibbles(ql[i])) | (((qh[i] >> (2 * k)) & 0x03030303u) << 4);
        words_to_floats(ql, 32.f, q);
    }
};

}  // namespace he
