//! The engine: a checkpoint, the plan the fit rule made for it, and the embedding rows where the plan
//! put them. `Engine::init_fit` opens, measures, decides, logs and places; every failure on the way
//! releases what was taken before it (each resource has one owner).
//!
//! Backends: CUDA runs the plan of `fit::plan`. The CPU backend (no device, or `backend = CPU`) reads
//! the rows straight from the file mapping and has no device plan: `plan()` is None there.
//!
//! Files: `options.rs` (defaults, checks, AUTO resolved), `plan.rs` (the fit rule's figures, the KV
//! pool), `load.rs` (`init_fit`), `split.rs` (its load over several devices), `step.rs` (a batch checked and stepped), `embed.rs` (the row gather);
//! here the `Engine` and the calls that hand a stream's work to its decoder.
#![allow(non_camel_case_types)]

mod embed;
mod load;
mod options;
mod plan;
mod split;
mod step;

pub use load::{HeldCheckpoint, Logger, rows_source};
pub use options::{
    BATCH_TENSOR_CORES_ENV, DEFAULT_MAX_BATCH, MMAP_ROWS_ENV, check_options, cpu_kv_types, default_options,
    gpu_kv_types, max_batch_of, resolve_batch_tensor_cores, resolve_mmap_rows, resolve_prefix_cache, resolve_unified,
    sampling_of, tuning_for, window_of,
};
pub use plan::{KvPool, drafter_window, fit_inputs, fit_inputs_with_drafter, host_rows_reason, rank_fit_inputs};

use crate::backend::Decoder;
use crate::checkpoint::Checkpoint;
use crate::constraint::Constraint;
use crate::cuda::PinnedBuffer;
use crate::fit::{engine_fit_inputs, engine_plan};
use crate::kv::KvTypes;
use crate::model::ModelConfig;
use crate::placement::Rows;
use crate::sampler::Sampling;
use crate::status::Result;
use crate::tokenizer::Tokenizer;
use crate::tuning::Tuning;
use std::sync::{Arc, Mutex};

pub use crate::abi::{
    engine_backend, engine_batch_item, engine_draft, engine_kv_type, engine_log_fn, engine_options, engine_speculation,
    engine_tristate,
};

/// The point after which `init_fit_failing_after` fails, to prove each step's failure frees everything.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitStep {
    Opened,
    Planned,
    RowsPlaced,
    Loaded,
}

/// Streams the CPU backend admits when `max_streams` is 0 (it has no device memory to plan).
pub const CPU_STREAMS: u32 = 16;

/// The backend an engine runs on, once resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cuda,
    Cpu,
}

/// A loaded model with its embedding rows placed.
pub struct Engine {
    // Fields drop in order: the decode backend (which reads the rows), the rows, the out-of-range
    // flag, and last the mapping the rows may point into.
    backend: Box<dyn Decoder>,
    tokenizer: Option<Arc<Tokenizer>>,
    rows: Rows,
    /// The drafter's rows and checkpoint (None without `options.draft_model`): its model in `backend`
    /// reads them, so they drop after it, beside the target's.
    _drafter_rows: Option<Rows>,
    /// The rows the other ranks of a tensor-parallel model read, where `rows` (rank 0's) are not theirs:
    /// they drop after the backend too.
    _rank_rows: Vec<Rows>,
    bad_ids: Option<Mutex<PinnedBuffer>>,
    plan: Option<engine_plan>,
    /// Each device's plan over `options.devices` (rank order; each one's `streams` what that device alone
    /// allows); empty on one device.
    device_plans: Vec<engine_plan>,
    inputs: Option<engine_fit_inputs>,
    options: engine_options,
    /// How the backend was told to run.
    tuning: Tuning,
    logger: Logger,
    kind: BackendKind,
    kv: KvTypes,
    ckpt: HeldCheckpoint,
    drafter_ckpt: Option<HeldCheckpoint>,
}

// SAFETY: the log callback's user pointer is the caller's, who promises the engine's new thread may use it.
unsafe impl Send for Engine {}

