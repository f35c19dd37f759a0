//! The CPU reference backend: the model in plain f32 Rust with f64 dot products, batched and threaded
//! so that long prompts stay cheap to check against.
//!
//! Every GPU kernel is tested against the ops here, and CI decodes with `CpuModel`. Weights stay in
//! their stored format (F32/F16/BF16/Q8_0) and are decoded as they are read. Dot products accumulate in
//! f64 so the oracle's own rounding stays far below any kernel's.
//!
//! A step of n tokens runs through the layers as a batch, in chunks of at most `CHUNK_TOKENS` so that
//! its scratch does not grow with the prompt. Each matrix product decodes a weight row once per chunk
//! and dots it with every token (cpu/matmul.rs); attention runs each token over the stream's cache up
//! to its own position, its softmax over position-aligned blocks with a running max and this
//! backend's own exp (cpu/attention.rs, cpu/exp.rs). Both split their work across threads
//! (cpu/parallel.rs: HOSTEMBED_CPU_THREADS, else every core). Every output value is the same sequence
//! of f64 operations however the tokens are batched and whatever the thread count or the host's libm,
//! so a prompt stepped at once gives the logits it gives token by token, bit for bit.

use std::sync::Arc;

use crate::backend::{Backend, KvStream};
use crate::model::{Arch, LayerWeights, ModelConfig, ModelWeights, TensorRef, TensorSource};
use crate::sampler::{self, Sampling};
use crate::status::Result;
use crate::{bail, err};

mod attention;
mod exp;
mod matmul;
mod parallel;

use self::attention::{AttentionScratch, Batch};
use self::matmul::{RowTile, Write};
use self::parallel::Pool;
pub use self::parallel::{MAX_THREADS, THREADS_ENV, thread_count};

/// Tokens a step runs through the layers together; a longer step runs in chunks of this many. Past a
/// few dozen tokens a decoded row is reused enough that larger chunks only cost scratch.
pub const CHUNK_TOKENS: usize = 64;

/// RMSNorm of one row: out = w * x / sqrt(mean(x^2) + eps).
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), w.len(), "rmsnorm: input and weight lengths differ");
    assert_eq!(x.len(), out.len(), "rmsnorm: input and output lengths differ");
    let inv_rms = inverse_rms(x, eps);
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = g * (v * inv_rms);
    }
}

/// 1 / sqrt(mean(x^2) + eps), the mean in f64.
fn inverse_rms(x: &[f32], eps: f32) -> f32 {
    let mean_square = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len() as f64;
    (1.0 / (mean_square + eps as f64).sqrt()) as f32
}

/// out[r] = sum_c w[r][c] * x[c] over a [rows, cols] weight in any stored format, on this thread: each
/// dot as `tensor::dot` defines it, the model's own arithmetic.
pub fn matvec(w: &TensorRef, x: &[f32], out: &mut [f32]) {
    matmul(w, x, out)
}

/// out[t][r] = w[r] . x[t] for the tokens of `x` (rows of w.cols() values) into the same rows of `out`
/// (w.rows() values each), on this thread: the batched path a prompt takes, bit for bit `matvec` of
/// each token.
pub fn matmul(w: &TensorRef, x: &[f32], out: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert!(x.len().is_multiple_of(cols), "matmul: input is not whole rows of the weight's columns");
    let n = x.len() / cols;
    assert_eq!(out.len(), n * rows, "matmul: output is not a row of the weight's rows per input row");
    let mut tile = [RowTile { decoded: vec![0f32; RowTile::len(cols)] }];
    matmul::matmul(w, x, n, out, Write::Set, &mut tile);
}

pub use crate::model::rope_inv_freq;

/// Rotates each of `n_heads` heads of `x` to position `pos`. Angle of pair i = pos * inv_freq[i]
/// (the product in f32, as HF forms it). Interleaved pairs are (2i, 2i+1); otherwise (i, i + head_dim/2).
pub fn rope(x: &mut [f32], n_heads: usize, head_dim: usize, pos: usize, inv_freq: &[f32], interleaved: bool) {
    assert_eq!(x.len(), n_heads * head_dim, "rope: input is not n_heads x head_dim");
    assert_eq!(inv_freq.len(), head_dim / 2, "rope: need head_dim/2 frequencies");
    let mut rotation = vec![(0f32, 0f32); head_dim / 2];
    rotation_at(pos, inv_freq, &mut rotation);
    rotate(x, head_dim, &rotation, interleaved);
}

