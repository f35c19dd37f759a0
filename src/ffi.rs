//! The C ABI: every exported function, each inside a panic boundary, each NULL checked.
//! Sections follow the header's order: basics, device, fit, engine, decode.
#![allow(non_camel_case_types, clippy::missing_safety_doc)]

use crate::abi::{
    engine_backend, engine_batch_item, engine_constraint, engine_dtype, engine_fit_inputs, engine_kv_type,
    engine_memory, engine_options, engine_placement, engine_plan, engine_rows, engine_sampling, engine_tristate,
};
pub use crate::abi::{engine_device_info, engine_kv_usage, engine_model_info};
use crate::abi::{engine_draft, engine_speculation};
use crate::cuda;
use crate::status::{self, Error, Result, Status, engine_status};
use std::os::raw::c_char;

pub use crate::abi::HOSTEMBED_ABI_VERSION;

/// Runs `f`, turning an error into its status (and the thread's last error) and a panic into
/// `ENGINE_STATUS_PANIC`; nothing unwinds into C and nothing is printed on the host's stderr.
pub(crate) fn guard(what: &str, f: impl FnOnce() -> Result<()>) -> engine_status {
    match status::catch_quietly(f) {
        Ok(Ok(())) => Status::Ok,
        Ok(Err(e)) => {
            status::set_last_error(&e.message);
            e.status
        }
        Err(panic) => {
            status::set_last_error(&format!("{what}: panic: {}", status::panic_text(&*panic)));
            Status::Panic
        }
    }
}

/// Like `guard` for functions that return a value instead of a status; `fallback` on failure.
pub(crate) fn guard_value<T>(what: &str, fallback: T, f: impl FnOnce() -> Result<T>) -> T {
    let mut value = None;
    let status = guard(what, || {
        value = Some(f()?);
        Ok(())
    });
    if status == Status::Ok { value.unwrap_or(fallback) } else { fallback }
}

/// A reference from a pointer C passed, or INVALID_ARGUMENT naming the argument.
pub(crate) unsafe fn arg_ref<'a, T>(p: *const T, name: &str) -> Result<&'a T> {
    // SAFETY: the caller guarantees `p` is NULL or points to a `T` that stays live and unmutated for `'a`.
    unsafe { p.as_ref() }.ok_or_else(|| Error::new(Status::InvalidArgument, format!("{name} is NULL")))
}

pub(crate) unsafe fn arg_mut<'a, T>(p: *mut T, name: &str) -> Result<&'a mut T> {
    // SAFETY: the caller guarantees `p` is NULL or points to a `T` that stays live and unaliased for `'a`.
    unsafe { p.as_mut() }.ok_or_else(|| Error::new(Status::InvalidArgument, format!("{name} is NULL")))
}

/// The UTF-8 text C passed as `len` bytes at `text` (none when `len` is 0, whatever `text` is), or
/// INVALID_ARGUMENT for a NULL `text` with a length or bytes that are not UTF-8.
pub(crate) unsafe fn text_arg<'a>(text: *const c_char, len: usize) -> Result<&'a str> {
    let bytes: &[u8] = match (len, text.is_null()) {
        (0, _) => &[],
        (_, true) => crate::bail!(InvalidArgument, "text is NULL with len {len}"),
        // SAFETY: `text` is non-NULL here and the caller guarantees it holds `len` bytes live for `'a`.
        (_, false) => unsafe { std::slice::from_raw_parts(text as *const u8, len) },
    };
    std::str::from_utf8(bytes)
        .map_err(|err| crate::err!(InvalidArgument, "text is not UTF-8 at byte {}", err.valid_up_to()))
}

/// Copies `text` into a C buffer with snprintf's rules: returns the length it needed.
pub(crate) unsafe fn write_c_string(text: &str, buf: *mut c_char, len: usize) -> usize {
    if !buf.is_null() && len > 0 {
        let n = text.len().min(len - 1);
        // SAFETY: `buf` is non-NULL and holds `len > n` bytes (the caller's contract), and `text`, a separate Rust string, has at least `n`.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr() as *const c_char, buf, n);
            *buf.add(n) = 0;
        }
    }
    text.len()
}

// ---------------------------------------------------------------------------------------------
// Basics

/// The ABI version of the loaded library; equal to `HOSTEMBED_ABI_VERSION` when header and library match.
#[unsafe(no_mangle)]
pub extern "C" fn engine_abi_version() -> u32 {
    HOSTEMBED_ABI_VERSION
}

