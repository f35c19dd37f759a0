//! The placement side of engine_init_fit without a GPU: the fit inputs an engine derives from a
//! checkpoint, options and DS4_EMBD_MMAP, the CPU backend's rows, failed loads that hold nothing, bad
//! checkpoints and NULLs through the C functions.

mod common;

use common::{Scratch, c_path, serial, set_env, stats};

use common::Rng;
use hostembed::checkpoint::Checkpoint;
use hostembed::checkpoint::write::{write_synthetic_gguf, write_synthetic_hf};
use hostembed::engine::{self, Engine, InitStep, engine_backend, engine_options, engine_tristate};
use hostembed::ffi::{self, engine_device_info};
use hostembed::fit::{self, engine_placement, engine_plan};
use hostembed::gpu::GpuModel;
use hostembed::kv::{KvType, KvTypes};
use hostembed::model::{Arch, ModelConfig, RopeScaling};
use hostembed::placement::{engine_memory, engine_rows};
use hostembed::status::last_error;
use hostembed::tensor::{DType, FORMATS, decode_row};
use hostembed::tuning::{self, Tuning};
use hostembed::{Status, cuda};
use std::ffi::{CStr, c_char, c_void};
use std::path::{Path, PathBuf};

fn config(vocab: usize, hidden: usize, tied: bool) -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab,
        hidden,
        layers: 3,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        intermediate: 96,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 2048,
        tied,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: Some(1),
        eos: Some(2),
        moe: None,
    }
}

fn cpu_options() -> engine_options {
    engine_options { backend: engine_backend::Cpu, ..engine::default_options() }
}

fn set_mmap_env(value: Option<&str>) {
    set_env(engine::MMAP_ROWS_ENV, value.map(std::ffi::OsStr::new));
}

#[test]
fn default_options_are_documented_values() {
    let o = ffi::engine_default_options();
    assert_eq!(o.device, 0);
    assert_eq!(o.context, 0);
    assert_eq!(o.room_bytes, 0);
    assert_eq!(o.reserve_bytes, 256 << 20);
    assert_eq!((o.drafter_weight_bytes, o.drafter_stream_bytes, o.max_streams), (0, 0, 0));
    assert_eq!(o.max_batch, 512);
    assert_eq!(
        (o.unified, o.mmap_rows, o.backend),
        (engine_tristate::Auto, engine_tristate::Auto, engine_backend::Auto)
    );
    assert_eq!((o.temperature, o.top_k, o.top_p), (0.0, 0, 1.0));
    assert!(o.log.is_none() && o.log_user.is_null());
    assert_eq!(o.batch_tensor_cores, engine_tristate::Auto);
    assert_eq!(o.prefix_cache, engine_tristate::Auto);
    assert_eq!(o.devices, 0, "one device");
    assert!(engine::resolve_prefix_cache(o.prefix_cache), "AUTO keeps a prefix cache");
    assert!(engine::resolve_prefix_cache(engine_tristate::Yes) && !engine::resolve_prefix_cache(engine_tristate::No));
}

#[test]
fn batch_tensor_cores_follow_their_variable_only_when_auto() {
    let _g = serial();
    let saved = std::env::var_os(engine::BATCH_TENSOR_CORES_ENV);
    for (env, auto) in [(None, false), (Some("1"), true), (Some("0"), false), (Some("yes"), false)] {
        set_env(engine::BATCH_TENSOR_CORES_ENV, env.map(std::ffi::OsStr::new));
        assert_eq!(engine::resolve_batch_tensor_cores(engine_tristate::Auto), auto, "{env:?}");
        assert!(engine::resolve_batch_tensor_cores(engine_tristate::Yes), "Yes overrides {env:?}");
        assert!(!engine::resolve_batch_tensor_cores(engine_tristate::No), "No overrides {env:?}");
    }
    set_env(engine::BATCH_TENSOR_CORES_ENV, saved.as_deref());
}

