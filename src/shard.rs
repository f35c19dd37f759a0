//! Tensor parallelism's shard rules: which rows and columns of every weight each of N ranks (devices)
//! holds, checked against the model's head counts and each matrix's block format. Pure: no device, no
//! file; the multi-device loader, the per-device fit and the CPU proof of the split
//! (`tests/tp_split.rs`) all read it. `RankSource` is one rank's model as a loader reads it. ARCHITECTURE.md's "Tensor parallelism" is the design.
//!
//! A weight's cut follows from its shape in the architecture's `weight_table!` (`Dim`s), so a new
//! weight needs no entry here:
//! - `QDim` rows (q and its bias) by the rank's query heads, `KvDim` rows by the KV heads those read;
//! - `QDim` columns (o) by the rank's query heads: it reads only its own attention output;
//! - `Intermediate` / `ExpertIntermediate` rows (gate, up) and columns (down) by the rank's range of
//!   the feed-forward's width, cut in units of the largest block of any matrix cut by its columns;
//! - `Vocab` rows of the untied head by `ceil(vocab / N)` chunks (an all-gather of equal chunks puts
//!   each rank's logits at its offset); the embedding stays whole (every rank gathers any row), and a
//!   tied head reads the rank's vocabulary rows of it (`ShardPlan::head`);
//! - anything else (norms, q/k norms, the router) whole on every rank.
//!
//! A vector's values are its columns here, as `model::shape_cols` counts them.

use std::ops::Range;

use crate::model::{Dim, EMBED_WEIGHT, ModelConfig, TensorRef, Weight, shape_cols, shape_rows, weight_list};
use crate::status::Result;
use crate::tensor::DType;
use crate::{bail, err};

/// The dimension of the model a cut follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    QueryHeads,
    KvHeads,
    Ffn,
    ExpertFfn,
    Vocab,
}

/// How a weight is cut across the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Every rank holds all of it.
    Whole,
    /// Each rank holds a range of its rows.
    Rows(Part),
    /// Each rank holds a range of its columns (a vector: of its values).
    Cols(Part),
}

fn part_of(dim: Dim) -> Option<Part> {
    match dim {
        Dim::QDim => Some(Part::QueryHeads),
        Dim::KvDim => Some(Part::KvHeads),
        Dim::Intermediate => Some(Part::Ffn),
        Dim::ExpertIntermediate => Some(Part::ExpertFfn),
        Dim::Vocab => Some(Part::Vocab),
        Dim::Hidden | Dim::HeadDim | Dim::Experts => None,
    }
}

/// The cut of `w`, from its table shape; UNSUPPORTED naming it when both dimensions would be cut.
pub fn cut_of(w: &Weight) -> Result<Cut> {
    if w.spec.role == EMBED_WEIGHT.role {
        return Ok(Cut::Whole);
    }
    Ok(match *w.spec.shape {
        [d] => part_of(d).map_or(Cut::Whole, Cut::Cols),
        [r, c] => match (part_of(r), part_of(c)) {
            (None, None) => Cut::Whole,
            (Some(p), None) => Cut::Rows(p),
            (None, Some(p)) if p != Part::Vocab && p != Part::KvHeads => Cut::Cols(p),
            _ => bail!(Unsupported, "tensor parallelism: {} ({:?}) has no rule to cut it", w.name, w.spec.shape),
        },
        _ => bail!(Unsupported, "tensor parallelism: {} has {} dimensions", w.name, w.spec.shape.len()),
    })
}

/// What one rank holds of each dimension the cuts follow (in heads, or in rows of the width).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankShare {
    pub q_heads: Range<usize>,
    /// The KV heads its query heads read; a KV head appears on several ranks when there are more ranks
    /// than KV heads.
    pub kv_heads: Range<usize>,
    pub ffn: Range<usize>,
    /// Of each expert's width; empty for a dense model.
    pub expert_ffn: Range<usize>,
    pub vocab: Range<usize>,
}

/// The rows and columns of a tensor one rank holds (its `TensorRef::rows` / `cols`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slice {
    pub rows: Range<usize>,
    pub cols: Range<usize>,
}

impl Slice {
    /// The slice's bytes in `dtype`; None when its columns are not whole blocks.
    pub fn bytes(&self, dtype: DType) -> Option<u64> {
        Some(self.rows.len() as u64 * dtype.row_bytes(self.cols.len())? as u64)
    }
}

/// Every rank's share of a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    head_dim: usize,
    hidden: usize,
    ranks: Vec<RankShare>,
}

