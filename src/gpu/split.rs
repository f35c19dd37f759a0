//! The CUDA backend over the ranks of a tensor-parallel model (ARCHITECTURE.md, "Tensor parallelism"):
//! one `GpuModel` a rank (`GpuModel::load_rank`), each on its device. The page ids are the engine's,
//! shared by every rank (each rank's pool holds its KV heads of every page); a stream holds a page table
//! on each rank. A step lends each rank a view of every item's stream (its own page table beside the
//! stream's positions, pages and history) and runs every rank's `step_batch` on a thread of its own,
//! so their collectives meet; every rank draws the same tokens from the same gathered logits, and rank
//! 0's are the step's.

use std::thread;

use super::backend::local_layers_of;
use super::collectives::{Collectives, NcclRank, SharedDevice};
use super::{GpuCache, GpuModel, GpuStream, PAGE_TOKENS, RowsOnDevice, Sizing};
use crate::backend::{Backend, KvStream, LocalLayers, StepItem};
use crate::constraint::PendingMask;
use crate::cuda;
use crate::cudart as rt;
use crate::model::TensorSource;
use crate::sampler::Sampling;
use crate::shard::{RankSource, ShardPlan};
use crate::status::{Error, Result};
use crate::tuning::Tuning;
use crate::{bail, err};

/// A stream's page table on every rank; a rank's is lent to its view of the stream during a step.
pub struct SplitCache {
    ranks: Vec<Option<GpuCache>>,
}

/// The ranks of one model, rank r's `GpuModel` on device `devices[r]`.
pub struct SplitBackend {
    ranks: Vec<GpuModel>,
    devices: Vec<i32>,
}

/// What every rank's item of a step shares (the stream's own parts are lent apart).
#[derive(Clone, Copy)]
struct ItemArgs<'a> {
    index: u32,
    tokens: &'a [u32],
    sampling: Sampling,
    mask: Option<&'a PendingMask>,
    heads: usize,
}

fn enter(device: i32) -> Result<()> {
    // SAFETY: plain runtime call on a device index; an invalid one returns an error code.
    cuda::check(unsafe { rt::cudaSetDevice(device) }, "cudaSetDevice")
}

impl SplitBackend {
    /// The ranks `ranks` (rank r on `devices[r]`): every one a rank of the same split, with pools of the
    /// same pages. INVALID_ARGUMENT otherwise.
    pub fn new(ranks: Vec<GpuModel>, devices: Vec<i32>) -> Result<SplitBackend> {
        let Some(first) = ranks.first() else { bail!(InvalidArgument, "a split model of no ranks") };
        if devices.len() != ranks.len() {
            bail!(InvalidArgument, "{} ranks on {} devices", ranks.len(), devices.len());
        }
        for (r, m) in ranks.iter().enumerate() {
            if m.world() != ranks.len() || m.rank_index() != r {
                bail!(InvalidArgument, "rank {r} of {} is a model split {} ways", ranks.len(), m.world());
            }
            if (m.pool_pages(), m.local_pages()) != (first.pool_pages(), first.local_pages()) {
                bail!(InvalidArgument, "rank {r}'s KV pool has other pages than rank 0's");
            }
        }
        Ok(SplitBackend { ranks, devices })
    }

