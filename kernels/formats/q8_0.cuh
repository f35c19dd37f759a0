// GGUF Q8_0 (src/tensor/q8_0.rs): blocks of 32 values, a little-endian f16 scale then 32 int8, 34 bytes,
// so blocks are only 2-byte aligned.
#pragma once
#include "formats/blocks.cuh"

namespace he {

struct BlockQ8_0 {
    unsigned short scale;
    signed char quants[32];  // src/tensor/q8_0.rs has the same block
};
static_assert(sizeof(BlockQ8_0) == 34, "block_q8_0 as GGUF stores it");

struct FormatQ8_0 {
    static constexpr int ID = HE_DTYPE_Q8_0;
    static constexpr unsigned BLOCK_VALUES = sizeof(BlockQ8_0::quants), BLOCK_BYTES = sizeof(BlockQ8_0);
    static constexpr unsigned QUANTS = offsetof(BlockQ8_0, quants), UNITS = 1;
    static constexpr bool HAS_MIN = false;

    static __device__ __forceinline__ float value(const unsigned char *row, unsigned int v) {
        const unsigned char *block = row + (size_t)(v / BLOCK_VALUES) * BLOCK_BYTES;
        // One rounded product, no fused add: the same f32 the CPU computes.
        return __fmul_rn(f16_bits_to_f32(u16_le(block)), (float)(signed char)block[QUANTS + v % BLOCK_VALUES]);
    }
    // The whole block is the unit; bytes biased by 128 so the exact-float trick applies to signed values.
    // The whole block is the unit; bytes biased by 128 so the exact-float trick applies to signed values.
    static __device__ __forceinline__ void parts(const unsigned char *block, unsigned int u, float *q, float *scale,
                                                 float *add) {
        scale[0] = scale[1] = load_f16(block);
        add[0] = add[1] = 0.f;
        unsigned int w[8];
        load_words<8, false>(block + QUANTS, w);
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] ^= 0x80808080u;
        words_to_floats(w, 128.f, q);
    }
};

}  // namespace he
