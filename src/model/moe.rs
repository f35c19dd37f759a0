//! The Mixture-of-Experts part of a model's description: `MoeConfig`, the shapes that carry one, the
//! parameter counts, and the expert tensors' names (Mixtral's HF spelling apart).

use super::{Arch, MAX_DIM, ModelConfig, Weight, WeightSpec, names};
use crate::status::Result;

/// The Mixture-of-Experts architectures and the names llama.cpp gives them.
impl Arch {
    /// Whether every layer's feed-forward is a Mixture of Experts (`ModelConfig::moe` is then given).
    pub const fn is_moe(self) -> bool {
        matches!(self, Arch::Qwen3Moe | Arch::Mixtral)
    }

    /// The name in GGUF `general.architecture` (and its keys' prefix): llama.cpp writes Mixtral as a
    /// `llama` with expert keys, and Qwen3-MoE without the underscore.
    pub const fn gguf_name(self) -> &'static str {
        match self {
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Mixtral => "llama",
            _ => self.traits().name,
        }
    }

    /// The architecture a GGUF file names, before its keys say whether a `llama` has experts.
    pub fn from_gguf_name(name: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.gguf_name() == name && *a != Arch::Mixtral)
    }

    /// The GGUF names, for messages: "llama, qwen2, qwen3, gemma3, qwen3moe" (Mixtral's is llama's).
    pub fn gguf_supported_names() -> String {
        let mut names: Vec<&str> = Vec::new();
        for name in Arch::ALL.map(Arch::gguf_name) {
            if !names.contains(&name) {
                names.push(name);
            }
        }
        names.join(", ")
    }
}

// A Mixture-of-Experts layer's tensors, re-exported in `names`.

/// The router, [experts, hidden] (Mixtral: `block_sparse_moe.gate.weight`).
pub const ROUTER: &str = "mlp.gate.weight";
/// Expert `*`'s matrices (Mixtral: `block_sparse_moe.experts.*.w1`, `w3`, `w2`); `expert` fills in
/// the index.
pub const EXPERT_GATE: &str = "mlp.experts.*.gate_proj.weight";
pub const EXPERT_UP: &str = "mlp.experts.*.up_proj.weight";
pub const EXPERT_DOWN: &str = "mlp.experts.*.down_proj.weight";

/// Most experts a layer may have (the largest models hold a few hundred).
pub const MAX_EXPERTS: usize = 1 << 12;

/// A Mixture-of-Experts feed-forward: a router scores `experts` SwiGLU experts of width `intermediate`
/// for each token, which runs through the `used` best (top-k) and sums their outputs, each weighted by
/// its softmax probability over all experts, renormalized over the chosen ones when `norm_topk`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    pub experts: usize,
    pub used: usize,
    pub intermediate: usize,
    /// Qwen3-MoE's `norm_topk_prob`; Mixtral always renormalizes (its softmax over the top-k logits).
    pub norm_topk: bool,
}

impl ModelConfig {
    /// The Qwen3-MoE of this shape (head_dim 128, 4 KV heads, Qwen3's rope base and norm epsilon),
    /// untied, no special tokens: `qwen3_moe(2048, 48, 32, 128, 8, 768, 151936)` is Qwen3-30B-A3B's.
    pub fn qwen3_moe(
        hidden: usize,
        layers: usize,
        heads: usize,
        experts: usize,
        used: usize,
        expert_intermediate: usize,
        vocab: usize,
    ) -> Self {
        ModelConfig {
            arch: Arch::Qwen3Moe,
            kv_heads: 4.min(heads),
            head_dim: 128,
            intermediate: 6144,
            rms_eps: 1e-6,
            rope_theta: 1000000.0,
            max_position: 40960,
            qk_norm: true,
            moe: Some(MoeConfig { experts, used, intermediate: expert_intermediate, norm_topk: true }),
            ..ModelConfig::llama(hidden, layers, heads, 4.min(heads), 6144, vocab)
        }
    }

    /// Qwen3-30B-A3B's shape (48 layers, 128 experts of width 768, 8 a token, hidden 2048): the
    /// benchmarks' Mixture-of-Experts model.
    pub fn qwen3_30b_a3b() -> Self {
        ModelConfig::qwen3_moe(2048, 48, 32, 128, 8, 768, 151936)
    }

