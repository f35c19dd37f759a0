//! Shared KV pages on the CPU backend through the C ABI: engine_fork (the source's pages shared, the
//! page a stream writes into copied first), the prefix cache (a prompt's first whole pages taken from
//! pages in the pool, live or kept from a reset, evicted least recently released first, never refusing
//! what would fit without it), engine_kv_usage, and engine_score. Every stream's logits are checked bit
//! for bit against a second engine that computes each stream alone with the cache off, and the pool's
//! counts against every stream's page table after every call.

mod common;
use common::shared::{self, alone, fork, kv_usage, no_cache, pages, prefix_stats, score};
use common::{Held, Rng, Scratch, bits, cpu_options, init, logits, serial, stats, step, try_step};
use common::{reset, room_for_tokens, stream_len, truncate, try_batch};

use hostembed::Status;
use hostembed::abi::engine_kv_usage;
use hostembed::engine::engine_options;
use hostembed::ffi;
use hostembed::model::ModelConfig;
use hostembed::placement::engine_memory;
use hostembed::status::last_error;
use hostembed::tensor::DType;
use std::path::PathBuf;

/// Positions in one page of the CPU backend's pool.
const PAGE: usize = hostembed::cpu::PAGE_TOKENS;

/// A small Llama with GQA 2:1 and an untied head.
fn llama() -> ModelConfig {
    ModelConfig {
        rope_theta: 10000.0,
        max_position: 512,
        bos: Some(1),
        eos: Some(2),
        ..ModelConfig::llama(64, 2, 4, 2, 128, 256)
    }
}

fn model(dir: &Scratch, rng: &mut Rng) -> PathBuf {
    dir.gguf("llama", &llama(), rng.next_u64(), DType::Q8_0)
}

/// `shared::check_pool` with the CPU's pages.
fn check_pool(e: &Held, lens: &[usize], total: u64, what: &str) -> Vec<Vec<u32>> {
    shared::check_pool(e, lens, total, PAGE, what)
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

/// engine_prefix_stats counts each stream's tokens since its reset: those the cache's pages stood for and
/// those computed (a score's too); a fork starts from nothing, a refused step counts nothing.
#[test]
fn prefix_stats_count_cached_and_computed_tokens() {
    let _g = serial();
    let mut rng = Rng::fresh("prefix_stats_count_cached_and_computed_tokens");
    let dir = Scratch::new("prefix-stats");
    let path = model(&dir, &mut rng);
    let vocab = llama().vocab;
    let e = init(&path, &cpu_options(256, 4));
    let system = rng.ids(vocab, 3 * PAGE + 10);
    assert_eq!(prefix_stats(&e, 0), (0, 0), "a stream never stepped");
    step(&e, 0, &system);
    step(&e, 0, &rng.ids(vocab, 7));
    assert_eq!(prefix_stats(&e, 0), (0, 3 * PAGE as u64 + 17), "nothing cached yet: every token computed");
    let mut p1 = system.clone();
    p1.extend(rng.ids(vocab, 30));
    step(&e, 1, &p1);
    assert_eq!(prefix_stats(&e, 1), (3 * PAGE as u64, 40), "three whole pages from the cache");
    score(&e, 1, &rng.ids(vocab, 5));
    assert_eq!(prefix_stats(&e, 1), (3 * PAGE as u64, 45), "a score's tokens are computed");
    assert_eq!(try_step(&e, 1, &rng.ids(vocab, 300)).0, Status::NoRoom);
    assert_eq!(prefix_stats(&e, 1), (3 * PAGE as u64, 45), "a refused step counts nothing");
    assert_eq!(fork(&e, 1, 2, 50), Status::Ok, "{}", last_error());
    assert_eq!(prefix_stats(&e, 2), (0, 0), "a fork's shared positions are neither");
    reset(&e, 0);
    assert_eq!(prefix_stats(&e, 0), (0, 0), "a reset starts the counts again");
    // A prompt of exactly the three pages takes two: its last token runs.
    step(&e, 0, &system[..3 * PAGE]);
    assert_eq!(prefix_stats(&e, 0), (2 * PAGE as u64, PAGE as u64));
    // SAFETY: a live engine; NULL outputs are allowed.
    assert_eq!(unsafe { ffi::engine_prefix_stats(e.0, 0, std::ptr::null_mut(), std::ptr::null_mut()) }, Status::Ok);
    // SAFETY: a stream the engine does not have is refused before any output is written.
    let past = unsafe { ffi::engine_prefix_stats(e.0, 9, std::ptr::null_mut(), std::ptr::null_mut()) };
    assert_eq!(past, Status::OutOfRange);
    // SAFETY: NULL is refused.
    let null = unsafe { ffi::engine_prefix_stats(std::ptr::null(), 0, std::ptr::null_mut(), std::ptr::null_mut()) };
    assert_eq!(null, Status::InvalidArgument);
    drop(e);
    assert_eq!(stats(), engine_memory::default());
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
    let reference = no_cache(cpu_options(window, 1));
    let calls = |opts| shared::Calls { path: &path, opts, reference: &reference, vocab: llama().vocab, page: PAGE };
    let seen = shared::random_calls("roomy", &calls(&roomy), 800, &mut rng);
    assert!(seen.steps > 50 && seen.forks > 10 && seen.scores > 5, "too few calls: {seen:?}");
    assert!(seen.live_hits > 0 && seen.cache_hits > 0 && seen.copies > 0, "nothing shared: {seen:?}");
    let seen = shared::random_calls("tight", &calls(&tight), 500, &mut rng);
    assert!(seen.steps > 30 && seen.pool_full > 0, "too few calls, or no refusal for the pool: {seen:?}");
    assert_eq!(stats(), engine_memory::default());
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
