// Decode products on tensor cores: y[t] = W x[t] for up to MMV_MAX_TOKENS tokens a launch, W read once
// for all of them, and every token's result the same bits whatever the other tokens are (batch
// invariance): mma.sync computes each output from its own row of A and column of B only, the K order is
// fixed, and how a matrix is split depends on its shape alone, never on the token count.
//
// Two kinds of product share the layout. Half rows: each f32 activation enters as two halves, hi = rn(x)
// and lo = rn(x - hi), each multiplied and accumulated in f32 (BF16: about 16 significant bits of x, within
// f32-activation rounding of the CPU's product, where bf16 activations alone would cost ~1e-3; F16: 22
// bits of x scaled per 256 columns, see MmaF16). Block
// formats: integer products (mma s8/u8 -> s32, exact). A token's activations are quantized per 256
// columns to v = rn(x * 32639 / max|x|), a 16-bit integer sent as two int8 halves (v = 256 hi + lo) in
// two columns of B; the weights enter as their quants. Each block's integer sum is exact, so only the
// float epilogue (the block scales, then the activation scale per 256 columns, in column order) rounds:
// about 2e-5 relative against the CPU's f32 product, and far fewer instructions a weight than unpacking
// quants into bf16.
//
// Layout: a block of 8 warps takes 128 weight rows (each warp rows g and g + 8 of its 16 as mma's A; a
// GLU launch puts 8 gate rows and the same 8 up rows in a warp) and one of `splits` column ranges. The
// activations of a chunk of columns are staged once per block in shared memory (half kernels past 8
// tokens: converted once a product by mmv_prep_kernel and copied a chunk ahead); each lane takes its
// weight rows either straight from memory into registers (a column group ahead of the arithmetic) or
// from its warp's slots in shared memory (WeightStage: copied with cp.async, groups ahead). A lane
// (g, t) holds, per 32-column step, 8 of the step's columns of its two rows (a reader's choice, the
// same for B). With splits > 1 each block writes its partial sums, and the last block of a row range to
// arrive (an atomic counter) adds them in split order and applies the epilogue.
//
// This header: the cut of a matrix (its constants and mmv_shape), the lane readers of every format
// and the integer mma; kernels/mmv.cuh adds what the kernels share, one kernel a .cu file (mmv_half,
// mmv_int with its body in mmv_int.cuh, which kernels/moe_mmv.cu's experts' kernel shares, mmv_tile),
// and kernels/mmv.cu the C entry points.
#pragma once
#include "formats.cuh"

