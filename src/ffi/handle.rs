//! The opaque `engine` handle: its load and free, the options C passes, and its embedding rows.

use super::{arg_mut, arg_ref, guard, guard_value};
use crate::abi::{
    engine_backend, engine_dtype, engine_kv_type, engine_memory, engine_model_info, engine_options, engine_plan,
    engine_rows, engine_tristate,
};
use crate::constraint::Grammars;
use crate::engine::{self as eng, Engine};
use crate::placement;
use crate::status::{Error, Result, Status, engine_status};
use crate::tokenizer::Tokenizer;
use crate::tokenizer::special::{self, TextRules};
use std::os::raw::{c_char, c_void};
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
    pub(super) state: Mutex<Engine>,
    /// Fixed at the load, read without the lock.
    pub(super) info: engine_model_info,
    pub(super) tokenizer: Option<Arc<Tokenizer>>,
    /// BOS/EOS flags, end-of-generation ids and the chat template, fixed at the load.
    pub(super) text: TextRules,
    /// llguidance's view of the vocabulary, built by the first `engine_set_constraint`.
    pub(super) grammars: Mutex<Option<Arc<Grammars>>>,
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
    pub(super) fn grammars(&self) -> Result<Arc<Grammars>> {
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
    pub(super) fn lock(&self) -> MutexGuard<'_, Engine> {
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
pub(super) unsafe fn handle<'a>(e: *const engine) -> Result<&'a engine> {
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

/// Device `index`'s plan of an engine over `options.devices` (index 0 is `options.device`, rank order):
/// that device's own figures, its `streams` what it alone allows (the engine starts the fewest of them,
/// which `engine_plan_of` gives). On one device, index 0 is `engine_plan_of`'s plan. INVALID_ARGUMENT
/// past the engine's devices, UNSUPPORTED on the CPU backend.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_plan_of_device(e: *const engine, index: u32, out: *mut engine_plan) -> engine_status {
    guard("engine_plan_of_device", || {
        // SAFETY: the caller passes an engine from engine_init_fit (or NULL, refused), not yet freed.
        let e = unsafe { handle(e) }?;
        // SAFETY: `out` is NULL (refused) or points to a writable engine_plan (the header's contract).
        let out = unsafe { arg_mut(out, "out") }?;
        let e = e.lock();
        if e.plan().is_none() {
            return Err(Error::new(Status::Unsupported, "the engine runs on the CPU backend and has no device plan"));
        }
        match e.device_plan(index as usize) {
            Some(plan) => {
                *out = *plan;
                Ok(())
            }
            None => Err(Error::new(
                Status::InvalidArgument,
                format!("device {index}: the engine runs on {} device(s)", e.options().devices.max(1)),
            )),
        }
    })
}
