//! The C ABI: every exported function, each inside a panic boundary, each NULL checked.
//! Sections follow the header's order: basics, device, fit, engine, decode.
#![allow(non_camel_case_types, clippy::missing_safety_doc)]

use crate::cuda;
use crate::cudart as rt;
use crate::status::{self, Error, Result, Status, engine_status};
use std::os::raw::{c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};

/// The ABI this header describes; a caller compares it with `engine_abi_version()`.
pub const HOSTEMBED_ABI_VERSION: u32 = 1;

/// Runs `f`, turning an error into its status (and the thread's last error) and a panic into
/// `ENGINE_STATUS_PANIC`; nothing unwinds into C.
pub(crate) fn guard(what: &str, f: impl FnOnce() -> Result<()>) -> engine_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => Status::Ok,
        Ok(Err(e)) => {
            status::set_last_error(&e.message);
            e.status
        }
        Err(panic) => {
            let text = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            status::set_last_error(&format!("{what}: panic: {text}"));
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
    unsafe { p.as_ref() }.ok_or_else(|| Error::new(Status::InvalidArgument, format!("{name} is NULL")))
}

pub(crate) unsafe fn arg_mut<'a, T>(p: *mut T, name: &str) -> Result<&'a mut T> {
    unsafe { p.as_mut() }.ok_or_else(|| Error::new(Status::InvalidArgument, format!("{name} is NULL")))
}

