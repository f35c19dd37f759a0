//! A stream's positions and the KV pool (truncate, fork, reset, usage), scoring, and the logits a
//! step left; the model's figures.

use super::handle::{engine, handle};
use super::{arg_mut, guard};
use crate::abi::{engine_kv_usage, engine_model_info};
use crate::status::{Result, engine_status};

/// Keeps the first `len` positions of stream `stream` and gives the KV pages past them back to the
/// pool; stepping the same tokens again in the same pieces gives the same logits, bit for bit (on CUDA, a
/// prompt chunk the cut falls inside, stepped again as a shorter chunk, may take another product route:
/// within 2e-3 relative L2; so may a prompt that takes the prefix cache's pages for its first whole pages,
/// see `engine_options.prefix_cache`). OUT_OF_RANGE when `len` is more than the stream holds or the stream
/// does not exist. INVALID_ARGUMENT, changing nothing, for a model whose sliding-window layers keep only
/// their window (Gemma 3 on the CPU backend) when `len` is further back than the positions they still
/// hold: a step keeps them from the stream's new length less the window and a margin of at least 32
/// positions (a fork holds its source's). The stream's logits are dropped when it loses positions.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_truncate(e: *mut engine, stream: u32, len: u32) -> engine_status {
    // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
    guard("engine_truncate", || unsafe { handle(e) }?.lock().truncate(stream, len as usize))
}

/// Tokens stream `stream` holds now, into `*len`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_stream_len(e: *const engine, stream: u32, len: *mut u32) -> engine_status {
    guard("engine_stream_len", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        // SAFETY: `len` is NULL (refused) or points to a writable u32 (the header's contract).
        let len = unsafe { arg_mut(len, "len") }?;
        // At most the window, which fits u32.
        *len = e.lock().stream_len(stream)? as u32;
        Ok(())
    })
}

/// The KV pool: positions it holds in all, and positions free (whole pages no stream holds, those the
/// prefix cache keeps included: a step takes them when it needs room), into the two outputs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_kv_stats(
    e: *const engine,
    tokens_total: *mut u64,
    tokens_free: *mut u64,
) -> engine_status {
    guard("engine_kv_stats", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        // SAFETY: `tokens_total` is NULL (refused) or points to a writable u64 (the header's contract).
        let total = unsafe { arg_mut(tokens_total, "tokens_total") }?;
        // SAFETY: `tokens_free` is NULL (refused) or points to a writable u64, not the same one (the header's contract).
        let free = unsafe { arg_mut(tokens_free, "tokens_free") }?;
        (*total, *free) = e.lock().kv_stats();
        Ok(())
    })
}

/// The KV pool's positions by state into `*out`: in all, free (as `engine_kv_stats`), held by more than
/// one stream, and kept by the prefix cache with no stream holding them (counted free too). Whole pages,
/// each counted once however many streams hold it, so the positions streams hold are `tokens_total -
/// tokens_free`. Where a model's sliding-window layers keep only their window in a pool of their own
/// (Gemma 3 on the CPU backend), every figure is the two pools' positions added.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_kv_usage(e: *const engine, out: *mut engine_kv_usage) -> engine_status {
    guard("engine_kv_usage", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        // SAFETY: `out` is NULL (refused) or points to a writable engine_kv_usage (the header's contract).
        let out = unsafe { arg_mut(out, "out") }?;
        *out = e.lock().kv_usage();
        Ok(())
    })
}

/// Stream `dst` is reset, then holds the first `len` positions of stream `src` (tokens and KV), sharing
/// `src`'s KV pages: no position is computed or copied, and each stream goes on on its own (the first
/// write into a page the other holds copies that page). `dst` keeps its own sampler settings and has
/// no logits until it is stepped. No page is taken: a step that writes into a shared page takes one
/// for the copy (NO_ROOM for that step when none is free). INVALID_ARGUMENT for `src == dst`, and for
/// `len` further back than `src`'s sliding-window layers still hold (as `engine_truncate`); OUT_OF_RANGE
/// for a stream the engine does not have or `len` past `src`'s length. A refused call changes nothing.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_fork(e: *mut engine, src: u32, dst: u32, len: u32) -> engine_status {
    // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
    guard("engine_fork", || unsafe { handle(e) }?.lock().fork(src, dst, len as usize))
}

