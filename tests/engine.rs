//! The decode engine through its C ABI on the CPU backend: the same tokens and logits from an HF folder
//! and from the GGUF of the same weights (llama's permuted Q/K rows and adjacent-pair rotation included),
//! engine_step's refusals leaving the stream as it was, reset, streams that do not see each other,
//! engine_logits against a fresh CpuModel, sampled runs that repeat for a seed, and engine_model_info.
//! Every checkpoint is written here; nothing depends on the demo model under models/.

mod common;
use common::{bits, max_abs_diff, rel_l2};

use common::{Held, Scratch, info, init, logits, serial, stats, step, try_step};

use common::{Rng, quiet};
use hostembed::Status;
use hostembed::checkpoint::Checkpoint;

use hostembed::cpu::CpuModel;
use hostembed::engine::{self, engine_backend, engine_options};
use hostembed::ffi::{self, engine_model_info};
use hostembed::fit::engine_placement;
use hostembed::model::{Arch, ModelConfig, RopeScaling};
use hostembed::placement::engine_memory;
use hostembed::sampler::{self, Sampling};
use hostembed::status::last_error;
use hostembed::tensor::DType;
use std::path::Path;

/// A small Llama 3: GQA 2:1, llama3 rope scaling, an untied head.
fn llama() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab: 384,
        hidden: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        intermediate: 128,
        rms_eps: 1e-5,
        rope_theta: 500000.0,
        rope_scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 32,
        },
        rope_interleaved: false,
        max_position: 512,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: Some(1),
        eos: Some(2),
        moe: None,
    }
}

/// Qwen2: q/k/v biases, a tied head, an odd vocabulary.
fn qwen2() -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen2,
        vocab: 301,
        heads: 4,
        kv_heads: 1,
        tied: true,
        qkv_bias: true,
        rope_theta: 1000000.0,
        rope_scaling: RopeScaling::None,
        ..llama()
    }
}

/// The CPU backend with a `window`-token window; the start-up line is dropped.
fn cpu_options(window: u32) -> engine_options {
    engine_options { backend: engine_backend::Cpu, context: window, log: Some(quiet), ..engine::default_options() }
}

fn sampled(seed: u64) -> engine_options {
    engine_options { temperature: 0.8, top_k: 40, top_p: 0.95, seed, ..cpu_options(128) }
}

fn sampling_of(o: &engine_options) -> Sampling {
    hostembed::engine::sampling_of(o)
}

fn reset(e: &Held, stream: u32) {
    // SAFETY: a live engine.
    assert_eq!(unsafe { ffi::engine_reset(e.0, stream) }, Status::Ok, "engine_reset({stream}): {}", last_error());
}

/// Steps `prompt`, then feeds each chosen token back `steps` times; the chosen tokens and the logits
/// after each step.
fn decode(e: &Held, stream: u32, prompt: &[i32], steps: usize) -> (Vec<i32>, Vec<Vec<f32>>) {
    let mut tokens = vec![step(e, stream, prompt)];
    let mut all = vec![logits(e, stream)];
    for _ in 0..steps {
        tokens.push(step(e, stream, &[*tokens.last().unwrap()]));
        all.push(logits(e, stream));
    }
    (tokens, all)
}

