//! The CPU backend's causal attention for a batch of tokens over a stream's cache, split across threads
//! in parts of one KV head and a few consecutive tokens. A part's queries share the KV rows they all
//! see, widened to f64 a block at a time while the block is in cache, and each query runs its softmax
//! over the blocks with a running max, so nothing grows with the context. The blocks are aligned to
//! positions, not to the part, so each output is the same sequence of f64 operations whichever part,
//! batch or thread computes it: batching and threads change no bit.
//!
//! The cache is read through `KvRows`, a stream's KV pages in position order: the blocks are aligned to
//! positions and a page holds a whole number of blocks, so each block's rows lie in one page. Rows are
//! stored in the cache's type (`kv::KvType`) and decoded as a block is widened, each value the one
//! `KvType::decode` gives.

use super::exp::{NORMAL, exp, exp_normal};
use super::parallel::{run_parts, threads_for};
use super::scratch::try_zeros;
use crate::kv::{self, KvType};
use crate::tensor::dot::{bf16_bits_to_f32, f16_bits_to_f32};

/// Queries a part holds at most: each KV block is read from cache once for all of them.
const PART_QUERIES: usize = 32;
/// Positions read by all of a part's queries together: 32 rows of one KV head stay in L1. A multiple
/// of SUM_LANES, so a block's weights fall in the lanes their positions name.
pub(super) const KEY_BLOCK: usize = 32;
/// Running sums of a softmax's weights, side by side: lane l adds the weights of positions l, l + 8, ...
const SUM_LANES: usize = 8;

/// One layer's K (or V) rows of a stream: its pages in position order, each `page_tokens` rows of
/// `kv_heads` heads of `head_dim` values in `ty` (one page of any length for a cache in one piece).
pub(super) struct KvRows<'a> {
    pub(super) pages: Vec<&'a [u8]>,
    pub(super) page_tokens: usize,
    pub(super) ty: KvType,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
}

