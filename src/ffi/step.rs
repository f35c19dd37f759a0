//! Steps, one stream or a batch, and each stream's speculation and prefix-cache counts.

use super::handle::{engine, handle};
use super::{arg_mut, guard};
use crate::abi::{engine_batch_item, engine_draft, engine_speculation};
use crate::status::{self, Error, Status, engine_status};

/// Appends `n` tokens (a prompt, or the last sampled token) to stream `stream` and writes the token the
/// stream's sampler picks next to `*next` (its `engine_sampling`, the options' unless
/// `engine_set_sampling` changed it; the draw depends on (seed, stream, position) only): a batch of one
/// item. OUT_OF_RANGE for an id outside the vocabulary or a stream the engine does not have, NO_ROOM past
/// the window (checked before any id is read) or when the KV pool has no free page for it; either way
/// nothing is appended. Steps of one engine are serialized: threads may step different streams of it at
/// once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_step(
    e: *mut engine,
    stream: u32,
    tokens: *const i32,
    n: usize,
    next: *mut i32,
) -> engine_status {
    guard("engine_step", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        // SAFETY: `next` is NULL (refused) or points to a writable i32 (the header's contract).
        let next = unsafe { arg_mut(next, "next") }?;
        if tokens.is_null() {
            crate::bail!(InvalidArgument, "tokens is NULL");
        }
        let mut item = engine_batch_item {
            stream,
            tokens,
            n,
            next: -1,
            status: Status::InvalidArgument,
            out: std::ptr::null_mut(),
            out_cap: 0,
            n_out: 0,
        };
        // SAFETY: the caller promises `tokens` holds `n` ids; the engine reads them only once `n` fits the
        // stream's room.
        let failed = unsafe { e.lock().step_batch(std::slice::from_mut(&mut item)) };
        let with_name = |e: Error| Error::new(e.status, format!("engine_step: {}", e.message));
        if let Some((_, e)) = failed.map_err(with_name)? {
            return Err(with_name(e));
        }
        *next = item.next;
        Ok(())
    })
}

/// Steps several streams at once: each item appends its `n` tokens (a prompt, a chunk of one, or the
/// last sampled token) to its stream and gets the token that stream's sampler picks next in `next`,
/// with its own status in `status` (a failed item appends nothing and gets `next` -1; the others
/// proceed). Items may mix prompt chunks and single tokens. Per item: OUT_OF_RANGE for a stream that
/// does not exist or an id outside the vocabulary, NO_ROOM past the window (checked before its tokens
/// are read) or when the KV pool has no free page for it, INVALID_ARGUMENT for `n` 0. The call returns
/// INVALID_ARGUMENT, stepping nothing, only when it is malformed: `e` NULL, `items` NULL with
/// `n_items` > 0, an item's `tokens` NULL with `n` > 0, a stream named twice, an item's `out` given
/// with `out_cap` below its stream's `max_tokens` + 1 while the stream speculates; otherwise OK (or the
/// device's failure). A stream's tokens and logits are the same whether it steps alone or in a batch.
///
/// Speculation (`engine_set_speculation`): an item with `out` and `out_cap` given may produce several
/// tokens: its stream's proposals are verified in the same forward as the batch's other items, and
/// `out` receives the accepted ones and then the target's own token (`n_out` of them, the last equal to
/// `next`); the stream holds the item's tokens and the accepted proposals. The tokens are those stepping
/// one token at a time would produce; `engine_logits` gives the logits after the last position kept.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_step_batch(
    e: *mut engine,
    items: *mut engine_batch_item,
    n_items: usize,
) -> engine_status {
    guard("engine_step_batch", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        if n_items == 0 {
            return Ok(());
        }
        if items.is_null() {
            crate::bail!(InvalidArgument, "items is NULL with n_items {n_items}");
        }
        if n_items > isize::MAX as usize / std::mem::size_of::<engine_batch_item>() {
            crate::bail!(InvalidArgument, "n_items {n_items} overflows the address space");
        }
        // SAFETY: the caller promises `items` holds `n_items` items, which this call may write.
        let items = unsafe { std::slice::from_raw_parts_mut(items, n_items) };
        // SAFETY: the header's contract for each item's `tokens` and `out`, which `Engine::step_batch` takes.
        let failed = unsafe { e.lock().step_batch(items) }
            .map_err(|err| Error::new(err.status, format!("engine_step_batch: {}", err.message)))?;
        if let Some((k, err)) = failed {
            status::set_last_error(&format!("engine_step_batch: items[{k}]: {}", err.message));
        }
        Ok(())
    })
}