#[test]
fn hf_and_gguf_of_the_same_weights_decode_the_same_tokens() {
    let _g = serial();
    let mut rng = Rng::fresh("hf_and_gguf_of_the_same_weights_decode_the_same_tokens");
    let dir = Scratch::new("formats");
    let qwen3 = ModelConfig { arch: Arch::Qwen3, qk_norm: true, head_dim: 32, ..qwen2() };
    let qwen3 = ModelConfig { tied: false, qkv_bias: false, ..qwen3 };
    let cases = [
        ("llama", llama(), DType::F32),
        ("llama", llama(), DType::Bf16),
        ("qwen2", qwen2(), DType::Bf16),
        ("qwen3", qwen3, DType::Bf16),
    ];
    for (name, cfg, dtype) in cases {
        let what = format!("{name} {}", dtype.name());
        let seed = rng.next_u64();
        let hf = dir.hf(&format!("{name}-{}", dtype.name()), &cfg, seed, dtype);
        let gguf = dir.gguf(&format!("{name}-{}", dtype.name()), &cfg, seed, dtype);
        // GGUF llama holds Q/K rows permuted for the adjacent-pair rotation: the case this test is for.
        let interleaved = |p: &Path| Checkpoint::open(p).unwrap().config.rope_interleaved;
        assert!(!interleaved(&hf), "{what}: HF rotates halves");
        assert_eq!(interleaved(&gguf), cfg.arch == Arch::Llama, "{what}: GGUF llama rotates adjacent pairs");

        let h = init(&hf, &cpu_options(64));
        let g = init(&gguf, &cpu_options(64));
        let prompt = rng.ids(cfg.vocab, 8);
        let (mut th, mut tg) = (step(&h, 0, &prompt), step(&g, 0, &prompt));
        let (mut worst, mut near_ties) = (0f64, Vec::new());
        for i in 0..=32 {
            let (lh, lg) = (logits(&h, 0), logits(&g, 0));
            let err = rel_l2(&lg, &lh);
            worst = worst.max(err);
            assert!(err < 1e-4, "{what} step {i}: GGUF logits differ from HF's by {err:.3e} relative L2");
            if tg != th {
                // GGUF's choice can only beat HF's by the logits' own difference.
                let gap = lh[th as usize] - lh[tg as usize];
                let bound = 2.0 * max_abs_diff(&lg, &lh);
                assert!(gap <= bound, "{what} step {i}: HF chose {th}, GGUF {tg}, gap {gap} > {bound}");
                near_ties.push(gap);
            }
            if i < 32 {
                // Both continue from HF's choice.
                let input = [th];
                (th, tg) = (step(&h, 0, &input), step(&g, 0, &input));
            }
        }
        println!("{what}: 33 greedy tokens, worst relative L2 {worst:.2e}, near-tie differences {near_ties:?}");
        assert!(near_ties.len() <= 1, "{what}: {} tokens differ", near_ties.len());
    }
    assert_eq!(stats(), engine_memory::default());
}

