//! config.json into a `ModelConfig`: the keys of every architecture, Gemma 3's attention, the Mixture
//! of Experts' keys and rope scaling, each miss or mistyped value a BAD_MODEL naming file and key.

use serde_json::{Map, Value};

use crate::model::{Arch, AttentionConfig, ModelConfig, MoeConfig, RopeScaling, SlidingWindow};
use crate::status::{Error, Result};
use crate::{bail, err};

/// Typed access to one JSON object; every miss or mistyped value a `BAD_MODEL` naming file and key.
struct Keys<'a> {
    obj: &'a Map<String, Value>,
    file: &'a str,
    prefix: &'a str,
}

impl<'a> Keys<'a> {
    /// The value, with JSON null read as absent.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn bad(&self, key: &str, v: &Value, expected: &str) -> Error {
        err!(BadModel, "{}: key {}{key} = {v} is not {expected}", self.file, self.prefix)
    }

    fn missing(&self, key: &str) -> Error {
        err!(BadModel, "{}: key {}{key} is missing", self.file, self.prefix)
    }

    fn usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
                Some(n) => Ok(Some(n)),
                None => Err(self.bad(key, v, "a non-negative integer")),
            },
        }
    }

    fn req_usize(&self, key: &str) -> Result<usize> {
        self.usize(key)?.ok_or_else(|| self.missing(key))
    }

    fn f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(|f| Some(f as f32)).ok_or_else(|| self.bad(key, v, "a number")),
        }
    }

    fn req_f32(&self, key: &str) -> Result<f32> {
        self.f32(key)?.ok_or_else(|| self.missing(key))
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.bad(key, v, "true or false")),
        }
    }

    fn str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.bad(key, v, "a string")),
        }
    }

    /// A token id given as an integer or a list (the first one is taken).
    fn token_id(&self, key: &str) -> Result<Option<u32>> {
        let first = match self.get(key) {
            None => return Ok(None),
            Some(Value::Array(ids)) => match ids.first() {
                None => return Ok(None),
                Some(id) => id,
            },
            Some(id) => id,
        };
        match first.as_u64().and_then(|id| u32::try_from(id).ok()) {
            Some(id) => Ok(Some(id)),
            None => Err(self.bad(key, first, "a token id")),
        }
    }

    fn object(&self, key: &str) -> Result<Option<Keys<'a>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(obj)) => Ok(Some(Keys { obj, file: self.file, prefix: key_prefix(key) })),
            Some(v) => Err(self.bad(key, v, "an object")),
        }
    }
}

/// The prefix messages give keys nested in the object at `key`.
fn key_prefix(key: &str) -> &'static str {
    match key {
        "rope_parameters" => "rope_parameters.",
        "full_attention" => "rope_parameters.full_attention.",
        "sliding_attention" => "rope_parameters.sliding_attention.",
        _ => "rope_scaling.",
    }
}

