//! The one place that calls the kernel launchers of `kernels.rs`: typed wrappers that take device
//! pointers and shapes, queue the kernel on a stream and turn its status into a `Result`. None waits.
//!
//! Every pointer passed here is a device address (NULL only where a kernel takes none) inside an
//! allocation the caller keeps alive until the stream has run the launch, and sized for the shapes
//! passed with it: the GPU model's weight, scratch and KV allocations, or the placed embedding rows.
// The launchers mirror the kernels' C signatures, argument for argument.
#![allow(clippy::too_many_arguments)]

use std::os::raw::{c_int, c_uint, c_void};
use std::ptr;

mod flash;
mod gemm;
mod moe;
pub(super) use self::flash::{FlashPartial, FlashStage, flash_attention, flash_stage, flash_supports};
pub(super) use self::gemm::{HalfMatrix, add_bias, convert_matrix, gemm};
pub(super) use self::moe::{
    ExpertStack, MOE_MMV_ROWS, ROUTE_TAIL_EXPERTS, SumInto, groups_len, moe_down, moe_gate_up, moe_grouped, moe_mmv,
    moe_mmv_sum, moe_mmv_supports, moe_mmv_workspace, moe_route, moe_router, moe_router_route, moe_sum, widen,
};

use super::RowsOnDevice;
use super::weights::DeviceWeight;
use crate::cuda;
use crate::cudart::cudaStream_t;
use crate::kernels::{self as kn, hostembed_tuning};
use crate::kv::KvTypes;
use crate::model::Activation;
use crate::sampler::Sampling;
use crate::status::Result;
use crate::tensor::DType;

/// y[t] = w x[t] (+ bias) (+ residual[t]) for `n` inputs of `w.cols`; rows of y are `ldy` apart.
pub(super) fn matvec(
    w: &DeviceWeight,
    x: *const f32,
    n: usize,
    bias: *const f32,
    residual: *const f32,
    y: *mut f32,
    ldy: usize,
    s: cudaStream_t,
) -> Result<()> {
    let (rows, cols) = (w.rows as c_uint, w.cols as c_uint);
    // SAFETY: device pointers into live allocations sized for these shapes (see the module's note).
    let code = unsafe {
        kn::hostembed_matvec(w.ptr, w.dtype as c_int, rows, cols, x, n as c_uint, bias, residual, y, ldy as c_uint, s)
    };
    cuda::check(code, "hostembed_matvec")
}

/// y[t] = silu(gate x[t]) * (up x[t]), gate and up in one format.
pub(super) fn matvec_swiglu(
    gate: &DeviceWeight,
    up: &DeviceWeight,
    x: *const f32,
    n: usize,
    y: *mut f32,
    s: cudaStream_t,
) -> Result<()> {
    let (dtype, rows, cols, n) = (gate.dtype as c_int, gate.rows as c_uint, gate.cols as c_uint, n as c_uint);
    // SAFETY: device pointers into live allocations sized for these shapes (see the module's note).
    let code = unsafe { kn::hostembed_matvec_swiglu(gate.ptr, up.ptr, dtype, rows, cols, x, n, y, s) };
    cuda::check(code, "hostembed_matvec_swiglu")
}

/// The scratch the tensor-core decode products share: partial sums of split products and their arrival
/// counters (zeroed at load, left zero by every launch), and the model's launch settings for them.
#[derive(Clone, Copy)]
pub(super) struct MmvWork {
    pub partial: *mut f32,
    pub counters: *mut c_uint,
    pub tuning: hostembed_tuning,
}

/// Arrival counters of the fused tails (scratch's `TailCounts`): the router's, the experts' weighted
/// sums' (`sums_count` of them) and the split attention's, each None where that tail is not fused.
#[derive(Clone, Copy)]
pub(super) struct TailCounters {
    pub router: Option<*mut c_uint>,
    pub sums: Option<*mut c_uint>,
    pub sums_count: usize,
    pub attention: Option<*mut c_uint>,
}

