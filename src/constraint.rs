//! Constrained output (`engine_set_constraint`): a stream's tokens held to a JSON schema, a regular
//! expression or a Lark grammar. llguidance compiles the constraint and, at each step, gives the set of
//! tokens allowed next (the mask); the sampler draws among those alone (`sampler::sample_stream_masked`).
//!
//! `Grammars` is the model's vocabulary as llguidance reads it (each id's exact bytes, control tokens
//! marked as such, the end-of-generation ids as its EOS set), built once per engine when the first
//! constraint is set. A `Constraint` is one stream's matcher plus the tokens it has taken, so that
//! truncate and reset roll it back with the stream. Its first token is the one the stream samples at the
//! end of the first step after it was set; from then on every token appended to the stream goes through
//! the matcher before the step runs (a token it refuses fails the item), and the mask for the step's
//! sampled token is computed on another thread while the forward runs (`PendingMask`).

use crate::abi::engine_constraint;
use crate::status::{Error, Result, Status};
use crate::tokenizer::Tokenizer;
use crate::{bail, err};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use std::sync::{Arc, OnceLock};

/// The model's vocabulary as llguidance sees it, and the factory that compiles constraints over it.
pub struct Grammars {
    factory: ParserFactory,
    eog: Arc<Eog>,
}

/// The end-of-generation ids: the only tokens a complete constraint allows.
struct Eog {
    ids: Vec<u32>,
    set: SimpleVob,
}

/// llguidance's tokenizer interface over the model's own tokenizer.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        // llguidance tokenizes text a grammar forces, to allow the model's own split of it. The
        // tokenizer's ids serve where their bytes are exactly `s` (a SentencePiece vocabulary adds a
        // space in front, a control token's name is not its text); the trie's longest-match split, whose
        // bytes always are, serves otherwise.
        let exact = |ids: &Vec<u32>| ids.iter().flat_map(|&id| self.trie.token(id)).copied().eq(s.iter().copied());
        match std::str::from_utf8(s).ok().and_then(|text| self.tokenizer.encode(text, None).ok()) {
            Some(ids) if exact(&ids) => ids,
            _ => self.trie.greedy_tokenize(s),
        }
    }
}

/// The bytes llguidance matches for each id below `vocab`: a text token's exact bytes; a control token
/// (or an end-of-generation id) as 0xFF then its name, which no text matches (0xFF is never in UTF-8);
/// padding rows and ids the tokenizer lacks as nothing, which no constraint allows.
fn token_bytes(tokenizer: &Tokenizer, vocab: usize, eog: &[u32]) -> Result<Vec<Vec<u8>>> {
    let mut words = Vec::with_capacity(vocab);
    for id in 0..vocab as u32 {
        let piece: &[u8] = if (id as usize) < tokenizer.vocab_size() { tokenizer.piece_ref(id)? } else { &[] };
        words.push(if tokenizer.is_special(id) || eog.contains(&id) {
            let name = if piece.is_empty() { format!("<[{id}]>").into_bytes() } else { piece.to_vec() };
            [&[TokTrie::SPECIAL_TOKEN_MARKER][..], &name].concat()
        } else {
            piece.to_vec()
        });
    }
    Ok(words)
}

/// An llguidance failure (or a panic inside it) as `status` with its message.
fn llg_error(status: Status, what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(status, format!("{what}: {e}"))
}

/// Runs a call into llguidance; a panic inside it becomes `status` (and prints nothing).
fn llg_call<T>(status: Status, what: &str, f: impl FnOnce() -> T) -> Result<T> {
    crate::status::catch_quietly(f)
        .map_err(|panic| llg_error(status, what, format!("panic: {}", crate::status::panic_text(&*panic))))
}

impl Grammars {
    /// llguidance's view of a model whose logits have `vocab` entries, with `tokenizer`'s pieces as the
    /// tokens' bytes and `eog` (the model's end-of-generation ids) as the tokens that end an output.
    pub fn new(tokenizer: Arc<Tokenizer>, vocab: usize, eog: &[u32]) -> Result<Grammars> {
        let Some(&first) = eog.first() else {
            bail!(Unsupported, "constraints need an end-of-generation token, and the model names none");
        };
        if let Some(&bad) = eog.iter().find(|&&id| id as usize >= vocab) {
            bail!(BadModel, "end-of-generation id {bad} is outside the vocabulary (0..{vocab})");
        }
        let vocab32 = u32::try_from(vocab).map_err(|_| err!(BadModel, "a vocabulary of {vocab} ids"))?;
        let words = token_bytes(&tokenizer, vocab, eog)?;
        let trie = llg_call(Status::BadModel, "the vocabulary's token trie", || {
            TokTrie::from(&TokRxInfo::new(vocab32, first), &words).with_eos_tokens(eog)
        })?;
        let set = trie.eos_token_set();
        let env: TokEnv = Arc::new(Vocabulary { trie, tokenizer });
        let mut factory = llg_call(Status::BadModel, "llguidance", || ParserFactory::new_simple(&env))?
            .map_err(|e| llg_error(Status::BadModel, "llguidance", format!("{e:#}")))?;
        // Nothing on the host's stderr; errors name the fault without dumping the parser's state.
        factory.quiet();
        factory.limits_mut().verbose_errors = false;
        Ok(Grammars { factory, eog: Arc::new(Eog { ids: eog.to_vec(), set }) })
    }

