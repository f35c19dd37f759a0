//! The KV options through the C ABI and the start-up line's count of the cache.

use super::{small, type_pairs};
use crate::common::{self, Rng, Scratch, info, init, logits, serial, step};
use hostembed::abi::engine_kv_type;
use hostembed::checkpoint::write::MemSource;
use hostembed::cpu::CpuModel;
use hostembed::engine::{engine_backend, engine_options};
use hostembed::kv::{KvType, KvTypes};
use hostembed::model::{Arch, ModelConfig};
use hostembed::status::last_error;
use hostembed::tensor::DType;
use hostembed::{Status, engine, ffi};
use std::ffi::{c_char, c_void};
use std::sync::Mutex;

// ---------------------------------------------------------------------------------------------
// Through the C ABI.

/// Log lines the engine wrote, collected by `collect`.
static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn collect(_user: *mut c_void, line: *const c_char) {
    // SAFETY: the engine passes a NUL-terminated line alive for the call.
    let line = unsafe { std::ffi::CStr::from_ptr(line) }.to_string_lossy().into_owned();
    LINES.lock().unwrap().push(line);
}

fn cpu_options(kv: (engine_kv_type, engine_kv_type)) -> engine_options {
    engine_options {
        backend: engine_backend::Cpu,
        context: 128,
        max_streams: 2,
        room_bytes: 1 << 30,
        log: Some(collect),
        kv_type_k: kv.0,
        kv_type_v: kv.1,
        ..engine::default_options()
    }
}

/// engine_init_fit's status and message for options whose `field` holds the raw value `raw`.
fn init_with_raw(path: &std::path::Path, field: usize, raw: u32) -> (Status, String) {
    let opts = cpu_options((engine_kv_type::ENGINE_KV_DEFAULT, engine_kv_type::ENGINE_KV_DEFAULT));
    let mut bytes = vec![0u8; std::mem::size_of::<engine_options>() + 8];
    let aligned = bytes.as_mut_ptr().wrapping_add(bytes.as_ptr().align_offset(8));
    let mut e = std::ptr::null_mut();
    // SAFETY: `aligned` is 8-byte aligned with room for engine_options in `bytes`; the raw value goes into the field at
    // `field`, a u32 inside it, which ffi reads raw before it treats it as an enum.
    let status = unsafe {
        std::ptr::copy_nonoverlapping(
            &opts as *const engine_options as *const u8,
            aligned,
            std::mem::size_of::<engine_options>(),
        );
        (aligned.add(field) as *mut u32).write(raw);
        ffi::engine_init_fit(common::c_path(path).as_ptr(), aligned as *const engine_options, &mut e)
    };
    let message = last_error();
    if status == Status::Ok {
        // SAFETY: the engine came from engine_init_fit and is freed here, once.
        unsafe { ffi::engine_free(e) };
    } else {
        assert!(e.is_null(), "a refused init left an engine");
    }
    (status, message)
}

