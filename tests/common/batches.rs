//! The loop that checks random batches against stepping each stream alone, and the models it runs on.

use super::{
    Held, Rng, Scratch, bits, info, init, kv_stats, logits, rel_l2, reset, set_sampling, stats, stream_len, truncate,
    try_batch, try_step,
};
use hostembed::checkpoint::write::Recipe;
use hostembed::engine::engine_options;
use hostembed::model::{ModelConfig, names};
use hostembed::placement::engine_memory;
use hostembed::status::last_error;
use hostembed::tensor::DType;
use hostembed::{Status, ffi};
use std::path::{Path, PathBuf};

/// A random sampler: greedy or drawn, with or without top-k, top-p, min-p and a penalty.
pub fn random_sampling(rng: &mut Rng) -> hostembed::abi::engine_sampling {
    let pick = |rng: &mut Rng, p: f32| rng.unit() < p;
    let mut s = ffi::engine_default_sampling();
    if pick(rng, 0.7) {
        s.temperature = 0.5 + rng.unit() * 1.5;
    }
    if pick(rng, 0.4) {
        s.top_k = 1 + rng.below(60) as u32;
    }
    if pick(rng, 0.4) {
        s.top_p = 0.5 + rng.unit() * 0.5;
    }
    if pick(rng, 0.5) {
        s.min_p = rng.unit() * 0.3;
    }
    if pick(rng, 0.6) {
        s.repeat_penalty = 0.7 + rng.unit() * 1.3;
        s.repeat_last_n = rng.below(40) as u32;
    }
    s.seed = rng.next_u64();
    s
}

/// How `batches_match_stepping_alone` draws its rounds.
pub struct Mix {
    pub rounds: usize,
    /// Items in one call: 1 to this many (no more than the engines' streams).
    pub widest: u32,
    /// Prompt chunks of 1 to `chunk` tokens, one in four of 1 to `long_chunk`.
    pub chunk: u64,
    pub long_chunk: u64,
}

/// What a run of `batches_match_stepping_alone` stepped.
#[derive(Debug, Default)]
pub struct BatchCounts {
    /// Items that stepped, and of them the single tokens and the prompt chunks in calls of several items.
    pub items: usize,
    pub singles_beside_others: usize,
    pub chunks_beside_others: usize,
    /// Items refused, as they were alone (a chunk past the window).
    pub refused: usize,
    /// The most items one call held.
    pub widest: usize,
}

/// Random batches on `batched` and the same steps one stream at a time on `alone` (fresh engines of
/// one model and the same options, `page` positions a KV page). Each round truncates, resets or
/// re-samples some streams on both, then steps 1 to `mix.widest` streams in a random order in one call,
/// each with a prompt chunk (a stream joining, or going on) or its last sampled token. Every item's
/// status, token and logits must be those of stepping it alone, bit for bit; the pool's free positions
/// follow the streams' lengths every round and are whole after every stream's reset.
pub fn batches_match_stepping_alone(
    what: &str,
    batched: &Held,
    alone: &Held,
    rng: &mut Rng,
    mix: &Mix,
    page: u64,
) -> BatchCounts {
    let i = info(batched);
    let (streams, window, vocab) = (i.streams, i.window, i.vocab as usize);
    assert!(mix.widest <= streams, "{what}: {} items in a call of {streams} streams", mix.widest);
    let (total, free) = kv_stats(batched);
    assert_eq!(free, total, "{what}: a fresh engine's pool");
    for s in 0..streams {
        let sampling = random_sampling(rng);
        set_sampling(batched, s, &sampling);
        set_sampling(alone, s, &sampling);
    }
    // What each stream feeds next: its last sampled token once it has one.
    let mut last: Vec<Option<i32>> = vec![None; streams as usize];
    let mut counts = BatchCounts::default();
    for round in 0..mix.rounds {
        // Between calls: some streams leave (reset), are truncated, or are given new settings; a stream
        // at a full window starts again.
        for s in 0..streams {
            let len = stream_len(batched, s);
            assert_eq!(len, stream_len(alone, s), "{what} round {round} stream {s}: lengths");
            match rng.below(20) {
                r if r == 0 || len == window => {
                    reset(batched, s);
                    reset(alone, s);
                    last[s as usize] = None;
                }
                1 if len > 0 => {
                    let keep = rng.below(len as u64) as u32;
                    truncate(batched, s, keep);
                    truncate(alone, s, keep);
                    last[s as usize] = None;
                }
                2 => {
                    let sampling = random_sampling(rng);
                    set_sampling(batched, s, &sampling);
                    set_sampling(alone, s, &sampling);
                }
                _ => {}
            }
        }
        // Every fifth call is as wide as the mix allows and every fifth a single item.
        let width = match round % 5 {
            0 => mix.widest,
            2 => 1,
            _ => 1 + rng.below(mix.widest as u64) as u32,
        };
        let mut order: Vec<u32> = (0..streams).collect();
        rng.shuffle(&mut order);
        order.truncate(width as usize);
        let inputs: Vec<Vec<i32>> = order
            .iter()
            .map(|&s| match last[s as usize] {
                Some(t) if rng.below(3) > 0 => vec![t],
                _ => {
                    let longest = if rng.below(4) == 0 { mix.long_chunk } else { mix.chunk };
                    let n = 1 + rng.below(longest) as usize;
                    rng.ids(vocab, n)
                }
            })
            .collect();
        let items: Vec<(u32, &[i32])> = order.iter().zip(&inputs).map(|(&s, t)| (s, t.as_slice())).collect();
        let (st, out) = try_batch(batched, &items);
        assert_eq!(st, Status::Ok, "{what} round {round}: {}", last_error());
        let others = items.len() > 1;
        for (&(s, tokens), &(item_status, next)) in items.iter().zip(&out) {
            let at = format!("{what} round {round} stream {s} ({} tokens of a call of {})", tokens.len(), items.len());
            let (want_status, want_next) = try_step(alone, s, tokens);
            assert_eq!(item_status, want_status, "{at}: status");
            if want_status != Status::Ok {
                assert_eq!(next, -1, "{at}: a failed item's next");
                counts.refused += 1;
                continue;
            }
            assert_eq!(next, want_next, "{at}: token");
            let (got, want) = (logits(batched, s), logits(alone, s));
            if bits(&got) != bits(&want) {
                panic!("{at}: logits differ from stepping alone by {:.3e} relative L2", rel_l2(&got, &want));
            }
            last[s as usize] = Some(next);
            counts.items += 1;
            counts.singles_beside_others += (others && tokens.len() == 1) as usize;
            counts.chunks_beside_others += (others && tokens.len() > 1) as usize;
        }
        counts.widest = counts.widest.max(items.len());
        let held: u64 = (0..streams).map(|s| (stream_len(batched, s) as u64).div_ceil(page) * page).sum();
        assert_eq!(kv_stats(batched), (total, total - held), "{what} round {round}: free positions");
    }
    for s in 0..streams {
        reset(batched, s);
        reset(alone, s);
    }
    assert_eq!(kv_stats(batched), (total, total), "{what}: the pool after every stream's reset");
    println!("{what}: {counts:?}");
    counts
}

