//! Gemma 3's sliding-window layers in a KV pool of their own on the CPU backend: a stream holds the
//! local layers' pages only as far back as their window reaches (with the engine's margin), truncating
//! or forking further back is refused with nothing changed, and every logit and log-probability is the
//! bits of computing the stream from its tokens in one pool of every layer.

mod common;
use common::gemma3::{Gemma3, gguf_shaped};
use common::shared::{fork, kv_usage, pages, prefix_stats, try_score};
use common::{Held, Rng, Scratch, bits, cpu_options, init, logits, reset, serial, stream_len, try_batch, try_step};

use hostembed::Status;
use hostembed::backend::log_prob;
use hostembed::checkpoint::Checkpoint;
use hostembed::cpu::{self, CpuModel};
use hostembed::ffi;
use hostembed::model::ModelConfig;
use hostembed::status::last_error;
use hostembed::tensor::DType;

/// Positions in one page of the CPU backend's pools.
const PAGE: usize = cpu::PAGE_TOKENS;
/// The local layers' window.
const WINDOW: usize = 9;
/// Positions before a stream's length whose local pages it keeps: the window, the CPU attention's
/// block of 32 positions, and a verification's longest rejection (32 proposals) with the one position
/// a score computes again.
const KEPT: usize = WINDOW + 32 + 33;

/// Seven layers, six of them local over 9 positions.
fn config() -> ModelConfig {
    gguf_shaped(Gemma3::on_cpu(2048), WINDOW)
}

/// Pages held in both pools by a stream of `len` positions after a step: every main page, and the
/// local pages from the first the margin keeps.
fn held_pages(len: usize) -> usize {
    len.div_ceil(PAGE) * 2 - len.saturating_sub(KEPT) / PAGE
}

/// The logits after each of `tokens`, computed from position 0 in a stream of the model's own pages
/// (one pool, every layer).
fn reference(model: &CpuModel<'_>, tokens: &[i32]) -> Vec<Vec<f32>> {
    let ids: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
    model.forward_all(&mut model.new_stream(ids.len()), &ids).unwrap()
}

fn try_truncate(e: &Held, stream: u32, len: usize) -> Status {
    // SAFETY: a live engine; the call takes no pointer.
    unsafe { ffi::engine_truncate(e.0, stream, len as u32) }
}

/// Positions held in both pools, as engine_kv_usage counts them.
fn held(e: &Held) -> usize {
    let u = kv_usage(e);
    (u.tokens_total - u.tokens_free) as usize
}

