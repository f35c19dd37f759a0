//! The C launchers in kernels/*.cu, declared by hand like the runtime (build.rs checks them
//! against kernels/hostembed_kernels.cuh). Each launches on the given stream and returns
//! cudaGetLastError(); none synchronizes.
#![allow(dead_code)]

use crate::cuda_fns;
use crate::cudart::{cudaError_t, cudaStream_t};
use std::os::raw::{c_char, c_int, c_void};

cuda_fns! {
    pub fn hostembed_device_name(device: c_int, name: *mut c_char, len: usize) -> cudaError_t;
}

// Silences the unused-import lint until a launcher takes these.
const _: Option<(cudaStream_t, *const c_void)> = None;
