// Every weight format read as 8-value pieces, for the prompt path's conversion into a half format
// (kernels/gemm.cu). Piece k of a matrix is its values 8k..8k+7 in storage order: rows are whole blocks
// and lie back to back, so a matrix is one run of blocks and piece k sits in block 8k / BLOCK_VALUES (or,
// for the one-value float formats, spans 8 of them). A lane decodes one piece into one 16-byte store, so
// a warp writes 512 contiguous bytes an instruction; its loads come straight from global memory, as wide
// as the format's alignment allows, and a warp's lanes read neighbouring bytes of the same blocks, so
// each load instruction touches a few lines only.
//
// Pieces<F> gives, for format F (the layouts are in each format's file):
//   ALIGN                       the byte alignment of the matrix load() needs
//   Raw, load(w, piece)         the piece's loads only, nothing computed from them, so that a thread
//                               can have several pieces' loads in flight before it uses the first
//   decode(raw, v)              its 8 values, each the arithmetic of F::value (the CPU's decode, bit
//                               for bit: the same f32 operations, each rounded once)
// A format without a specialization takes the generic one (eight F::value calls), so a new format
// converts correctly before it gets its own.
#pragma once
#include "formats.cuh"

namespace he {

// 8 bytes at a 2-byte aligned address: the aligned words around them, shifted into place by bytes8().
// The third word is read only when the address is not 4-byte aligned, and then it shares its 4-byte
// granule (so its page) with the last byte asked for.
struct Bytes8At2 {
    unsigned int w0, w1, w2, shift;
};
__device__ __forceinline__ Bytes8At2 load8_at2(const unsigned char *p) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const unsigned int *q = reinterpret_cast<const unsigned int *>(a & ~(uintptr_t)3);
    Bytes8At2 r;
    r.shift = (unsigned int)(a & 2) * 8;
    r.w0 = __ldg(q);
    r.w1 = __ldg(q + 1);
    r.w2 = r.shift != 0 ? __ldg(q + 2) : 0u;
    return r;
}
__device__ __forceinline__ uint2 bytes8(const Bytes8At2 &b) {
    return make_uint2(__funnelshift_r(b.w0, b.w1, b.shift), __funnelshift_r(b.w1, b.w2, b.shift));
}

// 8 bytes at a 4-byte aligned address, and at an 8-byte aligned one.
__device__ __forceinline__ uint2 load8_at4(const unsigned char *p) {
    const unsigned int *q = reinterpret_cast<const unsigned int *>(p);
    return make_uint2(__ldg(q), __ldg(q + 1));
}
__device__ __forceinline__ uint2 load8_at8(const unsigned char *p) { return __ldg(reinterpret_cast<const uint2 *>(p)); }

__device__ __forceinline__ unsigned int load_u16_nc(const unsigned char *p) {
    return __ldg(reinterpret_cast<const unsigned short *>(p));
}
__device__ __forceinline__ unsigned int load_u32_nc(const unsigned char *p) {
    return __ldg(reinterpret_cast<const unsigned int *>(p));
}

// The 8 bytes of b, each less `bias`, as exact floats.
__device__ __forceinline__ void bytes8_to_floats(uint2 b, float bias, float (&f)[8]) {
    bytes_to_floats(b.x, bias, f);
    bytes_to_floats(b.y, bias, f + 4);
}
__device__ __forceinline__ uint2 low_nibbles8(uint2 b) { return make_uint2(low_nibbles(b.x), low_nibbles(b.y)); }
__device__ __forceinline__ uint2 high_nibbles8(uint2 b) { return make_uint2(high_nibbles(b.x), high_nibbles(b.y)); }

// Scale and min i of a Q4_K / Q5_K block from its 12 scale bytes as three words (scale_min_k4's
// reading, with the bytes in registers).
__device__ __forceinline__ void scale_min_k4_words(unsigned int s0, unsigned int s1, unsigned int s2, unsigned int i,
                                                   unsigned int &sc, unsigned int &m) {
    const unsigned int sh = 8 * (i % 4);
    const unsigned int a = (s0 >> sh) & 0xFFu, b = (s1 >> sh) & 0xFFu, c = (s2 >> sh) & 0xFFu;
    if (i < 4) {
        sc = a & 63u;
        m = b & 63u;
    } else {
        sc = (c & 0xFu) | ((a >> 6) << 4);
        m = (c >> 4) | ((b >> 6) << 4);
    }
}

