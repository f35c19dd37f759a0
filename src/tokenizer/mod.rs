//! Text to token ids and back: a `tokenizer.json` beside the weights, or the vocabulary a GGUF
//! carries in `tokenizer.ggml.*`: byte-level BPE (`gpt2`, with the split its `pre` names, `pre.rs`)
//! run by the `tokenizers` crate, or SentencePiece (`llama`, `spm.rs`). `special.rs` holds what the
//! model says about BOS, EOS and end of generation, `chat.rs` its chat template. `json.rs` checks a
//! `tokenizer.json` before the crate reads it, `gguf.rs` builds a GGUF's vocabulary, `convert.rs` makes
//! the vocabularies the writers use.

pub mod chat;
mod convert;
mod gguf;
mod json;
pub mod pre;
pub mod special;
pub mod spm;

pub use convert::{GgufBpeVocab, gguf_bpe_vocab, train_byte_level_bpe};
use json::{check_json_ids, check_merges, check_patterns, json_merges, without_thread_cache};

use crate::checkpoint::TokenizerSource;
use crate::status::{Error, Result, Status};
use crate::{bail, err};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;
use tokenizers::DecoderWrapper;

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's numbering).
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// A loaded tokenizer and the bytes each of its tokens stands for.
pub struct Tokenizer {
    model: Model,
    /// Indexed by id: what the token adds to the text (empty for ids the vocabulary skips and padding).
    pieces: Vec<Vec<u8>>,
    /// Ids that stand for a control token (`<|im_end|>`, `<unk>`), never for their text; ascending.
    special: Vec<u32>,
    /// What the load has to say that does not stop it (an unknown pre-tokenizer name), one line each.
    notes: Vec<String>,
    /// Whether BOS goes first when the model's keys do not say, for a GGUF vocabulary (its kind or its
    /// pre-tokenizer family); None for a tokenizer.json, whose post-processor says.
    default_add_bos: Option<bool>,
}

/// What turns text into ids.
enum Model {
    Hf(Box<tokenizers::Tokenizer>),
    Spm(Box<spm::Spm>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab_size", &self.pieces.len()).finish()
    }
}

/// How the tokenizer's decoder turns a token's text into bytes.
#[derive(Default)]
struct PieceRules {
    byte_level: bool,
    byte_fallback: bool,
    /// (pattern, replacement) pairs applied in order, e.g. ("▁", " ") for sentencepiece vocabularies.
    replace: Vec<(String, String)>,
}

impl PieceRules {
    /// Reads the decoder through its serialized form, so nested sequences need no per-type code.
    fn of(decoder: Option<&DecoderWrapper>) -> PieceRules {
        let mut rules = PieceRules::default();
        if let Some(json) = decoder.and_then(|d| serde_json::to_value(d).ok()) {
            rules.collect(&json);
        }
        rules
    }

    fn collect(&mut self, decoder: &Value) {
        match decoder.get("type").and_then(Value::as_str) {
            Some("ByteLevel") => self.byte_level = true,
            Some("ByteFallback") => self.byte_fallback = true,
            Some("Metaspace") => {
                let mark = decoder.get("replacement").and_then(Value::as_str).unwrap_or("\u{2581}");
                self.replace.push((mark.to_string(), " ".to_string()));
            }
            Some("Replace") => {
                let pattern = decoder.pointer("/pattern/String").and_then(Value::as_str);
                let content = decoder.get("content").and_then(Value::as_str);
                if let (Some(p), Some(c)) = (pattern, content) {
                    self.replace.push((p.to_string(), c.to_string()));
                }
            }
            Some("Sequence") => {
                for d in decoder.get("decoders").and_then(Value::as_array).into_iter().flatten() {
                    self.collect(d);
                }
            }
            _ => {}
        }
    }

    fn piece(&self, token: &str, char_bytes: &std::collections::HashMap<char, u8>) -> Vec<u8> {
        if self.byte_level {
            let mut out = Vec::with_capacity(token.len());
            for c in token.chars() {
                match char_bytes.get(&c) {
                    Some(&b) => out.push(b),
                    None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                }
            }
            return out;
        }
        if self.byte_fallback
            && let Some(byte) = byte_token(token)
        {
            return vec![byte];
        }
        let mut text = token.to_string();
        for (pattern, content) in &self.replace {
            text = text.replace(pattern.as_str(), content);
        }
        text.into_bytes()
    }
}

/// `<0x0A>` → 0x0A: sentencepiece's byte-fallback tokens.
fn byte_token(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() == 2 { u8::from_str_radix(hex, 16).ok() } else { None }
}

/// GPT-2's reversible map from bytes to printable characters: printable Latin-1 bytes stand for
/// themselves, the rest take the code points from 256 up, in byte order.
pub fn byte_level_chars() -> [char; 256] {
    let keeps = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let mut map = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        map[b as usize] = if keeps(b) {
            char::from_u32(b).expect("Latin-1")
        } else {
            next += 1;
            char::from_u32(next - 1).expect("below the surrogates")
        };
    }
    map
}

