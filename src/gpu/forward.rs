//! The forward pass of a batch. A step's items (prompt chunks and single tokens of different streams)
//! are packed into passes of at most `max_batch` tokens; a pass runs every layer once over all of its
//! tokens, queued on the model's stream (the architecture's file over the operations of ops.rs). Its
//! tokens are rows: first those on the matrix-vector kernels (single tokens, and chunks shorter than
//! `TENSOR_CORE_MIN_TOKENS`), then those on tensor cores (longer chunks, and single tokens when the
//! batch tensor-core option is on and the pass has enough of them); each product runs once over each
//! group, so single tokens of every stream share each weight read.
//! Every row carries its own id, position and page table (uploaded together before the pass), so the
//! rotation with the KV append and the decode attention serve all streams in one launch; a long prompt
//! chunk's flash attention runs per chunk, over its own stream's pages.
//!
//! A token's row takes the same kernels, with the same reduction order, in any pass: the matrix-vector
//! kernels accumulate each token on its own, the norms are per row, the attention cuts a context by its
//! length and the model's fixed attention parts alone, and a long chunk's products and flash attention run
//! per chunk, its rows starting on a 16-row boundary (so a library product sees the same shape and
//! alignment as when the chunk runs alone; pad rows between carry position -1 and are never read). So
//! a stream's logits are the same bits alone and in any batch, unless the batch tensor-core option
//! moves single tokens to one product over all of them.

use std::os::raw::{c_int, c_uint};

use super::launch;
use super::mask;
use super::ops::PassOps;
use super::pages::{GpuCache, PAGE_TOKENS};
use super::scratch::{self, attention_grid};
use super::tensor_parallel::HeadInput;
use super::{GpuModel, GpuStream};
use crate::backend::{PagePool, StepItem};
use crate::constraint::PendingMask;
use crate::sampler::{self, Sampling};
use crate::status::Result;
use crate::{bail, err};

/// Chunks of at least this many tokens take the tensor-core path: below it the matrix-vector kernel,
/// which reads each weight once per 8 tokens, is as fast.
pub const TENSOR_CORE_MIN_TOKENS: usize = 16;

/// Where an item of the last step left its logits.
pub(super) enum LogitsAt {
    /// A row of the scratch's logits.
    Row(usize),
    /// Copied to the host (a step with more items than the scratch has logits rows).
    Host(Vec<f32>),
    /// Not kept: a verification's head after its first rejected proposal, which nothing reads.
    Dropped,
}

/// Which kernels a piece's products take.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Path {
    /// The matrix-vector kernels on f32 activations.
    Matvec,
    /// Tensor cores, in one product with every other single token of the pass (the batch option).
    TensorSingle,
    /// Tensor cores, the piece on its own (a chunk of `TENSOR_CORE_MIN_TOKENS` or more).
    Tensor,
}

/// Part of one item's tokens, run in one pass.
#[derive(Clone, Copy)]
pub(super) struct Piece {
    /// The item's index in the step.
    pub item: usize,
    /// The piece's first token in the item's tokens, and its token count.
    pub from: usize,
    pub len: usize,
    /// The position of its first token.
    pub pos: usize,
    /// The stream's page table (a device address), and its table of the local layers' pool (null
    /// without one).
    pub table: *const c_uint,
    pub local_table: *const c_uint,
    /// Whether the item ends with this piece (its logits follow the piece's last token).
    pub last: bool,
    /// Its first row in the pass, and its path (set by `lay_out`).
    pub row: usize,
    pub path: Path,
}

/// Rows between the starts of two tensor-core pieces: 16 rows of any width that is a multiple of 8 are
/// a multiple of 256 bytes in half and in f32, the alignment a library product wants.
const TENSOR_ROW_ALIGN: usize = 16;

/// How a pass lays out its rows (its pieces in order, each piece's tokens consecutive).
#[derive(Clone, Copy)]
pub(super) struct PassShape {
    pub(super) n: usize,
    /// Rows [0, m) run the matrix-vector kernels on f32 activations, rows [m, n) the tensor-core products.
    pub(super) m: usize,
    /// Rows [0, split_end) take the split attention kernel, the pieces from split_end on flash attention.
    pub(super) split_end: usize,
    /// Blocks the split attention gives each of its tokens' parts (`attention_grid_parts` of the
    /// longest context among those rows).
    pub(super) grid_parts: usize,
}

