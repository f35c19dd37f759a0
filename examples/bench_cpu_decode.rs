//! Decode speed on the CPU backend: a random-weight model of SmolLM2-135M's shape (Llama, hidden 576,
//! 30 layers, 9 heads over 3 KV heads of 64, intermediate 1536, vocab 49152, tied embeddings) built in
//! memory, a short prompt, then tokens one step each; prints a table of format, threads and tokens a
//! second (the best of `--runs` runs).
//!
//!     cargo run --release --example bench_cpu_decode -- [--dtype f32,f16,bf16,q8_0,q4_1,...,q4_k_m]
//!         [--threads 1,2] [--prompt 8] [--tokens 32] [--runs 3] [--layers 30] [--hidden 576] [--inter 1536]
//!
//! `--hidden` (heads of 64, three query heads a KV head) and `--inter` reshape the model: the k-quants
//! need multiples of 256 (`--hidden 768 --inter 2048`), else their rows fall back as llama.cpp's do.
//! `q4_k_m` is llama.cpp's Q4_K_M mix.
//!
//! Each decoded token is the greedy pick of the step before, as a server decodes. Beside the wall-clock
//! rate, the table gives the process's CPU milliseconds a token (all threads), which a loaded host
//! disturbs less.

use std::time::Instant;

use hostembed::checkpoint::write::{MemSource, Recipe};
use hostembed::cpu::CpuModel;
use hostembed::model::{Arch, ModelConfig, RopeScaling};
use hostembed::tensor::DType;

fn parse_recipe(name: &str) -> Recipe {
    Recipe::from_name(name).unwrap_or_else(|| panic!("no format or mix {name}"))
}

/// CPU seconds this process has run, all threads together.
fn process_cpu_seconds() -> f64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid timespec for the call to fill.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID) failed");
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn main() {
    let mut cfg = ModelConfig {
        arch: Arch::Llama,
        vocab: 49152,
        hidden: 576,
        layers: 30,
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
        intermediate: 1536,
        rms_eps: 1e-5,
        rope_theta: 100000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 8192,
        tied: true,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: None,
        eos: None,
    };
    let mut dtypes: Vec<Recipe> = [DType::F32, DType::F16, DType::Bf16, DType::Q8_0].map(Recipe::from).to_vec();
    let mut thread_counts = vec![1, 2];
    let (mut prompt, mut decode, mut runs) = (8usize, 32usize, 3usize);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("{flag} takes a value"));
        let num = || -> usize { value.parse().unwrap_or_else(|_| panic!("{flag} takes a number")) };
        match flag.as_str() {
            "--dtype" => dtypes = value.split(',').map(parse_recipe).collect(),
            "--threads" => {
                thread_counts =
                    value.split(',').map(|t| t.parse().unwrap_or_else(|_| panic!("--threads takes numbers"))).collect()
            }
            "--prompt" => prompt = num().max(1),
            "--tokens" => decode = num().max(1),
            "--runs" => runs = num().max(1),
            "--layers" => cfg.layers = num(),
            "--hidden" => {
                cfg.hidden = num();
                cfg.heads = cfg.hidden / cfg.head_dim;
                cfg.kv_heads = (cfg.heads / 3).max(1);
            }
            "--inter" => cfg.intermediate = num(),
            other => panic!("unknown flag {other}"),
        }
    }
    println!(
        "llama hidden {} layers {} heads {}:{} head_dim {} inter {} vocab {} tied; {prompt}-token prompt, \
         {decode} tokens decoded, best of {runs}",
        cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.intermediate, cfg.vocab
    );
    println!("{:<6} {:>7} {:>9} {:>13}", "format", "threads", "tok/s", "cpu ms/token");
    let prompt_tokens: Vec<u32> = (0..prompt).map(|i| (i * 7919 % cfg.vocab) as u32).collect();
    for &dtype in &dtypes {
        let src = MemSource::synthetic(&cfg, 1, dtype);
        for &threads in &thread_counts {
            let model = CpuModel::new(&src).expect("the random model loads").with_threads(threads);
            let (mut best, mut best_cpu) = (0f64, f64::MAX);
            let mut picks = Vec::new();
            for _ in 0..runs {
                let mut stream = model.new_stream(prompt + decode);
                let mut next = argmax(&model.forward(&mut stream, &prompt_tokens).expect("the prompt fits"));
                picks.clear();
                let (start, cpu_start) = (Instant::now(), process_cpu_seconds());
                for _ in 0..decode {
                    next = argmax(&model.forward(&mut stream, &[next]).expect("the window holds every token"));
                    picks.push(next);
                }
                best = best.max(decode as f64 / start.elapsed().as_secs_f64());
                best_cpu = best_cpu.min((process_cpu_seconds() - cpu_start) * 1e3 / decode as f64);
            }
            let tail = picks.iter().rev().take(4).map(|t| t.to_string()).collect::<Vec<_>>().join(",");
            println!(
                "{:<6} {:>7} {:>9.1} {:>13.1}   (last picks {tail})",
                dtype.name(),
                model.threads(),
                best,
                best_cpu
            );
        }
    }
}
