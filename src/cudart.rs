//! The CUDA runtime functions hostembed calls, declared by hand: scalars and pointers only.
//! build.rs compiles each line below against cuda_runtime_api.h, so a wrong type fails the build.
//! Linked from libcudart_static, which loads the driver at run time: nothing CUDA is needed to link.
#![allow(non_camel_case_types, non_upper_case_globals, dead_code)]

use std::os::raw::{c_char, c_float, c_int, c_uint, c_ulonglong, c_void};

pub type cudaError_t = c_int;
pub type cudaStream_t = *mut c_void;
pub type cudaEvent_t = *mut c_void;
pub type cudaGraph_t = *mut c_void;
pub type cudaGraphExec_t = *mut c_void;
pub type cudaMemcpyKind = c_int;
pub type cudaDeviceAttr = c_int;
pub type cudaStreamCaptureMode = c_int;

/// What every CUDA function returns in a build without nvcc; no real CUDA error has this value.
pub const NOT_BUILT: cudaError_t = -1;

/// Declares the functions as imports when the kernels were built, and as stubs returning
/// `NOT_BUILT` when they were not, so the rest of the crate compiles the same either way.
#[macro_export]
macro_rules! cuda_fns {
    ($(pub fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty;)*) => {
        #[cfg(hostembed_cuda)]
        unsafe extern "C" {
            $(pub fn $name($($arg: $ty),*) -> $ret;)*
        }
        $(
            #[cfg(not(hostembed_cuda))]
            #[allow(unused_variables, clippy::missing_safety_doc)]
            pub unsafe fn $name($($arg: $ty),*) -> $ret {
                $crate::cudart::NotBuilt::not_built()
            }
        )*
    };
}

/// The value a stub returns: `NOT_BUILT` for status codes, NULL for strings.
pub trait NotBuilt {
    fn not_built() -> Self;
}

impl NotBuilt for cudaError_t {
    fn not_built() -> Self {
        NOT_BUILT
    }
}

impl NotBuilt for *const c_char {
    fn not_built() -> Self {
        std::ptr::null()
    }
}

pub(crate) const cudaSuccess: cudaError_t = 0;
pub(crate) const cudaErrorNoDevice: cudaError_t = 100;
pub(crate) const cudaErrorInsufficientDriver: cudaError_t = 35;
pub(crate) const cudaErrorNotSupported: cudaError_t = 801;
pub(crate) const cudaErrorHostMemoryAlreadyRegistered: cudaError_t = 712;
pub(crate) const cudaErrorInvalidValue: cudaError_t = 1;

pub(crate) const cudaMemcpyHostToDevice: cudaMemcpyKind = 1;
pub(crate) const cudaMemcpyDeviceToHost: cudaMemcpyKind = 2;
pub(crate) const cudaMemcpyDeviceToDevice: cudaMemcpyKind = 3;
pub(crate) const cudaMemcpyDefault: cudaMemcpyKind = 4;

pub(crate) const cudaHostAllocPortable: c_uint = 0x01;
pub(crate) const cudaHostAllocMapped: c_uint = 0x02;
pub(crate) const cudaHostRegisterPortable: c_uint = 0x01;
pub(crate) const cudaHostRegisterMapped: c_uint = 0x02;
pub(crate) const cudaHostRegisterReadOnly: c_uint = 0x08;
pub(crate) const cudaStreamNonBlocking: c_uint = 0x01;
pub(crate) const cudaStreamCaptureModeThreadLocal: cudaStreamCaptureMode = 1;

pub(crate) const cudaDevAttrComputeCapabilityMajor: cudaDeviceAttr = 75;
pub(crate) const cudaDevAttrComputeCapabilityMinor: cudaDeviceAttr = 76;
pub(crate) const cudaDevAttrMultiProcessorCount: cudaDeviceAttr = 16;
pub(crate) const cudaDevAttrIntegrated: cudaDeviceAttr = 18;
pub(crate) const cudaDevAttrCanMapHostMemory: cudaDeviceAttr = 19;
pub(crate) const cudaDevAttrPageableMemoryAccess: cudaDeviceAttr = 88;
pub(crate) const cudaDevAttrCanUseHostPointerForRegisteredMem: cudaDeviceAttr = 91;
pub(crate) const cudaDevAttrPageableMemoryAccessUsesHostPageTables: cudaDeviceAttr = 100;
pub(crate) const cudaDevAttrHostRegisterSupported: cudaDeviceAttr = 99;
pub(crate) const cudaDevAttrHostRegisterReadOnlySupported: cudaDeviceAttr = 113;

