//! Safe owners over the CUDA runtime: every resource has one owner that frees it on drop, and
//! every byte it holds is counted in `memory_stats`. In a build without nvcc each call fails
//! with `NO_CUDA` ("built without nvcc").

use crate::abi::engine_device_info;
use crate::cudart as rt;
use crate::status::{Error, Result, Status};
use std::ffi::CStr;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};

/// Turns a CUDA return code into an error naming the call.
pub fn check(code: rt::cudaError_t, what: &str) -> Result<()> {
    match code {
        rt::cudaSuccess => Ok(()),
        rt::NOT_BUILT => Err(Error::new(Status::NoCuda, "built without nvcc")),
        rt::cudaErrorNoDevice | rt::cudaErrorInsufficientDriver => {
            Err(Error::new(Status::NoDevice, format!("{what}: {}", error_text(code))))
        }
        _ => Err(Error::new(Status::CudaError, format!("{what}: {}", error_text(code)))),
    }
}

/// "cudaErrorMemoryAllocation (out of memory)"; the runtime owns both strings.
pub fn error_text(code: rt::cudaError_t) -> String {
    if code == rt::NOT_BUILT {
        return "built without nvcc".into();
    }
    // SAFETY: for any code the runtime returns pointers to its own static NUL-terminated strings, or NULL, which `s` checks; nothing is freed.
    unsafe {
        let name = rt::cudaGetErrorName(code);
        let text = rt::cudaGetErrorString(code);
        let s = |p: *const std::os::raw::c_char| {
            if p.is_null() { String::from("?") } else { CStr::from_ptr(p).to_string_lossy().into_owned() }
        };
        format!("{} ({}, code {code})", s(name), s(text))
    }
}

/// True when this build carries GPU code at all.
pub const fn built_with_cuda() -> bool {
    cfg!(hostembed_cuda)
}

/// Fails with NO_CUDA, then NO_DEVICE (no driver, or no device with that index).
pub fn require_device(device: i32) -> Result<()> {
    let mut count: c_int = 0;
    // SAFETY: writes one int through a pointer to a live local.
    check(unsafe { rt::cudaGetDeviceCount(&mut count) }, "cudaGetDeviceCount")?;
    if device < 0 || device >= count {
        crate::bail!(NoDevice, "no CUDA device {device} ({count} present)");
    }
    // SAFETY: takes a plain index, which the runtime validates.
    check(unsafe { rt::cudaSetDevice(device) }, "cudaSetDevice")
}

pub fn attribute(attr: rt::cudaDeviceAttr, device: i32) -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: writes one int through a pointer to a live local; `attr` and `device` are plain values the runtime validates.
    check(unsafe { rt::cudaDeviceGetAttribute(&mut v, attr, device) }, "cudaDeviceGetAttribute")?;
    Ok(v)
}

/// (free, total) bytes on the current device.
pub fn mem_info() -> Result<(u64, u64)> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: writes two size_t values through pointers to live locals.
    check(unsafe { rt::cudaMemGetInfo(&mut free, &mut total) }, "cudaMemGetInfo")?;
    Ok((free as u64, total as u64))
}

/// The current device: (its index, compute capability major, minor).
pub fn current_compute_capability() -> Result<(i32, i32, i32)> {
    let mut device = 0;
    // SAFETY: writes one int through a valid pointer.
    check(unsafe { rt::cudaGetDevice(&mut device) }, "cudaGetDevice")?;
    let major = attribute(rt::cudaDevAttrComputeCapabilityMajor, device)?;
    let minor = attribute(rt::cudaDevAttrComputeCapabilityMinor, device)?;
    Ok((device, major, minor))
}

/// What the placements decide on, read from device `device` (which becomes current).
pub fn device_info(device: i32) -> Result<engine_device_info> {
    require_device(device)?;
    let attr = |a| attribute(a, device);
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
    check(
        // SAFETY: the name buffer is the struct's own array, passed with its length.
        unsafe { crate::kernels::hostembed_device_name(device as c_int, info.name.as_mut_ptr(), info.name.len()) },
        "cudaGetDeviceProperties",
    )?;
    (info.free_bytes, info.total_bytes) = mem_info()?;
    // SAFETY: both calls write one int into the struct's own fields.
    check(unsafe { rt::cudaDriverGetVersion(&mut info.driver_version) }, "cudaDriverGetVersion")?;
    // SAFETY: writes one int into the struct's own field.
    check(unsafe { rt::cudaRuntimeGetVersion(&mut info.runtime_version) }, "cudaRuntimeGetVersion")?;
    Ok(info)
}

