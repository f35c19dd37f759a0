//! The CPU reference backend and the sampler: ops against explicit formulas, the model's invariants
//! (KV cache, GQA, tied heads, stored formats), its refusals, and parity with HF transformers.

mod common;
use common::rel_l2;

use std::collections::HashMap;
use std::path::Path;

use common::Rng;
use hostembed::Status;
use hostembed::checkpoint::write;
use hostembed::cpu::{self, CpuModel};
use hostembed::model::{Arch, ModelConfig, RopeScaling, TensorRef, TensorSource, names};
use hostembed::sampler::{self, Sampling};
use hostembed::tensor::{self, DType, FORMATS, Simd, encode_row};

// ---------------------------------------------------------------------------------------------
// An in-memory model: the synthetic weight formula, and a TensorSource over encoded bytes.

struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

struct MemSource {
    cfg: ModelConfig,
    tensors: HashMap<String, Tensor>,
}

impl TensorSource for MemSource {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn tensor(&self, name: &str) -> hostembed::Result<TensorRef<'_>> {
        let t = self.tensors.get(name).ok_or_else(|| hostembed::err!(BadModel, "tensor {name} is missing"))?;
        Ok(TensorRef { dtype: t.dtype, shape: &t.shape, bytes: &t.bytes })
    }
}

impl MemSource {
    fn from_f32(cfg: ModelConfig, weights: Vec<(String, Vec<usize>, Vec<f32>)>, dtype: DType) -> MemSource {
        let tensors = weights
            .into_iter()
            .map(|(name, shape, values)| {
                // Vectors stay f32 (as GGUF keeps norms); matrices take the asked format.
                let dtype = if shape.len() == 1 { DType::F32 } else { dtype };
                let cols = *shape.last().unwrap();
                let bytes = values.chunks(cols).flat_map(|row| encode_row(dtype, row)).collect();
                (name, Tensor { dtype, shape, bytes })
            })
            .collect();
        MemSource { cfg, tensors }
    }

    fn f32_values(&self, name: &str) -> Vec<f32> {
        self.tensor(name).unwrap().to_f32()
    }

    fn set_f32(&mut self, name: &str, shape: Vec<usize>, values: &[f32]) {
        let cols = *shape.last().unwrap();
        let bytes = values.chunks(cols).flat_map(|row| encode_row(DType::F32, row)).collect();
        self.tensors.insert(name.to_string(), Tensor { dtype: DType::F32, shape, bytes });
    }
}

/// The synthetic weight formula scripts/hf_reference.py and the checkpoint writer share.
fn synthetic_tensor(name: &str, shape: &[usize], seed: u64) -> Vec<f32> {
    (0..shape.iter().product()).map(|i| write::synthetic_element(name, shape, seed, i)).collect()
}

/// Every tensor the config needs, canonical names and HF shapes.
fn tensor_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    hostembed::checkpoint::expected_tensors(cfg)
}

fn synthetic_model(cfg: &ModelConfig, seed: u64, dtype: DType) -> MemSource {
    let weights = tensor_shapes(cfg)
        .into_iter()
        .map(|(name, shape)| (name.clone(), shape.clone(), synthetic_tensor(&name, &shape, seed)))
        .collect();
    MemSource::from_f32(cfg.clone(), weights, dtype)
}

fn small_config(arch: Arch) -> ModelConfig {
    let mut cfg = ModelConfig {
        arch,
        vocab: 96,
        hidden: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        intermediate: 96,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 64,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: Some(1),
        eos: Some(2),
    };
    match arch {
        Arch::Llama => {
            cfg.rope_scaling = RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 16,
            }
        }
        Arch::Qwen2 => {
            cfg.qkv_bias = true;
            cfg.tied = true;
        }
        Arch::Qwen3 => {
            cfg.qk_norm = true;
            cfg.head_dim = 32; // q_dim 128 against hidden 64: head_dim independent of hidden/heads
        }
        Arch::Gemma3 => unreachable!("Gemma 3's small models are tests/gemma3.rs's"),
    }
    cfg
}

/// The llama family, whose plain definition `layer_major_logits` spells out (Gemma 3: tests/gemma3.rs).
const ARCHS: [Arch; 3] = [Arch::Llama, Arch::Qwen2, Arch::Qwen3];

fn tokens(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
}

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

