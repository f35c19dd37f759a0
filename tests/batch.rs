//! Many streams at once through the C ABI on the CPU backend: engine_step_batch against stepping each
//! stream alone (random mixes of prompt chunks and single tokens, streams joining, leaving, truncated
//! and reset mid-way, each with its own sampler), engine_truncate, the KV page pool running out and
//! coming back whole (engine_kv_stats), per-stream sampling with min-p and the repetition penalty, 64
//! single-token items in one call, threads truncating, resetting and re-sampling their own streams on
//! one engine, and the calls' refusals.

mod common;
use common::{Held, Rng, Scratch, bits, info, init, logits, serial, stats, step, try_step};
use common::{Mix, batches_match_stepping_alone, cpu_options, random_sampling};
use common::{kv_stats, on_threads, reset, room_for_tokens, set_sampling, stream_len, truncate, try_batch};

use hostembed::Status;
use hostembed::abi::{engine_batch_item, engine_sampling};
use hostembed::engine::{self, engine_options};
use hostembed::ffi;
use hostembed::model::{Arch, ModelConfig, RopeScaling};
use hostembed::placement::engine_memory;
use hostembed::sampler::{self, Sampling};
use hostembed::status::last_error;
use hostembed::tensor::DType;
use std::path::PathBuf;

/// Positions in one page of the CPU backend's pool.
const PAGE: u64 = hostembed::cpu::PAGE_TOKENS as u64;

/// A small Qwen2 (biases, GQA 2:1, a tied head): every op of the layer runs.
fn qwen2() -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen2,
        vocab: 301,
        hidden: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        intermediate: 96,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 512,
        tied: true,
        qkv_bias: true,
        qk_norm: false,
        attention: Default::default(),
        bos: Some(1),
        eos: Some(2),
        moe: None,
    }
}

fn model(dir: &Scratch, rng: &mut Rng) -> PathBuf {
    dir.hf("qwen2", &qwen2(), rng.next_u64(), DType::Bf16)
}

fn random_ids(rng: &mut Rng, n: usize) -> Vec<i32> {
    rng.ids(qwen2().vocab, n)
}

/// Random batches on one engine and the same steps one stream at a time on another: every item's
/// status, token and logits are the same, bit for bit, while streams join, leave, are truncated and reset
/// between batches; the pool's free count follows the streams' lengths and is whole after the resets.
#[test]
fn random_batches_match_stepping_each_stream_alone() {
    let _g = serial();
    let mut rng = Rng::fresh("random_batches_match_stepping_each_stream_alone");
    let dir = Scratch::new("batch-random");
    let path = model(&dir, &mut rng);
    let (window, streams) = (150u32, 7u32);
    let opts = cpu_options(window, streams);
    let batched = init(&path, &opts);
    let alone = init(&path, &opts);
    assert_eq!(info(&batched).streams, streams);
    let (total, free) = kv_stats(&batched);
    assert_eq!((total, free), (streams as u64 * (window as u64).div_ceil(PAGE) * PAGE, total));
    let mix = Mix { rounds: 60, widest: streams, chunk: 12, long_chunk: 90 };
    let counts = batches_match_stepping_alone("qwen2 bf16", &batched, &alone, &mut rng, &mix, PAGE);
    assert!(counts.items > 100 && counts.singles_beside_others > 50, "too few items to mean anything: {counts:?}");
    drop((batched, alone));
    assert_eq!(stats(), engine_memory::default());
}

