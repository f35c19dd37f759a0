//! engine_truncate and the KV page pool: re-stepping after a truncate, the pool's room, and running out of pages.

use super::{PAGE, model, qwen2, random_ids};
use crate::common::{
    Rng, Scratch, bits, cpu_options, info, init, kv_stats, logits, reset, room_for_tokens, serial, step, stream_len,
    truncate, try_batch, try_step,
};
use hostembed::engine::engine_options;
use hostembed::status::last_error;
use hostembed::{Status, ffi};

/// Truncating to any length and stepping the same tokens again gives the same logits, bit for bit, and
/// gives back exactly the pages past the new length.
#[test]
fn truncate_then_restep_gives_the_same_logits() {
    let _g = serial();
    let mut rng = Rng::fresh("truncate_then_restep_gives_the_same_logits");
    let dir = Scratch::new("batch-truncate");
    let path = model(&dir, &mut rng);
    let e = init(&path, &cpu_options(256, 2));
    let (total, _) = kv_stats(&e);
    let prompt = random_ids(&mut rng, 70);
    let mut fed = prompt.clone();
    let mut want = vec![(fed.len(), step(&e, 0, &prompt), logits(&e, 0))];
    for _ in 0..30 {
        let next = want.last().unwrap().1;
        fed.push(next);
        want.push((fed.len(), step(&e, 0, &[next]), logits(&e, 0)));
    }
    for keep in [99u32, 64, 63, 33, 32, 31, 5, 1, 0] {
        let before = stream_len(&e, 0) as u64;
        truncate(&e, 0, keep);
        assert_eq!(stream_len(&e, 0), keep);
        assert_eq!(kv_stats(&e), (total, total - (keep as u64).div_ceil(PAGE) * PAGE), "kept {keep}");
        assert!(before >= keep as u64);
        // The logits are gone with the positions.
        let mut out = vec![0f32; qwen2().vocab];
        // SAFETY: a live engine and a buffer of out.len() floats to write.
        assert_eq!(unsafe { ffi::engine_logits(e.0, 0, out.as_mut_ptr(), out.len()) }, Status::InvalidArgument);
        // Feed back what was fed after `keep`, one chunk then single tokens, and check each logit met.
        let keep = keep as usize;
        let split = (keep + 7).min(fed.len());
        if keep < split {
            let got = step(&e, 0, &fed[keep..split]);
            if let Some((_, next, l)) = want.iter().find(|(n, _, _)| *n == split) {
                assert_eq!(got, *next, "kept {keep}: token after {split}");
                assert_eq!(bits(&logits(&e, 0)), bits(l), "kept {keep}: logits after {split}");
            }
        }
        for at in split..fed.len() {
            let got = step(&e, 0, &fed[at..at + 1]);
            if let Some((_, next, l)) = want.iter().find(|(n, _, _)| *n == at + 1) {
                assert_eq!(got, *next, "kept {keep}: token after {}", at + 1);
                assert_eq!(bits(&logits(&e, 0)), bits(l), "kept {keep}: logits after {}", at + 1);
            }
        }
        assert_eq!(stream_len(&e, 0) as usize, fed.len());
    }
    // Truncating to the length it has changes nothing; past it, or on a stream that does not exist, fails.
    let len = stream_len(&e, 0);
    truncate(&e, 0, len);
    assert_eq!(bits(&logits(&e, 0)), bits(&want.last().unwrap().2), "logits after a truncate that cut nothing");
    // SAFETY: a live engine; a length past the stream's is refused before anything changes.
    assert_eq!(unsafe { ffi::engine_truncate(e.0, 0, len + 1) }, Status::OutOfRange);
    // SAFETY: a live engine; truncating an empty stream is refused before anything changes.
    assert_eq!(unsafe { ffi::engine_truncate(e.0, 1, 1) }, Status::OutOfRange, "an empty stream");
    // SAFETY: a live engine; a stream past its streams is refused before anything changes.
    assert_eq!(unsafe { ffi::engine_truncate(e.0, 2, 0) }, Status::OutOfRange, "no stream 2");
    // SAFETY: a NULL engine is refused before anything is read.
    assert_eq!(unsafe { ffi::engine_truncate(std::ptr::null_mut(), 0, 0) }, Status::InvalidArgument);
    assert_eq!(stream_len(&e, 0), len);
}