pub fn synchronize() -> Result<()> {
    // SAFETY: takes no arguments; waits for the current device.
    check(unsafe { rt::cudaDeviceSynchronize() }, "cudaDeviceSynchronize")
}

/// The last launch error, for checking right after a kernel launch.
pub fn last_launch_error(what: &str) -> Result<()> {
    // SAFETY: takes no arguments; reads and clears the runtime's last error.
    check(unsafe { rt::cudaGetLastError() }, what)
}

/// Process-wide bytes the library holds, by kind; tests assert they return to zero.
pub struct MemoryCounters {
    pub device: AtomicU64,
    pub pinned: AtomicU64,
    pub registered: AtomicU64,
    pub mapped: AtomicU64,
}

pub static MEMORY: MemoryCounters = MemoryCounters {
    device: AtomicU64::new(0),
    pinned: AtomicU64::new(0),
    registered: AtomicU64::new(0),
    mapped: AtomicU64::new(0),
};

/// Device memory from cudaMalloc, freed on drop.
pub struct DeviceBuffer {
    ptr: *mut c_void,
    bytes: usize,
}

// SAFETY: the owner holds its cudaMalloc allocation alone and never dereferences it on the host; the runtime calls it makes are thread-safe.
unsafe impl Send for DeviceBuffer {}
// SAFETY: `&self` methods only pass the device pointer to the runtime's thread-safe copies and fills.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    pub fn new(bytes: usize) -> Result<Self> {
        let mut ptr = ptr::null_mut();
        // cudaMalloc(0) returns NULL; one byte keeps every buffer a real, distinct pointer.
        // SAFETY: writes the new allocation's address through a pointer to a live local.
        check(unsafe { rt::cudaMalloc(&mut ptr, bytes.max(1)) }, &format!("cudaMalloc({bytes} bytes)"))?;
        MEMORY.device.fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(DeviceBuffer { ptr, bytes })
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice<T: Copy>(data: &[T]) -> Result<Self> {
        let buf = Self::new(std::mem::size_of_val(data))?;
        buf.upload(data, 0)?;
        Ok(buf)
    }

    pub fn ptr(&self) -> *mut c_void {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The device address `offset` bytes in, once `n` bytes from there are known to fit.
    fn upload_target(&self, offset: usize, n: usize) -> Result<*mut c_void> {
        if offset.checked_add(n).is_none_or(|end| end > self.bytes) {
            crate::bail!(InvalidArgument, "upload of {n} bytes at {offset} into a {}-byte buffer", self.bytes);
        }
        // SAFETY: `offset + n <= self.bytes` was checked just above, so the address stays inside this allocation.
        Ok(unsafe { (self.ptr as *mut u8).add(offset) } as *mut c_void)
    }

    /// Copies host `data` into this buffer at byte `offset` (synchronous).
    pub fn upload<T: Copy>(&self, data: &[T], offset: usize) -> Result<()> {
        let n = std::mem::size_of_val(data);
        let dst = self.upload_target(offset, n)?;
        check(
            // SAFETY: `dst` has `n` bytes of room (checked by `upload_target`) and `data` is a live host slice of `n` bytes.
            unsafe { rt::cudaMemcpy(dst, data.as_ptr() as *const c_void, n, rt::cudaMemcpyHostToDevice) },
            "cudaMemcpy(host to device)",
        )
    }

    /// Copies the buffer's first `out.len()` elements back to the host (synchronous).
    pub fn download<T: Copy>(&self, out: &mut [T]) -> Result<()> {
        let n = std::mem::size_of_val(out);
        if n > self.bytes {
            crate::bail!(InvalidArgument, "download of {n} bytes from a {}-byte buffer", self.bytes);
        }
        check(
            // SAFETY: `n <= self.bytes` was checked above, and `out` is a live host slice of `n` bytes.
            unsafe { rt::cudaMemcpy(out.as_mut_ptr() as *mut c_void, self.ptr, n, rt::cudaMemcpyDeviceToHost) },
            "cudaMemcpy(device to host)",
        )
    }

    /// Fills every byte with `value` (tests poison outputs with this).
    pub fn fill_bytes(&self, value: u8) -> Result<()> {
        // SAFETY: `self.ptr` is this owner's live allocation of `self.bytes` bytes (at least those).
        check(unsafe { rt::cudaMemset(self.ptr, value as c_int, self.bytes) }, "cudaMemset")
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: `self.ptr` came from cudaMalloc and this owner frees it once, here.
        unsafe { rt::cudaFree(self.ptr) };
        MEMORY.device.fetch_sub(self.bytes as u64, Ordering::Relaxed);
    }
}

