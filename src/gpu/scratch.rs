//! The scratch allocation: activations of one pass (f32, and the half-format copies the tensor-core
//! products read), each token's id, position and page table, the logits of up to `logit_rows` items,
//! the attention's partial results, the sampler's buffers and the constrained rows' masks, the slab
//! weights of other formats are converted into for those products and their library's workspace, at
//! offsets `ScratchLayout` fixes; and the copies in and out of it.

use std::os::raw::c_void;

use super::{GpuModel, Layout};
use crate::cuda;
use crate::cudart as rt;
use crate::kv::KvTypes;
use crate::model::ModelConfig;
use crate::status::Result;

/// Positions of one part of a `context`-position context cut in at most `parts` parts: whole 32-position
/// units, at least 128 (kernels/attention.cu's `part_positions`).
fn part_positions(context: usize, parts: usize) -> usize {
    context.div_ceil(32).div_ceil(parts).max(4) * 32
}

/// Blocks an attention launch gives each token's parts when its longest context is `max_context`: the
/// parts that context fills, rounded up to a power of two (so that few sizes of a decode pass are
/// captured as graphs), at most `parts`. Any value from 1 to `parts` gives the same bits (a block takes
/// parts in turn); fewer only run slower, more are blocks that leave at once.
pub fn attention_grid_parts(max_context: usize, parts: usize) -> usize {
    let filled = max_context.div_ceil(part_positions(max_context, parts)).max(1);
    filled.next_power_of_two().min(parts)
}

/// `attention_grid_parts` of the model's parts, or every part its own block (the grid before it) with
/// `Tuning::attention_grid_full` (`HOSTEMBED_ATTENTION_GRID=full`), to measure the two in one build.
pub(super) fn attention_grid(max_context: usize, parts: usize, full: bool) -> usize {
    if full { parts } else { attention_grid_parts(max_context, parts) }
}

/// Query tokens one attention launch takes (its partial results are sized for this many).
pub(super) const ATTENTION_TOKENS: usize = 64;
/// Items whose logits one step keeps on the device (more spill to the host).
pub(super) const LOGIT_ROWS: usize = 64;
/// The most positions of a stream an 8-bit cache's stage holds for a prompt chunk's flash attention
/// (kernels/flash.cu: decoded once a chunk instead of once a query block); past them the kernel decodes
/// in registers (at 65,536 positions, 60% of a BF16 cache's prompt speed with 32,768 staged; 99% with all).
/// 256 MiB for the Llama-3-8B shape's 8 kv heads of 128.
pub const STAGE_MAX_TOKENS: usize = 65536;
/// The flash kernel's tile of positions: a stage holds whole tiles.
const FLASH_TILE: usize = 64;

/// Positions the stage of a `window`-position stream holds: none unless prompt chunks take flash
/// attention (`flash`) and K or V is an 8-bit block type.
pub fn stage_tokens(kv: KvTypes, flash: bool, window: usize) -> usize {
    if !flash || !(kv.k.is_block() || kv.v.is_block()) {
        return 0;
    }
    window.next_multiple_of(FLASH_TILE).min(STAGE_MAX_TOKENS)
}

/// Bytes of a stage of `tokens` positions: f16 rows of every kv head, K's then V's (the kernels index
/// both, whichever of them is 8-bit).
fn stage_bytes(cfg: &ModelConfig, tokens: usize) -> usize {
    2 * tokens * cfg.kv_dim() * 2
}

/// kernels/mmv_readers.cuh's cut of a matrix (its MMV_* constants): output rows a block, the unit of column
/// ranges, blocks a launch aims at, column ranges at most, tokens a launch.
const MMV_BLOCK_ROWS: usize = 128;
const MMV_KC: usize = 256;
const MMV_TARGET_BLOCKS: usize = 256;
const MMV_MAX_SPLITS: usize = 16;
pub const MMV_MAX_TOKENS: usize = 64;
/// Launches of more tokens stage their activations once in the workspace (kernels/mmv.cuh's MMV_PREP_AFTER).
const MMV_PREP_AFTER: usize = 8;