/// The pool takes the room the plan leaves, not only the full windows that fit in it: room for two and a
/// half windows is a pool of two and a half windows that eight streams share, two of them whole windows.
#[test]
fn the_pool_takes_the_room_the_plan_leaves() {
    let _g = serial();
    let mut rng = Rng::fresh("the_pool_takes_the_room_the_plan_leaves");
    let dir = Scratch::new("batch-pool-room");
    let path = model(&dir, &mut rng);
    let window = 128u32;
    let tokens = 5 * window as u64 / 2;
    let opts = engine_options { room_bytes: room_for_tokens(&qwen2(), window, 8, tokens), ..cpu_options(window, 8) };
    let e = init(&path, &opts);
    assert_eq!(info(&e).streams, 8);
    assert_eq!(kv_stats(&e), (tokens, tokens), "a pool of the room's {tokens} positions");
    let reference = init(&path, &cpu_options(window, 8));
    let (a, b, c) = (
        random_ids(&mut rng, window as usize),
        random_ids(&mut rng, window as usize),
        random_ids(&mut rng, window as usize / 2),
    );
    let (st, out) = try_batch(&e, &[(0, &a), (1, &b), (2, &c)]);
    assert_eq!(st, Status::Ok, "{}", last_error());
    let want = [step(&reference, 0, &a), step(&reference, 1, &b), step(&reference, 2, &c)];
    assert_eq!(out, want.map(|t| (Status::Ok, t)), "{}", last_error());
    assert_eq!(kv_stats(&e), (tokens, 0), "two whole windows and a half one fill it");
    let (st, out) = try_batch(&e, &[(3, &a[..1])]);
    assert_eq!((st, out[0]), (Status::Ok, (Status::NoRoom, -1)));
    reset(&e, 0);
    assert_eq!(kv_stats(&e), (tokens, window as u64));
}

/// A pool of two windows shared by eight streams: an item that needs a page when none is free fails with
/// NO_ROOM and appends nothing while the others in its batch proceed; truncate and reset give pages back,
/// and the pool is whole after the resets.
#[test]
fn pool_exhaustion_fails_only_the_item_that_needs_a_page() {
    let _g = serial();
    let mut rng = Rng::fresh("pool_exhaustion_fails_only_the_item_that_needs_a_page");
    let dir = Scratch::new("batch-pool");
    let path = model(&dir, &mut rng);
    let window = 128u32;
    let opts = engine_options {
        room_bytes: room_for_tokens(&qwen2(), window, 8, 2 * window as u64),
        ..cpu_options(window, 8)
    };
    let e = init(&path, &opts);
    let reference = init(&path, &cpu_options(window, 8));
    assert_eq!(info(&e).streams, 8, "max_streams bounds the streams, not the full windows");
    let (total, free) = kv_stats(&e);
    assert_eq!((total, free), (2 * window as u64, 2 * window as u64), "a pool of two windows");

    // Streams 0 and 1 take 100 positions each: 4 pages each, every page of the pool.
    let (p0, p1, p2) = (random_ids(&mut rng, 100), random_ids(&mut rng, 100), random_ids(&mut rng, 20));
    let (st, out) = try_batch(&e, &[(0, &p0), (1, &p1)]);
    assert_eq!(st, Status::Ok);
    assert_eq!(out, [(Status::Ok, step(&reference, 0, &p0)), (Status::Ok, step(&reference, 1, &p1))]);
    assert_eq!(kv_stats(&e), (total, 0));

    // Stream 0's next token fits its last page; stream 2 needs a page and there is none.
    let first0 = out[0].1;
    let (st, out) = try_batch(&e, &[(2, &p2), (0, &[first0])]);
    assert_eq!(st, Status::Ok, "a full pool fails the item, not the call");
    assert_eq!(out[0], (Status::NoRoom, -1), "stream 2: {}", last_error());
    assert!(last_error().contains("pages"), "{}", last_error());
    assert_eq!(out[1].0, Status::Ok);
    assert_eq!(out[1].1, step(&reference, 0, &[first0]), "stream 0 proceeds");
    assert_eq!(bits(&logits(&e, 0)), bits(&logits(&reference, 0)));
    assert_eq!(stream_len(&e, 2), 0, "the refused item appended nothing");
    assert_eq!(try_step(&e, 2, &p2[..1]).0, Status::NoRoom);
    // Stream 1 crossing into a fifth page fails too; its length stays 100.
    let (st, out) = try_batch(&e, &[(1, &random_ids(&mut rng, 40))]);
    assert_eq!((st, out[0]), (Status::Ok, (Status::NoRoom, -1)));
    assert_eq!(stream_len(&e, 1), 100);

    // Truncating stream 0 to 60 positions gives back 2 pages: stream 2 fits in them.
    truncate(&e, 0, 60);
    assert_eq!(kv_stats(&e), (total, 2 * PAGE));
    let mut reference2 = step(&reference, 2, &p2);
    let (st, out) = try_batch(&e, &[(2, &p2)]);
    assert_eq!((st, out[0]), (Status::Ok, (Status::Ok, reference2)));
    assert_eq!(bits(&logits(&e, 2)), bits(&logits(&reference, 2)), "stream 2's logits from a recycled page");
    for _ in 0..5 {
        let (st, out) = try_batch(&e, &[(2, &[reference2])]);
        assert_eq!(st, Status::Ok);
        let want = step(&reference, 2, &[reference2]);
        assert_eq!(out[0], (Status::Ok, want));
        reference2 = want;
    }
    for s in 0..8 {
        reset(&e, s);
    }
    assert_eq!(kv_stats(&e), (total, total), "whole again after the resets");
    // And it serves the same two windows again.
    let (st, out) = try_batch(&e, &[(5, &p0), (7, &p1)]);
    assert_eq!((st, out[0].0, out[1].0), (Status::Ok, Status::Ok, Status::Ok));
}