fn tokenizer_error(what: &str, e: impl std::fmt::Display) -> Error {
    err!(BadModel, "{what}: {e}")
}

/// Runs a call into the `tokenizers` crate; a panic in it (the crate asserts on some inputs) becomes
/// `status` with `what` and the panic's text, and prints nothing.
fn crate_call<T>(status: Status, what: &str, f: impl FnOnce() -> T) -> Result<T> {
    crate::status::catch_quietly(f).map_err(|panic| {
        Error::new(status, format!("{what}: the tokenizer failed: {}", crate::status::panic_text(&*panic)))
    })
}

impl Tokenizer {
    /// A HF `tokenizer.json` whose ids are dense (below the number of ids it names).
    pub fn from_json(path: &Path) -> Result<Tokenizer> {
        Tokenizer::from_json_within(path, None)
    }

    /// A HF `tokenizer.json`, every id below `vocab` (the model's vocabulary) when given. The file is
    /// checked before the `tokenizers` crate sees it; what the crate still panics on is BAD_MODEL.
    pub fn from_json_within(path: &Path, vocab: Option<usize>) -> Result<Tokenizer> {
        let file = path.display().to_string();
        let bytes = crate::checkpoint::read_regular(path)?;
        let bad = |what: &str| err!(BadModel, "{file}: {what}");
        let json: Value = serde_json::from_slice(&bytes).map_err(|e| bad(&format!("not valid JSON: {e}")))?;
        check_json_ids(&json, vocab, &bad)?;
        for part in ["normalizer", "pre_tokenizer", "decoder", "post_processor"] {
            check_patterns(json.get(part).unwrap_or(&Value::Null), &format!("{file}: {part}"))?;
        }
        let model = json.get("model").ok_or_else(|| bad("no \"model\""))?;
        let bpe_merges = match model.get("type").and_then(Value::as_str) {
            Some("BPE") => Some(json_merges(model.get("merges").unwrap_or(&Value::Null), &bad)?),
            _ => None,
        };
        if let (Some(merges), Some(Value::Object(vocab))) = (&bpe_merges, model.get("vocab")) {
            let vocab: HashMap<String, u32> =
                vocab.iter().map(|(t, id)| (t.clone(), id.as_u64().unwrap_or(0) as u32)).collect();
            let prefix = model.get("continuing_subword_prefix").and_then(Value::as_str).unwrap_or("");
            check_merges(&vocab, merges, prefix, &format!("{file}: model"))?;
        }
        let what = format!("{file}: not a usable tokenizer.json");
        let mut inner = crate_call(Status::BadModel, &what, || tokenizers::Tokenizer::from_bytes(&bytes))?
            .map_err(|e| tokenizer_error(&what, e))?;
        if let Some(merges) = bpe_merges {
            without_thread_cache(&mut inner, merges, &what)?;
        }
        Tokenizer::wrap(inner, vocab)
    }

    /// The tokenizer a checkpoint points at, for a model of `vocab` ids; None when it has none. Errors
    /// keep their status: UNSUPPORTED for a GGUF tokenizer model other than gpt2 and llama (or a
    /// SentencePiece vocabulary that cannot spell every text), BAD_MODEL for a broken one or one with ids
    /// at or past `vocab`, IO_ERROR for a file that cannot be read.
    pub fn from_source(src: &TokenizerSource, vocab: usize) -> Result<Option<Tokenizer>> {
        match src {
            TokenizerSource::None => Ok(None),
            TokenizerSource::Json(path) => Tokenizer::from_json_within(path, Some(vocab)).map(Some),
            TokenizerSource::GgufBpe { model, pre, tokens, merges, token_types } => {
                if model == "gpt2" && tokens.len() > vocab {
                    bail!(BadModel, "GGUF tokenizer.ggml.tokens: {} tokens for a vocabulary of {vocab}", tokens.len());
                }
                Tokenizer::from_gguf_bpe(model, pre.as_deref(), tokens, merges, token_types).map(Some)
            }
            TokenizerSource::GgufSpm { tokens, scores, token_types, add_space_prefix } => {
                if tokens.len() > vocab {
                    bail!(BadModel, "GGUF tokenizer.ggml.tokens: {} tokens for a vocabulary of {vocab}", tokens.len());
                }
                Tokenizer::from_gguf_spm(tokens, scores, token_types, *add_space_prefix).map(Some)
            }
        }
    }

