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

// ---- shared by both kernels ----

// Bytes of shared memory the staged activations may take (the rest of a multiprocessor's goes to more
// blocks); a chunk is at least MMV_KC columns whatever the token count. The BF16 kernel's is a knob.
constexpr unsigned MMV_STAGE_BUDGET = 32 * 1024;
#ifndef MMV_BF16_STAGE_BUDGET
#define MMV_BF16_STAGE_BUDGET (32 * 1024)
#endif

// Columns staged at a time for n tokens of `bytes_per_col` each: as many whole `unit` pieces (a multiple
// of MMV_KC) of the column range as the budget takes, or the whole range.
__host__ __device__ constexpr unsigned int mmv_chunk(unsigned int n, unsigned int kr, unsigned int bytes_per_col,
                                                  unsigned int unit, unsigned int budget = MMV_STAGE_BUDGET) {
    unsigned int k = budget / (n * bytes_per_col) / unit * unit;
    k = k < unit ? unit : k;
    return k < kr ? k : kr;
}

// A lane's results to y: each(fn) calls fn(tok, va, vb) for every token the lane holds, va of its row a
// and vb of row b (GLU: the gate and up sums of output row a). One column range: the epilogue straight
// to y; several: the partial sums, and the last block of the row range to arrive adds them in split
// order and applies the epilogue.
template <bool GLU, typename Each>
__device__ __forceinline__ void mmv_write(const MmvShape &shape, unsigned int n, unsigned int rows, unsigned int row_a,
                                          unsigned int row_b, const float *bias, const float *residual, float *y,
                                          unsigned int ldy, float *partial, unsigned int *counters, Each &&each) {
    auto finish = [&](unsigned int tok, unsigned int r, float v, float v2) {
        const size_t at = (size_t)tok * ldy + r;
        if (GLU) {
            y[at] = he::silu(v) * v2;
        } else {
            if (bias != nullptr) v += bias[r];
            if (residual != nullptr) v += residual[at];
            y[at] = v;
        }
    };
    if (shape.splits == 1) {
        each([&](unsigned int tok, float va, float vb) {
            if (GLU) {
                if (row_a < rows) finish(tok, row_a, va, vb);
            } else {
                if (row_a < rows) finish(tok, row_a, va, 0.f);
                if (row_b < rows) finish(tok, row_b, vb, 0.f);
            }
        });
        return;
    }

    // Split: partial[((split * parts + part) * n + tok) * rows + row], parts 2 for GLU (gate, up).
    constexpr unsigned PARTS = GLU ? 2 : 1;
    auto slot = [&](unsigned int split, unsigned int part, unsigned int tok, unsigned int r) {
        return partial + ((size_t)(split * PARTS + part) * n + tok) * rows + r;
    };
    each([&](unsigned int tok, float va, float vb) {
        if (row_a < rows) *slot(blockIdx.y, 0, tok, row_a) = va;
        if (row_b < rows) *slot(blockIdx.y, GLU ? 1 : 0, tok, row_b) = vb;
    });
    __threadfence();
    __syncthreads();
    __shared__ unsigned int last;
    const unsigned int tid = threadIdx.x;
    if (tid == 0) last = atomicAdd(&counters[blockIdx.x], 1u) == shape.splits - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();  // the other blocks' partial sums are visible from here on
    const unsigned int first = GLU ? blockIdx.x * (MMV_BLOCK_ROWS / 2) : blockIdx.x * MMV_BLOCK_ROWS;
    const unsigned int block_rows = min(GLU ? MMV_BLOCK_ROWS / 2 : MMV_BLOCK_ROWS, rows - first);
    for (unsigned int i = tid; i < n * block_rows; i += MMV_THREADS) {
        const unsigned int tok = i / block_rows, r = first + i % block_rows;
        // Every split's load in flight at once, then the sum in split order.
        float v[MMV_MAX_SPLITS], v2[MMV_MAX_SPLITS];
#pragma unroll
        for (unsigned int s = 0; s < MMV_MAX_SPLITS; s++) {
            v[s] = s < shape.splits ? __ldcg(slot(s, 0, tok, r)) : 0.f;
            v2[s] = GLU && s < shape.splits ? __ldcg(slot(s, 1, tok, r)) : 0.f;
        }
        float sum = 0.f, sum2 = 0.f;
#pragma unroll
        for (unsigned int s = 0; s < MMV_MAX_SPLITS; s++) {
            if (s < shape.splits) sum += v[s], sum2 += v2[s];
        }
        finish(tok, r, sum, sum2);
    }
    if (tid == 0) counters[blockIdx.x] = 0;  // ready for the next launch
}

// The first of the warp's rows: of its 16 rows, or (GLU) of its 8 gate and 8 up rows.
template <bool GLU>
__device__ __forceinline__ unsigned int mmv_warp_row(unsigned int warp) {
    return GLU ? blockIdx.x * (MMV_BLOCK_ROWS / 2) + warp * 8 : blockIdx.x * MMV_BLOCK_ROWS + warp * 16;
}

// The warp's A rows: g and g + 8 of its 16 (GLU: gate row g and up row g of its 8). Rows past the matrix
// read its last row (never written out), so the loads need no tests.
struct MmvRows {
    unsigned int a, b;
    const unsigned char *wa, *wb;
};
template <bool GLU>
__device__ __forceinline__ MmvRows mmv_rows(const unsigned char *w, const unsigned char *w2, unsigned int rows,
                                            size_t row_bytes, unsigned int warp, unsigned int g) {
    const unsigned int base = mmv_warp_row<GLU>(warp);
    MmvRows r;
    r.a = base + g;
    r.b = GLU ? base + g : base + g + 8;
    r.wa = w + (size_t)min(r.a, rows - 1) * row_bytes;
    r.wb = (GLU ? w2 : w) + (size_t)min(r.b, rows - 1) * row_bytes;
    return r;
}

// The weights stream one column group ahead of the arithmetic; the chunk of activations column `col`
// enters is staged (between two barriers every warp of the block reaches together) when the group
// enters it. Returns the chunk's first column.
template <typename Stage>
__device__ __forceinline__ unsigned int enter_chunk(unsigned int col, unsigned int k_begin, unsigned int k_end,
                                                    unsigned int kch, unsigned int &staged, Stage &&stage) {
    const unsigned int chunk = (col - k_begin) / kch, c0 = k_begin + chunk * kch;
    if (chunk != staged) {
        __syncthreads();
        stage(c0, min(kch, k_end - c0));
        __syncthreads();
        staged = chunk;
    }
    return c0;
}

// ---- weights through shared memory (the staged kernels) ----
// A warp copies its 16 weight rows' bytes of a column group (the aligned 16-byte chunks that hold them,
// so a 2-byte aligned block format copies as well as any) into its own slots with cp.async, STAGES - 1
// groups ahead of the arithmetic: the loads in flight hold no registers, and the lane readers then take
// their narrow or misaligned pieces from shared memory, where they cost one request a warp instead of
// one per row touched (what bounds the formats whose blocks are 2-byte aligned when read from memory).
template <typename R, unsigned GROUP>
struct WeightSlots {
    static constexpr unsigned BYTES = GROUP / R::BLOCK_COLS * R::BYTES;  // a row's bytes of a group
    static constexpr unsigned CHUNKS = (BYTES + 16 - R::ALIGN + 15) / 16;  // any start the alignment allows
    // A row's stride: the chunks, then padding to the next stride the reader's pattern reads without
    // bank conflicts (`bank_ok` of the stride in 4-byte words).
    static constexpr unsigned row_stride() {
        unsigned pad = 0;
        while (!R::bank_ok((CHUNKS * 4 + pad) % 32)) pad += 4;
        return CHUNKS * 16 + pad * 4;
    }
    static constexpr unsigned ROW = row_stride();
    static constexpr unsigned SLOT = 16 * ROW;
    // Three slots where a block's eight warps' take at most 78 KiB (two blocks a multiprocessor with the
    // staged activations beside them), else two.
    static constexpr unsigned STAGES = 3 * SLOT * MMV_WARPS <= 78 * 1024 ? 3 : 2;
    static constexpr unsigned WARP_BYTES = STAGES * SLOT;
    static constexpr unsigned BLOCK_BYTES = MMV_WARPS * WARP_BYTES;
};

// Issues the copies of the warp's rows' bytes [start, start + len) into `slot` (row i of the warp at
// i * ROW, its first byte at the offset its address has in a 16-byte chunk); rows as mmv_rows names them.
template <typename WS, bool GLU>
__device__ __forceinline__ void copy_rows(unsigned char *slot, const unsigned char *w, const unsigned char *w2,
                                          unsigned int rows, size_t row_bytes, unsigned int warp, unsigned int lane,
                                          size_t start, unsigned int len) {
    const unsigned int base = mmv_warp_row<GLU>(warp);
#pragma unroll
    for (unsigned int j = 0; j < (16 * WS::CHUNKS + 31) / 32; j++) {
        const unsigned int idx = lane + 32 * j, i = idx / WS::CHUNKS, c = idx % WS::CHUNKS;
        const unsigned int r = GLU ? base + i % 8 : base + i;
        const unsigned char *p = (GLU && i >= 8 ? w2 : w) + (size_t)min(r, rows - 1) * row_bytes + start;
        const unsigned char *src =
            reinterpret_cast<const unsigned char *>(reinterpret_cast<uintptr_t>(p) & ~(uintptr_t)15) + 16 * c;
        // A chunk holding a byte of the range lies in the same mapped page as that byte.
        if (idx < 16 * WS::CHUNKS && src < p + len) he::cp_async16(slot + i * WS::ROW + 16 * c, src, true);
    }
}

// The staged weights of a launch: a warp's slots, its groups, and the shared-memory view of its rows.
template <typename R, unsigned GROUP, bool GLU>
struct WeightStage {
    using WS = WeightSlots<R, GROUP>;
    unsigned char *slots;
    const unsigned char *w, *w2;
    unsigned int rows, warp, lane, k_begin, k_end, groups;
    size_t row_bytes;

