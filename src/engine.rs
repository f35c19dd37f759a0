//! The engine: a checkpoint, the plan the fit rule made for it, and the embedding rows where the plan
//! put them. `Engine::init_fit` opens, measures, decides, logs and places; every failure on the way
//! releases what was taken before it (each resource has one owner).
//!
//! Backends: CUDA runs the plan of `fit::plan`. The CPU backend (no device, or `backend = CPU`) reads
//! the rows straight from the file mapping and has no device plan: `plan()` is None there.
#![allow(non_camel_case_types)]

use crate::abi::engine_device_info;
use crate::backend::{Backend, Batch, BatchItem, Decoder, Streams};
use crate::checkpoint::Checkpoint;
use crate::constraint::Constraint;
use crate::cpu::{CpuBackend, CpuStream};
use crate::cuda::{self, PinnedBuffer};
use crate::cudart as rt;
use crate::fit::{self, engine_fit_inputs, engine_placement, engine_plan};
use crate::gpu::{CudaBackend, GpuModel, MAX_BATCH_LIMIT, RowsOnDevice};
use crate::kv::KvTypes;
use crate::model::ModelConfig;
use crate::placement::{Rows, RowsSource};
use crate::sampler::Sampling;
use crate::status::{Result, Status};
use crate::tensor::DType;
use crate::tokenizer::Tokenizer;
use crate::tuning::{self, Tuning};
use std::ffi::CString;
use std::os::raw::c_void;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// The environment variable the seed issue gates file-mapped rows with; "1" means on.
pub const MMAP_ROWS_ENV: &str = "DS4_EMBD_MMAP";

pub use crate::abi::{
    engine_backend, engine_batch_item, engine_draft, engine_kv_type, engine_log_fn, engine_options, engine_speculation,
    engine_tristate,
};

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

/// Options no engine can start with: INVALID_ARGUMENT naming the field.
pub fn check_options(o: &engine_options) -> Result<()> {
    if o.device < 0 {
        crate::bail!(InvalidArgument, "options.device is {}", o.device);
    }
    if o.max_batch as usize > MAX_BATCH_LIMIT {
        crate::bail!(InvalidArgument, "options.max_batch is {}, past {MAX_BATCH_LIMIT}", o.max_batch);
    }
    sampling_of(o).check("options.")
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

/// The KV pool: `pages` pages of `page_tokens` positions, `bytes` of memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvPool {
    pub page_tokens: usize,
    pub pages: usize,
    pub bytes: u64,
}

impl KvPool {
    /// Pages for `windows` full windows of `window` tokens, or for `room` bytes at `per_token` bytes a
    /// position, whichever is more.
    pub fn sized(page_tokens: usize, window: usize, windows: u64, room: u64, per_token: u64) -> KvPool {
        let per_page = per_token.max(1).saturating_mul(page_tokens as u64);
        let for_windows = windows.saturating_mul(window.div_ceil(page_tokens) as u64);
        let pages = for_windows.max(room / per_page).min(u32::MAX as u64) as usize;
        KvPool { page_tokens, pages, bytes: (pages as u64).saturating_mul(per_page) }
    }

    pub fn tokens(&self) -> u64 {
        self.pages as u64 * self.page_tokens as u64
    }

    /// Streams to admit when `want` are asked for: no more than the pool has pages, so that each can
    /// hold a token.
    pub fn streams(&self, want: u32) -> u32 {
        want.min(u32::try_from(self.pages).unwrap_or(u32::MAX))
    }

    /// The start-up line's words for it.
    pub fn describe(&self) -> String {
        format!(
            "KV pool of {} tokens ({} GiB, {} pages of {} tokens)",
            self.tokens(),
            fit::gib(self.bytes),
            self.pages,
            self.page_tokens
        )
    }

    /// `describe` naming the cache types too: "KV pool of 4096 tokens in Q8_0 (...)".
    pub fn describe_with(&self, kv: KvTypes) -> String {
        format!(
            "KV pool of {} tokens in {} ({} GiB, {} pages of {} tokens)",
            self.tokens(),
            kv.describe(),
            fit::gib(self.bytes),
            self.pages,
            self.page_tokens
        )
    }
}

/// "device 0 (NVIDIA H200)" for messages about the device.
fn device_label(device: i32, info: &engine_device_info) -> String {
    let bytes: Vec<u8> = info.name.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    format!("device {device} ({})", String::from_utf8_lossy(&bytes))
}

/// Where log lines go.
#[derive(Clone, Copy)]
pub struct Logger {
    log: engine_log_fn,
    user: *mut c_void,
}

// SAFETY: the callback and its user pointer are the caller's, who promises any calling thread may use them.
unsafe impl Send for Logger {}
// SAFETY: as for Send; the logger itself holds no state a call changes.
unsafe impl Sync for Logger {}

impl Logger {
    pub fn new(opts: &engine_options) -> Logger {
        Logger { log: opts.log, user: opts.log_user }
    }

    pub fn line(&self, text: &str) {
        match self.log {
            Some(f) => {
                let c = CString::new(text.replace('\0', " ")).unwrap_or_default();
                // SAFETY: the caller's callback and user pointer, with a NUL-terminated line alive for the call.
                unsafe { f(self.user, c.as_ptr()) };
            }
            None => eprintln!("hostembed: {text}"),
        }
    }
}

/// A checkpoint owned by an engine: its mapped bytes count in `engine_memory.mapped_bytes` while it lives.
pub struct HeldCheckpoint {
    ckpt: Arc<Checkpoint>,
    mapped: u64,
}

