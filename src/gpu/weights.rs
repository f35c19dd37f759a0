//! The weight allocation: every weight of the table but the embedding rows, laid out in one device
//! allocation whose size `plan` predicts exactly, and handed out by role.

use std::os::raw::c_void;

use super::Layout;
use crate::cuda::{DeviceBuffer, StagedUploader};
use crate::model::{LayerWeights, ModelWeights, TensorRef, TensorSource};
use crate::status::Result;
use crate::tensor::DType;

/// A weight on the device: a matrix in its stored format, or a vector decoded to f32 (one row).
#[derive(Clone, Copy, Debug)]
pub(super) struct DeviceWeight {
    pub ptr: *const c_void,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
}

impl DeviceWeight {
    pub(super) fn f32_ptr(&self) -> *const f32 {
        self.ptr as *const f32
    }
}

/// q, k and v as one matrix when they share a format (one launch), else three.
pub(super) enum Qkv {
    Fused(DeviceWeight),
    Split([DeviceWeight; 3]),
}

/// Whether q, k and v share a region and are read as one matrix.
fn qkv_fused(q: DType, k: DType, v: DType) -> bool {
    q == k && k == v
}

impl Qkv {
    /// q, k and v as the projection reads them: one matrix where they share a format (the loader laid
    /// them out back to back, `place_layer`), else three.
    pub(super) fn of(q: &DeviceWeight, k: &DeviceWeight, v: &DeviceWeight) -> Qkv {
        if qkv_fused(q.dtype, k.dtype, v.dtype) {
            Qkv::Fused(DeviceWeight { rows: q.rows + k.rows + v.rows, ..*q })
        } else {
            Qkv::Split([*q, *k, *v])
        }
    }
}

/// A weight and where it goes in the weight allocation: matrices are copied as stored, vectors
/// (norms, biases) decoded to f32.
pub(super) struct Placed<'a> {
    tensor: TensorRef<'a>,
    offset: usize,
}

impl Placed<'_> {
    fn decoded(&self) -> bool {
        self.tensor.shape.len() == 1
    }
}

fn device_bytes(t: &TensorRef) -> usize {
    if t.shape.len() == 1 { t.cols() * 4 } else { t.bytes.len() }
}

impl Layout {
    /// Places `t` in a region of its own, or right after the previous weight.
    fn place<'a>(&mut self, t: TensorRef<'a>, after_previous: bool) -> Placed<'a> {
        let bytes = device_bytes(&t);
        let offset = if after_previous { self.append(bytes) } else { self.push(bytes) };
        Placed { tensor: t, offset }
    }
}

/// Where every weight the device holds goes (all but the embedding rows, which are placed apart).
pub(super) struct WeightPlan<'a> {
    pub layers: Vec<LayerWeights<Placed<'a>>>,
    pub final_norm: Placed<'a>,
    pub lm_head: Option<Placed<'a>>,
    pub total: usize,
}

/// Reads and checks every weight of `src` (the weight table) and lays them out in one allocation.
pub(super) fn plan(src: &dyn TensorSource) -> Result<WeightPlan<'_>> {
    let w = ModelWeights::read(src)?;
    let mut layout = Layout::default();
    let layers = w.layers.into_iter().map(|l| place_layer(l, &mut layout)).collect();
    let final_norm = layout.place(w.final_norm, false);
    let lm_head = w.lm_head.map(|t| layout.place(t, false));
    Ok(WeightPlan { layers, final_norm, lm_head, total: layout.total })
}

impl WeightPlan<'_> {
    /// (format, rows, cols) of every matrix a layer multiplies with, q/k/v fused as the loader fuses them.
    pub(super) fn product_matrices(&self) -> Vec<(DType, usize, usize)> {
        let mut out = Vec::new();
        for l in &self.layers {
            let m = |p: &Placed| (p.tensor.dtype, p.tensor.rows(), p.tensor.cols());
            let (q, k, v) = (m(&l.q), m(&l.k), m(&l.v));
            if qkv_fused(q.0, k.0, v.0) {
                out.push((q.0, q.1 + k.1 + v.1, q.2));
            } else {
                out.extend([q, k, v]);
            }
            out.push(m(&l.o));
            out.extend([&l.gate, &l.up, &l.down, &l.router].into_iter().flatten().map(m));
            out.extend(l.expert_gate.iter().chain(&l.expert_up).chain(&l.expert_down).map(m));
        }
        out
    }
}

/// The half format the prompt path's tensor-core products read (BF16 when every matrix is BF16, else
/// F16, which holds F16, Q8_0 and F32 weights more closely) and the values of the largest matrix in
/// another format, which is converted into the scratch slab before its product.
pub(super) fn prompt_format(matrices: &[(DType, usize, usize)]) -> (DType, usize) {
    let half = if matrices.iter().all(|m| m.0 == DType::Bf16) { DType::Bf16 } else { DType::F16 };
    let slab = matrices.iter().filter(|m| m.0 != half).map(|m| m.1 * m.2).max().unwrap_or(0);
    (half, slab)
}

/// Each weight in its own region, except q, k, v of one format and the three biases, which the fused
/// projection reads back to back, and each expert matrix right after the previous expert's, so a role's
/// experts are one stack that an expert's index strides through.
fn place_layer<'a>(l: LayerWeights<TensorRef<'a>>, layout: &mut Layout) -> LayerWeights<Placed<'a>> {
    let fused = qkv_fused(l.q.dtype, l.k.dtype, l.v.dtype);
    let attn_norm = layout.place(l.attn_norm, false);
    let q = layout.place(l.q, false);
    let k = layout.place(l.k, fused);
    let v = layout.place(l.v, fused);
    LayerWeights {
        attn_norm,
        q,
        k,
        v,
        q_bias: l.q_bias.map(|t| layout.place(t, false)),
        k_bias: l.k_bias.map(|t| layout.place(t, true)),
        v_bias: l.v_bias.map(|t| layout.place(t, true)),
        q_norm: l.q_norm.map(|t| layout.place(t, false)),
        k_norm: l.k_norm.map(|t| layout.place(t, false)),
        o: layout.place(l.o, false),
        ffn_norm: layout.place(l.ffn_norm, false),
        gate: l.gate.map(|t| layout.place(t, false)),
        up: l.up.map(|t| layout.place(t, false)),
        down: l.down.map(|t| layout.place(t, false)),
        router: l.router.map(|t| layout.place(t, false)),
        expert_gate: place_experts(l.expert_gate, layout),
        expert_up: place_experts(l.expert_up, layout),
        expert_down: place_experts(l.expert_down, layout),
    }
}

/// One role's expert matrices back to back, expert 0 first.
fn place_experts<'a>(experts: Vec<TensorRef<'a>>, layout: &mut Layout) -> Vec<Placed<'a>> {
    experts.into_iter().enumerate().map(|(e, t)| layout.place(t, e > 0)).collect()
}

/// Copies one placed weight into `weights` and says where it is.
pub(super) fn upload(weights: &DeviceBuffer, uploader: &mut StagedUploader, p: Placed) -> Result<DeviceWeight> {
    let t = p.tensor;
    let dtype = if p.decoded() {
        weights.upload(&t.to_f32(), p.offset)?;
        DType::F32
    } else {
        uploader.upload(weights, p.offset, t.bytes)?;
        t.dtype
    };
    let ptr = (weights.ptr() as *const u8).wrapping_add(p.offset) as *const c_void;
    Ok(DeviceWeight { ptr, dtype, rows: t.rows(), cols: t.cols() })
}
