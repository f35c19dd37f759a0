//! Streams in batches on CUDA: truncate and re-step, 64 long streams sharing the KV page pool, per-stream sampling.

use super::{batch_cuda, ids, write_formats};
use crate::common::{
    Rng, Scratch, bits, device_info, gpu_present, info, init, kv_stats, logits, rel_l2, reset, serial, set_sampling,
    stats, step, stream_len, truncate, try_batch,
};
use hostembed::checkpoint::Checkpoint;
use hostembed::engine::{engine_options, engine_tristate};
use hostembed::placement::engine_memory;
use hostembed::sampler::Sampling;
use hostembed::status::last_error;
use hostembed::{Status, engine, ffi, fit, sampler};

/// engine_truncate on CUDA: stepping the same tokens again after a truncate gives the same logits, bit
/// for bit, and the pool gets back the pages past the new length.
#[test]
fn truncate_then_restep_is_bit_identical_on_cuda() {
    if !gpu_present("truncate_then_restep_is_bit_identical_on_cuda") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("truncate_then_restep_is_bit_identical_on_cuda");
    let dir = Scratch::new("batch-truncate");
    let path = &write_formats(&dir.0, &[])[0].path;
    // The prefix cache off: re-stepped from 0, the prompt would take its own cached pages and run its
    // last page as a chunk of its own (tests/gpu_prefix.rs holds that to its own bound).
    let e = init(path, &engine_options { prefix_cache: engine_tristate::No, ..batch_cuda(512, 2) });
    let (total, free) = kv_stats(&e);
    assert_eq!(free, total);
    let mut fed = ids(&mut rng, 150);
    let mut want = vec![(fed.len(), step(&e, 0, &fed.clone()), logits(&e, 0))];
    for _ in 0..40 {
        let t = want.last().unwrap().1;
        fed.push(t);
        want.push((fed.len(), step(&e, 0, &[t]), logits(&e, 0)));
    }
    // Past the prompt every position was a single token: re-stepping from there repeats every bit. From 0
    // the whole prompt chunk runs again: every bit too. From inside the prompt the rest of it runs as a
    // shorter chunk, which may take another path: within the prompt-chunk bound.
    for keep in [189u32, 160, 151, 150, 0, 149, 100, 17, 1] {
        truncate(&e, 0, keep);
        assert_eq!(stream_len(&e, 0), keep);
        let (_, free_now) = kv_stats(&e);
        assert!(total - free_now >= keep as u64, "kept {keep}: {} positions held", total - free_now);
        let keep = keep as usize;
        let exact = keep == 0 || keep >= 150;
        let mut at = keep;
        // A truncate drops the stream's logits: compare only after something was stepped again.
        let mut stepped = false;
        if keep < 150 {
            step(&e, 0, &fed[keep..150]);
            at = 150;
            stepped = true;
        }
        let mut compared = 0;
        loop {
            if let Some((_, _, l)) = want.iter().find(|(n, _, _)| *n == at).filter(|_| stepped) {
                let got = logits(&e, 0);
                if exact {
                    assert!(bits(&got) == bits(l), "kept {keep}: logits after {at}");
                } else {
                    let rel = rel_l2(&got, l);
                    assert!(rel <= 2e-3, "kept {keep}: logits after {at} {rel:.3e} from the first run");
                }
                compared += 1;
            }
            if at == fed.len() {
                break;
            }
            let got = step(&e, 0, &fed[at..at + 1]);
            at += 1;
            stepped = true;
            let first_run = want.iter().find(|(n, _, _)| *n == at).map(|w| w.1);
            if exact && first_run.is_some() {
                assert_eq!(Some(got), first_run, "kept {keep}: token after {at}");
            }
        }
        assert!(compared > 0, "kept {keep}: nothing compared");
    }
    reset(&e, 0);
    assert_eq!(kv_stats(&e), (total, total), "whole after the reset");
}