/// Truncating to any length and stepping the same tokens again gives the same logits, bit for bit, and
/// gives back exactly the pages past the new length.
#[test]
fn truncate_then_restep_gives_the_same_logits() {
    let _g = serial();
    let mut rng = Rng::fresh("truncate_then_restep_gives_the_same_logits");
    let dir = Scratch::new("batch-truncate");
    let path = model(&dir, &mut rng);
    let e = init(&path, &cpu_options(256, 2));
    let (total, _) = kv_stats(&e);
    let prompt = random_ids(&mut rng, 70);
    let mut fed = prompt.clone();
    let mut want = vec![(fed.len(), step(&e, 0, &prompt), logits(&e, 0))];
    for _ in 0..30 {
        let next = want.last().unwrap().1;
        fed.push(next);
        want.push((fed.len(), step(&e, 0, &[next]), logits(&e, 0)));
    }
    for keep in [99u32, 64, 63, 33, 32, 31, 5, 1, 0] {
        let before = stream_len(&e, 0) as u64;
        truncate(&e, 0, keep);
        assert_eq!(stream_len(&e, 0), keep);
        assert_eq!(kv_stats(&e), (total, total - (keep as u64).div_ceil(PAGE) * PAGE), "kept {keep}");
        assert!(before >= keep as u64);
        // The logits are gone with the positions.
        let mut out = vec![0f32; qwen2().vocab];
        // SAFETY: a live engine and a buffer of out.len() floats to write.
        assert_eq!(unsafe { ffi::engine_logits(e.0, 0, out.as_mut_ptr(), out.len()) }, Status::InvalidArgument);
        // Feed back what was fed after `keep`, one chunk then single tokens, and check each logit met.
        let keep = keep as usize;
        let split = (keep + 7).min(fed.len());
        if keep < split {
            let got = step(&e, 0, &fed[keep..split]);
            if let Some((_, next, l)) = want.iter().find(|(n, _, _)| *n == split) {
                assert_eq!(got, *next, "kept {keep}: token after {split}");
                assert_eq!(bits(&logits(&e, 0)), bits(l), "kept {keep}: logits after {split}");
            }
        }
        for at in split..fed.len() {
            let got = step(&e, 0, &fed[at..at + 1]);
            if let Some((_, next, l)) = want.iter().find(|(n, _, _)| *n == at + 1) {
                assert_eq!(got, *next, "kept {keep}: token after {}", at + 1);
                assert_eq!(bits(&logits(&e, 0)), bits(l), "kept {keep}: logits after {}", at + 1);
            }
        }
        assert_eq!(stream_len(&e, 0) as usize, fed.len());
    }
    // Truncating to the length it has changes nothing; past it, or on a stream that does not exist, fails.
    let len = stream_len(&e, 0);
    truncate(&e, 0, len);
    assert_eq!(bits(&logits(&e, 0)), bits(&want.last().unwrap().2), "logits after a truncate that cut nothing");
    // SAFETY: a live engine; a length past the stream's is refused before anything changes.
    assert_eq!(unsafe { ffi::engine_truncate(e.0, 0, len + 1) }, Status::OutOfRange);
    // SAFETY: a live engine; truncating an empty stream is refused before anything changes.
    assert_eq!(unsafe { ffi::engine_truncate(e.0, 1, 1) }, Status::OutOfRange, "an empty stream");
    // SAFETY: a live engine; a stream past its streams is refused before anything changes.
    assert_eq!(unsafe { ffi::engine_truncate(e.0, 2, 0) }, Status::OutOfRange, "no stream 2");
    // SAFETY: a NULL engine is refused before anything is read.
    assert_eq!(unsafe { ffi::engine_truncate(std::ptr::null_mut(), 0, 0) }, Status::InvalidArgument);
    assert_eq!(stream_len(&e, 0), len);
}

/// The pool takes the room the plan leaves, not only the full windows that fit in it: room for two and a
/// half windows is a pool of two and a half windows that eight streams share, two of them whole windows.
#[test]
fn the_pool_takes_the_room_the_plan_leaves() {
    let _g = serial();
    let mut rng = Rng::fresh("the_pool_takes_the_room_the_plan_leaves");
    let dir = Scratch::new("batch-pool-room");
    let path = model(&dir, &mut rng);
    let window = 128u32;
    let tokens = 5 * window as u64 / 2;
    let opts = engine_options { room_bytes: room_for_tokens(&qwen2(), window, 8, tokens), ..cpu_options(window, 8) };
    let e = init(&path, &opts);
    assert_eq!(info(&e).streams, 8);
    assert_eq!(kv_stats(&e), (tokens, tokens), "a pool of the room's {tokens} positions");
    let reference = init(&path, &cpu_options(window, 8));
    let (a, b, c) = (
        random_ids(&mut rng, window as usize),
        random_ids(&mut rng, window as usize),
        random_ids(&mut rng, window as usize / 2),
    );
    let (st, out) = try_batch(&e, &[(0, &a), (1, &b), (2, &c)]);
    assert_eq!(st, Status::Ok, "{}", last_error());
    let want = [step(&reference, 0, &a), step(&reference, 1, &b), step(&reference, 2, &c)];
    assert_eq!(out, want.map(|t| (Status::Ok, t)), "{}", last_error());
    assert_eq!(kv_stats(&e), (tokens, 0), "two whole windows and a half one fill it");
    let (st, out) = try_batch(&e, &[(3, &a[..1])]);
    assert_eq!((st, out[0]), (Status::Ok, (Status::NoRoom, -1)));
    reset(&e, 0);
    assert_eq!(kv_stats(&e), (tokens, window as u64));
}

