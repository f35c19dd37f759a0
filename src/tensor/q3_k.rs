//! GGUF Q3_K: super-blocks of 256 values in 16 sub-blocks of 16, each with a signed 6-bit scale
//! (stored + 32) relative to the super-block's f16 `d`; value = d * (scale - 32) * (q - 4), q in 0..=7,
//! its low two bits packed as Q2_K's and its third bit in `hmask`.

use std::mem::offset_of;

use super::dot::{Lanes, Vector, dot_lanes_by_blocks};
use super::k_quants::{
    BYTES_LOW1, BYTES_LOW2, SUPER_BLOCK, le_word, make_q3_quants, nearest_int, pack_two_bit, sixteen_bytes,
};
use super::{DType, Dtype, Format, f16_at, f16_le, f16_round};

#[allow(non_camel_case_types)]
pub struct Q3_K;

/// ggml's `block_q3_K`, byte for byte.
#[repr(C)]
#[allow(non_camel_case_types)]
pub struct BlockQ3_K {
    /// Third bits: value v's in byte v % 32, bit v / 32.
    pub hmask: [u8; SUPER_BLOCK / 8],
    /// Low two bits, as Q2_K packs them.
    pub quants: [u8; SUPER_BLOCK / 4],
    /// Sixteen 6-bit scales: low nibbles in bytes 0-7 (sub-blocks 0-7 low, 8-15 high), top bit pairs in
    /// bytes 8-11 (sub-block j in byte 8 + j % 4 at bit 2 * (j / 4)).
    pub scales: [u8; 12],
    pub d: [u8; 2],
}

// The size GGUF files and the device formats assume.
const _: () = assert!(size_of::<BlockQ3_K>() == 110);

const QUANTS: usize = offset_of!(BlockQ3_K, quants);
const SCALES: usize = offset_of!(BlockQ3_K, scales);
const D: usize = offset_of!(BlockQ3_K, d);

/// Sub-block j's scale, less 32, from the 12 packed bytes.
fn scale(packed: &[u8], j: usize) -> i32 {
    let low = if j < 8 { packed[j] & 0x0F } else { packed[j - 8] >> 4 };
    let high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
    (low | high << 4) as i32 - 32
}

impl Format for Q3_K {
    const DTYPE: DType = DType::Q3_K;
    const NAME: &'static str = "Q3_K";
    const GGML_TYPE: u32 = 11;
    const SAFETENSORS: Option<Dtype> = None;
    type Block = BlockQ3_K;
    const BLOCK_VALUES: usize = SUPER_BLOCK;
    const F16_SCALES: &'static [usize] = &[offset_of!(BlockQ3_K, d)];