/// Room for two full 64k windows and 64 streams: 64 streams of 2,048 tokens are admitted and decoded
/// (the pool, not the window count, bounds them); one more page for any of them is NO_ROOM for that item
/// alone; each stream's logits match it stepped alone on a second engine; resets make the pool whole.
#[test]
fn sixty_four_streams_of_2048_tokens_share_two_64k_windows_on_cuda() {
    if !gpu_present("sixty_four_streams_of_2048_tokens_share_two_64k_windows_on_cuda") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("sixty_four_streams_of_2048_tokens_share_two_64k_windows_on_cuda");
    let dir = Scratch::new("batch-pool");
    let path = &write_formats(&dir.0, &[])[0].path;
    let window = 65536u32;
    let base = engine_options { reserve_bytes: 0, ..batch_cuda(window, 1) };
    let ckpt = Checkpoint::open(path).unwrap();
    let inputs = engine::fit_inputs(&ckpt, &base, Some(&device_info())).unwrap();
    let plan = fit::plan(&inputs).unwrap();
    let room = plan.on_card_bytes + 2 * plan.stream_bytes;
    let opts = engine_options { room_bytes: room, max_streams: 64, ..base };
    let e = init(path, &opts);
    assert_eq!(info(&e).streams, 64, "max_streams streams over a pool of two windows");
    // SAFETY: engine_plan is numbers and enums with a variant at 0: all zeros is a value of it.
    let mut plan_of = unsafe { std::mem::zeroed() };
    // SAFETY: a live engine and a writable engine_plan.
    assert_eq!(unsafe { ffi::engine_plan_of(e.0, &mut plan_of) }, Status::Ok);
    assert_eq!(plan_of.streams, 2, "the fit counts two full windows");
    // SAFETY: engine_plan is numbers and enums with a variant at 0: all zeros is a value of it.
    let mut device_0 = unsafe { std::mem::zeroed() };
    // SAFETY: a live engine and a writable engine_plan.
    assert_eq!(unsafe { ffi::engine_plan_of_device(e.0, 0, &mut device_0) }, Status::Ok);
    assert_eq!(device_0, plan_of, "one device's plan is the engine's");
    // SAFETY: as above.
    assert_eq!(unsafe { ffi::engine_plan_of_device(e.0, 1, &mut device_0) }, Status::InvalidArgument);
    let (total, free) = kv_stats(&e);
    println!("pool: {total} positions ({free} free) for two {window}-token windows");
    assert!(total >= 2 * window as u64 && total < 2 * window as u64 + 4096, "a pool of two windows: {total}");

    let prompts: Vec<Vec<i32>> = (0..64).map(|_| ids(&mut rng, 2047)).collect();
    // The prompts in batches of 8 chunks of up to 512 tokens.
    let mut at = vec![0usize; 64];
    let mut next = vec![0i32; 64];
    while at.iter().any(|&a| a < 2047) {
        let mut batch: Vec<(u32, &[i32])> = Vec::new();
        for s in 0..64 {
            if at[s] < 2047 && batch.len() < 8 {
                let end = (at[s] + 512).min(2047);
                batch.push((s as u32, &prompts[s][at[s]..end]));
                at[s] = end;
            }
        }
        let (st, out) = try_batch(&e, &batch);
        assert_eq!(st, Status::Ok, "{}", last_error());
        for (&(s, _), &(item, t)) in batch.iter().zip(&out) {
            assert_eq!(item, Status::Ok, "stream {s}'s prompt: {}", last_error());
            next[s as usize] = t;
        }
    }
    // One token each, all 64 in one call: 2,048 positions a stream.
    let inputs: Vec<[i32; 1]> = next.iter().map(|&t| [t]).collect();
    let batch: Vec<(u32, &[i32])> = (0..64u32).map(|s| (s, inputs[s as usize].as_slice())).collect();
    let (st, out) = try_batch(&e, &batch);
    assert_eq!(st, Status::Ok);
    assert!(out.iter().all(|o| o.0 == Status::Ok), "{out:?}: {}", last_error());
    assert!((0..64).all(|s| stream_len(&e, s) == 2048));
    let logits_4 = logits(&e, 4);
    let (_, free) = kv_stats(&e);
    assert_eq!(free, total - 64 * 2048, "every stream holds exactly its 2,048 positions");
    // Compare a few streams with themselves alone on an engine of one window.
    let reference = init(path, &batch_cuda(4096, 1));
    for s in [0u32, 17, 63] {
        reset(&reference, 0);
        step(&reference, 0, &prompts[s as usize]);
        step(&reference, 0, &inputs[s as usize]);
        let rel = rel_l2(&logits(&e, s), &logits(&reference, 0));
        assert!(rel <= 2e-3, "stream {s}: {rel:.3e} relative L2 from alone");
    }
    // Where the pool has no page left, the item that needs one fails alone.
    // Stream 4 steps its last position again (a page it holds); stream 3 needs a page past the pool's.
    if free < 64 {
        truncate(&e, 4, 2047);
        let more = ids(&mut rng, 64);
        let (st, out) = try_batch(&e, &[(3, &more), (4, &inputs[4])]);
        assert_eq!(st, Status::Ok);
        assert_eq!(out[0], (Status::NoRoom, -1), "{}", last_error());
        assert_eq!(stream_len(&e, 3), 2048, "the refused item appended nothing");
        assert_eq!((out[1], stream_len(&e, 4)), ((Status::Ok, out[1].1), 2048), "{}", last_error());
        assert!(bits(&logits(&e, 4)) == bits(&logits_4), "stream 4 re-stepped: the same logits");
    }
    for s in 0..64 {
        reset(&e, s);
    }
    assert_eq!(kv_stats(&e), (total, total), "whole after the resets");
    drop((e, reference));
    assert_eq!(stats(), engine_memory::default());
}

