//! Shared KV pages on the CPU backend through the C ABI: engine_fork (the source's pages shared, the
//! page a stream writes into copied first), the prefix cache (a prompt's first whole pages taken from
//! pages in the pool, live or kept from a reset, evicted least recently released first, never refusing
//! what would fit without it), engine_kv_usage, and engine_score. Every stream's logits are checked bit
//! for bit against a second engine that computes each stream alone with the cache off, and the pool's
//! counts against every stream's page table after every call.

mod common;
use common::{Held, Rng, Scratch, bits, cpu_options, info, init, logits, serial, stats, step, try_step};
use common::{kv_stats, reset, stream_len, truncate, try_batch};

use hostembed::Status;
use hostembed::abi::engine_kv_usage;
use hostembed::cpu::CpuStream;
use hostembed::engine::{self, engine_options, engine_tristate};
use hostembed::ffi;
use hostembed::fit;
use hostembed::model::{Arch, ModelConfig, RopeScaling};
use hostembed::placement::engine_memory;
use hostembed::status::last_error;
use hostembed::tensor::DType;
use std::collections::HashMap;
use std::path::PathBuf;

/// Positions in one page of the CPU backend's pool.
const PAGE: usize = hostembed::cpu::PAGE_TOKENS;

/// A small Llama with GQA 2:1 and an untied head.
fn llama() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab: 256,
        hidden: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        intermediate: 128,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 512,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        bos: Some(1),
        eos: Some(2),
    }
}

fn model(dir: &Scratch, rng: &mut Rng) -> PathBuf {
    dir.gguf("llama", &llama(), rng.next_u64(), DType::Q8_0)
}

/// The cache off: the reference that computes every position itself.
fn no_cache(opts: engine_options) -> engine_options {
    engine_options { prefix_cache: engine_tristate::No, ..opts }
}

fn fork(e: &Held, src: u32, dst: u32, len: usize) -> Status {
    // SAFETY: a live engine.
    unsafe { ffi::engine_fork(e.0, src, dst, len as u32) }
}

fn kv_usage(e: &Held) -> engine_kv_usage {
    let mut u = engine_kv_usage::default();
    // SAFETY: a live engine and a struct to fill.
    assert_eq!(unsafe { ffi::engine_kv_usage(e.0, &mut u) }, Status::Ok, "{}", last_error());
    u
}

/// engine_score's status and what it wrote (-7 where it wrote nothing).
fn try_score(e: &Held, stream: u32, tokens: &[i32]) -> (Status, Vec<f32>) {
    let mut out = vec![-7f32; tokens.len()];
    // SAFETY: a live engine, `tokens.len()` ids and as many floats.
    let st = unsafe { ffi::engine_score(e.0, stream, tokens.as_ptr(), tokens.len(), out.as_mut_ptr()) };
    (st, out)
}

fn score(e: &Held, stream: u32, tokens: &[i32]) -> Vec<f32> {
    let (st, out) = try_score(e, stream, tokens);
    assert_eq!(st, Status::Ok, "engine_score(stream {stream}, {} tokens): {}", tokens.len(), last_error());
    out
}

/// Stream `stream`'s pages, after the pool's own check of its counts against every stream's.
fn pages(e: &Held, stream: u32) -> Vec<u32> {
    // SAFETY: a live engine.
    let (pages, audit) = unsafe { ffi::debug_kv_pages(e.0, stream) }.unwrap();
    audit.unwrap_or_else(|err| panic!("{err}"));
    pages
}

