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
    /// Qwen3 with a Mixture-of-Experts feed-forward in every layer (GGUF `qwen3moe`).
    Qwen3Moe,
    /// Llama with a Mixture-of-Experts feed-forward in every layer (GGUF `llama` with expert keys).
    Mixtral,
}

/// What sets one architecture apart from the others: the readers fill a `ModelConfig` from this.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArchTraits {
    /// The name in config.json `model_type` and GGUF `general.architecture`.
    pub name: &'static str,
    /// q/k/v projections carry a bias.
    pub qkv_bias: bool,
    /// RMSNorm over each head of q and k before the rotation.
    pub qk_norm: bool,
    /// llama.cpp's converter permutes this architecture's Q/K rows, so its GGUF files rotate adjacent
    /// pairs; HF files (and every other GGUF) rotate halves.
    pub gguf_rope_interleaved: bool,
}

impl Arch {
    /// Every architecture the readers accept.
    pub const ALL: [Arch; 5] = [Arch::Llama, Arch::Qwen2, Arch::Qwen3, Arch::Qwen3Moe, Arch::Mixtral];

    pub const fn traits(self) -> ArchTraits {
        match self {
            Arch::Llama => ArchTraits { name: "llama", qkv_bias: false, qk_norm: false, gguf_rope_interleaved: true },
            Arch::Qwen2 => ArchTraits { name: "qwen2", qkv_bias: true, qk_norm: false, gguf_rope_interleaved: false },
            Arch::Qwen3 => ArchTraits { name: "qwen3", qkv_bias: false, qk_norm: true, gguf_rope_interleaved: false },
            Arch::Qwen3Moe => {
                ArchTraits { name: "qwen3_moe", qkv_bias: false, qk_norm: true, gguf_rope_interleaved: false }
            }
            Arch::Mixtral => {
                ArchTraits { name: "mixtral", qkv_bias: false, qk_norm: false, gguf_rope_interleaved: true }
            }
        }
    }

    pub fn name(self) -> &'static str {
        self.traits().name
    }

    pub fn from_name(name: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.name() == name)
    }

    /// The names, for messages about an architecture the readers do not accept: "llama, qwen2, qwen3".
    pub fn supported_names() -> String {
        Arch::ALL.map(Arch::name).join(", ")
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
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// The Mixture-of-Experts feed-forward of every layer (`Arch::is_moe`); None for a dense model.
    pub moe: Option<MoeConfig>,
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
        self.check_moe(source)?;
        Ok(())
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

// ---------------------------------------------------------------------------------------------------
// The weight table's machinery: an architecture file declares its layers' tensors with `weight_table!`
// (`arch/llama.rs`); checkpoint validation, the CPU backend and the GPU loader all walk that table, and a
// new role is a new line there, after which the compiler points at each backend that must place it.

/// One dimension of a weight's shape, as the config gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dim {
    Vocab,
    Hidden,
    QDim,
    KvDim,
    HeadDim,
    Intermediate,
    /// The Mixture-of-Experts dimensions: the expert count and an expert's width.
    Experts,
    ExpertIntermediate,
}

impl Dim {
    pub fn of(self, cfg: &ModelConfig) -> usize {
        match self {
            Dim::Vocab => cfg.vocab,
            Dim::Hidden => cfg.hidden,
            Dim::QDim => cfg.q_dim(),
            Dim::KvDim => cfg.kv_dim(),
            Dim::HeadDim => cfg.head_dim,
            Dim::Intermediate => cfg.intermediate,
            Dim::Experts => cfg.moe.map_or(0, |m| m.experts),
            Dim::ExpertIntermediate => cfg.moe.map_or(0, |m| m.intermediate),
        }
    }
}

/// When a model carries a weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    Always,
    /// With `ModelConfig::qkv_bias`.
    QkvBias,
    /// With `ModelConfig::qk_norm`.
    QkNorm,
    /// Unless the head is tied to the embedding.
    Untied,
    /// A dense model's feed-forward; a Mixture-of-Experts model's router (`ModelConfig::moe`).
    Dense,
    Moe,
    /// One weight an expert of a Mixture-of-Experts model (a `Vec`, expert 0 first; `*` in its name).
    Experts,
}

