//! Whole prompts against the CPU and token by token: every architecture, 32,768 tokens, chunk boundaries.

use crate::common::{Rng, gpu_present, prompt_base as base, prompt_configs as configs, rel_l2, rows_on_card};
use hostembed::Status;
use hostembed::checkpoint::write::MemSource;
use hostembed::cpu::CpuModel;
use hostembed::gpu::{GpuModel, PAGE_TOKENS};
use hostembed::model::{Arch, ModelConfig};
use hostembed::sampler::Sampling;
use hostembed::tensor::DType;
use hostembed::tuning::Tuning;

// ---------------------------------------------------------------------------------------------------
// Whole prompts.

fn model(cfg: ModelConfig, dtype: DType, seed: u64) -> MemSource {
    MemSource::synthetic(&cfg, seed, dtype)
}

fn random_tokens(rng: &mut Rng, vocab: usize, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
}

#[test]
fn prompt_logits_match_cpu_on_every_architecture() {
    if !gpu_present("prompt_logits_match_cpu_on_every_architecture") {
        return;
    }
    let mut rng = Rng::fresh("prompt_logits_match_cpu_on_every_architecture");
    let n = 2048;
    for (name, cfg) in configs() {
        let src = model(cfg.clone(), DType::Bf16, rng.next_u64());
        let (_rows_buf, rows) = rows_on_card(&src);
        let mut gpu = GpuModel::load(&src, rows, 512, 3 * (n + 64) / PAGE_TOKENS, &Tuning::from_env()).unwrap();
        let mut pool = gpu.page_pool().unwrap();
        println!("{name}: {}", gpu.prompt_route());
        // HOSTEMBED_CUBLASLT=0 (the suite's second run) is the library's own kernel, and the route says so.
        let own = std::env::var("HOSTEMBED_CUBLASLT").is_ok_and(|v| v == "0");
        let says_own =
            gpu.prompt_route().contains("hostembed's tensor-core kernel (no cuBLASLt: HOSTEMBED_CUBLASLT=0)");
        assert_eq!(says_own, own, "{name}: {}", gpu.prompt_route());
        let tokens = random_tokens(&mut rng, cfg.vocab, n);
        let mut gs = gpu.new_stream(n + 64).unwrap();
        let got = gpu.all_logits(&mut pool, &mut gs, &tokens).unwrap();
        // The CPU with the GPU's cache type rounds K and V as the GPU does: what is left is the GPU's own
        // arithmetic (at the first positions a BF16 cache's rounding of V alone is ~1e-3).
        let cpu = CpuModel::new(&src).unwrap().with_kv_types(gpu.kv_types()).unwrap();
        let mut cs = cpu.new_stream(n + 64);
        let want = cpu.forward_all(&mut cs, &tokens).unwrap();
        // The CPU backend as it runs by default (an F32 cache): printed beside, for the cache's share.
        let cpu_f32 = CpuModel::new(&src).unwrap();
        let mut fs = cpu_f32.new_stream(n + 64);
        let want_f32 = cpu_f32.forward_all(&mut fs, &tokens).unwrap();
        let mut worst = 0f64;
        for p in [0, 1, 15, 16, 511, 512, 1000, 1537, n - 1] {
            let e = rel_l2(&got[p], &want[p]);
            let e_f32 = rel_l2(&got[p], &want_f32[p]);
            println!("{name}: position {p}: relative L2 {e:.2e} (against an F32-cache CPU {e_f32:.2e})");
            worst = worst.max(e);
        }
        assert!(worst <= 2e-3, "{name}: prompt logits differ from the CPU's by {worst:.3e}");

        // The same prompt in one step, then 64 greedy tokens, against the prompt stepped token by token.
        let mut one = gpu.new_stream(n + 64).unwrap();
        let mut by_token = gpu.new_stream(n + 64).unwrap();
        let mut a = gpu.step(&mut pool, &mut one, &tokens, &Sampling::GREEDY, 0).unwrap();
        let mut b = 0;
        for &t in &tokens {
            b = gpu.step(&mut pool, &mut by_token, &[t], &Sampling::GREEDY, 0).unwrap();
        }
        let mut differ = 0;
        for i in 0..64 {
            differ += (a != b) as usize;
            assert_eq!(a, b, "{name}: greedy token {i} after the prompt: {a} in one step, {b} token by token");
            a = gpu.step(&mut pool, &mut one, &[a], &Sampling::GREEDY, 0).unwrap();
            b = gpu.step(&mut pool, &mut by_token, &[b], &Sampling::GREEDY, 0).unwrap();
        }
        println!("{name}: 64 greedy tokens after the prompt, {differ} differ between one step and token by token");
    }
}

