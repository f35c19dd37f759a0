//! The fit rule against the seed's receipt, its boundaries, its flags, its overflow checks and its
//! largest windows, in Rust and through the C ABI; the CPU plan in `cpu`.

#[path = "../common/mod.rs"]
mod common;

mod cpu;
mod devices;

use hostembed::Status;
use hostembed::ffi::{engine_fit_default_inputs, engine_fit_plan, engine_last_error, engine_plan_describe};
use hostembed::fit::{self, ENGINE_FIT_DEFAULT_RESERVE_BYTES, engine_fit_inputs, engine_placement as P, engine_plan};
use hostembed::kv::KvTypes;
use std::ffi::CStr;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// 64 KiB of KV cache a token (the receipt's streams grow 2 GiB every 32k tokens).
const SEED_PER_TOKEN: u64 = 64 << 10;
/// The target's stream without its per-token part; with the drafter's 358 MiB the fixed part is 0.90 GiB.
const SEED_STREAM_FIXED: u64 = 564 * MIB;

/// The seed's 24 GB card, in exact bytes that reproduce every figure the receipt printed:
/// room 22754 MiB = on-card model 16036 MiB (15.66 GiB) + 6718 MiB left (6.56 GiB); the bf16 rows are
/// 248,320 x 5,120 x 2 bytes = 2425 MiB (2.37 GiB), so mapped the model is 13611 MiB (13.29 GiB) and
/// 9143 MiB (8.93 GiB) are left.
fn seed(window: u32) -> engine_fit_inputs {
    engine_fit_inputs {
        room_bytes: 22754 * MIB,
        weight_bytes: 14236 * MIB,
        embed_bytes: 248_320 * 5_120 * 2,
        scratch_bytes: 700 * MIB,
        stream_bytes: SEED_STREAM_FIXED + window as u64 * SEED_PER_TOKEN,
        stream_bytes_per_token: SEED_PER_TOKEN,
        drafter_weight_bytes: 1100 * MIB,
        drafter_stream_bytes: 358 * MIB,
        reserve_bytes: 256 * MIB,
        window,
        max_streams: 0,
        unified: false,
        embed_tied: false,
        mmap_rows: false,
    }
}

/// The same figures at window `w` under the rule's stream model (fixed part + w x per token);
/// None when that stream does not fit in 64 bits.
fn at_window(i: &engine_fit_inputs, w: u32) -> Option<engine_fit_inputs> {
    let fixed = i.stream_bytes - i.window as u64 * i.stream_bytes_per_token;
    let stream = (w as u64).checked_mul(i.stream_bytes_per_token)?.checked_add(fixed)?;
    Some(engine_fit_inputs { window: w, stream_bytes: stream, ..*i })
}

/// The plan at window `w`, or None when the figures there overflow (such a stream never starts).
fn plan_at(i: &engine_fit_inputs, w: u32) -> Option<engine_plan> {
    at_window(i, w).and_then(|i| fit::plan(&i).ok())
}

fn starts(i: &engine_fit_inputs, w: u32) -> bool {
    plan_at(i, w).is_some_and(|p| p.streams >= 1)
}

fn starts_on_card(i: &engine_fit_inputs, w: u32) -> bool {
    plan_at(i, w).is_some_and(|p| p.streams >= 1 && p.placement == P::Device)
}

/// An engine that never maps the rows (main's rule): the unified flag keeps them on the card and
/// leaves the admission, which the reserve does not enter, as it is.
fn starts_never_mapping(i: &engine_fit_inputs, w: u32) -> bool {
    let never = engine_fit_inputs { unified: true, mmap_rows: false, embed_tied: false, ..*i };
    starts(&never, w)
}

