//! The fit rule over the devices of a tensor-parallel engine: through the C ABI, and each rank's figures
//! from a real checkpoint (`engine::rank_fit_inputs`).

use super::{GIB, common};
use hostembed::Status;
use hostembed::ffi::engine_last_error;
use hostembed::fit::{self, engine_fit_inputs, engine_plan};
use std::ffi::CStr;

/// The plan over several devices through the C ABI: each device's plan and the fewest streams as
/// `fit::plan_devices` gives them, the start-up line as `describe_devices`, a device without a stream
/// named with NO_ROOM (its plans still filled), and the refusals of NULL, counts and bad placements.
#[test]
fn c_abi_plans_over_devices_like_rust() {
    use hostembed::ffi::{engine_fit_plan_devices, engine_plan_describe_devices};
    let one = engine_fit_inputs {
        weight_bytes: 16 * GIB,
        embed_bytes: GIB,
        scratch_bytes: GIB / 2,
        stream_bytes: GIB,
        window: 8192,
        ..fit::default_inputs()
    };
    let device = |room: u64| fit::device_inputs(&one, 9 * GIB, (4, 8), room).unwrap();
    let error = || {
        // SAFETY: engine_last_error is this thread's NUL-terminated message, valid until its next failure.
        unsafe { CStr::from_ptr(engine_last_error()) }.to_str().unwrap().to_string()
    };
    let inputs = [device(20 * GIB), device(14 * GIB)];
    let mut plans = [fit::plan(&inputs[0]).unwrap(); 2];
    let mut streams = u32::MAX;
    // SAFETY: two inputs and two plans, a live u32.
    let st = unsafe { engine_fit_plan_devices(inputs.as_ptr(), 2, plans.as_mut_ptr(), &mut streams) };
    assert_eq!(st, Status::Ok);
    let want = fit::plan_devices(&inputs).unwrap();
    assert_eq!((plans.to_vec(), streams), (want.plans.clone(), 9));
    let mut buf = [0 as std::os::raw::c_char; 512];
    // SAFETY: two plans the call above filled, a live buffer of its length.
    let n = unsafe { engine_plan_describe_devices(plans.as_ptr(), 2, buf.as_mut_ptr(), buf.len()) };
    // SAFETY: the call wrote a NUL-terminated line into `buf`.
    let line = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap().to_string();
    assert_eq!((line.as_str(), n), (fit::describe_devices(&want).as_str(), line.len()));
    assert!(line.starts_with("2 devices, 9 streams at an 8192-token window; device 0:"), "{line}");

    // Device 1 with room for its weights and no stream: NO_ROOM naming it, both plans filled.
    let short = [device(20 * GIB), device(8 * GIB)];
    // SAFETY: as above.
    let status = unsafe { engine_fit_plan_devices(short.as_ptr(), 2, plans.as_mut_ptr(), &mut streams) };
    assert_eq!((status, streams, plans[0].streams), (Status::NoRoom, 0, 21));
    assert!(error().starts_with("2 devices refuse: device 1 has a 0.50 GiB stream"), "{}", error());

    // SAFETY: every pointer is NULL or as above; the counts are refused before anything is read.
    unsafe {
        for (inputs, devices, plans, streams) in [
            (std::ptr::null(), 2, plans.as_mut_ptr(), &mut streams as *mut u32),
            (inputs.as_ptr(), 2, std::ptr::null_mut(), &mut streams),
            (inputs.as_ptr(), 2, plans.as_mut_ptr(), std::ptr::null_mut()),
            (inputs.as_ptr(), 0, plans.as_mut_ptr(), &mut streams),
            (inputs.as_ptr(), 65, plans.as_mut_ptr(), &mut streams),
        ] {
            assert_eq!(engine_fit_plan_devices(inputs, devices, plans, streams), Status::InvalidArgument);
        }
    }
    let bad = engine_fit_inputs { stream_bytes: 0, ..device(20 * GIB) };
    // SAFETY: as above.
    let status =
        unsafe { engine_fit_plan_devices([device(20 * GIB), bad].as_ptr(), 2, plans.as_mut_ptr(), &mut streams) };
    assert_eq!(status, Status::InvalidArgument);
    assert!(error().starts_with("device 1: "), "{}", error());

    // A placement C wrote out of range is named, not read as an enum: the plans' bytes copied into an
    // 8-aligned buffer, the second's placement 7.
    let size = std::mem::size_of::<engine_plan>();
    let mut raw = vec![0u64; (2 * size).div_ceil(8)];
    let bytes = raw.as_mut_ptr() as *mut u8;
    // SAFETY: `raw` holds two plans' bytes, 8-aligned; the placement field is a u32 inside the second.
    let n = unsafe {
        std::ptr::copy_nonoverlapping(plans.as_ptr() as *const u8, bytes, 2 * size);
        std::ptr::write_unaligned(bytes.add(size + std::mem::offset_of!(engine_plan, placement)) as *mut u32, 7);
        engine_plan_describe_devices(bytes as *const engine_plan, 2, buf.as_mut_ptr(), buf.len())
    };
    assert_eq!(n, 0);
    assert!(error().contains("plans[1]->placement is 7"), "{}", error());
}

