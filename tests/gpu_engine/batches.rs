//! Batches on CUDA against stepping alone: single tokens, the tensor-core option, mixed and random batches.

use super::{batch_cuda, config, ids, write_formats};
use crate::common::{
    Mix, Rng, Scratch, bits, every_recipe_batches_like_alone, gpu_present, info, init, logits, model_file, rel_l2,
    reset, serial, set_env, set_sampling, step, stream_len, truncate, try_batch, try_step, twins_batch_like_alone,
};
use hostembed::engine::{engine_options, engine_tristate};
use hostembed::status::last_error;
use hostembed::tensor::DType;
use hostembed::{Status, engine, ffi};
use std::ffi::{c_char, c_void};

/// A stream's logits alone and in a batch of up to 64 single-token items, whatever the others are:
/// bit for bit, token for token. Each stream's prompt is stepped alone on both engines (so their caches
/// hold the same bits); then every round steps a random subset of the streams, in a random order, one
/// token each, on one engine in one call and on the other one stream at a time. Streams are truncated
/// and reset (and prompted again alone) between rounds.
#[test]
fn single_token_items_are_batch_invariant_on_cuda() {
    if !gpu_present("single_token_items_are_batch_invariant_on_cuda") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("single_token_items_are_batch_invariant_on_cuda");
    let dir = Scratch::new("batch-invariance");
    let path = &write_formats(&dir.0, &[])[0].path;
    let (window, streams) = (256u32, 64u32);
    let batched = init(path, &batch_cuda(window, streams));
    let alone = init(path, &batch_cuda(window, streams));
    assert_eq!(info(&batched).streams, streams);
    for s in 0..streams {
        // Half greedy, half drawn with every cut and the penalty: the device sampler per item.
        let mut sampling = ffi::engine_default_sampling();
        if s % 2 == 1 {
            sampling = hostembed::abi::engine_sampling {
                temperature: 0.9,
                top_k: 40,
                top_p: 0.95,
                min_p: 0.02,
                repeat_penalty: 1.3,
                repeat_last_n: 32,
                seed: rng.next_u64(),
            };
        }
        set_sampling(&batched, s, &sampling);
        set_sampling(&alone, s, &sampling);
    }
    let mut last = vec![0i32; streams as usize];
    let prompt_both = |s: u32, rng: &mut Rng, last: &mut Vec<i32>| {
        let n = 1 + rng.below(40) as usize;
        let p = ids(rng, n);
        let t = step(&batched, s, &p);
        assert_eq!(step(&alone, s, &p), t, "stream {s}: the prompt, alone on both engines");
        last[s as usize] = t;
    };
    for s in 0..streams {
        prompt_both(s, &mut rng, &mut last);
    }
    let (mut items, mut widest) = (0usize, 0usize);
    for round in 0..48 {
        for s in 0..streams {
            let len = stream_len(&batched, s);
            if len + 1 >= window || rng.below(40) == 0 {
                reset(&batched, s);
                reset(&alone, s);
                prompt_both(s, &mut rng, &mut last);
            } else if rng.below(40) == 0 {
                let keep = 1 + rng.below(len as u64) as u32;
                truncate(&batched, s, keep);
                truncate(&alone, s, keep);
                // Re-step the last kept position's token so both have a token to feed.
                let t = ids(&mut rng, 1);
                let (a, b) = (step(&batched, s, &t), step(&alone, s, &t));
                assert_eq!(a, b, "round {round} stream {s}: after truncating to {keep}");
                last[s as usize] = a;
            }
        }
        let width = [1usize, 2, 7, 16, 33, 64][round % 6];
        let mut order: Vec<u32> = (0..streams).collect();
        rng.shuffle(&mut order);
        order.truncate(width);
        let inputs: Vec<[i32; 1]> = order.iter().map(|&s| [last[s as usize]]).collect();
        let batch: Vec<(u32, &[i32])> = order.iter().zip(&inputs).map(|(&s, t)| (s, t.as_slice())).collect();
        let (st, out) = try_batch(&batched, &batch);
        assert_eq!(st, Status::Ok, "round {round}: {}", last_error());
        for (&(s, t), &(item, next)) in batch.iter().zip(&out) {
            assert_eq!(item, Status::Ok, "round {round} stream {s}: {}", last_error());
            let want = step(&alone, s, t);
            assert_eq!(next, want, "round {round} (batch of {width}) stream {s}: token");
            assert!(
                bits(&logits(&batched, s)) == bits(&logits(&alone, s)),
                "round {round} (batch of {width}) stream {s}: logits differ by {:.3e} relative L2",
                rel_l2(&logits(&batched, s), &logits(&alone, s))
            );
            last[s as usize] = next;
            items += 1;
        }
        widest = widest.max(width);
    }
    println!("{items} single-token items in batches of up to {widest}: every logit bit-identical to stepping alone");
}