    __device__ __forceinline__ size_t start_of(unsigned int gi) const {
        return (size_t)((k_begin + gi * GROUP) / R::BLOCK_COLS) * R::BYTES;
    }
    // Copies of group gi (if there is one) into its slot, then a commit (every call commits one group, so
    // the waits count groups).
    __device__ __forceinline__ void issue(unsigned int gi) const {
        if (gi < groups) {
            const unsigned int col = k_begin + gi * GROUP;
            const unsigned int len = (min(col + GROUP, k_end) - col) / R::BLOCK_COLS * R::BYTES;
            copy_rows<WS, GLU>(slots + (gi % WS::STAGES) * WS::SLOT, w, w2, rows, row_bytes, warp, lane, start_of(gi),
                               len);
        }
        he::cp_async_commit();
    }
    __device__ __forceinline__ void begin() const {
#pragma unroll
        for (unsigned int s = 0; s + 1 < WS::STAGES; s++) issue(s);
    }
    // Group gi's copies by every lane of the warp are in its slot (the slot of gi - 1 is free: the warp
    // left it at the __syncwarp that ended its arithmetic), with the copies of gi + STAGES - 1 in flight.
    __device__ __forceinline__ void wait(unsigned int gi) const {
        issue(gi + WS::STAGES - 1);
        he::cp_async_wait<WS::STAGES - 1>();
        __syncwarp();
    }
    // Row i of the warp in group gi's slot, where `row` (its address in memory) starts; columns from the
    // group's first.
    __device__ __forceinline__ const unsigned char *row(unsigned int gi, unsigned int i, const unsigned char *at) const {
        return slots + (gi % WS::STAGES) * WS::SLOT + i * WS::ROW +
               ((reinterpret_cast<uintptr_t>(at) + start_of(gi)) & 15);
    }
};

// The staged kernels' loop over their column groups: each group's weights wait in the warp's slots,
// the lane's raw bits of its tiles (UNROLL tiles of TILE columns) are read from there, and
// compute(r, col, c0) takes them with the activation chunk staged from column c0.
template <typename R, unsigned UNROLL, unsigned TILE, bool GLU, typename Stage, typename Compute>
__device__ __forceinline__ void staged_groups(unsigned char *slots, const unsigned char *w, const unsigned char *w2,
                                              unsigned int rows, size_t row_bytes, const unsigned char *const (&wr)[2],
                                              unsigned int warp, unsigned int lane, unsigned int k_begin,
                                              unsigned int k_end, unsigned int kch, Stage &&stage, Compute &&compute) {
    constexpr unsigned GROUP = UNROLL * TILE;
    const unsigned int g = lane / 4, t = lane % 4;
    const WeightStage<R, GROUP, GLU> ws{slots + warp * WeightSlots<R, GROUP>::WARP_BYTES,
                                        w, w2, rows, warp, lane, k_begin, k_end,
                                        (k_end - k_begin + GROUP - 1) / GROUP, row_bytes};
    ws.begin();
    he::pdl_wait();  // the weights' first groups are in flight; the activations come from the kernel before
    unsigned int staged = ~0u;
    for (unsigned int gi = 0; gi < ws.groups; gi++) {
        const unsigned int col = k_begin + gi * GROUP;
        const unsigned int c0 = enter_chunk(col, k_begin, k_end, kch, staged, stage);
        ws.wait(gi);
        const unsigned char *sa = ws.row(gi, g, wr[0]), *sb = ws.row(gi, 8 + g, wr[1]);
        typename R::Raw r[UNROLL][2];
#pragma unroll
        for (int u = 0; u < (int)UNROLL; u++)
            if (col + u * TILE < k_end) {
                R::template fetch<true>(r[u][0], sa, u * TILE, t);
                R::template fetch<true>(r[u][1], sb, u * TILE, t);
            }
        compute(r, col, c0);
        __syncwarp();
    }
}

// The columns a kernel takes a step of its main loop: its reader's tiles of a group, staged or streamed.
template <typename R, bool STAGED>
__host__ __device__ constexpr unsigned mmv_group() {
    return (STAGED ? R::SUNROLL : R::UNROLL) * R::STEP * R::TILE_STEPS;
}

// Whether a launch of `n` tokens stages its weights: where the reader measured faster so (its
// STAGE_TOKENS), or as hostembed_tuning's mmv_stage says, to measure. Both ways give the same bits: only
// where the weights wait differs.
template <typename R>
bool mmv_staged(const hostembed_tuning &tuning, unsigned int n) {
    return tuning.mmv_stage == HE_MMV_STAGE_ALWAYS || (tuning.mmv_stage != HE_MMV_STAGE_NEVER && n <= R::STAGE_TOKENS);
}

// ---- the BF16 kernel ----

// One token's staged row of `kch` columns: groups of 4 columns, hi[4] then lo[4] (16 bytes), then padding
// that puts a quarter warp's 16-byte reads (tokens g and g + 1, lanes t = 0..3) in distinct banks.
__host__ __device__ constexpr unsigned mmv_stride(unsigned kch) { return kch / 4 * 16 + 16; }
// The staged activations' bytes: the rows, then (scaled readers) each token's group exponents, rounded up
// so that the weight slots after them are 16-byte aligned.
__host__ __device__ constexpr unsigned mmv_act_bytes(unsigned n, unsigned kch, bool scaled) {
    return (n * mmv_stride(kch) + (scaled ? n * (kch / MMV_KC) * 4 : 0) + 15) / 16 * 16;
}
// The exponent e of a scaled group (see MmaF16) whose max|x| is `amax`: amax 2^e in [2^14, 2^15), within
// [-64, 64] so that neither the staged values nor the scaled accumulators leave their ranges.
__device__ __forceinline__ int mmv_group_exponent(float amax) {
    const int biased = (int)((__float_as_uint(amax) >> 23) & 0xFFu);  // floor(log2 amax) + 127 (normal amax)
    return biased == 0 ? 64 : max(-64, min(64, 14 - (biased - 127)));
}
// A warp staging a token's 256-column group: the lane's 8 columns from 8e of the chunk at c0 (zeros where
// not `here`, past a short last group), and the group's max|x| over the warp.
__device__ __forceinline__ float stage_unit(const float *x, unsigned int tok, unsigned int cols, unsigned int c0,
                                            unsigned int e, bool here, float (&f)[8]) {
    if (here) {
        const float4 *xp = reinterpret_cast<const float4 *>(x + (size_t)tok * cols + c0 + 8 * e);
        const float4 p = __ldg(xp), q = __ldg(xp + 1);
        f[0] = p.x, f[1] = p.y, f[2] = p.z, f[3] = p.w, f[4] = q.x, f[5] = q.y, f[6] = q.z, f[7] = q.w;
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++) f[k] = 0.f;
    }
    float amax = 0.f;
#pragma unroll
    for (int k = 0; k < 8; k++) amax = fmaxf(amax, fabsf(f[k]));
#pragma unroll
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    return amax;
}
// 2^e for e in [-126, 127].
__device__ __forceinline__ float mmv_pow2(int e) { return __uint_as_float((unsigned int)(e + 127) << 23); }

// Four columns as a half kernel stages them: hi[4] then lo[4], each pair packed. Plain (BF16): hi = bf16
// rn(x); scaled (F16): the reader's rn(x 2^e) of the group's exponent.
template <typename Op>
__device__ __forceinline__ uint4 mmv_quad_plain(const float *f) {
    float hi[4], lo[4];
#pragma unroll
    for (int e = 0; e < 4; e++) {
        hi[e] = __bfloat162float(__float2bfloat16_rn(f[e]));
        lo[e] = f[e] - hi[e];
    }
    return make_uint4(Op::pack(hi[0], hi[1]), Op::pack(hi[2], hi[3]), Op::pack(lo[0], lo[1]), Op::pack(lo[2], lo[3]));
}
template <typename Op>
__device__ __forceinline__ uint4 mmv_quad_scaled(const float *f, float scale) {
    float hi[4], lo[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float v = f[k] * scale;
        hi[k] = Op::unpack(Op::pack(v, 0.f));
        lo[k] = v - hi[k];
    }
    return make_uint4(Op::pack(hi[0], hi[1]), Op::pack(hi[2], hi[3]), Op::pack(lo[0], lo[1]), Op::pack(lo[2], lo[3]));
}

// ---- activations staged once a product (launches of more than MMV_PREP_AFTER tokens) ----
// Every row block of a product stages the same activations; past a few tokens, converting them in each
// block (a dependent global load and a warp's max a unit, repeated by 32-112 row blocks) cost more than the
// tensor cores' work. A launch of more tokens converts them once into the workspace, after the split
// sums: each token's row as the blocks' shared memory holds it (per 4 columns hi[4], lo[4]), then
// (scaled readers) each token's exponent a 256-column group; the blocks copy chunks of it with cp.async a
// chunk ahead of the arithmetic. Same values, so the same bits, as converting in the block.
constexpr unsigned MMV_PREP_AFTER = 8;

// Floats of the split sums of a launch of `n` tokens, rounded up to 16 bytes: where the staged rows start.
__host__ __device__ inline size_t mmv_prep_offset(const MmvShape &s, bool glu, unsigned int n, unsigned int rows) {
    const size_t sums = s.splits > 1 ? (size_t)s.splits * (glu ? 2 : 1) * n * rows : 0;
    return (sums + 3) / 4 * 4;
}
// Floats of the staged rows and exponents of `n` tokens.
__host__ __device__ inline size_t mmv_prep_floats(unsigned int n, unsigned int cols) {
    return (size_t)n * cols + (size_t)n * ((cols + MMV_KC - 1) / MMV_KC);
}

// One warp a token's 256-column group: its 8 columns a lane, as stage_scaled / stage do in a block.
template <typename R>
__global__ __launch_bounds__(MMV_THREADS) void mmv_prep_kernel(const float *__restrict__ x, unsigned int n,
                                                                unsigned int cols, uint4 *__restrict__ xp,
                                                                int *__restrict__ xe) {
    he::pdl_launch_dependents();
    const unsigned int groups = (cols + MMV_KC - 1) / MMV_KC, lane = threadIdx.x % 32;
    const unsigned int unit = blockIdx.x * MMV_WARPS + threadIdx.x / 32;
    he::pdl_wait();  // x comes from the kernel before; the product before may still read xp
    if (unit >= n * groups) return;  // a whole warp
    const unsigned int tok = unit / groups, gi = unit % groups, c0 = gi * MMV_KC;
    const bool here = c0 + 8 * lane < cols;
    float f[8];
    const float amax = stage_unit(x, tok, cols, c0, lane, here, f);
    uint4 *at = xp + ((size_t)tok * cols + c0) / 4 + 2 * lane;
    if constexpr (R::SCALED) {
        const int ex = mmv_group_exponent(amax);
        const float scale = mmv_pow2(ex);
        if (here) at[0] = mmv_quad_scaled<typename R::Op>(f, scale), at[1] = mmv_quad_scaled<typename R::Op>(f + 4, scale);
        if (lane == 0) xe[tok * groups + gi] = ex;
    } else {
        if (here) at[0] = mmv_quad_plain<typename R::Op>(f), at[1] = mmv_quad_plain<typename R::Op>(f + 4);
    }
}