// Any format: eight value() calls on the block (or, for one-value blocks, the 8 values) the piece is in.
template <typename F>
struct Pieces {
    static_assert(F::BLOCK_VALUES == 1 || F::BLOCK_VALUES % 8 == 0, "a piece lies in one block");
    static constexpr unsigned ALIGN = 1;
    struct Raw {
        const unsigned char *at;
        unsigned int first;
    };
    static __device__ __forceinline__ Raw load(const unsigned char *w, size_t piece) {
        const size_t first = 8 * piece;
        return Raw{w + first / F::BLOCK_VALUES * F::BLOCK_BYTES, (unsigned int)(first % F::BLOCK_VALUES)};
    }
    static __device__ __forceinline__ void decode(const Raw &r, float (&v)[8]) {
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = F::value(r.at, r.first + i);
    }
};

// ---- the float formats: 8 values are 32 or 16 bytes, read on 16-byte boundaries ----

template <>
struct Pieces<FormatF32> {
    static constexpr unsigned ALIGN = 16;
    struct Raw {
        uint4 a, b;
    };
    static __device__ __forceinline__ Raw load(const unsigned char *w, size_t piece) {
        const uint4 *p = reinterpret_cast<const uint4 *>(w) + 2 * piece;
        return Raw{__ldg(p), __ldg(p + 1)};
    }
    static __device__ __forceinline__ void decode(const Raw &r, float (&v)[8]) {
        FormatF32::decode(r.a, v);
        FormatF32::decode(r.b, v + 4);
    }
};

template <typename F>
struct HalfPieces {
    static constexpr unsigned ALIGN = 16;
    struct Raw {
        uint4 a;
    };
    static __device__ __forceinline__ Raw load(const unsigned char *w, size_t piece) {
        return Raw{__ldg(reinterpret_cast<const uint4 *>(w) + piece)};
    }
    static __device__ __forceinline__ void decode(const Raw &r, float (&v)[8]) { F::decode(r.a, v); }
};
template <>
struct Pieces<FormatF16> : HalfPieces<FormatF16> {};
template <>
struct Pieces<FormatBF16> : HalfPieces<FormatBF16> {};

// ---- 32-value blocks: a block is 4 pieces ----

template <>
struct Pieces<FormatQ8_0> {
    using F = FormatQ8_0;
    static constexpr unsigned ALIGN = 2;
    struct Raw {
        Bytes8At2 q;
        unsigned int d;
    };
    static __device__ __forceinline__ Raw load(const unsigned char *w, size_t piece) {
        const unsigned char *block = w + piece / 4 * F::BLOCK_BYTES;
        return Raw{load8_at2(block + F::QUANTS + 8 * (piece % 4)), load_u16_nc(block)};
    }
    static __device__ __forceinline__ void decode(const Raw &r, float (&v)[8]) {
        uint2 b = bytes8(r.q);
        b.x ^= 0x80808080u, b.y ^= 0x80808080u;  // int8 + 128 as bytes: the exact-float trick, less 128
        float q[8];
        bytes8_to_floats(b, 128.f, q);
        const float d = f16_bits_to_f32(r.d);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fmul_rn(d, q[i]);
    }
};

template <>
struct Pieces<FormatQ4_0> {
    using F = FormatQ4_0;
    static constexpr unsigned ALIGN = 2;
    struct Raw {
        Bytes8At2 q;
        unsigned int d, p;
    };
    // Pieces 0 and 1 are the low nibbles of the 16 quant bytes, 2 and 3 the high ones.
    static __device__ __forceinline__ Raw load(const unsigned char *w, size_t piece) {
        const unsigned char *block = w + piece / 4 * F::BLOCK_BYTES;
        const unsigned int p = piece % 4;
        return Raw{load8_at2(block + F::QS + 8 * (p % 2)), load_u16_nc(block), p};
    }
    static __device__ __forceinline__ void decode(const Raw &r, float (&v)[8]) {
        const uint2 b = bytes8(r.q);
        float q[8];
        bytes8_to_floats(r.p < 2 ? low_nibbles8(b) : high_nibbles8(b), 8.f, q);
        const float d = f16_bits_to_f32(r.d);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fmul_rn(q[i], d);
    }
};

