// The one header every kernel file shares: the C launchers Rust calls (src/kernels.rs repeats
// them, and build.rs checks the two agree), and the device helpers the kernels have in common.
// Over 600 lines on purpose: every launcher's declaration in one place, so that build.rs's one check
// against src/kernels.rs covers them all.
#pragma once
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

// Row and weight formats, the values of src/tensor/'s DType; kernels/formats.cuh has their traits.
#define HE_DTYPE_F32 0
#define HE_DTYPE_F16 1
#define HE_DTYPE_BF16 2
#define HE_DTYPE_Q8_0 3
#define HE_DTYPE_Q4_0 4
#define HE_DTYPE_Q4_1 5
#define HE_DTYPE_Q5_0 6
#define HE_DTYPE_Q5_1 7
#define HE_DTYPE_Q2_K 8
#define HE_DTYPE_Q3_K 9
#define HE_DTYPE_Q4_K 10
#define HE_DTYPE_Q5_K 11
#define HE_DTYPE_Q6_K 12

// KV cache types, the values of engine_kv_type (src/kv.rs has their rounding, which kernels/rope.cu
// follows): one value in bf16, f16 or f32; or blocks of HE_KV_BLOCK values of one head's row, each a
// scale and one-byte codes (Q8_0: an f16 scale max|x| / 127 and int8 codes; FP8_E4M3: a bf16 scale
// max|x| / 448 and E4M3 codes).
#define HE_KV_BF16 1
#define HE_KV_F16 2
#define HE_KV_F32 3
#define HE_KV_Q8_0 4
#define HE_KV_FP8_E4M3 5
#define HE_KV_BLOCK 32

// The paged KV pool: each layer's pool is pool_pages pages one after the other, a page holding
// HE_PAGE_TOKENS positions as the K slabs of every kv head, then the V slabs of every kv head. A slab is
// HE_PAGE_TOKENS rows of head_dim values in its type (K's or V's); for the block types, HE_PAGE_TOKENS
// rows of head_dim one-byte codes, then the slab's 16-bit scales [HE_PAGE_TOKENS][head_dim / HE_KV_BLOCK].
// (he::kv_slab_bytes and he::kv_page_bytes below; src/gpu/pages.rs's PageLayout is the same on the
// host.) A stream's page table (unsigned int page ids, in position order) maps position p to slot
// p % HE_PAGE_TOKENS of page table[p / HE_PAGE_TOKENS].
#define HE_PAGE_TOKENS 16

// How the launchers that take it launch (src/tuning.rs's Tuning, which the engine resolves once; any
// setting gives the same bits): `overlap` lets a launch start while the kernel before it finishes (on
// sm_90 and newer); hostembed_mmv's `mmv_stage` (HE_MMV_STAGE_*) says when its weights are staged,
// `mmvq_tokens` the tokens an integer launch takes (0, or past MMVQ_MAX_TOKENS: its own choice), and
// `mmv_prep` whether half launches of many tokens convert their activations once, and `mmv_tc_blocks`
// whether integer launches of more than 8 tokens take the tile kernel (every token of a launch at once,
// the activations converted once a product; the same bits as the streamed kernel), and `attention_blocks`
// which decode attention kernel a launch takes (0 by its block count, 1 the one with more loads in flight a
// thread, 2 the one with twice the blocks a multiprocessor), and `mmv_wgmma` whether half launches of more
// than 8 tokens take the warpgroup products on an sm_90 card (0 no, 1 yes, 2 the pipelined kernel), and
// `moe_prefetch` whether a Mixture-of-Experts layer's decode rows' down product has its experts' rows
// fetched into L2 while the gate and up product runs (kernels/moe_mmv.cu), and `moe_mmv_cut` how those
// products cut an expert's columns (HE_MOE_CUT_*: enough ranges to fill the card with one token's experts,
// rounded up; as many as keep one token's launch in one wave of blocks, src/tuning.rs's default; one range).
#define HE_MOE_CUT_FILL 0
#define HE_MOE_CUT_WAVES 1
#define HE_MOE_CUT_ONE 2
#define HE_MMV_STAGE_NEVER 0
#define HE_MMV_STAGE_MEASURED 1
#define HE_MMV_STAGE_ALWAYS 2
typedef struct hostembed_tuning {
    int overlap;
    int mmv_stage;
    unsigned int mmvq_tokens;
    int mmv_prep;
    int mmv_tc_blocks;
    unsigned int attention_blocks;
    int mmv_wgmma;
    int moe_prefetch;
    int moe_mmv_cut;
} hostembed_tuning;
static_assert(sizeof(hostembed_tuning) == 36, "src/kernels.rs repeats hostembed_tuning");

