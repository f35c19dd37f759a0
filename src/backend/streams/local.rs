//! The local layers' page pool (`Backend::local_layers`): the sliding-window layers' K and V kept in a
//! pool of their own, a stream holding only the pages their window can still reach. A stream's local
//! page list runs beside its page list, entry for entry; the pages before the reach go back to the
//! pool after each step (`NO_PAGE` in their place, never read), a margin of a verification's longest
//! rejection kept so that cutting rejected proposals never needs one back. Truncating or forking
//! further back than the pages a stream still holds is refused, as recomputing them is the caller's to
//! decide. The prefix cache keys a local page under its main page's key; a hit needs the local pages of
//! the matched positions the window reaches, so a hit is cut to the longest prefix whose local tail is
//! still in the pool (vLLM's rule for sliding windows).

use super::Streams;
use crate::abi::ENGINE_SPECULATION_MAX_TOKENS;
use crate::backend::{Backend, KvStream, LocalLayers, NO_PAGE, PagePool, ROOT, StepItem, log_prob};
use crate::bail;
use crate::sampler::Sampling;
use crate::status::Result;

/// Positions a step's verification may cut back from a stream's length (its rejected proposals), with
/// the one position a score computes again.
const REWIND: usize = ENGINE_SPECULATION_MAX_TOKENS as usize + 1;

/// The local layers' pool and what the backend says of those layers.
pub(super) struct LocalPool {
    pub(super) pool: PagePool,
    pub(super) layers: LocalLayers,
}

impl LocalPool {
    pub(super) fn new(layers: LocalLayers, page_tokens: usize) -> Result<LocalPool> {
        Ok(LocalPool { pool: PagePool::new(page_tokens, layers.pages)?, layers })
    }

    /// Positions before a stream's next position that its next step may read: the window and the
    /// backend's reach before it.
    fn reach(&self) -> usize {
        self.layers.window + self.layers.reach
    }

    /// The first page a stream of `len` positions must hold to step on (the first its next query, or a
    /// score's recomputed last one, reads).
    pub(super) fn need_from(&self, len: usize) -> usize {
        len.saturating_sub(self.reach() + 1) / self.pool.page_tokens()
    }

    /// The first page a stream keeps after a step leaves it at `len`: what it needs at any length a
    /// verification's rejection cuts it back to.
    pub(super) fn keep_from(&self, len: usize) -> usize {
        len.saturating_sub(self.reach() + REWIND) / self.pool.page_tokens()
    }

    /// The local pages standing for `matched` (the prefix cache's main pages for a stream's pages from
    /// `whole` on, whose keys chain from `parent`), or None when one the stream keeps at its new length
    /// is not in the local cache (kept as a step keeps them, so a cut within the margin works after a
    /// hit too). Pages before those stand as `NO_PAGE`.
    pub(super) fn matches(
        &self,
        parent: u64,
        whole: usize,
        matched: &[(u64, u32)],
        tokens: &[u32],
    ) -> Option<Vec<u32>> {
        let page = self.pool.page_tokens();
        let from = self.keep_from((whole + matched.len()) * page);
        let mut parent = parent;
        let mut out = Vec::with_capacity(matched.len());
        for (j, &(node, _)) in matched.iter().enumerate() {
            if whole + j < from {
                out.push(NO_PAGE);
            } else {
                out.push(self.pool.lookup(parent, &tokens[j * page..(j + 1) * page])?.1);
            }
            parent = node;
        }
        Some(out)
    }
}

/// The first local page a stream holds (its list's length when it holds none).
pub(super) fn first_held(local: &[u32]) -> usize {
    local.iter().position(|&p| p != NO_PAGE).unwrap_or(local.len())
}

impl<B: Backend> Streams<B> {
    /// Gives back the local pages of stream slot `slot` past its length and those before what it keeps.
    pub(super) fn trim_local(&mut self, slot: usize) {
        let (Some(lp), Some(s)) = (self.local.as_mut(), self.slots[slot].as_mut()) else { return };
        let keep = lp.pool.pages_for(s.len);
        if s.local.len() > keep {
            lp.pool.give_back(s.local.drain(keep..).filter(|&p| p != NO_PAGE));
        }
        let from = lp.keep_from(s.len).min(s.local.len());
        let released: Vec<u32> = s.local[..from].iter().copied().filter(|&p| p != NO_PAGE).collect();
        s.local[..from].fill(NO_PAGE);
        lp.pool.give_back(released);
    }