/// Relative L2 error a format's rounding of uniform weights may cause in a product (several times the
/// typical error of its bits).
fn rounding_bound(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-6,
        DType::F16 | DType::Bf16 | DType::Q8_0 => 0.02,
        DType::Q6_K => 0.05,
        DType::Q5_0 | DType::Q5_1 | DType::Q5_K => 0.1,
        DType::Q4_0 | DType::Q4_1 | DType::Q4_K => 0.2,
        DType::Q3_K => 0.4,
        DType::Q2_K => 0.8,
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

// ---------------------------------------------------------------------------------------------
// The model.

/// `cpu::attention`'s signature: one query over `n_ctx` cached positions.
type AttentionFn = fn(&[f32], &[f32], &[f32], usize, usize, usize, usize, &mut [f32]);
/// `cpu::matvec`'s signature.
type MatvecFn = fn(&TensorRef, &[f32], &mut [f32]);

/// The model computed layer by layer over the whole sequence at once, with no cache carried between
/// tokens: the same ops in another schedule, so a cache that stores or reads the wrong rows shows.
fn layer_major_logits(src: &MemSource, toks: &[u32]) -> Vec<Vec<f32>> {
    layer_major_logits_with(src, toks, cpu::matvec, cpu::attention)
}

/// `layer_major_logits` with other products and attention.
fn layer_major_logits_with(src: &MemSource, toks: &[u32], product: MatvecFn, attention: AttentionFn) -> Vec<Vec<f32>> {
    let cfg = &src.cfg;
    let (_n, q_dim, kv_dim, hd) = (toks.len(), cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
    let w = |name: &str| src.tensor(name).unwrap();
    let inv_freq = cpu::rope_inv_freq(cfg);
    let matvec = |name: &str, x: &[f32], rows: usize| {
        let mut out = vec![0f32; rows];
        product(&w(name), x, &mut out);
        out
    };
    let norm = |x: &[f32], weight: &[f32]| {
        let mut out = vec![0f32; x.len()];
        cpu::rmsnorm(x, weight, cfg.rms_eps, &mut out);
        out
    };
    let mut xs: Vec<Vec<f32>> = toks.iter().map(|&t| w(names::EMBED).row_f32(t as usize)).collect();
    for i in 0..cfg.layers {
        let l = |part: &str| names::layer(i, part);
        let (mut qs, mut ks, mut vs) = (vec![], vec![], vec![]);
        for (pos, x) in xs.iter().enumerate() {
            let h = norm(x, &src.f32_values(&l(names::ATTN_NORM)));
            let (mut q, mut k, mut v) =
                (matvec(&l(names::Q), &h, q_dim), matvec(&l(names::K), &h, kv_dim), matvec(&l(names::V), &h, kv_dim));
            if cfg.qkv_bias {
                cpu::add(&mut q, &src.f32_values(&l(names::Q_BIAS)));
                cpu::add(&mut k, &src.f32_values(&l(names::K_BIAS)));
                cpu::add(&mut v, &src.f32_values(&l(names::V_BIAS)));
            }
            if cfg.qk_norm {
                let (qn, kn) = (src.f32_values(&l(names::Q_NORM)), src.f32_values(&l(names::K_NORM)));
                q = q.chunks(hd).flat_map(|head| norm(head, &qn)).collect();
                k = k.chunks(hd).flat_map(|head| norm(head, &kn)).collect();
            }
            cpu::rope(&mut q, cfg.heads, hd, pos, &inv_freq, cfg.rope_interleaved);
            cpu::rope(&mut k, cfg.kv_heads, hd, pos, &inv_freq, cfg.rope_interleaved);
            qs.push(q);
            ks.extend(k);
            vs.extend(v);
        }
        for (pos, x) in xs.iter_mut().enumerate() {
            let mut attn = vec![0f32; q_dim];
            attention(&qs[pos], &ks, &vs, pos + 1, cfg.heads, cfg.kv_heads, hd, &mut attn);
            cpu::add(x, &matvec(&l(names::O), &attn, cfg.hidden));
            let h = norm(x, &src.f32_values(&l(names::FFN_NORM)));
            let mut gated = vec![0f32; cfg.intermediate];
            let (gate, up) =
                (matvec(&l(names::GATE), &h, cfg.intermediate), matvec(&l(names::UP), &h, cfg.intermediate));
            cpu::swiglu(&gate, &up, &mut gated);
            cpu::add(x, &matvec(&l(names::DOWN), &gated, cfg.hidden));
        }
    }
    let head = if cfg.tied { names::EMBED } else { names::LM_HEAD };
    xs.iter().map(|x| matvec(head, &norm(x, &src.f32_values(names::FINAL_NORM)), cfg.vocab)).collect()
}

#[test]
fn cached_forward_equals_layer_major_recomputation_in_any_chunking() {
    let mut rng = Rng::fresh("cached_forward_equals_layer_major_recomputation_in_any_chunking");
    for arch in ARCHS {
        let cfg = small_config(arch);
        let src = synthetic_model(&cfg, rng.next_u64(), DType::F32);
        let model = CpuModel::new(&src).unwrap();
        let toks = tokens(&mut rng, 20, cfg.vocab);
        let mut stream = model.new_stream(32);
        let all = model.forward_all(&mut stream, &toks).unwrap();
        assert_eq!(all.len(), toks.len());
        assert_eq!(stream.len(), toks.len());
        assert_eq!(all, layer_major_logits(&src, &toks), "{arch:?}");

        // The same tokens in random chunks through forward: the cache carries the rest.
        let mut chunked = model.new_stream(32);
        let mut at = 0;
        while at < toks.len() {
            let n = (1 + rng.below(5) as usize).min(toks.len() - at);
            let logits = model.forward(&mut chunked, &toks[at..at + n]).unwrap();
            at += n;
            assert_eq!(logits, all[at - 1], "{arch:?} after {at} tokens");
        }

        // A reset stream decodes as a fresh one; a second stream is independent of the first.
        chunked.reset();
        let mut other = model.new_stream(32);
        model.forward(&mut other, &toks[5..9]).unwrap();
        assert_eq!(model.forward_all(&mut chunked, &toks).unwrap(), all);

        // Position matters: the same token later gives other logits.
        assert_ne!(all[0], model.forward(&mut other, &toks[..1]).unwrap());
    }
}

#[test]
fn gqa_equals_mha_with_kv_heads_repeated() {
    let mut rng = Rng::fresh("gqa_equals_mha_with_kv_heads_repeated");
    for arch in ARCHS {
        let cfg = small_config(arch);
        let gqa = synthetic_model(&cfg, rng.next_u64(), DType::F32);
        let group = cfg.heads / cfg.kv_heads;
        assert!(group > 1);
        let mha_cfg = ModelConfig { kv_heads: cfg.heads, ..cfg.clone() };
        let mut mha = MemSource { cfg: mha_cfg, tensors: HashMap::new() };
        for (name, t) in &gqa.tensors {
            mha.tensors.insert(name.clone(), Tensor { dtype: t.dtype, shape: t.shape.clone(), bytes: t.bytes.clone() });
        }
        // KV head j becomes heads j*group .. j*group+group-1, so query head h still reads j = h/group.
        let repeat = |values: &[f32], row_len: usize| -> Vec<f32> {
            values
                .chunks(cfg.head_dim * row_len)
                .flat_map(|head| (0..group).flat_map(move |_| head.iter().copied()))
                .collect()
        };
        for i in 0..cfg.layers {
            for part in [names::K, names::V] {
                let name = names::layer(i, part);
                let values = repeat(&gqa.f32_values(&name), cfg.hidden);
                mha.set_f32(&name, vec![cfg.q_dim(), cfg.hidden], &values);
            }
            if cfg.qkv_bias {
                for part in [names::K_BIAS, names::V_BIAS] {
                    let name = names::layer(i, part);
                    let values = repeat(&gqa.f32_values(&name), 1);
                    mha.set_f32(&name, vec![cfg.q_dim()], &values);
                }
            }
        }
        let toks = tokens(&mut rng, 12, cfg.vocab);
        let a =
            CpuModel::new(&gqa).unwrap().forward_all(&mut CpuModel::new(&gqa).unwrap().new_stream(12), &toks).unwrap();
        let mha_model = CpuModel::new(&mha).unwrap();
        let b = mha_model.forward_all(&mut mha_model.new_stream(12), &toks).unwrap();
        for (pos, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(rel_l2(x, y) < 1e-6, "{arch:?} position {pos}: {}", rel_l2(x, y));
        }
    }
}

#[test]
fn tied_head_equals_an_untied_copy_of_the_embedding() {
    let mut rng = Rng::fresh("tied_head_equals_an_untied_copy_of_the_embedding");
    let cfg = small_config(Arch::Qwen2);
    assert!(cfg.tied);
    let tied = synthetic_model(&cfg, rng.next_u64(), DType::F32);
    let mut untied = MemSource { cfg: ModelConfig { tied: false, ..cfg.clone() }, tensors: HashMap::new() };
    for (name, t) in &tied.tensors {
        untied.tensors.insert(name.clone(), Tensor { dtype: t.dtype, shape: t.shape.clone(), bytes: t.bytes.clone() });
    }
    let embed = tied.f32_values(names::EMBED);
    untied.set_f32(names::LM_HEAD, vec![cfg.vocab, cfg.hidden], &embed);
    let toks = tokens(&mut rng, 8, cfg.vocab);
    let run = |src: &MemSource| {
        let m = CpuModel::new(src).unwrap();
        m.forward_all(&mut m.new_stream(8), &toks).unwrap()
    };
    let expect = run(&untied);
    assert_eq!(run(&tied), expect);
    // And the head is really read: another head gives other logits.
    let other: Vec<f32> = embed.iter().map(|v| -v).collect();
    untied.set_f32(names::LM_HEAD, vec![cfg.vocab, cfg.hidden], &other);
    assert_ne!(run(&untied), expect);
}

#[test]
fn stored_formats_decode_to_the_same_model() {
    let mut rng = Rng::fresh("stored_formats_decode_to_the_same_model");
    // Q8_0 needs every matrix's columns to be multiples of 32.
    let cfg = ModelConfig { vocab: 64, ..small_config(Arch::Llama) };
    let seed = rng.next_u64();
    let toks = tokens(&mut rng, 10, cfg.vocab);
    let reference = {
        let src = synthetic_model(&cfg, seed, DType::F32);
        let m = CpuModel::new(&src).unwrap();
        m.forward_all(&mut m.new_stream(10), &toks).unwrap()
    };
    for (dtype, bound) in [(DType::Bf16, 3e-2), (DType::F16, 3e-3), (DType::Q8_0, 3e-2)] {
        let src = synthetic_model(&cfg, seed, dtype);
        // The same values, rounded through the format and stored as F32: exactly the same model.
        let mut rounded = MemSource { cfg: cfg.clone(), tensors: HashMap::new() };
        for (name, t) in &src.tensors {
            let values = src.f32_values(name);
            rounded.set_f32(name, t.shape.clone(), &values);
        }
        let m = CpuModel::new(&src).unwrap();
        let got = m.forward_all(&mut m.new_stream(10), &toks).unwrap();
        let r = CpuModel::new(&rounded).unwrap();
        assert_eq!(got, r.forward_all(&mut r.new_stream(10), &toks).unwrap(), "{dtype:?}");
        for (pos, (g, want)) in got.iter().zip(&reference).enumerate() {
            let err = rel_l2(g, want);
            assert!(err < bound && err > 0.0, "{dtype:?} position {pos}: relative L2 {err}");
        }
    }
}

/// Every quantized format, on a model whose rows are whole super-blocks: the model as stored equals,
/// bit for bit, the F32 model of its decoded values (weights are decoded as read, nothing else), in
/// one batch and token by token, and stays within its rounding of the unquantized model.
#[test]
fn quantized_formats_decode_to_the_same_model() {
    let mut rng = Rng::fresh("quantized_formats_decode_to_the_same_model");
    let cfg = ModelConfig { vocab: 64, hidden: 256, head_dim: 64, intermediate: 256, ..small_config(Arch::Llama) };
    let seed = rng.next_u64();
    let toks = tokens(&mut rng, 6, cfg.vocab);
    let reference = {
        let src = synthetic_model(&cfg, seed, DType::F32);
        let m = CpuModel::new(&src).unwrap();
        m.forward_all(&mut m.new_stream(6), &toks).unwrap()
    };
    for dtype in FORMATS.iter().filter(|f| f.block_values > 1).map(|f| f.dtype) {
        let src = synthetic_model(&cfg, seed, dtype);
        let mut rounded = MemSource { cfg: cfg.clone(), tensors: HashMap::new() };
        for (name, t) in &src.tensors {
            rounded.set_f32(name, t.shape.clone(), &src.f32_values(name));
        }
        let m = CpuModel::new(&src).unwrap();
        let got = m.forward_all(&mut m.new_stream(6), &toks).unwrap();
        let r = CpuModel::new(&rounded).unwrap();
        assert_eq!(got, r.forward_all(&mut r.new_stream(6), &toks).unwrap(), "{dtype:?}");
        assert_eq!(got, token_by_token(&m, &toks, 6), "{dtype:?} token by token");
        let err = got.iter().zip(&reference).map(|(g, want)| rel_l2(g, want)).fold(0f64, f64::max);
        println!("{dtype:?}: largest relative L2 of the logits {err:.4}");
        assert!(err > 0.0 && err < 2.0 * rounding_bound(dtype), "{dtype:?}: relative L2 {err}");
    }
}

// ---------------------------------------------------------------------------------------------
// Prompts as batches: the batched model against the plain definitions and against itself token by
// token.

/// matvec as a plain loop: each row decoded, then one f64 sum from zero in column order.
fn plain_matvec(w: &TensorRef, x: &[f32]) -> Vec<f32> {
    (0..w.rows())
        .map(|r| {
            let row = w.row_f32(r);
            let mut acc = 0f64;
            for c in 0..x.len() {
                acc += row[c] as f64 * x[c] as f64;
            }
            acc as f32
        })
        .collect()
}

/// Attention as a plain loop over one query: the exact max, the host's exp, each sum in position order.
#[allow(clippy::too_many_arguments)]
fn plain_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_ctx: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    let (kv_dim, group) = (kv_heads * head_dim, heads / kv_heads);
    let scale = 1.0 / (head_dim as f64).sqrt();
    for h in 0..heads {
        let (qh, off) = (&q[h * head_dim..(h + 1) * head_dim], (h / group) * head_dim);
        let scores: Vec<f64> = (0..n_ctx)
            .map(|t| (0..head_dim).map(|d| qh[d] as f64 * k[t * kv_dim + off + d] as f64).sum::<f64>() * scale)
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        for d in 0..head_dim {
            let acc: f64 = weights.iter().enumerate().map(|(t, &p)| p * v[t * kv_dim + off + d] as f64).sum();
            out[h * head_dim + d] = (acc / total) as f32;
        }
    }
}

/// Every format the crate reads.
fn formats() -> impl Iterator<Item = DType> {
    FORMATS.iter().map(|f| f.dtype)
}

/// The formats a model of `cfg` can be stored in: every matrix width a whole number of blocks.
fn formats_for(cfg: &ModelConfig) -> impl Iterator<Item = DType> + '_ {
    formats().filter(|d| [cfg.hidden, cfg.q_dim(), cfg.intermediate].iter().all(|&c| d.row_bytes(c).is_some()))
}

