//! Failed loads that hold nothing, bad checkpoints, devices past one, and NULLs and bad enums through the C functions.

use super::{config, cpu_options};
use crate::common::{Scratch, c_path, serial, stats};
use hostembed::checkpoint::Checkpoint;
use hostembed::checkpoint::write::{write_synthetic_gguf, write_synthetic_hf};
use hostembed::engine::{Engine, InitStep, engine_backend, engine_options};
use hostembed::fit::engine_plan;
use hostembed::placement::{engine_memory, engine_rows};
use hostembed::status::last_error;
use hostembed::tensor::DType;
use hostembed::{Status, cuda, engine, ffi};
use std::ffi::c_void;
use std::path::{Path, PathBuf};

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

/// `options.devices` past one never runs on one device in silence: INVALID_ARGUMENT on the CPU backend
/// and past 64 devices, UNSUPPORTED beside a drafter, and on CUDA and AUTO the devices' own refusal
/// where there is none (AUTO does not fall back to the CPU); 0 and 1 start today's engine.
#[test]
fn devices_past_one_run_on_cuda_devices_only() {
    let _g = serial();
    let dir = Scratch::new("devices");
    write_synthetic_hf(&dir.0, &config(128, 64, false), 2, DType::Bf16).unwrap();
    let path = c_path(&dir.0);
    let drafter = c_path(&dir.0);
    // Where the machine has no device, the CUDA cases fail as its probe does.
    let no_cuda = cuda::require_device(0).err().map(|e| e.status);
    let cases = [
        (
            engine_backend::Cpu,
            0,
            2,
            false,
            Some(Status::InvalidArgument),
            "options.devices is 2: the CPU backend runs on one",
        ),
        (engine_backend::Cuda, 0, 65, false, Some(Status::InvalidArgument), "takes 2 to 64 devices"),
        (engine_backend::Cuda, 0, 2, true, Some(Status::Unsupported), "a drafter model (options.draft_model)"),
        (engine_backend::Cuda, 0, 2, false, no_cuda, ""),
        (engine_backend::Auto, 1, 4, false, no_cuda, ""),
    ];
    for (backend, device, devices, with_drafter, want, words) in cases {
        let Some(want) = want else { continue };
        let draft_model = if with_drafter { drafter.as_ptr() } else { std::ptr::null() };
        let opts = engine_options { backend, device, devices, draft_model, ..cpu_options() };
        let mut e = std::ptr::null_mut();
        // SAFETY: a NUL-terminated path, live options and a writable engine pointer.
        assert_eq!(unsafe { ffi::engine_init_fit(path.as_ptr(), &opts, &mut e) }, want, "{backend:?} x {devices}");
        assert!(e.is_null(), "a refused load returned an engine");
        let why = last_error();
        assert!(why.contains(words), "{why}");
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
        assert_eq!(ffi::engine_plan_of_device(std::ptr::null(), 0, &mut plan), Status::InvalidArgument);
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
        assert_eq!(ffi::engine_plan_of_device(e, 0, std::ptr::null_mut()), Status::InvalidArgument);
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
