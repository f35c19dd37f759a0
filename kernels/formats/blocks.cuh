// What the block formats (GGUF's quantized blocks, kernels/formats/q*.cuh) share: reading their fields at
// the 2-byte alignment GGUF guarantees, and turning packed small integers into exact floats without the
// slow integer-to-float conversion (a byte placed under the exponent of 2^23 is 2^23 + byte exactly).
//
// A block format's traits add to those kernels/formats.cuh lists:
//   UNITS, UNIT_VALUES (32)      a block is UNITS units of 32 consecutive values (unit u: values 32u..)
//   HAS_MIN                      whether values carry an offset (scale * q + add) or not (scale * q)
//   parts(block, u, q, scale, add)
//                                unit u of the block at `block` (2-byte aligned, in any memory): its
//                                quants as exact floats q[0..32) and the scale (and offset) of each half
//                                of 16 values, rounded as the CPU rounds them
// decode_unit() below turns them into values; the staged matrix-vector product (kernels/matvec.cu) can
// instead apply the scales to whole dot products. (The prompt path's conversion reads 8-value pieces
// instead: formats/pieces.cuh.)
#pragma once
#include "formats/float.cuh"

namespace he {

constexpr unsigned UNIT_VALUES = 32;
constexpr float MAGIC_2P23 = 8388608.f;

// N little-endian 32-bit words from p (2-byte aligned, or 4-byte when ALIGNED4): the aligned words around
// them, funnel-shifted; the word past the end is read only when p is not 4-byte aligned, and it shares its
// 4-byte granule (so its page) with the last byte asked for.
template <int N, bool ALIGNED4>
__device__ __forceinline__ void load_words(const unsigned char *p, unsigned int (&out)[N]) {
    if constexpr (ALIGNED4) {
        const unsigned int *q = reinterpret_cast<const unsigned int *>(p);
#pragma unroll
        for (int i = 0; i < N; i++) out[i] = q[i];
    } else {
        const uintptr_t a = reinterpret_cast<uintptr_t>(p);
        const unsigned int *q = reinterpret_cast<const unsigned int *>(a & ~(uintptr_t)3);
        const unsigned int shift = (unsigned int)(a & 3) * 8;
        unsigned int raw[N + 1];
#pragma unroll
        for (int i = 0; i < N; i++) raw[i] = q[i];
        raw[N] = shift != 0 ? q[N] : 0u;
#pragma unroll
        for (int i = 0; i < N; i++) out[i] = __funnelshift_r(raw[i], raw[i + 1], shift);
    }
}

// A 16-bit little-endian field at a 2-byte aligned address.
__device__ __forceinline__ unsigned int load_u16(const unsigned char *p) {
    return *reinterpret_cast<const unsigned short *>(p);
}
__device__ __forceinline__ float load_f16(const unsigned char *p) { return f16_bits_to_f32(load_u16(p)); }

// Byte k of w plus 2^23, as a float (exact: the byte lands in the mantissa).
__device__ __forceinline__ float byte_magic(unsigned int w, int k) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540u + (unsigned int)k));
}

// The four bytes of w, each less `bias`, as exact floats in f[0..4).
__device__ __forceinline__ void bytes_to_floats(unsigned int w, float bias, float *f) {
    const float sub = MAGIC_2P23 + bias;
#pragma unroll
    for (int k = 0; k < 4; k++) f[k] = byte_magic(w, k) - sub;
}

// The low and high nibbles of each byte of w, as four bytes each.
__device__ __forceinline__ unsigned int low_nibbles(unsigned int w) { return w & 0x0F0F0F0Fu; }
__device__ __forceinline__ unsigned int high_nibbles(unsigned int w) { return (w >> 4) & 0x0F0F0F0Fu; }

// Bits b..b+3 of m, one to bit `to` of each byte (bit b to byte 0).
__device__ __forceinline__ unsigned int spread_bits(unsigned int m, int b, int to) {
    return ((((m >> b) & 0xFu) * 0x00204081u) & 0x01010101u) << to;
}

// The bytes of N words of quants, each less `bias`, as exact floats in q[0..4N).
template <int N>
__device__ __forceinline__ void words_to_floats(const unsigned int (&words)[N], float bias, float *q) {
#pragma unroll
    for (int i = 0; i < N; i++) bytes_to_floats(words[i], bias, q + 4 * i);
}

// Unit u of a block format's block as values: w[i] = scale[i / 16] * q[i] (+ add[i / 16] when the format
// has offsets), with one fused rounding, or the CPU's two when EXACT.
template <typename F, bool EXACT = false>
__device__ __forceinline__ void decode_unit(const unsigned char *block, unsigned int u, float *w) {
    float q[UNIT_VALUES], scale[2], add[2];
    F::parts(block, u, q, scale, add);
#pragma unroll
    for (int i = 0; i < (int)UNIT_VALUES; i++) {
        const int h = i / 16;
        w[i] = !F::HAS_MIN ? scale[h] * q[i]
               : EXACT     ? __fadd_rn(__fmul_rn(scale[h], q[i]), add[h])
                           : fmaf(scale[h], q[i], add[h]);
    }
}

// The i-th 6-bit scale and min of a Q4_K / Q5_K block's 12 packed bytes (s), as llama.cpp packs them.
__device__ __forceinline__ void scale_min_k4(const unsigned char *s, int i, unsigned int &sc, unsigned int &m) {
    if (i < 4) {
        sc = s[i] & 63u;
        m = s[i + 4] & 63u;
    } else {
        sc = (s[i + 4] & 0xFu) | ((unsigned int)(s[i - 4] >> 6) << 4);
        m = (s[i + 4] >> 4) | ((unsigned int)(s[i] >> 6) << 4);
    }
}

}  // namespace he
