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

/// Blocks a flash launch should give the card: a short chunk over a long context (a question after a
/// cached system prompt: 2 query blocks of 32 heads) has too few and cuts its context into parts.
const FLASH_FILL_BLOCKS: usize = 256;
/// 64-position tiles a part takes at least, and the most parts.
const FLASH_PART_TILES_MIN: usize = 4;
const FLASH_MAX_PARTS: usize = 16;

/// Where a flash launch cut in parts keeps their results until they are merged (the split attention's
/// partial buffer, free again by the time the prompt pieces' attention runs).
#[derive(Clone, Copy)]
pub(in crate::gpu) struct FlashPartial {
    pub ptr: *mut f32,
    pub floats: usize,
}

/// (parts, tiles a part) of the flash launch of `n` queries whose context reaches `ctx` positions: from
/// the piece's own shape and the buffer's room only, so a piece has the same bits alone or in a batch.
/// One part (no cut) for a sliding window, whose early tiles are skipped anyway.
pub(in crate::gpu) fn flash_parts(a: &AttentionShape, ctx: usize, room_floats: usize) -> (usize, usize) {
    let qblocks = a.n.div_ceil(64);
    let tiles = ctx.div_ceil(64);
    let room = room_floats / (qblocks * 64 * a.heads * (a.head_dim + 2)).max(1);
    let parts = FLASH_FILL_BLOCKS
        .div_ceil((qblocks * a.heads).max(1))
        .min(tiles / FLASH_PART_TILES_MIN)
        .min(FLASH_MAX_PARTS)
        .min(room);
    if parts <= 1 || a.window != 0 {
        return (1, 0);
    }
    let part_tiles = tiles.div_ceil(parts);
    (tiles.div_ceil(part_tiles), part_tiles)
}

/// Causal flash attention of a prompt chunk's `n` queries over the pages of their stream (page table
/// `table`), whose context reaches `ctx` positions, into `out` (`dtype`, rows `out_stride` values apart);
/// the stream's first positions from `stage` when given; cut in parts (`flash_parts`) through `partial`.
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
    ctx: usize,
    partial: FlashPartial,
    s: cudaStream_t,
) -> Result<()> {
    let (stage_ptr, stage_tokens, staged) = match stage {
        Some(st) => (st.ptr as *const c_void, st.tokens as c_uint, st.ctx as c_uint),
        None => (std::ptr::null(), 0, 0),
    };
    let a = shape;
    let (parts, part_tiles) = flash_parts(&a, ctx, partial.floats);
    // SAFETY: device pointers into live allocations sized for these shapes, `partial` holding
    // `partial.floats` floats (see the module's note).
    let code = unsafe {
        kn::hostembed_flash_attention_parts(
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
            parts as c_uint,
            part_tiles as c_uint,
            partial.ptr,
            partial.floats,
            s,
        )
    };
    cuda::check(code, "hostembed_flash_attention_parts")
}
