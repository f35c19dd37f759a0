//! The C launchers in kernels/*.cu, declared by hand like the runtime (build.rs checks them
//! against kernels/hostembed_kernels.cuh). Each launches on the given stream and returns
//! cudaGetLastError(); none synchronizes.
#![allow(dead_code)]

use crate::cuda_fns;
use crate::cudart::{cudaError_t, cudaStream_t};
use std::os::raw::{c_char, c_int, c_uint, c_void};

cuda_fns! {
    // embed.cu
    pub fn hostembed_embed_gather(rows: *const c_void, dtype: c_int, vocab: c_uint, cols: c_uint, ids: *const c_int, n: c_uint, out: *mut c_void, out_dtype: c_int, bad: *mut c_int, stream: cudaStream_t) -> cudaError_t;
    // decode kernels
    // device.cu
    pub fn hostembed_device_name(device: c_int, name: *mut c_char, len: usize) -> cudaError_t;
}