// PREP launches stage chunks of one width for a tile count (NT tiles of 8 tokens) and rows for all its
// tokens, absent ones too (never copied, never written out): a tile's rows then sit at offsets known when
// compiling, where computing each tile's address from the token count was most of the loop's instructions.
__host__ __device__ constexpr unsigned mmv_prep_chunk(unsigned nt, unsigned group) {
    return mmv_chunk(nt * 8, ~0u, 4, group, MMV_BF16_STAGE_BUDGET);
}
// Scaled PREP launches keep every exponent of their column range in shared memory, a group's tokens side by
// side (a lane's two tokens one 8-byte read, a tile's at a known offset): read from global memory, each took
// a 64-bit address of its own, twice a group.
__host__ __device__ constexpr unsigned mmv_prep_exponent_bytes(unsigned nt, unsigned kr) {
    return (kr + MMV_KC - 1) / MMV_KC * nt * 8 * 4;
}
// The tile count a PREP launch of `n` tokens takes (launch_mmv's choice).
__host__ __device__ constexpr unsigned mmv_prep_tiles(unsigned n) { return n <= 16 ? 2 : n <= 32 ? 4 : 8; }

// The staged activations' bytes of a launch: one chunk converted in the block, or (PREP) two copied.
__host__ __device__ inline unsigned int mmv_half_smem(unsigned int n, unsigned int kr, unsigned int group, bool scaled,
                                                      bool prep) {
    if (!prep) return mmv_act_bytes(n, mmv_chunk(n, kr, 4, MMV_KC, MMV_BF16_STAGE_BUDGET), scaled);
    const unsigned nt = mmv_prep_tiles(n);
    return 2 * mmv_act_bytes(nt * 8, mmv_prep_chunk(nt, group), false) + (scaled ? mmv_prep_exponent_bytes(nt, kr) : 0);
}

// PREP: the activations come staged from mmv_prep_kernel (in the workspace after the split sums), in chunks
// of whole column groups copied a chunk ahead into two buffers; the streamed kernel only.
template <typename R, int NT, bool GLU, bool STAGED, bool PREP = false>
__global__ __launch_bounds__(MMV_THREADS, NT <= 2 ? MMV_SMALL_MIN_BLOCKS : 2) void mmv_kernel(const unsigned char *__restrict__ w,
                                                         const unsigned char *__restrict__ w2, unsigned int rows,
                                                         unsigned int cols, size_t row_bytes,
                                                         const float *__restrict__ x, unsigned int n,
                                                         const float *bias, const float *residual, float *y,
                                                         unsigned int ldy, float *partial, unsigned int *counters) {
    extern __shared__ __align__(16) unsigned char mmv_smem[];
    // PREP launches of 8 tiles take half the column group: two groups of weights in registers beside 8
    // tiles' sums spilled at 128 registers a thread (two blocks a multiprocessor).
    constexpr unsigned UNROLL = STAGED ? R::SUNROLL : PREP && NT >= 8 ? R::UNROLL / 2 : R::UNROLL;
    constexpr unsigned GROUP = UNROLL * R::STEP * R::TILE_STEPS;
    static_assert(!PREP || mmv_prep_chunk(NT, GROUP) == mmv_prep_chunk(NT, mmv_group<R, STAGED>()),
                  "the host sizes the chunks with the whole group");

    const unsigned int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
    he::pdl_launch_dependents();
    const MmvShape shape = mmv_shape(rows, cols, GLU, true);
    const unsigned int k_begin = blockIdx.y * shape.kr;
    const unsigned int k_end = min(cols, k_begin + shape.kr);
    static_assert(!(PREP && STAGED), "staged activations come with streamed weights");
    constexpr unsigned PREP_KCH = mmv_prep_chunk(NT, GROUP);
    const unsigned int kch = PREP ? PREP_KCH : mmv_chunk(n, shape.kr, 4, MMV_KC, MMV_BF16_STAGE_BUDGET);
    const unsigned int stride = mmv_stride(kch);
    const unsigned int groups = kch / MMV_KC;
    unsigned char *xs = mmv_smem;
    const unsigned char *xb = xs;  // the chunk the arithmetic reads (PREP: one of two buffers)
    int *xe = reinterpret_cast<int *>(xs + n * stride);  // scaled readers: [tok][group] exponents
    // PREP: the staged rows and every token's exponents of the whole row (mmv_prep_kernel's layout).
    const uint4 *xp = reinterpret_cast<const uint4 *>(partial + mmv_prep_offset(mmv_shape(rows, cols, GLU), GLU, n, rows));
    const int *xpe = reinterpret_cast<const int *>(xp) + (size_t)n * cols;
    const unsigned int row_groups = (cols + MMV_KC - 1) / MMV_KC;
    const MmvRows rw = mmv_rows<GLU>(w, w2, rows, row_bytes, warp, g);
    const unsigned char *wr[2] = {rw.wa, rw.wb};

    // One accumulator chain a token tile, hi then lo products in column order: the same sequence of
    // roundings for a token in any launch (a second chain for the lo products only at some token counts
    // broke that: measured by mmv_is_batch_invariant).
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[j][e] = 0.f;

    // Activations of columns [c0, c0 + len) into shared memory, every load issued before the stores: 8
    // 16-byte loads a thread in flight where the weights stream for up to 16 tokens (8 streams 1,309 ->
    // 1,326 tok/s, 16: 2,159 -> 2,209), 4 elsewhere (8 cost the staged 1-token kernel 3.6%, 64 tokens 23%).
    constexpr int STAGE_LOADS = !STAGED && NT <= 2 ? 8 : 4;
    auto stage = [&](unsigned int c0, unsigned int len) {
        const unsigned int quads = len / 4, total = n * quads;
        for (unsigned int i0 = tid; i0 < total; i0 += STAGE_LOADS * MMV_THREADS) {
            float4 v[STAGE_LOADS];
#pragma unroll
            for (int u = 0; u < STAGE_LOADS; u++) {
                const unsigned int i = i0 + u * MMV_THREADS;
                if (i < total)
                    v[u] = __ldg(reinterpret_cast<const float4 *>(x + (size_t)(i / quads) * cols + c0) + i % quads);
            }
#pragma unroll
            for (int u = 0; u < STAGE_LOADS; u++) {
                const unsigned int i = i0 + u * MMV_THREADS;
                if (i >= total) break;
                const float f[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
                *reinterpret_cast<uint4 *>(xs + (i / quads) * stride + 16 * (i % quads)) = mmv_quad_plain<typename R::Op>(f);
            }
        }
    };
    // Scaled readers: a warp takes a token's 256-column group (8 columns a lane; lanes past a short last
    // group hold zeros), its exponent from a shuffled max, and stages the values times 2^e.
    auto stage_scaled = [&](unsigned int c0, unsigned int len) {
        const unsigned int units = (len + MMV_KC - 1) / MMV_KC * 32, total = n * units;
        for (unsigned int i = tid; i < total; i += MMV_THREADS) {
            const unsigned int tok = i / units, e = i % units;  // e: 8-column unit of the chunk
            const bool here = 8 * e < len;
            float f[8];
            const float amax = stage_unit(x, tok, cols, c0, e, here, f);
            const int ex = mmv_group_exponent(amax);
            const float scale = mmv_pow2(ex);
            if (here) {
#pragma unroll
                for (int q = 0; q < 2; q++)
                    *reinterpret_cast<uint4 *>(xs + tok * stride + 16 * (2 * e + q)) =
                        mmv_quad_scaled<typename R::Op>(f + 4 * q, scale);
            }
            if (lane == 0) xe[tok * groups + e / 32] = ex;
        }
    };
    auto stage_any = [&](unsigned int c0, unsigned int len) {
        if constexpr (R::SCALED) stage_scaled(c0, len);
        else stage(c0, len);
    };
    // A token's exponent of the group that holds column `col`, whose chunk starts at `c0`.
    auto exponent = [&](unsigned int tok, unsigned int col, unsigned int c0) { return xe[tok * groups + (col - c0) / MMV_KC]; };
    // PREP: the range's exponents, [group][token] (see mmv_prep_exponent_bytes), after the two buffers.
    int *xes = reinterpret_cast<int *>(xs + 2 * mmv_act_bytes(NT * 8, PREP_KCH, false));
    // Scaled readers: the lane's accumulators times 2^(sign e) of their tokens' group holding `col`.
    auto rescale = [&](unsigned int col, unsigned int c0, int sign) {
#pragma unroll
        for (int j = 0; j < NT; j++) {
            if (!PREP && 8 * j >= n) break;
            int e0, e1;
            if constexpr (PREP) {  // absent tokens' exponents are whatever the buffer holds, as their rows
                const int2 e = *reinterpret_cast<const int2 *>(xes + (col - k_begin) / MMV_KC * (NT * 8) + 8 * j + 2 * t);
                e0 = e.x, e1 = e.y;
            } else {
                e0 = exponent(min(8 * j + 2 * t, n - 1), col, c0), e1 = exponent(min(8 * j + 2 * t + 1, n - 1), col, c0);
            }
            const float f0 = mmv_pow2(sign * e0), f1 = mmv_pow2(sign * e1);
            acc[j][0] *= f0, acc[j][2] *= f0, acc[j][1] *= f1, acc[j][3] *= f1;
        }
    };

    using Raw = typename R::Raw;
    auto fetch_group = [&](Raw (&r)[UNROLL][2], unsigned int col) {
#pragma unroll
        for (int u = 0; u < (int)UNROLL; u++)
            if (col + u * R::STEP < k_end) {
                R::template fetch<false>(r[u][0], wr[0], col + u * R::STEP, t);
                R::template fetch<false>(r[u][1], wr[1], col + u * R::STEP, t);
            }
    };

    // The steps of column group `col`, whose chunk starts at column `c0` of shared memory.
    auto compute = [&](const Raw (&r)[UNROLL][2], unsigned int col, unsigned int c0) {
#pragma unroll
        for (int u = 0; u < (int)UNROLL; u++) {
            if (col + u * R::STEP >= k_end) break;
            const unsigned int c = col + u * R::STEP - c0;  // column within the chunk
            // Groups start at multiples of MMV_KC in the row (k_begin is one, and so is a converted chunk).
            if constexpr (R::SCALED)
                if ((col + u * R::STEP) % MMV_KC == 0) rescale(col + u * R::STEP, c0, 1);
            unsigned int fa[R::KSTEPS][2], fb[R::KSTEPS][2];
            R::frag(r[u][0], fa);
            R::frag(r[u][1], fb);
#pragma unroll
            for (int j = 0; j < NT; j++) {
                // A whole tile of absent tokens; PREP launches compute every tile, so that the compiler may
                // interleave the tiles' dependent tensor-core chains.
                if (!PREP && 8 * j >= n) break;
                // Absent tokens reread the last one (PREP: their rows are staged, whatever they hold).
                const unsigned int tok = PREP ? 8 * j + g : min(8 * j + g, n - 1);
#pragma unroll
                for (int k = 0; k < (int)R::KSTEPS; k++) {
                    const unsigned int a[4] = {fa[k][0], fb[k][0], fa[k][1], fb[k][1]};
                    const uint4 v = *reinterpret_cast<const uint4 *>(xb + tok * stride + 4 * (c + R::group(t, k)));
                    R::Op::mma(acc[j], a, v.x, v.y);  // hi
                    R::Op::mma(acc[j], a, v.z, v.w);  // lo
                }
            }
            if constexpr (R::SCALED)
                if ((col + u * R::STEP + R::STEP) % MMV_KC == 0 || col + u * R::STEP + R::STEP >= k_end)
                    rescale(col + u * R::STEP, c0, -1);
        }
    };

    if constexpr (STAGED) {
        staged_groups<R, UNROLL, R::STEP, GLU>(xs + mmv_act_bytes(n, kch, R::SCALED), w, w2, rows, row_bytes, wr, warp,
                                               lane, k_begin, k_end, kch, stage_any, compute);
    } else if constexpr (PREP) {
        // Chunk ci's copies go out when every warp has left chunk ci - 1 (whose buffer they take) and are
        // waited for when the arithmetic enters chunk ci + 1: a whole chunk's arithmetic hides them.
        const unsigned int buf = mmv_act_bytes(NT * 8, PREP_KCH, false), chunks = (k_end - k_begin + kch - 1) / kch;
        auto issue = [&](unsigned int ci) {  // a warp a token, a lane 4 columns at a time
            if (ci < chunks) {
                const unsigned int c0 = k_begin + ci * kch, quads = min(kch, k_end - c0) / 4;
                unsigned char *dst = xs + (ci % 2) * buf;
                for (unsigned int tok = warp; tok < n; tok += MMV_WARPS)
                    for (unsigned int q = lane; q < quads; q += 32)
                        he::cp_async16(dst + tok * stride + 16 * q, xp + ((size_t)tok * cols + c0) / 4 + q, true);
            }
            he::cp_async_commit();
        };
        unsigned int entered = ~0u;
        // 8-tile launches read the weights two (half) groups ahead: one group's arithmetic did not hide a
        // load's latency (the profile's stalls on global loads).
        constexpr unsigned AHEAD = NT >= 8 ? 2 : 1;
        Raw cur[UNROLL][2], nxt[UNROLL][2], far[UNROLL][2];
        fetch_group(cur, k_begin);
        if (AHEAD == 2 && k_begin + GROUP < k_end) fetch_group(nxt, k_begin + GROUP);
        he::pdl_wait();  // the staged rows come from mmv_prep_kernel
        issue(0);
        if constexpr (R::SCALED) {  // read once the first chunk's barrier has passed
            const unsigned int range_groups = (k_end - k_begin + MMV_KC - 1) / MMV_KC, first = k_begin / MMV_KC;
            for (unsigned int i = tid; i < n * range_groups; i += MMV_THREADS) {
                const unsigned int tok = i / range_groups, gi = i % range_groups;
                xes[gi * (NT * 8) + tok] = __ldg(xpe + tok * row_groups + first + gi);
            }
        }
        for (unsigned int col = k_begin; col < k_end; col += GROUP) {
            if (col + AHEAD * GROUP < k_end) fetch_group(AHEAD == 2 ? far : nxt, col + AHEAD * GROUP);
            const unsigned int ci = (col - k_begin) / kch;
            if (ci != entered) {
                he::cp_async_wait<0>();
                __syncthreads();  // chunk ci is every thread's; every warp has left chunk ci - 1
                issue(ci + 1);
                entered = ci;
                xb = xs + (ci % 2) * buf;
            }
            compute(cur, col, k_begin + ci * kch);
#pragma unroll
            for (int u = 0; u < (int)UNROLL; u++) {
                cur[u][0] = nxt[u][0], cur[u][1] = nxt[u][1];
                if constexpr (AHEAD == 2) nxt[u][0] = far[u][0], nxt[u][1] = far[u][1];
            }
        }
    } else {
        unsigned int staged = ~0u;
        Raw cur[UNROLL][2], nxt[UNROLL][2];
        fetch_group(cur, k_begin);
        he::pdl_wait();
        for (unsigned int col = k_begin; col < k_end; col += GROUP) {
            if (col + GROUP < k_end) fetch_group(nxt, col + GROUP);
            compute(cur, col, enter_chunk(col, k_begin, k_end, kch, staged, stage_any));
#pragma unroll
            for (int u = 0; u < (int)UNROLL; u++) cur[u][0] = nxt[u][0], cur[u][1] = nxt[u][1];
        }
    }

    // Lane (g, t) holds tokens 8j + 2t (+ 1) of rows a (c0, c1) and b (c2, c3).
    mmv_write<GLU>(shape, n, rows, rw.a, rw.b, bias, residual, y, ldy, partial, counters, [&](auto &&fn) {
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const unsigned int tok = 8 * j + 2 * t + e;
                if (tok < n) fn(tok, acc[j][e], acc[j][2 + e]);
            }
    });
}