/// A pool of two windows shared by eight streams: an item that needs a page when none is free fails with
/// NO_ROOM and appends nothing while the others in its batch proceed; truncate and reset give pages back,
/// and the pool is whole after the resets.
#[test]
fn pool_exhaustion_fails_only_the_item_that_needs_a_page() {
    let _g = serial();
    let mut rng = Rng::fresh("pool_exhaustion_fails_only_the_item_that_needs_a_page");
    let dir = Scratch::new("batch-pool");
    let path = model(&dir, &mut rng);
    let window = 128u32;
    let opts = engine_options {
        room_bytes: room_for_tokens(&qwen2(), window, 8, 2 * window as u64),
        ..cpu_options(window, 8)
    };
    let e = init(&path, &opts);
    let reference = init(&path, &cpu_options(window, 8));
    assert_eq!(info(&e).streams, 8, "max_streams bounds the streams, not the full windows");
    let (total, free) = kv_stats(&e);
    assert_eq!((total, free), (2 * window as u64, 2 * window as u64), "a pool of two windows");

    // Streams 0 and 1 take 100 positions each: 4 pages each, every page of the pool.
    let (p0, p1, p2) = (random_ids(&mut rng, 100), random_ids(&mut rng, 100), random_ids(&mut rng, 20));
    let (st, out) = try_batch(&e, &[(0, &p0), (1, &p1)]);
    assert_eq!(st, Status::Ok);
    assert_eq!(out, [(Status::Ok, step(&reference, 0, &p0)), (Status::Ok, step(&reference, 1, &p1))]);
    assert_eq!(kv_stats(&e), (total, 0));

    // Stream 0's next token fits its last page; stream 2 needs a page and there is none.
    let first0 = out[0].1;
    let (st, out) = try_batch(&e, &[(2, &p2), (0, &[first0])]);
    assert_eq!(st, Status::Ok, "a full pool fails the item, not the call");
    assert_eq!(out[0], (Status::NoRoom, -1), "stream 2: {}", last_error());
    assert!(last_error().contains("pages"), "{}", last_error());
    assert_eq!(out[1].0, Status::Ok);
    assert_eq!(out[1].1, step(&reference, 0, &[first0]), "stream 0 proceeds");
    assert_eq!(bits(&logits(&e, 0)), bits(&logits(&reference, 0)));
    assert_eq!(stream_len(&e, 2), 0, "the refused item appended nothing");
    assert_eq!(try_step(&e, 2, &p2[..1]).0, Status::NoRoom);
    // Stream 1 crossing into a fifth page fails too; its length stays 100.
    let (st, out) = try_batch(&e, &[(1, &random_ids(&mut rng, 40))]);
    assert_eq!((st, out[0]), (Status::Ok, (Status::NoRoom, -1)));
    assert_eq!(stream_len(&e, 1), 100);

    // Truncating stream 0 to 60 positions gives back 2 pages: stream 2 fits in them.
    truncate(&e, 0, 60);
    assert_eq!(kv_stats(&e), (total, 2 * PAGE));
    let mut reference2 = step(&reference, 2, &p2);
    let (st, out) = try_batch(&e, &[(2, &p2)]);
    assert_eq!((st, out[0]), (Status::Ok, (Status::Ok, reference2)));
    assert_eq!(bits(&logits(&e, 2)), bits(&logits(&reference, 2)), "stream 2's logits from a recycled page");
    for _ in 0..5 {
        let (st, out) = try_batch(&e, &[(2, &[reference2])]);
        assert_eq!(st, Status::Ok);
        let want = step(&reference, 2, &[reference2]);
        assert_eq!(out[0], (Status::Ok, want));
        reference2 = want;
    }
    for s in 0..8 {
        reset(&e, s);
    }
    assert_eq!(kv_stats(&e), (total, total), "whole again after the resets");
    // And it serves the same two windows again.
    let (st, out) = try_batch(&e, &[(5, &p0), (7, &p1)]);
    assert_eq!((st, out[0].0, out[1].0), (Status::Ok, Status::Ok, Status::Ok));
}