    /// INVALID_ARGUMENT (led by `call`) when `s` no longer holds the local pages a stream of its first
    /// `len` positions needs.
    pub(super) fn check_local_reach<C>(&self, s: &KvStream<C>, len: usize, call: &str) -> Result<()> {
        let Some(lp) = self.local.as_ref() else { return Ok(()) };
        if len == 0 || first_held(&s.local) <= lp.need_from(len) {
            return Ok(());
        }
        let page = lp.pool.page_tokens();
        bail!(
            InvalidArgument,
            "{call}the stream's sliding-window layers keep positions from {} on (a window of {} tokens); its first {len} positions would need them from {}",
            first_held(&s.local) * page,
            lp.layers.window,
            lp.need_from(len) * page
        );
    }

    /// The parent key of a stream's page `i` in the prefix cache.
    pub(super) fn parent_key(keys: &[u64], i: usize) -> u64 {
        if i == 0 { ROOT } else { keys[i - 1] }
    }
}

impl<B: Backend> Streams<B> {
    /// `audit` of the local layers' pool: each stream's local list as long as its page list, its
    /// released entries a prefix holding none its length needs, and the pool's counts.
    pub(super) fn audit_local(&self) -> Result<()> {
        let Some(lp) = self.local.as_ref() else { return Ok(()) };
        for (i, s) in self.slots.iter().enumerate() {
            let Some(s) = s else { continue };
            let first = first_held(&s.local);
            if s.local.len() != s.pages.len() || s.local[first..].contains(&NO_PAGE) {
                bail!(
                    InvalidArgument,
                    "stream {i}: {} local pages for {} pages, the first held {first}",
                    s.local.len(),
                    s.pages.len()
                );
            }
            if s.len > 0 && first > lp.need_from(s.len) {
                bail!(InvalidArgument, "stream {i}: {} positions, local pages held from {first}", s.len);
            }
        }
        let held: Vec<Vec<u32>> =
            self.slots.iter().flatten().map(|s| s.local.iter().copied().filter(|&p| p != NO_PAGE).collect()).collect();
        lp.pool
            .audit(held.iter().map(Vec::as_slice))
            .map_err(|why| crate::err!(InvalidArgument, "the local layers' KV pool: {why}"))
    }
}

impl<B: Backend> Streams<B> {
    /// With a local layers' pool, steps all but the last piece of an item of `tokens` on `stream` ahead
    /// in pieces of `LocalLayers::piece`, each a backend call of its own (the prefix cache taking what it
    /// holds), the local pages its window leaves given back after each, so that a long prompt never
    /// holds more local pages than the window's reach and a piece. Returns how many tokens ran ahead
    /// (their tokens appended, the stream's kept logits gone). None run for a constrained stream, an
    /// item the window or the main pool has no room for (its admission then refuses it whole), or one
    /// of a piece or less. Err only when the backend failed a piece: the pieces before it stay.
    pub(super) fn step_ahead(&mut self, stream: u32, tokens: &[u32]) -> Result<usize> {
        let Some(piece) = self.local.as_ref().map(|lp| lp.layers.piece.max(1)) else { return Ok(0) };
        let slot = self.slot(stream, "")?;
        let len = self.slots[slot].as_ref().map_or(0, |s| s.len);
        if tokens.len() <= piece || self.constraints[slot].is_some() || tokens.len() > self.window.saturating_sub(len) {
            return Ok(0);
        }
        // Room for every piece in the main pool (a page more for a copy of a shared last page).
        let held = self.slots[slot].as_ref().map_or(0, |s| s.pages.len());
        if self.pool.pages_for(len + tokens.len()).saturating_sub(held) + 1 > self.pool.free_pages() {
            return Ok(0);
        }
        let ahead = (tokens.len() - 1) / piece * piece;
        let mut done = 0;
        while done < ahead {
            let part = &tokens[done..done + piece];
            let Ok(a) = self.admit(stream, None, part, part.len()) else { break };
            self.last.clear();
            let Streams { backend, slots, .. } = &mut *self;
            let s = slots[slot].as_mut().expect("admitted");
            let mut item = [StepItem::new(s, stream, &part[a.skip..], Sampling::GREEDY)];
            let ran = backend.step_batch(&mut item);
            let next = std::mem::replace(&mut item[0].next, Ok(0));
            if let Err(e) = ran.and(next) {
                self.restore(&a);
                return Err(e);
            }
            let s = self.slots[slot].as_mut().expect("admitted");
            s.tokens.extend_from_slice(&part[a.skip..]);
            self.reuse[slot].0 += a.skip as u64;
            self.reuse[slot].1 += (piece - a.skip) as u64;
            self.enter_pages(slot);
            self.trim_pages(slot);
            done += piece;
        }
        Ok(done)
    }
}