/// A small Llama (8 layers, 4 KV heads, a vocabulary of 8000) written in BF16, opened, with 1024-token
/// windows, prompt chunks of 8 (a small scratch beside the weights) and no reserve; its directory lives
/// as long as the `Scratch`.
fn split_checkpoint() -> (common::Scratch, hostembed::checkpoint::Checkpoint, hostembed::engine::engine_options) {
    let dir = common::Scratch::new("rank-fit");
    let cfg = hostembed::model::ModelConfig::llama(512, 8, 8, 4, 2048, 8000);
    hostembed::checkpoint::write::write_synthetic_hf(&dir.0, &cfg, 3, hostembed::tensor::DType::Bf16).unwrap();
    let ckpt = hostembed::checkpoint::Checkpoint::open(&dir.0).unwrap();
    let opts = hostembed::engine::engine_options {
        context: 1024,
        max_batch: 8,
        room_bytes: GIB,
        reserve_bytes: 0,
        ..hostembed::engine::default_options()
    };
    (dir, ckpt, opts)
}

/// The fit figures of each rank of `ckpt` split over `rooms.len()` devices of those rooms.
fn rank_inputs(
    ckpt: &hostembed::checkpoint::Checkpoint,
    opts: &hostembed::engine::engine_options,
    rooms: &[u64],
) -> Vec<engine_fit_inputs> {
    use hostembed::shard::{RankSource, ShardPlan};
    let plan = ShardPlan::new(&ckpt.config, rooms.len(), |_| hostembed::tensor::DType::Bf16).unwrap();
    // SAFETY: engine_device_info is numbers, bools and a byte array: all zeros is a value of it.
    let device: hostembed::abi::engine_device_info = unsafe { std::mem::zeroed() };
    let tuning = hostembed::tuning::Tuning::default();
    (0..rooms.len())
        .map(|r| {
            let rank = RankSource::new(ckpt, &plan, r).unwrap();
            hostembed::engine::rank_fit_inputs(ckpt, &rank, opts, &device, rooms[r], &tuning).unwrap()
        })
        .collect()
}

/// Each rank's figures for the fit rule over devices (`engine::rank_fit_inputs`): a rank of a split in
/// two holds half the KV heads (half a stream), its shards (the two together the whole model's weights,
/// plus each rank's copies of what is not cut: norms), the rows whole, and beside its scratch its head's
/// gather; the plan over both devices admits what the fewer room allows.
#[test]
fn each_rank_of_a_split_checkpoint_plans_its_share() {
    let (_dir, ckpt, opts) = split_checkpoint();
    let cfg = &ckpt.config;
    let whole = hostembed::engine::fit_inputs(&ckpt, &opts, None).unwrap();
    let ranks = rank_inputs(&ckpt, &opts, &[GIB, GIB / 2]);
    let norms = (cfg.layers as u64 * 2 + 1) * cfg.hidden as u64 * 2;
    let shards: u64 = ranks.iter().map(|i| i.weight_bytes - i.embed_bytes).sum();
    let weights = whole.weight_bytes - whole.embed_bytes;
    assert!(shards >= weights && shards <= weights + norms + (64 << 10), "{shards} against {weights}");
    let gather = hostembed::gpu::GpuModel::gather_bytes(cfg.vocab, 2, 8);
    assert_eq!(gather, 3 * 8 * 4000 * 4, "a rank's part and both ranks' parts of 8 logits rows");
    for (r, i) in ranks.iter().enumerate() {
        assert_eq!((i.embed_bytes, i.room_bytes), (whole.embed_bytes, [GIB, GIB / 2][r]), "rank {r}");
        assert_eq!(i.stream_bytes * 2, whole.stream_bytes, "rank {r}: 2 of 4 KV heads");
        assert_eq!(i.stream_bytes_per_token * 2, whole.stream_bytes_per_token, "rank {r}");
        assert!(i.scratch_bytes > gather && i.scratch_bytes < whole.scratch_bytes + gather, "rank {r}");
    }
    let p = fit::plan_devices(&ranks).unwrap();
    assert_eq!(p.streams, p.plans[1].streams);
    assert!(p.plans[0].streams > p.plans[1].streams && p.streams > 0, "{p:?}");
}

/// A model no one device holds is admitted across two: each device's room is the whole model's weights
/// and scratch without its rows, which leaves one device no room for a stream even with the rows in host
/// memory, and each of two its streams with the rows on the card.
/// With less room, short of a rank's shards, rows and one stream, each device reads the rows from the
/// one host copy instead, and that is what lets the window fit.
#[test]
fn a_model_too_big_for_one_device_fits_across_two() {
    let (_dir, ckpt, opts) = split_checkpoint();
    let whole = hostembed::engine::fit_inputs(&ckpt, &opts, None).unwrap();
    let room = whole.weight_bytes - whole.embed_bytes + whole.scratch_bytes;
    let one = fit::plan(&engine_fit_inputs { room_bytes: room, ..whole }).unwrap();
    assert_eq!(one.streams, 0, "one device: {}", fit::describe(&one));
    let two = fit::plan_devices(&rank_inputs(&ckpt, &opts, &[room, room])).unwrap();
    assert!(two.streams > 0 && !fit::maps_rows(&two, 0) && !fit::maps_rows(&two, 1), "{}", fit::describe_devices(&two));
    // Room for a rank's shards, scratch, reserve and one stream, but not the rows beside them.
    let r = rank_inputs(&ckpt, &opts, &[room, room])[0];
    let tight = r.weight_bytes - r.embed_bytes + r.scratch_bytes + r.reserve_bytes + r.stream_bytes;
    let on_card_only = fit::plan_devices(&rank_inputs(&ckpt, &opts, &[tight, tight])).unwrap();
    assert!(on_card_only.streams >= 1, "{}", fit::describe_devices(&on_card_only));
    assert!(fit::maps_rows(&on_card_only, 0) && fit::maps_rows(&on_card_only, 1));
    assert_eq!(on_card_only.embed_host_bytes, whole.embed_bytes, "the rows once in host memory");
}
