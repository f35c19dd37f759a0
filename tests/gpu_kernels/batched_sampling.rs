//! The batched sampler against the single-row one, its refusals, and masked rows against the host's masked sampler.

use super::{NULL_STREAM, SAMPLE_SETTINGS, device_sample_penalized, download, ok, poisoned, sample_logits};
use crate::common::{Rng, gpu_present};
use hostembed::cuda::DeviceBuffer;
use hostembed::sampler::Sampling;
use hostembed::{cuda, kernels as kn, sampler};
use std::os::raw::{c_int, c_uint, c_void};
use std::ptr;

/// Scratch for `hostembed_sample_rows`: what the GPU model gives it (`launch::sample_rows_bytes`: 64 bytes
/// and a 33 KiB workspace a row, 8 bytes a vocabulary entry for the ids, 1 KiB of alignment).
fn rows_scratch_bytes(vocab: usize, rows: usize) -> usize {
    rows * (64 + (33 << 10)) + vocab * 8 + 1024
}

/// One batched draw of `rows` logits rows (`logits`: rows x vocab on the device) with `settings[r]`, the
/// penalized ids of row r `ids[r]`, into poisoned tokens, on a poisoned scratch of `scratch_bytes`; checks
/// the logits are left as they were and returns the launch's status and the tokens.
fn device_sample_rows(
    logits: &DeviceBuffer,
    vocab: usize,
    settings: &[(Sampling, u32, u64)],
    ids: &[Vec<u32>],
    scratch_bytes: usize,
) -> (c_int, Vec<i32>) {
    let rows = settings.len();
    let mut flat: Vec<i32> = Vec::new();
    let mut host = Vec::new();
    for ((s, stream, position), ids) in settings.iter().zip(ids) {
        host.push(kn::hostembed_sample_row {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            repeat_penalty: s.repeat_penalty,
            n_penalty: ids.len() as c_uint,
            penalty_at: flat.len() as c_uint,
            stream_index: *stream,
            seed: s.seed,
            position: *position,
            mask_row: kn::NO_MASK,
            reserved: 0,
        });
        flat.extend(ids.iter().map(|&t| t as i32));
    }
    let scratch = poisoned(scratch_bytes.max(1));
    let tokens = poisoned(rows.max(1) * 4);
    let before = download::<f32>(logits, rows * vocab);
    // SAFETY: host arrays of the lengths passed; device buffers of rows x vocab floats, rows tokens and
    // scratch_bytes of scratch.
    let code = unsafe {
        kn::hostembed_sample_rows(
            logits.ptr() as *mut f32,
            vocab as c_uint,
            rows as c_uint,
            host.as_ptr(),
            flat.as_ptr(),
            flat.len() as c_uint,
            ptr::null(),
            scratch.ptr(),
            scratch_bytes,
            tokens.ptr() as *mut c_int,
            NULL_STREAM,
        )
    };
    cuda::synchronize().unwrap_or_else(|e| panic!("hostembed_sample_rows while running: {e}"));
    let mut t = vec![0i32; rows];
    tokens.download(&mut t).unwrap();
    let after = download::<f32>(logits, rows * vocab);
    assert!(
        before.iter().zip(&after).all(|(a, b)| a.to_bits() == b.to_bits()),
        "the batched sampler left the logits changed"
    );
    (code, t)
}

