//! The Mixture-of-Experts launchers (kernels/moe.cu): the router's logits, each row's top-k and weights
//! (and the rows grouped by expert), the chosen experts' SwiGLU and down products, and their weighted sum
//! onto the residual; and the half activations widened to f32 for them; and the tensor-core rows' grouped
//! products (kernels/moe_gemm.cu). Pointers as `launch`'s module note says.

use std::os::raw::{c_int, c_uint, c_void};

use super::super::weights::DeviceWeight;
use crate::cuda;
use crate::cudart::cudaStream_t;
use crate::kernels as kn;
use crate::status::Result;
use crate::tensor::DType;

/// One role's experts of a layer as the loader lays them out: `count` matrices of one format and shape,
/// expert e's at `ptr + e * stride`.
#[derive(Clone, Copy, Debug)]
pub(in crate::gpu) struct ExpertStack {
    pub ptr: *const c_void,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub stride: usize,
}

impl ExpertStack {
    /// The stack `experts` are (`weights::place_layers` puts each right after the one before);
    /// UNSUPPORTED where they differ in format or shape (an HF folder may mix them), which the kernels
    /// cannot stride through.
    pub(in crate::gpu) fn of(experts: &[DeviceWeight], what: &str) -> Result<ExpertStack> {
        let Some(first) = experts.first() else { crate::bail!(BadModel, "{what}: no experts") };
        let bytes = first.dtype.row_bytes(first.cols).unwrap_or(0) * first.rows;
        for (e, w) in experts.iter().enumerate() {
            let at = (first.ptr as *const u8).wrapping_add(e * bytes) as *const c_void;
            if (w.dtype, w.rows, w.cols, w.ptr) != (first.dtype, first.rows, first.cols, at) {
                crate::bail!(
                    Unsupported,
                    "{what}: expert {e} is {} {}x{}, expert 0 {} {}x{}: the CUDA backend takes experts of one format and shape",
                    w.dtype.name(),
                    w.rows,
                    w.cols,
                    first.dtype.name(),
                    first.rows,
                    first.cols
                );
            }
        }
        Ok(ExpertStack { ptr: first.ptr, dtype: first.dtype, rows: first.rows, cols: first.cols, stride: bytes })
    }
}

/// logits[r][e] = router[e] . x[r] for `n` rows of `router.cols`.
pub(in crate::gpu) fn moe_router(
    router: &DeviceWeight,
    x: *const f32,
    n: usize,
    logits: *mut f32,
    s: cudaStream_t,
) -> Result<()> {
    let (experts, cols) = (router.rows as c_uint, router.cols as c_uint);
    // SAFETY: device pointers into live allocations sized for these shapes (see `launch`'s note).
    let code = unsafe {
        kn::hostembed_moe_router(router.ptr, router.dtype as c_int, experts, cols, x, n as c_uint, logits, s)
    };
    cuda::check(code, "hostembed_moe_router")
}

/// The most experts and experts a token `moe_route` takes (kernels/moe.cu's one block and warp a row).
const MAX_EXPERTS: usize = 1024;
const MAX_USED: usize = 32;

/// Each of `n` rows' `k` experts (ascending ids) and weights from its `experts` logits, and the rows'
/// slots grouped by expert into `groups` (`groups_len` ints).
#[allow(clippy::too_many_arguments)]
pub(in crate::gpu) fn moe_route(
    logits: *const f32,
    experts: usize,
    n: usize,
    k: usize,
    norm_topk: bool,
    ids: *mut c_int,
    weights: *mut f32,
    groups: *mut c_int,
    s: cudaStream_t,
) -> Result<()> {
    if experts > MAX_EXPERTS || k > MAX_USED {
        crate::bail!(
            Unsupported,
            "{k} of {experts} experts a token: the CUDA backend routes at most {MAX_USED} of {MAX_EXPERTS}"
        );
    }
    let (experts, n, k) = (experts as c_uint, n as c_uint, k as c_uint);
    // SAFETY: device pointers to n x experts logits, n x k ids and weights, and groups_len(experts, n * k)
    // ints (see `launch`'s note).
    let code = unsafe { kn::hostembed_moe_route(logits, experts, n, k, norm_topk as c_int, ids, weights, groups, s) };
    cuda::check(code, "hostembed_moe_route")
}

