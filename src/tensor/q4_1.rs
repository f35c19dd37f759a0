//! GGUF Q4_1: blocks of 32 values, a little-endian f16 scale and f16 minimum, then 16 bytes of 4-bit
//! quants (value j in the low nibble of byte j, value j + 16 in its high nibble); value = scale * q + min.

use std::mem::offset_of;

use super::dot::{LANES, Vector, dot_lanes_of_pairs};
use super::{DType, Dtype, Format, f16_at, f16_le, min_max};

#[allow(non_camel_case_types)]
pub struct Q4_1;

/// ggml's `block_q4_1`, byte for byte.
#[repr(C)]
#[allow(non_camel_case_types)]
pub struct BlockQ4_1 {
    pub scale: [u8; 2],
    pub min: [u8; 2],
    pub quants: [u8; Q4_1::BLOCK_VALUES / 2],
}

// The size GGUF files and the device formats assume.
const _: () = assert!(size_of::<BlockQ4_1>() == 20);

const MIN: usize = offset_of!(BlockQ4_1, min);
const QUANTS: usize = offset_of!(BlockQ4_1, quants);

impl Format for Q4_1 {
    const DTYPE: DType = DType::Q4_1;
    const NAME: &'static str = "Q4_1";
    const GGML_TYPE: u32 = 3;
    const SAFETENSORS: Option<Dtype> = None;
    type Block = BlockQ4_1;
    const BLOCK_VALUES: usize = 32;
    const F16_SCALES: &'static [usize] = &[offset_of!(BlockQ4_1, scale), offset_of!(BlockQ4_1, min)];

    fn decode_block(block: &[u8], out: &mut [f32]) {
        let (scale, min) = (f16_at(block, 0), f16_at(block, MIN));
        let (low, high) = out.split_at_mut(16);
        for ((lo, hi), q) in low.iter_mut().zip(high).zip(&block[QUANTS..]) {
            *lo = (q & 0x0F) as f32 * scale + min;
            *hi = (q >> 4) as f32 * scale + min;
        }
    }

    /// The block decoded in registers (`decode_in_lanes`), each value the one `decode_block` gives.
    #[inline(always)]
    unsafe fn dot_lanes<V: Vector, const R: usize>(rows: [&[u8]; R], x: &[f32], acc: &mut [V; R]) {
        // SAFETY: the caller runs this inside V's build.
        unsafe { dot_lanes_of_pairs::<BLOCK_BYTES, V, R>(rows, x, acc, decode_in_lanes::<V>) }
    }

    /// As llama.cpp's reference quantizer: scale = (max - min) / 15, each value's distance from the
    /// minimum rounded half up, at most 15.
    fn encode_block(values: &[f32], out: &mut Vec<u8>) {
        let (min, max) = min_max(values);
        let scale = (max - min) / 15.0;
        let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        out.extend_from_slice(&f16_le(scale));
        out.extend_from_slice(&f16_le(min));
        let quant = |v: f32| (((v - min) * inv + 0.5) as i8).clamp(0, 15) as u8;
        let (low, high) = values.split_at(16);
        out.extend(low.iter().zip(high).map(|(&lo, &hi)| quant(lo) | quant(hi) << 4));
    }
}

const BLOCK_BYTES: usize = size_of::<BlockQ4_1>();
// `decode_in_lanes` reads the quants as one run of LANES bytes: low nibbles first, then high.
const _: () = assert!(BLOCK_BYTES - QUANTS == LANES);

/// A block's two runs of LANES values in registers: q * scale + min, the product exact in f32 (4 by 11
/// significant bits), so fused with the add or not it rounds once, to the value `decode_block` gives.
///
/// # Safety
/// Inside V's build (see `Vector`).
#[inline(always)]
unsafe fn decode_in_lanes<V: Vector>(block: &[u8; BLOCK_BYTES]) -> (V, V) {
    let quants = block[QUANTS..].first_chunk::<LANES>().expect("a block's quants are LANES bytes");
    // SAFETY: the caller runs this inside V's build.
    unsafe {
        let scale = V::splat_f16_bytes([block[0], block[1]]);
        let min = V::splat_f16_bytes([block[MIN], block[MIN + 1]]);
        (min.fma(V::from_low_nibbles(quants), scale), min.fma(V::from_high_nibbles(quants), scale))
    }
}