// ---- the integer kernel ----

constexpr int MMVQ_RANGE = 32639;  // the largest |v|: hi = (v + 128) >> 8 stays an int8, lo in [-128, 127]

// One token's staged row of `kch` columns: per 32-column step 32 hi bytes then 32 lo bytes, in column
// order; 64 bytes of padding put the two tokens a half warp reads in distinct banks.
__host__ __device__ constexpr unsigned mmvq_stride(unsigned kch) { return kch * 2 + 64; }

// The rows, each token's group scales and (readers with minimums, min_cols their STEP) its sums of v per
// min_cols columns.
__host__ __device__ constexpr unsigned mmvq_smem_bytes(unsigned n, unsigned kch, unsigned min_cols) {
    return n * mmvq_stride(kch) + n * (kch / MMV_KC) * 4 + (min_cols != 0 ? n * (kch / min_cols) * 4 : 0);
}
// The staged activations' bytes, rounded up so that the weight slots after them are 16-byte aligned.
__host__ __device__ constexpr unsigned mmvq_act_bytes(unsigned n, unsigned kch, unsigned min_cols) {
    return (mmvq_smem_bytes(n, kch, min_cols) + 15) / 16 * 16;
}
// The columns a reader's minimum spans (its step), or 0 for readers without one.
template <typename R>
__host__ __device__ constexpr unsigned mmvq_min_cols() {
    return R::HAS_MIN ? R::STEP : 0;
}
// The unit of staged activation chunks: whole column groups and whole activation groups.
__host__ __device__ constexpr unsigned mmvq_unit(unsigned group) { return group > MMV_KC ? group : MMV_KC; }

