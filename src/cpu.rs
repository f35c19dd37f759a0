//! The CPU reference backend: the model in plain f32 Rust, readable rather than fast.
//!
//! Every GPU kernel is tested against the ops here, and CI decodes with `CpuModel`. Weights stay in
//! their stored format (F32/F16/BF16/Q8_0) and are decoded row by row as they are read. Dot products
//! accumulate in f64 so the oracle's own rounding stays far below any kernel's.

use std::sync::Arc;

use crate::backend::{Backend, KvStream};
use crate::model::{Arch, LayerWeights, ModelConfig, ModelWeights, TensorRef, TensorSource};
use crate::sampler::{self, Sampling};
use crate::status::Result;
use crate::{bail, err};

/// RMSNorm of one row: out = w * x / sqrt(mean(x^2) + eps).
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), w.len(), "rmsnorm: input and weight lengths differ");
    assert_eq!(x.len(), out.len(), "rmsnorm: input and output lengths differ");
    let mean_square = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len() as f64;
    let inv_rms = (1.0 / (mean_square + eps as f64).sqrt()) as f32;
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = g * (v * inv_rms);
    }
}

/// out[r] = sum_c w[r][c] * x[c] over a [rows, cols] weight in any stored format.
pub fn matvec(w: &TensorRef, x: &[f32], out: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(x.len(), cols, "matvec: input length does not match the weight's columns");
    assert_eq!(out.len(), rows, "matvec: output length does not match the weight's rows");
    let row_bytes = w.dtype.row_bytes(cols).expect("matvec: row size invalid for the weight's format");
    let mut row = vec![0f32; cols];
    for (r, o) in out.iter_mut().enumerate() {
        crate::tensor::decode_row(w.dtype, &w.bytes[r * row_bytes..(r + 1) * row_bytes], &mut row);
        *o = dot(&row, x) as f32;
    }
}

/// sum a[i] * b[i] in f64. A plain indexed loop: unoptimized builds (the test suite) run it faster than
/// an iterator chain.
fn dot(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let mut acc = 0f64;
    for i in 0..a.len() {
        acc += a[i] as f64 * b[i] as f64;
    }
    acc
}

pub use crate::model::rope_inv_freq;

/// Rotates each of `n_heads` heads of `x` to position `pos`. Angle of pair i = pos * inv_freq[i]
/// (the product in f32, as HF forms it). Interleaved pairs are (2i, 2i+1); otherwise (i, i + head_dim/2).
pub fn rope(x: &mut [f32], n_heads: usize, head_dim: usize, pos: usize, inv_freq: &[f32], interleaved: bool) {
    let half = head_dim / 2;
    assert_eq!(x.len(), n_heads * head_dim, "rope: input is not n_heads x head_dim");
    assert_eq!(inv_freq.len(), half, "rope: need head_dim/2 frequencies");
    for head in x.chunks_exact_mut(head_dim) {
        for (i, &freq) in inv_freq.iter().enumerate() {
            let angle = (pos as f32 * freq) as f64;
            let (sin, cos) = (angle.sin() as f32, angle.cos() as f32);
            let (a, b) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
            let (xa, xb) = (head[a], head[b]);
            head[a] = xa * cos - xb * sin;
            head[b] = xb * cos + xa * sin;
        }
    }
}

/// One query (`heads` x `head_dim`) attending over `n_ctx` cached positions; `k` and `v` hold
/// [n_ctx][kv_heads * head_dim] (longer slices are fine: only the first n_ctx rows are read).
/// Query head h reads KV head h / (heads / kv_heads); scores are scaled by 1/sqrt(head_dim).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_ctx: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    let kv_dim = kv_heads * head_dim;
    assert!(kv_heads > 0 && heads.is_multiple_of(kv_heads), "attention: heads must be a multiple of kv_heads");
    assert_eq!(q.len(), heads * head_dim, "attention: query is not heads x head_dim");
    assert_eq!(out.len(), heads * head_dim, "attention: output is not heads x head_dim");
    assert!(k.len() >= n_ctx * kv_dim && v.len() >= n_ctx * kv_dim, "attention: cache shorter than n_ctx");
    let group = heads / kv_heads;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let mut scores = vec![0f64; n_ctx];
    for h in 0..heads {
        let qh = &q[h * head_dim..(h + 1) * head_dim];
        let kv_off = (h / group) * head_dim;
        for (t, s) in scores.iter_mut().enumerate() {
            let kt = &k[t * kv_dim + kv_off..t * kv_dim + kv_off + head_dim];
            *s = dot(qh, kt) * scale;
        }
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let mut total = 0f64;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            total += *s;
        }
        let oh = &mut out[h * head_dim..(h + 1) * head_dim];
        for (d, o) in oh.iter_mut().enumerate() {
            let acc: f64 = scores.iter().enumerate().map(|(t, &p)| p * v[t * kv_dim + kv_off + d] as f64).sum();
            *o = (acc / total) as f32;
        }
    }
}

/// SwiGLU: out = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && up.len() == out.len(), "swiglu: lengths differ");
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = (g / (1.0 + (-g).exp())) * u;
    }
}