/// Malformed calls (NULLs, a stream named twice) step nothing and say INVALID_ARGUMENT; items that are
/// wrong on their own fail alone; the other new calls refuse NULLs and bad settings.
#[test]
fn malformed_batches_and_bad_arguments_are_refused() {
    let _g = serial();
    let mut rng = Rng::fresh("malformed_batches_and_bad_arguments_are_refused");
    let dir = Scratch::new("batch-refusals");
    let path = model(&dir, &mut rng);
    let window = 32u32;
    let e = init(&path, &cpu_options(window, 3));
    let reference = init(&path, &cpu_options(window, 3));
    let prompt = random_ids(&mut rng, 6);
    let vocab = qwen2().vocab as i32;

    // A stream named twice: nothing steps, every item says INVALID_ARGUMENT.
    let (st, out) = try_batch(&e, &[(0, &prompt), (1, &prompt), (0, &prompt[..1])]);
    assert_eq!(st, Status::InvalidArgument);
    assert!(last_error().contains("stream 0"), "{}", last_error());
    assert!(out.iter().all(|&o| o == (Status::InvalidArgument, -1)), "{out:?}");
    assert_eq!((stream_len(&e, 0), stream_len(&e, 1)), (0, 0), "nothing appended");

    // NULL items with items to read, NULL tokens with tokens to read, a NULL engine.
    let mut item = engine_batch_item {
        stream: 0,
        tokens: std::ptr::null(),
        n: 2,
        next: -7,
        status: Status::Ok,
        out: std::ptr::null_mut(),
        out_cap: 0,
        n_out: 0,
    };
    // SAFETY: a live engine and one item whose NULL tokens pointer is refused before it is read.
    assert_eq!(unsafe { ffi::engine_step_batch(e.0, &mut item, 1) }, Status::InvalidArgument);
    assert_eq!((item.status, item.next), (Status::InvalidArgument, -1));
    // SAFETY: a live engine; NULL items with a count of 2 are refused before anything is read.
    assert_eq!(unsafe { ffi::engine_step_batch(e.0, std::ptr::null_mut(), 2) }, Status::InvalidArgument);
    // SAFETY: a live engine; NULL items with a count of 0 are never read.
    assert_eq!(unsafe { ffi::engine_step_batch(e.0, std::ptr::null_mut(), 0) }, Status::Ok, "an empty batch");
    let mut fine = engine_batch_item {
        stream: 0,
        tokens: prompt.as_ptr(),
        n: 1,
        next: -7,
        status: Status::Ok,
        out: std::ptr::null_mut(),
        out_cap: 0,
        n_out: 0,
    };
    // SAFETY: a NULL engine is refused before the live item is read.
    assert_eq!(unsafe { ffi::engine_step_batch(std::ptr::null_mut(), &mut fine, 1) }, Status::InvalidArgument);
    assert_eq!(stream_len(&e, 0), 0);

    // Items wrong on their own fail alone: no tokens, a stream that does not exist, an id outside the
    // vocabulary, past the window. The good item steps as it does alone.
    let past_window = random_ids(&mut rng, window as usize + 1);
    let bad_id = [3, vocab, 4];
    let (st, out) = try_batch(&e, &[(1, &[]), (7, &prompt), (2, &bad_id), (0, &prompt), (u32::MAX, &prompt)]);
    assert_eq!(st, Status::Ok, "{}", last_error());
    assert_eq!(out[0], (Status::InvalidArgument, -1));
    assert_eq!(out[1], (Status::OutOfRange, -1));
    assert_eq!(out[2], (Status::OutOfRange, -1));
    assert_eq!(out[3], (Status::Ok, step(&reference, 0, &prompt)));
    assert_eq!(out[4], (Status::OutOfRange, -1));
    assert!(last_error().contains("items[0]"), "the first failed item's message: {}", last_error());
    let (st, out) = try_batch(&e, &[(1, &past_window)]);
    assert_eq!((st, out[0]), (Status::Ok, (Status::NoRoom, -1)));
    assert_eq!((stream_len(&e, 1), stream_len(&e, 2)), (0, 0));
    assert_eq!(bits(&logits(&e, 0)), bits(&logits(&reference, 0)));

    // engine_logits answers for every stream the last batch stepped, and for no other.
    let (a, b) = (random_ids(&mut rng, 3), random_ids(&mut rng, 1));
    let (st, out) = try_batch(&e, &[(2, &a), (1, &b)]);
    assert_eq!((st, out[0].0, out[1].0), (Status::Ok, Status::Ok, Status::Ok));
    step(&reference, 2, &a);
    let logits2 = logits(&reference, 2);
    assert_eq!(bits(&logits(&e, 2)), bits(&logits2));
    step(&reference, 1, &b);
    assert_eq!(bits(&logits(&e, 1)), bits(&logits(&reference, 1)));
    let mut out = vec![0f32; vocab as usize];
    // SAFETY: a live engine and a buffer of out.len() floats to write.
    assert_eq!(unsafe { ffi::engine_logits(e.0, 0, out.as_mut_ptr(), out.len()) }, Status::InvalidArgument);
    // A batch in which every item fails leaves them.
    let (st, _) = try_batch(&e, &[(0, &past_window)]);
    assert_eq!(st, Status::Ok);
    assert_eq!(bits(&logits(&e, 2)), bits(&logits2));

    // The other calls: NULLs, streams that do not exist, settings out of range.
    let mut len = 0u32;
    let (mut total, mut free) = (0u64, 0u64);
    // SAFETY: a live engine; the NULL out pointer is refused before anything is written.
    assert_eq!(unsafe { ffi::engine_stream_len(e.0, 0, std::ptr::null_mut()) }, Status::InvalidArgument);
    // SAFETY: a NULL engine is refused before `len` is written.
    assert_eq!(unsafe { ffi::engine_stream_len(std::ptr::null(), 0, &mut len) }, Status::InvalidArgument);
    // SAFETY: a live engine and a writable u32; stream 3 is refused.
    assert_eq!(unsafe { ffi::engine_stream_len(e.0, 3, &mut len) }, Status::OutOfRange);
    // SAFETY: a live engine; the NULL total is refused before `free` is written.
    assert_eq!(unsafe { ffi::engine_kv_stats(e.0, std::ptr::null_mut(), &mut free) }, Status::InvalidArgument);
    // SAFETY: a live engine; the NULL free is refused before `total` is written.
    assert_eq!(unsafe { ffi::engine_kv_stats(e.0, &mut total, std::ptr::null_mut()) }, Status::InvalidArgument);
    // SAFETY: a NULL engine is refused before the counters are written.
    assert_eq!(unsafe { ffi::engine_kv_stats(std::ptr::null(), &mut total, &mut free) }, Status::InvalidArgument);
    let good = ffi::engine_default_sampling();
    // SAFETY: a live engine; the NULL settings are refused before anything is read.
    assert_eq!(unsafe { ffi::engine_set_sampling(e.0, 0, std::ptr::null()) }, Status::InvalidArgument);
    // SAFETY: a NULL engine is refused before the settings are read.
    assert_eq!(unsafe { ffi::engine_set_sampling(std::ptr::null_mut(), 0, &good) }, Status::InvalidArgument);
    // SAFETY: a live engine and live settings; stream 3 is refused.
    assert_eq!(unsafe { ffi::engine_set_sampling(e.0, 3, &good) }, Status::OutOfRange);
    let bad = [
        engine_sampling { temperature: -1.0, ..good },
        engine_sampling { temperature: f32::NAN, ..good },
        engine_sampling { top_p: 0.0, ..good },
        engine_sampling { top_p: 1.5, ..good },
        engine_sampling { min_p: -0.1, ..good },
        engine_sampling { min_p: 1.1, ..good },
        engine_sampling { min_p: f32::NAN, ..good },
        engine_sampling { repeat_penalty: 0.0, ..good },
        engine_sampling { repeat_penalty: f32::INFINITY, ..good },
    ];
    for s in &bad {
        // SAFETY: a live engine and live settings, which are refused.
        assert_eq!(unsafe { ffi::engine_set_sampling(e.0, 0, s) }, Status::InvalidArgument, "{s:?}");
    }
    let mut got = engine_sampling { seed: 9, ..good };
    // SAFETY: a live engine and a writable engine_sampling.
    assert_eq!(unsafe { ffi::engine_get_sampling(e.0, 0, &mut got) }, Status::Ok);
    assert_eq!(got, good, "refused settings leave the stream's as they were");
    let mine = engine_sampling { temperature: 0.7, min_p: 0.1, repeat_penalty: 1.2, seed: 5, ..good };
    set_sampling(&e, 1, &mine);
    // SAFETY: a live engine and a writable engine_sampling.
    assert_eq!(unsafe { ffi::engine_get_sampling(e.0, 1, &mut got) }, Status::Ok);
    assert_eq!(got, mine);
    reset(&e, 1);
    // SAFETY: a live engine and a writable engine_sampling.
    assert_eq!(unsafe { ffi::engine_get_sampling(e.0, 1, &mut got) }, Status::Ok);
    assert_eq!(got, mine, "a reset keeps the stream's sampler");
    // SAFETY: a live engine; the NULL out pointer is refused before anything is written.
    assert_eq!(unsafe { ffi::engine_get_sampling(e.0, 1, std::ptr::null_mut()) }, Status::InvalidArgument);
    let opts = engine_options { min_p: 2.0, ..cpu_options(window, 3) };
    let mut none = std::ptr::null_mut();
    let c = common::c_path(&path);
    // SAFETY: a NUL-terminated path, live options and a writable handle (left NULL on failure).
    assert_eq!(unsafe { ffi::engine_init_fit(c.as_ptr(), &opts, &mut none) }, Status::InvalidArgument);
    assert!(last_error().contains("options.min_p"), "{}", last_error());
}

