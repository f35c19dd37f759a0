//! The CUDA decode backend: the architectures' forward passes (`arch`) run on the kernels in kernels/*.cu;
//! `backend.rs` puts a model behind the engine's `Backend` seam.
//!
//! Weights go to the device as stored (BF16/F16/F32/Q8_0 matrices, no conversion), except the small
//! 1-D tensors (norms, biases), which are decoded to f32 once. Everything lives in one weight
//! allocation, one scratch allocation and one KV pool, whose sizes `weight_bytes`, `scratch_bytes` and
//! `pool_bytes` predict exactly. The pool is cut in pages of `PAGE_TOKENS` positions (every layer's K
//! and V for them, in the engine's KV cache types: `pages::PageLayout`); a stream holds the pages the
//! engine's `PagePool` gave it, and its page table (the page ids in position order) lives in a small
//! device buffer the kernels read, updated as pages come. K and V are rounded to their types once, when
//! the rotation kernel writes them; both attention kernels read every type directly.
//!
//! A step runs a batch of items of different streams: `forward.rs` packs them into passes of at most
//! `max_batch` tokens, each token carrying its own position and page table, so single-token items of
//! every stream share each weight read. All work is queued on one CUDA stream; the only host wait is for
//! the sampled tokens (and, once a pass is queued, for its constrained items' masks, which the device's
//! sampler applies: `mask.rs`). Passes of single tokens replay a CUDA graph captured per token count (they read
//! everything that changes from the scratch; `Tuning::cuda_graphs` turns that off). Prompt chunks of
//! `TENSOR_CORE_MIN_TOKENS` or more run their matrix products on tensor cores (cuBLASLt when it can
//! be loaded, else the library's own kernel) and their attention as flash attention, except where
//! exactness asks otherwise: an F32 K or V cache takes the split attention kernel (f32 arithmetic)
//! for prompt chunks too, and a model whose matrices are all F32 with an F32 cache runs its prompt
//! chunks on the f32 matrix-vector path (the tensor-core operands are half formats).
//!
//! Batch invariance: a single token's products, norms and attention take the same kernels with the same
//! reduction order whatever else is in its pass (the matrix-vector kernels accumulate each token on its
//! own; decode attention cuts a context by its length alone), so its logits are the same bits alone or
//! beside others. `Tuning::batch_tensor_cores` (the engine's `options.batch_tensor_cores`) trades that
//! for speed: passes of 16 or more single tokens take the tensor-core products.
//!
//! The model reads no environment variable: every setting of how it runs comes from the `Tuning` its
//! load is given.

mod backend;
mod blas;
pub mod collectives;
mod forward;
mod graph;
mod launch;
mod mask;
pub mod nccl;
mod ops;
mod pages;
mod score;
mod scratch;
pub mod split;
mod tensor_parallel;
mod weights;

