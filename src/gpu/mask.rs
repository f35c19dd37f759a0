//! Constraint masks on the device. A constrained item's allowed ids (llguidance's bit set, computed on a
//! host thread while the forward runs) are written into pinned staging once the pass is queued, and one
//! asynchronous copy a pass takes every constrained row of it into the scratch's mask rows, on the model's
//! stream right before the pass's sampler; the sampler then draws each such row among its allowed ids
//! (kernels/sample.cu), so the logits never leave the device. The mask rows sit at fixed addresses in the
//! scratch and neither the copy nor the draw is part of a captured graph (graph.rs holds the forward
//! alone), so graphs replay unchanged.

use std::os::raw::c_void;

use super::GpuModel;
use crate::cuda::{self, Event, PinnedBuffer};
use crate::cudart as rt;
use crate::status::Result;

/// The host side of the mask rows: their pinned staging (made at the first constrained step) and the
/// event after the last copy out of it.
#[derive(Default)]
pub(super) struct MaskStage {
    host: Option<PinnedBuffer>,
    copied: Option<Event>,
}

/// Whether `allowed` (bit `i % 32` of word `i / 32`) lets an id below `vocab` through. A mask that does not
/// is not used and the row draws freely, as `StepItem::sample` does on the host.
pub(super) fn allows_any(allowed: &[u32], vocab: usize) -> bool {
    allowed.iter().take(vocab.div_ceil(32)).enumerate().any(|(w, &word)| {
        let valid = vocab - w * 32;
        let bits = if valid >= 32 { word } else { word & ((1u32 << valid) - 1) };
        bits != 0
    })
}

impl GpuModel {
    /// Puts the masks of a pass's heads (in order; None for a head drawn among every id) into mask rows
    /// `first..` in that order, with one copy queued on the stream, and returns each head's mask row.
    /// `first` counts the rows earlier passes took since the device's rows were last read back (which
    /// waits for the stream), so no staged row a queued copy may still read is written.
    pub(super) fn stage_masks(&mut self, masks: &[Option<&[u32]>], first: usize) -> Result<Vec<Option<u32>>> {
        let count = masks.iter().flatten().count();
        if count == 0 {
            return Ok(vec![None; masks.len()]);
        }
        let (words, rows_cap) = (self.s.mask_words, self.s.logit_rows);
        if first + count > rows_cap {
            crate::bail!(Panic, "{count} masks after {first} rows: the scratch has {rows_cap} mask rows");
        }
        let stage = &mut self.mask_stage;
        if stage.host.is_none() {
            stage.copied = Some(Event::new()?);
            stage.host = Some(PinnedBuffer::new_mapped(rows_cap * words * 4)?);
        } else if first == 0
            && let Some(copied) = &stage.copied
        {
            // Rows from 0 again: a step that failed may have left the last copy queued.
            copied.synchronize()?;
        }
        let host = stage.host.as_mut().expect("made above");
        let base = host.host_ptr() as *const u8;
        // SAFETY: every bit pattern is a u32, and cudaHostAlloc's pages are aligned for it.
        let (before, staged, _) = unsafe { host.as_mut_slice().align_to_mut::<u32>() };
        debug_assert!(before.is_empty(), "pinned memory is page-aligned");
        let mut rows = Vec::with_capacity(masks.len());
        let mut row = first;
        for mask in masks {
            let Some(allowed) = mask else {
                rows.push(None);
                continue;
            };
            let dst = &mut staged[row * words..(row + 1) * words];
            let n = allowed.len().min(words);
            dst[..n].copy_from_slice(&allowed[..n]);
            dst[n..].fill(0);
            rows.push(Some(row as u32));
            row += 1;
        }
        let (at, bytes) = (first * words * 4, count * words * 4);
        let s = self.stream.raw();
        cuda::check(
            // SAFETY: rows first..first + count of the staging (pinned, rows_cap rows) and of the scratch's
            // mask region (rows_cap rows, checked above); the staged rows stay unwritten until the stream
            // has run this copy (see the doc comment).
            unsafe {
                rt::cudaMemcpyAsync(
                    self.buf(self.s.masks + at),
                    base.wrapping_add(at) as *const c_void,
                    bytes,
                    rt::cudaMemcpyHostToDevice,
                    s,
                )
            },
            "cudaMemcpyAsync(constraint masks)",
        )?;
        self.mask_stage.copied.as_ref().expect("made with the staging").record(s)?;
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::allows_any;

    #[test]
    fn only_ids_below_the_vocabulary_count() {
        assert!(!allows_any(&[], 40));
        assert!(!allows_any(&[0, 0], 40));
        assert!(allows_any(&[1, 0], 40));
        assert!(allows_any(&[0, 1 << 7], 40), "id 39");
        assert!(!allows_any(&[0, 1 << 8], 40), "id 40 is past the vocabulary");
        assert!(!allows_any(&[0, 0, 1], 64), "a word past the vocabulary");
        assert!(allows_any(&[0, 1 << 31], 64), "id 63");
    }
}
