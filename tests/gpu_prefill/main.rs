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

use common::launch::{NULL_STREAM, download, launch_tuning, ok, poisoned};
use hostembed::tensor::{DType, decode_row, encode_row};

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