impl HeldCheckpoint {
    pub fn new(ckpt: Checkpoint) -> HeldCheckpoint {
        let mapped = ckpt.files.iter().map(|f| f.map.len() as u64).sum();
        cuda::MEMORY.mapped.fetch_add(mapped, Ordering::Relaxed);
        HeldCheckpoint { ckpt: Arc::new(ckpt), mapped }
    }

    /// The checkpoint for a holder that must keep it alive on its own (the CPU backend's view).
    pub fn shared(&self) -> Arc<Checkpoint> {
        Arc::clone(&self.ckpt)
    }
}

impl std::ops::Deref for HeldCheckpoint {
    type Target = Checkpoint;
    fn deref(&self) -> &Checkpoint {
        &self.ckpt
    }
}

impl Drop for HeldCheckpoint {
    fn drop(&mut self) {
        cuda::MEMORY.mapped.fetch_sub(self.mapped, Ordering::Relaxed);
    }
}

/// The embedding table of a checkpoint, as the placements read it.
pub fn rows_source(ckpt: &Checkpoint) -> RowsSource<'_> {
    let t = ckpt.embed();
    RowsSource { bytes: ckpt.bytes_of(t), dtype: t.dtype, vocab: t.rows(), cols: t.cols() }
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

/// The figures the fit rule decides on, from a checkpoint and the options (the KV cache in
/// `gpu_kv_types`; UNSUPPORTED when a type cannot hold the model's heads), for the tuning an engine
/// would run with (`tuning_for`). `device` is the device the engine would run on (None: no device;
/// then `room_bytes` must be given and unified Auto is false).
pub fn fit_inputs(
    ckpt: &Checkpoint,
    opts: &engine_options,
    device: Option<&engine_device_info>,
) -> Result<engine_fit_inputs> {
    fit_inputs_with_drafter(ckpt, None, opts, device, &tuning_for(opts))
}

/// `fit_inputs` for `tuning`, with a drafter model beside the target: its terms are the drafter's real
/// bytes (its weights, embedding rows and scratch; one stream at the drafter's window) instead of the
/// options'.
pub fn fit_inputs_with_drafter(
    ckpt: &Checkpoint,
    drafter: Option<&Checkpoint>,
    opts: &engine_options,
    device: Option<&engine_device_info>,
    tuning: &Tuning,
) -> Result<engine_fit_inputs> {
    let cfg = &ckpt.config;
    let window = window_of(cfg, opts)?;
    let room = match (opts.room_bytes, device) {
        (0, Some(d)) => d.free_bytes,
        (0, None) => crate::bail!(InvalidArgument, "options.room_bytes is 0 and there is no device to probe"),
        (room, _) => room,
    };
    let embed = ckpt.bytes_of(ckpt.embed()).len() as u64;
    // What the GPU model allocates beside the rows, from the same layout its load uses.
    let weights = GpuModel::weight_bytes(ckpt);
    if weights == 0 {
        crate::bail!(BadModel, "{}: the GPU backend cannot lay out this model's weights", ckpt.path.display());
    }
    let kv = gpu_kv_types(opts);
    kv.check(cfg)?;
    let scratch = GpuModel::scratch_bytes(ckpt, max_batch_of(opts), kv, window as usize, tuning);
    let stream = GpuModel::stream_bytes(cfg, kv, window as usize);
    let (drafter_weight_bytes, drafter_stream_bytes) = match drafter {
        None => (opts.drafter_weight_bytes, opts.drafter_stream_bytes),
        Some(d) => {
            let weights = GpuModel::weight_bytes(d);
            if weights == 0 {
                crate::bail!(BadModel, "{}: the GPU backend cannot lay out the drafter's weights", d.path.display());
            }
            kv.check(&d.config)?;
            let window = drafter_window(&d.config, window as usize);
            let embed = d.bytes_of(d.embed()).len() as u64;
            let scratch = GpuModel::scratch_bytes(d, max_batch_of(opts), kv, window, tuning);
            (weights + embed + scratch, GpuModel::stream_bytes(&d.config, kv, window))
        }
    };
    Ok(engine_fit_inputs {
        room_bytes: room,
        weight_bytes: weights + embed,
        embed_bytes: embed,
        scratch_bytes: scratch,
        stream_bytes: stream,
        stream_bytes_per_token: kv.bytes_per_token(cfg),
        drafter_weight_bytes,
        drafter_stream_bytes,
        reserve_bytes: opts.reserve_bytes,
        window,
        max_streams: opts.max_streams,
        unified: resolve_unified(opts.unified, device),
        embed_tied: cfg.tied,
        mmap_rows: resolve_mmap_rows(opts.mmap_rows),
    })
}

/// The line logged when the rows leave the card, in the seed's words.
pub fn host_rows_reason(plan: &engine_plan, inputs: &engine_fit_inputs, opts: &engine_options) -> Option<String> {
    match plan.placement {
        engine_placement::Device => None,
        engine_placement::HostMapped => {
            Some(format!("embedding rows read from host memory: no room beside a {}-token stream", plan.window))
        }
        engine_placement::FileMapped => Some(match opts.mmap_rows {
            engine_tristate::Yes => "embedding rows read from the file mapping: options.mmap_rows is set".to_string(),
            _ if inputs.mmap_rows => format!("embedding rows read from the file mapping: {MMAP_ROWS_ENV}=1"),
            _ => "embedding rows read from the file mapping".to_string(),
        }),
    }
}

