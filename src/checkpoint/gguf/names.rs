//! llama.cpp's tensor names and the canonical (HF) ones, both ways, per architecture; a Mixture of
//! Experts' stacked expert tensors.

use crate::checkpoint::ROPE_FREQS;
use crate::model::{Arch, Dim, names};

/// llama.cpp's per-layer tensor names and their HF counterparts.
const LAYER_PARTS: [(&str, &str); 15] = [
    ("attn_norm.weight", names::ATTN_NORM),
    ("attn_q.weight", names::Q),
    ("attn_k.weight", names::K),
    ("attn_v.weight", names::V),
    ("attn_output.weight", names::O),
    ("attn_q.bias", names::Q_BIAS),
    ("attn_k.bias", names::K_BIAS),
    ("attn_v.bias", names::V_BIAS),
    ("attn_q_norm.weight", names::Q_NORM),
    ("attn_k_norm.weight", names::K_NORM),
    ("ffn_norm.weight", names::FFN_NORM),
    ("ffn_gate.weight", names::GATE),
    ("ffn_up.weight", names::UP),
    ("ffn_down.weight", names::DOWN),
    ("ffn_gate_inp.weight", names::ROUTER),
];

/// llama.cpp's stacked expert matrices, [experts, rows, cols] (ggml order reversed): each layer's
/// experts of one role in one tensor, expert 0 first; the reader splits them into the canonical
/// per-expert tensors (views of the stack, whose rows are whole blocks), the writer stacks them.
pub const EXPERT_STACKS: [(&str, &str, [Dim; 2]); 3] = [
    ("ffn_gate_exps.weight", names::EXPERT_GATE, [Dim::ExpertIntermediate, Dim::Hidden]),
    ("ffn_up_exps.weight", names::EXPERT_UP, [Dim::ExpertIntermediate, Dim::Hidden]),
    ("ffn_down_exps.weight", names::EXPERT_DOWN, [Dim::Hidden, Dim::ExpertIntermediate]),
];

/// The layer and the `EXPERT_STACKS` entry of a GGUF stack's name (`blk.N.ffn_up_exps.weight`).
pub(super) fn expert_stack(gguf: &str) -> Option<(usize, usize)> {
    let (layer, part) = gguf.strip_prefix("blk.")?.split_once('.')?;
    let i = layer.parse::<usize>().ok().filter(|i| i.to_string() == layer)?;
    Some((i, EXPERT_STACKS.iter().position(|(g, _, _)| *g == part)?))
}

/// The GGUF name of layer `layer`'s stack of `EXPERT_STACKS` entry `role`.
pub fn expert_stack_name(layer: usize, role: usize) -> String {
    format!("blk.{layer}.{}", EXPERT_STACKS[role].0)
}

/// llama.cpp's spelling before it stacked experts (Mixtral files of early 2024): one tensor an expert,
/// `blk.N.ffn_gate.E.weight`, of layer `layer`'s `EXPERT_STACKS` entry `role`.
pub fn expert_tensor_name(layer: usize, role: usize, e: usize) -> String {
    let base = EXPERT_STACKS[role].0.strip_suffix("_exps.weight").expect("a stack's name ends in _exps.weight");
    format!("blk.{layer}.{base}.{e}.weight")
}

/// A whole number as GGUF names write it (no sign, no leading zeros).
fn index(s: &str) -> Option<usize> {
    s.parse::<usize>().ok().filter(|i| i.to_string() == s)
}

/// The canonical name of an expert tensor in that earlier spelling.
fn expert_tensor(gguf: &str) -> Option<String> {
    let (layer, part) = gguf.strip_prefix("blk.")?.split_once('.')?;
    let (base, e) = part.strip_suffix(".weight")?.rsplit_once('.')?;
    let (layer, e) = (index(layer)?, index(e)?);
    let (_, hf, _) = EXPERT_STACKS.iter().find(|(g, _, _)| g.strip_suffix("_exps.weight") == Some(base))?;
    Some(names::layer(layer, &names::expert(hf, e)))
}

/// The earlier spelling of a canonical per-expert name (`expert_tensor_name`).
pub fn expert_tensor_name_of(canonical: &str) -> Option<String> {
    let (layer, e) = names::expert_of(canonical)?;
    let part = canonical.strip_prefix(&names::layer(layer, ""))?;
    let role = EXPERT_STACKS.iter().position(|(_, hf, _)| names::expert(hf, e) == part)?;
    Some(expert_tensor_name(layer, role, e))
}

/// The GGUF stack a canonical per-expert name belongs to: (its name, the expert's index).
pub fn expert_stack_of(canonical: &str) -> Option<(String, usize)> {
    let (layer, e) = names::expert_of(canonical)?;
    let part = canonical.strip_prefix(&names::layer(layer, ""))?;
    let role = EXPERT_STACKS.iter().position(|(_, hf, _)| names::expert(hf, e) == part)?;
    Some((expert_stack_name(layer, role), e))
}

const GLOBAL_NAMES: [(&str, &str); 4] = [
    ("token_embd.weight", names::EMBED),
    ("output_norm.weight", names::FINAL_NORM),
    ("output.weight", names::LM_HEAD),
    ("rope_freqs.weight", ROPE_FREQS),
];

/// The canonical name of a GGUF tensor of the llama family; names it does not know are kept as they are.
pub fn canonical_name(gguf: &str) -> String {
    canonical_name_in(Arch::Llama, gguf)
}

/// The GGUF name of a canonical tensor of the llama family, or None for a name GGUF has no spelling for.
pub fn gguf_name(canonical: &str) -> Option<String> {
    gguf_name_in(Arch::Llama, canonical)
}

/// The (GGUF, HF) layer parts of `arch`: its own spellings (`ArchTraits::gguf_layer_parts`) first.
fn layer_parts(arch: Arch) -> impl Iterator<Item = &'static (&'static str, &'static str)> {
    arch.traits().gguf_layer_parts.iter().chain(LAYER_PARTS.iter())
}

/// The canonical name of a GGUF tensor of an `arch` model; names it does not know are kept as they are.
pub fn canonical_name_in(arch: Arch, gguf: &str) -> String {
    if let Some((_, hf)) = GLOBAL_NAMES.iter().find(|(g, _)| *g == gguf) {
        return hf.to_string();
    }
    if let Some((layer, part)) = gguf.strip_prefix("blk.").and_then(|rest| rest.split_once('.'))
        && let Ok(i) = layer.parse::<usize>()
        && i.to_string() == layer
        && let Some((_, hf)) = layer_parts(arch).find(|(g, _)| *g == part)
    {
        return names::layer(i, hf);
    }
    expert_tensor(gguf).unwrap_or_else(|| gguf.to_string())
}

/// The GGUF name of a canonical tensor of an `arch` model, or None for a name GGUF has no spelling for.
pub fn gguf_name_in(arch: Arch, canonical: &str) -> Option<String> {
    if let Some((g, _)) = GLOBAL_NAMES.iter().find(|(_, hf)| *hf == canonical) {
        return Some(g.to_string());
    }
    let (layer, part) = canonical.strip_prefix("model.layers.")?.split_once('.')?;
    let i = layer.parse::<usize>().ok().filter(|i| i.to_string() == layer)?;
    let (g, _) = layer_parts(arch).find(|(_, hf)| *hf == part)?;
    Some(format!("blk.{i}.{g}"))
}
