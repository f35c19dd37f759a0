//! The C launchers in kernels/*.cu, declared by hand like the runtime (build.rs checks them
//! against kernels/hostembed_kernels.cuh). Each launches on the given stream and returns
//! cudaGetLastError(); none synchronizes.
#![allow(dead_code)]

use crate::cuda_fns;
use crate::cudart::{cudaError_t, cudaStream_t};
use crate::tuning::{MmvStage, MoeMmvCut, Tuning};
use std::os::raw::{c_char, c_int, c_uint, c_void};

/// One row's settings for `hostembed_sample_rows`, as kernels/hostembed_kernels.cuh declares it: what
/// `hostembed_sample` takes for one row, its `n_penalty` ids at `ids[penalty_at..]`, and the row of the
/// masks holding the ids it may draw (`NO_MASK`: every id).
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct hostembed_sample_row {
    pub temperature: f32,
    pub top_k: c_uint,
    pub top_p: f32,
    pub min_p: f32,
    pub repeat_penalty: f32,
    pub n_penalty: c_uint,
    pub penalty_at: c_uint,
    pub stream_index: c_uint,
    pub seed: u64,
    pub position: u64,
    pub mask_row: c_uint,
    pub reserved: c_uint,
}
const _: () = assert!(std::mem::size_of::<hostembed_sample_row>() == 56);

/// How the launchers that take it launch, as kernels/hostembed_kernels.cuh declares it: the kernel side
/// of the engine's `Tuning` (`hostembed_tuning::of`). Every setting gives the same bits.
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct hostembed_tuning {
    /// Non-zero: a launch may start while the kernel before it finishes (sm_90 and newer).
    pub overlap: c_int,
    /// When hostembed_mmv stages its weights: `MMV_STAGE_*`.
    pub mmv_stage: c_int,
    /// Tokens an integer hostembed_mmv launch takes; 0 is the kernel's own choice.
    pub mmvq_tokens: c_uint,
    /// Non-zero: half hostembed_mmv launches of many tokens convert their activations once.
    pub mmv_prep: c_int,
    /// Non-zero: integer hostembed_mmv launches of more than 8 tokens take the tile kernel.
    pub mmv_tc_blocks: c_int,
    /// Which decode attention kernel a launch takes: 0 by its block count, 1 the one with more loads in
    /// flight a thread, 2 the one with twice the blocks a multiprocessor.
    pub attention_blocks: c_uint,
    /// Half hostembed_mmv launches of more than 8 tokens on an sm_90 card: 0 mma.sync, 1 the warpgroup
    /// products, 2 their pipelined kernel.
    pub mmv_wgmma: c_int,
    /// Non-zero: a Mixture-of-Experts decode piece's down product has its experts' rows fetched into L2
    /// while the gate and up product runs.
    pub moe_prefetch: c_int,
    /// How a Mixture-of-Experts decode product cuts an expert's columns: `MOE_CUT_*`.
    pub moe_mmv_cut: c_int,
}
const _: () = assert!(std::mem::size_of::<hostembed_tuning>() == 36);

/// `hostembed_tuning::moe_mmv_cut` values (HE_MOE_CUT_*).
pub const MOE_CUT_FILL: c_int = 0;
pub const MOE_CUT_WAVES: c_int = 1;
pub const MOE_CUT_ONE: c_int = 2;

/// `hostembed_tuning::mmv_stage` values (HE_MMV_STAGE_*).
pub const MMV_STAGE_NEVER: c_int = 0;
pub const MMV_STAGE_MEASURED: c_int = 1;
pub const MMV_STAGE_ALWAYS: c_int = 2;

