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
    use crate::sampler::{self, Sampling, key, splitmix64};

    /// kernels/sample.cu's masking, on the host: a masked id takes key 0 (the NaN with every bit set), an
    /// allowed id's key is raised to 1 at least (the NaN one below that).
    fn as_the_device_masks(logits: &[f32], allowed: &[u32]) -> Vec<f32> {
        let lowest = f32::from_bits(0xFFFF_FFFF);
        let raised = f32::from_bits(0xFFFF_FFFE);
        let is_allowed = |i: usize| allowed[i / 32] >> (i % 32) & 1 == 1;
        logits
            .iter()
            .enumerate()
            .map(|(i, &l)| {
                if !is_allowed(i) {
                    lowest
                } else if key(l) == 0 {
                    raised
                } else {
                    l
                }
            })
            .collect()
    }

    /// The device's sampler is `sampler::sample_stream` bit for bit (tests/gpu_kernels/); on the row its
    /// masking makes, that draw is `sample_stream_masked`'s for every setting, with -inf and NaN logits
    /// among the allowed ones, and allowed ids whose logits are all -inf.
    #[test]
    fn masking_by_the_lowest_key_is_the_masked_draw() {
        let mut state = 0x3A5C_u64;
        let mut next = || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            splitmix64(state)
        };
        let mut off_argmax = 0;
        for case in 0..3000u64 {
            let n = 1 + (next() % 400) as usize;
            let mut logits: Vec<f32> = (0..n).map(|_| (next() % 2000) as f32 / 100.0 - 10.0).collect();
            if case % 3 == 1 {
                // Runs of equal logits.
                logits.iter_mut().for_each(|l| *l = l.round());
            }
            let mut allowed = vec![0u32; n.div_ceil(32)];
            let density = [1, 2, 8, 50, n as u64 + 1][(next() % 5) as usize];
            for i in 0..n {
                if next() % density == 0 {
                    allowed[i / 32] |= 1 << (i % 32);
                }
            }
            let one = (next() % n as u64) as usize;
            allowed[one / 32] |= 1 << (one % 32);
            match case % 11 {
                0 => {
                    (0..n).filter(|&i| allowed[i / 32] >> (i % 32) & 1 == 1).for_each(|i| logits[i] = f32::NEG_INFINITY)
                }
                1 => logits[one] = f32::NAN,
                2 => logits[one] = -f32::NAN,
                3 => logits.iter_mut().step_by(3).for_each(|l| *l = f32::NEG_INFINITY),
                _ => {}
            }
            let mut s = Sampling { seed: next(), ..Sampling::GREEDY };
            if case % 4 != 0 {
                s.temperature = 0.2 + (next() % 100) as f32 / 40.0;
            }
            if case % 3 == 0 {
                s.top_k = 1 + (next() % 50) as u32;
            }
            if case % 5 < 2 {
                s.top_p = 0.3 + (next() % 70) as f32 / 100.0;
            }
            if case % 7 < 3 {
                s.min_p = (next() % 40) as f32 / 100.0;
            }
            if case % 2 == 0 {
                (s.repeat_penalty, s.repeat_last_n) = ([1.4, 0.7][(next() % 2) as usize], 8);
            }
            let history: Vec<u32> = (0..next() % 12).map(|_| (next() % n as u64) as u32).collect();
            let new = [(next() % n as u64) as u32];
            let stream = (next() % 8) as u32;
            let want = sampler::sample_stream_masked(&logits, &allowed, &s, stream, &history, &new);
            let got = sampler::sample_stream(&as_the_device_masks(&logits, &allowed), &s, stream, &history, &new);
            assert_eq!(Some(got), want, "case {case}: {s:?}");
            off_argmax += usize::from(got != sampler::argmax(&logits));
        }
        assert!(off_argmax > 1000, "only {off_argmax} draws left the free argmax");
    }

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
