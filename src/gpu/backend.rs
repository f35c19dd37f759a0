//! The CUDA backend behind the engine's `Backend` seam: a `GpuModel` and the device it was loaded on.

use super::{GpuCache, GpuModel, GpuStream, PAGE_TOKENS, RowsOnDevice, Sizing, forward, local_piece};
use crate::backend::{Backend, LocalLayers, StepItem};
use crate::cuda;
use crate::cudart as rt;
use crate::kv::KvTypes;
use crate::model::TensorSource;
use crate::status::Result;
use crate::tuning::Tuning;

/// The CUDA backend: a `GpuModel` and the device it was loaded on, made current before each call.
pub struct CudaBackend {
    model: GpuModel,
    device: i32,
}

impl CudaBackend {
    /// `GpuModel::load_for_window` on `device`, which the caller has made current, with a KV pool of
    /// `pool_pages` pages of `PAGE_TOKENS` positions in `kv`'s types, for streams of `window` positions,
    /// to run as `tuning` says.
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        src: &dyn TensorSource,
        rows: RowsOnDevice,
        max_batch: usize,
        device: i32,
        pool_pages: usize,
        kv: KvTypes,
        window: usize,
        tuning: &Tuning,
    ) -> Result<CudaBackend> {
        let sizing = Sizing { max_batch, pool_pages, local_pages: None, kv, window };
        Self::load_with_pools(src, rows, device, sizing, tuning)
    }

    /// `load` sized as `sizing` says: with the sliding-window layers (where the model has them and
    /// `sizing.local_pages` is given) in a pool of their own (`GpuModel::load_with_pools`).
    pub fn load_with_pools(
        src: &dyn TensorSource,
        rows: RowsOnDevice,
        device: i32,
        sizing: Sizing,
        tuning: &Tuning,
    ) -> Result<CudaBackend> {
        let model = GpuModel::load_with_pools(src, rows, sizing, tuning)?;
        Ok(CudaBackend { model, device })
    }

    /// What runs a prompt chunk's products and attention, in one line for the log.
    pub fn prompt_route(&self) -> &str {
        self.model.prompt_route()
    }

    /// The model, for tests that look under the seam.
    pub fn model(&self) -> &GpuModel {
        &self.model
    }

    /// Makes the model's device current for this thread (the caller may have moved to another).
    fn enter(&self) -> Result<()> {
        // SAFETY: plain runtime call on a device index; an invalid one returns an error code.
        cuda::check(unsafe { rt::cudaSetDevice(self.device) }, "cudaSetDevice")
    }
}

impl Backend for CudaBackend {
    type Cache = GpuCache;

    const PAGE_TOKENS: usize = PAGE_TOKENS;

    fn new_stream(&self, window: usize) -> Result<GpuStream> {
        self.enter()?;
        self.model.new_stream(window)
    }

    fn step_batch(&mut self, items: &mut [StepItem<'_, GpuCache>]) -> Result<()> {
        self.enter()?;
        self.model.step_batch(items)
    }

    fn logits(&self, i: usize, head: usize) -> Result<Vec<f32>> {
        self.enter()?;
        self.model.head_logits(i, head)
    }

    fn verify_tokens(&self) -> usize {
        // Shorter runs take the matrix-vector kernels, whose rows are the bits of single-token steps.
        (forward::TENSOR_CORE_MIN_TOKENS - 1).min(self.model.max_batch())
    }

    fn copy_page(&mut self, from: u32, to: u32) -> Result<()> {
        self.enter()?;
        self.model.copy_page(from, to)
    }

    fn local_layers(&self) -> Option<LocalLayers> {
        local_layers_of(&self.model)
    }

    fn copy_local_page(&mut self, from: u32, to: u32) -> Result<()> {
        self.enter()?;
        self.model.copy_pool_page(true, from, to)
    }

    fn score(&mut self, stream: &mut GpuStream, tokens: &[u32], out: &mut [f32]) -> Result<()> {
        self.enter()?;
        self.model.score(stream, tokens, out)
    }
}

/// The sliding-window layers' pool of `m`, where it keeps one (`Backend::local_layers`).
pub(super) fn local_layers_of(m: &GpuModel) -> Option<LocalLayers> {
    let window = (0..m.cfg.layers).filter_map(|l| m.cfg.attention.window(l)).max()?;
    // The flash kernel reads 64-position tiles from the one holding a window's first position (the
    // decode kernel less: its 32-position units).
    (m.local_pages > 0).then(|| LocalLayers {
        window,
        reach: 64,
        pages: m.local_pages,
        piece: local_piece(m.max_batch),
    })
}