namespace {


constexpr int MMV_WARPS = 8;
constexpr int MMV_THREADS = MMV_WARPS * 32;
constexpr unsigned MMV_BLOCK_ROWS = MMV_WARPS * 16;
constexpr unsigned MMV_KC = 256;  // the unit of column ranges and staged chunks
constexpr unsigned MMV_MAX_TOKENS = 64;
constexpr unsigned MMVQ_MAX_TOKENS = 32;  // the integer kernel's widest tile set (hostembed_tuning's mmvq_tokens)
// The integer kernel's tokens a launch: 16 tokens at two blocks a multiprocessor beat 32 at one (Q4_K 64
// tokens on 4096 x 14336: 236 -> 165 us; BENCHMARKS.md).
constexpr unsigned MMVQ_LAUNCH_TOKENS = 16;
// Tuning knobs, fixed at build time, for benchmark builds (HOSTEMBED_KERNEL_DEFINES); the defaults are the
// measured best (BENCHMARKS.md), and src/gpu/scratch.rs mirrors the default MMV_TARGET.
#ifndef MMV_TARGET
#define MMV_TARGET 256
#endif
#ifndef MMV_SMALL_MIN_BLOCKS
#define MMV_SMALL_MIN_BLOCKS 2
#endif
#ifndef MMVQ_MID_MIN_BLOCKS  // the integer kernel's blocks a multiprocessor at 9 to 16 tokens
#define MMVQ_MID_MIN_BLOCKS 2
#endif
#ifndef MMV_BF16_UNROLL
#define MMV_BF16_UNROLL 4
#endif
#ifndef MMV_HALF_TWO_CHAINS  // 1: the half kernel's lo products in a second accumulator chain (kernels/mmv_half.cu)
#define MMV_HALF_TWO_CHAINS 0
#endif
// The kernels only a tuning setting asks for (mmv_stage staging a format's weights where it streams them by
// default, mmvq_tokens past MMVQ_LAUNCH_TOKENS): a third of this file's instantiations and of its build
// time, so built only with -DMMV_TUNING_KERNELS=1; without, those settings give the default kernels.
#ifndef MMV_TUNING_KERNELS
#define MMV_TUNING_KERNELS 0
#endif
constexpr unsigned MMV_TARGET_BLOCKS = MMV_TARGET;  // blocks a launch aims at (two a multiprocessor: 264)
constexpr unsigned MMV_MAX_ROW_BLOCKS_SPLIT = MMV_TARGET_BLOCKS;  // a split product has fewer row blocks
constexpr unsigned MMV_MAX_SPLITS = 16;  // column ranges at most (the last block adds them unrolled)
// How a matrix is cut: its row blocks, and its columns in `splits` ranges of `kr` (a multiple of MMV_KC).
struct MmvShape {
    unsigned int row_blocks, splits, kr;
};

// `whole_waves` (every product's launch) rounds the splits down, so that a matrix of more than half the
// target's row blocks stays one wave (14,336-row GLU: 224 blocks, not 448 in 1.7 waves; the F16 product
// of 14336 x 4096 at 64 tokens 114.8 -> 99.8 us, BENCHMARKS.md); the workspace and the staged
// activations' offset are sized by the rounding up, which never gives fewer splits.
__host__ __device__ inline MmvShape mmv_shape(unsigned int rows, unsigned int cols, bool glu, bool whole_waves = false) {
    const unsigned int out_rows = glu ? MMV_BLOCK_ROWS / 2 : MMV_BLOCK_ROWS;
    MmvShape s;
    s.row_blocks = (rows + out_rows - 1) / out_rows;
    unsigned int splits = whole_waves ? max(1u, MMV_TARGET_BLOCKS / s.row_blocks)
                                      : (MMV_TARGET_BLOCKS + s.row_blocks - 1) / s.row_blocks;
    const unsigned int chunks = (cols + MMV_KC - 1) / MMV_KC;
    splits = splits < chunks ? splits : chunks;
    splits = splits < MMV_MAX_SPLITS ? splits : MMV_MAX_SPLITS;
    if (s.row_blocks > MMV_MAX_ROW_BLOCKS_SPLIT || splits == 0) splits = 1;
    s.kr = (chunks + splits - 1) / splits * MMV_KC;
    s.splits = (cols + s.kr - 1) / s.kr;
    return s;
}

// ---- small helpers ----

// Weight loads: from global memory through the read-only path, or (SM) from a warp's slots in shared
// memory (the staged kernels), where narrow and 2-byte aligned reads cost no more than wide ones.
template <bool SM>
__device__ __forceinline__ unsigned int ld16(const unsigned char *p) {
    if constexpr (SM) return *reinterpret_cast<const unsigned short *>(p);
    else return __ldg(reinterpret_cast<const unsigned short *>(p));
}
template <bool SM>
__device__ __forceinline__ unsigned int ld32(const unsigned char *p) {
    if constexpr (SM) return *reinterpret_cast<const unsigned int *>(p);
    else return __ldg(reinterpret_cast<const unsigned int *>(p));
}
template <bool SM>
__device__ __forceinline__ uint2 ld64(const unsigned char *p) {
    if constexpr (SM) return *reinterpret_cast<const uint2 *>(p);
    else return __ldg(reinterpret_cast<const uint2 *>(p));
}
template <bool SM>
__device__ __forceinline__ uint4 ld128(const unsigned char *p) {
    if constexpr (SM) return *reinterpret_cast<const uint4 *>(p);
    else return __ldg(reinterpret_cast<const uint4 *>(p));
}
__device__ __forceinline__ unsigned int halves(unsigned int lo, unsigned int hi) { return __byte_perm(lo, hi, 0x5410); }

// ---- BF16 rows: the hi/lo product ----

// A 32-column step is one 16-byte load of columns 8t .. 8t + 7 (k-step 0: 8t..8t+3): f[k][0] holds the
// k-step's columns 0 and 1 of the lane's group, f[k][1] columns 2 and 3.
struct MmaBF16 {
    using Op = he::Bf16Op;
    static constexpr bool SCALED = false;  // activations staged as they are (see MmaF16)
    static constexpr unsigned STEP = 32, TILE_STEPS = 1, KSTEPS = 2, UNROLL = MMV_BF16_UNROLL, SUNROLL = 2, ALIGN = 16;
    static constexpr unsigned STAGE_TOKENS = 1;  // staged: 1 token 78-97% of the copy bandwidth (from 72-86%), 2: 68% (73)
    static constexpr unsigned BYTES = 2, BLOCK_COLS = 1;
    static constexpr bool INT = false;
    // A quarter warp reads two rows' 64 bytes: rows 16 words apart in the banks.
    static constexpr bool bank_ok(unsigned words) { return words % 32 == 16; }
    struct Raw {
        uint4 q;
    };
    static __device__ __forceinline__ unsigned int group(unsigned int t, unsigned int k) { return 8 * t + 4 * k; }
    template <bool SM>
    static __device__ __forceinline__ void fetch(Raw &r, const unsigned char *row, unsigned int col, unsigned int t) {
        const unsigned char *p = row + 2 * ((size_t)col + 8 * t);
        if constexpr (SM) r.q = *reinterpret_cast<const uint4 *>(p);
        else r.q = he::load_stream16(p);
    }
    static __device__ __forceinline__ void frag(const Raw &r, unsigned int (&f)[KSTEPS][2]) {
        f[0][0] = r.q.x, f[0][1] = r.q.y, f[1][0] = r.q.z, f[1][1] = r.q.w;
    }
};

// F16 rows: the weights enter f16 tensor cores as they are, the activations as f16 hi/lo pairs of x 2^e,
// e per token and 256-column group putting the group's max|x| in [2^14, 2^15): 22 significant bits for
// the large values and no f16 overflow. Each group's products accumulate scaled, between multiplications of
// the accumulators by 2^e and 2^-e (powers of two: exact, and every rounding between them is the
// unscaled one's); the order stays fixed by column, so a token's bits depend on its own values alone.
struct MmaF16 : MmaBF16 {
    using Op = he::F16Op;
    static constexpr bool SCALED = true;
    static constexpr unsigned STAGE_TOKENS = 0;  // streamed: 8B decode 158.8 tok/s, staged at 1 token 154.0
};

// ---- block formats: the integer product's lane readers ----
// A reader gives, for each STEP-column step (32: one m16n8k32 product, 16: one m16n8k16) of a TILE of
// TILE_STEPS steps, the lane's A words of one weight row: w[h] holds the 4 quants (bytes) of k-half h
// (STEP 32: w[0] columns 8t..8t+3 of the step, w[1] 8t+4..8t+7; STEP 16: w[0] columns 4t..4t+3), and the
// step's scale. SUPER readers (k-quants) give an integer sub-scale `isc` (and min `imin`) a step and the
// tile's float scales (`tile`: d and -dmin); block readers a float scale `fsc` a step (and, HAS_MIN, a
// float minimum `fmin`, times the block's sum of activation integers). `fetch` only
// loads (raw bits, nothing converted, so the loads stay in flight until the step that uses them).

// Q8_0: a step is one 34-byte block (2-byte aligned), lane t takes quants 8t .. 8t + 7 as they are.
struct QQ8_0 {
    static constexpr unsigned STEP = 32, TILE_STEPS = 1, UNROLL = 8, SUNROLL = 4, BYTES = 34, BLOCK_COLS = 32, ALIGN = 2;
    static constexpr unsigned STAGE_TOKENS = MMVQ_MAX_TOKENS;  // staged: 51% (from 27%)
    static constexpr bool INT = true, SIGNED = true, SUPER = false, HAS_MIN = false;
    // Lanes read words 2t apart in 8 rows: two-way conflicts at best, unless rows share banks.
    static constexpr bool bank_ok(unsigned words) { return words % 8 == 4 || words % 16 == 8; }
    struct Raw {
        unsigned int q[4], d;  // 16-bit halves
    };
    template <bool SM>
    static __device__ __forceinline__ void fetch(Raw &r, const unsigned char *row, unsigned int col, unsigned int t) {
        const unsigned char *b = row + (size_t)(col / 32) * BYTES;
#pragma unroll
        for (int i = 0; i < 4; i++) r.q[i] = ld16<SM>(b + 2 + 8 * t + 2 * i);
        r.d = ld16<SM>(b);
    }
    static __device__ __forceinline__ void a(const Raw &r, int, unsigned int (&w)[2], unsigned int) {
        w[0] = halves(r.q[0], r.q[1]), w[1] = halves(r.q[2], r.q[3]);
    }
    static __device__ __forceinline__ float fsc(const Raw &r, int) { return he::f16_bits_to_f32(r.d); }
};

// Signed bytes q - bias from bytes q < 128 (no borrow crosses a byte: each is lifted by 0x80 first).
__device__ __forceinline__ unsigned int sub_bytes(unsigned int q, unsigned int bias4) {
    return ((q | 0x80808080u) - bias4) ^ 0x80808080u;
}

// Q4_0: a step is one 18-byte block; lane t takes values 8t .. 8t + 7: the low (t < 2) or high nibbles of
// bytes 8(t % 2) .. + 7, less 8.
struct QQ4_0 {
    static constexpr unsigned STEP = 32, TILE_STEPS = 1, UNROLL = 8, SUNROLL = 8, BYTES = 18, BLOCK_COLS = 32, ALIGN = 2;
    static constexpr unsigned STAGE_TOKENS = MMVQ_MAX_TOKENS;  // staged: 29% (from 15%)
    static constexpr bool INT = true, SIGNED = true, SUPER = false, HAS_MIN = false;
    static constexpr bool bank_ok(unsigned words) { return words % 8 == 4 || words % 16 == 8; }
    struct Raw {
        unsigned int q[4], d;
    };
    template <bool SM>
    static __device__ __forceinline__ void fetch(Raw &r, const unsigned char *row, unsigned int col, unsigned int t) {
        const unsigned char *b = row + (size_t)(col / 32) * BYTES;
#pragma unroll
        for (int i = 0; i < 4; i++) r.q[i] = ld16<SM>(b + 2 + 8 * (t % 2) + 2 * i);
        r.d = ld16<SM>(b);
    }
    static __device__ __forceinline__ void a(const Raw &r, int, unsigned int (&w)[2], unsigned int t) {
        const unsigned int shift = t < 2 ? 0 : 4;
        w[0] = sub_bytes((halves(r.q[0], r.q[1]) >> shift) & 0x0F0F0F0Fu, 0x08080808u);
        w[1] = sub_bytes((halves(r.q[2], r.q[3]) >> shift) & 0x0F0F0F0Fu, 0x08080808u);
    }
    static __device__ __forceinline__ float fsc(const Raw &r, int) { return he::f16_bits_to_f32(r.d); }
};

// Q4_1: a step is one 20-byte block (4-byte aligned): Q4_0's nibbles, unsigned, and a minimum m per block
// (fmin), which enters as m times the block's sum of activation integers.
struct QQ4_1 {
    static constexpr unsigned STEP = 32, TILE_STEPS = 1, UNROLL = 8, SUNROLL = 8, BYTES = 20, BLOCK_COLS = 32, ALIGN = 4;
    static constexpr unsigned STAGE_TOKENS = MMVQ_MAX_TOKENS;
    static constexpr bool INT = true, SIGNED = false, SUPER = false, HAS_MIN = true;
    // Lanes read words 1 + 2(t % 2) (+ 1) of 8 rows: rows an odd multiple of 4 words apart.
    static constexpr bool bank_ok(unsigned words) { return words % 8 == 4; }
    struct Raw {
        unsigned int q[2], dm;
    };
    template <bool SM>
    static __device__ __forceinline__ void fetch(Raw &r, const unsigned char *row, unsigned int col, unsigned int t) {
        const unsigned char *b = row + (size_t)(col / 32) * BYTES;
        r.q[0] = ld32<SM>(b + 4 + 8 * (t % 2));
        r.q[1] = ld32<SM>(b + 8 + 8 * (t % 2));
        r.dm = ld32<SM>(b);
    }
    static __device__ __forceinline__ void a(const Raw &r, int, unsigned int (&w)[2], unsigned int t) {
        const unsigned int shift = t < 2 ? 0 : 4;
        w[0] = (r.q[0] >> shift) & 0x0F0F0F0Fu, w[1] = (r.q[1] >> shift) & 0x0F0F0F0Fu;
    }
    static __device__ __forceinline__ float fsc(const Raw &r, int) { return he::f16_bits_to_f32(r.dm & 0xFFFFu); }
    static __device__ __forceinline__ float fmin(const Raw &r, int) { return he::f16_bits_to_f32(r.dm >> 16); }
};

// The fifth bits of values 4i .. 4i + 3 (bits 0..3 of `bits`) as bit 4 of four bytes.
__device__ __forceinline__ unsigned int fifth_bits(unsigned int bits) { return ((bits & 0xFu) * 0x00204081u & 0x01010101u) << 4; }

// Q5_0: a step is one 22-byte block (2-byte aligned): Q4_0's nibbles with a fifth bit each (bit j of the
// u32 at 2 for value j: byte t for lane t's values 8t .. 8t + 7), less 16.
struct QQ5_0 {
    // Four tiles a step of the loop: eight spill (a tile holds 7 registers a row).
    static constexpr unsigned STEP = 32, TILE_STEPS = 1, UNROLL = 4, SUNROLL = 4, BYTES = 22, BLOCK_COLS = 32, ALIGN = 2;
    static constexpr unsigned STAGE_TOKENS = MMVQ_MAX_TOKENS;
    static constexpr bool INT = true, SIGNED = true, SUPER = false, HAS_MIN = false;
    static constexpr bool bank_ok(unsigned words) { return words % 8 == 4 || words % 16 == 8; }
    struct Raw {
        unsigned int q[4], h[2], d;  // 16-bit halves
    };
    template <bool SM>
    static __device__ __forceinline__ void fetch(Raw &r, const unsigned char *row, unsigned int col, unsigned int t) {
        const unsigned char *b = row + (size_t)(col / 32) * BYTES;
#pragma unroll
        for (int i = 0; i < 4; i++) r.q[i] = ld16<SM>(b + 6 + 8 * (t % 2) + 2 * i);
        r.h[0] = ld16<SM>(b + 2), r.h[1] = ld16<SM>(b + 4);
        r.d = ld16<SM>(b);
    }
    static __device__ __forceinline__ void a(const Raw &r, int, unsigned int (&w)[2], unsigned int t) {
        const unsigned int shift = t < 2 ? 0 : 4, hb = halves(r.h[0], r.h[1]) >> (8 * t);
        w[0] = sub_bytes(((halves(r.q[0], r.q[1]) >> shift) & 0x0F0F0F0Fu) | fifth_bits(hb), 0x10101010u);
        w[1] = sub_bytes(((halves(r.q[2], r.q[3]) >> shift) & 0x0F0F0F0Fu) | fifth_bits(hb >> 4), 0x10101010u);
    }
    static __device__ __forceinline__ float fsc(const Raw &r, int) { return he::f16_bits_to_f32(r.d); }
};

// Q5_1: a step is one 24-byte block (4-byte aligned): d, m, the fifth bits at 4, the nibbles at 8;
// unsigned, with Q4_1's minimum.
struct QQ5_1 {
    static constexpr unsigned STEP = 32, TILE_STEPS = 1, UNROLL = 8, SUNROLL = 4, BYTES = 24, BLOCK_COLS = 32, ALIGN = 4;
    static constexpr unsigned STAGE_TOKENS = MMVQ_MAX_TOKENS;
    static constexpr bool INT = true, SIGNED = false, SUPER = false, HAS_MIN = true;
    static constexpr bool bank_ok(unsigned words) { return words % 8 == 4; }
    struct Raw {
        unsigned int q[2], h, dm;
    };
    template <bool SM>
    static __device__ __forceinline__ void fetch(Raw &r, const unsigned char *row, unsigned int col, unsigned int t) {
        const unsigned char *b = row + (size_t)(col / 32) * BYTES;
        r.q[0] = ld32<SM>(b + 8 + 8 * (t % 2));
        r.q[1] = ld32<SM>(b + 12 + 8 * (t % 2));
        r.h = ld32<SM>(b + 4);
        r.dm = ld32<SM>(b);
    }
    static __device__ __forceinline__ void a(const Raw &r, int, unsigned int (&w)[2], unsigned int t) {
        const unsigned int shift = t < 2 ? 0 : 4, hb = r.h >> (8 * t);
        w[0] = ((r.q[0] >> shift) & 0x0F0F0F0Fu) | fifth_bits(hb);
        w[1] = ((r.q[1] >> shift) & 0x0F0F0F0Fu) | fifth_bits(hb >> 4);
    }
    static __device__ __forceinline__ float fsc(const Raw &r, int) { return he::f16_bits_to_f32(r.dm & 0xFFFFu); }
    static __device__ __forceinline__ float fmin(const Raw &r, int) { return he::f16_bits_to_f32(r.dm >> 16); }
};

// The 8 six-bit sub-scales and mins of a Q4_K / Q5_K header (d, dmin, 12 bytes) as bytes: sc[0] holds
// those of sub-blocks 0..3, sc[1] 4..7.
struct KScales {
    static __device__ __forceinline__ void packed(const uint4 &h, unsigned int (&sc)[2], unsigned int (&m)[2]) {
        sc[0] = h.y & 0x3F3F3F3Fu;
        m[0] = h.z & 0x3F3F3F3Fu;
        sc[1] = (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u);
        m[1] = ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u);
    }
    static __device__ __forceinline__ int isc_of(const uint4 &h, int s) {
        unsigned int sc[2], m[2];
        packed(h, sc, m);
        return (int)((sc[s / 4] >> (8 * (s % 4))) & 0xFFu);
    }
    static __device__ __forceinline__ int imin_of(const uint4 &h, int s) {
        unsigned int sc[2], m[2];
        packed(h, sc, m);
        return (int)((m[s / 4] >> (8 * (s % 4))) & 0xFFu);
    }
    static __device__ __forceinline__ void tile_of(const uint4 &h, float &d, float &neg_dmin) {
        d = he::f16_bits_to_f32(h.x & 0xFFFFu);
        neg_dmin = -he::f16_bits_to_f32(h.x >> 16);
    }
};