/// Copies host bytes (a checkpoint's file mapping, mostly) into device memory through a pinned staging
/// buffer: the DMA runs at pinned speed, and the driver is never asked to pin the source pages itself,
/// which file-backed read-only mappings can refuse.
pub struct StagedUploader {
    staging: PinnedBuffer,
}

impl StagedUploader {
    /// Staging size: large enough that per-copy overhead vanishes, small next to any model.
    const CHUNK: usize = 64 << 20;

    pub fn new() -> Result<Self> {
        Ok(StagedUploader { staging: PinnedBuffer::new_mapped(Self::CHUNK)? })
    }

    /// Copies `data` into `dst` at byte `offset` (synchronous).
    pub fn upload(&mut self, dst: &DeviceBuffer, offset: usize, data: &[u8]) -> Result<()> {
        let start = dst.upload_target(offset, data.len())? as *mut u8;
        for (i, piece) in data.chunks(Self::CHUNK).enumerate() {
            let stage = &mut self.staging.as_mut_slice()[..piece.len()];
            crate::hostmem::parallel_copy(stage, piece);
            // SAFETY: `i * CHUNK < data.len()`, and `upload_target` checked that `data.len()` bytes from `start` fit in `dst`.
            let at = unsafe { start.add(i * Self::CHUNK) } as *mut c_void;
            check(
                // SAFETY: `at` has `piece.len()` bytes of room in `dst`, and the staging buffer holds `CHUNK >= piece.len()` pinned bytes.
                unsafe {
                    rt::cudaMemcpy(at, self.staging.host as *const c_void, piece.len(), rt::cudaMemcpyHostToDevice)
                },
                "cudaMemcpy(staged host to device)",
            )?;
        }
        Ok(())
    }
}

/// Pinned host memory mapped into the device's address space (cudaHostAlloc Mapped|Portable).
pub struct PinnedBuffer {
    host: *mut c_void,
    device: *mut c_void,
    bytes: usize,
}

// SAFETY: the owner holds its pinned allocation alone, and Portable makes it usable from any thread.
unsafe impl Send for PinnedBuffer {}
// SAFETY: `&self` only hands out the addresses; writing through the host slice takes `&mut self`.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    pub fn new_mapped(bytes: usize) -> Result<Self> {
        let mut host = ptr::null_mut();
        check(
            // SAFETY: writes the new allocation's address through a pointer to a live local.
            unsafe { rt::cudaHostAlloc(&mut host, bytes.max(1), rt::cudaHostAllocMapped | rt::cudaHostAllocPortable) },
            &format!("cudaHostAlloc({bytes} bytes, Mapped|Portable)"),
        )?;
        MEMORY.pinned.fetch_add(bytes as u64, Ordering::Relaxed);
        // From here on, drop frees the allocation even if the device pointer lookup fails.
        let mut buf = PinnedBuffer { host, device: ptr::null_mut(), bytes };
        let mut device = ptr::null_mut();
        // SAFETY: `host` is the Mapped pinned allocation just made; the device address is written into a live local.
        check(unsafe { rt::cudaHostGetDevicePointer(&mut device, host, 0) }, "cudaHostGetDevicePointer")?;
        buf.device = device;
        Ok(buf)
    }

    pub fn host_ptr(&self) -> *mut c_void {
        self.host
    }

    pub fn device_ptr(&self) -> *mut c_void {
        self.device
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `host` is this owner's pinned allocation of at least `bytes` bytes, and `&mut self` makes the slice exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.host as *mut u8, self.bytes) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // SAFETY: `host` came from cudaHostAlloc and this owner frees it once, here.
        unsafe { rt::cudaFreeHost(self.host) };
        MEMORY.pinned.fetch_sub(self.bytes as u64, Ordering::Relaxed);
    }
}

/// A host range registered with cudaHostRegister; unregistered on drop unless it was
/// registered by someone else first (error 712), in which case it is only borrowed.
pub struct HostRegistration {
    host: *mut c_void,
    device: *mut c_void,
    bytes: usize,
    owned: bool,
}

