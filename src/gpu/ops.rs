//! The CUDA backend's operations (`arch::Ops`): each queues on the model's stream the launches of one
//! operation over a pass's rows, as `forward.rs` lays them out: rows [0, m) on the matrix-vector kernels
//! in f32, rows [m, n) on tensor-core products in groups (the single tokens together, each long chunk
//! on its own) from the half activations in `act`. Nothing here waits or reads the device, so a pass
//! of single tokens captures into a graph.

use std::os::raw::{c_int, c_uint, c_void};
use std::ptr;

use super::GpuModel;
use super::forward::{PassShape, Path, Piece};
use super::launch::{self, AttentionShape, HalfMatrix, KvPages};
use super::scratch::ATTENTION_TOKENS;
use super::weights::{DeviceWeight, Qkv};
use crate::arch::{Feeds, Ops, Rotary};
use crate::cudart::cudaStream_t;
use crate::model::Activation;
use crate::status::Result;
use crate::tensor::DType;

/// A product's refinement (`product`): its outputs from row `from` of the weight on again from the
/// half input's rounding residue at `residue` (rows `w.cols` apart).
#[derive(Clone, Copy)]
pub(super) struct Refine {
    pub from: usize,
    pub residue: *const c_void,
}

/// One pass's rows, their layout, and the scratch addresses its launches take.
pub(super) struct PassOps<'a> {
    model: &'a GpuModel,
    pieces: &'a [Piece],
    m: usize,
    n: usize,
    split_end: usize,
    grid_parts: usize,
    /// The tensor-core products' row groups (first row, rows): the single tokens together, each chunk
    /// on its own.
    groups: Vec<(usize, usize)>,
    /// Whether the first group is the single tokens (which are not refined: their option is for speed).
    singles_group: bool,
    x: *mut f32,
    xn: *mut f32,
    qkv: *mut f32,
    attn: *mut f32,
    gate: *mut f32,
    up: *mut f32,
    partial: *mut f32,
    act: *mut c_void,
    /// The half rows' rounding residue, for refined products.
    residue: *mut c_void,
    pos: *const c_int,
    tables: *const *const c_uint,
    /// Each row's page table of the local layers' pool (null rows without one).
    local_tables: *const *const c_uint,
    inv_freq: *const f32,
    /// The local layers' frequencies (null for a model without them).
    inv_freq_local: *const f32,
    tensor: Option<launch::MmvWork>,
    half: DType,
    s: cudaStream_t,
}

// Device addresses are only formed here, never read on the host: wrapping arithmetic is enough.
fn row(p: *mut f32, r: usize, width: usize) -> *mut f32 {
    p.wrapping_add(r * width)
}

/// Whether a stack of experts takes the grouped products (kernels/moe_gemm.cu): columns in whole 16-byte
/// pieces of halves, and the stack at a 16-byte boundary (the placement's).
fn grouped(st: &launch::ExpertStack) -> bool {
    st.cols.is_multiple_of(8) && (st.ptr as usize).is_multiple_of(16)
}