/// (cos, sin) of each pair's angle at `pos`: computed once a token, then applied to every head.
fn rotation_at(pos: usize, inv_freq: &[f32], out: &mut [(f32, f32)]) {
    for (r, &freq) in out.iter_mut().zip(inv_freq) {
        let angle = (pos as f32 * freq) as f64;
        *r = (angle.cos() as f32, angle.sin() as f32);
    }
}

/// Rotates each head_dim slice of `x` by `rotation` (one (cos, sin) a pair).
fn rotate(x: &mut [f32], head_dim: usize, rotation: &[(f32, f32)], interleaved: bool) {
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        for (i, &(cos, sin)) in rotation.iter().enumerate() {
            let (a, b) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
            let (xa, xb) = (head[a], head[b]);
            head[a] = xa * cos - xb * sin;
            head[b] = xb * cos + xa * sin;
        }
    }
}

/// One query (`heads` x `head_dim`) attending over `n_ctx` cached positions; `k` and `v` hold
/// [n_ctx][kv_heads * head_dim] (longer slices are fine: only the first n_ctx rows are read).
/// Query head h reads KV head h / (heads / kv_heads); scores are scaled by 1/sqrt(head_dim). The
/// same arithmetic as the model's batched attention, on this thread.
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
    assert!(kv_heads > 0 && heads.is_multiple_of(kv_heads), "attention: heads must be a multiple of kv_heads");
    assert_eq!(q.len(), heads * head_dim, "attention: query is not heads x head_dim");
    assert!(n_ctx > 0, "attention: a query sees at least its own position");
    let batch = Batch { q, k, v, first_pos: n_ctx - 1, heads, kv_heads, head_dim };
    let mut scratch = [AttentionScratch::new(heads / kv_heads, head_dim).unwrap_or_else(|e| panic!("{e}"))];
    batch.run(out, &mut scratch);
}

/// SwiGLU: out = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && up.len() == out.len(), "swiglu: lengths differ");
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu_times(g, u);
    }
}

fn silu_times(g: f32, u: f32) -> f32 {
    (g / (1.0 + (-g).exp())) * u
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
    /// The threads a step runs on: this one and the pool's workers.
    pool: Pool,
}

/// One stream's f32 KV cache: per layer, `window` rows of kv_heads * head_dim for K and for V.
pub struct CpuCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

pub type CpuStream = KvStream<CpuCache>;

impl<'a> CpuModel<'a> {
    /// Reads the config and checks every tensor the architecture needs; `BadModel` names the first at
    /// fault. The model runs on `thread_count()` threads.
    pub fn new(src: &'a dyn TensorSource) -> Result<Self> {
        let cfg = src.config().clone();
        let w = ModelWeights::read(src)?;
        let layers = w.layers.into_iter().map(|l| l.try_map(|t| Ok(CpuWeight::new(t)))).collect::<Result<_>>()?;
        let lm_head = w.lm_head.unwrap_or(w.embed);
        let inv_freq = rope_inv_freq(&cfg);
        let final_norm = w.final_norm.to_f32();
        let pool = Pool::new(thread_count());
        Ok(CpuModel { cfg, embed: w.embed, final_norm, lm_head, layers, inv_freq, pool })
    }

