//! Batch invariance in every weight format on the CPU backend: a small Llama written as GGUF with its
//! matrices in each format `FORMATS` lists, and in llama.cpp's Q4_K_M mix, stepped in random batches of
//! 1 to 64 items (single tokens and prompt chunks; streams joining, leaving, truncated and reset) against
//! the same steps one stream at a time on a twin engine: the same statuses, tokens and logits bits, and
//! the KV pool's accounting.

mod common;
use common::{Mix, Rng, cpu_options, every_recipe_batches_like_alone, serial};

use hostembed::model::{Arch, ModelConfig, RopeScaling};

const PAGE: u64 = hostembed::cpu::PAGE_TOKENS as u64;
const STREAMS: u32 = 64;
const WINDOW: u32 = 96;
/// Calls of up to 64 items with chunks of up to 8 tokens, one in four up to 40 (some past the window).
const MIX: Mix = Mix { rounds: 15, widest: STREAMS, chunk: 8, long_chunk: 40 };

/// A Llama with GQA 2:1 whose every matrix row is whole k-quant super-blocks (256 values), so each
/// format stores every matrix as itself; two layers, so Q4_K_M gives the second one's V and down Q6_K.
fn config() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab: 300,
        hidden: 256,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        intermediate: 256,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 1024,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        bos: Some(1),
        eos: Some(2),
    }
}

#[test]
fn random_batches_match_stepping_alone_in_every_format() {
    let _g = serial();
    let mut rng = Rng::fresh("random_batches_match_stepping_alone_in_every_format");
    every_recipe_batches_like_alone(&config(), &cpu_options(WINDOW, STREAMS), &MIX, PAGE, &mut rng);
}
