//! Shared KV pages and scoring on CUDA (each test prints a SKIP line without a device): engine_fork's
//! copy on write as a device copy of every layer, the prefix cache's matches, random calls over many
//! streams against each stream computed alone with the pool's counts checked after every call, and
//! engine_score (its log-softmax on the device) against stepping token by token and against the CPU;
//! examples/perplexity.c on SmolLM2-135M Q4_1 against its F32 dequantization.
//!
//! A prompt chunk's route on CUDA depends on its length (tensor cores from 16 tokens, a library
//! product's algorithm by its shape), so a position's K and V bits depend on the chunk that computed
//! them. Where the tests want bits they compare runs of the same chunks; where the chunking differs they
//! hold the prompt route's bound (2e-3 relative L2). A model whose matrices and KV cache are all F32
//! runs every row on the matrix-vector path, which is the same bits in any chunking: there the random
//! calls are held to bits as on the CPU.

mod common;
mod native;

use common::shared::{self, fork, kv_usage, no_cache, score};
use common::{
    Held, Rng, Scratch, bits, cuda_options, decode_base, gpu_present, init, logits, model_file, rel_l2, reset, serial,
    stats, step, truncate,
};

use hostembed::Status;
use hostembed::checkpoint::write::{write_gguf_dequantized, write_synthetic_gguf, write_synthetic_hf};
use hostembed::engine::{engine_backend, engine_kv_type, engine_options};
use hostembed::model::{Arch, ModelConfig};
use hostembed::placement::engine_memory;
use hostembed::status::last_error;
use hostembed::tensor::DType;
use std::path::{Path, PathBuf};

/// Positions in one page of the CUDA backend's pool.
const PAGE: usize = hostembed::gpu::PAGE_TOKENS;

/// A Llama with GQA 4:1 whose head size flash attention takes and whose widths tensor cores take.
fn config() -> ModelConfig {
    ModelConfig { vocab: 1024, ..decode_base(Arch::Llama) }
}

/// The model in BF16 (an HF folder: prompt chunks on tensor cores, a BF16 cache).
fn bf16_model(dir: &Scratch, rng: &mut Rng) -> PathBuf {
    let p = dir.join("hf-bf16");
    write_synthetic_hf(&p, &config(), rng.next_u64(), DType::Bf16).unwrap();
    p
}

/// The model in F32 (GGUF): with an F32 cache every row takes the matrix-vector path.
fn f32_model(dir: &Scratch, rng: &mut Rng) -> PathBuf {
    let p = dir.join("f32.gguf");
    write_synthetic_gguf(&p, &config(), rng.next_u64(), DType::F32).unwrap();
    p
}

fn cuda(window: u32, streams: u32) -> engine_options {
    cuda_options(window, streams, 64)
}

fn f32_cache(opts: engine_options) -> engine_options {
    engine_options { kv_type_k: engine_kv_type::ENGINE_KV_F32, kv_type_v: engine_kv_type::ENGINE_KV_F32, ..opts }
}

fn check_pool(e: &Held, lens: &[usize], total: u64, what: &str) -> Vec<Vec<u32>> {
    shared::check_pool(e, lens, total, PAGE, what)
}

/// A fork inside a page the source keeps writing: each stream's next steps copy the shared page first
/// (a device copy of every layer) and give the bits of a stream that ran the same calls alone.
#[test]
fn fork_copies_the_shared_page_on_cuda() {
    if !gpu_present("fork_copies_the_shared_page_on_cuda") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("fork_copies_the_shared_page_on_cuda");
    let dir = Scratch::new("gpu-prefix-fork");
    let path = bf16_model(&dir, &mut rng);
    let vocab = config().vocab;
    let e = init(&path, &cuda(512, 3));
    let reference = init(&path, &no_cache(cuda(512, 1)));
    let total = kv_usage(&e).tokens_total;
    // The prompt in one call, then single tokens: the reference runs the same calls.
    let prompt = rng.ids(vocab, 40);
    let singles = rng.ids(vocab, 10);
    step(&e, 0, &prompt);
    step(&reference, 0, &prompt);
    for t in &singles[..5] {
        step(&e, 0, std::slice::from_ref(t));
        step(&reference, 0, std::slice::from_ref(t));
    }
    // Position 45 is inside the source's last page: the fork shares all of its pages.
    assert_eq!(fork(&e, 0, 1, 45), Status::Ok, "{}", last_error());
    let tables = check_pool(&e, &[45, 45, 0], total, "after the fork");
    assert_eq!(tables[0], tables[1]);
    assert_eq!(kv_usage(&e).tokens_shared, 45u64.div_ceil(PAGE as u64) * PAGE as u64);
    let u = rng.ids(vocab, 1);
    step(&e, 1, &u);
    let tables = check_pool(&e, &[45, 46, 0], total, "after the fork's step");
    assert_ne!(tables[1][45 / PAGE], tables[0][45 / PAGE], "the last page copied");
    let mut want = {
        let r = init(&path, &no_cache(cuda(512, 1)));
        step(&r, 0, &prompt);
        for t in &singles[..5] {
            step(&r, 0, std::slice::from_ref(t));
        }
        step(&r, 0, &u);
        logits(&r, 0)
    };
    assert!(bits(&logits(&e, 1)) == bits(&want), "the fork against the same calls alone");
    // The source goes on over its own page 2, untouched by the fork's write.
    for t in &singles[5..] {
        step(&e, 0, std::slice::from_ref(t));
        step(&reference, 0, std::slice::from_ref(t));
        want = logits(&reference, 0);
        assert!(bits(&logits(&e, 0)) == bits(&want), "the source after the fork");
    }
    check_pool(&e, &[50, 46, 0], total, "at the end");
    drop((e, reference));
    assert_eq!(stats(), engine_memory::default());
}

