//! What the tests of shared KV pages (engine_fork, the prefix cache, engine_score) share: the calls
//! through the C ABI, and the check of the pool's counts against every stream's page table.

use super::{Held, Rng, bits, info, init, kv_stats, logits, reset, step, stream_len, truncate, try_batch, try_step};
use hostembed::Status;
use hostembed::abi::engine_kv_usage;
use hostembed::engine::{engine_options, engine_tristate};
use hostembed::ffi;
use hostembed::status::last_error;
use std::collections::HashMap;
use std::path::Path;

/// The cache off: the reference that computes every position itself.
pub fn no_cache(opts: engine_options) -> engine_options {
    engine_options { prefix_cache: engine_tristate::No, ..opts }
}

pub fn fork(e: &Held, src: u32, dst: u32, len: usize) -> Status {
    // SAFETY: a live engine.
    unsafe { ffi::engine_fork(e.0, src, dst, len as u32) }
}

pub fn kv_usage(e: &Held) -> engine_kv_usage {
    let mut u = engine_kv_usage::default();
    // SAFETY: a live engine and a struct to fill.
    assert_eq!(unsafe { ffi::engine_kv_usage(e.0, &mut u) }, Status::Ok, "{}", last_error());
    u
}

/// engine_prefix_stats: (tokens the prefix cache gave, tokens computed) of stream `stream`.
pub fn prefix_stats(e: &Held, stream: u32) -> (u64, u64) {
    let (mut cached, mut computed) = (u64::MAX, u64::MAX);
    // SAFETY: a live engine and two writable counters.
    let st = unsafe { ffi::engine_prefix_stats(e.0, stream, &mut cached, &mut computed) };
    assert_eq!(st, Status::Ok, "engine_prefix_stats({stream}): {}", last_error());
    (cached, computed)
}

/// engine_score's status and what it wrote (-7 where it wrote nothing).
pub fn try_score(e: &Held, stream: u32, tokens: &[i32]) -> (Status, Vec<f32>) {
    let mut out = vec![-7f32; tokens.len()];
    // SAFETY: a live engine, `tokens.len()` ids and as many floats.
    let st = unsafe { ffi::engine_score(e.0, stream, tokens.as_ptr(), tokens.len(), out.as_mut_ptr()) };
    (st, out)
}

pub fn score(e: &Held, stream: u32, tokens: &[i32]) -> Vec<f32> {
    let (st, out) = try_score(e, stream, tokens);
    assert_eq!(st, Status::Ok, "engine_score(stream {stream}, {} tokens): {}", tokens.len(), last_error());
    out
}

/// Stream `stream`'s pages, after the pool's own check of its counts against every stream's.
pub fn pages(e: &Held, stream: u32) -> Vec<u32> {
    // SAFETY: a live engine.
    let (pages, audit) = unsafe { ffi::debug_kv_pages(e.0, stream) }.unwrap();
    audit.unwrap_or_else(|err| panic!("{err}"));
    pages
}

/// The pool's counts against the streams' page tables: the pool checks its own, and engine_kv_usage
/// adds up: positions held are the distinct pages held, shared ones those in more than one table,
/// cached ones free. Each stream holds exactly the pages of its length. Returns every stream's pages.
pub fn check_pool(e: &Held, lens: &[usize], total: u64, page_tokens: usize, what: &str) -> Vec<Vec<u32>> {
    let tables: Vec<Vec<u32>> = (0..lens.len() as u32).map(|s| pages(e, s)).collect();
    let mut holders: HashMap<u32, usize> = HashMap::new();
    for (s, t) in tables.iter().enumerate() {
        assert_eq!(
            t.len(),
            lens[s].div_ceil(page_tokens),
            "{what}: stream {s} holds {} pages for {} positions",
            t.len(),
            lens[s]
        );
        assert_eq!(stream_len(e, s as u32) as usize, lens[s], "{what}: stream {s}'s length");
        for &p in t {
            *holders.entry(p).or_default() += 1;
        }
    }
    let u = kv_usage(e);
    let page = page_tokens as u64;
    assert_eq!(u.tokens_total, total, "{what}: the pool's size");
    assert_eq!(u.tokens_total - u.tokens_free, holders.len() as u64 * page, "{what}: held positions");
    assert_eq!(u.tokens_shared, holders.values().filter(|&&n| n > 1).count() as u64 * page, "{what}: shared");
    assert!(u.tokens_cached <= u.tokens_free, "{what}: cached {} of {} free", u.tokens_cached, u.tokens_free);
    assert_eq!(kv_stats(e), (u.tokens_total, u.tokens_free), "{what}: engine_kv_stats");
    tables
}