/// One stream through prompts, chunks and single tokens: the logits of one pool, and the local pages
/// before the margin given back; a truncate or fork reaching before them is INVALID_ARGUMENT naming the
/// window, with nothing changed; within the margin both work; resets give every page back.
#[test]
fn local_layers_keep_only_their_window() {
    let _g = serial();
    let mut rng = Rng::fresh("local_layers_keep_only_their_window");
    let dir = Scratch::new("gemma3-pool");
    let cfg = config();
    let path = dir.gguf("gemma3", &cfg, rng.next_u64(), DType::Q8_0);
    let ckpt = Checkpoint::open(&path).unwrap();
    let model = CpuModel::new(&ckpt).unwrap();
    let e = init(&path, &cpu_options(1536, 3));
    let total = kv_usage(&e).tokens_total;
    // A prompt of more than a piece (512 tokens on the CPU) is stepped in pieces, and so is a score.
    let long = rng.ids(cfg.vocab, 700);
    let (st, got) = try_score(&e, 2, &long);
    assert_eq!(st, Status::Ok, "{}", last_error());
    let all = reference(&model, &long);
    let want: Vec<f32> =
        (0..long.len()).map(|i| if i == 0 { f32::NAN } else { log_prob(&all[i - 1], long[i] as u32) }).collect();
    assert_eq!(bits(&got), bits(&want), "a score in pieces");
    assert_eq!(bits(&logits(&e, 2)), bits(all.last().unwrap()), "after the score");
    assert_eq!(held(&e), held_pages(long.len()) * PAGE, "held after the score");
    reset(&e, 2);
    let mut hist: Vec<i32> = Vec::new();
    for n in [300usize, 37, 1, 1, 1, 64, 1, 5, 700] {
        let tokens = rng.ids(cfg.vocab, n);
        assert_eq!(try_step(&e, 0, &tokens).0, Status::Ok, "{}", last_error());
        hist.extend(&tokens);
        let want = reference(&model, &hist);
        assert_eq!(bits(&logits(&e, 0)), bits(want.last().unwrap()), "after {} tokens", hist.len());
        assert_eq!(pages(&e, 0).len(), hist.len().div_ceil(PAGE), "main pages");
        assert_eq!(held(&e), held_pages(hist.len()) * PAGE, "held after {} tokens", hist.len());
    }
    let len = hist.len();
    assert!(held_pages(len) < 2 * len.div_ceil(PAGE) - 8, "the local layers gave pages back");

    // Too far back: refused, and the stream goes on as before.
    for cut in [0usize, 100, len - KEPT - 2 * PAGE] {
        if cut == 0 {
            continue;
        }
        assert_eq!(try_truncate(&e, 0, cut), Status::InvalidArgument, "truncate to {cut}");
        assert!(last_error().contains("window"), "{}", last_error());
        assert_eq!(fork(&e, 0, 1, cut), Status::InvalidArgument, "fork at {cut}");
        assert_eq!(stream_len(&e, 0) as usize, len);
        assert_eq!(stream_len(&e, 1), 0);
        assert_eq!(held(&e), held_pages(len) * PAGE, "nothing taken");
    }
    // Within the margin: a fork and a truncate, each going on with the logits of one pool.
    let at = len - 20;
    assert_eq!(fork(&e, 0, 1, at), Status::Ok, "{}", last_error());
    let tail = rng.ids(cfg.vocab, 3);
    assert_eq!(try_step(&e, 1, &tail).0, Status::Ok, "{}", last_error());
    let forked: Vec<i32> = hist[..at].iter().chain(&tail).copied().collect();
    assert_eq!(bits(&logits(&e, 1)), bits(reference(&model, &forked).last().unwrap()), "the fork");
    pages(&e, 1);
    assert_eq!(try_truncate(&e, 0, len - 30), Status::Ok, "{}", last_error());
    hist.truncate(len - 30);
    let more = rng.ids(cfg.vocab, 2);
    assert_eq!(try_step(&e, 0, &more).0, Status::Ok, "{}", last_error());
    hist.extend(&more);
    assert_eq!(bits(&logits(&e, 0)), bits(reference(&model, &hist).last().unwrap()), "after the truncate");
    pages(&e, 0);
    // The prefix cache: a prompt of stream 0's first 200 tokens takes its first six pages, the local
    // layers' two of them that the window reaches among them (kept in the cache when given back).
    assert_eq!(try_step(&e, 2, &hist[..200]).0, Status::Ok, "{}", last_error());
    assert_eq!(prefix_stats(&e, 2), (192, 8), "six pages from the cache");
    assert_eq!(bits(&logits(&e, 2)), bits(&reference(&model, &hist[..200])[199]), "the cached prefix");
    pages(&e, 2);
    reset(&e, 0);
    reset(&e, 1);
    reset(&e, 2);
    let u = kv_usage(&e);
    assert_eq!((u.tokens_free, u.tokens_total), (total, total), "every page back");
}

