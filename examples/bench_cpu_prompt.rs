//! Prompt speed on the CPU backend: one prompt stepped through `CpuModel::forward` on a random model of
//! a given shape (by default 2 layers, hidden 64, GQA 4:2), and the time it took.
//!
//!     cargo run --release --example bench_cpu_prompt -- [--arch llama|qwen2|qwen3] [--hidden 64]
//!         [--layers 2] [--heads 4] [--kv-heads 2] [--head-dim 16] [--inter 128] [--vocab 256]
//!         [--dtype f32|f16|bf16|q8_0] [--prompt 2048] [--runs 1]
//!
//! HOSTEMBED_CPU_THREADS sets the thread count (default: every available core).

use std::time::Instant;

use hostembed::checkpoint::write::MemSource;
use hostembed::cpu::CpuModel;
use hostembed::model::{Arch, ModelConfig, RopeScaling};
use hostembed::tensor::DType;

fn main() {
    let mut cfg = ModelConfig {
        arch: Arch::Llama,
        vocab: 256,
        hidden: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        intermediate: 128,
        rms_eps: 1e-5,
        rope_theta: 500000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 0,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: None,
        eos: None,
    };
    let (mut dtype, mut prompt, mut runs) = (DType::F32, 2048, 1);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("{flag} takes a value"));
        let num = || -> usize { value.parse().unwrap_or_else(|_| panic!("{flag} takes a number")) };
        match flag.as_str() {
            "--arch" => cfg.arch = Arch::from_name(&value).unwrap_or_else(|| panic!("no architecture {value}")),
            "--hidden" => cfg.hidden = num(),
            "--layers" => cfg.layers = num(),
            "--heads" => cfg.heads = num(),
            "--kv-heads" => cfg.kv_heads = num(),
            "--head-dim" => cfg.head_dim = num(),
            "--inter" => cfg.intermediate = num(),
            "--vocab" => cfg.vocab = num(),
            "--prompt" => prompt = num(),
            "--runs" => runs = num(),
            "--dtype" => {
                dtype = match value.as_str() {
                    "f32" => DType::F32,
                    "f16" => DType::F16,
                    "bf16" => DType::Bf16,
                    "q8_0" => DType::Q8_0,
                    other => panic!("no format {other}"),
                }
            }
            other => panic!("unknown flag {other}"),
        }
    }
    let traits = cfg.arch.traits();
    (cfg.qkv_bias, cfg.qk_norm, cfg.max_position) = (traits.qkv_bias, traits.qk_norm, prompt);
    let src = MemSource::synthetic(&cfg, 1, dtype);
    let model = CpuModel::new(&src).expect("the random model loads");
    let tokens: Vec<u32> = (0..prompt).map(|i| (i * 7919 % cfg.vocab) as u32).collect();
    println!(
        "{} hidden {} layers {} heads {}:{} head_dim {} inter {} vocab {} {}, {prompt}-token prompt",
        cfg.arch.name(),
        cfg.hidden,
        cfg.layers,
        cfg.heads,
        cfg.kv_heads,
        cfg.head_dim,
        cfg.intermediate,
        cfg.vocab,
        dtype.name()
    );
    for run in 0..runs {
        let mut stream = model.new_stream(prompt);
        let start = Instant::now();
        let logits = model.forward(&mut stream, &tokens).expect("the prompt fits the window");
        let seconds = start.elapsed().as_secs_f64();
        let checksum: f64 = logits.iter().map(|&v| v as f64).sum();
        println!("run {run}: {seconds:.3} s, {:.0} tokens/s, logits sum {checksum:.6}", prompt as f64 / seconds);
    }
}
