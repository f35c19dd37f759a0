//! The seam between the engine and a decode backend. A backend (the CPU reference, CUDA) is a model
//! that makes streams and steps a batch of them at once; `Streams` holds the engine's stream slots, their
//! sampler settings and the KV page pool over any backend, and the engine sees it only as a `Decoder`.
//!
//! KV memory comes in pages of `Backend::PAGE_TOKENS` positions from one `PagePool`, sized by the
//! engine from the fit. `Streams` does all of the pool's accounting: before a batch runs it gives each
//! item the pages its new positions need (an item that cannot get them fails with NO_ROOM, untouched),
//! and truncate, reset and failed items give pages back. A backend only reads `KvStream::pages` to
//! find where each position lives in its pool memory, and copies a page when `Streams` asks.
//!
//! Pages are counted: a page may be held by several streams (`engine_fork` gives the forked stream the
//! source's pages) and returns to the pool only when no stream holds it. A position is written only
//! into a page its stream alone holds: before an item writes into a page another stream holds, the page
//! is copied (copy on write; only the page holding a stream's first new position can be shared).
//!
//! The prefix cache (`PagePool::set_prefix_cache`): every whole page a step completes is entered under
//! its key, its tokens after the key of the page before it (a chain from position 0, so a key names the
//! tokens of every position up to the page's end; keys are compared whole, never by a hash alone). An
//! item whose stream is at a page boundary takes the pages whose keys its next whole pages have instead
//! of computing them (at least its last token is computed: its logits are the step's). Pages no stream
//! holds stay entered and count as free: a step that needs room takes them, least recently released
//! first, so the cache never refuses an item the pool would have had room for. On the CPU a position's
//! K and V are the same bits however its tokens were chunked, so a stream that took cached pages has the
//! logits of computing them; on CUDA they are those of a stream that stepped the matched positions in
//! the calls that wrote the pages and the rest as its own call (a chunk's route depends on its length).

use crate::abi::{engine_kv_usage, engine_speculation};
use crate::constraint::{Constraint, PendingMask};
use crate::sampler::{self, Sampling};
use crate::status::{Error, Result, Status};

mod batch;
mod pool;
mod streams;

pub use self::batch::{Batch, BatchItem};
use self::pool::ROOT;
pub use self::pool::{PagePool, PoolUsage};
pub use self::streams::Streams;

/// A local-layer page entry of a stream whose page fell out of the layers' window and went back to the
/// pool: the kernels never read it.
pub const NO_PAGE: u32 = u32::MAX;

/// A model's sliding-window (local) layers as a backend keeps them: a page pool of their own, each page
/// a position range of every local layer, holding only the positions their window can still reach.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalLayers {
    /// The layers' window: a query sees its last `window` positions, its own counted.
    pub window: usize,
    /// Positions before a query's window that the backend's attention may still read (it reads whole
    /// blocks of positions and masks those before the window).
    pub reach: usize,
    /// Pages in the local layers' pool.
    pub pages: usize,
    /// Tokens of the pieces `Streams` steps a longer item in (a multiple of the backend's own chunks,
    /// so the pieces take the routes the whole item would), each piece's early pages given back before
    /// the next: a stream's local pages never hold more than the window's reach and one piece.
    pub piece: usize,
}

/// log p(`id`) under the softmax of `logits`, in f64 as `sampler::top_logprobs` computes it; NaN where
/// the logits hold a NaN or no finite value.
pub fn log_prob(logits: &[f32], id: u32) -> f32 {
    let max = logits.iter().fold(f64::NEG_INFINITY, |m, &l| m.max(l as f64));
    if !max.is_finite() || logits.iter().any(|l| l.is_nan()) {
        return f32::NAN;
    }
    let log_z = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
    (logits[id as usize] as f64 - log_z) as f32
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
    /// The prefix cache's node for each of its first whole pages (while the engine's cache is on).
    pub(crate) keys: Vec<u64>,
    /// With a local layers' pool (`Backend::local_layers`): that pool's page for each page of `pages`,
    /// `NO_PAGE` for those before the window's reach (always a prefix). Empty without one.
    pub(crate) local: Vec<u32>,
}

