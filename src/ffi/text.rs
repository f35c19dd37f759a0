//! Text: tokenizing, token pieces, end-of-generation ids and the chat template, all read without the
//! engine's lock.

use super::handle::{engine, handle};
use super::{arg_mut, guard, guard_value, text_arg, write_c_string};
use crate::abi::{ENGINE_BOS_MODEL, ENGINE_BOS_NO, engine_chat_message};
use crate::status::{Error, Result, Status, engine_status};
use crate::tokenizer::{Tokenizer, chat};
use std::os::raw::c_char;

/// The engine's text tokenizer, or UNSUPPORTED saying why text cannot be used.
fn text_tokenizer(e: &engine) -> Result<&Tokenizer> {
    e.tokenizer.as_deref().ok_or_else(|| {
        Error::new(
            Status::Unsupported,
            "the model has no usable tokenizer (no tokenizer.json beside the weights, or a GGUF tokenizer other \
             than gpt2 byte-level BPE and llama SentencePiece: the load's log says which); token ids still work",
        )
    })
}

/// Tokenizes `len` bytes of UTF-8 `text` (no NUL needed) into `ids`. `add_bos`: `ENGINE_BOS_NO` (0,
/// C's false) adds nothing; `ENGINE_BOS_MODEL` adds BOS and EOS as the model says
/// (`engine_model_info.add_bos` / `add_eos`); any other value (C's true) puts the model's BOS first
/// when it has one. `*n_out` is always set to the number of ids the text needs; `ids` may
/// be NULL with `cap` 0 to ask only for that. OUT_OF_RANGE when `cap` is smaller (nothing written),
/// UNSUPPORTED when the model has no usable tokenizer, INVALID_ARGUMENT for text that is not UTF-8,
/// BAD_MODEL when the model's tokenizer fails on the text. Runs beside steps without waiting.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_tokenize(
    e: *const engine,
    text: *const c_char,
    len: usize,
    add_bos: i32,
    ids: *mut i32,
    cap: usize,
    n_out: *mut usize,
) -> engine_status {
    guard("engine_tokenize", || {
        // SAFETY: `n_out` is NULL (refused) or points to a writable size_t (the header's contract).
        let n_out = unsafe { arg_mut(n_out, "n_out") }?;
        *n_out = 0;
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        // SAFETY: `text` is NULL or holds `len` bytes (the header's contract).
        let text = unsafe { text_arg(text, len) }?;
        let tokenizer = text_tokenizer(e)?;
        let (bos, eos) = match add_bos {
            ENGINE_BOS_NO => (None, None),
            ENGINE_BOS_MODEL => (e.text.bos.filter(|_| e.text.add_bos), e.text.eos.filter(|_| e.text.add_eos)),
            _ => (e.text.bos, None),
        };
        let mut tokens = tokenizer.encode(text, bos)?;
        tokens.extend(eos);
        let vocab = e.info.vocab as usize;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            crate::bail!(OutOfRange, "the tokenizer gave id {bad}, outside the model's vocabulary (0..{vocab})");
        }
        *n_out = tokens.len();
        if ids.is_null() {
            if cap == 0 {
                return Ok(());
            }
            crate::bail!(InvalidArgument, "ids is NULL with cap {cap}");
        }
        if tokens.len() > cap {
            crate::bail!(OutOfRange, "the text needs {} ids, ids holds {cap}", tokens.len());
        }
        // SAFETY: `ids` is non-NULL (checked) and holds `cap >= tokens.len()` ids (the header's contract).
        let out = unsafe { std::slice::from_raw_parts_mut(ids, tokens.len()) };
        for (slot, &token) in out.iter_mut().zip(&tokens) {
            // Below the model's vocabulary, which fits i32 (checked at load).
            *slot = token as i32;
        }
        Ok(())
    })
}

