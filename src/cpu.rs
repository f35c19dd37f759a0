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
//! its scratch does not grow with the prompt. Each matrix product decodes a weight row once per chunk
//! and dots it with every token (cpu/matmul.rs); attention runs each token over the stream's cache up
//! to its own position, its softmax over position-aligned blocks with a running max and this
//! backend's own exp (cpu/attention.rs, cpu/exp.rs). Both split their work across threads
//! (cpu/parallel.rs: HOSTEMBED_CPU_THREADS, else every core). Every output value is the same sequence
//! of f64 operations however the tokens are batched and whatever the thread count or the host's libm,
//! so a prompt stepped at once gives the logits it gives token by token, bit for bit.

use std::sync::Arc;

use crate::backend::{Backend, KvStream, StepItem};
use crate::kv::{KvType, KvTypes};
use crate::model::{Arch, LayerWeights, ModelConfig, ModelWeights, TensorRef, TensorSource};
use crate::sampler;
use crate::status::Result;
use crate::{bail, err};

mod attention;
mod exp;
mod matmul;
mod parallel;

use self::attention::{AttentionScratch, Batch, KEY_BLOCK, KvRows};
use self::matmul::{RowTile, Write};
use self::parallel::Pool;
pub use self::parallel::{MAX_THREADS, THREADS_ENV, thread_count};

/// Tokens a step runs through the layers together; a longer step runs in chunks of this many. Past a
/// few dozen tokens a decoded row is reused enough that larger chunks only cost scratch.
pub const CHUNK_TOKENS: usize = 64;

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
    /// What the streams `new_stream` makes keep K and V in.
    kv: KvTypes,
    /// The threads a step runs on: this one and the pool's workers.
    pool: Pool,
}

/// KV memory in pages of `PAGE_TOKENS` positions, each holding every layer's K and V rows:
/// [page][layer][K rows, V rows], each PAGE_TOKENS rows of kv_heads heads, a head's row as its type
/// stores it (`KvType::encode`). K and V are rounded to their types once, when written. Fresh pages
/// are zero pages the host has not touched yet, so a pool costs memory only as streams fill it.
pub struct KvPages {
    /// The pages' bytes, kept in f32s so that F32 rows (whose offsets are all multiples of 4) read as
    /// aligned floats.
    data: Vec<f32>,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    kv: KvTypes,
    /// Bytes of one position's K row and of its V row (every head).
    row: [usize; 2],
    pages: usize,
}

impl KvPages {
    /// `pages` pages of f32 K and V for the model `cfg`; NO_ROOM when the host cannot give them.
    pub fn new(cfg: &ModelConfig, pages: usize) -> Result<KvPages> {
        Self::with_types(cfg, pages, KvTypes::CPU_DEFAULT)
    }

    /// `pages` pages of K and V in `kv`'s types; UNSUPPORTED when a type cannot hold the model's heads,
    /// NO_ROOM when the host cannot give them.
    pub fn with_types(cfg: &ModelConfig, pages: usize, kv: KvTypes) -> Result<KvPages> {
        kv.check(cfg)?;
        let row = [kv.k, kv.v].map(|t| cfg.kv_heads * t.row_bytes(cfg.head_dim));
        let len = (PAGE_TOKENS * (row[0] + row[1]))
            .checked_mul(cfg.layers)
            .and_then(|page| page.checked_mul(pages))
            .ok_or_else(|| err!(NoRoom, "a KV pool of {pages} pages overflows the address space"))?;
        let data = zeroed_f32(len.div_ceil(4))?;
        Ok(KvPages { data, layers: cfg.layers, kv_heads: cfg.kv_heads, head_dim: cfg.head_dim, kv, row, pages })
    }

    pub fn pages(&self) -> usize {
        self.pages
    }

    /// The K and V types the pages store.
    pub fn kv_types(&self) -> KvTypes {
        self.kv
    }