/// The logits after `tokens`, computed alone from position 0 on stream 0 of `reference` (cache off).
pub fn alone(reference: &Held, tokens: &[i32]) -> Vec<f32> {
    reset(reference, 0);
    step(reference, 0, tokens);
    logits(reference, 0)
}

/// What `random_calls` did.
#[derive(Debug, Default)]
pub struct Seen {
    pub steps: usize,
    pub forks: usize,
    pub scores: usize,
    pub live_hits: usize,
    pub cache_hits: usize,
    pub no_room: usize,
    /// NO_ROOM from the pool, not the window.
    pub pool_full: usize,
    pub copies: usize,
}

/// The model and options `random_calls` runs on.
pub struct Calls<'a> {
    pub path: &'a Path,
    /// The engine under test.
    pub opts: &'a engine_options,
    /// The reference's (one stream, the cache off): it computes each stream alone from its tokens.
    pub reference: &'a engine_options,
    pub vocab: usize,
    /// Positions in one KV page of the backend.
    pub page: usize,
}

/// `rounds` random calls on the streams of an engine of `m`: prompts that share system prompts or repeat
/// what a reset stream held, single tokens, batches, forks, truncates, resets and scores; after each
/// step or score the stream's logits (and log-probabilities) are the bits of the reference computing the
/// stream alone from its tokens, and after every call `check_pool` holds. An item is NO_ROOM past its
/// window, and never where it would fit without the cache. The engines are freed before it returns.
pub fn random_calls(what: &str, m: &Calls<'_>, rounds: usize, rng: &mut Rng) -> Seen {
    let (vocab, page) = (m.vocab, m.page);
    let e = init(m.path, m.opts);
    let reference = init(m.path, m.reference);
    let i = info(&e);
    let (streams, window) = (i.streams as usize, i.window as usize);
    let total = kv_usage(&e).tokens_total;
    let systems: Vec<Vec<i32>> = (0..3).map(|k| rng.ids(vocab, 40 + 35 * k)).collect();
    let mut hist: Vec<Vec<i32>> = vec![Vec::new(); streams];
    // What each stream held before its last reset: asked for again now and then.
    let mut gone: Vec<Vec<i32>> = vec![Vec::new(); streams];
    let mut seen = Seen::default();
    let lens = |hist: &[Vec<i32>]| hist.iter().map(Vec::len).collect::<Vec<_>>();
    let mut tables = check_pool(&e, &lens(&hist), total, page, what);
    for round in 0..rounds {
        let at = format!("{what} round {round}");
        let s = rng.below(streams as u64) as usize;
        // A stream near its window starts again.
        if hist[s].len() + 2 * page > window {
            reset(&e, s as u32);
            gone[s] = std::mem::take(&mut hist[s]);
        }
        match rng.below(100) {
            // A prompt, a chunk or a token on one stream.
            0..40 => {
                let tokens = next_tokens(rng, &hist[s], &gone[s], &systems, vocab, page);
                let u = kv_usage(&e);
                let need = need_without_cache(&tables, s, hist[s].len(), tokens.len(), page);
                let (st, _) = try_step(&e, s as u32, &tokens);
                if hist[s].len() + tokens.len() > window {
                    assert_eq!(st, Status::NoRoom, "{at}: past the window");
                } else if need > u.tokens_free as usize / page {
                    // Without the cache it would not fit either; the cache may still make it fit.
                    assert!(matches!(st, Status::Ok | Status::NoRoom), "{at}: {st:?} {}", last_error());
                    seen.pool_full += (st == Status::NoRoom) as usize;
                } else {
                    assert_eq!(st, Status::Ok, "{at}: {need} pages with {} free: {}", u.tokens_free, last_error());
                }
                if st == Status::Ok {
                    let from = hist[s].len();
                    hist[s].extend(&tokens);
                    let new = check_pool(&e, &lens(&hist), total, page, &at);
                    count_hits(&mut seen, page, &tables, &new, s, from, &u, &kv_usage(&e), need);
                    tables = new;
                    assert_eq!(bits(&logits(&e, s as u32)), bits(&alone(&reference, &hist[s])), "{at}: stream {s}");
                    seen.steps += 1;
                } else {
                    seen.no_room += 1;
                }
            }
            // A batch of several streams.
            40..52 => {
                let mut order: Vec<usize> = (0..streams).collect();
                rng.shuffle(&mut order);
                order.truncate(1 + rng.below(streams as u64) as usize);
                let inputs: Vec<Vec<i32>> =
                    order.iter().map(|&s| next_tokens(rng, &hist[s], &gone[s], &systems, vocab, page)).collect();
                let items: Vec<(u32, &[i32])> =
                    order.iter().zip(&inputs).map(|(&s, t)| (s as u32, t.as_slice())).collect();
                let (st, out) = try_batch(&e, &items);
                assert_eq!(st, Status::Ok, "{at}: {}", last_error());
                for (k, &(item_status, _)) in out.iter().enumerate() {
                    let s = order[k];
                    if hist[s].len() + inputs[k].len() > window {
                        assert_eq!(item_status, Status::NoRoom, "{at}: stream {s} past the window");
                    }
                    if item_status == Status::Ok {
                        hist[s].extend(&inputs[k]);
                    } else {
                        assert_eq!(item_status, Status::NoRoom, "{at}: stream {s}");
                        seen.no_room += 1;
                        seen.pool_full += (hist[s].len() + inputs[k].len() <= window) as usize;
                    }
                }
                tables = check_pool(&e, &lens(&hist), total, page, &at);
                for (k, &(item_status, _)) in out.iter().enumerate() {
                    let s = order[k];
                    if item_status == Status::Ok {
                        assert_eq!(bits(&logits(&e, s as u32)), bits(&alone(&reference, &hist[s])), "{at}: stream {s}");
                        seen.steps += 1;
                    }
                }
            }
            // A fork.
            52..66 => {
                let dst = rng.below(streams as u64) as usize;
                let len = rng.below(hist[s].len() as u64 + 1) as usize;
                let st = fork(&e, s as u32, dst as u32, len);
                if dst == s {
                    assert_eq!(st, Status::InvalidArgument, "{at}");
                } else {
                    assert_eq!(st, Status::Ok, "{at}: {}", last_error());
                    gone[dst] = std::mem::take(&mut hist[dst]);
                    hist[dst] = hist[s][..len].to_vec();
                    seen.forks += 1;
                }
                tables = check_pool(&e, &lens(&hist), total, page, &at);
            }
            66..76 => {
                let keep = rng.below(hist[s].len() as u64 + 1) as usize;
                truncate(&e, s as u32, keep as u32);
                hist[s].truncate(keep);
                tables = check_pool(&e, &lens(&hist), total, page, &at);
            }
            76..88 => {
                reset(&e, s as u32);
                gone[s] = std::mem::take(&mut hist[s]);
                tables = check_pool(&e, &lens(&hist), total, page, &at);
            }
            // A score: the log-probabilities of computing the stream alone, then scoring the tokens.
            _ => {
                let tokens = next_tokens(rng, &hist[s], &gone[s], &systems, vocab, page);
                let (st, got) = try_score(&e, s as u32, &tokens);
                if hist[s].len() + tokens.len() > window {
                    assert_eq!(st, Status::NoRoom, "{at}: past the window");
                }
                if st != Status::Ok {
                    assert_eq!(st, Status::NoRoom, "{at}: {}", last_error());
                    seen.no_room += 1;
                    seen.pool_full += (hist[s].len() + tokens.len() <= window) as usize;
                    tables = check_pool(&e, &lens(&hist), total, page, &at);
                    continue;
                }
                reset(&reference, 0);
                if !hist[s].is_empty() {
                    step(&reference, 0, &hist[s]);
                }
                let want = score(&reference, 0, &tokens);
                assert_eq!(bits(&got), bits(&want), "{at}: stream {s}'s log-probabilities");
                hist[s].extend(&tokens);
                assert_eq!(bits(&logits(&e, s as u32)), bits(&logits(&reference, 0)), "{at}: logits after the score");
                tables = check_pool(&e, &lens(&hist), total, page, &at);
                seen.scores += 1;
            }
        }
    }
    println!("{what}: {seen:?}");
    for s in 0..streams {
        reset(&e, s as u32);
    }
    check_pool(&e, &vec![0; streams], total, page, what);
    assert_eq!(kv_usage(&e).tokens_free, total, "{what}: whole after the resets");
    seen
}