/// Each stream samples with its own settings, from the engine options' by default: the token is what
/// `sampler::sample_stream` picks from the stream's logits and its own tokens (the penalty looking at
/// the prompt and what was sampled), and streams with other settings in the same batch change nothing.
#[test]
fn each_stream_samples_with_its_own_settings() {
    let _g = serial();
    let mut rng = Rng::fresh("each_stream_samples_with_its_own_settings");
    let dir = Scratch::new("batch-sampling");
    let path = model(&dir, &mut rng);
    let defaults = engine_options {
        temperature: 0.9,
        top_k: 50,
        min_p: 0.05,
        repeat_penalty: 1.5,
        repeat_last_n: 16,
        seed: 77,
        ..cpu_options(256, 4)
    };
    let e = init(&path, &defaults);
    let mut got = ffi::engine_default_sampling();
    // SAFETY: a live engine and a writable engine_sampling.
    assert_eq!(unsafe { ffi::engine_get_sampling(e.0, 3, &mut got) }, Status::Ok);
    assert_eq!(got, engine::sampling_of(&defaults), "a stream starts with the options' sampler");
    let settings: [Sampling; 4] = [
        engine::sampling_of(&defaults),
        Sampling { repeat_penalty: 50.0, repeat_last_n: 1000, ..Sampling::GREEDY },
        Sampling { temperature: 1.3, min_p: 0.2, seed: 3, ..Sampling::GREEDY },
        Sampling { temperature: 1.0, min_p: 1.0, repeat_penalty: 0.5, repeat_last_n: 8, ..Sampling::GREEDY },
    ];
    for (s, sampling) in settings.iter().enumerate().skip(1) {
        set_sampling(&e, s as u32, sampling);
    }
    let mut history: Vec<Vec<u32>> = vec![Vec::new(); 4];
    // Stream 1's prompt holds many of the ids, so its penalty often takes the likeliest one away.
    let mut feed: Vec<Vec<i32>> = (0..4).map(|s| random_ids(&mut rng, if s == 1 { 150 } else { 10 })).collect();
    let mut penalized_changes = 0;
    for round in 0..25 {
        let items: Vec<(u32, &[i32])> = (0..4u32).map(|s| (s, feed[s as usize].as_slice())).collect();
        let (st, out) = try_batch(&e, &items);
        assert_eq!(st, Status::Ok, "{}", last_error());
        for s in 0..4usize {
            assert_eq!(out[s].0, Status::Ok);
            let new: Vec<u32> = feed[s].iter().map(|&t| t as u32).collect();
            let l = logits(&e, s as u32);
            let want = sampler::sample_stream(&l, &settings[s], s as u32, &history[s], &new);
            assert_eq!(out[s].1 as u32, want, "round {round} stream {s}");
            let position = (history[s].len() + new.len()) as u64;
            if sampler::sample(&l, &settings[s], s as u32, position) != want {
                penalized_changes += 1;
            }
            if s == 1 {
                // Greedy on the penalized logits: the largest of them.
                let ids = sampler::penalty_ids(&history[s], &new, &settings[s]);
                let mut p = l.clone();
                ids.iter().for_each(|&i| p[i as usize] = sampler::penalize(p[i as usize], 50.0));
                assert_eq!(want, sampler::argmax(&p));
            }
            if s == 3 {
                // min_p 1 keeps only the likeliest (penalized) token.
                let ids = sampler::penalty_ids(&history[s], &new, &settings[s]);
                let mut p = l.clone();
                ids.iter().for_each(|&i| p[i as usize] = sampler::penalize(p[i as usize], 0.5));
                assert_eq!(want, sampler::argmax(&p), "round {round}: min_p 1 is greedy");
            }
            history[s].extend(&new);
            feed[s] = vec![out[s].1];
        }
    }
    println!("the penalty changed {penalized_changes} of 100 picks");
    assert!(penalized_changes >= 5, "the repetition penalty changed only {penalized_changes} picks");
}

