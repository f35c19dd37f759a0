//! The seam between the engine and a decode backend. A backend (the CPU reference, CUDA) is a model
//! that makes streams and steps a batch of them at once; `Streams` holds the engine's stream slots, their
//! sampler settings and the KV page pool over any backend, and the engine sees it only as a `Decoder`.
//!
//! KV memory comes in pages of `Backend::PAGE_TOKENS` positions from one `PagePool`, sized by the
//! engine from the fit. `Streams` does all of the pool's accounting: before a batch runs it gives each
//! item the pages its new positions need (an item that cannot get them fails with NO_ROOM, untouched),
//! and truncate, reset and failed items give pages back. A backend only reads `KvStream::pages` to
//! find where each position lives in its pool memory.

use crate::constraint::{Constraint, PendingMask};
use crate::sampler::{self, Sampling};
use crate::status::{Error, Result, Status};
use crate::{bail, err};

/// The page ids of one KV pool: which are free, and how many positions a page holds.
#[derive(Debug)]
pub struct PagePool {
    page_tokens: usize,
    total: usize,
    /// Free page ids; the next page taken is the last one.
    free: Vec<u32>,
}

impl PagePool {
    /// `pages` pages of `page_tokens` positions, all free; NO_ROOM where the host cannot hold the list.
    pub fn new(page_tokens: usize, pages: usize) -> Result<PagePool> {
        if page_tokens == 0 {
            bail!(InvalidArgument, "a KV page of 0 tokens");
        }
        if pages > u32::MAX as usize {
            bail!(NoRoom, "a KV pool of {pages} pages is more than page ids count");
        }
        let mut free = Vec::new();
        free.try_reserve_exact(pages).map_err(|_| err!(NoRoom, "the host has no room for a list of {pages} pages"))?;
        // Reversed, so pages are taken in id order from a fresh pool.
        free.extend((0..pages as u32).rev());
        Ok(PagePool { page_tokens, total: pages, free })
    }

    pub fn page_tokens(&self) -> usize {
        self.page_tokens
    }

    pub fn total_pages(&self) -> usize {
        self.total
    }

    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Pages a stream of `tokens` positions holds.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_tokens)
    }

    /// `n` free pages, or None (and nothing taken) when fewer are free.
    pub fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        let keep = self.free.len().checked_sub(n)?;
        Some(self.free.split_off(keep))
    }

    /// Returns pages to the pool.
    pub fn give_back(&mut self, pages: impl IntoIterator<Item = u32>) {
        self.free.extend(pages);
        debug_assert!(self.free.len() <= self.total, "a page was given back twice");
    }
}

/// One stream of a backend: its cache state (`C`, in the backend's own form), the pool pages holding
/// its positions, its tokens, and its window.
pub struct KvStream<C> {
    pub(crate) cache: C,
    /// Positions written (the backend advances it as it appends).
    pub(crate) len: usize,
    pub(crate) window: usize,
    /// The pool pages holding its positions, in position order: page `i` holds positions
    /// `i * PAGE_TOKENS ..`. A step's pages are here before the backend runs it.
    pub(crate) pages: Vec<u32>,
    /// Every token appended (for the repetition penalty and truncate); `Streams` keeps it, a backend
    /// reads it as the history before the step's own tokens.
    pub(crate) tokens: Vec<u32>,
}

impl<C> KvStream<C> {
    pub(crate) fn new(cache: C, window: usize) -> KvStream<C> {
        KvStream { cache, len: 0, window, pages: Vec::new(), tokens: Vec::new() }
    }

    /// A stream over the given pages (a backend's own, outside any engine pool).
    pub(crate) fn with_pages(cache: C, window: usize, pages: Vec<u32>) -> KvStream<C> {
        KvStream { cache, len: 0, window, pages, tokens: Vec::new() }
    }