/// Window exceeded, ids outside the vocabulary, streams not admitted, NULLs and empty calls are refused
/// with nothing appended: the stream then decodes exactly as one that never saw them.
#[test]
fn refused_steps_append_nothing() {
    let _g = serial();
    let mut rng = Rng::fresh("refused_steps_append_nothing");
    let dir = Scratch::new("refusals");
    let cfg = llama();
    let path = dir.hf("llama", &cfg, rng.next_u64(), DType::Bf16);
    let window = 16;
    let opts = engine_options { max_streams: 2, ..cpu_options(window) };
    let e = init(&path, &opts);
    let reference = init(&path, &opts);
    let vocab = cfg.vocab as i32;
    assert_eq!(info(&e).streams, 2);

    let prompt = rng.ids(cfg.vocab, 10);
    let first = step(&e, 0, &prompt);
    assert_eq!(step(&reference, 0, &prompt), first);
    let after_prompt = logits(&reference, 0);

    let (st, next) = try_step(&e, 0, &rng.ids(cfg.vocab, 7));
    assert_eq!((st, next), (Status::NoRoom, -7), "10 + 7 tokens in a 16-token window: {}", last_error());
    assert!(last_error().contains("window of 16"), "{}", last_error());

    for bad in [-1, vocab, vocab + 1000, i32::MIN, i32::MAX] {
        let (st, next) = try_step(&e, 0, &[first, bad, 3]);
        assert_eq!((st, next), (Status::OutOfRange, -7), "id {bad}: {}", last_error());
        assert!(last_error().contains(&format!("id {bad}")), "id {bad}: {}", last_error());
    }
    for stream in [2, 3, u32::MAX] {
        let (st, next) = try_step(&e, stream, &[first]);
        assert_eq!((st, next), (Status::OutOfRange, -7), "stream {stream}: {}", last_error());
        assert!(last_error().contains(&format!("stream {stream}")), "{}", last_error());
    }

    let tokens = [first, 5];
    let mut next = -7;
    let calls: [(&str, Status); 5] = [
        // SAFETY: a NULL engine is refused before the live token and out are read.
        ("engine NULL", unsafe { ffi::engine_step(std::ptr::null_mut(), 0, tokens.as_ptr(), 1, &mut next) }),
        // SAFETY: a live engine; the NULL tokens are refused before anything is read.
        ("tokens NULL", unsafe { ffi::engine_step(e.0, 0, std::ptr::null(), 1, &mut next) }),
        // SAFETY: a live engine; the NULL out is refused before anything runs.
        ("next NULL", unsafe { ffi::engine_step(e.0, 0, tokens.as_ptr(), 1, std::ptr::null_mut()) }),
        // SAFETY: a live engine; n = 0 is refused before anything is read.
        ("n = 0", unsafe { ffi::engine_step(e.0, 0, tokens.as_ptr(), 0, &mut next) }),
        // SAFETY: a live engine; n = 0 is refused before the NULL tokens are read.
        ("n = 0, tokens NULL", unsafe { ffi::engine_step(e.0, 0, std::ptr::null(), 0, &mut next) }),
    ];
    for (what, st) in calls {
        assert_eq!(st, Status::InvalidArgument, "{what}: {}", last_error());
        assert!(!last_error().is_empty(), "{what}: no message");
    }
    assert_eq!(next, -7, "a refused step wrote next");

    // The refusals neither appended nor replaced the last logits.
    assert_eq!(bits(&logits(&e, 0)), bits(&logits(&reference, 0)), "logits after the refusals");
    let fill = rng.ids(cfg.vocab, 6);
    assert_eq!(step(&e, 0, &fill), step(&reference, 0, &fill), "the step that fills the window");
    assert_eq!(bits(&logits(&e, 0)), bits(&logits(&reference, 0)), "logits at a full window");
    assert_eq!(try_step(&e, 0, &[first]), (Status::NoRoom, -7), "a full window takes no token");

    // The other stream is untouched and has its own window.
    assert_eq!(try_step(&e, 1, &rng.ids(cfg.vocab, window as usize + 1)).0, Status::NoRoom);
    assert_eq!(step(&e, 1, &prompt), first, "stream 1 starts empty");
    assert_eq!(bits(&logits(&e, 1)), bits(&after_prompt), "stream 1 after the same prompt");
    // A reset stream takes a window's worth again.
    reset(&e, 0);
    let t = step(&e, 0, &rng.ids(cfg.vocab, window as usize));
    assert!((0..vocab).contains(&t), "token {t}");
    drop((e, reference));
    assert_eq!(stats(), engine_memory::default());
}

/// Prompts of several of the CPU backend's chunks (64 tokens) that would run past the window are NO_ROOM
/// with nothing appended, whether the stream is empty or part full; the stream then goes on exactly as
/// one that never saw them, up to the last position of its window.
#[test]
fn prompts_of_several_chunks_past_the_window_append_nothing() {
    let _g = serial();
    let mut rng = Rng::fresh("prompts_of_several_chunks_past_the_window_append_nothing");
    let dir = Scratch::new("chunks-past-window");
    let cfg = llama();
    let path = dir.hf("llama", &cfg, rng.next_u64(), DType::Bf16);
    let chunk = hostembed::cpu::CHUNK_TOKENS;
    let window = 3 * chunk + 8;
    let e = init(&path, &cpu_options(window as u32));
    let reference = init(&path, &cpu_options(window as u32));
    let len = |e: &Held| common::stream_len(e, 0) as usize;

    let (st, _) = try_step(&e, 0, &rng.ids(cfg.vocab, window + 1));
    assert_eq!(st, Status::NoRoom, "{} tokens into an empty {window}-token window", window + 1);
    assert_eq!(len(&e), 0, "the refused prompt appended nothing");

    let first = rng.ids(cfg.vocab, chunk + 5);
    let next = step(&e, 0, &first);
    assert_eq!(step(&reference, 0, &first), next);
    let room = window - first.len();
    for n in [room + 1, room + chunk, window] {
        let (st, _) = try_step(&e, 0, &rng.ids(cfg.vocab, n));
        assert_eq!(st, Status::NoRoom, "{n} tokens after {}: {}", first.len(), last_error());
        assert_eq!(len(&e), first.len(), "{n} tokens after {}: appended", first.len());
    }
    assert_eq!(bits(&logits(&e, 0)), bits(&logits(&reference, 0)), "logits after the refusals");
    // The rest of the window, in one prompt of more than one chunk, is taken and matches the reference.
    let rest = rng.ids(cfg.vocab, room);
    assert_eq!(step(&e, 0, &rest), step(&reference, 0, &rest));
    assert_eq!(bits(&logits(&e, 0)), bits(&logits(&reference, 0)), "logits at a full window");
    assert_eq!(len(&e), window);
    drop((e, reference));
    assert_eq!(stats(), engine_memory::default());
}