/// Reads config.json (`file` names it in messages) into a `ModelConfig`.
pub fn parse_config(json: &Value, file: &str) -> Result<ModelConfig> {
    let Some(obj) = json.as_object() else {
        bail!(BadModel, "{file}: the top level is not a JSON object");
    };
    let j = Keys { obj, file, prefix: "" };
    let model_type = j.str("model_type")?.ok_or_else(|| j.missing("model_type"))?;
    let arch = Arch::from_hf_model_type(model_type).ok_or_else(|| {
        err!(Unsupported, "{file}: model_type \"{model_type}\" is not supported ({})", Arch::supported_hf_model_types())
    })?;

    let activation = arch.traits().activation;
    for key in ["hidden_act", "hidden_activation"] {
        if let Some(act) = j.str(key)?
            && !activation.hf_names().contains(&act)
        {
            bail!(
                Unsupported,
                "{file}: {key} \"{act}\" is not supported for {model_type} ({})",
                activation.hf_names().join(", ")
            );
        }
    }
    let attention_bias = j.bool("attention_bias")?.unwrap_or(false);
    if attention_bias && !arch.traits().qkv_bias {
        bail!(
            Unsupported,
            "{file}: attention_bias = true (biases on q/k/v and o_proj) is not supported for {model_type}"
        );
    }
    if j.bool("mlp_bias")?.unwrap_or(false) {
        bail!(Unsupported, "{file}: mlp_bias = true is not supported");
    }
    if j.bool("use_sliding_window")?.unwrap_or(false) {
        bail!(Unsupported, "{file}: use_sliding_window = true is not supported");
    }

    let hidden = j.req_usize("hidden_size")?;
    let heads = j.req_usize("num_attention_heads")?;
    if heads == 0 {
        bail!(BadModel, "{file}: key num_attention_heads is 0");
    }
    let head_dim = match j.usize("head_dim")? {
        Some(d) => d,
        None if hidden % heads == 0 => hidden / heads,
        None => bail!(BadModel, "{file}: key head_dim is missing and {hidden} is not a multiple of {heads} heads"),
    };

    // transformers 5 gives Gemma 3 one rope_parameters object a layer type.
    let by_layer_type = match j.object("rope_parameters")? {
        Some(p) => Some((p.object("full_attention")?, p.object("sliding_attention")?))
            .filter(|(f, s)| f.is_some() || s.is_some()),
        None => None,
    };
    let (rope_theta, rope_scaling) = match (&by_layer_type, j.object("rope_parameters")?) {
        (Some((Some(full), _)), _) => (full.f32("rope_theta")?.unwrap_or(10000.0), parse_rope_scaling(full)?),
        (Some((None, _)), _) => (j.f32("rope_theta")?.unwrap_or(10000.0), RopeScaling::None),
        (None, Some(params)) => (params.f32("rope_theta")?.unwrap_or(10000.0), parse_rope_scaling(&params)?),
        (None, None) => {
            let scaling = match j.object("rope_scaling")? {
                Some(s) => parse_rope_scaling(&s)?,
                None => RopeScaling::None,
            };
            (j.f32("rope_theta")?.unwrap_or(10000.0), scaling)
        }
    };
    let layers = j.req_usize("num_hidden_layers")?;
    let attention = match arch {
        Arch::Gemma3 => {
            let local_theta = match &by_layer_type {
                Some((_, Some(local))) => {
                    if parse_rope_scaling(local)? != RopeScaling::None {
                        bail!(Unsupported, "{file}: rope scaling on the sliding-window layers is not supported");
                    }
                    local.f32("rope_theta")?.unwrap_or(10000.0)
                }
                _ => j.f32("rope_local_base_freq")?.unwrap_or(10000.0),
            };
            gemma3_attention(&j, layers, local_theta)?
        }
        _ => AttentionConfig::default(),
    };

    let moe = parse_moe(&j, arch)?;
    let config = ModelConfig {
        arch,
        vocab: j.req_usize("vocab_size")?,
        hidden,
        layers,
        heads,
        kv_heads: j.usize("num_key_value_heads")?.unwrap_or(heads),
        head_dim,
        intermediate: j.req_usize("intermediate_size")?,
        rms_eps: j.req_f32("rms_norm_eps")?,
        rope_theta,
        rope_scaling,
        rope_interleaved: false,
        max_position: j.req_usize("max_position_embeddings")?,
        tied: j.bool("tie_word_embeddings")?.unwrap_or(false),
        qkv_bias: arch.traits().qkv_bias,
        qk_norm: arch.traits().qk_norm,
        attention,
        bos: j.token_id("bos_token_id")?,
        eos: j.token_id("eos_token_id")?,
        moe,
    };
    config.check(file)?;
    Ok(config)
}

/// Gemma 3's query scaling and sliding window: query_pre_attn_scalar, sliding_window, and which layers
/// slide (`layer_types`, or every layer but each `sliding_window_pattern`th); refuses soft-capping and
/// bidirectional attention, which this engine does not compute.
fn gemma3_attention(j: &Keys, layers: usize, local_theta: f32) -> Result<AttentionConfig> {
    let file = j.file;
    for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if let Some(v) = j.f32(key)? {
            bail!(Unsupported, "{file}: {key} = {v} is not supported");
        }
    }
    if j.bool("use_bidirectional_attention")?.unwrap_or(false) {
        bail!(Unsupported, "{file}: use_bidirectional_attention = true is not supported");
    }
    let query_scale_base = Some(j.f32("query_pre_attn_scalar")?.unwrap_or(256.0));
    let Some(window) = j.usize("sliding_window")? else {
        return Ok(AttentionConfig { query_scale_base, sliding: None });
    };
    let pattern = j.usize("sliding_window_pattern")?.unwrap_or(6);
    let global: Vec<bool> = match j.get("layer_types") {
        None => (0..layers).map(|l| pattern > 0 && (l + 1) % pattern == 0).collect(),
        Some(Value::Array(types)) if types.len() == layers => types
            .iter()
            .map(|t| match t.as_str() {
                Some("full_attention") => Ok(true),
                Some("sliding_attention") => Ok(false),
                _ => Err(j.bad("layer_types", t, "\"full_attention\" or \"sliding_attention\"")),
            })
            .collect::<Result<_>>()?,
        Some(v) => return Err(j.bad("layer_types", v, &format!("a list of {layers} layer types"))),
    };
    if global.iter().all(|&g| g) {
        return Ok(AttentionConfig { query_scale_base, sliding: None });
    }
    // Global layers at every `global_every`th layer, as Gemma 3 places them; with none, past the last.
    let global_every = global.iter().position(|&g| g).map_or(layers + 1, |first| first + 1);
    if global.iter().enumerate().any(|(l, &g)| g != (l + 1).is_multiple_of(global_every)) {
        bail!(Unsupported, "{file}: layer_types are not a global layer every {global_every} layers");
    }
    Ok(AttentionConfig {
        query_scale_base,
        sliding: Some(SlidingWindow { window, global_every, rope_theta: local_theta }),
    })
}