/// A prompt that takes a live stream's whole pages has the bits of a stream that stepped the matched
/// positions as the call that wrote them and the rest as a call of its own; stepped as one call, it
/// may take another route and is held to the prompt route's bound. A reset stream's pages serve the
/// same way.
#[test]
fn prefix_cache_hits_on_cuda_have_the_bits_of_the_same_chunks() {
    if !gpu_present("prefix_cache_hits_on_cuda_have_the_bits_of_the_same_chunks") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("prefix_cache_hits_on_cuda_have_the_bits_of_the_same_chunks");
    let dir = Scratch::new("gpu-prefix-cache");
    let path = bf16_model(&dir, &mut rng);
    let vocab = config().vocab;
    let e = init(&path, &cuda(512, 3));
    let total = kv_usage(&e).tokens_total;
    let system = rng.ids(vocab, 4 * PAGE);
    let (q0, q1) = (rng.ids(vocab, 40), rng.ids(vocab, 40));
    step(&e, 0, &system);
    step(&e, 0, &q0);
    let mut p1 = system.clone();
    p1.extend(&q1);
    step(&e, 1, &p1);
    let tables = check_pool(&e, &[system.len() + 40, p1.len(), 0], total, "after the hit");
    assert_eq!(tables[1][..4], tables[0][..4], "the system prompt's four pages taken");
    let same_chunks = {
        let r = init(&path, &no_cache(cuda(512, 1)));
        step(&r, 0, &system);
        step(&r, 0, &q1);
        logits(&r, 0)
    };
    assert!(bits(&logits(&e, 1)) == bits(&same_chunks), "the bits of the system prompt and the rest as two calls");
    let one_call = {
        let r = init(&path, &no_cache(cuda(512, 1)));
        step(&r, 0, &p1);
        logits(&r, 0)
    };
    let rel = rel_l2(&logits(&e, 1), &one_call);
    println!(
        "against the prompt as one call: {rel:.3e} relative L2 (identical: {})",
        bits(&logits(&e, 1)) == bits(&one_call)
    );
    assert!(rel <= 2e-3, "{rel:.3e} from the prompt computed in one call");
    // Both leave; a third stream asks for the same prompt: it takes every whole page of stream 1's from
    // the cache (the system prompt's and its question's) and computes the positions past them as a
    // chunk of its own. A reference that computed those positions again as their own call matches it.
    reset(&e, 0);
    reset(&e, 1);
    let cached = kv_usage(&e).tokens_cached;
    step(&e, 2, &p1);
    let whole = (p1.len() - 1) / PAGE * PAGE;
    assert_eq!(cached - kv_usage(&e).tokens_cached, whole as u64, "every whole page taken from the cache");
    let recomputed_tail = {
        let r = init(&path, &no_cache(cuda(512, 1)));
        step(&r, 0, &system);
        step(&r, 0, &q1);
        truncate(&r, 0, whole as u32);
        step(&r, 0, &p1[whole..]);
        logits(&r, 0)
    };
    assert!(bits(&logits(&e, 2)) == bits(&recomputed_tail), "the bits of the pages' calls and the tail's own");
    let rel = rel_l2(&logits(&e, 2), &same_chunks);
    println!("from the cache, against the system prompt and the question as two calls: {rel:.3e} relative L2");
    assert!(rel <= 2e-3, "{rel:.3e} from two calls");
    check_pool(&e, &[0, 0, p1.len()], total, "at the end");
    drop(e);
    assert_eq!(stats(), engine_memory::default());
}

