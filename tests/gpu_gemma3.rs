//! Gemma 3 on the CUDA backend against the CPU reference: logits at every position of prompts that run
//! past the sliding window (matrix-vector rows, tensor-core chunks with flash attention, and the split
//! kernel for an F32 cache; head size 256 on flash attention with a 16-bit cache), 64 greedy tokens
//! equal to the CPU's, and batches through the engine equal to stepping each stream alone, bit for bit.
//! Skips where no CUDA device is present.

mod common;
use common::card::{OnBoth, random_tokens};
use common::gemma3::Gemma3;
use common::{Rng, Scratch, gpu_present, rel_l2};

use hostembed::checkpoint::write::MemSource;
use hostembed::kv::{KvType, KvTypes};
use hostembed::model::ModelConfig;
use hostembed::sampler::{self, Sampling};
use hostembed::tensor::DType;
use hostembed::tuning::Tuning;

/// Head size 64 (flash attention has a kernel for it), q_dim 256 beside hidden 128, local layers 0 and
/// 2 over 20 positions, scores scaled by 1/sqrt(80), linear rope scaling on the global layers.
fn config() -> ModelConfig {
    Gemma3::on_card(512, 80.0, 20).config()
}

#[test]
fn gpu_logits_match_cpu_at_every_position() {
    if !gpu_present("gpu_logits_match_cpu_at_every_position") {
        return;
    }
    let mut rng = Rng::fresh("gpu_logits_match_cpu_at_every_position");
    // F32 weights and cache: no tensor-core path, held to the CPU's 1e-4. The others: the half formats'
    // bound the llama family's suite holds them to.
    let cases = [
        ("F32, F32 cache", DType::F32, KvTypes::same(KvType::F32), 1e-4),
        ("BF16", DType::Bf16, KvTypes::GPU_DEFAULT, 2e-2),
        ("Q8_0", DType::Q8_0, KvTypes::GPU_DEFAULT, 2e-2),
        ("Q8_0, Q8_0 cache", DType::Q8_0, KvTypes::same(KvType::Q8_0), 3e-2),
    ];
    for (name, dtype, kv, bound) in cases {
        let cfg = config();
        let src = MemSource::synthetic(&cfg, rng.next_u64(), dtype);
        let mut b = OnBoth::new(&src, 32, Some(kv), 128);
        // 100 tokens in chunks of 32: windows crossing chunks and the attention's blocks.
        let tokens = random_tokens(&mut rng, cfg.vocab, 100);
        let (_, worst) = b.all_logits(&tokens);
        println!("gemma3 {name}: worst relative L2 of the logits over {} positions {worst:.2e}", tokens.len());
        assert!(worst < bound, "gemma3 {name}: logits differ from the CPU's by {worst:.3e}");

        // Then single tokens (matrix-vector rows, split attention) past the window.
        for step in 0..24 {
            let t = random_tokens(&mut rng, cfg.vocab, 1);
            b.gpu.step(&mut b.pool, &mut b.gs, &t, &Sampling::GREEDY, 0).unwrap();
            let want = b.cpu.forward(&mut b.cs, &t).unwrap();
            let err = rel_l2(&b.gpu.last_logits().unwrap(), &want);
            assert!(err < bound, "gemma3 {name} decode step {step}: {err:.3e}");
        }
    }
}

/// Head size 256 (Gemma 3's): prompt chunks on flash attention with a 16-bit cache (the split kernel
/// with an 8-bit one), against the CPU at every position, past the window.
#[test]
fn gpu_head_size_256_matches_cpu() {
    if !gpu_present("gpu_head_size_256_matches_cpu") {
        return;
    }
    let mut rng = Rng::fresh("gpu_head_size_256_matches_cpu");
    let shape = Gemma3 { head_dim: 256, query_scale_base: 256.0, ..Gemma3::on_card(512, 80.0, 20) };
    let cfg = shape.config();
    // The 16-bit caches take flash attention unless `HOSTEMBED_FLASH_HEAD_256=0` turns it off.
    let flash = if Tuning::from_env().flash_head_256 { "flash attention" } else { "split attention" };
    for (name, kv, bound, route) in [
        ("BF16 cache", KvTypes::GPU_DEFAULT, 2e-2, flash),
        ("F16 cache", KvTypes::same(KvType::F16), 2e-2, flash),
        ("Q8_0 cache", KvTypes::same(KvType::Q8_0), 3e-2, "split attention"),
    ] {
        let src = MemSource::synthetic(&cfg, rng.next_u64(), DType::Bf16);
        let mut b = OnBoth::new(&src, 32, Some(kv), 256);
        assert!(b.gpu.prompt_route().contains(route), "head 256, {name}: {}", b.gpu.prompt_route());
        let tokens = random_tokens(&mut rng, cfg.vocab, 150);
        let (_, worst) = b.all_logits(&tokens);
        println!("gemma3 head 256, {name}: worst relative L2 over {} positions {worst:.2e}", tokens.len());
        assert!(worst < bound, "gemma3 head 256, {name}: logits differ from the CPU's by {worst:.3e}");
    }
}

/// 64 greedy tokens, each backend on its own choices: the same tokens (F32 weights and cache, where
/// the CUDA logits are within 1e-4 of the CPU's).
#[test]
fn greedy_64_tokens_equal_the_cpus() {
    if !gpu_present("greedy_64_tokens_equal_the_cpus") {
        return;
    }
    let mut rng = Rng::fresh("greedy_64_tokens_equal_the_cpus");
    let cfg = config();
    let kv = KvTypes::same(KvType::F32);
    let src = MemSource::synthetic(&cfg, rng.next_u64(), DType::F32);
    let mut b = OnBoth::new(&src, 16, Some(kv), 128);
    let prompt = random_tokens(&mut rng, cfg.vocab, 30);
    let (mut g_in, mut c_in) = (prompt.clone(), prompt);
    let (mut g_out, mut c_out) = (Vec::new(), Vec::new());
    for _ in 0..64 {
        let g = b.gpu.step(&mut b.pool, &mut b.gs, &g_in, &Sampling::GREEDY, 0).unwrap();
        let c = sampler::argmax(&b.cpu.forward(&mut b.cs, &c_in).unwrap());
        g_out.push(g);
        c_out.push(c);
        (g_in, c_in) = (vec![g], vec![c]);
    }
    assert_eq!(g_out, c_out, "greedy tokens, CUDA against the CPU");
}

/// Random batches of prompt chunks and single tokens through the CUDA engine, with truncation, resets
/// and the prefix cache: each stream's bits are those of stepping it alone.
#[test]
fn engine_batches_match_stepping_alone() {
    if !gpu_present("engine_batches_match_stepping_alone") {
        return;
    }
    let _serial = common::serial();
    let mut rng = Rng::fresh("engine_batches_match_stepping_alone");
    let dir = Scratch::new("gpu-gemma3-batches");
    // llama.cpp's pattern, which GGUF files carry: every sixth layer global.
    let cfg = common::gemma3::gguf_shaped(config(), 20);
    let mix = common::Mix { rounds: 150, widest: 6, chunk: 8, long_chunk: 48 };
    for dtype in [DType::Bf16, DType::Q8_0] {
        let path = dir.gguf(dtype.name(), &cfg, rng.next_u64(), dtype);
        let opts = common::cuda_options(256, 6, 32);
        let page = hostembed::gpu::PAGE_TOKENS as u64;
        common::twins_batch_like_alone(&format!("gemma3 {}", dtype.name()), &path, &opts, &mix, page, &mut rng);
    }
}