/// The bytes token `id` adds to the text, written into `buf` like snprintf (at most `len - 1` bytes, then
/// a NUL); returns the piece's length. Use that length rather than strlen: a piece may hold a NUL byte,
/// and a byte-level piece may be part of a UTF-8 character. An id of the model that the tokenizer lacks
/// (padding rows) is an empty piece. On failure a negative status: -OUT_OF_RANGE for an id outside the
/// vocabulary, -UNSUPPORTED when the model has no usable tokenizer, -INVALID_ARGUMENT for NULLs. Runs
/// beside steps without waiting.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_token_piece(e: *const engine, id: i32, buf: *mut c_char, len: usize) -> i32 {
    if !buf.is_null() && len > 0 {
        // SAFETY: `buf` is non-NULL (checked) and holds `len > 0` bytes (the header's contract).
        unsafe { *buf = 0 };
    }
    let mut need = 0i32;
    let status = guard("engine_token_piece", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        if buf.is_null() && len > 0 {
            crate::bail!(InvalidArgument, "buf is NULL with len {len}");
        }
        let vocab = e.info.vocab as usize;
        if id < 0 || id as usize >= vocab {
            crate::bail!(OutOfRange, "token id {id} outside the vocabulary (0..{vocab})");
        }
        let tokenizer = text_tokenizer(e)?;
        let piece: &[u8] = if (id as usize) < tokenizer.vocab_size() { tokenizer.piece_ref(id as u32)? } else { &[] };
        need = i32::try_from(piece.len())
            .map_err(|_| crate::err!(OutOfRange, "token {id}'s piece is {} bytes", piece.len()))?;
        if len > 0 {
            let n = piece.len().min(len - 1);
            // SAFETY: `buf` is non-NULL (checked) and holds `len > n` bytes (the header's contract); `piece` is a separate Rust slice of at least `n`.
            unsafe {
                std::ptr::copy_nonoverlapping(piece.as_ptr(), buf as *mut u8, n);
                *buf.add(n) = 0;
            }
        }
        Ok(())
    });
    if status == Status::Ok { need } else { -(status as i32) }
}

/// Whether `id` ends a generation: the model's EOS, its end-of-turn and end-of-message ids, every token
/// whose text is a known end marker (`<|im_end|>`, `<|eot_id|>`, `<|end_of_text|>`, ...), and the eos
/// ids of generation_config.json. False for NULL or an id outside the vocabulary. Runs beside steps.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_is_eog(e: *const engine, id: i32) -> bool {
    guard_value("engine_is_eog", false, || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        Ok(u32::try_from(id).is_ok_and(|id| e.text.is_eog(id)))
    })
}

/// The end-of-generation ids (as `engine_is_eog` tests them), ascending, into `out`. `*n` is always set
/// to their number; `out` may be NULL with `cap` 0 to ask only for that; OUT_OF_RANGE when `cap` is
/// smaller (nothing written). Runs beside steps without waiting.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_eog_ids(e: *const engine, out: *mut i32, cap: usize, n: *mut usize) -> engine_status {
    guard("engine_eog_ids", || {
        // SAFETY: `n` is NULL (refused) or points at a size_t the caller owns.
        let n = unsafe { arg_mut(n, "n") }?;
        *n = 0;
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        let ids = &e.text.eog;
        *n = ids.len();
        if out.is_null() {
            if cap == 0 {
                return Ok(());
            }
            crate::bail!(InvalidArgument, "out is NULL with cap {cap}");
        }
        if ids.len() > cap {
            crate::bail!(OutOfRange, "the model has {} end-of-generation ids, out holds {cap}", ids.len());
        }
        // SAFETY: the caller promises `out` holds `cap` ids, and ids.len() <= cap.
        let out = unsafe { std::slice::from_raw_parts_mut(out, ids.len()) };
        for (slot, &id) in out.iter_mut().zip(ids) {
            // Below the model's vocabulary, which fits i32 (checked at load).
            *slot = id as i32;
        }
        Ok(())
    })
}

/// Renders `n` messages with the model's own chat template (GGUF `tokenizer.chat_template`, or an HF
/// folder's tokenizer_config.json `chat_template` / chat_template.jinja) as transformers'
/// `apply_chat_template` does, with the model's BOS and EOS texts as `bos_token` / `eos_token`; with
/// `add_generation_prompt`, the text ends where the assistant's reply begins. The text is written into
/// `buf` like snprintf (at most `len - 1` bytes, then a NUL; `buf` may be NULL with `len` 0) and its
/// length is returned: call again with a larger buffer when it is `len` or more. The text is not
/// tokenized: pass it to `engine_tokenize` with `ENGINE_BOS_NO` when the template writes BOS itself.
/// On failure a negative status: -UNSUPPORTED when the model has no chat template, -BAD_MODEL for a
/// template that does not parse, -INVALID_ARGUMENT for NULLs, text that is not UTF-8, or messages the
/// template refuses (its raise_exception; the message says why). Runs beside steps without waiting.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_chat_template(
    e: *const engine,
    messages: *const engine_chat_message,
    n: usize,
    add_generation_prompt: bool,
    buf: *mut c_char,
    len: usize,
) -> i32 {
    let render = |e: &engine, template: &str| -> Result<String> {
        if messages.is_null() && n > 0 {
            crate::bail!(InvalidArgument, "messages is NULL with n {n}");
        }
        let raw: &[engine_chat_message] =
        // SAFETY: the caller promises `messages` holds `n` messages; n is 0 when it is NULL.
        if n == 0 { &[] } else { unsafe { std::slice::from_raw_parts(messages, n) } };
        let mut chat_messages = Vec::with_capacity(n);
        for (i, m) in raw.iter().enumerate() {
            let text = |p: *const c_char, field: &str| -> Result<&str> {
                if p.is_null() {
                    crate::bail!(InvalidArgument, "messages[{i}].{field} is NULL");
                }
                // SAFETY: the caller promises a NUL-terminated string that outlives the call.
                unsafe { std::ffi::CStr::from_ptr(p) }.to_str().map_err(|err| {
                    crate::err!(InvalidArgument, "messages[{i}].{field} is not UTF-8 at byte {}", err.valid_up_to())
                })
            };
            chat_messages.push(chat::ChatMessage { role: text(m.role, "role")?, content: text(m.content, "content")? });
        }
        chat::render(template, &chat_messages, add_generation_prompt, &e.text.bos_text, &e.text.eos_text)
    };
    // SAFETY: the caller's contract for `e`, `buf` and `len`, passed on.
    unsafe { render_chat("engine_chat_template", e, buf, len, render) }
}

