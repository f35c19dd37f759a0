//! What the k-quant formats (Q2_K to Q6_K) share: the 256-value super-block, the 6-bit scale and
//! minimum packing of Q4_K and Q5_K, and llama.cpp's reference fits of one sub-block's quants
//! (`make_qkx2_quants`, `make_qx_quants`, `make_q3_quants` in ggml-quants.c), re-expressed with the same
//! float operations in the same order so the encoders quantize as llama.cpp's reference does; and the
//! bytewise helpers their `dot_lanes` assemble quants with, eight bytes at a time in a u64.

use super::dot::{Lanes, Vector};
use super::signed_absmax;

/// Values in a k-quant super-block.
pub const SUPER_BLOCK: usize = 256;

/// Every byte's low four, two and one bits: a u64 shifted right by s and masked with one of these holds
/// each of its eight bytes' bits s.. (no bit of a neighbouring byte gets in).
pub const BYTES_LOW4: u64 = 0x0F0F_0F0F_0F0F_0F0F;
pub const BYTES_LOW2: u64 = 0x0303_0303_0303_0303;
pub const BYTES_LOW1: u64 = 0x0101_0101_0101_0101;

/// The eight bytes of `block` from `at`, as a little-endian u64.
#[inline(always)]
pub fn le_word(block: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(block[at..at + 8].try_into().expect("8 bytes"))
}

/// Sixteen quant bytes, eight at a time from `word(0)` and `word(8)`.
#[inline(always)]
pub fn sixteen_bytes(word: impl Fn(usize) -> u64) -> [u8; 16] {
    let mut q = [0u8; 16];
    q[..8].copy_from_slice(&word(0).to_le_bytes());
    q[8..].copy_from_slice(&word(8).to_le_bytes());
    q
}

/// One Q4_K or Q5_K super-block's products into a row's lanes: for each sub-block of 32, its 6-bit scale
/// and minimum (`scale_min_k4` of the 12 bytes at `SCALES`), and its two runs of LANES quants that
/// `quants(sub, run)` widens. d * scale and dmin * min are exact in f32 (11 by 6 significant bits), and
/// so is their product with a quant of up to 5 bits, so q * scale - min rounds once, fused or not, as
/// the formats' `decode_block` rounds it.
///
/// # Safety
/// Inside V's build (see `Vector`).
#[inline(always)]
pub unsafe fn scale_min_block_dot<V: Vector, const SCALES: usize>(
    block: &[u8],
    dmin_at: usize,
    x: &[Lanes],
    acc: &mut V,
    quants: impl Fn(usize, usize) -> V,
) {
    let (d, dmin) = (super::f16_at(block, 0), super::f16_at(block, dmin_at));
    let packed = &block[SCALES..SCALES + 12];
    for sub in 0..8 {
        let (sc, m) = scale_min_k4(sub, packed);
        // SAFETY: the caller runs this inside V's build.
        unsafe {
            let (scale, neg_min) = (V::splat(d * sc as f32), V::splat(-(dmin * m as f32)));
            for run in 0..2 {
                *acc = acc.fma(neg_min.fma(quants(sub, run), scale), V::load(&x[2 * sub + run]));
            }
        }
    }
}

/// Below this a sub-block's largest magnitude counts as zero.
pub const GROUP_MAX_EPS: f32 = 1e-15;

