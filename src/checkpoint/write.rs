//! Deterministic checkpoint writers, for tests, the tiny demo model and benchmarks: HF folders
//! (config.json + safetensors, optionally sharded) and GGUF files as llama.cpp's converter lays them out
//! (names, keys, Q/K row permutation for llama, `rope_freqs.weight` for Llama 3 scaling).
//!
//! `synthetic_weights` fills a model with values from a fixed formula that scripts/hf_reference.py
//! reproduces with numpy; the `write_synthetic_*` variants generate each tensor straight into the file.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, View};
use serde_json::{Value, json};

pub use super::gguf::GgufValue;
use super::gguf::{self, DEFAULT_ALIGNMENT};
use super::{ROPE_FREQS, expected_tensors, llama3_rope_factors};
use crate::model::{Arch, ModelConfig, MoeConfig, RopeScaling, names, shape_cols, shape_rows};
use crate::sampler::splitmix64;
use crate::status::Result;
use crate::tensor::{DType, encode_row};
use crate::{bail, err};

/// A tensor held in memory, under its canonical name, in its stored format.
#[derive(Clone, Debug, PartialEq)]
pub struct OwnedTensor {
    pub name: String,
    pub dtype: DType,
    /// Outermost first.
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl OwnedTensor {
    /// Encodes `values` (row-major over `shape`) in `dtype`.
    pub fn from_f32(name: &str, dtype: DType, shape: &[usize], values: &[f32]) -> Result<OwnedTensor> {
        let cols = shape_cols(shape);
        if values.len() != shape.iter().product::<usize>() || dtype.row_bytes(cols).is_none() {
            bail!(InvalidArgument, "tensor {name}: {} values do not fill {shape:?} in {}", values.len(), dtype.name());
        }
        let data =
            if cols == 0 { Vec::new() } else { values.chunks(cols).flat_map(|r| encode_row(dtype, r)).collect() };
        Ok(OwnedTensor { name: name.to_string(), dtype, shape: shape.to_vec(), data })
    }

    /// The values decoded to f32, row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        crate::model::TensorRef { dtype: self.dtype, shape: &self.shape, bytes: &self.data }.to_f32()
    }

    fn check(&self) -> Result<()> {
        match stored_bytes(self.dtype, &self.shape) {
            Some(n) if n == self.data.len() => Ok(()),
            Some(expected) => bail!(
                InvalidArgument,
                "tensor {}: {} bytes, but {:?} of {} needs {expected}",
                self.name,
                self.data.len(),
                self.shape,
                self.dtype.name()
            ),
            None => bail!(
                InvalidArgument,
                "tensor {}: {:?} rows are not whole {} blocks",
                self.name,
                self.shape,
                self.dtype.name()
            ),
        }
    }
}

/// Bytes of a tensor of `shape` in `dtype`; None when its rows are not whole blocks of it.
pub fn stored_bytes(dtype: DType, shape: &[usize]) -> Option<usize> {
    dtype.row_bytes(shape_cols(shape))?.checked_mul(shape_rows(shape))
}

// ---------------------------------------------------------------------------------------------------
// The synthetic weight formula.

pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xCBF2_9CE4_8422_2325, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01B3))
}

/// What the formula does with the uniform draw u in [-1, 1), by the tensor's name.
#[derive(Clone, Copy)]
enum Rule {
    Norm,
    Bias,
    Embed,
    Matrix { scale: f32 },
}

/// The value of every element of one synthetic tensor.
#[derive(Clone, Copy)]
struct Synthetic {
    key: u64,
    rule: Rule,
}

impl Synthetic {
    fn new(name: &str, shape: &[usize], seed: u64) -> Synthetic {
        let rule = if name.ends_with("norm.weight") {
            Rule::Norm
        } else if name.ends_with(".bias") {
            Rule::Bias
        } else if name == names::EMBED {
            Rule::Embed
        } else {
            Rule::Matrix { scale: 1.0 / (shape_cols(shape) as f32).sqrt() }
        };
        Synthetic { key: seed ^ fnv1a64(name.as_bytes()), rule }
    }

    fn value(&self, i: u64) -> f32 {
        let bits = splitmix64(self.key ^ i.wrapping_mul(0xD1B5_4A32_D192_ED03));
        let u = ((bits >> 40) as f32 / 16_777_216.0) * 2.0 - 1.0;
        match self.rule {
            Rule::Norm => 1.0 + 0.1 * u,
            Rule::Bias => 0.05 * u,
            Rule::Embed => u,
            Rule::Matrix { scale } => u * scale,
        }
    }