/// Every row of a batched draw picks the token `hostembed_sample` picks for that row alone, which is
/// `sampler::sample_stream`'s: rows of fresh random logits of every kind, each with its own settings
/// (greedy, temperature with top-k / top-p / min-p, repetition penalties over its own history), stream
/// and position, in batches of 1 to 64 rows, with the scratch the GPU model gives and with one too small
/// for more than one block a row.
#[test]
fn batched_sampling_matches_the_single_row_sampler() {
    if !gpu_present("batched_sampling_matches_the_single_row_sampler") {
        return;
    }
    let mut rng = Rng::fresh("batched_sampling_matches_the_single_row_sampler");
    let extra: [(f32, f32, u32); 5] =
        [(0.0, 1.0, 64), (0.05, 1.0, 64), (0.0, 1.3, 64), (0.1, 1.8, 256), (0.3, 0.7, 32)];
    let (mut compared, mut not_argmax) = (0, 0);
    for vocab in [2usize, 256, 4096, 8192, 32000, 128256, 151936] {
        for rows in [1usize, 3, 17, 64] {
            if vocab >= 128256 && rows == 17 {
                continue; // the largest shapes at 1, 3 and 64 rows keep the test short
            }
            let logits: Vec<Vec<f32>> = (0..rows).map(|r| sample_logits(&mut rng, vocab, r % 3)).collect();
            let flat: Vec<f32> = logits.concat();
            let d = DeviceBuffer::from_slice(&flat).unwrap();
            let mut settings = Vec::new();
            let mut histories = Vec::new();
            let mut ids = Vec::new();
            for r in 0..rows {
                // A third of the rows greedy, the rest drawn with a setting of the single-row tests.
                let (temperature, top_k, top_p) = if r % 3 == 0 {
                    (0.0, 0, 1.0)
                } else {
                    SAMPLE_SETTINGS[rng.below(SAMPLE_SETTINGS.len() as u64) as usize]
                };
                let (min_p, repeat_penalty, repeat_last_n) = extra[rng.below(extra.len() as u64) as usize];
                let s =
                    Sampling { temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed: rng.next_u64() };
                let history: Vec<u32> = (0..rng.below(300)).map(|_| rng.below(vocab as u64) as u32).collect();
                let new = [rng.below(vocab as u64) as u32];
                let position = (history.len() + new.len()) as u64;
                ids.push(sampler::penalty_ids(&history, &new, &s));
                settings.push((s, rng.below(64) as u32, position));
                histories.push((history, new));
            }
            let full = rows_scratch_bytes(vocab, rows);
            let total_ids: usize = ids.iter().map(Vec::len).sum();
            // Only the settings, barrier words and ids fit: one block a row.
            let tight = (rows * std::mem::size_of::<kn::hostembed_sample_row>()).next_multiple_of(16)
                + (8 * rows).next_multiple_of(16)
                + 8 * total_ids
                + 256;
            for scratch in [full, tight] {
                let (code, got) = device_sample_rows(&d, vocab, &settings, &ids, scratch);
                ok(code, &format!("hostembed_sample_rows, vocab {vocab}, {rows} rows, {scratch} bytes of scratch"));
                for r in 0..rows {
                    let (s, stream, position) = settings[r];
                    let row = DeviceBuffer::from_slice(&logits[r]).unwrap();
                    let alone = device_sample_penalized(&row, vocab, &s, stream, position, &ids[r]);
                    let (history, new) = &histories[r];
                    let want = sampler::sample_stream(&logits[r], &s, stream, history, new);
                    assert_eq!(alone, want, "vocab {vocab} row {r}: hostembed_sample against src/sampler.rs");
                    assert_eq!(
                        got[r] as u32, want,
                        "vocab {vocab}, {rows} rows, scratch {scratch}: row {r} {s:?} stream {stream} position {position}"
                    );
                    compared += 1;
                    not_argmax += (want != sampler::argmax(&logits[r])) as usize;
                }
            }
        }
    }
    println!("{compared} batched draws identical to the single-row sampler, {not_argmax} of them not the argmax");
    assert!(not_argmax * 4 > compared, "only {not_argmax} of {compared} draws left the argmax");
}