    /// Parameters every token reads, and those of the whole model: the same for a dense model; a
    /// Mixture of Experts reads its router and `used` of its experts a layer. The embedding counts
    /// once when tied, and a token reads one row of it (the head reads all of it).
    pub fn parameters(&self) -> (u64, u64) {
        let (h, l) = (self.hidden as u64, self.layers as u64);
        let (q, kv) = (self.q_dim() as u64, self.kv_dim() as u64);
        let mut attention = h * (q + 2 * kv) + q * h + 2 * h;
        if self.qkv_bias {
            attention += q + 2 * kv;
        }
        if self.qk_norm {
            attention += 2 * self.head_dim as u64;
        }
        let (ffn_total, ffn_active) = match self.moe {
            None => (3 * h * self.intermediate as u64, 3 * h * self.intermediate as u64),
            Some(m) => {
                let expert = 3 * h * m.intermediate as u64;
                let router = m.experts as u64 * h;
                (router + m.experts as u64 * expert, router + m.used as u64 * expert)
            }
        };
        let embed = self.vocab as u64 * h;
        let head = if self.tied { 0 } else { embed };
        let around = embed + head + h;
        (around + l * (attention + ffn_active), around + l * (attention + ffn_total))
    }

    /// The width of the feed-forward a product runs over: the dense one's, or an expert's.
    pub fn ffn_width(&self) -> usize {
        self.moe.map_or(self.intermediate, |m| m.intermediate)
    }

    /// `check`'s part for the experts: a Mixture-of-Experts architecture has them, in range, and a
    /// dense one has none.
    pub(super) fn check_moe(&self, source: &str) -> Result<()> {
        match (self.arch.is_moe(), self.moe) {
            (false, None) => {}
            (true, None) => crate::bail!(BadModel, "{source}: {} has no expert count", self.arch.name()),
            (false, Some(_)) => crate::bail!(BadModel, "{source}: {} has no experts", self.arch.name()),
            (true, Some(m)) => {
                if m.experts < 2 || m.experts > MAX_EXPERTS {
                    crate::bail!(BadModel, "{source}: expert count {} is out of range (2..={MAX_EXPERTS})", m.experts);
                }
                if m.used == 0 || m.used > m.experts {
                    crate::bail!(
                        BadModel,
                        "{source}: {} experts a token (top-k) is outside 1..={}, the expert count",
                        m.used,
                        m.experts
                    );
                }
                if m.intermediate == 0 || m.intermediate > MAX_DIM {
                    crate::bail!(BadModel, "{source}: expert width {} is out of range (1..={MAX_DIM})", m.intermediate);
                }
            }
        }
        Ok(())
    }
}

/// An expert part with its index: `expert(EXPERT_UP, 3)` is `mlp.experts.3.up_proj.weight`.
pub fn expert(part: &str, e: usize) -> String {
    part.replacen('*', &e.to_string(), 1)
}

/// The layer and expert a canonical name is a part of (`model.layers.L.mlp.experts.E.`...).
pub fn expert_of(name: &str) -> Option<(usize, usize)> {
    let (layer, rest) = name.strip_prefix("model.layers.")?.split_once('.')?;
    let (e, _) = rest.strip_prefix("mlp.experts.")?.split_once('.')?;
    Some((layer.parse().ok()?, e.parse().ok()?))
}

/// Mixtral's HF spellings of the Mixture-of-Experts parts (`block_sparse_moe.`...), canonical first.
pub const MIXTRAL: [(&str, &str); 4] = [
    (ROUTER, "block_sparse_moe.gate.weight"),
    (EXPERT_GATE, "block_sparse_moe.experts.*.w1.weight"),
    (EXPERT_UP, "block_sparse_moe.experts.*.w3.weight"),
    (EXPERT_DOWN, "block_sparse_moe.experts.*.w2.weight"),
];

/// A layer part in Mixtral's spelling (`mixtral`) or the canonical one, swapped: the HF reader and
/// writer rename a Mixtral folder's tensors with it. None for a part the two spell alike.
pub fn mixtral_swap(part: &str, to_mixtral: bool) -> Option<String> {
    MIXTRAL.iter().find_map(|&(canonical, mixtral)| {
        let (from, to) = if to_mixtral { (canonical, mixtral) } else { (mixtral, canonical) };
        match from.split_once('*') {
            None => (part == from).then(|| to.to_string()),
            Some((head, tail)) => {
                let e = part.strip_prefix(head)?.strip_suffix(tail)?;
                (!e.is_empty() && e.bytes().all(|b| b.is_ascii_digit())).then(|| to.replacen('*', e, 1))
            }
        }
    })
}

impl Weight {
    /// Expert `e`'s weight of a `Need::Experts` row.
    pub(crate) fn expert(spec: &'static WeightSpec, layer: usize, e: usize, cfg: &ModelConfig) -> Weight {
        Weight { name: names::layer(layer, &names::expert(spec.name, e)), ..Weight::new(spec, Some(layer), cfg) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each GGUF name once, Mixtral's `llama` with Llama's, Gemma 3's among them.
    #[test]
    fn gguf_names_are_listed_once() {
        assert_eq!(Arch::gguf_supported_names(), "llama, qwen2, qwen3, gemma3, qwen3moe");
        for arch in Arch::ALL {
            let read = Arch::from_gguf_name(arch.gguf_name());
            assert_eq!(read, Some(if arch == Arch::Mixtral { Arch::Llama } else { arch }), "{arch:?}");
        }
    }
}