/// What a stream is fed next: its last token again, a chunk of new ids, a system prompt and a question
/// (from an empty stream), or what it held before its last reset.
fn next_tokens(rng: &mut Rng, hist: &[i32], gone: &[i32], systems: &[Vec<i32>], vocab: usize, page: usize) -> Vec<i32> {
    match rng.below(8) {
        0 | 1 if hist.is_empty() && !gone.is_empty() => {
            let n = gone.len().min(page + 1 + rng.below(gone.len() as u64) as usize);
            gone[..n].to_vec()
        }
        0..4 if hist.is_empty() => {
            let mut t = systems[rng.below(systems.len() as u64) as usize].clone();
            let n = 1 + rng.below(30) as usize;
            t.extend(rng.ids(vocab, n));
            t
        }
        4 | 5 => {
            let n = 1 + rng.below(3 * page as u64) as usize;
            rng.ids(vocab, n)
        }
        _ => rng.ids(vocab, 1),
    }
}

/// Pages an item of `n` tokens on stream `s` (of `len` positions) takes from the pool without the cache:
/// those its new positions need, and a copy of its last page when another stream holds it.
fn need_without_cache(tables: &[Vec<u32>], s: usize, len: usize, n: usize, page: usize) -> usize {
    let grow = (len + n).div_ceil(page) - len.div_ceil(page);
    let shared =
        len % page != 0 && tables.iter().enumerate().any(|(o, t)| o != s && t.contains(&tables[s][len / page]));
    grow + shared as usize
}

/// Counts what a step of stream `s` from `from` took: pages another stream holds (live), pages that
/// came from the cache (its count fell while free pages outside it were enough), and copies.
#[allow(clippy::too_many_arguments)]
fn count_hits(
    seen: &mut Seen,
    page: usize,
    before: &[Vec<u32>],
    after: &[Vec<u32>],
    s: usize,
    from: usize,
    u0: &engine_kv_usage,
    u1: &engine_kv_usage,
    need: usize,
) {
    let new = &after[s][from / page..];
    let others_before: Vec<u32> =
        before.iter().enumerate().filter(|&(o, _)| o != s).flat_map(|(_, t)| t.iter().copied()).collect();
    seen.live_hits += new.iter().filter(|p| others_before.contains(p)).count();
    // The cache loses the pages taken from it and those evicted for room, which is at most what the free
    // pages outside it could not give.
    let outside = (u0.tokens_free - u0.tokens_cached) as usize / page;
    let fell = (u0.tokens_cached.saturating_sub(u1.tokens_cached)) as usize / page;
    if fell > need.saturating_sub(outside) {
        seen.cache_hits += 1;
    }
    if from % page != 0 && before[s].get(from / page) != after[s].get(from / page) {
        seen.copies += 1;
    }
}
