//! The CUDA decode backend: a dense decoder (Llama, Qwen2, Qwen3) run on the kernels in kernels/*.cu.
//!
//! Weights go to the device as stored (BF16/F16/F32/Q8_0 matrices, no conversion), except the small
//! 1-D tensors (norms, biases), which are decoded to f32 once. Everything lives in one weight
//! allocation and one scratch allocation whose sizes `weight_bytes` and `scratch_bytes` predict
//! exactly; each stream owns one allocation for its bf16 KV cache. All work of a step is queued on one
//! CUDA stream; the only host wait is for the 4 bytes of the sampled token. Single-token steps replay a
//! CUDA graph captured for that stream (HOSTEMBED_CUDA_GRAPHS=0 turns that off). Prompt chunks of
//! `TENSOR_CORE_MIN_TOKENS` or more run their matrix products on tensor cores (cuBLASLt when it can
//! be loaded, else the library's own kernel) and their attention as flash attention.

mod blas;
mod forward;
mod graph;
mod launch;
mod scratch;
mod weights;

use std::os::raw::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

pub use self::blas::CUBLASLT_ENV;
use self::forward::Head;
pub use self::forward::TENSOR_CORE_MIN_TOKENS;
use self::graph::StepGraph;
use self::scratch::ScratchLayout;
use self::weights::{DeviceWeight, GpuLayer, plan, prompt_format, upload};
use crate::backend::{Backend, KvStream, StepItem};
use crate::cuda::{self, DeviceBuffer, StagedUploader, Stream};
use crate::cudart as rt;
use crate::model::{ModelConfig, TensorSource, rope_inv_freq};
use crate::sampler::{self, Sampling};
use crate::status::Result;
use crate::tensor::DType;
use crate::{bail, err};

/// Where the embedding rows live for the device: on the card or in mapped host memory, read through
/// `ptr` by the gather (and by the output head when the model is tied).
#[derive(Clone, Copy, Debug)]
pub struct RowsOnDevice {
    pub ptr: *const c_void,
    pub dtype: DType,
    pub vocab: usize,
    pub cols: usize,
}

// SAFETY: a device address is a plain number to the host; the rows' owner keeps them alive.
unsafe impl Send for RowsOnDevice {}
// SAFETY: as for Send: nothing here is read through the pointer on the host.
unsafe impl Sync for RowsOnDevice {}

/// Every device region starts on this boundary (cudaMalloc's own alignment).
const ALIGN: usize = 256;
/// The largest prompt chunk one pass takes (the attention grid's third dimension bounds it).
pub const MAX_BATCH_LIMIT: usize = 4096;