template <typename R, int NT4, bool GLU, bool STAGED>
__global__ __launch_bounds__(MMV_THREADS, NT4 <= 2 ? MMV_SMALL_MIN_BLOCKS : NT4 <= 4 ? MMVQ_MID_MIN_BLOCKS : 1) void mmvq_kernel(
    const unsigned char *__restrict__ w, const unsigned char *__restrict__ w2, unsigned int rows, unsigned int cols,
    size_t row_bytes, const float *__restrict__ x, unsigned int n, const float *bias, const float *residual, float *y,
    unsigned int ldy, float *partial, unsigned int *counters) {
    extern __shared__ __align__(16) unsigned char mmv_smem[];
    constexpr unsigned UNROLL = STAGED ? R::SUNROLL : R::UNROLL;
    constexpr unsigned TILE = R::STEP * R::TILE_STEPS, GROUP = mmv_group<R, STAGED>(), KW = R::STEP / 16;
    static_assert(MMV_KC % TILE == 0 && (GROUP % MMV_KC == 0 || MMV_KC % GROUP == 0), "tiles within an activation group");

    const unsigned int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
    he::pdl_launch_dependents();
    const MmvShape shape = mmv_shape(rows, cols, GLU, true);
    const unsigned int k_begin = blockIdx.y * shape.kr;
    const unsigned int k_end = min(cols, k_begin + shape.kr);
    const unsigned int kch = mmv_chunk(n, shape.kr, 2, mmvq_unit(GROUP)), stride = mmvq_stride(kch);
    constexpr unsigned MIN_LANES = R::STEP / 8;  // the staging lanes (8 columns each) a minimum spans
    const unsigned int groups = kch / MMV_KC, blocks = kch / R::STEP;
    unsigned char *xs = mmv_smem;
    float *sx = reinterpret_cast<float *>(mmv_smem + n * stride);  // [tok][group]: the activation scales
    int *xv = reinterpret_cast<int *>(sx + n * groups);            // [tok][32-column block]: sums of v
    const MmvRows rw = mmv_rows<GLU>(w, w2, rows, row_bytes, warp, g);
    const unsigned char *wr[2] = {rw.wa, rw.wb};

    // Lane (g, t) holds token 4j + t of rows a ([0]) and b ([1]) in tile j: `out` the sum so far, and the
    // current activation group's: `acc` (block formats), or (k-quants) the hi and lo halves' integer sums
    // times the sub-scales in `ihi` and `ilo` (exact: at most 16 steps of 16 x 32 x 128 x 128 < 2^31, two
    // integer multiply-adds a row a step instead of a conversion and a float add), and `mins`.
    float out[NT4][2], acc[NT4][2];
    int ihi[NT4][2], ilo[NT4][2], mins[NT4][2];
#pragma unroll
    for (int j = 0; j < NT4; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) out[j][e] = 0.f, acc[j][e] = 0.f, ihi[j][e] = ilo[j][e] = mins[j][e] = 0;

    // Columns [c0, c0 + len) as 16-bit integers: a warp takes a token's 256-column group (8 columns a
    // lane; lanes past a short last group hold zeros), its scale from a shuffled max.
    auto stage = [&](unsigned int c0, unsigned int len) {
        const unsigned int units = (len + MMV_KC - 1) / MMV_KC * 32, total = n * units;
        for (unsigned int i = tid; i < total; i += MMV_THREADS) {
            const unsigned int tok = i / units, e = i % units;  // e: 8-column unit of the chunk
            const bool here = 8 * e < len;
            float f[8];
            const float amax = stage_unit(x, tok, cols, c0, e, here, f);
            const float inv = amax > 0.f ? (float)MMVQ_RANGE / amax : 0.f;
            unsigned int hw[2] = {0u, 0u}, lw[2] = {0u, 0u};
            int sum = 0;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const int v = __float2int_rn(f[k] * inv);
                const int h = (v + 128) >> 8, l = v - 256 * h;
                hw[k / 4] |= ((unsigned int)h & 0xFFu) << (8 * (k % 4));
                lw[k / 4] |= ((unsigned int)l & 0xFFu) << (8 * (k % 4));
                sum += v;
            }
            if (here) {
                unsigned char *at = xs + tok * stride + (e / 4) * 64 + 8 * (e % 4);
                *reinterpret_cast<uint2 *>(at) = make_uint2(hw[0], hw[1]);
                *reinterpret_cast<uint2 *>(at + 32) = make_uint2(lw[0], lw[1]);
            }
            if (lane == 0) sx[tok * groups + e / 32] = amax / (float)MMVQ_RANGE;
            if constexpr (R::HAS_MIN) {
#pragma unroll
                for (unsigned o = 1; o < MIN_LANES; o *= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);
                if (here && lane % MIN_LANES == 0) xv[tok * blocks + e / MIN_LANES] = sum;
            }
        }
    };

    using Raw = typename R::Raw;
    auto fetch_group = [&](Raw (&r)[UNROLL][2], unsigned int col) {
#pragma unroll
        for (int u = 0; u < (int)UNROLL; u++)
            if (col + u * TILE < k_end) {
                R::template fetch<false>(r[u][0], wr[0], col + u * TILE, t);
                R::template fetch<false>(r[u][1], wr[1], col + u * TILE, t);
            }
    };

    // The tiles of column group `col`, whose chunk starts at column `c0` of shared memory; streamed, each
    // tile's registers are refilled with the next group's tile as soon as it is used.
    auto compute = [&](Raw (&r)[UNROLL][2], unsigned int col, unsigned int c0) {
#pragma unroll
        for (int u = 0; u < (int)UNROLL; u++) {
            const unsigned int tc = col + u * TILE;
            if (tc >= k_end) break;
#pragma unroll
            for (int s = 0; s < (int)R::TILE_STEPS; s++) {
                const unsigned int c = tc + s * R::STEP - c0;  // column within the chunk
                unsigned int wa[KW], wb[KW];
                R::a(r[u][0], s, wa, t);
                R::a(r[u][1], s, wb, t);
                int isa = 1, isb = 1, ima = 0, imb = 0;
                float fsa = 1.f, fsb = 1.f;
                if constexpr (R::SUPER) {
                    isa = R::isc(r[u][0], s), isb = R::isc(r[u][1], s);
                    if constexpr (R::HAS_MIN) ima = R::imin(r[u][0], s), imb = R::imin(r[u][1], s);
                } else {
                    fsa = R::fsc(r[u][0], s), fsb = R::fsc(r[u][1], s);
                }
#pragma unroll
                for (int j = 0; j < NT4; j++) {
                    if (4 * j >= n) break;  // a whole tile of absent tokens
                    // B column g: token 4j + g / 2 (absent ones reread the last), its hi (even g) or lo half.
                    const unsigned int tok = min(4 * j + g / 2, n - 1);
                    const unsigned char *bp = xs + tok * stride + (c / 32) * 64 + (g % 2) * 32 + c % 32 + (R::STEP / 4) * t;
                    int d[4];
                    if constexpr (R::STEP == 32) {
                        const uint2 b = *reinterpret_cast<const uint2 *>(bp);
                        mma_k32<R::SIGNED>(d, wa[0], wb[0], wa[KW - 1], wb[KW - 1], b.x, b.y);
                    } else {
                        const unsigned int b = *reinterpret_cast<const unsigned int *>(bp);
                        mma_k16<R::SIGNED>(d, wa[0], wb[0], b);
                    }
                    // d[0], d[1]: row a, token 4j + t's hi and lo sums; d[2], d[3]: row b.
                    if constexpr (R::SUPER) {
                        ihi[j][0] += isa * d[0], ilo[j][0] += isa * d[1];
                        ihi[j][1] += isb * d[2], ilo[j][1] += isb * d[3];
                        if constexpr (R::HAS_MIN) {
                            const int xs_sum = xv[min(4 * j + t, n - 1) * blocks + c / R::STEP];
                            mins[j][0] += ima * xs_sum;
                            mins[j][1] += imb * xs_sum;
                        }
                    } else {
                        acc[j][0] = fmaf(fsa, (float)(d[0] * 256 + d[1]), acc[j][0]);
                        acc[j][1] = fmaf(fsb, (float)(d[2] * 256 + d[3]), acc[j][1]);
                        if constexpr (R::HAS_MIN) {
                            const float xs_sum = (float)xv[min(4 * j + t, n - 1) * blocks + c / R::STEP];
                            acc[j][0] = fmaf(R::fmin(r[u][0], s), xs_sum, acc[j][0]);
                            acc[j][1] = fmaf(R::fmin(r[u][1], s), xs_sum, acc[j][1]);
                        }
                    }
                }
            }
            // An activation group (a super-block) ends: its scales into the sum, in column order.
            if ((tc + TILE) % MMV_KC == 0 || tc + TILE >= k_end) {
                float da = 1.f, db = 1.f, ma = 0.f, mb = 0.f;
                if constexpr (R::SUPER) {
                    R::tile(r[u][0], da, ma);
                    R::tile(r[u][1], db, mb);
                }
#pragma unroll
                for (int j = 0; j < NT4; j++) {
                    if (4 * j >= n) break;
                    const float s = sx[min(4 * j + t, n - 1) * groups + (tc - c0) / MMV_KC];
                    if constexpr (R::SUPER) {
#pragma unroll
                        for (int e = 0; e < 2; e++) {
                            acc[j][e] = fmaf((float)ihi[j][e], 256.f, (float)ilo[j][e]);
                            ihi[j][e] = ilo[j][e] = 0;
                        }
                    }
                    out[j][0] = fmaf(da * s, acc[j][0], out[j][0]);
                    out[j][1] = fmaf(db * s, acc[j][1], out[j][1]);
                    if constexpr (R::SUPER && R::HAS_MIN) {
                        out[j][0] = fmaf(ma * s, (float)mins[j][0], out[j][0]);
                        out[j][1] = fmaf(mb * s, (float)mins[j][1], out[j][1]);
                    }
                    acc[j][0] = acc[j][1] = 0.f;
                    mins[j][0] = mins[j][1] = 0;
                }
            }
            if (!STAGED && tc + GROUP < k_end) {
                R::template fetch<false>(r[u][0], wr[0], tc + GROUP, t);
                R::template fetch<false>(r[u][1], wr[1], tc + GROUP, t);
            }
        }
    };

    if constexpr (STAGED) {
        staged_groups<R, UNROLL, TILE, GLU>(mmv_smem + mmvq_act_bytes(n, kch, mmvq_min_cols<R>()), w, w2, rows, row_bytes, wr,
                                            warp, lane, k_begin, k_end, kch, stage, compute);
    } else {
        unsigned int staged = ~0u;
        Raw r[UNROLL][2];
        fetch_group(r, k_begin);
        he::pdl_wait();
        for (unsigned int col = k_begin; col < k_end; col += GROUP)
            compute(r, col, enter_chunk(col, k_begin, k_end, kch, staged, stage));
    }

    mmv_write<GLU>(shape, n, rows, rw.a, rw.b, bias, residual, y, ldy, partial, counters, [&](auto &&fn) {
#pragma unroll
        for (int j = 0; j < NT4; j++) {
            const unsigned int tok = 4 * j + t;
            if (tok < n) fn(tok, out[j][0], out[j][1]);
        }
    });
}


// ---- the tile kernel (block formats, more than MMV_PREP_AFTER tokens a launch) ----
// The integer kernel above holds every token tile's sums at once, so it takes 16 tokens a launch and
// reads (and decodes) the weights again for each 16; each block also converts its chunk's activations
// itself. The tile kernel computes the same integers and the same float epilogue, in the same order
// (so the same bits, for any token count), arranged for many tokens: the activations are converted once
// a product (mmvt_prep_kernel, into the workspace after the split sums); a block takes every token of
// the launch (up to 64) against its 128 rows, one 256-column chunk (an activation group) at a time: the
// chunk's weight bytes (each warp's 16 rows, as WeightStage lays them out) and its converted activations
// are copied with cp.async into one of three buffers, two chunks ahead of the arithmetic; a warp decodes its
// rows' quants of the chunk into registers once, then runs them against its token tiles one after the
// other, each tile's sub-block sums and epilogue finished before the next tile starts (so a lane holds
// one float a row and token across chunks, not the integer kernel's five). One block a multiprocessor
// at most (up to 255 registers a thread: a warp's decoded quants and scales stay in registers).