/// `max` is the last window where `holds` is true: true at `max` (when not 0), false at `max + 1`.
fn check_largest(what: &str, max: u32, holds: impl Fn(u32) -> bool) {
    if max == 0 {
        assert!(!holds(1), "{what}: 0 (none) but the rule holds at window 1");
        return;
    }
    assert!(holds(max), "{what}: the rule does not hold at the reported maximum {max}");
    if max < u32::MAX {
        assert!(!holds(max + 1), "{what}: the rule still holds at {} beyond the reported maximum", max + 1);
    }
}

fn check_max_windows(i: &engine_fit_inputs, p: &engine_plan) {
    check_largest("max_window", p.max_window, |w| starts(i, w));
    check_largest("max_window_on_card", p.max_window_on_card, |w| starts_on_card(i, w));
    check_largest("max_window_unmapped", p.max_window_unmapped, |w| starts_never_mapping(i, w));
    if p.max_window > 0 {
        assert_eq!(p.max_window_placement, plan_at(i, p.max_window).unwrap().placement, "max_window_placement");
    }
}

#[test]
fn seed_receipt_rows() {
    // (window, placement, streams, stream figure, start-up line or refusal)
    let rows = [
        (
            32_768,
            P::Device,
            2,
            "2.90",
            "model 15.66 GiB, rows on the card, 2 streams at a 32768-token window, 6.56 GiB left",
        ),
        (
            65_536,
            P::Device,
            1,
            "4.90",
            "model 15.66 GiB, rows on the card, 1 stream at a 65536-token window, 6.56 GiB left",
        ),
        (
            98_304,
            P::HostMapped,
            1,
            "6.90",
            "model 13.29 GiB, rows mapped (2.37 GiB in host memory), 1 stream at a 98304-token window, 8.93 GiB left",
        ),
        (
            131_072,
            P::HostMapped,
            1,
            "8.90",
            "model 13.29 GiB, rows mapped (2.37 GiB in host memory), 1 stream at a 131072-token window, 8.93 GiB left",
        ),
        (
            163_840,
            P::HostMapped,
            0,
            "10.90",
            "model 13.29 GiB, rows mapped (2.37 GiB in host memory), refuses: a 10.90 GiB stream, 8.93 GiB left",
        ),
    ];
    for (window, placement, streams, stream, line) in rows {
        let p = fit::plan(&seed(window)).unwrap();
        assert_eq!(p.placement, placement, "{window}: placement");
        assert_eq!(p.streams, streams, "{window}: streams");
        assert_eq!(p.window, window);
        assert_eq!(fit::gib(p.stream_bytes), stream, "{window}: one stream with the drafter's");
        assert_eq!(fit::describe(&p), line, "{window}: start-up line");
        let rows_mapped = placement == P::HostMapped;
        assert_eq!(fit::gib(p.on_card_bytes), if rows_mapped { "13.29" } else { "15.66" });
        assert_eq!(fit::gib(p.left_bytes), if rows_mapped { "8.93" } else { "6.56" });
        assert_eq!(p.embed_host_bytes, if rows_mapped { 2425 * MIB } else { 0 });
        assert_eq!(fit::gib(p.need_bytes - p.stream_bytes - p.on_card_bytes - p.embed_host_bytes), "0.25", "reserve");
    }
    let refused = fit::plan(&seed(163_840)).unwrap();
    assert_eq!(fit::refusal(&refused).as_deref(), Some("a 10.90 GiB stream, 8.93 GiB left"));
    assert_eq!(fit::refusal(&fit::plan(&seed(131_072)).unwrap()), None);
}

#[test]
fn seed_receipt_main_column() {
    // main never maps: it refuses 98k and 131k with the rows on the card, as the receipt printed.
    let main = |w| fit::plan(&engine_fit_inputs { unified: true, ..seed(w) }).unwrap();
    assert_eq!(
        fit::describe(&main(32_768)),
        "model 15.66 GiB, rows on the card, 2 streams at a 32768-token window, 6.56 GiB left"
    );
    assert_eq!(main(65_536).streams, 1);
    assert_eq!(fit::refusal(&main(98_304)).as_deref(), Some("a 6.90 GiB stream, 6.56 GiB left"));
    assert_eq!(fit::refusal(&main(131_072)).as_deref(), Some("an 8.90 GiB stream, 6.56 GiB left"));
    assert_eq!(main(163_840).streams, 0);
}

