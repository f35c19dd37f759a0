//! What a decoder is (dense or Mixture-of-Experts), independent of its file; the weights' canonical names.

use crate::status::Result;
use crate::tensor::DType;
mod moe;
pub use self::moe::{MAX_EXPERTS, MoeConfig};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
    /// Qwen3 with a Mixture-of-Experts feed-forward in every layer (GGUF `qwen3moe`).
    Qwen3Moe,
    /// Llama with a Mixture-of-Experts feed-forward in every layer (GGUF `llama` with expert keys).
    Mixtral,
}

/// The gated feed-forward's activation of the gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// silu(g) = g / (1 + e^-g): SwiGLU.
    Silu,
    /// GELU's tanh approximation, 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))): GeGLU.
    GeluTanh,
}

impl Activation {
    /// The names config.json gives it (`hidden_act` / `hidden_activation`).
    pub fn hf_names(self) -> &'static [&'static str] {
        match self {
            Activation::Silu => &["silu"],
            Activation::GeluTanh => &["gelu_pytorch_tanh"],
        }
    }
}

/// What sets one architecture apart from the others: the readers fill a `ModelConfig` from this.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArchTraits {
    /// The name in GGUF `general.architecture` (and config.json `model_type` unless `hf_model_type` differs).
    pub name: &'static str,
    /// config.json's `model_type` (Gemma 3's text model is "gemma3_text").
    pub hf_model_type: &'static str,
    /// q/k/v projections carry a bias.
    pub qkv_bias: bool,
    /// RMSNorm over each head of q and k before the rotation.
    pub qk_norm: bool,
    /// llama.cpp's converter permutes this architecture's Q/K rows, so its GGUF files rotate adjacent
    /// pairs; HF files (and every other GGUF) rotate halves.
    pub gguf_rope_interleaved: bool,
    /// The feed-forward's activation.
    pub activation: Activation,
    /// HF stores its RMSNorm weights w of a norm that multiplies by (1 + w) (Gemma); the readers hold
    /// the multiplier (1 + w), as llama.cpp's converter writes it into GGUF.
    pub hf_norms_plus_one: bool,
    /// GGUF layer tensor names this architecture spells apart from the llama family's (GGUF part,
    /// HF part), looked up before those.
    pub gguf_layer_parts: &'static [(&'static str, &'static str)],
}

impl Arch {
    /// Every architecture the readers accept.
    pub const ALL: [Arch; 6] = [Arch::Llama, Arch::Qwen2, Arch::Qwen3, Arch::Gemma3, Arch::Qwen3Moe, Arch::Mixtral];

    pub const fn traits(self) -> ArchTraits {
        const LLAMA: ArchTraits = ArchTraits {
            name: "llama",
            hf_model_type: "llama",
            qkv_bias: false,
            qk_norm: false,
            gguf_rope_interleaved: true,
            activation: Activation::Silu,
            hf_norms_plus_one: false,
            gguf_layer_parts: &[],
        };
        match self {
            Arch::Llama => LLAMA,
            Arch::Qwen2 => ArchTraits {
                name: "qwen2",
                hf_model_type: "qwen2",
                qkv_bias: true,
                gguf_rope_interleaved: false,
                ..LLAMA
            },
            Arch::Qwen3 => ArchTraits {
                name: "qwen3",
                hf_model_type: "qwen3",
                qk_norm: true,
                gguf_rope_interleaved: false,
                ..LLAMA
            },
            Arch::Gemma3 => ArchTraits {
                name: "gemma3",
                hf_model_type: "gemma3_text",
                qk_norm: true,
                gguf_rope_interleaved: false,
                activation: Activation::GeluTanh,
                hf_norms_plus_one: true,
                gguf_layer_parts: crate::arch::gemma3::GGUF_PARTS,
                ..LLAMA
            },
            Arch::Qwen3Moe => ArchTraits {
                name: "qwen3_moe",
                hf_model_type: "qwen3_moe",
                qk_norm: true,
                gguf_rope_interleaved: false,
                ..LLAMA
            },
            Arch::Mixtral => ArchTraits { name: "mixtral", hf_model_type: "mixtral", ..LLAMA },
        }
    }

    pub fn name(self) -> &'static str {
        self.traits().name
    }

    pub fn from_name(name: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.name() == name)
    }

    /// The architecture of a config.json `model_type`.
    pub fn from_hf_model_type(model_type: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.traits().hf_model_type == model_type)
    }

    /// The names, for messages about an architecture the readers do not accept: "llama, qwen2, qwen3, gemma3".
    pub fn supported_names() -> String {
        Arch::ALL.map(Arch::name).join(", ")
    }

    /// config.json's names of them: "llama, qwen2, qwen3, gemma3_text".
    pub fn supported_hf_model_types() -> String {
        Arch::ALL.map(|a| a.traits().hf_model_type).join(", ")
    }
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
    /// How attention departs from every layer seeing every position, scaled by 1/sqrt(head_dim).
    pub attention: AttentionConfig,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// The Mixture-of-Experts feed-forward of every layer (`Arch::is_moe`); None for a dense model.
    pub moe: Option<MoeConfig>,
}

