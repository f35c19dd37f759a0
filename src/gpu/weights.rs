//! The weight allocation: every weight of the table but the embedding rows, laid out in one device
//! allocation whose size `plan` predicts exactly, and handed out by role.

use std::os::raw::c_void;

use super::Layout;
use crate::cuda::{DeviceBuffer, StagedUploader};
use crate::model::{Layers, ModelWeights, Need, TensorRef, TensorSource, names};
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

/// q, k and v as one matrix when they share a format (one launch); q and k as one and v apart when only
/// they share one (llama-quantize's Q4_K_M gives half the layers' v more bits: two launches); else three.
pub(super) enum Qkv {
    Fused(DeviceWeight),
    QkThenV([DeviceWeight; 2]),
    Split([DeviceWeight; 3]),
}

/// Which of a layer's q, k and v share a region and are read as one matrix.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Joined {
    Qkv,
    Qk,
    None,
}

fn joined(q: DType, k: DType, v: DType) -> Joined {
    match (q == k, k == v) {
        (true, true) => Joined::Qkv,
        (true, false) => Joined::Qk,
        _ => Joined::None,
    }
}

impl Qkv {
    /// q, k and v as the projection reads them: the matrices the loader laid out back to back
    /// (`place_layers`) as one.
    pub(super) fn of(q: &DeviceWeight, k: &DeviceWeight, v: &DeviceWeight) -> Qkv {
        match joined(q.dtype, k.dtype, v.dtype) {
            Joined::Qkv => Qkv::Fused(DeviceWeight { rows: q.rows + k.rows + v.rows, ..*q }),
            Joined::Qk => Qkv::QkThenV([DeviceWeight { rows: q.rows + k.rows, ..*q }, *v]),
            Joined::None => Qkv::Split([*q, *k, *v]),
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
    pub layers: Layers<Placed<'a>>,
    pub final_norm: Placed<'a>,
    pub lm_head: Option<Placed<'a>>,
    pub total: usize,
}

/// Reads and checks every weight of `src` (the weight table) and lays them out in one allocation.
pub(super) fn plan(src: &dyn TensorSource) -> Result<WeightPlan<'_>> {
    let w = ModelWeights::read(src)?;
    let mut layout = Layout::default();
    let layers = place_layers(w.layers, &mut layout)?;
    let final_norm = layout.place(w.final_norm, false);
    // One rank's share of a model computes its vocabulary rows of the head (`shard::RankSource`).
    let lm_head = match src.rank_head() {
        Some(ids) => {
            let shape = [ids.len(), src.config().hidden];
            Some(layout.place(src.tensor(crate::shard::RANK_HEAD)?.check(crate::shard::RANK_HEAD, &shape)?, false))
        }
        None => w.lm_head.map(|t| layout.place(t, false)),
    };
    Ok(WeightPlan { layers, final_norm, lm_head, total: layout.total })
}

impl WeightPlan<'_> {
    /// (format, rows, cols) of every matrix a layer multiplies with, q/k/v fused as the loader fuses them.
    pub(super) fn product_matrices(&self) -> Vec<(DType, usize, usize)> {
        let mut out: Vec<(DType, usize, usize)> = Vec::new();
        let fused = fused_layers(&self.layers, |p| p.tensor.dtype);
        self.layers.each(|l, spec, p| {
            let t = &p.tensor;
            if t.shape.len() != 2 {
                return;
            }
            let m = (t.dtype, t.rows(), t.cols());
            match (spec.name, fused[l]) {
                // k (and v) join q's matrix where they share its format.
                (names::K, Joined::Qkv | Joined::Qk) | (names::V, Joined::Qkv) => {
                    out.last_mut().expect("q comes first").1 += m.1
                }
                _ => out.push(m),
            }
        });
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

/// Which of each layer's q, k and v share a format (and are read as one matrix).
fn fused_layers<T>(layers: &Layers<T>, dtype: impl Fn(&T) -> DType) -> Vec<Joined> {
    let mut qkv = vec![[None; 3]; layers.len()];
    layers.each(|l, spec, t| {
        if let Some(i) = [names::Q, names::K, names::V].iter().position(|&n| n == spec.name) {
            qkv[l][i] = Some(dtype(t));
        }
    });
    qkv.iter()
        .map(|&[q, k, v]| match (q, k, v) {
            (Some(q), Some(k), Some(v)) => joined(q, k, v),
            _ => Joined::None,
        })
        .collect()
}

/// Each weight in its own region, in table order, except q, k, v of one format (or q and k of one) and the
/// three biases, which the fused projection reads back to back (each table lists them in that order), and each expert
/// matrix right after the previous expert's, so a role's experts are one stack that an expert's index
/// strides through.
fn place_layers<'a>(layers: Layers<TensorRef<'a>>, layout: &mut Layout) -> Result<Layers<Placed<'a>>> {
    let fused = fused_layers(&layers, |t| t.dtype);
    // The layer and row of the weight placed last: an expert row's weights come one expert after another.
    let mut last: Option<(usize, &'static str)> = None;
    layers.try_map(|l, spec, t| {
        let after_previous = match spec.name {
            names::K => fused[l] != Joined::None,
            names::V => fused[l] == Joined::Qkv,
            names::K_BIAS | names::V_BIAS => true,
            _ => spec.need == Need::Experts && last == Some((l, spec.name)),
        };
        last = Some((l, spec.name));
        Ok(layout.place(t, after_previous))
    })
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