#[test]
fn batched_sampler_refuses_bad_arguments() {
    if !gpu_present("batched_sampler_refuses_bad_arguments") {
        return;
    }
    let vocab = 1000;
    let logits = DeviceBuffer::from_slice(&vec![0.5f32; 2 * vocab]).unwrap();
    let greedy = (Sampling::GREEDY, 0u32, 1u64);
    let big = rows_scratch_bytes(vocab, 2);
    // Too small for even the settings, the barrier words and the ids.
    let (code, _) = device_sample_rows(&logits, vocab, &[greedy, greedy], &[vec![], vec![]], 64);
    assert_ne!(code, 0, "a scratch too small for the settings");
    // A row whose ids run past the ids passed.
    let mut host = kn::hostembed_sample_row {
        repeat_penalty: 1.5,
        n_penalty: 3,
        penalty_at: 0,
        mask_row: kn::NO_MASK,
        ..Default::default()
    };
    let ids = [1i32, 2];
    let scratch = poisoned(big);
    let tokens = poisoned(8);
    let call = |rows: &kn::hostembed_sample_row, scratch_ptr: *mut c_void, vocab: usize| {
        // SAFETY: every call here is refused before it reads or writes anything.
        unsafe {
            kn::hostembed_sample_rows(
                logits.ptr() as *mut f32,
                vocab as c_uint,
                1,
                rows,
                ids.as_ptr(),
                ids.len() as c_uint,
                ptr::null(),
                scratch_ptr,
                big,
                tokens.ptr() as *mut c_int,
                NULL_STREAM,
            )
        }
    };
    assert_ne!(call(&host, scratch.ptr(), vocab), 0, "3 ids of a row among 2");
    host.n_penalty = 1;
    host.penalty_at = 2;
    assert_ne!(call(&host, scratch.ptr(), vocab), 0, "a row's ids starting past the ids");
    host.penalty_at = 1;
    let misaligned = (scratch.ptr() as *mut u8).wrapping_add(16) as *mut c_void;
    assert_ne!(call(&host, misaligned, vocab), 0, "a scratch off its 256-byte boundary");
    assert_ne!(call(&host, scratch.ptr(), 0), 0, "no vocabulary");
    assert_ne!(call(&host, scratch.ptr(), 1 << 28), 0, "a vocabulary past 2^28 - 1");
    host.mask_row = 0;
    assert_ne!(call(&host, scratch.ptr(), vocab), 0, "a row's mask and no masks");
    host.mask_row = kn::NO_MASK;
    let mut t = [0i32; 2];
    tokens.download(&mut t).unwrap();
    assert_eq!(t, [-1, -1], "a refused call wrote tokens");
    // The same row accepted (id 2 penalized among equal logits): greedy takes the lowest index.
    assert_eq!(call(&host, scratch.ptr(), vocab), 0, "a valid call");
    cuda::synchronize().unwrap();
    tokens.download(&mut t).unwrap();
    assert_eq!(t[0], 0, "greedy over equal logits is the lowest index");
}

