//! Admitting an item to a batch: the pages its new positions need from the pool (the prefix cache's
//! matches first, a shared page copied before it is written), and undoing that when the backend refuses it.

use super::Streams;
use crate::backend::{Backend, NO_PAGE, PagePool, ROOT};
use crate::bail;
use crate::status::Result;

/// What an item ending at position `end` takes from `pool`, where its stream holds `held` pages with
/// those the prefix cache gives it (`cached`): the page it writes first when another stream holds it
/// (to copy), the pages it needs, and the pages free for it (the cache's own not counted).
fn room(
    pool: &PagePool,
    written: Option<u32>,
    end: usize,
    held: usize,
    cached: impl Iterator<Item = u32>,
) -> (Option<u32>, usize, usize) {
    let copy = written.filter(|&p| pool.refs(p) > 1);
    let need = pool.pages_for(end).saturating_sub(held) + copy.is_some() as usize;
    let from_cache = cached.filter(|&p| pool.refs(p) == 0).count();
    (copy, need, pool.free_pages() - from_cache)
}

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
        let parent = s.keys.last().copied().unwrap_or(ROOT);
        if reuse > 0 && start.is_multiple_of(page) && s.pages.len() == whole && s.keys.len() == whole {
            let mut parent = parent;
            while (matched.len() + 1) * page < reuse.min(n) {
                let at = matched.len() * page;
                let Some((node, p)) = self.pool.lookup(parent, &tokens[at..at + page]) else { break };
                matched.push((node, p));
                parent = node;
            }
        }
        // With a local layers' pool, the longest match whose local pages the window reaches are cached too.
        let mut local_matched = Vec::new();
        if let Some(lp) = self.local.as_ref() {
            while !matched.is_empty() {
                if let Some(found) = lp.matches(parent, whole, &matched, tokens) {
                    local_matched = found;
                    break;
                }
                matched.pop();
            }
        }
        let skip = matched.len() * page;
        let held = s.pages.len() + matched.len();
        // The page the first computed position lands in, where the stream holds it already.
        let at = (start + skip) / page;
        let written = s.pages.get(at).copied();
        let (copy, need, free) = room(&self.pool, written, start + n, held, matched.iter().map(|&(_, p)| p));
        if need > free {
            bail!(
                NoRoom,
                "stream {stream}: {} tokens after {len} need {need} more KV pages of {page} tokens; {free} of {} are free",
                n - (len - start),
                self.pool.total_pages()
            );
        }
        // The same of the local layers' pool.
        let local_written = s.local.get(at).copied().filter(|&p| p != NO_PAGE);
        let mut local_copy = None;
        let mut local_need = 0;
        if let Some(lp) = self.local.as_ref() {
            let cached = local_matched.iter().copied().filter(|&p| p != NO_PAGE);
            let free;
            (local_copy, local_need, free) = room(&lp.pool, local_written, start + n, held, cached);
            if local_need > free {
                bail!(
                    NoRoom,
                    "stream {stream}: {} tokens after {len} need {local_need} more pages of the sliding-window layers' KV pool; {free} of {} are free",
                    n - (len - start),
                    lp.pool.total_pages()
                );
            }
        }
        // Held before `take`, which would otherwise evict them.
        for &(_, p) in &matched {
            self.pool.hold(p);
        }
        let mut fresh = self.pool.take(need).expect("counted above");
        let mut local_fresh = Vec::new();
        if let Some(lp) = self.local.as_mut() {
            local_matched.iter().filter(|&&p| p != NO_PAGE).for_each(|&p| lp.pool.hold(p));
            local_fresh = lp.pool.take(local_need).expect("counted above");
        }
        let copied = self.copy_written(copy, &mut fresh, local_copy, &mut local_fresh);
        if let Err(e) = copied {
            self.pool.give_back(matched.iter().map(|&(_, p)| p).chain(fresh));
            if let Some(lp) = self.local.as_mut() {
                lp.pool.give_back(local_matched.iter().copied().filter(|&p| p != NO_PAGE).chain(local_fresh));
            }
            return Err(e);
        }
        let (to, local_to) = copied.expect("checked above");
        match (copy, to) {
            (Some(from), Some(to)) => {
                self.slots[slot].as_mut().expect("made above").pages[at] = to;
                self.pool.give_back([from]);
            }
            _ => written.into_iter().for_each(|p| self.pool.forget(p)),
        }
        if let Some(lp) = self.local.as_mut() {
            match (local_copy, local_to) {
                (Some(from), Some(to)) => {
                    self.slots[slot].as_mut().expect("made above").local[at] = to;
                    lp.pool.give_back([from]);
                }
                _ => local_written.into_iter().for_each(|p| lp.pool.forget(p)),
            }
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
        if self.local.is_some() {
            s.local.extend(local_matched);
            s.local.extend(local_fresh);
        }
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
        self.enter_pages(a.slot);
        self.trim_pages(a.slot);
    }

    /// Copies the page an item writes first into a page of its own where another stream holds it (in
    /// either pool): the last of `fresh` (`local_fresh`) becomes the copy. The copies' pages, or the
    /// backend's error (nothing taken out of `fresh`).
    fn copy_written(
        &mut self,
        copy: Option<u32>,
        fresh: &mut Vec<u32>,
        local_copy: Option<u32>,
        local_fresh: &mut Vec<u32>,
    ) -> Result<(Option<u32>, Option<u32>)> {
        if let Some(from) = copy {
            self.backend.copy_page(from, *fresh.last().expect("counted in need"))?;
        }
        if let Some(from) = local_copy {
            self.backend.copy_local_page(from, *local_fresh.last().expect("counted in need"))?;
        }
        Ok((copy.and_then(|_| fresh.pop()), local_copy.and_then(|_| local_fresh.pop())))
    }
}
