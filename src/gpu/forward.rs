//! The forward pass: a prompt chunk through every layer, queued on the model's stream. Chunks of
//! `TENSOR_CORE_MIN_TOKENS` or more take the prompt path (half-format activations into tensor-core
//! products, flash attention); shorter ones, and every decode step, the matrix-vector path.

use std::os::raw::{c_int, c_void};
use std::ptr;

use super::launch::{self, AttentionShape, HalfMatrix};
use super::scratch::attention_splits;
use super::weights::{DeviceWeight, Qkv};
use super::{GpuModel, GpuStream};
use crate::status::Result;

/// Chunks of at least this many tokens take the tensor-core path: below it the matrix-vector kernel,
/// which reads each weight once per 8 tokens, is as fast.
pub const TENSOR_CORE_MIN_TOKENS: usize = 16;

/// Which logits a forward pass leaves.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Head {
    /// None: a prompt chunk before the last.
    Skip,
    /// The last token's, in the logits buffer.
    Last,
    /// Final-normed hidden states of every token in xn; the caller runs the head per token.
    All,
}

impl GpuModel {
    /// Runs one chunk of at most max_batch tokens at the stream's next positions.
    pub(super) fn run_chunk(&mut self, stream: &mut GpuStream, chunk: &[u32], head: Head) -> Result<()> {
        let n = chunk.len();
        let ids: Vec<i32> = chunk.iter().map(|&t| t as i32).collect();
        let pos: Vec<i32> = (stream.len..stream.len + n).map(|p| p as i32).collect();
        self.upload(self.s.ids, &ids)?;
        self.upload(self.s.pos, &pos)?;
        let replayed = n == 1 && head == Head::Last && self.replay_step(stream)?;
        if !replayed {
            self.enqueue_forward(stream, n, head)?;
        }
        stream.len += n;
        Ok(())
    }

    /// The output head over one final-normed hidden state into the logits buffer.
    pub(super) fn head_matvec(&self, x: *const f32) -> Result<()> {
        let logits = self.buf(self.s.logits) as *mut f32;
        launch::matvec(&self.head, x, 1, ptr::null(), ptr::null(), logits, self.head.rows, self.stream.raw())
    }

    /// y[t] = w a[t] (+ bias) (+ residual[t]) for `n` half-format rows of `a` (`w.cols` apart): on
    /// cuBLASLt where it is loaded and takes the shape, else on the library's kernel; a weight in another
    /// format is converted into the slab first.
    #[allow(clippy::too_many_arguments)]
    fn product(
        &self,
        w: &DeviceWeight,
        a: *const c_void,
        n: usize,
        bias: *const f32,
        residual: *const f32,
        y: *mut f32,
        ldy: usize,
    ) -> Result<()> {
        let s = self.stream.raw();
        let mut m = HalfMatrix { ptr: w.ptr, dtype: self.half, rows: w.rows, cols: w.cols };
        if w.dtype != self.half {
            let slab = self.buf(self.s.slab);
            launch::convert_matrix(w, slab, self.half, s)?;
            m.ptr = slab;
        }
        let on_blas = match &self.blas {
            Some(b) => b.matmul(a, w.cols, &m, n, residual, y, ldy, self.buf(self.s.workspace), s)?,
            None => false,
        };
        if !on_blas {
            return launch::gemm(a, w.cols, &m, n, bias, residual, y, ldy, s);
        }
        if !bias.is_null() {
            launch::add_bias(y, ldy, bias, m.rows, n, s)?;
        }
        Ok(())
    }

    /// Whether a chunk of `n` tokens takes the tensor-core path.
    pub(super) fn on_tensor_cores(&self, n: usize) -> bool {
        self.tensor_cores && n >= TENSOR_CORE_MIN_TOKENS
    }

