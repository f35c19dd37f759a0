//! CUDA graphs: the single-token step of one stream, captured once and replayed
//! (HOSTEMBED_CUDA_GRAPHS=0 turns them off).

use std::ptr;

use super::forward::Head;
use super::{GpuModel, GpuStream};
use crate::cuda;
use crate::cudart as rt;
use crate::status::Result;

/// A captured single-token forward pass for one stream of one model.
pub(super) struct StepGraph {
    graph: rt::cudaGraph_t,
    exec: rt::cudaGraphExec_t,
    model_id: u64,
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

/// Whether graphs are on: HOSTEMBED_CUDA_GRAPHS unset or anything but "0".
pub(super) fn graphs_enabled() -> bool {
    std::env::var("HOSTEMBED_CUDA_GRAPHS").map(|v| v != "0").unwrap_or(true)
}

impl GpuModel {
    /// Replays the stream's single-token graph, capturing it first if needed; false when graphs are
    /// off (or turned off by a failed capture) and the caller must queue the pass itself.
    pub(super) fn replay_step(&mut self, stream: &mut GpuStream) -> Result<bool> {
        if !self.graphs {
            return Ok(false);
        }
        if stream.cache.graph.as_ref().is_none_or(|g| g.model_id != self.id) {
            stream.cache.graph = None;
            match self.capture(stream) {
                Ok(g) => stream.cache.graph = Some(g),
                // A device or driver that cannot capture: run without graphs from now on.
                Err(_) => self.graphs = false,
            }
        }
        let Some(g) = &stream.cache.graph else { return Ok(false) };
        // SAFETY: the graph was captured from this model's stream over buffers this model and stream own.
        cuda::check(unsafe { rt::cudaGraphLaunch(g.exec, self.stream.raw()) }, "cudaGraphLaunch")?;
        Ok(true)
    }

    /// Captures the single-token forward pass of `stream` into a graph.
    fn capture(&self, stream: &GpuStream) -> Result<StepGraph> {
        let s = self.stream.raw();
        // SAFETY: `s` is this model's live stream; thread-local mode leaves other threads' work alone.
        let began = unsafe { rt::cudaStreamBeginCapture(s, rt::cudaStreamCaptureModeThreadLocal) };
        cuda::check(began, "cudaStreamBeginCapture")?;
        let queued = self.enqueue_forward(stream, 1, Head::Last);
        let mut graph: rt::cudaGraph_t = ptr::null_mut();
        // SAFETY: ends the capture begun above on the same stream; `graph` receives the result.
        let ended = cuda::check(unsafe { rt::cudaStreamEndCapture(s, &mut graph) }, "cudaStreamEndCapture");
        let mut g = StepGraph { graph, exec: ptr::null_mut(), model_id: self.id };
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