impl<B: Backend> Streams<B> {
    /// `score`'s appending of `run` (the tokens, after the stream's last token again when `start` is
    /// one before its length) on stream slot `slot`, through its constraint (fed `tokens` at the
    /// stream's length), and the backend's log-probabilities of each next token (the last NaN). With a
    /// local layers' pool, in pieces of `LocalLayers::piece` (the main pool's room checked for all of
    /// them first), each piece's last log-probability from the logits it kept. Refused, appending
    /// nothing, where the first piece is; a backend failure in a later piece leaves those before it.
    pub(super) fn score_run(
        &mut self,
        stream: u32,
        slot: usize,
        start: usize,
        run: &[u32],
        tokens: &[u32],
    ) -> Result<Vec<f32>> {
        let len = self.slots[slot].as_ref().map_or(0, |s| s.len);
        let piece = self.local.as_ref().map_or(run.len(), |lp| lp.layers.piece.max(1));
        if run.len() > piece {
            let s = self.slots[slot].as_ref();
            let held = s.map_or(0, |s| s.pages.len());
            let page = self.pool.page_tokens();
            let shared = s.and_then(|s| s.pages.get(start / page)).is_some_and(|&p| self.pool.refs(p) > 1);
            let need = self.pool.pages_for(start + run.len()).saturating_sub(held) + shared as usize;
            if need > self.pool.free_pages() {
                bail!(
                    NoRoom,
                    "stream {stream}: {} tokens after {len} need {need} more KV pages of {page} tokens; {} of {} are free",
                    tokens.len(),
                    self.pool.free_pages(),
                    self.pool.total_pages()
                );
            }
        }
        let mut scored = vec![f32::NAN; run.len()];
        let mut done = 0;
        while done < run.len() {
            let part = &run[done..(done + piece).min(run.len())];
            let a = self.admit(stream, (done == 0).then_some(start), part, 0)?;
            // The tokens go through the stream's constraint as a step's would (one it refuses fails the call).
            if done == 0
                && let Err(e) = self.feed_constraint(slot, len, tokens)
            {
                self.restore(&a);
                return Err(e);
            }
            let s = self.slots[slot].as_mut().expect("admitted");
            let mut scored_part = self.backend.score(s, part, &mut scored[done..done + part.len()]);
            let s = self.slots[slot].as_mut().expect("admitted");
            s.tokens.extend_from_slice(part);
            done += part.len();
            if scored_part.is_ok() && done < run.len() {
                // The next piece's first token after the logits this one kept.
                scored_part = self.backend.logits(0, 0).map(|logits| scored[done - 1] = log_prob(&logits, run[done]));
            }
            if let Err(e) = scored_part {
                let s = self.slots[slot].as_mut().expect("admitted");
                if s.len > a.len {
                    self.backend.truncate(s, a.len);
                }
                self.restore(&a);
                if let Some(c) = self.constraints[slot].as_mut() {
                    c.rollback(self.slots[slot].as_ref().map_or(0, |s| s.len));
                }
                // The backend may have dropped what it kept.
                self.last.clear();
                return Err(e);
            }
            self.enter_pages(slot);
            self.trim_local(slot);
        }
        Ok(scored)
    }
}
