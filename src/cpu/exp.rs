//! The softmax's exp, in f64: e^x = 2^k * e^r with k = round(x / ln 2) and e^r from its Taylor series
//! to r^13 (|r| <= ln2/2, where the first term left out is below 2^-57 of the sum). Plain multiplies
//! and adds with no table, so a row of them vectorizes and every IEEE host gives the same bits,
//! whatever its libm; within 1 ulp of the host's exp (tests/cpu/ measures it).

/// Inputs whose result is a normal number; outside (0, subnormals, inf, NaN) the host's exp answers.
pub(super) const NORMAL: std::ops::RangeInclusive<f64> = -708.0..=709.0;
/// 1.5 * 2^52: adding it rounds a value below 2^51 to an integer, left in the low bits.
const SHIFT: f64 = 6755399441055744.0;
/// ln 2 in two parts; the first has 32 significant bits, so k * LN2_HI is exact for every k here.
const LN2_HI: f64 = f64::from_bits(0x3fe62e42ff000000);
const LN2_LO: f64 = f64::from_bits(0xbdc718432a1b0e26);

/// 1/2!, 1/3!, ..., 1/13!, each correctly rounded (n! is exact in f64).
const INVERSE_FACTORIALS: [f64; 12] = {
    let mut c = [0f64; 12];
    let (mut n, mut factorial) = (2, 1f64);
    while n <= 13 {
        factorial *= n as f64;
        c[n - 2] = 1.0 / factorial;
        n += 1;
    }
    c
};

/// e^x.
#[inline(always)]
pub(super) fn exp(x: f64) -> f64 {
    if NORMAL.contains(&x) { exp_normal(x) } else { x.exp() }
}

/// e^x for x in `NORMAL`: no branch and no float-to-int conversion, so a loop of them vectorizes.
#[inline(always)]
pub(super) fn exp_normal(x: f64) -> f64 {
    let shifted = x * std::f64::consts::LOG2_E + SHIFT;
    let k = shifted - SHIFT;
    let r = (x - k * LN2_HI) - k * LN2_LO;
    // The low bits of `shifted` are k (two's complement); k + 1023 is 2^k's exponent field.
    let scale = f64::from_bits(shifted.to_bits().wrapping_add(1023) << 52);
    let c = INVERSE_FACTORIALS;
    let mut tail = c[11];
    for &coefficient in c[..11].iter().rev() {
        tail = coefficient + r * tail;
    }
    // e^r - 1 = r + r^2 (1/2! + r/3! + ...), kept apart from the 1 until the last add.
    let expm1 = r + (r * r) * tail;
    scale + scale * expm1
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units of the last place between two finite positive doubles.
    fn ulps(a: f64, b: f64) -> u64 {
        a.to_bits().abs_diff(b.to_bits())
    }

    #[test]
    fn within_one_ulp_of_the_hosts_exp() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut worst = 0;
        for i in 0..2_000_000u64 {
            state = crate::sampler::splitmix64(state.wrapping_add(i));
            let unit = (state >> 11) as f64 / (1u64 << 53) as f64;
            // Softmax inputs (x <= 0) mostly, with the whole normal range covered.
            let x = if i % 4 == 0 { -708.0 + unit * 1417.0 } else { -unit * 40.0 };
            worst = worst.max(ulps(exp(x), x.exp()));
        }
        assert!(worst <= 1, "{worst} ulps from the host's exp");
    }

    #[test]
    fn edges_are_exact() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        assert_eq!(exp(-1e-300), 1.0);
        assert_eq!(exp(f64::NEG_INFINITY), 0.0);
        assert_eq!(exp(-800.0), 0.0);
        assert!(exp(f64::NAN).is_nan());
        assert!(ulps(exp(1.0), std::f64::consts::E) <= 1);
        assert!(exp(709.0).is_finite() && exp(710.0).is_infinite());
    }
}