// Q4_K: a tile is a 144-byte super-block (8 steps: its sub-blocks); lane t takes values 8t .. 8t + 7 of
// each sub-block: bytes 8t .. + 7 of the 32 at 32(s / 2), low nibbles for even s.
struct QQ4_K : KScales {
    static constexpr unsigned STEP = 32, TILE_STEPS = 8, UNROLL = 2, SUNROLL = 1, BYTES = 144, BLOCK_COLS = 256, QS = 16,
                              ALIGN = 16;
    static constexpr unsigned STAGE_TOKENS = 0;  // streamed: 44% of the copy bandwidth, staged 37%
    static constexpr bool INT = true, SIGNED = false, SUPER = true, HAS_MIN = true;
    // A half warp's 8-byte reads cover four rows' 8 words each: rows 8 words apart.
    static constexpr bool bank_ok(unsigned words) { return words % 16 == 8; }
    struct Raw {
        uint2 q[4];
        uint4 h;
    };
    template <bool SM>
    static __device__ __forceinline__ void fetch(Raw &r, const unsigned char *row, unsigned int col, unsigned int t) {
        const unsigned char *b = row + (size_t)(col / 256) * BYTES;
#pragma unroll
        for (int p = 0; p < 4; p++) r.q[p] = ld64<SM>(b + QS + 32 * p + 8 * t);
        r.h = ld128<SM>(b);
    }
    static __device__ __forceinline__ void a(const Raw &r, int s, unsigned int (&w)[2], unsigned int) {
        const unsigned int shift = s % 2 ? 4 : 0;
        w[0] = (r.q[s / 2].x >> shift) & 0x0F0F0F0Fu;
        w[1] = (r.q[s / 2].y >> shift) & 0x0F0F0F0Fu;
    }
    static __device__ __forceinline__ int isc(const Raw &r, int s) { return isc_of(r.h, s); }
    static __device__ __forceinline__ int imin(const Raw &r, int s) { return imin_of(r.h, s); }
    static __device__ __forceinline__ void tile(const Raw &r, float &d, float &neg_dmin) { tile_of(r.h, d, neg_dmin); }
};