/// engine_logits, engine_reset and engine_model_info refuse NULLs, short buffers and streams the engine
/// did not admit; engine_logits serves the last stepped stream only.
#[test]
fn bad_calls_to_logits_reset_and_model_info_are_refused() {
    let _g = serial();
    let mut rng = Rng::fresh("bad_calls_to_logits_reset_and_model_info_are_refused");
    let dir = Scratch::new("bad-calls");
    let cfg = llama();
    let path = dir.gguf("llama", &cfg, rng.next_u64(), DType::Q8_0);
    let e = init(&path, &engine_options { max_streams: 3, ..cpu_options(32) });
    let mut out = vec![0f32; cfg.vocab];
    // SAFETY: the callers pass a live engine (or NULL, which it refuses) and room for `len` floats at `out`.
    let logits_call = |e: *const ffi::engine, stream: u32, out: *mut f32, len: usize| unsafe {
        ffi::engine_logits(e, stream, out, len)
    };
    assert_eq!(logits_call(e.0, 0, out.as_mut_ptr(), out.len()), Status::InvalidArgument, "before any step");
    step(&e, 1, &rng.ids(cfg.vocab, 4));
    assert_eq!(logits_call(e.0, 1, out.as_mut_ptr(), out.len()), Status::Ok, "{}", last_error());
    // Each status checked as it comes, while engine_last_error() is still that call's.
    let expect = |what: &str, got: Status, want: Status| assert_eq!(got, want, "{what}: {}", last_error());
    let null_engine = logits_call(std::ptr::null(), 1, out.as_mut_ptr(), out.len());
    expect("engine NULL", null_engine, Status::InvalidArgument);
    expect("out NULL", logits_call(e.0, 1, std::ptr::null_mut(), out.len()), Status::InvalidArgument);
    let short = logits_call(e.0, 1, out.as_mut_ptr(), out.len() - 1);
    expect("len vocab - 1", short, Status::InvalidArgument);
    let not_last = logits_call(e.0, 0, out.as_mut_ptr(), out.len());
    expect("a stream not stepped last", not_last, Status::InvalidArgument);
    expect("stream 3 of 3", logits_call(e.0, 3, out.as_mut_ptr(), out.len()), Status::OutOfRange);
    // SAFETY: a NULL engine is refused.
    expect("reset NULL", unsafe { ffi::engine_reset(std::ptr::null_mut(), 0) }, Status::InvalidArgument);
    // SAFETY: a live engine; stream 3 of 3 is refused.
    expect("reset stream 3 of 3", unsafe { ffi::engine_reset(e.0, 3) }, Status::OutOfRange);
    // SAFETY: a live engine; stream u32::MAX is refused.
    expect("reset u32::MAX", unsafe { ffi::engine_reset(e.0, u32::MAX) }, Status::OutOfRange);
    // SAFETY: engine_model_info is numbers, bools and enums with a variant at 0: all zeros is a value of it.
    let mut mi: engine_model_info = unsafe { std::mem::zeroed() };
    // SAFETY: a NULL engine is refused before `mi` is written.
    let null_engine = unsafe { ffi::engine_model_info(std::ptr::null(), &mut mi) };
    expect("model_info engine NULL", null_engine, Status::InvalidArgument);
    // SAFETY: a live engine; the NULL out is refused.
    let null_out = unsafe { ffi::engine_model_info(e.0, std::ptr::null_mut()) };
    expect("model_info out NULL", null_out, Status::InvalidArgument);
    assert!(out.iter().all(|v| v.is_finite()), "the one good call wrote logits");
    // A stream never stepped resets fine; resetting the last stepped stream drops its logits.
    reset(&e, 2);
    assert_eq!(logits_call(e.0, 1, out.as_mut_ptr(), out.len()), Status::Ok);
    reset(&e, 1);
    assert_eq!(logits_call(e.0, 1, out.as_mut_ptr(), out.len()), Status::InvalidArgument, "logits after reset");
    drop(e);
    assert_eq!(stats(), engine_memory::default());
}

