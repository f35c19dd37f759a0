//! The sampler: greedy ties, seeded draws, temperature, top-k and top-p, and its definition on tie-heavy logits.

use crate::common::Rng;
use hostembed::sampler;
use hostembed::sampler::Sampling;

// ---------------------------------------------------------------------------------------------
// The sampler.

fn sampling(temperature: f32, top_k: u32, top_p: f32, seed: u64) -> Sampling {
    Sampling { temperature, top_k, top_p, seed, ..Sampling::GREEDY }
}

#[test]
fn greedy_is_argmax_with_the_lowest_index_on_ties() {
    let mut rng = Rng::fresh("greedy_is_argmax_with_the_lowest_index_on_ties");
    for _ in 0..100 {
        let logits = rng.vec(50, 4.0);
        let best = (0..50).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
        assert_eq!(sampler::sample(&logits, &Sampling::GREEDY, 0, 0), best as u32);
        assert_eq!(sampler::sample(&logits, &sampling(-1.0, 5, 0.5, 9), 3, 7), best as u32);
    }
    assert_eq!(sampler::sample(&[1.0, 3.0, 2.0, 3.0], &Sampling::GREEDY, 0, 0), 1);
    // A NaN temperature is not above 0: greedy too.
    assert_eq!(sampler::sample(&[1.0, 3.0, 2.0, 3.0], &sampling(f32::NAN, 0, 1.0, 9), 0, 0), 1);
}

#[test]
fn a_draw_repeats_for_the_same_seed_stream_and_position() {
    let mut rng = Rng::fresh("a_draw_repeats_for_the_same_seed_stream_and_position");
    let logits = vec![0.0f32; 1000]; // uniform: the draw alone picks the token
    let s = sampling(1.0, 0, 1.0, rng.next_u64());
    let picks: Vec<u32> = (0..64).map(|p| sampler::sample(&logits, &s, 2, p)).collect();
    let again: Vec<u32> = (0..64).map(|p| sampler::sample(&logits, &s, 2, p)).collect();
    assert_eq!(picks, again);
    let other_stream: Vec<u32> = (0..64).map(|p| sampler::sample(&logits, &s, 3, p)).collect();
    let other_seed: Vec<u32> =
        (0..64).map(|p| sampler::sample(&logits, &Sampling { seed: s.seed ^ 1, ..s }, 2, p)).collect();
    assert_ne!(picks, other_stream);
    assert_ne!(picks, other_seed);
    // With equal weights the pick is floor(bits * n / 2^24), bits = uniform * 2^24: the draw is `uniform`.
    for p in 0..64u64 {
        let bits = (sampler::uniform(s.seed, 2, p) * 16_777_216.0) as u64;
        assert_eq!(picks[p as usize] as u64, (bits * 1000) >> 24, "position {p}");
    }
}

#[test]
fn a_draw_on_a_cumulative_boundary_takes_the_next_token() {
    // 4096 equal weights of 2^36: r = u * 4096 * 2^36 and the running sums are k * 2^36 for k = 1..=4096.
    // Where r lands exactly on a sum k * 2^36 the strict "> r" picks token k, not k - 1.
    let mut rng = Rng::fresh("a_draw_on_a_cumulative_boundary_takes_the_next_token");
    let s = sampling(1.0, 0, 1.0, rng.next_u64());
    let logits = vec![0.5f32; 4096];
    let mut boundaries = 0;
    for p in 0..400_000u64 {
        let u = sampler::uniform(s.seed, 0, p);
        let scaled = u * 4096.0;
        if scaled == scaled.floor() && scaled > 0.0 {
            boundaries += 1;
            assert_eq!(sampler::sample(&logits, &s, 0, p), scaled as u32, "position {p}, u {u}");
        }
    }
    assert!(boundaries >= 20, "only {boundaries} boundary draws found");
}

