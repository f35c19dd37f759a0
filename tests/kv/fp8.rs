//! FP8 E4M3: the codes against their definition and a brute-force rounding, and the FP8 blocks.

use crate::common::Rng;
use hostembed::kv;
use hostembed::kv::KvType;

// ---------------------------------------------------------------------------------------------
// FP8 E4M3.

/// An E4M3 code's value from the format's definition, in f64: sign, 4 exponent bits of bias 7 (0 is
/// subnormal: m/8 x 2^-6), 3 mantissa bits; S.1111.111 is NaN.
fn e4m3_definition(code: u8) -> f64 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (((code >> 3) & 0xF) as i32, (code & 7) as f64);
    if e == 15 && m == 7.0 {
        return f64::NAN;
    }
    let magnitude = if e == 0 { m / 8.0 * 2f64.powi(-6) } else { (1.0 + m / 8.0) * 2f64.powi(e - 7) };
    sign * magnitude
}

/// The E4M3 code nearest `x` found by trying every finite code (ties to the code with an even
/// mantissa), saturating at ±448, NaN as 0x7F with x's sign: the rounding `e4m3_from_f32` promises.
fn e4m3_brute_force(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    if x.is_nan() {
        return sign | 0x7F;
    }
    let a = x.abs() as f64;
    if a >= 448.0 {
        return sign | 0x7E;
    }
    let mut best = 0u8;
    for code in 1..=0x7Eu8 {
        let (d, b) = ((e4m3_definition(code) - a).abs(), (e4m3_definition(best) - a).abs());
        if d < b || (d == b && code % 2 == 0) {
            best = code;
        }
    }
    sign | best
}

#[test]
fn e4m3_codes_decode_to_their_definition() {
    for code in 0..=255u8 {
        let (got, want) = (kv::e4m3_to_f32(code), e4m3_definition(code));
        if want.is_nan() {
            assert!(got.is_nan(), "code {code:#04x} is NaN, decoded {got}");
        } else {
            assert_eq!(got as f64, want, "code {code:#04x}");
            assert_eq!(got.is_sign_negative(), code & 0x80 != 0, "code {code:#04x}: sign");
        }
        assert_eq!(got.to_bits(), kv::e4m3_value(code).to_bits(), "code {code:#04x}: the table");
    }
    assert_eq!(kv::e4m3_to_f32(0x7E), 448.0, "the largest finite value");
    assert_eq!(kv::e4m3_to_f32(0x01), 2f32.powi(-9), "the smallest subnormal");
    assert_eq!(kv::e4m3_to_f32(0x08), 2f32.powi(-6), "the smallest normal");
    // Positive codes increase with their value: one code a value, no gaps or repeats.
    for code in 1..=0x7Eu8 {
        assert!(kv::e4m3_to_f32(code) > kv::e4m3_to_f32(code - 1), "code {code:#04x}");
    }
}

#[test]
fn e4m3_rounds_to_nearest_even_and_saturates() {
    let mut rng = Rng::fresh("e4m3_rounds_to_nearest_even_and_saturates");
    let check = |x: f32| {
        let (got, want) = (kv::e4m3_from_f32(x), e4m3_brute_force(x));
        assert_eq!(got, want, "{x:e} ({:#010x}): {got:#04x}, nearest-even {want:#04x}", x.to_bits());
    };
    // Every code's value, and the midpoints between neighbours (the ties) and just around them.
    for code in 0..0x7Eu8 {
        let (lo, hi) = (kv::e4m3_to_f32(code), kv::e4m3_to_f32(code + 1));
        let mid = (lo + hi) / 2.0;
        for x in [lo, hi, mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1)] {
            check(x);
            check(-x);
        }
    }
    // Saturation, infinities, NaN, zeros, f32 subnormals.
    for x in [448.0, 449.0, 463.9, 464.0, 480.0, 1e6, f32::MAX, f32::INFINITY, 0.0, 1e-40, f32::MIN_POSITIVE] {
        check(x);
        check(-x);
    }
    assert_eq!(kv::e4m3_from_f32(f32::INFINITY), 0x7E);
    assert_eq!(kv::e4m3_from_f32(f32::NEG_INFINITY), 0xFE);
    assert_eq!(kv::e4m3_from_f32(f32::NAN), 0x7F);
    assert_eq!(kv::e4m3_from_f32(-f32::NAN), 0xFF);
    assert_eq!(kv::e4m3_from_f32(-0.0), 0x80, "-0 keeps its sign");
    // Every f16 value (the range a block's values fall in), and random f32 bit patterns near E4M3's range.
    for bits in 0..=u16::MAX {
        check(half::f16::from_bits(bits).to_f32());
    }
    for _ in 0..200_000 {
        let exponent = 127 - 14 + rng.below(26) as u32;
        check(f32::from_bits((rng.below(2) as u32) << 31 | exponent << 23 | rng.below(1 << 23) as u32));
    }
}

