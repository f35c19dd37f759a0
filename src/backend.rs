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

use std::collections::{BTreeMap, HashMap};

use crate::abi::{engine_draft, engine_kv_usage, engine_speculation};
use crate::constraint::{Constraint, PendingMask};
use crate::sampler::{self, Sampling};
use crate::speculative::{self, SpecState};
use crate::status::{Error, Result, Status};
use crate::{bail, err};

/// The key before a stream's first page: the root of every chain.
const ROOT: u64 = 0;

/// A whole page in the prefix cache: its tokens after the node of the page before it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct PageKey {
    parent: u64,
    tokens: Box<[u32]>,
}

/// A page entered in the prefix cache.
#[derive(Debug)]
struct Cached {
    key: PageKey,
    /// Its node: the parent of the next page's key. Never reused, so a key names one chain.
    node: u64,
    /// Its place in the eviction order while no stream holds it.
    released: Option<u64>,
}

/// The prefix cache's pages: by key, by page, and those no stream holds in the order they were released.
#[derive(Debug, Default)]
struct PrefixCache {
    index: HashMap<PageKey, u32>,
    pages: HashMap<u32, Cached>,
    /// Release tick -> page, for pages no stream holds: the first is evicted first.
    unheld: BTreeMap<u64, u32>,
    next_node: u64,
    clock: u64,
}

impl PrefixCache {
    /// Takes `page` out of the cache (it is about to be written, or reused for other positions).
    fn remove(&mut self, page: u32) {
        if let Some(c) = self.pages.remove(&page) {
            self.index.remove(&c.key);
            if let Some(t) = c.released {
                self.unheld.remove(&t);
            }
        }
    }
}

/// The pool's pages by state, for `engine_kv_usage`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolUsage {
    /// Pages no stream holds (the cache's among them).
    pub free: usize,
    /// Pages more than one stream holds.
    pub shared: usize,
    /// Pages the prefix cache keeps that no stream holds.
    pub cached: usize,
}

/// The page ids of one KV pool: how many streams hold each, which are free, which the prefix cache
/// keeps, and how many positions a page holds.
#[derive(Debug)]
pub struct PagePool {
    page_tokens: usize,
    total: usize,
    /// Free page ids outside the cache; the next page taken is the last one.
    free: Vec<u32>,
    /// Streams holding each page.
    refs: Vec<u32>,
    /// None when the prefix cache is off.
    cache: Option<PrefixCache>,
}

impl PagePool {
    /// `pages` pages of `page_tokens` positions, all free, no prefix cache; NO_ROOM where the host cannot
    /// hold the lists.
    pub fn new(page_tokens: usize, pages: usize) -> Result<PagePool> {
        if page_tokens == 0 {
            bail!(InvalidArgument, "a KV page of 0 tokens");
        }
        if pages > u32::MAX as usize {
            bail!(NoRoom, "a KV pool of {pages} pages is more than page ids count");
        }
        let no_room = |_| err!(NoRoom, "the host has no room for a list of {pages} pages");
        let mut free = Vec::new();
        free.try_reserve_exact(pages).map_err(no_room)?;
        // Reversed, so pages are taken in id order from a fresh pool.
        free.extend((0..pages as u32).rev());
        let mut refs = Vec::new();
        refs.try_reserve_exact(pages).map_err(no_room)?;
        refs.resize(pages, 0);
        Ok(PagePool { page_tokens, total: pages, free, refs, cache: None })
    }

    /// Keeps whole pages for the prefix cache (`on`), or not (the pages it kept are free again).
    pub fn set_prefix_cache(&mut self, on: bool) {
        if !on {
            if let Some(c) = self.cache.take() {
                for p in c.unheld.into_values() {
                    self.free.push(p);
                }
            }
        } else if self.cache.is_none() {
            self.cache = Some(PrefixCache { next_node: ROOT + 1, ..PrefixCache::default() });
        }
    }

    /// Whether whole pages are kept for the prefix cache.
    pub fn caching(&self) -> bool {
        self.cache.is_some()
    }

    pub fn page_tokens(&self) -> usize {
        self.page_tokens
    }

    pub fn total_pages(&self) -> usize {
        self.total
    }

    /// Pages no stream holds: free ones and those the prefix cache keeps, which a step takes when it
    /// needs room.
    pub fn free_pages(&self) -> usize {
        self.free.len() + self.cache.as_ref().map_or(0, |c| c.unheld.len())
    }