#[test]
fn reset_then_the_same_prompt_gives_the_same_tokens() {
    let _g = serial();
    let mut rng = Rng::fresh("reset_then_the_same_prompt_gives_the_same_tokens");
    let dir = Scratch::new("reset");
    let cfg = llama();
    let path = dir.hf("llama", &cfg, rng.next_u64(), DType::Bf16);
    let prompt = rng.ids(cfg.vocab, 9);
    for opts in [cpu_options(128), sampled(rng.next_u64())] {
        let e = init(&path, &opts);
        let stream = 1;
        let (first, first_logits) = decode(&e, stream, &prompt, 32);
        reset(&e, stream);
        // Something else in between, on the same stream, then reset again.
        decode(&e, stream, &rng.ids(cfg.vocab, 5), 3);
        reset(&e, stream);
        let (again, again_logits) = decode(&e, stream, &prompt, 32);
        assert_eq!(again, first, "temperature {}: tokens after reset", opts.temperature);
        assert!(
            first_logits.iter().zip(&again_logits).all(|(a, b)| bits(a) == bits(b)),
            "temperature {}: logits after reset",
            opts.temperature
        );
        // Reset after a half-full stream, and a window's worth fits again.
        reset(&e, stream);
        step(&e, stream, &rng.ids(cfg.vocab, 128));
    }
    assert_eq!(stats(), engine_memory::default());
}

#[test]
fn interleaved_streams_decode_as_each_alone() {
    let _g = serial();
    let mut rng = Rng::fresh("interleaved_streams_decode_as_each_alone");
    let dir = Scratch::new("streams");
    let cfg = qwen2();
    let path = dir.gguf("qwen2", &cfg, rng.next_u64(), DType::F16);
    let (a, b) = (rng.ids(cfg.vocab, 7), rng.ids(cfg.vocab, 12));
    let steps = 24;
    for opts in [cpu_options(64), sampled(rng.next_u64())] {
        let opts = engine_options { max_streams: 4, ..opts };
        let what = format!("temperature {}", opts.temperature);
        let (alone_a, logits_a) = decode(&init(&path, &opts), 0, &a, steps);
        let (alone_b, logits_b) = decode(&init(&path, &opts), 3, &b, steps);
        let e = init(&path, &opts);
        let (mut ta, mut tb) = (vec![step(&e, 0, &a)], vec![]);
        assert_eq!(bits(&logits(&e, 0)), bits(&logits_a[0]), "{what}: stream 0 after its prompt");
        tb.push(step(&e, 3, &b));
        assert_eq!(bits(&logits(&e, 3)), bits(&logits_b[0]), "{what}: stream 3 after its prompt");
        for i in 1..=steps {
            ta.push(step(&e, 0, &[ta[i - 1]]));
            assert_eq!(bits(&logits(&e, 0)), bits(&logits_a[i]), "{what}: stream 0 step {i}");
            tb.push(step(&e, 3, &[tb[i - 1]]));
            assert_eq!(bits(&logits(&e, 3)), bits(&logits_b[i]), "{what}: stream 3 step {i}");
        }
        assert_eq!(ta, alone_a, "{what}: stream 0");
        assert_eq!(tb, alone_b, "{what}: stream 3");
    }
    assert_eq!(stats(), engine_memory::default());
}