/// Random calls on four streams with the prefix cache on: prompts sharing system prompts or repeating a
/// reset stream's, chunks, single tokens, batches, forks, truncates, resets and scores. Every logit and
/// log-probability is one pool's computation of the stream alone; after every call both pools' counts
/// agree with every stream's page lists (the engine's audit); a truncate or fork within the margin
/// always works, and one refused changes nothing.
#[test]
fn random_calls_match_one_pool() {
    let _g = serial();
    let mut rng = Rng::fresh("random_calls_match_one_pool");
    let dir = Scratch::new("gemma3-pool-random");
    let cfg = config();
    let path = dir.gguf("gemma3", &cfg, rng.next_u64(), DType::Q8_0);
    let ckpt = Checkpoint::open(&path).unwrap();
    let model = CpuModel::new(&ckpt).unwrap();
    let (window, streams) = (1024usize, 4usize);
    let e = init(&path, &cpu_options(window as u32, streams as u32));
    let systems: Vec<Vec<i32>> = (0..2).map(|k| rng.ids(cfg.vocab, 120 + 70 * k)).collect();
    let mut hist: Vec<Vec<i32>> = vec![Vec::new(); streams];
    // The shortest length each stream can surely be cut to: 32 positions before its length after a step
    // or score, or what it held before if that was later (a fork holds its source's pages, and no more).
    let mut floor = vec![0usize; streams];
    let (mut refused, mut forks, mut scores, mut hits) = (0, 0, 0, 0);
    let audit = |e: &Held, hist: &[Vec<i32>]| {
        for (s, h) in hist.iter().enumerate() {
            assert_eq!(pages(e, s as u32).len(), h.len().div_ceil(PAGE), "stream {s}'s main pages");
            assert_eq!(stream_len(e, s as u32) as usize, h.len(), "stream {s}'s length");
        }
    };
    for round in 0..400 {
        let at = format!("round {round}");
        let s = rng.below(streams as u64) as usize;
        let next = |rng: &mut Rng, h: &[i32]| -> Vec<i32> {
            match rng.below(6) {
                0 | 1 if h.is_empty() => {
                    let mut t = systems[rng.below(2) as usize].clone();
                    let n = 1 + rng.below(20) as usize;
                    t.extend(rng.ids(cfg.vocab, n));
                    t
                }
                2 => {
                    let n = 1 + rng.below(80) as usize;
                    rng.ids(cfg.vocab, n)
                }
                // More than a piece: stepped (or scored) in pieces.
                3 if h.len() + 800 <= window => {
                    let n = 513 + rng.below(180) as usize;
                    rng.ids(cfg.vocab, n)
                }
                _ => rng.ids(cfg.vocab, 1),
            }
        };
        if hist[s].len() + 100 > window || (hist[s].len() > 300 && rng.below(4) == 0) {
            reset(&e, s as u32);
            hist[s].clear();
            floor[s] = 0;
        }
        match rng.below(100) {
            0..45 => {
                let tokens = next(&mut rng, &hist[s]);
                assert_eq!(try_step(&e, s as u32, &tokens).0, Status::Ok, "{at}: {}", last_error());
                hist[s].extend(&tokens);
                floor[s] = floor[s].max(hist[s].len().saturating_sub(32));
                let want = reference(&model, &hist[s]);
                assert_eq!(bits(&logits(&e, s as u32)), bits(want.last().unwrap()), "{at}: stream {s}");
                hits += (prefix_stats(&e, s as u32).0 > 0) as usize;
            }
            45..57 => {
                let inputs: Vec<Vec<i32>> = hist.iter().map(|h| next(&mut rng, h)).collect();
                let items: Vec<(u32, &[i32])> = inputs.iter().enumerate().map(|(s, t)| (s as u32, &t[..])).collect();
                let (st, out) = try_batch(&e, &items);
                assert_eq!(st, Status::Ok, "{at}: {}", last_error());
                for (s, t) in inputs.iter().enumerate() {
                    assert_eq!(out[s].0, Status::Ok, "{at}: item {s}");
                    hist[s].extend(t);
                    floor[s] = floor[s].max(hist[s].len().saturating_sub(32));
                    let want = reference(&model, &hist[s]);
                    assert_eq!(bits(&logits(&e, s as u32)), bits(want.last().unwrap()), "{at}: stream {s}");
                }
            }
            57..70 => {
                let dst = (s + 1 + rng.below(streams as u64 - 1) as usize) % streams;
                // Half the forks within the margin, half anywhere.
                let len = match rng.below(2) {
                    0 => hist[s].len().saturating_sub(rng.below(33) as usize),
                    _ => rng.below(hist[s].len() as u64 + 1) as usize,
                };
                let before = held(&e);
                match fork(&e, s as u32, dst as u32, len) {
                    Status::Ok => {
                        hist[dst] = hist[s][..len].to_vec();
                        floor[dst] = floor[s];
                        forks += 1;
                    }
                    Status::InvalidArgument => {
                        assert!(len < floor[s], "{at}: a fork at {len} refused, surely fine from {}", floor[s]);
                        assert!(last_error().contains("window"), "{at}: {}", last_error());
                        assert_eq!(held(&e), before, "{at}: the refused fork took nothing");
                        refused += 1;
                    }
                    st => panic!("{at}: {st:?} {}", last_error()),
                }
            }
            70..80 => {
                let keep = hist[s].len() - rng.below(hist[s].len() as u64 + 1) as usize;
                match try_truncate(&e, s as u32, keep) {
                    Status::Ok => hist[s].truncate(keep),
                    Status::InvalidArgument => {
                        assert!(keep < floor[s], "{at}: a truncate to {keep} refused, surely fine from {}", floor[s]);
                        refused += 1;
                    }
                    st => panic!("{at}: {st:?} {}", last_error()),
                }
            }
            80..88 => {
                reset(&e, s as u32);
                hist[s].clear();
                floor[s] = 0;
            }
            _ => {
                let tokens = next(&mut rng, &hist[s]);
                let (st, got) = try_score(&e, s as u32, &tokens);
                assert_eq!(st, Status::Ok, "{at}: {}", last_error());
                let from = hist[s].len();
                hist[s].extend(&tokens);
                floor[s] = floor[s].max(hist[s].len().saturating_sub(32));
                let all = reference(&model, &hist[s]);
                let want: Vec<f32> = (0..tokens.len())
                    .map(|i| if from + i == 0 { f32::NAN } else { log_prob(&all[from + i - 1], tokens[i] as u32) })
                    .collect();
                assert_eq!(bits(&got), bits(&want), "{at}: stream {s}'s log-probabilities");
                assert_eq!(bits(&logits(&e, s as u32)), bits(all.last().unwrap()), "{at}: after the score");
                scores += 1;
            }
        }
        audit(&e, &hist);
    }
    println!("refused {refused}, forks {forks}, scores {scores}, steps after a cache hit {hits}");
    assert!(
        refused > 5 && forks > 10 && scores > 5 && hits > 3,
        "too few calls: {refused} refused, {forks} forks, {scores} scores, {hits} hits"
    );
    for s in 0..streams as u32 {
        reset(&e, s);
    }
    let u = kv_usage(&e);
    assert_eq!(u.tokens_free, u.tokens_total, "whole after the resets");
}

