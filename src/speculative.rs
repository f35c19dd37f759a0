//! Speculative decoding: a stream proposes the tokens it expects next, the target runs its next token
//! and the proposals in one forward (the positions of a prompt chunk, each with its own logits), and
//! keeps the proposals up to the first one its own sampler would not have picked, then its own token.
//!
//! Verification draws the target's token at every position exactly as a plain step would (the same
//! logits, the same penalty history, the draw seeded by (seed, stream, position)) and accepts a
//! proposal when that token equals it. Both kinds of draft propose deterministically (prompt lookup,
//! a drafter's argmax), so the draft distribution q is a point mass on the proposal d, and this is the
//! standard rule: accept with probability min(1, p(d) / q(d)) = p(d), else draw from the normalized
//! max(0, p - q), which is p with d removed. So the output keeps the target's distribution, and where
//! a position's logits are the bits of stepping it alone, speculative output is the plain output
//! token for token, greedy or sampled.

use crate::abi::{ENGINE_SPECULATION_MAX_TOKENS, engine_draft, engine_speculation};
use crate::status::Result;

/// `engine_default_speculation()`: off, with the settings prompt lookup starts from when turned on.
pub const DEFAULT: engine_speculation =
    engine_speculation { draft: engine_draft::None, max_tokens: 8, ngram_min: 2, ngram_max: 4 };

/// Settings no stream may take: INVALID_ARGUMENT naming the field.
pub fn check(s: &engine_speculation) -> Result<()> {
    if s.draft == engine_draft::None {
        return Ok(());
    }
    if s.max_tokens == 0 || s.max_tokens > ENGINE_SPECULATION_MAX_TOKENS {
        crate::bail!(
            InvalidArgument,
            "speculation.max_tokens is {}; it must be in 1..={ENGINE_SPECULATION_MAX_TOKENS}",
            s.max_tokens
        );
    }
    if s.draft == engine_draft::Ngram && (s.ngram_min == 0 || s.ngram_min > s.ngram_max) {
        crate::bail!(
            InvalidArgument,
            "speculation.ngram_min is {} and ngram_max {}; they must satisfy 1 <= ngram_min <= ngram_max",
            s.ngram_min,
            s.ngram_max
        );
    }
    Ok(())
}

/// The longest pause, in steps, after proposals of one token keep being rejected.
const MOST_PAUSE: u32 = 32;

/// Proposals a stream's first verification may hold: one, doubled while all are accepted. Starting at
/// `max_tokens` made 16 streams whose drafts all miss verify 144 positions in their first step, 14 plain
/// steps' time on the H100's 8B shape.
const FIRST_LIMIT: u32 = 1;

/// The first pause after a lone proposal is rejected, doubled each time up to `MOST_PAUSE`.
const FIRST_PAUSE: u32 = 2;

/// A stream's speculation: its settings, its adaptive proposal length and its counts.
#[derive(Clone, Copy, Debug)]
pub struct SpecState {
    pub settings: engine_speculation,
    /// Proposals the next verification may hold (1..=max_tokens): `FIRST_LIMIT` at first, doubled after
    /// all were accepted, cut to one more than were accepted after a rejection, so a stream whose drafts
    /// miss pays for two positions rather than max_tokens + 1.
    limit: u32,
    /// Steps left that propose nothing, and the pause the next rejection of a lone proposal sets (doubled
    /// each time, up to `MOST_PAUSE`): a stream whose drafts always miss steps almost as without them.
    pause: u32,
    backoff: u32,
    /// Tokens proposed and accepted since the settings were last set.
    pub proposed: u64,
    pub accepted: u64,
}

impl SpecState {
    pub fn new(settings: engine_speculation) -> SpecState {
        SpecState::with_limit(settings, FIRST_LIMIT)
    }

    /// A stream's speculation whose next verification may hold `limit` proposals (clamped to
    /// 1..=max_tokens): for measuring a verification of a given length.
    pub fn with_limit(settings: engine_speculation, limit: u32) -> SpecState {
        let limit = limit.clamp(1, settings.max_tokens.max(1));
        SpecState { settings, limit, pause: 0, backoff: 0, proposed: 0, accepted: 0 }
    }