impl<C> KvStream<C> {
    pub(crate) fn new(cache: C, window: usize) -> KvStream<C> {
        KvStream { cache, len: 0, window, pages: Vec::new(), tokens: Vec::new(), keys: Vec::new(), local: Vec::new() }
    }

    /// A stream over the given pages (a backend's own, outside any engine pool).
    pub(crate) fn with_pages(cache: C, window: usize, pages: Vec<u32>) -> KvStream<C> {
        KvStream { cache, len: 0, window, pages, tokens: Vec::new(), keys: Vec::new(), local: Vec::new() }
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

    /// The local layers' pool pages for each of `pages` (`NO_PAGE` where released); empty without
    /// that pool.
    pub fn local_pages(&self) -> &[u32] {
        &self.local
    }

    /// Forgets every token (the cache's memory, and whatever the backend keeps with it, stays).
    pub fn reset(&mut self) {
        self.len = 0;
        self.tokens.clear();
        self.keys.clear();
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
    /// Positions at the end of `tokens` whose next token is drawn (1..=tokens.len(); 1 for a plain step,
    /// more to verify proposals): each draws as a step ending there would.
    pub heads: usize,
    /// Out: the token drawn after each of those positions, in order (the last is `next`).
    pub drawn: Vec<u32>,
}

impl<'a, C> StepItem<'a, C> {
    /// A plain step of `tokens`: one token drawn after the last.
    pub fn new(stream: &'a mut KvStream<C>, index: u32, tokens: &'a [u32], sampling: Sampling) -> StepItem<'a, C> {
        StepItem { stream, index, tokens, sampling, mask: None, next: Err(not_run()), heads: 1, drawn: Vec::new() }
    }
}

impl<C> StepItem<'_, C> {
    /// The token the item's sampler picks from `logits` after the stream's tokens `history` and the
    /// item's own, among those its constraint allows when it has one (waiting for the mask): the CPU
    /// backend's draw (CUDA's sampler applies the mask on the device, with the same result). A mask that
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