    /// Norms and biases are stored F32.
    fn is_vector(&self) -> bool {
        matches!(self.rule, Rule::Norm | Rule::Bias)
    }
}

/// Element `i` (row-major over `shape`) of the synthetic tensor `name`.
pub fn synthetic_element(name: &str, shape: &[usize], seed: u64, i: usize) -> f32 {
    Synthetic::new(name, shape, seed).value(i as u64)
}

/// The format a synthetic tensor is stored in: F32 for norms and biases, else `matrix_dtype`, except
/// where its rows are not whole blocks of it: then llama.cpp's fallback (Q2_K/Q3_K to Q4_0, Q4_K to
/// Q5_0, Q5_K to Q5_1, Q6_K to Q8_0), and F16 where those do not fit either, as llama.cpp does.
pub fn synthetic_dtype(name: &str, shape: &[usize], matrix_dtype: DType) -> DType {
    if Synthetic::new(name, shape, 0).is_vector() { DType::F32 } else { fitting(shape, matrix_dtype) }
}

/// `dtype`, or what llama.cpp falls back to when `shape`'s rows are not whole blocks of it.
fn fitting(shape: &[usize], dtype: DType) -> DType {
    let fallback = match dtype {
        DType::Q2_K | DType::Q3_K => DType::Q4_0,
        DType::Q4_K => DType::Q5_0,
        DType::Q5_K => DType::Q5_1,
        DType::Q6_K => DType::Q8_0,
        _ => DType::F16,
    };
    [dtype, fallback, DType::F16].into_iter().find(|d| stored_bytes(*d, shape).is_some()).unwrap_or(DType::F32)
}

/// Which format each matrix of a synthetic model is stored in (norms and biases are always F32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recipe {
    /// Every matrix in one format (see `synthetic_dtype` for rows that are not whole blocks).
    Uniform(DType),
    /// llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for the output head (the embedding when the head is tied)
    /// and for the `attn_v` and `ffn_down` matrices of the layers llama.cpp gives more bits (the first
    /// and last eighth of the layers and every third between: about half).
    Q4KM,
}

impl From<DType> for Recipe {
    fn from(dtype: DType) -> Recipe {
        Recipe::Uniform(dtype)
    }
}

impl Recipe {
    /// The format of tensor `name` (canonical) of shape `shape` in a model of `cfg`.
    pub fn dtype(self, cfg: &ModelConfig, name: &str, shape: &[usize]) -> DType {
        let matrix = match self {
            Recipe::Uniform(dtype) => dtype,
            Recipe::Q4KM => q4_k_m_dtype(cfg, name),
        };
        synthetic_dtype(name, shape, matrix)
    }

    pub fn name(self) -> &'static str {
        match self {
            Recipe::Uniform(dtype) => dtype.name(),
            Recipe::Q4KM => "Q4_K_M",
        }
    }

    /// "Q4_K_M", or a format's name for every matrix in it ("q8_0", "Q6_K", "bf16"), in any case.
    pub fn from_name(name: &str) -> Option<Recipe> {
        if name.eq_ignore_ascii_case("Q4_K_M") {
            Some(Recipe::Q4KM)
        } else {
            DType::from_name(name).map(Recipe::Uniform)
        }
    }
}

/// llama.cpp's choice for a Q4_K_M matrix (before its fallback for rows that are not whole blocks).
fn q4_k_m_dtype(cfg: &ModelConfig, name: &str) -> DType {
    let head = if cfg.tied { names::EMBED } else { names::LM_HEAD };
    if name == head {
        return DType::Q6_K;
    }
    let layer_part = name.strip_prefix("model.layers.").and_then(|rest| rest.split_once('.'));
    let Some((layer, part)) = layer_part.and_then(|(i, part)| Some((i.parse::<i64>().ok()?, part))) else {
        return DType::Q4_K;
    };
    let n = cfg.layers as i64;
    let more_bits = layer < n / 8 || layer >= 7 * n / 8 || (layer - n / 8) % 3 == 2;
    let down = part == names::DOWN
        || names::expert_of(name).is_some_and(|(_, e)| part == names::expert(names::EXPERT_DOWN, e));
    if (part == names::V || down) && more_bits { DType::Q6_K } else { DType::Q4_K }
}

