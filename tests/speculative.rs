//! Speculative decoding on the CPU backend through the C ABI: prompt lookup (ENGINE_DRAFT_NGRAM)
//! verified in one forward per step. Greedy output with speculation is the output without it, token
//! for token (tiny models and, when present, SmolLM2-135M Q4_1); random batches mixing speculative and
//! plain items give each stream the tokens of stepping it alone, with the KV pool's counts exact after
//! every rejection; sampled output keeps the target's distribution (a chi-square test, and the tokens
//! themselves, since the draw is seeded by position); bad input is refused as the header says.

mod common;
use common::shared::{self, fork, no_cache};
use common::spec::{Item, RandomStreams, batch, generate, lookup, repeating_prompt, set_speculation, spec_stats};
use common::spec::{speculated_as_plain, tiny};
use common::{Rng, Scratch, cpu_options, init, logits, model_file, reset, serial, set_sampling, stream_len};

use hostembed::Status;
use hostembed::abi::{ENGINE_SPECULATION_MAX_TOKENS, engine_draft, engine_sampling, engine_speculation};
use hostembed::engine::{self, engine_backend, engine_options};
use hostembed::ffi;
use hostembed::model::{Arch, ModelConfig};
use hostembed::status::last_error;
use hostembed::tensor::DType;
use std::path::PathBuf;

const PAGE: usize = hostembed::cpu::PAGE_TOKENS;

fn model(dir: &Scratch, cfg: &ModelConfig, rng: &mut Rng, dtype: DType) -> PathBuf {
    dir.gguf("m", cfg, rng.next_u64(), dtype)
}

#[test]
fn greedy_lookup_gives_the_tokens_and_logits_of_plain_steps() {
    let _g = serial();
    let mut rng = Rng::fresh("greedy_lookup_gives_the_tokens_and_logits_of_plain_steps");
    let dir = Scratch::new("spec-greedy");
    let (mut proposed, mut accepted) = (0, 0);
    for (arch, dtype) in [(Arch::Llama, DType::Q8_0), (Arch::Qwen2, DType::F32)] {
        let cfg = tiny(arch);
        let path = model(&dir, &cfg, &mut rng, dtype);
        let spec = init(&path, &cpu_options(512, 2));
        let plain = init(&path, &cpu_options(512, 2));
        for p in 0..10 {
            let max = 1 + rng.below(10) as u32;
            let prompt = if p % 3 == 2 { rng.ids(cfg.vocab, 5) } else { repeating_prompt(&mut rng, cfg.vocab) };
            let what = format!("{arch:?} prompt {p} with max_tokens {max}");
            let cap = max as usize + 1 + p % 2;
            let (got, (pr, ac)) = speculated_as_plain(&spec, &plain, &lookup(max), &prompt, 128, cap, &what);
            // The logits kept are those after the stream's last position, as a plain step leaves them.
            let len = stream_len(&spec, 0);
            assert_eq!(len as usize, prompt.len() + got.len() - 1);
            let mut input = prompt.clone();
            input.extend_from_slice(&got);
            reset(&plain, 1);
            common::step(&plain, 1, &input[..len as usize]);
            assert_eq!(common::bits(&logits(&spec, 0)), common::bits(&logits(&plain, 1)), "logits after {len}");
            (proposed, accepted) = (proposed + pr, accepted + ac);
            reset(&spec, 0);
            reset(&plain, 0);
        }
    }
    println!("proposed {proposed}, accepted {accepted}");
    assert!(accepted > 0 && accepted < proposed, "proposed {proposed}, accepted {accepted}");
}

