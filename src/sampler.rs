//! Choosing the next token from logits: a repetition penalty, then greedy, or temperature + top-k +
//! min-p + top-p with a seeded draw.
//!
//! kernels/sample.cu implements this same algorithm on the device, and both sides compute every number
//! in it bit for bit alike (integer arithmetic, and f32 operations that IEEE 754 rounds exactly, never a
//! library `exp`), so they pick the same token from the same logits. The algorithm, exactly:
//!
//! P. Penalty, when `repeat_penalty` is neither 1 nor NaN and `repeat_last_n > 0`: each distinct id among
//!    the stream's last `repeat_last_n` tokens (those of this step included) has its logit `l` replaced
//!    by `l / repeat_penalty` when `l > 0`, by `l * repeat_penalty` when `l <= 0` (one f32 operation,
//!    rounded to nearest even), and kept when NaN. Every step below reads the penalized logits.
//! 0. Order. `key(l)` maps an f32's bits to a u32 whose unsigned order is the total order of f32
//!    (-NaN < -inf < .. < -0 < +0 < .. < +inf < +NaN). Tokens are ranked by key descending, then by index
//!    ascending; "the largest logit" is the first token in that ranking.
//! 1. Greedy when `!(temperature > 0)` (0, negative or NaN) or `top_k == 1`: the largest logit.
//! 2. Candidates: the first `top_k` tokens of the ranking when `0 < top_k < vocab`, else every token.
//! 3. Weights (integers): with `s = LOG2E / temperature` (`LOG2E` = f32 log2(e), bits 0x3FB8AA3B) and
//!    `l_max` the largest logit, in f32,
//!    `x = (l_max - l) * s` and `w = exp2_weight(x)`, about `2^36 * 2^-x` (below). `total` is the sum of
//!    the candidates' weights (u64, exact; vocab < 2^28 keeps it below 2^64). `total == 0` (an infinite or
//!    NaN largest logit, a temperature so small that `s` is infinite): the largest logit.
//! 3b. Min-p, when `min_p > 0` (NaN: off): `m = min(round_half_even(min_p * 2^24), 2^24) * 2^12`, and
//!    every candidate whose weight is below `m` weighs 0 from here on. The largest logit weighs 2^36 >= m,
//!    so it always stays; the cut keeps the tokens at least `min_p` times as likely as the likeliest.
//! 4. Top-p, when `0 < top_p < 1`: `P = round_half_even(top_p * 2^24)`,
//!    `thresh = max(1, ceil(total * P / 2^24))`. When `thresh < total` the kept tokens are the shortest
//!    prefix of the candidates in ranking order whose weights sum to at least `thresh`; otherwise (or with
//!    no top-p) every candidate is kept.
//! 5. Draw: `bits` = the top 24 bits of `splitmix64(seed ^ splitmix64((stream << 40) ^ position))`,
//!    `kept` = the sum of the kept tokens' weights, `r = floor(bits * kept / 2^24)` (< kept). Walking the
//!    kept tokens in INDEX order, the first whose running weight sum exceeds `r` is the token. Any fixed
//!    order gives each kept token the probability `w / kept`; index order lets the device find it with a
//!    prefix sum instead of a sort.
//!
//! (Top-p's `total` is the sum after the min-p cut.)
//!
//! `exp2_weight(x)`: 0 unless `x < 40` (so also for NaN). Else, all in f32 with one rounding per operation
//! (no fused multiply-add): `n = round_half_even(x)`, `f = x - n` (exact, in [-0.5, 0.5]),
//! `p = ((((((C7 f + C6) f + C5) f + C4) f + C3) f + C2) f + C1) f + C0` with `Ck = f32((-ln 2)^k / k!)`
//! (the Taylor series of `2^-f`, within 1.6 ulp of it), and `w = round_half_even(p * 2^(36 - n))`, the
//! product exact. So the largest logit weighs exactly 2^36, and a token whose probability is below about
//! 2^-37 of the largest one's weighs 0 and is never drawn.
//!
//! The draw depends only on (seed, stream, position), where `position` is the index in the stream of
//! the token being produced, so a run repeats exactly whatever the placement or batching.

/// A stream's sampler settings: the C type `engine_sampling` (the engine options give the default).
pub use crate::abi::engine_sampling as Sampling;

