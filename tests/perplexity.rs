//! examples/perplexity.c on a real quantized model: SmolLM2-135M-Instruct in Q4_1 (scripts/fetch-smollm.sh;
//! the test prints a SKIP line without it) and the same file with every tensor decoded to F32
//! (`write_gguf_dequantized`) give the same perplexity on the CPU backend, within 0.1%, over chunks of
//! README.md scored as llama-perplexity scores them.

mod common;
mod native;

use common::{Scratch, model_file};
use hostembed::checkpoint::write::write_gguf_dequantized;
use std::path::Path;

/// The final perplexity perplexity.c prints for `model`.
fn perplexity(exe: &Path, model: &Path, text: &Path, ctx: &str, chunks: &str) -> f64 {
    let (model, text) = (model.to_str().unwrap(), text.to_str().unwrap());
    let out = native::run(exe, &[model, text, "--ctx", ctx, "--chunks", chunks, "--backend", "cpu"]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "perplexity {model}:\nstdout:\n{stdout}\nstderr:\n{stderr}");
    println!("{model}:\n{stdout}");
    let line = stdout.lines().find(|l| l.starts_with("perplexity ")).unwrap_or_else(|| panic!("no result:\n{stdout}"));
    let ppl: f64 = line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{line}"));
    assert!(ppl.is_finite() && ppl > 1.0, "{line}");
    ppl
}

#[test]
fn smollm2_q4_1_perplexity_is_its_f32_dequantizations() {
    let Some(q4_1) = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "scripts/fetch-smollm.sh fetches it") else {
        return;
    };
    let dir = Scratch::new("perplexity");
    let f32_model = dir.join("SmolLM2-135M-Instruct.F32.gguf");
    write_gguf_dequantized(&q4_1, &f32_model).unwrap();
    let exe = native::scratch("perplexity").join("perplexity");
    native::build_c_program(&native::repo().join("examples/perplexity.c"), &exe);
    let text = native::repo().join("README.md");
    let started = std::time::Instant::now();
    let quantized = perplexity(&exe, &q4_1, &text, "128", "4");
    let plain = perplexity(&exe, &f32_model, &text, "128", "4");
    println!("Q4_1 {quantized:.6}, F32 {plain:.6} ({:.1} s)", started.elapsed().as_secs_f64());
    let rel = (quantized - plain).abs() / plain;
    assert!(rel <= 1e-3, "Q4_1 {quantized} against its F32 dequantization {plain}: {rel:.2e} apart");
}