/// The most experts `moe_router_route` takes (kernels/moe.cu's ROUTE_TAIL_PER experts a lane).
pub(in crate::gpu) const ROUTE_TAIL_EXPERTS: usize = 256;

/// `moe_router` of `n` rows, then `moe_route` of rows [0, route_n) by the router's last block to finish
/// (one launch, the same bits); `counter` a zero that the launch leaves zero. At most
/// `ROUTE_TAIL_EXPERTS` experts.
#[allow(clippy::too_many_arguments)]
pub(in crate::gpu) fn moe_router_route(
    router: &DeviceWeight,
    x: *const f32,
    n: usize,
    logits: *mut f32,
    route_n: usize,
    k: usize,
    norm_topk: bool,
    ids: *mut c_int,
    weights: *mut f32,
    groups: *mut c_int,
    counter: *mut c_uint,
    s: cudaStream_t,
) -> Result<()> {
    if router.rows > ROUTE_TAIL_EXPERTS || k > MAX_USED {
        crate::bail!(
            Unsupported,
            "{k} of {} experts a token: the router's route takes at most {MAX_USED} of {ROUTE_TAIL_EXPERTS}",
            router.rows
        );
    }
    let (experts, cols) = (router.rows as c_uint, router.cols as c_uint);
    let (n, route_n, k) = (n as c_uint, route_n as c_uint, k as c_uint);
    // SAFETY: device pointers into live allocations sized for these shapes: n x experts logits, route_n x k
    // ids and weights, groups_len(experts, route_n * k) ints, and one u32 counter (see `launch`'s note).
    let code = unsafe {
        kn::hostembed_moe_router_route(
            router.ptr,
            router.dtype as c_int,
            experts,
            cols,
            x,
            n,
            logits,
            route_n,
            k,
            norm_topk as c_int,
            ids,
            weights,
            groups,
            counter,
            s,
        )
    };
    cuda::check(code, "hostembed_moe_router_route")
}

/// Ints of `moe_route`'s groups for `slots` (rows times k) of `experts`: the count of experts chosen, the
/// chosen experts, each expert's first place and count, and the slots.
pub(in crate::gpu) fn groups_len(experts: usize, slots: usize) -> usize {
    1 + 3 * experts + slots
}

/// act[r * k + slot] = silu(gate_e x[r]) * (up_e x[r]) for each row's `k` chosen experts e, as `groups`
/// lists them (`moe_route`).
#[allow(clippy::too_many_arguments)]
pub(in crate::gpu) fn moe_gate_up(
    gate: &ExpertStack,
    up: &ExpertStack,
    x: *const f32,
    groups: *const c_int,
    experts: usize,
    n: usize,
    k: usize,
    act: *mut f32,
    s: cudaStream_t,
) -> Result<()> {
    if (gate.dtype, gate.rows, gate.cols, gate.stride) != (up.dtype, up.rows, up.cols, up.stride) {
        crate::bail!(Unsupported, "expert gate and up matrices of different formats or shapes");
    }
    let (width, cols) = (gate.rows as c_uint, gate.cols as c_uint);
    // SAFETY: device pointers into live allocations sized for these shapes; every expert in `groups` is
    // below the stack's expert count (the route kernel writes them) (see `launch`'s note).
    let code = unsafe {
        kn::hostembed_moe_gate_up(
            gate.ptr,
            up.ptr,
            gate.dtype as c_int,
            gate.stride,
            width,
            cols,
            x,
            groups,
            experts as c_uint,
            n as c_uint,
            k as c_uint,
            act,
            s,
        )
    };
    cuda::check(code, "hostembed_moe_gate_up")
}

/// out[r * k + slot] = down_e act[r * k + slot] for each row's chosen experts e, as `groups` lists them.
#[allow(clippy::too_many_arguments)]
pub(in crate::gpu) fn moe_down(
    down: &ExpertStack,
    act: *const f32,
    groups: *const c_int,
    experts: usize,
    n: usize,
    k: usize,
    out: *mut f32,
    s: cudaStream_t,
) -> Result<()> {
    let (rows, cols) = (down.rows as c_uint, down.cols as c_uint);
    // SAFETY: as `moe_gate_up`.
    let code = unsafe {
        kn::hostembed_moe_down(
            down.ptr,
            down.dtype as c_int,
            down.stride,
            rows,
            cols,
            act,
            groups,
            experts as c_uint,
            n as c_uint,
            k as c_uint,
            out,
            s,
        )
    };
    cuda::check(code, "hostembed_moe_down")
}

