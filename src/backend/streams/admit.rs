//! Admitting an item to a batch: the pages its new positions need from the pool (the prefix cache's
//! matches first, a shared page copied before it is written), and undoing that when the backend refuses it.

use super::Streams;
use crate::backend::{Backend, ROOT};
use crate::bail;
use crate::status::Result;

/// Where `Streams::admit` put an item: what to restore when the backend refuses it.
pub(super) struct Admission {
    pub(super) slot: usize,
    /// The stream's length and its last token before the call (`start` may be one less).
    pub(super) len: usize,
    pub(super) last: Option<u32>,
    /// The item's first tokens the prefix cache gave (whole pages): the backend computes the rest.
    pub(super) skip: usize,
}

impl<B: Backend> Streams<B> {
    /// Readies `tokens` for the backend on stream `stream` from position `start` (its length, or one less
    /// to compute its last position again): the stream exists, holds the pages its new positions need,
    /// the page of its first new position is its own (copied when another stream holds it, out of the
    /// prefix cache otherwise), and with `reuse` the prefix cache's pages stand for the item's first
    /// whole pages among its first `reuse` tokens (their tokens appended). NO_ROOM past the window or the
    /// pool, with nothing changed.
    pub(super) fn admit(
        &mut self,
        stream: u32,
        start: Option<usize>,
        tokens: &[u32],
        reuse: usize,
    ) -> Result<Admission> {
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
    pub(super) fn restore(&mut self, a: &Admission) {
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
}