/// Generates one synthetic tensor's bytes in `dtype` (which `synthetic_dtype` chose), across cores.
fn synthetic_bytes(name: &str, shape: &[usize], dtype: DType, seed: u64) -> Vec<u8> {
    let synthetic = Synthetic::new(name, shape, seed);
    let (rows, cols) = (shape_rows(shape), shape_cols(shape));
    let row_bytes = dtype.row_bytes(cols).expect("synthetic_dtype picks a format the rows fit");
    let mut out = vec![0u8; rows * row_bytes];
    if out.is_empty() {
        return out;
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // At least 1 Mi values a chunk, so small tensors stay on one thread.
    let chunks = threads.min((rows * cols).div_ceil(1 << 20)).max(1);
    let rows_per_chunk = rows.div_ceil(chunks);
    let fill = |first_row: usize, dst: &mut [u8]| {
        let mut values = vec![0f32; cols];
        for (r, row) in dst.chunks_exact_mut(row_bytes).enumerate() {
            let base = ((first_row + r) * cols) as u64;
            values.iter_mut().enumerate().for_each(|(c, v)| *v = synthetic.value(base + c as u64));
            row.copy_from_slice(&encode_row(dtype, &values));
        }
    };
    if chunks == 1 {
        fill(0, &mut out);
    } else {
        std::thread::scope(|s| {
            for (k, dst) in out.chunks_mut(rows_per_chunk * row_bytes).enumerate() {
                let fill = &fill;
                s.spawn(move || fill(k * rows_per_chunk, dst));
            }
        });
    }
    out
}

/// Every tensor the architecture reads (embedding, layers, final norm, the head unless tied), filled by
/// the synthetic formula; matrices in the formats `recipe` picks (a `DType` for all of them, or a mix),
/// norms and biases in F32.
pub fn synthetic_weights(cfg: &ModelConfig, seed: u64, recipe: impl Into<Recipe>) -> Vec<OwnedTensor> {
    let recipe = recipe.into();
    expected_tensors(cfg)
        .into_iter()
        .map(|(name, shape)| {
            let dtype = recipe.dtype(cfg, &name, &shape);
            let data = synthetic_bytes(&name, &shape, dtype, seed);
            OwnedTensor { name, dtype, shape, data }
        })
        .collect()
}

/// A model held in memory: the synthetic weights of `cfg` as a `TensorSource`, for tests and benchmarks
/// that load the backends without writing a checkpoint.
pub struct MemSource {
    pub cfg: ModelConfig,
    pub tensors: HashMap<String, OwnedTensor>,
}

impl MemSource {
    /// `synthetic_weights(cfg, seed, recipe)`, by name: `DType::Q8_0` for every matrix in Q8_0,
    /// `Recipe::Q4KM` for llama.cpp's Q4_K_M mix.
    pub fn synthetic(cfg: &ModelConfig, seed: u64, recipe: impl Into<Recipe>) -> MemSource {
        let tensors = synthetic_weights(cfg, seed, recipe).into_iter().map(|t| (t.name.clone(), t)).collect();
        MemSource { cfg: cfg.clone(), tensors }
    }

    /// A model of `cfg` whose block-format matrices repeat 64 random rows of their format: quick to make
    /// at the 8B shape, where encoding every row takes minutes, and read by the kernels at the same speed.
    /// Float formats are `synthetic`; rows that are not whole blocks stay BF16, as a converter keeps them.
    pub fn benchmark(cfg: &ModelConfig, recipe: impl Into<Recipe>) -> MemSource {
        let recipe = recipe.into();
        if let Recipe::Uniform(dtype) = recipe
            && dtype.format().block_values == 1
        {
            return MemSource::synthetic(cfg, 1, dtype);
        }
        let mut src = MemSource::synthetic(cfg, 1, DType::Bf16);
        for (k, t) in src.tensors.values_mut().enumerate() {
            if t.shape.len() != 2 {
                continue;
            }
            let dtype = recipe.dtype(cfg, &t.name, &t.shape);
            let (rows, cols) = (t.shape[0], t.shape[1]);
            let Some(row_bytes) = dtype.row_bytes(cols) else { continue };
            let sample = random_matrix(dtype, rows.min(64), cols, 100 + k as u64);
            t.data = sample.iter().copied().cycle().take(rows * row_bytes).collect();
            t.dtype = dtype;
        }
        src
    }
}

/// `rows` x `cols` uniform random values within 1/sqrt(cols), encoded in `dtype` on every core.
pub fn random_matrix(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let row_bytes = dtype.row_bytes(cols).expect("rows of whole blocks");
    let mut out = vec![0u8; rows * row_bytes];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = rows.div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (k, chunk) in out.chunks_mut(per * row_bytes).enumerate() {
            s.spawn(move || {
                let mut state = seed ^ (k as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                let mut values = vec![0f32; cols];
                for row in chunk.chunks_exact_mut(row_bytes) {
                    for v in values.iter_mut() {
                        state = splitmix64(state);
                        *v = ((state >> 40) as f32 / 16_777_216.0 * 2.0 - 1.0) / (cols as f32).sqrt();
                    }
                    row.copy_from_slice(&encode_row(dtype, &values));
                }
            });
        }
    });
    out
}

