//! GGUF Q6_K: super-blocks of 256 values in 16 sub-blocks of 16, each with a signed 8-bit scale
//! relative to the super-block's f16 `d`; value = d * scale * (q - 32), q in 0..=63. In each half of
//! 128 values, value l + 32k (k 0..4, l 0..32) has its low four bits in `ql` byte l + 32 (k % 2), nibble
//! k / 2, and its top two bits in `qh` byte l, bits 2k.

use std::mem::offset_of;

use super::dot::{Lanes, Vector, dot_lanes_by_blocks};
use super::k_quants::{
    BYTES_LOW2, BYTES_LOW4, GROUP_MAX_EPS, SUPER_BLOCK, le_word, make_qx_quants, nearest_int, sixteen_bytes,
};
use super::{DType, Dtype, Format, f16_at, f16_le, f16_round};

#[allow(non_camel_case_types)]
pub struct Q6_K;

/// ggml's `block_q6_K`, byte for byte.
#[repr(C)]
#[allow(non_camel_case_types)]
pub struct BlockQ6_K {
    pub ql: [u8; SUPER_BLOCK / 2],
    pub qh: [u8; SUPER_BLOCK / 4],
    pub scales: [i8; SUPER_BLOCK / 16],
    pub d: [u8; 2],
}

// The size GGUF files and the device formats assume.
const _: () = assert!(size_of::<BlockQ6_K>() == 210);

const QH: usize = offset_of!(BlockQ6_K, qh);
const SCALES: usize = offset_of!(BlockQ6_K, scales);
const D: usize = offset_of!(BlockQ6_K, d);

impl Format for Q6_K {
    const DTYPE: DType = DType::Q6_K;
    const NAME: &'static str = "Q6_K";
    const GGML_TYPE: u32 = 14;
    const SAFETENSORS: Option<Dtype> = None;
    type Block = BlockQ6_K;
    const BLOCK_VALUES: usize = SUPER_BLOCK;
    const F16_SCALES: &'static [usize] = &[offset_of!(BlockQ6_K, d)];

    fn decode_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, D);
        for (sub, out) in out.chunks_exact_mut(16).enumerate() {
            let (half, k, part) = (sub / 8, sub % 8 / 2, 16 * (sub % 2));
            let ql = &block[64 * half + 32 * (k % 2) + part..][..16];
            let qh = &block[QH + 32 * half + part..][..16];
            let dl = d * block[SCALES + sub] as i8 as f32;
            for ((v, lo), hi) in out.iter_mut().zip(ql).zip(qh) {
                let q = (lo >> (4 * (k / 2)) & 0x0F) | (hi >> (2 * k) & 3) << 4;
                *v = dl * (q as i32 - 32) as f32;
            }
        }
    }

    /// Each sub-block's 16 six-bit quants assembled eight bytes at a time in a u64 (the nibbles of `ql`
    /// and the bit pairs of `qh` shifted and masked bytewise), widened in registers, then (q - 32) * dl:
    /// the subtraction exact, the product rounded once, as `decode_block` rounds it.
    #[inline(always)]
    unsafe fn dot_lanes<V: Vector, const R: usize>(rows: [&[u8]; R], x: &[f32], acc: &mut [V; R]) {
        // SAFETY: the caller runs this inside V's build.
        unsafe { dot_lanes_by_blocks::<SUPER_BLOCK, BLOCK_BYTES, V, R>(rows, x, acc, |b, x, acc| block_dot(b, x, acc)) }
    }

    /// As llama.cpp's `quantize_row_q6_K_ref`: each sub-block fitted by `make_qx_quants`, the 16 scales
    /// quantized to 8 bits against the one of largest magnitude, then every value requantized against
    /// its sub-block's stored scale.
    fn encode_block(values: &[f32], out: &mut Vec<u8>) {
        let mut levels = [0i8; SUPER_BLOCK];
        let mut scales = [0f32; 16];
        let (mut max_scale, mut max_abs) = (0f32, 0f32);
        for (j, x) in values.chunks_exact(16).enumerate() {
            scales[j] = make_qx_quants(32, x, &mut levels[16 * j..16 * j + 16]);
            if scales[j].abs() > max_abs {
                max_abs = scales[j].abs();
                max_scale = scales[j];
            }
        }
        if max_abs < GROUP_MAX_EPS {
            out.extend(std::iter::repeat_n(0, size_of::<BlockQ6_K>()));
            return;
        }
        let iscale = -128.0 / max_scale;
        let d = 1.0 / iscale;
        let packed: [i8; 16] = std::array::from_fn(|j| nearest_int(iscale * scales[j]).min(127) as i8);
        let d_stored = f16_round(d);
        for (j, x) in values.chunks_exact(16).enumerate() {
            let dl = d_stored * packed[j] as f32;
            if dl == 0.0 {
                continue;
            }
            for (q, v) in levels[16 * j..16 * j + 16].iter_mut().zip(x) {
                *q = (nearest_int(v / dl).clamp(-32, 31) + 32) as i8;
            }
        }
        let mut ql = [0u8; SUPER_BLOCK / 2];
        let mut qh = [0u8; SUPER_BLOCK / 4];
        for (half, levels) in levels.chunks_exact(128).enumerate() {
            for l in 0..32 {
                let q: [u8; 4] = std::array::from_fn(|k| levels[l + 32 * k] as u8);
                ql[64 * half + l] = (q[0] & 0x0F) | (q[2] & 0x0F) << 4;
                ql[64 * half + l + 32] = (q[1] & 0x0F) | (q[3] & 0x0F) << 4;
                qh[32 * half + l] = q[0] >> 4 | (q[1] >> 4) << 2 | (q[2] >> 4) << 4 | (q[3] >> 4) << 6;
            }
        }
        out.extend_from_slice(&ql);
        out.extend_from_slice(&qh);
        out.extend(packed.iter().map(|&s| s as u8));
        out.extend_from_slice(&f16_le(d));
    }
}

const BLOCK_BYTES: usize = size_of::<BlockQ6_K>();

/// One super-block's products (`Format::dot_lanes` above says how its values are made), multiply-added
/// into a row's lanes; `x` is the block's columns in runs of LANES.
///
/// # Safety
/// Inside V's build (see `Vector`).
#[inline(always)]
unsafe fn block_dot<V: Vector>(block: &[u8; BLOCK_BYTES], x: &[Lanes], acc: &mut V) {
    // SAFETY: the caller runs this inside V's build.
    unsafe {
        let minus_32 = V::splat(-32.0);
        let d = f16_at(block, D);
        for (sub, x) in x.iter().enumerate() {
            let (half, k, part) = (sub / 8, sub % 8 / 2, 16 * (sub % 2));
            let (ql, qh) = (64 * half + 32 * (k % 2) + part, QH + 32 * half + part);
            let q = sixteen_bytes(|i| {
                let lo = le_word(block, ql + i) >> (4 * (k / 2)) & BYTES_LOW4;
                let hi = le_word(block, qh + i) >> (2 * k) & BYTES_LOW2;
                lo | hi << 4
            });
            let dl = V::splat(d * block[SCALES + sub] as i8 as f32);
            *acc = acc.fma(V::from_u8_bytes(&q).add(minus_32).mul(dl), V::load(x));
        }
    }
}