    /// Tokens this step may propose (0: none), counting down a pause.
    pub fn budget(&mut self) -> usize {
        if self.settings.draft == engine_draft::None {
            return 0;
        }
        if self.pause > 0 {
            self.pause -= 1;
            return 0;
        }
        self.limit as usize
    }

    /// A verification of `proposed` tokens kept `accepted` of them.
    pub fn record(&mut self, proposed: usize, accepted: usize) {
        self.proposed += proposed as u64;
        self.accepted += accepted as u64;
        let max = self.settings.max_tokens.max(1);
        if accepted == proposed {
            self.limit = (self.limit * 2).min(max);
            self.backoff = 0;
        } else {
            self.limit = (accepted as u32 + 1).min(max);
            if accepted == 0 && proposed == 1 {
                self.backoff = (self.backoff * 2).clamp(FIRST_PAUSE, MOST_PAUSE);
                self.pause = self.backoff;
            } else if accepted > 0 {
                self.backoff = 0;
            }
        }
    }
}

/// Prompt lookup: the tokens that followed the latest earlier occurrence of `history`'s last n tokens
/// (n from `ngram_max` down to `ngram_min`, the first n that occurs), at most `most` of them.
pub fn lookup(history: &[u32], ngram_min: usize, ngram_max: usize, most: usize) -> Vec<u32> {
    let len = history.len();
    if most == 0 || ngram_min == 0 {
        return Vec::new();
    }
    for n in (ngram_min..=ngram_max.min(len.saturating_sub(1))).rev() {
        let pattern = &history[len - n..];
        // Latest first: the start of an earlier occurrence, whose next token lies inside the history.
        if let Some(at) = (0..len - n).rev().find(|&i| &history[i..i + n] == pattern) {
            let from = at + n;
            return history[from..(from + most).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// How many of `proposals` verification keeps, given the target's token after each of the run's last
/// `proposals.len() + 1` positions: the proposals up to the first the target did not draw.
pub fn accepted(proposals: &[u32], drawn: &[u32]) -> usize {
    proposals.iter().zip(drawn).take_while(|(p, d)| p == d).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_takes_the_latest_longest_match() {
        let h = [1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3];
        assert_eq!(lookup(&h, 1, 3, 2), vec![4, 5]);
        assert_eq!(lookup(&h, 1, 3, 10), vec![4, 5, 1, 2, 3]);
        assert_eq!(lookup(&[7, 8, 9], 1, 3, 4), Vec::<u32>::new());
        assert_eq!(lookup(&[5, 5], 1, 3, 4), vec![5]);
        assert_eq!(lookup(&[1, 2, 1], 2, 2, 4), Vec::<u32>::new());
    }

    #[test]
    fn the_limit_adapts() {
        let s = engine_speculation { draft: engine_draft::Ngram, max_tokens: 8, ngram_min: 1, ngram_max: 3 };
        let mut st = SpecState::new(s);
        assert_eq!(st.budget(), 1);
        st.record(1, 1);
        assert_eq!(st.budget(), 2);
        st.record(2, 2);
        assert_eq!(st.budget(), 4);
        st.record(4, 4);
        assert_eq!(st.budget(), 8);
        st.record(8, 8);
        assert_eq!(st.budget(), 8);
        st.record(8, 2);
        assert_eq!(st.budget(), 3);
        st.record(3, 0);
        assert_eq!(st.budget(), 1);
        // A rejected lone proposal pauses 2 steps, then 4.
        st.record(1, 0);
        assert_eq!((st.budget(), st.budget(), st.budget()), (0, 0, 1));
        st.record(1, 0);
        assert_eq!((0..4).map(|_| st.budget()).collect::<Vec<_>>(), [0; 4]);
        assert_eq!(st.budget(), 1);
        st.record(1, 1);
        assert_eq!(st.budget(), 2);
        assert_eq!((st.proposed, st.accepted), (29, 18));
        assert_eq!(SpecState::with_limit(s, 20).budget(), 8);
    }
}