/// `total` cut in `unit`s dealt out as evenly as they go, the first ranks one unit more.
fn deal(total: usize, unit: usize, world: usize) -> Vec<Range<usize>> {
    let units = total / unit;
    let (each, extra) = (units / world, units % world);
    let mut start = 0;
    (0..world)
        .map(|r| {
            let len = (each + usize::from(r < extra)) * unit;
            start += len;
            start - len..start
        })
        .collect()
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

impl ShardPlan {
    /// The shares of the model `cfg` over `world` ranks, its matrices in the formats `dtype_of` gives.
    /// INVALID_ARGUMENT for no ranks; UNSUPPORTED, naming the counts or the tensor, for a model the
    /// rules cannot cut that many ways.
    pub fn new(cfg: &ModelConfig, world: usize, dtype_of: impl Fn(&Weight) -> DType) -> Result<ShardPlan> {
        if world == 0 {
            bail!(InvalidArgument, "tensor parallelism over 0 devices");
        }
        let over = format!("tensor parallelism over {world} devices");
        if !cfg.heads.is_multiple_of(world) {
            bail!(Unsupported, "{over}: the model's {} attention heads do not split evenly", cfg.heads);
        }
        if !(cfg.kv_heads.is_multiple_of(world) || world.is_multiple_of(cfg.kv_heads)) {
            bail!(
                Unsupported,
                "{over}: the model's {} KV heads neither split evenly nor divide the devices",
                cfg.kv_heads
            );
        }
        let weights = weight_list(cfg);
        let cuts = weights.iter().map(|w| Ok((w, cut_of(w)?))).collect::<Result<Vec<_>>>()?;
        // A width's unit: the least common multiple of the blocks of the matrices cut by its columns.
        let unit = |part: Part| {
            cuts.iter()
                .filter(|(_, c)| *c == Cut::Cols(part))
                .map(|(w, _)| dtype_of(w).format().block_values)
                .fold(1, |a, b| a / gcd(a, b) * b)
        };
        let width = |part: Part, total: usize, what: &str| -> Result<Vec<Range<usize>>> {
            if total == 0 {
                return Ok(vec![0..0; world]);
            }
            let unit = unit(part);
            if !total.is_multiple_of(unit) {
                bail!(InvalidArgument, "{over}: the {what} width {total} is not whole blocks of {unit} values");
            }
            if total / unit < world {
                bail!(
                    Unsupported,
                    "{over}: the {what} width {total} is {} blocks of {unit} values (its down matrices' format), fewer than the devices",
                    total / unit
                );
            }
            Ok(deal(total, unit, world))
        };
        let ffn = width(Part::Ffn, if cfg.moe.is_none() { cfg.intermediate } else { 0 }, "feed-forward")?;
        let expert_ffn = width(Part::ExpertFfn, cfg.moe.map_or(0, |m| m.intermediate), "expert")?;
        let chunk = cfg.vocab.div_ceil(world);
        if (world - 1) * chunk >= cfg.vocab {
            bail!(Unsupported, "{over}: a vocabulary of {} leaves the last device no rows", cfg.vocab);
        }
        let (per_rank, group) = (cfg.heads / world, cfg.heads / cfg.kv_heads);
        let ranks = (0..world)
            .map(|r| {
                let q = r * per_rank..(r + 1) * per_rank;
                RankShare {
                    kv_heads: q.start / group..(q.end - 1) / group + 1,
                    q_heads: q,
                    ffn: ffn[r].clone(),
                    expert_ffn: expert_ffn[r].clone(),
                    vocab: r * chunk..((r + 1) * chunk).min(cfg.vocab),
                }
            })
            .collect();
        let plan = ShardPlan { head_dim: cfg.head_dim, hidden: cfg.hidden, ranks };
        // Every column cut on block boundaries (o's every heads/N x head_dim columns above all).
        for (w, cut) in &cuts {
            let Cut::Cols(_) = cut else { continue };
            let dtype = dtype_of(w);
            let block = dtype.format().block_values;
            for r in 0..world {
                let s = plan.slice(r, w)?;
                if !s.cols.start.is_multiple_of(block) || !s.cols.end.is_multiple_of(block) {
                    bail!(
                        Unsupported,
                        "{over}: {} ({}) would be cut at columns {}..{}, not whole blocks of {block} values",
                        w.name,
                        dtype.name(),
                        s.cols.start,
                        s.cols.end
                    );
                }
            }
        }
        Ok(plan)
    }

    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    pub fn rank(&self, rank: usize) -> &RankShare {
        &self.ranks[rank]
    }

    /// The range of `part`'s rows (or columns) rank `rank` holds.
    pub fn range(&self, rank: usize, part: Part) -> Range<usize> {
        let s = &self.ranks[rank];
        let heads = |h: &Range<usize>| h.start * self.head_dim..h.end * self.head_dim;
        match part {
            Part::QueryHeads => heads(&s.q_heads),
            Part::KvHeads => heads(&s.kv_heads),
            Part::Ffn => s.ffn.clone(),
            Part::ExpertFfn => s.expert_ffn.clone(),
            Part::Vocab => s.vocab.clone(),
        }
    }

    /// What rank `rank` holds of `w` (a weight of the model the plan was made for).
    pub fn slice(&self, rank: usize, w: &Weight) -> Result<Slice> {
        if rank >= self.world() {
            bail!(InvalidArgument, "rank {rank} of {} devices", self.world());
        }
        let (n_rows, n_cols) = (shape_rows(&w.shape), shape_cols(&w.shape));
        let (rows, cols) = (0..n_rows, 0..n_cols);
        let s = match cut_of(w)? {
            Cut::Whole => Slice { rows, cols },
            Cut::Rows(p) => Slice { rows: self.range(rank, p), cols },
            Cut::Cols(p) => Slice { rows, cols: self.range(rank, p) },
        };
        if s.rows.end > n_rows || s.cols.end > n_cols {
            bail!(
                InvalidArgument,
                "{} of shape {:?} is not a weight of the model the shards were made for",
                w.name,
                w.shape
            );
        }
        Ok(s)
    }

    /// Rank `rank`'s weights as stored (the model `cfg` the plan was made for, its formats from
    /// `dtype_of`): its slices of the cut weights and every whole one, the embedding included; the
    /// per-device fit's `weight_bytes` before a backend's own layout.
    pub fn weight_bytes(&self, rank: usize, cfg: &ModelConfig, dtype_of: impl Fn(&Weight) -> DType) -> Result<u64> {
        let mut sum = 0u64;
        for w in weight_list(cfg) {
            let dtype = dtype_of(&w);
            let bytes = self.slice(rank, &w)?.bytes(dtype);
            sum += bytes
                .ok_or_else(|| err!(InvalidArgument, "{}: its slice is not whole {} blocks", w.name, dtype.name()))?;
        }
        Ok(sum)
    }

    /// The output head's rows on rank `rank`: its vocabulary range, of the untied head or of the
    /// embedding when tied.
    pub fn head(&self, rank: usize) -> Slice {
        Slice { rows: self.ranks[rank].vocab.clone(), cols: 0..self.hidden }
    }
}

/// The bytes of `s` out of `t`: the row range, and within each row the byte range of the column range.
/// INVALID_ARGUMENT when the slice leaves the tensor or cuts a block.
pub fn take(t: &TensorRef, s: &Slice) -> Result<Vec<u8>> {
    let (rows, cols) = (t.rows(), t.cols());
    if s.rows.start > s.rows.end || s.rows.end > rows || s.cols.start > s.cols.end || s.cols.end > cols {
        bail!(InvalidArgument, "slice {s:?} of a {rows} x {cols} tensor");
    }
    let f = t.dtype.format();
    if !s.cols.start.is_multiple_of(f.block_values) || !s.cols.end.is_multiple_of(f.block_values) {
        bail!(InvalidArgument, "columns {:?} cut {} blocks of {} values", s.cols, f.name, f.block_values);
    }
    let row_bytes = t.dtype.row_bytes(cols).ok_or_else(|| err!(InvalidArgument, "{cols} columns in {}", f.name))?;
    let (first, last) = (s.cols.start / f.block_values * f.block_bytes, s.cols.end / f.block_values * f.block_bytes);
    let mut out = Vec::with_capacity(s.rows.len() * (last - first));
    for r in s.rows.clone() {
        out.extend_from_slice(&t.bytes[r * row_bytes + first..r * row_bytes + last]);
    }
    Ok(out)
}

/// UNSUPPORTED for one rank's share of a model (`RankSource`), which a loader of whole models would
/// run as a smaller model, its head the wrong rows.
pub fn refuse_rank(src: &dyn crate::model::TensorSource) -> Result<()> {
    match src.rank_head() {
        Some(rows) => bail!(
            Unsupported,
            "one device's share of a tensor-parallel model (its head the vocabulary ids {}..{}) runs only beside the other devices' shares",
            rows.start,
            rows.end
        ),
        None => Ok(()),
    }
}

mod source;
pub use source::{RANK_HEAD, RankSource, rank_config};

#[cfg(test)]
mod tests;