/// Whether `w` takes the tensor-core decode product (a format with a lane reader, whole tiles of columns).
pub(super) fn mmv_supports(w: &DeviceWeight) -> bool {
    // SAFETY: host-side checks on a format id, an address and a width; nothing is dereferenced.
    unsafe { kn::hostembed_mmv_supports(w.dtype as c_int, w.ptr, w.cols as c_uint) == 0 }
}

/// y[t] = w x[t] (+ bias) (+ residual[t]) for `n` decode rows: on tensor cores when `tensor` and `w` takes
/// them (every token the same bits whatever else is in the launch), else on the matrix-vector kernel.
pub(super) fn decode_product(
    w: &DeviceWeight,
    x: *const f32,
    n: usize,
    bias: *const f32,
    residual: *const f32,
    y: *mut f32,
    ldy: usize,
    tensor: Option<MmvWork>,
    s: cudaStream_t,
) -> Result<()> {
    let Some(work) = tensor.filter(|_| mmv_supports(w)) else {
        return matvec(w, x, n, bias, residual, y, ldy, s);
    };
    let (rows, cols) = (w.rows as c_uint, w.cols as c_uint);
    // SAFETY: device pointers into live allocations sized for these shapes; `work` holds what
    // hostembed_mmv_workspace asks for the largest product (see the module's note).
    let code = unsafe {
        kn::hostembed_mmv(
            w.ptr,
            w.dtype as c_int,
            rows,
            cols,
            x,
            n as c_uint,
            bias,
            residual,
            y,
            ldy as c_uint,
            work.partial,
            work.counters,
            work.tuning,
            s,
        )
    };
    cuda::check(code, "hostembed_mmv")
}

/// y[t] = silu(gate x[t]) * (up x[t]) for `n` decode rows, on tensor cores as `decode_product` decides.
pub(super) fn decode_swiglu(
    gate: &DeviceWeight,
    up: &DeviceWeight,
    x: *const f32,
    n: usize,
    y: *mut f32,
    tensor: Option<MmvWork>,
    s: cudaStream_t,
) -> Result<()> {
    let Some(work) = tensor.filter(|_| mmv_supports(gate) && mmv_supports(up)) else {
        return matvec_swiglu(gate, up, x, n, y, s);
    };
    let (dtype, rows, cols, n) = (gate.dtype as c_int, gate.rows as c_uint, gate.cols as c_uint, n as c_uint);
    // SAFETY: as for decode_product.
    let code = unsafe {
        let (partial, counters, tuning) = (work.partial, work.counters, work.tuning);
        kn::hostembed_mmv_swiglu(gate.ptr, up.ptr, dtype, rows, cols, x, n, y, partial, counters, tuning, s)
    };
    cuda::check(code, "hostembed_mmv_swiglu")
}

/// RMSNorm of `rows` rows of `cols` values.
pub(super) fn rmsnorm(
    x: *const f32,
    w: *const f32,
    eps: f32,
    out: *mut f32,
    rows: usize,
    cols: usize,
    tuning: hostembed_tuning,
    s: cudaStream_t,
) -> Result<()> {
    // SAFETY: device pointers to `rows` x `cols` floats (`cols` for `w`; see the module's note).
    let code = unsafe { kn::hostembed_rmsnorm(x, w, eps, out, rows as c_uint, cols as c_uint, tuning, s) };
    cuda::check(code, "hostembed_rmsnorm")
}

/// The shapes of one attention pass: `n` query tokens.
#[derive(Clone, Copy)]
pub(super) struct AttentionShape {
    pub n: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Floats between one token's q/k/v row and the next's.
    pub qkv_stride: usize,
    /// A sliding-window layer's window (each query's last positions, its own counted); 0 for none.
    pub window: usize,
}

/// One layer's part of the paged KV pool: where its first page starts, how many pages it has, and the
/// types its K and V are kept in (`pages::PageLayout`).
#[derive(Clone, Copy)]
pub(super) struct KvPages {
    pub pool: *mut c_void,
    pub pages: usize,
    pub kv: KvTypes,
}

