//! `Streams`: the engine's stream slots over one backend and one page pool, each slot's sampler
//! settings, constraint and speculation, and the pool's accounting around every batch (the module doc
//! of `backend` says how pages are taken, shared, copied and cached).

use super::{Backend, Batch, Decoder, KvStream, NO_PAGE, PagePool, StepItem, log_prob, not_run};
use crate::abi::{engine_draft, engine_kv_usage, engine_speculation};
use crate::constraint::{Constraint, PendingMask};
use crate::sampler::Sampling;
use crate::speculative::{self, SpecState};
use crate::status::{Result, Status};
use crate::{bail, err};

mod admit;
mod local;
mod propose;

use self::local::LocalPool;

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
    /// The sliding-window layers' pool, where the backend keeps them apart (`Backend::local_layers`).
    local: Option<LocalPool>,
    /// The streams whose logits the backend holds, with their item index in its last batch and the head
    /// position of their last kept token.
    last: Vec<(u32, usize, usize)>,
    spec: Vec<SpecState>,
    /// Each stream's tokens since its last reset: those the prefix cache gave, those computed.
    reuse: Vec<(u64, u64)>,
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
        let local = backend.local_layers().map(|l| LocalPool::new(l, B::PAGE_TOKENS)).transpose()?;
        let spec = vec![SpecState::new(speculative::DEFAULT); count];
        let reuse = vec![(0, 0); count];
        Ok(Streams {
            backend,
            window,
            slots,
            sampling: settings,
            constraints,
            pool,
            local,
            last: Vec::new(),
            spec,
            reuse,
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
        if let Some(lp) = self.local.as_mut() {
            lp.pool.set_prefix_cache(on);
        }
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

    /// Enters a stream's whole pages past those it has keys for into the prefix cache.
    fn enter_pages(&mut self, slot: usize) {
        if !self.pool.caching() {
            return;
        }
        let page = self.pool.page_tokens();
        let Streams { slots, pool, local, .. } = self;
        let Some(s) = slots[slot].as_mut() else { return };
        while s.keys.len() < s.len / page {
            let i = s.keys.len();
            let parent = Self::parent_key(&s.keys, i);
            let tokens = &s.tokens[i * page..(i + 1) * page];
            let node = pool.enter(s.pages[i], parent, tokens);
            s.keys.push(node);
            // The local layers' page under the same key (its pool caches as the main one does).
            if let (Some(lp), Some(&p)) = (local.as_mut(), s.local.get(i))
                && p != NO_PAGE
            {
                lp.pool.enter(p, parent, tokens);
            }
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
        self.trim_local(slot);
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
}

impl<B: Backend> Decoder for Streams<B> {
    fn stream_count(&self) -> usize {
        self.slots.len()
    }

    fn window(&self) -> usize {
        self.window
    }

    fn step_batch(&mut self, batch: &mut Batch<'_>) -> Result<()> {
        // The batch names each stream once (`Batch::new`), so each admitted item has its stream's slot alone.
        let items = batch.items_mut();
        // Each item's run: its tokens, then what its stream proposes after them (a constrained stream
        // proposes nothing: its mask is computed for one draw).
        let mut runs: Vec<Vec<u32>> = Vec::with_capacity(items.len());
        let mut proposed = vec![0usize; items.len()];
        // Which items run, in the caller's order; the others have their status already. A constrained
        // stream's tokens go through its constraint first: one it refuses fails the item.
        let mut run = Vec::with_capacity(items.len());
        let mut all_proposals = self.propose_all(items);
        for (i, item) in items.iter_mut().enumerate() {
            if item.is_refused() {
                runs.push(Vec::new());
                continue;
            }
            item.out.clear();
            let proposals = std::mem::take(&mut all_proposals[i]);
            // A long item's first pieces run ahead where the local layers keep only their window.
            let own = match self.step_ahead(item.stream(), item.tokens) {
                Ok(ahead) => &item.tokens[ahead..],
                Err(e) => {
                    runs.push(Vec::new());
                    item.next = Err(e);
                    continue;
                }
            };
            let mut tokens = own.to_vec();
            tokens.extend_from_slice(&proposals);
            // The cache may stand for the item's own tokens only: every proposal needs its logits.
            let mut admitted = self.admit(item.stream(), None, &tokens, own.len());
            if admitted.as_ref().is_err_and(|e| e.status == Status::NoRoom) && !proposals.is_empty() {
                // No room for the proposals: the item steps as without them.
                tokens.truncate(own.len());
                admitted = self.admit(item.stream(), None, &tokens, own.len());
            }
            proposed[i] = tokens.len() - own.len();
            runs.push(tokens);
            let a = match admitted {
                Ok(a) => a,
                Err(e) => {
                    item.next = Err(e);
                    continue;
                }
            };
            match self.feed_constraint(a.slot, a.len, own) {
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
            .map(|(i, _)| constraints[items[*i].stream() as usize].as_ref().map(|_| PendingMask::new()))
            .collect();
        let mut by_slot: Vec<Option<&mut KvStream<B::Cache>>> = slots.iter_mut().map(Option::as_mut).collect();
        let mut constrained: Vec<Option<&mut Constraint>> = constraints.iter_mut().map(Option::as_mut).collect();
        // The constrained items' masks are computed on one thread beside the backend's forward (on CUDA
        // the host only queues and waits then); the sampler waits for each.
        let work: Vec<(&mut Constraint, &PendingMask)> = run
            .iter()
            .zip(&masks)
            .filter_map(|((i, _), m)| Some((constrained[items[*i].stream() as usize].take()?, m.as_ref()?)))
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
                    let stream = items[*i].stream();
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
                let reuse = &mut self.reuse[a.slot];
                reuse.0 += a.skip as u64;
                reuse.1 += (runs[*i].len() - proposed[*i] - a.skip) as u64;
                // Entered before the local pages the window left are given back, so the cache keeps them.
                self.enter_pages(a.slot);
                self.trim_pages(a.slot);
            }
            let len = self.slots[a.slot].as_ref().map_or(0, |s| s.len);
            if let Some(c) = self.constraints[a.slot].as_mut() {
                if items[*i].next.is_ok() { c.stepped(len) } else { c.rollback(len) }
            }
        }
        self.last = last;
        // The drafter's streams keep no more than the target's: rejected drafts leave them too.
        if self.drafter.is_some() {
            for item in items.iter().filter(|i| !i.is_refused()) {
                let Some(slot) = self.slots.get(item.stream() as usize) else { continue };
                let len = slot.as_ref().map_or(0, |s| s.len);
                self.cut_drafter(item.stream(), len);
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
        self.reuse[stream as usize] = (0, 0);
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
        let s = self.slots[slot].as_ref().expect("checked above");
        self.check_local_reach(s, len, &format!("stream {stream}: "))?;
        let s = self.slots[slot].as_mut().expect("checked above");
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
        if let Some(s) = self.slots[from].as_ref() {
            self.check_local_reach(s, len, &format!("engine_fork: stream {src}: "))?;
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
        let local = s.local[..s.local.len().min(pages.len())].to_vec();
        for &p in &pages {
            self.pool.hold(p);
        }
        if let Some(lp) = self.local.as_mut() {
            local.iter().filter(|&&p| p != NO_PAGE).for_each(|&p| lp.pool.hold(p));
        }
        let d = self.slots[to].as_mut().expect("made above");
        (d.pages, d.tokens, d.keys, d.local, d.len) = (pages, tokens, keys, local, len);
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
        let scored = self.score_run(stream, slot, start, &run, tokens)?;
        self.reuse[slot].1 += n as u64;
        self.last = vec![(stream, 0, 0)];
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
        let u = self.kv_usage();
        (u.tokens_total, u.tokens_free)
    }

    /// The two pools' counts added where the sliding-window layers have their own.
    fn kv_usage(&self) -> engine_kv_usage {
        let page = self.pool.page_tokens() as u64;
        let pools = std::iter::once(&self.pool).chain(self.local.as_ref().map(|lp| &lp.pool));
        let mut out = engine_kv_usage { tokens_total: 0, tokens_free: 0, tokens_shared: 0, tokens_cached: 0 };
        for pool in pools {
            let u = pool.usage();
            out.tokens_total += pool.total_pages() as u64 * page;
            out.tokens_free += u.free as u64 * page;
            out.tokens_shared += u.shared as u64 * page;
            out.tokens_cached += u.cached as u64 * page;
        }
        out
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

    fn set_proposal_limit(&mut self, stream: u32, limit: u32) -> Result<()> {
        let slot = self.slot(stream, "")?;
        self.spec[slot] = SpecState::with_limit(self.spec[slot].settings, limit);
        Ok(())
    }

    fn speculation_stats(&self, stream: u32) -> Result<(u64, u64)> {
        let s = &self.spec[self.slot(stream, "")?];
        Ok((s.proposed, s.accepted))
    }

    fn allowed_tokens(&mut self, stream: u32, vocab: usize) -> Result<Option<Vec<u32>>> {
        let slot = self.slot(stream, "")?;
        self.constraints[slot].as_mut().map(|c| c.allowed_words(vocab)).transpose()
    }

    fn prefix_stats(&self, stream: u32) -> Result<(u64, u64)> {
        Ok(self.reuse[self.slot(stream, "")?])
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
        self.pool.audit(holders).map_err(|why| err!(InvalidArgument, "the KV pool: {why}"))?;
        self.audit_local()
    }
}