/// Copies `text` into a C buffer with snprintf's rules: returns the length it needed.
pub(crate) unsafe fn write_c_string(text: &str, buf: *mut c_char, len: usize) -> usize {
    if !buf.is_null() && len > 0 {
        let n = text.len().min(len - 1);
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

/// A static, human-readable name for a status ("no room", "bad model", ...).
#[unsafe(no_mangle)]
pub extern "C" fn engine_status_str(status: engine_status) -> *const c_char {
    status.c_name().as_ptr()
}

/// The message of the last failure on the calling thread ("" when none); valid until the next failure.
#[unsafe(no_mangle)]
pub extern "C" fn engine_last_error() -> *const c_char {
    status::last_error_ptr()
}

// ---------------------------------------------------------------------------------------------
// Device

/// What the placements decide on, read from the device.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct engine_device_info {
    /// NUL-terminated device name.
    pub name: [c_char; 256],
    pub compute_major: i32,
    pub compute_minor: i32,
    pub multiprocessors: i32,
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub integrated: bool,
    pub can_map_host_memory: bool,
    pub pageable_memory_access: bool,
    pub pageable_memory_access_uses_host_page_tables: bool,
    pub host_register_supported: bool,
    pub host_register_read_only_supported: bool,
    pub can_use_host_pointer_for_registered_mem: bool,
    /// Driver and runtime versions as CUDA encodes them (13000 = 13.0).
    pub driver_version: i32,
    pub runtime_version: i32,
}

pub(crate) fn device_info(device: i32) -> Result<engine_device_info> {
    cuda::require_device(device)?;
    let attr = |a| cuda::attribute(a, device);
    let mut info = engine_device_info {
        name: [0; 256],
        compute_major: attr(rt::cudaDevAttrComputeCapabilityMajor)?,
        compute_minor: attr(rt::cudaDevAttrComputeCapabilityMinor)?,
        multiprocessors: attr(rt::cudaDevAttrMultiProcessorCount)?,
        total_bytes: 0,
        free_bytes: 0,
        integrated: attr(rt::cudaDevAttrIntegrated)? != 0,
        can_map_host_memory: attr(rt::cudaDevAttrCanMapHostMemory)? != 0,
        pageable_memory_access: attr(rt::cudaDevAttrPageableMemoryAccess)? != 0,
        pageable_memory_access_uses_host_page_tables: attr(rt::cudaDevAttrPageableMemoryAccessUsesHostPageTables)? != 0,
        host_register_supported: attr(rt::cudaDevAttrHostRegisterSupported)? != 0,
        host_register_read_only_supported: attr(rt::cudaDevAttrHostRegisterReadOnlySupported)? != 0,
        can_use_host_pointer_for_registered_mem: attr(rt::cudaDevAttrCanUseHostPointerForRegisteredMem)? != 0,
        driver_version: 0,
        runtime_version: 0,
    };
    cuda::check(
        unsafe { crate::kernels::hostembed_device_name(device as c_int, info.name.as_mut_ptr(), info.name.len()) },
        "cudaGetDeviceProperties",
    )?;
    (info.free_bytes, info.total_bytes) = cuda::mem_info()?;
    cuda::check(unsafe { rt::cudaDriverGetVersion(&mut info.driver_version) }, "cudaDriverGetVersion")?;
    cuda::check(unsafe { rt::cudaRuntimeGetVersion(&mut info.runtime_version) }, "cudaRuntimeGetVersion")?;
    Ok(info)
}

/// Fills `out` for CUDA device `device`. NO_CUDA without GPU code, NO_DEVICE without a driver or device.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_device_info(device: i32, out: *mut engine_device_info) -> engine_status {
    guard("engine_device_info", || {
        let out = unsafe { arg_mut(out, "out") }?;
        *out = device_info(device)?;
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Fit

use crate::fit;

/// The fit rule's defaults: a 256 MiB reserve, every other figure 0 and every flag false.
#[unsafe(no_mangle)]
pub extern "C" fn engine_fit_default_inputs() -> fit::engine_fit_inputs {
    fit::default_inputs()
}

/// Runs the fit rule on `inputs` into `out`. NO_ROOM when no stream starts: `out` is still filled and
/// `engine_last_error()` says why ("a 10.90 GiB stream, 8.93 GiB left"). INVALID_ARGUMENT for NULL,
/// figures that overflow 64 bits, or figures that contradict each other.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_fit_plan(
    inputs: *const fit::engine_fit_inputs,
    out: *mut fit::engine_plan,
) -> engine_status {
    guard("engine_fit_plan", || {
        let inputs = unsafe { arg_ref(inputs, "inputs") }?;
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
pub unsafe extern "C" fn engine_plan_describe(plan: *const fit::engine_plan, buf: *mut c_char, len: usize) -> usize {
    if !buf.is_null() && len > 0 {
        unsafe { *buf = 0 };
    }
    guard_value("engine_plan_describe", 0, || {
        if plan.is_null() {
            return Err(Error::new(Status::InvalidArgument, "plan is NULL"));
        }
        // The enums came from C: check their raw values before Rust reads them as enums.
        for (offset, field) in [
            (std::mem::offset_of!(fit::engine_plan, placement), "placement"),
            (std::mem::offset_of!(fit::engine_plan, max_window_placement), "max_window_placement"),
        ] {
            let raw = unsafe { std::ptr::read_unaligned((plan as *const u8).add(offset) as *const u32) };
            if fit::engine_placement::from_raw(raw).is_none() {
                return Err(Error::new(
                    Status::InvalidArgument,
                    format!("plan->{field} is {raw}, not an engine_placement"),
                ));
            }
        }
        let plan = unsafe { arg_ref(plan, "plan") }?;
        Ok(unsafe { write_c_string(&fit::describe(plan), buf, len) })
    })
}

// ---------------------------------------------------------------------------------------------
// Engine

use crate::engine::{self as eng, Engine, engine_backend, engine_options, engine_tristate};
use crate::placement::{self, engine_memory, engine_rows};
use crate::tensor::engine_dtype;
use std::os::raw::c_void;

/// A loaded model with its embedding rows placed; opaque to C.
pub struct engine(pub(crate) Engine);

/// The defaults: device 0, the model's window, probed room, a 256 MiB reserve, no drafter, every
/// stream that fits, rows placed by the fit rule (DS4_EMBD_MMAP=1 reads them from the file mapping),
/// backend auto, greedy sampling, log lines to standard error.
#[unsafe(no_mangle)]
pub extern "C" fn engine_default_options() -> engine_options {
    eng::default_options()
}

/// Reads options a C caller filled, checking the enums' raw values before Rust reads them as enums.
unsafe fn options_from_c(p: *const engine_options) -> Result<engine_options> {
    if p.is_null() {
        return Ok(eng::default_options());
    }
    let raw = |offset: usize| unsafe { std::ptr::read_unaligned((p as *const u8).add(offset) as *const u32) };
    let tristates = [
        (std::mem::offset_of!(engine_options, unified), "unified"),
        (std::mem::offset_of!(engine_options, mmap_rows), "mmap_rows"),
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
    Ok(unsafe { std::ptr::read(p) })
}

unsafe fn engine_ref<'a>(e: *const engine) -> Result<&'a Engine> {
    Ok(&unsafe { arg_ref(e, "engine") }?.0)
}

/// Opens the checkpoint at `model_path` (an HF folder or a .gguf file), plans with the fit rule, logs
/// the start-up line, places the embedding rows and stores the engine in `*out` (NULL on failure).
/// `opts` NULL = `engine_default_options()`. NO_ROOM when no stream fits (the message says why, in the
/// start-up line's words); BAD_MODEL/IO_ERROR for a checkpoint that cannot be read; NO_CUDA/NO_DEVICE
/// when the CUDA backend is asked for and absent. Whatever failed, nothing is held afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_init_fit(
    model_path: *const c_char,
    opts: *const engine_options,
    out: *mut *mut engine,
) -> engine_status {
    if !out.is_null() {
        unsafe { *out = std::ptr::null_mut() };
    }
    guard("engine_init_fit", || {
        let out = unsafe { arg_mut(out, "out") }?;
        if model_path.is_null() {
            return Err(Error::new(Status::InvalidArgument, "model_path is NULL"));
        }
        let bytes = unsafe { std::ffi::CStr::from_ptr(model_path) }.to_bytes();
        let path = std::path::Path::new(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(bytes));
        let opts = unsafe { options_from_c(opts) }?;
        let e = Engine::init_fit(path, &opts)?;
        *out = Box::into_raw(Box::new(engine(e)));
        Ok(())
    })
}

/// Frees the engine and everything it holds: device memory, pinned memory, registrations, mappings.
/// NULL is accepted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_free(e: *mut engine) {
    guard("engine_free", || {
        if !e.is_null() {
            drop(unsafe { Box::from_raw(e) });
        }
        Ok(())
    });
}

/// The device-usable pointer to embedding rows in host memory (pinned, or the registered file
/// mapping); NULL when the rows are on the card, on the CPU backend, or `e` is NULL.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_host_embed_ptr(e: *const engine) -> *const c_void {
    guard_value("engine_host_embed_ptr", std::ptr::null(), || Ok(unsafe { engine_ref(e) }?.rows().host_embed_ptr()))
}

/// Where the embedding rows are and how to read them, in every placement.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_embed_rows(e: *const engine, out: *mut engine_rows) -> engine_status {
    guard("engine_embed_rows", || {
        let e = unsafe { engine_ref(e) }?;
        *unsafe { arg_mut(out, "out") }? = e.rows().describe();
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
    let raw_dtype = unsafe { std::ptr::read(&out_dtype as *const engine_dtype as *const u32) };
    guard("engine_embed", || {
        let e = unsafe { engine_ref(e) }?;
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
        unsafe { e.embed(device_ids, n, device_out, dtype, cuda_stream) }
    })
}

/// Process-wide bytes the library holds now: device, pinned, registered and mapped (checkpoints of
/// live engines). All zero once every engine is freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_memory_stats(out: *mut engine_memory) -> engine_status {
    guard("engine_memory_stats", || {
        *unsafe { arg_mut(out, "out") }? = placement::memory_stats();
        Ok(())
    })
}

/// The plan the engine started with; its placement is where the rows went (a device that cannot
/// register the file mapping gets HOST_MAPPED). UNSUPPORTED on the CPU backend, which has no device plan.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_plan_of(e: *const engine, out: *mut fit::engine_plan) -> engine_status {
    guard("engine_plan_of", || {
        let e = unsafe { engine_ref(e) }?;
        let out = unsafe { arg_mut(out, "out") }?;
        match e.plan() {
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