// SAFETY: the registration is only its addresses; the range stays mapped by `new`'s contract, and it may be unregistered from any thread.
unsafe impl Send for HostRegistration {}
// SAFETY: `&self` only reads the addresses and the ownership flag.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Registers `[host, host+bytes)` with `flags`.
    ///
    /// # Safety
    /// `host` must be page-aligned and the range must stay mapped for the registration's whole life:
    /// the device reads it directly.
    pub unsafe fn new(host: *mut c_void, bytes: usize, flags: std::os::raw::c_uint) -> Result<Self> {
        // SAFETY: the caller guarantees `host` is page-aligned and the range stays mapped while registered (this function's contract).
        let code = unsafe { rt::cudaHostRegister(host, bytes, flags) };
        let owned = match code {
            rt::cudaSuccess => true,
            rt::cudaErrorHostMemoryAlreadyRegistered => {
                // The host process registered it already; clear the sticky-free error and borrow.
                // SAFETY: takes no arguments; clears the error the refused registration left behind.
                unsafe { rt::cudaGetLastError() };
                false
            }
            _ => {
                check(code, &format!("cudaHostRegister({bytes} bytes, flags {flags:#x})"))?;
                unreachable!("check fails for every code but cudaSuccess")
            }
        };
        if owned {
            MEMORY.registered.fetch_add(bytes as u64, Ordering::Relaxed);
        }
        let mut reg = HostRegistration { host, device: ptr::null_mut(), bytes, owned };
        let mut device = ptr::null_mut();
        // SAFETY: `host` is registered (here, or by the host process before); the device address is written into a live local.
        check(unsafe { rt::cudaHostGetDevicePointer(&mut device, host, 0) }, "cudaHostGetDevicePointer")?;
        reg.device = device;
        Ok(reg)
    }

    pub fn device_ptr(&self) -> *mut c_void {
        self.device
    }

    pub fn owned(&self) -> bool {
        self.owned
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: this owner registered the range and unregisters it once, here, while it is still mapped (`new`'s contract).
            unsafe { rt::cudaHostUnregister(self.host) };
            MEMORY.registered.fetch_sub(self.bytes as u64, Ordering::Relaxed);
        }
    }
}

/// A non-blocking stream, destroyed on drop.
pub struct Stream(rt::cudaStream_t);

// SAFETY: a CUDA stream handle may be used and destroyed from any thread.
unsafe impl Send for Stream {}
// SAFETY: `&self` only passes the handle to the runtime, whose stream calls are thread-safe.
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new() -> Result<Self> {
        let mut s = ptr::null_mut();
        check(
            // SAFETY: writes the new stream's handle through a pointer to a live local.
            unsafe { rt::cudaStreamCreateWithFlags(&mut s, rt::cudaStreamNonBlocking) },
            "cudaStreamCreateWithFlags",
        )?;
        Ok(Stream(s))
    }

    pub fn raw(&self) -> rt::cudaStream_t {
        self.0
    }

    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: `self.0` is this owner's live stream.
        check(unsafe { rt::cudaStreamSynchronize(self.0) }, "cudaStreamSynchronize")
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: `self.0` was made by `Stream::new` and is destroyed once, here.
        unsafe { rt::cudaStreamDestroy(self.0) };
    }
}

/// A timing event, destroyed on drop.
pub struct Event(rt::cudaEvent_t);

impl Event {
    pub fn new() -> Result<Self> {
        let mut e = ptr::null_mut();
        // SAFETY: writes the new event's handle through a pointer to a live local.
        check(unsafe { rt::cudaEventCreate(&mut e) }, "cudaEventCreate")?;
        Ok(Event(e))
    }

    // The stream is an opaque handle the runtime checks; nothing here dereferences it.
    #[allow(clippy::not_unsafe_ptr_arg_deref)]
    pub fn record(&self, stream: rt::cudaStream_t) -> Result<()> {
        // SAFETY: `self.0` is this owner's live event; `stream` is a handle the runtime validates.
        check(unsafe { rt::cudaEventRecord(self.0, stream) }, "cudaEventRecord")
    }

    /// Waits until the work queued before the last `record` has run.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: `self.0` is this owner's live event.
        check(unsafe { rt::cudaEventSynchronize(self.0) }, "cudaEventSynchronize")
    }

    /// Milliseconds from `start` to this event, waiting for this event first.
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32> {
        // SAFETY: `self.0` is this owner's live event.
        check(unsafe { rt::cudaEventSynchronize(self.0) }, "cudaEventSynchronize")?;
        let mut ms = 0f32;
        // SAFETY: writes one float through a pointer to a live local; both events are live owners.
        check(unsafe { rt::cudaEventElapsedTime(&mut ms, start.0, self.0) }, "cudaEventElapsedTime")?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: `self.0` was made by `Event::new` and is destroyed once, here.
        unsafe { rt::cudaEventDestroy(self.0) };
    }
}
