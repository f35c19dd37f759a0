//! SentencePiece tokenization of a GGUF `llama` vocabulary (Llama 2, Mistral, and the models
//! converted from a `tokenizer.model`): pieces with scores, `▁` for a space, `<0xNN>` byte pieces for
//! what the vocabulary lacks.
//!
//! Encoding follows SentencePiece's BPE: the text (a space put before it, spaces written as `▁`)
//! starts as one symbol per character; the adjacent pair whose joined text is a piece with the highest
//! score (the leftmost among equals) merges, until no pair is a piece; a symbol left that is no piece
//! becomes the byte pieces of its UTF-8 bytes (or unknown). Control, user-defined and unknown tokens
//! written in the text are matched whole first, longest first, and text after one gets the space
//! prefix again, as llama.cpp does.

use super::token_type;
use crate::status::Result;
use crate::{bail, err};
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// The word boundary mark that stands for a space.
pub const SPACE_MARK: char = '\u{2581}';

/// A SentencePiece vocabulary ready to encode.
pub struct Spm {
    /// Piece text to id; the first id wins where the list repeats a text.
    ids: HashMap<String, u32>,
    /// Merge score of each id; ids that may not be formed by merging hold None.
    scores: Vec<Option<f32>>,
    byte_ids: [Option<u32>; 256],
    unknown: Option<u32>,
    /// Tokens matched whole in the text, longest first.
    specials: Vec<(String, u32)>,
    add_space_prefix: bool,
}

/// A candidate merge of two adjacent symbols.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Bytes of the joined text when the candidate was made; a merge since makes it stale.
    len: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// The heap's top is the highest score, then the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then_with(|| other.left.cmp(&self.left))
    }
}