/// The loaded library's version, "MAJOR.MINOR.PATCH", a static string: `HOSTEMBED_VERSION` of the header
/// it was built with.
#[unsafe(no_mangle)]
pub extern "C" fn engine_version() -> *const c_char {
    VERSION.as_ptr()
}

/// The crate's version, which is the library's.
const VERSION: &std::ffi::CStr =
    match std::ffi::CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(v) => v,
        Err(_) => panic!("CARGO_PKG_VERSION holds a NUL"),
    };

/// A static, human-readable name for a status ("no room", "bad model", ...); any value is accepted
/// (-1 arrives as `UINT32_MAX`), and one outside `engine_status` gives "unknown status".
// The enum's own ABI type, so C and Zig callers pass an `engine_status` without a cast.
#[unsafe(no_mangle)]
pub extern "C" fn engine_status_str(status: u32) -> *const c_char {
    Status::from_raw(status.into()).map_or(c"unknown status", Status::c_name).as_ptr()
}

/// The message of the last failure on the calling thread ("" when none); valid until the next failure.
#[unsafe(no_mangle)]
pub extern "C" fn engine_last_error() -> *const c_char {
    status::last_error_ptr()
}

// ---------------------------------------------------------------------------------------------
// Device

/// Fills `out` for CUDA device `device`. NO_CUDA without GPU code, NO_DEVICE without a driver or device.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_device_info(device: i32, out: *mut engine_device_info) -> engine_status {
    guard("engine_device_info", || {
        // SAFETY: `out` is NULL (refused) or points to a writable engine_device_info (the header's contract).
        let out = unsafe { arg_mut(out, "out") }?;
        *out = cuda::device_info(device)?;
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Fit

use crate::fit;

/// The fit rule's defaults: a 256 MiB reserve, every other figure 0 and every flag false.
#[unsafe(no_mangle)]
pub extern "C" fn engine_fit_default_inputs() -> engine_fit_inputs {
    fit::default_inputs()
}

/// Runs the fit rule on `inputs` into `out`. NO_ROOM when no stream starts: `out` is still filled and
/// `engine_last_error()` says why ("a 10.90 GiB stream, 8.93 GiB left"). INVALID_ARGUMENT for NULL,
/// figures that overflow 64 bits, or figures that contradict each other.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_fit_plan(inputs: *const engine_fit_inputs, out: *mut engine_plan) -> engine_status {
    guard("engine_fit_plan", || {
        // SAFETY: `inputs` is NULL (refused) or points to a readable engine_fit_inputs (the header's contract).
        let inputs = unsafe { arg_ref(inputs, "inputs") }?;
        // SAFETY: `out` is NULL (refused) or points to a writable engine_plan (the header's contract).
        let out = unsafe { arg_mut(out, "out") }?;
        let plan = fit::plan(inputs)?;
        *out = plan;
        match fit::refusal(&plan) {
            Some(why) => Err(Error::new(Status::NoRoom, why)),
            None => Ok(()),
        }
    })
}

/// Writes the plan's start-up line into `buf` (NUL-terminated, truncated to `len`) and returns the
/// length it needed, like snprintf; 0 with `engine_last_error()` set for NULL or a bad placement.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_plan_describe(plan: *const engine_plan, buf: *mut c_char, len: usize) -> usize {
    if !buf.is_null() && len > 0 {
        // SAFETY: `buf` is non-NULL (checked) and holds `len > 0` bytes (the header's contract).
        unsafe { *buf = 0 };
    }
    guard_value("engine_plan_describe", 0, || {
        if plan.is_null() {
            return Err(Error::new(Status::InvalidArgument, "plan is NULL"));
        }
        // The enums came from C: check their raw values before Rust reads them as enums.
        for (offset, field) in [
            (std::mem::offset_of!(engine_plan, placement), "placement"),
            (std::mem::offset_of!(engine_plan, max_window_placement), "max_window_placement"),
        ] {
            // SAFETY: `plan` is non-NULL (checked) and points to an engine_plan (the header's contract); `offset` is a u32 field's, read unaligned.
            let raw = unsafe { std::ptr::read_unaligned((plan as *const u8).add(offset) as *const u32) };
            if engine_placement::from_raw(raw).is_none() {
                return Err(Error::new(
                    Status::InvalidArgument,
                    format!("plan->{field} is {raw}, not an engine_placement"),
                ));
            }
        }
        // SAFETY: `plan` points to an engine_plan whose enum fields were just checked to hold valid values.
        let plan = unsafe { arg_ref(plan, "plan") }?;
        // SAFETY: `buf` is NULL or holds `len` bytes (the header's contract), which is all `write_c_string` asks.
        Ok(unsafe { write_c_string(&fit::describe(plan), buf, len) })
    })
}