/// Round to nearest, ties to even, for |x| < 2^22, as llama.cpp does it: the float's mantissa after
/// adding 1.5 * 2^23. Outside that range (and for NaN) the result is meaningless but never a panic.
pub fn nearest_int(x: f32) -> i32 {
    ((x + 12_582_912.0).to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// The scale and minimum of sub-block `j` (0..8) from Q4_K / Q5_K's 12 packed bytes: sub-blocks 0-3
/// in the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums); 4-7 in the nibbles of bytes 8-11, with
/// their top two bits in the top bits of bytes 0-7.
pub fn scale_min_k4(j: usize, packed: &[u8]) -> (u8, u8) {
    if j < 4 {
        (packed[j] & 63, packed[j + 4] & 63)
    } else {
        ((packed[j + 4] & 0x0F) | (packed[j - 4] >> 6) << 4, (packed[j + 4] >> 4) | (packed[j] >> 6) << 4)
    }
}

/// Packs eight 6-bit scales and minimums as [`scale_min_k4`] reads them.
pub fn pack_scale_min_k4(scales: &[u8; 8], mins: &[u8; 8]) -> [u8; 12] {
    let mut packed = [0u8; 12];
    for j in 0..8 {
        let (ls, lm) = (scales[j], mins[j]);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0x0F) | (lm & 0x0F) << 4;
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    packed
}

/// Quants in 0..=nmax and (scale, min) with x ~ scale * q - min: a first guess from the range, then
/// `nstep + 1` trial scales around it, each refit by weighted least squares, keeping the one of least
/// weighted error (absolute when `use_mad`, else squared). Returns (scale, min) with min >= 0.
#[allow(clippy::too_many_arguments)]
pub fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    quants: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        quants.fill(0);
        return (0.0, -min);
    }
    if nstep < 1 {
        let iscale = nmax as f32 / (max - min);
        for (q, &v) in quants.iter_mut().zip(x) {
            *q = nearest_int(iscale * (v - min)).clamp(0, nmax) as u8;
        }
        return (1.0 / iscale, -min);
    }
    let error = |diff: f32| if use_mad { diff.abs() } else { diff * diff };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        quants[i] = l as u8;
        best_error += weights[i] * error(scale * l as f32 + min - x[i]);
    }
    // Sub-blocks are 16 or 32 values.
    let mut trial = [0u8; 32];
    let trial = &mut trial[..n];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            trial[i] = l as u8;
            let (w, l) = (weights[i], l as f32);
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                cur_error += weights[i] * error(this_scale * trial[i] as f32 + this_min - x[i]);
            }
            if cur_error < best_error {
                quants.copy_from_slice(trial);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Symmetric quants in 0..2*nmax (q - nmax in -nmax..nmax) and the scale, weighted by x^2: the scale
/// that maps the value of largest magnitude to -nmax, then 18 nearby scales, keeping the best
/// least-squares fit (llama.cpp's `make_qx_quants` with rmse_type 1 and no importance weights).
pub fn make_qx_quants(nmax: i32, x: &[f32], quants: &mut [i8]) -> f32 {
    let max = signed_absmax(x);
    if max.abs() < GROUP_MAX_EPS {
        quants.fill(0);
        return 0.0;
    }
    let quant = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for &v in x {
            let (w, l) = (v * v, quant(iscale, v) as f32);
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let mut iscale = -(nmax as f32) / max;
    for (q, &v) in quants.iter_mut().zip(x) {
        *q = (quant(iscale, v) + nmax) as i8;
    }
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (q, &v) in quants.iter_mut().zip(x) {
                *q = (quant(iscale, v) + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Symmetric 3-bit-style quants in 0..2*nmax and the scale: the scale that maps the value of largest
/// magnitude to -nmax, then up to five passes that move single quants while the x^2-weighted
/// least-squares fit improves (llama.cpp's `make_q3_quants` with do_rmse).
pub fn make_q3_quants(nmax: i32, x: &[f32], quants: &mut [i8]) -> f32 {
    let max = signed_absmax(x);
    if max.abs() < GROUP_MAX_EPS {
        quants.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut levels: Vec<i32> = x.iter().map(|&v| nearest_int(iscale * v).clamp(-nmax, nmax - 1)).collect();
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (&v, &l) in x.iter().zip(&levels) {
        let w = v * v;
        sumlx += w * v * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for (i, &v) in x.iter().enumerate() {
            let w = v * v;
            let old = levels[i] as f32;
            let mut slx = sumlx - w * v * old;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * old * old;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != levels[i] {
                    slx += w * v * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        levels[i] = new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    for (q, l) in quants.iter_mut().zip(&levels) {
        *q = (l + nmax) as i8;
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// Packs 256 two-bit quants as Q2_K and Q3_K store them: in each half of 128, byte l holds quants
/// l, l + 32, l + 64 and l + 96 in its bit pairs from the lowest.
pub fn pack_two_bit(quants: &[u8], out: &mut Vec<u8>) {
    for half in quants.chunks_exact(128) {
        out.extend((0..32).map(|l| half[l] | half[l + 32] << 2 | half[l + 64] << 4 | half[l + 96] << 6));
    }
}