template <>
struct Pieces<FormatQ4_1> {
    using F = FormatQ4_1;
    static constexpr unsigned ALIGN = 4;
    struct Raw {
        uint2 q;
        unsigned int dm, p;
    };
    static __device__ __forceinline__ Raw load(const unsigned char *w, size_t piece) {
        const unsigned char *block = w + piece / 4 * F::BLOCK_BYTES;
        const unsigned int p = piece % 4;
        return Raw{load8_at4(block + F::QS + 8 * (p % 2)), load_u32_nc(block), p};
    }
    static __device__ __forceinline__ void decode(const Raw &r, float (&v)[8]) {
        float q[8];
        bytes8_to_floats(r.p < 2 ? low_nibbles8(r.q) : high_nibbles8(r.q), 0.f, q);
        const float d = f16_bits_to_f32(r.dm & 0xFFFFu), m = f16_bits_to_f32(r.dm >> 16);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fadd_rn(__fmul_rn(q[i], d), m);
    }
};

// Q5_0 and Q5_1: value 8p + i takes bit i of the fifth-bit byte p.
__device__ __forceinline__ uint2 with_fifth_bits(uint2 nibbles, unsigned int high) {
    return make_uint2(nibbles.x | spread_bits(high, 0, 4), nibbles.y | spread_bits(high, 4, 4));
}

template <>
struct Pieces<FormatQ5_0> {
    using F = FormatQ5_0;
    static constexpr unsigned ALIGN = 2;
    struct Raw {
        Bytes8At2 q;
        unsigned int d, high, p;
    };
    static __device__ __forceinline__ Raw load(const unsigned char *w, size_t piece) {
        const unsigned char *block = w + piece / 4 * F::BLOCK_BYTES;
        const unsigned int p = piece % 4;
        return Raw{load8_at2(block + F::QS + 8 * (p % 2)), load_u16_nc(block), __ldg(block + F::QH + p), p};
    }
    static __device__ __forceinline__ void decode(const Raw &r, float (&v)[8]) {
        const uint2 b = bytes8(r.q);
        float q[8];
        bytes8_to_floats(with_fifth_bits(r.p < 2 ? low_nibbles8(b) : high_nibbles8(b), r.high), 16.f, q);
        const float d = f16_bits_to_f32(r.d);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fmul_rn(q[i], d);
    }
};

template <>
struct Pieces<FormatQ5_1> {
    using F = FormatQ5_1;
    static constexpr unsigned ALIGN = 8;
    struct Raw {
        uint2 q;
        unsigned int dm, high, p;
    };
    static __device__ __forceinline__ Raw load(const unsigned char *w, size_t piece) {
        const unsigned char *block = w + piece / 4 * F::BLOCK_BYTES;
        const unsigned int p = piece % 4;
        return Raw{load8_at8(block + F::QS + 8 * (p % 2)), load_u32_nc(block), __ldg(block + F::QH + p), p};
    }
    static __device__ __forceinline__ void decode(const Raw &r, float (&v)[8]) {
        float q[8];
        bytes8_to_floats(with_fifth_bits(r.p < 2 ? low_nibbles8(r.q) : high_nibbles8(r.q), r.high), 0.f, q);
        const float d = f16_bits_to_f32(r.dm & 0xFFFFu), m = f16_bits_to_f32(r.dm >> 16);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fadd_rn(__fmul_rn(q[i], d), m);
    }
};

// ---- 256-value super-blocks: a block is 32 pieces, one a lane of a warp ----

