//! The CPU plan: streams beside the step scratch, and the sliding-window layers counted at their share.

use super::MIB;
use hostembed::fit;
use hostembed::kv::KvTypes;

/// The CPU plan: a model of 2 layers x 2 KV heads x 16 dims at a 256-token window (128 KiB a stream).
fn cpu(room_bytes: u64, scratch_bytes: u64) -> fit::CpuFitInputs {
    fit::CpuFitInputs {
        layers: 2,
        window: 256,
        kv_heads: 2,
        head_dim: 16,
        kv: KvTypes::CPU_DEFAULT,
        want_streams: 100,
        slot_bytes: 64,
        scratch_bytes,
        room_bytes,
        probed: None,
        local: None,
    }
}

#[test]
fn cpu_streams_leave_room_for_the_step_scratch() {
    let stream = fit::cpu_kv_bytes(2, 256, 2, 16, KvTypes::CPU_DEFAULT).unwrap() + 64;
    let scratch = 3 * MIB;
    assert_eq!(fit::plan_cpu(&cpu(scratch + 3 * stream, scratch)).streams, 3);
    assert_eq!(fit::plan_cpu(&cpu(scratch + 3 * stream - 1, scratch)).streams, 2);
    // The same room with no scratch to pay holds the scratch's worth of streams more.
    assert_eq!(fit::plan_cpu(&cpu(scratch + 3 * stream, 0)).streams as u64, 3 + scratch / stream);
    let line = fit::describe_cpu(&fit::plan_cpu(&cpu(scratch + 3 * stream, scratch)));
    assert!(
        line.starts_with("3 streams of 0.00 GiB (F32 KV cache) at a 256-token window, beside 0.00 GiB of step scratch"),
        "{line}"
    );
    // Room for the scratch and not one stream: refused, the refusal naming both.
    let refused = fit::plan_cpu(&cpu(scratch + stream - 1, scratch));
    assert_eq!(refused.streams, 0);
    let why = fit::refusal_cpu(&refused).unwrap();
    assert!(why.contains("256-token window") && why.contains("step scratch"), "{why}");
    // Scratch larger than the room: refused, not wrapped around.
    assert_eq!(fit::plan_cpu(&cpu(MIB, u64::MAX)).streams, 0);
}

/// Gemma 3 27B's shape of layers: 62, every sixth global, local windows of 1,024.
fn gemma3_layers(window: usize) -> hostembed::model::ModelConfig {
    let mut cfg = hostembed::model::ModelConfig::llama(64, 62, 4, 2, 128, 256);
    cfg.attention.sliding = Some(hostembed::model::SlidingWindow { window, global_every: 6, rope_theta: 10_000.0 });
    cfg
}

/// The sliding-window layers' share: the window's reach with the margin (32 proposals and a score's
/// recomputed position beside 128 of attention reach) and a piece with 32 proposals, in whole pages;
/// none where that would hold the whole stream window, or without such layers.
#[test]
fn local_share_counts_the_window_reach_and_a_piece() {
    let cfg = gemma3_layers(1024);
    let share = fit::local_share(&cfg, 131_072, 16, 2048).unwrap();
    let pages = (1024 + 161usize).div_ceil(16) + 1 + (2048 + 32usize).div_ceil(16) + 1;
    assert_eq!(share, fit::LocalShare { layers: 52, window: 1024, positions: (pages * 16) as u64 });
    assert_eq!(fit::local_share(&cfg, pages * 16, 16, 2048), None, "a stream window the share fills");
    assert!(fit::local_share(&cfg, pages * 16 + 16, 16, 2048).is_some());
    assert_eq!(fit::local_share(&hostembed::model::ModelConfig::llama(64, 4, 4, 2, 128, 256), 131_072, 16, 2048), None);
}

/// The CPU plan counts the sliding-window layers at their share's positions and the others at the
/// window: a stream costs less, so more start in the same room.
#[test]
fn cpu_plan_counts_local_layers_at_their_share() {
    let whole = fit::plan_cpu(&cpu(1 << 30, 0));
    let local = fit::LocalShare { layers: 1, window: 9, positions: 64 };
    let apart = fit::plan_cpu(&fit::CpuFitInputs { local: Some(local), ..cpu(1 << 30, 0) });
    let row = 2 * 16 * 4 * 2; // K and V rows of 2 heads of 16 f32 values
    assert_eq!(whole.stream_bytes, Some(2 * 256 * row + 64));
    assert_eq!(apart.stream_bytes, Some(256 * row + 64 * row + 64));
    let small = fit::plan_cpu(&fit::CpuFitInputs { local: Some(local), ..cpu(100 * (256 * row + 64 * row + 64), 0) });
    assert_eq!(small.streams, 100, "a hundred streams at the share's bytes");
    assert!(fit::plan_cpu(&cpu(100 * (256 * row + 64 * row + 64), 0)).streams < 100);
}