/// The device sampler through the engine: each stream's token is `sampler::sample_stream` of its own
/// settings (min-p and the penalty included) on the logits the engine reports, stream by stream in
/// one batch.
#[test]
fn per_stream_sampling_on_cuda_is_the_cpu_samplers_choice() {
    if !gpu_present("per_stream_sampling_on_cuda_is_the_cpu_samplers_choice") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("per_stream_sampling_on_cuda_is_the_cpu_samplers_choice");
    let dir = Scratch::new("batch-sampling");
    let path = &write_formats(&dir.0, &[])[0].path;
    let e = init(path, &batch_cuda(256, 4));
    let settings = [
        Sampling::GREEDY,
        Sampling { repeat_penalty: 2.0, repeat_last_n: 64, ..Sampling::GREEDY },
        Sampling {
            temperature: 1.2,
            top_k: 50,
            min_p: 0.05,
            repeat_penalty: 1.4,
            repeat_last_n: 16,
            seed: 9,
            ..Sampling::GREEDY
        },
        Sampling { temperature: 0.8, top_p: 0.9, min_p: 0.2, seed: 4, ..Sampling::GREEDY },
    ];
    for (s, sampling) in settings.iter().enumerate() {
        set_sampling(&e, s as u32, sampling);
    }
    let mut history: Vec<Vec<u32>> = vec![Vec::new(); 4];
    let mut feed: Vec<Vec<i32>> = (0..4).map(|_| ids(&mut rng, 12)).collect();
    for round in 0..40 {
        let batch: Vec<(u32, &[i32])> = (0..4u32).map(|s| (s, feed[s as usize].as_slice())).collect();
        let (st, out) = try_batch(&e, &batch);
        assert_eq!(st, Status::Ok, "{}", last_error());
        for s in 0..4usize {
            assert_eq!(out[s].0, Status::Ok);
            let new: Vec<u32> = feed[s].iter().map(|&t| t as u32).collect();
            let want = sampler::sample_stream(&logits(&e, s as u32), &settings[s], s as u32, &history[s], &new);
            assert_eq!(out[s].1 as u32, want, "round {round} stream {s}: {:?}", settings[s]);
            history[s].extend(&new);
            feed[s] = vec![out[s].1];
        }
    }
}