/// The Rust API's `Engine::step_tokens` is `engine_step_batch`'s item with `out`: the same tokens a step
/// at a time; `out` too small for the stream's proposals refuses the call; `Engine::step` steps one token.
#[test]
fn engine_step_tokens_speculates_as_the_c_batch_item_does() {
    let _g = serial();
    let mut rng = Rng::fresh("engine_step_tokens_speculates_as_the_c_batch_item_does");
    let dir = Scratch::new("spec-rust-api");
    let cfg = tiny(Arch::Llama);
    let path = model(&dir, &cfg, &mut rng, DType::Q8_0);
    let through_c = init(&path, &cpu_options(512, 1));
    let mut e = engine::Engine::init_fit(&path, &cpu_options(512, 1)).unwrap();
    let max = 6;
    assert_eq!(set_speculation(&through_c, 0, &lookup(max)), Status::Ok, "{}", last_error());
    e.set_speculation(0, &lookup(max)).unwrap();
    let prompt = repeating_prompt(&mut rng, cfg.vocab);
    let want = generate(&through_c, 0, &prompt, 96, max as usize + 1);
    let (mut got, mut input, mut steps) = (Vec::new(), prompt.clone(), 0);
    while got.len() < want.len() {
        let out = e.step_tokens(0, &input, max as usize + 1).unwrap();
        assert!(!out.is_empty() && out.len() <= max as usize + 1, "{out:?}");
        got.extend(out.iter().map(|&t| t as i32));
        input = vec![*got.last().unwrap()];
        steps += 1;
    }
    assert_eq!(got, want, "the same tokens through the Rust API and the C batch item");
    assert!(steps < got.len(), "some step produced more than one token ({steps} steps for {})", got.len());
    let refused = e.step_tokens(0, &input, max as usize).unwrap_err();
    assert_eq!(refused.status, Status::InvalidArgument, "{}", refused.message);
    let len = e.stream_len(0).unwrap();
    e.step(0, &input).unwrap();
    assert_eq!(e.stream_len(0).unwrap(), len + 1, "engine_step's path proposes nothing");
}

#[test]
fn smollm2_greedy_lookup_is_token_for_token() {
    let Some(path) = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "scripts/fetch-smollm.sh fetches it") else {
        return;
    };
    let _g = serial();
    let opts = engine_options { backend: engine_backend::Cpu, context: 256, ..cpu_options(256, 1) };
    let spec = init(&path, &opts);
    let plain = init(&path, &opts);
    assert_eq!(set_speculation(&spec, 0, &lookup(8)), Status::Ok, "{}", last_error());
    let texts = [
        "Repeat this code exactly:\nfor (int i = 0; i < n; i++) {\n    sum += a[i] * b[i];\n}\nfor (int i = 0; i < n; i++) {\n",
        "The capital of France is",
        "List the days of the week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Again: Monday,",
    ];
    for text in texts {
        let prompt = common::tokenize(&spec, text);
        let want = generate(&plain, 0, &prompt, 40, 0);
        let got = generate(&spec, 0, &prompt, 40, 9);
        assert_eq!(got[..40], want[..], "{text:?}");
        reset(&spec, 0);
        reset(&plain, 0);
    }
    let (p, a) = spec_stats(&spec, 0);
    println!("SmolLM2: proposed {p}, accepted {a}");
    assert!(a > 0, "the repeated code is accepted");
}

#[test]
fn random_batches_mixing_speculative_and_plain_items_match_stepping_alone() {
    let _g = serial();
    let mut rng = Rng::fresh("random_batches_mixing_speculative_and_plain_items_match_stepping_alone");
    let dir = Scratch::new("spec-batches");
    let cfg = tiny(Arch::Llama);
    let path = model(&dir, &cfg, &mut rng, DType::Q8_0);
    const STREAMS: usize = 6;
    const WINDOW: u32 = 160;
    for cached in [true, false] {
        let opts = cpu_options(WINDOW, STREAMS as u32);
        let e = init(&path, &if cached { opts } else { no_cache(opts) });
        let reference = init(&path, &no_cache(cpu_options(WINDOW, 1)));
        let total = shared::kv_usage(&e).tokens_total;
        let (mut caps, mut prompts): (Vec<usize>, Vec<Vec<i32>>) = (Vec::new(), Vec::new());
        for s in 0..STREAMS {
            let max = 1 + rng.below(8) as u32;
            assert_eq!(set_speculation(&e, s as u32, &lookup(max)), Status::Ok);
            caps.push(max as usize + 1);
            // Some streams start from the same prompt, so the cache shares their pages.
            let p = if s > 0 && rng.below(3) == 0 { prompts[0].clone() } else { repeating_prompt(&mut rng, cfg.vocab) };
            prompts.push(p);
        }
        let mut streams = RandomStreams::new(prompts, caps);
        for round in 0..60 {
            let what = format!("cache {cached}, round {round}");
            streams.step(&e, &reference, &mut rng, 2, WINDOW as usize, &what);
            shared::check_pool(&e, &streams.lens(), total, PAGE, &what);
        }
        let stats: Vec<(u64, u64)> = (0..STREAMS as u32).map(|s| spec_stats(&e, s)).collect();
        println!("cache {cached}: proposed, accepted per stream {stats:?}");
        assert!(stats.iter().any(|&(p, a)| a > 0 && a < p), "{stats:?}");
    }
}