/// Threads stepping their own streams through engine_step_batch at once get what a serial run gets.
#[test]
fn concurrent_batches_match_a_serial_run() {
    let _g = serial();
    let mut rng = Rng::fresh("concurrent_batches_match_a_serial_run");
    let dir = Scratch::new("batch-threads");
    let path = model(&dir, &mut rng);
    let opts = cpu_options(64, 8);
    let shared = init(&path, &opts);
    let serial_engine = init(&path, &opts);
    let prompts: Vec<Vec<i32>> = (0..8).map(|_| random_ids(&mut rng, 5)).collect();
    let run = |e: &Held, pair: u32, prompts: &[Vec<i32>]| -> Vec<i32> {
        let (a, b) = (2 * pair, 2 * pair + 1);
        let (mut ta, mut tb) = (prompts[a as usize].clone(), prompts[b as usize].clone());
        let mut out = Vec::new();
        for _ in 0..12 {
            let (st, items) = try_batch(e, &[(a, &ta), (b, &tb)]);
            assert_eq!(st, Status::Ok);
            assert!(items.iter().all(|i| i.0 == Status::Ok), "{items:?}: {}", last_error());
            out.extend([items[0].1, items[1].1]);
            (ta, tb) = (vec![items[0].1], vec![items[1].1]);
        }
        out
    };
    let want: Vec<Vec<i32>> = (0..4).map(|p| run(&serial_engine, p, &prompts)).collect();
    assert_eq!(on_threads(&shared, 4, |e, p| run(e, p, &prompts)), want);
}

/// Sixty-four single-token items in one call (the "up to 63 others"), and random subsets of them,
/// give each stream the token and the logits bits of stepping it alone, whatever else is in the batch.
#[test]
fn sixty_four_single_token_items_are_batch_invariant() {
    let _g = serial();
    let mut rng = Rng::fresh("sixty_four_single_token_items_are_batch_invariant");
    let dir = Scratch::new("batch-64");
    let path = model(&dir, &mut rng);
    let (window, streams) = (48u32, 64u32);
    let batched = init(&path, &cpu_options(window, streams));
    let alone = init(&path, &cpu_options(window, streams));
    assert_eq!(info(&batched).streams, streams);
    let mut last: Vec<i32> = Vec::new();
    for s in 0..streams {
        let sampling = random_sampling(&mut rng);
        set_sampling(&batched, s, &sampling);
        set_sampling(&alone, s, &sampling);
        let n = 1 + rng.below(20) as usize;
        let prompt = random_ids(&mut rng, n);
        let t = step(&batched, s, &prompt);
        assert_eq!(step(&alone, s, &prompt), t, "stream {s}'s prompt");
        last.push(t);
    }
    for round in 0..8 {
        // All 64 in a shuffled order on even rounds, a random subset on odd ones.
        let mut order: Vec<u32> = (0..streams).filter(|_| round % 2 == 0 || rng.below(2) == 0).collect();
        rng.shuffle(&mut order);
        let inputs: Vec<(u32, [i32; 1])> = order.iter().map(|&s| (s, [last[s as usize]])).collect();
        let items: Vec<(u32, &[i32])> = inputs.iter().map(|(s, t)| (*s, &t[..])).collect();
        let (st, out) = try_batch(&batched, &items);
        assert_eq!(st, Status::Ok, "round {round}: {}", last_error());
        for (&(s, tokens), &(item_status, next)) in items.iter().zip(&out) {
            assert_eq!(item_status, Status::Ok, "round {round} stream {s}: {}", last_error());
            assert_eq!(next, step(&alone, s, tokens), "round {round} stream {s} of {}: token", items.len());
            assert_eq!(bits(&logits(&batched, s)), bits(&logits(&alone, s)), "round {round} stream {s}: logits");
            last[s as usize] = next;
        }
    }
    drop((batched, alone));
    assert_eq!(stats(), engine_memory::default());
}