impl<'a> PassOps<'a> {
    /// The operations over `pieces`, laid out as `shape`, whose rows' ids, positions and page tables are
    /// already in scratch.
    pub(super) fn new(model: &'a GpuModel, pieces: &'a [Piece], shape: PassShape) -> PassOps<'a> {
        let PassShape { n, m, split_end, grid_parts } = shape;
        let mut groups: Vec<(usize, usize)> = Vec::new();
        let singles_group = pieces.iter().any(|p| p.path == Path::TensorSingle);
        let singles: Vec<&Piece> = pieces.iter().filter(|p| p.path == Path::TensorSingle).collect();
        if let (Some(first), Some(last)) = (singles.first(), singles.last()) {
            groups.push((first.row, last.row + 1 - first.row));
        }
        groups.extend(pieces.iter().filter(|p| p.path == Path::Tensor).map(|p| (p.row, p.len)));
        let f = |off: usize| model.buf(off) as *mut f32;
        PassOps {
            model,
            pieces,
            m,
            n,
            split_end,
            grid_parts,
            groups,
            singles_group,
            x: f(model.s.x),
            xn: f(model.s.xn),
            qkv: f(model.s.qkv),
            attn: f(model.s.attn),
            gate: f(model.s.gate),
            up: f(model.s.up),
            partial: f(model.s.partial),
            act: model.buf(model.s.act),
            residue: model.buf(model.s.act_residue),
            pos: model.buf(model.s.pos) as *const c_int,
            tables: model.buf(model.s.tables) as *const *const c_uint,
            local_tables: model.buf(model.s.local_tables) as *const *const c_uint,
            inv_freq: model.buf(model.s.inv_freq) as *const f32,
            inv_freq_local: model.s.inv_freq_local.map_or(ptr::null(), |at| model.buf(at) as *const f32),
            tensor: model.mmv_work(),
            half: model.half,
            s: model.stream.raw(),
        }
    }

    /// Rows of the tensor-core activations, from row `r` (counted from the pass's first row) of `width`.
    fn act_row(&self, r: usize, width: usize) -> *mut c_void {
        (self.act as *mut u8).wrapping_add((r - self.m) * width * 2) as *mut c_void
    }

    fn shape_of(&self, rows: usize) -> AttentionShape {
        let cfg = &self.model.cfg;
        AttentionShape {
            n: rows,
            heads: cfg.heads,
            kv_heads: cfg.kv_heads,
            head_dim: cfg.head_dim,
            qkv_stride: cfg.q_dim() + 2 * cfg.kv_dim(),
            window: 0,
        }
    }

    /// Layer `layer`'s part of the KV pool.
    fn kv(&self, layer: usize) -> KvPages {
        let (pool, pages, _) = self.model.layer_region(layer);
        KvPages { pool: pool as *mut c_void, pages, kv: self.model.kv }
    }

    /// The rows' page tables `layer` reads: the local layers' pool's where the layer is in it.
    fn tables(&self, layer: usize) -> *const *const c_uint {
        if self.model.layer_region(layer).2 { self.local_tables } else { self.tables }
    }

    /// y = w input (+ bias) (+ residual) for every row: rows [0, m) from the f32 `input`, rows [m, n)
    /// from the half activations in act; y and residual rows are `ldy` apart. `refine_from`: the half
    /// rows' outputs from that row of w on again from the residue (as the f32 rows' are).
    #[allow(clippy::too_many_arguments)]
    fn project(
        &self,
        w: &DeviceWeight,
        input: *const f32,
        bias: *const f32,
        residual: *const f32,
        y: *mut f32,
        ldy: usize,
        refine_from: Option<usize>,
    ) -> Result<()> {
        if self.m > 0 {
            launch::decode_product(w, input, self.m, bias, residual, y, ldy, self.tensor, self.s)?;
        }
        for (g, &(r0, rows)) in self.groups.iter().enumerate() {
            let residual = if residual.is_null() { residual } else { residual.wrapping_add(r0 * ldy) };
            let refine = refine_from.filter(|_| !(self.singles_group && g == 0)).map(|from| Refine {
                from,
                residue: (self.residue as *const u8).wrapping_add((r0 - self.m) * w.cols * 2).cast::<c_void>(),
            });
            let (a, y) = (self.act_row(r0, w.cols), y.wrapping_add(r0 * ldy));
            self.model.product(w, a, rows, bias, residual, y, ldy, refine)?;
        }
        Ok(())
    }
}