impl hostembed_tuning {
    /// The kernels' part of `tuning`.
    pub fn of(tuning: &Tuning) -> hostembed_tuning {
        hostembed_tuning {
            overlap: tuning.overlap as c_int,
            mmv_stage: match tuning.mmv_stage {
                MmvStage::Never => MMV_STAGE_NEVER,
                MmvStage::Measured => MMV_STAGE_MEASURED,
                MmvStage::Always => MMV_STAGE_ALWAYS,
            },
            mmvq_tokens: tuning.mmvq_tokens,
            mmv_prep: tuning.mmv_prep as c_int,
            mmv_tc_blocks: tuning.mmv_tc_blocks as c_int,
            attention_blocks: match tuning.attention_wide {
                None => 0,
                Some(false) => 1,
                Some(true) => 2,
            },
            mmv_wgmma: tuning.mmv_wgmma as c_int,
            moe_prefetch: tuning.moe_prefetch as c_int,
            moe_mmv_cut: match tuning.moe_mmv_cut {
                MoeMmvCut::Fill => MOE_CUT_FILL,
                MoeMmvCut::Waves => MOE_CUT_WAVES,
                MoeMmvCut::One => MOE_CUT_ONE,
            },
        }
    }
}

impl Default for hostembed_tuning {
    /// Every setting as shipped.
    fn default() -> hostembed_tuning {
        hostembed_tuning::of(&Tuning::default())
    }
}

/// `hostembed_glu_to`'s activations (HE_ACT_*).
pub const ACT_SILU: c_int = 0;
pub const ACT_GELU_TANH: c_int = 1;

/// `hostembed_sample_row::mask_row` of a row drawn among every id (HOSTEMBED_NO_MASK).
pub const NO_MASK: c_uint = c_uint::MAX;