/// Whether a stack takes the integer decode product's expert kernel (kernels/moe_mmv.cu: a block format,
/// whole tiles of columns, every expert at its reader's alignment).
pub(in crate::gpu) fn moe_mmv_supports(w: &ExpertStack) -> bool {
    // SAFETY: host-side checks on a format id, an address, a stride and a width; nothing is dereferenced.
    unsafe { kn::hostembed_moe_mmv_supports(w.dtype as c_int, w.ptr, w.stride, w.cols as c_uint) == 0 }
}

/// The most decode rows one `moe_mmv` launch takes (the workspace is sized for this many; more rows go
/// in launches of this many, each routed apart).
pub(in crate::gpu) const MOE_MMV_ROWS: usize = 64;

/// (partial floats, counters) `moe_mmv` needs for `n` rows of a stack of `rows` x `cols` (glu: gate with up).
pub(in crate::gpu) fn moe_mmv_workspace(
    rows: usize,
    cols: usize,
    glu: bool,
    experts: usize,
    n: usize,
    k: usize,
) -> Option<(usize, usize)> {
    let (mut floats, mut counters) = (0usize, 0 as c_uint);
    let c = |v: usize| c_uint::try_from(v).ok();
    let (rows, cols, experts, n, k) = (c(rows)?, c(cols)?, c(experts)?, c(n)?, c(k)?);
    // SAFETY: host arithmetic on sizes, writing the two out-parameters only.
    let code =
        unsafe { kn::hostembed_moe_mmv_workspace(rows, cols, glu as c_int, experts, n, k, &mut floats, &mut counters) };
    (code == 0).then_some((floats, counters as usize))
}

/// y[slot] = w_e x[slot / x_div] for each slot of `groups` (n rows, k slots a row) and its expert e, or
/// with `up` silu(w_e x) * (up_e x), on the integer decode product (rows of y `w.rows` apart); `work` as
/// `moe_mmv_workspace` sizes it for at most `MOE_MMV_ROWS` rows.
#[allow(clippy::too_many_arguments)]
pub(in crate::gpu) fn moe_mmv(
    w: &ExpertStack,
    up: Option<&ExpertStack>,
    x: *const f32,
    x_div: usize,
    groups: *const c_int,
    experts: usize,
    n: usize,
    k: usize,
    y: *mut f32,
    work: &super::MmvWork,
    s: cudaStream_t,
) -> Result<()> {
    if let Some(u) = up
        && (u.dtype, u.rows, u.cols, u.stride) != (w.dtype, w.rows, w.cols, w.stride)
    {
        crate::bail!(Unsupported, "expert gate and up matrices of different formats or shapes");
    }
    let w2 = up.map_or(std::ptr::null(), |u| u.ptr);
    // SAFETY: device pointers into live allocations sized for these shapes; `w` (and `up`) a stack of
    // `experts` matrices back to back (`ExpertStack::of`), every expert and slot in `groups` in range (the
    // route kernel writes them), and the workspace sized for `n` rows (see `launch`'s note).
    let code = unsafe {
        kn::hostembed_moe_mmv(
            w.ptr,
            w2,
            w.dtype as c_int,
            w.stride,
            w.rows as c_uint,
            w.cols as c_uint,
            x,
            x_div as c_uint,
            groups,
            experts as c_uint,
            n as c_uint,
            k as c_uint,
            y,
            work.partial,
            work.counters,
            work.tuning,
            s,
        )
    };
    cuda::check(code, "hostembed_moe_mmv")
}

/// Where the down product's blocks add each row's weighted sum (`moe_mmv_sum`): the rows' slot weights,
/// the rows they add to, and `count` zeroed arrival counters.
pub(in crate::gpu) struct SumInto {
    pub weights: *const f32,
    pub sums: *mut f32,
    pub counters: *mut c_uint,
    pub count: usize,
}

