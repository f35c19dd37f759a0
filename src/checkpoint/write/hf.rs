//! HF folders: config.json and safetensors, one file or shards, from held or synthetic tensors.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use safetensors::tensor::{Dtype, View};
use serde_json::{Value, json};

use super::synthetic::{synthetic_bytes, synthetic_dtype};
use super::{OwnedTensor, io_error, stored_bytes, write_file};
use crate::bail;
use crate::checkpoint::expected_tensors;
use crate::model::{Arch, ModelConfig, MoeConfig, RopeScaling};
use crate::status::Result;
use crate::tensor::DType;

fn json_f32(x: f32) -> Value {
    // Through the shortest decimal, so 1e-5f32 is written 1e-05 rather than 9.999999747378752e-06.
    let shortest: f64 = x.to_string().parse().unwrap_or(x as f64);
    serde_json::Number::from_f64(shortest).map_or(Value::Null, Value::Number)
}

/// config.json for `cfg`, in the keys transformers reads (HF rotates halves: `rope_interleaved` has no
/// place here; weights given to the HF writers are in HF row order).
pub fn hf_config_json(cfg: &ModelConfig) -> Value {
    let architecture = match cfg.arch {
        Arch::Llama => "LlamaForCausalLM",
        Arch::Qwen2 => "Qwen2ForCausalLM",
        Arch::Qwen3 => "Qwen3ForCausalLM",
        Arch::Gemma3 => "Gemma3ForCausalLM",
        Arch::Qwen3Moe => "Qwen3MoeForCausalLM",
        Arch::Mixtral => "MixtralForCausalLM",
    };
    let rope_scaling = match cfg.rope_scaling {
        RopeScaling::None => Value::Null,
        RopeScaling::Linear { factor } => json!({ "rope_type": "linear", "factor": json_f32(factor) }),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => json!({
            "rope_type": "llama3",
            "factor": json_f32(factor),
            "low_freq_factor": json_f32(low_freq_factor),
            "high_freq_factor": json_f32(high_freq_factor),
            "original_max_position_embeddings": original_max_position,
        }),
    };
    let mut config = json!({
        "architectures": [architecture],
        "model_type": cfg.arch.traits().hf_model_type,
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.hidden,
        // Mixtral's experts are as wide as its intermediate_size.
        "intermediate_size": if cfg.arch == Arch::Mixtral { cfg.ffn_width() } else { cfg.intermediate },
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.arch.traits().activation.hf_names()[0],
        "max_position_embeddings": cfg.max_position,
        "rms_norm_eps": json_f32(cfg.rms_eps),
        "rope_theta": json_f32(cfg.rope_theta),
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": cfg.tied,
        "bos_token_id": cfg.bos,
        "eos_token_id": cfg.eos,
        "use_cache": true,
    });
    let extra = match cfg.arch {
        Arch::Llama => json!({ "attention_bias": false, "mlp_bias": false }),
        Arch::Qwen2 => json!({ "use_sliding_window": false }),
        Arch::Qwen3 => json!({ "attention_bias": false, "use_sliding_window": false }),
        Arch::Gemma3 => gemma3_config_json(cfg),
        Arch::Qwen3Moe => {
            let m = cfg.moe.unwrap_or(MoeConfig { experts: 0, used: 0, intermediate: 0, norm_topk: false });
            json!({
                "attention_bias": false,
                "use_sliding_window": false,
                "num_experts": m.experts,
                "num_experts_per_tok": m.used,
                "moe_intermediate_size": m.intermediate,
                "norm_topk_prob": m.norm_topk,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            })
        }
        Arch::Mixtral => {
            let m = cfg.moe.unwrap_or(MoeConfig { experts: 0, used: 0, intermediate: 0, norm_topk: true });
            json!({
                "num_local_experts": m.experts,
                "num_experts_per_tok": m.used,
                "sliding_window": null,
            })
        }
    };
    if let (Some(c), Value::Object(e)) = (config.as_object_mut(), extra) {
        c.extend(e);
    }
    config
}

/// Gemma 3's keys: query_pre_attn_scalar, and the sliding window with its layer types and local base
/// (a model without one has every layer global).
fn gemma3_config_json(cfg: &ModelConfig) -> Value {
    let a = cfg.attention;
    let global = |l: usize| cfg.attention.window(l).is_none();
    let layer_types: Vec<&str> =
        (0..cfg.layers).map(|l| if global(l) { "full_attention" } else { "sliding_attention" }).collect();
    json!({
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": false,
        "query_pre_attn_scalar": json_f32(a.query_scale_base.unwrap_or(cfg.head_dim as f32)),
        "sliding_window": a.sliding.map_or(cfg.max_position, |s| s.window),
        "layer_types": layer_types,
        "rope_local_base_freq": json_f32(a.sliding.map_or(10000.0, |s| s.rope_theta)),
        "final_logit_softcapping": null,
        "attn_logit_softcapping": null,
    })
}

/// One tensor as the safetensors crate serializes it: borrowed bytes, or generated when written.
struct StTensor<'a> {
    dtype: DType,
    shape: &'a [usize],
    data: StData<'a>,
}

