//! The seam between the engine and a decode backend. A backend (the CPU reference, CUDA) is a model
//! that makes streams and steps them; `Streams` holds the engine's stream slots over any backend, and
//! the engine sees it only as a `Decoder`.

use crate::sampler::Sampling;
use crate::status::Result;
use crate::{bail, err};

/// One stream of a backend: its KV cache (`C`, in the backend's own form) and how many of its
/// `window` positions hold tokens.
pub struct KvStream<C> {
    pub(crate) cache: C,
    pub(crate) len: usize,
    pub(crate) window: usize,
}

impl<C> KvStream<C> {
    pub(crate) fn new(cache: C, window: usize) -> KvStream<C> {
        KvStream { cache, len: 0, window }
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