use std::collections::{HashMap, HashSet};
use std::os::raw::{c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

pub use self::backend::CudaBackend;
use self::collectives::Collectives;
pub use self::forward::{TENSOR_CORE_MIN_TOKENS, reserve_pages, truncate_stream};
use self::graph::StepGraph;
pub use self::pages::{GpuCache, GpuStream, PAGE_TOKENS, PageLayout};
use self::scratch::ScratchLayout;
pub use self::scratch::{MMV_MAX_TOKENS, attention_grid_parts, mmv_shape, mmv_workspace};
use self::tensor_parallel::RankPart;
use self::weights::{DeviceWeight, plan, prompt_format, upload};
use crate::backend::PagePool;
use crate::cuda::{self, DeviceBuffer, StagedUploader, Stream};
use crate::kernels::hostembed_tuning;
use crate::kv::{KvType, KvTypes};
use crate::model::{Layers, ModelConfig, TensorSource, rope_inv_freq, rope_inv_freq_local};
use crate::status::Result;
use crate::tensor::DType;
use crate::tuning::{FusedTails, Tuning};
use crate::{bail, err};

/// Where the embedding rows live for the device: on the card or in mapped host memory, read through
/// `ptr` by the gather (and by the output head when the model is tied).
#[derive(Clone, Copy, Debug)]
pub struct RowsOnDevice {
    pub ptr: *const c_void,
    pub dtype: DType,
    pub vocab: usize,
    pub cols: usize,
}

// SAFETY: a device address is a plain number to the host; the rows' owner keeps them alive.
unsafe impl Send for RowsOnDevice {}
// SAFETY: as for Send: nothing here is read through the pointer on the host.
unsafe impl Sync for RowsOnDevice {}

/// Every device region starts on this boundary (cudaMalloc's own alignment).
const ALIGN: usize = 256;
/// The largest prompt chunk one pass takes (the attention grid's third dimension bounds it).
pub const MAX_BATCH_LIMIT: usize = 4096;

fn align_up(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

/// Regions laid out one after the other, each aligned; `append` continues the last region instead.
#[derive(Default)]
struct Layout {
    /// End of the last region, unaligned.
    end: usize,
    total: usize,
}

impl Layout {
    fn push(&mut self, bytes: usize) -> usize {
        let at = self.total;
        self.end = at + bytes;
        self.total = align_up(self.end);
        at
    }

    /// Places `bytes` right after the last region, with no padding between.
    fn append(&mut self, bytes: usize) -> usize {
        let at = self.end;
        self.end = at + bytes;
        self.total = align_up(self.end);
        at
    }
}

static NEXT_MODEL_ID: AtomicU64 = AtomicU64::new(1);

/// The model on the device: all weights but the embedding rows, and the scratch one step needs.
pub struct GpuModel {
    cfg: ModelConfig,
    max_batch: usize,
    id: u64,
    layers: Layers<DeviceWeight>,
    final_norm: *const f32,
    head: DeviceWeight,
    rows: RowsOnDevice,
    s: ScratchLayout,
    graphs: bool,
    /// Captured passes whose every row is a head, by rows, matrix-vector rows and attention grid
    /// (`PassShape::{n, m, grid_parts}`).
    decode_graphs: HashMap<(usize, usize, usize), StepGraph>,
    /// Those keys run once already (the next one is captured).
    decode_seen: HashSet<(usize, usize, usize)>,
    /// Where each item of the last step left its logits.
    /// Per item of the last step, where the logits after each of its head positions are.
    logits_at: Vec<Vec<forward::LogitsAt>>,
    /// Whether passes of many single tokens take the tensor-core products (not batch invariant).
    batch_tensor_cores: bool,
    /// Whether decode rows take the batch-invariant tensor-core products where a weight's format has them
    /// (`Tuning::mmv`; off keeps every decode product on the matrix-vector kernels).
    mmv: bool,
    /// The parts the split attention cuts a context into (the scratch's partial results are sized for them).
    attention_parts: usize,
    /// Whether every attention part is a block of its own (`scratch::attention_grid`).
    attention_grid_full: bool,
    /// Whether a short chunk's flash attention may cut its context in parts (`launch::flash_parts`).
    flash_parts: bool,
    /// Whether a MoE layer's prompt rows take the grouped tensor-core products (`ops::add_moe_ffn`).
    moe_grouped: bool,
    /// Whether a MoE layer's decode rows take the integer decode product where the format has it.
    moe_mmv: bool,
    /// Which small last steps run in the last block of the kernel before them (`tail_counters`).
    fused_tails: FusedTails,
    /// How the launchers that take it launch.
    kernel_tuning: hostembed_tuning,
    pool_pages: usize,
    /// Pages of the sliding-window layers' own pool (0: they are in the main one), after the main
    /// pool's layers in the allocation.
    local_pages: usize,
    /// Each layer's pool (true: the local one) and its place among that pool's layers.
    layer_pool: Vec<(bool, usize)>,
    /// Layers in the main pool: the local pool's region starts after theirs.
    main_layers: usize,
    /// What the pool keeps K and V in, and how a page lays them out.
    kv: KvTypes,
    page: PageLayout,
    /// The format of the prompt path's activations and product operands.
    half: DType,
    /// Whether prompt chunks may take the tensor-core path (every product width a multiple of 8).
    tensor_cores: bool,
    /// Whether the flash kernel takes this head size.
    flash: bool,
    blas: Option<blas::Blas>,
    /// Which products the prompt path runs, for the engine's log line.
    route: String,
    /// The pinned staging of constrained rows' masks.
    mask_stage: mask::MaskStage,
    /// One rank's share of a tensor-parallel model: its collectives and the head's gather.
    rank: Option<RankPart>,
    // Declared last: dropped after everything that points into them.
    stream: Stream,
    scratch: DeviceBuffer,
    pool: DeviceBuffer,
    weights: DeviceBuffer,
}

// SAFETY: it owns its allocations and stream; its pointers are device addresses, never read on the host.
unsafe impl Send for GpuModel {}

/// What a GPU model's buffers are sized for beside its weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sizing {
    /// Prompt tokens one pass takes.
    pub max_batch: usize,
    /// Pages of `PAGE_TOKENS` positions in the KV pool.
    pub pool_pages: usize,
    /// The sliding-window layers' own pool's pages, where the model keeps one.
    pub local_pages: Option<usize>,
    pub kv: KvTypes,
    /// The most positions a stream holds (what an 8-bit cache's prompt stage is sized for).
    pub window: usize,
}

fn u32_of(v: usize, what: &str) -> Result<c_uint> {
    c_uint::try_from(v).map_err(|_| err!(Unsupported, "{what} of {v} is more than the kernels index"))
}

impl GpuModel {
    /// Device bytes `load` allocates for the weights (the embedding rows excluded, an untied head
    /// included); 0 when `src` does not hold a model `load` accepts.
    pub fn weight_bytes(src: &dyn TensorSource) -> u64 {
        plan(src).map_or(0, |p| p.total as u64)
    }

    /// Device bytes `load_for_window` allocates for activations and scratch with prompt chunks of
    /// `max_batch`, a KV cache in `kv`'s types, streams of up to `window` positions and `tuning`; 0 when
    /// `src` does not hold a model `load` accepts.
    pub fn scratch_bytes(src: &dyn TensorSource, max_batch: usize, kv: KvTypes, window: usize, tuning: &Tuning) -> u64 {
        plan(src).map_or(0, |p| {
            let (_, slab) = prompt_format(&p.product_matrices());
            let cfg = src.config();
            let stage = scratch::stage_tokens(kv, flash_attention_for(cfg, kv, tuning), window);
            ScratchLayout::new(cfg, max_batch, slab, stage, tuning.attention_parts).total as u64
        })
    }

    /// KV bytes of a full window of `window` tokens in `kv`'s types, as the fit rule counts a stream
    /// (linear in the window; the pool's pages round each stream up to a whole page).
    pub fn stream_bytes(cfg: &ModelConfig, kv: KvTypes, window: usize) -> u64 {
        kv.bytes_per_token(cfg) * window as u64
    }

    /// Device bytes `load_with_kv` allocates for a KV pool of `pages` pages in `kv`'s types: every
    /// layer's pages of `PageLayout::page_bytes`, which is `PAGE_TOKENS` positions' bytes.
    pub fn pool_bytes(cfg: &ModelConfig, kv: KvTypes, pages: usize) -> u64 {
        kv.bytes_per_token(cfg) * (pages * PAGE_TOKENS) as u64
    }

    /// Device bytes `load_with_pools` allocates: `pages` pages of the layers in the main pool, and with
    /// `local` the sliding-window layers' `local` pages of their own.
    pub fn pools_bytes(cfg: &ModelConfig, kv: KvTypes, pages: usize, local: Option<usize>) -> u64 {
        let apart = local.map_or(0, |_| local_layer_count(cfg)) as u64;
        let per_layer = Self::pool_bytes(cfg, kv, 1) / cfg.layers.max(1) as u64;
        per_layer * ((cfg.layers as u64 - apart) * pages as u64 + apart * local.unwrap_or(0) as u64)
    }

    /// What the pool keeps K and V in.
    pub fn kv_types(&self) -> KvTypes {
        self.kv
    }

    /// Pages in the KV pool.
    pub fn pool_pages(&self) -> usize {
        self.pool_pages
    }

    /// Pages of the sliding-window layers' own pool; 0 when they are in the main one.
    pub fn local_pages(&self) -> usize {
        self.local_pages
    }

    /// Layer `layer`'s region of the pool allocation (its first page), its pool's page count, and
    /// whether that pool is the local layers'.
    pub(super) fn layer_region(&self, layer: usize) -> (*mut u8, usize, bool) {
        let page = self.page.page_bytes();
        let (base, main_layers) = (self.pool.ptr() as *mut u8, self.main_layers);
        match self.layer_pool[layer] {
            (false, i) => (base.wrapping_add(i * self.pool_pages * page), self.pool_pages, false),
            (true, i) => {
                let local = base.wrapping_add(main_layers * self.pool_pages * page);
                (local.wrapping_add(i * self.local_pages * page), self.local_pages, true)
            }
        }
    }

    /// A page pool over every page of this model's KV pool, for callers that step streams directly
    /// (the engine keeps its own).
    pub fn page_pool(&self) -> Result<PagePool> {
        PagePool::new(PAGE_TOKENS, self.pool_pages)
    }

    /// Whether passes of `TENSOR_CORE_MIN_TOKENS` or more single tokens take the tensor-core products:
    /// faster with many streams, but a stream's logits then depend on how many others share its pass.
    pub fn set_batch_tensor_cores(&mut self, on: bool) {
        self.batch_tensor_cores = on;
        self.decode_graphs.clear();
        self.decode_seen.clear();
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// What runs a prompt chunk's products and attention, in one line for the log.
    pub fn prompt_route(&self) -> &str {
        &self.route
    }

    /// Bytes actually allocated for (weights, scratch): what `weight_bytes` and `scratch_bytes` predict.
    pub fn allocated_bytes(&self) -> (u64, u64) {
        (self.weights.bytes() as u64, self.scratch.bytes() as u64)
    }

    /// Bytes actually allocated for the KV pool: what `pool_bytes` predicts.
    pub fn allocated_pool_bytes(&self) -> u64 {
        self.pool.bytes() as u64
    }

    /// Uploads the weights and allocates scratch and a KV pool of `pool_pages` pages of BF16 K and V on
    /// the current device, to run as `tuning` says.
    pub fn load(
        src: &dyn TensorSource,
        rows: RowsOnDevice,
        max_batch: usize,
        pool_pages: usize,
        tuning: &Tuning,
    ) -> Result<GpuModel> {
        Self::load_with_kv(src, rows, max_batch, pool_pages, KvTypes::GPU_DEFAULT, tuning)
    }

    /// `load` with the pool's K and V in `kv`'s types, for streams as long as the pool. UNSUPPORTED
    /// when a type cannot hold the model's heads or the current device cannot run it (FP8 E4M3 below
    /// compute capability 8.9).
    pub fn load_with_kv(
        src: &dyn TensorSource,
        rows: RowsOnDevice,
        max_batch: usize,
        pool_pages: usize,
        kv: KvTypes,
        tuning: &Tuning,
    ) -> Result<GpuModel> {
        Self::load_for_window(src, rows, max_batch, pool_pages, kv, pool_pages.saturating_mul(PAGE_TOKENS), tuning)
    }

    /// `load_with_kv` for streams of at most `window` positions (what an 8-bit cache's prompt stage is
    /// sized for; `scratch_bytes` with the same arguments is what it allocates).
    pub fn load_for_window(
        src: &dyn TensorSource,
        rows: RowsOnDevice,
        max_batch: usize,
        pool_pages: usize,
        kv: KvTypes,
        window: usize,
        tuning: &Tuning,
    ) -> Result<GpuModel> {
        Self::load_with_pools(src, rows, Sizing { max_batch, pool_pages, local_pages: None, kv, window }, tuning)
    }

    /// `load_for_window` sized as `sizing` says: with the sliding-window layers (where the model has them
    /// and `sizing.local_pages` is given) in a pool of their own.
    pub fn load_with_pools(
        src: &dyn TensorSource,
        rows: RowsOnDevice,
        sizing: Sizing,
        tuning: &Tuning,
    ) -> Result<GpuModel> {
        crate::shard::refuse_rank(src)?;
        Self::load_parts(src, None, rows, sizing, tuning)
    }

    /// `load_with_pools`, or with `comm` one rank's share of a tensor-parallel model (`load_rank`).
    fn load_parts(
        src: &dyn TensorSource,
        comm: Option<Box<dyn Collectives>>,
        rows: RowsOnDevice,
        sizing: Sizing,
        tuning: &Tuning,
    ) -> Result<GpuModel> {
        let Sizing { max_batch, pool_pages, local_pages, kv, window } = sizing;
        let cfg = src.config().clone();
        let local_pages = if local_layer_count(&cfg) > 0 { local_pages.unwrap_or(0) } else { 0 };
        if local_pages > u32::MAX as usize {
            bail!(InvalidArgument, "a local layers' KV pool of {local_pages} pages is more than page ids count");
        }
        Self::check_config(&cfg)?;
        kv.check(&cfg)?;
        if kv.k == KvType::Fp8E4m3 || kv.v == KvType::Fp8E4m3 {
            let (device, major, minor) = cuda::current_compute_capability()?;
            kv.check_device(major, minor, &format!("device {device}"))?;
        }
        if max_batch == 0 || max_batch > MAX_BATCH_LIMIT {
            bail!(InvalidArgument, "max_batch {max_batch} is outside 1..={MAX_BATCH_LIMIT}");
        }
        if pool_pages == 0 || pool_pages > u32::MAX as usize {
            bail!(InvalidArgument, "a KV pool of {pool_pages} pages is outside 1..={}", u32::MAX);
        }
        pages::check_page_tokens()?;
        if rows.ptr.is_null() {
            bail!(InvalidArgument, "the embedding rows' device pointer is NULL");
        }
        if rows.vocab != cfg.vocab || rows.cols != cfg.hidden {
            bail!(
                BadModel,
                "embedding rows are {} x {}, the model needs {} x {}",
                rows.vocab,
                rows.cols,
                cfg.vocab,
                cfg.hidden
            );
        }
        if rows.dtype.row_bytes(rows.cols).is_none() {
            bail!(BadModel, "embedding rows of {} columns do not fit the {} format", rows.cols, rows.dtype.name());
        }
        let plan = plan(src)?;
        let matrices = plan.product_matrices();
        let (half, slab) = prompt_format(&matrices);
        let weights = DeviceBuffer::new(plan.total)?;
        let mut uploader = StagedUploader::new()?;
        let mut up = |p| upload(&weights, &mut uploader, p);
        let layers = plan.layers.try_map(|_, _, p| up(p))?;
        if let Layers::Llama(llama) = &layers {
            for (i, l) in llama.iter().enumerate() {
                for (experts, role) in [(&l.expert_gate, "gate"), (&l.expert_up, "up"), (&l.expert_down, "down")] {
                    if !experts.is_empty() {
                        launch::ExpertStack::of(experts, &format!("layer {i}'s expert {role} matrices"))?;
                    }
                }
            }
        }
        let final_norm = up(plan.final_norm)?.f32_ptr();
        let head = match plan.lm_head {
            Some(p) => up(p)?,
            None => DeviceWeight { ptr: rows.ptr, dtype: rows.dtype, rows: rows.vocab, cols: rows.cols },
        };

        let local = (local_pages > 0).then_some(local_pages);
        let pool_bytes = usize::try_from(Self::pools_bytes(&cfg, kv, pool_pages, local))
            .map_err(|_| err!(NoRoom, "a KV pool of {pool_pages} pages does not fit in memory"))?;
        let mut counts = [0usize; 2];
        let layer_pool = (0..cfg.layers)
            .map(|l| {
                let apart = local_pages > 0 && cfg.attention.window(l).is_some();
                counts[apart as usize] += 1;
                (apart, counts[apart as usize] - 1)
            })
            .collect();
        let pool = DeviceBuffer::new(pool_bytes)?;
        let flash = flash_attention_for(&cfg, kv, tuning);
        let stage = scratch::stage_tokens(kv, flash, window);
        let s = ScratchLayout::new(&cfg, max_batch, slab, stage, tuning.attention_parts);
        let scratch = DeviceBuffer::new(s.total)?;
        scratch.upload(&rope_inv_freq(&cfg), s.inv_freq)?;
        if let (Some(at), Some(local)) = (s.inv_freq_local, rope_inv_freq_local(&cfg)) {
            scratch.upload(&local, at)?;
        }
        scratch.upload(&vec![0u8; s.mmv_counter_bytes], s.mmv_counters)?;
        scratch.upload(&vec![0u8; s.tail_counter_bytes], s.tail_counters)?;
        let stream = Stream::new()?;
        let f32_cache = kv.k == KvType::F32 || kv.v == KvType::F32;
        // An all-F32 model with an F32 cache keeps its prompt chunks in f32: the half-format operands of
        // the tensor-core products alone cost ~1e-3 of relative error.
        let exact = kv == KvTypes::same(KvType::F32) && matrices.iter().all(|m| m.0 == DType::F32);
        let tensor_cores = !exact && [cfg.hidden, cfg.q_dim(), cfg.intermediate].iter().all(|d| d % 8 == 0);
        let (blas, route) = match blas::Blas::new(&tuning.cublaslt) {
            Ok(b) => {
                let route = format!("prompt products on cuBLASLt ({})", b.name());
                (Some(b), route)
            }
            Err(why) => (None, format!("prompt products on hostembed's tensor-core kernel (no cuBLASLt: {why})")),
        };
        let route = if exact {
            "prompt chunks on the f32 matrix-vector products and split attention (F32 weights, F32 KV cache)"
                .to_string()
        } else if flash {
            format!("{route}, flash attention")
        } else if f32_cache {
            format!("{route}, split attention (an F32 KV cache is read in f32)")
        } else {
            format!("{route}, split attention (no flash kernel for head_dim {})", cfg.head_dim)
        };
        let route = format!("{route}; KV cache {}", kv.describe());
        let page = PageLayout::new(&cfg, kv);
        let rank = match comm {
            Some(comm) => Some(RankPart::new(comm, cfg.vocab, s.logit_rows)?),
            None => None,
        };
        // A rank's collectives that wait on the host cannot be captured.
        let graphs = tuning.cuda_graphs && rank.as_ref().is_none_or(|r| r.comm.capturable());
        Ok(GpuModel {
            cfg,
            max_batch,
            id: NEXT_MODEL_ID.fetch_add(1, Ordering::Relaxed),
            layers,
            final_norm,
            head,
            rows,
            s,
            graphs,
            decode_graphs: HashMap::new(),
            decode_seen: HashSet::new(),
            logits_at: Vec::new(),
            batch_tensor_cores: tuning.batch_tensor_cores,
            mmv: tuning.mmv,
            attention_parts: tuning.attention_parts,
            attention_grid_full: tuning.attention_grid_full,
            flash_parts: tuning.flash_parts,
            moe_grouped: tuning.moe_grouped,
            moe_mmv: tuning.moe_mmv,
            fused_tails: tuning.fused_tails,
            kernel_tuning: hostembed_tuning::of(tuning),
            pool_pages,
            local_pages,
            main_layers: counts[0],
            layer_pool,
            kv,
            page,
            half,
            tensor_cores,
            flash,
            blas,
            route,
            mask_stage: mask::MaskStage::default(),
            rank,
            stream,
            scratch,
            pool,
            weights,
        })
    }

    /// The config's own check, then what the kernels take beyond it.
    fn check_config(cfg: &ModelConfig) -> Result<()> {
        cfg.check("config")?;
        if cfg.head_dim == 0 || !cfg.head_dim.is_multiple_of(8) || cfg.head_dim > 256 {
            bail!(Unsupported, "head_dim {}: the CUDA attention takes multiples of 8 up to 256", cfg.head_dim);
        }
        if cfg.vocab > i32::MAX as usize {
            bail!(Unsupported, "a vocabulary of {} ids does not fit the kernels' int token ids", cfg.vocab);
        }
        for (what, v) in [
            ("hidden", cfg.hidden),
            ("intermediate", cfg.intermediate),
            ("q/k/v width", cfg.q_dim() + 2 * cfg.kv_dim()),
        ] {
            u32_of(v, what)?;
        }
        Ok(())
    }
}

/// Layers with a sliding window: those a local layers' pool would hold.
fn local_layer_count(cfg: &ModelConfig) -> usize {
    (0..cfg.layers).filter(|&l| cfg.attention.window(l).is_some()).count()
}

/// Tokens of the pieces `Streams` steps a long item in where the sliding-window layers have a pool of
/// their own (`backend::LocalLayers::piece`): whole prompt chunks of `max_batch`, about 2,048 tokens.
pub fn local_piece(max_batch: usize) -> usize {
    max_batch.max(1) * (2048 / max_batch.max(1)).max(1)
}

/// Whether prompt chunks take flash attention: its operands are half formats (an F32 cache is read by
/// the split kernel in f32), for the head sizes it has kernels for.
fn flash_attention_for(cfg: &ModelConfig, kv: KvTypes, tuning: &Tuning) -> bool {
    // Head sizes past 128 (Gemma 3's 256) have flash kernels for the 16-bit caches only, taken where the
    // tuning asks for them (`Tuning::flash_head_256`).
    let types = if cfg.head_dim > 128 { tuning.flash_head_256 && !kv.k.is_block() && !kv.v.is_block() } else { true };
    kv.k != KvType::F32 && kv.v != KvType::F32 && types && launch::flash_supports(cfg.head_dim)
}
