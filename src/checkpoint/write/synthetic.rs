//! The synthetic weights (a fixed formula per element, which scripts/hf_reference.py reproduces), the
//! formats a `Recipe` gives each tensor, and `MemSource`, a model held in memory.

use std::collections::HashMap;

use super::{OwnedTensor, fnv1a64, stored_bytes};
use crate::checkpoint::expected_tensors;
use crate::err;
use crate::model::{ModelConfig, names, shape_cols, shape_rows};
use crate::sampler::splitmix64;
use crate::status::Result;
use crate::tensor::{DType, encode_row};

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

/// llama.cpp's choice for a Q4_K_M matrix (before its fallback for rows that are not whole blocks): a
/// Mixture of Experts' router stays F32 (llama-quantize leaves `ffn_gate_inp` as the converter wrote it).
fn q4_k_m_dtype(cfg: &ModelConfig, name: &str) -> DType {
    let head = if cfg.tied { names::EMBED } else { names::LM_HEAD };
    if name == head {
        return DType::Q6_K;
    }
    let layer_part = name.strip_prefix("model.layers.").and_then(|rest| rest.split_once('.'));
    let Some((layer, part)) = layer_part.and_then(|(i, part)| Some((i.parse::<i64>().ok()?, part))) else {
        return DType::Q4_K;
    };
    if part == names::ROUTER {
        return DType::F32;
    }
    let n = cfg.layers as i64;
    let more_bits = layer < n / 8 || layer >= 7 * n / 8 || (layer - n / 8) % 3 == 2;
    let down = part == names::DOWN
        || names::expert_of(name).is_some_and(|(_, e)| part == names::expert(names::EXPERT_DOWN, e));
    if (part == names::V || down) && more_bits { DType::Q6_K } else { DType::Q4_K }
}

/// Generates one synthetic tensor's bytes in `dtype` (which `synthetic_dtype` chose), across cores.
pub(super) fn synthetic_bytes(name: &str, shape: &[usize], dtype: DType, seed: u64) -> Vec<u8> {
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
            if dtype.row_bytes(cols).is_none() {
                continue;
            }
            t.data = sampled_rows(dtype, rows, cols, 100 + k as u64);
            t.dtype = dtype;
        }
        src
    }
}

/// `rows` rows of `cols` values in `dtype` (a format whose rows are whole blocks) that repeat 64 random
/// rows (`random_matrix`): read at the same speed as any, and quick to make where encoding every row of
/// a block format takes minutes.
fn sampled_rows(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let row_bytes = dtype.row_bytes(cols).expect("rows of whole blocks");
    let sample = random_matrix(dtype, rows.min(64), cols, seed);
    sample.iter().copied().cycle().take(rows * row_bytes).collect()
}

/// `synthetic_bytes`, but a block format's matrix repeats 64 random rows of its own (`sampled_rows`,
/// seeded by `seed` and the name); float formats and vectors are `synthetic_bytes`' formula.
pub(super) fn sampled_bytes(name: &str, shape: &[usize], dtype: DType, seed: u64) -> Vec<u8> {
    if shape.len() != 2 || dtype.format().block_values == 1 {
        return synthetic_bytes(name, shape, dtype, seed);
    }
    sampled_rows(dtype, shape[0], shape[1], seed ^ fnv1a64(name.as_bytes()))
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
