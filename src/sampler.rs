//! Choosing the next token from logits: greedy, or temperature + top-k + top-p with a seeded draw.
//!
//! The device sampler implements this same algorithm, so each step is specified exactly:
//! 1. `temperature <= 0`: argmax, the lowest index winning ties.
//! 2. Candidates: the `top_k` largest logits (all when `top_k` is 0 or >= vocab), ordered by logit
//!    descending, ties by lower index.
//! 3. Weights in f32: `p_i = exp((l_i - l_max) / T)`; `total` = their sum accumulated in f32 in
//!    candidate order.
//! 4. Top-p (only when 0 < top_p < 1): keep the shortest prefix whose running sum >= `top_p * total`.
//!    `kept` is the running sum at the last kept candidate.
//! 5. `r = u * kept` with `u = uniform(seed, stream, position)`; return the first kept candidate whose
//!    running sum (the same f32 sums as in step 3) is > r, or the last kept candidate if none is.
//!
//! The draw depends only on (seed, stream, position), where `position` is the index in the stream of
//! the token being produced, so a run repeats exactly whatever the placement or batching.

/// The sampler's options; part of the engine options handed in from C.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// <= 0 picks greedily.
    pub temperature: f32,
    /// 0 keeps every token.
    pub top_k: u32,
    /// >= 1 or <= 0 keeps every token.
    pub top_p: f32,
    pub seed: u64,
}

impl Sampling {
    pub const GREEDY: Sampling = Sampling { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 };
}

/// splitmix64's output function applied to `x` (wrapping arithmetic).
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The draw for one token in [0, 1): 24 random bits, so exact in f32.
pub fn uniform(seed: u64, stream: u32, position: u64) -> f32 {
    let key = splitmix64(((stream as u64) << 40) ^ position);
    (splitmix64(seed ^ key) >> 40) as f32 / 16_777_216.0
}

/// Index of the largest logit, the lowest index among equals.
pub fn argmax(logits: &[f32]) -> u32 {
    assert!(!logits.is_empty(), "argmax of no logits");
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate().skip(1) {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The token chosen from `logits` for `stream`'s token at `position` (see the module comment).
pub fn sample(logits: &[f32], s: &Sampling, stream: u32, position: u64) -> u32 {
    if s.temperature <= 0.0 {
        return argmax(logits);
    }
    assert!(!logits.is_empty(), "sampling from no logits");
    let mut candidates: Vec<u32> = (0..logits.len() as u32).collect();
    // Logit descending, then index ascending: a strict order, so the result never depends on the sort.
    candidates.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    if s.top_k != 0 && (s.top_k as usize) < logits.len() {
        candidates.truncate(s.top_k as usize);
    }

    let l_max = logits[candidates[0] as usize];
    let mut running = Vec::with_capacity(candidates.len());
    let mut total = 0f32;
    for &c in &candidates {
        total += ((logits[c as usize] - l_max) / s.temperature).exp();
        running.push(total);
    }

    let mut kept = candidates.len();
    if s.top_p > 0.0 && s.top_p < 1.0 {
        let threshold = s.top_p * total;
        kept = running.iter().position(|&c| c >= threshold).map_or(candidates.len(), |i| i + 1);
    }
    let r = uniform(s.seed, stream, position) * running[kept - 1];
    let chosen = running[..kept].iter().position(|&c| c > r).unwrap_or(kept - 1);
    candidates[chosen]
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