    /// Compiles a constraint of `kind` from `text` (JSON and NONE take none). INVALID_ARGUMENT with
    /// llguidance's message for a schema, regex or grammar it refuses. NONE is no constraint.
    pub fn compile(&self, kind: engine_constraint, text: &str) -> Result<Option<Constraint>> {
        let grammar = match kind {
            engine_constraint::None => {
                check_no_text(kind, text)?;
                return Ok(None);
            }
            engine_constraint::JsonSchema => {
                let schema = serde_json::from_str(text)
                    .map_err(|e| err!(InvalidArgument, "the JSON schema is not JSON: {e}"))?;
                TopLevelGrammar::from_json_schema(with_bounded_whitespace(schema))
            }
            engine_constraint::Regex => TopLevelGrammar::from_regex(text),
            engine_constraint::Lark => TopLevelGrammar::from_lark(text.to_string()),
            engine_constraint::Json => {
                check_no_text(kind, text)?;
                TopLevelGrammar::from_json_schema(with_bounded_whitespace(serde_json::json!({})))
            }
        };
        let what = kind_name(kind);
        let parser = llg_call(Status::InvalidArgument, what, || self.factory.create_parser(grammar))?
            .map_err(|e| llg_error(Status::InvalidArgument, what, format!("{e:#}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(llg_error(Status::InvalidArgument, what, e));
        }
        Ok(Some(Constraint {
            fresh: matcher.clone(),
            matcher,
            start: None,
            tokens: Vec::new(),
            fed: 0,
            eog: Arc::clone(&self.eog),
        }))
    }
}

/// Whitespace between two JSON tokens, where the schema's `x-guidance` does not say: what JSON allows,
/// at most 20 characters at a time (as llama.cpp's grammars bound it), so that a model cannot loop on
/// blank lines and never end its output.
pub const JSON_WHITESPACE: &str = r"[\x20\x0A\x0D\x09]{1,20}";

/// `schema` with llguidance's JSON options set to `JSON_WHITESPACE`, unless it sets them itself.
fn with_bounded_whitespace(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(map) = schema.as_object_mut()
        && !map.contains_key("x-guidance")
    {
        map.insert("x-guidance".into(), serde_json::json!({ "whitespace_pattern": JSON_WHITESPACE }));
    }
    schema
}

/// NONE and JSON take no text: one given is a mistake worth reporting.
pub fn check_no_text(kind: engine_constraint, text: &str) -> Result<()> {
    if !text.is_empty() {
        bail!(InvalidArgument, "{} takes no text; {} bytes were given", kind_name(kind), text.len());
    }
    Ok(())
}

/// The C name of a kind, for messages.
pub fn kind_name(kind: engine_constraint) -> &'static str {
    match kind {
        engine_constraint::None => "ENGINE_CONSTRAINT_NONE",
        engine_constraint::JsonSchema => "ENGINE_CONSTRAINT_JSON_SCHEMA",
        engine_constraint::Regex => "ENGINE_CONSTRAINT_REGEX",
        engine_constraint::Lark => "ENGINE_CONSTRAINT_LARK",
        engine_constraint::Json => "ENGINE_CONSTRAINT_JSON",
    }
}

/// One stream's constraint and the tokens it has taken.
pub struct Constraint {
    /// The compiled constraint before any token, for a rebuild where a rollback cannot be made.
    fresh: Matcher,
    matcher: Matcher,
    /// The stream position of the constraint's first token; None until a step after it was set.
    start: Option<usize>,
    /// The stream's tokens from `start` on: the first `fed` went through the matcher, the rest are
    /// end-of-generation tokens after it completed.
    tokens: Vec<u32>,
    fed: usize,
    eog: Arc<Eog>,
}

impl Constraint {
    /// Whether the constraint is complete: its output ended, only end-of-generation tokens follow.
    fn complete(&self) -> bool {
        self.matcher.is_stopped() && !self.matcher.is_error()
    }