/// Per-head q/k norm (when given), rotation of q and k, and K and V written at `pos` into the pages the
/// tokens' page tables (`tables`, one device pointer a token) name.
pub(super) fn rope_kv(
    qkv: *mut f32,
    shape: AttentionShape,
    pos: *const c_int,
    inv_freq: *const f32,
    interleaved: bool,
    q_norm: Option<&DeviceWeight>,
    k_norm: Option<&DeviceWeight>,
    eps: f32,
    kv: KvPages,
    tables: *const *const c_uint,
    tuning: hostembed_tuning,
    s: cudaStream_t,
) -> Result<()> {
    let norm = |w: Option<&DeviceWeight>| w.map_or(ptr::null(), |w| w.f32_ptr());
    let a = shape;
    // SAFETY: device pointers into live allocations sized for these shapes (see the module's note).
    let code = unsafe {
        kn::hostembed_rope_kv(
            qkv,
            a.qkv_stride as c_uint,
            a.n as c_uint,
            pos,
            a.heads as c_uint,
            a.kv_heads as c_uint,
            a.head_dim as c_uint,
            inv_freq,
            interleaved as c_int,
            norm(q_norm),
            norm(k_norm),
            eps,
            kv.pool,
            tables,
            kv.pages as c_uint,
            kv.kv.k as c_int,
            kv.kv.v as c_int,
            tuning,
            s,
        )
    };
    cuda::check(code, "hostembed_rope_kv")
}

/// Attention of `n` queries, each over its own stream's pages, its context cut in at most `splits` parts
/// that `grid_parts` blocks a token take in turn; with `counters`, the parts combined in the same launch.
pub(super) fn attention(
    q: *const f32,
    shape: AttentionShape,
    kv: KvPages,
    tables: *const *const c_uint,
    pos: *const c_int,
    scale: f32,
    splits: usize,
    grid_parts: usize,
    partial: *mut f32,
    out: *mut f32,
    counters: Option<*mut c_uint>,
    tuning: hostembed_tuning,
    s: cudaStream_t,
) -> Result<()> {
    let a = shape;
    // SAFETY: device pointers into live allocations sized for these shapes, `counters` (where given) the
    // `n * heads` zeros of scratch's `TailCounts` (see the module's note).
    let code = unsafe {
        kn::hostembed_attention_combined(
            q,
            a.qkv_stride as c_uint,
            kv.pool,
            tables,
            kv.pages as c_uint,
            kv.kv.k as c_int,
            kv.kv.v as c_int,
            pos,
            a.n as c_uint,
            a.heads as c_uint,
            a.kv_heads as c_uint,
            a.head_dim as c_uint,
            scale,
            a.window as c_uint,
            splits as c_uint,
            grid_parts as c_uint,
            partial,
            out,
            counters.unwrap_or(std::ptr::null_mut()),
            tuning,
            s,
        )
    };
    cuda::check(code, "hostembed_attention")
}

/// The embedding rows of `n` ids into `out` as f32.
pub(super) fn embed_gather(
    rows: &RowsOnDevice,
    ids: *const c_int,
    n: usize,
    out: *mut f32,
    s: cudaStream_t,
) -> Result<()> {
    // SAFETY: `rows` describes the placed table, which outlives the model; `ids` and `out` are scratch.
    let code = unsafe {
        kn::hostembed_embed_gather(
            rows.ptr,
            rows.dtype as c_int,
            rows.vocab as c_uint,
            rows.cols as c_uint,
            ids,
            n as c_uint,
            out as *mut c_void,
            DType::F32 as c_int,
            ptr::null_mut(),
            s,
        )
    };
    cuda::check(code, "hostembed_embed_gather")
}

/// One row of `sample_rows`: an item's settings, its stream index, the position of the token drawn, its
/// penalized ids (`sampler::penalty_ids`: distinct, fewer than the vocabulary), and the row of the masks
/// holding the ids its constraint allows (None: every id).
pub(super) struct SampleRow<'a> {
    pub sampling: &'a Sampling,
    pub stream_index: u32,
    pub position: u64,
    pub penalty: &'a [u32],
    pub mask: Option<u32>,
}

