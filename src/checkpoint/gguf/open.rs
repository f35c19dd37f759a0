//! A parsed GGUF file as a `Checkpoint`: the model config from the `{arch}.*` keys, the tensors under
//! their canonical names (expert stacks split into per-expert views), and the tokenizer's source.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use super::names::{
    EXPERT_STACKS, canonical_name_in, expert_stack, expert_stack_name, expert_tensor_name, expert_tensor_name_of,
};
use super::parse::{GgufTensor, GgufValue, parse};
use super::{KEY_LLAMA3_FACTOR, KEY_LLAMA3_HIGH, KEY_LLAMA3_LOW, KEY_LLAMA3_ORIGINAL};
use crate::checkpoint::{
    Checkpoint, Format, MappedFile, ROPE_FREQS, TensorInfo, TokenizerSource, check_tensors, llama3_rope_factors,
};
use crate::model::{Arch, AttentionConfig, ModelConfig, MoeConfig, RopeScaling, SlidingWindow, names};
use crate::status::Result;
use crate::tensor::DType;
use crate::tokenizer::special::SpecialTokens;
use crate::{bail, err};

/// Typed access to the metadata, every miss or mistyped value a `BAD_MODEL` naming the key.
struct Meta<'a> {
    kv: HashMap<String, GgufValue>,
    file: &'a str,
}

impl Meta<'_> {
    fn uint(&self, key: &str) -> Result<Option<u64>> {
        match self.kv.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                err!(
                    BadModel,
                    "{}: key {key} is {} {}, expected a non-negative integer",
                    self.file,
                    v.type_name(),
                    v.brief()
                )
            }),
        }
    }

    fn usize(&self, key: &str) -> Result<Option<usize>> {
        match self.uint(key)? {
            None => Ok(None),
            Some(v) => match usize::try_from(v) {
                Ok(v) if v <= u32::MAX as usize => Ok(Some(v)),
                _ => bail!(BadModel, "{}: key {key} = {v} is out of range", self.file),
            },
        }
    }

    fn req_usize(&self, key: &str) -> Result<usize> {
        self.usize(key)?.ok_or_else(|| err!(BadModel, "{}: key {key} is missing", self.file))
    }

    fn float(&self, key: &str) -> Result<Option<f32>> {
        match self.kv.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(|f| Some(f as f32)).ok_or_else(|| {
                err!(BadModel, "{}: key {key} is {} {v:?}, expected a number", self.file, v.type_name())
            }),
        }
    }

    fn req_float(&self, key: &str) -> Result<f32> {
        self.float(key)?.ok_or_else(|| err!(BadModel, "{}: key {key} is missing", self.file))
    }

    fn flag(&self, key: &str) -> Result<Option<bool>> {
        match self.kv.get(key) {
            None => Ok(None),
            Some(GgufValue::Bool(b)) => Ok(Some(*b)),
            Some(v) => bail!(BadModel, "{}: key {key} is {}, expected a bool", self.file, v.type_name()),
        }
    }

    fn str(&self, key: &str) -> Result<Option<&str>> {
        match self.kv.get(key) {
            None => Ok(None),
            Some(GgufValue::String(s)) => Ok(Some(s)),
            Some(v) => bail!(BadModel, "{}: key {key} is {}, expected a string", self.file, v.type_name()),
        }
    }

    fn take_strings(&mut self, key: &str) -> Result<Option<Vec<String>>> {
        match self.kv.remove(key) {
            None => Ok(None),
            Some(GgufValue::ArrayString(a)) => Ok(Some(a)),
            Some(v) => bail!(BadModel, "{}: key {key} is {}, expected an array of string", self.file, v.type_name()),
        }
    }
}