/// The window a drafter's streams have beside a target's of `window`: the target's, or the drafter's
/// own positions where those are fewer (its streams then stop proposing before the target's end).
pub fn drafter_window(cfg: &ModelConfig, window: usize) -> usize {
    window.min(cfg.max_position)
}

/// A drafter model loaded beside the target: its checkpoint, its rows (on CUDA, on the device), and
/// the pages of its own KV pool (one stream at its window for each of the target's streams).
struct DrafterLoad<'a> {
    ckpt: &'a HeldCheckpoint,
    rows: &'a Rows,
    pool: KvPool,
}

/// Opens `options.draft_model` when set: BAD_MODEL, naming both sizes, when its vocabulary is not the
/// target's.
fn open_drafter(opts: &engine_options, target: &Checkpoint) -> Result<Option<HeldCheckpoint>> {
    if opts.draft_model.is_null() {
        return Ok(None);
    }
    // SAFETY: engine_options' contract: `draft_model` is NULL (handled) or a NUL-terminated path that
    // lives across engine_init_fit.
    let bytes = unsafe { std::ffi::CStr::from_ptr(opts.draft_model) }.to_bytes();
    let path = Path::new(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(bytes));
    let d = Checkpoint::open(path)
        .map_err(|e| crate::Error::new(e.status, format!("options.draft_model: {}", e.message)))?;
    if d.config.vocab != target.config.vocab {
        crate::bail!(
            BadModel,
            "options.draft_model: the drafter {} has a vocabulary of {} tokens and the target {} one of {}; a drafter \
             must share the target's vocabulary",
            path.display(),
            d.config.vocab,
            target.path.display(),
            target.config.vocab
        );
    }
    Ok(Some(HeldCheckpoint::new(d)))
}

/// The start-up line's words for a drafter.
fn describe_drafter(d: &Checkpoint, window: usize, weight_bytes: u64, pool: &KvPool, kv: KvTypes) -> String {
    format!(
        "drafter {} ({:?}, {} layers, {} hidden, vocabulary {}): {} GiB of weights, streams of {window} tokens, {}",
        d.path.display(),
        d.config.arch,
        d.config.layers,
        d.config.hidden,
        d.config.vocab,
        fit::gib(weight_bytes),
        pool.describe_with(kv)
    )
}

/// The decode backend beside the placed rows, with its stream slots over one KV page pool: on CUDA the
/// GPU model reading `rows`; on the CPU a model view over the checkpoint, checked here so a bad model
/// fails the load rather than the first step. With a drafter, a second model of the same kind over its
/// own pool proposes for `ENGINE_DRAFT_MODEL`.
#[allow(clippy::too_many_arguments)]
fn load_decoder(
    kind: BackendKind,
    ckpt: &HeldCheckpoint,
    rows: &Rows,
    streams: u32,
    pool: &KvPool,
    kv: KvTypes,
    opts: &engine_options,
    tuning: &Tuning,
    logger: &Logger,
    drafter: Option<DrafterLoad<'_>>,
) -> Result<Box<dyn Decoder>> {
    let window = window_of(&ckpt.config, opts)? as usize;
    let sampling = sampling_of(opts);
    let streams = streams as usize;
    let prefix_cache = resolve_prefix_cache(opts.prefix_cache);
    Ok(match kind {
        BackendKind::Cpu => {
            let backend = CpuBackend::with_kv(ckpt.shared(), pool.pages, kv, tuning)?;
            let target = Streams::new(backend, window, streams, pool.pages, sampling)?.with_prefix_cache(prefix_cache);
            match drafter {
                None => Box::new(target),
                Some(d) => {
                    let backend = CpuBackend::with_kv(d.ckpt.shared(), d.pool.pages, kv, tuning)?;
                    let dwindow = drafter_window(&d.ckpt.config, window);
                    let drafts = Streams::new(backend, dwindow, streams, d.pool.pages, Sampling::GREEDY)?
                        .with_prefix_cache(prefix_cache);
                    Box::new(target.with_drafter(drafts)?)
                }
            }
        }
        BackendKind::Cuda => {
            let r = rows.describe();
            let rows = RowsOnDevice { ptr: r.data, dtype: r.dtype, vocab: r.rows as usize, cols: r.cols as usize };
            let model =
                CudaBackend::load(&**ckpt, rows, max_batch_of(opts), opts.device, pool.pages, kv, window, tuning)?;
            logger.line(model.prompt_route());
            if tuning.batch_tensor_cores {
                logger.line("batches of 16 or more single tokens share tensor-core products: a stream's logits depend on its batch");
            }
            let target = Streams::new(model, window, streams, pool.pages, sampling)?.with_prefix_cache(prefix_cache);
            match drafter {
                None => Box::new(target),
                Some(d) => {
                    let r = d.rows.describe();
                    let rows =
                        RowsOnDevice { ptr: r.data, dtype: r.dtype, vocab: r.rows as usize, cols: r.cols as usize };
                    let dwindow = drafter_window(&d.ckpt.config, window);
                    let (device, pages) = (opts.device, d.pool.pages);
                    let model =
                        CudaBackend::load(&**d.ckpt, rows, max_batch_of(opts), device, pages, kv, dwindow, tuning)?;
                    let drafts = Streams::new(model, dwindow, streams, d.pool.pages, Sampling::GREEDY)?
                        .with_prefix_cache(prefix_cache);
                    Box::new(target.with_drafter(drafts)?)
                }
            }
        }
    })
}

