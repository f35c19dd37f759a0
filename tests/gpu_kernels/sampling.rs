//! The single-row sampler against the CPU's: greedy, sampled, min-p, repetition penalty, bad logits, refusals.

use super::{NULL_STREAM, SAMPLE_SETTINGS, device_sample_penalized, poisoned, sample_logits};
use crate::common::{Rng, gpu_present};
use hostembed::cuda::DeviceBuffer;
use hostembed::sampler::Sampling;
use hostembed::{kernels as kn, sampler};
use std::os::raw::{c_int, c_uint, c_void};
use std::ptr;

/// Runs the device sampler once, on a poisoned scratch of the size GpuModel gives it (8 bytes a token).
fn device_sample(logits: &DeviceBuffer, vocab: usize, s: &Sampling, stream: u32, position: u64) -> u32 {
    device_sample_penalized(logits, vocab, s, stream, position, &[])
}

/// The vocabularies the sampler tests run: one block below 8192 logits, many blocks from there, and the
/// Llama-3 and Qwen2 sizes.
const SAMPLE_VOCABS: [usize; 9] = [1, 2, 256, 4096, 8191, 8192, 32000, 128256, 151936];

#[test]
fn greedy_sampling_is_the_cpu_argmax() {
    if !gpu_present("greedy_sampling_is_the_cpu_argmax") {
        return;
    }
    let mut rng = Rng::fresh("greedy_sampling_is_the_cpu_argmax");
    for vocab in SAMPLE_VOCABS {
        let mut logits = rng.vec(vocab, 10.0);
        if vocab > 10 {
            // Several equal maxima: the lowest index wins.
            for _ in 0..3 {
                let i = rng.below(vocab as u64) as usize;
                logits[i] = 11.0;
            }
        }
        let d = DeviceBuffer::from_slice(&logits).unwrap();
        for temperature in [0.0, -1.0, f32::NAN] {
            let s = Sampling { temperature, ..Sampling::GREEDY };
            assert_eq!(
                device_sample(&d, vocab, &s, 0, 0),
                sampler::argmax(&logits),
                "vocab {vocab}, temperature {temperature}"
            );
        }
        // top_k = 1 is greedy at any temperature.
        let s = Sampling { temperature: 0.8, top_k: 1, top_p: 0.9, seed: rng.next_u64(), ..Sampling::GREEDY };
        assert_eq!(device_sample(&d, vocab, &s, 1, 5), sampler::argmax(&logits), "vocab {vocab}, top_k 1");
    }
    // The total order of f32: +0 above -0, and the largest logit at the very last index.
    let mut logits = vec![-0.0f32; 20000];
    logits[7] = 0.0;
    let d = DeviceBuffer::from_slice(&logits).unwrap();
    assert_eq!(device_sample(&d, logits.len(), &Sampling::GREEDY, 0, 0), 7);
    logits[19999] = 1.0;
    let d = DeviceBuffer::from_slice(&logits).unwrap();
    assert_eq!(device_sample(&d, logits.len(), &Sampling::GREEDY, 0, 0), 19999);
}

#[test]
fn sampled_tokens_match_the_cpu_sampler() {
    if !gpu_present("sampled_tokens_match_the_cpu_sampler") {
        return;
    }
    let mut rng = Rng::fresh("sampled_tokens_match_the_cpu_sampler");
    let (mut compared, mut not_argmax) = (0, 0);
    for vocab in SAMPLE_VOCABS {
        for kind in 0..3 {
            let logits = sample_logits(&mut rng, vocab, kind);
            let d = DeviceBuffer::from_slice(&logits).unwrap();
            let arg = sampler::argmax(&logits);
            for &(temperature, top_k, top_p) in &SAMPLE_SETTINGS {
                for _ in 0..3 {
                    let s = Sampling { temperature, top_k, top_p, seed: rng.next_u64(), ..Sampling::GREEDY };
                    let (stream, position) = (rng.below(8) as u32, rng.below(1 << 40));
                    let got = device_sample(&d, vocab, &s, stream, position);
                    let want = sampler::sample(&logits, &s, stream, position);
                    assert_eq!(got, want, "vocab {vocab} kind {kind} {s:?} stream {stream} position {position}");
                    assert_eq!(got, device_sample(&d, vocab, &s, stream, position), "repeat");
                    compared += 1;
                    not_argmax += (got != arg) as usize;
                }
            }
        }
    }
    println!("{compared} draws identical to src/sampler.rs, {not_argmax} of them not the argmax");
    // The draws did sample: most settings spread over many tokens.
    assert!(not_argmax * 3 > compared, "only {not_argmax} of {compared} draws left the argmax");
}