impl Ops for PassOps<'_> {
    type Weight = DeviceWeight;

    fn embed(&mut self) -> Result<()> {
        let ids = self.model.buf(self.model.s.ids) as *const c_int;
        launch::embed_gather(&self.model.rows, ids, self.n, self.x, self.s)
    }

    fn scale(&mut self, factor: f32) -> Result<()> {
        launch::scale(self.x, factor, self.n * self.model.cfg.hidden, self.s)
    }

    /// The normed input: f32 rows [0, m) into xn, half rows [m, n) into act, and for the q/k/v product
    /// their rounding residue into act_residue: K and V from the normed input to f32 accuracy, because
    /// the cache keeps them, and a bf16 input's rounding, rounded again into the cache, was most of the
    /// prompt logits' distance from the CPU's (tests/prompt_roundings.rs); q's rounding costs far less.
    fn norm(&mut self, w: &DeviceWeight, feeds: Feeds) -> Result<()> {
        let (cfg, m, tc) = (&self.model.cfg, self.m, self.n - self.m);
        if m > 0 {
            let tuning = self.model.kernel_tuning;
            launch::rmsnorm(self.x, w.f32_ptr(), cfg.rms_eps, self.xn, m, cfg.hidden, tuning, self.s)?;
        }
        if tc > 0 {
            let res = if feeds == Feeds::Cache { self.residue } else { ptr::null_mut() };
            let x = row(self.x, m, cfg.hidden);
            let (act, half, tuning) = (self.act, self.half, self.model.kernel_tuning);
            launch::rmsnorm_to(x, w.f32_ptr(), cfg.rms_eps, act, res, half, tc, cfg.hidden, tuning, self.s)?;
        }
        Ok(())
    }

    /// One product where q, k and v share a format (the loader laid them out as one matrix, and their
    /// biases back to back), two where q and k do, else three; k and v refined on the tensor-core rows.
    fn qkv(
        &mut self,
        q: &DeviceWeight,
        k: &DeviceWeight,
        v: &DeviceWeight,
        bias: Option<[&DeviceWeight; 3]>,
    ) -> Result<()> {
        let cfg = &self.model.cfg;
        let (q_dim, kv_dim) = (cfg.q_dim(), cfg.kv_dim());
        let qkv_dim = q_dim + 2 * kv_dim;
        let none = ptr::null::<f32>();
        let qkv_bias = bias.map_or(none, |[q, _, _]| q.f32_ptr());
        // The biases lie back to back like q, k and v in a row of the qkv buffer.
        let bias = |at: usize| if qkv_bias.is_null() { none } else { qkv_bias.wrapping_add(at) };
        match Qkv::of(q, k, v) {
            Qkv::Fused(w) => self.project(&w, self.xn, qkv_bias, none, self.qkv, qkv_dim, Some(q_dim)),
            Qkv::QkThenV([qk, v]) => {
                self.project(&qk, self.xn, qkv_bias, none, self.qkv, qkv_dim, Some(q_dim))?;
                let at = q_dim + kv_dim;
                self.project(&v, self.xn, bias(at), none, self.qkv.wrapping_add(at), qkv_dim, Some(0))
            }
            Qkv::Split(parts) => {
                for (k, (w, at)) in parts.iter().zip([0, q_dim, q_dim + kv_dim]).enumerate() {
                    self.project(w, self.xn, bias(at), none, self.qkv.wrapping_add(at), qkv_dim, (k > 0).then_some(0))?;
                }
                Ok(())
            }
        }
    }

    /// One launch: the per-head norms, the rotation and the KV append of every row of the pass.
    fn rope_append(&mut self, layer: usize, head_norms: Option<[&DeviceWeight; 2]>, rotary: Rotary) -> Result<()> {
        let cfg = &self.model.cfg;
        let inv_freq = match rotary {
            Rotary::Global => self.inv_freq,
            Rotary::Local => self.inv_freq_local,
        };
        if inv_freq.is_null() {
            crate::bail!(InvalidArgument, "{rotary:?} rotary frequencies of a model without them");
        }
        let (q_norm, k_norm) = match head_norms {
            Some([q, k]) => (Some(q), Some(k)),
            None => (None, None),
        };
        let (shape, kv) = (self.shape_of(self.n), self.kv(layer));
        let (qkv, pos, interleaved) = (self.qkv, self.pos, cfg.rope_interleaved);
        let (tables, tuning) = (self.tables(layer), self.model.kernel_tuning);
        launch::rope_kv(qkv, shape, pos, inv_freq, interleaved, q_norm, k_norm, cfg.rms_eps, kv, tables, tuning, self.s)
    }

    /// Rows [0, split_end) on the split kernel into attn (f32), in launches of ATTENTION_TOKENS; the
    /// tensor-core rows among them are converted into act; the other tensor rows' pieces on flash
    /// attention, each over its own stream, straight into act.
    fn attention(&mut self, layer: usize, window: Option<usize>) -> Result<()> {
        let (model, cfg, s) = (self.model, &self.model.cfg, self.s);
        let q_dim = cfg.q_dim();
        let qkv_dim = q_dim + 2 * cfg.kv_dim();
        let (kv, tables) = (self.kv(layer), self.tables(layer));
        let local = model.layer_region(layer).2;
        let scale = cfg.score_scale_f32();
        let shape_of = |rows: usize| AttentionShape { window: window.unwrap_or(0), ..self.shape_of(rows) };
        let (split_end, m) = (self.split_end, self.m);
        // A grid of one block a token (every context one part): the split kernel writes each head's output
        // itself. Contexts of more parts keep the combine kernel, whose heads run in parallel (combined in
        // the split kernel's last block, 64 streams of 512 positions and one stream of 16,384 were 4-6%
        // slower on the H100).
        let combine_here = model.tail_counters().filter(|_| self.grid_parts == 1).and_then(|t| t.attention);
        for g0 in (0..split_end).step_by(ATTENTION_TOKENS) {
            let g = (split_end - g0).min(ATTENTION_TOKENS);
            launch::attention(
                row(self.qkv, g0, qkv_dim),
                shape_of(g),
                kv,
                tables.wrapping_add(g0),
                self.pos.wrapping_add(g0),
                scale,
                model.attention_parts,
                self.grid_parts,
                self.partial,
                row(self.attn, g0, q_dim),
                combine_here,
                model.kernel_tuning,
                s,
            )?;
        }
        if split_end > m {
            launch::convert(row(self.attn, m, q_dim), self.act, self.half, (split_end - m) * q_dim, s)?;
        }
        if model.flash {
            for p in self.pieces.iter().filter(|p| p.path == Path::Tensor) {
                let (q, at, out) =
                    (row(self.qkv, p.row, qkv_dim), self.pos.wrapping_add(p.row), self.act_row(p.row, q_dim));
                // An 8-bit cache: the stream's positions so far, this piece's included, decoded once.
                let stage = (model.s.stage_tokens > 0).then(|| launch::FlashStage {
                    ptr: model.buf(model.s.stage),
                    tokens: model.s.stage_tokens,
                    ctx: p.pos + p.len,
                });
                let table = if local { p.local_table } else { p.table };
                if let Some(st) = stage {
                    launch::flash_stage(kv, table, cfg.kv_heads, cfg.head_dim, st, s)?;
                }
                let ctx = p.pos + p.len;
                let room = if model.flash_parts { model.s.partial_floats } else { 0 };
                let partial = launch::FlashPartial { ptr: self.partial, floats: room };
                launch::flash_attention(
                    q,
                    shape_of(p.len),
                    kv,
                    table,
                    at,
                    scale,
                    out,
                    self.half,
                    q_dim,
                    stage,
                    ctx,
                    partial,
                    s,
                )?;
            }
        }
        Ok(())
    }

    /// With a post-norm or tensor parallelism: the product into xn (the normed input, read by now), then
    /// x += it (`add_reduced`).
    fn add_attention_out(&mut self, o: &DeviceWeight, post_norm: Option<&DeviceWeight>) -> Result<()> {
        let hidden = self.model.cfg.hidden;
        if post_norm.is_none() && self.model.world() == 1 {
            return self.project(o, self.attn, ptr::null(), self.x, self.x, hidden, None);
        }
        self.project(o, self.attn, ptr::null(), ptr::null(), self.xn, hidden, None)?;
        self.add_reduced(post_norm)
    }

    /// The matrix-vector rows with gate and up in one launch where SwiGLU's share a format; then the
    /// tensor-core groups' gate and up products, one activation into act over all their rows, and their
    /// down products. With a post-norm the down products go to xn, and x += their norm.
    fn add_gated_ffn(
        &mut self,
        act: Activation,
        gate: &DeviceWeight,
        up: &DeviceWeight,
        down: &DeviceWeight,
        post_norm: Option<&DeviceWeight>,
    ) -> Result<()> {
        let (cfg, s, tensor) = (&self.model.cfg, self.s, self.tensor);
        let (hidden, inter) = (cfg.hidden, cfg.intermediate);
        let (m, tc, x, xn) = (self.m, self.n - self.m, self.x, self.xn);
        let none = ptr::null::<f32>();
        // Where the down products go: onto the residual, or into xn for the post-norm or the ranks' sum.
        let apart = post_norm.is_some() || self.model.world() > 1;
        let (residual, y) = if apart { (none, xn) } else { (x as *const f32, x) };
        if m > 0 {
            if act == Activation::Silu && gate.dtype == up.dtype {
                launch::decode_swiglu(gate, up, xn, m, self.gate, tensor, s)?;
            } else {
                launch::decode_product(gate, xn, m, none, none, self.gate, inter, tensor, s)?;
                launch::decode_product(up, xn, m, none, none, self.up, inter, tensor, s)?;
                launch::glu_to(act, self.gate, self.up, self.gate.cast(), DType::F32, m * inter, s)?;
            }
            launch::decode_product(down, self.gate, m, none, residual, y, hidden, tensor, s)?;
        }
        if tc > 0 {
            for &(r0, rows) in &self.groups {
                let a = self.act_row(r0, hidden);
                self.model.product(gate, a, rows, none, none, row(self.gate, r0, inter), inter, None)?;
                self.model.product(up, a, rows, none, none, row(self.up, r0, inter), inter, None)?;
            }
            // The normed input is read by now: the activation's output takes its place.
            let (g, u) = (row(self.gate, m, inter), row(self.up, m, inter));
            launch::glu_to(act, g, u, self.act, self.half, tc * inter, s)?;
            for &(r0, rows) in &self.groups {
                let res = if residual.is_null() { none } else { row(x, r0, hidden) };
                let yr = row(y, r0, hidden);
                self.model.product(down, self.act_row(r0, inter), rows, none, res, yr, hidden, None)?;
            }
        }
        if apart { self.add_reduced(post_norm) } else { Ok(()) }
    }

    /// The router over every row (the tensor-core rows' half normed inputs widened into their f32 rows
    /// first), then each row range routed and grouped by expert apart: rows [0, m) through kernels/moe.cu
    /// (each chosen expert's SwiGLU and down product, a warp a matrix row, in f32), rows [m, n) through the
    /// grouped tensor-core products of kernels/moe_gemm.cu from their half normed inputs where the shapes
    /// allow (else kernels/moe.cu's as well); each range's weighted sums onto x, all on the device. A piece
    /// takes its range's path alone or in a batch, so its bits do not depend on the batch.
    fn add_moe_ffn(
        &mut self,
        router: &DeviceWeight,
        gate: &[DeviceWeight],
        up: &[DeviceWeight],
        down: &[DeviceWeight],
    ) -> Result<()> {
        let (model, s, n, m) = (self.model, self.s, self.n, self.m);
        let (cfg, sl) = (&model.cfg, &model.s);
        let moe = cfg.moe.expect("a model with a router has a Mixture-of-Experts config");
        let (hidden, experts, k, width) = (cfg.hidden, moe.experts, moe.used, moe.intermediate);
        if n > m {
            launch::widen(self.act, self.half, row(self.xn, m, hidden), (n - m) * hidden, s)?;
        }
        let logits = model.buf(sl.moe_logits) as *mut f32;
        let ids = model.buf(sl.moe_ids) as *mut c_int;
        let weights = model.buf(sl.moe_weights) as *mut f32;
        let groups = model.buf(sl.moe_groups) as *mut c_int;
        let act = model.buf(sl.moe_act) as *mut f32;
        let out = model.buf(sl.moe_out) as *mut f32;
        let stack = |w: &[DeviceWeight], what: &str| launch::ExpertStack::of(w, what);
        let (gate, up, down) = (stack(gate, "expert gate")?, stack(up, "expert up")?, stack(down, "expert down")?);
        // Split over ranks, each row's sum of its experts' slices goes to its xn row (zeroed once read),
        // summed over the ranks before the residual takes it.
        let split = model.world() > 1;
        let sums = if split { self.xn } else { self.x };
        let work = model.mmv_work().filter(|_| model.moe_mmv);
        let on_mmv = work.filter(|_| [&gate, &up, &down].iter().all(|st| launch::moe_mmv_supports(st)));
        let tails = model.tail_counters().filter(|_| on_mmv.is_some());
        // Decode rows that are one piece are routed by the router's launch.
        let routed = (tails.and_then(|t| t.router))
            .filter(|_| m > 0 && m <= launch::MOE_MMV_ROWS && experts <= launch::ROUTE_TAIL_EXPERTS);
        match routed {
            Some(counter) => {
                let norm = moe.norm_topk;
                launch::moe_router_route(router, self.xn, n, logits, m, k, norm, ids, weights, groups, counter, s)?
            }
            None => launch::moe_router(router, self.xn, n, logits, s)?,
        }
        if let Some(work) = on_mmv {
            // Pieces of at most MOE_MMV_ROWS rows (the workspace's), each routed and summed apart: a
            // row's experts, products and sum are its own in any piece.
            for r0 in (0..m).step_by(launch::MOE_MMV_ROWS) {
                let rows = (m - r0).min(launch::MOE_MMV_ROWS);
                let (ids, weights) = (ids.wrapping_add(r0 * k), row(weights, r0, k));
                let (act, out) = (row(act, r0 * k, width), row(out, r0 * k, hidden));
                if routed.is_none() {
                    let logits = row(logits, r0, experts);
                    launch::moe_route(logits, experts, rows, k, moe.norm_topk, ids, weights, groups, s)?;
                }
                launch::moe_mmv(
                    &gate,
                    Some(&up),
                    row(self.xn, r0, hidden),
                    k,
                    groups,
                    experts,
                    rows,
                    k,
                    act,
                    &work,
                    s,
                )?;
                if split {
                    // After the gate and up products read it, before the sums add to it.
                    launch::zero(row(self.xn, r0, hidden), rows * hidden, s)?;
                }
                match tails.and_then(|t| t.sums.map(|counters| (counters, t.sums_count))) {
                    Some((counters, count)) => {
                        let into = launch::SumInto { weights, sums: row(sums, r0, hidden), counters, count };
                        launch::moe_mmv_sum(&down, act, groups, experts, rows, k, out, &work, &into, s)?;
                    }
                    None => {
                        launch::moe_mmv(&down, None, act, 1, groups, experts, rows, k, out, &work, s)?;
                        launch::moe_sum(out, weights, hidden, rows, k, row(sums, r0, hidden), s)?;
                    }
                }
            }
        } else if m > 0 {
            launch::moe_route(logits, experts, m, k, moe.norm_topk, ids, weights, groups, s)?;
            launch::moe_gate_up(&gate, &up, self.xn, groups, experts, m, k, act, s)?;
            launch::moe_down(&down, act, groups, experts, m, k, out, s)?;
            if split {
                launch::zero(self.xn, m * hidden, s)?;
            }
            launch::moe_sum(out, weights, hidden, m, k, sums, s)?;
        }
        let tc = n - m;
        if tc == 0 {
            return if split { self.add_reduced(None) } else { Ok(()) };
        }
        // Rows [m, n)'s buffers from their first slot's place; their groups after rows [0, m)'s.
        let (logits, ids, weights) = (row(logits, m, experts), ids.wrapping_add(m * k), row(weights, m, k));
        let (act, out) = (row(act, m * k, width), row(out, m * k, hidden));
        let groups = groups.wrapping_add(launch::groups_len(experts, m * k));
        launch::moe_route(logits, experts, tc, k, moe.norm_topk, ids, weights, groups, s)?;
        if model.moe_grouped && [&gate, &up, &down].iter().all(|st| grouped(st)) {
            let (slots, none, half, half_act) = (tc * k, ptr::null::<f32>(), self.half, model.buf(sl.moe_half));
            launch::moe_grouped(self.act, hidden, k, half, &gate, groups, experts, slots, none, act.cast(), width, s)?;
            // The up product's outputs are SwiGLU's with the gate's, in the half format the down product reads.
            launch::moe_grouped(self.act, hidden, k, half, &up, groups, experts, slots, act, half_act, width, s)?;
            launch::moe_grouped(half_act, width, 1, half, &down, groups, experts, slots, none, out.cast(), hidden, s)?;
        } else {
            let xn = row(self.xn, m, hidden);
            launch::moe_gate_up(&gate, &up, xn, groups, experts, tc, k, act, s)?;
            launch::moe_down(&down, act, groups, experts, tc, k, out, s)?;
        }
        if split {
            launch::zero(row(self.xn, m, hidden), tc * hidden, s)?;
        }
        launch::moe_sum(out, weights, hidden, tc, k, row(sums, m, hidden), s)?;
        if split { self.add_reduced(None) } else { Ok(()) }
    }
}

