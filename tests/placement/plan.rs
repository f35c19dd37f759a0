//! The fit inputs the engine derives from a checkpoint, and tied rows on the card.

use super::{config, set_mmap_env};
use crate::common::{Rng, Scratch, serial};
use hostembed::checkpoint::Checkpoint;
use hostembed::checkpoint::write::{write_synthetic_gguf, write_synthetic_hf};
use hostembed::engine::{engine_options, engine_tristate};
use hostembed::fit::engine_placement;
use hostembed::gpu::GpuModel;
use hostembed::kv::{KvType, KvTypes};
use hostembed::model::ModelConfig;
use hostembed::tensor::DType;
use hostembed::tuning::Tuning;
use hostembed::{Status, engine, fit};

#[test]
fn the_plan_the_engine_derives_from_a_checkpoint() {
    let _g = serial();
    set_mmap_env(None);
    let mut rng = Rng::fresh("the_plan_the_engine_derives_from_a_checkpoint");
    let dir = Scratch::new("derive");
    let cfg = config(320, 64, false);
    write_synthetic_hf(&dir.0, &cfg, rng.next_u64(), DType::Bf16).unwrap();
    let ckpt = Checkpoint::open(&dir.0).unwrap();

    let window = 1000 + rng.below(1000) as u32;
    let opts = engine_options { room_bytes: 1 << 40, context: window, max_batch: 64, ..engine::default_options() };
    let inputs = engine::fit_inputs(&ckpt, &opts, None).unwrap();
    let embed = (cfg.vocab * cfg.hidden * 2) as u64;
    assert_eq!(inputs.embed_bytes, embed);
    assert_eq!(inputs.weight_bytes, GpuModel::weight_bytes(&ckpt) + embed);
    assert!(inputs.weight_bytes >= ckpt.weight_bytes(), "the card holds at least the stored bytes");
    // KV cache in bf16: layers x (K, V) x kv_heads x head_dim x 2 bytes a token.
    let per_token = (cfg.layers * 2 * cfg.kv_heads * cfg.head_dim * 2) as u64;
    assert_eq!(inputs.stream_bytes_per_token, per_token);
    assert_eq!(inputs.stream_bytes, GpuModel::stream_bytes(&cfg, KvTypes::GPU_DEFAULT, window as usize));
    assert!(inputs.stream_bytes >= window as u64 * per_token);
    assert_eq!(
        inputs.scratch_bytes,
        GpuModel::scratch_bytes(&ckpt, 64, KvTypes::GPU_DEFAULT, window as usize, &Tuning::from_env())
    );
    assert!(inputs.scratch_bytes > 0);
    assert_eq!((inputs.window, inputs.room_bytes, inputs.reserve_bytes), (window, 1 << 40, 256 << 20));
    assert!(!inputs.unified && !inputs.embed_tied && !inputs.mmap_rows);

    // One more token of window costs exactly one token of KV cache: the window model the rule assumes.
    let wider = engine::fit_inputs(&ckpt, &engine_options { context: window + 1, ..opts }, None).unwrap();
    assert_eq!(wider.stream_bytes - inputs.stream_bytes, per_token);
    // Another KV cache type: the stream and its growth in that type's bytes (Q8_0 and FP8: 34 bytes a
    // block of 32 values where BF16 takes 64; F32 twice BF16), and ENGINE_KV_DEFAULT is BF16. The block
    // types want heads of whole blocks: this model's 16 values are not.
    for t in [KvType::Q8_0, KvType::Fp8E4m3] {
        let typed = engine_options { kv_type_v: t.to_c(), ..opts };
        assert_eq!(engine::fit_inputs(&ckpt, &typed, None).unwrap_err().status, Status::Unsupported);
    }
    {
        let cfg = ModelConfig { head_dim: 32, ..cfg };
        let wide = Scratch::new("derive-wide");
        write_synthetic_hf(&wide.0, &cfg, rng.next_u64(), DType::Bf16).unwrap();
        let ckpt = Checkpoint::open(&wide.0).unwrap();
        let per_token = (cfg.layers * 2 * cfg.kv_heads * cfg.head_dim * 2) as u64;
        assert_eq!(engine::fit_inputs(&ckpt, &opts, None).unwrap().stream_bytes_per_token, per_token);
        for t in KvType::ALL {
            let typed = engine_options { kv_type_k: t.to_c(), kv_type_v: t.to_c(), ..opts };
            let i = engine::fit_inputs(&ckpt, &typed, None).unwrap();
            let bytes = KvTypes::same(t).bytes_per_token(&cfg);
            assert_eq!(i.stream_bytes_per_token, bytes, "{}", t.name());
            assert_eq!(i.stream_bytes, bytes * window as u64, "{}", t.name());
            let want = match t {
                KvType::Bf16 | KvType::F16 => per_token,
                KvType::F32 => 2 * per_token,
                KvType::Q8_0 | KvType::Fp8E4m3 => per_token / 64 * 34,
            };
            assert_eq!(bytes, want, "{}", t.name());
        }
        let mixed = engine_options { kv_type_k: KvType::Q8_0.to_c(), kv_type_v: KvType::F32.to_c(), ..opts };
        assert_eq!(
            engine::fit_inputs(&ckpt, &mixed, None).unwrap().stream_bytes_per_token,
            per_token / 64 * 17 + per_token,
            "K Q8_0 (17/32 of BF16's half) and V F32 (twice BF16's half)"
        );
    }
    // Context 0 plans for the model's own window.
    let own = engine::fit_inputs(&ckpt, &engine_options { context: 0, ..opts }, None).unwrap();
    assert_eq!(own.window as usize, cfg.max_position);

    // The boundary: room == need keeps the rows on the card, one byte less maps them.
    let need = fit::plan(&inputs).unwrap().need_bytes;
    let at = |room: u64| {
        let i = engine::fit_inputs(&ckpt, &engine_options { room_bytes: room, ..opts }, None).unwrap();
        fit::plan(&i).unwrap()
    };
    assert_eq!(at(need).placement, engine_placement::Device);
    let mapped = at(need - 1);
    assert_eq!(mapped.placement, engine_placement::HostMapped);
    assert_eq!(mapped.embed_host_bytes, embed);
    assert_eq!(mapped.on_card_bytes, inputs.weight_bytes - embed + inputs.scratch_bytes);
    assert_eq!(
        engine::host_rows_reason(&mapped, &inputs, &opts).unwrap(),
        format!("embedding rows read from host memory: no room beside a {window}-token stream")
    );
    assert_eq!(engine::host_rows_reason(&at(need), &inputs, &opts), None);

    // A drafter enters the need.
    let drafter =
        engine_options { drafter_weight_bytes: 1 << 20, drafter_stream_bytes: 1 << 16, room_bytes: need, ..opts };
    let d = fit::plan(&engine::fit_inputs(&ckpt, &drafter, None).unwrap()).unwrap();
    assert_eq!(d.need_bytes, need + (1 << 20) + (1 << 16));
    assert_eq!(d.placement, engine_placement::HostMapped);

    // DS4_EMBD_MMAP=1 reads the rows from the file mapping whatever the room.
    set_mmap_env(Some("1"));
    let m = engine::fit_inputs(&ckpt, &opts, None).unwrap();
    set_mmap_env(None);
    assert!(m.mmap_rows);
    let plan = fit::plan(&m).unwrap();
    assert_eq!(plan.placement, engine_placement::FileMapped);
    assert_eq!(
        engine::host_rows_reason(&plan, &m, &opts).unwrap(),
        "embedding rows read from the file mapping: DS4_EMBD_MMAP=1"
    );

    // No room given and no device to ask.
    let e = engine::fit_inputs(&ckpt, &engine_options { room_bytes: 0, ..opts }, None).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
}

#[test]
fn tied_rows_stay_on_the_card_in_any_room() {
    let _g = serial();
    set_mmap_env(None);
    let dir = Scratch::new("tied");
    let cfg = config(256, 64, true);
    write_synthetic_gguf(&dir.0.join("m.gguf"), &cfg, 5, DType::F16).unwrap();
    let ckpt = Checkpoint::open(&dir.0.join("m.gguf")).unwrap();
    let opts = engine_options { room_bytes: 1, mmap_rows: engine_tristate::Yes, ..engine::default_options() };
    let inputs = engine::fit_inputs(&ckpt, &opts, None).unwrap();
    assert!(inputs.embed_tied);
    let plan = fit::plan(&inputs).unwrap();
    assert_eq!(plan.placement, engine_placement::Device);
    assert_eq!(plan.streams, 0);
}