    /// Bytes the pages hold.
    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }

    fn data(&self) -> &[u8] {
        // SAFETY: the f32 storage read as its bytes: u8 has no alignment, f32 no padding.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr() as *const u8, self.data.len() * 4) }
    }

    fn data_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `data`; every byte pattern written is a valid f32, and the borrow is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.data.as_mut_ptr() as *mut u8, self.data.len() * 4) }
    }

    /// Bytes of one layer's K (`which` 0) or V (1) rows in a page.
    fn block(&self, which: usize) -> usize {
        PAGE_TOKENS * self.row[which]
    }

    /// Where page `page`'s K (`which` 0) or V (1) rows of `layer` start.
    fn at(&self, page: u32, layer: usize, which: usize) -> usize {
        (page as usize * self.layers + layer) * (self.block(0) + self.block(1)) + which * self.block(0)
    }

    /// Page `page`'s K (`which` 0) or V (1) rows of `layer`.
    fn rows(&self, page: u32, layer: usize, which: usize) -> &[u8] {
        let at = self.at(page, layer, which);
        &self.data()[at..at + self.block(which)]
    }

    /// Copies page `from`'s rows of every layer into page `to`.
    pub fn copy_page(&mut self, from: u32, to: u32) {
        assert!((from as usize) < self.pages && (to as usize) < self.pages, "a page outside the pool");
        let bytes = self.layers * (self.block(0) + self.block(1));
        let (src, dst) = (self.at(from, 0, 0), self.at(to, 0, 0));
        self.data_mut().copy_within(src..src + bytes, dst);
    }

    /// Writes `values` (kv_heads x head_dim) as the K (`which` 0) or V (1) row of `layer` at position `pos`
    /// of a stream holding `pages`, rounded to its type.
    fn store(&mut self, pages: &[u32], pos: usize, layer: usize, which: usize, values: &[f32]) {
        let at = self.at(pages[pos / PAGE_TOKENS], layer, which) + (pos % PAGE_TOKENS) * self.row[which];
        let ty = if which == 0 { self.kv.k } else { self.kv.v };
        let (row_bytes, head_dim) = (self.row[which], self.head_dim);
        let row = &mut self.data_mut()[at..at + row_bytes];
        let head_bytes = ty.row_bytes(head_dim);
        for (head, out) in values.chunks_exact(head_dim).zip(row.chunks_exact_mut(head_bytes)) {
            ty.encode(head, out);
        }
    }

    /// One layer's K or V rows of a stream holding `pages`, for its first `positions` positions.
    fn stream_rows(&self, pages: &[u32], positions: usize, layer: usize, which: usize) -> KvRows<'_> {
        let pages = pages[..positions.div_ceil(PAGE_TOKENS)].iter().map(|&p| self.rows(p, layer, which)).collect();
        let ty = if which == 0 { self.kv.k } else { self.kv.v };
        KvRows { pages, page_tokens: PAGE_TOKENS, ty, kv_heads: self.kv_heads, head_dim: self.head_dim }
    }
}

/// A CPU stream's own KV memory: the pages of a stream made by `CpuModel::new_stream`, outside any
/// pool; None for an engine's streams, whose pages are in the backend's pool.
pub struct CpuCache {
    own: Option<KvPages>,
}

pub type CpuStream = KvStream<CpuCache>;

/// One stream's share of a pass through the layers: `tokens` at positions `first_pos..`, rows
/// `row..row + tokens.len()` of the pass's activations.
struct Segment<'s> {
    pages: &'s [u32],
    tokens: &'s [u32],
    first_pos: usize,
    row: usize,
}