// Q5_K: Q4_K's layout with 32 bytes of fifth bits at 16 (bit s of byte l for value l of sub-block s).
struct QQ5_K : KScales {
    static constexpr unsigned STEP = 32, TILE_STEPS = 8, UNROLL = 2, SUNROLL = 1, BYTES = 176, BLOCK_COLS = 256, QH = 16,
                              QS = 48, ALIGN = 16;
    static constexpr unsigned STAGE_TOKENS = 0;  // streamed: 46%, staged 39%
    static constexpr bool INT = true, SIGNED = false, SUPER = true, HAS_MIN = true;
    static constexpr bool bank_ok(unsigned words) { return words % 8 == 4 || words % 16 == 8; }
    struct Raw {
        uint2 q[4];
        uint2 hb;
        uint4 h;
    };
    template <bool SM>
    static __device__ __forceinline__ void fetch(Raw &r, const unsigned char *row, unsigned int col, unsigned int t) {
        const unsigned char *b = row + (size_t)(col / 256) * BYTES;
#pragma unroll
        for (int p = 0; p < 4; p++) r.q[p] = ld64<SM>(b + QS + 32 * p + 8 * t);
        r.hb = ld64<SM>(b + QH + 8 * t);
        r.h = ld128<SM>(b);
    }
    static __device__ __forceinline__ void a(const Raw &r, int s, unsigned int (&w)[2], unsigned int) {
        const unsigned int shift = s % 2 ? 4 : 0;
        w[0] = ((r.q[s / 2].x >> shift) & 0x0F0F0F0Fu) | (((r.hb.x >> s) & 0x01010101u) << 4);
        w[1] = ((r.q[s / 2].y >> shift) & 0x0F0F0F0Fu) | (((r.hb.y >> s) & 0x01010101u) << 4);
    }
    static __device__ __forceinline__ int isc(const Raw &r, int s) { return isc_of(r.h, s); }
    static __device__ __forceinline__ int imin(const Raw &r, int s) { return imin_of(r.h, s); }
    static __device__ __forceinline__ void tile(const Raw &r, float &d, float &neg_dmin) { tile_of(r.h, d, neg_dmin); }
};