#[test]
fn seed_max_windows_answer_the_reviewer() {
    let i = seed(98_304);
    let p = fit::plan(&i).unwrap();
    // Rows on the card while 16036 + 922 + 256 MiB + w x 64 KiB <= 22754 MiB: w <= 88640.
    assert_eq!(p.max_window_on_card, 88_640);
    // Mapped, one stream while 922 MiB + w x 64 KiB <= 9143 MiB: w <= 131536.
    assert_eq!(p.max_window, 131_536);
    assert_eq!(p.max_window_placement, P::HostMapped);
    // main starts up to 92736 (no reserve): the 256 MiB reserve maps 88641..=92736 that main keeps on the card.
    assert_eq!(p.max_window_unmapped, 92_736);
    check_max_windows(&i, &p);
    for w in [32_768, 65_536, 98_304, 131_072, 163_840] {
        assert_eq!(fit::plan(&seed(w)).unwrap().max_window, 131_536, "max windows do not depend on the asked window");
    }
}

#[test]
fn boundary_room_equal_to_need_keeps_rows_on_the_card() {
    let mut i = seed(98_304);
    i.room_bytes = fit::plan(&i).unwrap().need_bytes;
    let p = fit::plan(&i).unwrap();
    assert_eq!(p.placement, P::Device, "room == need");
    assert_eq!(p.embed_host_bytes, 0);
    assert_eq!(p.left_bytes, p.stream_bytes + i.reserve_bytes, "left is the stream and the reserve");
    assert_eq!(p.streams, 1);
    i.room_bytes -= 1;
    let p = fit::plan(&i).unwrap();
    assert_eq!(p.placement, P::HostMapped, "room == need - 1");
    assert_eq!(p.embed_host_bytes, i.embed_bytes);
    assert_eq!(p.on_card_bytes, i.weight_bytes - i.embed_bytes + i.scratch_bytes + i.drafter_weight_bytes);
}

#[test]
fn flags_in_every_combination() {
    let fits = seed(32_768);
    let short = seed(98_304);
    // (unified, tied, mmap_rows, room >= need) -> placement: tied, then mmap_rows, then unified, then the room.
    let table = [
        (false, false, false, true, P::Device),
        (false, false, false, false, P::HostMapped),
        (false, false, true, true, P::FileMapped),
        (false, false, true, false, P::FileMapped),
        (false, true, false, true, P::Device),
        (false, true, false, false, P::Device),
        (false, true, true, true, P::Device),
        (false, true, true, false, P::Device),
        (true, false, false, true, P::Device),
        (true, false, false, false, P::Device),
        (true, false, true, true, P::FileMapped),
        (true, false, true, false, P::FileMapped),
        (true, true, false, true, P::Device),
        (true, true, false, false, P::Device),
        (true, true, true, true, P::Device),
        (true, true, true, false, P::Device),
    ];
    for (unified, embed_tied, mmap_rows, room_fits, placement) in table {
        let base = if room_fits { fits } else { short };
        let i = engine_fit_inputs { unified, embed_tied, mmap_rows, ..base };
        let what = format!("unified={unified} tied={embed_tied} mmap_rows={mmap_rows} fits={room_fits}");
        let p = fit::plan(&i).unwrap();
        assert_eq!(p.placement, placement, "{what}");
        let in_host = if placement == P::Device { 0 } else { i.embed_bytes };
        assert_eq!(p.embed_host_bytes, in_host, "{what}");
        assert_eq!(p.on_card_bytes, i.weight_bytes - in_host + i.scratch_bytes + i.drafter_weight_bytes, "{what}");
        assert_eq!(p.left_bytes, i.room_bytes - p.on_card_bytes, "{what}");
        assert_eq!(p.streams as u64, p.left_bytes / p.stream_bytes, "{what}");
        assert_eq!(p.need_bytes, base_need(&i), "{what}: need does not depend on the flags");
        check_max_windows(&i, &p);
        let line = fit::describe(&p);
        let rows = match placement {
            P::Device => "rows on the card",
            P::HostMapped => "rows mapped (2.37 GiB in host memory)",
            P::FileMapped => "rows read from the file mapping (2.37 GiB in host memory)",
        };
        assert!(line.contains(rows), "{what}: {line}");
    }
}

