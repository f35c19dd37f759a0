//! The options' defaults and the variables they follow only when auto.

use super::{config, set_mmap_env};
use crate::common::{self, Rng, Scratch, serial, set_env};
use hostembed::checkpoint::write::write_synthetic_hf;
use hostembed::engine::{Engine, engine_backend, engine_options, engine_tristate};
use hostembed::ffi::engine_device_info;
use hostembed::tensor::DType;
use hostembed::tuning::Tuning;
use hostembed::{engine, ffi, tuning};

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
