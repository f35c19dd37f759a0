//! Gemma 3 (text): embeddings scaled by sqrt(hidden); RMSNorm before and after attention and before and
//! after the feed-forward (each block's output normed before it joins the residual); an RMSNorm over
//! each head of q and k; GELU-tanh gated feed-forward (GeGLU); scores scaled by
//! 1/sqrt(query_pre_attn_scalar); sliding-window (local) layers with their own rotary base between
//! global layers (every sixth); the head tied to the embedding.
//!
//! The norm weights here are the multipliers: HF's Gemma3RMSNorm multiplies by (1 + w), and llama.cpp's
//! converter stores w + 1 in GGUF; the HF reader adds the 1 as it opens the folder
//! (`ArchTraits::hf_norms_plus_one`), so both files give these tensors the same values.

use super::{Feeds, Ops, Rotary};
use crate::model::{Activation, ModelConfig, names, weight_table};
use crate::status::Result;

weight_table! {
    /// RMSNorm weight before attention.
    attn_norm: names::ATTN_NORM, [Hidden], Always;
    q: names::Q, [QDim, Hidden], Always;
    k: names::K, [KvDim, Hidden], Always;
    v: names::V, [KvDim, Hidden], Always;
    /// RMSNorm weight over each head of q, before the rotation.
    q_norm: names::Q_NORM, [HeadDim], Always;
    k_norm: names::K_NORM, [HeadDim], Always;
    o: names::O, [Hidden, QDim], Always;
    /// RMSNorm weight of the attention output, before the residual add.
    post_attn_norm: names::POST_ATTN_NORM, [Hidden], Always;
    /// RMSNorm weight before the feed-forward block.
    ffn_norm: names::PRE_FFN_NORM, [Hidden], Always;
    gate: names::GATE, [Intermediate, Hidden], Always;
    up: names::UP, [Intermediate, Hidden], Always;
    down: names::DOWN, [Hidden, Intermediate], Always;
    /// RMSNorm weight of the feed-forward output, before the residual add.
    post_ffn_norm: names::POST_FFN_NORM, [Hidden], Always;
}

/// The GGUF names of the parts Gemma 3 spells apart from the llama family (GGUF, HF): llama.cpp's
/// `ffn_norm` is the norm before the feed-forward, which HF names `pre_feedforward_layernorm`.
pub const GGUF_PARTS: &[(&str, &str)] = &[
    ("post_attention_norm.weight", names::POST_ATTN_NORM),
    ("ffn_norm.weight", names::PRE_FFN_NORM),
    ("post_ffw_norm.weight", names::POST_FFN_NORM),
];

/// The scaled embedding, then each layer: pre-normed attention (local or global) normed again before
/// the residual add, and a pre-normed GeGLU feed-forward normed again before the residual add.
pub fn forward<O: Ops>(cfg: &ModelConfig, ops: &mut O, layers: &[LayerWeights<O::Weight>]) -> Result<()> {
    ops.embed()?;
    // HF forms sqrt(hidden) in double and multiplies in the activations' dtype (f32 here).
    ops.scale((cfg.hidden as f64).sqrt() as f32)?;
    for (l, w) in layers.iter().enumerate() {
        let window = cfg.attention.window(l);
        let rotary = if window.is_some() { Rotary::Local } else { Rotary::Global };
        ops.norm(&w.attn_norm, Feeds::Cache)?;
        ops.qkv(&w.q, &w.k, &w.v, None)?;
        ops.rope_append(l, Some([&w.q_norm, &w.k_norm]), rotary)?;
        ops.attention(l, window)?;
        ops.add_attention_out(&w.o, Some(&w.post_attn_norm))?;

        ops.norm(&w.ffn_norm, Feeds::Product)?;
        ops.add_gated_ffn(Activation::GeluTanh, &w.gate, &w.up, &w.down, Some(&w.post_ffn_norm))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{Layers, recorder::Recorder};
    use crate::model::{Arch, AttentionConfig, RopeScaling, SlidingWindow};

    /// Seven layers with a global layer every third: local layers 0, 1, 3, 4, 6 on their window and
    /// rotary base, global layers 2 and 5 on neither; every norm in its place.
    #[test]
    fn gemma3_passes_its_norms_windows_and_rotations_in_order() {
        let sliding = SlidingWindow { window: 5, global_every: 3, rope_theta: 10000.0 };
        let mut cfg = ModelConfig::llama(16, 7, 2, 1, 32, 10);
        cfg.arch = Arch::Gemma3;
        cfg.head_dim = 8;
        cfg.tied = true;
        cfg.qk_norm = true;
        cfg.rope_scaling = RopeScaling::Linear { factor: 8.0 };
        cfg.attention = AttentionConfig { query_scale_base: Some(12.0), sliding: Some(sliding) };
        let layers = Layers::build(&cfg, |w| Ok(w.name.clone())).unwrap();
        let mut ops = Recorder(Vec::new());
        crate::arch::forward(&cfg, &mut ops, &layers).unwrap();
        let mut want = vec!["embed".to_string(), "scale 4".to_string()];
        for l in 0..cfg.layers {
            let n = |part: &str| names::layer(l, part);
            let q = |part: &str| format!("{:?}", n(part));
            let global = l == 2 || l == 5;
            want.push(format!("norm {} Cache", n(names::ATTN_NORM)));
            want.push(format!("qkv {} {} {} None", n(names::Q), n(names::K), n(names::V)));
            let rotary = if global { "Global" } else { "Local" };
            want.push(format!("rope_append {l} Some([{}, {}]) {rotary}", q(names::Q_NORM), q(names::K_NORM)));
            want.push(format!("attention {l} {}", if global { "None" } else { "Some(5)" }));
            want.push(format!("add_attention_out {} Some({})", n(names::O), q(names::POST_ATTN_NORM)));
            want.push(format!("norm {} Product", n(names::PRE_FFN_NORM)));
            want.push(format!(
                "add_gated_ffn GeluTanh {} {} {} Some({})",
                n(names::GATE),
                n(names::UP),
                n(names::DOWN),
                q(names::POST_FFN_NORM)
            ));
        }
        assert_eq!(ops.0, want);
    }
}
