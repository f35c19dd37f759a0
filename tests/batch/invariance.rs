//! Batches against stepping each stream alone: random mixes, 64 single-token items, random calls.

use super::{PAGE, model, qwen2, random_ids};
use crate::common::{
    Mix, Rng, Scratch, batches_match_stepping_alone, bits, cpu_options, info, init, kv_stats, logits, random_sampling,
    reset, room_for_tokens, serial, set_sampling, stats, step, stream_len, truncate, try_batch,
};
use hostembed::engine::engine_options;
use hostembed::placement::engine_memory;
use hostembed::status::last_error;
use hostembed::{Status, ffi};

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
