//! Teacher forcing: the logits or log-probabilities after every token of one stream's tokens, each chunk
//! of `max_batch` one forward pass with its final-normed rows kept and the head run over them.

use std::os::raw::{c_int, c_void};

use super::forward::{Head, LogitsAt, Path, Piece, reserve_pages};
use super::launch;
use super::tensor_parallel::HeadInput;
use super::{GpuModel, GpuStream};
use crate::backend::PagePool;
use crate::cuda::{self, DeviceBuffer};
use crate::cudart as rt;
use crate::status::Result;

impl GpuModel {
    /// Enqueues the forward pass of `tokens[from..from + len]`, one item of `stream` at the positions
    /// after its `len`, with every row's final-normed activations kept (`Head::All`) for a head to read;
    /// returns the path the pass laid the chunk out on.
    fn enqueue_chunk(&self, stream: &GpuStream, tokens: &[u32], from: usize, len: usize) -> Result<Path> {
        let piece = Piece {
            item: 0,
            from,
            len,
            pos: stream.len + from,
            table: stream.cache.table_ptr(),
            local_table: stream.cache.local_table_ptr(),
            last: false,
            row: 0,
            path: Path::Matvec,
        };
        let mut pass = vec![piece];
        let shape = self.lay_out(&mut pass);
        self.upload_pass(&pass, &[tokens])?;
        self.enqueue_forward(&pass, shape, Head::All)?;
        Ok(pass[0].path)
    }

    /// Appends `tokens` to one stream (pages from `pool`) and returns the logits after each of them
    /// (teacher forcing), for parity tests.
    pub fn all_logits(&mut self, pool: &mut PagePool, stream: &mut GpuStream, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        self.check_tokens(stream, tokens)?;
        reserve_pages(pool, stream, tokens.len())?;
        self.sync_table(stream)?;
        let mut out = Vec::with_capacity(tokens.len());
        let (hidden, vocab) = (self.cfg.hidden, self.cfg.vocab);
        for (c, chunk) in tokens.chunks(self.max_batch).enumerate() {
            let from = c * self.max_batch;
            self.enqueue_chunk(stream, tokens, from, chunk.len())?;
            for t in 0..chunk.len() {
                let x = (self.buf(self.s.xn) as *const f32).wrapping_add(t * hidden);
                let logits = self.buf(self.s.logits) as *mut f32;
                self.head_product(HeadInput::F32(x), 1, logits)?;
                let mut row = vec![0f32; vocab];
                self.download(self.s.logits, &mut row)?;
                out.push(row);
            }
        }
        stream.len += tokens.len();
        stream.tokens.extend_from_slice(tokens);
        self.logits_at.clear();
        self.logits_at.push(vec![LogitsAt::Row(0)]);
        Ok(out)
    }

