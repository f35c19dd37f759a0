//! The CUDA decode backend: a dense decoder (Llama, Qwen2, Qwen3) run on the kernels in kernels/*.cu.
//!
//! Weights go to the device as stored (BF16/F16/F32/Q8_0 matrices, no conversion), except the small
//! 1-D tensors (norms, biases), which are decoded to f32 once. Everything lives in one weight
//! allocation and one scratch allocation whose sizes `weight_bytes` and `scratch_bytes` predict
//! exactly; each stream owns one allocation for its bf16 KV cache. All work of a step is queued on one
//! CUDA stream; the only host wait is for the 4 bytes of the sampled token. Single-token steps replay a
//! CUDA graph captured for that stream (HOSTEMBED_CUDA_GRAPHS=0 turns that off).

use std::os::raw::{c_int, c_uint, c_void};
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::cuda::{self, DeviceBuffer, StagedUploader, Stream};
use crate::cudart as rt;
use crate::kernels as kn;
use crate::model::{LayerWeights, ModelConfig, ModelWeights, TensorRef, TensorSource, rope_inv_freq};
use crate::sampler::Sampling;
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

unsafe impl Send for RowsOnDevice {}
unsafe impl Sync for RowsOnDevice {}

/// Every device region starts on this boundary (cudaMalloc's own alignment).
const ALIGN: usize = 256;
/// Blocks the attention kernel aims for per launch: two per SM of a 132-SM card.
const ATTENTION_TARGET_BLOCKS: usize = 264;
const ATTENTION_MAX_SPLITS: usize = 64;
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

/// Query heads one attention block takes (a power of two), as the attention launcher picks it.
fn heads_per_block(cfg: &ModelConfig) -> usize {
    let group = cfg.heads / cfg.kv_heads.max(1);
    let cap = if cfg.head_dim > 128 { 4 } else { 8 };
    let mut hb = 1;
    while hb < group && hb < cap {
        hb *= 2;
    }
    hb
}

/// Context splits for `n` query tokens: enough blocks to fill the card, at most 64.
fn attention_splits(cfg: &ModelConfig, n: usize) -> usize {
    let group = cfg.heads / cfg.kv_heads.max(1);
    let blocks = cfg.kv_heads * group.div_ceil(heads_per_block(cfg)) * n.max(1);
    ATTENTION_TARGET_BLOCKS.div_ceil(blocks).clamp(1, ATTENTION_MAX_SPLITS)
}

/// The scratch allocation: byte offsets of each buffer.
struct ScratchLayout {
    x: usize,
    xn: usize,
    qkv: usize,
    attn: usize,
    gate: usize,
    up: usize,
    logits: usize,
    partial: usize,
    inv_freq: usize,
    ids: usize,
    pos: usize,
    token: usize,
    sample: usize,
    total: usize,
}

impl ScratchLayout {
    fn new(cfg: &ModelConfig, max_batch: usize) -> ScratchLayout {
        let b = max_batch.max(1);
        let f = 4;
        let partial_floats =
            (1..=b).map(|n| n * attention_splits(cfg, n) * cfg.heads * (cfg.head_dim + 2)).max().unwrap_or(0);
        let mut l = Layout::default();
        let x = l.push(b * cfg.hidden * f);
        let xn = l.push(b * cfg.hidden * f);
        let qkv = l.push(b * (cfg.q_dim() + 2 * cfg.kv_dim()) * f);
        let attn = l.push(b * cfg.q_dim() * f);
        let gate = l.push(b * cfg.intermediate * f);
        let up = l.push(b * cfg.intermediate * f);
        let logits = l.push(cfg.vocab * f);
        let partial = l.push(partial_floats * f);
        let inv_freq = l.push(cfg.head_dim / 2 * f);
        let ids = l.push(b * 4);
        let pos = l.push(b * 4);
        let token = l.push(4);
        let sample = l.push(cfg.vocab * 8);
        ScratchLayout { x, xn, qkv, attn, gate, up, logits, partial, inv_freq, ids, pos, token, sample, total: l.total }
    }
}