/// The Mixture-of-Experts keys: Qwen3-MoE's (`num_experts`, `num_experts_per_tok`,
/// `moe_intermediate_size`, `norm_topk_prob`; dense layers between expert layers are refused) and
/// Mixtral's (`num_local_experts`, `num_experts_per_tok`, experts as wide as `intermediate_size`,
/// always renormalized). transformers 5 writes either architecture's expert count as
/// `num_local_experts`, so both names are read for both.
fn parse_moe(j: &Keys, arch: Arch) -> Result<Option<MoeConfig>> {
    let file = j.file;
    let experts = |first: &str, second: &str| -> Result<usize> {
        match j.usize(first)? {
            Some(n) => Ok(n),
            None => j.usize(second)?.ok_or_else(|| j.missing(first)),
        }
    };
    match arch {
        Arch::Qwen3Moe => {
            if let Some(step) = j.usize("decoder_sparse_step")?
                && step != 1
            {
                bail!(
                    Unsupported,
                    "{file}: decoder_sparse_step = {step} (dense layers between expert layers) is not supported"
                );
            }
            match j.get("mlp_only_layers") {
                None => {}
                Some(Value::Array(layers)) if layers.is_empty() => {}
                Some(v) => bail!(
                    Unsupported,
                    "{file}: mlp_only_layers = {v} (dense layers among expert layers) is not supported"
                ),
            }
            Ok(Some(MoeConfig {
                experts: experts("num_experts", "num_local_experts")?,
                used: j.req_usize("num_experts_per_tok")?,
                intermediate: j.req_usize("moe_intermediate_size")?,
                // transformers' default for Qwen3-MoE.
                norm_topk: j.bool("norm_topk_prob")?.unwrap_or(false),
            }))
        }
        Arch::Mixtral => {
            if let Some(window) = j.get("sliding_window") {
                bail!(Unsupported, "{file}: sliding_window = {window} is not supported");
            }
            Ok(Some(MoeConfig {
                experts: experts("num_local_experts", "num_experts")?,
                used: j.req_usize("num_experts_per_tok")?,
                intermediate: j.req_usize("intermediate_size")?,
                norm_topk: true,
            }))
        }
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3 => Ok(None),
    }
}

/// rope_scaling (or transformers 5's rope_parameters): default, linear or llama3.
fn parse_rope_scaling(s: &Keys) -> Result<RopeScaling> {
    let kind = match s.str("rope_type")? {
        Some(kind) => Some(kind),
        None => s.str("type")?,
    };
    Ok(match kind {
        None | Some("default") => RopeScaling::None,
        Some("linear") => RopeScaling::Linear { factor: s.req_f32("factor")? },
        Some("llama3") => RopeScaling::Llama3 {
            factor: s.req_f32("factor")?,
            low_freq_factor: s.req_f32("low_freq_factor")?,
            high_freq_factor: s.req_f32("high_freq_factor")?,
            original_max_position: match u32::try_from(s.req_usize("original_max_position_embeddings")?) {
                Ok(n) => n,
                Err(_) => bail!(BadModel, "{}: key {}original_max_position_embeddings is too large", s.file, s.prefix),
            },
        },
        Some(other) => bail!(
            Unsupported,
            "{}: {}rope_type \"{other}\" is not supported (default, linear, llama3)",
            s.file,
            s.prefix
        ),
    })
}
