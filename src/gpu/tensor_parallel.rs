//! One rank of a tensor-parallel model on its device (ARCHITECTURE.md, "Tensor parallelism"): a
//! `GpuModel` loaded from the rank's slices (`shard::RankSource`) with the rank's `Collectives`. The
//! architecture files run unchanged: the operations that end in a hidden-wide output (attention's o,
//! the feed-forward's down, the experts' sum) leave this rank's part in xn, sum it over the ranks, and
//! only then add it to the residual (`PassOps::add_reduced`); the head computes the rank's vocabulary
//! rows, which an all-gather and a strided copy lay out as whole logits rows, so sampling, masks and
//! `logits` read them as on one device. Every rank runs every step (its own streams and page tables)
//! and draws the same tokens from the same logits.

use std::ops::Range;
use std::os::raw::c_void;
use std::ptr;

use super::collectives::Collectives;
use super::scratch::LOGIT_ROWS;
use super::{GpuModel, RowsOnDevice, Sizing, launch};
use crate::bail;
use crate::cuda::{self, DeviceBuffer};
use crate::cudart as rt;
use crate::model::TensorSource;
use crate::shard::RankSource;
use crate::status::Result;
use crate::tuning::Tuning;

/// A rank's collectives and the buffers of its head's gather.
pub(super) struct RankPart {
    pub(super) comm: Box<dyn Collectives>,
    /// The whole vocabulary: the gathered rows' width.
    vocab: usize,
    /// ceil(vocab / world): each rank's piece of a row in the gather (the last rank's ids fewer).
    chunk: usize,
    /// Rows the buffers hold (the scratch's logits rows).
    rows: usize,
    /// This rank's head outputs, rows of `chunk`.
    part: DeviceBuffer,
    /// Every rank's `part`, rank after rank.
    gathered: DeviceBuffer,
}

impl RankPart {
    pub(super) fn new(comm: Box<dyn Collectives>, vocab: usize, rows: usize) -> Result<RankPart> {
        let (world, chunk) = (comm.world(), vocab.div_ceil(comm.world().max(1)));
        let part = DeviceBuffer::new(rows * chunk * 4)?;
        let gathered = DeviceBuffer::new(world * rows * chunk * 4)?;
        Ok(RankPart { comm, vocab, chunk, rows, part, gathered })
    }

    /// The bytes `new` allocates for `rows` logits rows of `vocab` ids over `world` ranks.
    fn bytes(vocab: usize, world: usize, rows: usize) -> u64 {
        let chunk = vocab.div_ceil(world.max(1)) as u64;
        (world as u64 + 1) * rows as u64 * chunk * 4
    }
}

/// What the head reads: the final-normed rows in f32 (the decode products), or in the half format (the
/// tensor-core product).
#[derive(Clone, Copy)]
pub(super) enum HeadInput {
    F32(*const f32),
    Half(*const c_void),
}

impl GpuModel {
    /// Rank `src.rank()` of a tensor-parallel model on the current device, summing and gathering with
    /// `comm` (rank and world as the source's): otherwise as `load_with_pools`, its KV pool holding the
    /// rank's KV heads. INVALID_ARGUMENT when the two disagree.
    #[allow(clippy::too_many_arguments)]
    pub fn load_rank(
        src: &RankSource,
        comm: Box<dyn Collectives>,
        rows: RowsOnDevice,
        sizing: Sizing,
        tuning: &Tuning,
    ) -> Result<GpuModel> {
        if (comm.rank(), comm.world()) != (src.rank(), src.world()) {
            bail!(
                InvalidArgument,
                "the collectives are rank {} of {}, the weights rank {} of {}",
                comm.rank(),
                comm.world(),
                src.rank(),
                src.world()
            );
        }
        let ids = src.rank_head().expect("a rank's source names its head's ids");
        let chunk = src.config().vocab.div_ceil(src.world());
        if ids.start != src.rank() * chunk {
            bail!(InvalidArgument, "rank {}'s head ids start at {}, not at its gather offset", src.rank(), ids.start);
        }
        Self::load_parts(src, Some(comm), rows, sizing, tuning)
    }

