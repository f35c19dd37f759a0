//! GGUF Q5_K: super-blocks of 256 values in 8 sub-blocks of 32, scales and minimums as Q4_K; value =
//! d * scale * q - dmin * min, q in 0..=31: its low four bits as Q4_K packs them, its fifth bit in `qh`
//! (value 64c + l: byte l % 32, bit 2c + l / 32).

use std::mem::offset_of;

use super::dot::{Lanes, Vector, dot_lanes_by_blocks};
use super::k_quants::{BYTES_LOW1, BYTES_LOW4, SUPER_BLOCK, le_word, scale_min_block_dot, scale_min_k4, sixteen_bytes};
use super::q4_k::encode_scale_min;
use super::{DType, Dtype, Format, f16_at};

#[allow(non_camel_case_types)]
pub struct Q5_K;

/// ggml's `block_q5_K`, byte for byte.
#[repr(C)]
#[allow(non_camel_case_types)]
pub struct BlockQ5_K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    /// Eight 6-bit scales and minimums, as `k_quants::scale_min_k4` reads them.
    pub scales: [u8; 12],
    pub qh: [u8; SUPER_BLOCK / 8],
    pub quants: [u8; SUPER_BLOCK / 2],
}

// The size GGUF files and the device formats assume.
const _: () = assert!(size_of::<BlockQ5_K>() == 176);

const DMIN: usize = offset_of!(BlockQ5_K, dmin);
const SCALES: usize = offset_of!(BlockQ5_K, scales);
const QH: usize = offset_of!(BlockQ5_K, qh);
const QUANTS: usize = offset_of!(BlockQ5_K, quants);

impl Format for Q5_K {
    const DTYPE: DType = DType::Q5_K;
    const NAME: &'static str = "Q5_K";
    const GGML_TYPE: u32 = 13;
    const SAFETENSORS: Option<Dtype> = None;
    type Block = BlockQ5_K;
    const BLOCK_VALUES: usize = SUPER_BLOCK;
    const F16_SCALES: &'static [usize] = &[offset_of!(BlockQ5_K, d), offset_of!(BlockQ5_K, dmin)];

    fn decode_block(block: &[u8], out: &mut [f32]) {
        let (d, dmin) = (f16_at(block, 0), f16_at(block, DMIN));
        let packed = &block[SCALES..SCALES + 12];
        let qh = &block[QH..QH + 32];
        for (sub, out) in out.chunks_exact_mut(32).enumerate() {
            let (sc, m) = scale_min_k4(sub, packed);
            let (scale, min) = (d * sc as f32, dmin * m as f32);
            let shift = 4 * (sub % 2);
            let low = &block[QUANTS + 32 * (sub / 2)..][..32];
            for ((v, q), h) in out.iter_mut().zip(low).zip(qh) {
                let q = (q >> shift & 0x0F) as u32 + if h >> sub & 1 != 0 { 16 } else { 0 };
                *v = scale * q as f32 - min;
            }
        }
    }

    /// Each sub-block's five-bit quants assembled eight at a time in a u64 (a nibble, and the sub-block's
    /// bit of `qh` as bit 4), widened in registers: d * scale and dmin * min are exact in f32 (11 by 6
    /// significant bits), and so is their product with a quant, so q * scale - min rounds once, as
    /// `decode_block` rounds it.
    #[inline(always)]
    unsafe fn dot_lanes<V: Vector, const R: usize>(rows: [&[u8]; R], x: &[f32], acc: &mut [V; R]) {
        // SAFETY: the caller runs this inside V's build.
        unsafe { dot_lanes_by_blocks::<SUPER_BLOCK, BLOCK_BYTES, V, R>(rows, x, acc, |b, x, acc| block_dot(b, x, acc)) }
    }

    /// As llama.cpp's `quantize_row_q5_K_ref`.
    fn encode_block(values: &[f32], out: &mut Vec<u8>) {
        let quants = encode_scale_min(values, 31, -0.5, 0.1, 15, out);
        let mut qh = [0u8; 32];
        let mut low = Vec::with_capacity(SUPER_BLOCK / 2);
        for (c, chunk) in quants.chunks_exact(64).enumerate() {
            for l in 0..32 {
                let (a, b) = (chunk[l], chunk[l + 32]);
                qh[l] |= (a >> 4) << (2 * c) | (b >> 4) << (2 * c + 1);
                low.push((a & 0x0F) | (b & 0x0F) << 4);
            }
        }
        out.extend_from_slice(&qh);
        out.extend_from_slice(&low);
    }
}

const BLOCK_BYTES: usize = size_of::<BlockQ5_K>();

/// One super-block's products (`Format::dot_lanes` above says how its values are made), multiply-added
/// into a row's lanes; `x` is the block's columns in runs of LANES.
///
/// # Safety
/// Inside V's build (see `Vector`).
#[inline(always)]
unsafe fn block_dot<V: Vector>(block: &[u8; BLOCK_BYTES], x: &[Lanes], acc: &mut V) {
    // A nibble (low for even sub-blocks, high for odd), and the sub-block's bit of `qh` as bit 4.
    let quants = |sub: usize, run: usize| {
        let (low, shift) = (QUANTS + 32 * (sub / 2) + 16 * run, 4 * (sub % 2));
        let q = sixteen_bytes(|i| {
            (le_word(block, low + i) >> shift & BYTES_LOW4)
                | (le_word(block, QH + 16 * run + i) >> sub & BYTES_LOW1) << 4
        });
        // SAFETY: the caller runs this inside V's build.
        unsafe { V::from_u8_bytes(&q) }
    };
    // SAFETY: the caller runs this inside V's build.
    unsafe { scale_min_block_dot::<V, SCALES>(block, DMIN, x, acc, quants) }
}