impl KvRows<'_> {
    /// Bytes of one position's row (every head).
    fn row_bytes(&self) -> usize {
        self.kv_heads * self.ty.row_bytes(self.head_dim)
    }

    /// Positions the pages hold.
    fn positions(&self) -> usize {
        self.pages.len() * self.page_tokens
    }

    /// The rows of positions `range`, which lie in one page.
    #[inline(always)]
    fn rows(&self, range: std::ops::Range<usize>) -> &[u8] {
        let page = range.start / self.page_tokens;
        let first = page * self.page_tokens;
        assert!(range.end - first <= self.page_tokens, "attention: a block of rows crosses a page");
        let row = self.row_bytes();
        &self.pages[page][(range.start - first) * row..(range.end - first) * row]
    }

    /// Kv head `head`'s values in the rows of positions `range` (which lie in one page), each as
    /// `KvType::decode` gives it, widened into `out`: transposed (`out[d * KEY_BLOCK + t]`, the keys) or
    /// row by row (`out[t * head_dim + d]`, the values).
    #[inline(always)]
    fn widen(&self, range: std::ops::Range<usize>, head: usize, out: &mut [f64], transposed: bool) {
        let hd = self.head_dim;
        let head_bytes = self.ty.row_bytes(hd);
        let rows = self.rows(range).chunks_exact(self.row_bytes());
        // A decoded piece of a row (a block of the block types).
        let mut piece = [0f32; kv::BLOCK_VALUES];
        for (t, row) in rows.enumerate() {
            let h = &row[head * head_bytes..(head + 1) * head_bytes];
            let mut put = |from: usize, values: &[f32]| {
                if transposed {
                    for (i, &v) in values.iter().enumerate() {
                        out[(from + i) * KEY_BLOCK + t] = v as f64;
                    }
                } else {
                    for (o, &v) in out[t * hd + from..t * hd + from + values.len()].iter_mut().zip(values) {
                        *o = v as f64;
                    }
                }
            };
            match self.ty {
                KvType::F32 => {
                    // SAFETY: any 4 bytes are an f32; F32 rows sit at multiples of 4 in f32 storage, so the
                    // prefix is empty there (and the bytes are decoded one by one where it is not).
                    let (prefix, floats, _) = unsafe { h.align_to::<f32>() };
                    if prefix.is_empty() && floats.len() == hd {
                        put(0, floats);
                    } else {
                        for (k, c) in h.as_chunks::<{ 4 * kv::BLOCK_VALUES }>().0.iter().enumerate() {
                            for (p, b) in piece.iter_mut().zip(c.as_chunks::<4>().0) {
                                *p = f32::from_le_bytes(*b);
                            }
                            put(k * kv::BLOCK_VALUES, &piece);
                        }
                        let done = hd / kv::BLOCK_VALUES * kv::BLOCK_VALUES;
                        let tail = &h[done * 4..].as_chunks::<4>().0;
                        for (p, b) in piece.iter_mut().zip(tail.iter()) {
                            *p = f32::from_le_bytes(*b);
                        }
                        put(done, &piece[..tail.len()]);
                    }
                }
                KvType::Bf16 | KvType::F16 => {
                    let to_f32 = if self.ty == KvType::Bf16 { bf16_bits_to_f32 } else { f16_bits_to_f32 };
                    for (k, c) in h.as_chunks::<2>().0.chunks(kv::BLOCK_VALUES).enumerate() {
                        for (p, b) in piece.iter_mut().zip(c) {
                            *p = to_f32(u16::from_le_bytes(*b));
                        }
                        put(k * kv::BLOCK_VALUES, &piece[..c.len()]);
                    }
                }
                KvType::Q8_0 | KvType::Fp8E4m3 => {
                    let fp8 = self.ty == KvType::Fp8E4m3;
                    for (b, block) in h.as_chunks::<{ kv::BLOCK_BYTES }>().0.iter().enumerate() {
                        let bits = u16::from_le_bytes([block[0], block[1]]);
                        let scale = if fp8 { bf16_bits_to_f32(bits) } else { f16_bits_to_f32(bits) };
                        for (p, &code) in piece.iter_mut().zip(&block[2..]) {
                            *p = scale * if fp8 { kv::e4m3_value(code) } else { code as i8 as f32 };
                        }
                        put(b * kv::BLOCK_VALUES, &piece);
                    }
                }
            }
        }
    }
}

/// The queries and cache of one attention call: `tokens` consecutive tokens, the first at position
/// `first_pos`, each seeing the cache up to and including its own position (and, with a `window`, no
/// further back than that many positions, its own counted).
pub(super) struct Batch<'a> {
    /// [tokens][heads * head_dim]
    pub(super) q: &'a [f32],
    /// At least first_pos + tokens positions of kv_heads * head_dim.
    pub(super) k: KvRows<'a>,
    pub(super) v: KvRows<'a>,
    pub(super) first_pos: usize,
    pub(super) window: Option<usize>,
    /// The factor of every score (1/sqrt(head_dim) unless the model says otherwise).
    pub(super) scale: f64,
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
}

/// One thread's attention buffers, for one part at a time, in f64: its queries, a block of scores for
/// each, a block of keys (transposed) and of values, and each query's weighted sums, weight lanes and
/// running max.
pub(super) struct AttentionScratch {
    pub(super) queries: Vec<f64>,
    pub(super) scores: Vec<f64>,
    pub(super) keys: Vec<f64>,
    pub(super) values: Vec<f64>,
    pub(super) sums: Vec<f64>,
    pub(super) lanes: Vec<f64>,
    pub(super) maxes: Vec<f64>,
}

/// Tokens in one part at most, for `group` query heads a KV head.
fn part_tokens(group: usize) -> usize {
    (PART_QUERIES / group).max(1)
}