    /// Tokens in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn window(&self) -> usize {
        self.window
    }

    /// The pool pages this stream holds, in position order.
    pub fn pages(&self) -> &[u32] {
        &self.pages
    }

    /// Forgets every token (the cache's memory, and whatever the backend keeps with it, stays).
    pub fn reset(&mut self) {
        self.len = 0;
        self.tokens.clear();
    }
}

/// One item of a batched step, as a backend sees it.
pub struct StepItem<'a, C> {
    pub stream: &'a mut KvStream<C>,
    /// The stream's index: seeds the sampler's draw.
    pub index: u32,
    /// Ids to append (checked against the vocabulary and the window already).
    pub tokens: &'a [u32],
    /// The stream's own sampler settings.
    pub sampling: Sampling,
    /// The mask of the stream's constraint, computed while the forward runs; None when it has none.
    pub mask: Option<&'a PendingMask>,
    /// Out: the token the sampler picks after `tokens`; an Err item appended nothing.
    pub next: Result<u32>,
}

impl<C> StepItem<'_, C> {
    /// The token the item's sampler picks from `logits` after the stream's tokens `history` and the
    /// item's own, among those its constraint allows when it has one (waiting for the mask). A mask that
    /// failed samples freely: `Streams` then fails the item.
    pub fn sample(&self, logits: &[f32], history: &[u32]) -> u32 {
        let (s, index, new) = (&self.sampling, self.index, self.tokens);
        self.mask
            .and_then(PendingMask::wait)
            .and_then(|allowed| sampler::sample_stream_masked(logits, allowed, s, index, history, new))
            .unwrap_or_else(|| sampler::sample_stream(logits, s, index, history, new))
    }
}

/// What an item holds until its backend sets it.
fn not_run() -> Error {
    Error::new(Status::Panic, "the backend left this batch item unstepped")
}

/// A model on some device that decodes streams it made.
pub trait Backend: Send {
    /// A stream's cache state as this backend holds it.
    type Cache: Send;

    /// Positions in one KV page.
    const PAGE_TOKENS: usize;

    /// An empty stream with room for `window` tokens; it takes no KV memory (its pages come from the pool).
    fn new_stream(&self, window: usize) -> Result<KvStream<Self::Cache>>;

