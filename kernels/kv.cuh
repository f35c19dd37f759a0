// Reading the KV cache types (HE_KV_*, laid out as hostembed_kernels.cuh's HE_PAGE_TOKENS comment says)
// in the attention kernels: a Reader loads eight consecutive values of one row of a slab raw, then decodes
// them to exact f32 in registers; the block types' scale (one per 32 values, so the same for all eight; f16
// for Q8_0, bf16 for FP8_E4M3) is read apart and applied by the caller, to a dot product or to a weight. Reader<0> takes the type at run
// time (one kernel for every pair of K and V types); the others are fixed at compile time.
//
// Every value decodes exactly: bf16 and f16 are f32 subsets, an int8 or an E4M3 code is exact in f32, and
// scale x code is exact in f32 (11 by 8 significant bits), so attention reads what src/kv.rs decodes.
#pragma once
#include <cuda_fp8.h>

#include "formats/blocks.cuh"
#include "hostembed_kernels.cuh"

namespace he {
namespace kv {

// Where a slab's scales start: after its HE_PAGE_TOKENS rows of one-byte codes.
__device__ __forceinline__ const unsigned char *scales_of(const unsigned char *slab, unsigned int d) {
    return slab + (size_t)HE_PAGE_TOKENS * d;
}

// The scale of values c.. of row t of a block type's slab: f16 bits for Q8_0, bf16 for FP8_E4M3.
template <bool FP8>
__device__ __forceinline__ float block_scale(const unsigned char *slab, unsigned int t, unsigned int c,
                                             unsigned int d) {
    const unsigned int bits = __ldg(reinterpret_cast<const unsigned short *>(scales_of(slab, d)) +
                                    (size_t)t * (d / HE_KV_BLOCK) + c / HE_KV_BLOCK);
    return FP8 ? __uint_as_float(bits << 16) : f16_bits_to_f32(bits);
}

// Eight int8 quants (two words) as exact floats.
__device__ __forceinline__ void q8_to_floats(uint2 w, float (&f)[8]) {
    bytes_to_floats(w.x ^ 0x80808080u, 128.f, f);
    bytes_to_floats(w.y ^ 0x80808080u, 128.f, f + 4);
}

// Eight E4M3 codes (two words) as exact floats (E4M3 converts to f16 exactly; NaN stays NaN).
__device__ __forceinline__ void fp8_to_floats(uint2 w, float (&f)[8]) {
    const unsigned int words[2] = {w.x, w.y};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const unsigned int pair = (words[i / 2] >> (16 * (i % 2))) & 0xffffu;
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)pair, __NV_E4M3);
        f[2 * i] = f16_bits_to_f32(h.x);
        f[2 * i + 1] = f16_bits_to_f32(h.y);
    }
}

__device__ __forceinline__ void halves_to_floats(uint4 w, bool f16, float (&f)[8]) {
    const unsigned int words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = f16 ? f16_bits_to_f32(words[i] & 0xffffu) : bf16_lo(words[i]);
        f[2 * i + 1] = f16 ? f16_bits_to_f32(words[i] >> 16) : bf16_hi(words[i]);
    }
}

__device__ __forceinline__ void words_to_floats(uint4 a, uint4 b, float (&f)[8]) {
    f[0] = __uint_as_float(a.x), f[1] = __uint_as_float(a.y), f[2] = __uint_as_float(a.z);
    f[3] = __uint_as_float(a.w), f[4] = __uint_as_float(b.x), f[5] = __uint_as_float(b.y);
    f[6] = __uint_as_float(b.z), f[7] = __uint_as_float(b.w);
}

// Reader<TYPE>: Raw (the bytes of eight values), SCALED (whether `scale` can be other than 1), and
//   load(slab, t, c, d)    values c..c+7 of row t (c a multiple of 8) of a slab of rows of d values
//   decode(raw, f)         those values as floats, before the scale
//   scale(slab, t, c, d)   their block's scale (1 for the one-value types)
template <int TYPE>
struct Reader;

template <>
struct Reader<HE_KV_BF16> {
    using Raw = uint4;
    static constexpr bool SCALED = false;
    __device__ explicit Reader(int) {}
    __device__ __forceinline__ Raw load(const unsigned char *slab, unsigned int t, unsigned int c,
                                        unsigned int d) const {
        return __ldg(reinterpret_cast<const uint4 *>(slab + ((size_t)t * d + c) * 2));
    }
    __device__ __forceinline__ void decode(const Raw &r, float (&f)[8]) const { halves_to_floats(r, false, f); }
    __device__ __forceinline__ float scale(const unsigned char *, unsigned int, unsigned int, unsigned int) const {
        return 1.f;
    }
};