// Every block of attention's rows lies in one page.
const _: () = assert!(PAGE_TOKENS.is_multiple_of(KEY_BLOCK));

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
        let kv = KvTypes::CPU_DEFAULT;
        Ok(CpuModel { cfg, embed: w.embed, final_norm, lm_head, layers, inv_freq, kv, pool })
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
                self.advance(
                    kv,
                    &[Segment { pages: &stream.pages, tokens: chunk, first_pos: stream.len, row: 0 }],
                    &mut s,
                );
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
                self.advance(
                    kv,
                    &[Segment { pages: &stream.pages, tokens: chunk, first_pos: stream.len, row: 0 }],
                    &mut s,
                );
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
        if stream.pages.len() < need || stream.pages.iter().any(|&p| p as usize >= kv.pages) {
            bail!(
                InvalidArgument,
                "stream holds {} KV pages ({} tokens need {need}) or a page outside the pool of {}",
                stream.pages.len(),
                stream.len + tokens.len(),
                kv.pages
            );
        }
        Ok(())
    }

    /// Runs one pass of tokens through every layer, each segment at its stream's next positions, caching
    /// their K and V in the segment's pages; leaves their final hidden states (before the final norm) in
    /// `s.x`, one row a token in segment order. The streams' lengths are the caller's to advance.
    fn advance(&self, kv: &mut KvPages, segments: &[Segment], s: &mut Scratch) {
        let cfg = &self.cfg;
        let n: usize = segments.iter().map(|g| g.tokens.len()).sum();
        let (hidden, q_dim, kv_dim, head_dim) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let Scratch { x, h, q, k, v, attn, gate, up, rotation, tiles, attention } = s;
        let (x, h, q, attn) = (&mut x[..n * hidden], &mut h[..n * hidden], &mut q[..n * q_dim], &mut attn[..n * q_dim]);
        let (k, v) = (&mut k[..n * kv_dim], &mut v[..n * kv_dim]);
        let (gate, up) = (&mut gate[..n * cfg.intermediate], &mut up[..n * cfg.intermediate]);
        let embed_row_bytes = self.embed.dtype.row_bytes(hidden).expect("validated at load");
        let tokens = segments.iter().flat_map(|g| g.tokens);
        for (row, &t) in x.chunks_exact_mut(hidden).zip(tokens) {
            let t = t as usize;
            crate::tensor::decode_row(
                self.embed.dtype,
                &self.embed.bytes[t * embed_row_bytes..(t + 1) * embed_row_bytes],
                row,
            );
        }
        // The position of each row of the pass.
        let positions: Vec<usize> =
            segments.iter().flat_map(|g| (0..g.tokens.len()).map(move |t| g.first_pos + t)).collect();
        // Projects `input` (n tokens) through `w` into (or onto) `out`.
        let mut project = |w: &CpuWeight, input: &[f32], out: &mut [f32], mode: Write| {
            matmul::matmul(w.matrix(), input, n, out, mode, tiles);
        };
        for (l, layer) in self.layers.iter().enumerate() {
            norm_rows(x, layer.attn_norm.values(), cfg.rms_eps, h);
            project(&layer.q, h, q, Write::Set);
            project(&layer.k, h, k, Write::Set);
            project(&layer.v, h, v, Write::Set);
            if let (Some(qb), Some(kb), Some(vb)) = (&layer.q_bias, &layer.k_bias, &layer.v_bias) {
                q.chunks_exact_mut(q_dim).for_each(|row| add(row, qb.values()));
                k.chunks_exact_mut(kv_dim).for_each(|row| add(row, kb.values()));
                v.chunks_exact_mut(kv_dim).for_each(|row| add(row, vb.values()));
            }
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                norm_heads(q, qn.values(), cfg.rms_eps);
                norm_heads(k, kn.values(), cfg.rms_eps);
            }
            for ((q_row, k_row), &pos) in q.chunks_exact_mut(q_dim).zip(k.chunks_exact_mut(kv_dim)).zip(&positions) {
                rotation_at(pos, &self.inv_freq, rotation);
                rotate(q_row, head_dim, rotation, cfg.rope_interleaved);
                rotate(k_row, head_dim, rotation, cfg.rope_interleaved);
            }
            for g in segments {
                for t in 0..g.tokens.len() {
                    let (row, pos) = ((g.row + t) * kv_dim, g.first_pos + t);
                    kv.store(g.pages, pos, l, 0, &k[row..row + kv_dim]);
                    kv.store(g.pages, pos, l, 1, &v[row..row + kv_dim]);
                }
            }
            for g in segments {
                let (rows, ctx) = (g.row..g.row + g.tokens.len(), g.first_pos + g.tokens.len());
                let batch = Batch {
                    q: &q[rows.start * q_dim..rows.end * q_dim],
                    k: kv.stream_rows(g.pages, ctx, l, 0),
                    v: kv.stream_rows(g.pages, ctx, l, 1),
                    first_pos: g.first_pos,
                    heads: cfg.heads,
                    kv_heads: cfg.kv_heads,
                    head_dim,
                };
                batch.run(&mut attn[rows.start * q_dim..rows.end * q_dim], attention);
            }
            project(&layer.o, attn, x, Write::Add);

            norm_rows(x, layer.ffn_norm.values(), cfg.rms_eps, h);
            project(&layer.gate, h, gate, Write::Set);
            project(&layer.up, h, up, Write::Set);
            for (g, &u) in gate.iter_mut().zip(up.iter()) {
                *g = silu_times(*g, u);
            }
            project(&layer.down, gate, x, Write::Add);
        }
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
    /// f32s of the chunk's new k and v rows each (tokens x kv_dim), copied into the pages.
    kv: u128,
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
            kv: tokens * cfg.kv_dim() as u128,
            intermediate: tokens * cfg.intermediate as u128,
            rotation: cfg.head_dim as u128 / 2,
            logits: cfg.vocab as u128,
            threads,
            tile: RowTile::len(widest) as u128,
            attention: AttentionScratch::lens(cfg.heads / cfg.kv_heads, cfg.head_dim).map(|n| n as u128),
        }
    }

    fn bytes(&self) -> u128 {
        let shared = (2 * (self.hidden + self.q + self.kv + self.intermediate) + self.logits) * 4 + self.rotation * 8;
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

/// The buffers `ScratchLens` sizes.
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
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
            k: try_filled(l.kv, 0.0)?,
            v: try_filled(l.kv, 0.0)?,
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

/// The CPU backend: a `CpuModel` built once at load over a source it keeps alive, the KV pool's
/// memory, and the logits of each item of the last batch.
pub struct CpuBackend {
    // Declared before `_source`: dropped before what it reads.
    model: CpuModel<'static>,
    kv: KvPages,
    /// Per item, the logits after each of its head positions (none for a refused item).
    logits: Vec<Vec<Vec<f32>>>,
    _source: Arc<dyn TensorSource + Send + Sync>,
}

impl CpuBackend {
    /// Checks the model in `source` (so a bad model fails the load, not the first step), builds its view
    /// and a KV pool of `pages` pages of f32 K and V.
    pub fn new(source: Arc<dyn TensorSource + Send + Sync>, pages: usize) -> Result<CpuBackend> {
        Self::with_kv(source, pages, KvTypes::CPU_DEFAULT)
    }

    /// `new` with the pool's K and V in `kv`'s types, rounded as the GPU rounds them.
    pub fn with_kv(source: Arc<dyn TensorSource + Send + Sync>, pages: usize, kv: KvTypes) -> Result<CpuBackend> {
        // SAFETY: an Arc's pointee never moves, and this struct drops the view before its Arc.
        let src: &'static dyn TensorSource = unsafe { &*Arc::as_ptr(&source) };
        let model = CpuModel::new(src)?.with_kv_types(kv)?;
        let kv = KvPages::with_types(model.config(), pages, kv)?;
        Ok(CpuBackend { model, kv, logits: Vec::new(), _source: source })
    }

    pub fn model(&self) -> &CpuModel<'static> {
        &self.model
    }

    /// Host bytes the KV pool holds: what `fit::cpu_kv_bytes` counts for its pages' positions.
    pub fn pool_bytes(&self) -> u64 {
        self.kv.bytes() as u64
    }
}