fn align_up(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

/// Regions laid out one after the other, each aligned; `append` continues the last region instead.
#[derive(Default)]
struct Layout {
    /// End of the last region, unaligned.
    end: usize,
    total: usize,
}

impl Layout {
    fn push(&mut self, bytes: usize) -> usize {
        let at = self.total;
        self.end = at + bytes;
        self.total = align_up(self.end);
        at
    }

    /// Places `bytes` right after the last region, with no padding between.
    fn append(&mut self, bytes: usize) -> usize {
        let at = self.end;
        self.end = at + bytes;
        self.total = align_up(self.end);
        at
    }
}

/// One stream's bf16 KV cache ([layer][K, V][kv_head][window][head_dim]) and its captured step.
pub struct GpuCache {
    kv: DeviceBuffer,
    model_id: u64,
    graph: Option<StepGraph>,
}

// SAFETY: the cache owns its allocation and graph; CUDA handles may be used from any thread.
unsafe impl Send for GpuCache {}

pub type GpuStream = KvStream<GpuCache>;

impl GpuStream {
    /// Bytes allocated for this stream: what `GpuModel::stream_bytes` predicts.
    pub fn allocated_bytes(&self) -> u64 {
        self.cache.kv.bytes() as u64
    }
}

static NEXT_MODEL_ID: AtomicU64 = AtomicU64::new(1);

/// The model on the device: all weights but the embedding rows, and the scratch one step needs.
pub struct GpuModel {
    cfg: ModelConfig,
    max_batch: usize,
    id: u64,
    layers: Vec<GpuLayer>,
    final_norm: *const f32,
    head: DeviceWeight,
    rows: RowsOnDevice,
    s: ScratchLayout,
    graphs: bool,
    has_logits: bool,
    /// The format of the prompt path's activations and product operands.
    half: DType,
    /// Whether prompt chunks may take the tensor-core path (every product width a multiple of 8).
    tensor_cores: bool,
    /// Whether the flash kernel takes this head size.
    flash: bool,
    blas: Option<blas::Blas>,
    /// Which products the prompt path runs, for the engine's log line.
    route: String,
    // Declared last: dropped after everything that points into them.
    stream: Stream,
    scratch: DeviceBuffer,
    weights: DeviceBuffer,
}

// SAFETY: it owns its allocations and stream; its pointers are device addresses, never read on the host.
unsafe impl Send for GpuModel {}

fn u32_of(v: usize, what: &str) -> Result<c_uint> {
    c_uint::try_from(v).map_err(|_| err!(Unsupported, "{what} of {v} is more than the kernels index"))
}

impl GpuModel {
    /// Device bytes `load` allocates for the weights (the embedding rows excluded, an untied head
    /// included); 0 when `src` does not hold a model `load` accepts.
    pub fn weight_bytes(src: &dyn TensorSource) -> u64 {
        plan(src).map_or(0, |p| p.total as u64)
    }

    /// Device bytes `load` allocates for activations and scratch with prompt chunks of `max_batch`;
    /// 0 when `src` does not hold a model `load` accepts.
    pub fn scratch_bytes(src: &dyn TensorSource, max_batch: usize) -> u64 {
        plan(src).map_or(0, |p| {
            let (_, slab) = prompt_format(&p.product_matrices());
            ScratchLayout::new(src.config(), max_batch, slab).total as u64
        })
    }

    /// Device bytes `new_stream(window)` allocates: the KV cache, nothing else.
    pub fn stream_bytes(cfg: &ModelConfig, window: usize) -> u64 {
        cfg.kv_bytes_per_token() * window as u64
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// What runs a prompt chunk's products and attention, in one line for the log.
    pub fn prompt_route(&self) -> &str {
        &self.route
    }

    /// Bytes actually allocated for (weights, scratch): what `weight_bytes` and `scratch_bytes` predict.
    pub fn allocated_bytes(&self) -> (u64, u64) {
        (self.weights.bytes() as u64, self.scratch.bytes() as u64)
    }

    /// Uploads the weights and allocates scratch on the current device.
    pub fn load(src: &dyn TensorSource, rows: RowsOnDevice, max_batch: usize) -> Result<GpuModel> {
        let cfg = src.config().clone();
        Self::check_config(&cfg)?;
        if max_batch == 0 || max_batch > MAX_BATCH_LIMIT {
            bail!(InvalidArgument, "max_batch {max_batch} is outside 1..={MAX_BATCH_LIMIT}");
        }
        if rows.ptr.is_null() {
            bail!(InvalidArgument, "the embedding rows' device pointer is NULL");
        }
        if rows.vocab != cfg.vocab || rows.cols != cfg.hidden {
            bail!(
                BadModel,
                "embedding rows are {} x {}, the model needs {} x {}",
                rows.vocab,
                rows.cols,
                cfg.vocab,
                cfg.hidden
            );
        }
        if rows.dtype.row_bytes(rows.cols).is_none() {
            bail!(BadModel, "embedding rows of {} columns do not fit the {} format", rows.cols, rows.dtype.name());
        }
        let plan = plan(src)?;
        let (half, slab) = prompt_format(&plan.product_matrices());
        let weights = DeviceBuffer::new(plan.total)?;
        let mut uploader = StagedUploader::new()?;
        let mut up = |p| upload(&weights, &mut uploader, p);
        let layers =
            plan.layers.into_iter().map(|l| l.try_map(&mut up).map(GpuLayer::new)).collect::<Result<Vec<_>>>()?;
        let final_norm = up(plan.final_norm)?.f32_ptr();
        let head = match plan.lm_head {
            Some(p) => up(p)?,
            None => DeviceWeight { ptr: rows.ptr, dtype: rows.dtype, rows: rows.vocab, cols: rows.cols },
        };

        let s = ScratchLayout::new(&cfg, max_batch, slab);
        let scratch = DeviceBuffer::new(s.total)?;
        scratch.upload(&rope_inv_freq(&cfg), s.inv_freq)?;
        let stream = Stream::new()?;
        let graphs = graph::graphs_enabled();
        let tensor_cores = [cfg.hidden, cfg.q_dim(), cfg.intermediate].iter().all(|d| d % 8 == 0);
        let flash = launch::flash_supports(cfg.head_dim);
        let (blas, route) = match blas::Blas::new() {
            Ok(b) => {
                let route = format!("prompt products on cuBLASLt ({})", b.name());
                (Some(b), route)
            }
            Err(why) => (None, format!("prompt products on hostembed's tensor-core kernel (no cuBLASLt: {why})")),
        };
        let route = if flash {
            format!("{route}, flash attention")
        } else {
            format!("{route}, split attention (no flash kernel for head_dim {})", cfg.head_dim)
        };
        Ok(GpuModel {
            cfg,
            max_batch,
            id: NEXT_MODEL_ID.fetch_add(1, Ordering::Relaxed),
            layers,
            final_norm,
            head,
            rows,
            s,
            graphs,
            has_logits: false,
            half,
            tensor_cores,
            flash,
            blas,
            route,
            stream,
            scratch,
            weights,
        })
    }

    /// A stream with an empty KV cache for `window` tokens.
    pub fn new_stream(&self, window: usize) -> Result<GpuStream> {
        if window == 0 || window > i32::MAX as usize {
            bail!(InvalidArgument, "a window of {window} tokens is outside 1..={}", i32::MAX);
        }
        let bytes = usize::try_from(Self::stream_bytes(&self.cfg, window))
            .map_err(|_| err!(NoRoom, "a window of {window} tokens does not fit in memory"))?;
        let kv = DeviceBuffer::new(bytes)?;
        Ok(KvStream::new(GpuCache { kv, model_id: self.id, graph: None }, window))
    }

    /// Appends `tokens` (in chunks of max_batch) and returns the next token chosen by `sampling` for the
    /// position after them, with no repetition penalty.
    pub fn step(
        &mut self,
        stream: &mut GpuStream,
        tokens: &[u32],
        sampling: &Sampling,
        stream_index: u32,
    ) -> Result<u32> {
        self.step_penalized(stream, tokens, sampling, stream_index, &[])
    }

    /// `step` with the repetition penalty on the ids `penalty` (`sampler::penalty_ids`).
    pub fn step_penalized(
        &mut self,
        stream: &mut GpuStream,
        tokens: &[u32],
        sampling: &Sampling,
        stream_index: u32,
        penalty: &[u32],
    ) -> Result<u32> {
        self.check_tokens(stream, tokens)?;
        if penalty.len() > self.cfg.vocab {
            bail!(InvalidArgument, "{} penalized ids for a vocabulary of {}", penalty.len(), self.cfg.vocab);
        }
        let chunks = tokens.len().div_ceil(self.max_batch);
        for (i, chunk) in tokens.chunks(self.max_batch).enumerate() {
            self.run_chunk(stream, chunk, if i + 1 == chunks { Head::Last } else { Head::Skip })?;
        }
        self.has_logits = true;
        let position = stream.len as u64;
        if !penalty.is_empty() {
            let ids: Vec<i32> = penalty.iter().map(|&t| t as i32).collect();
            self.scratch.upload(&ids, self.s.penalty)?;
        }
        let (logits, scratch, token) = (self.buf(self.s.logits), self.buf(self.s.sample), self.buf(self.s.token));
        let s = self.stream.raw();
        launch::sample(
            logits as *mut f32,
            self.cfg.vocab,
            sampling,
            stream_index,
            position,
            self.buf(self.s.penalty) as *mut c_int,
            penalty.len(),
            scratch,
            token as *mut c_int,
            s,
        )?;
        let mut token = [0i32; 1];
        self.download(self.s.token, &mut token)?;
        if token[0] < 0 || token[0] as usize >= self.cfg.vocab {
            bail!(CudaError, "the device sampler returned token {} for a vocabulary of {}", token[0], self.cfg.vocab);
        }
        Ok(token[0] as u32)
    }

    /// Logits of the last position of the last step (or of `all_logits`).
    pub fn last_logits(&self) -> Result<Vec<f32>> {
        if !self.has_logits {
            bail!(InvalidArgument, "no step has produced logits yet");
        }
        let mut out = vec![0f32; self.cfg.vocab];
        self.download(self.s.logits, &mut out)?;
        Ok(out)
    }

    /// Appends `tokens` and returns the logits after each of them (teacher forcing), for parity tests.
    pub fn all_logits(&mut self, stream: &mut GpuStream, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        self.check_tokens(stream, tokens)?;
        let mut out = Vec::with_capacity(tokens.len());
        let (hidden, vocab) = (self.cfg.hidden, self.cfg.vocab);
        for chunk in tokens.chunks(self.max_batch) {
            self.run_chunk(stream, chunk, Head::All)?;
            for t in 0..chunk.len() {
                let x = (self.buf(self.s.xn) as *const f32).wrapping_add(t * hidden);
                self.head_matvec(x)?;
                let mut logits = vec![0f32; vocab];
                self.download(self.s.logits, &mut logits)?;
                out.push(logits);
            }
        }
        self.has_logits = true;
        Ok(out)
    }

    /// Everything that could refuse the call, checked before anything is written.
    fn check_tokens(&self, stream: &GpuStream, tokens: &[u32]) -> Result<()> {
        if stream.cache.model_id != self.id {
            bail!(InvalidArgument, "stream was not made by this model");
        }
        self.cfg.check_append(stream.len, stream.window, tokens)
    }

    /// The config's own check, then what the kernels take beyond it.
    fn check_config(cfg: &ModelConfig) -> Result<()> {
        cfg.check("config")?;
        if cfg.head_dim == 0 || !cfg.head_dim.is_multiple_of(8) || cfg.head_dim > 256 {
            bail!(Unsupported, "head_dim {}: the CUDA attention takes multiples of 8 up to 256", cfg.head_dim);
        }
        if cfg.vocab > i32::MAX as usize {
            bail!(Unsupported, "a vocabulary of {} ids does not fit the kernels' int token ids", cfg.vocab);
        }
        for (what, v) in [
            ("hidden", cfg.hidden),
            ("intermediate", cfg.intermediate),
            ("q/k/v width", cfg.q_dim() + 2 * cfg.kv_dim()),
        ] {
            u32_of(v, what)?;
        }
        Ok(())
    }
}

/// The CUDA backend: a `GpuModel` and the device it was loaded on, made current before each call, and
/// the logits of each item of the last batch.
pub struct CudaBackend {
    model: GpuModel,
    device: i32,
    logits: Vec<Option<Vec<f32>>>,
}

impl CudaBackend {
    /// `GpuModel::load` on `device`, which the caller has made current, with a KV pool of `pool_pages`
    /// pages of `PAGE_TOKENS` positions.
    pub fn load(
        src: &dyn TensorSource,
        rows: RowsOnDevice,
        max_batch: usize,
        device: i32,
        pool_pages: usize,
    ) -> Result<CudaBackend> {
        // Each stream still holds a whole window of its own; the pool's pages are counted, not yet used.
        let _ = pool_pages;
        Ok(CudaBackend { model: GpuModel::load(src, rows, max_batch)?, device, logits: Vec::new() })
    }

    /// What runs a prompt chunk's products and attention, in one line for the log.
    pub fn prompt_route(&self) -> &str {
        self.model.prompt_route()
    }

    /// Makes the model's device current for this thread (the caller may have moved to another).
    fn enter(&self) -> Result<()> {
        // SAFETY: plain runtime call on a device index; an invalid one returns an error code.
        cuda::check(unsafe { rt::cudaSetDevice(self.device) }, "cudaSetDevice")
    }
}

impl Backend for CudaBackend {
    type Cache = GpuCache;

    const PAGE_TOKENS: usize = 64;

    fn new_stream(&self, window: usize) -> Result<GpuStream> {
        self.enter()?;
        self.model.new_stream(window)
    }

    fn step_batch(&mut self, items: &mut [StepItem<'_, GpuCache>]) -> Result<()> {
        self.enter()?;
        self.logits.clear();
        // One item at a time, each keeping a copy of its logits.
        for item in items.iter_mut() {
            let penalty = sampler::penalty_ids(&item.stream.tokens, item.tokens, &item.sampling);
            item.next = self.model.step_penalized(item.stream, item.tokens, &item.sampling, item.index, &penalty);
            let logits = match &item.next {
                Ok(_) => Some(self.model.last_logits()?),
                Err(e) if e.status == crate::Status::CudaError => return Err(e.clone()),
                Err(_) => None,
            };
            self.logits.push(logits);
        }
        Ok(())
    }

    fn logits(&self, i: usize) -> Result<Vec<f32>> {
        self.logits
            .get(i)
            .and_then(Option::clone)
            .ok_or_else(|| err!(InvalidArgument, "item {i} of the last batch has no logits"))
    }

    fn truncate(&mut self, stream: &mut GpuStream, len: usize) {
        stream.len = len;
    }
}