/// A weight on the device: a matrix in its stored format, or a vector decoded to f32 (one row).
#[derive(Clone, Copy, Debug)]
struct DeviceWeight {
    ptr: *const c_void,
    dtype: DType,
    rows: usize,
    cols: usize,
}

impl DeviceWeight {
    fn f32_ptr(&self) -> *const f32 {
        self.ptr as *const f32
    }
}

/// q, k and v as one matrix when they share a format (one launch), else three.
enum Qkv {
    Fused(DeviceWeight),
    Split([DeviceWeight; 3]),
}

/// Whether q, k and v share a region and are read as one matrix.
fn qkv_fused(q: DType, k: DType, v: DType) -> bool {
    q == k && k == v
}

/// One layer on the device: its weights by role, and q/k/v as the projection reads them.
struct GpuLayer {
    w: LayerWeights<DeviceWeight>,
    qkv: Qkv,
}

impl GpuLayer {
    fn new(w: LayerWeights<DeviceWeight>) -> GpuLayer {
        let qkv = if qkv_fused(w.q.dtype, w.k.dtype, w.v.dtype) {
            Qkv::Fused(DeviceWeight { rows: w.q.rows + w.k.rows + w.v.rows, ..w.q })
        } else {
            Qkv::Split([w.q, w.k, w.v])
        };
        GpuLayer { w, qkv }
    }

    /// The q, k and v biases back to back (f32), or NULL.
    fn qkv_bias(&self) -> *const f32 {
        self.w.q_bias.map_or(ptr::null(), |b| b.f32_ptr())
    }
}

/// A weight and where it goes in the weight allocation: matrices are copied as stored, vectors
/// (norms, biases) decoded to f32.
struct Placed<'a> {
    tensor: TensorRef<'a>,
    offset: usize,
}

impl Placed<'_> {
    fn decoded(&self) -> bool {
        self.tensor.shape.len() == 1
    }
}

fn device_bytes(t: &TensorRef) -> usize {
    if t.shape.len() == 1 { t.cols() * 4 } else { t.bytes.len() }
}

impl Layout {
    /// Places `t` in a region of its own, or right after the previous weight.
    fn place<'a>(&mut self, t: TensorRef<'a>, after_previous: bool) -> Placed<'a> {
        let bytes = device_bytes(&t);
        let offset = if after_previous { self.append(bytes) } else { self.push(bytes) };
        Placed { tensor: t, offset }
    }
}

/// Where every weight the device holds goes (all but the embedding rows, which are placed apart).
struct WeightPlan<'a> {
    layers: Vec<LayerWeights<Placed<'a>>>,
    final_norm: Placed<'a>,
    lm_head: Option<Placed<'a>>,
    total: usize,
}

/// Reads and checks every weight of `src` (the weight table) and lays them out in one allocation.
fn plan(src: &dyn TensorSource) -> Result<WeightPlan<'_>> {
    let w = ModelWeights::read(src)?;
    let mut layout = Layout::default();
    let layers = w.layers.into_iter().map(|l| place_layer(l, &mut layout)).collect();
    let final_norm = layout.place(w.final_norm, false);
    let lm_head = w.lm_head.map(|t| layout.place(t, false));
    Ok(WeightPlan { layers, final_norm, lm_head, total: layout.total })
}

/// Each weight in its own region, except q, k, v of one format and the three biases, which the fused
/// projection reads back to back.
fn place_layer<'a>(l: LayerWeights<TensorRef<'a>>, layout: &mut Layout) -> LayerWeights<Placed<'a>> {
    let fused = qkv_fused(l.q.dtype, l.k.dtype, l.v.dtype);
    let attn_norm = layout.place(l.attn_norm, false);
    let q = layout.place(l.q, false);
    let k = layout.place(l.k, fused);
    let v = layout.place(l.v, fused);
    LayerWeights {
        attn_norm,
        q,
        k,
        v,
        q_bias: l.q_bias.map(|t| layout.place(t, false)),
        k_bias: l.k_bias.map(|t| layout.place(t, true)),
        v_bias: l.v_bias.map(|t| layout.place(t, true)),
        q_norm: l.q_norm.map(|t| layout.place(t, false)),
        k_norm: l.k_norm.map(|t| layout.place(t, false)),
        o: layout.place(l.o, false),
        ffn_norm: layout.place(l.ffn_norm, false),
        gate: layout.place(l.gate, false),
        up: layout.place(l.up, false),
        down: layout.place(l.down, false),
    }
}