/// Appends `n` tokens to stream `stream` as `engine_step` would (its KV, its history for the repetition
/// penalty; no token is sampled) and writes `logprobs[i]` = log p(tokens[i] | every token before it):
/// the float64 log-softmax of the logits after the position before, as `engine_top_logprobs` reports
/// them. `logprobs[0]` is NaN when the stream was empty; otherwise it comes from the stream's kept
/// logits, or, when none are kept, from its last position computed again with the tokens. The tokens run
/// as a prompt does (in chunks, the logits of every position computed), not one step a token; afterwards
/// `engine_logits` gives the logits after the last of them. NO_ROOM past the window (checked before any
/// id is read) or when the KV pool has no free page; OUT_OF_RANGE for an id outside the vocabulary or a
/// stream the engine does not have; INVALID_ARGUMENT for NULLs or `n` 0. A refused call changes nothing.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_score(
    e: *mut engine,
    stream: u32,
    tokens: *const i32,
    n: usize,
    logprobs: *mut f32,
) -> engine_status {
    guard("engine_score", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        if tokens.is_null() || logprobs.is_null() {
            crate::bail!(InvalidArgument, "tokens or logprobs is NULL");
        }
        let mut state = e.lock();
        // A wrong `n` must be refused before it is used to read the caller's buffers.
        let (len, window) = (state.stream_len(stream)?, state.window());
        if n > window.saturating_sub(len) {
            crate::bail!(NoRoom, "engine_score: {n} tokens after {len} do not fit the stream's window of {window}");
        }
        if n == 0 {
            crate::bail!(InvalidArgument, "engine_score: no tokens");
        }
        // SAFETY: the caller promises `tokens` holds `n` ids, and `n` is at most the window.
        let tokens = unsafe { std::slice::from_raw_parts(tokens, n) };
        let mut out = vec![f32::NAN; n];
        state.score(stream, tokens, &mut out)?;
        // SAFETY: the caller promises `logprobs` holds `n` floats; `out` is a separate Rust buffer of `n`.
        unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), logprobs, n) };
        Ok(())
    })
}

/// The KV pool pages stream `stream` holds, in position order, and the pool's own check of its page
/// counts against every stream's (for tests; not part of the C API).
#[doc(hidden)]
pub unsafe fn debug_kv_pages(e: *const engine, stream: u32) -> Result<(Vec<u32>, Result<()>)> {
    // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
    let e = unsafe { handle(e) }?;
    let state = e.lock();
    Ok((state.stream_pages(stream)?, state.audit_pages()))
}

/// Copies the logits of the last position of stream `stream` into `out` (`len` must be at least the
/// vocabulary). Logits are kept for every stream the last step or batch that stepped anything stepped:
/// with several threads stepping, another call's step in between makes this INVALID_ARGUMENT.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_logits(e: *const engine, stream: u32, out: *mut f32, len: usize) -> engine_status {
    guard("engine_logits", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        if out.is_null() {
            crate::bail!(InvalidArgument, "out is NULL");
        }
        let vocab = e.info.vocab as usize;
        if len < vocab {
            crate::bail!(InvalidArgument, "out holds {len} floats; the vocabulary is {vocab}");
        }
        let logits = e.lock().logits(stream)?;
        // SAFETY: `out` holds `len` >= vocab floats (the caller's promise), and `logits` holds vocab.
        unsafe { std::ptr::copy_nonoverlapping(logits.as_ptr(), out, vocab) };
        Ok(())
    })
}

/// The `k` most likely next tokens after stream `stream`'s last step, most likely first (a tie to the
/// lower id), in `ids[0..k)`, with their log-probabilities in `logprobs[0..k)`: the log-softmax of
/// `engine_logits` in double precision, before the sampling transforms (temperature, penalties, cuts),
/// as OpenAI's `top_logprobs` reports them. `k` may be 0 (the arrays may then be NULL); past the
/// vocabulary it is INVALID_ARGUMENT. Available when `engine_logits` is; logits with a NaN are
/// BAD_MODEL (no distribution to report).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_top_logprobs(
    e: *const engine,
    stream: u32,
    k: usize,
    ids: *mut i32,
    logprobs: *mut f32,
) -> engine_status {
    guard("engine_top_logprobs", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        let vocab = e.info.vocab as usize;
        if k > vocab {
            crate::bail!(InvalidArgument, "k is {k}; the vocabulary is {vocab}");
        }
        if k > 0 && (ids.is_null() || logprobs.is_null()) {
            crate::bail!(InvalidArgument, "ids or logprobs is NULL with k {k}");
        }
        let logits = e.lock().logits(stream)?;
        let Some(top) = crate::sampler::top_logprobs(&logits, k) else {
            crate::bail!(BadModel, "stream {stream}'s logits hold a NaN or no finite value: no distribution");
        };
        if k == 0 {
            return Ok(());
        }
        // SAFETY: the caller promises `ids` and `logprobs` hold `k` values each (neither NULL, checked).
        let (ids, logprobs) =
            unsafe { (std::slice::from_raw_parts_mut(ids, k), std::slice::from_raw_parts_mut(logprobs, k)) };
        for ((id, lp), (token, value)) in ids.iter_mut().zip(logprobs.iter_mut()).zip(top) {
            // Below the vocabulary, which fits i32 (checked at load).
            (*id, *lp) = (token as i32, value);
        }
        Ok(())
    })
}

/// Empties stream `stream` so it can take a new prompt, giving its KV pages back to the pool (with the
/// prefix cache on, its whole pages stay there for a prompt that starts the same, until a step needs
/// their room); its sampler settings stay.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_reset(e: *mut engine, stream: u32) -> engine_status {
    // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
    guard("engine_reset", || unsafe { handle(e) }?.lock().reset(stream))
}

/// The model's figures and the engine's window and streams; runs beside steps without waiting.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_model_info(e: *const engine, out: *mut engine_model_info) -> engine_status {
    guard("engine_model_info", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        // SAFETY: `out` is NULL (refused) or points to a writable engine_model_info (the header's contract).
        *unsafe { arg_mut(out, "out") }? = e.info;
        Ok(())
    })
}