// Words of a token's record a 256-column group: the activation scale (then 3 unused, for 16-byte copies)
// and, for readers with minimums, the group's sums of v per minimum (ints for k-quants, floats else).
template <typename R>
__host__ __device__ constexpr unsigned mmvt_meta() {
    return 4 + (R::HAS_MIN ? MMV_KC / R::STEP : 0);
}
// A token's converted row in the workspace: per 32-column step 32 hi bytes then 32 lo bytes (the
// integer kernel's shared-memory layout), 2 bytes a column.
__host__ __device__ inline size_t mmvt_prep_bytes(unsigned int n, unsigned int cols) { return (size_t)n * cols * 2; }
// Bytes of shared memory a staged chunk's activations take: each token's 512 bytes and 64 of padding
// (mmvq_stride: two tokens a half warp reads in distinct banks), then the tokens' records.
template <typename R>
__host__ __device__ constexpr unsigned mmvt_act_bytes(unsigned n) {
    return n * mmvq_stride(MMV_KC) + n * mmvt_meta<R>() * 4;
}
template <typename R>
__host__ __device__ constexpr unsigned mmvt_stage_bytes(unsigned n) {
    return mmvt_act_bytes<R>(n) + MMV_WARPS * WeightSlots<R, MMV_KC>::SLOT;
}
// The converted activations fit the workspace hostembed_mmv_workspace gives launches of more than
// MMV_PREP_AFTER tokens after the split sums (a token's cols + groups words): a token's cols / 2 words of
// quantized row and META words a group, so cols / 2 >= (META - 1) groups. The tightest case of each
// record size: 32 columns (one group) for 12-word records (16 >= 11), 256 for the 20-word records of the
// 16-column k-quants, whose rows are whole super-blocks.
static_assert(mmvt_meta<QQ4_1>() - 1 <= 32 / 2 && mmvt_meta<QQ2_K>() - 1 <= 256 / 2, "the workspace holds it");
// Chunks in flight: copies of the next two while one computes.
constexpr unsigned MMVT_STAGES = 3;

// One warp a token's 256-column group, converted as the integer kernel's `stage` does: v = rn(x 32639 /
// max|x|) as hi and lo bytes, the group's scale and (readers with minimums) its sums of v.
template <typename R>
__global__ __launch_bounds__(MMV_THREADS) void mmvt_prep_kernel(const float *__restrict__ x, unsigned int n,
                                                                 unsigned int cols, unsigned char *__restrict__ xq,
                                                                 int *__restrict__ meta) {
    he::pdl_launch_dependents();
    constexpr unsigned META = mmvt_meta<R>(), MIN_LANES = R::STEP / 8;
    const unsigned int groups = (cols + MMV_KC - 1) / MMV_KC, lane = threadIdx.x % 32;
    const unsigned int unit = blockIdx.x * MMV_WARPS + threadIdx.x / 32;
    he::pdl_wait();  // x comes from the kernel before; the product before may still read the workspace
    if (unit >= n * groups) return;  // a whole warp
    const unsigned int tok = unit / groups, gi = unit % groups, c0 = gi * MMV_KC;
    const bool here = c0 + 8 * lane < cols;
    float f[8];
    const float amax = stage_unit(x, tok, cols, c0, lane, here, f);
    const float inv = amax > 0.f ? (float)MMVQ_RANGE / amax : 0.f;
    unsigned int hw[2] = {0u, 0u}, lw[2] = {0u, 0u};
    int sum = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int v = __float2int_rn(f[k] * inv);
        const int h = (v + 128) >> 8, l = v - 256 * h;
        hw[k / 4] |= ((unsigned int)h & 0xFFu) << (8 * (k % 4));
        lw[k / 4] |= ((unsigned int)l & 0xFFu) << (8 * (k % 4));
        sum += v;
    }
    if (here) {
        unsigned char *at = xq + (size_t)tok * cols * 2 + (size_t)(c0 + 8 * lane) / 32 * 64 + 8 * (lane % 4);
        *reinterpret_cast<uint2 *>(at) = make_uint2(hw[0], hw[1]);
        *reinterpret_cast<uint2 *>(at + 32) = make_uint2(lw[0], lw[1]);
    }
    int *rec = meta + (size_t)(tok * groups + gi) * META;
    if (lane == 0) rec[0] = __float_as_int(amax / (float)MMVQ_RANGE);
    if constexpr (R::HAS_MIN) {
#pragma unroll
        for (unsigned o = 1; o < MIN_LANES; o *= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);
        // k-quants multiply the sums as integers; block readers take them as floats (exact: |sum| < 2^24).
        if (here && lane % MIN_LANES == 0) rec[4 + lane / MIN_LANES] = R::SUPER ? sum : __float_as_int((float)sum);
    }
}

// The block readers' (not k-quants') step sums d enter the float epilogue as the integer kernel's
// (float)(d_hi 256 + d_lo), which is fmaf((float)d_hi, 256, (float)d_lo) (both exact: |d| <= 32 128 128 =
// 2^19, so the one rounding is of the same integer). Each (float)d is taken without the conversion unit
// (a quarter of the FMA rate): the product adds MMVT_MAGIC, the bits of 1.5 2^23, whose float then holds
// 1.5 2^23 + d exactly for |d| < 2^22, less 1.5 2^23.
constexpr int MMVT_MAGIC = 0x4B400000;
__device__ __forceinline__ float mmvt_float(int biased) { return __int_as_float(biased) - 12582912.f; }

