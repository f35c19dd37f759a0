//! What the speculative decoding tests share: tiny models, the calls through the C ABI, and a
//! generation loop that takes every token a step produces.

use super::{Held, Rng};
use hostembed::Status;
use hostembed::abi::{engine_batch_item, engine_draft, engine_speculation};
use hostembed::ffi;
use hostembed::model::{Arch, ModelConfig};
use hostembed::status::last_error;

/// The speculative tests' model of `arch` (Llama, or Qwen2 with its tied head and q/k/v biases) on
/// `base`'s shape.
pub fn shaped(arch: Arch, base: ModelConfig) -> ModelConfig {
    ModelConfig {
        arch,
        rope_theta: 10000.0,
        max_position: 512,
        tied: arch == Arch::Qwen2,
        qkv_bias: arch == Arch::Qwen2,
        bos: Some(1),
        eos: Some(2),
        ..base
    }
}

/// `shaped` small enough for the CPU tests: hidden 64, 2 layers, vocabulary 64.
pub fn tiny(arch: Arch) -> ModelConfig {
    shaped(arch, ModelConfig::llama(64, 2, 4, 2, 96, 64))
}

pub fn lookup(max_tokens: u32) -> engine_speculation {
    engine_speculation { draft: engine_draft::Ngram, max_tokens, ngram_min: 1, ngram_max: 3 }
}

/// The drafter model's proposals, at most `max_tokens` a step.
pub fn drafted(max_tokens: u32) -> engine_speculation {
    engine_speculation { draft: engine_draft::Model, max_tokens, ..lookup(max_tokens) }
}

pub fn set_speculation(e: &Held, stream: u32, s: &engine_speculation) -> Status {
    // SAFETY: a live engine and a live struct.
    unsafe { ffi::engine_set_speculation(e.0, stream, s) }
}

pub fn spec_stats(e: &Held, stream: u32) -> (u64, u64) {
    let (mut p, mut a) = (u64::MAX, u64::MAX);
    // SAFETY: a live engine and two writable counters.
    let st = unsafe { ffi::engine_speculation_stats(e.0, stream, &mut p, &mut a) };
    assert_eq!(st, Status::Ok, "{}", last_error());
    (p, a)
}

/// One item: a stream, its tokens, and the room its `out` has (0: no out).
pub struct Item<'a> {
    pub stream: u32,
    pub tokens: &'a [i32],
    pub cap: usize,
}