    /// `src` split as `plan` says, rank r loaded on `devices[r]` from its own slices (copied one rank at
    /// a time, dropped once loaded) and reading the rows at `rows[r]`, every rank sized as `sizing` says
    /// (the same pages on each): over NCCL where the devices differ, through `SharedDevice` where all
    /// share one (no NCCL loaded, no graphs). INVALID_ARGUMENT for devices or rows that do not match the
    /// plan's ranks, or devices repeated but not all the same.
    pub fn load(
        src: &dyn TensorSource,
        plan: &ShardPlan,
        devices: &[i32],
        rows: &[RowsOnDevice],
        sizing: Sizing,
        tuning: &Tuning,
    ) -> Result<SplitBackend> {
        let world = plan.world();
        if devices.len() != world || rows.len() != world {
            bail!(
                InvalidArgument,
                "a split over {world} ranks given {} devices and {} rows",
                devices.len(),
                rows.len()
            );
        }
        let shared = devices.iter().all(|&d| d == devices[0]);
        let distinct = devices.iter().enumerate().all(|(i, d)| !devices[..i].contains(d));
        if !shared && !distinct {
            bail!(InvalidArgument, "devices {devices:?}: ranks share a device only when all of them do");
        }
        let comms: Vec<Box<dyn Collectives>> = if shared {
            SharedDevice::ranks(world).into_iter().map(|c| Box::new(c) as Box<dyn Collectives>).collect()
        } else {
            NcclRank::all(devices)?.into_iter().map(|c| Box::new(c) as Box<dyn Collectives>).collect()
        };
        // Built up rank by rank, so a failure drops the ranks already loaded each on its device.
        let mut split = SplitBackend { ranks: Vec::with_capacity(world), devices: Vec::with_capacity(world) };
        for (r, comm) in comms.into_iter().enumerate() {
            enter(devices[r])?;
            let rank = RankSource::new(src, plan, r)?;
            let model = GpuModel::load_rank(&rank, comm, rows[r], sizing, tuning)?;
            split.ranks.push(model);
            split.devices.push(devices[r]);
        }
        Ok(split)
    }

    /// Rank `r`'s model.
    pub fn rank(&self, r: usize) -> &GpuModel {
        &self.ranks[r]
    }

    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// `f` on every rank (its model and `views[r]`), each on a thread of its own with its device current,
    /// so their collectives meet; a rank's panic becomes its error.
    fn on_every_rank<V: Send, T: Send>(
        &mut self,
        views: &mut [V],
        f: impl Fn(&mut GpuModel, &mut V) -> Result<T> + Sync,
    ) -> Vec<Result<T>> {
        let f = &f;
        thread::scope(|sc| {
            let runs: Vec<_> = self
                .ranks
                .iter_mut()
                .zip(&self.devices)
                .zip(views.iter_mut())
                .map(|((model, &device), view)| sc.spawn(move || enter(device).and_then(|()| f(model, view))))
                .collect();
            runs.into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(err!(Panic, "a rank's thread panicked"))))
                .collect()
        })
    }
}

impl Drop for SplitBackend {
    /// Each rank's model is freed with its own device current.
    fn drop(&mut self) {
        for (model, &device) in self.ranks.drain(..).zip(&self.devices) {
            let _ = enter(device);
            drop(model);
        }
    }
}

/// Rank 0's outcome, or the first rank's failure (named when it is not rank 0's).
fn first_failure<T>(outcomes: Vec<Result<T>>) -> Result<T> {
    let mut first = None;
    for (r, outcome) in outcomes.into_iter().enumerate() {
        match outcome {
            Err(e) if r == 0 => return Err(e),
            Err(e) => return Err(Error::new(e.status, format!("rank {r}: {}", e.message))),
            Ok(v) if r == 0 => first = Some(v),
            Ok(_) => {}
        }
    }
    first.ok_or_else(|| err!(InvalidArgument, "a split model of no ranks"))
}

/// Rank `r`'s view of `stream`: its page table, lent, beside copies of the stream's own parts.
fn lend(stream: &mut KvStream<SplitCache>, r: usize) -> GpuStream {
    let cache = stream.cache.ranks[r].take().expect("every rank's table is back after each step");
    let mut view = KvStream::with_pages(cache, stream.window, stream.pages.clone());
    view.len = stream.len;
    view.tokens = stream.tokens.clone();
    view.local = stream.local.clone();
    view
}

impl Backend for SplitBackend {
    type Cache = SplitCache;

    const PAGE_TOKENS: usize = PAGE_TOKENS;

