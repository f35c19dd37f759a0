//! The ops against explicit formulas: RMSNorm, the matvec in every format, RoPE and its scalings, attention, SwiGLU.

use super::{rounding_bound, small_config};
use crate::common::{Rng, rel_l2};
use hostembed::cpu;
use hostembed::model::{Arch, ModelConfig, RopeScaling, TensorRef};
use hostembed::tensor::{FORMATS, encode_row};

// ---------------------------------------------------------------------------------------------
// Ops.

#[test]
fn rmsnorm_gives_unit_rms_times_the_weight() {
    let mut rng = Rng::fresh("rmsnorm_gives_unit_rms_times_the_weight");
    let x = rng.vec(257, 3.0);
    let w = rng.vec(257, 1.0);
    let mut out = vec![0f32; 257];
    cpu::rmsnorm(&x, &w, 0.0, &mut out);
    let normalized: Vec<f64> = out.iter().zip(&w).map(|(&o, &g)| o as f64 / g as f64).collect();
    let rms = (normalized.iter().map(|v| v * v).sum::<f64>() / 257.0).sqrt();
    assert!((rms - 1.0).abs() < 1e-5, "rms {rms}");
    // Direction kept: normalized is a positive multiple of x.
    let ratio = normalized[0] / x[0] as f64;
    assert!(ratio > 0.0);
    for (n, &v) in normalized.iter().zip(&x) {
        assert!((n - ratio * v as f64).abs() < 1e-4 * n.abs().max(1.0), "{n} vs {}", ratio * v as f64);
    }
    // eps enters under the root: a zero row stays zero and finite.
    cpu::rmsnorm(&vec![0.0; 257], &w, 1e-6, &mut out);
    assert!(out.iter().all(|&v| v == 0.0));
}

#[test]
fn matvec_decodes_every_format() {
    let mut rng = Rng::fresh("matvec_decodes_every_format");
    // One k-quant super-block a row.
    let (rows, cols) = (13, 256);
    let values = rng.vec(rows * cols, 1.0);
    let x = rng.vec(cols, 1.0);
    for dtype in FORMATS.iter().map(|f| f.dtype) {
        let bytes: Vec<u8> = values.chunks(cols).flat_map(|r| encode_row(dtype, r)).collect();
        let shape = [rows, cols];
        let w = TensorRef { dtype, shape: &shape, bytes: &bytes };
        let decoded = w.to_f32();
        let mut out = vec![0f32; rows];
        cpu::matvec(&w, &x, &mut out);
        for r in 0..rows {
            let expect: f64 = (0..cols).map(|c| decoded[r * cols + c] as f64 * x[c] as f64).sum();
            // f32 lanes: a few roundings of 2^-24 each, relative to the sum of the products' sizes.
            let size: f64 = (0..cols).map(|c| (decoded[r * cols + c] as f64 * x[c] as f64).abs()).sum();
            assert!((out[r] as f64 - expect).abs() <= 1e-6 * size.max(1.0), "{dtype:?} row {r}");
        }
        // The stored format's rounding stays a rounding, not a different matrix.
        let exact: Vec<f32> = (0..rows)
            .map(|r| (0..cols).map(|c| values[r * cols + c] as f64 * x[c] as f64).sum::<f64>() as f32)
            .collect();
        let err = rel_l2(&out, &exact);
        assert!(err < rounding_bound(dtype), "{dtype:?}: relative L2 {err} against the unrounded product");
    }
}