/// The engine resolves its tuning once, the option over its variable, and the backend is given that:
/// NO with HOSTEMBED_BATCH_TENSOR_CORES=1 stays off (the GPU model once read the variable itself and
/// stayed on), and the tuning carries the environment's other settings beside it.
#[test]
fn the_engine_tuning_takes_the_option_over_its_variable() {
    let _g = serial();
    let saved = std::env::var_os(engine::BATCH_TENSOR_CORES_ENV);
    let saved_graphs = std::env::var_os(tuning::CUDA_GRAPHS_ENV);
    set_env(engine::BATCH_TENSOR_CORES_ENV, Some(std::ffi::OsStr::new("1")));
    set_env(tuning::CUDA_GRAPHS_ENV, Some(std::ffi::OsStr::new("0")));
    let with = |option| engine_options { batch_tensor_cores: option, ..common::cpu_options(64, 1) };
    assert!(!engine::tuning_for(&with(engine_tristate::No)).batch_tensor_cores, "NO with the variable set");
    assert!(engine::tuning_for(&with(engine_tristate::Auto)).batch_tensor_cores, "AUTO reads the variable");
    assert!(engine::tuning_for(&with(engine_tristate::Yes)).batch_tensor_cores);
    assert!(!engine::tuning_for(&with(engine_tristate::Yes)).cuda_graphs, "the other variables are read beside it");

    // A whole engine keeps what it resolved at its creation, whatever the variables say after.
    let mut rng = Rng::fresh("the_engine_tuning_takes_the_option_over_its_variable");
    let dir = Scratch::new("tuning");
    write_synthetic_hf(&dir.0, &config(64, 64, false), rng.next_u64(), DType::Bf16).unwrap();
    let e = Engine::init_fit(&dir.0, &with(engine_tristate::No)).unwrap();
    set_env(engine::BATCH_TENSOR_CORES_ENV, saved.as_deref());
    set_env(tuning::CUDA_GRAPHS_ENV, saved_graphs.as_deref());
    assert!(!e.tuning().batch_tensor_cores && !e.tuning().cuda_graphs, "{:?}", e.tuning());
    assert_eq!(e.tuning().cpu_threads, Tuning::from_env().cpu_threads);
}

#[test]
fn mmap_rows_follows_ds4_embd_mmap_only_when_auto() {
    let _g = serial();
    let saved = std::env::var_os(engine::MMAP_ROWS_ENV);
    for (env, auto) in [
        (None, false),
        (Some("1"), true),
        (Some("0"), false),
        (Some("true"), false),
        (Some("1 "), false),
        (Some(""), false),
    ] {
        set_mmap_env(env);
        assert_eq!(engine::resolve_mmap_rows(engine_tristate::Auto), auto, "DS4_EMBD_MMAP={env:?}");
        assert!(engine::resolve_mmap_rows(engine_tristate::Yes), "Yes overrides DS4_EMBD_MMAP={env:?}");
        assert!(!engine::resolve_mmap_rows(engine_tristate::No), "No overrides DS4_EMBD_MMAP={env:?}");
    }
    set_env(engine::MMAP_ROWS_ENV, saved.as_deref());
}

#[test]
fn unified_auto_asks_the_device() {
    // SAFETY: engine_device_info is numbers, bools and a byte array: all zeros is a value of it.
    let mut info: engine_device_info = unsafe { std::mem::zeroed() };
    assert!(!engine::resolve_unified(engine_tristate::Auto, None));
    assert!(!engine::resolve_unified(engine_tristate::Auto, Some(&info)));
    info.integrated = true;
    assert!(!engine::resolve_unified(engine_tristate::Auto, Some(&info)), "integrated without pageable access");
    info.pageable_memory_access = true;
    assert!(engine::resolve_unified(engine_tristate::Auto, Some(&info)));
    assert!(!engine::resolve_unified(engine_tristate::No, Some(&info)));
    assert!(engine::resolve_unified(engine_tristate::Yes, None));
}

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

fn expect_row(ckpt: &Checkpoint, id: usize) -> Vec<f32> {
    let t = ckpt.embed();
    let rb = t.row_bytes();
    let mut v = vec![0f32; t.cols()];
    decode_row(t.dtype, &ckpt.bytes_of(t)[id * rb..(id + 1) * rb], &mut v);
    v
}

unsafe extern "C" fn collect_lines(user: *mut c_void, line: *const c_char) {
    // SAFETY: the user pointer is the `Vec<String>` this test's options gave the engine, alive and not otherwise
    // borrowed while it logs.
    let lines = unsafe { &mut *(user as *mut Vec<String>) };
    // SAFETY: the engine passes a NUL-terminated line alive for the call.
    lines.push(unsafe { CStr::from_ptr(line) }.to_string_lossy().into_owned());
}