/// Attention's departures from the plain form (every layer over every earlier position, with the one
/// rotary base, scores scaled by 1/sqrt(head_dim)); `Default` is the plain form.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttentionConfig {
    /// Scores are q.k / sqrt(this) (Gemma 3's query_pre_attn_scalar); None: head_dim.
    pub query_scale_base: Option<f32>,
    /// Sliding-window (local) layers among global ones.
    pub sliding: Option<SlidingWindow>,
}

/// Local layers attend over the last `window` positions, their own included, with a rotary base of
/// their own and no rope scaling; layer l is global when (l + 1) is a multiple of `global_every`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlidingWindow {
    pub window: usize,
    pub global_every: usize,
    pub rope_theta: f32,
}

impl AttentionConfig {
    /// The window layer `layer` attends over: None for a global layer.
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.sliding.filter(|s| !(layer + 1).is_multiple_of(s.global_every)).map(|s| s.window)
    }
}

impl ModelConfig {
    /// A Llama of this shape with Llama 3's rope base and norm epsilon, untied, no special tokens:
    /// the random models benchmarks and tests build (`llama(4096, 32, 32, 8, 14336, 128256)` is the 8B shape).
    pub fn llama(
        hidden: usize,
        layers: usize,
        heads: usize,
        kv_heads: usize,
        intermediate: usize,
        vocab: usize,
    ) -> Self {
        ModelConfig {
            arch: Arch::Llama,
            vocab,
            hidden,
            layers,
            heads,
            kv_heads,
            head_dim: hidden / heads,
            intermediate,
            rms_eps: 1e-5,
            rope_theta: 500000.0,
            rope_scaling: RopeScaling::None,
            rope_interleaved: false,
            max_position: 131072,
            tied: false,
            qkv_bias: false,
            qk_norm: false,
            attention: AttentionConfig::default(),
            bos: None,
            eos: None,
            moe: None,
        }
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

    /// Checks a config read from `source` (a file and the place its keys live, or a test's name for
    /// an in-memory model) for values no model has; every reader and every backend calls this.
    pub fn check(&self, source: &str) -> Result<()> {
        let dims = [
            ("vocab", self.vocab),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("intermediate", self.intermediate),
            ("max_position", self.max_position),
        ];
        for (what, v) in dims {
            if v == 0 || v > MAX_DIM {
                crate::bail!(BadModel, "{source}: {what} = {v} is out of range (1..={MAX_DIM})");
            }
        }
        if self.layers == 0 || self.layers > MAX_LAYERS {
            crate::bail!(BadModel, "{source}: layer count {} is out of range (1..={MAX_LAYERS})", self.layers);
        }
        if self.heads.checked_mul(self.head_dim).is_none_or(|q| q > MAX_DIM) {
            crate::bail!(BadModel, "{source}: heads x head_dim = {} x {} is too large", self.heads, self.head_dim);
        }
        if self.kv_heads > self.heads || !self.heads.is_multiple_of(self.kv_heads) {
            crate::bail!(
                BadModel,
                "{source}: {} attention heads are not a multiple of {} KV heads",
                self.heads,
                self.kv_heads
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            crate::bail!(BadModel, "{source}: head_dim {} is odd; rotary embedding needs pairs", self.head_dim);
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            crate::bail!(BadModel, "{source}: RMSNorm epsilon {} is not a positive number", self.rms_eps);
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            crate::bail!(BadModel, "{source}: rope theta {} is not a positive number", self.rope_theta);
        }
        let positive = |v: f32| v.is_finite() && v > 0.0;
        match self.rope_scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } if positive(factor) => {}
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position }
                if positive(factor)
                    && positive(low_freq_factor)
                    && positive(high_freq_factor)
                    && high_freq_factor > low_freq_factor
                    && original_max_position > 0 => {}
            other => crate::bail!(BadModel, "{source}: rope scaling {other:?} has a factor out of range"),
        }
        if let Some(base) = self.attention.query_scale_base
            && !positive(base)
        {
            crate::bail!(BadModel, "{source}: query_pre_attn_scalar {base} is not a positive number");
        }
        if let Some(s) = self.attention.sliding {
            if s.window == 0 || s.window > MAX_DIM || s.global_every == 0 || s.global_every > MAX_LAYERS {
                crate::bail!(
                    BadModel,
                    "{source}: sliding window {} (a global layer every {}) is out of range",
                    s.window,
                    s.global_every
                );
            }
            if !positive(s.rope_theta) {
                crate::bail!(BadModel, "{source}: local rope theta {} is not a positive number", s.rope_theta);
            }
        }
        self.check_moe(source)?;
        Ok(())
    }

    /// The factor scores are scaled by, 1/sqrt(head_dim) or 1/sqrt(query_pre_attn_scalar), in f64 (the
    /// CPU's) and as the CUDA kernels take it, in f32.
    pub fn score_scale(&self) -> f64 {
        1.0 / self.attention.query_scale_base.map_or(self.head_dim as f64, |b| b as f64).sqrt()
    }

    pub fn score_scale_f32(&self) -> f32 {
        1.0 / self.attention.query_scale_base.unwrap_or(self.head_dim as f32).sqrt()
    }

    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// Largest dimension accepted from a file, so every product the engine forms stays far from overflow.