enum StData<'a> {
    Bytes(&'a [u8]),
    Synthetic { name: &'a str, seed: u64 },
}

fn st_dtype(dtype: DType) -> Option<Dtype> {
    dtype.format().safetensors
}

impl View for StTensor<'_> {
    fn dtype(&self) -> Dtype {
        st_dtype(self.dtype).expect("checked before writing")
    }

    fn shape(&self) -> &[usize] {
        self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        match self.data {
            StData::Bytes(b) => Cow::Borrowed(b),
            StData::Synthetic { name, seed } => Cow::Owned(synthetic_bytes(name, self.shape, self.dtype, seed)),
        }
    }

    fn data_len(&self) -> usize {
        stored_bytes(self.dtype, self.shape).expect("checked before writing")
    }
}

fn write_safetensors(path: &Path, tensors: Vec<(&str, StTensor)>) -> Result<()> {
    for (name, t) in &tensors {
        if st_dtype(t.dtype).is_none() {
            bail!(InvalidArgument, "tensor {name}: {} cannot be stored in safetensors", t.dtype.name());
        }
    }
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(tensors, Some(metadata), path).map_err(|e| io_error(path, e))
}

fn write_config(dir: &Path, cfg: &ModelConfig) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| io_error(dir, e))?;
    let text = serde_json::to_string_pretty(&hf_config_json(cfg)).expect("a JSON value serializes");
    write_file(&dir.join(crate::checkpoint::safetensors::CONFIG), text.as_bytes())
}

/// A canonical name as an HF folder of `cfg`'s architecture spells it (Mixtral's experts apart).
fn hf_name<'n>(cfg: &ModelConfig, canonical: &'n str) -> Cow<'n, str> {
    match cfg.arch {
        Arch::Mixtral => {
            crate::checkpoint::safetensors::mixtral_name(canonical, true).map_or(Cow::Borrowed(canonical), Cow::Owned)
        }
        _ => Cow::Borrowed(canonical),
    }
}

/// Writes an HF folder: config.json from `cfg`, and the tensors (canonical names, spelled as the
/// architecture's folders spell them) in model.safetensors (`shards` <= 1) or in `shards` files with
/// model.safetensors.index.json. Quantized tensors are refused.
pub fn write_hf_folder(dir: &Path, cfg: &ModelConfig, tensors: &[OwnedTensor], shards: usize) -> Result<()> {
    tensors.iter().try_for_each(OwnedTensor::check)?;
    write_config(dir, cfg)?;
    let renamed: Vec<OwnedTensor> =
        tensors.iter().map(|t| OwnedTensor { name: hf_name(cfg, &t.name).into_owned(), ..t.clone() }).collect();
    let tensors = &renamed[..];
    fn view(t: &OwnedTensor) -> StTensor<'_> {
        StTensor { dtype: t.dtype, shape: &t.shape, data: StData::Bytes(&t.data) }
    }
    let shards = shards.clamp(1, tensors.len().max(1));
    if shards == 1 {
        let all = tensors.iter().map(|t| (t.name.as_str(), view(t))).collect();
        return write_safetensors(&dir.join(crate::checkpoint::safetensors::SINGLE), all);
    }
    // Consecutive tensors, each shard taking about an equal share of the bytes.
    let total: usize = tensors.iter().map(|t| t.data.len()).sum();
    let mut groups: Vec<Vec<&OwnedTensor>> = vec![Vec::new(); shards];
    let (mut k, mut done) = (0usize, 0usize);
    for (i, t) in tensors.iter().enumerate() {
        let left = tensors.len() - i;
        let share_done = done * shards >= (k + 1) * total;
        // Move on once this shard has its share, or when every later shard needs one of those left.
        if k + 1 < shards && !groups[k].is_empty() && (share_done || left < shards - k) {
            k += 1;
        }
        groups[k].push(t);
        done += t.data.len();
    }
    let mut weight_map = BTreeMap::new();
    for (k, group) in groups.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", k + 1, shards);
        for t in group {
            weight_map.insert(t.name.clone(), Value::String(file.clone()));
        }
        let views = group.iter().map(|t| (t.name.as_str(), view(t))).collect();
        write_safetensors(&dir.join(&file), views)?;
    }
    let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    let text = serde_json::to_string_pretty(&index).expect("a JSON value serializes");
    write_file(&dir.join(crate::checkpoint::safetensors::INDEX), text.as_bytes())
}

/// `write_hf_folder` for `synthetic_weights(cfg, seed, dtype)`, one tensor generated at a time as the
/// file is written, so a model far larger than memory can be written.
pub fn write_synthetic_hf(dir: &Path, cfg: &ModelConfig, seed: u64, dtype: DType) -> Result<()> {
    if st_dtype(dtype).is_none() {
        bail!(InvalidArgument, "{} cannot be stored in safetensors", dtype.name());
    }
    write_config(dir, cfg)?;
    let shapes = expected_tensors(cfg);
    let spelled: Vec<String> = shapes.iter().map(|(name, _)| hf_name(cfg, name).into_owned()).collect();
    let views = shapes
        .iter()
        .zip(&spelled)
        .map(|((name, shape), stored)| {
            let dtype = synthetic_dtype(name, shape, dtype);
            (stored.as_str(), StTensor { dtype, shape, data: StData::Synthetic { name, seed } })
        })
        .collect();
    write_safetensors(&dir.join(crate::checkpoint::safetensors::SINGLE), views)
}
