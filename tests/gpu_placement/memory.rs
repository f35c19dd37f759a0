//! Device memory: predicted on-card bytes, the fit rule's boundary, and failed loads that hold nothing.

use super::{MIB, config, free_bytes, need_of, options, placements, rows_of, warm_up, write_model};
use crate::common::{Held, Scratch, c_path, gpu_present, init, serial, stats};
use hostembed::checkpoint::Checkpoint;
use hostembed::checkpoint::write::write_synthetic_gguf;
use hostembed::engine::{Engine, InitStep, engine_kv_type, engine_options, engine_tristate};
use hostembed::fit::{engine_placement, engine_plan};
use hostembed::model::ModelConfig;
use hostembed::placement::engine_memory;
use hostembed::status::last_error;
use hostembed::tensor::DType;
use hostembed::{Status, ffi, fit};

/// The engine's own prediction of what its load puts on the card (plan.on_card_bytes: weights,
/// scratch, and the rows when they stay there) against cudaMemGetInfo, in every placement, and with the
/// prompt path's larger buffers.
#[test]
fn predicted_on_card_bytes_match_measured() {
    if !gpu_present("predicted_on_card_bytes_match_measured") {
        return;
    }
    let _g = serial();
    let dir = Scratch::new("predicted");
    warm_up(&dir.0);
    let cfg =
        ModelConfig { layers: 2, heads: 16, kv_heads: 4, head_dim: 128, intermediate: 5632, ..config(32_000, 2_048) };
    let path = write_model(&dir.0, &cfg, DType::Bf16, 8);
    let mut lines = Vec::new();
    for (placement, opts) in placements(&path, &mut lines) {
        let base = free_bytes();
        let e = init(&path, &opts);
        let taken = base.saturating_sub(free_bytes());
        // SAFETY: engine_plan is numbers and enums with a variant at 0: all zeros is a value of it.
        let mut plan: engine_plan = unsafe { std::mem::zeroed() };
        // SAFETY: a live engine and a writable engine_plan.
        assert_eq!(unsafe { ffi::engine_plan_of(e.0, &mut plan) }, Status::Ok);
        println!("{placement:?}: predicted on card {} MiB, measured {} MiB", plan.on_card_bytes / MIB, taken / MIB);
        assert!(
            plan.on_card_bytes.abs_diff(taken) <= 32 * MIB,
            "{placement:?}: predicted {} bytes on the card, cudaMemGetInfo says {taken}",
            plan.on_card_bytes
        );
        drop(e);
        assert_eq!(stats(), engine_memory::default());
    }
    // The prompt path's buffers counted too: the default chunk (max_batch 0) and a chunk of 2,048, Q8_0
    // weights (their conversion slab) and an 8-bit cache (its stage).
    let q8 = write_model(&dir.0, &cfg, DType::Q8_0, 8);
    for (max_batch, kv) in [(0, engine_kv_type::ENGINE_KV_DEFAULT), (2048, engine_kv_type::ENGINE_KV_Q8_0)] {
        let opts = engine_options {
            max_batch,
            kv_type_k: kv,
            kv_type_v: kv,
            ..options(1 << 50, engine_tristate::No, &mut lines)
        };
        let base = free_bytes();
        let e = init(&q8, &opts);
        let taken = base.saturating_sub(free_bytes());
        // SAFETY: engine_plan is numbers and enums with a variant at 0: all zeros is a value of it.
        let mut plan: engine_plan = unsafe { std::mem::zeroed() };
        // SAFETY: a live engine and a writable engine_plan.
        assert_eq!(unsafe { ffi::engine_plan_of(e.0, &mut plan) }, Status::Ok);
        let what = format!("Q8_0 weights, max_batch {max_batch}, cache {kv:?}");
        println!("{what}: predicted on card {} MiB, measured {} MiB", plan.on_card_bytes / MIB, taken / MIB);
        assert!(
            plan.on_card_bytes.abs_diff(taken) <= 32 * MIB,
            "{what}: predicted {} bytes on the card, cudaMemGetInfo says {taken}",
            plan.on_card_bytes
        );
        drop(e);
        assert_eq!(stats(), engine_memory::default());
    }
}