/// `batches_match_stepping_alone` on two fresh engines of `path` with `opts` (CUDA or the CPU, as
/// `opts.backend` says), with enough single tokens and prompt chunks beside others, and a call of every
/// stream, to mean anything; nothing held once they are freed.
pub fn twins_batch_like_alone(what: &str, path: &Path, opts: &engine_options, mix: &Mix, page: u64, rng: &mut Rng) {
    let batched = init(path, opts);
    let alone = init(path, opts);
    let i = info(&batched);
    let cuda = opts.backend == hostembed::engine::engine_backend::Cuda;
    assert_eq!((i.cuda, i.streams), (cuda, mix.widest), "{what}: the backend and the streams");
    let counts = batches_match_stepping_alone(what, &batched, &alone, rng, mix, page);
    assert!(
        counts.singles_beside_others > 100 && counts.chunks_beside_others > 50 && counts.widest == i.streams as usize,
        "{what}: too few items beside others to mean anything: {counts:?}"
    );
    drop((batched, alone));
    assert_eq!(stats(), engine_memory::default(), "{what}: held after the engines were freed");
}

/// `twins_batch_like_alone` on `cfg` written as GGUF in every recipe (`every_recipe`).
pub fn every_recipe_batches_like_alone(cfg: &ModelConfig, opts: &engine_options, mix: &Mix, page: u64, rng: &mut Rng) {
    let dir = Scratch::new("batch-formats");
    for recipe in every_recipe() {
        let started = std::time::Instant::now();
        let path = gguf_of_recipe(&dir, cfg, rng.next_u64(), recipe);
        twins_batch_like_alone(recipe.name(), &path, opts, mix, page, rng);
        println!("{}: {:.1} s", recipe.name(), started.elapsed().as_secs_f64());
    }
}

/// Every format `FORMATS` lists for all of a model's matrices, then llama.cpp's Q4_K_M mix.
pub fn every_recipe() -> Vec<Recipe> {
    hostembed::tensor::FORMATS.iter().map(|f| Recipe::Uniform(f.dtype)).chain([Recipe::Q4KM]).collect()
}

/// Writes `cfg` in `recipe` into `dir` and checks the file stores every tensor as the recipe asks, with
/// no fallback for rows that are not whole blocks (Q4_K_M: Q4_K and Q6_K both present, a router in F32).
pub fn gguf_of_recipe(dir: &Scratch, cfg: &ModelConfig, seed: u64, recipe: Recipe) -> PathBuf {
    let path = dir.gguf(recipe.name(), cfg, seed, recipe);
    let ckpt = hostembed::checkpoint::Checkpoint::open(&path).unwrap();
    for t in ckpt.tensors.values().filter(|t| t.shape.len() == 2) {
        let fits = match recipe {
            Recipe::Uniform(dtype) => t.dtype == dtype,
            Recipe::Q4KM => {
                let quantized = matches!(t.dtype, DType::Q4_K | DType::Q6_K) || t.name.ends_with(names::ROUTER);
                quantized && t.dtype == recipe.dtype(cfg, &t.name, &t.shape)
            }
        };
        assert!(fits, "{}: tensor {} of {:?} stored as {}", recipe.name(), t.name, t.shape, t.dtype.name());
    }
    if recipe == Recipe::Q4KM {
        for k in [DType::Q4_K, DType::Q6_K] {
            assert!(ckpt.tensors.values().any(|t| t.dtype == k), "Q4_K_M without {}", k.name());
        }
    }
    path
}
