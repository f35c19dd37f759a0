//! A step: the caller's batch items checked once for every layer below, stepped, and their outcomes
//! written back; `step` and `step_tokens` are a batch of one.

use super::{Engine, engine_batch_item, engine_draft};
use crate::backend::{Batch, BatchItem};
use crate::status::{Result, Status};

impl Engine {
    /// Appends `tokens` to stream `stream` and returns the token its sampler picks next: a batch of one.
    pub fn step(&mut self, stream: u32, tokens: &[i32]) -> Result<u32> {
        let out = self.step_tokens(stream, tokens, 1)?;
        Ok(*out.last().expect("a stepped item produced its next token"))
    }

    /// Appends `tokens` to stream `stream`, letting its speculation produce up to `most` tokens, and
    /// returns every token the step produced (the last is the one sampled next): a batch of one.
    pub fn step_tokens(&mut self, stream: u32, tokens: &[i32], most: usize) -> Result<Vec<u32>> {
        let mut out = vec![0i32; most];
        let mut item = engine_batch_item {
            stream,
            tokens: tokens.as_ptr(),
            n: tokens.len(),
            next: -1,
            status: Status::InvalidArgument,
            out: if most > 1 { out.as_mut_ptr() } else { std::ptr::null_mut() },
            out_cap: if most > 1 { most } else { 0 },
            n_out: 0,
        };
        // SAFETY: the item's `tokens` are `tokens`, every id readable, and its `out`, when given, is `out`
        // of `out_cap` ints; both outlive the call.
        if let Some((_, e)) = unsafe { self.step_batch(std::slice::from_mut(&mut item)) }? {
            return Err(e);
        }
        if item.out.is_null() {
            return Ok(vec![item.next as u32]);
        }
        Ok(out[..item.n_out].iter().map(|&t| t as u32).collect())
    }

    /// Steps the caller's items at once, each with its outcome written into it: `status`, `next` (-1
    /// when it failed; a failed item appends nothing), and the tokens its step produced in `out` and
    /// `n_out`. This is where a batch is checked, once, for every layer below: the call is refused
    /// (INVALID_ARGUMENT, nothing stepped, every item INVALID_ARGUMENT) for an item's `tokens` NULL with
    /// `n` > 0, a stream named twice, or an `out` with `out_cap` below its stream's `max_tokens` + 1
    /// while the stream speculates; an item fails alone (OUT_OF_RANGE) for a stream the engine does not
    /// have or an id outside the vocabulary, or (NO_ROOM) for `n` past its stream's room, which is
    /// checked before its tokens are read. Ok holds the first failed item (its index and why) for the
    /// caller's last error; another Err only when the device failed (the items say which were stepped).
    ///
    /// # Safety
    /// Each item's `tokens` is NULL or holds `n` ids (where `n` fits its stream's room: a larger `n` is
    /// refused before they are read), and its `out` is NULL or holds `out_cap` writable ints.
    pub unsafe fn step_batch(&mut self, items: &mut [engine_batch_item]) -> Result<Option<(usize, crate::Error)>> {
        for item in items.iter_mut() {
            item.next = -1;
            item.status = Status::InvalidArgument;
            item.n_out = 0;
        }
        if let Some(k) = items.iter().position(|i| i.tokens.is_null() && i.n > 0) {
            crate::bail!(InvalidArgument, "items[{k}].tokens is NULL with n {}", items[k].n);
        }
        // Room for a speculating stream's every token, checked before anything is stepped.
        for (k, item) in items.iter().enumerate() {
            if item.out.is_null() || item.out_cap == 0 {
                continue;
            }
            let Ok(spec) = self.backend.speculation(item.stream) else { continue };
            if spec.draft != engine_draft::None && item.out_cap < spec.max_tokens as usize + 1 {
                crate::bail!(
                    InvalidArgument,
                    "items[{k}].out_cap is {}; stream {} may produce max_tokens + 1 = {}",
                    item.out_cap,
                    item.stream,
                    spec.max_tokens as usize + 1
                );
            }
        }
        let checked = items
            .iter()
            .map(|item| {
                // SAFETY: this function's contract, passed on.
                match unsafe { self.checked_tokens(item) } {
                    Ok(tokens) => {
                        let most = if item.out.is_null() { 1 } else { item.out_cap };
                        BatchItem::new(item.stream, tokens).with_most(most)
                    }
                    Err(e) => BatchItem::refused(item.stream, e),
                }
            })
            .collect();
        let mut batch = Batch::new(checked)?;
        let ran = self.backend.step_batch(&mut batch);
        let mut first_error = None;
        for (k, (item, stepped)) in items.iter_mut().zip(batch.into_items()).enumerate() {
            match stepped.next {
                Ok(t) => {
                    item.next = t as i32;
                    item.status = Status::Ok;
                    item.n_out = stepped.out.len();
                    if !item.out.is_null() && item.out_cap > 0 {
                        // `most` was out_cap, so the step produced at most that many.
                        debug_assert!(stepped.out.len() <= item.out_cap);
                        let n = stepped.out.len().min(item.out_cap);
                        // SAFETY: the contract: `out` holds `out_cap` ints, and `n` is at most `out_cap`.
                        let out = unsafe { std::slice::from_raw_parts_mut(item.out, n) };
                        for (o, &t) in out.iter_mut().zip(&stepped.out) {
                            *o = t as i32;
                        }
                    }
                }
                Err(e) => {
                    item.status = e.status;
                    first_error.get_or_insert((k, e));
                }
            }
        }
        ran?;
        Ok(first_error)
    }

    /// An item's ids as the backends take them: its stream exists, its `n` fits the stream's room
    /// (checked before its tokens are read), and every id is in the vocabulary.
    ///
    /// # Safety
    /// As `step_batch`'s: `item.tokens` holds `item.n` ids when `n` fits the stream's room, alive and
    /// unchanged for `'t` (the call that steps them).
    unsafe fn checked_tokens<'t>(&self, item: &engine_batch_item) -> Result<&'t [u32]> {
        let len = self.backend.stream_len(item.stream)?;
        let window = self.backend.window();
        if item.n > window.saturating_sub(len) {
            crate::bail!(
                NoRoom,
                "stream {}: {} tokens after {len} do not fit the stream's window of {window}",
                item.stream,
                item.n
            );
        }
        if item.n == 0 {
            return Ok(&[]);
        }
        // SAFETY: the contract: `tokens` holds `n` ids, and `n` fits the stream's room.
        let ids = unsafe { std::slice::from_raw_parts(item.tokens, item.n) };
        let vocab = self.ckpt.config.vocab;
        if let Some((i, t)) = ids.iter().enumerate().find(|(_, t)| **t < 0 || **t as usize >= vocab) {
            crate::bail!(OutOfRange, "token {i} is id {t}, outside the vocabulary (0..{vocab})");
        }
        // SAFETY: i32 and u32 have one size and alignment, and every id was just found non-negative, so
        // each reads as the same number.
        Ok(unsafe { std::slice::from_raw_parts(ids.as_ptr().cast::<u32>(), ids.len()) })
    }
}