cuda_fns! {
    // embed.cu
    pub fn hostembed_embed_gather(rows: *const c_void, dtype: c_int, vocab: c_uint, cols: c_uint, ids: *const c_int, n: c_uint, out: *mut c_void, out_dtype: c_int, bad: *mut c_int, stream: cudaStream_t) -> cudaError_t;
    // decode kernels
    pub fn hostembed_rmsnorm(x: *const f32, w: *const f32, eps: f32, out: *mut f32, n: c_uint, cols: c_uint, tuning: hostembed_tuning, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_matvec(w: *const c_void, dtype: c_int, rows: c_uint, cols: c_uint, x: *const f32, n: c_uint, bias: *const f32, residual: *const f32, y: *mut f32, ldy: c_uint, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_matvec_swiglu(w_gate: *const c_void, w_up: *const c_void, dtype: c_int, rows: c_uint, cols: c_uint, x: *const f32, n: c_uint, y: *mut f32, stream: cudaStream_t) -> cudaError_t;
    // mmv.cu
    pub fn hostembed_mmv(w: *const c_void, dtype: c_int, rows: c_uint, cols: c_uint, x: *const f32, n: c_uint, bias: *const f32, residual: *const f32, y: *mut f32, ldy: c_uint, partial: *mut f32, counters: *mut c_uint, tuning: hostembed_tuning, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_mmv_swiglu(w_gate: *const c_void, w_up: *const c_void, dtype: c_int, rows: c_uint, cols: c_uint, x: *const f32, n: c_uint, y: *mut f32, partial: *mut f32, counters: *mut c_uint, tuning: hostembed_tuning, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_mmv_supports(dtype: c_int, w: *const c_void, cols: c_uint) -> cudaError_t;
    pub fn hostembed_mmv_workspace(rows: c_uint, cols: c_uint, glu: c_int, n: c_uint, partial_floats: *mut usize, counters: *mut c_uint) -> cudaError_t;
    pub fn hostembed_rope_kv(qkv: *mut f32, qkv_stride: c_uint, n: c_uint, pos: *const c_int, heads: c_uint, kv_heads: c_uint, head_dim: c_uint, inv_freq: *const f32, interleaved: c_int, q_norm: *const f32, k_norm: *const f32, eps: f32, kv_pool: *mut c_void, tables: *const *const c_uint, pool_pages: c_uint, k_type: c_int, v_type: c_int, tuning: hostembed_tuning, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_kv_page_tokens(page_tokens: *mut c_uint) -> cudaError_t;
    pub fn hostembed_attention(q: *const f32, q_stride: c_uint, kv_pool: *const c_void, tables: *const *const c_uint, pool_pages: c_uint, k_type: c_int, v_type: c_int, pos: *const c_int, n: c_uint, heads: c_uint, kv_heads: c_uint, head_dim: c_uint, scale: f32, window: c_uint, splits: c_uint, grid_parts: c_uint, partial: *mut f32, out: *mut f32, tuning: hostembed_tuning, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_attention_combined(q: *const f32, q_stride: c_uint, kv_pool: *const c_void, tables: *const *const c_uint, pool_pages: c_uint, k_type: c_int, v_type: c_int, pos: *const c_int, n: c_uint, heads: c_uint, kv_heads: c_uint, head_dim: c_uint, scale: f32, window: c_uint, splits: c_uint, grid_parts: c_uint, partial: *mut f32, out: *mut f32, counters: *mut c_uint, tuning: hostembed_tuning, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_glu_to(gate: *const f32, up: *const f32, out: *mut c_void, out_dtype: c_int, act: c_int, len: usize, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_add(a: *const f32, b: *const f32, out: *mut f32, len: usize, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_scale(x: *mut f32, factor: f32, len: usize, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_rmsnorm_add(y: *const f32, w: *const f32, eps: f32, x: *mut f32, n: c_uint, cols: c_uint, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_sample_rows(logits: *mut f32, vocab: c_uint, rows: c_uint, settings: *const hostembed_sample_row, ids: *const c_int, n_ids: c_uint, masks: *const c_uint, scratch: *mut c_void, scratch_size: usize, tokens: *mut c_int, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_sample(logits: *mut f32, vocab: c_uint, temperature: f32, top_k: c_uint, top_p: f32, min_p: f32, repeat_penalty: f32, penalty: *mut c_int, n_penalty: c_uint, seed: u64, stream_index: c_uint, position: u64, scratch: *mut c_void, token: *mut c_int, stream: cudaStream_t) -> cudaError_t;
    // logprob.cu
    pub fn hostembed_row_logprobs(logits: *const f32, vocab: c_uint, rows: c_uint, targets: *const c_int, out: *mut f32, stream: cudaStream_t) -> cudaError_t;
    // prompt chunks on tensor cores: gemm.cu, flash.cu, and the half-format writers of norm.cu and act.cu
    pub fn hostembed_gemm(a: *const c_void, lda: c_uint, w: *const c_void, dtype: c_int, rows: c_uint, cols: c_uint, n: c_uint, bias: *const f32, residual: *const f32, y: *mut f32, ldy: c_uint, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_convert_matrix(w: *const c_void, w_dtype: c_int, rows: c_uint, cols: c_uint, out: *mut c_void, out_dtype: c_int, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_add_bias(y: *mut f32, ldy: c_uint, bias: *const f32, rows: c_uint, n: c_uint, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_rmsnorm_to(x: *const f32, w: *const f32, eps: f32, out: *mut c_void, residue: *mut c_void, out_dtype: c_int, n: c_uint, cols: c_uint, tuning: hostembed_tuning, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_convert(x: *const f32, out: *mut c_void, out_dtype: c_int, len: usize, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_flash_head_dim(head_dim: c_uint) -> cudaError_t;
    pub fn hostembed_flash_attention(q: *const f32, q_stride: c_uint, kv_pool: *const c_void, table: *const c_uint, pool_pages: c_uint, k_type: c_int, v_type: c_int, pos: *const c_int, n: c_uint, heads: c_uint, kv_heads: c_uint, head_dim: c_uint, scale: f32, window: c_uint, out: *mut c_void, out_dtype: c_int, out_stride: c_uint, stage: *const c_void, stage_tokens: c_uint, staged: c_uint, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_flash_attention_parts(q: *const f32, q_stride: c_uint, kv_pool: *const c_void, table: *const c_uint, pool_pages: c_uint, k_type: c_int, v_type: c_int, pos: *const c_int, n: c_uint, heads: c_uint, kv_heads: c_uint, head_dim: c_uint, scale: f32, window: c_uint, out: *mut c_void, out_dtype: c_int, out_stride: c_uint, stage: *const c_void, stage_tokens: c_uint, staged: c_uint, parts: c_uint, part_tiles: c_uint, partial: *mut f32, partial_floats: usize, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_flash_stage(kv_pool: *const c_void, table: *const c_uint, pool_pages: c_uint, k_type: c_int, v_type: c_int, kv_heads: c_uint, head_dim: c_uint, ctx: c_uint, stage: *mut c_void, stage_tokens: c_uint, stream: cudaStream_t) -> cudaError_t;
    // moe.cu
    pub fn hostembed_moe_router(router: *const c_void, dtype: c_int, experts: c_uint, cols: c_uint, x: *const f32, n: c_uint, logits: *mut f32, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_moe_route(logits: *const f32, experts: c_uint, n: c_uint, k: c_uint, norm_topk: c_int, ids: *mut c_int, weights: *mut f32, groups: *mut c_int, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_moe_router_route(router: *const c_void, dtype: c_int, experts: c_uint, cols: c_uint, x: *const f32, n: c_uint, logits: *mut f32, route_n: c_uint, k: c_uint, norm_topk: c_int, ids: *mut c_int, weights: *mut f32, groups: *mut c_int, counter: *mut c_uint, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_moe_gate_up(gate: *const c_void, up: *const c_void, dtype: c_int, expert_bytes: usize, width: c_uint, cols: c_uint, x: *const f32, groups: *const c_int, experts: c_uint, n: c_uint, k: c_uint, act: *mut f32, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_moe_down(down: *const c_void, dtype: c_int, expert_bytes: usize, rows: c_uint, cols: c_uint, act: *const f32, groups: *const c_int, experts: c_uint, n: c_uint, k: c_uint, out: *mut f32, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_moe_sum(out: *const f32, weights: *const f32, rows: c_uint, n: c_uint, k: c_uint, x: *mut f32, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_widen(x: *const c_void, dtype: c_int, out: *mut f32, len: usize, stream: cudaStream_t) -> cudaError_t;
    // moe_mmv.cu
    pub fn hostembed_moe_mmv(w: *const c_void, w2: *const c_void, dtype: c_int, expert_bytes: usize, rows: c_uint, cols: c_uint, x: *const f32, x_div: c_uint, groups: *const c_int, experts: c_uint, n: c_uint, k: c_uint, y: *mut f32, partial: *mut f32, counters: *mut c_uint, tuning: hostembed_tuning, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_moe_mmv_sum(w: *const c_void, dtype: c_int, expert_bytes: usize, rows: c_uint, cols: c_uint, x: *const f32, groups: *const c_int, experts: c_uint, n: c_uint, k: c_uint, y: *mut f32, partial: *mut f32, counters: *mut c_uint, weights: *const f32, sums: *mut f32, sum_counters: *mut c_uint, sum_counter_count: c_uint, tuning: hostembed_tuning, stream: cudaStream_t) -> cudaError_t;
    pub fn hostembed_moe_mmv_supports(dtype: c_int, w: *const c_void, expert_bytes: usize, cols: c_uint) -> cudaError_t;
    pub fn hostembed_moe_mmv_workspace(rows: c_uint, cols: c_uint, glu: c_int, experts: c_uint, n: c_uint, k: c_uint, partial_floats: *mut usize, counters: *mut c_uint) -> cudaError_t;
    // moe_gemm.cu
    pub fn hostembed_moe_grouped(a: *const c_void, lda: c_uint, per: c_uint, dtype: c_int, w: *const c_void, w_dtype: c_int, rows: c_uint, cols: c_uint, groups: *const c_int, experts: c_uint, slots: c_uint, gate: *const f32, out: *mut c_void, ldy: c_uint, stream: cudaStream_t) -> cudaError_t;
    // device.cu
    pub fn hostembed_device_name(device: c_int, name: *mut c_char, len: usize) -> cudaError_t;
}
