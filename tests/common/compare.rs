//! Comparisons of logits and token streams: relative L2, largest difference, top-two gap, greedy runs, bits.

use super::{Held, logits, step};

/// Relative L2 distance of `got` from `want`, in f64; both must be finite (a NaN is an unwritten output).
pub fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    assert!(got.iter().chain(want).all(|v| v.is_finite()), "non-finite logits");
    let num: f64 = got.iter().zip(want).map(|(&g, &w)| (g as f64 - w as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|&w| (w as f64).powi(2)).sum();
    (num / den).sqrt()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}

/// The gap between the two largest values: below the measured error, a greedy pick may flip.
pub fn top_two_gap(l: &[f32]) -> f32 {
    let mut v = l.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    v[0] - v[1]
}

/// Both engines step `prompt`, then the same tokens (the reference's greedy choice); logits compared at every
/// step, and a differing choice allowed only where the reference's own gap is within twice the measured
/// error. Returns the worst relative L2 and the differing steps (step, gap between the choices, top-two
/// gap, error).
pub fn compare_greedy(
    what: &str,
    test: &Held,
    reference: &Held,
    prompt: &[i32],
    steps: usize,
) -> (f64, Vec<(usize, f32, f32, f32)>) {
    compare_greedy_with_jumps(what, test, reference, prompt, steps, 0)
}

/// `compare_greedy`, with up to `jumps` steps between 2e-2 and 6e-2 of relative L2: a Mixture of Experts'
/// router picks another expert where two scores are within the backends' difference, which moves that
/// step's logits by a few percent (every other step still within 2e-2).
pub fn compare_greedy_with_jumps(
    what: &str,
    test: &Held,
    reference: &Held,
    prompt: &[i32],
    steps: usize,
    jumps: usize,
) -> (f64, Vec<(usize, f32, f32, f32)>) {
    let (mut got, mut want) = (step(test, 0, prompt), step(reference, 0, prompt));
    let (mut worst, mut differ, mut jumped) = (0f64, Vec::new(), Vec::new());
    for i in 0..=steps {
        let (lt, lr) = (logits(test, 0), logits(reference, 0));
        let rel = rel_l2(&lt, &lr);
        if (2e-2..6e-2).contains(&rel) && jumped.len() < jumps {
            jumped.push((i, rel));
        } else {
            worst = worst.max(rel);
            assert!(rel < 2e-2, "{what} step {i}: relative L2 {rel:.3e} of the logits (jumps {jumped:?})");
        }
        if got != want {
            let err = max_abs_diff(&lt, &lr);
            let gap = lr[want as usize] - lr[got as usize];
            assert!(gap <= 2.0 * err, "{what} step {i}: chose {got} over {want}, gap {gap} > 2 x error {err}");
            differ.push((i, gap, top_two_gap(&lr), err));
        }
        if i < steps {
            let input = [want];
            (got, want) = (step(test, 0, &input), step(reference, 0, &input));
        }
    }
    println!(
        "{what}: {} greedy tokens, worst relative L2 {worst:.2e}, {} near-tie differences (step, gap, top-two gap, \
         max error): {differ:?}{}",
        steps + 1,
        differ.len(),
        if jumped.is_empty() { String::new() } else { format!(", router jumps (step, relative L2): {jumped:?}") }
    );
    (worst, differ)
}

/// Bit patterns, for comparing floats exactly.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