/// Prompt lookup proposing up to 32 tokens a step on streams whose local pages go back after every
/// step: the greedy tokens of plain steps, every rejected proposal cut without reaching a page given
/// back, and the logits of one pool at the end.
#[test]
fn speculation_cuts_rejections_within_the_margin() {
    let _g = serial();
    let mut rng = Rng::fresh("speculation_cuts_rejections_within_the_margin");
    let dir = Scratch::new("gemma3-pool-spec");
    let cfg = config();
    let path = dir.gguf("gemma3", &cfg, rng.next_u64(), DType::Q8_0);
    let ckpt = Checkpoint::open(&path).unwrap();
    let model = CpuModel::new(&ckpt).unwrap();
    let spec = init(&path, &cpu_options(1536, 2));
    let plain = init(&path, &cpu_options(1536, 2));
    let (mut proposed, mut accepted) = (0, 0);
    for p in 0..3 {
        let prompt = common::spec::repeating_prompt(&mut rng, cfg.vocab);
        let what = format!("prompt {p}");
        let (got, (pr, ac)) =
            common::spec::speculated_as_plain(&spec, &plain, &common::spec::lookup(32), &prompt, 300, 40, &what);
        let len = stream_len(&spec, 0) as usize;
        let all: Vec<i32> = prompt.iter().chain(&got).copied().take(len).collect();
        assert_eq!(bits(&logits(&spec, 0)), bits(reference(&model, &all).last().unwrap()), "{what}");
        assert_eq!(held(&spec), held_pages(len) * PAGE, "{what}: pages held");
        pages(&spec, 0);
        (proposed, accepted) = (proposed + pr, accepted + ac);
        reset(&spec, 0);
        reset(&plain, 0);
    }
    println!("proposed {proposed}, accepted {accepted}");
    assert!(accepted > 0 && accepted < proposed, "proposed {proposed}, accepted {accepted}");
}
