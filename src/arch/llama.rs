//! Llama and its two descendants that differ only in optional tensors: Qwen2 (biases on the q, k and v
//! products) and Qwen3 (an RMSNorm over each head of q and k before the rotation). One graph, as
//! llama.cpp's llama builder serves all three: a tensor the file lacks is an operand left out.

use super::{Feeds, Ops, Rotary};
use crate::model::{Activation, names, weight_table};
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
        ops.rope_append(l, head_norms, Rotary::Global)?;
        ops.attention(l, None)?;
        ops.add_attention_out(&w.o, None)?;

        ops.norm(&w.ffn_norm, Feeds::Product)?;
        ops.add_gated_ffn(Activation::Silu, &w.gate, &w.up, &w.down, None)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{Layers, recorder::Recorder};
    use crate::model::{Arch, ModelConfig, RopeScaling};

    fn config(arch: Arch) -> ModelConfig {
        let t = arch.traits();
        ModelConfig {
            arch,
            vocab: 10,
            hidden: 8,
            layers: 2,
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            intermediate: 16,
            rms_eps: 1e-6,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::None,
            rope_interleaved: false,
            max_position: 32,
            tied: true,
            qkv_bias: t.qkv_bias,
            qk_norm: t.qk_norm,
            attention: Default::default(),
            bos: None,
            eos: None,
        }
    }

    /// Each architecture's pass as the registry runs it: every layer's operations in order, with the
    /// optional operands its tensor list gives it and no others.
    #[test]
    fn each_architecture_passes_its_own_tensors_in_order() {
        for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
            let cfg = config(arch);
            let layers = Layers::build(&cfg, |w| Ok(w.name.clone())).unwrap();
            assert!(matches!(layers, Layers::Llama(_)), "{arch:?}");
            let mut ops = Recorder(Vec::new());
            crate::arch::forward(&cfg, &mut ops, &layers).unwrap();
            let mut want = vec!["embed".to_string()];
            for l in 0..cfg.layers {
                let n = |part: &str| crate::model::names::layer(l, part);
                let bias = arch == Arch::Qwen2;
                let head_norms = arch == Arch::Qwen3;
                let q = |part: &str| format!("{:?}", n(part));
                want.push(format!("norm {} Cache", n(names::ATTN_NORM)));
                let bias = if bias {
                    format!("Some([{}, {}, {}])", q(names::Q_BIAS), q(names::K_BIAS), q(names::V_BIAS))
                } else {
                    "None".into()
                };
                want.push(format!("qkv {} {} {} {bias}", n(names::Q), n(names::K), n(names::V)));
                let norms = if head_norms {
                    format!("Some([{}, {}])", q(names::Q_NORM), q(names::K_NORM))
                } else {
                    "None".into()
                };
                want.push(format!("rope_append {l} {norms} Global"));
                want.push(format!("attention {l} None"));
                want.push(format!("add_attention_out {} None", n(names::O)));
                want.push(format!("norm {} Product", n(names::FFN_NORM)));
                want.push(format!("add_gated_ffn Silu {} {} {} None", n(names::GATE), n(names::UP), n(names::DOWN)));
            }
            assert_eq!(ops.0, want, "{arch:?}");
        }
    }
}