    /// Pages a stream of `tokens` positions holds.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_tokens)
    }

    /// Streams holding `page`.
    pub fn refs(&self, page: u32) -> u32 {
        self.refs[page as usize]
    }

    /// `n` pages no stream holds, each now held once, or None (and nothing taken) when fewer are free.
    /// Free pages go first, then the prefix cache's, least recently released first.
    pub fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free_pages() {
            return None;
        }
        let keep = self.free.len().saturating_sub(n);
        let mut pages = self.free.split_off(keep);
        if let Some(c) = self.cache.as_mut() {
            while pages.len() < n {
                let (_, page) = c.unheld.pop_first().expect("counted in free_pages");
                let key = c.pages.remove(&page).expect("an unheld cached page is entered").key;
                c.index.remove(&key);
                pages.push(page);
            }
        }
        for &p in &pages {
            self.refs[p as usize] = 1;
        }
        Some(pages)
    }

    /// One more holder of `page`, which a stream holds or the prefix cache keeps.
    pub fn hold(&mut self, page: u32) {
        let refs = &mut self.refs[page as usize];
        if *refs == 0 {
            let c = self.cache.as_mut().expect("a page nobody holds is held again only from the cache");
            let t = c.pages.get_mut(&page).and_then(|e| e.released.take()).expect("an unheld cached page");
            c.unheld.remove(&t);
        }
        *refs += 1;
    }

    /// Gives back one hold of each page, the last first: a page nobody holds any more is free again, or
    /// kept by the prefix cache when entered there (a stream's last pages then go before its first).
    pub fn give_back(&mut self, pages: impl IntoIterator<Item = u32>) {
        let pages: Vec<u32> = pages.into_iter().collect();
        for &p in pages.iter().rev() {
            let refs = &mut self.refs[p as usize];
            assert!(*refs > 0, "page {p} was given back more often than it was held");
            *refs -= 1;
            if *refs > 0 {
                continue;
            }
            let kept = match self.cache.as_mut() {
                Some(c) => match c.pages.get_mut(&p) {
                    Some(entry) => {
                        c.clock += 1;
                        entry.released = Some(c.clock);
                        c.unheld.insert(c.clock, p);
                        true
                    }
                    None => false,
                },
                None => false,
            };
            if !kept {
                self.free.push(p);
            }
        }
    }

    /// The page entered under `tokens` after `parent`, with its node.
    fn lookup(&self, parent: u64, tokens: &[u32]) -> Option<(u64, u32)> {
        let c = self.cache.as_ref()?;
        let key = PageKey { parent, tokens: tokens.into() };
        let page = *c.index.get(&key)?;
        Some((c.pages[&page].node, page))
    }

    /// Enters `page` (held, whole, holding `tokens` after `parent`) and returns its node; where another
    /// page is entered under the same key, that page's node (this one stays out).
    fn enter(&mut self, page: u32, parent: u64, tokens: &[u32]) -> u64 {
        let c = self.cache.as_mut().expect("entered only while caching");
        let key = PageKey { parent, tokens: tokens.into() };
        if let Some(&there) = c.index.get(&key) {
            return c.pages[&there].node;
        }
        if let Some(e) = c.pages.get(&page) {
            // Entered under another key: not possible for a page a stream may write (`admit` takes it out).
            debug_assert_eq!(e.key, key, "page {page} is entered under another key");
            return e.node;
        }
        let node = c.next_node;
        c.next_node += 1;
        c.index.insert(key.clone(), page);
        c.pages.insert(page, Cached { key, node, released: None });
        node
    }

    /// Takes `page`, which one stream holds and is about to write, out of the prefix cache.
    fn forget(&mut self, page: u32) {
        if let Some(c) = self.cache.as_mut() {
            c.remove(page);
        }
    }

    /// The pages by state.
    pub fn usage(&self) -> PoolUsage {
        PoolUsage {
            free: self.free_pages(),
            shared: self.refs.iter().filter(|&&r| r > 1).count(),
            cached: self.cache.as_ref().map_or(0, |c| c.unheld.len()),
        }
    }

    /// Checks the counts against the pages `holders` hold (each stream's list): every page is held by
    /// exactly its count of streams, a held page is neither free nor waiting in the cache, every page
    /// is accounted for once, and the cache's index and pages agree. The first discrepancy, in words.
    pub fn audit<'p>(&self, holders: impl IntoIterator<Item = &'p [u32]>) -> std::result::Result<(), String> {
        let mut counted = vec![0u32; self.total];
        for pages in holders {
            for &p in pages {
                *counted.get_mut(p as usize).ok_or_else(|| format!("page {p} is outside the pool"))? += 1;
            }
        }
        if let Some(p) = (0..self.total).find(|&p| counted[p] != self.refs[p]) {
            return Err(format!("page {p}: {} holders, counted {}", counted[p], self.refs[p]));
        }
        let mut seen = vec![false; self.total];
        let unheld: Vec<u32> = self.cache.as_ref().map_or(Vec::new(), |c| c.unheld.values().copied().collect());
        for &p in self.free.iter().chain(&unheld) {
            if std::mem::replace(&mut seen[p as usize], true) {
                return Err(format!("page {p} is listed free twice"));
            }
            if counted[p as usize] > 0 {
                return Err(format!("page {p} is free while {} streams hold it", counted[p as usize]));
            }
        }
        if let Some(p) = (0..self.total).find(|&p| !seen[p] && counted[p] == 0) {
            return Err(format!("page {p} is neither held nor free"));
        }
        let Some(c) = self.cache.as_ref() else { return Ok(()) };
        if c.index.len() != c.pages.len() {
            return Err(format!("{} keys for {} cached pages", c.index.len(), c.pages.len()));
        }
        for (&p, e) in &c.pages {
            if c.index.get(&e.key) != Some(&p) {
                return Err(format!("cached page {p} is not found under its key"));
            }
            if e.released.is_some() != (counted[p as usize] == 0) {
                return Err(format!("cached page {p}: released {:?} with {} holders", e.released, counted[p as usize]));
            }
            if e.key.tokens.len() != self.page_tokens {
                return Err(format!("cached page {p} is keyed by {} tokens", e.key.tokens.len()));
            }
        }
        if let Some((_, &p)) = c.unheld.iter().find(|&(&t, p)| c.pages.get(p).and_then(|e| e.released) != Some(t)) {
            return Err(format!("page {p} waits in the cache's order under another tick"));
        }
        Ok(())
    }
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
}

