//! The CPU reference backend: the model in plain f32 Rust with f64 dot products, batched and threaded
//! so that long prompts stay cheap to check against.
//!
//! Every GPU kernel is tested against the ops here, and CI decodes with `CpuModel`. Weights stay in
//! their stored format (any of `tensor::FORMATS`) and are decoded as they are read. Dot products
//! accumulate in f64 so the oracle's own rounding stays far below any kernel's.
//!
//! K and V are cached in pages (`KvPages`) in the engine's KV cache type: f32 by default, or any
//! `kv::KvType`, each row rounded once when written exactly as the CUDA backend rounds it, so the CPU
//! stays the reference for every type.
//!
//! A step of n tokens runs through the layers as a batch, in chunks of at most `CHUNK_TOKENS` so that
//! its scratch does not grow with the prompt; each pass is the architecture's file (`arch`) over the
//! CPU's operations (cpu/pass.rs). Each matrix product decodes a weight row once per chunk
//! and dots it with every token (cpu/matmul.rs); attention runs each token over the stream's cache up
//! to its own position, its softmax over position-aligned blocks with a running max and this
//! backend's own exp (cpu/attention.rs, cpu/exp.rs). Both split their work across threads
//! (cpu/parallel.rs, on `Tuning::cpu_threads` threads). Every output value is the same sequence
//! of f64 operations however the tokens are batched and whatever the thread count or the host's libm,
//! so a prompt stepped at once gives the logits it gives token by token, bit for bit.

use crate::backend::{KvStream, NO_PAGE};
use crate::kv::{KvType, KvTypes};
use crate::model::{Arch, Layers, ModelConfig, ModelWeights, TensorRef, TensorSource};
use crate::status::Result;
use crate::{bail, err};

mod attention;
mod backend;
mod exp;
mod kv_pages;
mod matmul;
mod moe;
mod parallel;
mod pass;
mod scratch;

use self::attention::{AttentionScratch, Batch, KEY_BLOCK, KvRows};
pub use self::backend::CpuBackend;
pub use self::kv_pages::{CpuCache, CpuStream, KvPages};
use self::matmul::{RowTile, Write};
pub use self::parallel::MAX_THREADS;
use self::parallel::Pool;
use self::pass::{CpuPass, Segment};
use self::scratch::{Scratch, try_filled};
pub use self::scratch::{scratch_bytes, step_threads};

/// Tokens a step runs through the layers together; a longer step runs in chunks of this many. Past a
/// few dozen tokens a decoded row is reused enough that larger chunks only cost scratch.
pub const CHUNK_TOKENS: usize = 64;
/// Tokens of the pieces a long item is stepped in where the sliding-window layers have a pool of their
/// own (`backend::LocalLayers::piece`).
pub const LOCAL_PIECE_TOKENS: usize = 8 * CHUNK_TOKENS;

/// Positions in one page of the KV pool.
pub const PAGE_TOKENS: usize = 32;

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
    // SAFETY: an f32 slice read as its bytes: u8 has no alignment, and f32 has no padding or invalid bits.
    let bytes = |v: &[f32]| unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) };
    attention_typed(q, bytes(k), bytes(v), KvTypes::same(KvType::F32), n_ctx, heads, kv_heads, head_dim, out);
}

/// `attention` over a cache stored in `kv`'s types: `k` and `v` hold [n_ctx][kv_heads] rows of one head
/// each, as `KvType::encode` writes a head's row (longer slices are fine: only the first n_ctx rows are
/// read). The values attention sees are the ones `KvType::decode` gives.
#[allow(clippy::too_many_arguments)]
pub fn attention_typed(
    q: &[f32],
    k: &[u8],
    v: &[u8],
    kv: KvTypes,
    n_ctx: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    assert!(kv_heads > 0 && heads.is_multiple_of(kv_heads), "attention: heads must be a multiple of kv_heads");
    assert_eq!(q.len(), heads * head_dim, "attention: query is not heads x head_dim");
    assert!(n_ctx > 0, "attention: a query sees at least its own position");
    // The cache in one piece: one page of every row it holds.
    fn one_page(bytes: &[u8], ty: KvType, n_ctx: usize, kv_heads: usize, head_dim: usize) -> KvRows<'_> {
        let row = kv_heads * ty.row_bytes(head_dim);
        assert!(bytes.len() >= n_ctx * row, "attention: the cache holds fewer than n_ctx rows");
        let bytes = &bytes[..bytes.len() / row * row];
        KvRows { pages: vec![bytes], page_tokens: bytes.len() / row, ty, kv_heads, head_dim }
    }
    let (k, v) = (one_page(k, kv.k, n_ctx, kv_heads, head_dim), one_page(v, kv.v, n_ctx, kv_heads, head_dim));
    let scale = 1.0 / (head_dim as f64).sqrt();
    let batch = Batch { q, k, v, first_pos: n_ctx - 1, window: None, scale, heads, kv_heads, head_dim };
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