    /// Device bytes a rank of a split over `world` ranks allocates beside `scratch_bytes`' for its
    /// head's gather, with prompt chunks of `max_batch` tokens (the fit rule counts them).
    pub fn gather_bytes(vocab: usize, world: usize, max_batch: usize) -> u64 {
        RankPart::bytes(vocab, world, LOGIT_ROWS.min(max_batch.max(1)))
    }

    /// Ranks the model is split over (1 for a whole model).
    pub fn world(&self) -> usize {
        self.rank.as_ref().map_or(1, |r| r.comm.world())
    }

    /// Its rank in the split (0 for a whole model).
    pub fn rank_index(&self) -> usize {
        self.rank.as_ref().map_or(0, |r| r.comm.rank())
    }

    /// The vocabulary ids this model's head computes: all of them, or a rank's.
    pub fn head_ids(&self) -> Range<usize> {
        match &self.rank {
            Some(r) => r.comm.rank() * r.chunk..(r.comm.rank() * r.chunk + self.head.rows),
            None => 0..self.head.rows,
        }
    }

    /// With tensor parallelism, `y`'s `len` values become their sum over the ranks; else nothing.
    pub(super) fn reduce(&self, y: *mut f32, len: usize) -> Result<()> {
        let Some(r) = &self.rank else { return Ok(()) };
        // SAFETY: `y` is scratch of this model's device holding `len` values (the callers' rows), queued on
        // the model's own stream; every rank runs the same operations, so the same collectives.
        unsafe { r.comm.all_reduce_sum(y, len, self.stream.raw()) }
    }

    /// The logits of `rows` final-normed rows into `logits` (rows of the whole vocabulary): the head's
    /// product, and for a rank its piece gathered from every rank.
    pub(super) fn head_product(&self, input: HeadInput, rows: usize, logits: *mut f32) -> Result<()> {
        let s = self.stream.raw();
        let none = ptr::null::<f32>();
        let Some(r) = &self.rank else {
            let vocab = self.head.rows;
            return match input {
                HeadInput::F32(x) => {
                    launch::decode_product(&self.head, x, rows, none, none, logits, vocab, self.mmv_work(), s)
                }
                HeadInput::Half(a) => self.product(&self.head, a, rows, none, none, logits, vocab, None),
            };
        };
        if rows > r.rows {
            bail!(InvalidArgument, "{rows} head rows at once; a rank gathers {} at most", r.rows);
        }
        let part = r.part.ptr() as *mut f32;
        match input {
            HeadInput::F32(x) => {
                launch::decode_product(&self.head, x, rows, none, none, part, r.chunk, self.mmv_work(), s)?
            }
            HeadInput::Half(a) => self.product(&self.head, a, rows, none, none, part, r.chunk, None)?,
        }
        let gathered = r.gathered.ptr() as *mut f32;
        // SAFETY: `part` holds rows x chunk values and `gathered` world times that, both this model's,
        // on its device and stream; every rank gathers the same rows at the same point of the pass.
        unsafe { r.comm.all_gather(part, gathered, rows * r.chunk, s)? };
        let world = r.comm.world();
        for k in 0..world {
            let ids = r.chunk.min(r.vocab - k * r.chunk);
            let from = gathered.wrapping_add(k * rows * r.chunk);
            // SAFETY: rank k's `rows` rows of `chunk` values in `gathered` into columns k x chunk.. of
            // `rows` logits rows of `vocab` values, both on this device (the caller's logits rows).
            let code = unsafe {
                rt::cudaMemcpy2DAsync(
                    logits.wrapping_add(k * r.chunk).cast(),
                    r.vocab * 4,
                    from as *const c_void,
                    r.chunk * 4,
                    ids * 4,
                    rows,
                    rt::cudaMemcpyDeviceToDevice,
                    s,
                )
            };
            cuda::check(code, "cudaMemcpy2DAsync (a rank's gathered logits)")?;
        }
        Ok(())
    }
}