// NT4 token tiles of 4 (4 * NT4 tokens at most).
template <typename R, int NT4, bool GLU>
__global__ __launch_bounds__(MMV_THREADS, 1) void mmvt_kernel(
    const unsigned char *__restrict__ w, const unsigned char *__restrict__ w2, unsigned int rows, unsigned int cols,
    size_t row_bytes, unsigned int n, const float *bias, const float *residual, float *y, unsigned int ldy,
    float *partial, unsigned int *counters) {
    extern __shared__ __align__(16) unsigned char mmv_smem[];
    using WS = WeightSlots<R, MMV_KC>;
    using Raw = typename R::Raw;
    constexpr unsigned TILE = R::STEP * R::TILE_STEPS, TPC = MMV_KC / TILE;
    constexpr unsigned KW = R::STEP / 16, META = mmvt_meta<R>(), XSTRIDE = mmvq_stride(MMV_KC);
    static_assert(MMV_KC % TILE == 0, "whole tiles in a chunk");
    static_assert(WS::BLOCK_BYTES == MMV_WARPS * WS::WARP_BYTES && WS::WARP_BYTES == WS::STAGES * WS::SLOT,
                  "a warp's rows of a chunk fill one of WeightSlots' slots");

    const unsigned int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
    he::pdl_launch_dependents();
    const MmvShape shape = mmv_shape(rows, cols, GLU, true);
    const unsigned int k_begin = blockIdx.y * shape.kr;
    const unsigned int k_end = min(cols, k_begin + shape.kr);
    const unsigned int chunks = (k_end - k_begin + MMV_KC - 1) / MMV_KC, groups = (cols + MMV_KC - 1) / MMV_KC;
    // The converted activations (mmvt_prep_kernel's), after the split sums of the non-rounded shape.
    const unsigned char *xq =
        reinterpret_cast<const unsigned char *>(partial + mmv_prep_offset(mmv_shape(rows, cols, GLU), GLU, n, rows));
    const unsigned char *xmeta = xq + mmvt_prep_bytes(n, cols);
    const unsigned int act = mmvt_act_bytes<R>(n), stage_bytes = act + MMV_WARPS * WS::SLOT;
    const MmvRows rw = mmv_rows<GLU>(w, w2, rows, row_bytes, warp, g);

    // Chunk ci's copies into buffer ci % MMVT_STAGES: each warp its rows' weight bytes, every thread a
    // share of the activations (512 bytes and the record a token; 32-column steps past the range as zeros).
    auto issue_weights = [&](unsigned int ci) {
        if (ci < chunks) {
            const unsigned int c0 = k_begin + ci * MMV_KC;
            const unsigned int len = (min(c0 + MMV_KC, k_end) - c0) / R::BLOCK_COLS * R::BYTES;
            copy_rows<WS, GLU>(mmv_smem + (ci % MMVT_STAGES) * stage_bytes + act + warp * WS::SLOT, w, w2, rows,
                               row_bytes, warp, lane, (size_t)(c0 / R::BLOCK_COLS) * R::BYTES, len);
        }
    };
    // A warp a token: lane p its 16-byte piece p of the row (4 a step: hi, then lo), the first lanes the
    // record (a division by the pieces a token took more instructions than the copies).
    auto issue_acts = [&](unsigned int ci) {
        if (ci < chunks) {
            const unsigned int c0 = k_begin + ci * MMV_KC;
            constexpr unsigned PIECES = MMV_KC * 2 / 16, MPIECES = META / 4;
            static_assert(PIECES == 32 && MPIECES <= 32, "a lane a piece");
            unsigned char *buf = mmv_smem + (ci % MMVT_STAGES) * stage_bytes;
            const bool valid = c0 + 32 * (lane / 4) < k_end;  // 32-column steps past the range as zeros
            for (unsigned int tok = warp; tok < n; tok += MMV_WARPS) {
                const unsigned char *row = xq + (size_t)tok * cols * 2;
                he::cp_async16(buf + tok * XSTRIDE + 16 * lane, valid ? row + (size_t)c0 * 2 + 16 * lane : row, valid);
                if (lane < MPIECES)
                    he::cp_async16(buf + n * XSTRIDE + (tok * META + 4 * lane) * 4,
                                   xmeta + ((size_t)tok * groups + c0 / MMV_KC) * META * 4 + 16 * lane, true);
            }
        }
    };

    float out[NT4][2];
#pragma unroll
    for (int j = 0; j < NT4; j++) out[j][0] = out[j][1] = 0.f;

    // The warp's rows against its token tiles over one chunk (`len` columns from c0) in buffer `buf`.
    auto compute = [&](const unsigned char *buf, unsigned int c0, unsigned int len) {
        const unsigned char *xs = buf;
        const int *meta = reinterpret_cast<const int *>(buf + n * XSTRIDE);
        const unsigned char *slot = buf + act + warp * WS::SLOT;
        const size_t start = (size_t)(c0 / R::BLOCK_COLS) * R::BYTES;
        const unsigned char *sa = slot + g * WS::ROW + ((reinterpret_cast<uintptr_t>(rw.wa) + start) & 15);
        const unsigned char *sb = slot + (8 + g) * WS::ROW + ((reinterpret_cast<uintptr_t>(rw.wb) + start) & 15);
        Raw r[TPC][2];
#pragma unroll
        for (int u = 0; u < (int)TPC; u++)
            if (u * TILE < len) {
                R::template fetch<true>(r[u][0], sa, u * TILE, t);
                R::template fetch<true>(r[u][1], sb, u * TILE, t);
            }
        // The chunk's A words and scales, decoded once for every token tile.
        unsigned int wa[TPC][R::TILE_STEPS][KW], wb[TPC][R::TILE_STEPS][KW];
        int isa[TPC][R::TILE_STEPS], isb[TPC][R::TILE_STEPS], ima[TPC][R::TILE_STEPS], imb[TPC][R::TILE_STEPS];
        float fsa[TPC], fsb[TPC], fmn_a[TPC], fmn_b[TPC];
#pragma unroll
        for (int u = 0; u < (int)TPC; u++) {
#pragma unroll
            for (int s = 0; s < (int)R::TILE_STEPS; s++) {
                R::a(r[u][0], s, wa[u][s], t);
                R::a(r[u][1], s, wb[u][s], t);
                if constexpr (R::SUPER) {
                    isa[u][s] = R::isc(r[u][0], s), isb[u][s] = R::isc(r[u][1], s);
                    if constexpr (R::HAS_MIN) ima[u][s] = R::imin(r[u][0], s), imb[u][s] = R::imin(r[u][1], s);
                }
            }
            if constexpr (!R::SUPER) {
                fsa[u] = R::fsc(r[u][0], 0), fsb[u] = R::fsc(r[u][1], 0);
                if constexpr (R::HAS_MIN) fmn_a[u] = R::fmin(r[u][0], 0), fmn_b[u] = R::fmin(r[u][1], 0);
            }
        }
        float da = 1.f, db = 1.f, ma = 0.f, mb = 0.f;
        if constexpr (R::SUPER) {
            R::tile(r[TPC - 1][0], da, ma);
            R::tile(r[TPC - 1][1], db, mb);
        }
#pragma unroll
        for (int j = 0; j < NT4; j++) {
            const unsigned int tb = 4 * j;
            // Absent tokens four tiles at a time: a branch between every two tiles kept the scheduler from
            // overlapping one tile's sums with the next tile's tensor-core products.
            if (j % 4 == 0 && tb >= n) break;
            // B column g: token tb + g / 2 (absent ones reread the last), its hi (even g) or lo half; the
            // lane's outputs are token tb + t's.
            const unsigned char *xb = xs + min(tb + g / 2, n - 1) * XSTRIDE + (g % 2) * 32 + (R::STEP / 4) * t;
            const int *rec = meta + min(tb + t, n - 1) * META;
            int ihi[2] = {0, 0}, ilo[2] = {0, 0}, mins[2] = {0, 0};
            float acc[2] = {0.f, 0.f};
#pragma unroll
            for (int u = 0; u < (int)TPC; u++) {
                if (u * TILE >= len) break;
#pragma unroll
                for (int s = 0; s < (int)R::TILE_STEPS; s++) {
                    const unsigned int c = u * TILE + s * R::STEP;  // column within the chunk
                    const unsigned char *bp = xb + (c / 32) * 64 + c % 32;
                    int d[4];
                    if constexpr (R::STEP == 32) {
                        const uint2 b = *reinterpret_cast<const uint2 *>(bp);
                        mma_k32<R::SIGNED>(d, wa[u][s][0], wb[u][s][0], wa[u][s][KW - 1], wb[u][s][KW - 1], b.x, b.y,
                                           R::SUPER ? 0 : MMVT_MAGIC);
                    } else {
                        const unsigned int b = *reinterpret_cast<const unsigned int *>(bp);
                        mma_k16<R::SIGNED>(d, wa[u][s][0], wb[u][s][0], b);
                    }
                    // As the integer kernel: d[0], d[1] row a's hi and lo sums, d[2], d[3] row b's.
                    if constexpr (R::SUPER) {
                        ihi[0] += isa[u][s] * d[0], ilo[0] += isa[u][s] * d[1];
                        ihi[1] += isb[u][s] * d[2], ilo[1] += isb[u][s] * d[3];
                        if constexpr (R::HAS_MIN) {
                            const int xs_sum = rec[4 + c / R::STEP];
                            mins[0] += ima[u][s] * xs_sum;
                            mins[1] += imb[u][s] * xs_sum;
                        }
                    } else {
                        static_assert(R::STEP == 32, "block readers take 32-column steps");
                        acc[0] = fmaf(fsa[u], fmaf(mmvt_float(d[0]), 256.f, mmvt_float(d[1])), acc[0]);
                        acc[1] = fmaf(fsb[u], fmaf(mmvt_float(d[2]), 256.f, mmvt_float(d[3])), acc[1]);
                        if constexpr (R::HAS_MIN) {
                            const float xs_sum = __int_as_float(rec[4 + c / R::STEP]);
                            acc[0] = fmaf(fmn_a[u], xs_sum, acc[0]);
                            acc[1] = fmaf(fmn_b[u], xs_sum, acc[1]);
                        }
                    }
                }
            }
            // The group ends with the chunk: its scales into the sum, as the integer kernel's epilogue.
            const float sc = __int_as_float(rec[0]);
            if constexpr (R::SUPER) {
#pragma unroll
                for (int e = 0; e < 2; e++) acc[e] = fmaf((float)ihi[e], 256.f, (float)ilo[e]);
            }
            out[j][0] = fmaf(da * sc, acc[0], out[j][0]);
            out[j][1] = fmaf(db * sc, acc[1], out[j][1]);
            if constexpr (R::SUPER && R::HAS_MIN) {
                out[j][0] = fmaf(ma * sc, (float)mins[0], out[j][0]);
                out[j][1] = fmaf(mb * sc, (float)mins[1], out[j][1]);
            }
        }
    };

    // MMVT_STAGES buffers, a commit group a chunk: chunk ci + STAGES - 1's copies go out once every warp
    // has left chunk ci - 1, whose buffer they take (the barrier that also makes chunk ci's copies every
    // thread's), so the arithmetic of the chunks before hides them.
    static_assert(MMVT_STAGES >= 2, "a chunk ahead at least");
    issue_weights(0);  // the weights do not depend on the kernel before
    he::pdl_wait();     // the converted activations come from mmvt_prep_kernel
    issue_acts(0);
    he::cp_async_commit();
#pragma unroll
    for (unsigned int ci = 1; ci + 1 < MMVT_STAGES; ci++) {
        issue_weights(ci);
        issue_acts(ci);
        he::cp_async_commit();
    }
    for (unsigned int ci = 0; ci < chunks; ci++) {
        he::cp_async_wait<MMVT_STAGES - 2>();
        __syncthreads();
        issue_weights(ci + MMVT_STAGES - 1);
        issue_acts(ci + MMVT_STAGES - 1);
        he::cp_async_commit();
        const unsigned int c0 = k_begin + ci * MMV_KC;
        compute(mmv_smem + (ci % MMVT_STAGES) * stage_bytes, c0, min(c0 + MMV_KC, k_end) - c0);
    }

    mmv_write<GLU>(shape, n, rows, rw.a, rw.b, bias, residual, y, ldy, partial, counters, [&](auto &&fn) {
#pragma unroll
        for (int j = 0; j < NT4; j++) {
            const unsigned int tok = 4 * j + t;
            if (tok < n) fn(tok, out[j][0], out[j][1]);
        }
    });
}

// Whether this device gives a block the tile kernel's shared memory for `n` tokens (3 x 75 KiB at most,
// at 64 tokens: sm_90's 227 KiB holds every reader's; smaller cards' launches stay on the integer kernel,
// which gives the same bits).
template <typename R>
bool mmvt_fits(unsigned int n) {
    int dev = 0, most = 0;
    return cudaGetDevice(&dev) == cudaSuccess &&
           cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess &&
           (size_t)MMVT_STAGES * mmvt_stage_bytes<R>(n) <= (size_t)most;
}

// A launch of `n` (MMV_PREP_AFTER < n <= MMV_MAX_TOKENS) tokens on the tile kernel: the conversion,
// then the product.
template <typename R, bool GLU>
cudaError_t launch_mmvt(const unsigned char *w, const unsigned char *w2, unsigned int rows, unsigned int cols,
                        size_t row_bytes, const float *x, unsigned int n, const float *bias, const float *residual,
                        float *y, unsigned int ldy, float *partial, unsigned int *counters,
                        const hostembed_tuning &tuning, cudaStream_t stream) {
    const MmvShape shape = mmv_shape(rows, cols, GLU, true);
    unsigned char *xq = reinterpret_cast<unsigned char *>(partial + mmv_prep_offset(mmv_shape(rows, cols, GLU), GLU, n, rows));
    const unsigned int units = n * ((cols + MMV_KC - 1) / MMV_KC);
    cudaError_t e = he::launch_overlapped(tuning, mmvt_prep_kernel<R>, dim3((units + MMV_WARPS - 1) / MMV_WARPS),
                                          dim3(MMV_THREADS), 0, stream, x, n, cols, xq,
                                          reinterpret_cast<int *>(xq + mmvt_prep_bytes(n, cols)));
    if (e != cudaSuccess) return e;
    const int smem = (int)(MMVT_STAGES * mmvt_stage_bytes<R>(n));
    auto go = [&](auto kernel) {
        cudaError_t err = he::allow_smem(kernel, smem);
        if (err != cudaSuccess) return err;
        return he::launch_overlapped(tuning, kernel, dim3(shape.row_blocks, shape.splits), dim3(MMV_THREADS), (size_t)smem,
                                     stream, w, w2, rows, cols, row_bytes, n, bias, residual, y, ldy, partial,
                                     counters);
    };
    if (n <= 16) return go(mmvt_kernel<R, 4, GLU>);
    if (n <= 32) return go(mmvt_kernel<R, 8, GLU>);
    return go(mmvt_kernel<R, 16, GLU>);
}

// Tokens an integer launch takes: MMVQ_LAUNCH_TOKENS, or hostembed_tuning's mmvq_tokens (1 to
// MMVQ_MAX_TOKENS), to measure. Any split gives a token the same bits.
inline unsigned int mmvq_launch_tokens(const hostembed_tuning &tuning) {
    const unsigned int t = tuning.mmvq_tokens;
    const unsigned int most = MMV_TUNING_KERNELS ? MMVQ_MAX_TOKENS : MMVQ_LAUNCH_TOKENS;
    return t >= 1 && t <= most ? t : MMVQ_LAUNCH_TOKENS;
}

