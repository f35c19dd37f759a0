//! The one type a batch item has between the engine and the backends. `Engine::step_batch` checks the
//! caller's items (`engine_batch_item`) once and makes a `BatchItem` of each: a stream, its ids (in the
//! vocabulary, within the stream's room), the most tokens its step may produce, or the reason it was
//! refused. A `Batch` of them names each stream once, which `Batch::new` alone checks; a `Decoder` steps
//! a `Batch` and never asks again. What a backend is then handed (`StepItem`) is not the item again but
//! what `Streams` made of it: the stream's KV state, the run with its proposals, its sampler and mask.

use std::collections::HashSet;
use std::ops::Deref;

use super::not_run;
use crate::bail;
use crate::status::{Error, Result};

/// One item of a batched step: a stream, the ids to append, how many tokens the step may produce, and
/// (out) what it produced. An item refused before it reached a `Decoder` holds its reason in `next` and
/// is not stepped.
pub struct BatchItem<'a> {
    stream: u32,
    /// The ids to append, each in the vocabulary (an engine's item) or the backend's to trust (an item
    /// a `Decoder` makes for itself, such as a drafter's).
    pub tokens: &'a [u32],
    /// Tokens the step may produce for this stream: 1 steps one token; more lets the stream's
    /// speculation propose up to this many less one.
    pub most: usize,
    /// Out: the token sampled after the item's tokens (the last of `out`); an Err item appended nothing.
    pub next: Result<u32>,
    /// Out: every token the step produced (accepted proposals, then `next`).
    pub out: Vec<u32>,
    refused: bool,
}

impl<'a> BatchItem<'a> {
    /// A plain step of `tokens` on `stream`: one token drawn after the last.
    pub fn new(stream: u32, tokens: &'a [u32]) -> BatchItem<'a> {
        BatchItem { stream, tokens, most: 1, next: Err(not_run()), out: Vec::new(), refused: false }
    }

    /// A step that may produce up to `most` tokens (speculation, where the stream has it on).
    pub fn with_most(mut self, most: usize) -> BatchItem<'a> {
        self.most = most.max(1);
        self
    }

    /// An item of `stream` refused before any step, for `why`: it keeps its place in the batch (its
    /// stream still counts as named) and is not stepped.
    pub fn refused(stream: u32, why: Error) -> BatchItem<'a> {
        BatchItem { stream, tokens: &[], most: 1, next: Err(why), out: Vec::new(), refused: true }
    }

    pub fn stream(&self) -> u32 {
        self.stream
    }

    /// Whether the item was refused before the step (a `Decoder` leaves it as it is).
    pub fn is_refused(&self) -> bool {
        self.refused
    }
}

/// The items of one batched step, each stream named once: what `Decoder::step_batch` takes.
pub struct Batch<'a> {
    items: Vec<BatchItem<'a>>,
}

impl<'a> Batch<'a> {
    /// The items, in the caller's order; INVALID_ARGUMENT, naming it and where, for a stream named
    /// twice (refused items count: the caller named their streams).
    pub fn new(items: Vec<BatchItem<'a>>) -> Result<Batch<'a>> {
        let mut named = HashSet::with_capacity(items.len());
        if let Some(k) = items.iter().position(|i| !named.insert(i.stream)) {
            bail!(InvalidArgument, "items[{k}] names stream {}, which an earlier item names too", items[k].stream);
        }
        Ok(Batch { items })
    }

    /// The items, to step them or to read what the step wrote (their streams stay as they are).
    pub fn items_mut(&mut self) -> &mut [BatchItem<'a>] {
        &mut self.items
    }

    pub fn into_items(self) -> Vec<BatchItem<'a>> {
        self.items
    }
}

impl<'a> Deref for Batch<'a> {
    type Target = [BatchItem<'a>];
    fn deref(&self) -> &[BatchItem<'a>] {
        &self.items
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Status;

    #[test]
    fn a_stream_named_twice_is_refused_even_beside_a_refused_item() {
        let (a, b) = ([1u32, 2], [3u32]);
        assert!(Batch::new(vec![BatchItem::new(0, &a), BatchItem::new(1, &b)]).is_ok());
        let twice = Batch::new(vec![BatchItem::new(4, &a), BatchItem::new(1, &b), BatchItem::new(4, &b)]);
        let e = twice.err().unwrap();
        assert_eq!(e.status, Status::InvalidArgument);
        assert_eq!(e.message, "items[2] names stream 4, which an earlier item names too");
        let refused = BatchItem::refused(4, crate::err!(OutOfRange, "no such stream"));
        assert!(refused.is_refused() && refused.next.is_err());
        assert!(Batch::new(vec![refused, BatchItem::new(4, &b)]).is_err(), "a refused item names its stream too");
        assert!(Batch::new(Vec::new()).is_ok_and(|b| b.is_empty()));
    }
}