    /// The same model on `threads` threads (1..=MAX_THREADS); the logits do not change.
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.pool = Pool::new(threads);
        self
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
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
        let mut s = Scratch::new(&self.cfg, tokens.len().min(CHUNK_TOKENS), self.step_threads(stream))?;
        let mut logits = try_filled(self.cfg.vocab as u128, 0f32)?;
        self.pool.install(|| {
            let mut last = 0;
            for chunk in tokens.chunks(CHUNK_TOKENS) {
                self.advance(stream, chunk, &mut s);
                last = chunk.len() - 1;
            }
            self.logits(&mut s, last..last + 1, &mut logits);
        });
        Ok(logits)
    }

    /// Appends `tokens` and returns the logits after each of them (teacher forcing).
    pub fn forward_all(&self, stream: &mut CpuStream, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        self.check_tokens(stream, tokens)?;
        let chunk_tokens = tokens.len().min(CHUNK_TOKENS);
        let mut s = Scratch::new(&self.cfg, chunk_tokens, self.step_threads(stream))?;
        let mut logits = try_filled(chunk_tokens as u128 * self.cfg.vocab as u128, 0f32)?;
        let mut all = Vec::with_capacity(tokens.len());
        self.pool.install(|| {
            for chunk in tokens.chunks(CHUNK_TOKENS) {
                self.advance(stream, chunk, &mut s);
                let logits = &mut logits[..chunk.len() * self.cfg.vocab];
                self.logits(&mut s, 0..chunk.len(), logits);
                all.extend(logits.chunks_exact(self.cfg.vocab).map(<[f32]>::to_vec));
            }
        });
        Ok(all)
    }

    /// Threads a step of `stream` runs on (those the plan counts at the stream's window).
    fn step_threads(&self, stream: &CpuStream) -> usize {
        step_threads(&self.cfg, stream.window, self.threads())
    }

    /// Everything that could refuse the call, before any token is appended.
    fn check_tokens(&self, stream: &CpuStream, tokens: &[u32]) -> Result<()> {
        let k = &stream.cache.k;
        if k.len() != self.cfg.layers || k.iter().any(|k| k.len() != stream.window * self.cfg.kv_dim()) {
            bail!(InvalidArgument, "stream was not made by this model");
        }
        self.cfg.check_append(stream.len, stream.window, tokens)
    }

    /// Runs a chunk of tokens through every layer at the stream's next positions, caching their K and
    /// V; leaves their final hidden states (before the final norm) in `s.x`.
    fn advance(&self, stream: &mut CpuStream, tokens: &[u32], s: &mut Scratch) {
        let cfg = &self.cfg;
        let (n, hidden, q_dim, kv_dim, head_dim) = (tokens.len(), cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let first_pos = stream.len;
        let Scratch { x, h, q, attn, gate, up, rotation, tiles, attention } = s;
        let (x, h, q, attn) = (&mut x[..n * hidden], &mut h[..n * hidden], &mut q[..n * q_dim], &mut attn[..n * q_dim]);
        let (gate, up) = (&mut gate[..n * cfg.intermediate], &mut up[..n * cfg.intermediate]);
        let embed_row_bytes = self.embed.dtype.row_bytes(hidden).expect("validated at load");
        for (row, &t) in x.chunks_exact_mut(hidden).zip(tokens) {
            let t = t as usize;
            crate::tensor::decode_row(
                self.embed.dtype,
                &self.embed.bytes[t * embed_row_bytes..(t + 1) * embed_row_bytes],
                row,
            );
        }
        // Projects `input` (n tokens) through `w` into (or onto) `out`.
        let mut project = |w: &CpuWeight, input: &[f32], out: &mut [f32], mode: Write| {
            matmul::matmul(w.matrix(), input, n, out, mode, tiles);
        };
        for (layer, (k_cache, v_cache)) in
            self.layers.iter().zip(stream.cache.k.iter_mut().zip(stream.cache.v.iter_mut()))
        {
            let new_rows = first_pos * kv_dim..(first_pos + n) * kv_dim;
            norm_rows(x, layer.attn_norm.values(), cfg.rms_eps, h);
            project(&layer.q, h, q, Write::Set);
            project(&layer.k, h, &mut k_cache[new_rows.clone()], Write::Set);
            project(&layer.v, h, &mut v_cache[new_rows.clone()], Write::Set);
            let (k, v) = (&mut k_cache[new_rows.clone()], &mut v_cache[new_rows]);
            if let (Some(qb), Some(kb), Some(vb)) = (&layer.q_bias, &layer.k_bias, &layer.v_bias) {
                q.chunks_exact_mut(q_dim).for_each(|row| add(row, qb.values()));
                k.chunks_exact_mut(kv_dim).for_each(|row| add(row, kb.values()));
                v.chunks_exact_mut(kv_dim).for_each(|row| add(row, vb.values()));
            }
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                norm_heads(q, qn.values(), cfg.rms_eps);
                norm_heads(k, kn.values(), cfg.rms_eps);
            }
            for (t, (q_row, k_row)) in q.chunks_exact_mut(q_dim).zip(k.chunks_exact_mut(kv_dim)).enumerate() {
                rotation_at(first_pos + t, &self.inv_freq, rotation);
                rotate(q_row, head_dim, rotation, cfg.rope_interleaved);
                rotate(k_row, head_dim, rotation, cfg.rope_interleaved);
            }
            let batch = Batch {
                q: &q[..],
                k: k_cache,
                v: v_cache,
                first_pos,
                heads: cfg.heads,
                kv_heads: cfg.kv_heads,
                head_dim,
            };
            batch.run(attn, attention);
            project(&layer.o, attn, x, Write::Add);

            norm_rows(x, layer.ffn_norm.values(), cfg.rms_eps, h);
            project(&layer.gate, h, gate, Write::Set);
            project(&layer.up, h, up, Write::Set);
            for (g, &u) in gate.iter_mut().zip(up.iter()) {
                *g = silu_times(*g, u);
            }
            project(&layer.down, gate, x, Write::Add);
        }
        stream.len += n;
    }

    /// The logits of the chunk's tokens `tokens` (hidden states in `s.x`), one row of `out` each.
    fn logits(&self, s: &mut Scratch, tokens: std::ops::Range<usize>, out: &mut [f32]) {
        let hidden = self.cfg.hidden;
        let n = tokens.len();
        let (x, h) = (&s.x[tokens.start * hidden..tokens.end * hidden], &mut s.h[..n * hidden]);
        norm_rows(x, &self.final_norm, self.cfg.rms_eps, h);
        matmul::matmul(&self.lm_head, h, n, out, Write::Set, &mut s.tiles);
    }
}

