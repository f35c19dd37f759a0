//! The CPU's operations (`arch::Ops`) over one pass of tokens: each computes at once, over the pass's
//! rows in the step's scratch, with the arithmetic the module doc describes.

use super::attention::{AttentionScratch, Batch};
use super::matmul::{self, RowTile, Write};
use super::moe::{MoeFfn, MoeScratch};
use super::{
    CpuStream, CpuWeight, KvPages, add, gelu_tanh_times, inverse_rms, norm_rows, rotate, rotation_at, silu_times,
};
use crate::arch::{Feeds, Ops, Rotary};
use crate::model::{Activation, ModelConfig, TensorRef};
use crate::status::Result;

/// One stream's share of a pass through the layers: `tokens` at positions `first_pos..`, rows
/// `row..row + tokens.len()` of the pass's activations.
pub(super) struct Segment<'s> {
    pub pages: &'s [u32],
    /// The stream's pages of the local layers' pool (empty without one).
    pub local: &'s [u32],
    pub tokens: &'s [u32],
    pub first_pos: usize,
    pub row: usize,
}

impl<'s> Segment<'s> {
    /// A pass of `tokens` of `stream` alone, at its next positions.
    pub fn alone(stream: &'s CpuStream, tokens: &'s [u32]) -> Segment<'s> {
        Segment { pages: &stream.pages, local: &stream.local, tokens, first_pos: stream.len, row: 0 }
    }
}

/// A pass of `n` rows: the model's constants, the streams' pages, and the scratch cut to n rows.
pub(super) struct CpuPass<'p, 'a> {
    pub cfg: &'p ModelConfig,
    pub embed: &'p TensorRef<'a>,
    pub inv_freq: &'p [f32],
    /// The local layers' frequencies (empty for a model without them).
    pub inv_freq_local: &'p [f32],
    pub kv: &'p mut KvPages,
    pub segments: &'p [Segment<'p>],
    /// The position of each row.
    pub positions: Vec<usize>,
    pub n: usize,
    pub x: &'p mut [f32],
    pub h: &'p mut [f32],
    pub q: &'p mut [f32],
    pub k: &'p mut [f32],
    pub v: &'p mut [f32],
    pub attn: &'p mut [f32],
    pub gate: &'p mut [f32],
    pub up: &'p mut [f32],
    pub rotation: &'p mut [(f32, f32)],
    pub tiles: &'p mut [RowTile],
    pub attention: &'p mut [AttentionScratch],
    /// The Mixture-of-Experts feed-forward's buffers (empty for a dense model).
    pub moe: &'p mut MoeScratch,
}

impl CpuPass<'_, '_> {
    /// Projects `input` (n rows) through `w` into (or onto) `out`.
    fn project(tiles: &mut [RowTile], n: usize, w: &CpuWeight, input: &[f32], out: &mut [f32], mode: Write) {
        matmul::matmul(w.matrix(), input, n, out, mode, tiles);
    }
}