// Q6_K: a tile is half a 210-byte super-block (2-byte aligned): half n of its 256 values, 8 steps of 16
// columns (each its own int8 scale); lane t takes values 4t .. 4t + 3 of each: in quarter k, columns
// l = 16(s % 2) + 4t .. + 3, low nibbles (k < 2) or high of ql[64n + 32(k % 2) + l], bits 2k of
// qh[32n + l], less 32.
struct QQ6_K {
    static constexpr unsigned STEP = 16, TILE_STEPS = 8, UNROLL = 2, SUNROLL = 2, BYTES = 210, BLOCK_COLS = 256, ALIGN = 2;
    static constexpr unsigned STAGE_TOKENS = MMVQ_MAX_TOKENS;  // staged: 42% (from 34%), the head 60% (46%)
    static constexpr unsigned QL = 0, QH = 128, SCALES = 192, D = 208;
    static constexpr bool INT = true, SIGNED = true, SUPER = true, HAS_MIN = false;
    struct Raw {
        unsigned int ql[2][2][2];  // [k % 2][l half][16-bit half]
        unsigned int qh[2][2];     // [l half][16-bit half]
        unsigned int sc[4];        // the half's 8 int8 scales, 16 bits at a time
        unsigned int d;
    };
    // Lanes read 4 consecutive words in 8 rows: rows an odd multiple of 4 words apart.
    static constexpr bool bank_ok(unsigned words) { return words % 8 == 4; }
    template <bool SM>
    static __device__ __forceinline__ void fetch(Raw &r, const unsigned char *row, unsigned int col, unsigned int t) {
        const unsigned char *b = row + (size_t)(col / 256) * BYTES;
        const unsigned int n = (col / 128) % 2;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const unsigned int l = 16 * h + 4 * t;
#pragma unroll
            for (int e = 0; e < 2; e++) {
                r.ql[0][h][e] = ld16<SM>(b + QL + 64 * n + l + 2 * e);
                r.ql[1][h][e] = ld16<SM>(b + QL + 64 * n + 32 + l + 2 * e);
                r.qh[h][e] = ld16<SM>(b + QH + 32 * n + l + 2 * e);
            }
        }
#pragma unroll
        for (int i = 0; i < 4; i++) r.sc[i] = ld16<SM>(b + SCALES + 8 * n + 2 * i);
        r.d = ld16<SM>(b + D);
    }
    // Step s covers values 16s .. 16s + 15 of the half: quarter k = s / 2, l half s % 2, scale s.
    static __device__ __forceinline__ void a(const Raw &r, int s, unsigned int (&w)[1], unsigned int) {
        const int k = s / 2, h = s % 2;
        const unsigned int q = halves(r.ql[k % 2][h][0], r.ql[k % 2][h][1]);
        const unsigned int low = k < 2 ? q & 0x0F0F0F0Fu : (q >> 4) & 0x0F0F0F0Fu;
        const unsigned int qh = halves(r.qh[h][0], r.qh[h][1]);
        w[0] = sub_bytes(low | (((qh >> (2 * k)) & 0x03030303u) << 4), 0x20202020u);
    }
    static __device__ __forceinline__ int isc(const Raw &r, int s) {
        return (int)(signed char)((r.sc[s / 2] >> (8 * (s % 2))) & 0xFFu);
    }
    static __device__ __forceinline__ void tile(const Raw &r, float &d, float &neg_dmin) {
        d = he::f16_bits_to_f32(r.d);
        neg_dmin = 0.f;
    }
};