/// Speculative sampling keeps the target's distribution: over many seeds, the two tokens a step after
/// a repeated prompt produces (an accepted or resampled proposal, then the next) are distributed as
/// plain sampling's (chi-square at p > 0.001), and, the draw being seeded by position, are the same tokens.
#[test]
fn sampled_tokens_keep_the_distribution() {
    let _g = serial();
    let mut rng = Rng::fresh("sampled_tokens_keep_the_distribution");
    let dir = Scratch::new("spec-sampling");
    let mut cfg = tiny(Arch::Llama);
    cfg.vocab = 32;
    let path = model(&dir, &cfg, &mut rng, DType::F32);
    // The draw is seeded by (seed, stream, position): both engines step stream 1.
    let plain = init(&path, &cpu_options(128, 2));
    let e = init(&path, &cpu_options(128, 2));
    let line = rng.ids(cfg.vocab, 5);
    let prompt: Vec<i32> = line.iter().chain(&line).chain(&line[..3]).copied().collect();
    let n = prompt.len() - 1;
    common::step(&e, 0, &prompt[..n]);
    common::step(&plain, 0, &prompt[..n]);
    let last = &prompt[n..];
    const DRAWS: u64 = 20_000;
    let vocab = cfg.vocab;
    let (mut plain_counts, mut spec_counts) = (vec![0u64; vocab], vec![0u64; vocab]);
    let (mut mismatched, mut proposed, mut accepted) = (0, 0, 0);
    for seed in 0..DRAWS {
        let s = engine_sampling {
            temperature: 1.3,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed,
            ..ffi::engine_default_sampling()
        };
        // Plain: the first sampled token.
        assert_eq!(fork(&plain, 0, 1, n), Status::Ok, "{}", last_error());
        set_sampling(&plain, 1, &s);
        let (_, p) = batch(&plain, &[Item { stream: 1, tokens: last, cap: 0 }]);
        // Speculative: the first token out (a proposal kept, or the target's own after a rejection).
        // Set again each draw, so that no pause after rejections skips the proposal.
        assert_eq!(fork(&e, 0, 1, n), Status::Ok, "{}", last_error());
        set_sampling(&e, 1, &s);
        assert_eq!(set_speculation(&e, 1, &lookup(2)), Status::Ok);
        let (_, q) = batch(&e, &[Item { stream: 1, tokens: last, cap: 3 }]);
        let (pr, ac) = spec_stats(&e, 1);
        (proposed, accepted) = (proposed + pr, accepted + ac);
        let (p, q) = (p[0].2[0] as usize, q[0].2[0] as usize);
        plain_counts[p] += 1;
        spec_counts[q] += 1;
        mismatched += (p != q) as u32;
    }
    println!("proposed {proposed}, accepted {accepted}; plain {plain_counts:?}; speculative {spec_counts:?}");
    assert!(proposed >= DRAWS && accepted > 0 && accepted < proposed, "the lookup proposed and was tested");
    // Two-sample chi-square over the tokens drawn at least 5 times in all.
    let (mut chi2, mut df) = (0.0f64, -1i64);
    for t in 0..vocab {
        let (a, b) = (plain_counts[t] as f64, spec_counts[t] as f64);
        if a + b >= 5.0 {
            chi2 += (a - b).powi(2) / (a + b);
            df += 1;
        }
    }
    // The 0.999 quantile of chi-square with df degrees of freedom (Wilson-Hilferty).
    let z = 3.090232;
    let d = df.max(1) as f64;
    let bound = d * (1.0 - 2.0 / (9.0 * d) + z * (2.0 / (9.0 * d)).sqrt()).powi(3);
    assert!(chi2 < bound, "chi-square {chi2} over {df} degrees of freedom, bound {bound}");
    assert_eq!(mismatched, 0, "the seeded draw gives the plain tokens");
}

