//! The weight table's machinery: an architecture file declares its layers' tensors with `weight_table!`
//! (`arch/llama.rs`, `arch/gemma3.rs`); checkpoint validation, the CPU backend and the GPU loader all
//! walk that table, and a new role is a new line there, after which the compiler points at each backend
//! that must place it.

use super::{ModelConfig, TensorRef, TensorSource, names};
use crate::status::Result;

/// One dimension of a weight's shape, as the config gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dim {
    Vocab,
    Hidden,
    QDim,
    KvDim,
    HeadDim,
    Intermediate,
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
}

impl Need {
    pub fn holds(self, cfg: &ModelConfig) -> bool {
        match self {
            Need::Always => true,
            Need::QkvBias => cfg.qkv_bias,
            Need::QkNorm => cfg.qk_norm,
            Need::Untied => !cfg.tied,
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
    ($need:ident, $t:ty) => { Option<$t> };
}

/// Builds a field: `f` is asked for each weight the config calls for.
macro_rules! weight_value {
    (Always, $w:expr, $cfg:expr, $f:expr) => {
        $f(&$w)?
    };
    ($need:ident, $w:expr, $cfg:expr, $f:expr) => {
        if $w.spec.need.holds($cfg) { Some($f(&$w)?) } else { None }
    };
}

macro_rules! weight_map {
    (Always, $spec:expr, $v:expr, $f:expr) => {
        $f($spec, $v)?
    };
    ($need:ident, $spec:expr, $v:expr, $f:expr) => {
        match $v {
            Some(v) => Some($f($spec, v)?),
            None => None,
        }
    };
}

macro_rules! weight_each {
    (Always, $spec:expr, $v:expr, $f:expr) => {
        $f($spec, $v)
    };
    ($need:ident, $spec:expr, $v:expr, $f:expr) => {
        if let Some(v) = $v {
            $f($spec, v)
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
                Ok(LayerWeights { $( $field: { let w = next(); $crate::model::weight_value!($need, w, cfg, &mut f) }, )+ })
            }

            /// Each weight through `f` with its table row, in file order.
            pub fn try_map<U>(
                self,
                mut f: impl FnMut(&'static $crate::model::WeightSpec, T) -> $crate::status::Result<U>,
            ) -> $crate::status::Result<LayerWeights<U>> {
                let mut specs = LAYER_WEIGHTS.iter();
                Ok(LayerWeights { $( $field: {
                    let spec = specs.next().expect("one table row per field");
                    $crate::model::weight_map!($need, spec, self.$field, &mut f)
                }, )+ })
            }

            /// `f` on each weight the layer has with its table row, in file order.
            pub fn each(&self, mut f: impl FnMut(&'static $crate::model::WeightSpec, &T)) {
                let mut specs = LAYER_WEIGHTS.iter();
                $( {
                    let spec = specs.next().expect("one table row per field");
                    $crate::model::weight_each!($need, spec, &self.$field, &mut f);
                } )+
            }
        }
    };
}

pub(crate) use {weight_each, weight_field, weight_map, weight_table, weight_value};

/// Every layer's weights, in the table of the model's architecture.
pub use crate::arch::Layers;

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
    pub layers: Layers<T>,
    pub final_norm: T,
    /// None when the head is the embedding table.
    pub lm_head: Option<T>,
}

impl<T> ModelWeights<T> {
    /// The model `cfg` describes, asking `f` for each weight it has in file order.
    pub fn build(cfg: &ModelConfig, mut f: impl FnMut(&Weight) -> Result<T>) -> Result<Self> {
        let embed = f(&Weight::new(&EMBED_WEIGHT, None, cfg))?;
        let layers = Layers::build(cfg, &mut f)?;
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