/// Speculation off (`ENGINE_DRAFT_NONE`), with the settings prompt lookup starts from when `draft` is
/// set: max_tokens 8, ngram_min 2, ngram_max 4.
#[unsafe(no_mangle)]
pub extern "C" fn engine_default_speculation() -> engine_speculation {
    crate::speculative::DEFAULT
}

/// Sets stream `stream`'s speculative decoding from its next step on, and starts its counts again.
/// A step proposes only for an item given `out` (see `engine_step_batch`). INVALID_ARGUMENT for NULL,
/// a `draft` that names no `engine_draft`, `max_tokens` outside 1..=ENGINE_SPECULATION_MAX_TOKENS or
/// NGRAM lengths with `ngram_min` 0 or above `ngram_max` (while `draft` is not NONE); UNSUPPORTED for
/// `ENGINE_DRAFT_MODEL` on an engine that loaded no drafter (`engine_options.draft_model`); OUT_OF_RANGE
/// for a stream the engine does not have.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_set_speculation(
    e: *mut engine,
    stream: u32,
    s: *const engine_speculation,
) -> engine_status {
    guard("engine_set_speculation", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        if s.is_null() {
            crate::bail!(InvalidArgument, "speculation is NULL");
        }
        // SAFETY: `s` is non-NULL (checked) and points to an engine_speculation; `draft` is its first field, a u32.
        let draft = unsafe { std::ptr::read_unaligned(s as *const u32) };
        if engine_draft::from_raw(draft).is_none() {
            crate::bail!(InvalidArgument, "speculation->draft is {draft}, not an engine_draft");
        }
        // SAFETY: `s` points to an engine_speculation whose enum field was checked above.
        let s = unsafe { std::ptr::read(s) };
        e.lock().set_speculation(stream, &s)
    })
}

/// Tokens stream `stream` proposed and tokens verification accepted since its speculation was last set
/// (either pointer may be NULL). OUT_OF_RANGE for a stream the engine does not have.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_speculation_stats(
    e: *const engine,
    stream: u32,
    proposed: *mut u64,
    accepted: *mut u64,
) -> engine_status {
    guard("engine_speculation_stats", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        let counts = e.lock().speculation_stats(stream)?;
        // SAFETY: each pointer is NULL or points to a writable u64 (the header's contract).
        unsafe { write_pair(counts, proposed, accepted) };
        Ok(())
    })
}

/// Of the tokens stream `stream` was given by steps and `engine_score` since it was last reset
/// (`engine_reset`, or `engine_fork` onto it): those whose positions the prefix cache gave (whole KV pages
/// a step had computed before, `engine_options.prefix_cache`) into `*cached`, and those computed into
/// `*computed` (either pointer may be NULL). Proposals of speculative decoding are not counted
/// (`engine_speculation_stats` counts them). OUT_OF_RANGE for a stream the engine does not have.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_prefix_stats(
    e: *const engine,
    stream: u32,
    cached: *mut u64,
    computed: *mut u64,
) -> engine_status {
    guard("engine_prefix_stats", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        let counts = e.lock().prefix_stats(stream)?;
        // SAFETY: each pointer is NULL or points to a writable u64 (the header's contract).
        unsafe { write_pair(counts, cached, computed) };
        Ok(())
    })
}

/// Writes a pair of counts to the caller's two outputs, skipping a NULL one.
///
/// # Safety
/// Each pointer is NULL or points to a writable u64.
unsafe fn write_pair((a, b): (u64, u64), out_a: *mut u64, out_b: *mut u64) {
    // SAFETY: the caller's contract above.
    unsafe {
        if let Some(out) = out_a.as_mut() {
            *out = a;
        }
        if let Some(out) = out_b.as_mut() {
            *out = b;
        }
    }
}