    /// Queues the forward pass of `n` tokens whose ids and positions are already in scratch.
    pub(super) fn enqueue_forward(&self, stream: &GpuStream, n: usize, head: Head) -> Result<()> {
        let cfg = &self.cfg;
        let s = self.stream.raw();
        let (hidden, q_dim, kv_dim, inter, hd) =
            (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate, cfg.head_dim);
        let qkv_dim = q_dim + 2 * kv_dim;
        let f = |off: usize| self.buf(off) as *mut f32;
        let (x, xn, qkv, attn, gate, up) =
            (f(self.s.x), f(self.s.xn), f(self.s.qkv), f(self.s.attn), f(self.s.gate), f(self.s.up));
        let act = self.buf(self.s.act);
        let ids = self.buf(self.s.ids) as *const c_int;
        let pos = self.buf(self.s.pos) as *const c_int;
        let inv_freq = self.buf(self.s.inv_freq) as *const f32;
        // Device addresses are only formed here, never read on the host: wrapping arithmetic is enough.
        let layer_kv = cfg.kv_heads * stream.window * hd * 2;
        let kv_base = stream.cache.kv.ptr() as *mut u8;
        let shape = AttentionShape {
            n,
            heads: cfg.heads,
            kv_heads: cfg.kv_heads,
            head_dim: hd,
            window: stream.window,
            qkv_stride: qkv_dim,
        };
        let splits = attention_splits(cfg, n);
        let scale = 1.0 / (hd as f32).sqrt();
        let none = ptr::null::<f32>();
        let rmsnorm = |x: *const f32, w: *const f32, out: *mut f32, rows: usize| {
            launch::rmsnorm(x, w, cfg.rms_eps, out, rows, hidden, s)
        };
        let tensor_cores = self.on_tensor_cores(n);
        let half = self.half;
        // The normed input of a projection: f32 for the matrix-vector path, the half format for products.
        let norm_in = |w: &DeviceWeight| -> Result<*const c_void> {
            if tensor_cores {
                launch::rmsnorm_to(x, w.f32_ptr(), cfg.rms_eps, act, half, n, hidden, s)?;
                Ok(act as *const c_void)
            } else {
                rmsnorm(x, w.f32_ptr(), xn, n)?;
                Ok(xn as *const c_void)
            }
        };
        // y = w input (+ bias) (+ residual) on whichever path this chunk takes.
        let project =
            |w: &DeviceWeight, input: *const c_void, bias: *const f32, residual: *const f32, y: *mut f32, ldy| {
                if tensor_cores {
                    self.product(w, input, n, bias, residual, y, ldy)
                } else {
                    launch::matvec(w, input as *const f32, n, bias, residual, y, ldy, s)
                }
            };

        launch::embed_gather(&self.rows, ids, n, x, s)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let k_cache = kv_base.wrapping_add(2 * l * layer_kv) as *mut c_void;
            let v_cache = kv_base.wrapping_add((2 * l + 1) * layer_kv) as *mut c_void;

            let input = norm_in(&layer.w.attn_norm)?;
            let qkv_bias = layer.qkv_bias();
            match &layer.qkv {
                Qkv::Fused(m) => project(m, input, qkv_bias, none, qkv, qkv_dim)?,
                Qkv::Split(parts) => {
                    // The biases lie back to back like q, k and v in a row of the qkv buffer.
                    let bias = |at: usize| if qkv_bias.is_null() { none } else { qkv_bias.wrapping_add(at) };
                    for (m, at) in parts.iter().zip([0, q_dim, q_dim + kv_dim]) {
                        project(m, input, bias(at), none, qkv.wrapping_add(at), qkv_dim)?;
                    }
                }
            }
            let (q_norm, k_norm) = (layer.w.q_norm.as_ref(), layer.w.k_norm.as_ref());
            launch::rope_kv(
                qkv,
                shape,
                pos,
                inv_freq,
                cfg.rope_interleaved,
                q_norm,
                k_norm,
                cfg.rms_eps,
                k_cache,
                v_cache,
                s,
            )?;
            let attended = if tensor_cores && self.flash {
                launch::flash_attention(qkv, shape, k_cache, v_cache, pos, scale, act, half, q_dim, s)?;
                act as *const c_void
            } else {
                launch::attention(qkv, shape, k_cache, v_cache, pos, scale, splits, f(self.s.partial), attn, s)?;
                if tensor_cores {
                    launch::convert(attn, act, half, n * q_dim, s)?;
                    act as *const c_void
                } else {
                    attn as *const c_void
                }
            };
            project(&layer.w.o, attended, none, x, x, hidden)?;

            let input = norm_in(&layer.w.ffn_norm)?;
            if tensor_cores {
                project(&layer.w.gate, input, none, none, gate, inter)?;
                project(&layer.w.up, input, none, none, up, inter)?;
                // The normed input is read by now: the SwiGLU output takes its place.
                launch::swiglu_to(gate, up, act, half, n * inter, s)?;
                project(&layer.w.down, act, none, x, x, hidden)?;
            } else {
                if layer.w.gate.dtype == layer.w.up.dtype {
                    launch::matvec_swiglu(&layer.w.gate, &layer.w.up, xn, n, gate, s)?;
                } else {
                    launch::matvec(&layer.w.gate, xn, n, none, none, gate, inter, s)?;
                    launch::matvec(&layer.w.up, xn, n, none, none, up, inter, s)?;
                    launch::swiglu(gate, up, gate, n * inter, s)?;
                }
                launch::matvec(&layer.w.down, gate, n, none, x, x, hidden, s)?;
            }
        }
        match head {
            Head::Skip => Ok(()),
            Head::Last => {
                rmsnorm(x.wrapping_add((n - 1) * hidden), self.final_norm, xn, 1)?;
                self.head_matvec(xn)
            }
            Head::All => rmsnorm(x, self.final_norm, xn, n),
        }
    }
}