unsafe extern "C" fn collect_lines(user: *mut c_void, line: *const c_char) {
    // SAFETY: the test passes a live Vec<String> as `user`, and nothing else touches it during the call.
    let lines = unsafe { &mut *(user as *mut Vec<String>) };
    // SAFETY: the library passes a NUL-terminated line that lives for the call.
    lines.push(unsafe { std::ffi::CStr::from_ptr(line) }.to_string_lossy().into_owned());
}

/// options.batch_tensor_cores YES reaches the CUDA engine: its start-up log says so, and a batch of 24
/// single tokens gives logits near (not the bits of) those of the same engine options with NO, which are
/// the bits of stepping each stream alone, though HOSTEMBED_BATCH_TENSOR_CORES=1 is set.
#[test]
fn the_batch_tensor_core_option_reaches_cuda() {
    if !gpu_present("the_batch_tensor_core_option_reaches_cuda") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("the_batch_tensor_core_option_reaches_cuda");
    let dir = Scratch::new("batch-tensor-cores");
    let path = &write_formats(&dir.0, &[])[0].path;
    let streams = 24u32;
    let said = "share tensor-core products";
    let mut engines = Vec::new();
    // The variable says on: only AUTO may read it, so NO stays batch invariant.
    let saved = std::env::var_os(engine::BATCH_TENSOR_CORES_ENV);
    set_env(engine::BATCH_TENSOR_CORES_ENV, Some(std::ffi::OsStr::new("1")));
    for option in [engine_tristate::No, engine_tristate::Yes] {
        let mut lines: Vec<String> = Vec::new();
        let opts = engine_options {
            batch_tensor_cores: option,
            log: Some(collect_lines),
            log_user: &mut lines as *mut Vec<String> as *mut c_void,
            ..batch_cuda(128, streams)
        };
        let e = init(path, &opts);
        assert_eq!(lines.iter().any(|l| l.contains(said)), option == engine_tristate::Yes, "{option:?}: {lines:?}");
        engines.push(e);
    }
    set_env(engine::BATCH_TENSOR_CORES_ENV, saved.as_deref());
    let alone = init(path, &batch_cuda(128, streams));
    let prompts: Vec<Vec<i32>> = (0..streams).map(|s| ids(&mut rng, 3 + s as usize)).collect();
    for e in engines.iter().chain([&alone]) {
        for (s, p) in prompts.iter().enumerate() {
            step(e, s as u32, p);
        }
    }
    let next: Vec<[i32; 1]> = (0..streams).map(|_| [ids(&mut rng, 1)[0]]).collect();
    let batch: Vec<(u32, &[i32])> = next.iter().enumerate().map(|(s, t)| (s as u32, &t[..])).collect();
    for e in &engines {
        let (st, out) = try_batch(e, &batch);
        assert_eq!(st, Status::Ok, "{}", last_error());
        assert!(out.iter().all(|(item, _)| *item == Status::Ok), "{out:?}: {}", last_error());
    }
    let (mut worst, mut exact_on) = (0f64, 0);
    for (s, t) in batch.iter() {
        step(&alone, *s, t);
        let want = logits(&alone, *s);
        assert!(bits(&logits(&engines[0], *s)) == bits(&want), "stream {s}: option NO is not stepping alone");
        let on = logits(&engines[1], *s);
        worst = worst.max(rel_l2(&on, &want));
        exact_on += (bits(&on) == bits(&want)) as usize;
    }
    println!("{streams} single tokens with the option on: worst relative L2 {worst:.2e}, {exact_on} bit-identical");
    assert!(worst < 2e-2, "the option's logits differ by {worst:.3e}");
    assert!(exact_on < streams as usize, "every stream's bits equal stepping alone: the option did not apply");
}