    /// Appends each item's tokens to its stream (each stream appears once) and sets its `next`. The
    /// pages every item's new positions need are already in its stream's `pages`. An item refused here is
    /// left as it was (its `len` unchanged); the others proceed. Err only when the device failed.
    fn step_batch(&mut self, items: &mut [StepItem<'_, Self::Cache>]) -> Result<()>;

    /// The logits after the last position of item `i` of the last `step_batch` (a stepped item).
    fn logits(&self, i: usize) -> Result<Vec<f32>>;

    /// Cuts `stream` to its first `len` positions (`len` <= its length); the backend drops whatever it
    /// keeps for the positions cut. `Streams` then gives back the pages past `len`.
    fn truncate(&mut self, stream: &mut KvStream<Self::Cache>, len: usize) {
        stream.len = len;
    }
}

/// One item of `Decoder::step_batch`: a stream, the ids to append, and (out) the token sampled next.
pub struct BatchStep<'a> {
    pub stream: u32,
    pub tokens: &'a [u32],
    pub next: Result<u32>,
}

impl<'a> BatchStep<'a> {
    pub fn new(stream: u32, tokens: &'a [u32]) -> BatchStep<'a> {
        BatchStep { stream, tokens, next: Err(not_run()) }
    }
}

/// What the engine calls: its streams by index, on whichever backend runs them.
pub trait Decoder: Send {
    /// Streams that exist (the bound on how many are open at once, not on how many full windows fit).
    fn stream_count(&self) -> usize;
    /// The window every stream has, in tokens.
    fn window(&self) -> usize;
    /// Steps every item at once, each with its own status in `next`. INVALID_ARGUMENT (nothing done)
    /// for a stream named twice; another Err only when the device failed.
    fn step_batch(&mut self, items: &mut [BatchStep<'_>]) -> Result<()>;
    /// The logits after the last position of stream `stream`, kept for the streams stepped by the last
    /// batch that stepped anything.
    fn logits(&self, stream: u32) -> Result<Vec<f32>>;
    /// Empties a stream and gives back its pages; its sampler settings stay.
    fn reset(&mut self, stream: u32) -> Result<()>;
    /// Keeps the first `len` positions of a stream (OUT_OF_RANGE past its length).
    fn truncate(&mut self, stream: u32, len: usize) -> Result<()>;
    /// Tokens a stream holds now.
    fn stream_len(&self, stream: u32) -> Result<usize>;
    /// A stream's sampler settings (checked by the caller).
    fn set_sampling(&mut self, stream: u32, s: Sampling) -> Result<()>;
    /// Holds a stream's output to `c` from its next step on (None: no constraint).
    fn set_constraint(&mut self, stream: u32, c: Option<Constraint>) -> Result<()>;
    fn sampling(&self, stream: u32) -> Result<Sampling>;
    /// (positions in the pool, positions free).
    fn kv_stats(&self) -> (u64, u64);
}

/// A backend with `count` stream slots of `window` tokens over one page pool; a slot gets its stream on
/// its first step.
pub struct Streams<B: Backend> {
    backend: B,
    window: usize,
    slots: Vec<Option<KvStream<B::Cache>>>,
    sampling: Vec<Sampling>,
    /// Each stream's constraint, which truncate and reset roll back with it.
    constraints: Vec<Option<Constraint>>,
    pool: PagePool,
    /// The streams whose logits the backend holds, with their item index in its last batch.
    last: Vec<(u32, usize)>,
}

impl<B: Backend> Streams<B> {
    /// `count` streams sampling with `sampling`, over a pool of `pages` pages of `B::PAGE_TOKENS`.
    /// NO_ROOM where the host cannot give the tables (their sizes come from the caller's options).
    pub fn new(backend: B, window: usize, count: usize, pages: usize, sampling: Sampling) -> Result<Streams<B>> {
        let mut slots = Vec::new();
        slots
            .try_reserve_exact(count)
            .map_err(|_| err!(NoRoom, "the host has no room for a table of {count} streams"))?;
        slots.resize_with(count, || None);
        let mut settings = Vec::new();
        settings
            .try_reserve_exact(count)
            .map_err(|_| err!(NoRoom, "the host has no room for a table of {count} streams"))?;
        settings.resize(count, sampling);
        let mut constraints = Vec::new();
        constraints
            .try_reserve_exact(count)
            .map_err(|_| err!(NoRoom, "the host has no room for a table of {count} streams"))?;
        constraints.resize_with(count, || None);
        let pool = PagePool::new(B::PAGE_TOKENS, pages)?;
        Ok(Streams { backend, window, slots, sampling: settings, constraints, pool, last: Vec::new() })
    }

    /// The backend, for tests that look under the seam.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The slot of `stream`; OUT_OF_RANGE past the admitted count, the message led by `call`.
    fn slot(&self, stream: u32, call: &str) -> Result<usize> {
        let count = self.slots.len();
        if stream as usize >= count {
            bail!(OutOfRange, "{call}stream {stream}, but {count} streams were admitted");
        }
        Ok(stream as usize)
    }

    /// Readies item `item` for the backend: its stream exists and holds the pages its new positions need.
    fn admit(&mut self, item: &BatchStep) -> Result<()> {
        let slot = self.slot(item.stream, "")?;
        let n = item.tokens.len();
        if n == 0 {
            bail!(InvalidArgument, "stream {}: no tokens", item.stream);
        }
        let len = self.slots[slot].as_ref().map_or(0, |s| s.len);
        if n > self.window - len.min(self.window) {
            bail!(
                NoRoom,
                "stream {}: {n} tokens after {len} do not fit the stream's window of {}",
                item.stream,
                self.window
            );
        }
        if self.slots[slot].is_none() {
            self.slots[slot] = Some(self.backend.new_stream(self.window)?);
        }
        let s = self.slots[slot].as_mut().expect("made above");
        let need = self.pool.pages_for(len + n).saturating_sub(s.pages.len());
        let free = self.pool.free_pages();
        let Some(pages) = self.pool.take(need) else {
            bail!(
                NoRoom,
                "stream {}: {n} tokens after {len} need {need} more KV pages of {} tokens; {free} of {} are free",
                item.stream,
                self.pool.page_tokens(),
                self.pool.total_pages()
            );
        };
        s.pages.extend(pages);
        Ok(())
    }

    /// Gives back the pages of stream slot `slot` past its length.
    fn trim_pages(&mut self, slot: usize) {
        if let Some(s) = self.slots[slot].as_mut() {
            let keep = self.pool.pages_for(s.len);
            if s.pages.len() > keep {
                self.pool.give_back(s.pages.drain(keep..));
            }
        }
    }

    /// Runs the tokens of admitted item `item` through its stream's constraint, if it has one.
    fn feed_constraint(&mut self, item: &BatchStep) -> Result<()> {
        let slot = item.stream as usize;
        match self.constraints[slot].as_mut() {
            Some(c) => c.feed(self.slots[slot].as_ref().map_or(0, |s| s.len), item.tokens),
            None => Ok(()),
        }
    }

    fn forget_logits(&mut self, stream: u32) {
        self.last.retain(|&(s, _)| s != stream);
    }
}

impl<B: Backend> Decoder for Streams<B> {
    fn stream_count(&self) -> usize {
        self.slots.len()
    }

    fn window(&self) -> usize {
        self.window
    }

    fn step_batch(&mut self, items: &mut [BatchStep<'_>]) -> Result<()> {
        let mut named = std::collections::HashSet::with_capacity(items.len());
        if let Some(twice) = items.iter().find(|i| !named.insert(i.stream)) {
            bail!(InvalidArgument, "stream {} is named twice in one batch", twice.stream);
        }
        // Which items run, in the caller's order; the others have their status already. A constrained
        // stream's tokens go through its constraint first: one it refuses fails the item.
        let mut run = Vec::with_capacity(items.len());
        for (i, item) in items.iter_mut().enumerate() {
            let admitted = self.admit(item);
            match admitted.clone().and_then(|()| self.feed_constraint(item)) {
                Ok(()) => run.push(i),
                Err(e) => {
                    if admitted.is_ok() {
                        self.trim_pages(item.stream as usize);
                    }
                    item.next = Err(e);
                }
            }
        }
        if run.is_empty() {
            return Ok(());
        }
        let Streams { backend, slots, sampling, constraints, .. } = self;
        let masks: Vec<Option<PendingMask>> =
            run.iter().map(|&i| constraints[items[i].stream as usize].as_ref().map(|_| PendingMask::new())).collect();
        let mut by_slot: Vec<Option<&mut KvStream<B::Cache>>> = slots.iter_mut().map(Option::as_mut).collect();
        let mut constrained: Vec<Option<&mut Constraint>> = constraints.iter_mut().map(Option::as_mut).collect();
        // The constrained items' masks are computed on one thread beside the backend's forward (on CUDA
        // the host only queues and waits then); the sampler waits for each.
        let work: Vec<(&mut Constraint, &PendingMask)> = run
            .iter()
            .zip(&masks)
            .filter_map(|(&i, m)| Some((constrained[items[i].stream as usize].take()?, m.as_ref()?)))
            .collect();
        let mut last = Vec::new();
        let ran = std::thread::scope(|scope| {
            if !work.is_empty() {
                scope.spawn(move || {
                    for (c, mask) in work {
                        mask.compute(c);
                    }
                });
            }
            let mut step: Vec<StepItem<'_, B::Cache>> = run
                .iter()
                .zip(&masks)
                .map(|(&i, mask)| {
                    let stream = items[i].stream;
                    StepItem {
                        stream: by_slot[stream as usize].take().expect("admitted, and named once"),
                        index: stream,
                        tokens: items[i].tokens,
                        sampling: sampling[stream as usize],
                        mask: mask.as_ref(),
                        next: Err(not_run()),
                    }
                })
                .collect();
            let lens: Vec<usize> = step.iter().map(|s| s.stream.len).collect();
            let ran = backend.step_batch(&mut step);
            for (k, s) in step.iter_mut().enumerate() {
                let next = std::mem::replace(&mut s.next, Err(not_run()));
                let next = match (&ran, next) {
                    (Err(e), Err(_)) => Err(e.clone()),
                    (_, next) => next,
                };
                // A mask that failed fails its item, which then appends nothing.
                let next = match (next, masks[k].as_ref().and_then(PendingMask::error)) {
                    (Ok(_), Some(e)) => {
                        backend.truncate(s.stream, lens[k]);
                        Err(e)
                    }
                    (next, _) => next,
                };
                if next.is_ok() {
                    s.stream.tokens.extend_from_slice(s.tokens);
                    last.push((s.index, k));
                }
                items[run[k]].next = next;
            }
            ran
        });
        for &i in &run {
            let slot = items[i].stream as usize;
            let len = self.slots[slot].as_ref().map_or(0, |s| s.len);
            if let Some(c) = self.constraints[slot].as_mut() {
                if items[i].next.is_ok() { c.stepped(len) } else { c.rollback(len) }
            }
            if items[i].next.is_err() {
                self.trim_pages(slot);
            }
        }
        self.last = last;
        ran
    }

    fn logits(&self, stream: u32) -> Result<Vec<f32>> {
        if let Some(&(_, i)) = self.last.iter().find(|&&(s, _)| s == stream) {
            return self.backend.logits(i);
        }
        self.slot(stream, "")?;
        Err(err!(InvalidArgument, "no logits for stream {stream}: it was not stepped by the last batch"))
    }

    fn reset(&mut self, stream: u32) -> Result<()> {
        self.truncate(stream, 0)?;
        self.forget_logits(stream);
        Ok(())
    }

    fn truncate(&mut self, stream: u32, len: usize) -> Result<()> {
        let slot = self.slot(stream, "")?;
        let Some(s) = self.slots[slot].as_mut() else {
            if len > 0 {
                bail!(OutOfRange, "stream {stream} holds 0 tokens; it cannot keep {len}");
            }
            return Ok(());
        };
        if len > s.len {
            bail!(OutOfRange, "stream {stream} holds {} tokens; it cannot keep {len}", s.len);
        }
        if len < s.len {
            self.backend.truncate(s, len);
            s.tokens.truncate(len);
            self.forget_logits(stream);
        }
        if let Some(c) = self.constraints[slot].as_mut() {
            c.rollback(len);
        }
        self.trim_pages(slot);
        Ok(())
    }

    fn stream_len(&self, stream: u32) -> Result<usize> {
        let slot = self.slot(stream, "")?;
        Ok(self.slots[slot].as_ref().map_or(0, |s| s.len()))
    }

    fn set_sampling(&mut self, stream: u32, s: Sampling) -> Result<()> {
        let slot = self.slot(stream, "")?;
        self.sampling[slot] = s;
        Ok(())
    }

    fn set_constraint(&mut self, stream: u32, c: Option<Constraint>) -> Result<()> {
        let slot = self.slot(stream, "")?;
        self.constraints[slot] = c;
        Ok(())
    }

    fn sampling(&self, stream: u32) -> Result<Sampling> {
        Ok(self.sampling[self.slot(stream, "")?])
    }

    fn kv_stats(&self) -> (u64, u64) {
        let page = self.pool.page_tokens() as u64;
        (self.pool.total_pages() as u64 * page, self.pool.free_pages() as u64 * page)
    }
}
