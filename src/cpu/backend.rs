//! The CPU behind the engine's `Backend` seam: one model, one KV pool, the logits of the last batch.

use std::sync::Arc;

use super::{CpuCache, CpuModel, CpuStream, KvPages, PAGE_TOKENS};
use crate::backend::{Backend, KvStream, LocalLayers, StepItem};
use crate::err;
use crate::kv::KvTypes;
use crate::model::TensorSource;
use crate::sampler;
use crate::status::Result;
use crate::tuning::Tuning;

/// The CPU backend: a `CpuModel` built once at load over a source it keeps alive, the KV pool's
/// memory, and the logits of each item of the last batch.
pub struct CpuBackend {
    // Declared before `_source`: dropped before what it reads.
    model: CpuModel<'static>,
    kv: KvPages,
    /// Per item, the logits after each of its head positions (none for a refused item).
    logits: Vec<Vec<Vec<f32>>>,
    _source: Arc<dyn TensorSource + Send + Sync>,
}

impl CpuBackend {
    /// Checks the model in `source` (so a bad model fails the load, not the first step), builds its view
    /// and a KV pool of `pages` pages of f32 K and V, on every core.
    pub fn new(source: Arc<dyn TensorSource + Send + Sync>, pages: usize) -> Result<CpuBackend> {
        Self::with_kv(source, pages, KvTypes::CPU_DEFAULT, &Tuning::default())
    }

    /// `new` with the pool's K and V in `kv`'s types, rounded as the GPU rounds them, on
    /// `tuning.cpu_threads` threads.
    pub fn with_kv(
        source: Arc<dyn TensorSource + Send + Sync>,
        pages: usize,
        kv: KvTypes,
        tuning: &Tuning,
    ) -> Result<CpuBackend> {
        Self::with_pools(source, pages, None, kv, tuning)
    }

    /// `with_kv` with the sliding-window layers (where the model has them) in a pool of `local` pages
    /// of their own, holding only what their window reaches.
    pub fn with_pools(
        source: Arc<dyn TensorSource + Send + Sync>,
        pages: usize,
        local: Option<usize>,
        kv: KvTypes,
        tuning: &Tuning,
    ) -> Result<CpuBackend> {
        // SAFETY: an Arc's pointee never moves, and this struct drops the view before its Arc.
        let src: &'static dyn TensorSource = unsafe { &*Arc::as_ptr(&source) };
        let model = CpuModel::new(src)?.with_threads(tuning.cpu_threads).with_kv_types(kv)?;
        let kv = KvPages::with_local(model.config(), pages, local, kv)?;
        Ok(CpuBackend { model, kv, logits: Vec::new(), _source: source })
    }

    pub fn model(&self) -> &CpuModel<'static> {
        &self.model
    }

    /// Host bytes the KV pool holds: what `fit::cpu_kv_bytes` counts for its pages' positions.
    pub fn pool_bytes(&self) -> u64 {
        self.kv.bytes() as u64
    }
}

impl Backend for CpuBackend {
    type Cache = CpuCache;

    const PAGE_TOKENS: usize = PAGE_TOKENS;

    fn new_stream(&self, window: usize) -> Result<CpuStream> {
        Ok(KvStream::new(CpuCache { own: None }, window))
    }

    fn step_batch(&mut self, items: &mut [StepItem<'_, CpuCache>]) -> Result<()> {
        self.logits.clear();
        let histories: Vec<Vec<u32>> = items.iter().map(|i| i.stream.tokens.clone()).collect();
        let heads: Vec<usize> = items.iter().map(|i| i.heads.clamp(1, i.tokens.len().max(1))).collect();
        let mut inputs: Vec<(&mut CpuStream, &[u32])> = items.iter_mut().map(|i| (&mut *i.stream, i.tokens)).collect();
        let outs = self.model.forward_batch_heads(&mut self.kv, &mut inputs, &heads);
        drop(inputs);
        for (((item, out), history), &h) in items.iter_mut().zip(outs).zip(&histories).zip(&heads) {
            match out {
                Ok(rows) if item.mask.is_some() => {
                    // A constrained item proposes nothing: one draw, among the tokens its constraint allows.
                    let next = item.sample(rows.last().expect("at least one head"), history);
                    item.drawn = vec![next];
                    item.next = Ok(next);
                    self.logits.push(rows);
                }
                Ok(rows) => {
                    // Each head draws as a step ending at its position would.
                    let first = item.tokens.len() - h;
                    item.drawn = rows
                        .iter()
                        .enumerate()
                        .map(|(k, l)| {
                            sampler::sample_stream(
                                l,
                                &item.sampling,
                                item.index,
                                history,
                                &item.tokens[..first + k + 1],
                            )
                        })
                        .collect();
                    item.next = Ok(*item.drawn.last().expect("at least one head"));
                    self.logits.push(rows);
                }
                Err(e) => {
                    item.next = Err(e);
                    self.logits.push(Vec::new());
                }
            }
        }
        Ok(())
    }

    fn logits(&self, i: usize, head: usize) -> Result<Vec<f32>> {
        self.logits
            .get(i)
            .and_then(|rows| rows.get(head))
            .cloned()
            .ok_or_else(|| err!(InvalidArgument, "item {i} of the last batch has no logits at head {head}"))
    }

    fn copy_page(&mut self, from: u32, to: u32) -> Result<()> {
        self.kv.copy_page(false, from, to);
        Ok(())
    }

    fn local_layers(&self) -> Option<LocalLayers> {
        let pages = self.kv.local_pages()?;
        let cfg = self.model.config();
        let window = (0..cfg.layers).filter_map(|l| cfg.attention.window(l)).max()?;
        // Attention reads whole blocks of KEY_BLOCK positions from the block holding a window's first.
        Some(LocalLayers { window, reach: super::attention::KEY_BLOCK, pages, piece: super::LOCAL_PIECE_TOKENS })
    }

    fn copy_local_page(&mut self, from: u32, to: u32) -> Result<()> {
        self.kv.copy_page(true, from, to);
        Ok(())
    }

    fn score(&mut self, stream: &mut CpuStream, tokens: &[u32], out: &mut [f32]) -> Result<()> {
        self.logits.clear();
        let mut last = None;
        self.model.forward_each(&mut self.kv, stream, tokens, |i, row| match tokens.get(i + 1) {
            Some(&next) => out[i] = crate::backend::log_prob(row, next),
            None => last = Some(row.to_vec()),
        })?;
        self.logits.push(last.into_iter().collect());
        Ok(())
    }
}