#[test]
fn cpu_backend_reads_rows_from_the_mapping() {
    let _g = serial();
    let mut rng = Rng::fresh("cpu_backend_reads_rows_from_the_mapping");
    let dir = Scratch::new("cpu");
    for dtype in FORMATS.iter().map(|f| f.dtype) {
        // Rows of whole blocks: one k-quant super-block, or two Q8_0 blocks.
        let hidden = if dtype.format().block_values > 32 { 256 } else { 64 };
        let cfg = config(200 + rng.below(100) as usize, hidden, false);
        let path = if dtype == DType::Bf16 || dtype == DType::F32 {
            let p = dir.0.join(format!("hf-{}", dtype.name()));
            write_synthetic_hf(&p, &cfg, rng.next_u64(), dtype).unwrap();
            p
        } else {
            let p = dir.0.join(format!("m-{}.gguf", dtype.name()));
            write_synthetic_gguf(&p, &cfg, rng.next_u64(), dtype).unwrap();
            p
        };
        let ckpt = Checkpoint::open(&path).unwrap();
        assert_eq!(ckpt.embed().dtype, dtype);
        let file_bytes: u64 = ckpt.files.iter().map(|f| f.map.len() as u64).sum();

        let mut lines: Vec<String> = Vec::new();
        let opts = engine_options {
            log: Some(collect_lines),
            log_user: &mut lines as *mut Vec<String> as *mut c_void,
            ..cpu_options()
        };
        let before = stats();
        let mut e = std::ptr::null_mut();
        assert_eq!(
            // SAFETY: a NUL-terminated path, options and a handle slot, all alive across the call.
            unsafe { ffi::engine_init_fit(c_path(&path).as_ptr(), &opts, &mut e) },
            Status::Ok,
            "{}",
            last_error()
        );
        assert!(!e.is_null());
        assert_eq!(stats().mapped_bytes - before.mapped_bytes, file_bytes, "the engine's mapping is counted");
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].contains("CPU backend") && lines[0].contains(&format!("{}-token window", cfg.max_position)),
            "{lines:?}"
        );

        // SAFETY: engine_rows is pointers, numbers, a bool and enums with a variant at 0: all zeros is a value of it.
        let mut rows: engine_rows = unsafe { std::mem::zeroed() };
        // SAFETY: a live engine and a writable engine_rows.
        assert_eq!(unsafe { ffi::engine_embed_rows(e, &mut rows) }, Status::Ok);
        assert_eq!((rows.dtype, rows.placement, rows.device_usable), (dtype, engine_placement::FileMapped, false));
        assert_eq!((rows.rows, rows.cols), (cfg.vocab as u64, cfg.hidden as u64));
        assert_eq!(rows.row_bytes, dtype.row_bytes(cfg.hidden).unwrap() as u64);
        // No copy: the engine's own mapping, whose bytes are the file's.
        assert_eq!(rows.data, rows.host_data);
        // SAFETY: on the CPU backend the rows are the file mapping's `rows * row_bytes` bytes, alive while the engine
        // is.
        let mapped =
            unsafe { std::slice::from_raw_parts(rows.data as *const u8, (rows.rows * rows.row_bytes) as usize) };
        assert!(mapped == ckpt.bytes_of(ckpt.embed()), "the rows are the file's bytes");
        // SAFETY: a live engine.
        assert!(unsafe { ffi::engine_host_embed_ptr(e) }.is_null(), "no device reads these rows");
        // SAFETY: engine_plan is numbers and an enum with a variant at 0: all zeros is a value of it.
        let mut plan: engine_plan = unsafe { std::mem::zeroed() };
        // SAFETY: a live engine and a writable engine_plan.
        assert_eq!(unsafe { ffi::engine_plan_of(e, &mut plan) }, Status::Unsupported);

        let mut ids: Vec<i32> = (0..16).map(|_| rng.below(cfg.vocab as u64) as i32).collect();
        ids.extend([0, cfg.vocab as i32 - 1]);
        let mut out = vec![0f32; ids.len() * cfg.hidden];
        // SAFETY: a live engine, `ids.len()` ids and room for as many F32 rows of `hidden` values in `out`; host
        // memory, as the CPU backend reads and writes.
        let st = unsafe {
            ffi::engine_embed(
                e,
                ids.as_ptr(),
                ids.len(),
                out.as_mut_ptr() as *mut c_void,
                DType::F32,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(st, Status::Ok, "{}", last_error());
        for (k, &id) in ids.iter().enumerate() {
            let want = expect_row(&ckpt, id as usize);
            let got = &out[k * cfg.hidden..(k + 1) * cfg.hidden];
            assert!(want.iter().zip(got).all(|(a, b)| a.to_bits() == b.to_bits()), "{} row {id}", dtype.name());
        }
        let mut bf = vec![0u16; ids.len() * cfg.hidden];
        // SAFETY: a live engine, `ids.len()` ids and room for as many BF16 rows of `hidden` values in `bf`; host
        // memory, as the CPU backend reads and writes.
        let st = unsafe {
            ffi::engine_embed(
                e,
                ids.as_ptr(),
                ids.len(),
                bf.as_mut_ptr() as *mut c_void,
                DType::Bf16,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(st, Status::Ok, "{}", last_error());
        for (k, &id) in ids.iter().enumerate() {
            let want: Vec<u16> =
                expect_row(&ckpt, id as usize).iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect();
            assert_eq!(&bf[k * cfg.hidden..(k + 1) * cfg.hidden], &want[..], "{} row {id} as bf16", dtype.name());
        }

        // An id outside the vocabulary: OUT_OF_RANGE and nothing written.
        for bad in [-1, cfg.vocab as i32, i32::MAX] {
            let ids = [3, bad];
            let mut out = vec![7f32; 2 * cfg.hidden];
            // SAFETY: a live engine, two ids and room for two F32 rows of `hidden` values in `out`, in host memory.
            let st = unsafe {
                ffi::engine_embed(e, ids.as_ptr(), 2, out.as_mut_ptr() as *mut c_void, DType::F32, std::ptr::null_mut())
            };
            assert_eq!(st, Status::OutOfRange);
            assert!(last_error().contains(&bad.to_string()), "{}", last_error());
            assert!(out.iter().all(|&v| v == 7.0), "nothing written for a call with a bad id");
        }
        // SAFETY: the engine came from engine_init_fit and is freed here, once.
        unsafe { ffi::engine_free(e) };
        assert_eq!(stats(), before, "the engine's mapping is released");
    }
}

#[test]
fn failed_loads_without_a_device_hold_nothing() {
    let _g = serial();
    let dir = Scratch::new("nodevice");
    let cfg = config(128, 64, false);
    write_synthetic_hf(&dir.0, &cfg, 3, DType::Bf16).unwrap();
    let present = cuda::require_device(0);
    if present.is_ok() {
        println!("SKIP failed_loads_without_a_device_hold_nothing: a CUDA device is present");
        return;
    }
    let expected = present.unwrap_err().status;
    assert!(matches!(expected, Status::NoCuda | Status::NoDevice));
    let opts = engine_options { backend: engine_backend::Cuda, room_bytes: 1 << 30, ..engine::default_options() };
    for _ in 0..3 {
        let mut e = std::ptr::dangling_mut::<ffi::engine>();
        // SAFETY: a NUL-terminated path, options and a handle slot, all alive across the call.
        let st = unsafe { ffi::engine_init_fit(c_path(&dir.0).as_ptr(), &opts, &mut e) };
        assert_eq!(st, expected, "{}", last_error());
        if expected == Status::NoCuda {
            assert_eq!(last_error(), "built without nvcc");
        }
        assert!(e.is_null(), "*out is NULL after a failure");
        assert_eq!(stats(), engine_memory::default(), "nothing held");
    }
    // Auto without a device falls back to the CPU.
    let auto = engine_options { backend: engine_backend::Auto, ..opts };
    let e = Engine::init_fit(&dir.0, &auto).unwrap();
    assert_eq!(e.backend(), engine::BackendKind::Cpu);
    drop(e);
    assert_eq!(stats(), engine_memory::default());
}

#[test]
fn failing_at_every_step_releases_the_mapping() {
    let _g = serial();
    let dir = Scratch::new("steps");
    write_synthetic_hf(&dir.0, &config(128, 64, false), 4, DType::Bf16).unwrap();
    for step in [InitStep::Opened, InitStep::Planned, InitStep::RowsPlaced, InitStep::Loaded] {
        let before = stats();
        let e = Engine::init_fit_failing_after(&dir.0, &cpu_options(), Some(step));
        assert!(e.is_err(), "{step:?}");
        assert_eq!(stats(), before, "after failing at {step:?}");
    }
}

/// A GGUF written then cut right after the embedding rows' last byte.
fn truncated_after_rows(dir: &Path) -> PathBuf {
    let path = dir.join("cut.gguf");
    write_synthetic_gguf(&path, &config(256, 64, false), 9, DType::Q8_0).unwrap();
    let ckpt = Checkpoint::open(&path).unwrap();
    let end = ckpt.embed().offset + ckpt.embed().bytes;
    assert!((end as u64) < std::fs::metadata(&path).unwrap().len(), "tensors follow the rows");
    drop(ckpt);
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(end as u64).unwrap();
    path
}

#[test]
fn bad_checkpoints_are_bad_model_and_hold_nothing() {
    let _g = serial();
    let dir = Scratch::new("bad");
    let before = stats();
    let cases: Vec<(PathBuf, Status)> = {
        let cut = truncated_after_rows(&dir.0);
        let garbage = dir.0.join("garbage.gguf");
        std::fs::write(&garbage, b"GGUF\x03\0\0\0 not really").unwrap();
        let hf = dir.0.join("hf");
        write_synthetic_hf(&hf, &config(128, 64, false), 1, DType::Bf16).unwrap();
        let st = std::fs::read_dir(&hf)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .unwrap();
        let mut bytes = std::fs::read(&st).unwrap();
        bytes[9] ^= 0x5a; // inside the JSON header
        std::fs::write(&st, &bytes).unwrap();
        vec![
            (cut, Status::BadModel),
            (garbage, Status::BadModel),
            (hf, Status::BadModel),
            (dir.0.join("absent.gguf"), Status::IoError),
        ]
    };
    for (path, want) in &cases {
        for backend in [engine_backend::Cpu, engine_backend::Auto] {
            let opts = engine_options { backend, room_bytes: 1 << 40, ..engine::default_options() };
            let mut e = std::ptr::null_mut();
            // SAFETY: a NUL-terminated path, options and a handle slot, all alive across the call.
            let st = unsafe { ffi::engine_init_fit(c_path(path).as_ptr(), &opts, &mut e) };
            assert_eq!(st, *want, "{}: {}", path.display(), last_error());
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            assert!(last_error().contains(&name), "the message names the file: {}", last_error());
            assert!(e.is_null());
            assert_eq!(stats(), before);
        }
    }
}

/// `options.devices` past one is refused, never run on one device in silence: INVALID_ARGUMENT on the CPU
/// backend, UNSUPPORTED on CUDA and AUTO, naming tensor parallelism, the devices and what NCCL says (on a
/// machine without it, that it did not load); 0 and 1 start today's engine.
#[test]
fn devices_past_one_are_refused_until_tensor_parallelism_is_built() {
    let _g = serial();
    let dir = Scratch::new("devices");
    write_synthetic_hf(&dir.0, &config(128, 64, false), 2, DType::Bf16).unwrap();
    let path = c_path(&dir.0);
    let cases = [
        (engine_backend::Cpu, 0, 2, Status::InvalidArgument, "options.devices is 2: the CPU backend runs on one"),
        (engine_backend::Cuda, 0, 2, Status::Unsupported, "tensor parallelism over CUDA devices 0..=1 needs"),
        (engine_backend::Auto, 1, 4, Status::Unsupported, "over CUDA devices 1..=4 needs the multi-device backend"),
    ];
    for (backend, device, devices, want, words) in cases {
        let opts = engine_options { backend, device, devices, ..cpu_options() };
        let mut e = std::ptr::null_mut();
        // SAFETY: a NUL-terminated path, live options and a writable engine pointer.
        assert_eq!(unsafe { ffi::engine_init_fit(path.as_ptr(), &opts, &mut e) }, want, "{backend:?} x {devices}");
        assert!(e.is_null(), "a refused load returned an engine");
        let why = last_error();
        assert!(why.contains(words), "{why}");
        if want == Status::Unsupported {
            assert!(why.contains("NCCL"), "{why}");
        }
    }
    for devices in [0, 1] {
        let opts = engine_options { devices, ..cpu_options() };
        let mut e = std::ptr::null_mut();
        // SAFETY: as above; the engine is freed below.
        assert_eq!(unsafe { ffi::engine_init_fit(path.as_ptr(), &opts, &mut e) }, Status::Ok, "{}", last_error());
        // SAFETY: the engine engine_init_fit gave.
        unsafe { ffi::engine_free(e) };
    }
    assert_eq!(stats(), engine_memory::default());
}

#[test]
fn nulls_and_bad_enums_are_invalid_arguments() {
    let _g = serial();
    let dir = Scratch::new("nulls");
    write_synthetic_hf(&dir.0, &config(128, 64, false), 2, DType::Bf16).unwrap();
    let path = c_path(&dir.0);
    let opts = cpu_options();
    let mut e = std::ptr::null_mut();
    // SAFETY: each pointer below is NULL (which the call refuses before use) or a live local of the type
    // the function takes, `e` is NULL or the engine engine_init_fit gave, and the out-of-range enum values
    // are written as u32 inside the options' own fields, which ffi reads raw before it treats them as enums.
    unsafe {
        assert_eq!(ffi::engine_init_fit(std::ptr::null(), &opts, &mut e), Status::InvalidArgument);
        assert!(last_error().contains("model_path"), "{}", last_error());
        assert_eq!(ffi::engine_init_fit(path.as_ptr(), &opts, std::ptr::null_mut()), Status::InvalidArgument);
        assert_eq!(ffi::engine_memory_stats(std::ptr::null_mut()), Status::InvalidArgument);
        let mut rows: engine_rows = std::mem::zeroed();
        assert_eq!(ffi::engine_embed_rows(std::ptr::null(), &mut rows), Status::InvalidArgument);
        let mut plan: engine_plan = std::mem::zeroed();
        assert_eq!(ffi::engine_plan_of(std::ptr::null(), &mut plan), Status::InvalidArgument);
        assert!(ffi::engine_host_embed_ptr(std::ptr::null()).is_null());
        let id = 0i32;
        let mut out = [0f32; 64];
        let o = out.as_mut_ptr() as *mut c_void;
        assert_eq!(
            ffi::engine_embed(std::ptr::null(), &id, 1, o, DType::F32, std::ptr::null_mut()),
            Status::InvalidArgument
        );
        ffi::engine_free(std::ptr::null_mut());

        // Options whose enums hold values no enum has.
        for field in [
            std::mem::offset_of!(engine_options, unified),
            std::mem::offset_of!(engine_options, mmap_rows),
            std::mem::offset_of!(engine_options, backend),
            std::mem::offset_of!(engine_options, batch_tensor_cores),
            std::mem::offset_of!(engine_options, prefix_cache),
        ] {
            let mut raw = opts;
            std::ptr::write((&mut raw as *mut engine_options as *mut u8).add(field) as *mut u32, 7);
            assert_eq!(ffi::engine_init_fit(path.as_ptr(), &raw, &mut e), Status::InvalidArgument);
            assert!(last_error().contains("is 7"), "{}", last_error());
        }
        for bad in [
            engine_options { temperature: -1.0, ..opts },
            engine_options { top_p: 0.0, ..opts },
            engine_options { device: -1, ..opts },
            engine_options { max_batch: 4097, ..opts },
            engine_options { max_batch: u32::MAX, ..opts },
        ] {
            assert_eq!(ffi::engine_init_fit(path.as_ptr(), &bad, &mut e), Status::InvalidArgument);
            assert!(e.is_null(), "a refused load returned an engine");
        }
        assert!(last_error().contains("options.max_batch"), "{}", last_error());

        assert_eq!(ffi::engine_init_fit(path.as_ptr(), &opts, &mut e), Status::Ok, "{}", last_error());
        assert_eq!(ffi::engine_embed_rows(e, std::ptr::null_mut()), Status::InvalidArgument);
        assert_eq!(ffi::engine_plan_of(e, std::ptr::null_mut()), Status::InvalidArgument);
        assert_eq!(
            ffi::engine_embed(e, std::ptr::null(), 1, o, DType::F32, std::ptr::null_mut()),
            Status::InvalidArgument
        );
        assert_eq!(
            ffi::engine_embed(e, &id, 1, std::ptr::null_mut(), DType::F32, std::ptr::null_mut()),
            Status::InvalidArgument
        );
        assert_eq!(ffi::engine_embed(e, &id, 1, o, DType::F16, std::ptr::null_mut()), Status::InvalidArgument);
        assert_eq!(ffi::engine_embed(e, &id, 1, o, DType::Q8_0, std::ptr::null_mut()), Status::InvalidArgument);
        assert_eq!(
            ffi::engine_embed(e, std::ptr::null(), 0, std::ptr::null_mut(), DType::F32, std::ptr::null_mut()),
            Status::Ok
        );
        ffi::engine_free(e);
    }
    assert_eq!(stats(), engine_memory::default());
}

#[test]
fn parallel_copy_copies_every_byte() {
    let mut rng = Rng::fresh("parallel_copy_copies_every_byte");
    for len in [0usize, 1, 4095, (16 << 20) + 1, (53 << 20) + 12_345] {
        let src: Vec<u8> = (0..len.div_ceil(8)).flat_map(|_| rng.next_u64().to_le_bytes()).take(len).collect();
        let mut dst = vec![0u8; len];
        hostembed::hostmem::parallel_copy(&mut dst, &src);
        assert!(dst == src, "{len} bytes");
    }
}