impl AttentionScratch {
    /// f64s of (queries, scores, keys, values, sums, lanes, maxes) for parts of `group` query heads.
    pub(super) fn lens(group: usize, head_dim: usize) -> [usize; 7] {
        let queries = part_tokens(group) * group;
        let (block, per_query) = (KEY_BLOCK * head_dim, queries * head_dim);
        [per_query, queries * KEY_BLOCK, block, block, per_query, queries * SUM_LANES, queries]
    }

    /// NO_ROOM where the host cannot give the buffers.
    pub(super) fn new(group: usize, head_dim: usize) -> crate::status::Result<AttentionScratch> {
        let [queries, scores, keys, values, sums, lanes, maxes] =
            Self::lens(group, head_dim).map(|n| try_zeros(n as u128));
        Ok(AttentionScratch {
            queries: queries?,
            scores: scores?,
            keys: keys?,
            values: values?,
            sums: sums?,
            lanes: lanes?,
            maxes: maxes?,
        })
    }
}

impl Batch<'_> {
    fn tokens(&self) -> usize {
        self.q.len() / (self.heads * self.head_dim)
    }

    /// Writes each token's attention output, [tokens][heads * head_dim], into `out`.
    pub(super) fn run(&self, out: &mut [f32], scratch: &mut [AttentionScratch]) {
        let (tokens, q_dim) = (self.tokens(), self.heads * self.head_dim);
        assert!(
            self.kv_heads > 0 && self.heads.is_multiple_of(self.kv_heads),
            "attention: heads must be a multiple of kv_heads"
        );
        assert_eq!(self.q.len(), tokens * q_dim, "attention: queries are not whole tokens");
        assert_eq!(out.len(), tokens * q_dim, "attention: output is not tokens x heads x head_dim");
        let ctx = self.first_pos + tokens;
        assert!(self.k.positions() >= ctx && self.v.positions() >= ctx, "attention: cache shorter than the batch");
        for kv in [&self.k, &self.v] {
            assert!(
                kv.kv_heads == self.kv_heads && kv.head_dim == self.head_dim,
                "attention: cache rows are not kv_heads x head_dim"
            );
            assert!(
                kv.pages.len() == 1 || kv.page_tokens.is_multiple_of(KEY_BLOCK),
                "attention: pages of {} positions split blocks of {KEY_BLOCK}",
                kv.page_tokens
            );
        }
        let group = self.heads / self.kv_heads;
        // Fewer tokens a part where that leaves too few parts to keep every thread busy.
        let per_part = (tokens * self.kv_heads / (2 * scratch.len()).max(1)).clamp(1, part_tokens(group));
        // One slice per (token, KV head): the outputs of that KV head's query heads for that token.
        let mut slices: Vec<Option<&mut [f32]>> = out.chunks_exact_mut(group * self.head_dim).map(Some).collect();
        let mut parts = Vec::with_capacity(tokens.div_ceil(per_part) * self.kv_heads);
        for first in (0..tokens).step_by(per_part) {
            for kv_head in 0..self.kv_heads {
                let outs = (first..tokens.min(first + per_part))
                    .map(|t| slices[t * self.kv_heads + kv_head].take().expect("each slice goes to one part"))
                    .collect();
                parts.push(Part { kv_head, first, outs });
            }
        }
        // The longest parts (the latest tokens) first, so the last part a thread takes is a short one.
        parts.reverse();
        let work = (tokens as u64) * (ctx as u64) * (q_dim as u64) * 2;
        let threads = threads_for(work, parts.len(), scratch.len());
        run_parts(parts, &mut scratch[..threads], |part, s| part.run(self, s));
    }
}

/// The queries of one KV head for tokens `first..first + outs.len()`, and where their outputs go.
struct Part<'o> {
    kv_head: usize,
    first: usize,
    outs: Vec<&'o mut [f32]>,
}