// Q2_K: a tile is half an 84-byte super-block (4-byte aligned): half n of its 256 values, 8 steps of 16
// columns, step s the 2-bit quants at bits 2(s / 2) of qs[32n + 16(s % 2) + l] with sub-block 8n + s's
// 4-bit scale (low nibble) and min (high); lane t takes l = 4t .. 4t + 3. value = d sc q - dmin m.
struct QQ2_K {
    static constexpr unsigned STEP = 16, TILE_STEPS = 8, UNROLL = 2, SUNROLL = 2, BYTES = 84, BLOCK_COLS = 256, ALIGN = 4;
    static constexpr unsigned STAGE_TOKENS = MMVQ_MAX_TOKENS;
    static constexpr unsigned SCALES = 0, QS = 16, D = 80;
    static constexpr bool INT = true, SIGNED = false, SUPER = true, HAS_MIN = true;
    static constexpr bool bank_ok(unsigned words) { return words % 8 == 4; }
    struct Raw {
        unsigned int q[2], sc[2], dm;  // q[l half], the half's 8 scale bytes, d and dmin
    };
    template <bool SM>
    static __device__ __forceinline__ void fetch(Raw &r, const unsigned char *row, unsigned int col, unsigned int t) {
        const unsigned char *b = row + (size_t)(col / 256) * BYTES;
        const unsigned int n = (col / 128) % 2;
        r.q[0] = ld32<SM>(b + QS + 32 * n + 4 * t);
        r.q[1] = ld32<SM>(b + QS + 32 * n + 16 + 4 * t);
        r.sc[0] = ld32<SM>(b + SCALES + 8 * n), r.sc[1] = ld32<SM>(b + SCALES + 8 * n + 4);
        r.dm = ld32<SM>(b + D);
    }
    static __device__ __forceinline__ void a(const Raw &r, int s, unsigned int (&w)[1], unsigned int) {
        w[0] = (r.q[s % 2] >> (2 * (s / 2))) & 0x03030303u;
    }
    static __device__ __forceinline__ int isc(const Raw &r, int s) { return (int)((r.sc[s / 4] >> (8 * (s % 4))) & 0xFu); }
    static __device__ __forceinline__ int imin(const Raw &r, int s) {
        return (int)((r.sc[s / 4] >> (8 * (s % 4) + 4)) & 0xFu);
    }
    static __device__ __forceinline__ void tile(const Raw &r, float &d, float &neg_dmin) {
        d = he::f16_bits_to_f32(r.dm & 0xFFFFu);
        neg_dmin = -he::f16_bits_to_f32(r.dm >> 16);
    }
};

