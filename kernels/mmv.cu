// Decode products on tensor cores: y[t] = W x[t] for up to MMV_MAX_TOKENS tokens a launch, W read once
// for all of them, and every token's result the same bits whatever the other tokens are (batch
// invariance): mma.sync computes each output from its own row of A and column of B only, the K order is
// fixed, and how a matrix is split depends on its shape alone, never on the token count.
//
// Operands: the tokens are mma's M (16 a tile, up to 4 tiles), weight rows its N (8 a tile), K the
// columns. Each f32 activation enters as two bf16s, hi = rn(x) and lo = rn(x - hi), each multiplied and
// accumulated in f32 (about 16 significant bits of x: the product stays within f32-activation rounding of
// the CPU's, where bf16 activations alone would cost ~1e-3). Weights enter as stored: bf16 rows directly,
// block formats as their small integer quants (exact in bf16), each step's partial product then scaled
// by the row's scale (and the offset times the step's activation sum) in f32.
//
// Layout: a block of 8 warps takes 128 weight rows (each warp two n-tiles: rows g and g + 8 of its 16;
// a GLU launch puts 8 gate rows and the same 8 up rows in a warp) and one of `splits` column ranges. The
// activations of a 256-column chunk are staged once per block in shared memory, hi and lo side by side;
// each lane then streams its weight rows straight from memory into registers (several steps in flight),
// and reads its A fragments from shared memory. A lane (g, t) holds, per 16-column k-step, the 4 columns
// the step's `group(t)` names: b0 = W[row g][those 0, 1], b1 = [2, 3], and A's a0/a2 the same columns of
// token g (a1/a3 of token g + 8). With splits > 1 each block writes its partial sums, and the last block
// of a row range to arrive (an atomic counter) adds them in split order and applies the epilogue.
#include "formats.cuh"