#ifdef __cplusplus
extern "C" {
#endif

// ---- embed.cu: the embedding gather ----
// Gathers rows[ids[i]] (vocab rows of cols values in `dtype`) into row i of `out` (HE_DTYPE_F32 or
// HE_DTYPE_BF16). An id outside [0, vocab) is never read: its row is written as zeros and *bad
// (when bad != NULL) is set to 1. `rows` may be device memory or mapped host memory.
cudaError_t hostembed_embed_gather(const void *rows, int dtype, unsigned int vocab, unsigned int cols,
                                   const int *ids, unsigned int n, void *out, int out_dtype, int *bad,
                                   cudaStream_t stream);

// ---- decode kernels (norm.cu, matvec.cu, rope.cu, attention.cu, act.cu, sample.cu) ----
// Activations are f32 [n][cols] rows; kv_pool is one layer's paged pool (see HE_PAGE_TOKENS) and
// tables[t] the page table of token t's stream. Every launcher checks its arguments
// (cudaErrorInvalidValue) and returns the launch error.

// out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * w, for n rows of cols values (out may be x).
cudaError_t hostembed_rmsnorm(const float *x, const float *w, float eps, float *out, unsigned int n, unsigned int cols,
                              hostembed_tuning tuning, cudaStream_t stream);

// y[t*ldy + r] = sum_c W[r][c] * x[t*cols + c] (+ bias[r]) (+ residual[t*ldy + r]) for r < rows, t < n.
// W is rows x cols in `dtype` (HE_DTYPE_*), each weight read once per 8 tokens; bias and residual may be
// NULL, residual may equal y.
cudaError_t hostembed_matvec(const void *w, int dtype, unsigned int rows, unsigned int cols, const float *x,
                             unsigned int n, const float *bias, const float *residual, float *y, unsigned int ldy,
                             cudaStream_t stream);

// y[t*rows + r] = silu(G[r].x[t]) * (U[r].x[t]): gate and up projections and SwiGLU in one pass.
cudaError_t hostembed_matvec_swiglu(const void *w_gate, const void *w_up, int dtype, unsigned int rows,
                                    unsigned int cols, const float *x, unsigned int n, float *y, cudaStream_t stream);

// ---- mmv*.cu: decode products on tensor cores, batch invariant ----
// y[t*ldy + r] = sum_c W[r][c] * x[t*cols + c] (+ bias[r]) (+ residual[t*ldy + r]), as hostembed_matvec,
// for the formats and shapes hostembed_mmv_supports accepts (cudaErrorNotSupported otherwise): W read once
// per 64 tokens on tensor cores, each token's result the same bits whatever the others in the launch are.
// x is 16-byte aligned. A matrix cut into several column ranges needs `partial` and `counters` of the
// sizes hostembed_mmv_workspace gives (device memory; counters zero before the first launch, and left zero
// by every launch); launches sharing them must run in stream order.
cudaError_t hostembed_mmv(const void *w, int dtype, unsigned int rows, unsigned int cols, const float *x,
                          unsigned int n, const float *bias, const float *residual, float *y, unsigned int ldy,
                          float *partial, unsigned int *counters, hostembed_tuning tuning, cudaStream_t stream);

// y[t*rows + r] = silu(G[r].x[t]) * (U[r].x[t]) on tensor cores, as hostembed_mmv.
cudaError_t hostembed_mmv_swiglu(const void *w_gate, const void *w_up, int dtype, unsigned int rows,
                                 unsigned int cols, const float *x, unsigned int n, float *y, float *partial,
                                 unsigned int *counters, hostembed_tuning tuning, cudaStream_t stream);

// cudaSuccess when hostembed_mmv takes weights of `dtype` at `w` with rows of `cols` values.
cudaError_t hostembed_mmv_supports(int dtype, const void *w, unsigned int cols);

// The floats of `partial` and the entries of `counters` a product of rows x cols (glu: the swiglu form)
// over n tokens needs; both 0 when it runs in one column range. Host arithmetic only, no device needed.
cudaError_t hostembed_mmv_workspace(unsigned int rows, unsigned int cols, int glu, unsigned int n,
                                    size_t *partial_floats, unsigned int *counters);

// In each row t of qkv (stride qkv_stride floats: heads q heads, then kv_heads k heads, then kv_heads v
// heads, head_dim each): RMSNorm of every q/k head when q_norm/k_norm are not NULL, then the rotation at
// position pos[t] with inv_freq[head_dim/2] (interleaved pairs or halves), in place. When kv_pool is not
// NULL, the rotated k heads are also stored in k_type and the v heads in v_type (HE_KV_*, rounded as
// src/kv.rs rounds them) at position pos[t] of token t's stream (page tables[t][pos[t] /
// HE_PAGE_TOKENS]; an id past pool_pages is not written). head_dim even, <= 256; a multiple of 8 (of
// HE_KV_BLOCK for a block type) when kv_pool is not NULL.
cudaError_t hostembed_rope_kv(float *qkv, unsigned int qkv_stride, unsigned int n, const int *pos,
                              unsigned int heads, unsigned int kv_heads, unsigned int head_dim,
                              const float *inv_freq, int interleaved, const float *q_norm, const float *k_norm,
                              float eps, void *kv_pool, const unsigned int *const *tables, unsigned int pool_pages,
                              int k_type, int v_type, hostembed_tuning tuning, cudaStream_t stream);

// Writes HE_PAGE_TOKENS, for the host to check its own copy against.
cudaError_t hostembed_kv_page_tokens(unsigned int *page_tokens);

// Attention of query token t (q + t*q_stride, heads x head_dim) over positions [0, pos[t]] of its stream
// (pages tables[t], K in k_type and V in v_type, HE_KV_*, each value decoded exactly to f32) with GQA
// (query head h reads kv head h / (heads / kv_heads)), softmax(q.k * scale) v into out[t][heads*head_dim].
// The context is cut in at most `splits` parts of whole 32-position units, 128 positions at least (the
// cut depends only on pos[t] and splits), computed by separate blocks and combined in order; partial
// holds n*heads*splits*(head_dim+2) floats. head_dim a multiple of 8 (of HE_KV_BLOCK for a block type),
// <= 256; splits <= 1024. grid_parts (1..splits) blocks a token and head group take its parts in turn:
// any value gives the same bits; as many as the longest context fills is the fastest. window > 0: token t
// sees only its last `window` positions (its own counted), and the cut is of those, from their first
// 32-position unit.
cudaError_t hostembed_attention(const float *q, unsigned int q_stride, const void *kv_pool,
                                const unsigned int *const *tables, unsigned int pool_pages, int k_type, int v_type,
                                const int *pos, unsigned int n, unsigned int heads, unsigned int kv_heads,
                                unsigned int head_dim, float scale, unsigned int window, unsigned int splits,
                                unsigned int grid_parts, float *partial, float *out, hostembed_tuning tuning,
                                cudaStream_t stream);
// The same, the parts combined by the split kernel's last block to finish for each token and group of
// heads (one launch, not two; the same bits): counters holds n * heads zeros (device memory), which every
// launch leaves zero; launches sharing them run in stream order.
cudaError_t hostembed_attention_combined(const float *q, unsigned int q_stride, const void *kv_pool,
                                         const unsigned int *const *tables, unsigned int pool_pages, int k_type,
                                         int v_type, const int *pos, unsigned int n, unsigned int heads,
                                         unsigned int kv_heads, unsigned int head_dim, float scale,
                                         unsigned int window, unsigned int splits, unsigned int grid_parts,
                                         float *partial, float *out, unsigned int *counters, hostembed_tuning tuning,
                                         cudaStream_t stream);

// The gated feed-forward's activations (src/model.rs's Activation): silu(g) = g / (1 + e^-g), and GELU's
// tanh approximation gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))).
#define HE_ACT_SILU 0
#define HE_ACT_GELU_TANH 1

// out[i] = act(gate[i]) * up[i] (act HE_ACT_*) written in out_dtype (HE_DTYPE_F32 or a half format); out
// may not overlap gate or up unless out_dtype is HE_DTYPE_F32.
cudaError_t hostembed_glu_to(const float *gate, const float *up, void *out, int out_dtype, int act, size_t len,
                             cudaStream_t stream);

// out[i] = a[i] + b[i] (out may be a or b).
cudaError_t hostembed_add(const float *a, const float *b, float *out, size_t len, cudaStream_t stream);

// x[i] *= factor.
cudaError_t hostembed_scale(float *x, float factor, size_t len, cudaStream_t stream);

// x[r] += RMSNorm(y[r]) * w for each of n rows of cols values (y's own norm; x and y do not overlap).
cudaError_t hostembed_rmsnorm_add(const float *y, const float *w, float eps, float *x, unsigned int n,
                                  unsigned int cols, cudaStream_t stream);

// Picks the next token from logits[vocab] exactly as src/sampler.rs does (the repetition penalty on the
// n_penalty distinct ids in penalty[0..n_penalty); then temperature <= 0: argmax, lowest index on ties;
// else integer weights, top-k, min-p, top-p, one draw from (seed, stream_index, position)) and writes it
// to *token. penalty holds 2*n_penalty ints: the ids, then room where their logits are saved while
// penalized; logits are restored before the call's work ends. scratch holds 8*vocab bytes (8-byte
// aligned); vocab < 2^28 so the integer weights' sums fit in 64 bits.
cudaError_t hostembed_sample(float *logits, unsigned int vocab, float temperature, unsigned int top_k, float top_p,
                             float min_p, float repeat_penalty, int *penalty, unsigned int n_penalty, uint64_t seed,
                             unsigned int stream_index, uint64_t position, void *scratch, int *token,
                             cudaStream_t stream);

// One row's settings for hostembed_sample_rows (src/kernels.rs repeats the struct): what hostembed_sample
// takes for one row, its n_penalty ids at ids[penalty_at..], and the row of `masks` holding the ids it may
// draw (HOSTEMBED_NO_MASK: every id).
typedef struct hostembed_sample_row {
    float temperature;
    unsigned int top_k;
    float top_p;
    float min_p;
    float repeat_penalty;
    unsigned int n_penalty;
    unsigned int penalty_at;
    unsigned int stream_index;
    uint64_t seed;
    uint64_t position;
    unsigned int mask_row;
    unsigned int reserved;
} hostembed_sample_row;
#ifdef __cplusplus
static_assert(sizeof(hostembed_sample_row) == 56 && offsetof(hostembed_sample_row, seed) == 32 &&
                  offsetof(hostembed_sample_row, mask_row) == 48,
              "src/kernels.rs lays the row out so");
#endif
#define HOSTEMBED_NO_MASK 0xffffffffu

// hostembed_sample for each of `rows` rows in at most three launches: row r's token from logits + r * vocab
// (left as it was) into tokens[r], drawn with settings[r] (its distinct ids at ids[penalty_at ..
// penalty_at + n_penalty), inside ids[0..n_ids)), the same token hostembed_sample draws. A row whose
// mask_row is not HOSTEMBED_NO_MASK draws among the ids its mask allows (bit i % 32 of word i / 32 of the
// (vocab + 31) / 32 words at masks + mask_row * that), as src/sampler.rs sample_stream_masked does: every
// other id ranks below all of them and weighs 0, so the token is the one drawn with those logits at -inf;
// the mask must allow an id below vocab. masks is device memory (NULL when no row has one). settings and
// ids are host memory, copied into the scratch before this returns; scratch is device memory of
// scratch_size bytes, 256-byte aligned: 64 bytes a row and 8 an id at least, more for rows of many blocks
// (cudaErrorInvalidValue when even the settings and ids do not fit).
cudaError_t hostembed_sample_rows(float *logits, unsigned int vocab, unsigned int rows,
                                  const hostembed_sample_row *settings, const int *ids, unsigned int n_ids,
                                  const unsigned int *masks, void *scratch, size_t scratch_size, int *tokens,
                                  cudaStream_t stream);

// ---- logprob.cu ----
// For each of `rows` rows of logits (vocab apart): out[r] = logits[r][targets[r]] - log(sum_i
// exp(logits[r][i])), the sum in double after the row's max is taken out, as the host's log-softmax;
// NaN where targets[r] is outside [0, vocab) or the row holds a NaN or no finite value. rows <= 65535.
cudaError_t hostembed_row_logprobs(const float *logits, unsigned int vocab, unsigned int rows, const int *targets,
                                   float *out, cudaStream_t stream);

// ---- prompt chunks on tensor cores (gemm.cu, flash.cu; sm_80 and newer) ----
// Operands of the tensor-core paths are HE_DTYPE_BF16 or HE_DTYPE_F16 ("half" formats below); products
// accumulate in f32.

// y[t*ldy + r] = sum_c W[r][c] * a[t*lda + c] (+ bias[r]) (+ residual[t*ldy + r]) for r < rows, t < n.
// a and W share `dtype` (a half format); cols and lda are multiples of 8 and a and w 16-byte aligned.
// bias and residual may be NULL, residual may equal y.
cudaError_t hostembed_gemm(const void *a, unsigned int lda, const void *w, int dtype, unsigned int rows,
                           unsigned int cols, unsigned int n, const float *bias, const float *residual, float *y,
                           unsigned int ldy, cudaStream_t stream);

// out (rows x cols, row-major, in the half format out_dtype) = W (rows x cols in any format, rows of whole
// blocks), each value decoded as the CPU decodes it and rounded to nearest. out is 2-byte aligned; w any.
// At memory speed where out is 16-byte aligned and w as the format's 8-value pieces want
// (kernels/formats/pieces.cuh: 16 bytes for the float formats, Q4_K and Q5_K, 8 for Q5_1, 4 for Q4_1 and
// Q2_K, 2 for the others); one value at a time otherwise.
cudaError_t hostembed_convert_matrix(const void *w, int w_dtype, unsigned int rows, unsigned int cols, void *out,
                                     int out_dtype, cudaStream_t stream);

// y[t*ldy + r] += bias[r] for r < rows, t < n.
cudaError_t hostembed_add_bias(float *y, unsigned int ldy, const float *bias, unsigned int rows, unsigned int n,
                               cudaStream_t stream);

// RMSNorm as hostembed_rmsnorm, written in out_dtype (HE_DTYPE_F32 or a half format); where residue is
// not NULL (a half format only), y - half(y) of each value y in the same format there too.
cudaError_t hostembed_rmsnorm_to(const float *x, const float *w, float eps, void *out, void *residue, int out_dtype,
                                 unsigned int n, unsigned int cols, hostembed_tuning tuning, cudaStream_t stream);

// out[i] = x[i] in out_dtype (a half format).
cudaError_t hostembed_convert(const float *x, void *out, int out_dtype, size_t len, cudaStream_t stream);

// cudaSuccess where hostembed_flash_attention has a kernel for head_dim on the current device, else
// cudaErrorInvalidValue. Head size 256 takes 16-bit caches only (an 8-bit one is refused at launch).
cudaError_t hostembed_flash_head_dim(unsigned int head_dim);

// Causal attention of a prompt chunk of one stream (flash attention on tensor cores): query t (q +
// t*q_stride, heads x head_dim f32, already rotated) attends to positions [0, pos[t]] of the stream whose
// page table is `table` (its own chunk's K and V already written there, K in k_type and V in v_type: any
// HE_KV_* but HE_KV_F32) with GQA, softmax(q.k * scale) v written to out[t*out_stride + h*head_dim] in
// out_dtype (a half format). Q and K enter the tensor cores as bf16 for a bf16 K cache, else as f16 (an
// 8-bit block decoded to f16 in shared memory); the probabilities and V likewise by V's type. window > 0:
// query t attends to positions (pos[t] - window, pos[t]] only.
cudaError_t hostembed_flash_attention(const float *q, unsigned int q_stride, const void *kv_pool,
                                      const unsigned int *table, unsigned int pool_pages, int k_type, int v_type,
                                      const int *pos, unsigned int n, unsigned int heads, unsigned int kv_heads,
                                      unsigned int head_dim, float scale, unsigned int window, void *out, int out_dtype,
                                      unsigned int out_stride, const void *stage, unsigned int stage_tokens,
                                      unsigned int staged, cudaStream_t stream);

// hostembed_flash_attention with the context cut in `parts` of `part_tiles` 64-position tiles (grid z), each
// part's unnormalized results in `partial` (parts x the queries rounded up to 64 x heads x (head_dim + 2)
// floats, at most `partial_floats`), merged in part order by a second kernel: the blocks a short chunk
// over a long context needs to fill the card. parts 1 is hostembed_flash_attention (partial unused).
cudaError_t hostembed_flash_attention_parts(const float *q, unsigned int q_stride, const void *kv_pool,
                                            const unsigned int *table, unsigned int pool_pages, int k_type,
                                            int v_type, const int *pos, unsigned int n, unsigned int heads,
                                            unsigned int kv_heads, unsigned int head_dim, float scale,
                                            unsigned int window, void *out, int out_dtype, unsigned int out_stride,
                                            const void *stage, unsigned int stage_tokens, unsigned int staged,
                                            unsigned int parts, unsigned int part_tiles, float *partial,
                                            size_t partial_floats, cudaStream_t stream);

// The stage of an 8-bit cache for hostembed_flash_attention: the first min(ctx, stage_tokens) positions of
// the stream whose page table is `table`, rounded up to whole 64-position tiles (positions from ctx on are
// zeros), of each 8-bit half of K and V, decoded into f16 rows [K, V][kv_heads][stage_tokens][head_dim] of
// `stage` (a 16-bit half is not written: the kernel reads it in its pages). stage_tokens a multiple of 64.
// hostembed_flash_attention given that stage (stage_tokens, staged = ctx) reads those tiles from it,
// with the same results as without it. A stage may be NULL (with stage_tokens 0).
cudaError_t hostembed_flash_stage(const void *kv_pool, const unsigned int *table, unsigned int pool_pages, int k_type,
                                  int v_type, unsigned int kv_heads, unsigned int head_dim, unsigned int ctx,
                                  void *stage, unsigned int stage_tokens, cudaStream_t stream);

// ---- moe.cu ----
// The Mixture-of-Experts feed-forward: each chosen expert's weights read once a launch for every row that
// chose it, a row's results the same bits in any batch.
// logits[r*experts + j] = R[j] . x[r] for rows r < n, R (experts x cols) in `dtype`.
cudaError_t hostembed_moe_router(const void *router, int dtype, unsigned int experts, unsigned int cols,
                                 const float *x, unsigned int n, float *logits, cudaStream_t stream);
// Each row's k largest logits (ties to the lower index) as expert ids in ascending order in ids[r*k..],
// with their softmax probabilities over every expert (over the k when norm_topk) in weights[r*k..]; and
// the slots r*k + s grouped by expert into groups (1 + 3*experts + n*k ints; experts <= 1024, k <= 32): the
// count of experts chosen, those experts ascending, each expert's first place and count, then the slots.
cudaError_t hostembed_moe_route(const float *logits, unsigned int experts, unsigned int n, unsigned int k,
                                int norm_topk, int *ids, float *weights, int *groups, cudaStream_t stream);
// hostembed_moe_router, then hostembed_moe_route of rows [0, route_n) by the router's last block to finish
// (one launch; the same bits): counter is one zero in device memory, which every launch leaves zero.
// cudaErrorNotSupported for more than 256 experts.
cudaError_t hostembed_moe_router_route(const void *router, int dtype, unsigned int experts, unsigned int cols,
                                       const float *x, unsigned int n, float *logits, unsigned int route_n,
                                       unsigned int k, int norm_topk, int *ids, float *weights, int *groups,
                                       unsigned int *counter, cudaStream_t stream);
// act[(r*k + s)*width + j] = silu(G_e[j] . x[r]) * (U_e[j] . x[r]) with e = ids[r*k + s] (as `groups` has
// them): expert e's gate and up matrices (width x cols in dtype) at gate + e*expert_bytes and up + e*expert_bytes.
cudaError_t hostembed_moe_gate_up(const void *gate, const void *up, int dtype, size_t expert_bytes, unsigned int width,
                                  unsigned int cols, const float *x, const int *groups, unsigned int experts,
                                  unsigned int n, unsigned int k, float *act, cudaStream_t stream);
// out[(r*k + s)*rows + j] = D_e[j] . act[(r*k + s)*cols..] with e = ids[r*k + s] (as `groups` has them):
// expert e's down matrix (rows x cols in dtype) at down + e*expert_bytes.
cudaError_t hostembed_moe_down(const void *down, int dtype, size_t expert_bytes, unsigned int rows, unsigned int cols,
                               const float *act, const int *groups, unsigned int experts, unsigned int n,
                               unsigned int k, float *out, cudaStream_t stream);
// x[r*rows + j] += the sum over s = 0..k in order of weights[r*k + s] * out[(r*k + s)*rows + j].
cudaError_t hostembed_moe_sum(const float *out, const float *weights, unsigned int rows, unsigned int n,
                              unsigned int k, float *x, cudaStream_t stream);
// out[i] = x[i], a half format's values (HE_DTYPE_BF16 or HE_DTYPE_F16) widened to f32.
cudaError_t hostembed_widen(const void *x, int dtype, float *out, size_t len, cudaStream_t stream);

// ---- moe_mmv.cu ----
// The decode rows' expert products on the integer decode product (block formats): for each slot s of
// `groups` (hostembed_moe_route's over n rows, k slots a row) with expert e, y[s*rows + j] = W_e[j] .
// x[(s / x_div)*cols..] (W_e: rows x cols in dtype at w + e*expert_bytes); with w2 (the up matrices),
// y[s*rows + j] = silu(W_e[j] . x_s) * (W2_e[j] . x_s). A slot's results are the same bits in any batch. x is
// 16-byte aligned; `partial` and `counters` as hostembed_moe_mmv_workspace sizes them (counters zero before
// the first launch, left zero by every launch). cudaErrorNotSupported for a format or shape it does not take
// (hostembed_moe_mmv_supports, of each matrix stack).
cudaError_t hostembed_moe_mmv(const void *w, const void *w2, int dtype, size_t expert_bytes, unsigned int rows,
                              unsigned int cols, const float *x, unsigned int x_div, const int *groups,
                              unsigned int experts, unsigned int n, unsigned int k, float *y, float *partial,
                              unsigned int *counters, hostembed_tuning tuning, cudaStream_t stream);
// The down product (no w2, x_div 1), then each row's hostembed_moe_sum of its k slots' outputs into sums
// (sums[r*rows + j] += ..., weights as hostembed_moe_sum's) by the blocks that finish a row's outputs last (one
// launch; the same bits): sum_counters holds sum_counter_count zeros (n * ceil(rows / 128) at least; device
// memory), which every launch leaves zero.
cudaError_t hostembed_moe_mmv_sum(const void *w, int dtype, size_t expert_bytes, unsigned int rows, unsigned int cols,
                                  const float *x, const int *groups, unsigned int experts, unsigned int n,
                                  unsigned int k, float *y, float *partial, unsigned int *counters,
                                  const float *weights, float *sums, unsigned int *sum_counters,
                                  unsigned int sum_counter_count, hostembed_tuning tuning, cudaStream_t stream);
cudaError_t hostembed_moe_mmv_supports(int dtype, const void *w, size_t expert_bytes, unsigned int cols);
// The floats of `partial` and the entries of `counters` hostembed_moe_mmv needs for n rows (glu: with w2).
cudaError_t hostembed_moe_mmv_workspace(unsigned int rows, unsigned int cols, int glu, unsigned int experts,
                                        unsigned int n, unsigned int k, size_t *partial_floats,
                                        unsigned int *counters);

// ---- moe_gemm.cu ----
// The tensor-core rows' expert products, grouped: for each slot s of `groups` (hostembed_moe_route's, `slots`
// of them) with expert e, out[s*ldy + r] = W_e[r] . a[(s / per)*lda..] in f32 for the rows r of W_e (rows x
// cols in w_dtype at w, expert e's right after expert e - 1's), a in the half format dtype; where gate is
// not NULL, out is in dtype and out[s*ldy + r] = silu(gate[s*ldy + r]) * that product. The weights are
// rounded to dtype as hostembed_convert_matrix rounds them. cols and lda multiples of 8, ldy even, a and w
// 16-byte aligned, out 8-byte aligned. A row's results are the same bits in any batch.
cudaError_t hostembed_moe_grouped(const void *a, unsigned int lda, unsigned int per, int dtype, const void *w,
                                  int w_dtype, unsigned int rows, unsigned int cols, const int *groups,
                                  unsigned int experts, unsigned int slots, const float *gate, void *out,
                                  unsigned int ldy, cudaStream_t stream);

// ---- device.cu ----
// Writes the device's name (NUL-terminated, truncated to len) without exposing cudaDeviceProp to Rust.
cudaError_t hostembed_device_name(int device, char *name, size_t len);

#ifdef __cplusplus
}
#endif