/// Threads that each own two streams and, between batches, truncate and re-step them, reset them, give
/// them new samplers and read the pool's figures, all on one engine at once: each thread's tokens are
/// those of the same script run alone, and the pool is whole when every stream is reset.
#[test]
fn concurrent_truncates_resets_and_samplers_match_a_serial_run() {
    let _g = serial();
    let mut rng = Rng::fresh("concurrent_truncates_resets_and_samplers_match_a_serial_run");
    let dir = Scratch::new("batch-threads-edit");
    let path = model(&dir, &mut rng);
    let (window, threads) = (96u32, 4u32);
    let opts = cpu_options(window, 2 * threads);
    let shared = init(&path, &opts);
    let serial_engine = init(&path, &opts);
    let seeds: Vec<u64> = (0..threads).map(|_| rng.next_u64()).collect();
    let (total, _) = kv_stats(&shared);
    // One thread's script over streams 2t and 2t + 1, from its own seed: what it returns is every token
    // it was given and every length it read back.
    let script = |e: &Held, t: u32, seed: u64| -> Vec<i64> {
        let mut r = Rng(seed);
        let pair = [2 * t, 2 * t + 1];
        let mut last = [None::<i32>; 2];
        let mut seen = Vec::new();
        for _ in 0..30 {
            for (k, &s) in pair.iter().enumerate() {
                let len = stream_len(e, s);
                seen.push(len as i64);
                match r.below(8) {
                    0 => {
                        reset(e, s);
                        last[k] = None;
                    }
                    1 if len > 1 => {
                        truncate(e, s, r.below(len as u64) as u32);
                        last[k] = None;
                    }
                    2 => set_sampling(e, s, &random_sampling(&mut r)),
                    _ => {}
                }
                let (all, free) = kv_stats(e);
                assert!(all == total && free <= total, "pool figures {all} / {free} of {total}");
            }
            let inputs: Vec<(u32, Vec<i32>)> = pair
                .iter()
                .zip(&last)
                .map(|(&s, l)| {
                    // A stream near the end of its window starts again.
                    let mut room = window - stream_len(e, s);
                    let mut l = *l;
                    if room < 2 {
                        reset(e, s);
                        (room, l) = (window, None);
                    }
                    match l {
                        Some(tok) => (s, vec![tok]),
                        None => {
                            let n = (1 + r.below(12) as u32).min(room - 1) as usize;
                            (s, random_ids(&mut r, n))
                        }
                    }
                })
                .collect();
            let items: Vec<(u32, &[i32])> = inputs.iter().map(|(s, t)| (*s, t.as_slice())).collect();
            let (st, out) = try_batch(e, &items);
            assert_eq!(st, Status::Ok, "{}", last_error());
            for (k, &(item_status, next)) in out.iter().enumerate() {
                assert_eq!(item_status, Status::Ok, "stream {}: {}", pair[k], last_error());
                seen.push(next as i64);
                last[k] = Some(next);
            }
        }
        seen
    };
    let want: Vec<Vec<i64>> = (0..threads).map(|t| script(&serial_engine, t, seeds[t as usize])).collect();
    assert_eq!(on_threads(&shared, threads, |e, t| script(e, t, seeds[t as usize])), want);
    for s in 0..2 * threads {
        reset(&shared, s);
    }
    assert_eq!(kv_stats(&shared), (total, total), "the pool after every stream's reset");
}