impl crate::model::TensorSource for MemSource {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn tensor(&self, name: &str) -> Result<crate::model::TensorRef<'_>> {
        let t = self.tensors.get(name).ok_or_else(|| err!(BadModel, "tensor {name} is missing"))?;
        Ok(crate::model::TensorRef { dtype: t.dtype, shape: &t.shape, bytes: &t.data })
    }
}

// ---------------------------------------------------------------------------------------------------
// HF folders.

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

fn io_error(path: &Path, e: impl std::fmt::Display) -> crate::status::Error {
    err!(IoError, "{}: {e}", path.display())
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| io_error(path, e))
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
    write_file(&dir.join(super::safetensors::CONFIG), text.as_bytes())
}

/// A canonical name as an HF folder of `cfg`'s architecture spells it (Mixtral's experts apart).
fn hf_name<'n>(cfg: &ModelConfig, canonical: &'n str) -> Cow<'n, str> {
    match cfg.arch {
        Arch::Mixtral => super::safetensors::mixtral_name(canonical, true).map_or(Cow::Borrowed(canonical), Cow::Owned),
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
        return write_safetensors(&dir.join(super::safetensors::SINGLE), all);
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
    write_file(&dir.join(super::safetensors::INDEX), text.as_bytes())
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
    write_safetensors(&dir.join(super::safetensors::SINGLE), views)
}

// ---------------------------------------------------------------------------------------------------
// GGUF.

/// llama.cpp's converter permutation of llama Q/K rows: within each head, rows (i, i + d/2) of HF's
/// layout become the adjacent pair (2i, 2i + 1), so rotating adjacent pairs equals HF's half rotation.
/// `row_bytes` is the size of one row (one element for a bias).
pub fn permute_qk_rows(data: &[u8], row_bytes: usize, heads: usize) -> Vec<u8> {
    reorder_qk_rows(data, row_bytes, heads, false)
}

/// The inverse of `permute_qk_rows`: GGUF llama order back to HF order.
pub fn unpermute_qk_rows(data: &[u8], row_bytes: usize, heads: usize) -> Vec<u8> {
    reorder_qk_rows(data, row_bytes, heads, true)
}

