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
mod tests;