#[test]
fn top_k_one_is_greedy() {
    let mut rng = Rng::fresh("top_k_one_is_greedy");
    for p in 0..200 {
        let logits = rng.vec(40, 2.0);
        let s = sampling(5.0, 1, 1.0, rng.next_u64());
        assert_eq!(sampler::sample(&logits, &s, 0, p), sampler::argmax(&logits));
    }
}

/// Frequencies over many positions against the probabilities computed here in f64.
fn assert_frequencies(logits: &[f32], s: &Sampling, expect: &[f64]) {
    let draws = 200_000u64;
    let mut counts = vec![0u64; logits.len()];
    for p in 0..draws {
        counts[sampler::sample(logits, s, 1, p) as usize] += 1;
    }
    for (i, (&c, &p)) in counts.iter().zip(expect).enumerate() {
        let freq = c as f64 / draws as f64;
        let sigma = (p * (1.0 - p) / draws as f64).sqrt();
        if p == 0.0 {
            assert_eq!(c, 0, "token {i} is outside the kept set but was drawn {c} times ({s:?})");
        } else {
            assert!((freq - p).abs() < 5.0 * sigma + 1e-4, "token {i}: frequency {freq} vs {p} ({s:?})");
        }
    }
}

#[test]
fn sampled_frequencies_follow_temperature_top_k_and_top_p() {
    let mut rng = Rng::fresh("sampled_frequencies_follow_temperature_top_k_and_top_p");
    let logits = [1.0f32, 3.0, 0.0, 2.5, -1.0, 2.0];
    let softmax = |t: f64, keep: &[usize]| -> Vec<f64> {
        let w: Vec<f64> = (0..logits.len())
            .map(|i| if keep.contains(&i) { ((logits[i] as f64 - 3.0) / t).exp() } else { 0.0 })
            .collect();
        let z: f64 = w.iter().sum();
        w.iter().map(|x| x / z).collect()
    };
    let seed = rng.next_u64();
    let all = [0, 1, 2, 3, 4, 5];
    assert_frequencies(&logits, &sampling(1.0, 0, 1.0, seed), &softmax(1.0, &all));
    assert_frequencies(&logits, &sampling(0.5, 0, 1.0, seed), &softmax(0.5, &all));
    assert_frequencies(&logits, &sampling(2.0, 100, 0.0, seed), &softmax(2.0, &all));
    // Top-k 3 keeps logits 3.0, 2.5, 2.0.
    assert_frequencies(&logits, &sampling(1.0, 3, 1.0, seed), &softmax(1.0, &[1, 3, 5]));
    // Top-p: at T=1 the sorted probabilities are .41 .25 .15 .09 .06 .03; 0.6 needs the first two.
    let p = softmax(1.0, &all);
    assert!(p[1] < 0.6 && p[1] + p[3] >= 0.6);
    assert_frequencies(&logits, &sampling(1.0, 0, 0.6, seed), &softmax(1.0, &[1, 3]));
    // Both: top-k 4 then top-p 0.8 of those four.
    let p4 = softmax(1.0, &[1, 3, 5, 0]);
    assert!(p4[1] + p4[3] < 0.8 && p4[1] + p4[3] + p4[5] >= 0.8);
    assert_frequencies(&logits, &sampling(1.0, 4, 0.8, seed), &softmax(1.0, &[1, 3, 5]));
}

#[test]
fn equal_logits_order_candidates_by_index() {
    // Top-k 2 of four equal logits keeps tokens 0 and 1; top-p 0.25 keeps token 0 alone.
    let logits = [1.0f32; 4];
    for p in 0..2000 {
        assert!(sampler::sample(&logits, &sampling(1.0, 2, 1.0, 3), 0, p) < 2);
        assert_eq!(sampler::sample(&logits, &sampling(1.0, 0, 0.25, 3), 0, p), 0);
    }
}