fn reorder_qk_rows(data: &[u8], row_bytes: usize, heads: usize, inverse: bool) -> Vec<u8> {
    let rows = data.len() / row_bytes;
    assert!(
        rows * row_bytes == data.len() && rows.is_multiple_of(2 * heads),
        "{rows} rows do not split into {heads} heads"
    );
    let half = rows / heads / 2;
    let mut out = vec![0u8; data.len()];
    for h in 0..heads {
        for j in 0..half {
            for t in 0..2 {
                let hf = h * 2 * half + t * half + j;
                let gguf = h * 2 * half + 2 * j + t;
                let (dst, src) = if inverse { (hf, gguf) } else { (gguf, hf) };
                out[dst * row_bytes..(dst + 1) * row_bytes]
                    .copy_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    out
}

/// The head count whose rows llama.cpp permutes in `canonical` (Q and K, weights and biases, of the
/// architectures whose GGUF files rotate adjacent pairs).
fn permuted_heads(cfg: &ModelConfig, canonical: &str) -> Option<usize> {
    if !cfg.arch.traits().gguf_rope_interleaved {
        return None;
    }
    let part = canonical.strip_prefix("model.layers.")?.split_once('.')?.1;
    match part {
        names::Q | names::Q_BIAS => Some(cfg.heads),
        names::K | names::K_BIAS => Some(cfg.kv_heads),
        _ => None,
    }
}

/// One tensor to write into a GGUF file.
struct GgufEntry<'a> {
    gguf_name: String,
    canonical: String,
    dtype: DType,
    shape: Vec<usize>,
    data: GgufData<'a>,
}

enum GgufData<'a> {
    Bytes(&'a [u8]),
    Owned(Vec<u8>),
    Synthetic {
        seed: u64,
    },
    /// A layer's experts of one role stacked, expert 0 first, as llama.cpp stores them.
    Experts(Vec<GgufEntry<'a>>),
}

impl GgufEntry<'_> {
    /// The bytes as stored in GGUF (llama Q/K rows permuted).
    fn bytes(&self, cfg: &ModelConfig) -> Cow<'_, [u8]> {
        let hf: Cow<[u8]> = match &self.data {
            GgufData::Bytes(b) => Cow::Borrowed(b),
            GgufData::Owned(v) => Cow::Borrowed(v),
            GgufData::Synthetic { seed } => {
                Cow::Owned(synthetic_bytes(&self.canonical, &self.shape, self.dtype, *seed))
            }
            GgufData::Experts(experts) => Cow::Owned(experts.iter().flat_map(|e| e.bytes(cfg).into_owned()).collect()),
        };
        if cfg.arch.traits().hf_norms_plus_one && self.canonical.ends_with("norm.weight") {
            return Cow::Owned(plus_one(&hf, self.dtype));
        }
        match permuted_heads(cfg, &self.canonical) {
            None => hf,
            Some(heads) => {
                let cols = if self.shape.len() < 2 { 1 } else { *self.shape.last().unwrap_or(&1) };
                let row_bytes = self.dtype.row_bytes(cols).expect("checked before writing");
                Cow::Owned(permute_qk_rows(&hf, row_bytes, heads))
            }
        }
    }
}

/// An F32 norm weight w stored as w + 1, as llama.cpp's converter stores Gemma's norms.
fn plus_one(data: &[u8], dtype: DType) -> Vec<u8> {
    assert_eq!(dtype, DType::F32, "norm weights are written F32");
    data.chunks_exact(4)
        .flat_map(|b| (f32::from_le_bytes(b.try_into().expect("4 bytes")) + 1.0).to_le_bytes())
        .collect()
}

fn u32_of(what: &str, v: usize) -> Result<GgufValue> {
    u32::try_from(v).map(GgufValue::U32).map_err(|_| err!(InvalidArgument, "{what} = {v} does not fit a GGUF u32"))
}

/// Consecutive entries of one expert stack (`gguf::expert_stack_of`) made one stacked entry of shape
/// [experts, rows, cols], as the weight table lists them; INVALID_ARGUMENT where given experts differ in
/// format or shape, or come out of order or with one left out.
fn stack_experts(entries: Vec<GgufEntry<'_>>) -> Result<Vec<GgufEntry<'_>>> {
    let mut out: Vec<GgufEntry> = Vec::with_capacity(entries.len());
    for e in entries {
        let Some((stack, index)) = gguf::expert_stack_of(&e.canonical) else {
            out.push(e);
            continue;
        };
        match out.last_mut() {
            Some(last) if last.gguf_name == stack => {
                let GgufData::Experts(experts) = &mut last.data else { unreachable!("a stack holds experts") };
                if index != experts.len() || e.dtype != last.dtype || e.shape[..] != last.shape[1..] {
                    bail!(
                        InvalidArgument,
                        "tensor {}: not the next expert of {stack} in its format and shape",
                        e.canonical
                    );
                }
                experts.push(e);
                last.shape[0] += 1;
            }
            _ if index != 0 => {
                bail!(InvalidArgument, "tensor {}: the experts of {stack} before it are not given", e.canonical)
            }
            _ => {
                let mut shape = vec![1];
                shape.extend_from_slice(&e.shape);
                out.push(GgufEntry {
                    gguf_name: stack.clone(),
                    canonical: stack,
                    dtype: e.dtype,
                    shape,
                    data: GgufData::Experts(vec![e]),
                });
            }
        }
    }
    Ok(out)
}

/// The metadata llama.cpp's converter writes for `cfg` (general.*, `{arch}.*`, bos/eos ids; a
/// Mixture of Experts' `expert_*` keys).
pub fn gguf_metadata(cfg: &ModelConfig) -> Result<Vec<(String, GgufValue)>> {
    let arch = cfg.arch.gguf_name();
    let key = |k: &str| format!("{arch}.{k}");
    let mut kv = vec![
        ("general.architecture".to_string(), GgufValue::String(arch.to_string())),
        ("general.alignment".to_string(), GgufValue::U32(DEFAULT_ALIGNMENT as u32)),
        (key("vocab_size"), u32_of("vocab", cfg.vocab)?),
        (key("context_length"), u32_of("max_position", cfg.max_position)?),
        (key("embedding_length"), u32_of("hidden", cfg.hidden)?),
        (key("block_count"), u32_of("layers", cfg.layers)?),
        // llama.cpp reads a Mixtral's experts as feed_forward_length wide.
        (
            key("feed_forward_length"),
            u32_of("intermediate", if cfg.arch == Arch::Mixtral { cfg.ffn_width() } else { cfg.intermediate })?,
        ),
        (key("attention.head_count"), u32_of("heads", cfg.heads)?),
        (key("attention.head_count_kv"), u32_of("kv_heads", cfg.kv_heads)?),
        (key("attention.key_length"), u32_of("head_dim", cfg.head_dim)?),
        (key("attention.value_length"), u32_of("head_dim", cfg.head_dim)?),
        (key("rope.dimension_count"), u32_of("head_dim", cfg.head_dim)?),
        (key("rope.freq_base"), GgufValue::F32(cfg.rope_theta)),
        (key("attention.layer_norm_rms_epsilon"), GgufValue::F32(cfg.rms_eps)),
    ];
    match cfg.rope_scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => {
            kv.push((key("rope.scaling.type"), GgufValue::String("linear".to_string())));
            kv.push((key("rope.scaling.factor"), GgufValue::F32(factor)));
        }
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
            kv.push((gguf::KEY_LLAMA3_FACTOR.to_string(), GgufValue::F32(factor)));
            kv.push((gguf::KEY_LLAMA3_LOW.to_string(), GgufValue::F32(low_freq_factor)));
            kv.push((gguf::KEY_LLAMA3_HIGH.to_string(), GgufValue::F32(high_freq_factor)));
            kv.push((gguf::KEY_LLAMA3_ORIGINAL.to_string(), GgufValue::U32(original_max_position)));
        }
    }
    if cfg.arch == Arch::Gemma3
        && let Some(s) = cfg.attention.sliding
    {
        // llama.cpp reads no more: every sixth layer global, a local base of 10000, the query scaling
        // by the layer count (see `gemma3_attention` in gguf/open.rs).
        kv.push((key("attention.sliding_window"), u32_of("sliding window", s.window)?));
    }
    if let Some(m) = cfg.moe {
        kv.push((key("expert_count"), u32_of("experts", m.experts)?));
        kv.push((key("expert_used_count"), u32_of("experts used", m.used)?));
        if cfg.arch != Arch::Mixtral {
            kv.push((key("expert_feed_forward_length"), u32_of("expert width", m.intermediate)?));
        }
        if !m.norm_topk {
            kv.push((key("expert_weights_norm"), GgufValue::Bool(false)));
        }
    }
    if let Some(bos) = cfg.bos {
        kv.push(("tokenizer.ggml.bos_token_id".to_string(), GgufValue::U32(bos)));
    }
    if let Some(eos) = cfg.eos {
        kv.push(("tokenizer.ggml.eos_token_id".to_string(), GgufValue::U32(eos)));
    }
    Ok(kv)
}