#ifdef __CUDACC__
// ---- device helpers shared by the decode kernels ----
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <type_traits>

namespace he {

// The low and high bf16 of a 32-bit word.
__device__ __forceinline__ float bf16_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float f16_bits_to_f32(unsigned int h) {
    return __half2float(__ushort_as_half((unsigned short)h));
}
__device__ __forceinline__ unsigned short f32_to_bf16_bits(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of THREADS threads (a multiple of 32); `scratch` holds 32 floats. Every thread gets
// the sum. Contains barriers: call from all threads.
template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float *scratch) {
    constexpr int WARPS = THREADS / 32;
    v = warp_sum(v);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < WARPS ? scratch[lane] : 0.f;
    return warp_sum(t);
}

// 16 bytes of weights that are read once: through the non-coherent path, not kept in L1. Not volatile:
// the weights never change while a kernel runs, so the scheduler may move it.
__device__ __forceinline__ uint4 load_stream16(const void *p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Whether `type` is a KV cache type a head of head_dim values fits (a block type: whole blocks).
__host__ __device__ __forceinline__ bool kv_type_ok(int type, unsigned int head_dim) {
    switch (type) {
    case HE_KV_BF16: case HE_KV_F16: case HE_KV_F32: return true;
    case HE_KV_Q8_0: case HE_KV_FP8_E4M3: return head_dim % HE_KV_BLOCK == 0;
    default: return false;
    }
}
__host__ __device__ __forceinline__ bool kv_is_block(int type) {
    return type == HE_KV_Q8_0 || type == HE_KV_FP8_E4M3;
}
// Bytes of one head's row at one position in `type`, its scales included.
__host__ __device__ __forceinline__ size_t kv_row_bytes(int type, unsigned int head_dim) {
    switch (type) {
    case HE_KV_BF16: case HE_KV_F16: return (size_t)2 * head_dim;
    case HE_KV_F32: return (size_t)4 * head_dim;
    default: return (size_t)head_dim + head_dim / HE_KV_BLOCK * 2;
    }
}
// Bytes of one head's slab in a page, and of one page of one layer (see HE_PAGE_TOKENS).
__host__ __device__ __forceinline__ size_t kv_slab_bytes(int type, unsigned int head_dim) {
    return HE_PAGE_TOKENS * kv_row_bytes(type, head_dim);
}
__host__ __device__ __forceinline__ size_t kv_page_bytes(unsigned int kv_heads, unsigned int head_dim, int k_type,
                                                         int v_type) {
    return kv_heads * (kv_slab_bytes(k_type, head_dim) + kv_slab_bytes(v_type, head_dim));
}
// Where kv head h's K slab, or V slab (v), starts in a page.
__host__ __device__ __forceinline__ size_t kv_slab_at(unsigned int kv_heads, unsigned int head_dim, int k_type,
                                                      int v_type, bool v, unsigned int h) {
    return v ? kv_heads * kv_slab_bytes(k_type, head_dim) + h * kv_slab_bytes(v_type, head_dim)
             : h * kv_slab_bytes(k_type, head_dim);
}

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
    unsigned long long z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// A key whose unsigned order is the float order (larger float, larger key); 0 is only a negative NaN.
__device__ __forceinline__ unsigned int float_key(float f) {
    unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// ---- tensor cores (sm_80 and newer): operands as 32-bit pairs of halves, f32 accumulators ----
struct Bf16Op {
    static constexpr int ID = HE_DTYPE_BF16;
    using T = __nv_bfloat16;
    static __device__ __forceinline__ unsigned int pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<unsigned int *>(&v);
    }
    static __device__ __forceinline__ float unpack(unsigned int bits) { return __uint_as_float(bits << 16); }
    // d += a b for a 16x16 (row-major) by 16x8 (column-major) product.
    static __device__ __forceinline__ void mma(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                               unsigned int b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

struct F16Op {
    static constexpr int ID = HE_DTYPE_F16;
    using T = __half;
    static __device__ __forceinline__ unsigned int pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<unsigned int *>(&v);
    }
    static __device__ __forceinline__ float unpack(unsigned int bits) {
        return __half2float(__ushort_as_half((unsigned short)bits));
    }
    static __device__ __forceinline__ void mma(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                               unsigned int b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

// Calls fn(Op{}) for a half format id; false for any other.
template <typename Fn>
bool with_half(int dtype, Fn &&fn) {
    switch (dtype) {
    case HE_DTYPE_BF16: fn(Bf16Op{}); return true;
    case HE_DTYPE_F16: fn(F16Op{}); return true;
    default: return false;
    }
}

// Writers for kernels whose output is f32 or a half format: put one value, or four from a float4 (16-byte
// aligned for f32, 8-byte for halves).
struct F32Out {
    static constexpr int ID = HE_DTYPE_F32;
    using T = float;
    static __device__ __forceinline__ void put(T *o, float v) { *o = v; }
    static __device__ __forceinline__ void put4(T *o, float4 v) { *reinterpret_cast<float4 *>(o) = v; }
    // An f32 value is held exactly: its residue is 0.
    static __device__ __forceinline__ void put_residue(T *o, float) { *o = 0.f; }
    static __device__ __forceinline__ void put4_residue(T *o, float4) {
        *reinterpret_cast<float4 *>(o) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
};
template <typename Op>
struct HalfOut {
    static constexpr int ID = Op::ID;
    using T = typename Op::T;
    static __device__ __forceinline__ void put(T *o, float v) {
        *reinterpret_cast<unsigned short *>(o) = (unsigned short)(Op::pack(v, 0.f) & 0xffffu);
    }
    static __device__ __forceinline__ void put4(T *o, float4 v) {
        *reinterpret_cast<uint2 *>(o) = make_uint2(Op::pack(v.x, v.y), Op::pack(v.z, v.w));
    }
    // v - half(v), in the half format: a product of it added to one of half(v) is one of v to ~2^-16.
    static __device__ __forceinline__ float residue(float v) { return v - Op::unpack(Op::pack(v, 0.f) & 0xffffu); }
    static __device__ __forceinline__ void put_residue(T *o, float v) { put(o, residue(v)); }
    static __device__ __forceinline__ void put4_residue(T *o, float4 v) {
        put4(o, make_float4(residue(v.x), residue(v.y), residue(v.z), residue(v.w)));
    }
};

// Calls fn(Out{}) for HE_DTYPE_F32 or a half format; false for any other.
template <typename Fn>
bool with_out(int dtype, Fn &&fn) {
    switch (dtype) {
    case HE_DTYPE_F32: fn(F32Out{}); return true;
    case HE_DTYPE_BF16: fn(HalfOut<Bf16Op>{}); return true;
    case HE_DTYPE_F16: fn(HalfOut<F16Op>{}); return true;
    default: return false;
    }
}

__device__ __forceinline__ unsigned int smem_addr(const void *p) {
    return (unsigned int)__cvta_generic_to_shared(p);
}

// Four 8x8 matrices of 16-bit values; lanes 8i..8i+7 give the row addresses of matrix i, and each lane
// gets (row lane/4, columns 2(lane%4), +1) of every matrix; .trans gives (rows 2(lane%4), +1; column lane/4).
__device__ __forceinline__ void ldmatrix_x4(unsigned int (&r)[4], const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int (&r)[4], const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
}

// A warp's MT x NT m16n8k16 accumulators over one BK-column tile in shared memory: A's rows from wm of
// `as`, B's (the weights, k-major) from wn of `bs`, rows STRIDE halves apart; Op gives the half format.
template <typename Op, int MT, int NT, int BK, int STRIDE>
__device__ __forceinline__ void mma_warp_tile(float (&acc)[MT][NT][4], const unsigned short *as,
                                              const unsigned short *bs, unsigned int wm, unsigned int wn,
                                              unsigned int lane) {
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
        unsigned int af[MT][4], bf[NT / 2][4];
#pragma unroll
        for (int i = 0; i < MT; i++) ldmatrix_x4(af[i], as + (wm + i * 16 + lane % 16) * STRIDE + kk + (lane / 16) * 8);
#pragma unroll
        for (int j = 0; j < NT / 2; j++)
            ldmatrix_x4(bf[j], bs + (wn + j * 16 + lane % 8 + (lane / 16) * 8) * STRIDE + kk + ((lane / 8) % 2) * 8);
#pragma unroll
        for (int i = 0; i < MT; i++)
#pragma unroll
            for (int j = 0; j < NT; j++) Op::mma(acc[i][j], af[i], bf[j / 2][(j % 2) * 2], bf[j / 2][(j % 2) * 2 + 1]);
    }
}

// 16 bytes from global to shared memory without passing through registers; zeros where !valid (the
// source is then not read, but must still be a mapped address).
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING));
}

// Programmatic dependent launch (sm_90 and newer): a kernel launched with it may start while the kernel
// before it in the stream finishes, and waits (pdl_wait) before it reads anything that kernel writes or
// writes anything it reads; pdl_launch_dependents lets the next such kernel start once every block of
// this one has begun. Both are no-ops on older cards.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether launches may overlap the kernel before them: where `allowed` (hostembed_tuning's overlap), on
// sm_90 and newer.
inline bool pdl_enabled(bool allowed) {
    int dev = 0, major = 0;
    return allowed && cudaGetDevice(&dev) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9;
}

// Launches `kernel` as a programmatic dependent of the kernel before it in the stream where
// pdl_enabled(tuning.overlap): its blocks may start while that kernel's last blocks run, so the kernel
// must call pdl_wait() before it touches memory that kernel reads or writes. Returns the launch's status.
template <typename... Params, typename... Args>
cudaError_t launch_overlapped(const hostembed_tuning &tuning, void (*kernel)(Params...), dim3 grid, dim3 block,
                              size_t smem, cudaStream_t stream, Args &&...args) {
    cudaLaunchAttribute overlap;
    overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    overlap.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = &overlap;
    config.numAttrs = pdl_enabled(tuning.overlap != 0) ? 1 : 0;
    return cudaLaunchKernelEx(&config, kernel, static_cast<Args &&>(args)...);
}

// Raises a kernel's dynamic shared memory limit to `bytes` (beyond the default 48 KiB).
template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, int bytes) {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

}  // namespace he
#endif