/// RMSNorm of each token of `x` into the same row of `out`.
fn norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    for (x, o) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
        rmsnorm(x, w, eps, o);
    }
}

/// Qwen3's RMSNorm over each head_dim slice of projected q or k rows, in place.
fn norm_heads(x: &mut [f32], w: &[f32], eps: f32) {
    for head in x.chunks_exact_mut(w.len()) {
        let inv_rms = inverse_rms(head, eps);
        for (v, &g) in head.iter_mut().zip(w) {
            *v = g * (*v * inv_rms);
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Scratch: what a step allocates beside the streams, sized once for the plan and for the allocation.

/// Every buffer of a step, for chunks of up to `tokens` tokens on `threads` threads, as counts of
/// values (u128: the plan sizes any window without overflow). Nothing here grows with the context.
struct ScratchLens {
    /// f32s of x and h each (tokens x hidden), of q and attn each (tokens x q_dim), of gate and up
    /// each (tokens x intermediate).
    hidden: u128,
    q: u128,
    intermediate: u128,
    /// (cos, sin) pairs: head_dim / 2.
    rotation: u128,
    /// f32s: the logits a step returns.
    logits: u128,
    threads: u128,
    /// Per thread: f32s of its row tile.
    tile: u128,
    /// Per thread: its attention buffers, as `AttentionScratch::lens` counts them.
    attention: [u128; 7],
}

impl ScratchLens {
    fn new(cfg: &ModelConfig, tokens: u128, threads: u128) -> ScratchLens {
        let widest = cfg.hidden.max(cfg.q_dim()).max(cfg.intermediate);
        ScratchLens {
            hidden: tokens * cfg.hidden as u128,
            q: tokens * cfg.q_dim() as u128,
            intermediate: tokens * cfg.intermediate as u128,
            rotation: cfg.head_dim as u128 / 2,
            logits: cfg.vocab as u128,
            threads,
            tile: RowTile::len(widest) as u128,
            attention: AttentionScratch::lens(cfg.heads / cfg.kv_heads, cfg.head_dim).map(|n| n as u128),
        }
    }

    fn bytes(&self) -> u128 {
        let shared = (2 * (self.hidden + self.q + self.intermediate) + self.logits) * 4 + self.rotation * 8;
        let attention = self.attention.iter().sum::<u128>() * 8;
        shared + self.threads * (self.tile * 4 + attention)
    }
}

/// Host bytes a CPU step takes beside the streams' caches, at most, at a `window`-token window with
/// `threads` allowed: the activations of a chunk (at most CHUNK_TOKENS, and never more than the
/// window), the logits, and a row tile and attention blocks for each of
/// `step_threads` threads. u64::MAX where that overflows 64 bits.
pub fn scratch_bytes(cfg: &ModelConfig, window: usize, threads: usize) -> u64 {
    let threads = step_threads(cfg, window, threads);
    let lens = ScratchLens::new(cfg, window.min(CHUNK_TOKENS) as u128, threads as u128);
    u64::try_from(lens.bytes()).unwrap_or(u64::MAX)
}

/// Threads a step at a `window`-token window gets, of `threads` allowed: no more than a full chunk's
/// multiply-adds (every weight, and attention over the whole window) keep busy, so that a small
/// model does not hold a scratch for every core.
pub fn step_threads(cfg: &ModelConfig, window: usize, threads: usize) -> usize {
    let (hidden, q, kv, inter) =
        (cfg.hidden as u128, cfg.q_dim() as u128, cfg.kv_dim() as u128, cfg.intermediate as u128);
    let weights = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter;
    let attention = 2 * q * window as u128;
    let work = window.min(CHUNK_TOKENS) as u128 * cfg.layers as u128 * (weights + attention);
    let worth = work / (4 * parallel::MIN_THREAD_WORK as u128);
    threads.min(usize::try_from(worth).unwrap_or(usize::MAX)).clamp(1, MAX_THREADS)
}

/// The buffers `ScratchLens` sizes; the KV rows of a chunk are written straight into the cache.
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    attn: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    rotation: Vec<(f32, f32)>,
    tiles: Vec<RowTile>,
    attention: Vec<AttentionScratch>,
}

impl Scratch {
    /// Buffers for chunks of up to `tokens` tokens; NO_ROOM when the host cannot give them (before
    /// any token is appended).
    fn new(cfg: &ModelConfig, tokens: usize, threads: usize) -> Result<Scratch> {
        let l = ScratchLens::new(cfg, tokens as u128, threads as u128);
        let (mut tiles, mut attention) = (Vec::new(), Vec::new());
        tiles
            .try_reserve_exact(threads)
            .map_err(|_| err!(NoRoom, "the host has no room for {threads} threads' scratch"))?;
        attention
            .try_reserve_exact(threads)
            .map_err(|_| err!(NoRoom, "the host has no room for {threads} threads' scratch"))?;
        for _ in 0..threads {
            tiles.push(RowTile { decoded: try_filled(l.tile, 0.0)? });
            attention.push(AttentionScratch::new(cfg.heads / cfg.kv_heads, cfg.head_dim)?);
        }
        Ok(Scratch {
            x: try_filled(l.hidden, 0.0)?,
            h: try_filled(l.hidden, 0.0)?,
            q: try_filled(l.q, 0.0)?,
            attn: try_filled(l.q, 0.0)?,
            gate: try_filled(l.intermediate, 0.0)?,
            up: try_filled(l.intermediate, 0.0)?,
            rotation: try_filled(l.rotation, (0.0, 0.0))?,
            tiles,
            attention,
        })
    }
}

/// `len` zeros, or NO_ROOM when the allocator refuses or `len` overflows the address space.
fn try_zeros(len: u128) -> Result<Vec<f64>> {
    try_filled(len, 0.0)
}

/// `len` copies of `value`, or NO_ROOM when the allocator refuses or `len` overflows the address space.
fn try_filled<T: Clone>(len: u128, value: T) -> Result<Vec<T>> {
    let len = usize::try_from(len).map_err(|_| err!(NoRoom, "a buffer of {len} values overflows the address space"))?;
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| err!(NoRoom, "the host has no room for a buffer of {len} x {} bytes", size_of::<T>()))?;
    v.resize(len, value);
    Ok(v)
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
