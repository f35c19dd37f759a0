// GGUF Q8_0 (src/tensor/q8_0.rs): blocks of 32 values, a little-endian f16 scale then 32 int8, 34 bytes,
// so blocks are only 2-byte aligned. Two readings: the matrix-vector product's chunks (a slot is a quarter
// block, 8 values: a warp step takes 8 blocks of one parity out of a group of 16, so whether a lane's 8
// bytes sit on a 4-byte boundary is the same for the whole warp and the aligned/unaligned load choice never
// diverges; measured faster than the staged block path: 35% against 20% of copy bandwidth on 4096 x 14336),
// and the 32-value units the prompt path's conversion decodes.
#pragma once
#include "formats/blocks.cuh"
#include "formats/float.cuh"

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
    // A warp step is 32 lanes, one slot each: 8 blocks of one parity, four quarters each.
    static constexpr unsigned QUARTER = BLOCK_VALUES / 4, GROUP_BLOCKS = 16, SLOTS_PER_GROUP = GROUP_BLOCKS * 4,
                              STEP_SLOTS = SLOTS_PER_GROUP / 2;

    static __device__ __forceinline__ float value(const unsigned char *row, unsigned int v) {
        const unsigned char *block = row + (size_t)(v / BLOCK_VALUES) * BLOCK_BYTES;
        // One rounded product, no fused add: the same f32 the CPU computes.
        return __fmul_rn(f16_bits_to_f32(u16_le(block)), (float)(signed char)block[QUANTS + v % BLOCK_VALUES]);
    }
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

    struct Chunk {
        unsigned int lo, hi;
        float scale;
    };
    static constexpr int CHUNK_VALUES = QUARTER;
    static bool chunks_fit(const void *w, unsigned int) { return reinterpret_cast<uintptr_t>(w) % 2 == 0; }
    static __device__ __forceinline__ unsigned int blocks(unsigned int cols) { return cols / BLOCK_VALUES; }
    // Slot k: group k / SLOTS_PER_GROUP, parity (k / STEP_SLOTS) % 2, then the lane's block and quarter.
    static __device__ __forceinline__ unsigned int block_of(unsigned int slot) {
        return slot / SLOTS_PER_GROUP * GROUP_BLOCKS + 2 * ((slot % STEP_SLOTS) / 4) + (slot / STEP_SLOTS) % 2;
    }
    static __device__ __forceinline__ unsigned int slots(unsigned int cols) {
        return (blocks(cols) + GROUP_BLOCKS - 1) / GROUP_BLOCKS * SLOTS_PER_GROUP;
    }
    static __device__ __forceinline__ unsigned int whole_slots(unsigned int cols) {
        return blocks(cols) / GROUP_BLOCKS * SLOTS_PER_GROUP;
    }
    static __device__ __forceinline__ bool has(unsigned int slot, unsigned int cols) {
        return block_of(slot) < blocks(cols);
    }
    static __device__ __forceinline__ size_t column(unsigned int slot) {
        return (size_t)block_of(slot) * BLOCK_VALUES + QUARTER * (slot % 4);
    }
    static __device__ __forceinline__ Chunk load_chunk(const unsigned char *row, unsigned int first, unsigned int ahead) {
        const unsigned int slot = first + ahead;
        const unsigned char *block = row + (size_t)block_of(slot) * BLOCK_BYTES;
        const unsigned char *d = block + QUANTS + QUARTER * (slot % 4);
        Chunk c;
        c.scale = f16_bits_to_f32(__ldg(reinterpret_cast<const unsigned short *>(block)));
        if ((reinterpret_cast<uintptr_t>(d) & 3) == 0) {
            c.lo = __ldg(reinterpret_cast<const unsigned int *>(d));
            c.hi = __ldg(reinterpret_cast<const unsigned int *>(d + 4));
        } else {
            const unsigned int a = __ldg(reinterpret_cast<const unsigned short *>(d));
            const unsigned int m = __ldg(reinterpret_cast<const unsigned int *>(d + 2));
            const unsigned int b = __ldg(reinterpret_cast<const unsigned short *>(d + 6));
            c.lo = a | (m << 16);
            c.hi = (m >> 16) | (b << 16);
        }
        return c;
    }
    static __device__ __forceinline__ void decode(const Chunk &c, float *f) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            f[i] = c.scale * (float)(signed char)(c.lo >> (8 * i));
            f[4 + i] = c.scale * (float)(signed char)(c.hi >> (8 * i));
        }
    }
};

}  // namespace he
