//! The prompt path on the GPU: the tensor-core product, the weight conversion, the half-format writers
//! and flash attention against the CPU oracle on fresh random data with poisoned outputs; then whole
//! prompts (2,048 tokens on each architecture, 32,768 on a small model, chunk boundaries) against the
//! CPU backend and against stepping the same prompt one token at a time. Skips where no CUDA device is
//! present. Run it once more with HOSTEMBED_CUBLASLT=0 to cover the library's own product kernel.

#[path = "../common/mod.rs"]
mod common;

mod flash;
mod products;
mod prompts;

use hostembed::cuda::DeviceBuffer;
use hostembed::tensor::{DType, decode_row, encode_row};
use hostembed::tuning::Tuning;
use hostembed::{cuda, kernels as kn};
use std::os::raw::{c_int, c_void};
use std::ptr;

/// The launchers' settings as the environment gives them (what an engine would run with).
fn launch_tuning() -> kn::hostembed_tuning {
    kn::hostembed_tuning::of(&Tuning::from_env())
}

const NULL_STREAM: *mut c_void = ptr::null_mut();

fn ok(code: c_int, what: &str) {
    cuda::check(code, what).unwrap_or_else(|e| panic!("{what}: {e}"));
    cuda::synchronize().unwrap_or_else(|e| panic!("{what} while running: {e}"));
}

fn poisoned(bytes: usize) -> DeviceBuffer {
    let b = DeviceBuffer::new(bytes.max(1)).unwrap();
    b.fill_bytes(0xFF).unwrap();
    b
}

fn download<T: Copy + Default>(b: &DeviceBuffer, n: usize) -> Vec<T> {
    let mut out = vec![T::default(); n];
    b.download(&mut out).unwrap();
    out
}

/// Values of a half format (2 bytes each, little-endian) as f32.
fn halves_to_f32(dtype: DType, bits: &[u16]) -> Vec<f32> {
    let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
    let mut out = vec![0f32; bits.len()];
    decode_row(dtype, &bytes, &mut out);
    out
}

/// `values` rounded to the half format, as its bits and as the f32 they now are.
fn to_half(dtype: DType, values: &[f32]) -> (Vec<u16>, Vec<f32>) {
    let bytes = encode_row(dtype, values);
    let bits: Vec<u16> = bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
    let back = halves_to_f32(dtype, &bits);
    (bits, back)
}

fn finite(what: &str, v: &[f32]) {
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        panic!("{what}: element {i} of {} is {} (not written?)", v.len(), v[i]);
    }
}

const HALVES: [DType; 2] = [DType::Bf16, DType::F16];
