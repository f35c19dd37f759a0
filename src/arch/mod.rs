//! An architecture is one file: its tensor list (`weight_table!`) and its forward pass, said in the
//! operations a backend offers (`Ops`), and both backends execute that file. The CPU backend's
//! operations compute (the oracle); the CUDA backend's queue the launches of a pass on its stream, so a
//! captured graph holds whatever the architecture file asked for.
//!
//! An operation names the buffers it reads and writes (the residual rows `x`, the normed rows `h`, the
//! projected q, k and v, the attention output, the feed-forward activation) rather than taking tensor
//! handles: each backend keeps these as its pass's scratch, and the CUDA pass splits its rows into the
//! matrix-vector rows and the tensor-core groups inside each operation. Fused work stays one operation
//! (the q/k/v product with its biases; the per-head norms with the rotation and the KV append; the
//! gated feed-forward with its residual add), so each backend keeps its fusions; the CPU runs them
//! unfused.
//!
//! Adding an architecture adds a file here with its table and forward (and, where it needs an
//! operation the trait lacks, that operation in both backends), a variant of `Layers` and its arms.

pub mod gemma3;
pub mod llama;

use crate::model::{Activation, Arch, ModelConfig, Weight, WeightSpec};
use crate::status::Result;

/// What reads a norm's output, which decides how exactly a backend keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Feeds {
    /// The q/k/v product, whose K and V the cache keeps: a backend that rounds the normed rows to a half
    /// format for its tensor cores keeps their rounding residue too, to refine K and V to f32 accuracy.
    Cache,
    /// Any other product.
    Product,
}

/// Which rotary frequencies a layer's rotation takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rotary {
    /// The model's (`model::rope_inv_freq`: its base and scaling).
    Global,
    /// Its sliding-window layers' own (`model::rope_inv_freq_local`).
    Local,
}

/// The operations a decoder layer is made of, over the rows of one pass (tokens of one or more
/// streams, each at its own position, each with its stream's KV pages). Each backend implements them;
/// an architecture file calls them in its order.
pub trait Ops {
    /// A weight as the backend holds it.
    type Weight;

    /// x = the embedding row of each row's token.
    fn embed(&mut self) -> Result<()>;

    /// x *= `factor` (f32), every value of every row.
    fn scale(&mut self, factor: f32) -> Result<()>;

    /// h = RMSNorm(x) with weight `w`, per row.
    fn norm(&mut self, w: &Self::Weight, feeds: Feeds) -> Result<()>;

    /// q, k, v = the products of h with `q`, `k`, `v`, plus `bias` (q's, k's, v's) when given.
    fn qkv(
        &mut self,
        q: &Self::Weight,
        k: &Self::Weight,
        v: &Self::Weight,
        bias: Option<[&Self::Weight; 3]>,
    ) -> Result<()>;

    /// RMSNorm over each head of q and k with `head_norms` (q's, k's) when given, then the rotation of
    /// each row's q and k to its position with `rotary`'s frequencies, and k and v appended to layer
    /// `layer`'s cache at that position.
    fn rope_append(&mut self, layer: usize, head_norms: Option<[&Self::Weight; 2]>, rotary: Rotary) -> Result<()>;

    /// attn = each row's q attending over its stream's cached K and V of layer `layer`, up to and
    /// including its own position, and no further back than `window` positions (its own counted) when
    /// given; scores scaled by `ModelConfig::score_scale`.
    fn attention(&mut self, layer: usize, window: Option<usize>) -> Result<()>;

    /// x += the product of attn with `o`, through RMSNorm with `post_norm` first when given.
    fn add_attention_out(&mut self, o: &Self::Weight, post_norm: Option<&Self::Weight>) -> Result<()>;

    /// x += the product with `down` of act(the product of h with `gate`) * (the product of h with
    /// `up`), through RMSNorm with `post_norm` first when given.
    fn add_gated_ffn(
        &mut self,
        act: Activation,
        gate: &Self::Weight,
        up: &Self::Weight,
        down: &Self::Weight,
        post_norm: Option<&Self::Weight>,
    ) -> Result<()>;
}

/// Every layer's weights, in the table of the model's architecture.
pub enum Layers<T> {
    /// Llama, Qwen2, Qwen3.
    Llama(Vec<llama::LayerWeights<T>>),
    Gemma3(Vec<gemma3::LayerWeights<T>>),
}