impl<'a> Ops for CpuPass<'_, 'a> {
    type Weight = CpuWeight<'a>;

    fn embed(&mut self) -> Result<()> {
        let hidden = self.cfg.hidden;
        let embed_row_bytes = self.embed.dtype.row_bytes(hidden).expect("validated at load");
        let tokens = self.segments.iter().flat_map(|g| g.tokens);
        for (row, &t) in self.x.chunks_exact_mut(hidden).zip(tokens) {
            let t = t as usize;
            crate::tensor::decode_row(
                self.embed.dtype,
                &self.embed.bytes[t * embed_row_bytes..(t + 1) * embed_row_bytes],
                row,
            );
        }
        Ok(())
    }

    fn scale(&mut self, factor: f32) -> Result<()> {
        self.x.iter_mut().for_each(|v| *v *= factor);
        Ok(())
    }

    fn norm(&mut self, w: &CpuWeight<'a>, _feeds: Feeds) -> Result<()> {
        norm_rows(self.x, w.values(), self.cfg.rms_eps, self.h);
        Ok(())
    }

    fn qkv(
        &mut self,
        q: &CpuWeight<'a>,
        k: &CpuWeight<'a>,
        v: &CpuWeight<'a>,
        bias: Option<[&CpuWeight<'a>; 3]>,
    ) -> Result<()> {
        let (n, tiles) = (self.n, &mut *self.tiles);
        Self::project(tiles, n, q, self.h, self.q, Write::Set);
        Self::project(tiles, n, k, self.h, self.k, Write::Set);
        Self::project(tiles, n, v, self.h, self.v, Write::Set);
        if let Some([qb, kb, vb]) = bias {
            let (q_dim, kv_dim) = (self.cfg.q_dim(), self.cfg.kv_dim());
            self.q.chunks_exact_mut(q_dim).for_each(|row| add(row, qb.values()));
            self.k.chunks_exact_mut(kv_dim).for_each(|row| add(row, kb.values()));
            self.v.chunks_exact_mut(kv_dim).for_each(|row| add(row, vb.values()));
        }
        Ok(())
    }

    fn rope_append(&mut self, layer: usize, head_norms: Option<[&CpuWeight<'a>; 2]>, rotary: Rotary) -> Result<()> {
        let cfg = self.cfg;
        let inv_freq = match rotary {
            Rotary::Global => self.inv_freq,
            Rotary::Local => self.inv_freq_local,
        };
        assert_eq!(inv_freq.len(), cfg.head_dim / 2, "{rotary:?} rotary frequencies of a model without them");
        let (q_dim, kv_dim, head_dim) = (cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        if let Some([qn, kn]) = head_norms {
            norm_heads(self.q, qn.values(), cfg.rms_eps);
            norm_heads(self.k, kn.values(), cfg.rms_eps);
        }
        let rows = self.q.chunks_exact_mut(q_dim).zip(self.k.chunks_exact_mut(kv_dim));
        for ((q_row, k_row), &pos) in rows.zip(&self.positions) {
            rotation_at(pos, inv_freq, self.rotation);
            rotate(q_row, head_dim, self.rotation, cfg.rope_interleaved);
            rotate(k_row, head_dim, self.rotation, cfg.rope_interleaved);
        }
        for g in self.segments {
            for t in 0..g.tokens.len() {
                let (row, pos) = ((g.row + t) * kv_dim, g.first_pos + t);
                self.kv.store(g.pages, g.local, pos, layer, 0, &self.k[row..row + kv_dim]);
                self.kv.store(g.pages, g.local, pos, layer, 1, &self.v[row..row + kv_dim]);
            }
        }
        Ok(())
    }

    fn attention(&mut self, layer: usize, window: Option<usize>) -> Result<()> {
        let cfg = self.cfg;
        let q_dim = cfg.q_dim();
        for g in self.segments {
            let (rows, ctx) = (g.row..g.row + g.tokens.len(), g.first_pos + g.tokens.len());
            let batch = Batch {
                q: &self.q[rows.start * q_dim..rows.end * q_dim],
                k: self.kv.stream_rows(g.pages, g.local, ctx, layer, 0),
                v: self.kv.stream_rows(g.pages, g.local, ctx, layer, 1),
                first_pos: g.first_pos,
                window,
                scale: cfg.score_scale(),
                heads: cfg.heads,
                kv_heads: cfg.kv_heads,
                head_dim: cfg.head_dim,
            };
            batch.run(&mut self.attn[rows.start * q_dim..rows.end * q_dim], self.attention);
        }
        Ok(())
    }

    fn add_attention_out(&mut self, o: &CpuWeight<'a>, post_norm: Option<&CpuWeight<'a>>) -> Result<()> {
        match post_norm {
            None => Self::project(self.tiles, self.n, o, self.attn, self.x, Write::Add),
            Some(w) => {
                // h (the normed input, read by now) holds the product before its norm.
                Self::project(self.tiles, self.n, o, self.attn, self.h, Write::Set);
                add_normed(self.x, self.h, w.values(), self.cfg.rms_eps);
            }
        }
        Ok(())
    }

    fn add_gated_ffn(
        &mut self,
        act: Activation,
        gate: &CpuWeight<'a>,
        up: &CpuWeight<'a>,
        down: &CpuWeight<'a>,
        post_norm: Option<&CpuWeight<'a>>,
    ) -> Result<()> {
        let (n, tiles) = (self.n, &mut *self.tiles);
        Self::project(tiles, n, gate, self.h, self.gate, Write::Set);
        Self::project(tiles, n, up, self.h, self.up, Write::Set);
        let f = match act {
            Activation::Silu => silu_times,
            Activation::GeluTanh => gelu_tanh_times,
        };
        for (g, &u) in self.gate.iter_mut().zip(self.up.iter()) {
            *g = f(*g, u);
        }
        match post_norm {
            None => Self::project(tiles, n, down, self.gate, self.x, Write::Add),
            Some(w) => {
                Self::project(tiles, n, down, self.gate, self.h, Write::Set);
                add_normed(self.x, self.h, w.values(), self.cfg.rms_eps);
            }
        }
        Ok(())
    }

    fn add_moe_ffn(
        &mut self,
        router: &CpuWeight<'a>,
        gate: &[CpuWeight<'a>],
        up: &[CpuWeight<'a>],
        down: &[CpuWeight<'a>],
    ) -> Result<()> {
        let moe = self.cfg.moe.expect("a model with a router has a Mixture-of-Experts config");
        let (n, hidden) = (self.n, self.cfg.hidden);
        MoeFfn {
            moe,
            hidden,
            n,
            h: self.h,
            x: self.x,
            gate: self.gate,
            up: self.up,
            tiles: self.tiles,
            s: self.moe,
            router,
            experts: [gate, up, down],
        }
        .run();
        Ok(())
    }
}

/// x += RMSNorm(y) with weight `w`, row by row (Gemma's norm of a block's output before the residual).
fn add_normed(x: &mut [f32], y: &mut [f32], w: &[f32], eps: f32) {
    for (x, y) in x.chunks_exact_mut(w.len()).zip(y.chunks_exact_mut(w.len())) {
        let inv_rms = inverse_rms(y, eps);
        for ((x, y), &g) in x.iter_mut().zip(y.iter()).zip(w) {
            *x += g * (*y * inv_rms);
        }
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