namespace {

constexpr int MMV_WARPS = 8;
constexpr int MMV_THREADS = MMV_WARPS * 32;
constexpr unsigned MMV_BLOCK_ROWS = MMV_WARPS * 16;
constexpr unsigned MMV_KC = 256;  // columns of x staged at a time
constexpr unsigned MMV_MAX_TOKENS = 64;
constexpr unsigned MMV_TARGET_BLOCKS = 256;  // about two blocks a multiprocessor on a 132-SM card
constexpr unsigned MMV_MAX_ROW_BLOCKS_SPLIT = MMV_TARGET_BLOCKS;  // a split product has fewer row blocks
// One token's staged chunk: groups of 4 columns, hi[4] then lo[4] (16 bytes), then padding that puts the
// 16-byte reads of a quarter warp (tokens g and g + 1, lanes t = 0..3) in distinct banks: lanes 32 bytes
// apart (32-column steps) want the next token 16 bytes on, lanes 16 bytes apart want it 64 bytes on.
constexpr unsigned mmv_token_stride(unsigned step) { return MMV_KC / 4 * 16 + (step == 32 ? 16 : 64); }

// How a matrix is cut: its row blocks, and its columns in `splits` ranges of `kr` (a multiple of MMV_KC).
struct MmvShape {
    unsigned int row_blocks, splits, kr;
};

__host__ __device__ inline MmvShape mmv_shape(unsigned int rows, unsigned int cols, bool glu) {
    const unsigned int out_rows = glu ? MMV_BLOCK_ROWS / 2 : MMV_BLOCK_ROWS;
    MmvShape s;
    s.row_blocks = (rows + out_rows - 1) / out_rows;
    unsigned int splits = (MMV_TARGET_BLOCKS + s.row_blocks - 1) / s.row_blocks;
    const unsigned int chunks = (cols + MMV_KC - 1) / MMV_KC;
    splits = splits < chunks ? splits : chunks;
    if (s.row_blocks > MMV_MAX_ROW_BLOCKS_SPLIT || splits == 0) splits = 1;
    s.kr = (chunks + splits - 1) / splits * MMV_KC;
    s.splits = (cols + s.kr - 1) / s.kr;
    return s;
}

// ---- small helpers ----

__device__ __forceinline__ unsigned int pack_bf16(float lo, float hi) { return he::Bf16Op::pack(lo, hi); }

// The 32-bit word at p, whose address is 2-byte aligned (two 16-bit loads unless it is 4-byte aligned).
__device__ __forceinline__ unsigned int ld32_a2(const unsigned char *p) {
    if ((reinterpret_cast<uintptr_t>(p) & 3) == 0) return __ldg(reinterpret_cast<const unsigned int *>(p));
    const unsigned short *h = reinterpret_cast<const unsigned short *>(p);
    return (unsigned int)__ldg(h) | ((unsigned int)__ldg(h + 1) << 16);
}

__device__ __forceinline__ float ld_f16(const unsigned char *p) {
    return he::f16_bits_to_f32(__ldg(reinterpret_cast<const unsigned short *>(p)));
}

// Bytes 0 and 1 (or 2 and 3) of w, each 0..127, as the bf16 pair (q0, q1), exactly, less `bias` each.
// 0x43 above a byte is the bf16 128 + byte; one packed subtraction takes 128 + bias off.
__device__ __forceinline__ unsigned int bytes_bf16(unsigned int w, unsigned int sel, __nv_bfloat162 off) {
    const unsigned int v = __byte_perm(w, 0x43u, sel);
    __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162 *>(&v);
    b = __hsub2(b, off);
    return *reinterpret_cast<const unsigned int *>(&b);
}
constexpr unsigned int SEL_LO = 0x4140u, SEL_HI = 0x4342u;

// The 4 bytes of w (each 0..127) less `bias` as two bf16 pairs: b0 = (q0, q1), b1 = (q2, q3).
__device__ __forceinline__ void small_ints(unsigned int w, float bias, unsigned int &b0, unsigned int &b1) {
    const __nv_bfloat162 off = __floats2bfloat162_rn(128.f + bias, 128.f + bias);
    b0 = bytes_bf16(w, SEL_LO, off);
    b1 = bytes_bf16(w, SEL_HI, off);
}

// The 4 signed bytes of w as two exact bf16 pairs (int8 needs the f32 route: 128 + q is past bf16's
// integers).
__device__ __forceinline__ void signed_bytes(unsigned int w, unsigned int &b0, unsigned int &b1) {
    const float q0 = (float)(signed char)(w & 0xFFu), q1 = (float)(signed char)((w >> 8) & 0xFFu);
    const float q2 = (float)(signed char)((w >> 16) & 0xFFu), q3 = (float)(signed char)(w >> 24);
    b0 = pack_bf16(q0, q1);
    b1 = pack_bf16(q2, q3);
}

// ---- the formats' lane readers ----
// Each reader gives, for STEP columns (one or two 16-column k-steps; group(t, k) is the first of the 4
// columns lane t holds in k-step k), the B fragments of one weight row, and for scaled formats the scale
// and offset of the two rows of the lane's D fragment (rows 2t and 2t + 1 of its n-tile), which it loads
// itself rather than shuffling them from the lanes that read those rows. A read is split into `fetch`
// (the loads of TILE_STEPS steps, issued before any use) and `frag` (the arithmetic of one step).

// BF16 rows: a 32-column step is one 16-byte load of columns 8t .. 8t + 7 (k-step 0: 8t..8t+3).
struct MmaBF16 {
    static constexpr unsigned STEP = 32, KSTEPS = 2, TILE_STEPS = 1, UNROLL = 4, ALIGN = 16;
    static constexpr bool SCALED = false, HAS_MIN = false;
    struct Raw {
        uint4 q;
    };
    static __device__ __forceinline__ unsigned int group(unsigned int t, unsigned int k) { return 8 * t + 4 * k; }
    static __device__ __forceinline__ void fetch(Raw &r, const unsigned char *row, const unsigned char *, const unsigned char *,
                                                 unsigned int col, unsigned int t) {
        r.q = he::load_stream16(row + 2 * ((size_t)col + 8 * t));
    }
    static __device__ __forceinline__ void frag(const Raw &r, int, unsigned int (&b)[KSTEPS][2], float (&)[2],
                                                float (&)[2]) {
        b[0][0] = r.q.x, b[0][1] = r.q.y, b[1][0] = r.q.z, b[1][1] = r.q.w;
    }
};

// Q8_0: a step is one 34-byte block (2-byte aligned); lane t takes quants 8t .. 8t + 7.
struct MmaQ8_0 {
    static constexpr unsigned STEP = 32, KSTEPS = 2, TILE_STEPS = 1, UNROLL = 4, BYTES = 34, ALIGN = 2;
    static constexpr bool SCALED = true, HAS_MIN = false;
    struct Raw {
        unsigned int q0, q1;
        float sa, sb;
    };
    static __device__ __forceinline__ unsigned int group(unsigned int t, unsigned int k) { return 8 * t + 4 * k; }
    static __device__ __forceinline__ void fetch(Raw &r, const unsigned char *row, const unsigned char *ra,
                                                 const unsigned char *rb, unsigned int col, unsigned int t) {
        const size_t at = (size_t)(col / 32) * BYTES;
        r.q0 = ld32_a2(row + at + 2 + 8 * t);
        r.q1 = ld32_a2(row + at + 6 + 8 * t);
        r.sa = ld_f16(ra + at);
        r.sb = ld_f16(rb + at);
    }
    static __device__ __forceinline__ void frag(const Raw &r, int, unsigned int (&b)[KSTEPS][2], float (&scale)[2],
                                                float (&add)[2]) {
        signed_bytes(r.q0, b[0][0], b[0][1]);
        signed_bytes(r.q1, b[1][0], b[1][1]);
        scale[0] = r.sa, scale[1] = r.sb, add[0] = add[1] = 0.f;
    }
};

// Q4_0: a step is one 18-byte block; lane t takes values 8t .. 8t + 7: the low (t < 2) or high nibbles
// of bytes 8(t % 2) .. + 7.
struct MmaQ4_0 {
    static constexpr unsigned STEP = 32, KSTEPS = 2, TILE_STEPS = 1, UNROLL = 4, BYTES = 18, ALIGN = 2;
    static constexpr bool SCALED = true, HAS_MIN = false;
    struct Raw {
        unsigned int q0, q1;
        float sa, sb;
    };
    static __device__ __forceinline__ unsigned int group(unsigned int t, unsigned int k) { return 8 * t + 4 * k; }
    static __device__ __forceinline__ void fetch(Raw &r, const unsigned char *row, const unsigned char *ra,
                                                 const unsigned char *rb, unsigned int col, unsigned int t) {
        const size_t at = (size_t)(col / 32) * BYTES;
        const unsigned int shift = t < 2 ? 0 : 4;
        r.q0 = (ld32_a2(row + at + 2 + 8 * (t % 2)) >> shift) & 0x0F0F0F0Fu;
        r.q1 = (ld32_a2(row + at + 6 + 8 * (t % 2)) >> shift) & 0x0F0F0F0Fu;
        r.sa = ld_f16(ra + at);
        r.sb = ld_f16(rb + at);
    }
    static __device__ __forceinline__ void frag(const Raw &r, int, unsigned int (&b)[KSTEPS][2], float (&scale)[2],
                                                float (&add)[2]) {
        small_ints(r.q0, 8.f, b[0][0], b[0][1]);
        small_ints(r.q1, 8.f, b[1][0], b[1][1]);
        scale[0] = r.sa, scale[1] = r.sb, add[0] = add[1] = 0.f;
    }
};

// The 6-bit scale and min of sub-block u from a Q4_K / Q5_K header held as 4 words (d, dmin, 12 bytes).
__device__ __forceinline__ void k4_scale_min(const uint4 &h, int u, float &scale, float &add) {
    const unsigned int s[3] = {h.y, h.z, h.w};  // the 12 scale bytes
    auto byte = [&](int i) { return (s[i / 4] >> (8 * (i % 4))) & 0xFFu; };
    unsigned int sc, m;
    if (u < 4) {
        sc = byte(u) & 63u;
        m = byte(u + 4) & 63u;
    } else {
        sc = (byte(u + 4) & 0xFu) | ((byte(u - 4) >> 6) << 4);
        m = (byte(u + 4) >> 4) | ((byte(u) >> 6) << 4);
    }
    scale = he::f16_bits_to_f32(h.x & 0xFFFFu) * (float)sc;
    add = -(he::f16_bits_to_f32(h.x >> 16) * (float)m);
}

// Q4_K: a tile is a 144-byte super-block (8 steps of 32: its sub-blocks); lane t takes values 8t .. 8t + 7
// of each sub-block: bytes 8t .. + 7 of the 32 at 32(u / 2), low nibbles for even u.
struct MmaQ4_K {
    static constexpr unsigned STEP = 32, KSTEPS = 2, TILE_STEPS = 8, UNROLL = 1, BYTES = 144, QS = 16, ALIGN = 16;
    static constexpr bool SCALED = true, HAS_MIN = true;
    struct Raw {
        uint2 q[4];
        uint4 ha, hb;
    };
    static __device__ __forceinline__ unsigned int group(unsigned int t, unsigned int k) { return 8 * t + 4 * k; }
    static __device__ __forceinline__ void fetch(Raw &r, const unsigned char *row, const unsigned char *ra,
                                                 const unsigned char *rb, unsigned int col, unsigned int t) {
        const size_t at = (size_t)(col / 256) * BYTES;
#pragma unroll
        for (int p = 0; p < 4; p++) r.q[p] = __ldg(reinterpret_cast<const uint2 *>(row + at + QS + 32 * p + 8 * t));
        r.ha = __ldg(reinterpret_cast<const uint4 *>(ra + at));
        r.hb = __ldg(reinterpret_cast<const uint4 *>(rb + at));
    }
    static __device__ __forceinline__ void frag(const Raw &r, int u, unsigned int (&b)[KSTEPS][2], float (&scale)[2],
                                                float (&add)[2]) {
        const unsigned int shift = u % 2 ? 4 : 0;
        small_ints((r.q[u / 2].x >> shift) & 0x0F0F0F0Fu, 0.f, b[0][0], b[0][1]);
        small_ints((r.q[u / 2].y >> shift) & 0x0F0F0F0Fu, 0.f, b[1][0], b[1][1]);
        k4_scale_min(r.ha, u, scale[0], add[0]);
        k4_scale_min(r.hb, u, scale[1], add[1]);
    }
};

// Q5_K: Q4_K's layout with 32 bytes of fifth bits at 16 (bit u of byte l for value l of sub-block u).
struct MmaQ5_K {
    static constexpr unsigned STEP = 32, KSTEPS = 2, TILE_STEPS = 8, UNROLL = 1, BYTES = 176, QH = 16, QS = 48, ALIGN = 16;
    static constexpr bool SCALED = true, HAS_MIN = true;
    struct Raw {
        uint2 q[4];
        uint2 h;
        uint4 ha, hb;
    };
    static __device__ __forceinline__ unsigned int group(unsigned int t, unsigned int k) { return 8 * t + 4 * k; }
    static __device__ __forceinline__ void fetch(Raw &r, const unsigned char *row, const unsigned char *ra,
                                                 const unsigned char *rb, unsigned int col, unsigned int t) {
        const size_t at = (size_t)(col / 256) * BYTES;
#pragma unroll
        for (int p = 0; p < 4; p++) r.q[p] = __ldg(reinterpret_cast<const uint2 *>(row + at + QS + 32 * p + 8 * t));
        r.h = __ldg(reinterpret_cast<const uint2 *>(row + at + QH + 8 * t));
        r.ha = __ldg(reinterpret_cast<const uint4 *>(ra + at));
        r.hb = __ldg(reinterpret_cast<const uint4 *>(rb + at));
    }
    static __device__ __forceinline__ void frag(const Raw &r, int u, unsigned int (&b)[KSTEPS][2], float (&scale)[2],
                                                float (&add)[2]) {
        const unsigned int shift = u % 2 ? 4 : 0;
        const unsigned int q0 = ((r.q[u / 2].x >> shift) & 0x0F0F0F0Fu) | (((r.h.x >> u) & 0x01010101u) << 4);
        const unsigned int q1 = ((r.q[u / 2].y >> shift) & 0x0F0F0F0Fu) | (((r.h.y >> u) & 0x01010101u) << 4);
        small_ints(q0, 0.f, b[0][0], b[0][1]);
        small_ints(q1, 0.f, b[1][0], b[1][1]);
        k4_scale_min(r.ha, u, scale[0], add[0]);
        k4_scale_min(r.hb, u, scale[1], add[1]);
    }
};

// Q6_K: a tile is a 210-byte super-block (2-byte aligned) in 16 steps of 16 columns (each its own scale);
// lane t takes values 4t .. 4t + 3 of each: in half n, quarter k, columns l = 16(step % 2) + 4t .. + 3,
// low nibbles (k < 2) or high of ql[64n + 32(k % 2) + l], bits 2k of qh[32n + l].
struct MmaQ6_K {
    static constexpr unsigned STEP = 16, KSTEPS = 1, TILE_STEPS = 16, UNROLL = 1, BYTES = 210, ALIGN = 2;
    static constexpr unsigned QL = 0, QH = 128, SCALES = 192, D = 208;
    static constexpr bool SCALED = true, HAS_MIN = false;
    struct Raw {
        unsigned int ql[2][2][2];  // [n][k % 2][l half]
        unsigned int qh[2][2];     // [n][l half]
        unsigned int sa[4], sb[4];  // the 16 int8 scales of the two D rows
        float da, db;
    };
    static __device__ __forceinline__ unsigned int group(unsigned int t, unsigned int) { return 4 * t; }
    static __device__ __forceinline__ void fetch(Raw &r, const unsigned char *row, const unsigned char *ra,
                                                 const unsigned char *rb, unsigned int col, unsigned int t) {
        const size_t at = (size_t)(col / 256) * BYTES;
        const unsigned char *blk = row + at;
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const unsigned int l = 16 * h + 4 * t;
                r.ql[n][0][h] = ld32_a2(blk + QL + 64 * n + l);
                r.ql[n][1][h] = ld32_a2(blk + QL + 64 * n + 32 + l);
                r.qh[n][h] = ld32_a2(blk + QH + 32 * n + l);
            }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            r.sa[i] = ld32_a2(ra + at + SCALES + 4 * i);
            r.sb[i] = ld32_a2(rb + at + SCALES + 4 * i);
        }
        r.da = ld_f16(ra + at + D);
        r.db = ld_f16(rb + at + D);
    }
    // Step s covers values 16s .. 16s + 15: half n = s / 8, quarter k = (s % 8) / 2, l half s % 2.
    static __device__ __forceinline__ void frag(const Raw &r, int s, unsigned int (&b)[KSTEPS][2], float (&scale)[2],
                                                float (&add)[2]) {
        const int n = s / 8, k = (s % 8) / 2, h = s % 2;
        const unsigned int low = k < 2 ? r.ql[n][k % 2][h] & 0x0F0F0F0Fu : (r.ql[n][k % 2][h] >> 4) & 0x0F0F0F0Fu;
        const unsigned int q = low | (((r.qh[n][h] >> (2 * k)) & 0x03030303u) << 4);
        small_ints(q, 32.f, b[0][0], b[0][1]);
        const int si = s;  // scale index 8n + 2k + h == s
        scale[0] = r.da * (float)(signed char)((r.sa[si / 4] >> (8 * (si % 4))) & 0xFFu);
        scale[1] = r.db * (float)(signed char)((r.sb[si / 4] >> (8 * (si % 4))) & 0xFFu);
        add[0] = add[1] = 0.f;
    }
};

