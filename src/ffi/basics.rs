//! The library's basics (its ABI version, version, status names, last error), the device, and the
//! fit rule run by itself: calls that need no engine.

use super::{arg_mut, arg_ref, guard, guard_value, write_c_string};
use crate::abi::{HOSTEMBED_ABI_VERSION, engine_device_info, engine_fit_inputs, engine_placement, engine_plan};
use crate::cuda;
use crate::fit;
use crate::status::{self, Error, Status, engine_status};
use std::os::raw::c_char;

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
        // SAFETY: `plan` is NULL or points to an engine_plan (the header's contract).
        let plan = unsafe { checked_plan(plan, "plan") }?;
        // SAFETY: `buf` is NULL or holds `len` bytes (the header's contract), which is all `write_c_string` asks.
        Ok(unsafe { write_c_string(&fit::describe(plan), buf, len) })
    })
}

/// The engine_plan C passed at `plan`, its enum fields checked to hold values of their enums before Rust
/// reads them as enums; INVALID_ARGUMENT naming `name` (and the field) otherwise.
///
/// # Safety
/// `plan` is NULL or points to an engine_plan's bytes that stay live and unmutated for `'a`.
unsafe fn checked_plan<'a>(plan: *const engine_plan, name: &str) -> Result<&'a engine_plan, Error> {
    if plan.is_null() {
        return Err(Error::new(Status::InvalidArgument, format!("{name} is NULL")));
    }
    for (offset, field) in [
        (std::mem::offset_of!(engine_plan, placement), "placement"),
        (std::mem::offset_of!(engine_plan, max_window_placement), "max_window_placement"),
    ] {
        // SAFETY: `plan` is non-NULL (checked) and points to an engine_plan (the caller's contract); `offset` is a u32 field's, read unaligned.
        let raw = unsafe { std::ptr::read_unaligned((plan as *const u8).add(offset) as *const u32) };
        if engine_placement::from_raw(raw).is_none() {
            return Err(Error::new(
                Status::InvalidArgument,
                format!("{name}->{field} is {raw}, not an engine_placement"),
            ));
        }
    }
    // SAFETY: `plan` points to an engine_plan whose enum fields were just checked to hold valid values.
    unsafe { arg_ref(plan, name) }
}

/// Devices a plan over several may name: a bound on the count C passes.
const MAX_DEVICES: usize = 64;

fn device_count(devices: usize) -> Result<(), Error> {
    if devices == 0 || devices > MAX_DEVICES {
        return Err(Error::new(Status::InvalidArgument, format!("{devices} devices: a plan takes 1 to {MAX_DEVICES}")));
    }
    Ok(())
}

/// Runs the fit rule for a model split over `devices` devices with tensor parallelism: `inputs[i]` is
/// device i's own figures (its shards' bytes, its share of a stream, its room; ARCHITECTURE.md, "Tensor
/// parallelism"), `plans[i]` gets its plan, `*streams` the streams the engine starts on all of them (the
/// fewest any device allows: the page ids are shared). Each device keeps the embedding rows or maps
/// the one host copy by its own plan. NO_ROOM when a device allows none: every plan is still filled,
/// `*streams` is 0 and `engine_last_error()` names the device. INVALID_ARGUMENT for NULL, 0 or more
/// than 64 devices, or a device's figures the one-device rule refuses (naming the device).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_fit_plan_devices(
    inputs: *const engine_fit_inputs,
    devices: usize,
    plans: *mut engine_plan,
    streams: *mut u32,
) -> engine_status {
    guard("engine_fit_plan_devices", || {
        device_count(devices)?;
        if inputs.is_null() || plans.is_null() {
            return Err(Error::new(Status::InvalidArgument, "inputs or plans is NULL"));
        }
        // SAFETY: `streams` is NULL (refused) or points to a writable uint32_t (the header's contract).
        let streams = unsafe { arg_mut(streams, "streams") }?;
        // SAFETY: `inputs` is non-NULL (checked) and holds `devices` engine_fit_inputs (the header's contract).
        let inputs = unsafe { std::slice::from_raw_parts(inputs, devices) };
        let p = fit::plan_devices(inputs)?;
        // SAFETY: `plans` is non-NULL (checked) and holds `devices` writable engine_plans (the header's contract).
        let out = unsafe { std::slice::from_raw_parts_mut(plans, devices) };
        out.copy_from_slice(&p.plans);
        *streams = p.streams;
        match p.plans.iter().position(|plan| plan.streams == 0) {
            Some(_) => Err(Error::new(Status::NoRoom, fit::describe_devices(&p))),
            None => Ok(()),
        }
    })
}

/// Writes the start-up line of a plan over `devices` devices (`plans` as `engine_fit_plan_devices`
/// filled them) into `buf` like `engine_plan_describe`: "2 devices, 9 streams at an 8192-token window;
/// device 0: ...". 0 with `engine_last_error()` set for NULL, a bad count or a bad placement.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engine_plan_describe_devices(
    plans: *const engine_plan,
    devices: usize,
    buf: *mut c_char,
    len: usize,
) -> usize {
    if !buf.is_null() && len > 0 {
        // SAFETY: `buf` is non-NULL (checked) and holds `len > 0` bytes (the header's contract).
        unsafe { *buf = 0 };
    }
    guard_value("engine_plan_describe_devices", 0, || {
        device_count(devices)?;
        if plans.is_null() {
            return Err(Error::new(Status::InvalidArgument, "plans is NULL"));
        }
        let each = (0..devices)
            // SAFETY: `plans` is non-NULL (checked) and holds `devices` engine_plans (the header's contract).
            .map(|d| unsafe { checked_plan(plans.add(d), &format!("plans[{d}]")) }.copied())
            .collect::<Result<Vec<engine_plan>, Error>>()?;
        let streams = each.iter().map(|p| p.streams).min().unwrap_or(0);
        let embed_host_bytes = each.iter().map(|p| p.embed_host_bytes).max().unwrap_or(0);
        let p = fit::DevicesPlan { plans: each, streams, embed_host_bytes };
        // SAFETY: `buf` is NULL or holds `len` bytes (the header's contract), which is all `write_c_string` asks.
        Ok(unsafe { write_c_string(&fit::describe_devices(&p), buf, len) })
    })
}