/// Constrained rows in `hostembed_sample_rows`: in one launch beside free rows, each masked row's token is
/// `sampler::sample_stream_masked`'s (every cut, min-p, the penalty; masks of every id down to about one,
/// and allowed ids whose logits are all -inf), each free row's `sample_stream`'s; the logits are left as
/// they were.
#[test]
fn masked_rows_draw_the_host_masked_samplers_token() {
    if !gpu_present("masked_rows_draw_the_host_masked_samplers_token") {
        return;
    }
    let mut rng = Rng::fresh("masked_rows_draw_the_host_masked_samplers_token");
    let (mut compared, mut masked_away) = (0, 0);
    for vocab in [1usize, 33, 4096, 8192, 32000, 128256] {
        let words = vocab.div_ceil(32);
        for round in 0..6 {
            let rows = 1 + rng.below(12) as usize;
            let (mut logits, mut masks, mut ids) = (Vec::new(), Vec::<u32>::new(), Vec::<c_int>::new());
            let (mut settings, mut want, mut has_mask) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..rows {
                let kind = rng.below(3) as usize;
                let mut row = sample_logits(&mut rng, vocab, kind);
                let masked = rng.below(4) > 0;
                let mut allowed = vec![0u32; words];
                if masked {
                    // Every id, half, one in fifty, or about one.
                    let density = [1, 2, 50, vocab as u64 + 1][rng.below(4) as usize];
                    for i in 0..vocab {
                        if rng.below(density) == 0 {
                            allowed[i / 32] |= 1 << (i % 32);
                        }
                    }
                    let one = rng.below(vocab as u64) as usize;
                    allowed[one / 32] |= 1 << (one % 32);
                    if rng.below(6) == 0 {
                        for i in (0..vocab).filter(|&i| allowed[i / 32] >> (i % 32) & 1 == 1) {
                            row[i] = f32::NEG_INFINITY;
                        }
                    }
                }
                let (temperature, top_k, top_p) = if rng.below(4) == 0 {
                    (0.0, 0, 1.0)
                } else {
                    SAMPLE_SETTINGS[rng.below(SAMPLE_SETTINGS.len() as u64) as usize]
                };
                let (repeat_penalty, repeat_last_n) = [(1.0, 64), (1.3, 16), (0.8, 8)][rng.below(3) as usize];
                let min_p = [0.0, 0.05, 0.3][rng.below(3) as usize];
                let s =
                    Sampling { temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed: rng.next_u64() };
                let history: Vec<u32> = (0..rng.below(12)).map(|_| rng.below(vocab as u64) as u32).collect();
                let new = [rng.below(vocab as u64) as u32];
                let stream = rng.below(8) as u32;
                let penalty = sampler::penalty_ids(&history, &new, &s);
                want.push(if masked {
                    sampler::sample_stream_masked(&row, &allowed, &s, stream, &history, &new).unwrap()
                } else {
                    sampler::sample_stream(&row, &s, stream, &history, &new)
                });
                settings.push(kn::hostembed_sample_row {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    repeat_penalty,
                    n_penalty: penalty.len() as c_uint,
                    penalty_at: ids.len() as c_uint,
                    stream_index: stream,
                    seed: s.seed,
                    position: (history.len() + 1) as u64,
                    mask_row: if masked { (masks.len() / words) as c_uint } else { kn::NO_MASK },
                    reserved: 0,
                });
                ids.extend(penalty.iter().map(|&t| t as c_int));
                if masked {
                    masks.extend(&allowed);
                }
                has_mask.push(masked);
                logits.extend(row);
            }
            let d = DeviceBuffer::from_slice(&logits).unwrap();
            let m = DeviceBuffer::from_slice(&masks).unwrap();
            // What GpuModel gives the sampler: a row's settings and workspace, 8 bytes an id.
            let scratch_size = rows * (64 + (33 << 10)) + ids.len().max(vocab) * 8 + 1024;
            let (scratch, tokens) = (poisoned(scratch_size), poisoned(rows * 4));
            ok(
                // SAFETY: device buffers holding `rows` logits rows, their masks, settings and ids, a workspace sized
                // as GpuModel sizes it and `rows` tokens, alive until the synchronous check after the launch.
                unsafe {
                    kn::hostembed_sample_rows(
                        d.ptr() as *mut f32,
                        vocab as c_uint,
                        rows as c_uint,
                        settings.as_ptr(),
                        ids.as_ptr(),
                        ids.len() as c_uint,
                        m.ptr() as *const c_uint,
                        scratch.ptr(),
                        scratch_size,
                        tokens.ptr() as *mut c_int,
                        NULL_STREAM,
                    )
                },
                "hostembed_sample_rows",
            );
            let mut got = vec![0i32; rows];
            tokens.download(&mut got).unwrap();
            for r in 0..rows {
                let what = format!("vocab {vocab} round {round} row {r} (masked: {}) {:?}", has_mask[r], settings[r]);
                assert_eq!(got[r], want[r] as i32, "{what}");
                compared += 1;
                if has_mask[r] {
                    let row = &logits[r * vocab..(r + 1) * vocab];
                    // Would the free draw have left the mask? Then the mask decided this token.
                    masked_away += usize::from(sampler::argmax(row) != want[r]);
                }
            }
            let after = download::<f32>(&d, rows * vocab);
            assert!(logits.iter().zip(&after).all(|(a, b)| a.to_bits() == b.to_bits()), "the logits changed");
        }
    }
    println!("{compared} rows identical to src/sampler.rs, {masked_away} masked rows off their argmax");
    assert!(masked_away > 0, "no mask changed a draw");
}
