//! One rank's model as a `TensorSource`: the rank's slices of the cut weights under their canonical
//! names, the whole weights read through from the model's own source, and the rank's rows of the output
//! head under `RANK_HEAD`. Its config is the model with the rank's heads and widths, so every loader's
//! shape checks (`ModelWeights::read`) hold for the slices as they hold for a whole model; a backend
//! that runs ranks loads each device from one of these.

use std::collections::HashMap;
use std::ops::Range;

use super::{ShardPlan, take};
use crate::model::{ModelConfig, TensorRef, TensorSource, names, weight_list};
use crate::status::Result;
use crate::tensor::DType;
use crate::{bail, err};

/// The name a rank's source gives its rows of the output head (`RankSource::head_rows`): the untied
/// head's vocabulary rows, or the embedding's when tied. No checkpoint uses it.
pub const RANK_HEAD: &str = "tensor_parallel.head.weight";

/// A cut weight's slice, as the rank holds it.
struct Sliced {
    dtype: DType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

/// Rank `rank`'s model out of `base` (see the module note).
pub struct RankSource<'a> {
    base: &'a dyn TensorSource,
    cfg: ModelConfig,
    rank: usize,
    world: usize,
    head_rows: Range<usize>,
    sliced: HashMap<String, Sliced>,
}

/// The model `cfg` as rank `rank` of `plan` runs it: its query and KV heads, its range of the
/// feed-forward's (or each expert's) width, and a head of its own (`tied`, so no loader asks for
/// `lm_head`; `RANK_HEAD` is the head).
pub fn rank_config(cfg: &ModelConfig, plan: &ShardPlan, rank: usize) -> ModelConfig {
    let share = plan.rank(rank);
    let mut out = cfg.clone();
    out.heads = share.q_heads.len();
    out.kv_heads = share.kv_heads.len();
    if let Some(moe) = out.moe.as_mut() {
        moe.intermediate = share.expert_ffn.len();
    } else {
        out.intermediate = share.ffn.len();
    }
    out.tied = true;
    out
}

fn copy_of(t: &TensorRef, s: &super::Slice) -> Result<Sliced> {
    let shape = if t.shape.len() == 1 { vec![s.cols.len()] } else { vec![s.rows.len(), s.cols.len()] };
    Ok(Sliced { dtype: t.dtype, shape, bytes: take(t, s)? })
}

impl<'a> RankSource<'a> {
    /// Copies rank `rank`'s slices of every cut weight of `base` (the model `plan` was made for) and of
    /// its head; the whole weights stay in `base`. BAD_MODEL naming a tensor `base` lacks.
    pub fn new(base: &'a dyn TensorSource, plan: &ShardPlan, rank: usize) -> Result<RankSource<'a>> {
        let cfg = base.config();
        if rank >= plan.world() {
            bail!(InvalidArgument, "rank {rank} of {} devices", plan.world());
        }
        let mut sliced = HashMap::new();
        // The untied head is the rank's `RANK_HEAD`, not a weight of its config.
        for w in weight_list(cfg).into_iter().filter(|w| w.name != names::LM_HEAD) {
            let s = plan.slice(rank, &w)?;
            if s.rows.len() == super::shape_rows(&w.shape) && s.cols.len() == super::shape_cols(&w.shape) {
                continue;
            }
            let t = base.tensor(&w.name)?.check(&w.name, &w.shape)?;
            sliced.insert(w.name.clone(), copy_of(&t, &s)?);
        }
        let head_name = if cfg.tied { names::EMBED } else { names::LM_HEAD };
        let head = base.tensor(head_name)?.check(head_name, &[cfg.vocab, cfg.hidden])?;
        let head_rows = plan.head(rank).rows;
        sliced.insert(RANK_HEAD.into(), copy_of(&head, &plan.head(rank))?);
        Ok(RankSource { base, cfg: rank_config(cfg, plan, rank), rank, world: plan.world(), head_rows, sliced })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// The vocabulary ids the rank's head computes: its logits are those ids' (the all-gather puts them
    /// at this offset of the row).
    pub fn head_rows(&self) -> Range<usize> {
        self.head_rows.clone()
    }

    /// Host bytes the rank's copies of its slices hold.
    pub fn copied_bytes(&self) -> u64 {
        self.sliced.values().map(|s| s.bytes.len() as u64).sum()
    }
}

impl TensorSource for RankSource<'_> {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        if let Some(s) = self.sliced.get(name) {
            return Ok(TensorRef { dtype: s.dtype, shape: &s.shape, bytes: &s.bytes });
        }
        if name == names::LM_HEAD {
            return Err(err!(BadModel, "rank {} holds its rows of the head as {RANK_HEAD}", self.rank));
        }
        self.base.tensor(name)
    }

    fn rank_head(&self) -> Option<Range<usize>> {
        Some(self.head_rows())
    }
}