// ---------------------------------------------------------------------------------------------
// Engine

use crate::constraint::{self, Grammars};
use crate::engine::{self as eng, Engine};
use crate::placement;
use std::os::raw::c_void;
use std::sync::{Arc, Mutex, MutexGuard};

/// A loaded model with its embedding rows placed; opaque to C.
///
/// Threads: an engine may be called from several threads at once. Calls that touch its decode state
/// (steps, logits, resets, the rows) are serialized inside the library, so a stream's tokens are the same
/// as in a serial run; `engine_tokenize`, `engine_token_piece`, `engine_model_info`, `engine_is_eog`,
/// `engine_eog_ids`, `engine_chat_template` and `engine_chat_template_json` read only what the load
/// fixed and run beside them without waiting. `engine_free` while another thread is still inside a call
/// on the same engine is the caller's bug.
pub struct engine {
    /// Everything a step may change, behind one lock.
    state: Mutex<Engine>,
    /// Fixed at the load, read without the lock.
    info: engine_model_info,
    tokenizer: Option<Arc<Tokenizer>>,
    /// BOS/EOS flags, end-of-generation ids and the chat template, fixed at the load.
    text: TextRules,
    /// llguidance's view of the vocabulary, built by the first `engine_set_constraint`.
    grammars: Mutex<Option<Arc<Grammars>>>,
}

impl engine {
    fn new(e: Engine) -> engine {
        let c = e.config();
        let info = engine_model_info {
            vocab: c.vocab as u32,
            layers: c.layers as u32,
            hidden: c.hidden as u32,
            heads: c.heads as u32,
            kv_heads: c.kv_heads as u32,
            head_dim: c.head_dim as u32,
            window: e.window() as u32,
            streams: e.stream_count() as u32,
            bos: c.bos.map_or(-1, |b| b as i32),
            eos: c.eos.map_or(-1, |b| b as i32),
            placement: e.rows().placement(),
            cuda: e.backend() == crate::engine::BackendKind::Cuda,
            add_bos: false,
            add_eos: false,
            kv_type_k: e.kv_types().k.to_c(),
            kv_type_v: e.kv_types().v.to_c(),
        };
        let tokenizer = e.shared_tokenizer();
        let text = special::resolve(&e.checkpoint().special, c.bos, c.eos, c.vocab, tokenizer.as_deref());
        let info = engine_model_info { add_bos: text.add_bos, add_eos: text.add_eos, ..info };
        engine { state: Mutex::new(e), info, tokenizer, text, grammars: Mutex::new(None) }
    }

    /// The vocabulary constraints compile against, built on first use (outside the decode lock).
    fn grammars(&self) -> Result<Arc<Grammars>> {
        let mut built = self.grammars.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(g) = built.as_ref() {
            return Ok(Arc::clone(g));
        }
        let tokenizer = self.tokenizer.clone().ok_or_else(|| {
            Error::new(Status::Unsupported, "constraints need the model's tokenizer, and it has none usable")
        })?;
        let g = Arc::new(Grammars::new(tokenizer, self.info.vocab as usize, &self.text.eog)?);
        *built = Some(Arc::clone(&g));
        Ok(g)
    }

    /// The engine's state, one caller at a time. A panic caught while the lock was held leaves the
    /// state memory-safe (a step appends only once it has finished), so a poisoned lock is taken anyway.
    fn lock(&self) -> MutexGuard<'_, Engine> {
        self.state.lock().unwrap_or_else(|poisoned| {
            let guard = poisoned.into_inner();
            self.state.clear_poison();
            guard
        })
    }
}

/// The defaults: device 0, the model's window, probed room, a 256 MiB reserve, no drafter, every
/// stream that fits, rows placed by the fit rule (DS4_EMBD_MMAP=1 reads them from the file mapping),
/// backend auto, greedy sampling, log lines to standard error, the backend's own KV cache types.
#[unsafe(no_mangle)]
pub extern "C" fn engine_default_options() -> engine_options {
    eng::default_options()
}

