//! Mixture-of-Experts models (tests/common's small Qwen3-MoE and Mixtral) on the CUDA backend against
//! the CPU backend, the oracle (both with F32 caches): a prompt (its chunk on the tensor-core rows, whose
//! experts take the grouped products, but in F32, which keeps prompts in f32) then 64 greedy tokens in F32,
//! BF16, Q8_0 and llama.cpp's Q4_K_M mix, the logits within the formats' bound at every step and the
//! tokens the same but at near ties; a 256-token prompt in one chunk, whose experts' groups fill several
//! tiles of the grouped products, the last partly; and random batches giving each stream the bits it gets alone,
//! graphs and all; and a Qwen3-MoE of 40 experts, 8 a token, whose routing spans two of a lane's
//! registers and whose experts' groups hold many rows; and the grouped products (grouped.rs) and the
//! decode rows' expert products (mmv.rs) alone against the host, and the fused route and weighted sum
//! (tails.rs) against the launches they replace, alone and in the whole model. A SKIP line without a card.

#[path = "../common/mod.rs"]
mod common;
mod grouped;
mod mmv;
mod tails;
use common::{
    Mix, Rng, Scratch, compare_greedy_with_jumps, cpu_options, cuda_options, gguf_of_recipe, gpu_present, init,
};
use common::{moe_configs, qwen3_moe, serial, stats, twins_batch_like_alone};

use hostembed::checkpoint::write::Recipe;
use hostembed::engine::engine_options;
use hostembed::model::{ModelConfig, MoeConfig};
use hostembed::placement::engine_memory;
use hostembed::tensor::DType;

/// The small models, and a Qwen3-MoE of 40 experts choosing 8 (renormalized, as Qwen3-30B-A3B does).
fn configs() -> Vec<(&'static str, ModelConfig)> {
    let wide = ModelConfig {
        moe: Some(MoeConfig { experts: 40, used: 8, intermediate: 256, norm_topk: true }),
        ..qwen3_moe()
    };
    moe_configs().into_iter().chain([("qwen3_moe_40x8", wide)]).collect()
}

const RECIPES: [Recipe; 4] =
    [Recipe::Uniform(DType::F32), Recipe::Uniform(DType::Bf16), Recipe::Uniform(DType::Q8_0), Recipe::Q4KM];

#[test]
fn cuda_follows_the_cpu_in_every_format() {
    if !gpu_present("cuda_follows_the_cpu_in_every_format") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("cuda_follows_the_cpu_in_every_format");
    let dir = Scratch::new("gpu-moe");
    for (name, cfg) in configs() {
        for recipe in RECIPES {
            let what = format!("{name} {}", recipe.name());
            let path = gguf_of_recipe(&dir, &cfg, rng.next_u64(), recipe);
            let cpu = init(&path, &cpu_options(128, 1));
            // An F32 cache as the CPU's: with BF16 K and V, a router score within their rounding of the
            // next one can pick another expert (a 3% jump in the logits once in 64 steps).
            let f32_kv = hostembed::engine::engine_kv_type::ENGINE_KV_F32;
            let gpu = init(&path, &engine_options { kv_type_k: f32_kv, kv_type_v: f32_kv, ..cuda_options(128, 1, 64) });
            // 64 tokens after a 40-token prompt; a differing choice only at a near tie. With 16-bit weights
            // a router tie within their products' rounding still comes (40 experts choosing 8: step 5 of
            // 65 once moved the logits 2.6e-2): one such step is allowed.
            let prompt: Vec<i32> = (0..40).map(|i| ((i * 97 + 13) % cfg.vocab) as i32).collect();
            let (_, differ) = compare_greedy_with_jumps(&what, &gpu, &cpu, &prompt, 64, 1);
            assert!(differ.len() <= 2, "{what}: {} tokens differ", differ.len());
        }
    }
    assert_eq!(stats(), engine_memory::default());
}

#[test]
fn a_long_prompt_chunk_follows_the_cpu() {
    if !gpu_present("a_long_prompt_chunk_follows_the_cpu") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("a_long_prompt_chunk_follows_the_cpu");
    let dir = Scratch::new("gpu-moe-long");
    for (name, cfg) in configs() {
        // F32 with an F32 cache keeps its prompt chunks off the tensor cores.
        for recipe in RECIPES.into_iter().skip(1) {
            let what = format!("{name} {} long prompt", recipe.name());
            let path = gguf_of_recipe(&dir, &cfg, rng.next_u64(), recipe);
            let cpu = init(&path, &cpu_options(512, 1));
            let f32_kv = hostembed::engine::engine_kv_type::ENGINE_KV_F32;
            let gpu =
                init(&path, &engine_options { kv_type_k: f32_kv, kv_type_v: f32_kv, ..cuda_options(512, 1, 256) });
            // One chunk of 256 tokens: 64 to 128 slots an expert on average in these models. BF16's chunk
            // takes its products with 16-bit activations, whose rounding can pick another expert for one of
            // the 256 tokens where two router scores are that close (the 40-expert model once moved every
            // later step's logits 2.9e-2): that token's keys and values stay, so every step may be such a
            // jump; the 8-bit formats' chunks keep f32-accurate activations and the strict bound.
            let prompt: Vec<i32> = (0..256).map(|i| ((i * 131 + 7) % cfg.vocab) as i32).collect();
            let jumps = if recipe == Recipe::Uniform(DType::Bf16) { 17 } else { 0 };
            let (_, differ) = compare_greedy_with_jumps(&what, &gpu, &cpu, &prompt, 16, jumps);
            assert!(differ.len() <= 1, "{what}: {} tokens differ", differ.len());
        }
    }
    assert_eq!(stats(), engine_memory::default());
}

/// 40 calls of up to 16 items: single tokens (graphs replayed) and prompt chunks of several streams.
const MIX: Mix = Mix { rounds: 40, widest: 16, chunk: 6, long_chunk: 24 };

#[test]
fn a_cuda_batch_gives_each_stream_the_bits_it_gets_alone() {
    if !gpu_present("a_cuda_batch_gives_each_stream_the_bits_it_gets_alone") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("a_cuda_batch_gives_each_stream_the_bits_it_gets_alone");
    let dir = Scratch::new("gpu-moe-batch");
    let page = hostembed::gpu::PAGE_TOKENS as u64;
    for (name, cfg) in configs() {
        for recipe in [Recipe::Uniform(DType::Bf16), Recipe::Q4KM] {
            let path = gguf_of_recipe(&dir, &cfg, rng.next_u64(), recipe);
            let what = format!("{name} {}", recipe.name());
            twins_batch_like_alone(&what, &path, &cuda_options(64, MIX.widest, 64), &MIX, page, &mut rng);
        }
    }
}