fn base_need(i: &engine_fit_inputs) -> u64 {
    i.weight_bytes
        + i.scratch_bytes
        + i.stream_bytes
        + i.drafter_weight_bytes
        + i.drafter_stream_bytes
        + i.reserve_bytes
}

#[test]
fn overflow_and_contradictions_are_invalid_arguments() {
    let cases: [(&str, fn(&mut engine_fit_inputs), &str); 6] = [
        ("weights", |i| i.weight_bytes = u64::MAX, "weight_bytes"),
        ("weights + scratch", |i| i.scratch_bytes = u64::MAX - i.weight_bytes + 1, "overflows 64 bits"),
        ("stream + drafter", |i| i.drafter_stream_bytes = u64::MAX - i.stream_bytes + 1, "overflows 64 bits"),
        ("need", |i| i.reserve_bytes = u64::MAX - 20 * GIB, "overflows 64 bits"),
        ("rows larger than the weights", |i| i.embed_bytes = i.weight_bytes + 1, "embed_bytes"),
        (
            "stream below its own growth",
            |i| i.stream_bytes = i.window as u64 * i.stream_bytes_per_token - 1,
            "stream_bytes",
        ),
    ];
    for (what, spoil, names) in cases {
        let mut i = seed(98_304);
        spoil(&mut i);
        let e = fit::plan(&i).expect_err(what);
        assert_eq!(e.status, Status::InvalidArgument, "{what}");
        assert!(e.message.contains(names), "{what}: {}", e.message);

        let mut out = fit::plan(&seed(32_768)).unwrap();
        // SAFETY: live inputs and a writable plan.
        let status = unsafe { engine_fit_plan(&i, &mut out) };
        assert_eq!(status, Status::InvalidArgument, "{what} through the C ABI");
        // SAFETY: engine_last_error is this thread's NUL-terminated message, valid until its next failure.
        assert_eq!(unsafe { CStr::from_ptr(engine_last_error()) }.to_str().unwrap(), e.message);
    }
    let zero_stream =
        engine_fit_inputs { stream_bytes: 0, drafter_stream_bytes: 0, stream_bytes_per_token: 0, ..seed(0) };
    assert_eq!(fit::plan(&zero_stream).unwrap_err().status, Status::InvalidArgument);
    // The largest sums that still fit are no error.
    let edge = engine_fit_inputs {
        room_bytes: u64::MAX,
        weight_bytes: u64::MAX - 3,
        embed_bytes: 0,
        scratch_bytes: 0,
        stream_bytes: 1,
        stream_bytes_per_token: 0,
        drafter_weight_bytes: 0,
        drafter_stream_bytes: 1,
        reserve_bytes: 1,
        ..fit::default_inputs()
    };
    let p = fit::plan(&edge).unwrap();
    assert_eq!((p.need_bytes, p.placement, p.streams), (u64::MAX, P::Device, 1));
}

#[test]
fn max_streams_caps_the_count() {
    for (cap, streams) in [(0, 2), (1, 1), (2, 2), (5, 2)] {
        let p = fit::plan(&engine_fit_inputs { max_streams: cap, ..seed(32_768) }).unwrap();
        assert_eq!(p.streams, streams, "max_streams {cap}");
        assert_eq!(fit::describe(&p).contains("2 streams"), streams == 2);
    }
    let many = engine_fit_inputs { room_bytes: 100 * GIB, max_streams: 3, ..seed(1024) };
    assert_eq!(fit::plan(&many).unwrap().streams, 3);
    assert_eq!(fit::plan(&engine_fit_inputs { max_streams: 0, ..many }).unwrap().streams, 87);
}