/// Reads options a C caller filled, checking the enums' raw values before Rust reads them as enums.
unsafe fn options_from_c(p: *const engine_options) -> Result<engine_options> {
    if p.is_null() {
        return Ok(eng::default_options());
    }
    // SAFETY: `p` is non-NULL (checked) and points to an engine_options (the caller's contract); each offset is a u32 field's, read unaligned.
    let raw = |offset: usize| unsafe { std::ptr::read_unaligned((p as *const u8).add(offset) as *const u32) };
    let tristates = [
        (std::mem::offset_of!(engine_options, unified), "unified"),
        (std::mem::offset_of!(engine_options, mmap_rows), "mmap_rows"),
        (std::mem::offset_of!(engine_options, batch_tensor_cores), "batch_tensor_cores"),
        (std::mem::offset_of!(engine_options, prefix_cache), "prefix_cache"),
    ];
    for (offset, field) in tristates {
        if engine_tristate::from_raw(raw(offset)).is_none() {
            return Err(Error::new(
                Status::InvalidArgument,
                format!("options->{field} is {}, not an engine_tristate", raw(offset)),
            ));
        }
    }
    let backend = raw(std::mem::offset_of!(engine_options, backend));
    if engine_backend::from_raw(backend).is_none() {
        return Err(Error::new(
            Status::InvalidArgument,
            format!("options->backend is {backend}, not an engine_backend"),
        ));
    }
    let kv_types = [
        (std::mem::offset_of!(engine_options, kv_type_k), "kv_type_k"),
        (std::mem::offset_of!(engine_options, kv_type_v), "kv_type_v"),
    ];
    for (offset, field) in kv_types {
        if engine_kv_type::from_raw(raw(offset)).is_none() {
            return Err(Error::new(
                Status::InvalidArgument,
                format!("options->{field} is {}, not an engine_kv_type", raw(offset)),
            ));
        }
    }
    // SAFETY: `p` points to an engine_options whose enum fields were all checked above to hold valid values.
    Ok(unsafe { std::ptr::read(p) })
}

/// The handle C passed, or INVALID_ARGUMENT for NULL.
unsafe fn handle<'a>(e: *const engine) -> Result<&'a engine> {
    // SAFETY: the caller guarantees `e` is NULL or an engine from engine_init_fit, not yet freed.
    unsafe { arg_ref(e, "engine") }
}

/// Opens the checkpoint at `model_path` (an HF folder or a .gguf file), plans with the fit rule, logs
/// the start-up line, places the embedding rows and stores the engine in `*out` (NULL on failure).
/// `opts` NULL = `engine_default_options()`. NO_ROOM when no stream fits (the message says why, in the
/// start-up line's words); BAD_MODEL/IO_ERROR for a checkpoint that cannot be read; NO_CUDA/NO_DEVICE
/// when the CUDA backend is asked for and absent; INVALID_ARGUMENT for an option out of its range (an
/// enum value that names none among them); UNSUPPORTED for a KV cache type the model or the device
/// cannot take (Q8_0 / FP8_E4M3 with a head_dim that is not a multiple of 32, FP8_E4M3 on a device
/// older than compute capability 8.9). With `draft_model` set the drafter is opened too: BAD_MODEL,
/// naming both sizes, when its vocabulary is not the target's. Whatever failed, nothing is held afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_init_fit(
    model_path: *const c_char,
    opts: *const engine_options,
    out: *mut *mut engine,
) -> engine_status {
    if !out.is_null() {
        // SAFETY: `out` is non-NULL (checked) and points to a writable engine pointer (the header's contract).
        unsafe { *out = std::ptr::null_mut() };
    }
    guard("engine_init_fit", || {
        // SAFETY: `out` is NULL (refused) or points to a writable engine pointer (the header's contract).
        let out = unsafe { arg_mut(out, "out") }?;
        if model_path.is_null() {
            return Err(Error::new(Status::InvalidArgument, "model_path is NULL"));
        }
        // SAFETY: `model_path` is non-NULL (checked) and NUL-terminated (the header's contract).
        let bytes = unsafe { std::ffi::CStr::from_ptr(model_path) }.to_bytes();
        let path = std::path::Path::new(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(bytes));
        // SAFETY: `opts` is NULL or points to an engine_options (the header's contract), which is `options_from_c`'s.
        let opts = unsafe { options_from_c(opts) }?;
        let e = Engine::init_fit(path, &opts)?;
        *out = Box::into_raw(Box::new(engine::new(e)));
        Ok(())
    })
}

/// Frees the engine and everything it holds: device memory, pinned memory, registrations, mappings.
/// NULL is accepted. No other thread may be inside a call on the same engine, or enter one later.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_free(e: *mut engine) {
    guard("engine_free", || {
        if !e.is_null() {
            // SAFETY: `e` is non-NULL and came from `Box::into_raw` in engine_init_fit; the header makes this its one free, with no call inside.
            drop(unsafe { Box::from_raw(e) });
        }
        Ok(())
    });
}

/// The device-usable pointer to embedding rows in host memory (pinned, or the registered file
/// mapping); NULL when the rows are on the card, on the CPU backend, or `e` is NULL.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_host_embed_ptr(e: *const engine) -> *const c_void {
    // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
    guard_value("engine_host_embed_ptr", std::ptr::null(), || Ok(unsafe { handle(e) }?.lock().rows().host_embed_ptr()))
}