/// Opens a GGUF checkpoint: parse, map names, build the config from `{arch}.*` keys, check every tensor.
pub fn open_file(path: &Path) -> Result<Checkpoint> {
    let mapped = MappedFile::open(path)?;
    let label = path.display().to_string();
    let file = label.as_str();
    let parsed = parse(&mapped.map, file)?;

    let mut meta = Meta { kv: parsed.metadata.into_iter().collect(), file };
    let arch_name = meta
        .str("general.architecture")?
        .ok_or_else(|| err!(BadModel, "{file}: key general.architecture is missing"))?
        .to_string();
    let arch = Arch::from_gguf_name(&arch_name).ok_or_else(|| {
        let supported = Arch::gguf_supported_names();
        err!(Unsupported, "{file}: general.architecture \"{arch_name}\" is not supported ({supported})")
    })?;
    let key = |k: &str| format!("{arch_name}.{k}");
    // llama.cpp writes Mixtral as a llama with experts.
    let arch = match meta.usize(&key("expert_count"))? {
        Some(n) if n > 0 && arch == Arch::Llama => Arch::Mixtral,
        _ => arch,
    };

    let mut tensors = BTreeMap::new();
    // The expert stacks, split once the config says how many experts a layer has.
    let mut stacks = Vec::new();
    for t in &parsed.tensors {
        if let Some((layer, role)) = expert_stack(&t.name) {
            stacks.push((layer, role, t));
            continue;
        }
        let name = canonical_name_in(arch, &t.name);
        let shape = t.dims.iter().rev().map(|&d| d as usize).collect();
        let info = TensorInfo { name: name.clone(), dtype: t.dtype, shape, file: 0, offset: t.start, bytes: t.bytes };
        if tensors.insert(name.clone(), info).is_some() {
            bail!(BadModel, "{file}: tensor {} maps to {name}, which another tensor already holds", t.name);
        }
    }

    let embed =
        tensors.get(names::EMBED).ok_or_else(|| err!(BadModel, "{file}: tensor token_embd.weight is missing"))?;
    if embed.shape.len() != 2 {
        bail!(BadModel, "{file}: tensor token_embd.weight has shape {:?}, expected [vocab, hidden]", embed.shape);
    }
    let vocab = embed.shape[0];
    let hidden = meta.req_usize(&key("embedding_length"))?;
    let heads = meta.req_usize(&key("attention.head_count"))?;
    if heads == 0 {
        bail!(BadModel, "{file}: key {} is 0", key("attention.head_count"));
    }
    let head_dim = match meta.usize(&key("attention.key_length"))? {
        Some(d) => d,
        None if hidden % heads == 0 => hidden / heads,
        None => bail!(
            BadModel,
            "{file}: key {} is missing and {hidden} is not a multiple of {heads} heads",
            key("attention.key_length")
        ),
    };
    for other in ["attention.value_length", "rope.dimension_count"] {
        if let Some(v) = meta.usize(&key(other))?
            && v != head_dim
        {
            bail!(Unsupported, "{file}: key {} = {v} differs from the head size {head_dim}", key(other));
        }
    }

    let mut rope_scaling = match meta.str(&key("rope.scaling.type"))? {
        None | Some("none") => RopeScaling::None,
        Some("linear") => RopeScaling::Linear { factor: meta.req_float(&key("rope.scaling.factor"))? },
        Some(other) => {
            bail!(Unsupported, "{file}: key {} = \"{other}\" is not supported (none, linear)", key("rope.scaling.type"))
        }
    };
    if let Some(factor) = meta.float(KEY_LLAMA3_FACTOR)? {
        if rope_scaling != RopeScaling::None {
            bail!(BadModel, "{file}: key {KEY_LLAMA3_FACTOR} contradicts key {}", key("rope.scaling.type"));
        }
        let original = meta.usize(KEY_LLAMA3_ORIGINAL)?;
        rope_scaling = RopeScaling::Llama3 {
            factor,
            low_freq_factor: meta.req_float(KEY_LLAMA3_LOW)?,
            high_freq_factor: meta.req_float(KEY_LLAMA3_HIGH)?,
            original_max_position: original
                .ok_or_else(|| err!(BadModel, "{file}: key {KEY_LLAMA3_ORIGINAL} is missing"))?
                as u32,
        };
    }

    let layers = meta.req_usize(&key("block_count"))?;
    let attention = match arch {
        Arch::Gemma3 => gemma3_attention(&meta, &key, layers, hidden, heads, head_dim)?,
        _ => AttentionConfig::default(),
    };
    let token_id = |k: &str| -> Result<Option<u32>> { Ok(meta.usize(k)?.map(|v| v as u32)) };
    let mut config = ModelConfig {
        arch,
        vocab,
        hidden,
        layers,
        heads,
        kv_heads: meta.usize(&key("attention.head_count_kv"))?.unwrap_or(heads),
        head_dim,
        intermediate: meta.req_usize(&key("feed_forward_length"))?,
        rms_eps: meta.req_float(&key("attention.layer_norm_rms_epsilon"))?,
        rope_theta: meta.float(&key("rope.freq_base"))?.unwrap_or(10000.0),
        rope_scaling,
        rope_interleaved: arch.traits().gguf_rope_interleaved,
        max_position: meta.req_usize(&key("context_length"))?,
        tied: !tensors.contains_key(names::LM_HEAD),
        qkv_bias: arch.traits().qkv_bias,
        qk_norm: arch.traits().qk_norm,
        attention,
        bos: token_id("tokenizer.ggml.bos_token_id")?,
        eos: token_id("tokenizer.ggml.eos_token_id")?,
        moe: moe_config(&meta, arch, &key)?,
    };
    config.check(file)?;
    if let Some(t) = tensors.get(ROPE_FREQS) {
        config.rope_scaling = rope_scaling_from_freqs(&config, t, &mapped, &meta, &key)?;
    }
    split_expert_stacks(&config, &stacks, &mut tensors, file, &key)?;
    let files = vec![mapped];
    check_tensors(&config, &tensors, &files, file, &BTreeMap::new(), &|n| n.to_string())?;

    let special = SpecialTokens {
        add_bos: meta.flag("tokenizer.ggml.add_bos_token")?,
        add_eos: meta.flag("tokenizer.ggml.add_eos_token")?,
        eog: [token_id("tokenizer.ggml.eot_token_id")?, token_id("tokenizer.ggml.eom_token_id")?]
            .into_iter()
            .flatten()
            .collect(),
        chat_template: meta.str("tokenizer.chat_template")?.map(str::to_string),
        bos_text: None,
        eos_text: None,
    };

    let tokenizer = match meta.take_strings("tokenizer.ggml.tokens")? {
        None => TokenizerSource::None,
        Some(tokens) => {
            if tokens.len() > vocab {
                bail!(
                    BadModel,
                    "{file}: key tokenizer.ggml.tokens has {} tokens for {vocab} embedding rows",
                    tokens.len()
                );
            }
            let model = meta
                .str("tokenizer.ggml.model")?
                .ok_or_else(|| err!(BadModel, "{file}: key tokenizer.ggml.model is missing"))?
                .to_string();
            let token_types = match meta.kv.remove("tokenizer.ggml.token_type") {
                None => Vec::new(),
                Some(GgufValue::ArrayI32(a)) if a.len() == tokens.len() => a,
                Some(v) => bail!(
                    BadModel,
                    "{file}: key tokenizer.ggml.token_type is {} {}, expected {} i32 values",
                    v.type_name(),
                    if let GgufValue::ArrayI32(a) = &v { a.len() } else { 1 },
                    tokens.len()
                ),
            };
            if model == "llama" {
                let scores = match meta.kv.remove("tokenizer.ggml.scores") {
                    None => Vec::new(),
                    Some(GgufValue::ArrayF32(a)) if a.len() == tokens.len() => a,
                    Some(v) => bail!(
                        BadModel,
                        "{file}: key tokenizer.ggml.scores is {} {}, expected {} f32 values",
                        v.type_name(),
                        if let GgufValue::ArrayF32(a) = &v { a.len() } else { 1 },
                        tokens.len()
                    ),
                };
                let add_space_prefix = meta.flag("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
                TokenizerSource::GgufSpm { tokens, scores, token_types, add_space_prefix }
            } else {
                let pre = meta.str("tokenizer.ggml.pre")?.map(str::to_string);
                let merges = meta.take_strings("tokenizer.ggml.merges")?.unwrap_or_default();
                TokenizerSource::GgufBpe { model, pre, tokens, merges, token_types }
            }
        }
    };
    Ok(Checkpoint { path: path.to_path_buf(), format: Format::Gguf, config, tensors, files, tokenizer, special })
}

/// Gemma 3's attention as llama.cpp reads a `gemma3` file: a sliding window when
/// `gemma3.attention.sliding_window` is there, on every layer but each sixth, with a local rotary base
/// of 10000; no key for the query scaling, which is 1/sqrt(hidden / heads) for the 62-layer (27B)
/// model and 1/sqrt(head_dim) for the others; soft-capping keys refused.
fn gemma3_attention(
    meta: &Meta,
    key: &dyn Fn(&str) -> String,
    layers: usize,
    hidden: usize,
    heads: usize,
    head_dim: usize,
) -> Result<AttentionConfig> {
    for k in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if let Some(v) = meta.float(&key(k))?
            && v != 0.0
        {
            bail!(Unsupported, "{}: key {} = {v} (soft-capping) is not supported", meta.file, key(k));
        }
    }
    let base = if layers == 62 { hidden / heads } else { head_dim };
    let sliding = match meta.usize(&key("attention.sliding_window"))? {
        Some(window) if window > 0 => Some(SlidingWindow { window, global_every: 6, rope_theta: 10000.0 }),
        _ => None,
    };
    Ok(AttentionConfig { query_scale_base: Some(base as f32), sliding })
}