#[test]
fn max_windows_hold_at_max_and_not_beyond_on_random_figures() {
    let mut rng = common::Rng::fresh("max_windows_hold_at_max_and_not_beyond_on_random_figures");
    let mut seen = [0usize; 3];
    for _ in 0..3000 {
        let weight = rng.below(40 * GIB);
        let per_token = match rng.below(4) {
            0 => 1 + rng.below(16),
            _ => 1 + rng.below(512 << 10),
        };
        let window = rng.below(300_000) as u32;
        let i = engine_fit_inputs {
            room_bytes: rng.below(80 * GIB),
            weight_bytes: weight,
            embed_bytes: rng.below(weight / 4 + 1),
            scratch_bytes: rng.below(2 * GIB),
            stream_bytes: window as u64 * per_token + rng.below(2 * GIB) + 1,
            stream_bytes_per_token: per_token,
            drafter_weight_bytes: if rng.below(2) == 0 { 0 } else { rng.below(2 * GIB) },
            drafter_stream_bytes: if rng.below(2) == 0 { 0 } else { rng.below(GIB) },
            reserve_bytes: rng.below(GIB),
            window,
            max_streams: rng.below(4) as u32,
            unified: rng.below(4) == 0,
            embed_tied: rng.below(4) == 0,
            mmap_rows: rng.below(4) == 0,
        };
        let p = fit::plan(&i).unwrap();
        check_max_windows(&i, &p);
        assert!(p.max_window >= p.max_window_on_card, "{i:?}");
        // Every window below the largest starts too (the rule is monotone in the window).
        for _ in 0..4 {
            if p.max_window > 1 {
                let w = 1 + rng.below(p.max_window as u64) as u32;
                assert!(starts(&i, w), "{i:?}: window {w} below max_window {} refuses", p.max_window);
            }
        }
        seen[p.max_window_placement as usize] += p.max_window.min(1) as usize;
    }
    assert!(seen.iter().all(|&n| n > 0), "random figures reached every max_window placement: {seen:?}");
}

#[test]
fn unknown_growth_reports_no_max_windows() {
    let p = fit::plan(&engine_fit_inputs { stream_bytes_per_token: 0, ..seed(98_304) }).unwrap();
    assert_eq!((p.max_window, p.max_window_on_card, p.max_window_unmapped), (0, 0, 0));
    assert_eq!(p.max_window_placement, p.placement);
    assert_eq!(p.streams, 1);
}

#[test]
fn gib_rounds_half_up_with_two_decimals() {
    assert_eq!(fit::gib(0), "0.00");
    assert_eq!(fit::gib(GIB), "1.00");
    assert_eq!(fit::gib(1 << 27), "0.13", "0.125 GiB is a tie and rounds up");
    assert_eq!(fit::gib((1 << 27) - 1), "0.12");
    assert_eq!(fit::gib(u64::MAX), "17179869184.00");
    assert_eq!(fit::gib(248_320 * 10_240), "2.37");
}

#[test]
fn refusals_take_the_spoken_article() {
    let refuse = |stream: u64| {
        let p = engine_plan { streams: 0, stream_bytes: stream, left_bytes: GIB / 2, ..fit::plan(&seed(0)).unwrap() };
        fit::refusal(&p).unwrap()
    };
    assert_eq!(refuse(8 * GIB), "an 8.00 GiB stream, 0.50 GiB left");
    assert_eq!(refuse(11 * GIB), "an 11.00 GiB stream, 0.50 GiB left");
    assert_eq!(refuse(18 * GIB), "an 18.00 GiB stream, 0.50 GiB left");
    assert_eq!(refuse(83 * GIB), "an 83.00 GiB stream, 0.50 GiB left");
    assert_eq!(refuse(1 * GIB), "a 1.00 GiB stream, 0.50 GiB left");
    assert_eq!(refuse(GIB / 2), "a 0.50 GiB stream, 0.50 GiB left");
    let line = fit::describe(&fit::plan(&seed(8192)).unwrap());
    assert!(line.contains("at an 8192-token window"), "{line}");
}