/// Which logits a pass leaves.
pub(super) enum Head<'a> {
    /// None: every piece continues in a later pass.
    Skip,
    /// The logits after each of these rows, in order, into the logits rows from `base` on.
    Rows { rows: &'a [usize], base: usize },
    /// Final-normed hidden states of every row in xn; the caller runs the head per row.
    All,
}

impl GpuModel {
    /// Steps `items` (streams of this model, each named once, each holding the pages its new positions
    /// need) and sets each item's `next`. An item refused (foreign stream, bad ids, past its window or
    /// its pages) gets its error and appends nothing; the others run. Err only when the device failed,
    /// and then no item appends anything.
    pub fn step_batch(&mut self, items: &mut [StepItem<'_, GpuCache>]) -> Result<()> {
        self.logits_at.clear();
        self.logits_at.resize_with(items.len(), Vec::new);
        let mut run = Vec::with_capacity(items.len());
        for (i, item) in items.iter_mut().enumerate() {
            match self.admit(item) {
                Ok(()) => run.push(i),
                Err(e) => item.next = Err(e),
            }
        }
        if run.is_empty() {
            return Ok(());
        }
        match self.run_items(items, &run) {
            Ok(drawn) => {
                for (&i, drawn) in run.iter().zip(drawn) {
                    let item = &mut items[i];
                    item.stream.len += item.tokens.len();
                    item.next = Ok(*drawn.last().expect("at least one head"));
                    item.drawn = drawn;
                }
                Ok(())
            }
            Err(e) => {
                for &i in &run {
                    items[i].next = Err(e.clone());
                    self.logits_at[i].clear();
                }
                Err(e)
            }
        }
    }

    /// The logits after the last position of item `i` of the last step.
    pub fn logits(&self, i: usize) -> Result<Vec<f32>> {
        let heads = self.logits_at.get(i).map_or(0, Vec::len);
        self.head_logits(i, heads.saturating_sub(1))
    }

    /// The logits after head position `head` of item `i` of the last step (`StepItem::heads`).
    pub fn head_logits(&self, i: usize, head: usize) -> Result<Vec<f32>> {
        match self.logits_at.get(i).and_then(|h| h.get(head)) {
            Some(LogitsAt::Row(row)) => {
                let mut out = vec![0f32; self.cfg.vocab];
                self.download(self.s.logits + row * self.cfg.vocab * 4, &mut out)?;
                Ok(out)
            }
            Some(LogitsAt::Host(v)) => Ok(v.clone()),
            _ => Err(err!(InvalidArgument, "item {i} of the last step has no logits at head {head}")),
        }
    }

    /// Logits of the last position of the last step's first item (or of `all_logits`).
    pub fn last_logits(&self) -> Result<Vec<f32>> {
        if self.logits_at.is_empty() {
            bail!(InvalidArgument, "no step has produced logits yet");
        }
        self.logits(0)
    }

    /// One stream's step for callers without an engine: takes the pages the tokens need from `pool`
    /// (NO_ROOM, nothing taken, when it has too few), steps, and gives back what a failed step took.
    pub fn step(
        &mut self,
        pool: &mut PagePool,
        stream: &mut GpuStream,
        tokens: &[u32],
        sampling: &Sampling,
        stream_index: u32,
    ) -> Result<u32> {
        self.check_tokens(stream, tokens)?;
        reserve_pages(pool, stream, tokens.len())?;
        let mut items = [StepItem::new(stream, stream_index, tokens, *sampling)];
        let ran = self.step_batch(&mut items);
        let [StepItem { stream, next, .. }] = items;
        if next.is_ok() {
            stream.tokens.extend_from_slice(tokens);
        } else {
            pool.give_back(stream.pages.drain(pool.pages_for(stream.len)..));
        }
        ran.and(next)
    }

    /// Everything that could refuse a stream's tokens before anything is written.
    pub(super) fn check_tokens(&self, stream: &GpuStream, tokens: &[u32]) -> Result<()> {
        if stream.cache.model_id != self.id {
            bail!(InvalidArgument, "stream was not made by this model");
        }
        self.cfg.check_append(stream.len, stream.window, tokens)
    }

    /// Checks an item and queues its page table's update.
    fn admit(&self, item: &mut StepItem<'_, GpuCache>) -> Result<()> {
        self.check_tokens(item.stream, item.tokens)?;
        self.check_held(item.stream, item.stream.len + item.tokens.len())?;
        self.sync_table(item.stream)
    }

    /// NO_ROOM unless `stream` holds the pages of positions up to `end` (in both pools, where the local
    /// layers have their own).
    pub(super) fn check_held(&self, stream: &GpuStream, end: usize) -> Result<()> {
        let local = if self.local_pages > 0 { Some(stream.local.len()) } else { None };
        for (held, what) in [(Some(stream.pages.len()), "KV pages"), (local, "pages of the local layers' pool")] {
            if let Some(held) = held.filter(|&h| h * PAGE_TOKENS < end) {
                bail!(
                    NoRoom,
                    "positions up to {end} need {} {what}; the stream holds {held}",
                    end.div_ceil(PAGE_TOKENS)
                );
            }
        }
        Ok(())
    }

    /// Runs the admitted items `run` and returns the tokens drawn after each one's head positions (its
    /// last `heads`, each drawn as a step ending there would), in `run`'s order.
    fn run_items(&mut self, items: &[StepItem<'_, GpuCache>], run: &[usize]) -> Result<Vec<Vec<u32>>> {
        let b = self.max_batch;
        let rows_cap = self.s.logit_rows;
        let token_lists: Vec<&[u32]> = items.iter().map(|it| it.tokens).collect();
        let heads_of = |i: usize| items[i].heads.clamp(1, items[i].tokens.len());
        // The head rows a pass's pieces need.
        let head_count =
            |pass: &[Piece]| -> usize { pass.iter().filter(|p| p.last).map(|p| heads_of(p.item).min(p.len)).sum() };
        // Round r holds each item's r-th chunk of max_batch tokens, so a chunk's pass follows the
        // passes of the chunks before it.
        let rounds = run.iter().map(|&i| items[i].tokens.len().div_ceil(b)).max().unwrap_or(0);
        let mut passes: Vec<Vec<Piece>> = Vec::new();
        for r in 0..rounds {
            let mut pass = Vec::new();
            for &i in run {
                let (item, from) = (&items[i], r * b);
                let n = item.tokens.len();
                if from >= n {
                    continue;
                }
                let len = (n - from).min(b);
                let (table, local_table) = (item.stream.cache.table_ptr(), item.stream.cache.local_table_ptr());
                let piece = Piece {
                    item: i,
                    from,
                    len,
                    pos: item.stream.len + from,
                    table,
                    local_table,
                    last: from + len == n,
                    row: 0,
                    path: Path::Matvec,
                };
                // A piece that would take the pass past max_batch rows (pads included) or its heads past
                // the logits rows starts the next.
                let mut grown = pass.clone();
                grown.push(piece);
                if !pass.is_empty() && (self.lay_out(&mut grown).n > b || head_count(&grown) > rows_cap) {
                    passes.push(std::mem::replace(&mut pass, vec![piece]));
                } else {
                    pass = grown;
                }
            }
            if !pass.is_empty() {
                passes.push(pass);
            }
        }

        let mut sampled: Vec<Vec<Option<i32>>> = items.iter().map(|it| vec![None; it.heads.max(1)]).collect();
        // (item, head) whose logits and token sit in the device rows [0, pending.len()), in row order.
        let mut pending: Vec<(usize, usize)> = Vec::new();
        // Mask rows the passes since those rows were last read back have taken.
        let mut masked = 0;
        for mut pass in passes {
            let shape = self.lay_out(&mut pass);
            self.upload_pass(&pass, &token_lists)?;
            // (row, item, head, the head's token index in the item): a piece's last rows, one a head.
            let heads: Vec<(usize, usize, usize, usize)> = pass
                .iter()
                .filter(|p| p.last)
                .flat_map(|p| {
                    let h = heads_of(p.item).min(p.len);
                    (0..h).map(move |k| (p.row + p.len - h + k, p.item, k, p.from + p.len - h + k))
                })
                .collect();
            if pending.len() + heads.len() > rows_cap {
                self.spill(items, &pending, &mut sampled)?;
                pending.clear();
                masked = 0;
            }
            let base = pending.len();
            let head_rows: Vec<usize> = heads.iter().map(|h| h.0).collect();
            // The captured graphs hold passes whose every row is a head: single tokens, or (every row on the
            // matrix-vector kernels) a verification's token and proposals, the same launches a row.
            let every_row_a_head = heads.len() == shape.n && base == 0;
            let graphable =
                every_row_a_head && (pass.iter().all(|p| p.len == 1) || pass.iter().all(|p| p.path == Path::Matvec));
            if !(graphable && self.replay_decode(&pass, shape)?) {
                let head = if heads.is_empty() { Head::Skip } else { Head::Rows { rows: &head_rows, base } };
                self.enqueue_forward(&pass, shape, head)?;
            }
            let penalties: Vec<Vec<u32>> = heads
                .iter()
                .map(|&(_, i, _, t)| {
                    sampler::penalty_ids(&items[i].stream.tokens, &items[i].tokens[..t + 1], &items[i].sampling)
                })
                .collect();
            // A constrained item's token (after its last position) is drawn among the ids its mask allows:
            // the mask, computed on a host thread while the forward runs, is waited for once the pass is
            // queued.
            let allowed: Vec<Option<&[u32]>> = heads
                .iter()
                .map(|&(_, i, _, t)| {
                    let mask = items[i].mask.filter(|_| t + 1 == items[i].tokens.len());
                    mask.and_then(PendingMask::wait).filter(|m| mask::allows_any(m, self.cfg.vocab))
                })
                .collect();
            let mask_rows = self.stage_masks(&allowed, masked)?;
            masked += mask_rows.iter().flatten().count();
            let rows: Vec<launch::SampleRow<'_>> = heads
                .iter()
                .zip(&penalties)
                .zip(mask_rows)
                .map(|((&(_, i, _, t), penalty), mask)| launch::SampleRow {
                    sampling: &items[i].sampling,
                    stream_index: items[i].index,
                    position: (items[i].stream.len + t + 1) as u64,
                    penalty,
                    mask,
                })
                .collect();
            self.sample_rows(base, &rows)?;
            pending.extend(heads.iter().map(|&(_, i, k, _)| (i, k)));
        }
        let mut tokens = vec![0i32; pending.len()];
        self.download(self.s.token, &mut tokens)?;
        for (k, (&(i, h), &t)) in pending.iter().zip(&tokens).enumerate() {
            sampled[i][h] = Some(t);
            self.logits_at[i].push(LogitsAt::Row(k));
        }
        run.iter()
            .map(|&i| {
                sampled[i][..heads_of(i)]
                    .iter()
                    .map(|t| {
                        let t = t.unwrap_or(-1);
                        if t < 0 || t as usize >= self.cfg.vocab {
                            bail!(
                                CudaError,
                                "the device sampler returned token {t} for a vocabulary of {}",
                                self.cfg.vocab
                            );
                        }
                        Ok(t as u32)
                    })
                    .collect()
            })
            .collect()
    }

    /// Copies the tokens of the heads in the device rows to the host, and the logits of each item's one
    /// head a caller can read, freeing the rows. An item's heads after the first are a verification's:
    /// the stream keeps the positions up to the first head whose token is not the item's next token
    /// (else the last head), and only that head's logits are ever read.
    fn spill(
        &mut self,
        items: &[StepItem<'_, GpuCache>],
        pending: &[(usize, usize)],
        sampled: &mut [Vec<Option<i32>>],
    ) -> Result<()> {
        let vocab = self.cfg.vocab;
        let mut tokens = vec![0i32; pending.len()];
        self.download(self.s.token, &mut tokens)?;
        // Each item's heads sit in consecutive rows from its first: (item, first row, heads).
        let mut runs: Vec<(usize, usize, usize)> = Vec::new();
        for (row, &(i, _)) in pending.iter().enumerate() {
            match runs.last_mut() {
                Some(r) if r.0 == i => r.2 += 1,
                _ => runs.push((i, row, 1)),
            }
        }
        for (i, first, heads) in runs {
            let item = &items[i];
            let n = item.tokens.len();
            let draws = &tokens[first..first + heads];
            // Head k draws the token after position n - heads + k; the next position's token is a proposal.
            let kept = (0..heads)
                .find(|&k| k + 1 < heads && draws[k] != item.tokens[n - heads + k + 1] as i32)
                .unwrap_or(heads - 1);
            for (k, &(_, h)) in pending[first..first + heads].iter().enumerate() {
                sampled[i][h] = Some(draws[k]);
                let at = if k == kept {
                    let mut row = vec![0f32; vocab];
                    self.download(self.s.logits + (first + k) * vocab * 4, &mut row)?;
                    LogitsAt::Host(row)
                } else {
                    LogitsAt::Dropped
                };
                self.logits_at[i].push(at);
            }
        }
        Ok(())
    }

    /// Samples the token after each of `rows` logits rows from row `first` on into the same token rows (the
    /// logits end as they began; a row with a mask row draws among its allowed ids), in one batched draw, or
    /// more where the rows' penalized ids together pass the vocabulary.
    fn sample_rows(&self, first: usize, rows: &[launch::SampleRow<'_>]) -> Result<()> {
        let vocab = self.cfg.vocab;
        let s = self.stream.raw();
        let mut start = 0;
        while start < rows.len() {
            // Each row's ids are distinct ids of the vocabulary, so one row alone always fits.
            let (mut end, mut ids) = (start + 1, rows[start].penalty.len());
            while end < rows.len() && ids + rows[end].penalty.len() <= vocab {
                ids += rows[end].penalty.len();
                end += 1;
            }
            let logits = (self.buf(self.s.logits) as *mut f32).wrapping_add((first + start) * vocab);
            let tokens = (self.buf(self.s.token) as *mut c_int).wrapping_add(first + start);
            let (scratch, masks) = (self.buf(self.s.sample), self.buf(self.s.masks) as *const c_uint);
            launch::sample_rows(logits, vocab, &rows[start..end], masks, scratch, self.s.sample_bytes, tokens, s)?;
            start = end;
        }
        Ok(())
    }

    /// Orders a pass's pieces into rows and picks each one's path: the matrix-vector pieces first, then
    /// (from a 16-row boundary) the single tokens on tensor cores, then each chunk on tensor cores from a
    /// 16-row boundary of its own.
    pub(super) fn lay_out(&self, pieces: &mut [Piece]) -> PassShape {
        let singles = pieces.iter().filter(|p| p.len == 1).count();
        let singles_on_tc = self.tensor_cores && self.batch_tensor_cores && singles >= TENSOR_CORE_MIN_TOKENS;
        for p in pieces.iter_mut() {
            p.path = if self.on_tensor_cores(p.len) {
                Path::Tensor
            } else if p.len == 1 && singles_on_tc {
                Path::TensorSingle
            } else {
                Path::Matvec
            };
        }
        pieces.sort_by_key(|p| p.path);
        let mut row = 0usize;
        let mut m = None;
        for p in pieces.iter_mut() {
            if p.path != Path::Matvec {
                if m.is_none() {
                    row = row.next_multiple_of(TENSOR_ROW_ALIGN);
                    m = Some(row);
                }
                if p.path == Path::Tensor {
                    row = row.next_multiple_of(TENSOR_ROW_ALIGN);
                }
            }
            p.row = row;
            row += p.len;
        }
        let n = row;
        let m = m.unwrap_or(n);
        let singles_end = pieces.iter().filter(|p| p.path == Path::TensorSingle).map(|p| p.row + 1).max().unwrap_or(m);
        let split_end = if self.flash { singles_end } else { n };
        let longest = pieces.iter().filter(|p| p.row < split_end).map(|p| p.pos + p.len).max().unwrap_or(0);
        PassShape {
            n,
            m,
            split_end,
            grid_parts: attention_grid(longest, self.attention_parts, self.attention_grid_full),
        }
    }

    /// Uploads each row's id, position and page tables' addresses, in one copy.
    pub(super) fn upload_pass(&self, pieces: &[Piece], token_lists: &[&[u32]]) -> Result<()> {
        let b = self.max_batch;
        let mut meta = vec![0u8; b * 24];
        // Pad rows: id 0, position -1 (nothing written, nothing attended), no page table.
        for row in 0..b {
            meta[(b + row) * 4..(b + row) * 4 + 4].copy_from_slice(&(-1i32).to_ne_bytes());
        }
        for p in pieces {
            for k in 0..p.len {
                let (id, pos, row) = (token_lists[p.item][p.from + k] as i32, (p.pos + k) as i32, p.row + k);
                meta[row * 4..row * 4 + 4].copy_from_slice(&id.to_ne_bytes());
                meta[(b + row) * 4..(b + row) * 4 + 4].copy_from_slice(&pos.to_ne_bytes());
                meta[(b + row) * 8..(b + row) * 8 + 8].copy_from_slice(&(p.table as u64).to_ne_bytes());
                let local = (2 * b + row) * 8;
                meta[local..local + 8].copy_from_slice(&(p.local_table as u64).to_ne_bytes());
            }
        }
        self.upload(self.s.meta, &meta)
    }

    /// The tensor-core decode products' workspace, or None when they are off.
    pub(super) fn mmv_work(&self) -> Option<launch::MmvWork> {
        self.mmv.then(|| launch::MmvWork {
            partial: self.buf(self.s.mmv_partial) as *mut f32,
            counters: self.buf(self.s.mmv_counters) as *mut c_uint,
            tuning: self.kernel_tuning,
        })
    }

    /// The fused tails' arrival counters, where the model fuses them.
    pub(super) fn tail_counters(&self) -> Option<launch::TailCounters> {
        let base = self.buf(self.s.tail_counters) as *mut c_uint;
        let counts = scratch::TailCounts::new(&self.cfg, self.max_batch());
        let tails = self.fused_tails;
        tails.any().then(|| launch::TailCounters {
            router: tails.route.then_some(base),
            sums: tails.sums.then(|| base.wrapping_add(scratch::TailCounts::ROUTER)),
            sums_count: counts.sums,
            attention: tails.attention.then(|| base.wrapping_add(scratch::TailCounts::ROUTER + counts.sums)),
        })
    }

    /// Whether a chunk of `n` tokens takes the tensor-core path.
    pub(super) fn on_tensor_cores(&self, n: usize) -> bool {
        self.tensor_cores && n >= TENSOR_CORE_MIN_TOKENS
    }

    /// Queues the forward pass of `pieces`, laid out as `shape`, whose rows' ids, positions and page
    /// tables are already in scratch.
    pub(super) fn enqueue_forward(&self, pieces: &[Piece], shape: PassShape, head: Head<'_>) -> Result<()> {
        let cfg = &self.cfg;
        let s = self.stream.raw();
        crate::arch::forward(cfg, &mut PassOps::new(self, pieces, shape), &self.layers)?;
        let (n, hidden, half, tuning) = (shape.n, cfg.hidden, self.half, self.kernel_tuning);
        let f = |off: usize| self.buf(off) as *mut f32;
        let (x, xn, act) = (f(self.s.x), f(self.s.xn), self.buf(self.s.act));
        let row = |p: *mut f32, r: usize, width: usize| p.wrapping_add(r * width);
        match head {
            Head::Skip => Ok(()),
            Head::All => launch::rmsnorm(x, self.final_norm, cfg.rms_eps, xn, n, hidden, tuning, s),
            Head::Rows { rows, base } => {
                if rows.iter().enumerate().all(|(k, &r)| k == r) {
                    launch::rmsnorm(x, self.final_norm, cfg.rms_eps, xn, rows.len(), hidden, tuning, s)?;
                } else {
                    for (k, &r) in rows.iter().enumerate() {
                        launch::rmsnorm(
                            row(x, r, hidden),
                            self.final_norm,
                            cfg.rms_eps,
                            row(xn, k, hidden),
                            1,
                            hidden,
                            tuning,
                            s,
                        )?;
                    }
                }
                let logits = row(f(self.s.logits), base, cfg.vocab);
                // The batch tensor-core option runs a pass's many heads as one product too.
                let many = self.batch_tensor_cores && self.on_tensor_cores(rows.len()) && self.head.dtype == half;
                if many {
                    launch::convert(xn, act, half, rows.len() * hidden, s)?;
                    return self.head_product(HeadInput::Half(act), rows.len(), logits);
                }
                self.head_product(HeadInput::F32(xn), rows.len(), logits)
            }
        }
    }
}

/// Takes from `pool` the pages `stream` needs for `n` more tokens (NO_ROOM, nothing taken, when too few
/// are free): what the engine's `Streams` does before a batch, for callers that step streams directly.
pub fn reserve_pages(pool: &mut PagePool, stream: &mut GpuStream, n: usize) -> Result<()> {
    if pool.page_tokens() != PAGE_TOKENS {
        bail!(InvalidArgument, "a pool of {}-token pages for a model of {PAGE_TOKENS}-token pages", pool.page_tokens());
    }
    let need = pool.pages_for(stream.len + n).saturating_sub(stream.pages.len());
    let free = pool.free_pages();
    let pages = pool
        .take(need)
        .ok_or_else(|| err!(NoRoom, "{n} tokens after {} need {need} more KV pages; {free} are free", stream.len))?;
    stream.pages.extend(pages);
    Ok(())
}

/// Keeps the first `len` positions of `stream` (OUT_OF_RANGE past its length) and gives the pages past
/// them back to `pool`, for callers that step streams directly.
pub fn truncate_stream(pool: &mut PagePool, stream: &mut GpuStream, len: usize) -> Result<()> {
    if len > stream.len {
        bail!(OutOfRange, "cannot keep {len} positions of a stream of {}", stream.len);
    }
    stream.len = len;
    stream.tokens.truncate(len);
    pool.give_back(stream.pages.drain(pool.pages_for(len).min(stream.pages.len())..));
    Ok(())
}