/// Random rows of `dtype` and their `TensorRef`'s pieces.
fn random_weight(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> (Vec<u8>, [usize; 2]) {
    let values = rng.vec(rows * cols, 1.0);
    (values.chunks(cols).flat_map(|r| encode_row(dtype, r)).collect(), [rows, cols])
}

#[test]
fn fast_products_stay_within_1e_5_of_the_plain_f64_products_in_every_format_and_build() {
    let mut rng = Rng::fresh("fast_products_stay_within_1e_5_of_the_plain_f64_products_in_every_format_and_build");
    let builds = Simd::available();
    println!("builds: {:?}", builds.iter().map(|s| s.name()).collect::<Vec<_>>());
    // 13 rows: three groups of four and one row alone; 100 columns leave a tail of 4 lanes.
    for (rows, cols) in [(13, 96), (13, 100), (7, 576), (3, 1536), (5, 8)] {
        for dtype in formats() {
            if dtype.row_bytes(cols).is_none() {
                continue;
            }
            let (bytes, shape) = random_weight(&mut rng, dtype, rows, cols);
            let w = TensorRef { dtype, shape: &shape, bytes: &bytes };
            let x = rng.vec(cols, 2.0);
            let want = plain_matvec(&w, &x);
            let row_bytes: Vec<&[u8]> = bytes.chunks(bytes.len() / rows).collect();
            let mut portable = vec![f32::NAN; rows];
            tensor::dot_rows_into(dtype, Simd::portable(), &row_bytes, &x, &mut portable);
            for &simd in &builds {
                let mut got = vec![f32::NAN; rows];
                tensor::dot_rows_into(dtype, simd, &row_bytes, &x, &mut got);
                let err = rel_l2(&got, &want);
                assert!(err < 1e-5, "{dtype:?} {rows}x{cols} on {}: relative L2 {err}", simd.name());
                assert_eq!(common::bits(&got), common::bits(&portable), "{dtype:?} {rows}x{cols} on {}", simd.name());
            }
            let mut got = vec![f32::NAN; rows];
            cpu::matvec(&w, &x, &mut got);
            assert_eq!(common::bits(&got), common::bits(&portable), "{dtype:?} {rows}x{cols}: matvec");
        }
    }
}

#[test]
fn a_batched_product_gives_each_token_the_bits_of_its_own_matvec() {
    let mut rng = Rng::fresh("a_batched_product_gives_each_token_the_bits_of_its_own_matvec");
    for (rows, cols, tokens) in [(13, 96, 7), (9, 100, 2), (6, 64, 1), (4, 576, 5)] {
        for dtype in formats() {
            if dtype.row_bytes(cols).is_none() {
                continue;
            }
            let (bytes, shape) = random_weight(&mut rng, dtype, rows, cols);
            let w = TensorRef { dtype, shape: &shape, bytes: &bytes };
            let x = rng.vec(tokens * cols, 2.0);
            let mut batched = vec![f32::NAN; tokens * rows];
            cpu::matmul(&w, &x, &mut batched);
            for (t, (x, got)) in x.chunks(cols).zip(batched.chunks(rows)).enumerate() {
                let mut want = vec![f32::NAN; rows];
                cpu::matvec(&w, x, &mut want);
                assert_eq!(common::bits(got), common::bits(&want), "{dtype:?} {rows}x{cols}, token {t} of {tokens}");
            }
        }
    }
}

#[test]
fn attention_stays_within_rounding_of_the_plain_softmax() {
    let mut rng = Rng::fresh("attention_stays_within_rounding_of_the_plain_softmax");
    // head_dim 20 takes every column path (16, then 4); 6 heads over 2 KV heads make groups of 3.
    for (heads, kv_heads, head_dim) in [(6, 2, 20), (4, 4, 8), (8, 1, 16)] {
        let kv_dim = kv_heads * head_dim;
        let most = 300;
        let (k, v) = (rng.vec(most * kv_dim, 1.5), rng.vec(most * kv_dim, 1.0));
        for n_ctx in [1, 2, 31, 32, 33, 64, 65, 100, most] {
            let q = rng.vec(heads * head_dim, 3.0);
            let (mut got, mut want) = (vec![0f32; heads * head_dim], vec![0f32; heads * head_dim]);
            cpu::attention(&q, &k, &v, n_ctx, heads, kv_heads, head_dim, &mut got);
            plain_attention(&q, &k, &v, n_ctx, heads, kv_heads, head_dim, &mut want);
            let err = rel_l2(&got, &want);
            assert!(err < 1e-12, "{heads}:{kv_heads} x {head_dim} over {n_ctx}: relative L2 {err}");
        }
    }
}

#[test]
fn the_model_stays_within_rounding_of_the_plain_definitions() {
    let mut rng = Rng::fresh("the_model_stays_within_rounding_of_the_plain_definitions");
    for arch in ARCHS {
        let cfg = small_config(arch);
        let src = synthetic_model(&cfg, rng.next_u64(), DType::F32);
        let model = CpuModel::new(&src).unwrap();
        let toks = tokens(&mut rng, 64, cfg.vocab);
        let got = model.forward_all(&mut model.new_stream(64), &toks).unwrap();
        let want = layer_major_logits_with(&src, &toks, cpu::matvec, plain_attention);
        for (pos, (g, want)) in got.iter().zip(want).enumerate() {
            let err = rel_l2(g, &want);
            assert!(err < 1e-9, "{arch:?} position {pos}: relative L2 {err}");
        }
    }
}

/// `plain_matvec` into `out`.
fn plain_matvec_into(w: &TensorRef, x: &[f32], out: &mut [f32]) {
    out.copy_from_slice(&plain_matvec(w, x));
}

#[test]
fn the_model_stays_within_1e_5_of_the_plain_f64_model_in_every_format() {
    let mut rng = Rng::fresh("the_model_stays_within_1e_5_of_the_plain_f64_model_in_every_format");
    for arch in ARCHS {
        let cfg = small_config(arch);
        let seed = rng.next_u64();
        let toks = tokens(&mut rng, 24, cfg.vocab);
        for dtype in formats_for(&cfg) {
            let src = synthetic_model(&cfg, seed, dtype);
            let model = CpuModel::new(&src).unwrap();
            let got = model.forward_all(&mut model.new_stream(24), &toks).unwrap();
            let want = layer_major_logits_with(&src, &toks, plain_matvec_into, plain_attention);
            for (pos, (g, want)) in got.iter().zip(want).enumerate() {
                let err = rel_l2(g, &want);
                assert!(err < 1e-5, "{arch:?} {dtype:?} position {pos}: relative L2 {err}");
            }
        }
    }
}

#[test]
fn step_scratch_is_bounded_by_a_chunk_not_by_the_prompt_or_the_window() {
    let cfg = long_context_config(1 << 20);
    // Past one chunk the window adds nothing but threads, and here both windows get all of them.
    let threads = cpu::step_threads(&cfg, 1 << 14, 2);
    assert_eq!((threads, cpu::step_threads(&cfg, 1 << 20, 2)), (2, 2));
    assert_eq!(cpu::scratch_bytes(&cfg, 1 << 14, 2), cpu::scratch_bytes(&cfg, 1 << 20, 2));
    assert!(cpu::scratch_bytes(&cfg, 1 << 20, 2) < 1 << 20, "{} bytes", cpu::scratch_bytes(&cfg, 1 << 20, 2));
    // A short window holds a shorter chunk; a tiny model at a tiny window is not worth many threads.
    assert!(cpu::scratch_bytes(&cfg, 8, 2) < cpu::scratch_bytes(&cfg, 1 << 14, 2));
    assert!(cpu::step_threads(&cfg, 8, 64) < 64);
    assert_eq!(cpu::step_threads(&cfg, 1 << 14, 1), 1);
}

/// The logits after each token of `toks`, stepped one token a call.
fn token_by_token(model: &CpuModel, toks: &[u32], window: usize) -> Vec<Vec<f32>> {
    let mut stream = model.new_stream(window);
    toks.iter().map(|&t| model.forward(&mut stream, &[t]).unwrap()).collect()
}

#[test]
fn a_prompt_in_one_step_gives_the_logits_of_the_prompt_token_by_token() {
    let mut rng = Rng::fresh("a_prompt_in_one_step_gives_the_logits_of_the_prompt_token_by_token");
    for arch in ARCHS {
        let cfg = small_config(arch);
        let src = synthetic_model(&cfg, rng.next_u64(), DType::Bf16);
        // Longer than a chunk of the batch and than a block of attention, and not a multiple of either.
        let n = 2 * cpu::CHUNK_TOKENS + 37;
        let toks = tokens(&mut rng, n, cfg.vocab);
        let one = CpuModel::new(&src).unwrap().with_threads(1);
        let want = token_by_token(&one, &toks, n);
        for threads in [1, 2, 5] {
            let model = CpuModel::new(&src).unwrap().with_threads(threads);
            let at_once = model.forward(&mut model.new_stream(n), &toks).unwrap();
            assert_eq!(common::bits(&at_once), common::bits(&want[n - 1]), "{arch:?} on {threads} threads");
            let all = model.forward_all(&mut model.new_stream(n), &toks).unwrap();
            for (pos, (got, want)) in all.iter().zip(&want).enumerate() {
                assert_eq!(common::bits(got), common::bits(want), "{arch:?} on {threads} threads, position {pos}");
            }
        }
    }
}

#[test]
fn a_prompt_in_one_step_gives_the_token_by_token_bits_in_every_format() {
    let mut rng = Rng::fresh("a_prompt_in_one_step_gives_the_token_by_token_bits_in_every_format");
    let n = cpu::CHUNK_TOKENS + 5;
    for arch in ARCHS {
        let cfg = small_config(arch);
        let seed = rng.next_u64();
        let toks = tokens(&mut rng, n, cfg.vocab);
        for dtype in formats_for(&cfg) {
            let src = synthetic_model(&cfg, seed, dtype);
            let want = token_by_token(&CpuModel::new(&src).unwrap().with_threads(1), &toks, n);
            let model = CpuModel::new(&src).unwrap().with_threads(3);
            let all = model.forward_all(&mut model.new_stream(n), &toks).unwrap();
            for (pos, (got, want)) in all.iter().zip(&want).enumerate() {
                assert_eq!(common::bits(got), common::bits(want), "{arch:?} {dtype:?}, position {pos}");
            }
        }
    }
}

/// A small GQA model (hidden 64, 2 layers, 4 heads over 2 KV heads of 16) with a `window`-token window.
fn long_context_config(window: usize) -> ModelConfig {
    ModelConfig { max_position: window, ..small_config(Arch::Llama) }
}

#[test]
fn a_4096_token_prompt_matches_the_token_by_token_run_at_its_last_position() {
    let mut rng = Rng::fresh("a_4096_token_prompt_matches_the_token_by_token_run_at_its_last_position");
    let n = 4096;
    let cfg = long_context_config(n);
    let src = synthetic_model(&cfg, rng.next_u64(), DType::F16);
    let model = CpuModel::new(&src).unwrap();
    let toks = tokens(&mut rng, n, cfg.vocab);
    let start = std::time::Instant::now();
    let at_once = model.forward(&mut model.new_stream(n), &toks).unwrap();
    println!("{n} tokens in one step: {:.2} s on {} threads", start.elapsed().as_secs_f64(), model.threads());
    let start = std::time::Instant::now();
    let mut stream = model.new_stream(n);
    let mut last = Vec::new();
    for &t in &toks {
        last = model.forward(&mut stream, &[t]).unwrap();
    }
    println!("{n} tokens one a step: {:.2} s", start.elapsed().as_secs_f64());
    assert!(at_once.iter().all(|v| v.is_finite()));
    assert_eq!(common::bits(&at_once), common::bits(&last), "relative L2 {}", rel_l2(&at_once, &last));
}

/// Run with `cargo test --release --test cpu -- --ignored`: the long-prompt budget, printed.
#[test]
#[ignore = "a 32k-token prompt: about half a minute on two cores"]
fn a_32768_token_prompt_runs_in_well_under_a_minute() {
    let mut rng = Rng::fresh("a_32768_token_prompt_runs_in_well_under_a_minute");
    let n = 32768;
    let cfg = long_context_config(n);
    let src = synthetic_model(&cfg, rng.next_u64(), DType::Bf16);
    let model = CpuModel::new(&src).unwrap();
    let toks = tokens(&mut rng, n, cfg.vocab);
    let start = std::time::Instant::now();
    let at_once = model.forward(&mut model.new_stream(n), &toks).unwrap();
    let seconds = start.elapsed().as_secs_f64();
    println!("{n} tokens in one step: {seconds:.2} s on {} threads", model.threads());
    // The same prompt less its last token, then that token: the same logits.
    let mut stream = model.new_stream(n);
    model.forward(&mut stream, &toks[..n - 1]).unwrap();
    assert_eq!(common::bits(&at_once), common::bits(&model.forward(&mut stream, &toks[n - 1..]).unwrap()));
    assert!(seconds < 60.0, "{seconds:.1} s");
}

#[test]
fn out_of_range_token_appends_nothing() {
    let cfg = small_config(Arch::Llama);
    let src = synthetic_model(&cfg, 5, DType::F32);
    let model = CpuModel::new(&src).unwrap();
    let mut stream = model.new_stream(16);
    let first = model.forward(&mut stream, &[3, 4]).unwrap();
    let e = model.forward(&mut stream, &[5, cfg.vocab as u32, 6]).unwrap_err();
    assert_eq!(e.status, Status::OutOfRange);
    assert!(e.message.contains(&cfg.vocab.to_string()), "{}", e.message);
    let e = model.forward_all(&mut stream, &[u32::MAX]).unwrap_err();
    assert_eq!(e.status, Status::OutOfRange);
    assert_eq!(stream.len(), 2);
    // The stream carries on exactly as if the bad calls never happened.
    let mut fresh = model.new_stream(16);
    model.forward(&mut fresh, &[3, 4]).unwrap();
    assert_eq!(model.forward(&mut stream, &[5]).unwrap(), model.forward(&mut fresh, &[5]).unwrap());
    assert_ne!(first, model.forward(&mut fresh, &[5]).unwrap());
    assert_eq!(model.forward(&mut stream, &[]).unwrap_err().status, Status::InvalidArgument);
}

#[test]
fn tokens_beyond_the_window_are_refused_with_no_room() {
    let cfg = small_config(Arch::Qwen3);
    let src = synthetic_model(&cfg, 6, DType::F32);
    let model = CpuModel::new(&src).unwrap();
    let mut stream = model.new_stream(4);
    model.forward(&mut stream, &[1, 2, 3]).unwrap();
    let e = model.forward(&mut stream, &[4, 5]).unwrap_err();
    assert_eq!(e.status, Status::NoRoom);
    assert!(e.message.contains("window of 4"), "{}", e.message);
    assert_eq!(stream.len(), 3);
    model.forward(&mut stream, &[4]).unwrap();
    assert_eq!(model.forward_all(&mut stream, &[1]).unwrap_err().status, Status::NoRoom);
    assert_eq!(stream.len(), 4);
}

#[test]
fn missing_or_misshapen_tensors_are_bad_models_naming_them() {
    for arch in ARCHS {
        let cfg = small_config(arch);
        for (name, shape) in tensor_shapes(&cfg) {
            let mut src = synthetic_model(&cfg, 7, DType::F32);
            src.tensors.remove(&name);
            let e = CpuModel::new(&src).err().unwrap_or_else(|| panic!("{arch:?} loaded without {name}"));
            assert_eq!(e.status, Status::BadModel);
            assert!(e.message.contains(&name), "{arch:?}: {}", e.message);

            let mut src = synthetic_model(&cfg, 7, DType::F32);
            let mut wrong = shape.clone();
            *wrong.last_mut().unwrap() += 1;
            let values = vec![0.5f32; wrong.iter().product()];
            src.set_f32(&name, wrong, &values);
            let e = CpuModel::new(&src).err().unwrap_or_else(|| panic!("{arch:?} loaded a misshapen {name}"));
            assert_eq!(e.status, Status::BadModel);
            assert!(e.message.contains(&name), "{arch:?}: {}", e.message);
        }
    }
    // Bytes that do not hold the shape.
    let cfg = small_config(Arch::Llama);
    let mut src = synthetic_model(&cfg, 7, DType::F32);
    let name = names::layer(1, names::UP);
    src.tensors.get_mut(&name).unwrap().bytes.truncate(100);
    let e = CpuModel::new(&src).err().unwrap();
    assert!(e.status == Status::BadModel && e.message.contains(&name), "{}", e.message);
    // Heads that do not divide into KV groups.
    let src = synthetic_model(&ModelConfig { heads: 3, kv_heads: 2, ..cfg.clone() }, 7, DType::F32);
    assert_eq!(CpuModel::new(&src).err().unwrap().status, Status::BadModel);
}

// ---------------------------------------------------------------------------------------------
// Parity with HF transformers (scripts/hf_reference.py).

/// Values printed by `scripts/hf_reference.py --selftest` (numpy): FNV-1a of the name, then
/// element index: f32 bits.
#[test]
fn synthetic_formula_matches_the_python_generator() {
    let cases: [(&str, &[usize], u64, u64, [(usize, u32); 4]); 4] = [
        (
            "model.embed_tokens.weight",
            &[8, 16],
            11,
            0xa88fd795d5c6d156,
            [(0, 0x3de86eb0), (1, 0xbf5a314a), (2, 0xbf6ecb4c), (127, 0xbec43238)],
        ),
        (
            "model.layers.0.self_attn.q_proj.weight",
            &[32, 48],
            22,
            0x3a296639dc11febb,
            [(0, 0xbbd385d3), (1, 0x3e0b5b5e), (2, 0x3dceb48b), (1535, 0x3daf2fb4)],
        ),
        (
            "model.layers.1.input_layernorm.weight",
            &[64],
            33,
            0x6feb102c72cf8a89,
            [(0, 0x3f86d226), (1, 0x3f80b720), (2, 0x3f7abb61), (63, 0x3f86a45e)],
        ),
        (
            "model.layers.0.self_attn.k_proj.bias",
            &[40],
            44,
            0xc63519b3b8f76f48,
            [(0, 0xbd1eb1d8), (1, 0x3ccc71f3), (2, 0x3d453bfa), (39, 0xbccb8e6d)],
        ),
    ];
    for (name, shape, seed, fnv, picks) in cases {
        assert_eq!(write::fnv1a64(name.as_bytes()), fnv, "{name}");
        let values = synthetic_tensor(name, shape, seed);
        for (i, bits) in picks {
            assert_eq!(values[i].to_bits(), bits, "{name}[{i}] = {}", values[i]);
        }
    }
}

/// A ModelConfig from an HF config.json (transformers 4 `rope_scaling` or 5 `rope_parameters`).
fn config_from_hf_json(v: &serde_json::Value) -> ModelConfig {
    let n = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("config.json: {k}")) as usize;
    let arch = match v["model_type"].as_str().unwrap() {
        "llama" => Arch::Llama,
        "qwen2" => Arch::Qwen2,
        "qwen3" => Arch::Qwen3,
        other => panic!("config.json: model_type {other}"),
    };
    let rope = if v["rope_parameters"].is_object() { &v["rope_parameters"] } else { &v["rope_scaling"] };
    let rope_theta = v["rope_theta"].as_f64().or_else(|| rope["rope_theta"].as_f64()).expect("rope_theta") as f32;
    let rope_type = rope["rope_type"].as_str().or_else(|| rope["type"].as_str()).unwrap_or("default");
    let f = |k: &str| rope[k].as_f64().unwrap_or_else(|| panic!("config.json: rope {k}")) as f32;
    let rope_scaling = match rope_type {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: f("factor") },
        "llama3" => RopeScaling::Llama3 {
            factor: f("factor"),
            low_freq_factor: f("low_freq_factor"),
            high_freq_factor: f("high_freq_factor"),
            original_max_position: f("original_max_position_embeddings") as u32,
        },
        other => panic!("config.json: rope type {other}"),
    };
    let (hidden, heads) = (n("hidden_size"), n("num_attention_heads"));
    ModelConfig {
        arch,
        vocab: n("vocab_size"),
        hidden,
        layers: n("num_hidden_layers"),
        heads,
        kv_heads: n("num_key_value_heads"),
        head_dim: v["head_dim"].as_u64().map_or(hidden / heads, |d| d as usize),
        intermediate: n("intermediate_size"),
        rms_eps: v["rms_norm_eps"].as_f64().unwrap() as f32,
        rope_theta,
        rope_scaling,
        rope_interleaved: false,
        max_position: n("max_position_embeddings"),
        tied: v["tie_word_embeddings"].as_bool().unwrap(),
        qkv_bias: arch == Arch::Qwen2 || v["attention_bias"].as_bool().unwrap_or(false),
        qk_norm: arch == Arch::Qwen3,
        attention: Default::default(),
        bos: v["bos_token_id"].as_u64().map(|t| t as u32),
        eos: v["eos_token_id"].as_u64().map(|t| t as u32),
    }
}