/// `moe_mmv` of the down stack `w` (no up, x_div 1), then each row's `moe_sum` into `into.sums` by the
/// blocks that finish its outputs last (one launch, the same bits).
#[allow(clippy::too_many_arguments)]
pub(in crate::gpu) fn moe_mmv_sum(
    w: &ExpertStack,
    x: *const f32,
    groups: *const c_int,
    experts: usize,
    n: usize,
    k: usize,
    y: *mut f32,
    work: &super::MmvWork,
    into: &SumInto,
    s: cudaStream_t,
) -> Result<()> {
    let count = c_uint::try_from(into.count).unwrap_or(c_uint::MAX);
    // SAFETY: as `moe_mmv`'s, and `into` as scratch's `TailCounts` sizes it: n x w.rows sums, n x k weights,
    // `count` counters (the kernel checks that they cover n rows' row blocks).
    let code = unsafe {
        kn::hostembed_moe_mmv_sum(
            w.ptr,
            w.dtype as c_int,
            w.stride,
            w.rows as c_uint,
            w.cols as c_uint,
            x,
            groups,
            experts as c_uint,
            n as c_uint,
            k as c_uint,
            y,
            work.partial,
            work.counters,
            into.weights,
            into.sums,
            into.counters,
            count,
            work.tuning,
            s,
        )
    };
    cuda::check(code, "hostembed_moe_mmv_sum")
}

/// x[r] += the sum of weights[r * k + slot] * out[r * k + slot] over each row's `k` slots, in order.
pub(in crate::gpu) fn moe_sum(
    out: *const f32,
    weights: *const f32,
    rows: usize,
    n: usize,
    k: usize,
    x: *mut f32,
    s: cudaStream_t,
) -> Result<()> {
    let (rows, n, k) = (rows as c_uint, n as c_uint, k as c_uint);
    // SAFETY: device pointers to n x k x rows outputs, n x k weights and n x rows of x (see `launch`'s note).
    let code = unsafe { kn::hostembed_moe_sum(out, weights, rows, n, k, x, s) };
    cuda::check(code, "hostembed_moe_sum")
}

/// `len` values of the half format `dtype` widened to f32.
pub(in crate::gpu) fn widen(x: *const c_void, dtype: DType, out: *mut f32, len: usize, s: cudaStream_t) -> Result<()> {
    // SAFETY: device pointers to `len` values each (see `launch`'s note).
    cuda::check(unsafe { kn::hostembed_widen(x, dtype as c_int, out, len, s) }, "hostembed_widen")
}

/// out[s * ldy + r] = w_e[r] . a[s / per] for each of the `slots` slots s of `groups` and its expert e
/// (`w`'s e-th matrix, its values rounded to the half format `half`), on tensor cores in f32; with `gate`
/// (not null), out is in `half` and holds silu(gate[s * ldy + r]) times the product instead. Rows of `a`
/// are `lda` apart, in `half`.
#[allow(clippy::too_many_arguments)]
pub(in crate::gpu) fn moe_grouped(
    a: *const c_void,
    lda: usize,
    per: usize,
    half: DType,
    w: &ExpertStack,
    groups: *const c_int,
    experts: usize,
    slots: usize,
    gate: *const f32,
    out: *mut c_void,
    ldy: usize,
    s: cudaStream_t,
) -> Result<()> {
    let (rows, cols) = (w.rows as c_uint, w.cols as c_uint);
    // SAFETY: device pointers into live allocations sized for these shapes; `w` is a stack of `experts`
    // matrices back to back (`ExpertStack::of`), every expert in `groups` below that count and every slot
    // below `slots` (the route kernel writes them) (see `launch`'s note).
    let code = unsafe {
        kn::hostembed_moe_grouped(
            a,
            lda as c_uint,
            per as c_uint,
            half as c_int,
            w.ptr,
            w.dtype as c_int,
            rows,
            cols,
            groups,
            experts as c_uint,
            slots as c_uint,
            gate,
            out,
            ldy as c_uint,
            s,
        )
    };
    cuda::check(code, "hostembed_moe_grouped")
}