#[test]
fn kv_options_through_the_c_abi() {
    let _g = serial();
    let mut rng = Rng::fresh("kv_options_through_the_c_abi");
    let dir = Scratch::new("kv-options");
    let cfg = small(Arch::Qwen2, 128);
    let seed = rng.next_u64();
    let path = dir.hf("qwen2", &cfg, seed, DType::F32);

    // Out-of-range raw values are refused before anything is opened.
    for (field, name) in [
        (std::mem::offset_of!(engine_options, kv_type_k), "kv_type_k"),
        (std::mem::offset_of!(engine_options, kv_type_v), "kv_type_v"),
    ] {
        for raw in [6u32, 99, u32::MAX] {
            let (status, message) = init_with_raw(&path, field, raw);
            assert_eq!(status, Status::InvalidArgument, "{name} = {raw}: {message}");
            assert!(message.contains(name) && message.contains(&raw.to_string()), "{message}");
        }
        assert_eq!(init_with_raw(&path, field, 5).0, Status::Ok, "{name} = 5 (FP8_E4M3) is a type");
    }

    // Every type on the CPU backend (FP8 included: the CPU emulates it): the info and the start-up line
    // name it, and the logits are the CPU model's in that type.
    let src = MemSource::synthetic(&cfg, seed, DType::F32);
    let prompt: Vec<i32> = (0..20).map(|_| rng.below(cfg.vocab as u64) as i32).collect();
    let ids: Vec<u32> = prompt.iter().map(|&t| t as u32).collect();
    let mut c_types: Vec<(engine_kv_type, engine_kv_type)> =
        vec![(engine_kv_type::ENGINE_KV_DEFAULT, engine_kv_type::ENGINE_KV_DEFAULT)];
    c_types.extend(type_pairs().iter().map(|p| (p.k.to_c(), p.v.to_c())));
    for (k, v) in c_types {
        LINES.lock().unwrap().clear();
        let e = init(&path, &cpu_options((k, v)));
        let want = KvTypes::resolve(k, v, KvTypes::CPU_DEFAULT);
        let i = info(&e);
        assert_eq!((i.kv_type_k, i.kv_type_v), (want.k.to_c(), want.v.to_c()), "{k:?}/{v:?}: engine_model_info");
        let lines = LINES.lock().unwrap().clone();
        let start = lines.iter().find(|l| l.contains("KV pool of")).unwrap_or_else(|| panic!("{lines:?}"));
        assert!(start.contains(&format!("in {}", want.describe())), "{start}");
        assert!(start.contains(&format!("({} KV cache)", want.describe())), "{start}");
        step(&e, 0, &prompt);
        let model = CpuModel::new(&src).unwrap().with_kv_types(want).unwrap();
        let expect = model.forward(&mut model.new_stream(128), &ids).unwrap();
        assert_eq!(common::bits(&logits(&e, 0)), common::bits(&expect), "{}", want.describe());
    }

    // A block type on a model whose heads are not whole blocks: UNSUPPORTED, naming the option.
    let narrow = ModelConfig { head_dim: 16, ..cfg.clone() };
    let narrow_path = dir.hf("narrow", &narrow, seed, DType::F32);
    for (k, v, field) in [
        (engine_kv_type::ENGINE_KV_Q8_0, engine_kv_type::ENGINE_KV_DEFAULT, "kv_type_k"),
        (engine_kv_type::ENGINE_KV_F16, engine_kv_type::ENGINE_KV_FP8_E4M3, "kv_type_v"),
    ] {
        let mut e = std::ptr::null_mut();
        let opts = cpu_options((k, v));
        // SAFETY: a NUL-terminated path, options and a handle slot, all alive across the call.
        let status = unsafe { ffi::engine_init_fit(common::c_path(&narrow_path).as_ptr(), &opts, &mut e) };
        assert_eq!(status, Status::Unsupported, "{}", last_error());
        assert!(last_error().contains(field) && last_error().contains("head_dim 16"), "{}", last_error());
        assert!(e.is_null());
    }
    // The same model with types that take any head: loads.
    drop(init(&narrow_path, &cpu_options((engine_kv_type::ENGINE_KV_BF16, engine_kv_type::ENGINE_KV_F16))));
    assert_eq!(common::stats(), Default::default(), "everything freed");
}

#[test]
fn the_cpu_start_up_line_counts_the_cache_in_its_type() {
    let _g = serial();
    let dir = Scratch::new("kv-line");
    let cfg = small(Arch::Llama, 128);
    let path = dir.hf("llama", &cfg, 3, DType::F32);
    let mut stream_bytes = Vec::new();
    for t in KvType::ALL {
        LINES.lock().unwrap().clear();
        let opts = engine_options { max_streams: 1, ..cpu_options((t.to_c(), t.to_c())) };
        let e = init(&path, &opts);
        let (total, _) = common::kv_stats(&e);
        // One full window in the pool: the stream the plan counted.
        assert_eq!(total, 128, "{}", t.name());
        let line = LINES.lock().unwrap().iter().find(|l| l.contains("KV pool")).cloned().unwrap();
        assert!(line.contains(&format!("{} KV cache", t.name())), "{line}");
        stream_bytes.push(KvTypes::same(t).bytes_per_token(&cfg) * 128);
    }
    // BF16 and F16 half of F32; Q8_0 and FP8 17/32 of BF16.
    assert_eq!(stream_bytes[0], stream_bytes[2] / 2);
    assert_eq!(stream_bytes[1], stream_bytes[0]);
    assert_eq!(stream_bytes[3] * 32, stream_bytes[0] * 17);
    assert_eq!(stream_bytes[4], stream_bytes[3]);
}