#[test]
fn logits_of_the_last_stepped_stream_equal_a_fresh_cpu_forward() {
    let _g = serial();
    let mut rng = Rng::fresh("logits_of_the_last_stepped_stream_equal_a_fresh_cpu_forward");
    let dir = Scratch::new("logits");
    let cfg = llama();
    let seed = rng.next_u64();
    for path in [dir.hf("llama", &cfg, seed, DType::Bf16), dir.gguf("llama", &cfg, seed, DType::Q8_0)] {
        let window = 48;
        let e = init(&path, &engine_options { max_streams: 4, ..cpu_options(window) });
        let mut fed = rng.ids(cfg.vocab, 11);
        let mut next = step(&e, 2, &fed);
        for _ in 0..5 {
            fed.push(next);
            next = step(&e, 2, &[next]);
        }
        step(&e, 1, &rng.ids(cfg.vocab, 3));
        fed.push(next);
        let last = step(&e, 2, &[next]);

        let ckpt = Checkpoint::open(&path).unwrap();
        let model = CpuModel::new(&ckpt).unwrap();
        let mut stream = model.new_stream(window as usize);
        let ids: Vec<u32> = fed.iter().map(|&t| t as u32).collect();
        let want = model.forward(&mut stream, &ids).unwrap();
        let got = logits(&e, 2);
        assert_eq!(bits(&got), bits(&want), "{}: engine_logits against CpuModel::forward", path.display());
        assert_eq!(last as u32, sampler::argmax(&want), "greedy picks the argmax");
    }
    assert_eq!(stats(), engine_memory::default());
}

/// engine_top_logprobs(e, s, k, ids, lps) into two vectors of k, with its status.
fn top_logprobs(e: &Held, stream: u32, k: usize) -> (Status, Vec<i32>, Vec<f32>) {
    let (mut ids, mut lps) = (vec![-1i32; k], vec![f32::NAN; k]);
    // SAFETY: a live engine, and two arrays of k values.
    let st = unsafe { ffi::engine_top_logprobs(e.0, stream, k, ids.as_mut_ptr(), lps.as_mut_ptr()) };
    (st, ids, lps)
}

/// The top-k log-probabilities against a float64 log-softmax of engine_logits (within 1e-5), in the
/// reference's order (a tie to the lower id), for k from 0 to the whole vocabulary, whatever the stream's
/// sampling settings; the whole vocabulary's probabilities sum to 1; bad calls are refused.
#[test]
fn top_logprobs_are_the_log_softmax_of_the_logits_in_order() {
    let _g = serial();
    let mut rng = Rng::fresh("top_logprobs_are_the_log_softmax_of_the_logits_in_order");
    let dir = Scratch::new("top-logprobs");
    let cfg = llama();
    let path = dir.gguf("llama", &cfg, rng.next_u64(), DType::Q8_0);
    let e = init(&path, &engine_options { max_streams: 2, ..sampled(7) });
    let (st, _, _) = top_logprobs(&e, 0, 3);
    assert_eq!(st, Status::InvalidArgument, "before any step: {}", last_error());
    step(&e, 0, &rng.ids(cfg.vocab, 9));
    let got_logits = logits(&e, 0);
    let max = got_logits.iter().fold(f64::NEG_INFINITY, |m, &l| m.max(l as f64));
    let log_z = max + got_logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
    let mut want: Vec<(usize, f64)> = got_logits.iter().enumerate().map(|(i, &l)| (i, l as f64 - log_z)).collect();
    want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let vocab = cfg.vocab;
    for k in [0, 1, 2, 5, 40, vocab - 1, vocab] {
        let (st, ids, lps) = top_logprobs(&e, 0, k);
        assert_eq!(st, Status::Ok, "k {k}: {}", last_error());
        for (i, (&id, &lp)) in ids.iter().zip(&lps).enumerate() {
            assert_eq!(id as usize, want[i].0, "k {k}: rank {i}");
            assert!((lp as f64 - want[i].1).abs() <= 1e-5, "k {k}: rank {i}: {lp} against {}", want[i].1);
            assert!(i == 0 || lps[i - 1] >= lp, "k {k}: not sorted at rank {i}");
        }
    }
    let (_, _, all) = top_logprobs(&e, 0, vocab);
    let total: f64 = all.iter().map(|&lp| (lp as f64).exp()).sum();
    assert!((total - 1.0).abs() < 1e-5, "the probabilities sum to {total}");
    assert_eq!(top_logprobs(&e, 0, vocab + 1).0, Status::InvalidArgument, "k past the vocabulary");
    // SAFETY: a live engine; the NULL arrays are what is refused.
    let null = unsafe { ffi::engine_top_logprobs(e.0, 0, 1, std::ptr::null_mut(), std::ptr::null_mut()) };
    assert_eq!(null, Status::InvalidArgument, "NULL arrays with k 1");
    // SAFETY: a live engine; k 0 reads no array.
    let none = unsafe { ffi::engine_top_logprobs(e.0, 0, 0, std::ptr::null_mut(), std::ptr::null_mut()) };
    assert_eq!(none, Status::Ok, "k 0 with NULL arrays: {}", last_error());
    // SAFETY: NULL is refused before anything is read.
    let engine_null =
        unsafe { ffi::engine_top_logprobs(std::ptr::null(), 0, 0, std::ptr::null_mut(), std::ptr::null_mut()) };
    assert_eq!(engine_null, Status::InvalidArgument, "a NULL engine");
    assert_eq!(top_logprobs(&e, 5, 1).0, Status::OutOfRange, "a stream past max_streams: {}", last_error());
    drop(e);
    assert_eq!(stats(), engine_memory::default());
}

