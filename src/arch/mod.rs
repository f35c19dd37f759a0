//! An architecture is one file: its forward pass, said in the operations a backend offers (`Ops`), and
//! both backends execute that file. The CPU backend's operations compute (the oracle); the CUDA
//! backend's queue the launches of a pass on its stream, so a captured graph holds whatever the
//! architecture file asked for.
//!
//! An operation names the buffers it reads and writes (the residual rows `x`, the normed rows `h`, the
//! projected q, k and v, the attention output, the feed-forward activation) rather than taking tensor
//! handles: each backend keeps these as its pass's scratch, and the CUDA pass splits its rows into the
//! matrix-vector rows and the tensor-core groups inside each operation. Fused work stays one operation
//! (the q/k/v product with its biases; the per-head norms with the rotation and the KV append; the
//! SwiGLU feed-forward with its residual add), so each backend keeps its fusions; the CPU runs them
//! unfused.
//!
//! Adding an architecture adds a file here with its forward (and, where it needs an operation the
//! trait lacks, that operation in both backends), and a line in `forward`.

pub mod llama;

use crate::model::{Arch, LayerWeights};
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

/// The operations a decoder layer is made of, over the rows of one pass (tokens of one or more
/// streams, each at its own position, each with its stream's KV pages). Each backend implements them;
/// an architecture file calls them in its order.
pub trait Ops {
    /// A weight as the backend holds it.
    type Weight;

    /// x = the embedding row of each row's token.
    fn embed(&mut self) -> Result<()>;

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
    /// each row's q and k to its position, and k and v appended to layer `layer`'s cache at that position.
    fn rope_append(&mut self, layer: usize, head_norms: Option<[&Self::Weight; 2]>) -> Result<()>;

    /// attn = each row's q attending over its stream's cached K and V of layer `layer`, up to and
    /// including its own position.
    fn attention(&mut self, layer: usize) -> Result<()>;

    /// x += the product of attn with `o`.
    fn add_attention_out(&mut self, o: &Self::Weight) -> Result<()>;

    /// x += the product with `down` of silu(the product of h with `gate`) * (the product of h with `up`).
    fn add_swiglu_ffn(&mut self, gate: &Self::Weight, up: &Self::Weight, down: &Self::Weight) -> Result<()>;

    /// x += the Mixture-of-Experts feed-forward of h: the product of h with `router` gives each
    /// expert's logit, their softmax its probability; the row's `ModelConfig::moe.used` most probable
    /// experts (ties to the lower index) each give down_e(silu(gate_e h) * up_e h), and the row adds
    /// their sum weighted by those probabilities (divided by the chosen ones' sum when `norm_topk`).
    /// `gate`, `up` and `down` hold one weight an expert. A row's result depends on its own h alone.
    fn add_moe_ffn(
        &mut self,
        router: &Self::Weight,
        gate: &[Self::Weight],
        up: &[Self::Weight],
        down: &[Self::Weight],
    ) -> Result<()>;
}

/// One pass of the model's layers over the rows `ops` holds: their final hidden states (before the
/// final norm) end in x. The registry: each architecture's forward, by its name in `Arch`.
pub fn forward<O: Ops>(arch: Arch, ops: &mut O, layers: &[LayerWeights<O::Weight>]) -> Result<()> {
    match arch {
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Mixtral => llama::forward(ops, layers),
    }
}