/// The pool's counts against the streams' page tables: the pool checks its own, and engine_kv_usage
/// adds up: positions held are the distinct pages held, shared ones those in more than one table,
/// cached ones free. Each stream holds exactly the pages of its length. Returns every stream's pages.
fn check_pool(e: &Held, lens: &[usize], total: u64, what: &str) -> Vec<Vec<u32>> {
    let tables: Vec<Vec<u32>> = (0..lens.len() as u32).map(|s| pages(e, s)).collect();
    let mut holders: HashMap<u32, usize> = HashMap::new();
    for (s, t) in tables.iter().enumerate() {
        assert_eq!(
            t.len(),
            lens[s].div_ceil(PAGE),
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
    let page = PAGE as u64;
    assert_eq!(u.tokens_total, total, "{what}: the pool's size");
    assert_eq!(u.tokens_total - u.tokens_free, holders.len() as u64 * page, "{what}: held positions");
    assert_eq!(u.tokens_shared, holders.values().filter(|&&n| n > 1).count() as u64 * page, "{what}: shared");
    assert!(u.tokens_cached <= u.tokens_free, "{what}: cached {} of {} free", u.tokens_cached, u.tokens_free);
    assert_eq!(kv_stats(e), (u.tokens_total, u.tokens_free), "{what}: engine_kv_stats");
    tables
}

/// The logits after `tokens`, computed alone from position 0 on stream 0 of `reference` (cache off).
fn alone(reference: &Held, tokens: &[i32]) -> Vec<f32> {
    reset(reference, 0);
    step(reference, 0, tokens);
    logits(reference, 0)
}

/// A fork shares the source's pages (engine_kv_usage counts them shared, nothing computed); the first
/// write into the shared partial page copies it, so each stream goes on as if computed alone and the
/// other's positions are untouched; forking at a page boundary shares whole pages only.
#[test]
fn fork_shares_pages_and_copies_the_page_it_writes() {
    let _g = serial();
    let mut rng = Rng::fresh("fork_shares_pages_and_copies_the_page_it_writes");
    let dir = Scratch::new("prefix-fork");
    let path = model(&dir, &mut rng);
    let vocab = llama().vocab;
    let e = init(&path, &cpu_options(256, 4));
    let reference = init(&path, &no_cache(cpu_options(256, 1)));
    let total = kv_usage(&e).tokens_total;
    let prompt = rng.ids(vocab, 90);
    step(&e, 0, &prompt);
    let before = kv_usage(&e);
    assert_eq!(fork(&e, 0, 1, 50), Status::Ok, "{}", last_error());
    let mut lens = vec![90, 50, 0, 0];
    let tables = check_pool(&e, &lens, total, "after the fork");
    assert_eq!(tables[1][..], tables[0][..2], "the fork holds the source's first two pages");
    let u = kv_usage(&e);
    assert_eq!((u.tokens_free, u.tokens_shared), (before.tokens_free, 2 * PAGE as u64), "no page taken, two shared");
    let mut out = vec![0f32; vocab];
    // SAFETY: a live engine and room for the vocabulary.
    let no_logits = unsafe { ffi::engine_logits(e.0, 1, out.as_mut_ptr(), out.len()) };
    assert_eq!(no_logits, Status::InvalidArgument, "the fork has no logits until it steps");

    // The fork writes position 50, inside the shared page 1: that page is copied first.
    let tail = rng.ids(vocab, 20);
    step(&e, 1, &tail);
    lens[1] = 70;
    let tables = check_pool(&e, &lens, total, "after the fork's step");
    assert_eq!(tables[1][0], tables[0][0], "page 0 stays shared");
    assert_ne!(tables[1][1], tables[0][1], "page 1 was copied");
    let mut fed1 = prompt[..50].to_vec();
    fed1.extend(&tail);
    assert_eq!(bits(&logits(&e, 1)), bits(&alone(&reference, &fed1)), "the fork's logits");
    // The source goes on over its own page 1, which the fork never touched.
    let more = rng.ids(vocab, 5);
    step(&e, 0, &more);
    lens[0] = 95;
    check_pool(&e, &lens, total, "after the source's step");
    let mut fed0 = prompt.clone();
    fed0.extend(&more);
    assert_eq!(bits(&logits(&e, 0)), bits(&alone(&reference, &fed0)), "the source's logits");

    // A fork of a fork at a page boundary, then the source reset: the pages live on in the forks.
    assert_eq!(fork(&e, 1, 2, 64), Status::Ok, "{}", last_error());
    lens[2] = 64;
    assert_eq!(fork(&e, 2, 3, 0), Status::Ok, "a fork of nothing empties the destination");
    reset(&e, 0);
    lens[0] = 0;
    let tables = check_pool(&e, &lens, total, "after the source's reset");
    assert_eq!(tables[2][..], tables[1][..2]);
    let next = rng.ids(vocab, 3);
    step(&e, 2, &next);
    lens[2] = 67;
    check_pool(&e, &lens, total, "after the second fork's step");
    let mut fed2 = fed1[..64].to_vec();
    fed2.extend(&next);
    assert_eq!(bits(&logits(&e, 2)), bits(&alone(&reference, &fed2)), "the second fork's logits");
    for s in 0..4 {
        reset(&e, s);
    }
    lens = vec![0; 4];
    check_pool(&e, &lens, total, "after every reset");
    assert_eq!(kv_usage(&e).tokens_free, total, "the pool is whole");
    drop((e, reference));
    assert_eq!(stats(), engine_memory::default());
}

/// Forking onto itself, past the source's length, from or into a stream the engine does not have, or
/// through a NULL engine is refused with a clear status, and changes nothing: no length, no logits,
/// no page.
#[test]
fn fork_refusals_change_nothing() {
    let _g = serial();
    let mut rng = Rng::fresh("fork_refusals_change_nothing");
    let dir = Scratch::new("prefix-fork-refusals");
    let path = model(&dir, &mut rng);
    let vocab = llama().vocab;
    let e = init(&path, &cpu_options(128, 3));
    let total = kv_usage(&e).tokens_total;
    let (p0, p1) = (rng.ids(vocab, 40), rng.ids(vocab, 10));
    assert_eq!(try_batch(&e, &[(0, &p0), (1, &p1)]).0, Status::Ok, "{}", last_error());
    let (l0, l1) = (logits(&e, 0), logits(&e, 1));
    let usage = kv_usage(&e);
    let tables = check_pool(&e, &[40, 10, 0], total, "before");
    let refusals = [
        (0, 0, 10, Status::InvalidArgument, "onto itself"),
        (0, 1, 41, Status::OutOfRange, "past the source's length"),
        (2, 1, 1, Status::OutOfRange, "from an empty stream"),
        (0, 3, 10, Status::OutOfRange, "into a stream not admitted"),
        (3, 1, 0, Status::OutOfRange, "from a stream not admitted"),
    ];
    for (src, dst, len, want, what) in refusals {
        assert_eq!(fork(&e, src, dst, len), want, "{what}: {}", last_error());
        assert!(!last_error().is_empty(), "{what}: a message");
        assert_eq!(check_pool(&e, &[40, 10, 0], total, what), tables, "{what}: the pages");
        assert_eq!(kv_usage(&e), usage, "{what}: the pool");
        assert_eq!(bits(&logits(&e, 0)), bits(&l0), "{what}: stream 0's logits");
        assert_eq!(bits(&logits(&e, 1)), bits(&l1), "{what}: stream 1's logits");
    }
    // SAFETY: NULL is refused before anything is read.
    assert_eq!(unsafe { ffi::engine_fork(std::ptr::null_mut(), 0, 1, 0) }, Status::InvalidArgument);
    // SAFETY: NULL is refused before anything is written.
    assert_eq!(unsafe { ffi::engine_kv_usage(e.0, std::ptr::null_mut()) }, Status::InvalidArgument);
    let mut u = engine_kv_usage::default();
    // SAFETY: NULL is refused before anything is read.
    assert_eq!(unsafe { ffi::engine_kv_usage(std::ptr::null(), &mut u) }, Status::InvalidArgument);
}

/// A prompt whose first whole pages are in the pool takes them: from a live stream, from a reset one,
/// from a truncated one; never its last token's page (its logits are computed), never a page past the
/// first that differs, never with the option NO. On the CPU a position's bits do not depend on how its
/// tokens were chunked, so every such stream has the logits of computing its whole prompt in one call
/// and of computing the matched prefix as a call of its own, bit for bit.
#[test]
fn prompts_take_whole_cached_pages_with_the_logits_of_computing_them() {
    let _g = serial();
    let mut rng = Rng::fresh("prompts_take_whole_cached_pages_with_the_logits_of_computing_them");
    let dir = Scratch::new("prefix-cache");
    let path = model(&dir, &mut rng);
    let vocab = llama().vocab;
    let e = init(&path, &cpu_options(256, 4));
    let reference = init(&path, &no_cache(cpu_options(256, 1)));
    let total = kv_usage(&e).tokens_total;
    let system = rng.ids(vocab, 3 * PAGE + 10);
    let question = |rng: &mut Rng, n| -> Vec<i32> { system.iter().copied().chain(rng.ids(vocab, n)).collect() };

    // Stream 0 computes the system prompt alone, then its question: its first three pages are cached.
    step(&e, 0, &system);
    step(&e, 0, &rng.ids(vocab, 7));
    // Stream 1's whole prompt takes those three pages and computes the rest.
    let p1 = question(&mut rng, 30);
    step(&e, 1, &p1);
    let tables = check_pool(&e, &[system.len() + 7, p1.len(), 0, 0], total, "a live stream's pages");
    assert_eq!(tables[1][..3], tables[0][..3], "three whole pages taken");
    assert_ne!(tables[1][3], tables[0][3], "the page the prompts part in is its own");
    let want = alone(&reference, &p1);
    assert_eq!(bits(&logits(&e, 1)), bits(&want), "the logits of computing the whole prompt in one call");
    reset(&reference, 0);
    step(&reference, 0, &p1[..3 * PAGE]);
    step(&reference, 0, &p1[3 * PAGE..]);
    assert_eq!(bits(&logits(&e, 1)), bits(&logits(&reference, 0)), "and of the prefix as a call of its own");

    // Both leave: their pages stay in the pool as cache, free for any step.
    reset(&e, 0);
    reset(&e, 1);
    let u = kv_usage(&e);
    assert_eq!(u.tokens_free, total, "every page free");
    assert!(u.tokens_cached >= 4 * PAGE as u64, "the whole pages stay cached: {u:?}");
    // A prompt of exactly the three pages takes two: its last token runs.
    step(&e, 2, &system[..3 * PAGE]);
    assert_eq!(kv_usage(&e).tokens_cached, u.tokens_cached - 2 * PAGE as u64, "two pages from the cache");
    assert_eq!(bits(&logits(&e, 2)), bits(&alone(&reference, &system[..3 * PAGE])));
    // A prompt that differs in its first token takes nothing; one that differs in page 2 takes two.
    let mut other = system.clone();
    other[0] = (other[0] + 1) % vocab as i32;
    let cached = kv_usage(&e).tokens_cached;
    step(&e, 3, &other);
    assert_eq!(kv_usage(&e).tokens_cached, cached, "no page taken");
    assert_eq!(bits(&logits(&e, 3)), bits(&alone(&reference, &other)));
    reset(&e, 3);
    let mut late = system.clone();
    late[2 * PAGE + 5] = (late[2 * PAGE + 5] + 1) % vocab as i32;
    step(&e, 3, &late);
    let tables = check_pool(&e, &[0, 0, 3 * PAGE, late.len()], total, "a prompt that parts in page 2");
    assert_eq!(tables[3][..2], tables[2][..2], "pages 0 and 1 shared with stream 2");
    assert_ne!(tables[3][2], tables[2][2]);
    assert_eq!(bits(&logits(&e, 3)), bits(&alone(&reference, &late)));

    // Truncated to a page boundary and going on the same way: the cut pages come back from the cache.
    let long = question(&mut rng, 60);
    step(&e, 1, &long);
    truncate(&e, 1, 2 * PAGE as u32);
    let cached = kv_usage(&e).tokens_cached;
    step(&e, 1, &long[2 * PAGE..]);
    assert!(kv_usage(&e).tokens_cached < cached, "the cut whole pages were taken back");
    assert_eq!(bits(&logits(&e, 1)), bits(&alone(&reference, &long)));
    // Truncated inside a cached page and going on differently: that page leaves the cache first, so a
    // stream that asks for the old tokens later does not get the new ones.
    let keep = 2 * PAGE + 3;
    truncate(&e, 1, keep as u32);
    let mut changed = long[..keep].to_vec();
    changed.extend(rng.ids(vocab, 40));
    step(&e, 1, &changed[keep..]);
    assert_eq!(bits(&logits(&e, 1)), bits(&alone(&reference, &changed)));
    reset(&e, 0);
    step(&e, 0, &long);
    assert_eq!(bits(&logits(&e, 0)), bits(&alone(&reference, &long)), "the old tokens' own pages");
    check_pool(&e, &[long.len(), changed.len(), 3 * PAGE, late.len()], total, "after the rewrites");

    // With the option NO nothing is taken from the pool.
    let off = init(&path, &no_cache(cpu_options(256, 2)));
    step(&off, 0, &system);
    step(&off, 1, &system);
    assert_eq!(kv_usage(&off).tokens_shared, 0);
    reset(&off, 0);
    assert_eq!(kv_usage(&off).tokens_cached, 0, "nothing kept");
    drop((e, reference, off));
    assert_eq!(stats(), engine_memory::default());
}

/// Host room for `tokens` positions of KV cache beside the step scratch and `streams` stream slots.
fn room_for_tokens(cfg: &ModelConfig, window: u32, streams: u32, tokens: u64) -> u64 {
    let slot = std::mem::size_of::<Option<CpuStream>>() as u64;
    let probe = engine_options { room_bytes: 1 << 40, ..cpu_options(window, streams) };
    let inputs = fit::cpu_inputs(cfg, window, streams, slot, engine::cpu_kv_types(&probe), &probe).unwrap();
    let per_token = (fit::plan_cpu(&inputs).stream_bytes.unwrap() - slot) / window as u64;
    inputs.scratch_bytes + streams as u64 * slot + tokens * per_token
}

/// A pool of 8 pages: pages no stream holds are taken when a step needs room, least recently released
/// first (a stream's last pages before its first), so a prompt that fits the free pages never fails for
/// the cache; what stays cached is still taken by a prompt that starts the same.
#[test]
fn cached_pages_are_evicted_least_recently_released_first() {
    let _g = serial();
    let mut rng = Rng::fresh("cached_pages_are_evicted_least_recently_released_first");
    let dir = Scratch::new("prefix-evict");
    let path = model(&dir, &mut rng);
    let vocab = llama().vocab;
    let window = 4 * PAGE as u32;
    let tokens = 8 * PAGE as u64;
    let opts = engine_options { room_bytes: room_for_tokens(&llama(), window, 4, tokens), ..cpu_options(window, 4) };
    let e = init(&path, &opts);
    let reference = init(&path, &no_cache(cpu_options(window, 1)));
    assert_eq!(kv_usage(&e).tokens_total, tokens, "a pool of 8 pages");
    let (a, b, c) = (rng.ids(vocab, 3 * PAGE), rng.ids(vocab, 3 * PAGE), rng.ids(vocab, 4 * PAGE));
    step(&e, 0, &a);
    let pages_a = pages(&e, 0);
    reset(&e, 0);
    step(&e, 1, &b);
    let pages_b = pages(&e, 1);
    reset(&e, 1);
    let u = kv_usage(&e);
    assert_eq!((u.tokens_free, u.tokens_cached), (tokens, 6 * PAGE as u64), "six pages cached, all free");
    // Four pages: the two never used, then a's pages 2 and 1, the oldest released.
    step(&e, 2, &c);
    let pages_c = pages(&e, 2);
    assert!(pages_c.contains(&pages_a[2]) && pages_c.contains(&pages_a[1]), "{pages_c:?} against a {pages_a:?}");
    assert!(!pages_c.contains(&pages_a[0]) && pages_b.iter().all(|p| !pages_c.contains(p)));
    assert_eq!(bits(&logits(&e, 2)), bits(&alone(&reference, &c)));
    // a again: its page 0 is still cached, page 1 is not; b's pages make the room, its last first.
    step(&e, 3, &a);
    let pages_a2 = pages(&e, 3);
    assert_eq!(pages_a2[0], pages_a[0], "a's first page from the cache");
    assert_eq!(pages_a2[1..], [pages_b[2], pages_b[1]], "b's last pages evicted for the rest");
    assert_eq!(bits(&logits(&e, 3)), bits(&alone(&reference, &a)));
    assert_eq!(kv_usage(&e).tokens_free, PAGE as u64, "b's page 0 is left, cached");
    // A prompt that needs two pages with one free (cached) page is NO_ROOM, as without the cache.
    assert_eq!(try_step(&e, 1, &rng.ids(vocab, PAGE + 1)).0, Status::NoRoom);
    check_pool(&e, &[0, 0, 4 * PAGE, 3 * PAGE], tokens, "after the refusal");
    // c leaves; b's first page again: taken from the cache, and its second page is c's last, released
    // before c's others.
    reset(&e, 2);
    step(&e, 1, &b[..PAGE + 1]);
    assert_eq!(pages(&e, 1), [pages_b[0], pages_c[3]], "b's first page from the cache");
    assert_eq!(bits(&logits(&e, 1)), bits(&alone(&reference, &b[..PAGE + 1])));
    check_pool(&e, &[0, PAGE + 1, 0, 3 * PAGE], tokens, "at the end");
}

/// One random call after another on many streams: prompts that share system prompts or repeat a reset
/// stream's, single tokens, batches, forks, truncates, resets and scores, against a second engine that
/// computes every stream alone from its tokens with the cache off: the same logits and log-probabilities,
/// bit for bit; after every call the pool's counts agree with every stream's pages and engine_kv_usage
/// adds up. With a pool too small for every stream, an item is NO_ROOM exactly when it would be without
/// the cache.
#[test]
fn random_calls_match_computing_each_stream_alone() {
    let _g = serial();
    let mut rng = Rng::fresh("random_calls_match_computing_each_stream_alone");
    let dir = Scratch::new("prefix-random");
    let path = model(&dir, &mut rng);
    let (window, streams) = (160u32, 6u32);
    let roomy = cpu_options(window, streams);
    let tight = engine_options { room_bytes: room_for_tokens(&llama(), window, streams, 14 * PAGE as u64), ..roomy };
    let seen = random_calls("roomy", &path, &roomy, 800, &mut rng);
    assert!(seen.steps > 50 && seen.forks > 10 && seen.scores > 5, "too few calls: {seen:?}");
    assert!(seen.live_hits > 0 && seen.cache_hits > 0 && seen.copies > 0, "nothing shared: {seen:?}");
    let seen = random_calls("tight", &path, &tight, 500, &mut rng);
    assert!(seen.steps > 30 && seen.pool_full > 0, "too few calls, or no refusal for the pool: {seen:?}");
    assert_eq!(stats(), engine_memory::default());
}

#[derive(Debug, Default)]
struct Seen {
    steps: usize,
    forks: usize,
    scores: usize,
    live_hits: usize,
    cache_hits: usize,
    no_room: usize,
    /// NO_ROOM from the pool, not the window.
    pool_full: usize,
    copies: usize,
}

fn random_calls(what: &str, path: &std::path::Path, opts: &engine_options, rounds: usize, rng: &mut Rng) -> Seen {
    let vocab = llama().vocab;
    let e = init(path, opts);
    let reference = init(path, &no_cache(cpu_options(opts.context, 1)));
    let i = info(&e);
    let (streams, window) = (i.streams as usize, i.window as usize);
    let total = kv_usage(&e).tokens_total;
    let systems: Vec<Vec<i32>> = (0..3).map(|k| rng.ids(vocab, 40 + 35 * k)).collect();
    let mut hist: Vec<Vec<i32>> = vec![Vec::new(); streams];
    // What each stream held before its last reset: asked for again now and then.
    let mut gone: Vec<Vec<i32>> = vec![Vec::new(); streams];
    let mut seen = Seen::default();
    let lens = |hist: &[Vec<i32>]| hist.iter().map(Vec::len).collect::<Vec<_>>();
    let mut tables = check_pool(&e, &lens(&hist), total, what);
    for round in 0..rounds {
        let at = format!("{what} round {round}");
        let s = rng.below(streams as u64) as usize;
        // A stream near its window starts again.
        if hist[s].len() + 2 * PAGE > window {
            reset(&e, s as u32);
            gone[s] = std::mem::take(&mut hist[s]);
        }
        match rng.below(100) {
            // A prompt, a chunk or a token on one stream.
            0..40 => {
                let tokens = next_tokens(rng, &hist[s], &gone[s], &systems, vocab);
                let u = kv_usage(&e);
                let need = need_without_cache(&tables, s, hist[s].len(), tokens.len());
                let (st, _) = try_step(&e, s as u32, &tokens);
                if hist[s].len() + tokens.len() > window {
                    assert_eq!(st, Status::NoRoom, "{at}: past the window");
                } else if need > u.tokens_free as usize / PAGE {
                    // Without the cache it would not fit either; the cache may still make it fit.
                    assert!(matches!(st, Status::Ok | Status::NoRoom), "{at}: {st:?} {}", last_error());
                    seen.pool_full += (st == Status::NoRoom) as usize;
                } else {
                    assert_eq!(st, Status::Ok, "{at}: {need} pages with {} free: {}", u.tokens_free, last_error());
                }
                if st == Status::Ok {
                    let from = hist[s].len();
                    hist[s].extend(&tokens);
                    let new = check_pool(&e, &lens(&hist), total, &at);
                    count_hits(&mut seen, &tables, &new, s, from, &u, &kv_usage(&e), need);
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
                    order.iter().map(|&s| next_tokens(rng, &hist[s], &gone[s], &systems, vocab)).collect();
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
                tables = check_pool(&e, &lens(&hist), total, &at);
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
                tables = check_pool(&e, &lens(&hist), total, &at);
            }
            66..76 => {
                let keep = rng.below(hist[s].len() as u64 + 1) as usize;
                truncate(&e, s as u32, keep as u32);
                hist[s].truncate(keep);
                tables = check_pool(&e, &lens(&hist), total, &at);
            }
            76..88 => {
                reset(&e, s as u32);
                gone[s] = std::mem::take(&mut hist[s]);
                tables = check_pool(&e, &lens(&hist), total, &at);
            }
            // A score: the log-probabilities of computing the stream alone, then scoring the tokens.
            _ => {
                let tokens = next_tokens(rng, &hist[s], &gone[s], &systems, vocab);
                let (st, got) = try_score(&e, s as u32, &tokens);
                if hist[s].len() + tokens.len() > window {
                    assert_eq!(st, Status::NoRoom, "{at}: past the window");
                }
                if st != Status::Ok {
                    assert_eq!(st, Status::NoRoom, "{at}: {}", last_error());
                    seen.no_room += 1;
                    seen.pool_full += (hist[s].len() + tokens.len() <= window) as usize;
                    tables = check_pool(&e, &lens(&hist), total, &at);
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
                tables = check_pool(&e, &lens(&hist), total, &at);
                seen.scores += 1;
            }
        }
    }
    println!("{what}: {seen:?}");
    for s in 0..streams {
        reset(&e, s as u32);
    }
    check_pool(&e, &vec![0; streams], total, what);
    assert_eq!(kv_usage(&e).tokens_free, total, "{what}: whole after the resets");
    seen
}

/// What a stream is fed next: its last token again, a chunk of new ids, a system prompt and a question
/// (from an empty stream), or what it held before its last reset.
fn next_tokens(rng: &mut Rng, hist: &[i32], gone: &[i32], systems: &[Vec<i32>], vocab: usize) -> Vec<i32> {
    match rng.below(8) {
        0 | 1 if hist.is_empty() && !gone.is_empty() => {
            let n = gone.len().min(PAGE + 1 + rng.below(gone.len() as u64) as usize);
            gone[..n].to_vec()
        }
        0..4 if hist.is_empty() => {
            let mut t = systems[rng.below(systems.len() as u64) as usize].clone();
            let n = 1 + rng.below(30) as usize;
            t.extend(rng.ids(vocab, n));
            t
        }
        4 | 5 => {
            let n = 1 + rng.below(3 * PAGE as u64) as usize;
            rng.ids(vocab, n)
        }
        _ => rng.ids(vocab, 1),
    }
}

/// Pages an item of `n` tokens on stream `s` (of `len` positions) takes from the pool without the cache:
/// those its new positions need, and a copy of its last page when another stream holds it.
fn need_without_cache(tables: &[Vec<u32>], s: usize, len: usize, n: usize) -> usize {
    let grow = (len + n).div_ceil(PAGE) - len.div_ceil(PAGE);
    let shared =
        len % PAGE != 0 && tables.iter().enumerate().any(|(o, t)| o != s && t.contains(&tables[s][len / PAGE]));
    grow + shared as usize
}

/// Counts what a step of stream `s` from `from` took: pages another stream holds (live), pages that
/// came from the cache (its count fell while free pages outside it were enough), and copies.
#[allow(clippy::too_many_arguments)]
fn count_hits(
    seen: &mut Seen,
    before: &[Vec<u32>],
    after: &[Vec<u32>],
    s: usize,
    from: usize,
    u0: &engine_kv_usage,
    u1: &engine_kv_usage,
    need: usize,
) {
    let new = &after[s][from / PAGE..];
    let others_before: Vec<u32> =
        before.iter().enumerate().filter(|&(o, _)| o != s).flat_map(|(_, t)| t.iter().copied()).collect();
    seen.live_hits += new.iter().filter(|p| others_before.contains(p)).count();
    // The cache loses the pages taken from it and those evicted for room, which is at most what the free
    // pages outside it could not give.
    let outside = (u0.tokens_free - u0.tokens_cached) as usize / PAGE;
    let fell = (u0.tokens_cached.saturating_sub(u1.tokens_cached)) as usize / PAGE;
    if fell > need.saturating_sub(outside) {
        seen.cache_hits += 1;
    }
    if from % PAGE != 0 && before[s].get(from / PAGE) != after[s].get(from / PAGE) {
        seen.copies += 1;
    }
}

/// engine_score against a float64 softmax of engine_logits stepped one token at a time, within 1e-5:
/// from an empty stream (the first NaN), after a step (the kept logits), after a truncate (the last
/// position computed again), over several chunks; engine_logits after it and the steps after it are the
/// token-by-token run's, bit for bit, and so are engine_top_logprobs's.
#[test]
fn score_is_the_log_softmax_of_stepping_token_by_token() {
    let _g = serial();
    let mut rng = Rng::fresh("score_is_the_log_softmax_of_stepping_token_by_token");
    let dir = Scratch::new("prefix-score");
    let path = model(&dir, &mut rng);
    let vocab = llama().vocab;
    let e = init(&path, &cpu_options(512, 3));
    let by_token = init(&path, &no_cache(cpu_options(512, 1)));
    let text = rng.ids(vocab, 300);
    // Every position's logits, one step a token.
    let mut want: Vec<Vec<f32>> = Vec::with_capacity(text.len());
    for t in &text {
        step(&by_token, 0, std::slice::from_ref(t));
        want.push(logits(&by_token, 0));
    }
    let log_p = |l: &[f32], id: i32| -> f64 {
        let max = l.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let log_z = max + l.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
        l[id as usize] as f64 - log_z
    };
    let check = |got: &[f32], from: usize, what: &str| {
        for (k, &lp) in got.iter().enumerate() {
            let i = from + k;
            if i == 0 {
                assert!(lp.is_nan(), "{what}: the first token of an empty stream");
                continue;
            }
            let w = log_p(&want[i - 1], text[i]);
            assert!((lp as f64 - w).abs() <= 1e-5, "{what}: token {i}: {lp} against {w}");
        }
    };
    // From empty, over three chunks.
    let got = score(&e, 0, &text[..150]);
    check(&got, 0, "from empty");
    assert_eq!(bits(&logits(&e, 0)), bits(&want[149]), "logits after the score");
    // After a step: the kept logits give the first.
    step(&e, 0, &text[150..160]);
    let got = score(&e, 0, &text[160..200]);
    check(&got, 160, "after a step");
    // After a truncate nothing is kept: the last position runs again with the tokens.
    truncate(&e, 0, 190);
    let got = score(&e, 0, &text[190..230]);
    check(&got, 190, "after a truncate");
    assert_eq!(bits(&logits(&e, 0)), bits(&want[229]));
    // A single token, then steps: the cache holds what the steps would have left.
    let got = score(&e, 0, &text[230..231]);
    check(&got, 230, "one token");
    for i in 231..240 {
        step(&e, 0, &text[i..i + 1]);
        assert_eq!(bits(&logits(&e, 0)), bits(&want[i]), "a step after the scores, token {i}");
    }
    // Scored on a fork of a stream that was itself scored.
    assert_eq!(fork(&e, 0, 1, 200), Status::Ok, "{}", last_error());
    let got = score(&e, 1, &text[200..300]);
    check(&got, 200, "a fork");
    let mut ids = vec![-1i32; 3];
    let mut lps = vec![f32::NAN; 3];
    // SAFETY: a live engine, room for three ids and three floats.
    let st = unsafe { ffi::engine_top_logprobs(e.0, 1, 3, ids.as_mut_ptr(), lps.as_mut_ptr()) };
    assert_eq!(st, Status::Ok, "{}", last_error());
    for (&id, &lp) in ids.iter().zip(&lps) {
        assert!((lp as f64 - log_p(&want[299], id)).abs() <= 1e-5, "top_logprobs after a score");
    }
    let total = kv_usage(&e).tokens_total;
    check_pool(&e, &[240, 300, 0], total, "after the scores");
}

/// A score past the window, with an id outside the vocabulary, of no tokens, on a stream the engine
/// does not have, or with NULLs is refused with a clear status and changes nothing.
#[test]
fn score_refusals_change_nothing() {
    let _g = serial();
    let mut rng = Rng::fresh("score_refusals_change_nothing");
    let dir = Scratch::new("prefix-score-refusals");
    let path = model(&dir, &mut rng);
    let vocab = llama().vocab;
    let e = init(&path, &cpu_options(64, 2));
    let total = kv_usage(&e).tokens_total;
    step(&e, 0, &rng.ids(vocab, 40));
    let kept = logits(&e, 0);
    let usage = kv_usage(&e);
    let tables = check_pool(&e, &[40, 0], total, "before");
    let mut bad = rng.ids(vocab, 5);
    bad[3] = vocab as i32;
    let refusals: [(u32, Vec<i32>, Status, &str); 4] = [
        (0, rng.ids(vocab, 25), Status::NoRoom, "past the window"),
        (0, bad, Status::OutOfRange, "an id outside the vocabulary"),
        (0, Vec::new(), Status::InvalidArgument, "no tokens"),
        (2, rng.ids(vocab, 1), Status::OutOfRange, "a stream not admitted"),
    ];
    for (stream, tokens, want, what) in refusals {
        let mut out = vec![-7f32; tokens.len().max(1)];
        // SAFETY: a live engine, `tokens.len()` ids and room for as many floats.
        let st = unsafe { ffi::engine_score(e.0, stream, tokens.as_ptr(), tokens.len(), out.as_mut_ptr()) };
        assert_eq!(st, want, "{what}: {}", last_error());
        assert!(!last_error().is_empty(), "{what}: a message");
        assert!(out.iter().all(|&v| v == -7.0), "{what}: nothing written");
        assert_eq!(check_pool(&e, &[40, 0], total, what), tables, "{what}: the pages");
        assert_eq!(kv_usage(&e), usage, "{what}: the pool");
        assert_eq!(bits(&logits(&e, 0)), bits(&kept), "{what}: the logits");
    }
    let ids = [3i32];
    let mut out = [0f32];
    // SAFETY: NULLs are refused before anything is read or written.
    unsafe {
        assert_eq!(ffi::engine_score(e.0, 0, std::ptr::null(), 1, out.as_mut_ptr()), Status::InvalidArgument);
        assert_eq!(ffi::engine_score(e.0, 0, ids.as_ptr(), 1, std::ptr::null_mut()), Status::InvalidArgument);
        assert_eq!(
            ffi::engine_score(std::ptr::null_mut(), 0, ids.as_ptr(), 1, out.as_mut_ptr()),
            Status::InvalidArgument
        );
    }
    assert_eq!(stream_len(&e, 0), 40);
    assert_eq!(bits(&logits(&e, 0)), bits(&kept));
}