#[test]
fn sampled_decoding_repeats_for_a_seed_and_differs_for_another() {
    let _g = serial();
    let mut rng = Rng::fresh("sampled_decoding_repeats_for_a_seed_and_differs_for_another");
    let dir = Scratch::new("sampled");
    let cfg = llama();
    let path = dir.hf("llama", &cfg, rng.next_u64(), DType::F32);
    let prompt = rng.ids(cfg.vocab, 6);
    let seed = rng.next_u64();
    let stream = 2;
    let run = |opts: &engine_options| {
        let e = init(&path, opts);
        let (tokens, all) = decode(&e, stream, &prompt, 40);
        // Each token is the sampler's draw on the engine's logits for the position it takes.
        let s = sampling_of(opts);
        for (i, (t, l)) in tokens.iter().zip(&all).enumerate() {
            let position = (prompt.len() + i) as u64;
            assert_eq!(*t as u32, sampler::sample(l, &s, stream, position), "seed {} token {i}", opts.seed);
        }
        tokens
    };
    let first = run(&sampled(seed));
    assert_eq!(run(&sampled(seed)), first, "the same seed repeats the run");
    let other = run(&sampled(seed ^ 1));
    let differ = first.iter().zip(&other).filter(|(a, b)| a != b).count();
    println!("seed {seed} and {}: {differ} of {} tokens differ", seed ^ 1, first.len());
    assert!(differ > 0, "another seed gives the same {} tokens", first.len());
    let greedy = run(&cpu_options(128));
    assert_ne!(greedy, first, "temperature 0.8 decodes like greedy");
    assert_eq!(stats(), engine_memory::default());
}

#[test]
fn model_info_describes_the_model_and_the_engine() {
    let _g = serial();
    let mut rng = Rng::fresh("model_info_describes_the_model_and_the_engine");
    let dir = Scratch::new("info");
    let cfg = llama();
    let path = dir.hf("llama", &cfg, rng.next_u64(), DType::Bf16);
    let e = init(&path, &engine_options { max_streams: 5, ..cpu_options(48) });
    let i = info(&e);
    let got = (i.vocab, i.layers, i.hidden, i.heads, i.kv_heads, i.head_dim, i.window, i.streams, i.bos, i.eos);
    assert_eq!(got, (384, 2, 64, 4, 2, 16, 48, 5, 1, 2));
    assert_eq!((i.placement, i.cuda), (engine_placement::FileMapped, false), "CPU rows are read from the mapping");
    let file = std::fs::metadata(path.join("model.safetensors")).unwrap().len();
    assert_eq!(stats().mapped_bytes, file, "the live engine's mapping is counted");
    drop(e);

    // The model's own window and the CPU backend's default streams; no bos or eos: -1.
    let none = ModelConfig { bos: None, eos: None, ..qwen2() };
    let path = dir.gguf("qwen2", &none, rng.next_u64(), DType::Bf16);
    let e = init(&path, &cpu_options(0));
    let i = info(&e);
    assert_eq!((i.vocab, i.kv_heads, i.window, i.streams), (301, 1, 512, engine::CPU_STREAMS));
    assert_eq!((i.bos, i.eos), (-1, -1));
    let last_stream = engine::CPU_STREAMS - 1;
    assert_eq!(step(&e, last_stream, &[0, 300]), step(&e, 0, &[0, 300]), "the last admitted stream decodes");
    drop(e);
    assert_eq!(stats(), engine_memory::default());
}
