//! The CPU reference backend and the sampler: ops against explicit formulas, the model's invariants
//! (KV cache, GQA, tied heads, stored formats), its refusals, and parity with HF transformers.

#[path = "../common/mod.rs"]
mod common;

mod batched;
mod invariants;
mod ops;
mod reference;
mod sampling;

use common::Rng;
use hostembed::checkpoint::write;
use hostembed::cpu;
use hostembed::cpu::CpuModel;
use hostembed::model::{Arch, ModelConfig, RopeScaling, TensorRef, TensorSource, names};
use hostembed::tensor::{DType, encode_row};
use std::collections::HashMap;

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
        moe: None,
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
        Arch::Qwen3Moe | Arch::Mixtral => panic!("{arch:?}: these tests' reference computes dense models"),
    }
    cfg
}

/// The llama family, whose plain definition `layer_major_logits` spells out (Gemma 3: tests/gemma3.rs).
const ARCHS: [Arch; 3] = [Arch::Llama, Arch::Qwen2, Arch::Qwen3];

fn tokens(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
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

/// The logits after each token of `toks`, stepped one token a call.
fn token_by_token(model: &CpuModel, toks: &[u32], window: usize) -> Vec<Vec<f32>> {
    let mut stream = model.new_stream(window);
    toks.iter().map(|&t| model.forward(&mut stream, &[t]).unwrap()).collect()
}