/// The `{arch}.expert_*` keys of a Mixture-of-Experts architecture: the counts, and the experts' width
/// (`expert_feed_forward_length`; llama.cpp's defaults without it: Mixtral's `feed_forward_length`,
/// Qwen3-MoE's divided by the experts a token uses). llama.cpp renormalizes both architectures' top-k
/// weights unless `expert_weights_norm` says otherwise.
fn moe_config(meta: &Meta, arch: Arch, key: &dyn Fn(&str) -> String) -> Result<Option<MoeConfig>> {
    if !arch.is_moe() {
        return Ok(None);
    }
    let experts = meta.req_usize(&key("expert_count"))?;
    let used = meta.req_usize(&key("expert_used_count"))?;
    let intermediate = match meta.usize(&key("expert_feed_forward_length"))? {
        Some(n) => n,
        None => {
            let ff = meta.req_usize(&key("feed_forward_length"))?;
            if arch == Arch::Qwen3Moe { ff / used.max(1) } else { ff }
        }
    };
    let norm_topk = meta.flag(&key("expert_weights_norm"))?.unwrap_or(true);
    Ok(Some(MoeConfig { experts, used, intermediate, norm_topk }))
}

/// Each expert stack as the canonical per-expert tensors, views of its bytes: BAD_MODEL naming the
/// stack when its experts, rows or columns are not the config's, when a Mixture-of-Experts layer lacks
/// one, or when a dense model has one.
fn split_expert_stacks(
    cfg: &ModelConfig,
    stacks: &[(usize, usize, &GgufTensor)],
    tensors: &mut BTreeMap<String, TensorInfo>,
    file: &str,
    key: &dyn Fn(&str) -> String,
) -> Result<()> {
    let Some(moe) = cfg.moe else {
        if let Some((_, _, t)) = stacks.first() {
            bail!(BadModel, "{file}: tensor {} holds experts, but key {} gives none", t.name, key("expert_count"));
        }
        return Ok(());
    };
    for &(layer, role, t) in stacks {
        let [rows, cols] = EXPERT_STACKS[role].2.map(|d| d.of(cfg) as u64);
        if layer >= cfg.layers {
            bail!(
                BadModel,
                "{file}: tensor {} is past the {} layers of key {}",
                t.name,
                cfg.layers,
                key("block_count")
            );
        }
        if t.dims.len() != 3 || t.dims[2] != moe.experts as u64 {
            let held = if t.dims.len() == 3 { t.dims[2].to_string() } else { format!("{}-D", t.dims.len()) };
            bail!(
                BadModel,
                "{file}: tensor {} holds {held} experts, key {} says {}",
                t.name,
                key("expert_count"),
                moe.experts
            );
        }
        if t.dims[..2] != [cols, rows] {
            bail!(
                BadModel,
                "{file}: tensor {} has experts of [{}, {}], the config asks for [{rows}, {cols}]",
                t.name,
                t.dims[1],
                t.dims[0]
            );
        }
        let bytes = t.bytes / moe.experts;
        for e in 0..moe.experts {
            let name = names::layer(layer, &names::expert(EXPERT_STACKS[role].1, e));
            let shape = vec![rows as usize, cols as usize];
            let info =
                TensorInfo { name: name.clone(), dtype: t.dtype, shape, file: 0, offset: t.start + e * bytes, bytes };
            if tensors.insert(name.clone(), info).is_some() {
                bail!(BadModel, "{file}: tensor {} maps to {name}, which another tensor already holds", t.name);
            }
        }
    }
    // A role without a stack is its experts one tensor each (llama.cpp's spelling before stacks), all of them.
    for layer in 0..cfg.layers {
        for role in 0..EXPERT_STACKS.len() {
            if stacks.iter().any(|&(l, r, _)| (l, r) == (layer, role)) {
                continue;
            }
            let held = |e: usize| tensors.contains_key(&names::layer(layer, &names::expert(EXPERT_STACKS[role].1, e)));
            let missing: Vec<usize> = (0..moe.experts).filter(|&e| !held(e)).collect();
            match missing.first() {
                None => {}
                Some(&e) if missing.len() < moe.experts => {
                    bail!(BadModel, "{file}: tensor {} is missing", expert_tensor_name(layer, role, e))
                }
                Some(_) => bail!(BadModel, "{file}: tensor {} is missing", expert_stack_name(layer, role)),
            }
        }
    }
    let past = |n: &String| names::expert_of(n).is_some_and(|(l, e)| l >= cfg.layers || e >= moe.experts);
    if let Some(name) = tensors.keys().find(|n| past(n)) {
        bail!(
            BadModel,
            "{file}: tensor {} is past the {} experts of key {} or the {} layers of key {}",
            expert_tensor_name_of(name).unwrap_or_else(|| name.clone()),
            moe.experts,
            key("expert_count"),
            cfg.layers,
            key("block_count")
        );
    }
    Ok(())
}