template <>
struct Pieces<FormatQ2_K> {
    using F = FormatQ2_K;
    static constexpr unsigned ALIGN = 4;
    struct Raw {
        uint2 q;
        unsigned int dd, s, p;
    };
    // Piece p is half p % 2 of group p / 2.
    static __device__ __forceinline__ Raw load(const unsigned char *w, size_t piece) {
        const unsigned char *block = w + piece / 32 * F::BLOCK_BYTES;
        const unsigned int p = piece % 32, g = p / 2;
        const unsigned char *q = block + F::QS + 32 * (g / 8) + 16 * (g % 2) + 8 * (p % 2);
        return Raw{load8_at4(q), load_u32_nc(block + F::D), __ldg(block + F::SCALES + g), p};
    }
    static __device__ __forceinline__ void decode(const Raw &r, float (&v)[8]) {
        const unsigned int shift = 2 * ((r.p / 2 % 8) / 2);
        float q[8];
        bytes8_to_floats(make_uint2((r.q.x >> shift) & 0x03030303u, (r.q.y >> shift) & 0x03030303u), 0.f, q);
        const float dl = __fmul_rn(f16_bits_to_f32(r.dd & 0xFFFFu), (float)(r.s & 0xFu));
        const float ml = __fmul_rn(f16_bits_to_f32(r.dd >> 16), (float)(r.s >> 4));
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fsub_rn(__fmul_rn(dl, q[i]), ml);
    }
};

template <>
struct Pieces<FormatQ3_K> {
    using F = FormatQ3_K;
    static constexpr unsigned ALIGN = 2;
    struct Raw {
        Bytes8At2 q, h;
        unsigned int d, lo, hi, p;
    };
    // Piece p is half p % 2 of group g = p / 2: bytes 16 (g % 2) + 8 (p % 2) of the quants and high bits.
    static __device__ __forceinline__ Raw load(const unsigned char *w, size_t piece) {
        const unsigned char *block = w + piece / 32 * F::BLOCK_BYTES;
        const unsigned int p = piece % 32, g = p / 2, byte = 16 * (g % 2) + 8 * (p % 2);
        return Raw{load8_at2(block + F::QS + 32 * (g / 8) + byte),
                   load8_at2(block + F::HMASK + byte),
                   load_u16_nc(block + F::D),
                   __ldg(block + F::SCALES + g % 8),
                   __ldg(block + F::SCALES + 8 + g % 4),
                   p};
    }
    static __device__ __forceinline__ void decode(const Raw &r, float (&v)[8]) {
        const unsigned int g = r.p / 2, n = g / 8, pair = (g % 8) / 2;
        const int scale = (int)(((r.lo >> (4 * (g / 8))) & 0xFu) | (((r.hi >> (2 * (g / 4))) & 3u) << 4)) - 32;
        const uint2 qs = bytes8(r.q), hm = bytes8(r.h);
        // 4 + q where the high bit is set, q where not: less 4 below.
        const unsigned int hb = 4 * n + pair;
        const uint2 b = make_uint2(((qs.x >> (2 * pair)) & 0x03030303u) | (((hm.x >> hb) & 0x01010101u) << 2),
                                   ((qs.y >> (2 * pair)) & 0x03030303u) | (((hm.y >> hb) & 0x01010101u) << 2));
        float q[8];
        bytes8_to_floats(b, 4.f, q);
        const float dl = __fmul_rn(f16_bits_to_f32(r.d), (float)scale);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fmul_rn(dl, q[i]);
    }
};

// Q4_K and Q5_K: the 16-byte head (d, dmin, the 12 scale bytes) is one load, the same for a warp's lanes.
template <>
struct Pieces<FormatQ4_K> {
    using F = FormatQ4_K;
    static constexpr unsigned ALIGN = 16;
    struct Raw {
        uint4 head;
        uint2 q;
        unsigned int p;
    };
    // Piece p is values 8 (p % 4).. of sub-block p / 4.
    static __device__ __forceinline__ Raw load(const unsigned char *w, size_t piece) {
        const unsigned char *block = w + piece / 32 * F::BLOCK_BYTES;
        const unsigned int p = piece % 32, s = p / 4;
        return Raw{__ldg(reinterpret_cast<const uint4 *>(block)), load8_at8(block + F::QS + 32 * (s / 2) + 8 * (p % 4)),
                   p};
    }
    static __device__ __forceinline__ void decode(const Raw &r, float (&v)[8]) {
        const unsigned int s = r.p / 4;
        unsigned int sc, m;
        scale_min_k4_words(r.head.y, r.head.z, r.head.w, s, sc, m);
        const float d1 = __fmul_rn(f16_bits_to_f32(r.head.x & 0xFFFFu), (float)sc);
        const float m1 = __fmul_rn(f16_bits_to_f32(r.head.x >> 16), (float)m);
        float q[8];
        bytes8_to_floats(s % 2 ? high_nibbles8(r.q) : low_nibbles8(r.q), 0.f, q);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fsub_rn(__fmul_rn(d1, q[i]), m1);
    }
};

