//! Many streams at once through the C ABI on the CPU backend: engine_step_batch against stepping each
//! stream alone (random mixes of prompt chunks and single tokens, streams joining, leaving, truncated
//! and reset mid-way, each with its own sampler), engine_truncate, the KV page pool running out and
//! coming back whole (engine_kv_stats), per-stream sampling with min-p and the repetition penalty, 64
//! single-token items in one call, threads truncating, resetting and re-sampling their own streams on
//! one engine, and the calls' refusals.

#[path = "../common/mod.rs"]
mod common;

mod invariance;
mod pool;
mod refusals;
mod streams;

use common::{Rng, Scratch};
use hostembed::model::{Arch, ModelConfig, RopeScaling};
use hostembed::tensor::DType;
use std::path::PathBuf;

/// Positions in one page of the CPU backend's pool.
const PAGE: u64 = hostembed::cpu::PAGE_TOKENS as u64;

/// A small Qwen2 (biases, GQA 2:1, a tied head): every op of the layer runs.
fn qwen2() -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen2,
        vocab: 301,
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
        max_position: 512,
        tied: true,
        qkv_bias: true,
        qk_norm: false,
        attention: Default::default(),
        bos: Some(1),
        eos: Some(2),
        moe: None,
    }
}

fn model(dir: &Scratch, rng: &mut Rng) -> PathBuf {
    dir.hf("qwen2", &qwen2(), rng.next_u64(), DType::Bf16)
}

fn random_ids(rng: &mut Rng, n: usize) -> Vec<i32> {
    rng.ids(qwen2().vocab, n)
}