#[test]
fn c_abi_default_inputs() {
    let d = engine_fit_default_inputs();
    assert_eq!(d.reserve_bytes, 256 * MIB);
    assert_eq!(d.reserve_bytes, ENGINE_FIT_DEFAULT_RESERVE_BYTES);
    assert_eq!(
        engine_fit_inputs { reserve_bytes: 0, ..d },
        engine_fit_inputs { reserve_bytes: 0, ..fit::default_inputs() }
    );
    // SAFETY: engine_fit_inputs is numbers and bools: all zeros is a value of it.
    let zero: engine_fit_inputs = unsafe { std::mem::zeroed() };
    assert_eq!(engine_fit_inputs { reserve_bytes: 0, ..d }, zero, "every other figure 0, every flag false");
}

#[test]
fn c_abi_plans_and_refuses_like_rust() {
    for w in [32_768, 65_536, 98_304, 131_072] {
        // SAFETY: engine_plan is numbers and enums with a variant at 0: all zeros is a value of it.
        let mut out: engine_plan = unsafe { std::mem::zeroed() };
        // SAFETY: live inputs and a writable plan.
        assert_eq!(unsafe { engine_fit_plan(&seed(w), &mut out) }, Status::Ok, "{w}");
        assert_eq!(out, fit::plan(&seed(w)).unwrap());
    }
    // SAFETY: engine_plan is numbers and enums with a variant at 0: all zeros is a value of it.
    let mut out: engine_plan = unsafe { std::mem::zeroed() };
    // SAFETY: live inputs and a writable plan.
    assert_eq!(unsafe { engine_fit_plan(&seed(163_840), &mut out) }, Status::NoRoom);
    // SAFETY: engine_last_error is this thread's NUL-terminated message, valid until its next failure.
    assert_eq!(unsafe { CStr::from_ptr(engine_last_error()) }.to_str().unwrap(), "a 10.90 GiB stream, 8.93 GiB left");
    assert_eq!(out, fit::plan(&seed(163_840)).unwrap(), "out is filled on NO_ROOM");

    // SAFETY: the NULL inputs are refused before `out` is written.
    assert_eq!(unsafe { engine_fit_plan(std::ptr::null(), &mut out) }, Status::InvalidArgument);
    // SAFETY: engine_last_error is this thread's NUL-terminated message, valid until its next failure.
    assert!(unsafe { CStr::from_ptr(engine_last_error()) }.to_str().unwrap().contains("inputs is NULL"));
    // SAFETY: the NULL out is refused after the live inputs are read.
    assert_eq!(unsafe { engine_fit_plan(&seed(0), std::ptr::null_mut()) }, Status::InvalidArgument);
    // SAFETY: engine_last_error is this thread's NUL-terminated message, valid until its next failure.
    assert!(unsafe { CStr::from_ptr(engine_last_error()) }.to_str().unwrap().contains("out is NULL"));
}

