//! What a step allocates beside the streams, sized once for the plan and for the allocation.

use super::attention::AttentionScratch;
use super::matmul::RowTile;
use super::moe::MoeScratch;
use super::{CHUNK_TOKENS, MAX_THREADS, parallel};
use crate::err;
use crate::model::ModelConfig;
use crate::status::Result;

/// Every buffer of a step, for chunks of up to `tokens` tokens on `threads` threads, as counts of
/// values (u128: the plan sizes any window without overflow). Nothing here grows with the context.
struct ScratchLens {
    /// f32s of x and h each (tokens x hidden), of q and attn each (tokens x q_dim), of gate and up
    /// each (tokens x the feed-forward's width: an expert's in a Mixture of Experts).
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
    /// The experts' buffers, as `MoeScratch::lens` counts them (f32s, (index, f32) pairs, f32s x 3).
    moe: [u128; 3],
}

impl ScratchLens {
    fn new(cfg: &ModelConfig, tokens: u128, threads: u128) -> ScratchLens {
        let widest = cfg.hidden.max(cfg.q_dim()).max(cfg.ffn_width());
        ScratchLens {
            hidden: tokens * cfg.hidden as u128,
            q: tokens * cfg.q_dim() as u128,
            kv: tokens * cfg.kv_dim() as u128,
            intermediate: tokens * cfg.ffn_width() as u128,
            rotation: cfg.head_dim as u128 / 2,
            logits: cfg.vocab as u128,
            threads,
            tile: RowTile::len(widest) as u128,
            attention: AttentionScratch::lens(cfg.heads / cfg.kv_heads, cfg.head_dim).map(|n| n as u128),
            moe: MoeScratch::lens(cfg.moe, tokens, cfg.hidden as u128),
        }
    }

    fn bytes(&self) -> u128 {
        let shared = (2 * (self.hidden + self.q + self.kv + self.intermediate) + self.logits) * 4 + self.rotation * 8;
        let [logits, chosen, rows] = self.moe;
        let moe = logits * 4 + chosen * size_of::<(usize, f32)>() as u128 + 3 * rows * 4;
        let attention = self.attention.iter().sum::<u128>() * 8;
        shared + moe + self.threads * (self.tile * 4 + attention)
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
    let (hidden, q, kv) = (cfg.hidden as u128, cfg.q_dim() as u128, cfg.kv_dim() as u128);
    // A token's feed-forward: the dense one, or the router and the experts it reads.
    let ffn = match cfg.moe {
        None => 3 * hidden * cfg.intermediate as u128,
        Some(m) => hidden * m.experts as u128 + 3 * hidden * (m.used * m.intermediate) as u128,
    };
    let weights = hidden * (q + 2 * kv) + q * hidden + ffn;
    let attention = 2 * q * window as u128;
    let work = window.min(CHUNK_TOKENS) as u128 * cfg.layers as u128 * (weights + attention);
    let worth = work / (4 * parallel::MIN_THREAD_WORK as u128);
    threads.min(usize::try_from(worth).unwrap_or(usize::MAX)).clamp(1, MAX_THREADS)
}

/// The buffers `ScratchLens` sizes.
pub(super) struct Scratch {
    pub(super) x: Vec<f32>,
    pub(super) h: Vec<f32>,
    pub(super) q: Vec<f32>,
    pub(super) k: Vec<f32>,
    pub(super) v: Vec<f32>,
    pub(super) attn: Vec<f32>,
    pub(super) gate: Vec<f32>,
    pub(super) up: Vec<f32>,
    pub(super) rotation: Vec<(f32, f32)>,
    pub(super) tiles: Vec<RowTile>,
    pub(super) attention: Vec<AttentionScratch>,
    pub(super) moe: MoeScratch,
}

impl Scratch {
    /// Buffers for chunks of up to `tokens` tokens; NO_ROOM when the host cannot give them (before
    /// any token is appended).
    pub(super) fn new(cfg: &ModelConfig, tokens: usize, threads: usize) -> Result<Scratch> {
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
            moe: MoeScratch::new(cfg.moe, tokens, cfg.hidden)?,
        })
    }
}

/// `len` zeros, or NO_ROOM when the allocator refuses or `len` overflows the address space.
pub(super) fn try_zeros(len: u128) -> Result<Vec<f64>> {
    try_filled(len, 0.0)
}

/// `len` copies of `value`, or NO_ROOM when the allocator refuses or `len` overflows the address space.
pub(super) fn try_filled<T: Clone>(len: u128, value: T) -> Result<Vec<T>> {
    let len = usize::try_from(len).map_err(|_| err!(NoRoom, "a buffer of {len} values overflows the address space"))?;
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| err!(NoRoom, "the host has no room for a buffer of {len} x {} bytes", size_of::<T>()))?;
    v.resize(len, value);
    Ok(v)
}