/// The llama3 `rope_freqs.weight` entry llama.cpp's converter adds for llama models.
fn rope_freqs_entry(cfg: &ModelConfig) -> Option<GgufEntry<'static>> {
    if cfg.arch.gguf_name() != "llama" {
        return None;
    }
    let factors = llama3_rope_factors(cfg)?;
    Some(GgufEntry {
        gguf_name: "rope_freqs.weight".to_string(),
        canonical: ROPE_FREQS.to_string(),
        dtype: DType::F32,
        shape: vec![factors.len()],
        data: GgufData::Owned(factors.iter().flat_map(|f| f.to_le_bytes()).collect()),
    })
}

/// Writes a GGUF v3 file: metadata from `cfg` (then `extra_kv`, which replaces a generated key of the
/// same name), tensors under llama.cpp's names with their data 32-byte aligned, llama Q/K rows permuted
/// as llama.cpp's converter does, and `rope_freqs.weight` for llama with Llama 3 scaling.
pub fn write_gguf(
    path: &Path,
    cfg: &ModelConfig,
    tensors: &[OwnedTensor],
    extra_kv: &[(String, GgufValue)],
) -> Result<()> {
    let mut entries = Vec::with_capacity(tensors.len() + 1);
    for t in tensors {
        t.check()?;
        let gguf_name = gguf::gguf_name_in(cfg.arch, &t.name)
            .or_else(|| gguf::expert_stack_of(&t.name).map(|s| s.0))
            .ok_or_else(|| err!(InvalidArgument, "tensor {} has no GGUF name", t.name))?;
        entries.push(GgufEntry {
            gguf_name,
            canonical: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            data: GgufData::Bytes(&t.data),
        });
    }
    if !tensors.iter().any(|t| t.name == ROPE_FREQS) {
        entries.extend(rope_freqs_entry(cfg));
    }
    write_gguf_entries(path, cfg, &stack_experts(entries)?, extra_kv)
}