/// engine_step_batch's status and each item's (status, next, out).
pub fn batch(e: &Held, items: &[Item<'_>]) -> (Status, Vec<(Status, i32, Vec<i32>)>) {
    let mut outs: Vec<Vec<i32>> = items.iter().map(|i| vec![-9; i.cap]).collect();
    let mut c: Vec<engine_batch_item> = items
        .iter()
        .zip(outs.iter_mut())
        .map(|(i, out)| engine_batch_item {
            stream: i.stream,
            tokens: i.tokens.as_ptr(),
            n: i.tokens.len(),
            next: -7,
            status: Status::Panic,
            out: if i.cap == 0 { std::ptr::null_mut() } else { out.as_mut_ptr() },
            out_cap: i.cap,
            n_out: usize::MAX,
        })
        .collect();
    // SAFETY: a live engine and items whose pointers live across the call.
    let st = unsafe { ffi::engine_step_batch(e.0, c.as_mut_ptr(), c.len()) };
    let res = c
        .iter()
        .zip(&outs)
        .map(|(i, out)| {
            let got = if i.out.is_null() {
                if i.status == Status::Ok {
                    assert_eq!(i.n_out, 1, "a plain item produces one token");
                }
                vec![i.next]
            } else {
                assert!(i.n_out <= i.out_cap, "n_out {} past out_cap {}", i.n_out, i.out_cap);
                out[..i.n_out].to_vec()
            };
            if i.status == Status::Ok {
                assert_eq!(got.last(), Some(&i.next), "the last token out is next");
                assert!(out[i.n_out.min(out.len())..].iter().all(|&t| t == -9), "written past n_out");
            }
            (i.status, i.next, got)
        })
        .collect();
    (st, res)
}

/// The tokens after `prompt` on `stream` until at least `n`, `cap` the out room of each step (0: one
/// token a step); the stream holds all but the last.
pub fn generate(e: &Held, stream: u32, prompt: &[i32], n: usize, cap: usize) -> Vec<i32> {
    let mut got = Vec::new();
    let mut input = prompt.to_vec();
    while got.len() < n {
        let (st, items) = batch(e, &[Item { stream, tokens: &input, cap }]);
        assert_eq!(st, Status::Ok, "{}", last_error());
        let (ist, next, out) = &items[0];
        assert_eq!(*ist, Status::Ok, "{}", last_error());
        got.extend_from_slice(out);
        input = vec![*next];
    }
    got
}

/// Generates `n` tokens after `prompt` on stream 0 of `plain`, and of `spec` speculating as `speculation`
/// says with `cap` the out room of each step; asserts they are the same tokens and returns what `spec`
/// generated (at least `n` tokens; its stream holds all but the last) and the stream's (proposed,
/// accepted). Both streams are left as they are.
pub fn speculated_as_plain(
    spec: &Held,
    plain: &Held,
    speculation: &engine_speculation,
    prompt: &[i32],
    n: usize,
    cap: usize,
    what: &str,
) -> (Vec<i32>, (u64, u64)) {
    assert_eq!(set_speculation(spec, 0, speculation), Status::Ok, "{what}: {}", last_error());
    let want = generate(plain, 0, prompt, n, 0);
    let got = generate(spec, 0, prompt, n, cap);
    assert_eq!(got[..n], want[..n], "{what}");
    let (proposed, accepted) = spec_stats(spec, 0);
    assert!(accepted <= proposed, "{what}: accepted {accepted} of {proposed}");
    (got, (proposed, accepted))
}

/// A prompt that repeats itself, with changes: what prompt lookup pays off on.
pub fn repeating_prompt(rng: &mut Rng, vocab: usize) -> Vec<i32> {
    let len = 6 + rng.below(10) as usize;
    let line = rng.ids(vocab, len);
    let mut p = Vec::new();
    for _ in 0..2 + rng.below(3) {
        let mut l = line.clone();
        let at = rng.below(l.len() as u64) as usize;
        l[at] = rng.below(vocab as u64) as i32;
        p.extend(l);
    }
    p
}

/// The streams of a random-batch test: each one's prompt, the tokens its cache holds, its next input,
/// and the out room its speculation needs.
pub struct RandomStreams {
    pub prompts: Vec<Vec<i32>>,
    pub held: Vec<Vec<i32>>,
    pub input: Vec<Vec<i32>>,
    pub caps: Vec<usize>,
}

impl RandomStreams {
    /// Streams that start from `prompts`, with out rooms `caps`.
    pub fn new(prompts: Vec<Vec<i32>>, caps: Vec<usize>) -> RandomStreams {
        let n = prompts.len();
        RandomStreams { input: prompts.clone(), prompts, held: vec![Vec::new(); n], caps }
    }

    /// Steps a random subset of the streams in one batch of `e` (one in `no_out` of them without an out),
    /// and checks each one's tokens against `reference` stepping it alone, one token at a time, without
    /// speculation; a stream out of room (which it must be) starts its prompt again.
    pub fn step(&mut self, e: &Held, reference: &Held, rng: &mut Rng, no_out: u64, window: usize, what: &str) {
        let mut chosen: Vec<usize> = (0..self.prompts.len()).filter(|_| rng.below(3) > 0).collect();
        rng.shuffle(&mut chosen);
        let items: Vec<Item<'_>> = chosen
            .iter()
            .map(|&s| Item {
                stream: s as u32,
                tokens: &self.input[s],
                cap: if rng.below(no_out) == 0 { 0 } else { self.caps[s] },
            })
            .collect();
        let (st, res) = batch(e, &items);
        assert_eq!(st, Status::Ok, "{what}: {}", last_error());
        for (&s, (ist, next, out)) in chosen.iter().zip(res) {
            if ist == Status::NoRoom {
                let need = self.held[s].len() + self.input[s].len() + self.caps[s];
                assert!(need > window, "{what}, stream {s}: out of room with {need} of {window}");
                super::reset(e, s as u32);
                self.held[s].clear();
                self.input[s] = self.prompts[s].clone();
                continue;
            }
            assert_eq!(ist, Status::Ok, "{what}, stream {s}: {}", last_error());
            self.held[s].extend_from_slice(&self.input[s]);
            super::reset(reference, 0);
            let mut want = vec![super::step(reference, 0, &self.held[s])];
            while want.len() < out.len() {
                want.push(super::step(reference, 0, &want[want.len() - 1..]));
            }
            assert_eq!(out, want, "{what}, stream {s}");
            self.held[s].extend_from_slice(&out[..out.len() - 1]);
            self.input[s] = vec![next];
        }
    }

    /// How many tokens each stream's cache holds.
    pub fn lens(&self) -> Vec<usize> {
        self.held.iter().map(Vec::len).collect()
    }
}