/// The sampler as src/sampler.rs's module comment defines it, written the plain way: a full sort, running
/// sums in rank order for top-p, then in index order for the draw.
fn sample_by_definition(logits: &[f32], s: &Sampling, stream: u32, position: u64) -> u32 {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| sampler::key(logits[b]).cmp(&sampler::key(logits[a])).then(a.cmp(&b)));
    if s.temperature.is_nan() || s.temperature <= 0.0 || s.top_k == 1 {
        return order[0] as u32;
    }
    if s.top_k != 0 && (s.top_k as usize) < logits.len() {
        order.truncate(s.top_k as usize);
    }
    let (l_max, scale) = (logits[order[0]], std::f32::consts::LOG2_E / s.temperature);
    let w: Vec<u64> = order.iter().map(|&i| sampler::exp2_weight((l_max - logits[i]) * scale)).collect();
    let total: u64 = w.iter().sum();
    if total == 0 {
        return order[0] as u32;
    }
    let mut kept = order.len();
    if s.top_p > 0.0 && s.top_p < 1.0 {
        let p24 = (s.top_p as f64 * 16_777_216.0).round_ties_even() as u128;
        let thresh = (((total as u128 * p24 + (1 << 24) - 1) >> 24) as u64).max(1);
        if thresh < total {
            let mut running = 0;
            kept = 0;
            while running < thresh {
                running += w[kept];
                kept += 1;
            }
        }
    }
    let mut keep: Vec<(usize, u64)> = order[..kept].iter().copied().zip(w[..kept].iter().copied()).collect();
    keep.sort();
    let kept_weight: u64 = keep.iter().map(|k| k.1).sum();
    let bits = (sampler::uniform(s.seed, stream, position) * 16_777_216.0) as u128;
    let r = ((bits * kept_weight as u128) >> 24) as u64;
    let mut running = 0;
    for (token, weight) in keep {
        running += weight;
        if running > r {
            return token as u32;
        }
    }
    panic!("r = {r} is not below the kept weight {kept_weight}");
}

#[test]
fn sample_follows_its_definition_on_tie_heavy_logits() {
    let mut rng = Rng::fresh("sample_follows_its_definition_on_tie_heavy_logits");
    let settings = [
        (1.0, 0, 1.0),
        (0.7, 40, 0.9),
        (0.8, 40, 0.95),
        (1.3, 0, 0.8),
        (0.6, 5, 1.0),
        (2.0, 100, 0.5),
        (1.0, 700, 0.95),
        (0.9, 3, 0.0),
        (1.0, 0, 1e-9),
        (0.02, 0, 0.99),
        (1e-30, 10, 0.9),
        (f32::INFINITY, 50, 0.5),
    ];
    let mut distinct = 0;
    for case in 0..12 {
        let vocab = [1, 2, 7, 300, 3000][case % 5];
        // Logits on a 0.5 grid tie by the hundred: the top-k cut, the top-p cut and the draw fall inside
        // runs of equal logits. Some are -inf (masked tokens), one case holds a NaN.
        let mut logits: Vec<f32> = rng.vec(vocab, 4.0).into_iter().map(|l| (l * 2.0).round() / 2.0).collect();
        for _ in 0..vocab / 10 {
            logits[rng.below(vocab as u64) as usize] = f32::NEG_INFINITY;
        }
        if case == 11 {
            logits[rng.below(vocab as u64) as usize] = f32::NAN;
        }
        for &(temperature, top_k, top_p) in &settings {
            let mut picks = std::collections::HashSet::new();
            for _ in 0..40 {
                let s = sampling(temperature, top_k, top_p, rng.next_u64());
                let (stream, position) = (rng.below(8) as u32, rng.below(1 << 40));
                let got = sampler::sample(&logits, &s, stream, position);
                let want = sample_by_definition(&logits, &s, stream, position);
                assert_eq!(got, want, "vocab {vocab} case {case} {s:?} stream {stream} position {position}");
                assert!(logits[got as usize] != f32::NEG_INFINITY || logits.iter().all(|&l| l == f32::NEG_INFINITY));
                picks.insert(got);
            }
            distinct += picks.len();
        }
    }
    // The draws did pick among many tokens, not just the argmax.
    assert!(distinct > 500, "only {distinct} distinct picks");
}