impl Part<'_> {
    fn run(self, b: &Batch, s: &mut AttentionScratch) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: this CPU has AVX2, the one feature `run_avx2` is compiled for.
            return unsafe { self.run_avx2(b, s) };
        }
        self.run_here(b, s)
    }

    /// `run_here` compiled for AVX2: four f64 lanes a vector, the same operations in the same order
    /// (no fused multiply-add), so the same bits.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn run_avx2(self, b: &Batch, s: &mut AttentionScratch) {
        self.run_here(b, s)
    }

    /// For each query, over the aligned blocks of KEY_BLOCK positions it sees (the last one cut at
    /// its own position, the first one's positions before its window given a score of -inf), in
    /// order: the block's scores q.k * scale (each dot from zero in dimension order); the running max raised to the block's, rescaling what is summed so far by
    /// e^(old - new); weights p_t = e^(score_t - max), added to SUM_LANES lanes by position; and each
    /// output column's sum of p_t v_t (from -0.0, in position order). The output is the sums over
    /// the lanes' total (combined pairwise). A query's blocks do not depend on the part it is in.
    #[inline(always)]
    fn run_here(self, b: &Batch, s: &mut AttentionScratch) {
        let (hd, group) = (b.head_dim, b.heads / b.kv_heads);
        let q_dim = b.heads * hd;
        let scale = b.scale;
        let queries = self.outs.len() * group;
        let n_ctx = |i: usize| b.first_pos + self.first + i / group + 1;
        // The first position query i sees.
        let from = |i: usize| b.window.map_or(0, |w| n_ctx(i).saturating_sub(w));
        let AttentionScratch { queries: widened, scores, keys, values, sums, lanes, maxes } = s;
        // Query i is head kv_head * group + i % group of token first + i / group, widened once.
        let widened = &mut widened[..queries * hd];
        for (i, out) in widened.chunks_exact_mut(hd).enumerate() {
            let (token, head) = (self.first + i / group, self.kv_head * group + i % group);
            for (o, &v) in out.iter_mut().zip(&b.q[token * q_dim + head * hd..token * q_dim + (head + 1) * hd]) {
                *o = v as f64;
            }
        }
        let query = |i: usize| &widened[i * hd..(i + 1) * hd];
        let scores = &mut scores[..queries * KEY_BLOCK];
        let (keys, values) = (&mut keys[..KEY_BLOCK * hd], &mut values[..KEY_BLOCK * hd]);
        let (sums, lanes, maxes) =
            (&mut sums[..queries * hd], &mut lanes[..queries * SUM_LANES], &mut maxes[..queries]);
        sums.fill(-0.0);
        lanes.fill(0.0);
        maxes.fill(f64::NEG_INFINITY);

        let last = n_ctx(queries - 1);
        // Blocks before the first query's window hold no position any query sees.
        for start in (from(0) / KEY_BLOCK * KEY_BLOCK..last).step_by(KEY_BLOCK) {
            // The block's rows that any query sees, widened once for all of them.
            let rows = start..last.min(start + KEY_BLOCK);
            b.k.widen(rows.clone(), self.kv_head, keys, true);
            b.v.widen(rows, self.kv_head, values, false);
            let seen = |i: usize| n_ctx(i).saturating_sub(start).min(KEY_BLOCK);
            // The block's rows before query i's window, which it scores -inf.
            let unseen = |i: usize| from(i).saturating_sub(start).min(KEY_BLOCK);
            let mut i = 0;
            while i < queries {
                let (len, skip) = (seen(i), unseen(i));
                let (scores, sums) = (&mut scores[i * KEY_BLOCK..], &mut sums[i * hd..]);
                let (lanes, maxes) = (&mut lanes[i * SUM_LANES..], &mut maxes[i..]);
                // Two queries that see the same rows (heads of one token) share each load of them.
                if i + 1 < queries && seen(i + 1) == len && unseen(i + 1) == skip {
                    if skip < len {
                        let (a, c) = scores.split_at_mut(KEY_BLOCK);
                        let (a, c) = (&mut a[..len], &mut c[..len]);
                        let (sa, sc) = sums.split_at_mut(hd);
                        let (la, lc) = lanes.split_at_mut(SUM_LANES);
                        key_dots([query(i), query(i + 1)], keys, scale, [&mut *a, &mut *c]);
                        a[..skip].fill(f64::NEG_INFINITY);
                        c[..skip].fill(f64::NEG_INFINITY);
                        to_weights(a, &mut maxes[0], la, sa);
                        to_weights(c, &mut maxes[1], &mut lc[..SUM_LANES], &mut sc[..hd]);
                        add_weighted([&*a, &*c], values, [sa, &mut sc[..hd]]);
                    }
                    i += 2;
                } else {
                    if skip < len {
                        let (w, sums) = (&mut scores[..len], &mut sums[..hd]);
                        key_dots([query(i)], keys, scale, [&mut *w]);
                        w[..skip].fill(f64::NEG_INFINITY);
                        to_weights(w, &mut maxes[0], &mut lanes[..SUM_LANES], sums);
                        add_weighted([&*w], values, [sums]);
                    }
                    i += 1;
                }
            }
        }

        let mut outs = self.outs;
        for (i, (sum, lanes)) in sums.chunks_exact(hd).zip(lanes.chunks_exact(SUM_LANES)).enumerate() {
            let total = combine_lanes(lanes);
            let out = &mut outs[i / group][(i % group) * hd..(i % group + 1) * hd];
            for (o, &acc) in out.iter_mut().zip(sum) {
                *o = (acc / total) as f32;
            }
        }
    }
}

