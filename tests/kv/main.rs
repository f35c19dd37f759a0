//! KV cache types on the CPU: the FP8 E4M3 codes against their definition and a brute-force rounding,
//! Q8_0 against GGUF's encoder, each type's rounding bounds and byte sizes, the GPU page layout's rows,
//! the CPU backend in every type against the model recomputed layer by layer with the same rounding (bit
//! for bit) and against an f32 cache (within the type's rounding), the CPU plan's bytes, and the options
//! through the C ABI: bad enum values, types a model cannot take, the device check, what
//! engine_model_info and the start-up line report.

#[path = "../common/mod.rs"]
mod common;

mod c_abi;
mod cpu_backend;
mod fp8;
mod rounding;

use hostembed::kv::{KvType, KvTypes};
use hostembed::model::{Arch, ModelConfig, RopeScaling};

// ---------------------------------------------------------------------------------------------
// The CPU backend in every type.

fn small(arch: Arch, window: usize) -> ModelConfig {
    let mut cfg = ModelConfig {
        arch,
        vocab: 96,
        hidden: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        intermediate: 96,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: window,
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
            };
            cfg.rope_interleaved = true;
        }
        Arch::Qwen2 => {
            cfg.qkv_bias = true;
            cfg.tied = true;
        }
        Arch::Qwen3 => {
            cfg.qk_norm = true;
            cfg.head_dim = 64;
        }
        Arch::Gemma3 => unreachable!("these tests run the llama family"),
        Arch::Qwen3Moe | Arch::Mixtral => panic!("{arch:?}: these tests' reference computes dense models"),
    }
    cfg
}

/// The pairs the CPU tests run: each type for K and V, and K and V apart.
fn type_pairs() -> Vec<KvTypes> {
    let mut pairs: Vec<KvTypes> = KvType::ALL.iter().map(|&t| KvTypes::same(t)).collect();
    pairs.push(KvTypes { k: KvType::Q8_0, v: KvType::F16 });
    pairs.push(KvTypes { k: KvType::Bf16, v: KvType::Fp8E4m3 });
    pairs
}