    /// The tokenizer with its piece table; BAD_MODEL for an id at or past `limit` (None: no limit past the
    /// dense table the crate's vocabulary gives), so no table is sized by a stray id.
    fn wrap(inner: tokenizers::Tokenizer, limit: Option<usize>) -> Result<Tokenizer> {
        let vocab = inner.get_vocab(true);
        let size = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        let limit = limit.unwrap_or(vocab.len());
        if size > limit {
            bail!(BadModel, "tokenizer: token id {} is at or past the vocabulary of {limit}", size - 1);
        }
        let rules = PieceRules::of(inner.get_decoder());
        let char_bytes = char_bytes();
        let added = inner.get_added_tokens_decoder();
        let mut pieces = vec![Vec::new(); size];
        for (token, id) in vocab {
            // Added tokens are literal text, not byte-level characters.
            pieces[id as usize] = match added.get(&id) {
                _ if is_padding(&token, None) => Vec::new(),
                Some(t) => t.content.clone().into_bytes(),
                None => rules.piece(&token, &char_bytes),
            };
        }
        // A tokenizer.json says through its post-processor whether BOS goes first (special.rs asks it).
        let mut special: Vec<u32> = added.iter().filter(|(_, t)| t.special).map(|(&id, _)| id).collect();
        special.sort_unstable();
        Ok(Tokenizer { model: Model::Hf(Box::new(inner)), pieces, special, notes: Vec::new(), default_add_bos: None })
    }

    /// The ids of `text`, after `add_bos` when given. Control tokens written in the text (`<|eos|>`)
    /// become their ids; the tokenizer's own post-processing (templates) is not applied.
    pub fn encode(&self, text: &str, add_bos: Option<u32>) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        ids.extend(add_bos);
        match &self.model {
            Model::Hf(inner) => {
                let encoding = crate_call(Status::BadModel, "tokenizing", || inner.encode_fast(text, false))?
                    .map_err(|e| err!(InvalidArgument, "tokenizing: {e}"))?;
                ids.extend_from_slice(encoding.get_ids());
            }
            Model::Spm(spm) => spm.encode(text, &mut ids),
        }
        Ok(ids)
    }

    /// What the load noted without failing, one line each (the engine logs them).
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// Whether the tokenizer itself puts BOS first: a tokenizer.json's post-processor, SentencePiece,
    /// or the GGUF pre-tokenizer family that llama.cpp ties BOS to. The model's keys override it.
    pub fn default_add_bos(&self, bos: Option<u32>) -> bool {
        match (&self.model, self.default_add_bos) {
            (_, Some(add)) => add,
            (Model::Hf(inner), None) => special::post_processor_adds(inner, bos, true),
            (Model::Spm(_), None) => true,
        }
    }

    /// Whether the tokenizer itself appends EOS (a tokenizer.json's post-processor; never for GGUF).
    pub fn default_add_eos(&self, eos: Option<u32>) -> bool {
        match (&self.model, self.default_add_bos) {
            (Model::Hf(inner), None) => special::post_processor_adds(inner, eos, false),
            _ => false,
        }
    }

    /// The bytes token `id` adds to the text; a byte-level piece may be part of a UTF-8 character.
    pub fn piece(&self, id: u32) -> Result<Vec<u8>> {
        self.piece_ref(id).map(<[u8]>::to_vec)
    }

    /// `piece` without the copy.
    pub fn piece_ref(&self, id: u32) -> Result<&[u8]> {
        self.pieces.get(id as usize).map(Vec::as_slice).ok_or_else(|| {
            Error::new(Status::OutOfRange, format!("token id {id} outside the tokenizer's {} ids", self.pieces.len()))
        })
    }

    /// The text of `ids`: their pieces joined, invalid UTF-8 replaced.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.piece_ref(id)?);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// One past the highest id the tokenizer knows.
    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    /// Whether `id` is a control token: its piece is a name (`<|im_end|>`), not text the model writes.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.binary_search(&id).is_ok()
    }

    /// The id of a token string (a special token such as `<|eos|>`), if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match &self.model {
            Model::Hf(inner) => inner.token_to_id(token),
            Model::Spm(spm) => spm.token_id(token),
        }
    }

    /// Saves the tokenizer as `tokenizer.json` (one read from a tokenizer.json or built from GGUF BPE).
    pub fn save_json(&self, path: &Path) -> Result<()> {
        match &self.model {
            Model::Hf(inner) => inner.save(path, true).map_err(|e| err!(IoError, "{}: {e}", path.display())),
            Model::Spm(_) => bail!(Unsupported, "a SentencePiece vocabulary is not saved as tokenizer.json"),
        }
    }
}

fn char_bytes() -> std::collections::HashMap<char, u8> {
    byte_level_chars().iter().enumerate().map(|(b, &c)| (c, b as u8)).collect()
}

/// Padding rows of a GGUF vocabulary: type UNUSED, or the `[PAD123]` names converters fill them with.
/// Their piece is empty, as it is for the ids a tokenizer.json lacks.
fn is_padding(token: &str, kind: Option<i32>) -> bool {
    kind == Some(token_type::UNUSED)
        || token
            .strip_prefix("[PAD")
            .and_then(|rest| rest.strip_suffix(']'))
            .is_some_and(|digits| !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
}
