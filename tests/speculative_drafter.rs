//! Speculative decoding with a drafter model (ENGINE_DRAFT_MODEL, `options.draft_model`) on the CPU
//! backend through the C ABI. Greedy output with a drafter is the output without speculation, token for
//! token, on 20 prompts of 128 tokens: a drafter that is the target itself is always accepted, a
//! different random model of the same vocabulary rarely; seeded sampled output is the plain output too;
//! random batches mixing drafter, prompt-lookup and plain items, with truncates, forks and resets
//! between them, give each stream the tokens of stepping it alone, with both KV pools' counts exact
//! (the audit also checks each drafter stream holds a prefix of its target stream's tokens); a drafter
//! of another vocabulary is refused at load naming both sizes; and, when present, SmolLM2-135M Q4_1
//! drafts for its own F32 dequantization.

mod common;
use common::shared::{self, fork, no_cache};
use common::spec::{Item, RandomStreams, batch, drafted, generate, lookup, repeating_prompt, set_speculation};
use common::spec::{spec_stats, speculated_as_plain, tiny};
use common::{
    Held, Rng, Scratch, c_path, cpu_options, init, model_file, reset, serial, set_sampling, stream_len, truncate,
};

use hostembed::Status;
use hostembed::abi::engine_draft;
use hostembed::checkpoint::write::write_gguf_dequantized;
use hostembed::engine::{Engine, InitStep, engine_options};
use hostembed::ffi;
use hostembed::model::{Arch, ModelConfig};
use hostembed::status::last_error;
use hostembed::tensor::DType;
use std::ffi::CString;
use std::path::Path;

const PAGE: usize = hostembed::cpu::PAGE_TOKENS;

/// `opts` with `drafter` as options.draft_model (the CString must outlive the init).
fn with_drafter(opts: engine_options, drafter: &CString) -> engine_options {
    engine_options { draft_model: drafter.as_ptr(), ..opts }
}

/// Generates `n` tokens after each of `prompts` with the drafter proposing (random max_tokens) and
/// without speculation; asserts they are the same tokens, and returns (proposed, accepted).
fn identical_with_drafter(
    spec: &Held,
    plain: &Held,
    prompts: &[Vec<i32>],
    n: usize,
    rng: &mut Rng,
    what: &str,
) -> (u64, u64) {
    let (mut proposed, mut accepted) = (0, 0);
    for (p, prompt) in prompts.iter().enumerate() {
        let max = 1 + rng.below(8) as u32;
        let case = format!("{what}: prompt {p} with max_tokens {max}");
        let cap = max as usize + 1 + p % 2;
        let (_, (pr, ac)) = speculated_as_plain(spec, plain, &drafted(max), prompt, n, cap, &case);
        (proposed, accepted) = (proposed + pr, accepted + ac);
        reset(spec, 0);
        reset(plain, 0);
        shared::check_pool(spec, &[0], shared::kv_usage(spec).tokens_total, PAGE, what);
    }
    (proposed, accepted)
}

#[test]
fn greedy_output_with_a_drafter_is_the_plain_output() {
    let _g = serial();
    let mut rng = Rng::fresh("greedy_output_with_a_drafter_is_the_plain_output");
    let dir = Scratch::new("draft-greedy");
    let cfg = tiny(Arch::Llama);
    let target = dir.gguf("target", &cfg, rng.next_u64(), DType::Q8_0);
    // Another random model of the same vocabulary, of another architecture and depth.
    let other_cfg = hostembed::model::ModelConfig { layers: 1, ..tiny(Arch::Qwen2) };
    let other = dir.gguf("other", &other_cfg, rng.next_u64(), DType::F32);
    let prompts: Vec<Vec<i32>> = (0..20)
        .map(|p| if p % 3 == 2 { rng.ids(cfg.vocab, 5) } else { repeating_prompt(&mut rng, cfg.vocab) })
        .collect();
    let plain = init(&target, &cpu_options(256, 1));

    let itself = c_path(&target);
    let spec = init(&target, &with_drafter(cpu_options(256, 1), &itself));
    let (p, a) = identical_with_drafter(&spec, &plain, &prompts, 128, &mut rng, "drafted by itself");
    println!("drafted by itself: proposed {p}, accepted {a}");
    assert!(p > 0 && a == p, "the target drafting for itself is always accepted: {a} of {p}");
    drop(spec);

    let another = c_path(&other);
    let spec = init(&target, &with_drafter(cpu_options(256, 1), &another));
    let (p, a) = identical_with_drafter(&spec, &plain, &prompts, 128, &mut rng, "drafted by another model");
    println!("drafted by another random model: proposed {p}, accepted {a}");
    // Random models fall into loops where they agree for long stretches, so the bound is on the rejected
    // proposals the rollback must get right: 55 the fewest over 76 seeds (proposals start at one a step and
    // pause after rejections, so a run that never agrees rejects about 7 a prompt).
    assert!(p >= a + 40, "another random model's drafts are rejected at least 40 times: {a} of {p} accepted");
}