/// One symbol of the text being merged: a byte range, linked to its neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    /// Checks the vocabulary: scores (when given) and types one per token, every byte piece well formed.
    pub fn new(tokens: &[String], scores: &[f32], token_types: &[i32], add_space_prefix: bool) -> Result<Spm> {
        if !scores.is_empty() && scores.len() != tokens.len() {
            bail!(BadModel, "GGUF tokenizer.ggml.scores has {} entries for {} tokens", scores.len(), tokens.len());
        }
        let kind = |id: usize| token_types.get(id).copied().unwrap_or(token_type::NORMAL);
        let mut ids = HashMap::with_capacity(tokens.len());
        let mut byte_ids = [None; 256];
        let mut unknown = None;
        let mut specials = Vec::new();
        let mut merge_scores = Vec::with_capacity(tokens.len());
        for (id, token) in tokens.iter().enumerate() {
            let id32 = u32::try_from(id).map_err(|_| err!(BadModel, "GGUF tokenizer.ggml.tokens: too many tokens"))?;
            ids.entry(token.clone()).or_insert(id32);
            let score = scores.get(id).copied().unwrap_or(0.0);
            merge_scores.push(match kind(id) {
                token_type::NORMAL | token_type::USER_DEFINED => Some(score),
                _ => None,
            });
            match kind(id) {
                token_type::BYTE => {
                    let byte = super::byte_token(token).ok_or_else(|| {
                        err!(BadModel, "GGUF tokenizer.ggml.tokens[{id}] \"{token}\" is a byte token but not <0xNN>")
                    })?;
                    byte_ids[byte as usize].get_or_insert(id32);
                }
                token_type::UNKNOWN => {
                    unknown.get_or_insert(id32);
                    specials.push((token.clone(), id32));
                }
                token_type::CONTROL | token_type::USER_DEFINED => specials.push((token.clone(), id32)),
                _ => {}
            }
        }
        // Files without token types still name their byte pieces <0xNN>.
        if token_types.is_empty() {
            for (id, token) in tokens.iter().enumerate() {
                if let Some(byte) = super::byte_token(token) {
                    byte_ids[byte as usize].get_or_insert(id as u32);
                }
            }
            unknown = ids.get("<unk>").copied();
        }
        // A character the pieces lack becomes its bytes' pieces, or unknown: with neither, text is lost.
        if unknown.is_none() && byte_ids.iter().any(Option::is_none) {
            bail!(
                Unsupported,
                "GGUF SentencePiece vocabulary has neither an unknown token nor a <0xNN> piece for every byte, so \
                 some text has no ids"
            );
        }
        specials.retain(|(text, _)| !text.is_empty());
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        Ok(Spm { ids, scores: merge_scores, byte_ids, unknown, specials, add_space_prefix })
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.ids.get(token).copied()
    }

    /// Appends the ids of `text` to `out`.
    pub fn encode(&self, text: &str, out: &mut Vec<u32>) {
        // Special tokens first: the text becomes runs of plain text and special ids.
        let mut fragments: Vec<std::result::Result<&str, u32>> = vec![Ok(text)];
        for (special, id) in &self.specials {
            let mut split = Vec::with_capacity(fragments.len());
            for fragment in fragments {
                let Ok(plain) = fragment else {
                    split.push(fragment);
                    continue;
                };
                let mut rest = plain;
                while let Some(at) = rest.find(special.as_str()) {
                    split.push(Ok(&rest[..at]));
                    split.push(Err(*id));
                    rest = &rest[at + special.len()..];
                }
                split.push(Ok(rest));
            }
            fragments = split;
        }
        let mut after_special = true;
        for fragment in fragments {
            match fragment {
                Ok("") => {}
                Ok(plain) => {
                    let mut word = String::with_capacity(plain.len() + 3);
                    if self.add_space_prefix && after_special {
                        word.push(SPACE_MARK);
                    }
                    word.extend(plain.chars().map(|c| if c == ' ' { SPACE_MARK } else { c }));
                    self.encode_word(&word, out);
                    after_special = false;
                }
                Err(id) => {
                    out.push(id);
                    after_special = true;
                }
            }
        }
    }

    /// The merge score of `text` when it is a piece that merging may form.
    fn score(&self, text: &str) -> Option<f32> {
        self.ids.get(text).and_then(|&id| self.scores[id as usize])
    }

    fn encode_word(&self, word: &str, out: &mut Vec<u32>) {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(word.len());
        for (i, (start, c)) in word.char_indices().enumerate() {
            symbols.push(Symbol { start, len: c.len_utf8(), prev: i.checked_sub(1), next: None });
            if i > 0 {
                symbols[i - 1].next = Some(i);
            }
        }
        let mut heap = BinaryHeap::new();
        let candidate = |symbols: &[Symbol], left: usize, right: usize| -> Option<Bigram> {
            let (l, r) = (symbols[left], symbols[right]);
            let text = &word[l.start..r.start + r.len];
            self.score(text).map(|score| Bigram { score, left, right, len: text.len() })
        };
        for i in 1..symbols.len() {
            heap.extend(candidate(&symbols, i - 1, i));
        }
        while let Some(bigram) = heap.pop() {
            let (left, right) = (symbols[bigram.left], symbols[bigram.right]);
            if left.len == 0 || right.len == 0 || left.len + right.len != bigram.len || left.next != Some(bigram.right)
            {
                continue;
            }
            symbols[bigram.left].len += right.len;
            symbols[bigram.right].len = 0;
            symbols[bigram.left].next = right.next;
            if let Some(next) = right.next {
                symbols[next].prev = Some(bigram.left);
            }
            if let Some(prev) = left.prev {
                heap.extend(candidate(&symbols, prev, bigram.left));
            }
            if let Some(next) = right.next {
                heap.extend(candidate(&symbols, bigram.left, next));
            }
        }
        let mut at = if symbols.is_empty() { None } else { Some(0) };
        while let Some(i) = at {
            let s = symbols[i];
            let text = &word[s.start..s.start + s.len];
            match self.ids.get(text) {
                Some(&id) => out.push(id),
                None => {
                    for &b in text.as_bytes() {
                        out.extend(self.byte_ids[b as usize].or(self.unknown));
                    }
                }
            }
            at = s.next;
        }
    }
}

/// The bytes a SentencePiece token stands for: its byte for `<0xNN>`, a space for each `▁` in a
/// normal piece, the text itself for control, unknown and user-defined tokens.
pub fn piece(token: &str, kind: i32) -> Vec<u8> {
    match kind {
        token_type::BYTE => super::byte_token(token).map_or_else(|| token.as_bytes().to_vec(), |b| vec![b]),
        token_type::NORMAL => token.replace(SPACE_MARK, " ").into_bytes(),
        _ => token.as_bytes().to_vec(),
    }
}