impl Need {
    pub fn holds(self, cfg: &ModelConfig) -> bool {
        match self {
            Need::Always => true,
            Need::QkvBias => cfg.qkv_bias,
            Need::QkNorm => cfg.qk_norm,
            Need::Untied => !cfg.tied,
            Need::Dense => cfg.moe.is_none(),
            Need::Moe | Need::Experts => cfg.moe.is_some(),
        }
    }
}

/// One row of the weight table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightSpec {
    /// The role, as the field of `LayerWeights` / `ModelWeights` that holds it.
    pub role: &'static str,
    /// The canonical name: a full name, or for a layer weight the part after `model.layers.{i}.`.
    pub name: &'static str,
    /// Outermost first; one dimension for a vector (norm, bias), two for a matrix.
    pub shape: &'static [Dim],
    pub need: Need,
}

/// One weight of one model: its table row with the name and shape the config gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Weight {
    pub spec: &'static WeightSpec,
    pub name: String,
    pub shape: Vec<usize>,
}

impl Weight {
    pub(crate) fn new(spec: &'static WeightSpec, layer: Option<usize>, cfg: &ModelConfig) -> Weight {
        let name = layer.map_or_else(|| spec.name.to_string(), |i| names::layer(i, spec.name));
        Weight { spec, name, shape: spec.shape.iter().map(|d| d.of(cfg)).collect() }
    }

    /// A norm or a bias, which backends keep as f32.
    pub fn is_vector(&self) -> bool {
        self.shape.len() == 1
    }
}

/// `T` for a weight every model has, `Option<T>` for one some lack.
macro_rules! weight_field {
    (Always, $t:ty) => { $t };
    (Experts, $t:ty) => { Vec<$t> };
    ($need:ident, $t:ty) => { Option<$t> };
}

/// Builds a field: `f` is asked for each weight the config calls for.
macro_rules! weight_value {
    (Always, $w:expr, $cfg:expr, $layer:expr, $f:expr) => {
        $f(&$w)?
    };
    (Experts, $w:expr, $cfg:expr, $layer:expr, $f:expr) => {
        match $cfg.moe {
            Some(m) if $w.spec.need.holds($cfg) => (0..m.experts)
                .map(|e| $f(&$crate::model::Weight::expert($w.spec, $layer, e, $cfg)))
                .collect::<$crate::status::Result<Vec<_>>>()?,
            _ => Vec::new(),
        }
    };
    ($need:ident, $w:expr, $cfg:expr, $layer:expr, $f:expr) => {
        if $w.spec.need.holds($cfg) { Some($f(&$w)?) } else { None }
    };
}

macro_rules! weight_map {
    (Always, $v:expr, $f:expr) => {
        $f($v)?
    };
    (Experts, $v:expr, $f:expr) => {
        $v.into_iter().map(|v| $f(v)).collect::<$crate::status::Result<Vec<_>>>()?
    };
    ($need:ident, $v:expr, $f:expr) => {
        match $v {
            Some(v) => Some($f(v)?),
            None => None,
        }
    };
}