#[test]
fn c_abi_describe_has_snprintf_semantics() {
    let plan = fit::plan(&seed(98_304)).unwrap();
    let line =
        "model 13.29 GiB, rows mapped (2.37 GiB in host memory), 1 stream at a 98304-token window, 8.93 GiB left";
    // SAFETY: a live plan; a NULL buffer of length 0 is never written.
    assert_eq!(unsafe { engine_plan_describe(&plan, std::ptr::null_mut(), 0) }, line.len(), "length with no buffer");
    let mut buf = vec![0x7f as std::os::raw::c_char; 128];
    // SAFETY: a live plan and a buffer of buf.len() chars to write.
    assert_eq!(unsafe { engine_plan_describe(&plan, buf.as_mut_ptr(), buf.len()) }, line.len());
    // SAFETY: engine_plan_describe NUL-terminated what it wrote inside `buf`.
    assert_eq!(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap(), line);
    let mut small = vec![0x7f as std::os::raw::c_char; 11];
    // SAFETY: a live plan and a buffer of small.len() chars to write.
    assert_eq!(unsafe { engine_plan_describe(&plan, small.as_mut_ptr(), small.len()) }, line.len());
    // SAFETY: engine_plan_describe NUL-terminated what it wrote inside `small`.
    assert_eq!(unsafe { CStr::from_ptr(small.as_ptr()) }.to_str().unwrap(), &line[..10], "truncated, NUL-terminated");

    // SAFETY: the NULL plan is refused; it writes only the empty string into `buf`.
    assert_eq!(unsafe { engine_plan_describe(std::ptr::null(), buf.as_mut_ptr(), buf.len()) }, 0);
    assert_eq!(buf[0], 0, "an empty string on failure");
    // SAFETY: engine_last_error is this thread's NUL-terminated message, valid until its next failure.
    assert!(unsafe { CStr::from_ptr(engine_last_error()) }.to_str().unwrap().contains("plan is NULL"));

    // A placement C wrote that names none: refused before Rust reads it as an enum.
    let mut raw = vec![0u8; std::mem::size_of::<engine_plan>() + 8];
    let aligned = raw.as_mut_ptr().wrapping_add(raw.as_ptr().align_offset(8));
    // SAFETY: `aligned` is 8-aligned with size_of::<engine_plan>() bytes of `raw` after it; the u32 write is inside.
    unsafe {
        std::ptr::copy_nonoverlapping(
            &plan as *const engine_plan as *const u8,
            aligned,
            std::mem::size_of::<engine_plan>(),
        );
        (aligned.add(std::mem::offset_of!(engine_plan, placement)) as *mut u32).write(7);
    }
    // SAFETY: `aligned` holds a whole engine_plan's bytes, 8-aligned, whose placement C-side is 7; a live buffer.
    assert_eq!(unsafe { engine_plan_describe(aligned as *const engine_plan, buf.as_mut_ptr(), buf.len()) }, 0);
    // SAFETY: engine_last_error is this thread's NUL-terminated message, valid until its next failure.
    let message = unsafe { CStr::from_ptr(engine_last_error()) }.to_str().unwrap().to_string();
    assert!(message.contains("placement is 7"), "{message}");
}

/// The receipt's model shape in KV terms: 64 KiB a token in BF16 is 32,768 values a token, K and V
/// together, i.e. layers x kv_heads x head_dim = 16,384 for each of K and V: 16 layers of 4 KV heads of
/// 256 here, and 32 layers of 4 heads of 128 or 16 of 8 of 128 give the same bytes for every type, as
/// each of those heads is whole blocks of 32. A type's stream is then the receipt's 564 MiB fixed part
/// (what is not KV) + its own bytes a token: BF16 and F16 2 bytes a value, F32 4, Q8_0 and FP8_E4M3 34
/// bytes a block of 32.
fn receipt_kv_shape() -> hostembed::model::ModelConfig {
    hostembed::model::ModelConfig {
        arch: hostembed::model::Arch::Qwen3,
        vocab: 248_320,
        hidden: 5_120,
        layers: 16,
        heads: 24,
        kv_heads: 4,
        head_dim: 256,
        intermediate: 17_408,
        rms_eps: 1e-6,
        rope_theta: 1e7,
        rope_scaling: hostembed::model::RopeScaling::None,
        rope_interleaved: false,
        max_position: 262_144,
        tied: false,
        qkv_bias: false,
        qk_norm: true,
        attention: Default::default(),
        bos: None,
        eos: None,
        moe: None,
    }
}