// Calls fn(Reader{}) for the formats that have a lane reader; false for the others.
template <typename Fn>
bool with_reader(int dtype, Fn &&fn) {
    switch (dtype) {
    case HE_DTYPE_BF16: fn(MmaBF16{}); return true;
    case HE_DTYPE_Q8_0: fn(MmaQ8_0{}); return true;
    case HE_DTYPE_Q4_0: fn(MmaQ4_0{}); return true;
    case HE_DTYPE_Q4_K: fn(MmaQ4_K{}); return true;
    case HE_DTYPE_Q5_K: fn(MmaQ5_K{}); return true;
    case HE_DTYPE_Q6_K: fn(MmaQ6_K{}); return true;
    default: return false;
    }
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    he::Bf16Op::mma(d, a, b0, b1);
}

// ---- the kernel ----

template <typename R, int MT, bool GLU>
__global__ __launch_bounds__(MMV_THREADS, 2) void mmv_kernel(const unsigned char *__restrict__ w,
                                                         const unsigned char *__restrict__ w2, unsigned int rows,
                                                         unsigned int cols, size_t row_bytes,
                                                         const float *__restrict__ x, unsigned int n,
                                                         const float *bias, const float *residual, float *y,
                                                         unsigned int ldy, float *partial, unsigned int *counters) {
    extern __shared__ __align__(16) unsigned char mmv_smem[];
    constexpr unsigned NP = 16 * MT;
    constexpr unsigned XS_GROUPS = MMV_KC / R::STEP;  // activation sums a token keeps per chunk
    constexpr unsigned STRIDE = mmv_token_stride(R::STEP);
    unsigned char *xs = mmv_smem;
    float *xsum = reinterpret_cast<float *>(mmv_smem + NP * STRIDE);

    const unsigned int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
    const MmvShape shape = mmv_shape(rows, cols, GLU);
    const unsigned int k_begin = blockIdx.y * shape.kr;
    const unsigned int k_end = min(cols, k_begin + shape.kr);

    // This warp's weight rows: n-tile j, lane row g; and the rows of its D fragment (2t, 2t + 1).
    const unsigned int base = GLU ? blockIdx.x * (MMV_BLOCK_ROWS / 2) + warp * 8 : blockIdx.x * MMV_BLOCK_ROWS + warp * 16;
    const unsigned char *wrow[2], *wa[2], *wb[2];
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const unsigned char *m = GLU && j == 1 ? w2 : w;
        const unsigned int first = GLU ? base : base + 8 * j;
        // Rows past the matrix read its last row (never written out), so loads need no tests.
        auto at = [&](unsigned int r) { return m + (size_t)min(first + r, rows - 1) * row_bytes; };
        wrow[j] = at(g);
        wa[j] = at(2 * t);
        wb[j] = at(2 * t + 1);
    }

    float acc[MT][2][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

    for (unsigned int c0 = k_begin; c0 < k_end; c0 += MMV_KC) {
        const unsigned int len = min(MMV_KC, k_end - c0);
        __syncthreads();  // the previous chunk's reads are done
        // Stage tokens [0, n): tokens past n stay unwritten, and only their own output rows see them.
        const unsigned int quads = len / 4;
        for (unsigned int i = tid; i < n * quads; i += MMV_THREADS) {
            const unsigned int tok = i / quads, q = i % quads;
            const float4 v = __ldg(reinterpret_cast<const float4 *>(x + (size_t)tok * cols + c0) + q);
            const float f[4] = {v.x, v.y, v.z, v.w};
            float hi[4], lo[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                hi[e] = __bfloat162float(__float2bfloat16_rn(f[e]));
                lo[e] = f[e] - hi[e];
            }
            *reinterpret_cast<uint4 *>(xs + tok * STRIDE + 16 * q) =
                make_uint4(pack_bf16(hi[0], hi[1]), pack_bf16(hi[2], hi[3]), pack_bf16(lo[0], lo[1]),
                           pack_bf16(lo[2], lo[3]));
        }
        if (R::HAS_MIN) {
            // Each step's activation sum, in column order: the same bits in any launch.
            const unsigned int groups = len / R::STEP;
            for (unsigned int i = tid; i < n * groups; i += MMV_THREADS) {
                const unsigned int tok = i / groups, q = i % groups;
                const float *xp = x + (size_t)tok * cols + c0 + q * R::STEP;
                float s = 0.f;
                for (unsigned int e = 0; e < R::STEP; e++) s += __ldg(xp + e);
                xsum[tok * XS_GROUPS + q] = s;
            }
        }
        __syncthreads();

        // Steps of this chunk: TILE_STEPS a fetch, R::UNROLL fetches in flight.
        constexpr unsigned TILE = R::STEP * R::TILE_STEPS;
        auto run = [&](auto unroll, unsigned int col) {
            constexpr int U = decltype(unroll)::value;
            typename R::Raw raw[U][2];
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int j = 0; j < 2; j++) R::fetch(raw[u][j], wrow[j], wa[j], wb[j], col + u * TILE, t);
#pragma unroll
            for (int u = 0; u < U; u++) {
#pragma unroll
                for (int s = 0; s < (int)R::TILE_STEPS; s++) {
                    const unsigned int c = col + u * TILE + s * R::STEP - c0;  // column within the chunk
                    unsigned int b[2][R::KSTEPS][2];
                    float scale[2][2], add[2][2];
#pragma unroll
                    for (int j = 0; j < 2; j++) R::frag(raw[u][j], s, b[j], scale[j], add[j]);
#pragma unroll
                    for (int i = 0; i < MT; i++) {
                        if (16 * i >= n) break;  // a whole m-tile of absent tokens
                        float p[2][4];
#pragma unroll
                        for (int j = 0; j < 2; j++)
#pragma unroll
                            for (int e = 0; e < 4; e++) p[j][e] = 0.f;
#pragma unroll
                        for (int k = 0; k < (int)R::KSTEPS; k++) {
                            const unsigned int gq = (c + R::group(t, k)) / 4;
                            const uint4 va = *reinterpret_cast<const uint4 *>(xs + (16 * i + g) * STRIDE + 16 * gq);
                            const uint4 vb =
                                *reinterpret_cast<const uint4 *>(xs + (16 * i + g + 8) * STRIDE + 16 * gq);
                            const unsigned int ahi[4] = {va.x, vb.x, va.y, vb.y}, alo[4] = {va.z, vb.z, va.w, vb.w};
#pragma unroll
                            for (int j = 0; j < 2; j++) {
                                if constexpr (R::SCALED) {
                                    mma_bf16(p[j], ahi, b[j][k][0], b[j][k][1]);
                                    mma_bf16(p[j], alo, b[j][k][0], b[j][k][1]);
                                } else {
                                    mma_bf16(acc[i][j], ahi, b[j][k][0], b[j][k][1]);
                                    mma_bf16(acc[i][j], alo, b[j][k][0], b[j][k][1]);
                                }
                            }
                        }
                        if constexpr (R::SCALED) {
                            const unsigned int q = c / R::STEP;
                            const float s0 = R::HAS_MIN ? xsum[(16 * i + g) * XS_GROUPS + q] : 0.f;
                            const float s1 = R::HAS_MIN ? xsum[(16 * i + g + 8) * XS_GROUPS + q] : 0.f;
#pragma unroll
                            for (int j = 0; j < 2; j++) {
                                // c0, c2: row 2t (scale[0]); c1, c3: row 2t + 1; c0, c1: token g; c2, c3: g + 8.
                                acc[i][j][0] = fmaf(scale[j][0], p[j][0], acc[i][j][0]);
                                acc[i][j][1] = fmaf(scale[j][1], p[j][1], acc[i][j][1]);
                                acc[i][j][2] = fmaf(scale[j][0], p[j][2], acc[i][j][2]);
                                acc[i][j][3] = fmaf(scale[j][1], p[j][3], acc[i][j][3]);
                                if (R::HAS_MIN) {
                                    acc[i][j][0] = fmaf(add[j][0], s0, acc[i][j][0]);
                                    acc[i][j][1] = fmaf(add[j][1], s0, acc[i][j][1]);
                                    acc[i][j][2] = fmaf(add[j][0], s1, acc[i][j][2]);
                                    acc[i][j][3] = fmaf(add[j][1], s1, acc[i][j][3]);
                                }
                            }
                        }
                    }
                }
            }
        };
        unsigned int col = c0;
        const unsigned int end = c0 + len;
        for (; col + R::UNROLL * TILE <= end; col += R::UNROLL * TILE) run(std::integral_constant<int, (int)R::UNROLL>{}, col);
        for (; col < end; col += TILE) run(std::integral_constant<int, 1>{}, col);
    }

    // The outputs of lane (g, t): tokens 16i + g (+ 8), rows 2t and 2t + 1 of each n-tile.
    const unsigned int out_rows = rows;
    auto out_row = [&](int j, int e) { return GLU ? base + 2 * t + e : base + 8 * j + 2 * t + e; };
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
#pragma unroll
        for (int i = 0; i < MT; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const unsigned int tok = 16 * i + g + (e >= 2 ? 8 : 0);
                if (tok >= n) continue;
                if (GLU) {
                    const unsigned int r = out_row(0, e % 2);
                    if (r < out_rows) finish(tok, r, acc[i][0][e], acc[i][1][e]);
                } else {
#pragma unroll
                    for (int j = 0; j < 2; j++) {
                        const unsigned int r = out_row(j, e % 2);
                        if (r < out_rows) finish(tok, r, acc[i][j][e], 0.f);
                    }
                }
            }
        return;
    }

    // Split: partial[(split * parts + part) * n + tok][rows], parts 2 for GLU (gate, up).
    constexpr unsigned PARTS = GLU ? 2 : 1;
    auto slot = [&](unsigned int split, unsigned int part, unsigned int tok, unsigned int r) {
        return partial + ((size_t)(split * PARTS + part) * n + tok) * rows + r;
    };
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const unsigned int tok = 16 * i + g + (e >= 2 ? 8 : 0);
            if (tok >= n) continue;
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const unsigned int r = out_row(GLU ? 0 : j, e % 2);
                if (r < out_rows) *slot(blockIdx.y, GLU ? j : 0, tok, r) = acc[i][j][e];
            }
        }
    __threadfence();
    __syncthreads();
    __shared__ unsigned int last;
    if (tid == 0) last = atomicAdd(&counters[blockIdx.x], 1u) == shape.splits - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();  // the other blocks' partial sums are visible from here on
    const unsigned int first = GLU ? blockIdx.x * (MMV_BLOCK_ROWS / 2) : blockIdx.x * MMV_BLOCK_ROWS;
    const unsigned int block_rows = min(GLU ? MMV_BLOCK_ROWS / 2 : MMV_BLOCK_ROWS, out_rows - first);
    for (unsigned int i = tid; i < n * block_rows; i += MMV_THREADS) {
        const unsigned int tok = i / block_rows, r = first + i % block_rows;
        float v = 0.f, v2 = 0.f;
        for (unsigned int s = 0; s < shape.splits; s++) {
            v += __ldcg(slot(s, 0, tok, r));
            if (GLU) v2 += __ldcg(slot(s, 1, tok, r));
        }
        finish(tok, r, v, v2);
    }
    if (tid == 0) counters[blockIdx.x] = 0;  // ready for the next launch
}