/// Copies one placed weight into `weights` and says where it is.
fn upload(weights: &DeviceBuffer, uploader: &mut StagedUploader, p: Placed) -> Result<DeviceWeight> {
    let t = p.tensor;
    let dtype = if p.decoded() {
        weights.upload(&t.to_f32(), p.offset)?;
        DType::F32
    } else {
        uploader.upload(weights, p.offset, t.bytes)?;
        t.dtype
    };
    // SAFETY: the plan put every offset inside the allocation, which is `total` bytes long.
    let ptr = unsafe { (weights.ptr() as *const u8).add(p.offset) } as *const c_void;
    Ok(DeviceWeight { ptr, dtype, rows: t.rows(), cols: t.cols() })
}

/// A captured single-token forward pass for one stream of one model.
struct StepGraph {
    graph: rt::cudaGraph_t,
    exec: rt::cudaGraphExec_t,
    model_id: u64,
}

impl Drop for StepGraph {
    fn drop(&mut self) {
        unsafe {
            if !self.exec.is_null() {
                rt::cudaGraphExecDestroy(self.exec);
            }
            if !self.graph.is_null() {
                rt::cudaGraphDestroy(self.graph);
            }
        }
    }
}

/// One stream: a bf16 KV cache for `window` tokens ([layer][K, V][kv_head][window][head_dim]).
pub struct GpuStream {
    kv: DeviceBuffer,
    window: usize,
    len: usize,
    model_id: u64,
    graph: Option<StepGraph>,
}

unsafe impl Send for GpuStream {}

impl GpuStream {
    /// Tokens in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn window(&self) -> usize {
        self.window
    }

    /// Bytes allocated for this stream: what `GpuModel::stream_bytes` predicts.
    pub fn allocated_bytes(&self) -> u64 {
        self.kv.bytes() as u64
    }

    /// Forgets every token (the cache's memory and the captured graph are kept).
    pub fn reset(&mut self) {
        self.len = 0;
    }
}

/// Which logits a forward pass leaves.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Head {
    /// None: a prompt chunk before the last.
    Skip,
    /// The last token's, in the logits buffer.
    Last,
    /// Final-normed hidden states of every token in xn; the caller runs the head per token.
    All,
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
    // Declared last: dropped after everything that points into them.
    stream: Stream,
    scratch: DeviceBuffer,
    weights: DeviceBuffer,
}

unsafe impl Send for GpuModel {}

fn launch(code: rt::cudaError_t, what: &str) -> Result<()> {
    cuda::check(code, what)
}

fn u32_of(v: usize, what: &str) -> Result<c_uint> {
    c_uint::try_from(v).map_err(|_| err!(Unsupported, "{what} of {v} is more than the kernels index"))
}

impl GpuModel {
    /// Device bytes `load` allocates for the weights (the embedding rows excluded, an untied head
    /// included); 0 when `src` does not hold a model `load` accepts.
    pub fn weight_bytes(src: &dyn TensorSource) -> u64 {
        plan(src).map_or(0, |p| p.total as u64)
    }

    /// Device bytes `load` allocates for activations and scratch with prompt chunks of `max_batch`.
    pub fn scratch_bytes(cfg: &ModelConfig, max_batch: usize) -> u64 {
        ScratchLayout::new(cfg, max_batch).total as u64
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

        let s = ScratchLayout::new(&cfg, max_batch);
        let scratch = DeviceBuffer::new(s.total)?;
        scratch.upload(&rope_inv_freq(&cfg), s.inv_freq)?;
        let stream = Stream::new()?;
        let graphs = std::env::var("HOSTEMBED_CUDA_GRAPHS").map(|v| v != "0").unwrap_or(true);
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
        Ok(GpuStream { kv, window, len: 0, model_id: self.id, graph: None })
    }