/// `$body` with `$l` bound to the layers' vector, whichever table it is.
macro_rules! each_table {
    ($layers:expr, $l:ident => $body:expr) => {
        match $layers {
            Layers::Llama($l) => $body,
            Layers::Gemma3($l) => $body,
        }
    };
}

impl<T> Layers<T> {
    /// The layers of the model `cfg` describes, asking `f` for each weight in file order.
    pub fn build(cfg: &ModelConfig, mut f: impl FnMut(&Weight) -> Result<T>) -> Result<Self> {
        Ok(match cfg.arch {
            Arch::Llama | Arch::Qwen2 | Arch::Qwen3 => Layers::Llama(
                (0..cfg.layers).map(|i| llama::LayerWeights::build(cfg, i, &mut f)).collect::<Result<_>>()?,
            ),
            Arch::Gemma3 => Layers::Gemma3(
                (0..cfg.layers).map(|i| gemma3::LayerWeights::build(cfg, i, &mut f)).collect::<Result<_>>()?,
            ),
        })
    }

    /// Each weight through `f` with its layer and table row, layer after layer in file order.
    pub fn try_map<U>(self, mut f: impl FnMut(usize, &'static WeightSpec, T) -> Result<U>) -> Result<Layers<U>> {
        Ok(match self {
            Layers::Llama(l) => Layers::Llama(
                l.into_iter().enumerate().map(|(i, w)| w.try_map(|spec, t| f(i, spec, t))).collect::<Result<_>>()?,
            ),
            Layers::Gemma3(l) => Layers::Gemma3(
                l.into_iter().enumerate().map(|(i, w)| w.try_map(|spec, t| f(i, spec, t))).collect::<Result<_>>()?,
            ),
        })
    }

    /// `f` on each weight of each layer (its index, its table row, the weight), in file order.
    pub fn each(&self, mut f: impl FnMut(usize, &'static WeightSpec, &T)) {
        each_table!(self, l => l.iter().enumerate().for_each(|(i, w)| w.each(|spec, t| f(i, spec, t))))
    }

    pub fn len(&self) -> usize {
        each_table!(self, l => l.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One pass of the model's layers over the rows `ops` holds: their final hidden states (before the
/// final norm) end in x. The registry: each table's forward.
pub fn forward<O: Ops>(cfg: &ModelConfig, ops: &mut O, layers: &Layers<O::Weight>) -> Result<()> {
    match layers {
        Layers::Llama(l) => llama::forward(ops, l),
        Layers::Gemma3(l) => gemma3::forward(cfg, ops, l),
    }
}

#[cfg(test)]
pub(crate) mod recorder {
    //! Operations that write down what they were asked, each weight by its name: the architecture
    //! files' tests.
    use super::*;

    pub(crate) struct Recorder(pub Vec<String>);

    impl Ops for Recorder {
        type Weight = String;

        fn embed(&mut self) -> Result<()> {
            self.0.push("embed".into());
            Ok(())
        }
        fn scale(&mut self, factor: f32) -> Result<()> {
            self.0.push(format!("scale {factor}"));
            Ok(())
        }
        fn norm(&mut self, w: &String, feeds: Feeds) -> Result<()> {
            self.0.push(format!("norm {w} {feeds:?}"));
            Ok(())
        }
        fn qkv(&mut self, q: &String, k: &String, v: &String, bias: Option<[&String; 3]>) -> Result<()> {
            self.0.push(format!("qkv {q} {k} {v} {bias:?}"));
            Ok(())
        }
        fn rope_append(&mut self, layer: usize, head_norms: Option<[&String; 2]>, rotary: Rotary) -> Result<()> {
            self.0.push(format!("rope_append {layer} {head_norms:?} {rotary:?}"));
            Ok(())
        }
        fn attention(&mut self, layer: usize, window: Option<usize>) -> Result<()> {
            self.0.push(format!("attention {layer} {window:?}"));
            Ok(())
        }
        fn add_attention_out(&mut self, o: &String, post_norm: Option<&String>) -> Result<()> {
            self.0.push(format!("add_attention_out {o} {post_norm:?}"));
            Ok(())
        }
        fn add_gated_ffn(
            &mut self,
            act: Activation,
            gate: &String,
            up: &String,
            down: &String,
            post_norm: Option<&String>,
        ) -> Result<()> {
            self.0.push(format!("add_gated_ffn {act:?} {gate} {up} {down} {post_norm:?}"));
            Ok(())
        }
    }
}