/// A short chunk after a long prompt (a question after a system prompt): its flash attention cuts the
/// context in parts and merges them (too few query blocks to fill the card otherwise). The logits follow
/// the CPU's within the prompt route's bound, and the chunk beside another stream's in one call has the
/// bits it has alone.
#[test]
fn a_short_chunk_over_a_long_context_follows_the_cpu_on_cuda() {
    if !gpu_present("a_short_chunk_over_a_long_context_follows_the_cpu_on_cuda") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("a_short_chunk_over_a_long_context_follows_the_cpu_on_cuda");
    let dir = Scratch::new("gpu-prefix-parts");
    let path = bf16_model(&dir, &mut rng);
    let vocab = config().vocab;
    let (system, question, other) = (rng.ids(vocab, 1500), rng.ids(vocab, 40), rng.ids(vocab, 23));
    let cpu = init(&path, &common::cpu_options(2048, 1));
    let gpu = init(&path, &no_cache(cuda(2048, 2)));
    for e in [&cpu, &gpu] {
        step(e, 0, &system);
        step(e, 0, &question);
    }
    let rel = rel_l2(&logits(&gpu, 0), &logits(&cpu, 0));
    println!("40 queries over 1,540 positions: {rel:.3e} relative L2 from the CPU");
    assert!(rel <= 2e-3, "{rel:.3e} from the CPU");
    let alone = logits(&gpu, 0);
    truncate(&gpu, 0, system.len() as u32);
    step(&gpu, 1, &system);
    let items = [(0u32, &question[..]), (1u32, &other[..])];
    let (st, each) = common::try_batch(&gpu, &items);
    assert_eq!(st, Status::Ok, "{}", last_error());
    assert!(each.iter().all(|&(s, _)| s == Status::Ok), "{each:?}");
    assert!(bits(&logits(&gpu, 0)) == bits(&alone), "the chunk's bits beside another stream's chunk");
}

/// Random calls on CUDA against each stream computed alone: on the all-F32 model with an F32 cache
/// (the matrix-vector path, the same bits in any chunking) bit for bit, the pool checked after every
/// call, NO_ROOM only where it would be without the cache.
#[test]
fn random_calls_on_cuda_match_each_stream_alone() {
    if !gpu_present("random_calls_on_cuda_match_each_stream_alone") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("random_calls_on_cuda_match_each_stream_alone");
    let dir = Scratch::new("gpu-prefix-random");
    let path = f32_model(&dir, &mut rng);
    let (window, streams) = (160u32, 6u32);
    let opts = f32_cache(cuda(window, streams));
    let reference = no_cache(f32_cache(cuda(window, 1)));
    let calls = shared::Calls { path: &path, opts: &opts, reference: &reference, vocab: config().vocab, page: PAGE };
    let seen = shared::random_calls("cuda f32", &calls, 600, &mut rng);
    assert!(seen.steps > 50 && seen.forks > 10 && seen.scores > 5, "too few calls: {seen:?}");
    assert!(seen.live_hits > 0 && seen.copies > 0, "nothing shared: {seen:?}");
    assert_eq!(stats(), engine_memory::default());
}

/// float64 log p(id) under `logits`.
fn log_p(l: &[f32], id: i32) -> f64 {
    let max = l.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    assert!(max.is_finite(), "finite logits");
    let log_z = max + l.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
    l[id as usize] as f64 - log_z
}

