//! Each stream's sampler settings and constraint, and the ids its constraint allows.

use super::handle::{engine, handle};
use super::{arg_mut, arg_ref, guard, text_arg};
use crate::abi::{engine_constraint, engine_sampling};
use crate::constraint;
use crate::status::engine_status;
use std::os::raw::c_char;

/// Greedy sampling with no cut and no penalty (temperature 0, top_k 0, top_p 1, min_p 0,
/// repeat_penalty 1, repeat_last_n 64, seed 0).
#[unsafe(no_mangle)]
pub extern "C" fn engine_default_sampling() -> engine_sampling {
    crate::sampler::Sampling::GREEDY
}

/// Sets stream `stream`'s sampler from its next step on (a stream starts with the engine options'
/// settings, and keeps its own across `engine_reset`). INVALID_ARGUMENT for NULL or a setting out of its
/// range (temperature < 0, top_p outside (0, 1], min_p outside [0, 1], repeat_penalty <= 0, any NaN),
/// OUT_OF_RANGE for a stream that does not exist.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_set_sampling(e: *mut engine, stream: u32, s: *const engine_sampling) -> engine_status {
    guard("engine_set_sampling", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        // SAFETY: `s` is NULL (refused) or points to a readable engine_sampling (the header's contract).
        let s = unsafe { arg_ref(s, "sampling") }?;
        e.lock().set_sampling(stream, s)
    })
}

/// Stream `stream`'s sampler settings, into `*out`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_get_sampling(
    e: *const engine,
    stream: u32,
    out: *mut engine_sampling,
) -> engine_status {
    guard("engine_get_sampling", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        // SAFETY: `out` is NULL (refused) or points to a writable engine_sampling (the header's contract).
        let out = unsafe { arg_mut(out, "out") }?;
        *out = e.lock().sampling(stream)?;
        Ok(())
    })
}

/// Holds stream `stream`'s output to a constraint from its next step on: the token that step samples
/// and every one after it are drawn only among the tokens the constraint allows (greedy or any sampling
/// setting; min-p and top-p see the distribution renormalized over them), and once the constraint is
/// complete only end-of-generation tokens (`engine_is_eog`) are. `text` is `len` bytes of UTF-8 (no NUL
/// needed): a JSON schema for JSON_SCHEMA (local `#/...` refs; an `x-guidance` key sets llguidance's JSON
/// options, e.g. `{"whitespace_flexible": false}`), a regular expression the whole output matches for
/// REGEX, an llguidance Lark grammar for LARK; JSON (any one JSON value) and NONE (removes the
/// constraint) take none. The constraint follows its stream: tokens the stream is given from then on
/// must be ones it allows (else that step's item fails with INVALID_ARGUMENT and appends nothing),
/// `engine_truncate` and `engine_reset` roll it back with the stream, and setting another replaces it.
/// `engine_logits` and `engine_top_logprobs` still report the model's logits before the mask. The first
/// call builds the vocabulary's token trie (tens of milliseconds). INVALID_ARGUMENT, with the stream
/// unchanged, for a schema, regex or grammar llguidance refuses (its message in `engine_last_error()`),
/// a `kind` outside the enum, text that is not UTF-8, `text` NULL with `len` > 0; OUT_OF_RANGE for a
/// stream the engine does not have; UNSUPPORTED when the model has no usable tokenizer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_set_constraint(
    e: *mut engine,
    stream: u32,
    kind: engine_constraint,
    text: *const c_char,
    len: usize,
) -> engine_status {
    // Read the kind as the integer C passed before Rust treats it as an enum.
    // SAFETY: `kind` is a live repr(C) enum argument, read as the 32-bit integer C passed for it.
    let raw_kind = unsafe { std::ptr::read(&kind as *const engine_constraint as *const u32) };
    guard("engine_set_constraint", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        let kind = engine_constraint::from_raw(raw_kind)
            .ok_or_else(|| crate::err!(InvalidArgument, "kind is {raw_kind}, not an engine_constraint"))?;
        // SAFETY: `text` is NULL or holds `len` bytes (the header's contract).
        let text = unsafe { text_arg(text, len) }?;
        // The stream is checked before a compile that may take a while; the compile holds no lock.
        e.lock().stream_len(stream)?;
        let compiled = match kind {
            engine_constraint::None => {
                constraint::check_no_text(kind, text)?;
                None
            }
            _ => e.grammars()?.compile(kind, text)?,
        };
        e.lock().set_constraint(stream, compiled)
    })
}

/// The ids stream `stream`'s constraint (`engine_set_constraint`) allows as its next token, the one its
/// last step's logits draw: bit `i % 32` of `bits[i / 32]` is set when id `i` is allowed, for every id of
/// the vocabulary (`words` must be at least `(vocab + 31) / 32`; bits past the vocabulary are 0). Every
/// id's bit is set when the stream has no constraint; once the constraint is complete only the
/// end-of-generation ids' are. A caller that samples a constrained stream itself from `engine_logits`
/// draws among these, and the engine takes that token at the next step. INVALID_ARGUMENT for NULLs, too
/// few words, or a constraint llguidance fails on (its message in `engine_last_error()`); OUT_OF_RANGE
/// for a stream the engine does not have.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_allowed_tokens(
    e: *mut engine,
    stream: u32,
    bits: *mut u32,
    words: usize,
) -> engine_status {
    guard("engine_allowed_tokens", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        let vocab = e.info.vocab as usize;
        let need = vocab.div_ceil(32);
        if bits.is_null() || words < need {
            crate::bail!(
                InvalidArgument,
                "bits is NULL or holds {words} words; the vocabulary of {vocab} needs {need}"
            );
        }
        let allowed = e.lock().allowed_tokens(stream, vocab)?;
        // SAFETY: the caller promises `bits` holds `words` u32s (not NULL, checked).
        let out = unsafe { std::slice::from_raw_parts_mut(bits, words) };
        out.fill(0);
        match allowed {
            Some(mask) => out[..need].copy_from_slice(&mask),
            None => {
                out[..need].fill(u32::MAX);
                if !vocab.is_multiple_of(32) {
                    out[need - 1] = (1u32 << (vocab % 32)) - 1;
                }
            }
        }
        Ok(())
    })
}
