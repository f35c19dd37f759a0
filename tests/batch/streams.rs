//! Per-stream sampling, and threads batching, truncating, resetting and re-sampling their own streams on one engine.

use super::{model, random_ids};
use crate::common::{
    Held, Rng, Scratch, cpu_options, init, kv_stats, logits, on_threads, random_sampling, reset, serial, set_sampling,
    stream_len, truncate, try_batch,
};
use hostembed::engine::engine_options;
use hostembed::sampler::Sampling;
use hostembed::status::last_error;
use hostembed::{Status, engine, ffi, sampler};

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