/// Min-p and the repetition penalty on the device: the same token as `sampler::sample_stream` from the
/// same logits and stream history, over every vocabulary size and kind of logits, with every other cut
/// beside them; the launch leaves the logits as they were (`device_sample_penalized` checks).
#[test]
fn min_p_and_repetition_penalty_match_the_cpu_sampler() {
    if !gpu_present("min_p_and_repetition_penalty_match_the_cpu_sampler") {
        return;
    }
    let mut rng = Rng::fresh("min_p_and_repetition_penalty_match_the_cpu_sampler");
    // (min_p, repeat_penalty, repeat_last_n) beside each (temperature, top_k, top_p).
    let extra: [(f32, f32, u32); 7] = [
        (0.05, 1.0, 64),
        (0.3, 1.0, 64),
        (1.0, 1.0, 64),
        (0.0, 1.3, 64),
        (0.1, 1.8, 256),
        (0.02, 0.7, 32),
        (0.5, 3.0, 4096),
    ];
    let (mut compared, mut changed) = (0, 0);
    for vocab in SAMPLE_VOCABS {
        for kind in 0..3 {
            let logits = sample_logits(&mut rng, vocab, kind);
            let d = DeviceBuffer::from_slice(&logits).unwrap();
            // A history that repeats the likeliest tokens, so the penalty moves the draw.
            let mut order: Vec<u32> = (0..vocab as u32).collect();
            order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
            let history: Vec<u32> = (0..300)
                .map(|i| {
                    if i % 3 == 0 {
                        order[rng.below(order.len().min(20) as u64) as usize]
                    } else {
                        rng.below(vocab as u64) as u32
                    }
                })
                .collect();
            let new = [history[0], order[0]];
            let greedy_settings = [(0.0f32, 0u32, 1.0f32)];
            for &(temperature, top_k, top_p) in SAMPLE_SETTINGS.iter().chain(&greedy_settings) {
                for &(min_p, repeat_penalty, repeat_last_n) in &extra {
                    let s = Sampling {
                        temperature,
                        top_k,
                        top_p,
                        min_p,
                        repeat_penalty,
                        repeat_last_n,
                        seed: rng.next_u64(),
                    };
                    let stream = rng.below(8) as u32;
                    let position = (history.len() + new.len()) as u64;
                    let ids = sampler::penalty_ids(&history, &new, &s);
                    let got = device_sample_penalized(&d, vocab, &s, stream, position, &ids);
                    let want = sampler::sample_stream(&logits, &s, stream, &history, &new);
                    assert_eq!(got, want, "vocab {vocab} kind {kind} {s:?} stream {stream}: {} ids", ids.len());
                    let plain =
                        sampler::sample(&logits, &Sampling { min_p: 0.0, repeat_penalty: 1.0, ..s }, stream, position);
                    changed += (want != plain) as usize;
                    compared += 1;
                }
            }
        }
    }
    println!("{compared} draws with min-p or a penalty identical to src/sampler.rs, {changed} moved by them");
    assert!(changed * 5 > compared, "min-p and the penalty moved only {changed} of {compared} draws");
}