/// The checkpoint's tokenizer; its absence (or an unsupported kind) only costs text, so it is logged;
/// a broken one fails the load.
fn load_tokenizer(ckpt: &Checkpoint, logger: &Logger) -> Result<Option<Arc<Tokenizer>>> {
    match Tokenizer::from_source(&ckpt.tokenizer, ckpt.config.vocab) {
        Ok(t) => {
            for note in t.iter().flat_map(|t| t.notes()) {
                logger.line(note);
            }
            Ok(t.map(Arc::new))
        }
        Err(e) if e.status != Status::Unsupported => Err(e),
        Err(e) => {
            logger.line(&format!("no tokenizer, token ids only: {}", e.message));
            Ok(None)
        }
    }
}

/// The point after which `init_fit_failing_after` fails, to prove each step's failure frees everything.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitStep {
    Opened,
    Planned,
    RowsPlaced,
    Loaded,
}

/// Streams the CPU backend admits when `max_streams` is 0 (it has no device memory to plan).
pub const CPU_STREAMS: u32 = 16;

/// The backend an engine runs on, once resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cuda,
    Cpu,
}

/// A loaded model with its embedding rows placed.
pub struct Engine {
    // Fields drop in order: the decode backend (which reads the rows), the rows, the out-of-range
    // flag, and last the mapping the rows may point into.
    backend: Box<dyn Decoder>,
    tokenizer: Option<Arc<Tokenizer>>,
    rows: Rows,
    /// The drafter's rows and checkpoint (None without `options.draft_model`): its model in `backend`
    /// reads them, so they drop after it, beside the target's.
    _drafter_rows: Option<Rows>,
    bad_ids: Option<Mutex<PinnedBuffer>>,
    plan: Option<engine_plan>,
    inputs: Option<engine_fit_inputs>,
    options: engine_options,
    /// How the backend was told to run.
    tuning: Tuning,
    logger: Logger,
    kind: BackendKind,
    kv: KvTypes,
    ckpt: HeldCheckpoint,
    drafter_ckpt: Option<HeldCheckpoint>,
}

// SAFETY: the log callback's user pointer is the caller's, who promises the engine's new thread may use it.
unsafe impl Send for Engine {}

impl Engine {
    /// Opens `path`, plans with the fit rule, logs the start-up line and places the rows.
    pub fn init_fit(path: &Path, opts: &engine_options) -> Result<Engine> {
        Self::init_fit_failing_after(path, opts, None)
    }