#[test]
fn rope_matches_an_explicit_rotation() {
    let mut rng = Rng::fresh("rope_matches_an_explicit_rotation");
    let (heads, head_dim, theta) = (3, 64, 10000f64);
    let cfg = ModelConfig { head_dim, rope_theta: theta as f32, ..small_config(Arch::Qwen3) };
    let inv_freq = cpu::rope_inv_freq(&cfg);
    for (i, &f) in inv_freq.iter().enumerate() {
        let expect = theta.powf(-(2.0 * i as f64) / head_dim as f64);
        assert!((f as f64 - expect).abs() <= 1e-6 * expect, "inv_freq[{i}] {f} vs {expect}");
    }
    let x = rng.vec(heads * head_dim, 1.0);
    let pos = 1 + rng.below(500) as usize;
    let mut rotated = x.clone();
    cpu::rope(&mut rotated, heads, head_dim, pos, &inv_freq, false);
    let half = head_dim / 2;
    for h in 0..heads {
        for i in 0..half {
            let angle = pos as f64 * theta.powf(-(2.0 * i as f64) / head_dim as f64);
            let (a, b) = (x[h * head_dim + i] as f64, x[h * head_dim + i + half] as f64);
            let (ra, rb) = (a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos());
            // An f32 angle of up to ~500 radians carries ~3e-5 of absolute error.
            assert!((rotated[h * head_dim + i] as f64 - ra).abs() < 1e-4, "head {h} pair {i}");
            assert!((rotated[h * head_dim + i + half] as f64 - rb).abs() < 1e-4, "head {h} pair {i}");
        }
    }
    // Position 0 is the identity.
    let mut same = x.clone();
    cpu::rope(&mut same, heads, head_dim, 0, &inv_freq, false);
    assert_eq!(same, x);
}

#[test]
fn rope_scores_depend_only_on_relative_position() {
    let mut rng = Rng::fresh("rope_scores_depend_only_on_relative_position");
    let cfg = small_config(Arch::Llama);
    let inv_freq = cpu::rope_inv_freq(&cfg);
    let (q, k) = (rng.vec(cfg.head_dim, 1.0), rng.vec(cfg.head_dim, 1.0));
    let score = |m: usize, n: usize| {
        let (mut qm, mut kn) = (q.clone(), k.clone());
        cpu::rope(&mut qm, 1, cfg.head_dim, m, &inv_freq, false);
        cpu::rope(&mut kn, 1, cfg.head_dim, n, &inv_freq, false);
        qm.iter().zip(&kn).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>()
    };
    let shift = 1 + rng.below(40) as usize;
    assert!((score(7, 3) - score(7 + shift, 3 + shift)).abs() < 1e-4);
    assert!((score(7, 3) - score(7, 4)).abs() > 1e-6, "rotation had no effect");
}

#[test]
fn interleaved_rope_equals_half_rope_under_the_row_permutation() {
    let mut rng = Rng::fresh("interleaved_rope_equals_half_rope_under_the_row_permutation");
    let (heads, head_dim) = (4, 32);
    let cfg = ModelConfig { head_dim, ..small_config(Arch::Qwen2) };
    let inv_freq = cpu::rope_inv_freq(&cfg);
    let half_layout = rng.vec(heads * head_dim, 1.0);
    // Half layout index i pairs with i + d/2; interleaved puts that pair at 2i, 2i+1.
    let permute = |x: &[f32]| -> Vec<f32> {
        let mut out = vec![0f32; x.len()];
        for h in 0..heads {
            for i in 0..head_dim / 2 {
                out[h * head_dim + 2 * i] = x[h * head_dim + i];
                out[h * head_dim + 2 * i + 1] = x[h * head_dim + i + head_dim / 2];
            }
        }
        out
    };
    let pos = rng.below(1000) as usize;
    let mut a = half_layout.clone();
    cpu::rope(&mut a, heads, head_dim, pos, &inv_freq, false);
    let mut b = permute(&half_layout);
    cpu::rope(&mut b, heads, head_dim, pos, &inv_freq, true);
    assert_eq!(permute(&a), b);
}

