//! GGUF Q5_1: blocks of 32 values, a little-endian f16 scale and f16 minimum, 4 bytes holding the fifth
//! bit of each value, then 16 bytes of low nibbles (as Q5_0); value = scale * q + min.

use std::mem::offset_of;

use super::q5_0::push_five_bit;
use super::{DType, Dtype, Format, f16_at, f16_le, min_max};

#[allow(non_camel_case_types)]
pub struct Q5_1;

/// ggml's `block_q5_1`, byte for byte.
#[repr(C)]
#[allow(non_camel_case_types)]
pub struct BlockQ5_1 {
    pub scale: [u8; 2],
    pub min: [u8; 2],
    pub high_bits: [u8; 4],
    pub quants: [u8; Q5_1::BLOCK_VALUES / 2],
}

// The size GGUF files and the device formats assume.
const _: () = assert!(size_of::<BlockQ5_1>() == 24);

const MIN: usize = offset_of!(BlockQ5_1, min);
const HIGH_BITS: usize = offset_of!(BlockQ5_1, high_bits);
const QUANTS: usize = offset_of!(BlockQ5_1, quants);

impl Format for Q5_1 {
    const DTYPE: DType = DType::Q5_1;
    const NAME: &'static str = "Q5_1";
    const GGML_TYPE: u32 = 7;
    const SAFETENSORS: Option<Dtype> = None;
    type Block = BlockQ5_1;
    const BLOCK_VALUES: usize = 32;
    const F16_SCALES: &'static [usize] = &[offset_of!(BlockQ5_1, scale), offset_of!(BlockQ5_1, min)];

    fn decode_block(block: &[u8], out: &mut [f32]) {
        let (scale, min) = (f16_at(block, 0), f16_at(block, MIN));
        let high = u32::from_le_bytes(block[HIGH_BITS..HIGH_BITS + 4].try_into().expect("4 bytes"));
        for (j, q) in block[QUANTS..QUANTS + 16].iter().enumerate() {
            let lo = (q & 0x0F) as u32 | (high >> j & 1) << 4;
            let hi = (q >> 4) as u32 | (high >> (j + 16) & 1) << 4;
            out[j] = lo as f32 * scale + min;
            out[j + 16] = hi as f32 * scale + min;
        }
    }

    /// As llama.cpp's reference quantizer: scale = (max - min) / 31, each value's distance from the
    /// minimum rounded half up, at most 31.
    fn encode_block(values: &[f32], out: &mut Vec<u8>) {
        let (min, max) = min_max(values);
        let scale = (max - min) / 31.0;
        let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        let quants: Vec<u8> = values.iter().map(|v| (((v - min) * inv + 0.5) as u8).min(31)).collect();
        out.extend_from_slice(&f16_le(scale));
        out.extend_from_slice(&f16_le(min));
        push_five_bit(&quants, out);
    }
}