#[test]
fn a_32k_prompt_matches_cpu_at_the_last_position() {
    if !gpu_present("a_32k_prompt_matches_cpu_at_the_last_position") {
        return;
    }
    let mut rng = Rng::fresh("a_32k_prompt_matches_cpu_at_the_last_position");
    let cfg = ModelConfig { hidden: 128, heads: 2, kv_heads: 1, head_dim: 64, intermediate: 256, ..base(Arch::Llama) };
    let n = 32768;
    let src = model(cfg.clone(), DType::Bf16, rng.next_u64());
    let (_rows_buf, rows) = rows_on_card(&src);
    let mut gpu = GpuModel::load(&src, rows, 2048, n / PAGE_TOKENS, &Tuning::from_env()).unwrap();
    let mut pool = gpu.page_pool().unwrap();
    let tokens = random_tokens(&mut rng, cfg.vocab, n);
    let mut gs = gpu.new_stream(n).unwrap();
    gpu.step(&mut pool, &mut gs, &tokens, &Sampling::GREEDY, 0).unwrap();
    let got = gpu.last_logits().unwrap();
    let cpu = CpuModel::new(&src).unwrap();
    let mut cs = cpu.new_stream(n);
    let t = std::time::Instant::now();
    let want = cpu.forward(&mut cs, &tokens).unwrap();
    let err = rel_l2(&got, &want);
    println!(
        "32768-token prompt: relative L2 at the last position {err:.2e} (CPU took {:.1} s)",
        t.elapsed().as_secs_f64()
    );
    assert!(err <= 2e-3, "32k prompt: {err:.3e}");
}

#[test]
fn chunk_boundaries_and_refusals() {
    if !gpu_present("chunk_boundaries_and_refusals") {
        return;
    }
    let mut rng = Rng::fresh("chunk_boundaries_and_refusals");
    let (_, cfg) = configs().remove(0);
    let src = model(cfg.clone(), DType::Bf16, rng.next_u64());
    let (_rows_buf, rows) = rows_on_card(&src);
    let chunk = 64;
    let mut gpu = GpuModel::load(&src, rows, chunk, 512, &Tuning::from_env()).unwrap();
    let mut pool = gpu.page_pool().unwrap();
    let cpu = CpuModel::new(&src).unwrap();
    for len in [1, chunk - 1, chunk, chunk + 1, 3 * chunk + 17] {
        let tokens = random_tokens(&mut rng, cfg.vocab, len);
        // A stream that already holds 10 tokens, so a chunk starts in the middle of a KV tile.
        let lead = random_tokens(&mut rng, cfg.vocab, 10);
        let mut gs = gpu.new_stream(512).unwrap();
        let mut cs = cpu.new_stream(512);
        gpu.step(&mut pool, &mut gs, &lead, &Sampling::GREEDY, 0).unwrap();
        cpu.forward(&mut cs, &lead).unwrap();
        gpu.step(&mut pool, &mut gs, &tokens, &Sampling::GREEDY, 0).unwrap();
        let want = cpu.forward(&mut cs, &tokens).unwrap();
        let err = rel_l2(&gpu.last_logits().unwrap(), &want);
        println!("prompt of {len} after 10, chunks of {chunk}: relative L2 {err:.2e}");
        assert!(err <= 2e-3, "prompt of {len}: {err:.3e}");
    }
    // Past the window: NO_ROOM at any chunk count, nothing appended, the last logits kept.
    let mut gs = gpu.new_stream(200).unwrap();
    gpu.step(&mut pool, &mut gs, &random_tokens(&mut rng, cfg.vocab, 50), &Sampling::GREEDY, 0).unwrap();
    let before = gpu.last_logits().unwrap();
    for extra in [151, 200, 3 * chunk + 151] {
        let e =
            gpu.step(&mut pool, &mut gs, &random_tokens(&mut rng, cfg.vocab, extra), &Sampling::GREEDY, 0).unwrap_err();
        assert_eq!(e.status, Status::NoRoom, "{extra} tokens past a 200 window: {e}");
        assert_eq!(gs.len(), 50, "a refused prompt appended tokens");
        assert_eq!(gpu.last_logits().unwrap(), before, "a refused prompt changed the logits");
    }
}
