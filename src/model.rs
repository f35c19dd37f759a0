//! What a dense decoder is, independent of the file it came from, and the weights' canonical names.

use crate::status::Result;
use crate::tensor::DType;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: u32,
    },
}

/// Shapes and hyper-parameters of one model. Filled from config.json or from GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    /// Rotate adjacent pairs (x0,x1),(x2,x3).. as llama.cpp does for GGUF llama, whose converter
    /// permuted Q/K rows; false rotates halves (x_i, x_{i+d/2}) as HF and GGUF qwen2/qwen3 do.
    pub rope_interleaved: bool,
    /// The model's own window (max_position_embeddings / context_length).
    pub max_position: usize,
    /// The output head is the embedding table.
    pub tied: bool,
    /// Qwen2: q/k/v projections carry a bias.
    pub qkv_bias: bool,
    /// Qwen3: RMSNorm over each head of q and k before the rotation.
    pub qk_norm: bool,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
}

impl ModelConfig {
    /// One token of one stream's KV cache in bf16: layers x (K and V) x kv_heads x head_dim x 2 bytes.
    pub fn kv_bytes_per_token(&self) -> u64 {
        (self.layers * 2 * self.kv_heads * self.head_dim * 2) as u64
    }

    /// What refuses appending `tokens` to a stream holding `len` of `window`: no tokens, an id outside
    /// the vocabulary, or too many tokens. Every backend checks this before writing anything.
    pub fn check_append(&self, len: usize, window: usize, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            crate::bail!(InvalidArgument, "no tokens to append");
        }
        if let Some((i, &t)) = tokens.iter().enumerate().find(|&(_, &t)| t as usize >= self.vocab) {
            crate::bail!(OutOfRange, "token {i} is id {t}, outside the vocabulary of {}", self.vocab);
        }
        if len + tokens.len() > window {
            crate::bail!(NoRoom, "{} tokens after {len} do not fit the stream's window of {window}", tokens.len());
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// Canonical (HF) tensor names; the GGUF reader maps its own names onto these.
pub mod names {
    pub const EMBED: &str = "model.embed_tokens.weight";
    pub const FINAL_NORM: &str = "model.norm.weight";
    pub const LM_HEAD: &str = "lm_head.weight";

    pub fn layer(i: usize, part: &str) -> String {
        format!("model.layers.{i}.{part}")
    }

    /// Per-layer parts, HF spelling.
    pub const ATTN_NORM: &str = "input_layernorm.weight";
    pub const FFN_NORM: &str = "post_attention_layernorm.weight";
    pub const Q: &str = "self_attn.q_proj.weight";
    pub const K: &str = "self_attn.k_proj.weight";
    pub const V: &str = "self_attn.v_proj.weight";
    pub const O: &str = "self_attn.o_proj.weight";
    pub const Q_BIAS: &str = "self_attn.q_proj.bias";
    pub const K_BIAS: &str = "self_attn.k_proj.bias";
    pub const V_BIAS: &str = "self_attn.v_proj.bias";
    pub const Q_NORM: &str = "self_attn.q_norm.weight";
    pub const K_NORM: &str = "self_attn.k_norm.weight";
    pub const GATE: &str = "mlp.gate_proj.weight";
    pub const UP: &str = "mlp.up_proj.weight";
    pub const DOWN: &str = "mlp.down_proj.weight";
}

/// A tensor's format, shape (outermost first: a [out, in] matrix has `out` rows of `in` values)
/// and bytes, wherever they live.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

impl TensorRef<'_> {
    pub fn rows(&self) -> usize {
        if self.shape.len() < 2 { 1 } else { self.shape[..self.shape.len() - 1].iter().product() }
    }

    pub fn cols(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }

    /// Decodes row `r` into f32.
    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        let cols = self.cols();
        let rb = self.dtype.row_bytes(cols).expect("validated at load");
        let mut out = vec![0f32; cols];
        crate::tensor::decode_row(self.dtype, &self.bytes[r * rb..(r + 1) * rb], &mut out);
        out
    }

    /// The whole tensor in f32, row after row.
    pub fn to_f32(&self) -> Vec<f32> {
        (0..self.rows()).flat_map(|r| self.row_f32(r)).collect()
    }
}

/// Where the weights of a model come from: a checkpoint on disk, or tensors built in memory by a test.
pub trait TensorSource {
    fn config(&self) -> &ModelConfig;
    /// The tensor by canonical name; `BAD_MODEL` naming it when absent.
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>>;
    /// The tensor if present (biases and norms some architectures lack).
    fn try_tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        self.tensor(name).ok()
    }
}
