//! `Engine::init_fit`: opens the checkpoint (and a drafter's), plans, logs the start-up line, places
//! the rows and loads the backend and tokenizer; a failure at any step drops what the steps before it
//! took. Also the owners the load hands the engine (`HeldCheckpoint`, `Logger`).

use super::options::{
    check_options, cpu_kv_types, gpu_kv_types, max_batch_of, resolve_prefix_cache, sampling_of, tuning_for, window_of,
};
use super::plan::{KvPool, device_label, device_pool, drafter_window, fit_inputs_with_drafter, host_rows_reason};
use super::split::load_split;
use super::{BackendKind, CPU_STREAMS, Engine, InitStep, engine_backend, engine_log_fn, engine_options};
use crate::backend::{Backend, Decoder, Streams};
use crate::checkpoint::Checkpoint;
use crate::cpu::{CpuBackend, CpuStream};
use crate::cuda::{self, PinnedBuffer};
use crate::fit::{self, engine_placement};
use crate::gpu::{CudaBackend, RowsOnDevice, Sizing};
use crate::kv::KvTypes;
use crate::placement::{Rows, RowsSource};
use crate::sampler::Sampling;
use crate::status::{Result, Status};
use crate::tokenizer::Tokenizer;
use crate::tuning::Tuning;
use std::ffi::CString;
use std::os::raw::c_void;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

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

/// Placed rows as a GPU model reads them.
pub(super) fn device_view(rows: &Rows) -> RowsOnDevice {
    let r = rows.describe();
    RowsOnDevice { ptr: r.data, dtype: r.dtype, vocab: r.rows as usize, cols: r.cols as usize }
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
            let local = pool.local.map(|(pages, _)| pages);
            let backend = CpuBackend::with_pools(ckpt.shared(), pool.pages, local, kv, tuning)?;
            let target = Streams::new(backend, window, streams, pool.pages, sampling)?.with_prefix_cache(prefix_cache);
            match drafter {
                None => Box::new(target),
                Some(d) => {
                    let local = d.pool.local.map(|(pages, _)| pages);
                    let backend = CpuBackend::with_pools(d.ckpt.shared(), d.pool.pages, local, kv, tuning)?;
                    let dwindow = drafter_window(&d.ckpt.config, window);
                    let drafts = Streams::new(backend, dwindow, streams, d.pool.pages, Sampling::GREEDY)?
                        .with_prefix_cache(prefix_cache);
                    Box::new(target.with_drafter(drafts)?)
                }
            }
        }
        BackendKind::Cuda => {
            let rows = device_view(rows);
            let (batch, local) = (max_batch_of(opts), pool.local.map(|(pages, _)| pages));
            let sizing = Sizing { max_batch: batch, pool_pages: pool.pages, local_pages: local, kv, window };
            let model = CudaBackend::load_with_pools(&**ckpt, rows, opts.device, sizing, tuning)?;
            logger.line(model.prompt_route());
            if tuning.batch_tensor_cores {
                logger.line("batches of 16 or more single tokens share tensor-core products: a stream's logits depend on its batch");
            }
            let target = Streams::new(model, window, streams, pool.pages, sampling)?.with_prefix_cache(prefix_cache);
            match drafter {
                None => Box::new(target),
                Some(d) => {
                    let rows = device_view(d.rows);
                    let dwindow = drafter_window(&d.ckpt.config, window);
                    let (device, pages) = (opts.device, d.pool.pages);
                    let (batch, local) = (max_batch_of(opts), d.pool.local.map(|(pages, _)| pages));
                    let sizing =
                        Sizing { max_batch: batch, pool_pages: pages, local_pages: local, kv, window: dwindow };
                    let model = CudaBackend::load_with_pools(&**d.ckpt, rows, device, sizing, tuning)?;
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
            // Tensor parallelism runs on CUDA devices only.
            engine_backend::Auto if opts.devices > 1 => Some(cuda::device_info(opts.device)?),
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
            // With the sliding-window layers in a pool of their own, the main pool's pages hold the other
            // layers, in the room the local pool leaves.
            let c = &ckpt.config;
            let per_layer = fit::cpu_kv_bytes(1, 1, c.kv_heads as u64, c.head_dim as u64, kv).unwrap_or(u64::MAX);
            let (apart, local_bytes) = cpu.inputs.local.map_or((0, 0), |l| {
                (l.layers, (want as u64).saturating_mul(l.positions).saturating_mul(l.layers).saturating_mul(per_layer))
            });
            let main_per_token = per_layer.saturating_mul((c.layers as u64 - apart).max(1));
            let main_room = room.saturating_sub(local_bytes);
            let pool =
                KvPool::sized(CpuBackend::PAGE_TOKENS, window as usize, cpu.streams as u64, main_room, main_per_token)
                    .with_local(c, window as usize, want as usize, crate::cpu::LOCAL_PIECE_TOKENS);
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
                    let dpool = KvPool::sized(CpuBackend::PAGE_TOKENS, dwindow, streams as u64, 0, per_token)
                        .with_local(&d.config, dwindow, streams as usize, crate::cpu::LOCAL_PIECE_TOKENS);
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
                _rank_rows: Vec::new(),
                bad_ids: None,
                plan: None,
                device_plans: Vec::new(),
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

        if opts.devices > 1 {
            let split = load_split(&ckpt, opts, &tuning, &logger, &injected)?;
            let bad_ids = Mutex::new(PinnedBuffer::new_mapped(std::mem::size_of::<i32>())?);
            let engine = Engine {
                backend: split.backend,
                tokenizer: load_tokenizer(&ckpt, &logger)?,
                rows: split.rows,
                _drafter_rows: None,
                _rank_rows: split.rank_rows,
                bad_ids: Some(bad_ids),
                plan: Some(split.plan),
                device_plans: split.device_plans,
                inputs: Some(split.inputs),
                options: *opts,
                tuning,
                logger,
                kind: BackendKind::Cuda,
                kv: gpu_kv_types(opts),
                ckpt,
                drafter_ckpt,
            };
            injected(InitStep::Loaded)?;
            return Ok(engine);
        }
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
        let beside = drafter_pool.as_ref().map_or(0, |p| p.bytes);
        let (streams, pool) = device_pool(&plan, &inputs, beside, &ckpt.config, kv, opts, &tuning);
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
            _rank_rows: Vec::new(),
            bad_ids: Some(bad_ids),
            plan: Some(plan),
            device_plans: Vec::new(),
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
}
