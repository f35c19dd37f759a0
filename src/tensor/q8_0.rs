//! GGUF Q8_0: blocks of 32 values, each a little-endian f16 scale then 32 int8; value = scale * q.

use std::mem::offset_of;

use half::f16;

use super::dot::{LANES, Vector, dot_lanes_of_pairs, f16_bits_to_f32};
use super::{DType, Dtype, Format};

#[allow(non_camel_case_types)]
pub struct Q8_0;

/// ggml's `block_q8_0`, byte for byte (no padding: the scale is kept as bytes).
#[repr(C)]
#[allow(non_camel_case_types)]
pub struct BlockQ8_0 {
    pub scale: [u8; 2],
    pub quants: [i8; Q8_0::BLOCK_VALUES],
}

// The size GGUF files and kernels/formats/q8_0.cuh assume.
const _: () = assert!(size_of::<BlockQ8_0>() == 34);

const QUANTS: usize = offset_of!(BlockQ8_0, quants);
// `dot_lanes` reads a block's quants as two runs of LANES.
const _: () = assert!(Q8_0::BLOCK_VALUES == 2 * LANES);

impl Format for Q8_0 {
    const DTYPE: DType = DType::Q8_0;
    const NAME: &'static str = "Q8_0";
    const GGML_TYPE: u32 = 8;
    const SAFETENSORS: Option<Dtype> = None;
    type Block = BlockQ8_0;
    const BLOCK_VALUES: usize = 32;
    const F16_SCALES: &'static [usize] = &[offset_of!(BlockQ8_0, scale)];

    fn decode_block(block: &[u8], out: &mut [f32]) {
        let scale = f16_bits_to_f32(u16::from_le_bytes([block[0], block[1]]));
        for (v, q) in out.iter_mut().zip(&block[QUANTS..]) {
            *v = scale * (*q as i8) as f32;
        }
    }

    /// A block's scale and quants are read straight from the row and scaled in registers: scale * q is
    /// exact in f32 (11 by 8 significant bits), so each value is the one `decode_block` gives.
    #[inline(always)]
    unsafe fn dot_lanes<V: Vector, const R: usize>(rows: [&[u8]; R], x: &[f32], acc: &mut [V; R]) {
        // SAFETY: the caller runs this inside V's build.
        unsafe { dot_lanes_of_pairs::<BLOCK_BYTES, V, R>(rows, x, acc, decode_in_lanes::<V>) }
    }

    /// As llama.cpp quantizes: scale = max|x| / 127, each value rounded to the nearest step.
    fn encode_block(values: &[f32], out: &mut Vec<u8>) {
        let amax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(scale).to_le_bytes());
        out.extend(values.iter().map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8));
    }
}

const BLOCK_BYTES: usize = size_of::<BlockQ8_0>();

/// A block's two runs of LANES values in registers.
///
/// # Safety
/// Inside V's build (see `Vector`).
#[inline(always)]
unsafe fn decode_in_lanes<V: Vector>(block: &[u8; BLOCK_BYTES]) -> (V, V) {
    let quants = block[QUANTS..].as_chunks::<LANES>().0;
    // SAFETY: the caller runs this inside V's build.
    unsafe {
        let scale = V::splat_f16_bytes([block[0], block[1]]);
        (V::from_i8_bytes(&quants[0]).mul(scale), V::from_i8_bytes(&quants[1]).mul(scale))
    }
}

#[cfg(test)]
mod tests {
    use crate::tensor::{DType, Format, Q8_0, decode_row, encode_row};

    #[test]
    fn round_trip_stays_within_half_a_step() {
        let n = 2 * Q8_0::BLOCK_VALUES;
        let values: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let bytes = encode_row(DType::Q8_0, &values);
        assert_eq!(bytes.len(), 2 * size_of::<<Q8_0 as Format>::Block>());
        let mut back = vec![0f32; n];
        decode_row(DType::Q8_0, &bytes, &mut back);
        for (block, back) in values.chunks(Q8_0::BLOCK_VALUES).zip(back.chunks(Q8_0::BLOCK_VALUES)) {
            let step = block.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            for (a, b) in block.iter().zip(back) {
                assert!((a - b).abs() <= step * 0.5 + 1e-3 * step, "{a} vs {b} (step {step})");
            }
        }
    }
}