#[test]
fn sampling_handles_degenerate_logits_like_the_cpu() {
    if !gpu_present("sampling_handles_degenerate_logits_like_the_cpu") {
        return;
    }
    let mut rng = Rng::fresh("sampling_handles_degenerate_logits_like_the_cpu");
    let vocab = 128256;
    let mut cases: Vec<(&str, Vec<f32>)> = vec![
        ("all equal", vec![0.25; vocab]),
        ("two values alternating", (0..vocab).map(|i| (i % 2) as f32).collect()),
        ("all -inf but three", {
            let mut l = vec![f32::NEG_INFINITY; vocab];
            (l[5], l[70000], l[vocab - 1]) = (1.0, 1.0, 0.5);
            l
        }),
        ("huge magnitudes", rng.vec(vocab, 1.0).into_iter().map(|l| l * 1e30).collect()),
        ("tiny differences", rng.vec(vocab, 1.0).into_iter().map(|l| 1000.0 + l * 1e-3).collect()),
        ("a +inf", {
            let mut l = rng.vec(vocab, 4.0);
            l[1234] = f32::INFINITY;
            l
        }),
        ("a NaN", {
            let mut l = rng.vec(vocab, 4.0);
            l[4321] = f32::NAN;
            l
        }),
    ];
    // The maximum at the last index, its run of ties crossing the last block boundary.
    let mut l = rng.vec(vocab, 2.0);
    l[vocab - 3000..].iter_mut().for_each(|x| *x = 3.0);
    cases.push(("ties at the end", l));
    let settings = [(1.0, 0, 1.0), (0.8, 40, 0.95), (1.0, 50000, 0.7), (f32::INFINITY, 0, 0.5), (1e-30, 0, 0.9)];
    for (name, logits) in &cases {
        let d = DeviceBuffer::from_slice(logits).unwrap();
        for &(temperature, top_k, top_p) in &settings {
            for _ in 0..4 {
                let s = Sampling { temperature, top_k, top_p, seed: rng.next_u64(), ..Sampling::GREEDY };
                let position = rng.below(1 << 30);
                let got = device_sample(&d, vocab, &s, 2, position);
                assert_eq!(got, sampler::sample(logits, &s, 2, position), "{name}: {s:?} position {position}");
            }
        }
    }
}

#[test]
fn sampler_refuses_bad_arguments() {
    if !gpu_present("sampler_refuses_bad_arguments") {
        return;
    }
    let b = poisoned(1 << 16);
    let p = b.ptr();
    // SAFETY: every pointer is into one live 64 KiB device buffer (or NULL, which the launcher refuses before
    // launching).
    let call = |logits: *mut f32, vocab: c_uint, scratch: *mut c_void, token: *mut c_int| unsafe {
        kn::hostembed_sample(
            logits,
            vocab,
            1.0,
            0,
            1.0,
            0.0,
            1.0,
            ptr::null_mut(),
            0,
            1,
            0,
            0,
            scratch,
            token,
            NULL_STREAM,
        )
    };
    // SAFETY: 4096 is within the 64 KiB buffer at `p`; only the address is formed.
    let (logits, token, scratch) = (p as *mut f32, p as *mut c_int, unsafe { (p as *mut u8).add(4096) } as *mut c_void);
    let invalid = 1; // cudaErrorInvalidValue
    assert_eq!(call(ptr::null_mut(), 16, scratch, token), invalid, "NULL logits");
    // SAFETY: the pointers of `call` above, the penalty ids NULL with a count, which the launcher refuses before
    // launching.
    let penalty_null = unsafe {
        kn::hostembed_sample(
            logits,
            16,
            1.0,
            0,
            1.0,
            0.0,
            1.3,
            ptr::null_mut(),
            2,
            1,
            0,
            0,
            scratch,
            token,
            NULL_STREAM,
        )
    };
    assert_eq!(penalty_null, invalid, "NULL penalty ids with 2 of them");
    assert_eq!(call(logits, 16, scratch, ptr::null_mut()), invalid, "NULL token");
    assert_eq!(call(logits, 16, ptr::null_mut(), token), invalid, "NULL scratch");
    // SAFETY: 4 is within the 64 KiB buffer; only the address is formed.
    assert_eq!(call(logits, 16, unsafe { (scratch as *mut u8).add(4) } as *mut c_void, token), invalid, "misaligned");
    assert_eq!(call(logits, 0, scratch, token), invalid, "no vocabulary");
    assert_eq!(call(logits, 1 << 28, scratch, token), invalid, "a vocabulary past 2^28 - 1");
}