/// (row blocks, column ranges) of a tensor-core decode product of `rows` x `cols`, as kernels/mmv_readers.cuh's mmv_shape.
pub fn mmv_shape(rows: usize, cols: usize, glu: bool) -> (usize, usize) {
    let out_rows = if glu { MMV_BLOCK_ROWS / 2 } else { MMV_BLOCK_ROWS };
    let row_blocks = rows.div_ceil(out_rows);
    let chunks = cols.div_ceil(MMV_KC);
    let mut splits = MMV_TARGET_BLOCKS.div_ceil(row_blocks).min(chunks).min(MMV_MAX_SPLITS);
    if row_blocks > MMV_TARGET_BLOCKS || splits == 0 {
        splits = 1;
    }
    let kr = chunks.div_ceil(splits) * MMV_KC;
    (row_blocks, cols.div_ceil(kr))
}

/// (partial floats, counters) a tensor-core decode product over `n` tokens needs, as
/// hostembed_mmv_workspace answers.
pub fn mmv_workspace(rows: usize, cols: usize, glu: bool, n: usize) -> (usize, usize) {
    let (row_blocks, splits) = mmv_shape(rows, cols, glu);
    let n = n.min(MMV_MAX_TOKENS);
    let sums = if splits > 1 { splits * if glu { 2 } else { 1 } * n * rows } else { 0 };
    // Then the activations staged once: a row (4 bytes a column) for every token of the launch's tiles of
    // 8 (the warpgroup kernel's layout holds absent ones too), and each token's group exponents.
    let tiles = if n <= 16 {
        2
    } else if n <= 32 {
        4
    } else {
        8
    };
    let prep = |n: usize| n * cols + n * cols.div_ceil(MMV_KC);
    let floats = if n > MMV_PREP_AFTER { sums.next_multiple_of(4) + prep(8 * tiles) } else { sums };
    (floats, if splits > 1 { row_blocks } else { 0 })
}

/// What the built kernels ask for (their knobs may differ from the defaults `mmv_workspace` mirrors);
/// None in a build without them.
fn kernels_workspace(rows: usize, cols: usize, glu: bool, n: usize) -> Option<(usize, usize)> {
    let (mut floats, mut counters) = (0usize, 0 as std::os::raw::c_uint);
    let (rows, cols, n) = (u32::try_from(rows).ok()?, u32::try_from(cols).ok()?, u32::try_from(n).ok()?);
    // SAFETY: host arithmetic on sizes, writing the two out-parameters only.
    let code =
        unsafe { crate::kernels::hostembed_mmv_workspace(rows, cols, glu as i32, n, &mut floats, &mut counters) };
    (code == 0).then_some((floats, counters as usize))
}

/// The most workspace any of a model's decode products needs over `n` tokens (each product shape the
/// forward pass may run: q/k/v fused, q/k fused or apart, o, gate and up fused or apart, down, the head).
fn mmv_workspace_for(cfg: &ModelConfig, n: usize) -> (usize, usize) {
    let (h, q, kv, i) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate);
    let shapes = [
        (q + 2 * kv, h, false),
        (q + kv, h, false),
        (q, h, false),
        (kv, h, false),
        (h, q, false),
        (i, h, true),
        (i, h, false),
        (h, i, false),
        (cfg.vocab, h, false),
    ];
    let dense = shapes.iter().fold((0, 0), |(p, c), &(rows, cols, glu)| {
        let (wp, wc) = kernels_workspace(rows, cols, glu, n).unwrap_or_else(|| mmv_workspace(rows, cols, glu, n));
        (p.max(wp), c.max(wc))
    });
    // A Mixture of Experts' decode rows take the same workspace (`launch::moe_mmv`, in stream order).
    let Some(m) = cfg.moe else { return dense };
    let rows = n.min(super::launch::MOE_MMV_ROWS);
    [(m.intermediate, h, true), (h, m.intermediate, false)].iter().fold(dense, |(p, c), &(r, cols, glu)| {
        let (wp, wc) = super::launch::moe_mmv_workspace(r, cols, glu, m.experts, rows, m.used).unwrap_or((0, 0));
        (p.max(wp), c.max(wc))
    })
}