/// Turns one block of a query's scores into its weights: raises the running `max` to the block's,
/// rescaling `lanes` and `sums` by e^(old - new) where it rises, then p = e^(score - max), each added
/// to the lane of its position (the block starts at a multiple of SUM_LANES).
#[inline(always)]
fn to_weights(scores: &mut [f64], max: &mut f64, lanes: &mut [f64], sums: &mut [f64]) {
    let (block_max, block_min) = score_range(scores);
    if block_max > *max {
        let factor = exp(*max - block_max);
        lanes.iter_mut().for_each(|l| *l *= factor);
        sums.iter_mut().for_each(|s| *s *= factor);
        *max = block_max;
    }
    let max = *max;
    // Where every weight is a normal number (the usual case), a pass of exps with no branch.
    if NORMAL.contains(&(block_min - max)) {
        scores.iter_mut().for_each(|x| *x = exp_normal(*x - max));
    } else {
        scores.iter_mut().for_each(|x| *x = exp(*x - max));
    }
    add_to_lanes(scores, lanes);
}

/// The largest and smallest of `scores`, four at a time (the max of numbers has no order to keep).
#[inline(always)]
fn score_range(scores: &[f64]) -> (f64, f64) {
    let (mut hi, mut lo) = ([f64::NEG_INFINITY; 4], [f64::INFINITY; 4]);
    let mut chunks = scores.chunks_exact(4);
    for chunk in &mut chunks {
        for j in 0..4 {
            hi[j] = hi[j].max(chunk[j]);
            lo[j] = lo[j].min(chunk[j]);
        }
    }
    for &x in chunks.remainder() {
        hi[0] = hi[0].max(x);
        lo[0] = lo[0].min(x);
    }
    (hi.into_iter().fold(f64::NEG_INFINITY, f64::max), lo.into_iter().fold(f64::INFINITY, f64::min))
}

/// Adds weights[j] to lane j % SUM_LANES (the weights start at a position that is a multiple of it).
#[inline(always)]
fn add_to_lanes(weights: &[f64], lanes: &mut [f64]) {
    let mut chunks = weights.chunks_exact(SUM_LANES);
    for chunk in &mut chunks {
        for (lane, &w) in lanes.iter_mut().zip(chunk) {
            *lane += w;
        }
    }
    for (lane, &w) in lanes.iter_mut().zip(chunks.remainder()) {
        *lane += w;
    }
}

