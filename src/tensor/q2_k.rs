//! GGUF Q2_K: super-blocks of 256 values in 16 sub-blocks of 16. Each sub-block has a 4-bit scale and
//! a 4-bit minimum (one byte, scale in the low nibble), relative to the super-block's f16 `d` and
//! `dmin`; value = d * scale * q - dmin * min, q in 0..=3.

use std::mem::offset_of;

use super::dot::{Lanes, Vector, dot_lanes_by_blocks};
use super::k_quants::{BYTES_LOW2, SUPER_BLOCK, le_word, make_qkx2_quants, nearest_int, pack_two_bit, sixteen_bytes};
use super::{DType, Dtype, Format, f16_at, f16_le, f16_round};

#[allow(non_camel_case_types)]
pub struct Q2_K;

/// ggml's `block_q2_K`, byte for byte.
#[repr(C)]
#[allow(non_camel_case_types)]
pub struct BlockQ2_K {
    /// Per sub-block: scale in the low nibble, minimum in the high nibble.
    pub scales: [u8; SUPER_BLOCK / 16],
    /// Two-bit quants: in each half of 128 values, byte l holds values l, l+32, l+64, l+96.
    pub quants: [u8; SUPER_BLOCK / 4],
    pub d: [u8; 2],
    pub dmin: [u8; 2],
}

// The size GGUF files and the device formats assume.
const _: () = assert!(size_of::<BlockQ2_K>() == 84);

const QUANTS: usize = offset_of!(BlockQ2_K, quants);
const D: usize = offset_of!(BlockQ2_K, d);
const DMIN: usize = offset_of!(BlockQ2_K, dmin);

impl Format for Q2_K {
    const DTYPE: DType = DType::Q2_K;
    const NAME: &'static str = "Q2_K";
    const GGML_TYPE: u32 = 10;
    const SAFETENSORS: Option<Dtype> = None;
    type Block = BlockQ2_K;
    const BLOCK_VALUES: usize = SUPER_BLOCK;
    const F16_SCALES: &'static [usize] = &[offset_of!(BlockQ2_K, d), offset_of!(BlockQ2_K, dmin)];

    fn decode_block(block: &[u8], out: &mut [f32]) {
        let (d, dmin) = (f16_at(block, D), f16_at(block, DMIN));
        for (sub, (out, &packed)) in out.chunks_exact_mut(16).zip(&block[..QUANTS]).enumerate() {
            // Sub-block s lies in half s / 8, bit pair (s / 2) % 4, bytes 16 * (s % 2) .. + 16.
            let bytes = &block[QUANTS + 32 * (sub / 8) + 16 * (sub % 2)..][..16];
            let shift = 2 * (sub / 2 % 4);
            let scale = d * (packed & 0x0F) as f32;
            let min = dmin * (packed >> 4) as f32;
            for (v, q) in out.iter_mut().zip(bytes) {
                *v = scale * (q >> shift & 3) as f32 - min;
            }
        }
    }

    /// Each sub-block's bit pairs taken eight bytes at a time from a u64, widened in registers: d * scale
    /// and dmin * min are exact in f32 (11 by 4 significant bits), and so is their product with a
    /// quant, so q * scale - min rounds once, as `decode_block` rounds it.
    #[inline(always)]
    unsafe fn dot_lanes<V: Vector, const R: usize>(rows: [&[u8]; R], x: &[f32], acc: &mut [V; R]) {
        // SAFETY: the caller runs this inside V's build.
        unsafe { dot_lanes_by_blocks::<SUPER_BLOCK, BLOCK_BYTES, V, R>(rows, x, acc, |b, x, acc| block_dot(b, x, acc)) }
    }

    /// As llama.cpp's `quantize_row_q2_K_ref`: each sub-block fitted by `make_qkx2_quants` (|x|
    /// weights, absolute error), the 16 scales and minimums each quantized to 4 bits against their
    /// largest, then every value requantized against its sub-block's stored scale and minimum.
    fn encode_block(values: &[f32], out: &mut Vec<u8>) {
        let mut quants = [0u8; SUPER_BLOCK];
        let mut scales = [0f32; 16];
        let mut mins = [0f32; 16];
        let (mut max_scale, mut max_min) = (0f32, 0f32);
        for (j, x) in values.chunks_exact(16).enumerate() {
            let weights: [f32; 16] = std::array::from_fn(|l| x[l].abs());
            let quants = &mut quants[16 * j..16 * j + 16];
            (scales[j], mins[j]) = make_qkx2_quants(3, x, &weights, quants, -0.5, 0.1, 15, true);
            max_scale = if scales[j] > max_scale { scales[j] } else { max_scale };
            max_min = if mins[j] > max_min { mins[j] } else { max_min };
        }
        let mut packed = [0u8; 16];
        let mut d = 0f32;
        if max_scale > 0.0 {
            let iscale = 15.0 / max_scale;
            for (p, s) in packed.iter_mut().zip(&scales) {
                *p = nearest_int(iscale * s) as u8;
            }
            d = max_scale / 15.0;
        }
        let mut dmin = 0f32;
        if max_min > 0.0 {
            let iscale = 15.0 / max_min;
            for (p, m) in packed.iter_mut().zip(&mins) {
                *p |= (nearest_int(iscale * m) << 4) as u8;
            }
            dmin = max_min / 15.0;
        }
        let (d_stored, dmin_stored) = (f16_round(d), f16_round(dmin));
        for (j, x) in values.chunks_exact(16).enumerate() {
            let scale = d_stored * (packed[j] & 0x0F) as f32;
            if scale == 0.0 {
                continue;
            }
            let min = dmin_stored * (packed[j] >> 4) as f32;
            for (q, v) in quants[16 * j..16 * j + 16].iter_mut().zip(x) {
                *q = nearest_int((v + min) / scale).clamp(0, 3) as u8;
            }
        }
        out.extend_from_slice(&packed);
        pack_two_bit(&quants, out);
        out.extend_from_slice(&f16_le(d));
        out.extend_from_slice(&f16_le(dmin));
    }
}

const BLOCK_BYTES: usize = size_of::<BlockQ2_K>();

/// One super-block's products (`Format::dot_lanes` above says how its values are made), multiply-added
/// into a row's lanes; `x` is the block's columns in runs of LANES.
///
/// # Safety
/// Inside V's build (see `Vector`).
#[inline(always)]
unsafe fn block_dot<V: Vector>(block: &[u8; BLOCK_BYTES], x: &[Lanes], acc: &mut V) {
    // SAFETY: the caller runs this inside V's build.
    unsafe {
        let (d, dmin) = (f16_at(block, D), f16_at(block, DMIN));
        for (sub, x) in x.iter().enumerate() {
            let packed = block[sub];
            let scale = V::splat(d * (packed & 0x0F) as f32);
            let neg_min = V::splat(-(dmin * (packed >> 4) as f32));
            let (bytes, shift) = (QUANTS + 32 * (sub / 8) + 16 * (sub % 2), 2 * (sub / 2 % 4));
            let q = sixteen_bytes(|i| le_word(block, bytes + i) >> shift & BYTES_LOW2);
            *acc = acc.fma(neg_min.fma(V::from_u8_bytes(&q), scale), V::load(x));
        }
    }
}
