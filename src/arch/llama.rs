//! Llama and its two descendants that differ only in optional tensors: Qwen2 (biases on the q, k and v
//! products) and Qwen3 (an RMSNorm over each head of q and k before the rotation). One graph, as
//! llama.cpp's llama builder serves all three: a tensor the file lacks is an operand left out.

use super::{Feeds, Ops};
use crate::model::{names, weight_table};
use crate::status::Result;

// The tensor list: one decoder layer's weights, their shapes in the config's dimensions, and which models
// carry them. Checkpoint validation, both loaders and `forward` below read it.
weight_table! {
    /// RMSNorm weight before attention.
    attn_norm: names::ATTN_NORM, [Hidden], Always;
    q: names::Q, [QDim, Hidden], Always;
    k: names::K, [KvDim, Hidden], Always;
    v: names::V, [KvDim, Hidden], Always;
    q_bias: names::Q_BIAS, [QDim], QkvBias;
    k_bias: names::K_BIAS, [KvDim], QkvBias;
    v_bias: names::V_BIAS, [KvDim], QkvBias;
    /// RMSNorm weight over each head of q, before the rotation.
    q_norm: names::Q_NORM, [HeadDim], QkNorm;
    k_norm: names::K_NORM, [HeadDim], QkNorm;
    o: names::O, [Hidden, QDim], Always;
    /// RMSNorm weight before the feed-forward block.
    ffn_norm: names::FFN_NORM, [Hidden], Always;
    gate: names::GATE, [Intermediate, Hidden], Always;
    up: names::UP, [Intermediate, Hidden], Always;
    down: names::DOWN, [Hidden, Intermediate], Always;
}

/// Pre-norm attention with grouped KV heads and rotary positions, then a pre-norm SwiGLU feed-forward,
/// each added to the residual rows.
pub fn forward<O: Ops>(ops: &mut O, layers: &[LayerWeights<O::Weight>]) -> Result<()> {
    ops.embed()?;
    for (l, w) in layers.iter().enumerate() {
        ops.norm(&w.attn_norm, Feeds::Cache)?;
        let bias = match (&w.q_bias, &w.k_bias, &w.v_bias) {
            (Some(q), Some(k), Some(v)) => Some([q, k, v]),
            _ => None,
        };
        ops.qkv(&w.q, &w.k, &w.v, bias)?;
        let head_norms = match (&w.q_norm, &w.k_norm) {
            (Some(q), Some(k)) => Some([q, k]),
            _ => None,
        };
        ops.rope_append(l, head_norms)?;
        ops.attention(l)?;
        ops.add_attention_out(&w.o)?;

        ops.norm(&w.ffn_norm, Feeds::Product)?;
        ops.add_swiglu_ffn(&w.gate, &w.up, &w.down)?;
    }
    Ok(())
}