    /// `init_fit` that fails on purpose right after `step` (tests use it to prove nothing leaks).
    #[doc(hidden)]
    pub fn init_fit_failing_after(path: &Path, opts: &engine_options, fail: Option<InitStep>) -> Result<Engine> {
        let injected = |step: InitStep| -> Result<()> {
            if fail == Some(step) {
                crate::bail!(IoError, "init_fit failed on purpose after {step:?}");
            }
            Ok(())
        };
        check_options(opts)?;
        let logger = Logger::new(opts);
        // The one read of the environment an engine makes; everything below is given this.
        let tuning = tuning_for(opts);
        let device = match opts.backend {
            engine_backend::Cpu => None,
            engine_backend::Cuda => Some(cuda::device_info(opts.device)?),
            engine_backend::Auto => match cuda::device_info(opts.device) {
                Ok(info) => Some(info),
                Err(e) if matches!(e.status, Status::NoCuda | Status::NoDevice) => None,
                Err(e) => return Err(e),
            },
        };
        let ckpt = HeldCheckpoint::new(Checkpoint::open(path)?);
        let drafter_ckpt = open_drafter(opts, &ckpt)?;
        injected(InitStep::Opened)?;
        let src = rows_source(&ckpt);

        let Some(info) = device else {
            let window = window_of(&ckpt.config, opts)?;
            let kv = cpu_kv_types(opts);
            kv.check(&ckpt.config)?;
            let want = if opts.max_streams > 0 { opts.max_streams } else { CPU_STREAMS };
            let slot = std::mem::size_of::<Option<CpuStream>>() as u64;
            let cpu = fit::plan_cpu(&fit::cpu_inputs(&ckpt.config, window, want, slot, kv, opts, tuning.cpu_threads)?);
            // As on CUDA, the pool takes the room the plan leaves beside the step scratch and the stream
            // slots, at least its full windows and at most `want` of them (all those streams could fill);
            // `want` streams share it. Its pages cost memory only as streams fill them.
            let room = (cpu.inputs.room_bytes.saturating_sub(cpu.inputs.scratch_bytes))
                .saturating_sub(want as u64 * slot)
                .min((want as u64).saturating_mul(cpu.stream_bytes.unwrap_or(0)));
            let pool = KvPool::sized(CpuBackend::PAGE_TOKENS, window as usize, cpu.streams as u64, room, {
                let c = &ckpt.config;
                fit::cpu_kv_bytes(c.layers as u64, 1, c.kv_heads as u64, c.head_dim as u64, kv).unwrap_or(u64::MAX)
            });
            let pool_line = if cpu.streams > 0 { format!(", {}", pool.describe_with(kv)) } else { String::new() };
            logger.line(&format!(
                "{}: model {} GiB on the CPU backend, rows read from the file mapping, {}{pool_line}",
                fit::describe_parameters(&ckpt.config),
                fit::gib(ckpt.weight_bytes()),
                fit::describe_cpu(&cpu)
            ));
            if let Some(why) = fit::refusal_cpu(&cpu) {
                crate::bail!(NoRoom, "{why}");
            }
            injected(InitStep::Planned)?;
            // SAFETY: the rows point into `ckpt`, which the engine drops after them.
            let rows = unsafe { Rows::in_mapping(&src) }?;
            // SAFETY: the drafter's rows point into `drafter_ckpt`, which the engine drops after them.
            let drafter_rows =
                drafter_ckpt.as_ref().map(|d| unsafe { Rows::in_mapping(&rows_source(d)) }).transpose()?;
            injected(InitStep::RowsPlaced)?;
            let streams = pool.streams(want);
            let drafter = match (&drafter_ckpt, &drafter_rows) {
                (Some(d), Some(r)) => {
                    let dwindow = drafter_window(&d.config, window as usize);
                    let per_token = fit::cpu_kv_bytes(
                        d.config.layers as u64,
                        1,
                        d.config.kv_heads as u64,
                        d.config.head_dim as u64,
                        kv,
                    )
                    .unwrap_or(u64::MAX);
                    let dpool = KvPool::sized(CpuBackend::PAGE_TOKENS, dwindow, streams as u64, 0, per_token);
                    logger.line(&describe_drafter(d, dwindow, d.weight_bytes(), &dpool, kv));
                    Some(DrafterLoad { ckpt: d, rows: r, pool: dpool })
                }
                _ => None,
            };
            let backend =
                load_decoder(BackendKind::Cpu, &ckpt, &rows, streams, &pool, kv, opts, &tuning, &logger, drafter)?;
            let engine = Engine {
                backend,
                tokenizer: load_tokenizer(&ckpt, &logger)?,
                rows,
                _drafter_rows: drafter_rows,
                bad_ids: None,
                plan: None,
                inputs: None,
                options: *opts,
                tuning,
                logger,
                kind: BackendKind::Cpu,
                kv,
                ckpt,
                drafter_ckpt,
            };
            injected(InitStep::Loaded)?;
            return Ok(engine);
        };

        let kv = gpu_kv_types(opts);
        kv.check(&ckpt.config)?;
        kv.check_device(info.compute_major, info.compute_minor, &device_label(opts.device, &info))?;
        let inputs = fit_inputs_with_drafter(&ckpt, drafter_ckpt.as_deref(), opts, Some(&info), &tuning)?;
        let mut plan = fit::plan(&inputs)?;
        // The drafter's pool: a full drafter window for each of the plan's streams, which the fit counted
        // (`streams = left / (stream + drafter_stream)`); more streams share it as they share the target's
        // (a drafter stream without room proposes nothing).
        let drafter_pool = drafter_ckpt.as_ref().map(|d| {
            let dwindow = drafter_window(&d.config, plan.window as usize);
            KvPool::sized(
                CudaBackend::PAGE_TOKENS,
                dwindow,
                plan.streams.max(1) as u64,
                0,
                kv.bytes_per_token(&d.config),
            )
        });
        // The pool takes the room the plan leaves beside the reserve and the drafter's pool, and at least
        // its full windows; no more than max_streams full windows, which is all those streams could fill.
        let room = plan
            .left_bytes
            .saturating_sub(inputs.reserve_bytes)
            .saturating_sub(drafter_pool.as_ref().map_or(0, |p| p.bytes));
        let room = match opts.max_streams {
            0 => room,
            most => room.min((most as u64).saturating_mul(plan.stream_bytes)),
        };
        let pool = KvPool::sized(
            CudaBackend::PAGE_TOKENS,
            plan.window as usize,
            plan.streams as u64,
            room,
            inputs.stream_bytes_per_token,
        );
        match fit::refusal(&plan) {
            Some(why) => {
                logger.line(&format!("{}: {}", fit::describe_parameters(&ckpt.config), fit::describe(&plan)));
                crate::bail!(NoRoom, "{why}");
            }
            None => logger.line(&format!(
                "{}: {}, {}",
                fit::describe_parameters(&ckpt.config),
                fit::describe(&plan),
                pool.describe_with(kv)
            )),
        }
        if let Some(reason) = host_rows_reason(&plan, &inputs, opts) {
            logger.line(&reason);
        }
        injected(InitStep::Planned)?;

        let rows = match plan.placement {
            engine_placement::Device => Rows::on_device(&src)?,
            engine_placement::HostMapped => Rows::host_mapped(&src)?,
            // SAFETY: the rows point into `ckpt`, which the engine drops after them.
            engine_placement::FileMapped => unsafe { Rows::file_mapped(&src, &info, &|l| logger.line(l)) }?,
        };
        // A fallback from the file mapping to pinned memory keeps every figure of the plan but its placement.
        plan.placement = rows.placement();
        let drafter_rows = drafter_ckpt.as_ref().map(|d| Rows::on_device(&rows_source(d))).transpose()?;
        let bad_ids = Mutex::new(PinnedBuffer::new_mapped(std::mem::size_of::<i32>())?);
        injected(InitStep::RowsPlaced)?;
        // `max_streams` bounds the streams, which share the pool however many full windows it holds.
        let streams = if opts.max_streams > 0 { pool.streams(opts.max_streams) } else { plan.streams };
        let drafter = match (&drafter_ckpt, &drafter_rows, drafter_pool) {
            (Some(d), Some(r), Some(dpool)) => {
                let dwindow = drafter_window(&d.config, plan.window as usize);
                logger.line(&describe_drafter(d, dwindow, inputs.drafter_weight_bytes, &dpool, kv));
                Some(DrafterLoad { ckpt: d, rows: r, pool: dpool })
            }
            _ => None,
        };
        let backend =
            load_decoder(BackendKind::Cuda, &ckpt, &rows, streams, &pool, kv, opts, &tuning, &logger, drafter)?;
        let engine = Engine {
            backend,
            tokenizer: load_tokenizer(&ckpt, &logger)?,
            rows,
            _drafter_rows: drafter_rows,
            bad_ids: Some(bad_ids),
            plan: Some(plan),
            inputs: Some(inputs),
            options: *opts,
            tuning,
            logger,
            kind: BackendKind::Cuda,
            kv,
            ckpt,
            drafter_ckpt,
        };
        injected(InitStep::Loaded)?;
        Ok(engine)
    }

    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_deref()
    }

    /// The tokenizer, for callers that tokenize without holding the engine.
    pub fn shared_tokenizer(&self) -> Option<Arc<Tokenizer>> {
        self.tokenizer.clone()
    }

    /// Streams this engine admits (the plan's count on CUDA).
    pub fn stream_count(&self) -> usize {
        self.backend.stream_count()
    }

    /// The window every stream has, in tokens.
    pub fn window(&self) -> usize {
        self.backend.window()
    }

    /// Appends `tokens` to stream `stream` and returns the token its sampler picks next: a batch of one.
    pub fn step(&mut self, stream: u32, tokens: &[i32]) -> Result<u32> {
        let out = self.step_tokens(stream, tokens, 1)?;
        Ok(*out.last().expect("a stepped item produced its next token"))
    }

    /// Appends `tokens` to stream `stream`, letting its speculation produce up to `most` tokens, and
    /// returns every token the step produced (the last is the one sampled next): a batch of one.
    pub fn step_tokens(&mut self, stream: u32, tokens: &[i32], most: usize) -> Result<Vec<u32>> {
        let mut out = vec![0i32; most];
        let mut item = engine_batch_item {
            stream,
            tokens: tokens.as_ptr(),
            n: tokens.len(),
            next: -1,
            status: Status::InvalidArgument,
            out: if most > 1 { out.as_mut_ptr() } else { std::ptr::null_mut() },
            out_cap: if most > 1 { most } else { 0 },
            n_out: 0,
        };
        // SAFETY: the item's `tokens` are `tokens`, every id readable, and its `out`, when given, is `out`
        // of `out_cap` ints; both outlive the call.
        if let Some((_, e)) = unsafe { self.step_batch(std::slice::from_mut(&mut item)) }? {
            return Err(e);
        }
        if item.out.is_null() {
            return Ok(vec![item.next as u32]);
        }
        Ok(out[..item.n_out].iter().map(|&t| t as u32).collect())
    }

    /// Steps the caller's items at once, each with its outcome written into it: `status`, `next` (-1
    /// when it failed; a failed item appends nothing), and the tokens its step produced in `out` and
    /// `n_out`. This is where a batch is checked, once, for every layer below: the call is refused
    /// (INVALID_ARGUMENT, nothing stepped, every item INVALID_ARGUMENT) for an item's `tokens` NULL with
    /// `n` > 0, a stream named twice, or an `out` with `out_cap` below its stream's `max_tokens` + 1
    /// while the stream speculates; an item fails alone (OUT_OF_RANGE) for a stream the engine does not
    /// have or an id outside the vocabulary, or (NO_ROOM) for `n` past its stream's room, which is
    /// checked before its tokens are read. Ok holds the first failed item (its index and why) for the
    /// caller's last error; another Err only when the device failed (the items say which were stepped).
    ///
    /// # Safety
    /// Each item's `tokens` is NULL or holds `n` ids (where `n` fits its stream's room: a larger `n` is
    /// refused before they are read), and its `out` is NULL or holds `out_cap` writable ints.
    pub unsafe fn step_batch(&mut self, items: &mut [engine_batch_item]) -> Result<Option<(usize, crate::Error)>> {
        for item in items.iter_mut() {
            item.next = -1;
            item.status = Status::InvalidArgument;
            item.n_out = 0;
        }
        if let Some(k) = items.iter().position(|i| i.tokens.is_null() && i.n > 0) {
            crate::bail!(InvalidArgument, "items[{k}].tokens is NULL with n {}", items[k].n);
        }
        // Room for a speculating stream's every token, checked before anything is stepped.
        for (k, item) in items.iter().enumerate() {
            if item.out.is_null() || item.out_cap == 0 {
                continue;
            }
            let Ok(spec) = self.backend.speculation(item.stream) else { continue };
            if spec.draft != engine_draft::None && item.out_cap < spec.max_tokens as usize + 1 {
                crate::bail!(
                    InvalidArgument,
                    "items[{k}].out_cap is {}; stream {} may produce max_tokens + 1 = {}",
                    item.out_cap,
                    item.stream,
                    spec.max_tokens as usize + 1
                );
            }
        }
        let checked = items
            .iter()
            .map(|item| {
                // SAFETY: this function's contract, passed on.
                match unsafe { self.checked_tokens(item) } {
                    Ok(tokens) => {
                        let most = if item.out.is_null() { 1 } else { item.out_cap };
                        BatchItem::new(item.stream, tokens).with_most(most)
                    }
                    Err(e) => BatchItem::refused(item.stream, e),
                }
            })
            .collect();
        let mut batch = Batch::new(checked)?;
        let ran = self.backend.step_batch(&mut batch);
        let mut first_error = None;
        for (k, (item, stepped)) in items.iter_mut().zip(batch.into_items()).enumerate() {
            match stepped.next {
                Ok(t) => {
                    item.next = t as i32;
                    item.status = Status::Ok;
                    item.n_out = stepped.out.len();
                    if !item.out.is_null() && item.out_cap > 0 {
                        // `most` was out_cap, so the step produced at most that many.
                        debug_assert!(stepped.out.len() <= item.out_cap);
                        let n = stepped.out.len().min(item.out_cap);
                        // SAFETY: the contract: `out` holds `out_cap` ints, and `n` is at most `out_cap`.
                        let out = unsafe { std::slice::from_raw_parts_mut(item.out, n) };
                        for (o, &t) in out.iter_mut().zip(&stepped.out) {
                            *o = t as i32;
                        }
                    }
                }
                Err(e) => {
                    item.status = e.status;
                    first_error.get_or_insert((k, e));
                }
            }
        }
        ran?;
        Ok(first_error)
    }

    /// An item's ids as the backends take them: its stream exists, its `n` fits the stream's room
    /// (checked before its tokens are read), and every id is in the vocabulary.
    ///
    /// # Safety
    /// As `step_batch`'s: `item.tokens` holds `item.n` ids when `n` fits the stream's room, alive and
    /// unchanged for `'t` (the call that steps them).
    unsafe fn checked_tokens<'t>(&self, item: &engine_batch_item) -> Result<&'t [u32]> {
        let len = self.backend.stream_len(item.stream)?;
        let window = self.backend.window();
        if item.n > window.saturating_sub(len) {
            crate::bail!(
                NoRoom,
                "stream {}: {} tokens after {len} do not fit the stream's window of {window}",
                item.stream,
                item.n
            );
        }
        if item.n == 0 {
            return Ok(&[]);
        }
        // SAFETY: the contract: `tokens` holds `n` ids, and `n` fits the stream's room.
        let ids = unsafe { std::slice::from_raw_parts(item.tokens, item.n) };
        let vocab = self.ckpt.config.vocab;
        if let Some((i, t)) = ids.iter().enumerate().find(|(_, t)| **t < 0 || **t as usize >= vocab) {
            crate::bail!(OutOfRange, "token {i} is id {t}, outside the vocabulary (0..{vocab})");
        }
        // SAFETY: i32 and u32 have one size and alignment, and every id was just found non-negative, so
        // each reads as the same number.
        Ok(unsafe { std::slice::from_raw_parts(ids.as_ptr().cast::<u32>(), ids.len()) })
    }

    /// Stream `stream`'s speculation from its next step on (INVALID_ARGUMENT for settings out of range,
    /// UNSUPPORTED for a drafter model where `options.draft_model` loaded none); its counts start again.
    pub fn set_speculation(&mut self, stream: u32, s: &engine_speculation) -> Result<()> {
        crate::speculative::check(s)?;
        self.backend.set_speculation(stream, *s)
    }

    /// The drafter model's checkpoint, when `options.draft_model` loaded one.
    pub fn drafter(&self) -> Option<&Checkpoint> {
        self.drafter_ckpt.as_deref()
    }

    pub fn speculation(&self, stream: u32) -> Result<engine_speculation> {
        self.backend.speculation(stream)
    }

    /// (tokens proposed, tokens accepted) on stream `stream` since its speculation was last set.
    pub fn speculation_stats(&self, stream: u32) -> Result<(u64, u64)> {
        self.backend.speculation_stats(stream)
    }

    /// The ids stream `stream`'s constraint allows next, as words of `vocab` bits; None without one.
    pub fn allowed_tokens(&mut self, stream: u32, vocab: usize) -> Result<Option<Vec<u32>>> {
        self.backend.allowed_tokens(stream, vocab)
    }

    /// (tokens the prefix cache gave, tokens computed) of those stream `stream` was given since its last reset.
    pub fn prefix_stats(&self, stream: u32) -> Result<(u64, u64)> {
        self.backend.prefix_stats(stream)
    }

    /// The logits after the last position of stream `stream`, for the streams the last batch stepped.
    pub fn logits(&self, stream: u32) -> Result<Vec<f32>> {
        self.backend.logits(stream)
    }

    /// Empties stream `stream` and gives its KV pages back to the pool; its sampler settings stay.
    pub fn reset(&mut self, stream: u32) -> Result<()> {
        self.backend.reset(stream)
    }

    /// Keeps the first `len` positions of stream `stream`, giving back the pages past them.
    pub fn truncate(&mut self, stream: u32, len: usize) -> Result<()> {
        self.backend.truncate(stream, len)
    }

    /// Empties stream `dst`, then gives it the first `len` positions of stream `src`, sharing its KV
    /// pages (copied on the first write into one). A refusal changes nothing.
    pub fn fork(&mut self, src: u32, dst: u32, len: usize) -> Result<()> {
        self.backend.fork(src, dst, len)
    }

    /// Appends `tokens` to stream `stream` as a step would, computing the logits at every position, and
    /// writes `out[i]` = log p(tokens[i] | everything before it) (`out[0]` NaN when the stream was empty).
    pub fn score(&mut self, stream: u32, tokens: &[i32], out: &mut [f32]) -> Result<()> {
        let vocab = self.ckpt.config.vocab;
        if let Some((i, t)) = tokens.iter().enumerate().find(|(_, t)| **t < 0 || **t as usize >= vocab) {
            crate::bail!(OutOfRange, "engine_score: token {i} is id {t}, outside the vocabulary (0..{vocab})");
        }
        let ids: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
        self.backend.score(stream, &ids, out)
    }

    /// The KV pool's positions by state.
    pub fn kv_usage(&self) -> crate::abi::engine_kv_usage {
        self.backend.kv_usage()
    }

    /// The KV pool pages stream `stream` holds, in position order (for tests).
    #[doc(hidden)]
    pub fn stream_pages(&self, stream: u32) -> Result<Vec<u32>> {
        self.backend.stream_pages(stream)
    }

    /// Checks the KV pool's page counts against every stream's pages (for tests).
    #[doc(hidden)]
    pub fn audit_pages(&self) -> Result<()> {
        self.backend.audit()
    }

    /// Tokens stream `stream` holds now.
    pub fn stream_len(&self, stream: u32) -> Result<usize> {
        self.backend.stream_len(stream)
    }

    /// Stream `stream`'s sampler settings from its next step on.
    pub fn set_sampling(&mut self, stream: u32, s: &Sampling) -> Result<()> {
        s.check("sampling.")?;
        self.backend.set_sampling(stream, *s)
    }

    pub fn sampling(&self, stream: u32) -> Result<Sampling> {
        self.backend.sampling(stream)
    }

    /// Holds stream `stream`'s output to `c` from its next step on (None removes its constraint).
    pub fn set_constraint(&mut self, stream: u32, c: Option<Constraint>) -> Result<()> {
        self.backend.set_constraint(stream, c)
    }

    /// (positions the KV pool holds, positions free).
    pub fn kv_stats(&self) -> (u64, u64) {
        self.backend.kv_stats()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.ckpt.config
    }

    pub fn checkpoint(&self) -> &Checkpoint {
        &self.ckpt
    }

    pub fn rows(&self) -> &Rows {
        &self.rows
    }

    /// The plan the engine started with (its placement is where the rows went); None on the CPU backend.
    pub fn plan(&self) -> Option<&engine_plan> {
        self.plan.as_ref()
    }

    /// The figures the plan was made from; None on the CPU backend.
    pub fn fit_inputs(&self) -> Option<&engine_fit_inputs> {
        self.inputs.as_ref()
    }

    pub fn options(&self) -> &engine_options {
        &self.options
    }

    /// The settings the engine resolved once at its creation and its backend runs with.
    pub fn tuning(&self) -> &Tuning {
        &self.tuning
    }

    pub fn backend(&self) -> BackendKind {
        self.kind
    }

    /// The K and V cache types in use.
    pub fn kv_types(&self) -> KvTypes {
        self.kv
    }

    pub fn log(&self, line: &str) {
        self.logger.line(line)
    }

    /// Gathers the rows of `n` ids into `out` as `out_dtype` (F32 or BF16). On CUDA, `ids` and `out`
    /// are device pointers and the gather runs on `stream`, which this call then synchronizes to read the
    /// out-of-range flag; on the CPU backend they are host pointers and `stream` is ignored. Any id
    /// outside the vocabulary: OUT_OF_RANGE, that id's row never read.
    ///
    /// # Safety
    /// `ids` must hold `n` ints and `out` room for `n` rows of `cols` values in `out_dtype`, where the
    /// backend reads and writes them.
    pub unsafe fn embed(
        &self,
        ids: *const i32,
        n: usize,
        out: *mut c_void,
        out_dtype: DType,
        stream: rt::cudaStream_t,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if ids.is_null() || out.is_null() {
            crate::bail!(InvalidArgument, "engine_embed: ids or out is NULL with {n} ids");
        }
        if !matches!(out_dtype, DType::F32 | DType::Bf16) {
            crate::bail!(
                InvalidArgument,
                "engine_embed: output in {}; only F32 and BF16 are written",
                out_dtype.name()
            );
        }
        let vocab = self.rows.vocab();
        match (self.kind, &self.bad_ids) {
            (BackendKind::Cuda, Some(flag)) => {
                let flag = flag.lock().unwrap_or_else(|p| p.into_inner());
                // SAFETY: plain runtime call on a device index; an invalid one returns an error code.
                cuda::check(unsafe { rt::cudaSetDevice(self.options.device) }, "cudaSetDevice")?;
                let host_flag = flag.host_ptr() as *mut i32;
                // SAFETY: the previous call synchronized before releasing the lock, so no kernel writes this now.
                unsafe { host_flag.write_volatile(0) };
                // SAFETY: the caller's pointers, as this function's contract states; the flag is mapped and live.
                unsafe { self.rows.gather_device(ids, n, out, out_dtype, flag.device_ptr() as *mut i32, stream) }?;
                // SAFETY: the caller's stream, on which the gather above was queued.
                cuda::check(unsafe { rt::cudaStreamSynchronize(stream) }, "cudaStreamSynchronize")?;
                // SAFETY: the stream is synchronized, so the kernel's write to the mapped flag is visible and done.
                if unsafe { host_flag.read_volatile() } != 0 {
                    crate::bail!(
                        OutOfRange,
                        "engine_embed: a token id outside the vocabulary (0..{vocab}); its row was not read"
                    );
                }
                Ok(())
            }
            _ => {
                let size = if out_dtype == DType::F32 { 4 } else { 2 };
                // SAFETY: the contract: `ids` holds `n` ints on the host here.
                let ids = unsafe { std::slice::from_raw_parts(ids, n) };
                let len = n
                    .checked_mul(self.rows.cols() * size)
                    .ok_or_else(|| crate::err!(InvalidArgument, "engine_embed: {n} rows overflow"))?;
                // SAFETY: the contract: `out` has room for `n` rows of `cols` values in `out_dtype` on the host here.
                let out = unsafe { std::slice::from_raw_parts_mut(out as *mut u8, len) };
                self.rows.gather_host(ids, out, out_dtype)
            }
        }
    }
}
