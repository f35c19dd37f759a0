//! Speculation's proposals for a batch: each speculating item's budget, prompt lookup's proposals,
//! and the drafter's, drafted for every item in one batched drafter step a token.

use super::Streams;
use crate::abi::engine_draft;
use crate::backend::{Backend, Batch, BatchItem, Decoder};
use crate::speculative;

impl<B: Backend> Streams<B> {
    /// How many tokens stream `stream` may propose after `tokens` for an item that may produce `most`
    /// tokens: none unless its speculation is on, and never past its window or the backend's
    /// verification (a pause after rejections counts down here).
    fn proposal_budget(&mut self, stream: u32, tokens: &[u32], most: usize) -> usize {
        let Ok(slot) = self.slot(stream, "") else { return 0 };
        let len = self.slots[slot].as_ref().map_or(0, |s| s.len);
        let room = self.window.saturating_sub(len + tokens.len());
        let fits = self.backend.verify_tokens().saturating_sub(tokens.len());
        let bound = most.saturating_sub(1).min(room).min(fits);
        if bound == 0 || tokens.is_empty() {
            return 0;
        }
        self.spec[slot].budget().min(bound)
    }

    /// Stream `stream`'s history: its tokens, then `tokens`.
    fn history(&self, stream: u32, tokens: &[u32]) -> Vec<u32> {
        let mut history = self.slots[stream as usize].as_ref().map_or(Vec::new(), |s| s.tokens.clone());
        history.extend_from_slice(tokens);
        history
    }

    /// Each item's proposals (empty for a constrained stream, whose mask is computed for one draw):
    /// prompt lookup's at once, the drafter's in one batched drafter step per proposed token.
    pub(super) fn propose_all(&mut self, items: &[BatchItem<'_>]) -> Vec<Vec<u32>> {
        let mut proposals = vec![Vec::new(); items.len()];
        let mut drafts: Vec<(usize, u32, Vec<u32>, usize)> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let stream = item.stream();
            if item.is_refused() || self.constraints.get(stream as usize).is_some_and(Option::is_some) {
                continue;
            }
            let k = self.proposal_budget(stream, item.tokens, item.most);
            if k == 0 {
                continue;
            }
            let set = self.spec[stream as usize].settings;
            let history = self.history(stream, item.tokens);
            match set.draft {
                engine_draft::Ngram => {
                    proposals[i] = speculative::lookup(&history, set.ngram_min as usize, set.ngram_max as usize, k)
                }
                engine_draft::Model => drafts.push((i, stream, history, k)),
                engine_draft::None => {}
            }
        }
        if let Some(drafter) = self.drafter.as_mut().filter(|_| !drafts.is_empty()) {
            let jobs: Vec<(u32, Vec<u32>, usize)> = drafts.iter().map(|(_, s, h, k)| (*s, h.clone(), *k)).collect();
            for ((i, ..), drafted) in drafts.iter().zip(drafter.draft(&jobs)) {
                proposals[*i] = drafted;
            }
        }
        proposals
    }

    /// As a drafter: for each job (stream, the target stream's history, k), up to k greedy tokens after
    /// the history. The stream first keeps its longest prefix of the history (less one token, whose
    /// logits the first draft needs) and catches up with the rest in the first batched step; each later
    /// step appends the previous draft. A job the drafter cannot step (its window or pool full) stops
    /// with what it has; a device error drafts nothing more.
    fn draft(&mut self, jobs: &[(u32, Vec<u32>, usize)]) -> Vec<Vec<u32>> {
        let mut drafted: Vec<Vec<u32>> = vec![Vec::new(); jobs.len()];
        let mut inputs: Vec<Vec<u32>> = Vec::with_capacity(jobs.len());
        for (stream, history, _) in jobs {
            let held = self.slots.get(*stream as usize).and_then(Option::as_ref).map_or(&[][..], |s| &s.tokens[..]);
            let common = held.iter().zip(history).take_while(|(a, b)| a == b).count().min(history.len() - 1);
            if common < held.len() && self.truncate(*stream, common).is_err() {
                let _ = self.reset(*stream);
            }
            let kept = self.stream_len(*stream).unwrap_or(0).min(common);
            inputs.push(history[kept..].to_vec());
        }
        let most = jobs.iter().map(|j| j.2).max().unwrap_or(0);
        for round in 0..most {
            let live: Vec<usize> = (0..jobs.len())
                .filter(|&j| jobs[j].2 > round && drafted[j].len() == round && !inputs[j].is_empty())
                .collect();
            if live.is_empty() {
                break;
            }
            // The jobs' streams are the target batch's, each named once.
            let items = live.iter().map(|&j| BatchItem::new(jobs[j].0, &inputs[j])).collect();
            let Ok(mut steps) = Batch::new(items) else { break };
            if self.step_batch(&mut steps).is_err() {
                break;
            }
            let next: Vec<Option<u32>> = steps.iter().map(|s| s.next.as_ref().ok().copied()).collect();
            drop(steps);
            for (&j, next) in live.iter().zip(next) {
                match next {
                    Some(t) => {
                        drafted[j].push(t);
                        inputs[j] = vec![t];
                    }
                    None => inputs[j].clear(),
                }
            }
        }
        drafted
    }

    /// Cuts the drafter's stream `stream` to at most `len` positions (after verification or a truncate of
    /// the target's stream); a drafter stream that cannot be cut starts again empty.
    pub(super) fn cut_drafter(&mut self, stream: u32, len: usize) {
        if let Some(d) = self.drafter.as_mut()
            && d.stream_len(stream).is_ok_and(|have| have > len)
            && d.truncate(stream, len).is_err()
        {
            let _ = d.reset(stream);
        }
    }
}