/// The draw is seeded by (seed, stream, position) and verification draws the target's token at every
/// position as a plain step would, so a stream sampled with a drafter gives the plain tokens.
#[test]
fn sampled_output_with_a_drafter_is_the_plain_output() {
    let _g = serial();
    let mut rng = Rng::fresh("sampled_output_with_a_drafter_is_the_plain_output");
    let dir = Scratch::new("draft-sampled");
    let cfg = tiny(Arch::Llama);
    let seed = rng.next_u64();
    let target = dir.gguf("target", &cfg, seed, DType::F32);
    // A quantized copy of the target: mostly accepted, sometimes not.
    let quantized = dir.gguf("quantized", &cfg, seed, DType::Q4_0);
    let drafter = c_path(&quantized);
    let spec = init(&target, &with_drafter(cpu_options(256, 1), &drafter));
    let plain = init(&target, &cpu_options(256, 1));
    let (mut proposed, mut accepted) = (0, 0);
    for p in 0..8 {
        let s = common::random_sampling(&mut rng);
        set_sampling(&spec, 0, &s);
        set_sampling(&plain, 0, &s);
        let max = 1 + rng.below(8) as u32;
        let prompt = repeating_prompt(&mut rng, cfg.vocab);
        let what = format!("prompt {p}, {s:?}");
        let (_, (pr, ac)) = speculated_as_plain(&spec, &plain, &drafted(max), &prompt, 96, max as usize + 1, &what);
        (proposed, accepted) = (proposed + pr, accepted + ac);
        reset(&spec, 0);
        reset(&plain, 0);
    }
    println!("sampled, drafted by a Q4_0 copy: proposed {proposed}, accepted {accepted}");
    assert!(accepted > 0 && accepted < proposed, "proposed {proposed}, accepted {accepted}");
}

