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
use crate::backend::{Backend, KvStream, LocalLayers, NO_PAGE, PagePool, ROOT};
use crate::bail;
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

    /// Enters stream `s`'s local page `i` under the key its main page `i` has (`parent`, `tokens`).
    pub(super) fn enter_local(&mut self, local: u32, parent: u64, tokens: &[u32]) {
        if let Some(lp) = self.local.as_mut().filter(|lp| lp.pool.caching() && local != NO_PAGE) {
            lp.pool.enter(local, parent, tokens);
        }
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