impl<C> KvStream<C> {
    pub(crate) fn new(cache: C, window: usize) -> KvStream<C> {
        KvStream { cache, len: 0, window, pages: Vec::new(), tokens: Vec::new(), keys: Vec::new() }
    }

    /// A stream over the given pages (a backend's own, outside any engine pool).
    pub(crate) fn with_pages(cache: C, window: usize, pages: Vec<u32>) -> KvStream<C> {
        KvStream { cache, len: 0, window, pages, tokens: Vec::new(), keys: Vec::new() }
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

    /// Appends `tokens` to `stream` as `step_batch` would an item of them (its pages ready), computing
    /// the logits after every one of them (a prompt's chunks, not a step a token), and writes
    /// `out[i] = log p(tokens[i + 1] | every position before it)` for `i < tokens.len() - 1`: the
    /// log-softmax of each position's logits, as `log_prob` computes it. The logits after the last
    /// token are kept as item 0 of `logits`. Refused (appending nothing) where `step_batch` would refuse.
    fn score(&mut self, stream: &mut KvStream<Self::Cache>, tokens: &[u32], out: &mut [f32]) -> Result<()>;
}

/// One item of `Decoder::step_batch`: a stream, the ids to append, and (out) the token sampled next.
pub struct BatchStep<'a> {
    pub stream: u32,
    pub tokens: &'a [u32],
    pub next: Result<u32>,
    /// Tokens the step may produce for this stream: 1 steps one token; more lets the stream's
    /// speculation propose up to this many less one.
    pub most: usize,
    /// Out: every token the step produced (accepted proposals, then `next`).
    pub out: Vec<u32>,
}

