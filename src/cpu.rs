//! The CPU reference backend: the model in plain f32 Rust, readable rather than fast.
//!
//! Every GPU kernel is tested against the ops here, and CI decodes with `CpuModel`. Weights stay in
//! their stored format (F32/F16/BF16/Q8_0) and are decoded row by row as they are read. Dot products
//! accumulate in f64 so the oracle's own rounding stays far below any kernel's.

use crate::model::{ModelConfig, RopeScaling, TensorRef};

/// RMSNorm of one row: out = w * x / sqrt(mean(x^2) + eps).
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), w.len(), "rmsnorm: input and weight lengths differ");
    assert_eq!(x.len(), out.len(), "rmsnorm: input and output lengths differ");
    let mean_square = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len() as f64;
    let inv_rms = (1.0 / (mean_square + eps as f64).sqrt()) as f32;
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = g * (v * inv_rms);
    }
}

/// out[r] = sum_c w[r][c] * x[c] over a [rows, cols] weight in any stored format.
pub fn matvec(w: &TensorRef, x: &[f32], out: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(x.len(), cols, "matvec: input length does not match the weight's columns");
    assert_eq!(out.len(), rows, "matvec: output length does not match the weight's rows");
    let row_bytes = w.dtype.row_bytes(cols).expect("matvec: row size invalid for the weight's format");
    let mut row = vec![0f32; cols];
    for (r, o) in out.iter_mut().enumerate() {
        crate::tensor::decode_row(w.dtype, &w.bytes[r * row_bytes..(r + 1) * row_bytes], &mut row);
        *o = row.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() as f32;
    }
}

/// The head_dim/2 rotary inverse frequencies, with the config's scaling, in f32 as HF computes them.
pub fn rope_inv_freq(cfg: &ModelConfig) -> Vec<f32> {
    let dim = cfg.head_dim;
    let base: Vec<f32> = (0..dim / 2)
        .map(|i| {
            let exponent = (2 * i) as f32 / dim as f32;
            1.0 / (cfg.rope_theta as f64).powf(exponent as f64) as f32
        })
        .collect();
    match cfg.rope_scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
            let old_context = original_max_position as f32;
            let low_freq_wavelen = old_context / low_freq_factor;
            let high_freq_wavelen = old_context / high_freq_factor;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_freq_wavelen {
                        f
                    } else if wavelen > low_freq_wavelen {
                        f / factor
                    } else {
                        // Between the two wavelengths HF blends the scaled and unscaled frequency.
                        let smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

/// Rotates each of `n_heads` heads of `x` to position `pos`. Angle of pair i = pos * inv_freq[i]
/// (the product in f32, as HF forms it). Interleaved pairs are (2i, 2i+1); otherwise (i, i + head_dim/2).
pub fn rope(x: &mut [f32], n_heads: usize, head_dim: usize, pos: usize, inv_freq: &[f32], interleaved: bool) {
    let half = head_dim / 2;
    assert_eq!(x.len(), n_heads * head_dim, "rope: input is not n_heads x head_dim");
    assert_eq!(inv_freq.len(), half, "rope: need head_dim/2 frequencies");
    for head in x.chunks_exact_mut(head_dim) {
        for (i, &freq) in inv_freq.iter().enumerate() {
            let angle = (pos as f32 * freq) as f64;
            let (sin, cos) = (angle.sin() as f32, angle.cos() as f32);
            let (a, b) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
            let (xa, xb) = (head[a], head[b]);
            head[a] = xa * cos - xb * sin;
            head[b] = xb * cos + xa * sin;
        }
    }
}

/// One query (`heads` x `head_dim`) attending over `n_ctx` cached positions; `k` and `v` hold
/// [n_ctx][kv_heads * head_dim] (longer slices are fine: only the first n_ctx rows are read).
/// Query head h reads KV head h / (heads / kv_heads); scores are scaled by 1/sqrt(head_dim).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_ctx: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    let kv_dim = kv_heads * head_dim;
    assert!(kv_heads > 0 && heads % kv_heads == 0, "attention: heads must be a multiple of kv_heads");
    assert_eq!(q.len(), heads * head_dim, "attention: query is not heads x head_dim");
    assert_eq!(out.len(), heads * head_dim, "attention: output is not heads x head_dim");
    assert!(k.len() >= n_ctx * kv_dim && v.len() >= n_ctx * kv_dim, "attention: cache shorter than n_ctx");
    let group = heads / kv_heads;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let mut scores = vec![0f64; n_ctx];
    for h in 0..heads {
        let qh = &q[h * head_dim..(h + 1) * head_dim];
        let kv_off = (h / group) * head_dim;
        for (t, s) in scores.iter_mut().enumerate() {
            let kt = &k[t * kv_dim + kv_off..t * kv_dim + kv_off + head_dim];
            *s = qh.iter().zip(kt).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale;
        }
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let mut total = 0f64;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            total += *s;
        }
        let oh = &mut out[h * head_dim..(h + 1) * head_dim];
        for (d, o) in oh.iter_mut().enumerate() {
            let acc: f64 = scores.iter().enumerate().map(|(t, &p)| p * v[t * kv_dim + kv_off + d] as f64).sum();
            *o = (acc / total) as f32;
        }
    }
}

/// SwiGLU: out = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && up.len() == out.len(), "swiglu: lengths differ");
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = (g / (1.0 + (-g).exp())) * u;
    }
}

/// a += b (the residual connection).
pub fn add(a: &mut [f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "add: lengths differ");
    for (x, &y) in a.iter_mut().zip(b) {
        *x += y;
    }
}
