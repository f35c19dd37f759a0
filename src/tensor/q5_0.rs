//! GGUF Q5_0: blocks of 32 values, a little-endian f16 scale, 4 bytes holding the fifth bit of each
//! value (bit j of the little-endian u32 for value j), then 16 bytes of low nibbles (value j in byte j's
//! low nibble, value j + 16 in its high nibble); value = scale * (q - 16).

use std::mem::offset_of;

use super::{DType, Dtype, Format, f16_at, f16_le, signed_absmax};

#[allow(non_camel_case_types)]
pub struct Q5_0;

/// ggml's `block_q5_0`, byte for byte.
#[repr(C)]
#[allow(non_camel_case_types)]
pub struct BlockQ5_0 {
    pub scale: [u8; 2],
    pub high_bits: [u8; 4],
    pub quants: [u8; Q5_0::BLOCK_VALUES / 2],
}

// The size GGUF files and the device formats assume.
const _: () = assert!(size_of::<BlockQ5_0>() == 22);

const HIGH_BITS: usize = offset_of!(BlockQ5_0, high_bits);
const QUANTS: usize = offset_of!(BlockQ5_0, quants);

impl Format for Q5_0 {
    const DTYPE: DType = DType::Q5_0;
    const NAME: &'static str = "Q5_0";
    const GGML_TYPE: u32 = 6;
    const SAFETENSORS: Option<Dtype> = None;
    type Block = BlockQ5_0;
    const BLOCK_VALUES: usize = 32;
    const F16_SCALES: &'static [usize] = &[offset_of!(BlockQ5_0, scale)];

    fn decode_block(block: &[u8], out: &mut [f32]) {
        let scale = f16_at(block, 0);
        let high = u32::from_le_bytes(block[HIGH_BITS..HIGH_BITS + 4].try_into().expect("4 bytes"));
        for (j, q) in block[QUANTS..QUANTS + 16].iter().enumerate() {
            let lo = (q & 0x0F) as u32 | (high >> j & 1) << 4;
            let hi = (q >> 4) as u32 | (high >> (j + 16) & 1) << 4;
            out[j] = (lo as i32 - 16) as f32 * scale;
            out[j + 16] = (hi as i32 - 16) as f32 * scale;
        }
    }

    /// As llama.cpp's reference quantizer: scale = (the value of largest magnitude) / -16, each value
    /// truncated after adding 16.5 to its scaled value, at most 31.
    fn encode_block(values: &[f32], out: &mut Vec<u8>) {
        let scale = signed_absmax(values) / -16.0;
        let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        let quants: Vec<u8> = values.iter().map(|v| ((v * inv + 16.5) as i8).clamp(0, 31) as u8).collect();
        out.extend_from_slice(&f16_le(scale));
        push_five_bit(&quants, out);
    }
}

/// Appends 32 five-bit quants as Q5_0 and Q5_1 store them: the fifth bits as a little-endian u32, then
/// the low nibbles of values j and j + 16 in byte j.
pub(super) fn push_five_bit(quants: &[u8], out: &mut Vec<u8>) {
    let high = quants.iter().enumerate().fold(0u32, |bits, (j, q)| bits | ((q >> 4 & 1) as u32) << j);
    out.extend_from_slice(&high.to_le_bytes());
    let (low, upper) = quants.split_at(16);
    out.extend(low.iter().zip(upper).map(|(lo, hi)| (lo & 0x0F) | (hi & 0x0F) << 4));
}