/// The lanes' sum, pairwise in a fixed order.
fn combine_lanes(lanes: &[f64]) -> f64 {
    let [a, b, c, d, e, f, g, h] = lanes.try_into().expect("SUM_LANES lanes");
    ((a + b) + (c + d)) + ((e + f) + (g + h))
}

/// outs[i][t] = dot(qs[i], key t) * scale for the keys of a transposed block (outs[i].len() of them),
/// each dot from zero in dimension order; sixteen, then four, then one key at a time side by side.
#[inline(always)]
fn key_dots<const Q: usize>(qs: [&[f64]; Q], keys: &[f64], scale: f64, mut outs: [&mut [f64]; Q]) {
    let (len, mut t) = (outs[0].len(), 0);
    while t < len {
        t += match len - t {
            16.. => key_columns::<Q, 16>(&qs, keys, t, scale, &mut outs),
            4.. => key_columns::<Q, 4>(&qs, keys, t, scale, &mut outs),
            _ => key_columns::<Q, 1>(&qs, keys, t, scale, &mut outs),
        };
    }
}
/// `key_dots` for the `W` keys from `t`; returns `W`.
#[inline(always)]
fn key_columns<const Q: usize, const W: usize>(
    qs: &[&[f64]; Q],
    keys: &[f64],
    t: usize,
    scale: f64,
    outs: &mut [&mut [f64]; Q],
) -> usize {
    let mut acc = [[0f64; W]; Q];
    for (d, row) in keys.chunks_exact(KEY_BLOCK).take(qs[0].len()).enumerate() {
        let k: &[f64; W] = row[t..t + W].try_into().expect("W keys");
        for (acc, q) in acc.iter_mut().zip(qs) {
            let qd = q[d];
            for j in 0..W {
                acc[j] += qd * k[j];
            }
        }
    }
    for (out, acc) in outs.iter_mut().zip(acc) {
        for (o, a) in out[t..t + W].iter_mut().zip(acc) {
            *o = a * scale;
        }
    }
    W
}

/// sums[i][d] += weights[i][t] * values[t][d] for t in order (values: rows of sums[i].len());
/// columns go sixteen, then four, then one at a time, their sums in registers across the rows.
#[inline(always)]
fn add_weighted<const Q: usize>(weights: [&[f64]; Q], values: &[f64], mut sums: [&mut [f64]; Q]) {
    let (width, mut d) = (sums[0].len(), 0);
    while d < width {
        d += match width - d {
            16.. => add_columns::<Q, 16>(&weights, values, d, &mut sums),
            4.. => add_columns::<Q, 4>(&weights, values, d, &mut sums),
            _ => add_columns::<Q, 1>(&weights, values, d, &mut sums),
        };
    }
}

/// `add_weighted` for the `W` columns from `d`; returns `W`.
#[inline(always)]
fn add_columns<const Q: usize, const W: usize>(
    weights: &[&[f64]; Q],
    values: &[f64],
    d: usize,
    sums: &mut [&mut [f64]; Q],
) -> usize {
    let width = sums[0].len();
    let mut acc: [[f64; W]; Q] = std::array::from_fn(|i| sums[i][d..d + W].try_into().expect("W sums"));
    for (t, row) in values.chunks_exact(width).take(weights[0].len()).enumerate() {
        let v: &[f64; W] = row[d..d + W].try_into().expect("W columns");
        for (acc, w) in acc.iter_mut().zip(weights) {
            let p = w[t];
            for j in 0..W {
                acc[j] += p * v[j];
            }
        }
    }
    for (sum, acc) in sums.iter_mut().zip(acc) {
        sum[d..d + W].copy_from_slice(&acc);
    }
    W
}