// Q3_K: a tile is half a 110-byte super-block (2-byte aligned), stepped as Q2_K: the 2-bit quants of qs,
// a third bit from hmask[16(s % 2) + l] (bit 4n + s / 2; clear means less 4), and sub-block 8n + s's
// 6-bit scale less 32 (low nibble of scale byte s, shifted 4n; high two bits from byte 8 + s % 4).
struct QQ3_K {
    static constexpr unsigned STEP = 16, TILE_STEPS = 8, UNROLL = 2, SUNROLL = 2, BYTES = 110, BLOCK_COLS = 256, ALIGN = 2;
    static constexpr unsigned STAGE_TOKENS = MMVQ_MAX_TOKENS;
    static constexpr unsigned HM = 0, QS = 32, SCALES = 96, D = 108;
    static constexpr bool INT = true, SIGNED = true, SUPER = true, HAS_MIN = false;
    static constexpr bool bank_ok(unsigned words) { return words % 8 == 4; }
    struct Raw {
        unsigned int q[2][2], hm[2][2];  // [l half][16-bit half]
        unsigned int sc[6], d;           // the 12 scale bytes, 16 bits at a time
        unsigned int n;                  // which half of the super-block
    };
    template <bool SM>
    static __device__ __forceinline__ void fetch(Raw &r, const unsigned char *row, unsigned int col, unsigned int t) {
        const unsigned char *b = row + (size_t)(col / 256) * BYTES;
        r.n = (col / 128) % 2;
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                r.q[h][e] = ld16<SM>(b + QS + 32 * r.n + 16 * h + 4 * t + 2 * e);
                r.hm[h][e] = ld16<SM>(b + HM + 16 * h + 4 * t + 2 * e);
            }
#pragma unroll
        for (int i = 0; i < 6; i++) r.sc[i] = ld16<SM>(b + SCALES + 2 * i);
        r.d = ld16<SM>(b + D);
    }
    static __device__ __forceinline__ void a(const Raw &r, int s, unsigned int (&w)[1], unsigned int) {
        const int j = s / 2, h = s % 2;
        const unsigned int q = (halves(r.q[h][0], r.q[h][1]) >> (2 * j)) & 0x03030303u;
        const unsigned int hb = (halves(r.hm[h][0], r.hm[h][1]) >> (4 * r.n + j)) & 0x01010101u;
        w[0] = sub_bytes(q | (hb << 2), 0x04040404u);
    }
    static __device__ __forceinline__ unsigned int scale_byte(const Raw &r, int i) { return (r.sc[i / 2] >> (8 * (i % 2))) & 0xFFu; }
    static __device__ __forceinline__ int isc(const Raw &r, int s) {
        const unsigned int low = (scale_byte(r, s) >> (4 * r.n)) & 0xFu;
        const unsigned int high = (scale_byte(r, 8 + s % 4) >> (2 * (2 * r.n + s / 4))) & 0x3u;
        return (int)(low | high << 4) - 32;
    }
    static __device__ __forceinline__ void tile(const Raw &r, float &d, float &neg_dmin) {
        d = he::f16_bits_to_f32(r.d);
        neg_dmin = 0.f;
    }
};