/// Batches mixing prompt chunks with single tokens (continuous batching): a chunk's logits within 2e-3
/// relative L2 of the same chunk stepped alone, the single tokens beside it bit-identical, and every
/// stream's later logits close to its alone twin's (both engines fed the batched engine's tokens).
#[test]
fn mixed_batches_match_stepping_alone_on_cuda() {
    if !gpu_present("mixed_batches_match_stepping_alone_on_cuda") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("mixed_batches_match_stepping_alone_on_cuda");
    let dir = Scratch::new("batch-mixed");
    let path = &write_formats(&dir.0, &[])[0].path;
    let (window, streams) = (512u32, 12u32);
    let batched = init(path, &batch_cuda(window, streams));
    let alone = init(path, &batch_cuda(window, streams));
    // Whether a stream's cache holds the same bits on both engines (no chunk of it was batched yet).
    let mut exact = vec![true; streams as usize];
    let mut last: Vec<Option<i32>> = vec![None; streams as usize];
    let (mut worst_chunk, mut worst_after, mut chunks) = (0f64, 0f64, 0usize);
    for round in 0..40 {
        let mut order: Vec<u32> = (0..streams).filter(|_| rng.below(4) > 0).collect();
        rng.shuffle(&mut order);
        let inputs: Vec<Vec<i32>> = order
            .iter()
            .map(|&s| {
                let room = window - stream_len(&batched, s);
                match last[s as usize] {
                    Some(t) if rng.below(3) > 0 => vec![t],
                    _ => {
                        let n = (1 + rng.below(100) as u32).min(room.saturating_sub(1)).max(1);
                        ids(&mut rng, n as usize)
                    }
                }
            })
            .collect();
        let batch: Vec<(u32, &[i32])> = order.iter().zip(&inputs).map(|(&s, t)| (s, t.as_slice())).collect();
        let (st, out) = try_batch(&batched, &batch);
        assert_eq!(st, Status::Ok, "round {round}: {}", last_error());
        let others = batch.len() > 1;
        for (&(s, t), &(item, next)) in batch.iter().zip(&out) {
            let (want_status, _) = try_step(&alone, s, t);
            assert_eq!(item, want_status, "round {round} stream {s}: status ({})", last_error());
            if item != Status::Ok {
                // The window is full: both start again.
                reset(&batched, s);
                reset(&alone, s);
                (exact[s as usize], last[s as usize]) = (true, None);
                continue;
            }
            let (got, want) = (logits(&batched, s), logits(&alone, s));
            let rel = rel_l2(&got, &want);
            if t.len() > 1 {
                assert!(rel <= 2e-3, "round {round} stream {s}: a {}-token chunk {rel:.3e} from alone", t.len());
                worst_chunk = worst_chunk.max(rel);
                chunks += 1;
                exact[s as usize] &= !others;
            } else if exact[s as usize] {
                assert!(bits(&got) == bits(&want), "round {round} stream {s}: a single token, {rel:.3e} from alone");
            } else {
                assert!(rel <= 5e-3, "round {round} stream {s}: {rel:.3e} from alone after a batched chunk");
                worst_after = worst_after.max(rel);
            }
            last[s as usize] = Some(next);
        }
    }
    println!(
        "{chunks} prompt chunks: worst {worst_chunk:.2e} relative L2 from alone; later tokens of batched chunks {worst_after:.2e}"
    );
    assert!(chunks > 20);
}

/// 64 streams of 256 tokens on CUDA, in passes of up to 32 tokens; calls of 1 to 64 items with prompt
/// chunks of 1 to 12 tokens (the decode rows' products), one in four up to 100 (the prompt path's, over
/// several passes).
fn mixed_batches() -> (engine_options, Mix) {
    (batch_cuda(256, 64), Mix { rounds: 15, widest: 64, chunk: 12, long_chunk: 100 })
}

/// Every weight format, and llama.cpp's Q4_K_M mix, on CUDA: random batches of 1 to 64 items (single
/// tokens and prompt chunks; streams joining, leaving, truncated and reset) give each stream the
/// status, the token and the logits bits of stepping it alone, and the pool follows the streams.
#[test]
fn random_batches_match_stepping_alone_in_every_format_on_cuda() {
    if !gpu_present("random_batches_match_stepping_alone_in_every_format_on_cuda") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("random_batches_match_stepping_alone_in_every_format_on_cuda");
    let (opts, mix) = mixed_batches();
    every_recipe_batches_like_alone(&config(), &opts, &mix, hostembed::gpu::PAGE_TOKENS as u64, &mut rng);
}

/// models/gguf-f16.gguf, which the `gguf` Python package wrote as llama.cpp's converter lays out an F16
/// Llama (scripts/gpu-build.sh bundles it; a SKIP line without it), on CUDA: its rows F16 on the card,
/// and random batches bit-identical to stepping alone.
#[test]
fn the_gguf_packages_f16_file_decodes_batch_invariant_on_cuda() {
    if !gpu_present("the_gguf_packages_f16_file_decodes_batch_invariant_on_cuda") {
        return;
    }
    let Some(path) =
        model_file("gguf-f16.gguf", "scripts/write-gguf-f16.sh writes it, scripts/gpu-build.sh bundles it")
    else {
        return;
    };
    let _g = serial();
    let mut rng = Rng::fresh("the_gguf_packages_f16_file_decodes_batch_invariant_on_cuda");
    let (opts, mix) = mixed_batches();
    {
        let e = init(&path, &opts);
        // SAFETY: engine_rows is plain C data (integers and pointers) for which all zeros is a value.
        let mut rows: hostembed::abi::engine_rows = unsafe { std::mem::zeroed() };
        // SAFETY: a live engine and a struct to fill.
        assert_eq!(unsafe { ffi::engine_embed_rows(e.0, &mut rows) }, Status::Ok, "{}", last_error());
        assert_eq!((rows.dtype, rows.device_usable), (DType::F16, true));
    }
    twins_batch_like_alone("gguf-f16.gguf", &path, &opts, &mix, hostembed::gpu::PAGE_TOKENS as u64, &mut rng);
}
