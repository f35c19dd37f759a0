//! The C ABI: every exported function, each inside a panic boundary, each NULL checked.
//! One file a family of calls, in the header's order, which is the order build.rs hands them to cbindgen:
//! `basics.rs` (basics, device, fit), `handle.rs` (the engine's load, free and rows), `step.rs`, `sample.rs`,
//! `streams.rs`, `text.rs`. Here: the panic boundary and the argument checks every call goes through.
#![allow(non_camel_case_types, clippy::missing_safety_doc)]

mod basics;
mod handle;
mod sample;
mod step;
mod streams;
mod text;

// Every export stays at `ffi::engine_*`, where the crate's tests and examples name it.
pub use basics::*;
pub use handle::*;
pub use sample::*;
pub use step::*;
pub use streams::*;
pub use text::*;

pub use crate::abi::{engine_device_info, engine_kv_usage, engine_model_info};
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