#[test]
fn bad_input_is_refused() {
    let _g = serial();
    let mut rng = Rng::fresh("bad_input_is_refused");
    let dir = Scratch::new("spec-bad");
    let cfg = tiny(Arch::Llama);
    let path = model(&dir, &cfg, &mut rng, DType::Q8_0);
    let e = init(&path, &cpu_options(64, 2));
    let d = ffi::engine_default_speculation();
    assert_eq!((d.draft, d.max_tokens, d.ngram_min, d.ngram_max), (engine_draft::None, 8, 2, 4));

    // Settings out of range, and streams the engine does not have.
    assert_eq!(set_speculation(&e, 2, &lookup(4)), Status::OutOfRange);
    assert!(last_error().contains("stream 2"), "{}", last_error());
    let (mut p, mut a) = (0, 0);
    // SAFETY: a live engine and two writable counts.
    assert_eq!(unsafe { ffi::engine_speculation_stats(e.0, 9, &mut p, &mut a) }, Status::OutOfRange);
    // SAFETY: a live engine; the NULL settings are refused before use.
    assert_eq!(unsafe { ffi::engine_set_speculation(e.0, 0, std::ptr::null()) }, Status::InvalidArgument);
    for bad in [lookup(0), lookup(ENGINE_SPECULATION_MAX_TOKENS + 1), engine_speculation { ngram_min: 4, ..lookup(2) }]
    {
        assert_eq!(set_speculation(&e, 0, &bad), Status::InvalidArgument, "{bad:?}");
    }
    assert_eq!(
        set_speculation(&e, 0, &engine_speculation { draft: engine_draft::Model, ..lookup(4) }),
        Status::Unsupported
    );
    let mut raw = [7u32, 4, 1, 3];
    // SAFETY: `raw` is four u32 laid out as engine_speculation (draft, max_tokens, ngram_min, ngram_max), 4-byte
    // aligned; ffi reads the draft value raw before it treats it as an enum.
    let st = unsafe { ffi::engine_set_speculation(e.0, 0, raw.as_mut_ptr() as *const engine_speculation) };
    assert_eq!(st, Status::InvalidArgument, "draft 7");
    assert!(last_error().contains("engine_draft"), "{}", last_error());

    // out_cap below max_tokens + 1: the call is refused, nothing stepped (the other item neither).
    assert_eq!(set_speculation(&e, 0, &lookup(4)), Status::Ok);
    let prompt: Vec<i32> = [3, 4, 5, 6].repeat(4);
    let (st, res) =
        batch(&e, &[Item { stream: 1, tokens: &prompt, cap: 0 }, Item { stream: 0, tokens: &prompt, cap: 4 }]);
    assert_eq!(st, Status::InvalidArgument);
    assert!(last_error().contains("out_cap"), "{}", last_error());
    assert!(res.iter().all(|r| r.0 == Status::InvalidArgument && r.1 == -1));
    assert_eq!((stream_len(&e, 0), stream_len(&e, 1)), (0, 0));
    // Without speculation any room will do.
    let (st, res) = batch(&e, &[Item { stream: 1, tokens: &prompt, cap: 1 }]);
    assert_eq!((st, res[0].0, res[0].2.len()), (Status::Ok, Status::Ok, 1));

    // At the window's end a stream proposes fewer, and never passes the window.
    let (st, _) = batch(&e, &[Item { stream: 0, tokens: &prompt[..], cap: 5 }]);
    assert_eq!(st, Status::Ok);
    let mut next = vec![prompt[0]];
    loop {
        let len = stream_len(&e, 0) as usize;
        let (st, res) = batch(&e, &[Item { stream: 0, tokens: &next, cap: 5 }]);
        assert_eq!(st, Status::Ok);
        if res[0].0 == Status::NoRoom {
            assert_eq!(len, 64, "refused only with the window full");
            break;
        }
        assert_eq!(res[0].0, Status::Ok, "{}", last_error());
        let now = stream_len(&e, 0) as usize;
        assert_eq!(now, len + res[0].2.len(), "the stream holds its input and the accepted proposals");
        assert!(now <= 64);
        next = vec![res[0].1];
    }
    let lens = [64, stream_len(&e, 1) as usize];
    shared::check_pool(&e, &lens, shared::kv_usage(&e).tokens_total, PAGE, "at the window's end");

    // ENGINE_DRAFT_MODEL needs a drafter loaded (tests/speculative_drafter.rs loads one).
    assert_eq!(set_speculation(&e, 1, &common::spec::drafted(4)), Status::Unsupported);
    assert!(last_error().contains("drafter"), "{}", last_error());
    let _ = engine::default_options();
}