template <int MT>
constexpr int mmv_smem_bytes(unsigned int step) {
    return 16 * MT * mmv_token_stride(step) + 16 * MT * (MMV_KC / step) * 4;
}

template <typename R, bool GLU>
cudaError_t launch_mmv(const unsigned char *w, const unsigned char *w2, unsigned int rows, unsigned int cols,
                       size_t row_bytes, const float *x, unsigned int n, const float *bias, const float *residual,
                       float *y, unsigned int ldy, float *partial, unsigned int *counters, cudaStream_t stream) {
    const MmvShape shape = mmv_shape(rows, cols, GLU);
    const dim3 grid(shape.row_blocks, shape.splits);
    for (unsigned int t0 = 0; t0 < n; t0 += MMV_MAX_TOKENS) {
        const unsigned int nt = min(MMV_MAX_TOKENS, n - t0);
        const float *xt = x + (size_t)t0 * cols;
        const float *rt = residual != nullptr ? residual + (size_t)t0 * ldy : nullptr;
        float *yt = y + (size_t)t0 * ldy;
        auto go = [&](auto kernel, int smem) {
            cudaError_t e = he::allow_smem(kernel, smem);
            if (e != cudaSuccess) return e;
            kernel<<<grid, MMV_THREADS, smem, stream>>>(w, w2, rows, cols, row_bytes, xt, nt, bias, rt, yt, ldy, partial,
                                                       counters);
            return cudaGetLastError();
        };
        cudaError_t e;
        if (nt <= 16) e = go(mmv_kernel<R, 1, GLU>, mmv_smem_bytes<1>(R::STEP));
        else if (nt <= 32) e = go(mmv_kernel<R, 2, GLU>, mmv_smem_bytes<2>(R::STEP));
        else e = go(mmv_kernel<R, 4, GLU>, mmv_smem_bytes<4>(R::STEP));
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
        const unsigned int tile = R::STEP * R::TILE_STEPS;
        ok = rb != 0 && cols % tile == 0 && cols % 4 == 0 && rb % R::ALIGN == 0 &&
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
    *partial_floats = s.splits > 1 ? (size_t)s.splits * (glu ? 2 : 1) * nt * rows : 0;
    *counters = s.splits > 1 ? s.row_blocks : 0;
    return cudaSuccess;
}

template <bool GLU>
static cudaError_t mmv_entry(const void *w, const void *w2, int dtype, unsigned int rows, unsigned int cols,
                             const float *x, unsigned int n, const float *bias, const float *residual, float *y,
                             unsigned int ldy, float *partial, unsigned int *counters, cudaStream_t stream) {
    if (w == nullptr || (GLU && w2 == nullptr) || x == nullptr || y == nullptr) return cudaErrorInvalidValue;
    if (rows == 0 || cols == 0 || ldy < rows || reinterpret_cast<uintptr_t>(x) % 16 != 0) return cudaErrorInvalidValue;
    if (hostembed_mmv_supports(dtype, w, cols) != cudaSuccess) return cudaErrorNotSupported;
    if (GLU && hostembed_mmv_supports(dtype, w2, cols) != cudaSuccess) return cudaErrorNotSupported;
    const MmvShape s = mmv_shape(rows, cols, GLU);
    if (s.splits > 1 && (partial == nullptr || counters == nullptr)) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    cudaError_t err = cudaErrorNotSupported;
    const unsigned char *wb = static_cast<const unsigned char *>(w), *wb2 = static_cast<const unsigned char *>(w2);
    with_reader(dtype, [&](auto reader) {
        using R = decltype(reader);
        he::with_format(dtype, [&](auto format) {
            using F = decltype(format);
            err = launch_mmv<R, GLU>(wb, wb2, rows, cols, he::row_bytes<F>(cols), x, n, bias, residual, y, ldy, partial,
                                     counters, stream);
        });
    });
    return err;
}

extern "C" cudaError_t hostembed_mmv(const void *w, int dtype, unsigned int rows, unsigned int cols, const float *x,
                                     unsigned int n, const float *bias, const float *residual, float *y,
                                     unsigned int ldy, float *partial, unsigned int *counters, cudaStream_t stream) {
    return mmv_entry<false>(w, nullptr, dtype, rows, cols, x, n, bias, residual, y, ldy, partial, counters, stream);
}

extern "C" cudaError_t hostembed_mmv_swiglu(const void *w_gate, const void *w_up, int dtype, unsigned int rows,
                                            unsigned int cols, const float *x, unsigned int n, float *y,
                                            float *partial, unsigned int *counters, cudaStream_t stream) {
    return mmv_entry<true>(w_gate, w_up, dtype, rows, cols, x, n, nullptr, nullptr, y, rows, partial, counters,
                           stream);
}
