//! CUDA graphs: a pass whose every row is a head, captured once per row count, matrix-vector row count
//! and attention grid (the blocks a token's parts take: a power of two that grows with the longest
//! context up to 4,096 positions, so at most six a count) and replayed (`Tuning::cuda_graphs` off,
//! HOSTEMBED_CUDA_GRAPHS=0, turns them off). Such a pass is single tokens of one stream or many, or, on
//! the matrix-vector kernels, verifications (a token and its proposals, each row its own position):
//! every row takes the same launches, and everything that changes between steps is read from the
//! scratch (ids, positions, page table addresses; the tables themselves are device memory updated as
//! pages come), so one graph serves every stream and every step of that shape. A shape is captured the
//! second time it runs, after a plain run has settled whatever a product library chooses on first use.

use std::ptr;

use super::GpuModel;
use super::forward::{Head, PassShape, Piece};
use crate::cuda;
use crate::cudart as rt;
use crate::status::Result;

/// A captured forward pass whose every row is a head, with their logits.
pub(super) struct StepGraph {
    graph: rt::cudaGraph_t,
    exec: rt::cudaGraphExec_t,
}

impl Drop for StepGraph {
    fn drop(&mut self) {
        // SAFETY: both handles were made by this graph's capture and are destroyed only here, once.
        unsafe {
            if !self.exec.is_null() {
                rt::cudaGraphExecDestroy(self.exec);
            }
            if !self.graph.is_null() {
                rt::cudaGraphDestroy(self.graph);
            }
        }
    }
}

impl GpuModel {
    /// Replays the graph of a pass of `shape.n` rows, every one a head (logits into rows 0..n), capturing
    /// it first when this shape ran before; false when the caller must queue the pass itself (graphs off,
    /// or turned off by a failed capture, or the shape's first run).
    pub(super) fn replay_decode(&mut self, pieces: &[Piece], shape: PassShape) -> Result<bool> {
        if !self.graphs || shape.n > self.max_batch {
            return Ok(false);
        }
        let key = (shape.n, shape.m, shape.grid_parts);
        if !self.decode_graphs.contains_key(&key) {
            if self.decode_seen.insert(key) {
                return Ok(false);
            }
            match self.capture(pieces, shape) {
                Ok(g) => {
                    self.decode_graphs.insert(key, g);
                }
                // A device or driver that cannot capture: run without graphs from now on.
                Err(_) => {
                    self.graphs = false;
                    return Ok(false);
                }
            }
        }
        let g = &self.decode_graphs[&key];
        // SAFETY: the graph was captured from this model's stream over buffers this model owns.
        cuda::check(unsafe { rt::cudaGraphLaunch(g.exec, self.stream.raw()) }, "cudaGraphLaunch")?;
        Ok(true)
    }

    /// Captures the pass of `pieces` (every row a head) into a graph.
    fn capture(&self, pieces: &[Piece], shape: PassShape) -> Result<StepGraph> {
        let s = self.stream.raw();
        let rows: Vec<usize> = (0..shape.n).collect();
        // SAFETY: `s` is this model's live stream; thread-local mode leaves other threads' work alone.
        let began = unsafe { rt::cudaStreamBeginCapture(s, rt::cudaStreamCaptureModeThreadLocal) };
        cuda::check(began, "cudaStreamBeginCapture")?;
        let queued = self.enqueue_forward(pieces, shape, Head::Rows { rows: &rows, base: 0 });
        let mut graph: rt::cudaGraph_t = ptr::null_mut();
        // SAFETY: ends the capture begun above on the same stream; `graph` receives the result.
        let ended = cuda::check(unsafe { rt::cudaStreamEndCapture(s, &mut graph) }, "cudaStreamEndCapture");
        let mut g = StepGraph { graph, exec: ptr::null_mut() };
        if let Err(e) = queued.and(ended) {
            // SAFETY: clears the sticky error a failed capture leaves; no arguments.
            unsafe { rt::cudaGetLastError() };
            return Err(e);
        }
        // SAFETY: `g.graph` is the graph just captured; `g.exec` receives the instance.
        let made = cuda::check(unsafe { rt::cudaGraphInstantiate(&mut g.exec, g.graph, 0) }, "cudaGraphInstantiate");
        if let Err(e) = made {
            // SAFETY: clears the sticky error a failed instantiation leaves; no arguments.
            unsafe { rt::cudaGetLastError() };
            g.exec = ptr::null_mut();
            return Err(e);
        }
        Ok(g)
    }
}