impl<'a> BatchStep<'a> {
    pub fn new(stream: u32, tokens: &'a [u32]) -> BatchStep<'a> {
        BatchStep { stream, tokens, next: Err(not_run()), most: 1, out: Vec::new() }
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
    /// Checks the pool's counts against every stream's pages (for tests): INVALID_ARGUMENT saying what
    /// disagrees.
    fn audit(&self) -> Result<()>;
}

/// Where `Streams::admit` put an item: what to restore when the backend refuses it.
struct Admission {
    slot: usize,
    /// The stream's length and its last token before the call (`start` may be one less).
    len: usize,
    last: Option<u32>,
    /// The item's first tokens the prefix cache gave (whole pages): the backend computes the rest.
    skip: usize,
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
    /// The streams whose logits the backend holds, with their item index in its last batch and the head
    /// position of their last kept token.
    last: Vec<(u32, usize, usize)>,
    spec: Vec<SpecState>,
    /// The drafter model for `ENGINE_DRAFT_MODEL`: a second model of the same backend kind with its own
    /// pool, greedy, stream `i` shadowing this stream `i` (its tokens a prefix of this one's).
    drafter: Option<Box<Streams<B>>>,
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
        let spec = vec![SpecState::new(speculative::DEFAULT); count];
        Ok(Streams {
            backend,
            window,
            slots,
            sampling: settings,
            constraints,
            pool,
            last: Vec::new(),
            spec,
            drafter: None,
        })
    }

    /// The same streams with `drafter` proposing for `ENGINE_DRAFT_MODEL`: it needs a stream for each of
    /// these, and drafts greedily whatever its own sampling settings were.
    pub fn with_drafter(mut self, mut drafter: Streams<B>) -> Result<Self> {
        if drafter.slots.len() < self.slots.len() {
            bail!(InvalidArgument, "a drafter of {} streams for {} streams", drafter.slots.len(), self.slots.len());
        }
        drafter.sampling.iter_mut().for_each(|s| *s = Sampling::GREEDY);
        self.drafter = Some(Box::new(drafter));
        Ok(self)
    }

    /// The drafter's streams, for tests that look under the seam.
    pub fn drafter(&self) -> Option<&Streams<B>> {
        self.drafter.as_deref()
    }

    /// The same streams with the prefix cache on or off (off unless told).
    pub fn with_prefix_cache(mut self, on: bool) -> Self {
        self.pool.set_prefix_cache(on);
        self
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

    /// Readies `tokens` for the backend on stream `stream` from position `start` (its length, or one less
    /// to compute its last position again): the stream exists, holds the pages its new positions need,
    /// the page of its first new position is its own (copied when another stream holds it, out of the
    /// prefix cache otherwise), and with `reuse` the prefix cache's pages stand for the item's first
    /// whole pages among its first `reuse` tokens (their tokens appended). NO_ROOM past the window or the
    /// pool, with nothing changed.
    fn admit(&mut self, stream: u32, start: Option<usize>, tokens: &[u32], reuse: usize) -> Result<Admission> {
        let slot = self.slot(stream, "")?;
        let n = tokens.len();
        if n == 0 {
            bail!(InvalidArgument, "stream {stream}: no tokens");
        }
        let len = self.slots[slot].as_ref().map_or(0, |s| s.len);
        let start = start.unwrap_or(len);
        debug_assert!(start <= len && start + 1 >= len, "a write starts at the stream's length or just before");
        if n > self.window - start.min(self.window) {
            bail!(
                NoRoom,
                "stream {stream}: {} tokens after {len} do not fit the stream's window of {}",
                n - (len - start),
                self.window
            );
        }
        if self.slots[slot].is_none() {
            self.slots[slot] = Some(self.backend.new_stream(self.window)?);
        }
        let s = self.slots[slot].as_ref().expect("made above");
        let page = self.pool.page_tokens();
        // The cache's pages for the item's next whole pages, leaving its last token to compute.
        let mut matched: Vec<(u64, u32)> = Vec::new();
        let whole = start / page;
        if reuse > 0 && start.is_multiple_of(page) && s.pages.len() == whole && s.keys.len() == whole {
            let mut parent = s.keys.last().copied().unwrap_or(ROOT);
            while (matched.len() + 1) * page < reuse.min(n) {
                let at = matched.len() * page;
                let Some((node, p)) = self.pool.lookup(parent, &tokens[at..at + page]) else { break };
                matched.push((node, p));
                parent = node;
            }
        }
        let skip = matched.len() * page;
        let held = s.pages.len() + matched.len();
        // The page the first computed position lands in, where the stream holds it already.
        let written = s.pages.get((start + skip) / page).copied();
        let copy = written.filter(|&p| self.pool.refs(p) > 1);
        let need = self.pool.pages_for(start + n).saturating_sub(held) + copy.is_some() as usize;
        let taken_from_cache = matched.iter().filter(|&&(_, p)| self.pool.refs(p) == 0).count();
        let free = self.pool.free_pages() - taken_from_cache;
        if need > free {
            bail!(
                NoRoom,
                "stream {stream}: {} tokens after {len} need {need} more KV pages of {page} tokens; {free} of {} are free",
                n - (len - start),
                self.pool.total_pages()
            );
        }
        // Held before `take`, which would otherwise evict them.
        for &(_, p) in &matched {
            self.pool.hold(p);
        }
        let mut fresh = self.pool.take(need).expect("counted above");
        if let Some(from) = copy {
            let to = fresh.pop().expect("counted in need");
            if let Err(e) = self.backend.copy_page(from, to) {
                self.pool.give_back(matched.iter().map(|&(_, p)| p).chain(fresh).chain([to]));
                return Err(e);
            }
            self.slots[slot].as_mut().expect("made above").pages[(start + skip) / page] = to;
            self.pool.give_back([from]);
        } else if let Some(p) = written {
            self.pool.forget(p);
        }
        let s = self.slots[slot].as_mut().expect("made above");
        let last = s.tokens.last().copied().filter(|_| start < len);
        if start < len {
            self.backend.truncate(s, start);
            s.tokens.truncate(start);
        }
        s.keys.truncate(start / page);
        s.pages.extend(matched.iter().map(|&(_, p)| p));
        s.keys.extend(matched.iter().map(|&(node, _)| node));
        s.tokens.extend_from_slice(&tokens[..skip]);
        s.len = start + skip;
        s.pages.extend(fresh);
        Ok(Admission { slot, len, last, skip })
    }

    /// Puts a stream the backend refused back as `admit` found it (its pages past that length given back).
    fn restore(&mut self, a: &Admission) {
        let page = self.pool.page_tokens();
        if let Some(s) = self.slots[a.slot].as_mut() {
            let start = a.len - a.last.is_some() as usize;
            s.len = a.len;
            s.tokens.truncate(start);
            s.tokens.extend(a.last);
            s.keys.truncate(start / page);
        }
        self.trim_pages(a.slot);
        self.enter_pages(a.slot);
    }

    /// Enters a stream's whole pages past those it has keys for into the prefix cache.
    fn enter_pages(&mut self, slot: usize) {
        if !self.pool.caching() {
            return;
        }
        let page = self.pool.page_tokens();
        let Some(s) = self.slots[slot].as_mut() else { return };
        while s.keys.len() < s.len / page {
            let i = s.keys.len();
            let parent = if i == 0 { ROOT } else { s.keys[i - 1] };
            let node = self.pool.enter(s.pages[i], parent, &s.tokens[i * page..(i + 1) * page]);
            s.keys.push(node);
        }
    }

    /// Gives back the pages of stream slot `slot` past its length, the last first.
    fn trim_pages(&mut self, slot: usize) {
        if let Some(s) = self.slots[slot].as_mut() {
            let keep = self.pool.pages_for(s.len);
            s.keys.truncate(s.len / self.pool.page_tokens());
            if s.pages.len() > keep {
                self.pool.give_back(s.pages.drain(keep..));
            }
        }
    }

    /// Runs the tokens of admitted item `item` through its stream's constraint, if it has one.
    /// Runs `tokens`, to be appended at position `at` of stream slot `slot`, through its constraint, if any.
    fn feed_constraint(&mut self, slot: usize, at: usize, tokens: &[u32]) -> Result<()> {
        match self.constraints[slot].as_mut() {
            Some(c) => c.feed(at, tokens),
            None => Ok(()),
        }
    }

    fn forget_logits(&mut self, stream: u32) {
        self.last.retain(|&(s, _, _)| s != stream);
    }

    /// How many tokens stream `stream` may propose after `tokens` for an item that may produce `most`
    /// tokens: none unless its speculation is on, and never past its window or the backend's
    /// verification (a pause after rejections counts down here).
    fn proposal_budget(&mut self, stream: u32, tokens: &[u32], most: usize) -> usize {
        let Ok(slot) = self.slot(stream, "") else { return 0 };
        let len = self.slots[slot].as_ref().map_or(0, |s| s.len);
        let room = self.window.saturating_sub(len + tokens.len());
        let fits = self.backend.verify_tokens().saturating_sub(tokens.len());
        let bound = most.saturating_sub(1).min(room).min(fits);
        if bound == 0 || tokens.is_empty() {
            return 0;
        }
        self.spec[slot].budget().min(bound)
    }

    /// Stream `stream`'s history: its tokens, then `tokens`.
    fn history(&self, stream: u32, tokens: &[u32]) -> Vec<u32> {
        let mut history = self.slots[stream as usize].as_ref().map_or(Vec::new(), |s| s.tokens.clone());
        history.extend_from_slice(tokens);
        history
    }

    /// Each item's proposals (empty for a constrained stream, whose mask is computed for one draw):
    /// prompt lookup's at once, the drafter's in one batched drafter step per proposed token.
    fn propose_all(&mut self, items: &[BatchStep<'_>]) -> Vec<Vec<u32>> {
        let mut proposals = vec![Vec::new(); items.len()];
        let mut drafts: Vec<(usize, u32, Vec<u32>, usize)> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            if self.constraints.get(item.stream as usize).is_some_and(Option::is_some) {
                continue;
            }
            let k = self.proposal_budget(item.stream, item.tokens, item.most);
            if k == 0 {
                continue;
            }
            let set = self.spec[item.stream as usize].settings;
            let history = self.history(item.stream, item.tokens);
            match set.draft {
                engine_draft::Ngram => {
                    proposals[i] = speculative::lookup(&history, set.ngram_min as usize, set.ngram_max as usize, k)
                }
                engine_draft::Model => drafts.push((i, item.stream, history, k)),
                engine_draft::None => {}
            }
        }
        if let Some(drafter) = self.drafter.as_mut().filter(|_| !drafts.is_empty()) {
            let jobs: Vec<(u32, Vec<u32>, usize)> = drafts.iter().map(|(_, s, h, k)| (*s, h.clone(), *k)).collect();
            for ((i, ..), drafted) in drafts.iter().zip(drafter.draft(&jobs)) {
                proposals[*i] = drafted;
            }
        }
        proposals
    }

    /// As a drafter: for each job (stream, the target stream's history, k), up to k greedy tokens after
    /// the history. The stream first keeps its longest prefix of the history (less one token, whose
    /// logits the first draft needs) and catches up with the rest in the first batched step; each later
    /// step appends the previous draft. A job the drafter cannot step (its window or pool full) stops
    /// with what it has; a device error drafts nothing more.
    fn draft(&mut self, jobs: &[(u32, Vec<u32>, usize)]) -> Vec<Vec<u32>> {
        let mut drafted: Vec<Vec<u32>> = vec![Vec::new(); jobs.len()];
        let mut inputs: Vec<Vec<u32>> = Vec::with_capacity(jobs.len());
        for (stream, history, _) in jobs {
            let held = self.slots.get(*stream as usize).and_then(Option::as_ref).map_or(&[][..], |s| &s.tokens[..]);
            let common = held.iter().zip(history).take_while(|(a, b)| a == b).count().min(history.len() - 1);
            if common < held.len() && self.truncate(*stream, common).is_err() {
                let _ = self.reset(*stream);
            }
            let kept = self.stream_len(*stream).unwrap_or(0).min(common);
            inputs.push(history[kept..].to_vec());
        }
        let most = jobs.iter().map(|j| j.2).max().unwrap_or(0);
        for round in 0..most {
            let live: Vec<usize> = (0..jobs.len())
                .filter(|&j| jobs[j].2 > round && drafted[j].len() == round && !inputs[j].is_empty())
                .collect();
            if live.is_empty() {
                break;
            }
            let mut steps: Vec<BatchStep<'_>> = live.iter().map(|&j| BatchStep::new(jobs[j].0, &inputs[j])).collect();
            if self.step_batch(&mut steps).is_err() {
                break;
            }
            let next: Vec<Option<u32>> = steps.iter().map(|s| s.next.as_ref().ok().copied()).collect();
            drop(steps);
            for (&j, next) in live.iter().zip(next) {
                match next {
                    Some(t) => {
                        drafted[j].push(t);
                        inputs[j] = vec![t];
                    }
                    None => inputs[j].clear(),
                }
            }
        }
        drafted
    }

    /// Cuts the drafter's stream `stream` to at most `len` positions (after verification or a truncate of
    /// the target's stream); a drafter stream that cannot be cut starts again empty.
    fn cut_drafter(&mut self, stream: u32, len: usize) {
        if let Some(d) = self.drafter.as_mut()
            && d.stream_len(stream).is_ok_and(|have| have > len)
            && d.truncate(stream, len).is_err()
        {
            let _ = d.reset(stream);
        }
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
        // Each item's run: its tokens, then what its stream proposes after them (a constrained stream
        // proposes nothing: its mask is computed for one draw).
        let mut runs: Vec<Vec<u32>> = Vec::with_capacity(items.len());
        let mut proposed = vec![0usize; items.len()];
        // Which items run, in the caller's order; the others have their status already. A constrained
        // stream's tokens go through its constraint first: one it refuses fails the item.
        let mut run = Vec::with_capacity(items.len());
        let mut all_proposals = self.propose_all(items);
        for (i, item) in items.iter_mut().enumerate() {
            item.out.clear();
            let proposals = std::mem::take(&mut all_proposals[i]);
            let mut tokens = item.tokens.to_vec();
            tokens.extend_from_slice(&proposals);
            // The cache may stand for the item's own tokens only: every proposal needs its logits.
            let mut admitted = self.admit(item.stream, None, &tokens, item.tokens.len());
            if admitted.as_ref().is_err_and(|e| e.status == Status::NoRoom) && !proposals.is_empty() {
                // No room for the proposals: the item steps as without them.
                tokens.truncate(item.tokens.len());
                admitted = self.admit(item.stream, None, &tokens, item.tokens.len());
            }
            proposed[i] = tokens.len() - item.tokens.len();
            runs.push(tokens);
            let a = match admitted {
                Ok(a) => a,
                Err(e) => {
                    item.next = Err(e);
                    continue;
                }
            };
            match self.feed_constraint(a.slot, a.len, item.tokens) {
                Ok(()) => run.push((i, a)),
                Err(e) => {
                    self.restore(&a);
                    item.next = Err(e);
                }
            }
        }
        if run.is_empty() {
            return Ok(());
        }
        let Streams { backend, slots, sampling, constraints, .. } = self;
        let masks: Vec<Option<PendingMask>> = run
            .iter()
            .map(|(i, _)| constraints[items[*i].stream as usize].as_ref().map(|_| PendingMask::new()))
            .collect();
        let mut by_slot: Vec<Option<&mut KvStream<B::Cache>>> = slots.iter_mut().map(Option::as_mut).collect();
        let mut constrained: Vec<Option<&mut Constraint>> = constraints.iter_mut().map(Option::as_mut).collect();
        // The constrained items' masks are computed on one thread beside the backend's forward (on CUDA
        // the host only queues and waits then); the sampler waits for each.
        let work: Vec<(&mut Constraint, &PendingMask)> = run
            .iter()
            .zip(&masks)
            .filter_map(|((i, _), m)| Some((constrained[items[*i].stream as usize].take()?, m.as_ref()?)))
            .collect();
        let mut last = Vec::new();
        let mut verified = Vec::new();
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
                .map(|((i, a), mask)| {
                    let stream = items[*i].stream;
                    let mut item = StepItem::new(
                        by_slot[stream as usize].take().expect("admitted, and named once"),
                        stream,
                        &runs[*i][a.skip..],
                        sampling[stream as usize],
                    );
                    item.heads = proposed[*i] + 1;
                    item.mask = mask.as_ref();
                    item
                })
                .collect();
            let lens: Vec<usize> = step.iter().map(|s| s.stream.len).collect();
            let ran = backend.step_batch(&mut step);
            for (k, s) in step.iter_mut().enumerate() {
                let i = run[k].0;
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
                let Ok(plain) = next else {
                    items[i].next = next;
                    continue;
                };
                s.stream.tokens.extend_from_slice(s.tokens);
                let n = proposed[i];
                let proposals = &runs[i][runs[i].len() - n..];
                let kept = if n > 0 { speculative::accepted(proposals, &s.drawn) } else { 0 };
                if kept < n {
                    // The rejected positions leave the stream; `trim_pages` below gives back their pages.
                    let len = s.stream.len - (n - kept);
                    backend.truncate(s.stream, len);
                    s.stream.tokens.truncate(len);
                }
                let own = if n > 0 { s.drawn[kept] } else { plain };
                items[i].out = proposals[..kept].iter().copied().chain([own]).collect();
                items[i].next = Ok(own);
                if n > 0 {
                    verified.push((s.index as usize, n, kept));
                }
                last.push((s.index, k, if n > 0 { kept } else { 0 }));
            }
            ran
        });
        for (stream, n, kept) in verified {
            self.spec[stream].record(n, kept);
        }
        for (i, a) in &run {
            if items[*i].next.is_err() {
                self.restore(a);
            } else {
                self.trim_pages(a.slot);
                self.enter_pages(a.slot);
            }
            let len = self.slots[a.slot].as_ref().map_or(0, |s| s.len);
            if let Some(c) = self.constraints[a.slot].as_mut() {
                if items[*i].next.is_ok() { c.stepped(len) } else { c.rollback(len) }
            }
        }
        self.last = last;
        // The drafter's streams keep no more than the target's: rejected drafts leave them too.
        if self.drafter.is_some() {
            for item in items.iter() {
                let len = self.slots[item.stream as usize].as_ref().map_or(0, |s| s.len);
                self.cut_drafter(item.stream, len);
            }
        }
        ran
    }

