//! GGUF Q4_K: super-blocks of 256 values in 8 sub-blocks of 32, each with a 6-bit scale and 6-bit
//! minimum relative to the super-block's f16 `d` and `dmin`; value = d * scale * q - dmin * min, q in
//! 0..=15. Quants come in 4 chunks of 64 values: 32 bytes, low nibbles first, then high nibbles.

use std::mem::offset_of;

use super::dot::{LANES, Lanes, Vector, dot_lanes_by_blocks};
use super::k_quants::{
    SUPER_BLOCK, make_qkx2_quants, nearest_int, pack_scale_min_k4, scale_min_block_dot, scale_min_k4,
};
use super::{DType, Dtype, Format, f16_at, f16_le, f16_round};

#[allow(non_camel_case_types)]
pub struct Q4_K;

/// ggml's `block_q4_K`, byte for byte.
#[repr(C)]
#[allow(non_camel_case_types)]
pub struct BlockQ4_K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    /// Eight 6-bit scales and minimums, as `k_quants::scale_min_k4` reads them.
    pub scales: [u8; 12],
    pub quants: [u8; SUPER_BLOCK / 2],
}

// The size GGUF files and the device formats assume.
const _: () = assert!(size_of::<BlockQ4_K>() == 144);

const DMIN: usize = offset_of!(BlockQ4_K, dmin);
const SCALES: usize = offset_of!(BlockQ4_K, scales);
const QUANTS: usize = offset_of!(BlockQ4_K, quants);

impl Format for Q4_K {
    const DTYPE: DType = DType::Q4_K;
    const NAME: &'static str = "Q4_K";
    const GGML_TYPE: u32 = 12;
    const SAFETENSORS: Option<Dtype> = None;
    type Block = BlockQ4_K;
    const BLOCK_VALUES: usize = SUPER_BLOCK;
    const F16_SCALES: &'static [usize] = &[offset_of!(BlockQ4_K, d), offset_of!(BlockQ4_K, dmin)];

    fn decode_block(block: &[u8], out: &mut [f32]) {
        let (d, dmin) = (f16_at(block, 0), f16_at(block, DMIN));
        let packed = &block[SCALES..SCALES + 12];
        for (sub, out) in out.chunks_exact_mut(32).enumerate() {
            let (sc, m) = scale_min_k4(sub, packed);
            let (scale, min) = (d * sc as f32, dmin * m as f32);
            let shift = 4 * (sub % 2);
            for (v, q) in out.iter_mut().zip(&block[QUANTS + 32 * (sub / 2)..][..32]) {
                *v = scale * (q >> shift & 0x0F) as f32 - min;
            }
        }
    }

    /// Each sub-block's 32 nibbles widened in registers: d * scale and dmin * min are exact in f32 (11 by
    /// 6 significant bits), and so is their product with a 4-bit quant, so q * scale - min rounds once,
    /// fused or not: each value is the one `decode_block` gives.
    #[inline(always)]
    unsafe fn dot_lanes<V: Vector, const R: usize>(rows: [&[u8]; R], x: &[f32], acc: &mut [V; R]) {
        // SAFETY: the caller runs this inside V's build.
        unsafe { dot_lanes_by_blocks::<SUPER_BLOCK, BLOCK_BYTES, V, R>(rows, x, acc, |b, x, acc| block_dot(b, x, acc)) }
    }

    /// As llama.cpp's `quantize_row_q4_K_ref`.
    fn encode_block(values: &[f32], out: &mut Vec<u8>) {
        let quants = encode_scale_min(values, 15, -1.0, 0.1, 20, out);
        for chunk in quants.chunks_exact(64) {
            out.extend((0..32).map(|l| chunk[l] | chunk[l + 32] << 4));
        }
    }
}

/// The reference quantizer Q4_K and Q5_K share: each sub-block of 32 fitted by `make_qkx2_quants`
/// (weights rms(x) + |x|, squared error), the 8 scales and minimums quantized to 6 bits against their
/// largest, then every value requantized to 0..=nmax against its sub-block's stored scale and minimum.
/// Appends d, dmin and the packed scales; returns the quants.
pub(super) fn encode_scale_min(
    values: &[f32],
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    out: &mut Vec<u8>,
) -> [u8; SUPER_BLOCK] {
    let mut quants = [0u8; SUPER_BLOCK];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for (j, x) in values.chunks_exact(32).enumerate() {
        let mut sum_x2 = 0f32;
        for v in x {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let weights: [f32; 32] = std::array::from_fn(|l| av_x + x[l].abs());
        let quants = &mut quants[32 * j..32 * j + 32];
        (scales[j], mins[j]) = make_qkx2_quants(nmax, x, &weights, quants, rmin, rdelta, nstep, false);
        max_scale = if scales[j] > max_scale { scales[j] } else { max_scale };
        max_min = if mins[j] > max_min { mins[j] } else { max_min };
    }
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let six_bit = |v: f32| (nearest_int(v) as u8).min(63);
    let ls: [u8; 8] = std::array::from_fn(|j| six_bit(inv_scale * scales[j]));
    let lm: [u8; 8] = std::array::from_fn(|j| six_bit(inv_min * mins[j]));
    let packed = pack_scale_min_k4(&ls, &lm);
    let (d, dmin) = (max_scale / 63.0, max_min / 63.0);
    let (d_stored, dmin_stored) = (f16_round(d), f16_round(dmin));
    for (j, x) in values.chunks_exact(32).enumerate() {
        let (sc, m) = scale_min_k4(j, &packed);
        let scale = d_stored * sc as f32;
        if scale == 0.0 {
            continue;
        }
        let min = dmin_stored * m as f32;
        for (q, v) in quants[32 * j..32 * j + 32].iter_mut().zip(x) {
            *q = nearest_int((v + min) / scale).clamp(0, nmax) as u8;
        }
    }
    out.extend_from_slice(&f16_le(d));
    out.extend_from_slice(&f16_le(dmin));
    out.extend_from_slice(&packed);
    quants
}

const BLOCK_BYTES: usize = size_of::<BlockQ4_K>();

/// One super-block's products (`Format::dot_lanes` above says how its values are made), multiply-added
/// into a row's lanes; `x` is the block's columns in runs of LANES.
///
/// # Safety
/// Inside V's build (see `Vector`).
#[inline(always)]
unsafe fn block_dot<V: Vector>(block: &[u8; BLOCK_BYTES], x: &[Lanes], acc: &mut V) {
    // Sub-blocks 2j and 2j + 1 are the low and high nibbles of the same 32 bytes.
    let quants = |sub: usize, run: usize| {
        let q = block[QUANTS + 32 * (sub / 2) + 16 * run..].first_chunk::<LANES>().expect("16 quant bytes");
        // SAFETY: the caller runs this inside V's build.
        unsafe { if sub % 2 == 0 { V::from_low_nibbles(q) } else { V::from_high_nibbles(q) } }
    };
    // SAFETY: the caller runs this inside V's build.
    unsafe { scale_min_block_dot::<V, SCALES>(block, DMIN, x, acc, quants) }
}