/// `write_gguf` for `synthetic_weights(cfg, seed, recipe)`, one tensor generated at a time as the file
/// is written, so a model far larger than memory can be written.
pub fn write_synthetic_gguf(path: &Path, cfg: &ModelConfig, seed: u64, recipe: impl Into<Recipe>) -> Result<()> {
    write_synthetic_gguf_kv(path, cfg, seed, recipe, &[])
}

/// `write_synthetic_gguf` with `extra_kv` after the generated metadata (a tokenizer's keys), as
/// `write_gguf` takes them.
pub fn write_synthetic_gguf_kv(
    path: &Path,
    cfg: &ModelConfig,
    seed: u64,
    recipe: impl Into<Recipe>,
    extra_kv: &[(String, GgufValue)],
) -> Result<()> {
    let recipe = recipe.into();
    let mut entries: Vec<GgufEntry> = expected_tensors(cfg)
        .into_iter()
        .map(|(canonical, shape)| GgufEntry {
            gguf_name: gguf::gguf_name_in(cfg.arch, &canonical)
                .or_else(|| gguf::expert_stack_of(&canonical).map(|s| s.0))
                .expect("every expected tensor has a GGUF name"),
            dtype: recipe.dtype(cfg, &canonical, &shape),
            canonical,
            shape,
            data: GgufData::Synthetic { seed },
        })
        .collect();
    entries.extend(rope_freqs_entry(cfg));
    write_gguf_entries(path, cfg, &stack_experts(entries)?, extra_kv)
}