    /// Appends each item's tokens to its stream (each stream appears once) and sets its `drawn` (the
    /// token drawn after each of its last `heads` positions) and `next` (the last of them). The pages
    /// every item's new positions need are already in its stream's `pages`. An item refused here is left
    /// as it was (its `len` unchanged); the others proceed. Err only when the device failed.
    fn step_batch(&mut self, items: &mut [StepItem<'_, Self::Cache>]) -> Result<()>;

    /// The logits after head position `head` (0..heads) of item `i` of the last `step_batch` (a stepped
    /// item), or after the last position of the last `score` (item 0, head 0).
    fn logits(&self, i: usize, head: usize) -> Result<Vec<f32>>;

    /// The most tokens an item may run with `heads` > 1 and have every head's logits the bits of stepping
    /// its positions one at a time (speculation runs no longer verifications).
    fn verify_tokens(&self) -> usize {
        usize::MAX
    }

    /// Cuts `stream` to its first `len` positions (`len` <= its length); the backend drops whatever it
    /// keeps for the positions cut. `Streams` then gives back the pages past `len`.
    fn truncate(&mut self, stream: &mut KvStream<Self::Cache>, len: usize) {
        stream.len = len;
    }

    /// Copies every layer's K and V of pool page `from` into page `to` (copy on write), before anything
    /// later reads or writes `to`.
    fn copy_page(&mut self, from: u32, to: u32) -> Result<()>;

    /// The model's sliding-window layers when this backend keeps them in a pool of their own (then a
    /// step's pages come from both pools: `KvStream::local` names the local one's); None when every
    /// layer's K and V live in the one pool.
    fn local_layers(&self) -> Option<LocalLayers> {
        None
    }

    /// `copy_page` for the local layers' pool.
    fn copy_local_page(&mut self, _from: u32, _to: u32) -> Result<()> {
        Err(Error::new(Status::Unsupported, "this backend keeps no local layers' pool"))
    }

    /// Appends `tokens` to `stream` as `step_batch` would an item of them (its pages ready), computing
    /// the logits after every one of them (a prompt's chunks, not a step a token), and writes
    /// `out[i] = log p(tokens[i + 1] | every position before it)` for `i < tokens.len() - 1`: the
    /// log-softmax of each position's logits, as `log_prob` computes it. The logits after the last
    /// token are kept as item 0 of `logits`. Refused (appending nothing) where `step_batch` would refuse.
    fn score(&mut self, stream: &mut KvStream<Self::Cache>, tokens: &[u32], out: &mut [f32]) -> Result<()>;
}

/// What the engine calls: its streams by index, on whichever backend runs them.
pub trait Decoder: Send {
    /// Streams that exist (the bound on how many are open at once, not on how many full windows fit).
    fn stream_count(&self) -> usize;
    /// The window every stream has, in tokens.
    fn window(&self) -> usize;
    /// Steps every item of `batch` but the refused ones at once, each with its own status in `next`. Err
    /// only when the device failed.
    fn step_batch(&mut self, batch: &mut Batch<'_>) -> Result<()>;
    /// The logits after the last position of stream `stream`, kept for the streams stepped by the last
    /// batch that stepped anything (or the stream the last `score` scored).
    fn logits(&self, stream: u32) -> Result<Vec<f32>>;
    /// Empties a stream and gives back its pages; its sampler settings stay.
    fn reset(&mut self, stream: u32) -> Result<()>;
    /// Keeps the first `len` positions of a stream (OUT_OF_RANGE past its length).
    fn truncate(&mut self, stream: u32, len: usize) -> Result<()>;
    /// Empties `dst`, then gives it the first `len` positions of `src`, sharing `src`'s pages.
    /// INVALID_ARGUMENT for `src == dst`, OUT_OF_RANGE for a stream not admitted or `len` past `src`'s
    /// length; a refusal changes nothing.
    fn fork(&mut self, src: u32, dst: u32, len: usize) -> Result<()>;
    /// Appends `tokens` to a stream as a step would and writes `out[i]` = log p(tokens[i] | all before
    /// it) (NaN for `out[0]` when the stream was empty). NO_ROOM past the window, with nothing changed.
    fn score(&mut self, stream: u32, tokens: &[u32], out: &mut [f32]) -> Result<()>;
    /// Tokens a stream holds now.
    fn stream_len(&self, stream: u32) -> Result<usize>;
    /// A stream's sampler settings (checked by the caller).
    fn set_sampling(&mut self, stream: u32, s: Sampling) -> Result<()>;
    /// Holds a stream's output to `c` from its next step on (None: no constraint).
    fn set_constraint(&mut self, stream: u32, c: Option<Constraint>) -> Result<()>;
    fn sampling(&self, stream: u32) -> Result<Sampling>;
    /// (positions in the pool, positions free).
    fn kv_stats(&self) -> (u64, u64);
    /// The pool's positions by state.
    fn kv_usage(&self) -> engine_kv_usage;
    /// The pool pages a stream holds, in position order (for tests).
    fn stream_pages(&self, stream: u32) -> Result<Vec<u32>>;
    /// A stream's speculation settings from its next step on (checked by the caller).
    fn set_speculation(&mut self, stream: u32, s: engine_speculation) -> Result<()>;
    fn speculation(&self, stream: u32) -> Result<engine_speculation>;
    /// (tokens proposed, tokens accepted) on a stream since its speculation was last set.
    fn speculation_stats(&self, stream: u32) -> Result<(u64, u64)>;
    /// Lets a stream's next verification hold `limit` proposals (at most its max_tokens), as if its
    /// earlier drafts had been accepted: for measuring a verification of a given length.
    fn set_proposal_limit(&mut self, stream: u32, limit: u32) -> Result<()>;
    /// The ids a stream's constraint allows as the token its last step's logits draw, as words of
    /// `vocab` bits; None without a constraint.
    fn allowed_tokens(&mut self, stream: u32, vocab: usize) -> Result<Option<Vec<u32>>>;
    /// (tokens the prefix cache gave, tokens computed) of the tokens a stream was given in steps and
    /// scores since its last reset (proposals not counted).
    fn prefix_stats(&self, stream: u32) -> Result<(u64, u64)>;
    /// Checks the pool's counts against every stream's pages (for tests): INVALID_ARGUMENT saying what
    /// disagrees.
    fn audit(&self) -> Result<()>;
}
