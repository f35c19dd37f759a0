//! The seam between the engine and a decode backend. A backend (the CPU reference, CUDA) is a model
//! that makes streams and steps them; `Streams` holds the engine's stream slots over any backend, and
//! the engine sees it only as a `Decoder`.

use crate::sampler::Sampling;
use crate::status::Result;
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

/// One item of a batched step, as a backend sees it.
pub struct StepItem<'a, C> {
    pub stream: &'a mut KvStream<C>,
    /// The stream's index: seeds the sampler's draw.
    pub index: u32,
    /// Ids to append (checked against the vocabulary and the window already).
    pub tokens: &'a [u32],
    /// The stream's own sampler settings.
    pub sampling: Sampling,
    /// Out: the token the sampler picks after `tokens`; an Err item appended nothing.
    pub next: Result<u32>,
}

impl<C> KvStream<C> {
    pub(crate) fn new(cache: C, window: usize) -> KvStream<C> {
        KvStream { cache, len: 0, window, pages: Vec::new(), tokens: Vec::new() }
    }

    /// The pool pages this stream holds, in position order.
    pub fn pages(&self) -> &[u32] {
        &self.pages
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

    /// Forgets every token (the cache's memory, and whatever the backend keeps with it, stays).
    pub fn reset(&mut self) {
        self.len = 0;
    }
}

/// A model on some device that decodes streams it made.
pub trait Backend: Send {
    /// A stream's KV cache as this backend holds it.
    type Cache: Send;

    /// An empty stream with room for `window` tokens: the one place a backend allocates a KV cache.
    fn new_stream(&self, window: usize) -> Result<KvStream<Self::Cache>>;

    /// Appends `tokens` to `stream` and returns the token `sampling` picks for the position after them;
    /// `stream_index` seeds the sampler. Refusals (checked before anything is written) leave the stream
    /// and the last logits as they were.
    fn step(
        &mut self,
        stream: &mut KvStream<Self::Cache>,
        tokens: &[u32],
        sampling: &Sampling,
        stream_index: u32,
    ) -> Result<u32>;

    /// The logits after the last position of the last successful step.
    fn last_logits(&self) -> Result<Vec<f32>>;
}

/// What the engine calls: its streams by index, on whichever backend runs them.
pub trait Decoder: Send {
    /// Streams admitted.
    fn stream_count(&self) -> usize;
    /// The window every stream has, in tokens.
    fn window(&self) -> usize;
    /// `Backend::step` on stream `stream`, allocating its cache on first use.
    fn step(&mut self, stream: u32, tokens: &[u32], sampling: &Sampling) -> Result<u32>;
    /// The last step's logits, kept for the last stepped stream only (holding every stream's would cost
    /// a vocabulary-sized copy per step).
    fn logits(&self, stream: u32) -> Result<Vec<f32>>;
    /// Empties a stream; resetting the last stepped stream drops its logits.
    fn reset(&mut self, stream: u32) -> Result<()>;
    /// Tokens a stream holds now.
    fn stream_len(&self, stream: u32) -> Result<usize>;
}

/// A backend with `count` stream slots of `window` tokens, each allocated on its first step so that
/// admitted streams cost nothing until used.
pub struct Streams<B: Backend> {
    backend: B,
    window: usize,
    slots: Vec<Option<KvStream<B::Cache>>>,
    /// The stream whose logits the backend holds.
    last: Option<u32>,
}

impl<B: Backend> Streams<B> {
    /// NO_ROOM where the host cannot give the slot table (its size comes from the caller's options).
    pub fn new(backend: B, window: usize, count: usize) -> Result<Streams<B>> {
        let mut slots = Vec::new();
        slots
            .try_reserve_exact(count)
            .map_err(|_| err!(NoRoom, "the host has no room for a table of {count} streams"))?;
        slots.resize_with(count, || None);
        Ok(Streams { backend, window, slots, last: None })
    }

    /// The slot of `stream`; OUT_OF_RANGE past the admitted count, the message led by `call`.
    fn slot(&self, stream: u32, call: &str) -> Result<usize> {
        let count = self.slots.len();
        if stream as usize >= count {
            bail!(OutOfRange, "{call}stream {stream}, but {count} streams were admitted");
        }
        Ok(stream as usize)
    }
}

impl<B: Backend> Decoder for Streams<B> {
    fn stream_count(&self) -> usize {
        self.slots.len()
    }

    fn window(&self) -> usize {
        self.window
    }

    fn step(&mut self, stream: u32, tokens: &[u32], sampling: &Sampling) -> Result<u32> {
        let slot = self.slot(stream, "engine_step: ")?;
        if self.slots[slot].is_none() {
            self.slots[slot] = Some(self.backend.new_stream(self.window)?);
        }
        let s = self.slots[slot].as_mut().expect("allocated above");
        let next = self.backend.step(s, tokens, sampling, stream)?;
        self.last = Some(stream);
        Ok(next)
    }

    fn logits(&self, stream: u32) -> Result<Vec<f32>> {
        if self.last == Some(stream) {
            return self.backend.last_logits();
        }
        self.slot(stream, "")?;
        Err(err!(InvalidArgument, "logits are kept for the last stepped stream only; stream {stream} is not it"))
    }

    fn reset(&mut self, stream: u32) -> Result<()> {
        let slot = self.slot(stream, "engine_reset: ")?;
        if let Some(s) = self.slots[slot].as_mut() {
            s.reset();
        }
        if self.last == Some(stream) {
            self.last = None;
        }
        Ok(())
    }

    fn stream_len(&self, stream: u32) -> Result<usize> {
        let slot = self.slot(stream, "")?;
        Ok(self.slots[slot].as_ref().map_or(0, |s| s.len()))
    }
}