/// GeGLU: out = gelu_tanh(gate) * up, gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))),
/// HF's `gelu_pytorch_tanh`.
pub fn geglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && up.len() == out.len(), "geglu: lengths differ");
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = gelu_tanh_times(g, u);
    }
}

/// In f32, each step as torch's tanh-approximated GELU forms it.
fn gelu_tanh_times(g: f32, u: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let inner = SQRT_2_OVER_PI * (g + 0.044715 * (g * g * g));
    (0.5 * g * (1.0 + inner.tanh())) * u
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

/// A decoder (Llama, Qwen2, Qwen3, Gemma 3, and the Mixture-of-Experts kin of Llama and Qwen3) read from a
/// `TensorSource`.
pub struct CpuModel<'a> {
    cfg: ModelConfig,
    embed: TensorRef<'a>,
    final_norm: Vec<f32>,
    /// The embedding table when the head is tied.
    lm_head: TensorRef<'a>,
    layers: Layers<CpuWeight<'a>>,
    inv_freq: Vec<f32>,
    /// The local layers' frequencies; empty for a model without them.
    inv_freq_local: Vec<f32>,
    /// What the streams `new_stream` makes keep K and V in.
    kv: KvTypes,
    /// The threads a step runs on: this one and the pool's workers.
    pool: Pool,
}

// Every block of attention's rows lies in one page.
const _: () = assert!(PAGE_TOKENS.is_multiple_of(KEY_BLOCK));

impl<'a> CpuModel<'a> {
    /// Reads the config and checks every tensor the architecture needs; `BadModel` names the first at
    /// fault. The model runs on every core (`with_threads` sets another count).
    pub fn new(src: &'a dyn TensorSource) -> Result<Self> {
        crate::shard::refuse_rank(src)?;
        let cfg = src.config().clone();
        let w = ModelWeights::read(src)?;
        let layers = w.layers.try_map(|_, _, t| Ok(CpuWeight::new(t)))?;
        let lm_head = w.lm_head.unwrap_or(w.embed);
        let inv_freq = rope_inv_freq(&cfg);
        let inv_freq_local = crate::model::rope_inv_freq_local(&cfg).unwrap_or_default();
        let final_norm = w.final_norm.to_f32();
        let pool = Pool::new(crate::tuning::Tuning::default().cpu_threads);
        let kv = KvTypes::CPU_DEFAULT;
        Ok(CpuModel { cfg, embed: w.embed, final_norm, lm_head, layers, inv_freq, inv_freq_local, kv, pool })
    }