impl PassOps<'_> {
    /// x += xn (through the post-norm `w` where given) over every row of the pass, xn first summed over
    /// the ranks of a tensor-parallel model (the norm needs the whole sum, and the residual is added once).
    fn add_reduced(&self, post_norm: Option<&DeviceWeight>) -> Result<()> {
        let (cfg, len) = (&self.model.cfg, self.n * self.model.cfg.hidden);
        self.model.reduce(self.xn, len)?;
        match post_norm {
            Some(w) => launch::rmsnorm_add(self.xn, w.f32_ptr(), cfg.rms_eps, self.x, self.n, cfg.hidden, self.s),
            None => launch::add(self.x, self.xn, len, self.s),
        }
    }
}

impl GpuModel {
    /// y[t] = w a[t] (+ bias) (+ residual[t]) for `n` half-format rows of `a` (`w.cols` apart): on
    /// cuBLASLt where it is loaded and takes the shape, else on the library's kernel; a weight in another
    /// format is converted into the slab first. With `refine`, rows [from, w.rows) of y then add the
    /// product of the input's residue, so those outputs are the f32 input's to ~2^-16.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn product(
        &self,
        w: &DeviceWeight,
        a: *const c_void,
        n: usize,
        bias: *const f32,
        residual: *const f32,
        y: *mut f32,
        ldy: usize,
        refine: Option<Refine>,
    ) -> Result<()> {
        let s = self.stream.raw();
        let mut m = HalfMatrix { ptr: w.ptr, dtype: self.half, rows: w.rows, cols: w.cols };
        if w.dtype != self.half {
            let slab = self.buf(self.s.slab);
            launch::convert_matrix(w, slab, self.half, s)?;
            m.ptr = slab;
        }
        self.matmul(a, &m, n, bias, residual, y, ldy)?;
        let Some(r) = refine else { return Ok(()) };
        let rows = HalfMatrix {
            ptr: (m.ptr as *const u8).wrapping_add(r.from * m.cols * 2) as *const c_void,
            dtype: m.dtype,
            rows: m.rows - r.from,
            cols: m.cols,
        };
        let ys = y.wrapping_add(r.from);
        self.matmul(r.residue, &rows, n, ptr::null(), ys, ys, ldy)
    }

    /// y[t] = m a[t] (+ bias) (+ residual[t]) for a matrix already in the half format.
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &self,
        a: *const c_void,
        m: &HalfMatrix,
        n: usize,
        bias: *const f32,
        residual: *const f32,
        y: *mut f32,
        ldy: usize,
    ) -> Result<()> {
        let s = self.stream.raw();
        let on_blas = match &self.blas {
            Some(b) => b.matmul(a, m.cols, m, n, residual, y, ldy, self.buf(self.s.workspace), s)?,
            None => false,
        };
        if !on_blas {
            return launch::gemm(a, m.cols, m, n, bias, residual, y, ldy, s);
        }
        if !bias.is_null() {
            launch::add_bias(y, ldy, bias, m.rows, n, s)?;
        }
        Ok(())
    }
}
