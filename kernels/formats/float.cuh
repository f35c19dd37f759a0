// F32, F16 and BF16: blocks of one value. The matrix-vector product reads 16-byte chunks on 16-byte
// boundaries, so it takes this layout when the weights are 16-byte aligned and rows are whole chunks.
#pragma once
#include "hostembed_kernels.cuh"

namespace he {

// Little-endian integers at any alignment.
__device__ __forceinline__ unsigned int u16_le(const unsigned char *p) { return (unsigned int)p[0] | ((unsigned int)p[1] << 8); }
__device__ __forceinline__ unsigned int u32_le(const unsigned char *p) {
    return (unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16) | ((unsigned int)p[3] << 24);
}

// What the three float formats share: the slot a lane reads is one 16-byte chunk, and every slot exists.
template <int ID_, unsigned BYTES>
struct FloatLayout {
    static constexpr int ID = ID_;
    static constexpr unsigned BLOCK_VALUES = 1, BLOCK_BYTES = BYTES;
    using Chunk = uint4;
    static constexpr int CHUNK_VALUES = 16 / BYTES;
    static bool chunks_fit(const void *w, unsigned int cols) {
        return cols % CHUNK_VALUES == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0;
    }
    static __device__ __forceinline__ unsigned int slots(unsigned int cols) { return cols / CHUNK_VALUES; }
    static __device__ __forceinline__ unsigned int whole_slots(unsigned int cols) { return slots(cols); }
    static __device__ __forceinline__ bool has(unsigned int, unsigned int) { return true; }
    static __device__ __forceinline__ size_t column(unsigned int slot) { return (size_t)slot * CHUNK_VALUES; }
    // Slot first + ahead (two offsets, not their sum, so the loads of one step share one address register).
    static __device__ __forceinline__ Chunk load_chunk(const unsigned char *row, unsigned int first, unsigned int ahead) {
        return load_stream16(reinterpret_cast<const uint4 *>(row) + first + ahead);
    }
};

struct FormatF32 : FloatLayout<HE_DTYPE_F32, 4> {
    static __device__ __forceinline__ float value(const unsigned char *row, unsigned int v) {
        return __uint_as_float(u32_le(row + 4 * (size_t)v));
    }
    static __device__ __forceinline__ void decode(Chunk v, float *f) {
        f[0] = __uint_as_float(v.x), f[1] = __uint_as_float(v.y), f[2] = __uint_as_float(v.z),
        f[3] = __uint_as_float(v.w);
    }
};

struct FormatF16 : FloatLayout<HE_DTYPE_F16, 2> {
    static __device__ __forceinline__ float value(const unsigned char *row, unsigned int v) {
        return f16_bits_to_f32(u16_le(row + 2 * (size_t)v));
    }
    static __device__ __forceinline__ float2 pair(unsigned int w) {
        __half2 h;
        memcpy(&h, &w, 4);
        return __half22float2(h);
    }
    static __device__ __forceinline__ void decode(Chunk v, float *f) {
        float2 a = pair(v.x), b = pair(v.y), c = pair(v.z), d = pair(v.w);
        f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y, f[4] = c.x, f[5] = c.y, f[6] = d.x, f[7] = d.y;
    }
};

struct FormatBF16 : FloatLayout<HE_DTYPE_BF16, 2> {
    static __device__ __forceinline__ float value(const unsigned char *row, unsigned int v) {
        return __bfloat162float(__ushort_as_bfloat16((unsigned short)u16_le(row + 2 * (size_t)v)));
    }
    static __device__ __forceinline__ void decode(Chunk v, float *f) {
        f[0] = bf16_lo(v.x), f[1] = bf16_hi(v.x), f[2] = bf16_lo(v.y), f[3] = bf16_hi(v.y);
        f[4] = bf16_lo(v.z), f[5] = bf16_hi(v.z), f[6] = bf16_lo(v.w), f[7] = bf16_hi(v.w);
    }
};

}  // namespace he
