//! The engine's options: their defaults, their checks, and how each AUTO resolves (the environment's
//! settings are read here, once an engine, into the `Tuning` the load passes down).

use super::{engine_backend, engine_kv_type, engine_options, engine_tristate};
use crate::abi::engine_device_info;
use crate::fit;
use crate::gpu::MAX_BATCH_LIMIT;
use crate::kv::KvTypes;
use crate::model::ModelConfig;
use crate::sampler::Sampling;
use crate::status::Result;
use crate::tuning::{self, Tuning};

/// The environment variable the seed issue gates file-mapped rows with; "1" means on.
pub const MMAP_ROWS_ENV: &str = "DS4_EMBD_MMAP";

pub const DEFAULT_MAX_BATCH: u32 = 512;

/// The defaults: device 0, the model's window, probed room, a 256 MiB reserve, no drafter, every
/// stream that fits, rows placed by the rule, greedy sampling, logs to standard error.
pub fn default_options() -> engine_options {
    engine_options {
        device: 0,
        context: 0,
        room_bytes: 0,
        reserve_bytes: fit::ENGINE_FIT_DEFAULT_RESERVE_BYTES,
        drafter_weight_bytes: 0,
        drafter_stream_bytes: 0,
        max_streams: 0,
        max_batch: DEFAULT_MAX_BATCH,
        unified: engine_tristate::Auto,
        mmap_rows: engine_tristate::Auto,
        backend: engine_backend::Auto,
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
        min_p: 0.0,
        repeat_penalty: 1.0,
        repeat_last_n: Sampling::GREEDY.repeat_last_n,
        log: None,
        log_user: std::ptr::null_mut(),
        kv_type_k: engine_kv_type::ENGINE_KV_DEFAULT,
        kv_type_v: engine_kv_type::ENGINE_KV_DEFAULT,
        batch_tensor_cores: engine_tristate::Auto,
        prefix_cache: engine_tristate::Auto,
        draft_model: std::ptr::null(),
        devices: 0,
    }
}

impl Default for engine_options {
    fn default() -> Self {
        default_options()
    }
}

/// Yes or No as set; Auto is on when the environment variable `var` is "1" (anything else is off).
fn tristate_or_env(option: engine_tristate, var: &str) -> bool {
    match option {
        engine_tristate::Yes => true,
        engine_tristate::No => false,
        engine_tristate::Auto => tuning::env_var(var).is_some_and(|v| v == "1"),
    }
}

/// Whether rows come from the file mapping: Auto reads DS4_EMBD_MMAP.
pub fn resolve_mmap_rows(option: engine_tristate) -> bool {
    tristate_or_env(option, MMAP_ROWS_ENV)
}

/// The environment variable `options.batch_tensor_cores` AUTO reads; "1" means on.
pub const BATCH_TENSOR_CORES_ENV: &str = "HOSTEMBED_BATCH_TENSOR_CORES";

/// Whether a CUDA engine's batches share tensor-core products among their single tokens (not batch
/// invariant): Auto reads HOSTEMBED_BATCH_TENSOR_CORES.
pub fn resolve_batch_tensor_cores(option: engine_tristate) -> bool {
    tristate_or_env(option, BATCH_TENSOR_CORES_ENV)
}

/// How an engine with these options runs: the environment's settings (`Tuning::from_env`, read here
/// once an engine) and the options' own (`batch_tensor_cores`). The engine passes it to the backend
/// it loads; nothing below reads the environment.
pub fn tuning_for(opts: &engine_options) -> Tuning {
    Tuning { batch_tensor_cores: resolve_batch_tensor_cores(opts.batch_tensor_cores), ..Tuning::from_env() }
}

/// Whether the engine's KV pool keeps a prefix cache: Auto is on.
pub fn resolve_prefix_cache(option: engine_tristate) -> bool {
    option != engine_tristate::No
}

/// Whether host and device share memory: Auto asks the device (integrated with pageable access), and
/// is false with no device to ask.
pub fn resolve_unified(option: engine_tristate, device: Option<&engine_device_info>) -> bool {
    match option {
        engine_tristate::Yes => true,
        engine_tristate::No => false,
        engine_tristate::Auto => device.is_some_and(|d| d.integrated && d.pageable_memory_access),
    }
}

/// Options no engine can start with: INVALID_ARGUMENT naming the field (UNSUPPORTED for what this
/// version does not combine).
pub fn check_options(o: &engine_options) -> Result<()> {
    if o.device < 0 {
        crate::bail!(InvalidArgument, "options.device is {}", o.device);
    }
    if o.max_batch as usize > MAX_BATCH_LIMIT {
        crate::bail!(InvalidArgument, "options.max_batch is {}, past {MAX_BATCH_LIMIT}", o.max_batch);
    }
    check_devices(o)?;
    sampling_of(o).check("options.")
}

/// `options.devices` past one: INVALID_ARGUMENT on the CPU backend, UNSUPPORTED beside a drafter
/// model (which runs on one device) or past the devices' ordinals `i32` holds.
fn check_devices(o: &engine_options) -> Result<()> {
    let n = o.devices;
    if n <= 1 {
        return Ok(());
    }
    if o.backend == engine_backend::Cpu {
        crate::bail!(InvalidArgument, "options.devices is {n}: the CPU backend runs on one (0 or 1)");
    }
    if !o.draft_model.is_null() {
        crate::bail!(
            Unsupported,
            "options.devices is {n}: a drafter model (options.draft_model) runs beside one device's model only"
        );
    }
    if n > 64 || o.device as i64 + n as i64 > i32::MAX as i64 {
        crate::bail!(InvalidArgument, "options.devices is {n}: tensor parallelism takes 2 to 64 devices");
    }
    Ok(())
}

/// The prompt tokens a pass takes: the option, or the default for 0. The fit rule's scratch and the load
/// both read it here, so the bytes planned are the bytes allocated.
pub fn max_batch_of(o: &engine_options) -> usize {
    if o.max_batch == 0 { DEFAULT_MAX_BATCH as usize } else { o.max_batch as usize }
}

/// The sampler settings the options give every stream to start with.
pub fn sampling_of(o: &engine_options) -> Sampling {
    Sampling {
        temperature: o.temperature,
        top_k: o.top_k,
        top_p: o.top_p,
        min_p: o.min_p,
        repeat_penalty: o.repeat_penalty,
        repeat_last_n: o.repeat_last_n,
        seed: o.seed,
    }
}

/// The window an engine plans for: the asked one, or the model's own.
pub fn window_of(cfg: &ModelConfig, opts: &engine_options) -> Result<u32> {
    let w = if opts.context == 0 { cfg.max_position } else { opts.context as usize };
    u32::try_from(w).map_err(|_| crate::err!(InvalidArgument, "a window of {w} tokens is more than the engine counts"))
}

/// The KV cache types a CUDA engine keeps for these options (ENGINE_KV_DEFAULT: BF16).
pub fn gpu_kv_types(opts: &engine_options) -> KvTypes {
    KvTypes::resolve(opts.kv_type_k, opts.kv_type_v, KvTypes::GPU_DEFAULT)
}

/// The KV cache types a CPU engine keeps for these options (ENGINE_KV_DEFAULT: F32).
pub fn cpu_kv_types(opts: &engine_options) -> KvTypes {
    KvTypes::resolve(opts.kv_type_k, opts.kv_type_v, KvTypes::CPU_DEFAULT)
}