#[test]
fn rope_scaling_follows_the_linear_and_llama3_rules() {
    let base_cfg = ModelConfig { head_dim: 128, rope_theta: 500000.0, ..small_config(Arch::Llama) };
    let base = cpu::rope_inv_freq(&ModelConfig { rope_scaling: RopeScaling::None, ..base_cfg.clone() });
    let linear =
        cpu::rope_inv_freq(&ModelConfig { rope_scaling: RopeScaling::Linear { factor: 4.0 }, ..base_cfg.clone() });
    for (b, l) in base.iter().zip(&linear) {
        assert_eq!(*l, b / 4.0);
    }
    let (factor, low, high, original) = (8.0f64, 1.0f64, 4.0f64, 8192.0f64);
    let scaling = RopeScaling::Llama3 {
        factor: factor as f32,
        low_freq_factor: low as f32,
        high_freq_factor: high as f32,
        original_max_position: original as u32,
    };
    let llama3 = cpu::rope_inv_freq(&ModelConfig { rope_scaling: scaling, ..base_cfg });
    let mut bands = [0; 3];
    for (&b, &s) in base.iter().zip(&llama3) {
        let (b, s) = (b as f64, s as f64);
        let wavelen = 2.0 * std::f64::consts::PI / b;
        let expect = if wavelen < original / high {
            bands[0] += 1;
            b
        } else if wavelen > original / low {
            bands[1] += 1;
            b / factor
        } else {
            bands[2] += 1;
            let smooth = (original / wavelen - low) / (high - low);
            (1.0 - smooth) * b / factor + smooth * b
        };
        assert!((s - expect).abs() <= 1e-5 * expect, "{s} vs {expect}");
    }
    assert!(bands.iter().all(|&n| n > 0), "the test must cover all three bands: {bands:?}");
}

#[test]
fn attention_matches_softmax_over_the_right_kv_head() {
    let mut rng = Rng::fresh("attention_matches_softmax_over_the_right_kv_head");
    let (heads, kv_heads, head_dim, n_ctx) = (6, 2, 8, 11);
    let kv_dim = kv_heads * head_dim;
    let q = rng.vec(heads * head_dim, 1.0);
    // The cache is longer than n_ctx: rows past it must be ignored.
    let mut k = rng.vec((n_ctx + 3) * kv_dim, 1.0);
    let v = rng.vec((n_ctx + 3) * kv_dim, 1.0);
    let mut out = vec![0f32; heads * head_dim];
    cpu::attention(&q, &k, &v, n_ctx, heads, kv_heads, head_dim, &mut out);
    for h in 0..heads {
        let g = h / (heads / kv_heads);
        let scores: Vec<f64> = (0..n_ctx)
            .map(|t| {
                (0..head_dim).map(|d| q[h * head_dim + d] as f64 * k[t * kv_dim + g * head_dim + d] as f64).sum::<f64>()
                    / (head_dim as f64).sqrt()
            })
            .collect();
        let z: f64 = scores.iter().map(|s| s.exp()).sum();
        for d in 0..head_dim {
            let expect: f64 = (0..n_ctx).map(|t| scores[t].exp() / z * v[t * kv_dim + g * head_dim + d] as f64).sum();
            assert!((out[h * head_dim + d] as f64 - expect).abs() < 1e-5, "head {h} dim {d}");
        }
    }
    k[n_ctx * kv_dim..].iter_mut().for_each(|x| *x = 1e9);
    let mut again = vec![0f32; heads * head_dim];
    cpu::attention(&q, &k, &v, n_ctx, heads, kv_heads, head_dim, &mut again);
    assert_eq!(out, again);
}

#[test]
fn swiglu_and_add() {
    let gate = [0.0f32, 1.0, -2.0, 30.0];
    let up = [5.0f32, 2.0, 3.0, 0.5];
    let mut out = [0f32; 4];
    cpu::swiglu(&gate, &up, &mut out);
    for i in 0..4 {
        let g = gate[i] as f64;
        let expect = g / (1.0 + (-g).exp()) * up[i] as f64;
        assert!((out[i] as f64 - expect).abs() < 1e-6 * expect.abs().max(1.0), "{i}: {} vs {expect}", out[i]);
    }
    let mut a = [1.0f32, 2.0];
    cpu::add(&mut a, &[0.5, -3.0]);
    assert_eq!(a, [1.5, -1.0]);
}