    /// Appends `tokens` to one stream (its pages in place) as a step of one item would, computing the
    /// logits after every token, and writes `out[i]` = log p(tokens[i + 1]) under the logits after token
    /// `i` for `i < tokens.len() - 1` (`Backend::score`). Each chunk of `max_batch` runs one forward pass
    /// with its final-normed rows kept; the head runs over them in groups of the scratch's logits rows,
    /// each group's log-softmax on the device, so memory stays one group of logits and a float a token
    /// (copied back once, at the end: no chunk waits for the host). A chunk on tensor
    /// cores runs the head there too (its half-format input, as the chunk's own products), but the last
    /// token's logits take the decode product a step's head takes: `logits(0)` is what `engine_step`
    /// would have left. Nothing is sampled.
    pub fn score(&mut self, stream: &mut GpuStream, tokens: &[u32], out: &mut [f32]) -> Result<()> {
        self.logits_at.clear();
        self.check_tokens(stream, tokens)?;
        let end = stream.len + tokens.len();
        self.check_held(stream, end)?;
        self.sync_table(stream)?;
        let (hidden, vocab, s) = (self.cfg.hidden, self.cfg.vocab, self.stream.raw());
        // Each group re-reads the whole head (1 GB for Llama 3's in F16), so a chunk's rows go through it
        // in one group where a buffer of their logits can be had; else in the scratch's logits rows.
        let chunk_rows = self.max_batch.min(tokens.len());
        // A rank's head gathers through buffers of the scratch's logits rows (`head_product`).
        let group_logits = if chunk_rows > self.s.logit_rows && self.world() == 1 {
            DeviceBuffer::new(chunk_rows * vocab * 4)
                .inspect_err(|_| {
                    // SAFETY: takes no arguments; clears the failed allocation's error before the next launch check.
                    unsafe { rt::cudaGetLastError() };
                })
                .ok()
        } else {
            None
        };
        let rows_cap = if group_logits.is_some() { chunk_rows } else { self.s.logit_rows };
        let f = |off: usize| self.buf(off) as *mut f32;
        let xn = f(self.s.xn);
        let logits = group_logits.as_ref().map_or(f(self.s.logits), |b| b.ptr() as *mut f32);
        let act = self.buf(self.s.act);
        // The rows' targets sit where a finished pass no longer reads; the log-probabilities of every chunk
        // stay on the device until the end, so no chunk waits for the host.
        let targets = self.buf(self.s.up) as *mut c_int;
        let results = DeviceBuffer::new(tokens.len() * 4)?;
        let scored = results.ptr() as *mut f32;
        let mut last_row = 0;
        for (c, chunk) in tokens.chunks(self.max_batch).enumerate() {
            let from = c * self.max_batch;
            let n = chunk.len();
            let path = self.enqueue_chunk(stream, tokens, from, n)?;
            let next: Vec<c_int> = (0..n).map(|r| tokens.get(from + r + 1).map_or(-1, |&t| t as c_int)).collect();
            self.upload(self.s.up, &next)?;
            let on_tc = path == Path::Tensor && self.head.dtype == self.half;
            if on_tc {
                launch::convert(xn, act, self.half, n * hidden, s)?;
            }
            let last_chunk = from + n == tokens.len();
            for g0 in (0..n).step_by(rows_cap) {
                let g = (n - g0).min(rows_cap);
                // The call's last token: the step's own head, alone in the group's last row.
                let step_head = last_chunk && g0 + g == n;
                if on_tc {
                    let tc_rows = if step_head { g - 1 } else { g };
                    if tc_rows > 0 {
                        let a = (act as *mut u8).wrapping_add(g0 * hidden * 2) as *mut c_void;
                        self.head_product(HeadInput::Half(a), tc_rows, logits)?;
                    }
                    if step_head {
                        let (x, y) = (xn.wrapping_add((n - 1) * hidden), logits.wrapping_add((g - 1) * vocab));
                        self.head_product(HeadInput::F32(x), 1, y)?;
                    }
                } else {
                    // Each row alone, as a step's head computes its last row.
                    self.head_product(HeadInput::F32(xn.wrapping_add(g0 * hidden)), g, logits)?;
                }
                if step_head {
                    last_row = g - 1;
                }
                // The next group's product overwrites these rows after this kernel, in stream order.
                launch::row_logprobs(logits, vocab, g, targets.wrapping_add(g0), scored.wrapping_add(from + g0), s)?;
            }
        }
        if group_logits.is_some() {
            // logits(0) reads the scratch's rows: the step head's logits move there from the group's buffer.
            let (src, dst) = (logits.wrapping_add(last_row * vocab), f(self.s.logits));
            cuda::check(
                // SAFETY: both rows are `vocab` floats inside live device allocations, copied in stream order.
                unsafe {
                    rt::cudaMemcpyAsync(
                        dst as *mut c_void,
                        src as *const c_void,
                        vocab * 4,
                        rt::cudaMemcpyDeviceToDevice,
                        s,
                    )
                },
                "cudaMemcpyAsync(step head logits)",
            )?;
            last_row = 0;
        }
        self.stream.synchronize()?;
        let mut all = vec![0f32; tokens.len()];
        results.download(&mut all)?;
        let last = tokens.len() - 1;
        out[..last].copy_from_slice(&all[..last]);
        stream.len = end;
        self.logits_at.push(vec![LogitsAt::Row(last_row)]);
        Ok(())
    }
}