/// The receipt's figures with a KV cache of `kv`: the same card, weights and drafter; the stream's
/// per-token part in the type's bytes.
fn seed_with(kv: KvTypes, window: u32) -> engine_fit_inputs {
    let per_token = kv.bytes_per_token(&receipt_kv_shape());
    engine_fit_inputs {
        stream_bytes: SEED_STREAM_FIXED + window as u64 * per_token,
        stream_bytes_per_token: per_token,
        ..seed(window)
    }
}

#[test]
fn the_receipt_recomputed_for_every_kv_type() {
    use hostembed::kv::KvType;
    assert_eq!(KvTypes::GPU_DEFAULT.bytes_per_token(&receipt_kv_shape()), SEED_PER_TOKEN, "the receipt's BF16");
    let windows = [32_768u32, 65_536, 98_304, 131_072, 163_840];
    let mut admitted = std::collections::HashMap::new();
    for t in KvType::ALL {
        let kv = KvTypes::same(t);
        let per_token = kv.bytes_per_token(&receipt_kv_shape());
        println!("{} ({} bytes a token):", t.name(), per_token);
        for w in windows {
            let p = fit::plan(&seed_with(kv, w)).unwrap();
            println!("  {w:>6}: {}", fit::describe(&p));
            assert_eq!(p.stream_bytes, SEED_STREAM_FIXED + 358 * MIB + w as u64 * per_token);
            admitted.insert((t, w), p.streams > 0);
        }
    }
    // BF16 and F16 are the receipt: 163,840 refused with "a 10.90 GiB stream, 8.93 GiB left".
    for t in [KvType::Bf16, KvType::F16] {
        let p = fit::plan(&seed_with(KvTypes::same(t), 163_840)).unwrap();
        assert_eq!(fit::refusal(&p).as_deref(), Some("a 10.90 GiB stream, 8.93 GiB left"), "{}", t.name());
        assert_eq!(p, fit::plan(&seed(163_840)).unwrap(), "{}: the receipt's own plan", t.name());
    }
    // An 8-bit cache halves the KV part (34 bytes a block of 32 values where BF16 takes 64): 163,840
    // starts, its rows still on the card (16036 + 6362 + 256 MiB of need, 22754 MiB of room).
    for t in [KvType::Q8_0, KvType::Fp8E4m3] {
        assert_eq!(KvTypes::same(t).bytes_per_token(&receipt_kv_shape()), 34 << 10);
        let p = fit::plan(&seed_with(KvTypes::same(t), 163_840)).unwrap();
        assert_eq!(
            fit::describe(&p),
            "model 15.66 GiB, rows on the card, 1 stream at a 163840-token window, 6.56 GiB left",
            "{}",
            t.name()
        );
        assert_eq!(fit::gib(p.stream_bytes), "6.21", "{}: 564 + 5440 + 358 MiB", t.name());
        let p = fit::plan(&seed_with(KvTypes::same(t), 98_304)).unwrap();
        assert_eq!((p.placement, p.streams), (P::Device, 1), "{}: 98k stays on the card", t.name());
        assert!(p.max_window > 163_840, "{}: the largest window {}", t.name(), p.max_window);
        check_max_windows(&seed_with(KvTypes::same(t), 98_304), &p);
    }
    // F32 doubles BF16's: 65,536 is as far as it goes (mapped), 98,304 is refused.
    assert!(admitted[&(KvType::F32, 65_536)] && !admitted[&(KvType::F32, 98_304)]);
    // Every type admits every window a smaller type admits.
    for w in windows {
        assert!(!admitted[&(KvType::Bf16, w)] || admitted[&(KvType::Q8_0, w)], "{w}");
        assert!(!admitted[&(KvType::F32, w)] || admitted[&(KvType::Bf16, w)], "{w}");
    }
}