    /// The same model on `threads` threads (1..=MAX_THREADS); the logits do not change.
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.pool = Pool::new(threads);
        self
    }

    /// The same model with the streams `new_stream` makes keeping K and V in `kv`'s types (f32 unless
    /// told); UNSUPPORTED when a type cannot hold the model's heads.
    pub fn with_kv_types(mut self, kv: KvTypes) -> Result<Self> {
        kv.check(&self.cfg)?;
        self.kv = kv;
        Ok(self)
    }

    /// What the streams `new_stream` makes keep K and V in.
    pub fn kv_types(&self) -> KvTypes {
        self.kv
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

    /// An empty stream with room for `window` tokens in pages of its own (panics where
    /// `try_new_stream` fails).
    pub fn new_stream(&self, window: usize) -> CpuStream {
        self.try_new_stream(window).unwrap_or_else(|e| panic!("{e}"))
    }

    /// An empty stream with room for `window` tokens in pages of its own; NO_ROOM when the host cannot
    /// give them.
    pub fn try_new_stream(&self, window: usize) -> Result<CpuStream> {
        let pages = window.div_ceil(PAGE_TOKENS);
        let ids = u32::try_from(pages).map_err(|_| err!(NoRoom, "a {window}-token KV cache has too many pages"))?;
        let own = KvPages::with_types(&self.cfg, pages, self.kv)?;
        Ok(KvStream::with_pages(CpuCache { own: Some(own) }, window, (0..ids).collect()))
    }

    /// Appends `tokens` to a stream with pages of its own and returns the logits after the last one.
    pub fn forward(&self, stream: &mut CpuStream, tokens: &[u32]) -> Result<Vec<f32>> {
        self.with_own_pages(stream, |kv, stream| self.forward_in(kv, stream, tokens))
    }

    /// Appends `tokens` and returns the logits after each of them (teacher forcing).
    pub fn forward_all(&self, stream: &mut CpuStream, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        self.with_own_pages(stream, |kv, stream| {
            let mut all = Vec::with_capacity(tokens.len());
            self.forward_each(kv, stream, tokens, |_, row| all.push(row.to_vec()))?;
            Ok(all)
        })
    }

    /// Appends `tokens` to a stream whose pages are in `kv` in chunks of `CHUNK_TOKENS`, and hands
    /// `each` the logits after every token (its index, the row) in order, one chunk's rows at a time:
    /// memory for one chunk's logits, whatever the length. The same bits as `forward_in` gives for the
    /// last token.
    pub fn forward_each(
        &self,
        kv: &mut KvPages,
        stream: &mut CpuStream,
        tokens: &[u32],
        mut each: impl FnMut(usize, &[f32]),
    ) -> Result<()> {
        self.check_tokens(kv, stream, tokens)?;
        let chunk_tokens = tokens.len().min(CHUNK_TOKENS);
        let mut s = Scratch::new(&self.cfg, chunk_tokens, self.step_threads(stream))?;
        let mut logits = try_filled(chunk_tokens as u128 * self.cfg.vocab as u128, 0f32)?;
        self.pool.install(|| {
            for (c, chunk) in tokens.chunks(CHUNK_TOKENS).enumerate() {
                self.advance(kv, &[Segment::alone(stream, chunk)], &mut s);
                stream.len += chunk.len();
                let logits = &mut logits[..chunk.len() * self.cfg.vocab];
                self.logits(&mut s, 0..chunk.len(), logits);
                for (i, row) in logits.chunks_exact(self.cfg.vocab).enumerate() {
                    each(c * CHUNK_TOKENS + i, row);
                }
            }
        });
        Ok(())
    }

    /// Runs `f` on a stream made by `new_stream` and its own pages.
    fn with_own_pages<T>(
        &self,
        stream: &mut CpuStream,
        f: impl FnOnce(&mut KvPages, &mut CpuStream) -> Result<T>,
    ) -> Result<T> {
        let Some(mut kv) = stream.cache.own.take() else {
            bail!(InvalidArgument, "the stream's pages are in an engine's pool; step it through the engine");
        };
        let out = f(&mut kv, stream);
        stream.cache.own = Some(kv);
        out
    }

    /// Appends `tokens` to a stream whose pages are in `kv` and returns the logits after the last one.
    pub fn forward_in(&self, kv: &mut KvPages, stream: &mut CpuStream, tokens: &[u32]) -> Result<Vec<f32>> {
        self.check_tokens(kv, stream, tokens)?;
        let mut s = Scratch::new(&self.cfg, tokens.len().min(CHUNK_TOKENS), self.step_threads(stream))?;
        let mut logits = try_filled(self.cfg.vocab as u128, 0f32)?;
        self.pool.install(|| {
            let mut last = 0;
            for chunk in tokens.chunks(CHUNK_TOKENS) {
                self.advance(kv, &[Segment::alone(stream, chunk)], &mut s);
                stream.len += chunk.len();
                last = chunk.len() - 1;
            }
            self.logits(&mut s, last..last + 1, &mut logits);
        });
        Ok(logits)
    }

    /// Appends each stream's tokens (streams whose pages are in `kv`) and returns the logits after each
    /// one's last token, or why that stream was refused (nothing appended). Single tokens of different
    /// streams share each pass through the weights, and prompts fill the rest of a pass; every logit is
    /// the one the stream gets stepped alone, bit for bit.
    pub fn forward_batch(&self, kv: &mut KvPages, items: &mut [(&mut CpuStream, &[u32])]) -> Vec<Result<Vec<f32>>> {
        let heads = vec![1; items.len()];
        let outs = self.forward_batch_heads(kv, items, &heads);
        outs.into_iter().map(|o| o.map(|mut rows| rows.pop().unwrap_or_default())).collect()
    }

    /// `forward_batch` returning the logits after each of item i's last `heads[i]` tokens (at least 1,
    /// at most its token count), in order: speculation's verification.
    pub fn forward_batch_heads(
        &self,
        kv: &mut KvPages,
        items: &mut [(&mut CpuStream, &[u32])],
        heads: &[usize],
    ) -> Vec<Result<Vec<Vec<f32>>>> {
        assert_eq!(heads.len(), items.len(), "one head count an item");
        let mut out: Vec<Result<Vec<Vec<f32>>>> =
            items.iter().map(|(stream, tokens)| self.check_tokens(kv, stream, tokens).map(|()| Vec::new())).collect();
        let total: usize = items.iter().zip(&out).filter(|(_, o)| o.is_ok()).map(|((_, t), _)| t.len()).sum();
        if total == 0 {
            return out;
        }
        let threads = items.iter().map(|(stream, _)| self.step_threads(stream)).max().unwrap_or(1);
        let scratch = Scratch::new(&self.cfg, total.min(CHUNK_TOKENS), threads);
        let mut s = match scratch {
            Ok(s) => s,
            Err(e) => return out.into_iter().map(|o| o.and(Err(e.clone()))).collect(),
        };
        let vocab = self.cfg.vocab;
        // How many of each item's tokens have run.
        let mut done = vec![0usize; items.len()];
        self.pool.install(|| {
            loop {
                // One pass: each unfinished item's next tokens, in item order, up to CHUNK_TOKENS in all.
                let mut segments = Vec::new();
                let mut taken = Vec::new();
                let mut rows = 0;
                for (i, (stream, tokens)) in items.iter().enumerate() {
                    let take = (tokens.len() - done[i]).min(CHUNK_TOKENS - rows);
                    if out[i].is_err() || take == 0 {
                        continue;
                    }
                    let first_pos = stream.len + done[i];
                    segments.push(Segment {
                        pages: &stream.pages,
                        local: &stream.local,
                        tokens: &tokens[done[i]..done[i] + take],
                        first_pos,
                        row: rows,
                    });
                    taken.push((i, take));
                    rows += take;
                }
                if segments.is_empty() {
                    break;
                }
                self.advance(kv, &segments, &mut s);
                drop(segments);
                // The rows of this pass whose logits are wanted: each item's last `heads` tokens.
                let mut finishing: Vec<(usize, usize)> = Vec::new();
                let mut row = 0;
                for &(i, take) in &taken {
                    let first_head = items[i].1.len() - heads[i].clamp(1, items[i].1.len());
                    for t in done[i]..done[i] + take {
                        if t >= first_head {
                            finishing.push((i, row + t - done[i]));
                        }
                    }
                    row += take;
                }
                for &(i, take) in &taken {
                    done[i] += take;
                }
                if !finishing.is_empty() {
                    let rows: Vec<usize> = finishing.iter().map(|&(_, row)| row).collect();
                    match try_filled(rows.len() as u128 * vocab as u128, 0f32) {
                        Ok(mut logits) => {
                            self.logits_of_rows(&mut s, &rows, &mut logits);
                            for (&(i, _), l) in finishing.iter().zip(logits.chunks_exact(vocab)) {
                                if let Ok(rows) = out[i].as_mut() {
                                    rows.push(l.to_vec());
                                }
                            }
                        }
                        Err(e) => finishing.iter().for_each(|&(i, _)| out[i] = Err(e.clone())),
                    }
                }
            }
        });
        for ((stream, tokens), o) in items.iter_mut().zip(&out) {
            if o.is_ok() {
                stream.len += tokens.len();
            }
        }
        out
    }

    /// Threads a step of `stream` runs on (those the plan counts at the stream's window).
    fn step_threads(&self, stream: &CpuStream) -> usize {
        step_threads(&self.cfg, stream.window, self.threads())
    }

    /// Everything that could refuse the call, before any token is appended.
    fn check_tokens(&self, kv: &KvPages, stream: &CpuStream, tokens: &[u32]) -> Result<()> {
        if kv.layers != self.cfg.layers || kv.kv_heads != self.cfg.kv_heads || kv.head_dim != self.cfg.head_dim {
            bail!(InvalidArgument, "stream was not made by this model");
        }
        self.cfg.check_append(stream.len, stream.window, tokens)?;
        let need = (stream.len + tokens.len()).div_ceil(PAGE_TOKENS);
        if stream.pages.len() < need || stream.pages.iter().any(|&p| p as usize >= kv.pages()) {
            bail!(
                InvalidArgument,
                "stream holds {} KV pages ({} tokens need {need}) or a page outside the pool of {}",
                stream.pages.len(),
                stream.len + tokens.len(),
                kv.pages()
            );
        }
        if let Some(pages) = kv.local_pages() {
            // Released pages (`NO_PAGE`) are before the window of every position the call reads.
            let outside = stream.local.iter().any(|&p| p != NO_PAGE && p as usize >= pages);
            if stream.local.len() < need || outside {
                bail!(
                    InvalidArgument,
                    "stream holds {} pages of the sliding-window layers' pool ({} tokens need {need}) or a page outside its {pages}",
                    stream.local.len(),
                    stream.len + tokens.len()
                );
            }
        }
        Ok(())
    }

    /// Runs one pass of tokens through every layer, each segment at its stream's next positions, caching
    /// their K and V in the segment's pages; leaves their final hidden states (before the final norm) in
    /// `s.x`, one row a token in segment order. The streams' lengths are the caller's to advance.
    fn advance(&self, kv: &mut KvPages, segments: &[Segment], s: &mut Scratch) {
        let cfg = &self.cfg;
        let n: usize = segments.iter().map(|g| g.tokens.len()).sum();
        let Scratch { x, h, q, k, v, attn, gate, up, rotation, tiles, attention, moe } = s;
        // The position of each row of the pass.
        let positions = segments.iter().flat_map(|g| (0..g.tokens.len()).map(move |t| g.first_pos + t)).collect();
        let mut pass = CpuPass {
            cfg,
            embed: &self.embed,
            inv_freq: &self.inv_freq,
            inv_freq_local: &self.inv_freq_local,
            kv,
            segments,
            positions,
            n,
            x: &mut x[..n * cfg.hidden],
            h: &mut h[..n * cfg.hidden],
            q: &mut q[..n * cfg.q_dim()],
            k: &mut k[..n * cfg.kv_dim()],
            v: &mut v[..n * cfg.kv_dim()],
            attn: &mut attn[..n * cfg.q_dim()],
            gate: &mut gate[..n * cfg.ffn_width()],
            up: &mut up[..n * cfg.ffn_width()],
            rotation,
            tiles,
            attention,
            moe,
        };
        crate::arch::forward(cfg, &mut pass, &self.layers).expect("the CPU's operations do not fail");
    }

    /// The logits of the pass's rows `rows` (hidden states in `s.x`), one row of `out` each.
    fn logits_of_rows(&self, s: &mut Scratch, rows: &[usize], out: &mut [f32]) {
        let hidden = self.cfg.hidden;
        let n = rows.len();
        for (j, &r) in rows.iter().enumerate() {
            rmsnorm(
                &s.x[r * hidden..(r + 1) * hidden],
                &self.final_norm,
                self.cfg.rms_eps,
                &mut s.h[j * hidden..(j + 1) * hidden],
            );
        }
        matmul::matmul(&self.lm_head, &s.h[..n * hidden], n, out, Write::Set, &mut s.tiles);
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