cuda_fns! {
    pub fn cudaGetDeviceCount(count: *mut c_int) -> cudaError_t;
    pub fn cudaSetDevice(device: c_int) -> cudaError_t;
    pub fn cudaGetDevice(device: *mut c_int) -> cudaError_t;
    pub fn cudaDeviceGetAttribute(value: *mut c_int, attr: cudaDeviceAttr, device: c_int) -> cudaError_t;
    pub fn cudaDriverGetVersion(version: *mut c_int) -> cudaError_t;
    pub fn cudaRuntimeGetVersion(version: *mut c_int) -> cudaError_t;
    pub fn cudaMemGetInfo(free: *mut usize, total: *mut usize) -> cudaError_t;
    pub fn cudaMalloc(ptr: *mut *mut c_void, size: usize) -> cudaError_t;
    pub fn cudaFree(ptr: *mut c_void) -> cudaError_t;
    pub fn cudaHostAlloc(ptr: *mut *mut c_void, size: usize, flags: c_uint) -> cudaError_t;
    pub fn cudaFreeHost(ptr: *mut c_void) -> cudaError_t;
    pub fn cudaHostRegister(ptr: *mut c_void, size: usize, flags: c_uint) -> cudaError_t;
    pub fn cudaHostUnregister(ptr: *mut c_void) -> cudaError_t;
    pub fn cudaHostGetDevicePointer(device_ptr: *mut *mut c_void, host_ptr: *mut c_void, flags: c_uint) -> cudaError_t;
    pub fn cudaMemcpy(dst: *mut c_void, src: *const c_void, count: usize, kind: cudaMemcpyKind) -> cudaError_t;
    pub fn cudaMemcpyAsync(dst: *mut c_void, src: *const c_void, count: usize, kind: cudaMemcpyKind, stream: cudaStream_t) -> cudaError_t;
    pub fn cudaMemcpy2DAsync(dst: *mut c_void, dpitch: usize, src: *const c_void, spitch: usize, width: usize, height: usize, kind: cudaMemcpyKind, stream: cudaStream_t) -> cudaError_t;
    pub fn cudaMemset(ptr: *mut c_void, value: c_int, count: usize) -> cudaError_t;
    pub fn cudaMemsetAsync(ptr: *mut c_void, value: c_int, count: usize, stream: cudaStream_t) -> cudaError_t;
    pub fn cudaDeviceSynchronize() -> cudaError_t;
    pub fn cudaStreamCreateWithFlags(stream: *mut cudaStream_t, flags: c_uint) -> cudaError_t;
    pub fn cudaStreamDestroy(stream: cudaStream_t) -> cudaError_t;
    pub fn cudaStreamSynchronize(stream: cudaStream_t) -> cudaError_t;
    pub fn cudaEventCreate(event: *mut cudaEvent_t) -> cudaError_t;
    pub fn cudaEventDestroy(event: cudaEvent_t) -> cudaError_t;
    pub fn cudaEventRecord(event: cudaEvent_t, stream: cudaStream_t) -> cudaError_t;
    pub fn cudaEventSynchronize(event: cudaEvent_t) -> cudaError_t;
    pub fn cudaEventElapsedTime(ms: *mut c_float, start: cudaEvent_t, end: cudaEvent_t) -> cudaError_t;
    pub fn cudaStreamBeginCapture(stream: cudaStream_t, mode: cudaStreamCaptureMode) -> cudaError_t;
    pub fn cudaStreamEndCapture(stream: cudaStream_t, graph: *mut cudaGraph_t) -> cudaError_t;
    pub fn cudaGraphInstantiate(exec: *mut cudaGraphExec_t, graph: cudaGraph_t, flags: c_ulonglong) -> cudaError_t;
    pub fn cudaGraphLaunch(exec: cudaGraphExec_t, stream: cudaStream_t) -> cudaError_t;
    pub fn cudaGraphExecDestroy(exec: cudaGraphExec_t) -> cudaError_t;
    pub fn cudaGraphDestroy(graph: cudaGraph_t) -> cudaError_t;
    pub fn cudaGetLastError() -> cudaError_t;
    pub fn cudaGetErrorName(error: cudaError_t) -> *const c_char;
    pub fn cudaGetErrorString(error: cudaError_t) -> *const c_char;
}