    fn logits(&self, stream: u32) -> Result<Vec<f32>> {
        if let Some(&(_, i, head)) = self.last.iter().find(|&&(s, _, _)| s == stream) {
            return self.backend.logits(i, head);
        }
        self.slot(stream, "")?;
        Err(err!(InvalidArgument, "no logits for stream {stream}: it was not stepped by the last batch"))
    }

    fn reset(&mut self, stream: u32) -> Result<()> {
        self.truncate(stream, 0)?;
        self.forget_logits(stream);
        if let Some(d) = self.drafter.as_mut() {
            d.reset(stream)?;
        }
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
        self.cut_drafter(stream, len);
        Ok(())
    }

    fn fork(&mut self, src: u32, dst: u32, len: usize) -> Result<()> {
        let from = self.slot(src, "engine_fork: source ")?;
        let to = self.slot(dst, "engine_fork: destination ")?;
        if src == dst {
            bail!(InvalidArgument, "engine_fork: stream {src} onto itself");
        }
        let have = self.slots[from].as_ref().map_or(0, |s| s.len);
        if len > have {
            bail!(OutOfRange, "engine_fork: stream {src} holds {have} tokens; it cannot give {len}");
        }
        if self.slots[to].is_none() {
            self.slots[to] = Some(self.backend.new_stream(self.window)?);
        }
        self.reset(dst)?;
        if len == 0 {
            return Ok(());
        }
        let page = self.pool.page_tokens();
        let s = self.slots[from].as_ref().expect("it holds positions");
        let pages = s.pages[..self.pool.pages_for(len)].to_vec();
        let tokens = s.tokens[..len].to_vec();
        let keys = s.keys[..s.keys.len().min(len / page)].to_vec();
        for &p in &pages {
            self.pool.hold(p);
        }
        let d = self.slots[to].as_mut().expect("made above");
        (d.pages, d.tokens, d.keys, d.len) = (pages, tokens, keys, len);
        // The drafter's `dst` shares the drafter's `src` pages as far as those hold the same tokens; a
        // drafter that cannot fork leaves `dst` empty, to catch up on its first proposal.
        if let Some(drafter) = self.drafter.as_mut() {
            let have = drafter.stream_len(src).unwrap_or(0).min(len);
            if drafter.fork(src, dst, have).is_err() {
                let _ = drafter.reset(dst);
            }
        }
        Ok(())
    }