/// An FP8 block as the module comment defines it, step by step in the test: the bf16 scale s of
/// max|x| / 448 (NaN ignored) and each x times 1/s (0 where s is not normal), brute-force rounded.
fn fp8_block_by_hand(values: &[f32]) -> Vec<u8> {
    let mut amax = 0f32;
    for v in values {
        if v.abs() > amax {
            amax = v.abs();
        }
    }
    let scale = half::bf16::from_f32(amax / 448.0);
    let s = scale.to_f32();
    let inv = if s.is_normal() { 1.0 / s } else { 0.0 };
    let mut out = scale.to_le_bytes().to_vec();
    out.extend(values.iter().map(|&v| e4m3_brute_force(v * inv)));
    out
}

#[test]
fn fp8_blocks_follow_their_rule_and_keep_nan_visible() {
    let mut rng = Rng::fresh("fp8_blocks_follow_their_rule_and_keep_nan_visible");
    let t = KvType::Fp8E4m3;
    for case in 0..200 {
        let head_dim = 32 * (1 + rng.below(8) as usize);
        let scale = [1e-3, 1.0, 37.0, 3e4, 1e-30][case % 5];
        let values = rng.vec(head_dim, scale);
        let mut bytes = vec![0u8; t.row_bytes(head_dim)];
        t.encode(&values, &mut bytes);
        let want: Vec<u8> = values.chunks(32).flat_map(fp8_block_by_hand).collect();
        assert_eq!(bytes, want, "case {case}: head_dim {head_dim}, values of size {scale}");
        let mut back = vec![0f32; head_dim];
        t.decode(&bytes, &mut back);
        for (block, (v, b)) in values.chunks(32).zip(back.chunks(32)).enumerate() {
            let s = half::bf16::from_le_bytes([bytes[34 * block], bytes[34 * block + 1]]).to_f32();
            let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert!((s * 448.0 - amax).abs() <= amax / 256.0, "the scale maps max|x| {amax} onto 448: {s}");
            for (x, y) in v.iter().zip(b) {
                let code = bytes[34 * block + 2 + v.iter().position(|z| z.to_bits() == x.to_bits()).unwrap()];
                assert_eq!(y.to_bits(), (s * e4m3_definition(code) as f32).to_bits(), "scale x code");
                // Three mantissa bits: half a step is 1/16 of the value, or half a subnormal step of the block;
                // the scale's own rounding is 1/256 at most.
                let bound = x.abs() / 16.0 + amax / 256.0 + s * 2f32.powi(-10);
                assert!((x - y).abs() <= bound, "{x} read as {y} (block max {amax})");
            }
        }
    }
    // A NaN stays a NaN and leaves its block's other values alone; an infinity makes the block NaN.
    let mut values = rng.vec(64, 1.0);
    values[3] = f32::NAN;
    values[40] = f32::INFINITY;
    let back = t.round(&values, 64);
    assert!(back[3].is_nan(), "a NaN value reads as {}", back[3]);
    assert!(back.iter().enumerate().filter(|(i, _)| *i != 3 && *i < 32).all(|(_, v)| v.is_finite()));
    assert!(back[32..].iter().all(|v| v.is_nan()), "the block with an infinity: {:?}", &back[32..]);
    assert_eq!(t.round(&[0.0; 32], 32), vec![0.0; 32], "a block of zeros");
}