template <typename R, bool GLU, bool STAGED>
cudaError_t launch_mmv(const unsigned char *w, const unsigned char *w2, unsigned int rows, unsigned int cols,
                       size_t row_bytes, const float *x, unsigned int n, const float *bias, const float *residual,
                       float *y, unsigned int ldy, float *partial, unsigned int *counters,
                       const hostembed_tuning &tuning, cudaStream_t stream) {
    const MmvShape shape = mmv_shape(rows, cols, GLU, true);
    const dim3 grid(shape.row_blocks, shape.splits);
    // The tile kernel (hostembed_tuning's mmv_tc_blocks, where the card has its shared memory) takes integer
    // launches of more than MMV_PREP_AFTER tokens, up to MMV_MAX_TOKENS at once; a launch of fewer takes
    // the integer kernel.
    bool tile = false;
    if constexpr (R::INT) tile = tuning.mmv_tc_blocks != 0 && n > MMV_PREP_AFTER && mmvt_fits<R>(min(n, MMV_MAX_TOKENS));
    const unsigned int MAX = R::INT && !tile ? mmvq_launch_tokens(tuning) : MMV_MAX_TOKENS;
    constexpr unsigned GROUP = mmv_group<R, STAGED>();
    constexpr unsigned WEIGHTS = STAGED ? WeightSlots<R, GROUP>::BLOCK_BYTES : 0;
    for (unsigned int t0 = 0; t0 < n; t0 += MAX) {
        const unsigned int nt = min(MAX, n - t0);
        const float *xt = x + (size_t)t0 * cols;
        const float *rt = residual != nullptr ? residual + (size_t)t0 * ldy : nullptr;
        float *yt = y + (size_t)t0 * ldy;
        const bool prep = !R::INT && !STAGED && nt > MMV_PREP_AFTER && tuning.mmv_prep != 0;
        int smem;
        if constexpr (R::INT) smem = (int)(mmvq_act_bytes(nt, mmv_chunk(nt, shape.kr, 2, mmvq_unit(GROUP)), mmvq_min_cols<R>()) + WEIGHTS);
        else smem = (int)(mmv_half_smem(nt, shape.kr, GROUP, R::SCALED, prep) + WEIGHTS);
        if constexpr (!R::INT && !STAGED) {
            if (prep) {
                float *staged = partial + mmv_prep_offset(mmv_shape(rows, cols, GLU), GLU, nt, rows);
                const unsigned int warps = nt * ((cols + MMV_KC - 1) / MMV_KC);
                const cudaError_t e = he::launch_overlapped(
                    tuning, mmv_prep_kernel<R>, dim3((warps + MMV_WARPS - 1) / MMV_WARPS), dim3(MMV_THREADS), 0, stream,
                    xt, nt, cols, reinterpret_cast<uint4 *>(staged),
                    reinterpret_cast<int *>(staged + (size_t)nt * cols));
                if (e != cudaSuccess) return e;
            }
        }
        auto go = [&](auto kernel) {
            cudaError_t e = he::allow_smem(kernel, smem);
            if (e != cudaSuccess) return e;
            return he::launch_overlapped(tuning, kernel, grid, dim3(MMV_THREADS), (size_t)smem, stream, w, w2, rows,
                                         cols, row_bytes, xt, nt, bias, rt, yt, ldy, partial, counters);
        };
        cudaError_t e;
        if constexpr (R::INT) {
            if (tile && nt > MMV_PREP_AFTER)
                e = launch_mmvt<R, GLU>(w, w2, rows, cols, row_bytes, xt, nt, bias, rt, yt, ldy, partial, counters, tuning,
                                        stream);
            else if (nt <= 4) e = go(mmvq_kernel<R, 1, GLU, STAGED>);
            else if (nt <= 8) e = go(mmvq_kernel<R, 2, GLU, STAGED>);
            else if (nt <= 16) e = go(mmvq_kernel<R, 4, GLU, STAGED>);
            else if constexpr (MMV_TUNING_KERNELS) e = go(mmvq_kernel<R, 8, GLU, STAGED>);
            else e = cudaErrorNotSupported;  // mmvq_launch_tokens keeps these builds at 16
        } else if constexpr (!STAGED) {
            static_assert(MMV_PREP_AFTER == 8, "the first tile count that converts once");
            if (nt <= 8) e = go(mmv_kernel<R, 1, GLU, false>);
            else if (nt <= 16) e = prep ? go(mmv_kernel<R, 2, GLU, false, true>) : go(mmv_kernel<R, 2, GLU, false>);
            else if (nt <= 32) e = prep ? go(mmv_kernel<R, 4, GLU, false, true>) : go(mmv_kernel<R, 4, GLU, false>);
            else e = prep ? go(mmv_kernel<R, 8, GLU, false, true>) : go(mmv_kernel<R, 8, GLU, false>);
        } else {
            if (nt <= 8) e = go(mmv_kernel<R, 1, GLU, STAGED>);
            else if (nt <= 16) e = go(mmv_kernel<R, 2, GLU, STAGED>);
            else if (nt <= 32) e = go(mmv_kernel<R, 4, GLU, STAGED>);
            else e = go(mmv_kernel<R, 8, GLU, STAGED>);
        }
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

// Whether the tensor-core decode product takes this format and shape: a lane reader, whole tiles of
// columns, rows whose blocks keep the reader's alignment, and at least a column range per split.
template <typename R>
bool mmv_fits(int dtype, const void *w, unsigned int cols) {
    bool ok = false;
    he::with_format(dtype, [&](auto format) {
        using F = decltype(format);
        const size_t rb = he::row_bytes<F>(cols);
        unsigned int tile = R::STEP;
        if constexpr (R::INT) tile = R::STEP * R::TILE_STEPS;
        ok = rb != 0 && cols % tile == 0 && cols % 8 == 0 && rb % R::ALIGN == 0 &&
             reinterpret_cast<uintptr_t>(w) % R::ALIGN == 0;
    });
    return ok;
}

}  // namespace

extern "C" cudaError_t hostembed_mmv_supports(int dtype, const void *w, unsigned int cols) {
    bool ok = false;
    const bool has = with_reader(dtype, [&](auto reader) { ok = mmv_fits<decltype(reader)>(dtype, w, cols); });
    return has && ok ? cudaSuccess : cudaErrorNotSupported;
}

extern "C" cudaError_t hostembed_mmv_workspace(unsigned int rows, unsigned int cols, int glu, unsigned int n,
                                               size_t *partial_floats, unsigned int *counters) {
    if (partial_floats == nullptr || counters == nullptr || rows == 0 || cols == 0) return cudaErrorInvalidValue;
    const MmvShape s = mmv_shape(rows, cols, glu != 0);
    const unsigned int nt = min(n, MMV_MAX_TOKENS);
    // The split sums, then (half kernels past MMV_PREP_AFTER tokens) the activations staged once.
    *partial_floats = nt > MMV_PREP_AFTER ? mmv_prep_offset(s, glu != 0, nt, rows) + mmv_prep_floats(nt, cols)
                                          : (s.splits > 1 ? (size_t)s.splits * (glu ? 2 : 1) * nt * rows : 0);
    *counters = s.splits > 1 ? s.row_blocks : 0;
    return cudaSuccess;
}

template <bool GLU>
static cudaError_t mmv_entry(const void *w, const void *w2, int dtype, unsigned int rows, unsigned int cols,
                             const float *x, unsigned int n, const float *bias, const float *residual, float *y,
                             unsigned int ldy, float *partial, unsigned int *counters, const hostembed_tuning &tuning,
                             cudaStream_t stream) {
    if (w == nullptr || (GLU && w2 == nullptr) || x == nullptr || y == nullptr) return cudaErrorInvalidValue;
    if (rows == 0 || cols == 0 || ldy < rows || reinterpret_cast<uintptr_t>(x) % 16 != 0) return cudaErrorInvalidValue;
    if (hostembed_mmv_supports(dtype, w, cols) != cudaSuccess) return cudaErrorNotSupported;
    if (GLU && hostembed_mmv_supports(dtype, w2, cols) != cudaSuccess) return cudaErrorNotSupported;
    const MmvShape s = mmv_shape(rows, cols, GLU);
    if (s.splits > 1 && (partial == nullptr || counters == nullptr)) return cudaErrorInvalidValue;
    // The half kernels past MMV_PREP_AFTER tokens stage the activations in the workspace (16-byte rows).
    if (n > MMV_PREP_AFTER && (partial == nullptr || reinterpret_cast<uintptr_t>(partial) % 16 != 0))
        return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    cudaError_t err = cudaErrorNotSupported;
    const unsigned char *wb = static_cast<const unsigned char *>(w), *wb2 = static_cast<const unsigned char *>(w2);
    with_reader(dtype, [&](auto reader) {
        using R = decltype(reader);
        he::with_format(dtype, [&](auto format) {
            using F = decltype(format);
            const size_t rb = he::row_bytes<F>(cols);
            // Formats that never stage by default have their staged kernels in tuning builds only.
            if constexpr (MMV_TUNING_KERNELS || R::STAGE_TOKENS > 0)
                if (mmv_staged<R>(tuning, n))
                    return void(err = launch_mmv<R, GLU, true>(wb, wb2, rows, cols, rb, x, n, bias, residual, y, ldy,
                                                                partial, counters, tuning, stream));
            err = launch_mmv<R, GLU, false>(wb, wb2, rows, cols, rb, x, n, bias, residual, y, ldy, partial, counters,
                                            tuning, stream);
        });
    });
    return err;
}

extern "C" cudaError_t hostembed_mmv(const void *w, int dtype, unsigned int rows, unsigned int cols, const float *x,
                                     unsigned int n, const float *bias, const float *residual, float *y,
                                     unsigned int ldy, float *partial, unsigned int *counters, hostembed_tuning tuning,
                                     cudaStream_t stream) {
    return mmv_entry<false>(w, nullptr, dtype, rows, cols, x, n, bias, residual, y, ldy, partial, counters, tuning,
                            stream);
}

extern "C" cudaError_t hostembed_mmv_swiglu(const void *w_gate, const void *w_up, int dtype, unsigned int rows,
                                            unsigned int cols, const float *x, unsigned int n, float *y,
                                            float *partial, unsigned int *counters, hostembed_tuning tuning,
                                            cudaStream_t stream) {
    return mmv_entry<true>(w_gate, w_up, dtype, rows, cols, x, n, nullptr, nullptr, y, rows, partial, counters, tuning,
                           stream);
}