template <>
struct Pieces<FormatQ5_K> {
    using F = FormatQ5_K;
    static constexpr unsigned ALIGN = 16;
    struct Raw {
        uint4 head;
        uint2 q, h;
        unsigned int p;
    };
    static __device__ __forceinline__ Raw load(const unsigned char *w, size_t piece) {
        const unsigned char *block = w + piece / 32 * F::BLOCK_BYTES;
        const unsigned int p = piece % 32, s = p / 4;
        return Raw{__ldg(reinterpret_cast<const uint4 *>(block)), load8_at8(block + F::QS + 32 * (s / 2) + 8 * (p % 4)),
                   load8_at8(block + F::QH + 8 * (p % 4)), p};
    }
    static __device__ __forceinline__ void decode(const Raw &r, float (&v)[8]) {
        const unsigned int s = r.p / 4;
        unsigned int sc, m;
        scale_min_k4_words(r.head.y, r.head.z, r.head.w, s, sc, m);
        const float d1 = __fmul_rn(f16_bits_to_f32(r.head.x & 0xFFFFu), (float)sc);
        const float m1 = __fmul_rn(f16_bits_to_f32(r.head.x >> 16), (float)m);
        const uint2 nib = s % 2 ? high_nibbles8(r.q) : low_nibbles8(r.q);
        const uint2 b =
            make_uint2(nib.x | (((r.h.x >> s) & 0x01010101u) << 4), nib.y | (((r.h.y >> s) & 0x01010101u) << 4));
        float q[8];
        bytes8_to_floats(b, 0.f, q);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fsub_rn(__fmul_rn(d1, q[i]), m1);
    }
};

template <>
struct Pieces<FormatQ6_K> {
    using F = FormatQ6_K;
    static constexpr unsigned ALIGN = 2;
    struct Raw {
        Bytes8At2 lo, hi;
        unsigned int d, scale, p;
    };
    // Piece p: half n = p / 16, 32-value group k = (p % 16) / 4, values l = 8 (p % 4).. of it.
    static __device__ __forceinline__ Raw load(const unsigned char *w, size_t piece) {
        const unsigned char *block = w + piece / 32 * F::BLOCK_BYTES;
        const unsigned int p = piece % 32, n = p / 16, k = (p % 16) / 4, l = 8 * (p % 4);
        return Raw{load8_at2(block + F::QL + 64 * n + 32 * (k % 2) + l), load8_at2(block + F::QH + 32 * n + l),
                   load_u16_nc(block + F::D), __ldg(block + F::SCALES + 8 * n + 2 * k + l / 16), p};
    }
    static __device__ __forceinline__ void decode(const Raw &r, float (&v)[8]) {
        const unsigned int k = (r.p % 16) / 4;
        const uint2 lo = bytes8(r.lo), hi = bytes8(r.hi);
        const uint2 nib = k < 2 ? low_nibbles8(lo) : high_nibbles8(lo);
        const uint2 b = make_uint2(nib.x | (((hi.x >> (2 * k)) & 0x03030303u) << 4),
                                   nib.y | (((hi.y >> (2 * k)) & 0x03030303u) << 4));
        float q[8];
        bytes8_to_floats(b, 32.f, q);
        const float dl = __fmul_rn(f16_bits_to_f32(r.d), (float)(signed char)r.scale);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fmul_rn(dl, q[i]);
    }
};

}  // namespace he