impl Sampling {
    /// Greedy, no cut, no penalty: `engine_default_sampling()`.
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.0,
        repeat_last_n: 64,
        seed: 0,
    };

    /// Whether the repetition penalty changes anything (see the module comment, step P).
    pub fn penalizes(&self) -> bool {
        self.repeat_last_n > 0 && !self.repeat_penalty.is_nan() && self.repeat_penalty != 1.0
    }

    /// Settings no stream may take: INVALID_ARGUMENT naming the field, led by `what`.
    pub fn check(&self, what: &str) -> crate::status::Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            crate::bail!(InvalidArgument, "{what}temperature is {}; it must be a number >= 0", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            crate::bail!(InvalidArgument, "{what}top_p is {}; it must be in (0, 1]", self.top_p);
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            crate::bail!(InvalidArgument, "{what}min_p is {}; it must be in [0, 1]", self.min_p);
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            crate::bail!(InvalidArgument, "{what}repeat_penalty is {}; it must be a number > 0", self.repeat_penalty);
        }
        Ok(())
    }
}

/// The ids the repetition penalty touches for a stream whose tokens are `history` then `new`: the
/// distinct ids among the last `repeat_last_n` of them, ascending; none when `s` does not penalize.
pub fn penalty_ids(history: &[u32], new: &[u32], s: &Sampling) -> Vec<u32> {
    if !s.penalizes() {
        return Vec::new();
    }
    let last_n = s.repeat_last_n as usize;
    let from_new = new.len().min(last_n);
    let from_history = history.len().min(last_n - from_new);
    let mut ids: Vec<u32> =
        history[history.len() - from_history..].iter().chain(&new[new.len() - from_new..]).copied().collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// The penalized logit of step P.
pub fn penalize(l: f32, penalty: f32) -> f32 {
    if l > 0.0 {
        l / penalty
    } else if l <= 0.0 {
        l * penalty
    } else {
        l
    }
}

/// The token chosen for a stream whose tokens are `history` then `new` (the step just run), from
/// the logits after them: the penalty of step P on a copy of the logits, then `sample`.
pub fn sample_stream(logits: &[f32], s: &Sampling, stream: u32, history: &[u32], new: &[u32]) -> u32 {
    let position = (history.len() + new.len()) as u64;
    let ids = penalty_ids(history, new, s);
    if ids.is_empty() {
        return sample(logits, s, stream, position);
    }
    let mut penalized = logits.to_vec();
    for &id in &ids {
        if let Some(l) = penalized.get_mut(id as usize) {
            *l = penalize(*l, s.repeat_penalty);
        }
    }
    sample(&penalized, s, stream, position)
}

/// `sample_stream` among the ids `allowed` lets through (bit `i % 32` of word `i / 32`, llguidance's
/// token-set layout; ids past the logits are ignored): the token is the one `sample_stream` picks when
/// every other logit is -inf, since the penalty, the cuts and the draw then read the allowed ids alone
/// (min-p and top-p see the distribution renormalized over them). Where every allowed logit is -inf it
/// is the lowest allowed id. None when no id is allowed.
pub fn sample_stream_masked(
    logits: &[f32],
    allowed: &[u32],
    s: &Sampling,
    stream: u32,
    history: &[u32],
    new: &[u32],
) -> Option<u32> {
    let penalized = penalty_ids(history, new, s);
    let value = |i: usize| match penalized.binary_search(&(i as u32)) {
        Ok(_) => penalize(logits[i], s.repeat_penalty),
        Err(_) => logits[i],
    };
    if s.temperature.is_nan() || s.temperature <= 0.0 || s.top_k == 1 {
        // Greedy: the largest allowed logit in one pass, the lowest id among equals (`argmax`'s rule).
        let mut best: Option<(u32, u32)> = None;
        for_each_allowed(allowed, logits.len(), |i| {
            let k = key(value(i));
            if best.is_none_or(|(_, b)| k > b) {
                best = Some((i as u32, k));
            }
        });
        return best.map(|(i, _)| i);
    }
    let mut ids = Vec::new();
    let mut kept = Vec::new();
    for_each_allowed(allowed, logits.len(), |i| {
        ids.push(i as u32);
        kept.push(value(i));
    });
    if ids.is_empty() {
        return None;
    }
    let position = (history.len() + new.len()) as u64;
    Some(ids[sample(&kept, s, stream, position) as usize])
}

/// Calls `f` with each id below `n` that `allowed` lets through, ascending.
fn for_each_allowed(allowed: &[u32], n: usize, mut f: impl FnMut(usize)) {
    for (w, &word) in allowed.iter().enumerate() {
        let mut bits = word;
        while bits != 0 {
            let i = w * 32 + bits.trailing_zeros() as usize;
            if i >= n {
                return;
            }
            f(i);
            bits &= bits - 1;
        }
    }
}

/// The vocabulary sizes the sampler takes: every sum of weights then fits in a u64.
const MAX_VOCAB: usize = (1 << 28) - 1;

/// log2(e) in f32 (0x3FB8AA3B); kernels/sample.cu has the same bits.
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// f32((-ln 2)^k / k!) for k = 0..=7, as bits; kernels/sample.cu has the same.
const EXP2_TAYLOR: [u32; 8] =
    [0x3F80_0000, 0xBF31_7218, 0x3E75_FDF0, 0xBD63_5847, 0x3C1D_955B, 0xBAAE_C3FF, 0x3921_8489, 0xB77F_E5FE];
/// x at or beyond this weighs 0 (2^36 * 2^-40 rounds to 0).
const WEIGHT_CUTOFF: f32 = 40.0;

/// Step 4's cut: moves the shortest run of top-ranked entries whose weights sum to at least `thresh`
/// (below their total) to the front of `weighted`, in any order, and returns its length. Selection
/// halves the range that holds the cut, so the cost is linear where a sort of every entry was not.
fn top_p_keep(weighted: &mut [(u32, u64)], thresh: u64, rank: &impl Fn(&u32, &u32) -> std::cmp::Ordering) -> usize {
    let by_rank = |a: &(u32, u64), b: &(u32, u64)| rank(&a.0, &b.0);
    // weighted[..lo] are the lo top-ranked entries, summing to `above` < thresh; the cut ends in lo..hi.
    let (mut lo, mut hi, mut above) = (0, weighted.len(), 0u64);
    while hi - lo > 32 {
        let mid = lo + (hi - lo) / 2;
        weighted[lo..hi].select_nth_unstable_by(mid - lo, by_rank);
        let left: u64 = weighted[lo..mid].iter().map(|e| e.1).sum();
        if above + left >= thresh {
            hi = mid;
        } else {
            above += left;
            lo = mid;
        }
    }
    weighted[lo..hi].sort_unstable_by(by_rank);
    let mut running = above;
    for (k, e) in weighted[lo..hi].iter().enumerate() {
        running += e.1;
        if running >= thresh {
            return lo + k + 1;
        }
    }
    unreachable!("the weights before {hi} sum to thresh {thresh} or more")
}

/// The `k` most likely tokens of `logits` (k at most their count), most likely first and a tie to the
/// lower id, each with its log-probability: the log-softmax over the whole row in f64, before any
/// sampling transform (temperature, penalties, cuts). None when no distribution exists: a NaN logit, or
/// a largest logit that is not finite.
pub fn top_logprobs(logits: &[f32], k: usize) -> Option<Vec<(u32, f32)>> {
    let max = logits.iter().fold(f64::NEG_INFINITY, |m, &l| m.max(l as f64));
    if !max.is_finite() || logits.iter().any(|l| l.is_nan()) {
        return None;
    }
    let log_z = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
    let first = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(order.len());
    if k > 0 && k < order.len() {
        order.select_nth_unstable_by(k - 1, first);
    }
    order.truncate(k);
    order.sort_unstable_by(first);
    Some(order.into_iter().map(|i| (i, (logits[i as usize] as f64 - log_z) as f32)).collect())
}

/// splitmix64's output function applied to `x` (wrapping arithmetic).
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The 24 random bits of the draw for one token.
fn draw_bits(seed: u64, stream: u32, position: u64) -> u64 {
    splitmix64(seed ^ splitmix64(((stream as u64) << 40) ^ position)) >> 40
}

/// The draw for one token in [0, 1): its 24 random bits over 2^24, so exact in f32.
pub fn uniform(seed: u64, stream: u32, position: u64) -> f32 {
    draw_bits(seed, stream, position) as f32 / 16_777_216.0
}

/// A key whose unsigned order is the total order of f32 (see the module comment).
pub fn key(l: f32) -> u32 {
    let u = l.to_bits();
    if u & 0x8000_0000 != 0 { !u } else { u | 0x8000_0000 }
}

/// Index of the largest logit in the total order of f32, the lowest index among equals.
pub fn argmax(logits: &[f32]) -> u32 {
    assert!(!logits.is_empty(), "argmax of no logits");
    let mut best = 0;
    let mut best_key = key(logits[0]);
    for (i, &l) in logits.iter().enumerate().skip(1) {
        let k = key(l);
        if k > best_key {
            best = i;
            best_key = k;
        }
    }
    best as u32
}

/// About 2^36 * 2^-x, computed as the module comment says.
pub fn exp2_weight(x: f32) -> u64 {
    if x.is_nan() || x >= WEIGHT_CUTOFF {
        return 0;
    }
    let n = x.round_ties_even();
    let f = x - n;
    let mut p = f32::from_bits(EXP2_TAYLOR[7]);
    for &c in EXP2_TAYLOR[..7].iter().rev() {
        p = p * f + f32::from_bits(c);
    }
    let scale = f32::from_bits(((127 + 36 - n as i32) as u32) << 23);
    (p * scale).round_ties_even() as u64
}

/// The weight of logit `l` against the largest logit `l_max` with `s = LOG2E / temperature`.
fn weight(l: f32, l_max: f32, s: f32) -> u64 {
    exp2_weight((l_max - l) * s)
}

/// floor(a * b / 2^24) for b < 2^64 and a <= 2^24.
fn mul_shift24(a: u64, b: u64) -> u64 {
    ((a as u128 * b as u128) >> 24) as u64
}

/// The min-p floor `m` of step 3b (0: no cut).
pub fn min_p_floor(min_p: f32) -> u64 {
    if min_p > 0.0 { ((min_p * 16_777_216.0).round_ties_even() as u64).min(1 << 24) << 12 } else { 0 }
}

/// The token chosen from `logits` for `stream`'s token at `position` (see the module comment), with
/// no repetition penalty (`sample_stream` applies it).
pub fn sample(logits: &[f32], s: &Sampling, stream: u32, position: u64) -> u32 {
    assert!(!logits.is_empty(), "sampling from no logits");
    assert!(logits.len() <= MAX_VOCAB, "a vocabulary of {} is above {MAX_VOCAB}", logits.len());
    let arg = argmax(logits);
    if s.temperature.is_nan() || s.temperature <= 0.0 || s.top_k == 1 {
        return arg;
    }
    let l_max = logits[arg as usize];
    let scale = LOG2E / s.temperature;
    // Rank order: key descending, then index ascending.
    let rank = |&a: &u32, &b: &u32| key(logits[b as usize]).cmp(&key(logits[a as usize])).then(a.cmp(&b));

    let mut candidates: Vec<u32> = (0..logits.len() as u32).collect();
    if s.top_k != 0 && (s.top_k as usize) < logits.len() {
        candidates.select_nth_unstable_by(s.top_k as usize - 1, rank);
        candidates.truncate(s.top_k as usize);
    }
    // Tokens of weight 0 add nothing to any sum and can never be drawn: only the others matter.
    let floor = min_p_floor(s.min_p);
    let mut weighted: Vec<(u32, u64)> = candidates
        .into_iter()
        .map(|c| (c, weight(logits[c as usize], l_max, scale)))
        .filter(|&(_, w)| w > 0 && w >= floor)
        .collect();
    let total: u64 = weighted.iter().map(|&(_, w)| w).sum();
    if total == 0 {
        return arg;
    }

    if s.top_p > 0.0 && s.top_p < 1.0 {
        let p24 = (s.top_p * 16_777_216.0).round_ties_even() as u64;
        let thresh = ((total as u128 * p24 as u128).div_ceil(1 << 24) as u64).max(1);
        if thresh < total {
            let keep = top_p_keep(&mut weighted, thresh, &rank);
            weighted.truncate(keep);
        }
    }

    weighted.sort_unstable_by_key(|&(c, _)| c);
    let kept: u64 = weighted.iter().map(|&(_, w)| w).sum();
    let r = mul_shift24(draw_bits(s.seed, stream, position), kept);
    let mut running = 0u64;
    for &(c, w) in &weighted {
        running += w;
        if running > r {
            return c;
        }
    }
    unreachable!("r = {r} is below the kept weight {kept}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_logprobs_order_ties_and_refusals() {
        let logits = [1.0f32, 3.0, 3.0, f32::NEG_INFINITY, 2.0];
        let top = top_logprobs(&logits, 4).unwrap();
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2, 4, 0], "a tie goes to the lower id");
        let log_z = (1f64.exp() + 2.0 * 3f64.exp() + 2f64.exp()).ln();
        assert!((top[0].1 as f64 - (3.0 - log_z)).abs() < 1e-6 && top[0].1 == top[1].1);
        assert_eq!(top_logprobs(&logits, 9).unwrap().len(), 5, "k past the row gives the whole row");
        assert_eq!(top_logprobs(&logits, 5).unwrap()[4], (3, f32::NEG_INFINITY));
        assert!(top_logprobs(&logits, 0).unwrap().is_empty());
        assert!(top_logprobs(&[0.0, f32::NAN], 1).is_none(), "a NaN");
        assert!(top_logprobs(&[f32::NEG_INFINITY; 3], 1).is_none(), "no finite logit");
        assert!(top_logprobs(&[0.0, f32::INFINITY], 1).is_none(), "an infinite logit");
    }

    #[test]
    fn splitmix64_matches_the_reference_sequence() {
        // The first outputs of the reference splitmix64 generator seeded with 0 (state advances by the
        // golden gamma, so output n is splitmix64((n - 1) * gamma)).
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(0x9E37_79B9_7F4A_7C15), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn uniform_stays_in_the_unit_interval_and_depends_on_every_input() {
        let u = uniform(7, 1, 2);
        assert!((0.0..1.0).contains(&u));
        assert_ne!(u, uniform(8, 1, 2));
        assert_ne!(u, uniform(7, 2, 2));
        assert_ne!(u, uniform(7, 1, 3));
    }

    #[test]
    fn constants_are_what_their_comments_say() {
        assert_eq!(LOG2E.to_bits(), 0x3FB8_AA3B);
        assert_eq!(LOG2E, std::f64::consts::LOG2_E as f32);
        let mut fact = 1f64;
        for (k, &bits) in EXP2_TAYLOR.iter().enumerate() {
            if k > 0 {
                fact *= k as f64;
            }
            let want = ((-std::f64::consts::LN_2).powi(k as i32) / fact) as f32;
            assert_eq!(bits, want.to_bits(), "coefficient {k}");
        }
    }

    #[test]
    fn exp2_weight_follows_two_to_the_minus_x() {
        assert_eq!(exp2_weight(0.0), 1 << 36);
        assert_eq!(exp2_weight(-0.0), 1 << 36);
        assert_eq!(exp2_weight(1.0), 1 << 35);
        assert_eq!(exp2_weight(36.0), 1);
        assert_eq!(exp2_weight(WEIGHT_CUTOFF), 0);
        assert_eq!(exp2_weight(f32::INFINITY), 0);
        assert_eq!(exp2_weight(f32::NAN), 0);
        let mut prev = u64::MAX;
        let mut x = 0f32;
        while x < WEIGHT_CUTOFF {
            let w = exp2_weight(x);
            let want = 2f64.powf(36.0 - x as f64);
            // Within 2 ulp of f32 relative, plus the final rounding to an integer.
            assert!((w as f64 - want).abs() <= want * 2.0 * f32::EPSILON as f64 / 2.0 + 0.5, "x {x}: {w} vs {want}");
            assert!(w <= prev, "x {x}: {w} after {prev}");
            prev = w;
            x += 1.0 / 1024.0 + x * 1e-4;
        }
    }

    #[test]
    fn key_order_is_the_total_order_of_f32() {
        let ordered = [f32::NEG_INFINITY, -1.0, -f32::MIN_POSITIVE, -0.0, 0.0, 1e-45, 1.0, f32::INFINITY, f32::NAN];
        for w in ordered.windows(2) {
            assert!(key(w[0]) < key(w[1]), "{} !< {}", w[0], w[1]);
        }
        assert!(key(-f32::NAN) < key(f32::NEG_INFINITY));
        assert_eq!(argmax(&[-0.0, 0.0, 0.0]), 1);
    }

    #[test]
    fn penalty_ids_are_the_distinct_ids_of_the_last_n_tokens() {
        let s = Sampling { repeat_penalty: 1.3, repeat_last_n: 4, ..Sampling::GREEDY };
        assert_eq!(penalty_ids(&[9, 8, 7, 7], &[5, 7], &s), vec![5, 7]);
        assert_eq!(penalty_ids(&[9, 8, 7, 3], &[5], &s), vec![3, 5, 7, 8]);
        assert_eq!(penalty_ids(&[], &[4, 4, 1, 2, 3, 4], &s), vec![1, 2, 3, 4]);
        assert_eq!(penalty_ids(&[1], &[], &s), vec![1]);
        let all = Sampling { repeat_last_n: u32::MAX, ..s };
        assert_eq!(penalty_ids(&[6, 2], &[2, 9], &all), vec![2, 6, 9]);
        for off in [
            Sampling { repeat_penalty: 1.0, ..s },
            Sampling { repeat_penalty: f32::NAN, ..s },
            Sampling { repeat_last_n: 0, ..s },
        ] {
            assert!(penalty_ids(&[1, 2], &[3], &off).is_empty(), "{off:?}");
        }
    }

    #[test]
    fn penalize_divides_positive_logits_and_multiplies_the_others() {
        assert_eq!(penalize(3.0, 1.5), 2.0);
        assert_eq!(penalize(-3.0, 1.5), -4.5);
        assert_eq!(penalize(0.0, 2.0), 0.0);
        assert_eq!(penalize(-0.0, 2.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(penalize(f32::INFINITY, 2.0), f32::INFINITY);
        assert_eq!(penalize(f32::NEG_INFINITY, 2.0), f32::NEG_INFINITY);
        let nan = f32::from_bits(0x7FC0_1234);
        assert_eq!(penalize(nan, 2.0).to_bits(), nan.to_bits(), "NaN is kept, bits and all");
        // A penalty below 1 makes repeats likelier.
        assert!(penalize(1.0, 0.5) > 1.0 && penalize(-1.0, 0.5) > -1.0);
    }

    #[test]
    fn min_p_keeps_the_tokens_at_least_min_p_as_likely_as_the_likeliest() {
        assert_eq!(min_p_floor(0.0), 0);
        assert_eq!(min_p_floor(-1.0), 0);
        assert_eq!(min_p_floor(f32::NAN), 0);
        assert_eq!(min_p_floor(1.0), 1 << 36);
        assert_eq!(min_p_floor(2.0), 1 << 36);
        assert_eq!(min_p_floor(0.5), 1 << 35);
        // At temperature 1 a logit ln(2) below the largest weighs half of it, 2 ln(2) below a quarter.
        let ln2 = std::f32::consts::LN_2;
        let logits = [0.0, -ln2, -2.0 * ln2, -3.0 * ln2];
        let s = Sampling { temperature: 1.0, ..Sampling::GREEDY };
        let drawn = |min_p: f32| -> Vec<u32> {
            let mut seen: Vec<u32> =
                (0..400).map(|p| sample(&logits, &Sampling { min_p, seed: 11, ..s }, 0, p)).collect();
            seen.sort_unstable();
            seen.dedup();
            seen
        };
        assert_eq!(drawn(0.0), vec![0, 1, 2, 3]);
        assert_eq!(drawn(0.2), vec![0, 1, 2], "1/8 < 0.2 <= 1/4");
        assert_eq!(drawn(0.45), vec![0, 1], "1/4 < 0.45 <= 1/2");
        assert_eq!(drawn(0.9), vec![0]);
        assert_eq!(drawn(1.0), vec![0]);
    }

    #[test]
    fn the_top_p_cut_by_selection_is_the_sorted_prefix() {
        let mut state = 0xC0FF_EEu64;
        let mut next = || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            splitmix64(state)
        };
        for case in 0..300 {
            let n = 2 + (next() % 3000) as usize;
            let logits: Vec<f32> = (0..n).map(|_| (next() % 64) as f32 / 4.0).collect();
            let rank = |&a: &u32, &b: &u32| key(logits[b as usize]).cmp(&key(logits[a as usize])).then(a.cmp(&b));
            let weighted: Vec<(u32, u64)> =
                (0..n as u32).map(|i| (i, exp2_weight(16.0 - logits[i as usize]))).filter(|e| e.1 > 0).collect();
            let total: u64 = weighted.iter().map(|e| e.1).sum();
            let thresh = 1 + next() % (total - 1).max(1);
            if thresh >= total {
                continue;
            }
            let mut sorted = weighted.clone();
            sorted.sort_unstable_by(|a, b| rank(&a.0, &b.0));
            let mut running = 0;
            let want = 1 + sorted
                .iter()
                .position(|e| {
                    running += e.1;
                    running >= thresh
                })
                .unwrap();
            let mut got = weighted.clone();
            let keep = top_p_keep(&mut got, thresh, &rank);
            assert_eq!(keep, want, "case {case}");
            let mut kept: Vec<u32> = got[..keep].iter().map(|e| e.0).collect();
            let mut expected: Vec<u32> = sorted[..want].iter().map(|e| e.0).collect();
            kept.sort_unstable();
            expected.sort_unstable();
            assert_eq!(kept, expected, "case {case}");
        }
    }

    #[test]
    fn a_mask_samples_as_minus_infinity_on_every_other_logit() {
        let mut state = 0x5EED_u64;
        let mut next = || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            splitmix64(state)
        };
        for case in 0..400u64 {
            let n = 1 + (next() % 300) as usize;
            let logits: Vec<f32> = (0..n).map(|_| (next() % 2000) as f32 / 100.0 - 10.0).collect();
            let mut allowed = vec![0u32; n.div_ceil(32) + 1];
            let density = 1 + next() % 8;
            for i in 0..n {
                if next() % density == 0 {
                    allowed[i / 32] |= 1 << (i % 32);
                }
            }
            // Bits past the logits are ignored.
            *allowed.last_mut().unwrap() |= 0x8000_0000;
            let first = (0..n).find(|&i| allowed[i / 32] >> (i % 32) & 1 == 1);
            let mut s = Sampling { seed: next(), ..Sampling::GREEDY };
            if case % 4 != 0 {
                s.temperature = 0.3 + (next() % 100) as f32 / 50.0;
            }
            if case % 3 == 0 {
                s.top_k = 1 + (next() % 20) as u32;
            }
            if case % 5 < 2 {
                s.top_p = 0.5 + (next() % 50) as f32 / 100.0;
            }
            if case % 7 < 3 {
                s.min_p = (next() % 30) as f32 / 100.0;
            }
            if case % 2 == 0 {
                (s.repeat_penalty, s.repeat_last_n) = (1.4, 6);
            }
            let history: Vec<u32> = (0..5).map(|_| (next() % n as u64) as u32).collect();
            let new = [(next() % n as u64) as u32];
            let got = sample_stream_masked(&logits, &allowed, &s, 3, &history, &new);
            let Some(first) = first else {
                assert_eq!(got, None, "case {case}: nothing allowed");
                continue;
            };
            let masked: Vec<f32> = (0..n)
                .map(|i| if allowed[i / 32] >> (i % 32) & 1 == 1 { logits[i] } else { f32::NEG_INFINITY })
                .collect();
            // A penalty never lifts -inf, so the masked row gives the same draw (its top-k may count
            // masked ids, which weigh 0).
            let want = sample_stream(&masked, &s, 3, &history, &new);
            assert_eq!(got, Some(want), "case {case}: {s:?}");
            assert!(got >= Some(first as u32));
        }
        // Every allowed logit -inf: the lowest allowed id, never a masked one.
        let row = [0.0, f32::NEG_INFINITY, f32::NEG_INFINITY];
        assert_eq!(sample_stream_masked(&row, &[0b110], &Sampling::GREEDY, 0, &[], &[1]), Some(1));
    }

    #[test]
    fn the_penalty_applies_before_greedy_and_to_the_prompt() {
        let logits = [1.0, 2.0, 1.9, -1.0];
        let s = Sampling { repeat_penalty: 1.2, repeat_last_n: 3, ..Sampling::GREEDY };
        // 2.0 / 1.2 < 1.9: the repeated token loses its lead.
        assert_eq!(sample_stream(&logits, &s, 0, &[], &[1]), 2);
        assert_eq!(sample_stream(&logits, &s, 0, &[1, 0], &[3, 3, 3]), 1, "token 1 is 4 tokens back");
        assert_eq!(sample_stream(&logits, &Sampling::GREEDY, 0, &[], &[1]), 1);
    }
}
