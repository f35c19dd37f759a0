//! Malformed batches and bad arguments, refused.

use super::{model, qwen2, random_ids};
use crate::common::{
    self, Rng, Scratch, bits, cpu_options, init, logits, reset, serial, set_sampling, step, stream_len, try_batch,
};
use hostembed::abi::{engine_batch_item, engine_sampling};
use hostembed::engine::engine_options;
use hostembed::status::last_error;
use hostembed::{Status, ffi};

/// Malformed calls (NULLs, a stream named twice) step nothing and say INVALID_ARGUMENT; items that are
/// wrong on their own fail alone; the other new calls refuse NULLs and bad settings.
#[test]
fn malformed_batches_and_bad_arguments_are_refused() {
    let _g = serial();
    let mut rng = Rng::fresh("malformed_batches_and_bad_arguments_are_refused");
    let dir = Scratch::new("batch-refusals");
    let path = model(&dir, &mut rng);
    let window = 32u32;
    let e = init(&path, &cpu_options(window, 3));
    let reference = init(&path, &cpu_options(window, 3));
    let prompt = random_ids(&mut rng, 6);
    let vocab = qwen2().vocab as i32;

    // A stream named twice: nothing steps, every item says INVALID_ARGUMENT.
    let (st, out) = try_batch(&e, &[(0, &prompt), (1, &prompt), (0, &prompt[..1])]);
    assert_eq!(st, Status::InvalidArgument);
    assert!(last_error().contains("stream 0"), "{}", last_error());
    assert!(out.iter().all(|&o| o == (Status::InvalidArgument, -1)), "{out:?}");
    assert_eq!((stream_len(&e, 0), stream_len(&e, 1)), (0, 0), "nothing appended");

    // NULL items with items to read, NULL tokens with tokens to read, a NULL engine.
    let mut item = engine_batch_item {
        stream: 0,
        tokens: std::ptr::null(),
        n: 2,
        next: -7,
        status: Status::Ok,
        out: std::ptr::null_mut(),
        out_cap: 0,
        n_out: 0,
    };
    // SAFETY: a live engine and one item whose NULL tokens pointer is refused before it is read.
    assert_eq!(unsafe { ffi::engine_step_batch(e.0, &mut item, 1) }, Status::InvalidArgument);
    assert_eq!((item.status, item.next), (Status::InvalidArgument, -1));
    // SAFETY: a live engine; NULL items with a count of 2 are refused before anything is read.
    assert_eq!(unsafe { ffi::engine_step_batch(e.0, std::ptr::null_mut(), 2) }, Status::InvalidArgument);
    // SAFETY: a live engine; NULL items with a count of 0 are never read.
    assert_eq!(unsafe { ffi::engine_step_batch(e.0, std::ptr::null_mut(), 0) }, Status::Ok, "an empty batch");
    let mut fine = engine_batch_item {
        stream: 0,
        tokens: prompt.as_ptr(),
        n: 1,
        next: -7,
        status: Status::Ok,
        out: std::ptr::null_mut(),
        out_cap: 0,
        n_out: 0,
    };
    // SAFETY: a NULL engine is refused before the live item is read.
    assert_eq!(unsafe { ffi::engine_step_batch(std::ptr::null_mut(), &mut fine, 1) }, Status::InvalidArgument);
    assert_eq!(stream_len(&e, 0), 0);

    // Items wrong on their own fail alone: no tokens, a stream that does not exist, an id outside the
    // vocabulary, past the window. The good item steps as it does alone.
    let past_window = random_ids(&mut rng, window as usize + 1);
    let bad_id = [3, vocab, 4];
    let (st, out) = try_batch(&e, &[(1, &[]), (7, &prompt), (2, &bad_id), (0, &prompt), (u32::MAX, &prompt)]);
    assert_eq!(st, Status::Ok, "{}", last_error());
    assert_eq!(out[0], (Status::InvalidArgument, -1));
    assert_eq!(out[1], (Status::OutOfRange, -1));
    assert_eq!(out[2], (Status::OutOfRange, -1));
    assert_eq!(out[3], (Status::Ok, step(&reference, 0, &prompt)));
    assert_eq!(out[4], (Status::OutOfRange, -1));
    assert!(last_error().contains("items[0]"), "the first failed item's message: {}", last_error());
    let (st, out) = try_batch(&e, &[(1, &past_window)]);
    assert_eq!((st, out[0]), (Status::Ok, (Status::NoRoom, -1)));
    assert_eq!((stream_len(&e, 1), stream_len(&e, 2)), (0, 0));
    assert_eq!(bits(&logits(&e, 0)), bits(&logits(&reference, 0)));

    // engine_logits answers for every stream the last batch stepped, and for no other.
    let (a, b) = (random_ids(&mut rng, 3), random_ids(&mut rng, 1));
    let (st, out) = try_batch(&e, &[(2, &a), (1, &b)]);
    assert_eq!((st, out[0].0, out[1].0), (Status::Ok, Status::Ok, Status::Ok));
    step(&reference, 2, &a);
    let logits2 = logits(&reference, 2);
    assert_eq!(bits(&logits(&e, 2)), bits(&logits2));
    step(&reference, 1, &b);
    assert_eq!(bits(&logits(&e, 1)), bits(&logits(&reference, 1)));
    let mut out = vec![0f32; vocab as usize];
    // SAFETY: a live engine and a buffer of out.len() floats to write.
    assert_eq!(unsafe { ffi::engine_logits(e.0, 0, out.as_mut_ptr(), out.len()) }, Status::InvalidArgument);
    // A batch in which every item fails leaves them.
    let (st, _) = try_batch(&e, &[(0, &past_window)]);
    assert_eq!(st, Status::Ok);
    assert_eq!(bits(&logits(&e, 2)), bits(&logits2));

    // The other calls: NULLs, streams that do not exist, settings out of range.
    let mut len = 0u32;
    let (mut total, mut free) = (0u64, 0u64);
    // SAFETY: a live engine; the NULL out pointer is refused before anything is written.
    assert_eq!(unsafe { ffi::engine_stream_len(e.0, 0, std::ptr::null_mut()) }, Status::InvalidArgument);
    // SAFETY: a NULL engine is refused before `len` is written.
    assert_eq!(unsafe { ffi::engine_stream_len(std::ptr::null(), 0, &mut len) }, Status::InvalidArgument);
    // SAFETY: a live engine and a writable u32; stream 3 is refused.
    assert_eq!(unsafe { ffi::engine_stream_len(e.0, 3, &mut len) }, Status::OutOfRange);
    // SAFETY: a live engine; the NULL total is refused before `free` is written.
    assert_eq!(unsafe { ffi::engine_kv_stats(e.0, std::ptr::null_mut(), &mut free) }, Status::InvalidArgument);
    // SAFETY: a live engine; the NULL free is refused before `total` is written.
    assert_eq!(unsafe { ffi::engine_kv_stats(e.0, &mut total, std::ptr::null_mut()) }, Status::InvalidArgument);
    // SAFETY: a NULL engine is refused before the counters are written.
    assert_eq!(unsafe { ffi::engine_kv_stats(std::ptr::null(), &mut total, &mut free) }, Status::InvalidArgument);
    let good = ffi::engine_default_sampling();
    // SAFETY: a live engine; the NULL settings are refused before anything is read.
    assert_eq!(unsafe { ffi::engine_set_sampling(e.0, 0, std::ptr::null()) }, Status::InvalidArgument);
    // SAFETY: a NULL engine is refused before the settings are read.
    assert_eq!(unsafe { ffi::engine_set_sampling(std::ptr::null_mut(), 0, &good) }, Status::InvalidArgument);
    // SAFETY: a live engine and live settings; stream 3 is refused.
    assert_eq!(unsafe { ffi::engine_set_sampling(e.0, 3, &good) }, Status::OutOfRange);
    let bad = [
        engine_sampling { temperature: -1.0, ..good },
        engine_sampling { temperature: f32::NAN, ..good },
        engine_sampling { top_p: 0.0, ..good },
        engine_sampling { top_p: 1.5, ..good },
        engine_sampling { min_p: -0.1, ..good },
        engine_sampling { min_p: 1.1, ..good },
        engine_sampling { min_p: f32::NAN, ..good },
        engine_sampling { repeat_penalty: 0.0, ..good },
        engine_sampling { repeat_penalty: f32::INFINITY, ..good },
    ];
    for s in &bad {
        // SAFETY: a live engine and live settings, which are refused.
        assert_eq!(unsafe { ffi::engine_set_sampling(e.0, 0, s) }, Status::InvalidArgument, "{s:?}");
    }
    let mut got = engine_sampling { seed: 9, ..good };
    // SAFETY: a live engine and a writable engine_sampling.
    assert_eq!(unsafe { ffi::engine_get_sampling(e.0, 0, &mut got) }, Status::Ok);
    assert_eq!(got, good, "refused settings leave the stream's as they were");
    let mine = engine_sampling { temperature: 0.7, min_p: 0.1, repeat_penalty: 1.2, seed: 5, ..good };
    set_sampling(&e, 1, &mine);
    // SAFETY: a live engine and a writable engine_sampling.
    assert_eq!(unsafe { ffi::engine_get_sampling(e.0, 1, &mut got) }, Status::Ok);
    assert_eq!(got, mine);
    reset(&e, 1);
    // SAFETY: a live engine and a writable engine_sampling.
    assert_eq!(unsafe { ffi::engine_get_sampling(e.0, 1, &mut got) }, Status::Ok);
    assert_eq!(got, mine, "a reset keeps the stream's sampler");
    // SAFETY: a live engine; the NULL out pointer is refused before anything is written.
    assert_eq!(unsafe { ffi::engine_get_sampling(e.0, 1, std::ptr::null_mut()) }, Status::InvalidArgument);
    let opts = engine_options { min_p: 2.0, ..cpu_options(window, 3) };
    let mut none = std::ptr::null_mut();
    let c = common::c_path(&path);
    // SAFETY: a NUL-terminated path, live options and a writable handle (left NULL on failure).
    assert_eq!(unsafe { ffi::engine_init_fit(c.as_ptr(), &opts, &mut none) }, Status::InvalidArgument);
    assert!(last_error().contains("options.min_p"), "{}", last_error());
}