#[test]
fn random_batches_with_a_drafter_match_stepping_alone() {
    let _g = serial();
    let mut rng = Rng::fresh("random_batches_with_a_drafter_match_stepping_alone");
    let dir = Scratch::new("draft-batches");
    let cfg = tiny(Arch::Llama);
    let seed = rng.next_u64();
    let target = dir.gguf("target", &cfg, seed, DType::F32);
    // The first of the target's layers, in Q4_0: drafts that agree often, and not always.
    let quantized = dir.gguf("quantized", &ModelConfig { layers: 1, ..cfg.clone() }, seed, DType::Q4_0);
    let drafter = c_path(&quantized);
    const STREAMS: usize = 6;
    const WINDOW: u32 = 160;
    for cached in [true, false] {
        let opts = with_drafter(cpu_options(WINDOW, STREAMS as u32), &drafter);
        let e = init(&target, &if cached { opts } else { no_cache(opts) });
        let reference = init(&target, &no_cache(cpu_options(WINDOW, 1)));
        let total = shared::kv_usage(&e).tokens_total;
        let (mut caps, mut prompts): (Vec<usize>, Vec<Vec<i32>>) = (Vec::new(), Vec::new());
        for s in 0..STREAMS {
            let max = 1 + rng.below(8) as u32;
            // Streams 0..4 draft with the model, 4 looks up, 5 steps plainly.
            let set = match s {
                0..4 => drafted(max),
                4 => lookup(max),
                _ => hostembed::ffi::engine_default_speculation(),
            };
            assert_eq!(set_speculation(&e, s as u32, &set), Status::Ok, "{}", last_error());
            caps.push(max as usize + 1);
            let p = if s > 0 && rng.below(3) == 0 { prompts[0].clone() } else { repeating_prompt(&mut rng, cfg.vocab) };
            prompts.push(p);
        }
        let mut streams = RandomStreams::new(prompts, caps);
        for round in 0..60 {
            // Between steps, now and then: a truncate, a fork or a reset, mirrored in the drafter.
            let s = rng.below(STREAMS as u64) as usize;
            match rng.below(8) {
                0 if streams.held[s].len() > 1 => {
                    let len = 1 + rng.below(streams.held[s].len() as u64 - 1) as usize;
                    truncate(&e, s as u32, len as u32);
                    let cut: Vec<i32> = streams.held[s].drain(len..).collect();
                    streams.input[s] = cut.into_iter().chain(streams.input[s].drain(..)).collect();
                }
                1 => {
                    let dst = (s + 1 + rng.below(STREAMS as u64 - 1) as usize) % STREAMS;
                    let len = rng.below(streams.held[s].len() as u64 + 1) as usize;
                    assert_eq!(fork(&e, s as u32, dst as u32, len), Status::Ok, "{}", last_error());
                    streams.held[dst] = streams.held[s][..len].to_vec();
                    streams.input[dst] = streams.held[s][len..].iter().chain(&streams.input[s]).copied().collect();
                }
                2 => {
                    reset(&e, s as u32);
                    streams.held[s].clear();
                    streams.input[s] = streams.prompts[s].clone();
                }
                _ => {}
            }
            let what = format!("cache {cached}, round {round}");
            streams.step(&e, &reference, &mut rng, 4, WINDOW as usize, &what);
            // The audit behind it checks the drafter's pool and streams too.
            shared::check_pool(&e, &streams.lens(), total, PAGE, &what);
        }
        let stats: Vec<(u64, u64)> = (0..STREAMS as u32).map(|s| spec_stats(&e, s)).collect();
        println!("cache {cached}: proposed, accepted per stream {stats:?}");
        assert!(stats[..4].iter().any(|&(p, a)| a > 0 && a < p), "{stats:?}");
        assert_eq!(stats[5], (0, 0));
    }
}