macro_rules! weight_table {
    ($( $(#[$doc:meta])* $field:ident: $name:expr, [$($dim:ident),+], $need:ident; )+) => {
        /// One decoder layer's weights by role; `T` is what a reader keeps of each (a tensor view, a
        /// device pointer, a region of an allocation).
        pub struct LayerWeights<T> {
            $( $(#[$doc])* pub $field: $crate::model::weight_field!($need, T), )+
        }

        /// The layer's rows of the weight table, in file order.
        pub const LAYER_WEIGHTS: &[$crate::model::WeightSpec] = &[
            $( $crate::model::WeightSpec {
                role: stringify!($field),
                name: $name,
                shape: &[$($crate::model::Dim::$dim),+],
                need: $crate::model::Need::$need,
            }, )+
        ];

        impl<T> LayerWeights<T> {
            /// Layer `layer` of the model `cfg` describes, asking `f` for each weight it has in file order.
            pub fn build(
                cfg: &$crate::model::ModelConfig,
                layer: usize,
                mut f: impl FnMut(&$crate::model::Weight) -> $crate::status::Result<T>,
            ) -> $crate::status::Result<Self> {
                let mut specs = LAYER_WEIGHTS.iter();
                let mut next = || $crate::model::Weight::new(specs.next().expect("one table row per field"), Some(layer), cfg);
                Ok(LayerWeights { $( $field: { let w = next(); $crate::model::weight_value!($need, w, cfg, layer, &mut f) }, )+ })
            }

            /// Each weight through `f`, in file order.
            pub fn try_map<U>(
                self,
                mut f: impl FnMut(T) -> $crate::status::Result<U>,
            ) -> $crate::status::Result<LayerWeights<U>> {
                Ok(LayerWeights { $( $field: $crate::model::weight_map!($need, self.$field, &mut f), )+ })
            }
        }
    };
}

pub(crate) use {weight_field, weight_map, weight_table, weight_value};

/// The layer weights of the architectures the backends run: the llama family's tensor list.
pub use crate::arch::llama::{LAYER_WEIGHTS, LayerWeights};

/// The weights around the layers, in file order: the embedding first, the final norm and head last.
pub const EMBED_WEIGHT: WeightSpec =
    WeightSpec { role: "embed", name: names::EMBED, shape: &[Dim::Vocab, Dim::Hidden], need: Need::Always };
pub const FINAL_NORM_WEIGHT: WeightSpec =
    WeightSpec { role: "final_norm", name: names::FINAL_NORM, shape: &[Dim::Hidden], need: Need::Always };
pub const LM_HEAD_WEIGHT: WeightSpec =
    WeightSpec { role: "lm_head", name: names::LM_HEAD, shape: &[Dim::Vocab, Dim::Hidden], need: Need::Untied };

/// Every weight of a model by role.
pub struct ModelWeights<T> {
    pub embed: T,
    pub layers: Vec<LayerWeights<T>>,
    pub final_norm: T,
    /// None when the head is the embedding table.
    pub lm_head: Option<T>,
}

impl<T> ModelWeights<T> {
    /// The model `cfg` describes, asking `f` for each weight it has in file order.
    pub fn build(cfg: &ModelConfig, mut f: impl FnMut(&Weight) -> Result<T>) -> Result<Self> {
        let embed = f(&Weight::new(&EMBED_WEIGHT, None, cfg))?;
        let layers = (0..cfg.layers).map(|i| LayerWeights::build(cfg, i, &mut f)).collect::<Result<_>>()?;
        let final_norm = f(&Weight::new(&FINAL_NORM_WEIGHT, None, cfg))?;
        let lm_head =
            if LM_HEAD_WEIGHT.need.holds(cfg) { Some(f(&Weight::new(&LM_HEAD_WEIGHT, None, cfg))?) } else { None };
        Ok(ModelWeights { embed, layers, final_norm, lm_head })
    }
}

impl<'a> ModelWeights<TensorRef<'a>> {
    /// Checks the config and reads every weight it calls for from `src`, each checked against its
    /// shape; `BadModel` names the first at fault.
    pub fn read(src: &'a dyn TensorSource) -> Result<Self> {
        src.config().check("config")?;
        ModelWeights::build(src.config(), |w| src.tensor(&w.name)?.check(&w.name, &w.shape))
    }
}

/// Every tensor the model `cfg` describes reads, with its canonical shape, in file order.
pub fn weight_list(cfg: &ModelConfig) -> Vec<Weight> {
    let mut out = Vec::new();
    ModelWeights::build(cfg, |w| {
        out.push(w.clone());
        Ok(())
    })
    .expect("listing fails nowhere");
    out
}