    fn new_stream(&self, window: usize) -> Result<KvStream<SplitCache>> {
        let mut ranks = Vec::with_capacity(self.ranks.len());
        for (m, &d) in self.ranks.iter().zip(&self.devices) {
            enter(d)?;
            ranks.push(Some(m.new_stream(window)?.cache));
        }
        Ok(KvStream::new(SplitCache { ranks }, window))
    }

    fn step_batch(&mut self, items: &mut [StepItem<'_, SplitCache>]) -> Result<()> {
        let args: Vec<ItemArgs> = items
            .iter()
            .map(|i| ItemArgs { index: i.index, tokens: i.tokens, sampling: i.sampling, mask: i.mask, heads: i.heads })
            .collect();
        let mut views: Vec<Vec<GpuStream>> =
            (0..self.ranks.len()).map(|r| items.iter_mut().map(|i| lend(i.stream, r)).collect()).collect();
        let outcomes = self.on_every_rank(&mut views, |model, streams| {
            let mut rank_items: Vec<StepItem<'_, GpuCache>> = streams
                .iter_mut()
                .zip(&args)
                .map(|(s, a)| {
                    let mut item = StepItem::new(s, a.index, a.tokens, a.sampling);
                    (item.mask, item.heads) = (a.mask, a.heads);
                    item
                })
                .collect();
            model.step_batch(&mut rank_items)?;
            Ok(rank_items.into_iter().map(|i| (i.next, i.drawn)).collect::<Vec<_>>())
        });
        for (r, streams) in views.into_iter().enumerate() {
            for (item, view) in items.iter_mut().zip(streams) {
                if r == 0 {
                    item.stream.len = view.len;
                }
                item.stream.cache.ranks[r] = Some(view.cache);
            }
        }
        match first_failure(outcomes) {
            Ok(first) => {
                for (item, (next, drawn)) in items.iter_mut().zip(first) {
                    (item.next, item.drawn) = (next, drawn);
                }
                Ok(())
            }
            Err(e) => {
                for item in items.iter_mut() {
                    item.next = Err(e.clone());
                }
                Err(e)
            }
        }
    }

    fn logits(&self, i: usize, head: usize) -> Result<Vec<f32>> {
        enter(self.devices[0])?;
        self.ranks[0].head_logits(i, head)
    }

    fn verify_tokens(&self) -> usize {
        (super::forward::TENSOR_CORE_MIN_TOKENS - 1).min(self.ranks[0].max_batch())
    }

    fn copy_page(&mut self, from: u32, to: u32) -> Result<()> {
        for (m, &d) in self.ranks.iter().zip(&self.devices) {
            enter(d)?;
            m.copy_page(from, to)?;
        }
        Ok(())
    }

    fn local_layers(&self) -> Option<LocalLayers> {
        local_layers_of(&self.ranks[0])
    }

    fn copy_local_page(&mut self, from: u32, to: u32) -> Result<()> {
        for (m, &d) in self.ranks.iter().zip(&self.devices) {
            enter(d)?;
            m.copy_pool_page(true, from, to)?;
        }
        Ok(())
    }

    /// Every rank scores its view of the stream (their heads gather the same logits); rank 0's
    /// log-probabilities are the call's.
    fn score(&mut self, stream: &mut KvStream<SplitCache>, tokens: &[u32], out: &mut [f32]) -> Result<()> {
        let mut views: Vec<GpuStream> = (0..self.ranks.len()).map(|r| lend(stream, r)).collect();
        let n = out.len();
        let outcomes = self.on_every_rank(&mut views, |model, view| {
            let mut mine = vec![0f32; n];
            model.score(view, tokens, &mut mine).map(|()| mine)
        });
        for (r, view) in views.into_iter().enumerate() {
            if r == 0 {
                stream.len = view.len;
            }
            stream.cache.ranks[r] = Some(view.cache);
        }
        out.copy_from_slice(&first_failure(outcomes)?);
        Ok(())
    }
}