fn read_le<T>(path: &Path, decode: fn([u8; 4]) -> T) -> Vec<T> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(bytes.len() % 4, 0, "{}", path.display());
    bytes.chunks_exact(4).map(|b| decode([b[0], b[1], b[2], b[3]])).collect()
}

/// The committed logits come from `scripts/hf_reference.py --out tests/data/hf_reference` (torch, transformers).
#[test]
fn matches_hf_reference() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf_reference");
    // The llama family's (Gemma 3's is tests/gemma3.rs's).
    let models: Vec<_> = ["llama", "qwen2", "qwen3"].map(|name| root.join(name)).into_iter().collect();
    for dir in &models {
        assert!(dir.join("logits.f32").is_file(), "{}: missing (run scripts/hf_reference.py)", dir.display());
    }
    // One thread a model: unoptimized test builds take tens of seconds for the hidden-1024 model.
    std::thread::scope(|scope| {
        for dir in &models {
            scope.spawn(move || check_against_hf(dir));
        }
    });
}

fn check_against_hf(dir: &Path) {
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let meta: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
    let cfg = config_from_hf_json(&json);
    let seed = meta["seed"].as_u64().unwrap();
    let toks = read_le(&dir.join("tokens.u32"), u32::from_le_bytes);
    let logits = read_le(&dir.join("logits.f32"), f32::from_le_bytes);
    assert_eq!(logits.len(), toks.len() * cfg.vocab, "{}", dir.display());

    // HF's own rotary frequencies, so a scaling mismatch shows as such rather than as logits.
    let hf_inv_freq = read_le(&dir.join("inv_freq.f32"), f32::from_le_bytes);
    let inv_freq = cpu::rope_inv_freq(&cfg);
    assert_eq!(inv_freq.len(), hf_inv_freq.len());
    for (i, (a, b)) in inv_freq.iter().zip(&hf_inv_freq).enumerate() {
        assert!((a - b).abs() <= 2e-7 * b.abs(), "{} inv_freq[{i}]: {a} vs HF {b}", dir.display());
    }

    // The script loaded exactly the tensors this model reads.
    let mut expected: Vec<String> = tensor_shapes(&cfg).into_iter().map(|(n, _)| n).collect();
    expected.sort();
    let loaded: Vec<String> =
        meta["tensors"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_string()).collect();
    assert_eq!(loaded, expected, "{}", dir.display());

    let src = synthetic_model(&cfg, seed, DType::F32);
    let model = CpuModel::new(&src).unwrap();
    let got = model.forward_all(&mut model.new_stream(toks.len()), &toks).unwrap();
    let mut worst = 0f64;
    for (pos, (g, want)) in got.iter().zip(logits.chunks(cfg.vocab)).enumerate() {
        let err = rel_l2(g, want);
        // The issue asks for 1e-4; this backend lands near 2e-7 (HF's own f32 run: 5e-7), so hold it tighter.
        assert!(err < 1e-5, "{} position {pos}: relative L2 {err:.3e}", dir.display());
        worst = worst.max(err);
    }
    println!("{}: {:?}, max relative L2 against HF {worst:.3e}", dir.display(), cfg.arch);
}

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
