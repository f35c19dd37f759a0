//! Flash attention's launchers (kernels/flash.cu): which heads it takes, an 8-bit cache's stage, and the
//! attention of a prompt chunk. Pointers as `launch`'s module note says.

use std::os::raw::{c_int, c_uint, c_void};

use super::{AttentionShape, KvPages};
use crate::cuda;
use crate::cudart::cudaStream_t;
use crate::kernels as kn;
use crate::status::Result;
use crate::tensor::DType;

/// Whether the flash kernel takes heads of `head_dim` values.
pub(in crate::gpu) fn flash_supports(head_dim: usize) -> bool {
    // SAFETY: a pure query on a number.
    u32::try_from(head_dim).is_ok_and(|d| unsafe { kn::hostembed_flash_head_dim(d) } == crate::cudart::cudaSuccess)
}

/// An 8-bit cache's stage for flash attention: `tokens` positions' f16 rows at `ptr` (scratch), of
/// which the stream's first `ctx` are written (`flash_stage`).
#[derive(Clone, Copy)]
pub(in crate::gpu) struct FlashStage {
    pub ptr: *mut c_void,
    pub tokens: usize,
    pub ctx: usize,
}

/// Decodes the first `stage.ctx` positions of the stream whose page table is `table` into the stage
/// (as many as it holds), for the flash attention after it.
pub(in crate::gpu) fn flash_stage(
    kv: KvPages,
    table: *const c_uint,
    kv_heads: usize,
    head_dim: usize,
    stage: FlashStage,
    s: cudaStream_t,
) -> Result<()> {
    // SAFETY: device pointers into live allocations: one layer's pool, a page table covering `ctx`
    // positions, a stage of `tokens` positions of every kv head (see the module's note).
    let code = unsafe {
        kn::hostembed_flash_stage(
            kv.pool,
            table,
            kv.pages as c_uint,
            kv.kv.k as c_int,
            kv.kv.v as c_int,
            kv_heads as c_uint,
            head_dim as c_uint,
            stage.ctx as c_uint,
            stage.ptr,
            stage.tokens as c_uint,
            s,
        )
    };
    cuda::check(code, "hostembed_flash_stage")
}

/// Causal flash attention of a prompt chunk's `n` queries over the pages of their stream (page table
/// `table`), into `out` (`dtype`, rows `out_stride` values apart); the stream's first positions from
/// `stage` when given.
pub(in crate::gpu) fn flash_attention(
    q: *const f32,
    shape: AttentionShape,
    kv: KvPages,
    table: *const c_uint,
    pos: *const c_int,
    scale: f32,
    out: *mut c_void,
    dtype: DType,
    out_stride: usize,
    stage: Option<FlashStage>,
    s: cudaStream_t,
) -> Result<()> {
    let (stage_ptr, stage_tokens, staged) = match stage {
        Some(st) => (st.ptr as *const c_void, st.tokens as c_uint, st.ctx as c_uint),
        None => (std::ptr::null(), 0, 0),
    };
    let a = shape;
    // SAFETY: device pointers into live allocations sized for these shapes (see the module's note).
    let code = unsafe {
        kn::hostembed_flash_attention(
            q,
            a.qkv_stride as c_uint,
            kv.pool,
            table,
            kv.pages as c_uint,
            kv.kv.k as c_int,
            kv.kv.v as c_int,
            pos,
            a.n as c_uint,
            a.heads as c_uint,
            a.kv_heads as c_uint,
            a.head_dim as c_uint,
            scale,
            a.window as c_uint,
            out,
            dtype as c_int,
            out_stride as c_uint,
            stage_ptr,
            stage_tokens,
            staged,
            s,
        )
    };
    cuda::check(code, "hostembed_flash_attention")
}