    fn decode_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, D);
        let packed = &block[SCALES..SCALES + 12];
        for (sub, out) in out.chunks_exact_mut(16).enumerate() {
            // As Q2_K: half sub / 8, bit pair (sub / 2) % 4; the third bit is bit sub / 2 of hmask.
            let offset = 16 * (sub % 2);
            let bytes = &block[QUANTS + 32 * (sub / 8) + offset..][..16];
            let high = &block[offset..offset + 16];
            let (shift, bit) = (2 * (sub / 2 % 4), sub / 2);
            let dl = d * scale(packed, sub) as f32;
            for ((v, q), h) in out.iter_mut().zip(bytes).zip(high) {
                let q = (q >> shift & 3) as i32 - if h >> bit & 1 != 0 { 0 } else { 4 };
                *v = dl * q as f32;
            }
        }
    }

    /// Each sub-block's three-bit quants assembled eight at a time in a u64 (a bit pair, and the
    /// sub-block's bit of `hmask` as bit 2), widened in registers, then (q - 4) * dl: every step exact in
    /// f32 (dl is 11 by 6 significant bits), so each value is the one `decode_block` gives.
    #[inline(always)]
    unsafe fn dot_lanes<V: Vector, const R: usize>(rows: [&[u8]; R], x: &[f32], acc: &mut [V; R]) {
        // SAFETY: the caller runs this inside V's build.
        unsafe { dot_lanes_by_blocks::<SUPER_BLOCK, BLOCK_BYTES, V, R>(rows, x, acc, |b, x, acc| block_dot(b, x, acc)) }
    }

    /// As llama.cpp's `quantize_row_q3_K_ref`: each sub-block fitted by `make_q3_quants`, the 16 scales
    /// quantized to 6 bits against the one of largest magnitude, then every value requantized against
    /// its sub-block's stored scale.
    fn encode_block(values: &[f32], out: &mut Vec<u8>) {
        let mut levels = [0i8; SUPER_BLOCK];
        let mut scales = [0f32; 16];
        let (mut max_scale, mut amax) = (0f32, 0f32);
        for (j, x) in values.chunks_exact(16).enumerate() {
            scales[j] = make_q3_quants(4, x, &mut levels[16 * j..16 * j + 16]);
            if scales[j].abs() > amax {
                amax = scales[j].abs();
                max_scale = scales[j];
            }
        }
        let mut packed = [0u8; 12];
        let mut d = 0f32;
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for (j, s) in scales.iter().enumerate() {
                let l = ((nearest_int(iscale * s) as i8).clamp(-32, 31) + 32) as u8;
                if j < 8 {
                    packed[j] = l & 0x0F;
                } else {
                    packed[j - 8] |= (l & 0x0F) << 4;
                }
                packed[8 + j % 4] |= (l >> 4) << (2 * (j / 4));
            }
            d = 1.0 / iscale;
        }
        let d_stored = f16_round(d);
        for (j, x) in values.chunks_exact(16).enumerate() {
            let dl = d_stored * scale(&packed, j) as f32;
            if dl == 0.0 {
                continue;
            }
            for (q, v) in levels[16 * j..16 * j + 16].iter_mut().zip(x) {
                *q = (nearest_int(v / dl).clamp(-4, 3) + 4) as i8;
            }
        }
        let mut hmask = [0u8; SUPER_BLOCK / 8];
        let mut low = [0u8; SUPER_BLOCK];
        for (v, (&l, low)) in levels.iter().zip(&mut low).enumerate() {
            let l = l as u8;
            if l > 3 {
                hmask[v % 32] |= 1 << (v / 32);
            }
            *low = l & 3;
        }
        out.extend_from_slice(&hmask);
        pack_two_bit(&low, out);
        out.extend_from_slice(&packed);
        out.extend_from_slice(&f16_le(d));
    }
}

const BLOCK_BYTES: usize = size_of::<BlockQ3_K>();

/// One super-block's products (`Format::dot_lanes` above says how its values are made), multiply-added
/// into a row's lanes; `x` is the block's columns in runs of LANES.
///
/// # Safety
/// Inside V's build (see `Vector`).
#[inline(always)]
unsafe fn block_dot<V: Vector>(block: &[u8; BLOCK_BYTES], x: &[Lanes], acc: &mut V) {
    // SAFETY: the caller runs this inside V's build.
    unsafe {
        let minus_4 = V::splat(-4.0);
        let d = f16_at(block, D);
        let packed = &block[SCALES..SCALES + 12];
        for (sub, x) in x.iter().enumerate() {
            let offset = 16 * (sub % 2);
            let bytes = QUANTS + 32 * (sub / 8) + offset;
            let (shift, bit) = (2 * (sub / 2 % 4), sub / 2);
            let q = sixteen_bytes(|i| {
                (le_word(block, bytes + i) >> shift & BYTES_LOW2)
                    | (le_word(block, offset + i) >> bit & BYTES_LOW1) << 2
            });
            let dl = V::splat(d * scale(packed, sub) as f32);
            *acc = acc.fma(V::from_u8_bytes(&q).add(minus_4).mul(dl), V::load(x));
        }
    }
}