impl Backend for CpuBackend {
    type Cache = CpuCache;

    const PAGE_TOKENS: usize = PAGE_TOKENS;

    fn new_stream(&self, window: usize) -> Result<CpuStream> {
        Ok(KvStream::new(CpuCache { own: None }, window))
    }

    fn step_batch(&mut self, items: &mut [StepItem<'_, CpuCache>]) -> Result<()> {
        self.logits.clear();
        let histories: Vec<Vec<u32>> = items.iter().map(|i| i.stream.tokens.clone()).collect();
        let heads: Vec<usize> = items.iter().map(|i| i.heads.clamp(1, i.tokens.len().max(1))).collect();
        let mut inputs: Vec<(&mut CpuStream, &[u32])> = items.iter_mut().map(|i| (&mut *i.stream, i.tokens)).collect();
        let outs = self.model.forward_batch_heads(&mut self.kv, &mut inputs, &heads);
        drop(inputs);
        for (((item, out), history), &h) in items.iter_mut().zip(outs).zip(&histories).zip(&heads) {
            match out {
                Ok(rows) if item.mask.is_some() => {
                    // A constrained item proposes nothing: one draw, among the tokens its constraint allows.
                    let next = item.sample(rows.last().expect("at least one head"), history);
                    item.drawn = vec![next];
                    item.next = Ok(next);
                    self.logits.push(rows);
                }
                Ok(rows) => {
                    // Each head draws as a step ending at its position would.
                    let first = item.tokens.len() - h;
                    item.drawn = rows
                        .iter()
                        .enumerate()
                        .map(|(k, l)| {
                            sampler::sample_stream(
                                l,
                                &item.sampling,
                                item.index,
                                history,
                                &item.tokens[..first + k + 1],
                            )
                        })
                        .collect();
                    item.next = Ok(*item.drawn.last().expect("at least one head"));
                    self.logits.push(rows);
                }
                Err(e) => {
                    item.next = Err(e);
                    self.logits.push(Vec::new());
                }
            }
        }
        Ok(())
    }

    fn logits(&self, i: usize, head: usize) -> Result<Vec<f32>> {
        self.logits
            .get(i)
            .and_then(|rows| rows.get(head))
            .cloned()
            .ok_or_else(|| err!(InvalidArgument, "item {i} of the last batch has no logits at head {head}"))
    }

    fn copy_page(&mut self, from: u32, to: u32) -> Result<()> {
        self.kv.copy_page(from, to);
        Ok(())
    }

    fn score(&mut self, stream: &mut CpuStream, tokens: &[u32], out: &mut [f32]) -> Result<()> {
        self.logits.clear();
        let mut last = None;
        self.model.forward_each(&mut self.kv, stream, tokens, |i, row| match tokens.get(i + 1) {
            Some(&next) => out[i] = crate::backend::log_prob(row, next),
            None => last = Some(row.to_vec()),
        })?;
        self.logits.push(last.into_iter().collect());
        Ok(())
    }
}