/// A row's workspace in `hostembed_sample_rows` at most, with some to spare: 8 bytes a word of the
/// histograms, the gathered candidates and 4 words a block (kernels/sample.cu's `scratch_bytes`), at
/// up to 160 blocks a row; where less is left the launch gives each row fewer blocks.
const SAMPLE_ROW_WORK_BYTES: usize = 33 << 10;

/// Bytes of the scratch region `sample_rows` draws in, for calls of up to `rows` rows whose penalized ids
/// together are at most `vocab`: 64 bytes a row (settings and barrier words) and 8 an id (the id and its
/// saved logit), the rows' workspaces, and room for the alignments.
pub(super) fn sample_rows_bytes(vocab: usize, rows: usize) -> usize {
    rows * (64 + SAMPLE_ROW_WORK_BYTES) + vocab * 8 + 1024
}

/// Draws the token after each of `rows` logits rows (`vocab` floats apart from `logits` on) into the same
/// rows of `tokens`, each as `hostembed_sample` draws it (`sampler::sample_stream`'s token), in at most
/// three launches. `scratch` is a region of `scratch_size` bytes (`sample_rows_bytes`); the rows'
/// penalized ids together at most the vocabulary. A row with a mask draws `sampler::sample_stream_masked`'s
/// token, among the ids of row `mask` of `masks` (device memory, `vocab.div_ceil(32)` words a row; each
/// such row allows an id below `vocab`). The logits end as they began.
#[allow(clippy::too_many_arguments)]
pub(super) fn sample_rows(
    logits: *mut f32,
    vocab: usize,
    rows: &[SampleRow<'_>],
    masks: *const c_uint,
    scratch: *mut c_void,
    scratch_size: usize,
    tokens: *mut c_int,
    s: cudaStream_t,
) -> Result<()> {
    let count = |n: usize, what: &str| {
        c_uint::try_from(n).map_err(|_| crate::err!(InvalidArgument, "{n} {what} are more than the kernel counts"))
    };
    let mut settings = Vec::with_capacity(rows.len());
    let mut ids: Vec<c_int> = Vec::new();
    for r in rows {
        let &Sampling { temperature, top_k, top_p, min_p, repeat_penalty, seed, .. } = r.sampling;
        let penalty_at = count(ids.len(), "penalized ids")?;
        ids.extend(r.penalty.iter().map(|&t| t as c_int));
        settings.push(kn::hostembed_sample_row {
            temperature,
            top_k,
            top_p,
            min_p,
            repeat_penalty,
            n_penalty: count(r.penalty.len(), "penalized ids")?,
            penalty_at,
            stream_index: r.stream_index,
            seed,
            position: r.position,
            mask_row: r.mask.unwrap_or(kn::NO_MASK),
            reserved: 0,
        });
    }
    let (n_rows, n_ids) = (count(rows.len(), "rows")?, count(ids.len(), "penalized ids")?);
    // SAFETY: `settings` and `ids` are host arrays of the lengths passed, copied before the call returns;
    // logits, tokens, the masks and the scratch region are device memory sized for these rows (see the
    // module's note).
    let code = unsafe {
        kn::hostembed_sample_rows(
            logits,
            vocab as c_uint,
            n_rows,
            settings.as_ptr(),
            ids.as_ptr(),
            n_ids,
            masks,
            scratch,
            scratch_size,
            tokens,
            s,
        )
    };
    cuda::check(code, "hostembed_sample_rows")
}

/// RMSNorm of `rows` rows of `cols` values, written in `dtype` (F32 or a half format), and where
/// `residue` is not null (a half format) each value's rounding residue there too.
pub(super) fn rmsnorm_to(
    x: *const f32,
    w: *const f32,
    eps: f32,
    out: *mut c_void,
    residue: *mut c_void,
    dtype: DType,
    rows: usize,
    cols: usize,
    tuning: hostembed_tuning,
    s: cudaStream_t,
) -> Result<()> {
    let (rows, cols) = (rows as c_uint, cols as c_uint);
    // SAFETY: device pointers to `rows` x `cols` values (`cols` for `w`; see the module's note).
    let code = unsafe { kn::hostembed_rmsnorm_to(x, w, eps, out, residue, dtype as c_int, rows, cols, tuning, s) };
    cuda::check(code, "hostembed_rmsnorm_to")
}

/// out = act(gate) * up over `len` values, written in `dtype` (F32 or a half format).
pub(super) fn glu_to(
    act: Activation,
    gate: *const f32,
    up: *const f32,
    out: *mut c_void,
    dtype: DType,
    len: usize,
    s: cudaStream_t,
) -> Result<()> {
    let act = match act {
        Activation::Silu => kn::ACT_SILU,
        Activation::GeluTanh => kn::ACT_GELU_TANH,
    };
    // SAFETY: device pointers to `len` values each (see the module's note).
    cuda::check(unsafe { kn::hostembed_glu_to(gate, up, out, dtype as c_int, act, len, s) }, "hostembed_glu_to")
}

/// x *= factor over `len` floats.
pub(super) fn scale(x: *mut f32, factor: f32, len: usize, s: cudaStream_t) -> Result<()> {
    // SAFETY: a device pointer to `len` floats (see the module's note).
    cuda::check(unsafe { kn::hostembed_scale(x, factor, len, s) }, "hostembed_scale")
}

/// x += y over `len` floats.
pub(super) fn add(x: *mut f32, y: *const f32, len: usize, s: cudaStream_t) -> Result<()> {
    // SAFETY: device pointers to `len` floats each (see the module's note); the kernel reads each element
    // before writing it, so `out` may be `a`.
    cuda::check(unsafe { kn::hostembed_add(x, y, x, len, s) }, "hostembed_add")
}

/// `len` floats of zeros at x.
pub(super) fn zero(x: *mut f32, len: usize, s: cudaStream_t) -> Result<()> {
    // SAFETY: a device pointer to `len` floats (see the module's note).
    cuda::check(unsafe { crate::cudart::cudaMemsetAsync(x.cast(), 0, len * 4, s) }, "cudaMemsetAsync")
}

/// x[r] += RMSNorm(y[r]) with weight `w`, for `rows` rows of `cols` values.
pub(super) fn rmsnorm_add(
    y: *const f32,
    w: *const f32,
    eps: f32,
    x: *mut f32,
    rows: usize,
    cols: usize,
    s: cudaStream_t,
) -> Result<()> {
    // SAFETY: device pointers to `rows` x `cols` floats (`cols` for `w`; see the module's note).
    let code = unsafe { kn::hostembed_rmsnorm_add(y, w, eps, x, rows as c_uint, cols as c_uint, s) };
    cuda::check(code, "hostembed_rmsnorm_add")
}

/// `len` f32 values written in the half format `dtype`.
pub(super) fn convert(x: *const f32, out: *mut c_void, dtype: DType, len: usize, s: cudaStream_t) -> Result<()> {
    // SAFETY: device pointers to `len` values each (see the module's note).
    cuda::check(unsafe { kn::hostembed_convert(x, out, dtype as c_int, len, s) }, "hostembed_convert")
}

/// out[r] = log p(targets[r]) under logits row r (`vocab` apart), for `rows` rows: `log_prob` on the device.
pub(super) fn row_logprobs(
    logits: *const f32,
    vocab: usize,
    rows: usize,
    targets: *const c_int,
    out: *mut f32,
    s: cudaStream_t,
) -> Result<()> {
    // SAFETY: device pointers to `rows` logits rows, targets and outputs (see the module's note).
    let code = unsafe { kn::hostembed_row_logprobs(logits, vocab as c_uint, rows as c_uint, targets, out, s) };
    cuda::check(code, "hostembed_row_logprobs")
}
