//! The sampler's unit tests: each step of the module comment's algorithm, and its constants.

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
        let mut seen: Vec<u32> = (0..400).map(|p| sample(&logits, &Sampling { min_p, seed: 11, ..s }, 0, p)).collect();
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
        let masked: Vec<f32> =
            (0..n).map(|i| if allowed[i / 32] >> (i % 32) & 1 == 1 { logits[i] } else { f32::NEG_INFINITY }).collect();
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