#[test]
fn room_swept_across_the_boundary_flips_where_the_rule_says() {
    if !gpu_present("room_swept_across_the_boundary_flips_where_the_rule_says") {
        return;
    }
    let _g = serial();
    let dir = Scratch::new("sweep");
    let path = write_model(&dir.0, &config(4096, 512), DType::Bf16, 3);
    let mut lines = Vec::new();
    let (inputs, plan) = need_of(&path, &options(1 << 50, engine_tristate::No, &mut lines));
    let need = plan.need_bytes;
    let start_mapped = inputs.weight_bytes - inputs.embed_bytes + inputs.scratch_bytes + inputs.stream_bytes;
    let start_on_card = inputs.weight_bytes + inputs.scratch_bytes + inputs.stream_bytes;
    let mut rooms =
        vec![need + 1, need, need - 1, need - 4096, start_on_card, start_mapped + 1, start_mapped, start_mapped - 1];
    rooms.extend((0..8).map(|k| start_mapped - 1 + (need + 2 - start_mapped) * k / 7));
    let mut seen = std::collections::BTreeSet::new();
    for room in rooms {
        let want = fit::plan(&fit::engine_fit_inputs { room_bytes: room, ..inputs }).unwrap();
        let opts = options(room, engine_tristate::No, &mut lines);
        let mut e = std::ptr::null_mut();
        // SAFETY: a NUL-terminated path that lives across the call, live options and a writable handle.
        let st = unsafe { ffi::engine_init_fit(c_path(&path).as_ptr(), &opts, &mut e) };
        if want.streams == 0 {
            assert_eq!(st, Status::NoRoom, "room {room}");
            assert_eq!(last_error(), fit::refusal(&want).unwrap(), "room {room}");
            assert!(e.is_null());
        } else {
            assert_eq!(st, Status::Ok, "room {room}: {}", last_error());
            let e = Held(e);
            // SAFETY: engine_plan is numbers and enums with a variant at 0: all zeros is a value of it.
            let mut got: engine_plan = unsafe { std::mem::zeroed() };
            // SAFETY: a live engine and a writable engine_plan.
            assert_eq!(unsafe { ffi::engine_plan_of(e.0, &mut got) }, Status::Ok);
            assert_eq!(got, want, "room {room}: the engine's plan is the rule's");
            assert_eq!(rows_of(&e).placement, want.placement, "room {room}");
            drop(e);
        }
        seen.insert(format!("{:?}/{}", want.placement, want.streams > 0));
        assert_eq!(stats(), engine_memory::default(), "room {room}");
    }
    assert_eq!(
        fit::plan(&fit::engine_fit_inputs { room_bytes: need, ..inputs }).unwrap().placement,
        engine_placement::Device
    );
    assert_eq!(
        fit::plan(&fit::engine_fit_inputs { room_bytes: need - 1, ..inputs }).unwrap().placement,
        engine_placement::HostMapped
    );
    assert!(seen.len() >= 3, "the sweep crossed on card, mapped and refused: {seen:?}");
}

#[test]
fn failed_loads_hold_nothing() {
    if !gpu_present("failed_loads_hold_nothing") {
        return;
    }
    let _g = serial();
    let dir = Scratch::new("failures");
    warm_up(&dir.0);
    let path = write_model(&dir.0, &config(4096, 1024), DType::Bf16, 5);
    let mut lines = Vec::new();
    let base = free_bytes();
    for (placement, opts) in placements(&path, &mut lines) {
        for step in [InitStep::Opened, InitStep::Planned, InitStep::RowsPlaced, InitStep::Loaded] {
            let r = Engine::init_fit_failing_after(&path, &opts, Some(step));
            assert!(r.is_err(), "{placement:?} {step:?}");
            assert_eq!(stats(), engine_memory::default(), "{placement:?}: failing after {step:?}");
            let now = free_bytes();
            assert!(now.abs_diff(base) <= 2 * MIB, "{placement:?} {step:?}: device memory {now}, baseline {base}");
        }
    }

    // A checkpoint cut right after the rows, 100 times in each placement's options.
    let cut = dir.0.join("cut.gguf");
    write_synthetic_gguf(&cut, &config(4096, 1024), 6, DType::F16).unwrap();
    let end = {
        let ckpt = Checkpoint::open(&cut).unwrap();
        ckpt.embed().offset + ckpt.embed().bytes
    };
    std::fs::OpenOptions::new().write(true).open(&cut).unwrap().set_len(end as u64).unwrap();
    for (i, mmap) in (0..100).map(|i| (i, [engine_tristate::No, engine_tristate::Yes][i % 2])) {
        let opts = options(if i % 3 == 0 { 1 << 20 } else { 1 << 50 }, mmap, &mut lines);
        let mut e = std::ptr::null_mut();
        // SAFETY: a NUL-terminated path that lives across the call, live options and a writable handle.
        let st = unsafe { ffi::engine_init_fit(c_path(&cut).as_ptr(), &opts, &mut e) };
        assert_eq!(st, Status::BadModel, "call {i}: {}", last_error());
        assert!(last_error().contains("cut.gguf"), "{}", last_error());
        assert!(e.is_null());
        assert_eq!(stats(), engine_memory::default(), "call {i}");
    }
    let now = free_bytes();
    assert!(now.abs_diff(base) <= 2 * MIB, "device memory {now} after 100 failed loads, baseline {base}");
}