/// a += b (the residual connection).
pub fn add(a: &mut [f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "add: lengths differ");
    for (x, &y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

/// A weight as the CPU reads it: a matrix stays as stored, a vector (norm, bias) is decoded once.
enum CpuWeight<'a> {
    Matrix(TensorRef<'a>),
    Vector(Vec<f32>),
}

impl<'a> CpuWeight<'a> {
    fn new(t: TensorRef<'a>) -> CpuWeight<'a> {
        if t.shape.len() == 1 { CpuWeight::Vector(t.to_f32()) } else { CpuWeight::Matrix(t) }
    }

    fn matrix(&self) -> &TensorRef<'a> {
        match self {
            CpuWeight::Matrix(t) => t,
            CpuWeight::Vector(_) => unreachable!("the weight table gives this role two dimensions"),
        }
    }

    fn values(&self) -> &[f32] {
        match self {
            CpuWeight::Vector(v) => v,
            CpuWeight::Matrix(_) => unreachable!("the weight table gives this role one dimension"),
        }
    }
}

/// A dense decoder (Llama, Qwen2, Qwen3) read from a `TensorSource`.
pub struct CpuModel<'a> {
    cfg: ModelConfig,
    embed: TensorRef<'a>,
    final_norm: Vec<f32>,
    /// The embedding table when the head is tied.
    lm_head: TensorRef<'a>,
    layers: Vec<LayerWeights<CpuWeight<'a>>>,
    inv_freq: Vec<f32>,
}

/// One stream's f32 KV cache: per layer, `window` rows of kv_heads * head_dim for K and for V.
pub struct CpuCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

pub type CpuStream = KvStream<CpuCache>;

impl<'a> CpuModel<'a> {
    /// Reads the config and checks every tensor the architecture needs; `BadModel` names the first at fault.
    pub fn new(src: &'a dyn TensorSource) -> Result<Self> {
        let cfg = src.config().clone();
        let w = ModelWeights::read(src)?;
        let layers = w.layers.into_iter().map(|l| l.try_map(|t| Ok(CpuWeight::new(t)))).collect::<Result<_>>()?;
        let lm_head = w.lm_head.unwrap_or(w.embed);
        let inv_freq = rope_inv_freq(&cfg);
        Ok(CpuModel { cfg, embed: w.embed, final_norm: w.final_norm.to_f32(), lm_head, layers, inv_freq })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The architecture, for messages.
    pub fn arch(&self) -> Arch {
        self.cfg.arch
    }

    /// An empty stream with room for `window` tokens (panics where `try_new_stream` fails).
    pub fn new_stream(&self, window: usize) -> CpuStream {
        self.try_new_stream(window).unwrap_or_else(|e| panic!("{e}"))
    }

    /// An empty stream with room for `window` tokens; NO_ROOM when the host cannot give its KV cache.
    pub fn try_new_stream(&self, window: usize) -> Result<CpuStream> {
        let len = window
            .checked_mul(self.cfg.kv_dim())
            .ok_or_else(|| err!(NoRoom, "a {window}-token KV cache overflows the address space"))?;
        let cache = || (0..self.cfg.layers).map(|_| zeroed_f32(len)).collect::<Result<Vec<_>>>();
        Ok(KvStream::new(CpuCache { k: cache()?, v: cache()? }, window))
    }

    /// Appends `tokens` to the stream and returns the logits after the last one.
    pub fn forward(&self, stream: &mut CpuStream, tokens: &[u32]) -> Result<Vec<f32>> {
        self.check_tokens(stream, tokens)?;
        let mut hidden = Vec::new();
        for &t in tokens {
            hidden = self.advance(stream, t);
        }
        Ok(self.logits(&hidden))
    }

    /// Appends `tokens` and returns the logits after each of them (teacher forcing).
    pub fn forward_all(&self, stream: &mut CpuStream, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        self.check_tokens(stream, tokens)?;
        Ok(tokens.iter().map(|&t| self.logits(&self.advance(stream, t))).collect())
    }

    /// Everything that could refuse the call, before any token is appended.
    fn check_tokens(&self, stream: &CpuStream, tokens: &[u32]) -> Result<()> {
        let k = &stream.cache.k;
        if k.len() != self.cfg.layers || k.iter().any(|k| k.len() != stream.window * self.cfg.kv_dim()) {
            bail!(InvalidArgument, "stream was not made by this model");
        }
        self.cfg.check_append(stream.len, stream.window, tokens)
    }

    /// Runs one token through every layer at the stream's next position, caching its K and V;
    /// returns the final hidden state (before the final norm).
    fn advance(&self, stream: &mut CpuStream, token: u32) -> Vec<f32> {
        let cfg = &self.cfg;
        let (hidden, q_dim, kv_dim, head_dim) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let pos = stream.len;
        let mut x = self.embed.row_f32(token as usize);
        let mut h = vec![0f32; hidden];
        let (mut q, mut k, mut v) = (vec![0f32; q_dim], vec![0f32; kv_dim], vec![0f32; kv_dim]);
        let mut attn = vec![0f32; q_dim];
        let mut proj = vec![0f32; hidden];
        let (mut gate, mut up) = (vec![0f32; cfg.intermediate], vec![0f32; cfg.intermediate]);
        let mut gated = vec![0f32; cfg.intermediate];
        for (layer, (k_cache, v_cache)) in
            self.layers.iter().zip(stream.cache.k.iter_mut().zip(stream.cache.v.iter_mut()))
        {
            rmsnorm(&x, layer.attn_norm.values(), cfg.rms_eps, &mut h);
            matvec(layer.q.matrix(), &h, &mut q);
            matvec(layer.k.matrix(), &h, &mut k);
            matvec(layer.v.matrix(), &h, &mut v);
            if let (Some(qb), Some(kb), Some(vb)) = (&layer.q_bias, &layer.k_bias, &layer.v_bias) {
                add(&mut q, qb.values());
                add(&mut k, kb.values());
                add(&mut v, vb.values());
            }
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                norm_heads(&mut q, qn.values(), cfg.rms_eps);
                norm_heads(&mut k, kn.values(), cfg.rms_eps);
            }
            rope(&mut q, cfg.heads, head_dim, pos, &self.inv_freq, cfg.rope_interleaved);
            rope(&mut k, cfg.kv_heads, head_dim, pos, &self.inv_freq, cfg.rope_interleaved);
            k_cache[pos * kv_dim..(pos + 1) * kv_dim].copy_from_slice(&k);
            v_cache[pos * kv_dim..(pos + 1) * kv_dim].copy_from_slice(&v);
            attention(&q, k_cache, v_cache, pos + 1, cfg.heads, cfg.kv_heads, head_dim, &mut attn);
            matvec(layer.o.matrix(), &attn, &mut proj);
            add(&mut x, &proj);

            rmsnorm(&x, layer.ffn_norm.values(), cfg.rms_eps, &mut h);
            matvec(layer.gate.matrix(), &h, &mut gate);
            matvec(layer.up.matrix(), &h, &mut up);
            swiglu(&gate, &up, &mut gated);
            matvec(layer.down.matrix(), &gated, &mut proj);
            add(&mut x, &proj);
        }
        stream.len += 1;
        x
    }

    fn logits(&self, x: &[f32]) -> Vec<f32> {
        let mut h = vec![0f32; self.cfg.hidden];
        rmsnorm(x, &self.final_norm, self.cfg.rms_eps, &mut h);
        let mut logits = vec![0f32; self.cfg.vocab];
        matvec(&self.lm_head, &h, &mut logits);
        logits
    }
}

/// Qwen3's RMSNorm over each head_dim slice of a projected q or k.
fn norm_heads(x: &mut [f32], w: &[f32], eps: f32) {
    let mut normed = vec![0f32; w.len()];
    for head in x.chunks_exact_mut(w.len()) {
        rmsnorm(head, w, eps, &mut normed);
        head.copy_from_slice(&normed);
    }
}

/// `len` zeros, or NO_ROOM when the allocator refuses; fresh zeroed pages are only touched when written.
fn zeroed_f32(len: usize) -> Result<Vec<f32>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<f32>(len)
        .map_err(|_| err!(NoRoom, "a KV cache of {len} floats overflows the address space"))?;
    // SAFETY: the layout's size is not zero (len > 0).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut f32;
    if ptr.is_null() {
        bail!(NoRoom, "the host has no room for a KV cache of {} bytes", layout.size());
    }
    // SAFETY: `ptr` comes from the global allocator with Vec's layout for `len` f32s, all zero bits.
    Ok(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

/// The CPU backend: a `CpuModel` built once at load over a source it keeps alive, and the logits of
/// the last step.
pub struct CpuBackend {
    // Declared before `_source`: dropped before what it reads.
    model: CpuModel<'static>,
    logits: Option<Vec<f32>>,
    _source: Arc<dyn TensorSource + Send + Sync>,
}

impl CpuBackend {
    /// Checks the model in `source` (so a bad model fails the load, not the first step) and builds its view.
    pub fn new(source: Arc<dyn TensorSource + Send + Sync>) -> Result<CpuBackend> {
        // SAFETY: an Arc's pointee never moves, and this struct drops the view before its Arc.
        let src: &'static dyn TensorSource = unsafe { &*Arc::as_ptr(&source) };
        Ok(CpuBackend { model: CpuModel::new(src)?, logits: None, _source: source })
    }
}

impl Backend for CpuBackend {
    type Cache = CpuCache;

    fn new_stream(&self, window: usize) -> Result<CpuStream> {
        self.model.try_new_stream(window)
    }

    fn step(&mut self, stream: &mut CpuStream, tokens: &[u32], sampling: &Sampling, stream_index: u32) -> Result<u32> {
        let position = (stream.len + tokens.len()) as u64;
        let logits = self.model.forward(stream, tokens)?;
        let next = sampler::sample(&logits, sampling, stream_index, position);
        self.logits = Some(logits);
        Ok(next)
    }

    fn last_logits(&self) -> Result<Vec<f32>> {
        self.logits.clone().ok_or_else(|| err!(InvalidArgument, "no step has produced logits yet"))
    }
}