/// Where the embedding rows are and how to read them, in every placement.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_embed_rows(e: *const engine, out: *mut engine_rows) -> engine_status {
    guard("engine_embed_rows", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        // SAFETY: `out` is NULL (refused) or points to a writable engine_rows (the header's contract).
        *unsafe { arg_mut(out, "out") }? = e.lock().rows().describe();
        Ok(())
    })
}

/// Gathers the embedding rows of `n` token ids into `device_out` as `out_dtype` (F32 or BF16), on
/// `cuda_stream` (NULL = the default stream), and synchronizes that stream. On the CPU backend both
/// pointers are host pointers. OUT_OF_RANGE when any id is outside the vocabulary: such a row is never
/// read (on CUDA it is written as zeros).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_embed(
    e: *const engine,
    device_ids: *const i32,
    n: usize,
    device_out: *mut c_void,
    out_dtype: engine_dtype,
    cuda_stream: *mut c_void,
) -> engine_status {
    // Read the dtype as the integer C passed before Rust treats it as an enum.
    // SAFETY: `out_dtype` is a live repr(C) enum argument, read as the 32-bit integer C passed for it.
    let raw_dtype = unsafe { std::ptr::read(&out_dtype as *const engine_dtype as *const u32) };
    guard("engine_embed", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        let dtype = match raw_dtype {
            0 => engine_dtype::F32,
            2 => engine_dtype::Bf16,
            other => {
                return Err(Error::new(
                    Status::InvalidArgument,
                    format!("out_dtype is {other}; the gather writes ENGINE_DTYPE_F32 or ENGINE_DTYPE_BF16"),
                ));
            }
        };
        if n > 0 && device_ids.is_null() {
            return Err(Error::new(Status::InvalidArgument, "device_ids is NULL"));
        }
        if n > 0 && device_out.is_null() {
            return Err(Error::new(Status::InvalidArgument, "device_out is NULL"));
        }
        // SAFETY: with `n > 0` both pointers are non-NULL (checked) and hold `n` ids and `n` rows where the backend reads them (the header's contract).
        unsafe { e.lock().embed(device_ids, n, device_out, dtype, cuda_stream) }
    })
}

/// Process-wide bytes the library holds now: device, pinned, registered and mapped (checkpoints of
/// live engines). All zero once every engine is freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_memory_stats(out: *mut engine_memory) -> engine_status {
    guard("engine_memory_stats", || {
        // SAFETY: `out` is NULL (refused) or points to a writable engine_memory (the header's contract).
        *unsafe { arg_mut(out, "out") }? = placement::memory_stats();
        Ok(())
    })
}

/// The plan the engine started with; its placement is where the rows went (a device that cannot
/// register the file mapping gets HOST_MAPPED). UNSUPPORTED on the CPU backend, which has no device plan.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_plan_of(e: *const engine, out: *mut engine_plan) -> engine_status {
    guard("engine_plan_of", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        // SAFETY: `out` is NULL (refused) or points to a writable engine_plan (the header's contract).
        let out = unsafe { arg_mut(out, "out") }?;
        match e.lock().plan() {
            Some(plan) => {
                *out = *plan;
                Ok(())
            }
            None => Err(Error::new(Status::Unsupported, "the engine runs on the CPU backend and has no device plan")),
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Decode

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

/// Keeps the first `len` positions of stream `stream` and gives the KV pages past them back to the
/// pool; stepping the same tokens again in the same pieces gives the same logits, bit for bit (on CUDA, a
/// prompt chunk the cut falls inside, stepped again as a shorter chunk, may take another product route:
/// within 2e-3 relative L2; so may a prompt that takes the prefix cache's pages for its first whole pages,
/// see `engine_options.prefix_cache`). OUT_OF_RANGE when `len` is more than the stream holds or the stream
/// does not exist. The stream's logits are dropped when it loses positions.
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
/// tokens_free`.
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
/// for the copy (NO_ROOM for that step when none is free). INVALID_ARGUMENT for `src == dst`;
/// OUT_OF_RANGE for a stream the engine does not have or `len` past `src`'s length. A refused call
/// changes nothing.
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

// ---------------------------------------------------------------------------------------------
// Decode: tokenizer

use crate::abi::{ENGINE_BOS_MODEL, ENGINE_BOS_NO, engine_chat_message};
use crate::tokenizer::special::{self, TextRules};
use crate::tokenizer::{Tokenizer, chat};

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