/// The fused tails' arrival counters (u32 each, in this order): the router's one (padded to 16 bytes), a
/// decode piece's experts' weighted sums (its rows by the down product's row blocks), and the split
/// attention's (a launch's tokens by the query heads, which bound its groups of heads).
pub(super) struct TailCounts {
    pub(super) sums: usize,
    pub(super) attention: usize,
}

impl TailCounts {
    pub(super) const ROUTER: usize = 4;

    pub(super) fn new(cfg: &ModelConfig, max_batch: usize) -> TailCounts {
        let max_batch = max_batch.max(1);
        let rows = max_batch.min(super::launch::MOE_MMV_ROWS);
        let sums = if cfg.moe.is_some() { rows * cfg.hidden.div_ceil(MMV_BLOCK_ROWS) } else { 0 };
        TailCounts { sums, attention: max_batch.min(ATTENTION_TOKENS) * cfg.heads }
    }

    pub(super) fn total(&self) -> usize {
        Self::ROUTER + self.sums + self.attention
    }
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
    /// Its floats: the split attention's parts of up to ATTENTION_TOKENS rows, or a flash launch's parts.
    pub(super) partial_floats: usize,
    pub(super) inv_freq: usize,
    /// The local layers' rotary frequencies, right after the model's (a model with sliding-window layers).
    pub(super) inv_freq_local: Option<usize>,
    /// Per token: ids (i32), then positions (i32), then page table addresses (u64), `max_batch` each.
    pub(super) meta: usize,
    pub(super) ids: usize,
    pub(super) pos: usize,
    pub(super) tables: usize,
    /// Each row's page table of the local layers' pool.
    pub(super) local_tables: usize,
    /// Sampled tokens of the items whose logits are on the device, one i32 a logits row.
    pub(super) token: usize,
    pub(super) logit_rows: usize,
    /// The sampler's region (`launch::sample_rows`: settings, penalized ids, workspaces) and its bytes.
    pub(super) sample: usize,
    pub(super) sample_bytes: usize,
    /// The constrained rows' allowed ids, `mask_words` u32 words a logits row (`mask::MaskStage`).
    pub(super) masks: usize,
    pub(super) mask_words: usize,
    /// Half-format activations of a chunk: the normed input, the attention output or the SwiGLU.
    pub(super) act: usize,
    /// In the same region past a chunk's normed input: that input's rounding residue (k and v refined).
    pub(super) act_residue: usize,
    /// One weight matrix converted to the half format (absent when every matrix is in it).
    pub(super) slab: usize,
    /// The tensor-core decode products' partial sums and arrival counters (`launch::MmvWork`).
    pub(super) mmv_partial: usize,
    pub(super) mmv_counters: usize,
    pub(super) mmv_counter_bytes: usize,
    pub(super) workspace: usize,
    /// A Mixture-of-Experts layer's router logits, each row's chosen experts (i32) and their weights,
    /// the rows' slots grouped by expert (i32, `launch::groups_len`: the matrix-vector rows' groups, then
    /// the tensor-core rows'), the chosen experts' SwiGLU and down outputs (f32), and the tensor-core rows'
    /// SwiGLU in the half format, which their grouped down product reads (each empty for a dense model).
    pub(super) moe_logits: usize,
    pub(super) moe_ids: usize,
    pub(super) moe_weights: usize,
    pub(super) moe_groups: usize,
    pub(super) moe_act: usize,
    pub(super) moe_out: usize,
    pub(super) moe_half: usize,
    /// The fused tails' arrival counters (zeroed at load, left zero by every launch; `TailCounters`).
    pub(super) tail_counters: usize,
    pub(super) tail_counter_bytes: usize,
    /// An 8-bit cache's stage for flash attention (`stage_tokens` positions; none when 0).
    pub(super) stage: usize,
    pub(super) stage_tokens: usize,
    pub(super) total: usize,
}