fn write_gguf_entries(
    path: &Path,
    cfg: &ModelConfig,
    entries: &[GgufEntry],
    extra_kv: &[(String, GgufValue)],
) -> Result<()> {
    let mut kv: Vec<(String, GgufValue)> = Vec::new();
    for (k, v) in extra_kv {
        if kv.iter().any(|(seen, _)| seen == k) {
            bail!(InvalidArgument, "GGUF key {k} is given twice");
        }
        kv.push((k.clone(), v.clone()));
    }
    let generated = gguf_metadata(cfg)?;
    let mut metadata: Vec<(String, GgufValue)> =
        generated.into_iter().filter(|(k, _)| !kv.iter().any(|(extra, _)| extra == k)).collect();
    metadata.extend(kv);

    let align = DEFAULT_ALIGNMENT as usize;
    let mut header = Vec::new();
    header.extend_from_slice(gguf::MAGIC);
    header.extend_from_slice(&gguf::VERSION.to_le_bytes());
    header.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    header.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in &metadata {
        gguf::put_string(&mut header, k);
        v.encode(&mut header);
    }
    let mut offset = 0usize;
    let mut sizes = Vec::with_capacity(entries.len());
    for e in entries {
        if entries.iter().filter(|o| o.gguf_name == e.gguf_name).count() > 1 {
            bail!(InvalidArgument, "tensor {} is given twice", e.canonical);
        }
        if e.shape.is_empty() || e.shape.len() > gguf::MAX_DIMS {
            bail!(InvalidArgument, "tensor {}: GGUF holds 1 to 4 dimensions, not {:?}", e.canonical, e.shape);
        }
        let bytes = stored_bytes(e.dtype, &e.shape).ok_or_else(|| {
            err!(InvalidArgument, "tensor {}: {:?} rows are not whole {} blocks", e.canonical, e.shape, e.dtype.name())
        })?;
        let cols = if e.shape.len() < 2 { 1 } else { e.shape[e.shape.len() - 1] };
        if let Some(heads) = permuted_heads(cfg, &e.canonical)
            && (e.shape[0] % (2 * heads) != 0 || e.dtype.row_bytes(cols).is_none())
        {
            bail!(
                InvalidArgument,
                "tensor {}: {} rows do not split into {heads} heads of pairs",
                e.canonical,
                e.shape[0]
            );
        }
        gguf::put_string(&mut header, &e.gguf_name);
        header.extend_from_slice(&(e.shape.len() as u32).to_le_bytes());
        for d in e.shape.iter().rev() {
            header.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        header.extend_from_slice(&e.dtype.ggml_type().to_le_bytes());
        header.extend_from_slice(&(offset as u64).to_le_bytes());
        sizes.push(bytes);
        offset = (offset + bytes).next_multiple_of(align);
    }
    header.resize(header.len().next_multiple_of(align), 0);

    // Written beside the target and renamed over it, so a reader mapping the old file never sees it shrink.
    let tmp = PathBuf::from(format!("{}.tmp{}", path.display(), std::process::id()));
    let result = (|| -> Result<()> {
        let file = File::create(&tmp).map_err(|e| io_error(&tmp, e))?;
        let mut out = BufWriter::with_capacity(8 << 20, file);
        out.write_all(&header).map_err(|e| io_error(&tmp, e))?;
        let zeros = [0u8; DEFAULT_ALIGNMENT as usize];
        for (e, size) in entries.iter().zip(&sizes) {
            let bytes = e.bytes(cfg);
            debug_assert_eq!(bytes.len(), *size);
            out.write_all(&bytes).map_err(|e| io_error(&tmp, e))?;
            out.write_all(&zeros[..size.next_multiple_of(align) - size]).map_err(|e| io_error(&tmp, e))?;
        }
        out.into_inner().map_err(|e| io_error(&tmp, e.error()))?.sync_all().map_err(|e| io_error(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| io_error(path, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// The GGUF file at `src` rewritten at `dst` with every tensor decoded to F32 as stored (each row by the
/// format's own decoder, so the values are exactly those a backend computes with): the same metadata,
/// names, shapes and order (llama's Q/K rows stay permuted). The exact F32 model of a quantized file.
pub fn write_gguf_dequantized(src: &Path, dst: &Path) -> Result<()> {
    let bytes = std::fs::read(src).map_err(|e| io_error(src, e))?;
    let g = gguf::parse(&bytes, &src.display().to_string())?;
    let align = g.alignment as usize;
    let mut header = Vec::new();
    header.extend_from_slice(gguf::MAGIC);
    header.extend_from_slice(&gguf::VERSION.to_le_bytes());
    header.extend_from_slice(&(g.tensors.len() as u64).to_le_bytes());
    header.extend_from_slice(&(g.metadata.len() as u64).to_le_bytes());
    for (k, v) in &g.metadata {
        gguf::put_string(&mut header, k);
        v.encode(&mut header);
    }
    let mut offset = 0usize;
    for t in &g.tensors {
        let values = t.dims.iter().product::<u64>() as usize;
        gguf::put_string(&mut header, &t.name);
        header.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            header.extend_from_slice(&d.to_le_bytes());
        }
        header.extend_from_slice(&DType::F32.ggml_type().to_le_bytes());
        header.extend_from_slice(&(offset as u64).to_le_bytes());
        offset = (offset + values * 4).next_multiple_of(align);
    }
    header.resize(header.len().next_multiple_of(align), 0);
    let file = File::create(dst).map_err(|e| io_error(dst, e))?;
    let mut out = BufWriter::with_capacity(8 << 20, file);
    out.write_all(&header).map_err(|e| io_error(dst, e))?;
    for t in &g.tensors {
        let cols = t.dims[0] as usize;
        let row_bytes = t.dtype.row_bytes(cols).ok_or_else(|| err!(BadModel, "tensor {}: rows of {cols}", t.name))?;
        let (mut row, mut le) = (vec![0f32; cols], Vec::with_capacity(cols * 4));
        for stored in bytes[t.start..t.start + t.bytes].chunks_exact(row_bytes) {
            crate::tensor::decode_row(t.dtype, stored, &mut row);
            le.clear();
            le.extend(row.iter().flat_map(|v| v.to_le_bytes()));
            out.write_all(&le).map_err(|e| io_error(dst, e))?;
        }
        let size = t.bytes / row_bytes * cols * 4;
        out.write_all(&vec![0u8; size.next_multiple_of(align) - size]).map_err(|e| io_error(dst, e))?;
    }
    out.into_inner().map_err(|e| io_error(dst, e.error()))?.sync_all().map_err(|e| io_error(dst, e))
}