/// engine_score on CUDA. On the all-F32 model with an F32 cache every row takes the step's own route:
/// the log-probabilities are the float64 log-softmax of the logits stepped token by token within 1e-5,
/// the logits after them those bits, and the CPU's score within 1e-3. On BF16 (prompt chunks on tensor
/// cores) the logits after the score are engine_step's of the same call, bit for bit, and the
/// log-probabilities the token-by-token run's within the prompt route's bound.
#[test]
fn score_on_cuda_matches_stepping_token_by_token() {
    if !gpu_present("score_on_cuda_matches_stepping_token_by_token") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("score_on_cuda_matches_stepping_token_by_token");
    let dir = Scratch::new("gpu-prefix-score");
    let vocab = config().vocab;
    let text = rng.ids(vocab, 200);
    let by_token = |e: &Held| -> Vec<Vec<f32>> {
        reset(e, 0);
        text.iter()
            .map(|t| {
                step(e, 0, std::slice::from_ref(t));
                logits(e, 0)
            })
            .collect()
    };
    // All F32: the step's route for every row.
    let path = f32_model(&dir, &mut rng);
    let e = init(&path, &f32_cache(cuda(512, 2)));
    let want = by_token(&e);
    let got = score(&e, 1, &text);
    assert!(got[0].is_nan(), "the first token of an empty stream");
    for i in 1..text.len() {
        let w = log_p(&want[i - 1], text[i]);
        assert!((got[i] as f64 - w).abs() <= 1e-5, "F32 token {i}: {} against {w}", got[i]);
    }
    assert!(bits(&logits(&e, 1)) == bits(&want[text.len() - 1]), "F32: the logits after the score");
    let cpu = init(&path, &engine_options { backend: engine_backend::Cpu, ..f32_cache(cuda(512, 1)) });
    let on_cpu = score(&cpu, 0, &text);
    let worst = got[1..].iter().zip(&on_cpu[1..]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    println!("F32: the CPU's log-probabilities within {worst:.3e}");
    assert!(worst <= 1e-3, "F32: {worst:.3e} from the CPU's score");
    drop((e, cpu));

    // BF16, the cache off so that the one-call step below computes every chunk: chunks of max_batch,
    // the long ones on tensor cores.
    let path = bf16_model(&dir, &mut rng);
    let e = init(&path, &no_cache(cuda(512, 2)));
    let want = by_token(&e);
    let got = score(&e, 1, &text);
    let scored = logits(&e, 1);
    reset(&e, 0);
    step(&e, 0, &text);
    assert!(bits(&scored) == bits(&logits(&e, 0)), "BF16: the score's logits are engine_step's of the same call");
    let mut worst = 0f64;
    for i in 1..text.len() {
        worst = worst.max((got[i] as f64 - log_p(&want[i - 1], text[i])).abs());
    }
    println!("BF16: token-by-token log-probabilities within {worst:.3e}");
    assert!(worst <= 5e-2, "BF16: {worst:.3e} from stepping token by token");
    drop(e);
    assert_eq!(stats(), engine_memory::default());
}

/// The final perplexity examples/perplexity.c prints for `model` on `backend`.
fn perplexity(exe: &Path, model: &Path, backend: &str) -> f64 {
    let text = native::repo().join("README.md");
    let args = [model.to_str().unwrap(), text.to_str().unwrap(), "--ctx", "256", "--chunks", "8", "--backend", backend];
    let out = native::run(exe, &args);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "perplexity {args:?}:\nstdout:\n{stdout}\nstderr:\n{stderr}");
    println!("{} on {backend}: {}", model.display(), stdout.lines().last().unwrap_or(""));
    let line = stdout.lines().find(|l| l.starts_with("perplexity ")).unwrap_or_else(|| panic!("no result:\n{stdout}"));
    line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{line}"))
}

/// SmolLM2-135M Q4_1 and its F32 dequantization give the same perplexity on CUDA within 0.1%, and the
/// CUDA figure is the CPU's within 1%.
#[test]
fn smollm2_perplexity_on_cuda_is_its_f32_dequantizations() {
    if !gpu_present("smollm2_perplexity_on_cuda_is_its_f32_dequantizations") {
        return;
    }
    let Some(q4_1) = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "scripts/fetch-smollm.sh fetches it") else {
        return;
    };
    let _g = serial();
    let dir = Scratch::new("gpu-perplexity");
    let f32_path = dir.join("SmolLM2-135M-Instruct.F32.gguf");
    write_gguf_dequantized(&q4_1, &f32_path).unwrap();
    let exe = native::scratch("gpu-perplexity").join("perplexity");
    native::build_c_program(&native::repo().join("examples/perplexity.c"), &exe);
    let (quantized, plain) = (perplexity(&exe, &q4_1, "cuda"), perplexity(&exe, &f32_path, "cuda"));
    let rel = (quantized - plain).abs() / plain;
    assert!(rel <= 1e-3, "Q4_1 {quantized} against its F32 dequantization {plain} on CUDA: {rel:.2e} apart");
    let on_cpu = perplexity(&exe, &q4_1, "cpu");
    let rel = (quantized - on_cpu).abs() / on_cpu;
    assert!(rel <= 1e-2, "CUDA {quantized} against the CPU's {on_cpu}: {rel:.2e} apart");
}