    /// Takes the tokens a step appends at positions `len..` of its stream (none before the constraint's
    /// first step). INVALID_ARGUMENT, with nothing taken, for a token the constraint does not allow.
    pub fn feed(&mut self, len: usize, new: &[u32]) -> Result<()> {
        let Some(start) = self.start else { return Ok(()) };
        debug_assert_eq!(start + self.tokens.len(), len, "the constraint follows its stream");
        let before = self.tokens.len();
        for (k, &t) in new.iter().enumerate() {
            let taken = if self.complete() {
                self.eog.ids.contains(&t)
            } else {
                match self.matcher.try_consume_tokens(&[t]) {
                    Ok(1) => {
                        self.fed += 1;
                        true
                    }
                    _ => false,
                }
            };
            if !taken {
                let why = match self.matcher.get_error() {
                    Some(e) => format!(": {e}"),
                    None if self.complete() => {
                        ": the constraint is complete, only end-of-generation tokens follow".into()
                    }
                    None => String::new(),
                };
                self.keep(before);
                bail!(
                    InvalidArgument,
                    "token {t} at position {} is not allowed by the stream's constraint{why}",
                    len + k
                );
            }
            self.tokens.push(t);
        }
        Ok(())
    }

    /// After a step stepped the stream to `len` positions: the constraint's first token is the one just
    /// sampled, at position `len`, when it had none.
    pub fn stepped(&mut self, len: usize) {
        self.start.get_or_insert(len);
    }

    /// Follows the stream back to its first `len` positions (truncate, reset, a failed step): the tokens
    /// past them are given back; before the constraint's first token it starts afresh.
    pub fn rollback(&mut self, len: usize) {
        match self.start {
            Some(start) if len >= start => self.keep(len - start),
            Some(_) => {
                self.start = None;
                self.keep(0);
            }
            None => {}
        }
    }

    /// Keeps the first `keep` tokens taken.
    fn keep(&mut self, keep: usize) {
        if keep >= self.tokens.len() {
            return;
        }
        self.tokens.truncate(keep);
        if self.fed > keep {
            let undo = self.fed - keep;
            self.fed = keep;
            if keep == 0 || self.matcher.rollback(undo).is_err() {
                // The tokens kept went through a matcher of this grammar before; they go through again.
                self.matcher = self.fresh.clone();
                let _ = self.matcher.consume_tokens(&self.tokens[..self.fed]);
            }
        }
    }

    /// The tokens allowed next: llguidance's mask, the end-of-generation ids where the output is
    /// complete, never empty. INVALID_ARGUMENT where llguidance fails (a grammar past its limits).
    pub fn mask(&mut self) -> Result<SimpleVob> {
        if self.complete() {
            return Ok(self.eog.set.clone());
        }
        let mask =
            self.matcher.compute_mask().map_err(|e| err!(InvalidArgument, "the stream's constraint failed: {e:#}"))?;
        Ok(if mask.is_zero() { self.eog.set.clone() } else { mask })
    }
}

impl Constraint {
    /// The mask of `mask` as words of `vocab` bits (bit `i % 32` of word `i / 32`), none past `vocab`; a
    /// panic inside llguidance becomes an error.
    pub fn allowed_words(&mut self, vocab: usize) -> Result<Vec<u32>> {
        let mask = llg_call(Status::Panic, "the constraint's mask", || self.mask())??;
        let mut words = vec![0u32; vocab.div_ceil(32)];
        for (w, &m) in words.iter_mut().zip(mask.as_slice()) {
            *w = m;
        }
        if !vocab.is_multiple_of(32)
            && let Some(last) = words.last_mut()
        {
            *last &= (1u32 << (vocab % 32)) - 1;
        }
        Ok(words)
    }
}

/// A mask computed on another thread while the forward runs: the sampler waits for it.
#[derive(Default)]
pub struct PendingMask(OnceLock<Result<SimpleVob>>);

impl PendingMask {
    pub fn new() -> PendingMask {
        PendingMask::default()
    }

    /// Computes `c`'s mask into this one; a panic inside becomes its error.
    pub fn compute(&self, c: &mut Constraint) {
        let mask = llg_call(Status::Panic, "the constraint's mask", || c.mask()).and_then(|m| m);
        let _ = self.0.set(mask);
    }

    /// The allowed ids (bit `i % 32` of word `i / 32`), once computed; None where computing failed.
    pub fn wait(&self) -> Option<&[u32]> {
        self.0.wait().as_ref().ok().map(SimpleVob::as_slice)
    }

    /// Why the mask could not be computed (waits for it).
    pub fn error(&self) -> Option<Error> {
        self.0.wait().as_ref().err().cloned()
    }
}