/// The two chat-template exports around their renderers: `buf` emptied first, the engine and `buf`
/// checked, the model's template handed to `render`, its text written into `buf`; the length it needs,
/// or -status.
///
/// # Safety
/// `e` is NULL or a live engine; `buf` is NULL or holds `len` bytes.
unsafe fn render_chat(
    name: &str,
    e: *const engine,
    buf: *mut c_char,
    len: usize,
    render: impl FnOnce(&engine, &str) -> Result<String>,
) -> i32 {
    if !buf.is_null() && len > 0 {
        // SAFETY: the caller promises `buf` holds `len` bytes.
        unsafe { *buf = 0 };
    }
    let mut need = 0i32;
    let status = guard(name, || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        if buf.is_null() && len > 0 {
            crate::bail!(InvalidArgument, "buf is NULL with len {len}");
        }
        let template = e.text.chat_template.as_deref().ok_or_else(|| {
            Error::new(Status::Unsupported, "the model has no chat template (tokenizer.chat_template, chat_template)")
        })?;
        let rendered = render(e, template)?;
        need = i32::try_from(rendered.len())
            .map_err(|_| crate::err!(OutOfRange, "the rendered chat is {} bytes", rendered.len()))?;
        // SAFETY: `buf` holds `len` bytes or is NULL with `len` 0.
        unsafe { write_c_string(&rendered, buf, len) };
        Ok(())
    });
    if status == Status::Ok { need } else { -(status as i32) }
}

/// As `engine_chat_template`, with the conversation and the tools given as JSON, the way transformers'
/// `apply_chat_template(messages, tools=tools)` receives them, for templates that call tools:
/// `messages_json` a NUL-terminated array of message objects passed to the template as they are (an
/// assistant message's `tool_calls`, a `"tool"` message's `tool_call_id`, any field the template
/// reads), `tools_json` a NUL-terminated array of tools (OpenAI's `{"type": "function", "function":
/// {"name", "description", "parameters"}}` objects, which the templates of Qwen2.5, Llama 3.1 and
/// Hermes models print) or NULL for the template's `tools` being none. Objects keep their keys' order
/// (Python's dicts do). Writes and returns as `engine_chat_template` does; -INVALID_ARGUMENT also for
/// JSON that does not parse or is not an array (of objects, for the messages). Runs beside steps
/// without waiting.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_chat_template_json(
    e: *const engine,
    messages_json: *const c_char,
    tools_json: *const c_char,
    add_generation_prompt: bool,
    buf: *mut c_char,
    len: usize,
) -> i32 {
    let render = |e: &engine, template: &str| -> Result<String> {
        if messages_json.is_null() {
            crate::bail!(InvalidArgument, "messages_json is NULL");
        }
        let text = |p: *const c_char, what: &str| -> Result<&str> {
            // SAFETY: the caller promises a NUL-terminated string that outlives the call (p is not NULL).
            unsafe { std::ffi::CStr::from_ptr(p) }
                .to_str()
                .map_err(|err| crate::err!(InvalidArgument, "{what} is not UTF-8 at byte {}", err.valid_up_to()))
        };
        let messages = text(messages_json, "messages_json")?;
        let tools = if tools_json.is_null() { None } else { Some(text(tools_json, "tools_json")?) };
        chat::render_json(template, messages, tools, add_generation_prompt, &e.text.bos_text, &e.text.eos_text)
    };
    // SAFETY: the caller's contract for `e`, `buf` and `len`, passed on.
    unsafe { render_chat("engine_chat_template_json", e, buf, len, render) }
}