template <>
struct Reader<HE_KV_F16> {
    using Raw = uint4;
    static constexpr bool SCALED = false;
    __device__ explicit Reader(int) {}
    __device__ __forceinline__ Raw load(const unsigned char *slab, unsigned int t, unsigned int c,
                                        unsigned int d) const {
        return __ldg(reinterpret_cast<const uint4 *>(slab + ((size_t)t * d + c) * 2));
    }
    __device__ __forceinline__ void decode(const Raw &r, float (&f)[8]) const { halves_to_floats(r, true, f); }
    __device__ __forceinline__ float scale(const unsigned char *, unsigned int, unsigned int, unsigned int) const {
        return 1.f;
    }
};

template <>
struct Reader<HE_KV_Q8_0> {
    using Raw = uint2;
    static constexpr bool SCALED = true;
    __device__ explicit Reader(int) {}
    __device__ __forceinline__ Raw load(const unsigned char *slab, unsigned int t, unsigned int c,
                                        unsigned int d) const {
        return __ldg(reinterpret_cast<const uint2 *>(slab + (size_t)t * d + c));
    }
    __device__ __forceinline__ void decode(const Raw &r, float (&f)[8]) const { q8_to_floats(r, f); }
    __device__ __forceinline__ float scale(const unsigned char *slab, unsigned int t, unsigned int c,
                                           unsigned int d) const {
        return block_scale<false>(slab, t, c, d);
    }
};

template <>
struct Reader<HE_KV_FP8_E4M3> {
    using Raw = uint2;
    static constexpr bool SCALED = true;
    __device__ explicit Reader(int) {}
    __device__ __forceinline__ Raw load(const unsigned char *slab, unsigned int t, unsigned int c,
                                        unsigned int d) const {
        return __ldg(reinterpret_cast<const uint2 *>(slab + (size_t)t * d + c));
    }
    __device__ __forceinline__ void decode(const Raw &r, float (&f)[8]) const { fp8_to_floats(r, f); }
    __device__ __forceinline__ float scale(const unsigned char *slab, unsigned int t, unsigned int c,
                                           unsigned int d) const {
        return block_scale<true>(slab, t, c, d);
    }
};

// Any type, chosen at run time (the branch is the same for every thread of a launch).
template <>
struct Reader<0> {
    struct Raw {
        uint4 a, b;
    };
    static constexpr bool SCALED = true;
    int type;
    __device__ explicit Reader(int t) : type(t) {}
    __device__ __forceinline__ Raw load(const unsigned char *slab, unsigned int t, unsigned int c,
                                        unsigned int d) const {
        Raw r;
        r.b = make_uint4(0, 0, 0, 0);
        switch (type) {
        case HE_KV_F32: {
            const uint4 *p = reinterpret_cast<const uint4 *>(slab + ((size_t)t * d + c) * 4);
            r.a = __ldg(p), r.b = __ldg(p + 1);
            break;
        }
        case HE_KV_Q8_0:
        case HE_KV_FP8_E4M3: {
            const uint2 w = __ldg(reinterpret_cast<const uint2 *>(slab + (size_t)t * d + c));
            r.a = make_uint4(w.x, w.y, 0, 0);
            break;
        }
        default: r.a = __ldg(reinterpret_cast<const uint4 *>(slab + ((size_t)t * d + c) * 2)); break;
        }
        return r;
    }
    __device__ __forceinline__ void decode(const Raw &r, float (&f)[8]) const {
        switch (type) {
        case HE_KV_F32: words_to_floats(r.a, r.b, f); break;
        case HE_KV_Q8_0: q8_to_floats(make_uint2(r.a.x, r.a.y), f); break;
        case HE_KV_FP8_E4M3: fp8_to_floats(make_uint2(r.a.x, r.a.y), f); break;
        default: halves_to_floats(r.a, type == HE_KV_F16, f); break;
        }
    }
    __device__ __forceinline__ float scale(const unsigned char *slab, unsigned int t, unsigned int c,
                                           unsigned int d) const {
        switch (type) {
        case HE_KV_Q8_0: return block_scale<false>(slab, t, c, d);
        case HE_KV_FP8_E4M3: return block_scale<true>(slab, t, c, d);
        default: return 1.f;
        }
    }
};

}  // namespace kv
}  // namespace he