    fn score(&mut self, stream: u32, tokens: &[u32], out: &mut [f32]) -> Result<()> {
        let slot = self.slot(stream, "")?;
        let n = tokens.len();
        if n == 0 {
            bail!(InvalidArgument, "stream {stream}: no tokens to score");
        }
        assert_eq!(out.len(), n, "one log-probability a token");
        let len = self.slots[slot].as_ref().map_or(0, |s| s.len);
        if n > self.window - len.min(self.window) {
            bail!(NoRoom, "stream {stream}: {n} tokens after {len} do not fit the stream's window of {}", self.window);
        }
        // The first token's distribution: the stream's kept logits, or its last position computed again.
        let kept = match self.last.iter().find(|&&(s, _, _)| s == stream) {
            Some(&(_, i, head)) if len > 0 => self.backend.logits(i, head).ok(),
            _ => None,
        };
        let run: Vec<u32> = match (len, &kept) {
            (0, _) | (_, Some(_)) => tokens.to_vec(),
            _ => {
                let last = *self.slots[slot].as_ref().and_then(|s| s.tokens.last()).expect("a stream of len > 0");
                std::iter::once(last).chain(tokens.iter().copied()).collect()
            }
        };
        let start = len + n - run.len();
        let a = self.admit(stream, Some(start), &run, 0)?;
        // The tokens go through the stream's constraint as a step's would (one it refuses fails the call).
        if let Err(e) = self.feed_constraint(slot, len, tokens) {
            self.restore(&a);
            return Err(e);
        }
        let mut scored = vec![f32::NAN; run.len()];
        let s = self.slots[slot].as_mut().expect("admitted");
        if let Err(e) = self.backend.score(s, &run, &mut scored) {
            self.restore(&a);
            if let Some(c) = self.constraints[slot].as_mut() {
                c.rollback(len);
            }
            // The backend may have dropped what it kept.
            self.last.clear();
            return Err(e);
        }
        s.tokens.extend_from_slice(&run);
        self.last = vec![(stream, 0, 0)];
        self.enter_pages(slot);
        if let Some(c) = self.constraints[slot].as_mut() {
            c.stepped(len + n);
        }
        match (len, kept) {
            (0, _) => {
                out[0] = f32::NAN;
                out[1..].copy_from_slice(&scored[..n - 1]);
            }
            (_, Some(logits)) => {
                out[0] = log_prob(&logits, tokens[0]);
                out[1..].copy_from_slice(&scored[..n - 1]);
            }
            (_, None) => out.copy_from_slice(&scored[..n]),
        }
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

    fn kv_usage(&self) -> engine_kv_usage {
        let page = self.pool.page_tokens() as u64;
        let u = self.pool.usage();
        engine_kv_usage {
            tokens_total: self.pool.total_pages() as u64 * page,
            tokens_free: u.free as u64 * page,
            tokens_shared: u.shared as u64 * page,
            tokens_cached: u.cached as u64 * page,
        }
    }

    fn stream_pages(&self, stream: u32) -> Result<Vec<u32>> {
        let slot = self.slot(stream, "")?;
        Ok(self.slots[slot].as_ref().map_or(Vec::new(), |s| s.pages.clone()))
    }

    fn set_speculation(&mut self, stream: u32, s: engine_speculation) -> Result<()> {
        let slot = self.slot(stream, "")?;
        if s.draft == engine_draft::Model && self.drafter.is_none() {
            bail!(Unsupported, "stream {stream}: ENGINE_DRAFT_MODEL needs a drafter, and this engine loaded none");
        }
        // A stream that stops drafting gives its drafter stream's pages back to the drafter's pool.
        if let Some(d) = self.drafter.as_mut().filter(|_| s.draft != engine_draft::Model) {
            d.reset(stream)?;
        }
        self.spec[slot] = SpecState::new(s);
        Ok(())
    }

    fn speculation(&self, stream: u32) -> Result<engine_speculation> {
        Ok(self.spec[self.slot(stream, "")?].settings)
    }

    fn speculation_stats(&self, stream: u32) -> Result<(u64, u64)> {
        let s = &self.spec[self.slot(stream, "")?];
        Ok((s.proposed, s.accepted))
    }

    fn audit(&self) -> Result<()> {
        let page = self.pool.page_tokens();
        for (i, s) in self.slots.iter().enumerate() {
            let Some(s) = s else { continue };
            if s.pages.len() != self.pool.pages_for(s.len) || s.tokens.len() != s.len || s.keys.len() > s.len / page {
                bail!(
                    InvalidArgument,
                    "stream {i}: {} positions, {} tokens, {} pages, {} keys",
                    s.len,
                    s.tokens.len(),
                    s.pages.len(),
                    s.keys.len()
                );
            }
        }
        if let Some(d) = self.drafter.as_ref() {
            d.audit().map_err(|e| err!(InvalidArgument, "the drafter: {}", e.message))?;
            for (i, (t, ds)) in self.slots.iter().zip(&d.slots).enumerate() {
                let target = t.as_ref().map_or(&[][..], |s| &s.tokens[..]);
                let drafter = ds.as_ref().map_or(&[][..], |s| &s.tokens[..]);
                if drafter.len() > target.len() || target[..drafter.len()] != *drafter {
                    bail!(
                        InvalidArgument,
                        "stream {i}: the drafter's {} tokens are not a prefix of the target's {}",
                        drafter.len(),
                        target.len()
                    );
                }
            }
        }
        let holders = self.slots.iter().flatten().map(|s| s.pages.as_slice());
        self.pool.audit(holders).map_err(|why| err!(InvalidArgument, "the KV pool: {why}"))
    }
}