/// Random calls, valid and not (streams that do not exist, empty items, ids outside the vocabulary,
/// prompts past the window or past the pool, truncates past a stream's length, samplers out of range),
/// on an engine whose pool holds three windows for six streams: each call and item answers the status
/// its contract gives, a refused one changes nothing, and after every call each stream holds what the
/// calls that succeeded gave it and the pool's free positions are its total less their whole pages. A
/// twin engine with room for every window replays only what succeeded, one item at a time: the same
/// tokens and the same logits bits.
#[test]
fn random_calls_keep_every_contract() {
    let _g = serial();
    let mut rng = Rng::fresh("random_calls_keep_every_contract");
    let dir = Scratch::new("batch-random-calls");
    let path = model(&dir, &mut rng);
    let (window, streams) = (64u32, 6u32);
    let pool = 3 * window as u64;
    let room = room_for_tokens(&qwen2(), window, streams, pool);
    let e = init(&path, &engine_options { room_bytes: room, ..cpu_options(window, streams) });
    let twin = init(&path, &cpu_options(window, streams));
    assert_eq!(kv_stats(&e), (pool, pool));
    let vocab = qwen2().vocab as i32;
    let pages = |len: u32| (len as u64).div_ceil(PAGE);
    let mut lens = vec![0u32; streams as usize];
    // Items stepped, items refused, other calls done, other calls refused.
    let mut counts = [0usize; 4];
    for call in 0..500 {
        let any_stream = |rng: &mut Rng| {
            if rng.below(8) == 0 { streams + rng.below(3) as u32 } else { rng.below(streams as u64) as u32 }
        };
        match rng.below(10) {
            0..=5 => {
                let n_items = 1 + rng.below(5) as usize;
                let mut chosen: Vec<u32> = Vec::new();
                while chosen.len() < n_items {
                    let s = any_stream(&mut rng);
                    if !chosen.contains(&s) {
                        chosen.push(s);
                    }
                }
                let inputs: Vec<(u32, Vec<i32>)> = chosen
                    .iter()
                    .map(|&s| {
                        let n = match rng.below(10) {
                            0 => 0,
                            1..=5 => 1,
                            6..=8 => 1 + rng.below(20) as usize,
                            _ => 1 + rng.below(window as u64 + 10) as usize,
                        };
                        let mut t = random_ids(&mut rng, n);
                        if n > 0 && rng.below(12) == 0 {
                            let at = rng.below(n as u64) as usize;
                            t[at] =
                                if rng.below(2) == 0 { -1 - rng.below(5) as i32 } else { vocab + rng.below(5) as i32 };
                        }
                        (s, t)
                    })
                    .collect();
                let items: Vec<(u32, &[i32])> = inputs.iter().map(|(s, t)| (*s, t.as_slice())).collect();
                let mut free_pages = kv_stats(&e).1 / PAGE;
                let (st, out) = try_batch(&e, &items);
                assert_eq!(st, Status::Ok, "call {call}: {}", last_error());
                for (&(s, t), &(status, next)) in items.iter().zip(&out) {
                    let what = format!("call {call}: stream {s}, {} tokens", t.len());
                    // In the order the layers check: the stream, no tokens, the stream's room in its
                    // window (before the ids are read), the ids, the pool's pages.
                    let want = if s >= streams {
                        Status::OutOfRange
                    } else if t.is_empty() {
                        Status::InvalidArgument
                    } else if lens[s as usize] + t.len() as u32 > window {
                        Status::NoRoom
                    } else if t.iter().any(|id| !(0..vocab).contains(id)) {
                        Status::OutOfRange
                    } else {
                        let need = pages(lens[s as usize] + t.len() as u32) - pages(lens[s as usize]);
                        if need > free_pages {
                            Status::NoRoom
                        } else {
                            free_pages -= need;
                            Status::Ok
                        }
                    };
                    assert_eq!(status, want, "{what}: {}", last_error());
                    if status != Status::Ok {
                        assert_eq!(next, -1, "{what}: a refused item's next");
                        counts[1] += 1;
                        continue;
                    }
                    lens[s as usize] += t.len() as u32;
                    assert_eq!(next, step(&twin, s, t), "{what}: token");
                    assert_eq!(bits(&logits(&e, s)), bits(&logits(&twin, s)), "{what}: logits");
                    counts[0] += 1;
                }
            }
            6 | 7 => {
                let s = any_stream(&mut rng);
                let have = lens.get(s as usize).copied().unwrap_or(0);
                let keep = rng.below(have as u64 + 4) as u32;
                // SAFETY: a live engine; a stream or length out of range is refused.
                let st = unsafe { ffi::engine_truncate(e.0, s, keep) };
                let ok = s < streams && keep <= have;
                assert_eq!(st, if ok { Status::Ok } else { Status::OutOfRange }, "call {call}: truncate({s}, {keep})");
                if ok {
                    truncate(&twin, s, keep);
                    lens[s as usize] = keep;
                }
                counts[2 + !ok as usize] += 1;
            }
            8 => {
                let s = any_stream(&mut rng);
                // SAFETY: a live engine; a stream out of range is refused.
                let st = unsafe { ffi::engine_reset(e.0, s) };
                assert_eq!(st, if s < streams { Status::Ok } else { Status::OutOfRange }, "call {call}: reset({s})");
                if s < streams {
                    reset(&twin, s);
                    lens[s as usize] = 0;
                }
                counts[2 + (s >= streams) as usize] += 1;
            }
            _ => {
                let s = any_stream(&mut rng);
                let mut sampling = random_sampling(&mut rng);
                let valid = rng.below(4) > 0;
                if !valid {
                    match rng.below(4) {
                        0 => sampling.temperature = -0.5,
                        1 => sampling.top_p = 0.0,
                        2 => sampling.min_p = 1.5,
                        _ => sampling.repeat_penalty = f32::NAN,
                    }
                }
                // SAFETY: a live engine and live settings; a stream or setting out of range is refused.
                let st = unsafe { ffi::engine_set_sampling(e.0, s, &sampling) };
                match (s < streams, valid) {
                    (true, true) => {
                        assert_eq!(st, Status::Ok, "call {call}: {}", last_error());
                        set_sampling(&twin, s, &sampling);
                    }
                    (true, false) => assert_eq!(st, Status::InvalidArgument, "call {call}: {sampling:?}"),
                    (false, true) => assert_eq!(st, Status::OutOfRange, "call {call}: stream {s}"),
                    (false, false) => {
                        assert!(matches!(st, Status::InvalidArgument | Status::OutOfRange), "call {call}: {st:?}")
                    }
                }
                counts[2 + (st != Status::Ok) as usize] += 1;
            }
        }
        for s in 0..streams {
            assert_eq!(stream_len(&e, s), lens[s as usize], "call {call}: stream {s}'s length");
        }
        let held: u64 = lens.iter().map(|&l| pages(l) * PAGE).sum();
        assert_eq!(kv_stats(&e), (pool, pool - held), "call {call}: the pool");
    }
    println!("items stepped / refused, other calls done / refused: {counts:?}");
    assert!(counts.iter().all(|&c| c > 20), "too few of some kind to mean anything: {counts:?}");
    for s in 0..streams {
        reset(&e, s);
    }
    assert_eq!(kv_stats(&e), (pool, pool));
    drop((e, twin));
    assert_eq!(stats(), engine_memory::default());
}
