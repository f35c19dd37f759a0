//! The CPU's Mixture-of-Experts feed-forward (`Ops::add_moe_ffn`): each row's router logits, its top-k
//! experts and their weights, then expert by expert the rows that chose it gathered into one batch
//! through the expert's SwiGLU (each product split across threads by `matmul`), and each row's outputs
//! summed in ascending expert order, as transformers sums them. A row's result is the same bits in any
//! batch: its choice reads its own logits only, the product gives each token the bits of its own
//! matrix-vector product, and its sum's order is its own experts' order.

use super::exp::exp;
use super::matmul::{self, RowTile, Write};
use super::{CpuWeight, silu_times};
use crate::model::MoeConfig;

/// A pass's buffers for the experts, for up to `tokens` rows: the router's logits, each row's chosen
/// experts, and the gathered inputs, one expert's outputs and the rows' weighted sums.
pub(super) struct MoeScratch {
    pub(super) logits: Vec<f32>,
    pub(super) chosen: Vec<(usize, f32)>,
    pub(super) input: Vec<f32>,
    pub(super) output: Vec<f32>,
    pub(super) sum: Vec<f32>,
    /// The rows of the pass that chose the expert at hand, with their weights for it.
    pub(super) rows: Vec<(usize, f32)>,
}

impl MoeScratch {
    /// Values of each buffer for `tokens` rows of `hidden` (logits, chosen, input/output/sum each).
    pub(super) fn lens(moe: Option<MoeConfig>, tokens: u128, hidden: u128) -> [u128; 3] {
        match moe {
            None => [0; 3],
            Some(m) => [tokens * m.experts as u128, tokens * m.used as u128, tokens * hidden],
        }
    }

    pub(super) fn new(moe: Option<MoeConfig>, tokens: usize, hidden: usize) -> crate::status::Result<MoeScratch> {
        use super::scratch::try_filled;
        let [logits, chosen, rows] = MoeScratch::lens(moe, tokens as u128, hidden as u128);
        Ok(MoeScratch {
            logits: try_filled(logits, 0.0)?,
            chosen: try_filled(chosen, (0, 0.0))?,
            input: try_filled(rows, 0.0)?,
            output: try_filled(rows, 0.0)?,
            sum: try_filled(rows, 0.0)?,
            rows: Vec::new(),
        })
    }
}

/// The experts a row of router logits chooses, with their weights: the `out.len()` largest logits
/// (ties to the lower index) in ascending expert order, each weighted by its softmax probability over
/// every expert, or over the chosen ones with `norm_topk` (which is the softmax of their logits alone).
/// The softmax in f64, the weights rounded to f32 once.
pub(super) fn choose(logits: &[f32], norm_topk: bool, out: &mut [(usize, f32)]) {
    let k = out.len();
    assert!(k > 0 && k <= logits.len(), "choose: top-k of {k} out of {} experts", logits.len());
    // The k best so far, best first: a row's own order, whatever the pass holds.
    let mut best: Vec<usize> = Vec::with_capacity(k + 1);
    for (e, &l) in logits.iter().enumerate() {
        let at = best.iter().position(|&b| l > logits[b]).unwrap_or(best.len());
        if at < k {
            best.insert(at, e);
            best.truncate(k);
        }
    }
    let max = logits[best[0]] as f64;
    let share = |e: usize| exp(logits[e] as f64 - max);
    let total: f64 = if norm_topk {
        best.iter().map(|&e| share(e)).sum()
    } else {
        logits.iter().map(|&l| exp(l as f64 - max)).sum()
    };
    best.sort_unstable();
    for (o, &e) in out.iter_mut().zip(&best) {
        *o = (e, (share(e) / total) as f32);
    }
}

/// The operation's buffers and operands: `h` the pass's `n` normed rows, `x` the residual rows it adds
/// onto, `gate` and `up` room for n rows of an expert's width.
pub(super) struct MoeFfn<'p, 'a> {
    pub moe: MoeConfig,
    pub hidden: usize,
    pub n: usize,
    pub h: &'p [f32],
    pub x: &'p mut [f32],
    pub gate: &'p mut [f32],
    pub up: &'p mut [f32],
    pub tiles: &'p mut [RowTile],
    pub s: &'p mut MoeScratch,
    pub router: &'p CpuWeight<'a>,
    pub experts: [&'p [CpuWeight<'a>]; 3],
}

impl MoeFfn<'_, '_> {
    pub(super) fn run(self) {
        let MoeFfn { moe, hidden, n, h, x, gate, up, tiles, s, router, experts: [gates, ups, downs] } = self;
        let (experts, k, width) = (moe.experts, moe.used, moe.intermediate);
        let logits = &mut s.logits[..n * experts];
        matmul::matmul(router.matrix(), h, n, logits, Write::Set, tiles);
        let chosen = &mut s.chosen[..n * k];
        for (row, out) in logits.chunks_exact(experts).zip(chosen.chunks_exact_mut(k)) {
            choose(row, moe.norm_topk, out);
        }
        let sum = &mut s.sum[..n * hidden];
        sum.fill(0.0);
        for e in 0..experts {
            s.rows.clear();
            for (r, choices) in chosen.chunks_exact(k).enumerate() {
                if let Some(&(_, w)) = choices.iter().find(|c| c.0 == e) {
                    s.rows.push((r, w));
                }
            }
            let m = s.rows.len();
            if m == 0 {
                continue;
            }
            let input = &mut s.input[..m * hidden];
            for (dst, &(r, _)) in input.chunks_exact_mut(hidden).zip(&s.rows) {
                dst.copy_from_slice(&h[r * hidden..(r + 1) * hidden]);
            }
            let (g, u) = (&mut gate[..m * width], &mut up[..m * width]);
            matmul::matmul(gates[e].matrix(), input, m, g, Write::Set, tiles);
            matmul::matmul(ups[e].matrix(), input, m, u, Write::Set, tiles);
            for (g, &u) in g.iter_mut().zip(u.iter()) {
                *g = silu_times(*g, u);
            }
            let output = &mut s.output[..m * hidden];
            matmul::matmul(downs[e].matrix(), g, m, output, Write::Set, tiles);
            for (out, &(r, w)) in output.chunks_exact(hidden).zip(&s.rows) {
                for (acc, &o) in sum[r * hidden..(r + 1) * hidden].iter_mut().zip(out) {
                    *acc += o * w;
                }
            }
        }
        for (x, &y) in x.iter_mut().zip(sum.iter()) {
            *x += y;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::choose;

    #[test]
    fn the_top_k_are_the_largest_logits_in_expert_order_with_softmax_weights() {
        let logits = [0.5f32, 2.0, -1.0, 2.0, 1.0];
        let mut out = [(0, 0f32); 3];
        choose(&logits, false, &mut out);
        // 2.0 twice (both taken), then 1.0; in ascending expert order.
        assert_eq!(out.map(|c| c.0), [1, 3, 4]);
        let total: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        for (e, w) in out {
            assert!((w as f64 - (logits[e] as f64).exp() / total).abs() < 1e-7, "expert {e}: {w}");
        }
        choose(&logits, true, &mut out);
        let chosen: f64 = [1, 3, 4].iter().map(|&e| (logits[e] as f64).exp()).sum();
        for (e, w) in out {
            assert!((w as f64 - (logits[e] as f64).exp() / chosen).abs() < 1e-7, "expert {e}: {w}");
        }
        // A tie at the cut goes to the lower index.
        let mut two = [(0, 0f32); 2];
        choose(&[1.0, 3.0, 1.0, 1.0], true, &mut two);
        assert_eq!(two.map(|c| c.0), [0, 1]);
    }
}