const MAX_DIM: usize = 1 << 28;
const MAX_LAYERS: usize = 1 << 12;

/// The head_dim/2 rotary inverse frequencies, with the config's scaling, in f32 as HF computes them.
pub fn rope_inv_freq(cfg: &ModelConfig) -> Vec<f32> {
    let dim = cfg.head_dim;
    let base: Vec<f32> = (0..dim / 2)
        .map(|i| {
            let exponent = (2 * i) as f32 / dim as f32;
            1.0 / (cfg.rope_theta as f64).powf(exponent as f64) as f32
        })
        .collect();
    match cfg.rope_scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
            let old_context = original_max_position as f32;
            let low_freq_wavelen = old_context / low_freq_factor;
            let high_freq_wavelen = old_context / high_freq_factor;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_freq_wavelen {
                        f
                    } else if wavelen > low_freq_wavelen {
                        f / factor
                    } else {
                        // Between the two wavelengths HF blends the scaled and unscaled frequency.
                        let smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

/// The head_dim/2 rotary inverse frequencies of a model's local (sliding-window) layers: their own
/// base and no scaling; None when it has none.
pub fn rope_inv_freq_local(cfg: &ModelConfig) -> Option<Vec<f32>> {
    let s = cfg.attention.sliding?;
    Some(rope_inv_freq(&ModelConfig { rope_theta: s.rope_theta, rope_scaling: RopeScaling::None, ..cfg.clone() }))
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
    /// Gemma's norms of the attention output and around the feed-forward (HF names the first as llama
    /// names its feed-forward's input norm; GGUF tells them apart).
    pub const POST_ATTN_NORM: &str = "post_attention_layernorm.weight";
    pub const PRE_FFN_NORM: &str = "pre_feedforward_layernorm.weight";
    pub const POST_FFN_NORM: &str = "post_feedforward_layernorm.weight";
    pub use super::moe::{EXPERT_DOWN, EXPERT_GATE, EXPERT_UP, MIXTRAL, ROUTER, expert, expert_of, mixtral_swap};
}

/// A tensor's format, shape (outermost first: a [out, in] matrix has `out` rows of `in` values)
/// and bytes, wherever they live.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

/// Rows of a tensor of `shape` (outermost first): every dimension but the last, multiplied; a vector
/// is one row.
pub fn shape_rows(shape: &[usize]) -> usize {
    if shape.len() < 2 { 1 } else { shape[..shape.len() - 1].iter().product() }
}

/// Columns of a tensor of `shape`: its last dimension.
pub fn shape_cols(shape: &[usize]) -> usize {
    *shape.last().unwrap_or(&1)
}

impl TensorRef<'_> {
    pub fn rows(&self) -> usize {
        shape_rows(self.shape)
    }

    pub fn cols(&self) -> usize {
        shape_cols(self.shape)
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
    /// Some for one rank's share of a tensor-parallel model (`shard::RankSource`): the vocabulary ids
    /// its head (`shard::RANK_HEAD`) computes. A loader that runs whole models refuses such a source.
    fn rank_head(&self) -> Option<std::ops::Range<usize>> {
        None
    }
}

impl<'a> TensorRef<'a> {
    /// Checks that the tensor has `shape` and that its bytes hold exactly that shape in its format;
    /// `BadModel` naming `name` otherwise. Both backends load every weight through this.
    pub fn check(self, name: &str, shape: &[usize]) -> Result<TensorRef<'a>> {
        if self.shape != shape {
            crate::bail!(BadModel, "tensor {name} has shape {:?}, expected {:?}", self.shape, shape);
        }
        let row_bytes = self.dtype.row_bytes(self.cols()).ok_or_else(|| {
            crate::err!(BadModel, "tensor {name}: {} columns do not fit the {} format", self.cols(), self.dtype.name())
        })?;
        if self.bytes.len() != self.rows() * row_bytes {
            crate::bail!(
                BadModel,
                "tensor {name} holds {} bytes, expected {} for {:?} in {}",
                self.bytes.len(),
                self.rows() * row_bytes,
                shape,
                self.dtype.name()
            );
        }
        Ok(self)
    }
}

mod table;
pub use table::{
    Dim, EMBED_WEIGHT, FINAL_NORM_WEIGHT, LM_HEAD_WEIGHT, Layers, ModelWeights, Need, Weight, WeightSpec, weight_list,
};
pub(crate) use table::{weight_each, weight_field, weight_map, weight_table, weight_value};