impl ScratchLayout {
    /// Scratch for chunks of `max_batch` tokens; `slab_values` is the largest matrix the prompt path
    /// converts (0 for none); `stage_tokens` the positions of an 8-bit cache's flash stage (0 for none);
    /// `attention_parts` the parts the split attention cuts a context into.
    pub(super) fn new(
        cfg: &ModelConfig,
        max_batch: usize,
        slab_values: usize,
        stage_tokens: usize,
        attention_parts: usize,
    ) -> ScratchLayout {
        let b = max_batch.max(1);
        let f = 4;
        let logit_rows = LOGIT_ROWS.min(b);
        let partial_floats = b.min(ATTENTION_TOKENS) * attention_parts * cfg.heads * (cfg.head_dim + 2);
        let mut l = Layout::default();
        let x = l.push(b * cfg.hidden * f);
        let xn = l.push(b * cfg.hidden * f);
        let qkv = l.push(b * (cfg.q_dim() + 2 * cfg.kv_dim()) * f);
        let attn = l.push(b * cfg.q_dim() * f);
        let gate = l.push(b * cfg.intermediate * f);
        let up = l.push(b * cfg.intermediate * f);
        let logits = l.push(logit_rows * cfg.vocab * f);
        let partial = l.push(partial_floats * f);
        let tables = if cfg.attention.sliding.is_some() { 2 } else { 1 };
        let inv_freq = l.push(tables * cfg.head_dim / 2 * f);
        let inv_freq_local = (tables == 2).then_some(inv_freq + cfg.head_dim / 2 * f);
        let meta = l.push(b * 24);
        let (ids, pos, tables, local_tables) = (meta, meta + b * 4, meta + b * 8, meta + b * 16);
        let token = l.push(logit_rows * 4);
        let sample_bytes = super::launch::sample_rows_bytes(cfg.vocab, logit_rows);
        let sample = l.push(sample_bytes);
        let mask_words = cfg.vocab.div_ceil(32);
        let masks = l.push(logit_rows * mask_words * 4);
        let act = l.push(b * (2 * cfg.hidden).max(cfg.q_dim()).max(cfg.intermediate) * 2);
        let act_residue = act + b * cfg.hidden * 2;
        let slab = l.push(slab_values * 2);
        let (mmv_floats, mmv_count) = mmv_workspace_for(cfg, b);
        let mmv_partial = l.push(mmv_floats * f);
        let mmv_counter_bytes = mmv_count * 4;
        let mmv_counters = l.push(mmv_counter_bytes);
        let workspace = l.push(super::blas::WORKSPACE_BYTES);
        let stage = l.push(stage_bytes(cfg, stage_tokens));
        let (experts, k, width) = cfg.moe.map_or((0, 0, 0), |m| (m.experts, m.used, m.intermediate));
        let moe_logits = l.push(b * experts * f);
        let moe_ids = l.push(b * k * 4);
        let moe_weights = l.push(b * k * f);
        // The two row ranges' groups: one more header than the rows' slots take in one.
        let groups = super::launch::groups_len(experts, b * k) + super::launch::groups_len(experts, 0);
        let moe_groups = l.push(if k == 0 { 0 } else { groups * 4 });
        let moe_act = l.push(b * k * width * f);
        let moe_out = l.push(b * k * cfg.hidden * f);
        let moe_half = l.push(b * k * width * 2);
        let tail = TailCounts::new(cfg, b);
        let tail_counters = l.push(tail.total() * 4);
        ScratchLayout {
            x,
            xn,
            qkv,
            attn,
            gate,
            up,
            logits,
            partial,
            partial_floats,
            inv_freq,
            inv_freq_local,
            meta,
            ids,
            pos,
            tables,
            local_tables,
            token,
            logit_rows,
            sample,
            sample_bytes,
            masks,
            mask_words,
            act,
            act_residue,
            slab,
            mmv_partial,
            mmv_counters,
            mmv_counter_bytes,
            workspace,
            stage,
            stage_tokens,
            moe_logits,
            moe_ids,
            moe_weights,
            moe_groups,
            moe_act,
            moe_out,
            moe_half,
            tail_counters,
            tail_counter_bytes: tail.total() * 4,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_attention_grid_covers_every_filled_part_in_few_sizes() {
        for parts in [1, 3, 32, 64] {
            let mut sizes = std::collections::BTreeSet::new();
            let mut last = 0;
            for context in 0..=40_000 {
                let grid = attention_grid_parts(context, parts);
                let filled = context.div_ceil(part_positions(context, parts));
                assert!(filled <= parts, "{context} positions cut in {filled} of {parts} parts");
                assert!(grid >= filled.max(1) && grid <= parts, "{context} positions: grid {grid}, {filled} filled");
                assert!(grid.is_power_of_two() || grid == parts, "{context} positions: grid {grid}");
                assert!(grid >= last, "the grid shrank at {context} positions");
                last = grid;
                sizes.insert(grid);
            }
            // The graph keys a token count can take (graph.rs captures one a size).
            assert!(sizes.len() <= parts.ilog2() as usize + 2, "{parts} parts: grids {sizes:?}");
        }
        assert_eq!(attention_grid_parts(512, crate::tuning::ATTENTION_PARTS), 4);
        assert_eq!(attention_grid_parts(64, crate::tuning::ATTENTION_PARTS), 1);
        assert_eq!(attention_grid_parts(16_384, crate::tuning::ATTENTION_PARTS), 32);
    }

    /// A Mixture of Experts' decode rows share the dense products' workspace: it holds their split sums
    /// and counters for a launch's most rows (Qwen3-30B-A3B: gate and up of 768 x 2048 in 12 row blocks a
    /// chosen expert, cut in ceil(256 / (12 x 8)) = 3 column ranges; down of 2048 x 768 in 16, cut in 2).
    #[test]
    fn moe_decode_rows_fit_the_shared_workspace() {
        let cfg = ModelConfig::qwen3_30b_a3b();
        let layout = ScratchLayout::new(&cfg, 512, 0, 0, crate::tuning::ATTENTION_PARTS);
        let rows = super::super::launch::MOE_MMV_ROWS;
        let (partial_bytes, counter_bytes) = (layout.mmv_counters - layout.mmv_partial, layout.mmv_counter_bytes);
        for (r, c, glu, splits) in [(768, 2048, true, 3), (2048, 768, false, 2)] {
            // Host arithmetic of the kernels' library: absent from a build without kernels.
            let Some((floats, counters)) = super::super::launch::moe_mmv_workspace(r, c, glu, 128, rows, 8) else {
                return;
            };
            let parts = if glu { 2 } else { 1 };
            assert_eq!(floats, splits * parts * rows * 8 * r, "{r} x {c}: the split sums, a row of each slot");
            let row_blocks = r.div_ceil(if glu { 64 } else { 128 });
            assert_eq!(
                counters,
                128 * rows.div_ceil(16) * row_blocks,
                "{r} x {c}: a counter an expert, pass and row block"
            );
            assert!(floats * 4 <= partial_bytes, "{r} x {c}: {floats} floats in {partial_bytes} bytes");
            assert!(counters * 4 <= counter_bytes, "{r} x {c}: {counters} counters in {counter_bytes} bytes");
        }
    }

    /// The fused tails' counters: a decode piece's rows by the down product's row blocks (Qwen3-30B-A3B:
    /// 64 rows of 2,048 outputs in blocks of 128), an attention launch's tokens by the query heads, and
    /// none for the experts' sums of a dense model or for rows a batch cannot hold.
    #[test]
    fn the_tails_counters_cover_their_launches() {
        let moe = ModelConfig::qwen3_30b_a3b();
        let wide = TailCounts::new(&moe, 512);
        assert_eq!((wide.sums, wide.attention), (64 * 16, ATTENTION_TOKENS * moe.heads));
        let one = TailCounts::new(&moe, 1);
        assert_eq!((one.sums, one.attention), (16, moe.heads));
        let layout = ScratchLayout::new(&moe, 512, 0, 0, crate::tuning::ATTENTION_PARTS);
        assert_eq!(layout.tail_counter_bytes, 4 * (TailCounts::ROUTER + 64 * 16 + ATTENTION_TOKENS * moe.heads));
        assert!(layout.tail_counters + layout.tail_counter_bytes <= layout.total);
        let dense = ModelConfig { moe: None, ..moe };
        assert_eq!(TailCounts::new(&dense, 64).sums, 0);
    }
}
