//! The scratch allocation: activations of one prompt chunk (f32, and the half-format copies the
//! tensor-core products read), the logits, the attention's partial results, the sampler's buffers, the
//! slab weights of other formats are converted into for those products and their library's workspace,
//! at offsets `ScratchLayout` fixes; and the copies in and out of it.

use std::os::raw::c_void;

use super::{GpuModel, Layout};
use crate::cuda;
use crate::cudart as rt;
use crate::model::ModelConfig;
use crate::status::Result;

/// Blocks the attention kernel aims for per launch: two per SM of a 132-SM card.
const ATTENTION_TARGET_BLOCKS: usize = 264;
const ATTENTION_MAX_SPLITS: usize = 64;
/// Query heads one attention block takes (a power of two), as the attention launcher picks it.
fn heads_per_block(cfg: &ModelConfig) -> usize {
    let group = cfg.heads / cfg.kv_heads.max(1);
    let cap = if cfg.head_dim > 128 { 4 } else { 8 };
    let mut hb = 1;
    while hb < group && hb < cap {
        hb *= 2;
    }
    hb
}

/// Context splits for `n` query tokens: enough blocks to fill the card, at most 64.
pub(super) fn attention_splits(cfg: &ModelConfig, n: usize) -> usize {
    let group = cfg.heads / cfg.kv_heads.max(1);
    let blocks = cfg.kv_heads * group.div_ceil(heads_per_block(cfg)) * n.max(1);
    ATTENTION_TARGET_BLOCKS.div_ceil(blocks).clamp(1, ATTENTION_MAX_SPLITS)
}

/// The scratch allocation: byte offsets of each buffer.
pub(super) struct ScratchLayout {
    pub(super) x: usize,
    pub(super) xn: usize,
    pub(super) qkv: usize,
    pub(super) attn: usize,
    pub(super) gate: usize,
    pub(super) up: usize,
    pub(super) logits: usize,
    pub(super) partial: usize,
    pub(super) inv_freq: usize,
    pub(super) ids: usize,
    pub(super) pos: usize,
    pub(super) token: usize,
    pub(super) sample: usize,
    /// The repetition penalty's ids and saved logits (`launch::sample`): 8 bytes a vocabulary entry.
    pub(super) penalty: usize,
    /// Half-format activations of a chunk: the normed input, the attention output or the SwiGLU.
    pub(super) act: usize,
    /// One weight matrix converted to the half format (absent when every matrix is in it).
    pub(super) slab: usize,
    pub(super) workspace: usize,
    pub(super) total: usize,
}

impl ScratchLayout {
    /// Scratch for chunks of `max_batch` tokens; `slab_values` is the largest matrix the prompt path
    /// converts (0 for none).
    pub(super) fn new(cfg: &ModelConfig, max_batch: usize, slab_values: usize) -> ScratchLayout {
        let b = max_batch.max(1);
        let f = 4;
        let partial_floats =
            (1..=b).map(|n| n * attention_splits(cfg, n) * cfg.heads * (cfg.head_dim + 2)).max().unwrap_or(0);
        let mut l = Layout::default();
        let x = l.push(b * cfg.hidden * f);
        let xn = l.push(b * cfg.hidden * f);
        let qkv = l.push(b * (cfg.q_dim() + 2 * cfg.kv_dim()) * f);
        let attn = l.push(b * cfg.q_dim() * f);
        let gate = l.push(b * cfg.intermediate * f);
        let up = l.push(b * cfg.intermediate * f);
        let logits = l.push(cfg.vocab * f);
        let partial = l.push(partial_floats * f);
        let inv_freq = l.push(cfg.head_dim / 2 * f);
        let ids = l.push(b * 4);
        let pos = l.push(b * 4);
        let token = l.push(4);
        let sample = l.push(cfg.vocab * 8);
        let penalty = l.push(cfg.vocab * 8);
        let act = l.push(b * cfg.hidden.max(cfg.q_dim()).max(cfg.intermediate) * 2);
        let slab = l.push(slab_values * 2);
        let workspace = l.push(super::blas::WORKSPACE_BYTES);
        ScratchLayout {
            x,
            xn,
            qkv,
            attn,
            gate,
            up,
            logits,
            partial,
            inv_freq,
            ids,
            pos,
            token,
            sample,
            penalty,
            act,
            slab,
            workspace,
            total: l.total,
        }
    }
}

impl GpuModel {
    /// A pointer `offset` bytes into the scratch allocation.
    pub(super) fn buf(&self, offset: usize) -> *mut c_void {
        (self.scratch.ptr() as *mut u8).wrapping_add(offset) as *mut c_void
    }

    /// Copies scratch bytes at `offset` to the host after the stream's queued work.
    pub(super) fn download<T: Copy>(&self, offset: usize, out: &mut [T]) -> Result<()> {
        let s = self.stream.raw();
        cuda::check(
            // SAFETY: `out` is a host slice of the copy's size; the offset lies in the scratch allocation.
            unsafe {
                rt::cudaMemcpyAsync(
                    out.as_mut_ptr() as *mut c_void,
                    self.buf(offset),
                    std::mem::size_of_val(out),
                    rt::cudaMemcpyDeviceToHost,
                    s,
                )
            },
            "cudaMemcpyAsync(device to host)",
        )?;
        self.stream.synchronize()
    }

    pub(super) fn upload<T: Copy>(&self, offset: usize, data: &[T]) -> Result<()> {
        cuda::check(
            // SAFETY: pageable `data` is staged before this returns; the offset lies in the scratch allocation.
            unsafe {
                rt::cudaMemcpyAsync(
                    self.buf(offset),
                    data.as_ptr() as *const c_void,
                    std::mem::size_of_val(data),
                    rt::cudaMemcpyHostToDevice,
                    self.stream.raw(),
                )
            },
            "cudaMemcpyAsync(host to device)",
        )
    }
}