impl Engine {
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_deref()
    }

    /// The tokenizer, for callers that tokenize without holding the engine.
    pub fn shared_tokenizer(&self) -> Option<Arc<Tokenizer>> {
        self.tokenizer.clone()
    }

    /// Streams this engine admits (the plan's count on CUDA).
    pub fn stream_count(&self) -> usize {
        self.backend.stream_count()
    }

    /// The window every stream has, in tokens.
    pub fn window(&self) -> usize {
        self.backend.window()
    }

    /// Stream `stream`'s speculation from its next step on (INVALID_ARGUMENT for settings out of range,
    /// UNSUPPORTED for a drafter model where `options.draft_model` loaded none); its counts start again.
    pub fn set_speculation(&mut self, stream: u32, s: &engine_speculation) -> Result<()> {
        crate::speculative::check(s)?;
        self.backend.set_speculation(stream, *s)
    }

    /// The drafter model's checkpoint, when `options.draft_model` loaded one.
    pub fn drafter(&self) -> Option<&Checkpoint> {
        self.drafter_ckpt.as_deref()
    }

    pub fn speculation(&self, stream: u32) -> Result<engine_speculation> {
        self.backend.speculation(stream)
    }

    /// (tokens proposed, tokens accepted) on stream `stream` since its speculation was last set.
    pub fn speculation_stats(&self, stream: u32) -> Result<(u64, u64)> {
        self.backend.speculation_stats(stream)
    }

    /// The ids stream `stream`'s constraint allows next, as words of `vocab` bits; None without one.
    pub fn allowed_tokens(&mut self, stream: u32, vocab: usize) -> Result<Option<Vec<u32>>> {
        self.backend.allowed_tokens(stream, vocab)
    }

    /// (tokens the prefix cache gave, tokens computed) of those stream `stream` was given since its last reset.
    pub fn prefix_stats(&self, stream: u32) -> Result<(u64, u64)> {
        self.backend.prefix_stats(stream)
    }

    /// The logits after the last position of stream `stream`, for the streams the last batch stepped.
    pub fn logits(&self, stream: u32) -> Result<Vec<f32>> {
        self.backend.logits(stream)
    }

    /// Empties stream `stream` and gives its KV pages back to the pool; its sampler settings stay.
    pub fn reset(&mut self, stream: u32) -> Result<()> {
        self.backend.reset(stream)
    }

    /// Keeps the first `len` positions of stream `stream`, giving back the pages past them.
    pub fn truncate(&mut self, stream: u32, len: usize) -> Result<()> {
        self.backend.truncate(stream, len)
    }

    /// Empties stream `dst`, then gives it the first `len` positions of stream `src`, sharing its KV
    /// pages (copied on the first write into one). A refusal changes nothing.
    pub fn fork(&mut self, src: u32, dst: u32, len: usize) -> Result<()> {
        self.backend.fork(src, dst, len)
    }

    /// Appends `tokens` to stream `stream` as a step would, computing the logits at every position, and
    /// writes `out[i]` = log p(tokens[i] | everything before it) (`out[0]` NaN when the stream was empty).
    pub fn score(&mut self, stream: u32, tokens: &[i32], out: &mut [f32]) -> Result<()> {
        let vocab = self.ckpt.config.vocab;
        if let Some((i, t)) = tokens.iter().enumerate().find(|(_, t)| **t < 0 || **t as usize >= vocab) {
            crate::bail!(OutOfRange, "engine_score: token {i} is id {t}, outside the vocabulary (0..{vocab})");
        }
        let ids: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
        self.backend.score(stream, &ids, out)
    }

    /// The KV pool's positions by state.
    pub fn kv_usage(&self) -> crate::abi::engine_kv_usage {
        self.backend.kv_usage()
    }

    /// The KV pool pages stream `stream` holds, in position order (for tests).
    #[doc(hidden)]
    pub fn stream_pages(&self, stream: u32) -> Result<Vec<u32>> {
        self.backend.stream_pages(stream)
    }

    /// Checks the KV pool's page counts against every stream's pages (for tests).
    #[doc(hidden)]
    pub fn audit_pages(&self) -> Result<()> {
        self.backend.audit()
    }

    /// Tokens stream `stream` holds now.
    pub fn stream_len(&self, stream: u32) -> Result<usize> {
        self.backend.stream_len(stream)
    }

    /// Stream `stream`'s sampler settings from its next step on.
    pub fn set_sampling(&mut self, stream: u32, s: &Sampling) -> Result<()> {
        s.check("sampling.")?;
        self.backend.set_sampling(stream, *s)
    }

    pub fn sampling(&self, stream: u32) -> Result<Sampling> {
        self.backend.sampling(stream)
    }

    /// Holds stream `stream`'s output to `c` from its next step on (None removes its constraint).
    pub fn set_constraint(&mut self, stream: u32, c: Option<Constraint>) -> Result<()> {
        self.backend.set_constraint(stream, c)
    }

    /// (positions the KV pool holds, positions free).
    pub fn kv_stats(&self) -> (u64, u64) {
        self.backend.kv_stats()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.ckpt.config
    }

    pub fn checkpoint(&self) -> &Checkpoint {
        &self.ckpt
    }

    pub fn rows(&self) -> &Rows {
        &self.rows
    }

    /// The plan the engine started with (its placement is where the rows went); None on the CPU backend.
    pub fn plan(&self) -> Option<&engine_plan> {
        self.plan.as_ref()
    }

    /// Device `index`'s plan (0 is `options.device`): on one device `plan()`, over several devices that
    /// device's own (its `streams` what it alone allows; the engine starts the fewest). None past the
    /// devices, or on the CPU backend.
    pub fn device_plan(&self, index: usize) -> Option<&engine_plan> {
        match self.device_plans.is_empty() {
            true if index == 0 => self.plan.as_ref(),
            true => None,
            false => self.device_plans.get(index),
        }
    }

    /// The figures the plan was made from; None on the CPU backend.
    pub fn fit_inputs(&self) -> Option<&engine_fit_inputs> {
        self.inputs.as_ref()
    }

    pub fn options(&self) -> &engine_options {
        &self.options
    }

    /// The settings the engine resolved once at its creation and its backend runs with.
    pub fn tuning(&self) -> &Tuning {
        &self.tuning
    }

    pub fn backend(&self) -> BackendKind {
        self.kind
    }

    /// The K and V cache types in use.
    pub fn kv_types(&self) -> KvTypes {
        self.kv
    }

    pub fn log(&self, line: &str) {
        self.logger.line(line)
    }
}