#[test]
fn a_drafter_of_another_vocabulary_is_refused() {
    let _g = serial();
    let mut rng = Rng::fresh("a_drafter_of_another_vocabulary_is_refused");
    let dir = Scratch::new("draft-bad");
    let cfg = tiny(Arch::Llama);
    let target = dir.gguf("target", &cfg, rng.next_u64(), DType::Q8_0);
    let before = common::stats();
    let wide =
        dir.gguf("wide", &hostembed::model::ModelConfig { vocab: 96, ..cfg.clone() }, rng.next_u64(), DType::Q8_0);
    let refused = |drafter: &Path| {
        let d = c_path(drafter);
        let opts = with_drafter(cpu_options(64, 1), &d);
        let mut h = std::ptr::null_mut();
        // SAFETY: a NUL-terminated path that lives across the call, live options and a writable handle.
        let st = unsafe { ffi::engine_init_fit(c_path(&target).as_ptr(), &opts, &mut h) };
        assert!(h.is_null());
        (st, last_error())
    };
    let (st, why) = refused(&wide);
    assert_eq!(st, Status::BadModel, "{why}");
    assert!(why.contains("96") && why.contains("64") && why.contains("draft_model"), "{why}");
    let (st, why) = refused(&dir.join("absent.gguf"));
    assert_ne!(st, Status::Ok);
    assert!(why.contains("draft_model"), "{why}");
    assert_eq!(common::stats(), before, "a refused drafter leaves nothing held");
    // A load that fails at any step after the drafter opened holds nothing afterwards either.
    let d = c_path(&target);
    for step in [InitStep::Opened, InitStep::Planned, InitStep::RowsPlaced, InitStep::Loaded] {
        let r = Engine::init_fit_failing_after(&target, &with_drafter(cpu_options(64, 1), &d), Some(step));
        assert!(r.is_err(), "{step:?}");
        assert_eq!(common::stats(), before, "after failing at {step:?}");
    }

    // With a drafter loaded, MODEL is accepted and its settings are checked as lookup's are.
    let d = c_path(&target);
    let e = init(&target, &with_drafter(cpu_options(64, 2), &d));
    assert_eq!(set_speculation(&e, 1, &drafted(4)), Status::Ok, "{}", last_error());
    assert_eq!(set_speculation(&e, 1, &drafted(0)), Status::InvalidArgument);
    assert_eq!(set_speculation(&e, 2, &drafted(4)), Status::OutOfRange);
    // At the window's end a drafting stream proposes fewer and never passes the window.
    assert_eq!(set_speculation(&e, 0, &drafted(4)), Status::Ok);
    let mut next = rng.ids(cfg.vocab, 8);
    loop {
        let len = stream_len(&e, 0) as usize;
        let (st, res) = batch(&e, &[Item { stream: 0, tokens: &next, cap: 5 }]);
        assert_eq!(st, Status::Ok);
        if res[0].0 == Status::NoRoom {
            assert_eq!(len, 64, "refused only with the window full");
            break;
        }
        assert_eq!(res[0].0, Status::Ok, "{}", last_error());
        assert_eq!(stream_len(&e, 0) as usize, len + next.len() + res[0].2.len() - 1);
        next = vec![res[0].1];
    }
    shared::check_pool(&e, &[64, 0], shared::kv_usage(&e).tokens_total, PAGE, "at the window's end");
    let (p, a) = spec_stats(&e, 0);
    assert!(p > 0 && a == p, "{a} of {p}");
    assert_eq!(hostembed::ffi::engine_default_speculation().draft, engine_draft::None);
}

/// SmolLM2-135M: its Q4_1 file drafting for its F32 dequantization, greedy, gives the F32 model's
/// tokens; the acceptance is printed.
#[test]
fn smollm2_q4_1_drafts_for_its_f32_dequantization() {
    let Some(q4_1) = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "scripts/fetch-smollm.sh fetches it") else {
        return;
    };
    let _g = serial();
    let dir = Scratch::new("draft-smollm");
    let f32_model = dir.join("SmolLM2-135M-Instruct.F32.gguf");
    write_gguf_dequantized(&q4_1, &f32_model).unwrap();
    let started = std::time::Instant::now();
    let opts = cpu_options(192, 1);
    let drafter = c_path(&q4_1);
    let spec = init(&f32_model, &with_drafter(opts, &drafter));
    let plain = init(&f32_model, &opts);
    assert_eq!(set_speculation(&spec, 0, &drafted(6)), Status::Ok, "{}", last_error());
    let texts = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"];
    let (mut plain_s, mut spec_s) = (0.0, 0.0);
    for text in texts {
        let prompt = common::tokenize(&spec, text);
        let t = std::time::Instant::now();
        let want = generate(&plain, 0, &prompt, 32, 0);
        plain_s += t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        let got = generate(&spec, 0, &prompt, 32, 7);
        spec_s += t.elapsed().as_secs_f64();
        assert_eq!(got[..32], want[..32], "{text:?}");
        reset(&spec, 0);
        reset(&plain, 0);
    }
    let (p, a) = spec_stats(&spec, 0);
    println!(
        "SmolLM2 F32 drafted by its Q4_1: proposed {p}, accepted {a} ({:.0}%); plain {plain_s:.2} s, drafted {spec_s:.2} s \
         ({:.1} s in all)",
        100.0 * a as f64 / p.max(1) as f64,
        started.elapsed().as_secs_f64()
    );
    assert!(a * 2 > p, "a quantized copy's drafts are mostly accepted: {a} of {p}");
}