// Calls fn(Reader{}) for the formats that have a lane reader; false for the others.
template <typename Fn>
bool with_reader(int dtype, Fn &&fn) {
    switch (dtype) {
    case HE_DTYPE_BF16: fn(MmaBF16{}); return true;
    case HE_DTYPE_F16: fn(MmaF16{}); return true;
    case HE_DTYPE_Q8_0: fn(QQ8_0{}); return true;
    case HE_DTYPE_Q4_0: fn(QQ4_0{}); return true;
    case HE_DTYPE_Q4_1: fn(QQ4_1{}); return true;
    case HE_DTYPE_Q5_0: fn(QQ5_0{}); return true;
    case HE_DTYPE_Q5_1: fn(QQ5_1{}); return true;
    case HE_DTYPE_Q2_K: fn(QQ2_K{}); return true;
    case HE_DTYPE_Q3_K: fn(QQ3_K{}); return true;
    case HE_DTYPE_Q4_K: fn(QQ4_K{}); return true;
    case HE_DTYPE_Q5_K: fn(QQ5_K{}); return true;
    case HE_DTYPE_Q6_K: fn(QQ6_K{}); return true;
    default: return false;
    }
}

// d = A B (+ c in every element) for int8 A (weights: signed, or unsigned quants) and signed int8 B (the
// activation halves).
template <bool SIGNED>
__device__ __forceinline__ void mma_k32(int (&d)[4], unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3,
                                        unsigned int b0, unsigned int b1, int c = 0) {
    if constexpr (SIGNED)
        asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
            : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(c));
    else
        asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
            : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(c));
}
template <bool SIGNED>
__device__ __forceinline__ void mma_k16(int (&d)[4], unsigned int a0, unsigned int a1, unsigned int b0) {
    if constexpr (SIGNED)
        asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};"
            : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
            : "r"(a0), "r"(a1), "r"(b0), "r"(0));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};"
            : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
            : "r"(a0), "r"(a1), "r"(b0), "r"(0));
}

}  // namespace