    /// Appends `tokens` (in chunks of max_batch) and returns the next token chosen by `sampling` for the
    /// position after them.
    pub fn step(
        &mut self,
        stream: &mut GpuStream,
        tokens: &[u32],
        sampling: &Sampling,
        stream_index: u32,
    ) -> Result<u32> {
        self.check_tokens(stream, tokens)?;
        let chunks = tokens.len().div_ceil(self.max_batch);
        for (i, chunk) in tokens.chunks(self.max_batch).enumerate() {
            self.run_chunk(stream, chunk, if i + 1 == chunks { Head::Last } else { Head::Skip })?;
        }
        self.has_logits = true;
        let position = stream.len as u64;
        let s = self.stream.raw();
        launch(
            unsafe {
                kn::hostembed_sample(
                    self.buf(self.s.logits) as *const f32,
                    self.cfg.vocab as c_uint,
                    sampling.temperature,
                    sampling.top_k,
                    sampling.top_p,
                    sampling.seed,
                    stream_index,
                    position,
                    self.buf(self.s.sample),
                    self.buf(self.s.token) as *mut c_int,
                    s,
                )
            },
            "hostembed_sample",
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
                let x = unsafe { (self.buf(self.s.xn) as *const f32).add(t * hidden) };
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
        if stream.model_id != self.id {
            bail!(InvalidArgument, "stream was not made by this model");
        }
        self.cfg.check_append(stream.len, stream.window, tokens)
    }

    /// A pointer `offset` bytes into the scratch allocation.
    fn buf(&self, offset: usize) -> *mut c_void {
        unsafe { (self.scratch.ptr() as *mut u8).add(offset) as *mut c_void }
    }

    /// Copies scratch bytes at `offset` to the host after the stream's queued work.
    fn download<T: Copy>(&self, offset: usize, out: &mut [T]) -> Result<()> {
        let s = self.stream.raw();
        cuda::check(
            unsafe {
                rt::cudaMemcpyAsync(
                    out.as_mut_ptr() as *mut c_void,
                    self.buf(offset),
                    std::mem::size_of_val(out),
                    rt::cudaMemcpyDeviceToHost,
                    s,
                )
            },
            "cudaMemcpyAsync(device to host)",
        )?;
        self.stream.synchronize()
    }

    fn upload<T: Copy>(&self, offset: usize, data: &[T]) -> Result<()> {
        cuda::check(
            unsafe {
                rt::cudaMemcpyAsync(
                    self.buf(offset),
                    data.as_ptr() as *const c_void,
                    std::mem::size_of_val(data),
                    rt::cudaMemcpyHostToDevice,
                    self.stream.raw(),
                )
            },
            "cudaMemcpyAsync(host to device)",
        )
    }

    /// Runs one chunk of at most max_batch tokens at the stream's next positions.
    fn run_chunk(&mut self, stream: &mut GpuStream, chunk: &[u32], head: Head) -> Result<()> {
        let n = chunk.len();
        let ids: Vec<i32> = chunk.iter().map(|&t| t as i32).collect();
        let pos: Vec<i32> = (stream.len..stream.len + n).map(|p| p as i32).collect();
        self.upload(self.s.ids, &ids)?;
        self.upload(self.s.pos, &pos)?;
        if self.graphs && n == 1 && head == Head::Last {
            if stream.graph.as_ref().is_none_or(|g| g.model_id != self.id) {
                stream.graph = None;
                match self.capture(stream) {
                    Ok(g) => stream.graph = Some(g),
                    // A device or driver that cannot capture: run without graphs from now on.
                    Err(_) => self.graphs = false,
                }
            }
            if let Some(g) = &stream.graph {
                launch(unsafe { rt::cudaGraphLaunch(g.exec, self.stream.raw()) }, "cudaGraphLaunch")?;
                stream.len += n;
                return Ok(());
            }
        }
        self.enqueue_forward(stream, n, head)?;
        stream.len += n;
        Ok(())
    }

    /// Captures the single-token forward pass of `stream` into a graph.
    fn capture(&self, stream: &GpuStream) -> Result<StepGraph> {
        let s = self.stream.raw();
        cuda::check(
            unsafe { rt::cudaStreamBeginCapture(s, rt::cudaStreamCaptureModeThreadLocal) },
            "cudaStreamBeginCapture",
        )?;
        let queued = self.enqueue_forward(stream, 1, Head::Last);
        let mut graph: rt::cudaGraph_t = ptr::null_mut();
        let ended = cuda::check(unsafe { rt::cudaStreamEndCapture(s, &mut graph) }, "cudaStreamEndCapture");
        let mut g = StepGraph { graph, exec: ptr::null_mut(), model_id: self.id };
        if let Err(e) = queued.and(ended) {
            unsafe { rt::cudaGetLastError() };
            return Err(e);
        }
        let made = cuda::check(unsafe { rt::cudaGraphInstantiate(&mut g.exec, g.graph, 0) }, "cudaGraphInstantiate");
        if let Err(e) = made {
            unsafe { rt::cudaGetLastError() };
            g.exec = ptr::null_mut();
            return Err(e);
        }
        Ok(g)
    }

    /// The output head over one final-normed hidden state into the logits buffer.
    fn head_matvec(&self, x: *const f32) -> Result<()> {
        let h = &self.head;
        launch(
            unsafe {
                kn::hostembed_matvec(
                    h.ptr,
                    h.dtype as c_int,
                    h.rows as c_uint,
                    h.cols as c_uint,
                    x,
                    1,
                    ptr::null(),
                    ptr::null(),
                    self.buf(self.s.logits) as *mut f32,
                    h.rows as c_uint,
                    self.stream.raw(),
                )
            },
            "hostembed_matvec(lm_head)",
        )
    }

    /// Queues the forward pass of `n` tokens whose ids and positions are already in scratch.
    fn enqueue_forward(&self, stream: &GpuStream, n: usize, head: Head) -> Result<()> {
        let cfg = &self.cfg;
        let s = self.stream.raw();
        let (hidden, q_dim, kv_dim, inter, hd) =
            (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate, cfg.head_dim);
        let qkv_dim = q_dim + 2 * kv_dim;
        let nu = n as c_uint;
        let f = |off: usize| self.buf(off) as *mut f32;
        let (x, xn, qkv, attn, gate, up) =
            (f(self.s.x), f(self.s.xn), f(self.s.qkv), f(self.s.attn), f(self.s.gate), f(self.s.up));
        let ids = self.buf(self.s.ids) as *const c_int;
        let pos = self.buf(self.s.pos) as *const c_int;
        let layer_kv = cfg.kv_heads * stream.window * hd * 2;
        let kv_base = stream.kv.ptr() as *mut u8;
        let splits = attention_splits(cfg, n) as c_uint;
        let scale = 1.0 / (hd as f32).sqrt();
        let matvec =
            |m: &DeviceWeight, x: *const f32, bias: *const f32, residual: *const f32, y: *mut f32, ldy: usize| {
                launch(
                    unsafe {
                        kn::hostembed_matvec(
                            m.ptr,
                            m.dtype as c_int,
                            m.rows as c_uint,
                            m.cols as c_uint,
                            x,
                            nu,
                            bias,
                            residual,
                            y,
                            ldy as c_uint,
                            s,
                        )
                    },
                    "hostembed_matvec",
                )
            };
        let rmsnorm = |x: *const f32, w: *const f32, out: *mut f32, rows: c_uint| {
            launch(
                unsafe { kn::hostembed_rmsnorm(x, w, cfg.rms_eps, out, rows, hidden as c_uint, s) },
                "hostembed_rmsnorm",
            )
        };

        launch(
            unsafe {
                kn::hostembed_embed_gather(
                    self.rows.ptr,
                    self.rows.dtype as c_int,
                    cfg.vocab as c_uint,
                    hidden as c_uint,
                    ids,
                    nu,
                    x as *mut c_void,
                    DType::F32 as c_int,
                    ptr::null_mut(),
                    s,
                )
            },
            "hostembed_embed_gather",
        )?;
        for (l, layer) in self.layers.iter().enumerate() {
            let k_cache = unsafe { kv_base.add(2 * l * layer_kv) } as *mut c_void;
            let v_cache = unsafe { kv_base.add((2 * l + 1) * layer_kv) } as *mut c_void;

            rmsnorm(x, layer.w.attn_norm.f32_ptr(), xn, nu)?;
            let qkv_bias = layer.qkv_bias();
            match &layer.qkv {
                Qkv::Fused(m) => matvec(m, xn, qkv_bias, ptr::null(), qkv, qkv_dim)?,
                Qkv::Split([mq, mk, mv]) => {
                    let bias = |off: usize| if qkv_bias.is_null() { ptr::null() } else { unsafe { qkv_bias.add(off) } };
                    matvec(mq, xn, bias(0), ptr::null(), qkv, qkv_dim)?;
                    matvec(mk, xn, bias(q_dim), ptr::null(), unsafe { qkv.add(q_dim) }, qkv_dim)?;
                    matvec(mv, xn, bias(q_dim + kv_dim), ptr::null(), unsafe { qkv.add(q_dim + kv_dim) }, qkv_dim)?;
                }
            }
            launch(
                unsafe {
                    kn::hostembed_rope_kv(
                        qkv,
                        qkv_dim as c_uint,
                        nu,
                        pos,
                        cfg.heads as c_uint,
                        cfg.kv_heads as c_uint,
                        hd as c_uint,
                        self.buf(self.s.inv_freq) as *const f32,
                        cfg.rope_interleaved as c_int,
                        layer.w.q_norm.map_or(ptr::null(), |w| w.f32_ptr()),
                        layer.w.k_norm.map_or(ptr::null(), |w| w.f32_ptr()),
                        cfg.rms_eps,
                        k_cache,
                        v_cache,
                        stream.window as c_uint,
                        s,
                    )
                },
                "hostembed_rope_kv",
            )?;
            launch(
                unsafe {
                    kn::hostembed_attention(
                        qkv,
                        qkv_dim as c_uint,
                        k_cache,
                        v_cache,
                        stream.window as c_uint,
                        pos,
                        nu,
                        cfg.heads as c_uint,
                        cfg.kv_heads as c_uint,
                        hd as c_uint,
                        scale,
                        splits,
                        f(self.s.partial),
                        attn,
                        s,
                    )
                },
                "hostembed_attention",
            )?;
            matvec(&layer.w.o, attn, ptr::null(), x, x, hidden)?;

            rmsnorm(x, layer.w.ffn_norm.f32_ptr(), xn, nu)?;
            if layer.w.gate.dtype == layer.w.up.dtype {
                let (g, u) = (&layer.w.gate, &layer.w.up);
                launch(
                    unsafe {
                        kn::hostembed_matvec_swiglu(
                            g.ptr,
                            u.ptr,
                            g.dtype as c_int,
                            g.rows as c_uint,
                            g.cols as c_uint,
                            xn,
                            nu,
                            gate,
                            s,
                        )
                    },
                    "hostembed_matvec_swiglu",
                )?;
            } else {
                matvec(&layer.w.gate, xn, ptr::null(), ptr::null(), gate, inter)?;
                matvec(&layer.w.up, xn, ptr::null(), ptr::null(), up, inter)?;
                launch(unsafe { kn::hostembed_swiglu(gate, up, gate, n * inter, s) }, "hostembed_swiglu")?;
            }
            matvec(&layer.w.down, gate, ptr::null(), x, x, hidden)?;
        }
        match head {
            Head::Skip => Ok(()),
            Head::Last => {
                rmsnorm(unsafe { x.add((n - 1) * hidden) }, self.final_norm, xn, 1)?;
                self.head_matvec(xn)
            }
            Head::All => rmsnorm(x, self.final_norm, xn, nu),
        }
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