/// Rope scaling for a file carrying llama.cpp's `rope_freqs.weight` divisors: the scaling the keys give
/// when they agree with it, else Llama 3.1's parameters (factor = the largest divisor, low 1, high 4)
/// when those reproduce it; anything else is refused rather than guessed.
fn rope_scaling_from_freqs(
    cfg: &ModelConfig,
    t: &TensorInfo,
    mapped: &MappedFile,
    meta: &Meta,
    key: &dyn Fn(&str) -> String,
) -> Result<RopeScaling> {
    let file = meta.file;
    if t.dtype != DType::F32 || t.shape != [cfg.head_dim / 2] {
        bail!(
            BadModel,
            "{file}: tensor rope_freqs.weight is {} {:?}, expected F32 [{}]",
            t.dtype.name(),
            t.shape,
            cfg.head_dim / 2
        );
    }
    let mut stored = vec![0f32; cfg.head_dim / 2];
    crate::tensor::decode_row(DType::F32, &mapped.map[t.offset..t.offset + t.bytes], &mut stored);
    let matches = |scaling: RopeScaling| {
        let candidate = ModelConfig { rope_scaling: scaling, ..cfg.clone() };
        let expected = llama3_rope_factors(&candidate).unwrap_or_else(|| vec![1.0; stored.len()]);
        stored.iter().zip(&expected).all(|(s, e)| (s - e).abs() <= 1e-4 * e.abs().max(1.0))
    };
    match cfg.rope_scaling {
        RopeScaling::Llama3 { .. } if matches(cfg.rope_scaling) => Ok(cfg.rope_scaling),
        RopeScaling::Llama3 { .. } => {
            bail!(BadModel, "{file}: tensor rope_freqs.weight disagrees with the hostembed.rope.llama3.* keys")
        }
        RopeScaling::Linear { .. } => {
            bail!(Unsupported, "{file}: tensor rope_freqs.weight beside linear rope scaling is not supported")
        }
        RopeScaling::None if matches(RopeScaling::None) => Ok(RopeScaling::None),
        RopeScaling::None => {
            let factor = stored.iter().fold(1f32, |m, &v| m.max(v));
            let original = meta.usize(&key("rope.scaling.original_context_length"))?.unwrap_or(8192);
            let llama31 = RopeScaling::Llama3 {
                factor,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: original as u32,
            };
            if !matches(llama31) {
                bail!(
                    Unsupported,
                    "{file}: tensor rope_freqs.weight holds rope divisors that are not Llama 3 scaling with \
                     factor {factor}, low 1, high 4, original context {original}"
                );
            }
            Ok(llama31)
        }
    }
}
