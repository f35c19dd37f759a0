//! GGUF Q4_0: blocks of 32 values, a little-endian f16 scale then 16 bytes of 4-bit quants (value j in
//! the low nibble of byte j, value j + 16 in its high nibble); value = scale * (q - 8).

use std::mem::offset_of;

use super::dot::{LANES, Vector, dot_lanes_of_pairs};
use super::{DType, Dtype, Format, f16_at, f16_le, signed_absmax};

#[allow(non_camel_case_types)]
pub struct Q4_0;

/// ggml's `block_q4_0`, byte for byte.
#[repr(C)]
#[allow(non_camel_case_types)]
pub struct BlockQ4_0 {
    pub scale: [u8; 2],
    pub quants: [u8; Q4_0::BLOCK_VALUES / 2],
}

// The size GGUF files and the device formats assume.
const _: () = assert!(size_of::<BlockQ4_0>() == 18);

const QUANTS: usize = offset_of!(BlockQ4_0, quants);

impl Format for Q4_0 {
    const DTYPE: DType = DType::Q4_0;
    const NAME: &'static str = "Q4_0";
    const GGML_TYPE: u32 = 2;
    const SAFETENSORS: Option<Dtype> = None;
    type Block = BlockQ4_0;
    const BLOCK_VALUES: usize = 32;
    const F16_SCALES: &'static [usize] = &[offset_of!(BlockQ4_0, scale)];

    fn decode_block(block: &[u8], out: &mut [f32]) {
        let scale = f16_at(block, 0);
        let (low, high) = out.split_at_mut(16);
        for ((lo, hi), q) in low.iter_mut().zip(high).zip(&block[QUANTS..]) {
            *lo = ((q & 0x0F) as i32 - 8) as f32 * scale;
            *hi = ((q >> 4) as i32 - 8) as f32 * scale;
        }
    }

    /// The block decoded in registers (`decode_in_lanes`), each value the one `decode_block` gives.
    #[inline(always)]
    unsafe fn dot_lanes<V: Vector, const R: usize>(rows: [&[u8]; R], x: &[f32], acc: &mut [V; R]) {
        // SAFETY: the caller runs this inside V's build.
        unsafe { dot_lanes_of_pairs::<BLOCK_BYTES, V, R>(rows, x, acc, decode_in_lanes::<V>) }
    }

    /// As llama.cpp's reference quantizer: scale = (the value of largest magnitude) / -8, each value
    /// truncated after adding 8.5 to its scaled value, at most 15.
    fn encode_block(values: &[f32], out: &mut Vec<u8>) {
        let scale = signed_absmax(values) / -8.0;
        let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        out.extend_from_slice(&f16_le(scale));
        let quant = |v: f32| ((v * inv + 8.5) as i8).clamp(0, 15) as u8;
        let (low, high) = values.split_at(16);
        out.extend(low.iter().zip(high).map(|(&lo, &hi)| quant(lo) | quant(hi) << 4));
    }
}

const BLOCK_BYTES: usize = size_of::<BlockQ4_0>();
// `decode_in_lanes` reads the quants as one run of LANES bytes: low nibbles first, then high.
const _: () = assert!(BLOCK_BYTES - QUANTS == LANES);

/// A block's two runs of LANES values in registers: (q - 8) * scale, each step exact in f32 (4 by 11
/// significant bits): the value `decode_block` gives.
///
/// # Safety
/// Inside V's build (see `Vector`).
#[inline(always)]
unsafe fn decode_in_lanes<V: Vector>(block: &[u8; BLOCK_BYTES]) -> (V, V) {
    let quants = block[QUANTS..].first_chunk::<LANES>().expect("a block's quants are LANES bytes");
    // SAFETY: the caller runs this inside V's build.
    unsafe {
        let scale = V::splat_f16_bytes([block[0], block[1]]);
        let minus_8 = V::splat(-8.0);
        (V::from_low_nibbles(quants).add(minus_8).mul(scale), V::from_high_nibbles(quants).add(minus_8).mul(scale))
    }
}
