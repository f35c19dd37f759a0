//! Text to token ids and back: a `tokenizer.json` beside the weights, or the vocabulary a GGUF
//! carries in `tokenizer.ggml.*`: byte-level BPE (`gpt2`, with the split its `pre` names, `pre.rs`)
//! run by the `tokenizers` crate, or SentencePiece (`llama`, `spm.rs`). `special.rs` holds what the
//! model says about BOS, EOS and end of generation, `chat.rs` its chat template.

pub mod chat;
pub mod pre;
pub mod special;
pub mod spm;

use crate::checkpoint::TokenizerSource;
use crate::checkpoint::gguf::GgufValue;
use crate::status::{Error, Result, Status};
use crate::{bail, err};
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use tokenizers::models::bpe::{BPE, BpeTrainer, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, DecoderWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

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

/// Merges as (left, right) pairs, from ["a", "b"] pairs or the older "a b" strings, as the crate reads them.
fn json_merges(merges: &Value, bad: &dyn Fn(&str) -> Error) -> Result<Vec<(String, String)>> {
    let mut pairs = Vec::new();
    for (i, merge) in merges.as_array().ok_or_else(|| bad("model.merges is not a list"))?.iter().enumerate() {
        pairs.push(match merge {
            Value::String(line) if line.starts_with("#version") => continue,
            Value::String(line) => match line.split(' ').collect::<Vec<_>>().as_slice() {
                [a, b] => (a.to_string(), b.to_string()),
                _ => return Err(bad(&format!("model.merges[{i}] is not \"left right\""))),
            },
            Value::Array(pair) => match pair.as_slice() {
                [Value::String(a), Value::String(b)] => (a.clone(), b.clone()),
                _ => return Err(bad(&format!("model.merges[{i}] is not a pair of strings"))),
            },
            _ => return Err(bad(&format!("model.merges[{i}] is neither a string nor a pair"))),
        });
    }
    Ok(pairs)
}

/// What the BPE builder would assert on: every merge's parts and result are in the vocabulary (a
/// result longer than any token overruns the builder's buffer). `prefix` is continuing_subword_prefix.
fn check_merges(vocab: &HashMap<String, u32>, merges: &[(String, String)], prefix: &str, what: &str) -> Result<()> {
    for (i, (a, b)) in merges.iter().enumerate() {
        for part in [a, b] {
            if !vocab.contains_key(part) {
                bail!(BadModel, "{what}: merges[{i}] names \"{part}\", which the vocabulary lacks");
            }
        }
        let Some(rest) = b.strip_prefix(prefix) else {
            bail!(BadModel, "{what}: merges[{i}]'s right part \"{b}\" lacks the subword prefix \"{prefix}\"");
        };
        if !vocab.contains_key(&format!("{a}{rest}")) {
            bail!(BadModel, "{what}: merges[{i}] builds \"{a}{rest}\", which the vocabulary lacks");
        }
    }
    Ok(())
}

/// Refuses what the crate would accept and then panic on: an empty pattern in a Replace or a Split
/// (normalizer, pre-tokenizer or decoder), at any depth.
fn check_patterns(node: &Value, path: &str) -> Result<()> {
    match node {
        Value::Object(map) => {
            if let Some(Value::Object(pattern)) = map.get("pattern")
                && pattern.values().any(|p| p.as_str() == Some(""))
            {
                bail!(BadModel, "{path}: an empty pattern matches everywhere");
            }
            for (key, value) in map {
                check_patterns(value, &format!("{path}.{key}"))?;
            }
        }
        Value::Array(items) => {
            for (i, value) in items.iter().enumerate() {
                check_patterns(value, &format!("{path}[{i}]"))?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// One past the largest id a tokenizer.json gives (vocabulary and added tokens), checked against
/// `limit` (the model's vocabulary; None: the number of ids the file names, so ids are dense).
fn check_json_ids(json: &Value, limit: Option<usize>, bad: &dyn Fn(&str) -> Error) -> Result<()> {
    let model = json.get("model").ok_or_else(|| bad("no \"model\""))?;
    let mut ids: Vec<u64> = Vec::new();
    match model.get("vocab") {
        // BPE, WordPiece, WordLevel: token -> id.
        Some(Value::Object(vocab)) => {
            for (token, id) in vocab {
                ids.push(id.as_u64().ok_or_else(|| bad(&format!("model.vocab[\"{token}\"] is not an id")))?);
            }
        }
        // Unigram: ids are positions in the list.
        Some(Value::Array(pieces)) => ids.extend(0..pieces.len() as u64),
        _ => {}
    }
    for added in json.get("added_tokens").and_then(Value::as_array).into_iter().flatten() {
        ids.push(added.get("id").and_then(Value::as_u64).ok_or_else(|| bad("an added token has no id"))?);
    }
    let limit = limit.unwrap_or_else(|| ids.iter().collect::<HashSet<_>>().len()) as u64;
    if let Some(&past) = ids.iter().find(|&&id| id >= limit) {
        return Err(bad(&format!("token id {past} is at or past the vocabulary of {limit}")));
    }
    Ok(())
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

    /// The byte-level BPE a GGUF describes in `tokenizer.ggml.*` (`model == "gpt2"`): tokens, merges
    /// and token types; `pre` names the split of the text before BPE (`pre.rs`). A name the table lacks
    /// falls back to GPT-2's split and leaves a note saying so.
    pub fn from_gguf_bpe(
        model: &str,
        pre: Option<&str>,
        tokens: &[String],
        merges: &[String],
        token_types: &[i32],
    ) -> Result<Tokenizer> {
        if model != "gpt2" {
            bail!(
                Unsupported,
                "GGUF tokenizer.ggml.model \"{model}\": only \"gpt2\" (byte-level BPE) and \"llama\" (SentencePiece) \
                 are supported"
            );
        }
        check_token_types(tokens, token_types)?;
        let mut notes = Vec::new();
        let family = match pre {
            None => pre::FALLBACK,
            Some(name) => pre::find(name).unwrap_or_else(|| {
                notes.push(format!(
                    "GGUF tokenizer.ggml.pre \"{name}\" is not a pre-tokenizer hostembed knows: splitting as GPT-2 \
                     does, so some texts may tokenize differently from the model's own tokenizer"
                ));
                pre::FALLBACK
            }),
        };

        // The first id wins where a vocabulary repeats a string, as the model's own lookups do.
        let mut vocab = Vocab::default();
        for (id, token) in tokens.iter().enumerate() {
            vocab.entry(token.clone()).or_insert(id as u32);
        }
        let mut pairs = Vec::with_capacity(merges.len());
        for (i, merge) in merges.iter().enumerate() {
            let (a, b) = merge
                .split_once(' ')
                .filter(|(a, b)| !a.is_empty() && !b.is_empty() && !b.contains(' '))
                .ok_or_else(|| err!(BadModel, "GGUF tokenizer.ggml.merges[{i}] \"{merge}\" is not \"left right\""))?;
            pairs.push((a.to_string(), b.to_string()));
        }
        let lookup: HashMap<String, u32> = vocab.iter().map(|(t, &id)| (t.clone(), id)).collect();
        check_merges(&lookup, &pairs, "", "GGUF tokenizer.ggml")?;
        // No per-thread cache: its entries would outlive the engine on every thread that tokenized.
        let bpe = crate_call(Status::BadModel, "GGUF tokenizer.ggml.merges", || {
            BPE::builder().vocab_and_merges(vocab, pairs).ignore_merges(family.ignore_merges).cache_capacity(0).build()
        })?
        .map_err(|e| tokenizer_error("GGUF tokenizer.ggml.merges", e))?;

        let mut inner = tokenizers::Tokenizer::new(bpe);
        let pre_tokenizer: PreTokenizerWrapper = if family.splits.is_empty() {
            ByteLevel::new(false, true, true).into()
        } else {
            let mut steps = Vec::with_capacity(family.splits.len() + 1);
            for pattern in family.splits {
                let split = Split::new(SplitPattern::Regex((*pattern).into()), SplitDelimiterBehavior::Isolated, false)
                    .map_err(|e| tokenizer_error("pre-tokenizer regex", e))?;
                steps.push(split.into());
            }
            steps.push(ByteLevel::new(false, true, false).into());
            Sequence::new(steps).into()
        };
        inner.with_pre_tokenizer(Some(pre_tokenizer));
        inner.with_decoder(Some(ByteLevel::default()));

        // Control and user-defined tokens are matched whole in the text, never split by BPE.
        let mut added = Vec::new();
        for (token, &kind) in tokens.iter().zip(token_types) {
            match kind {
                token_type::CONTROL => added.push(AddedToken::from(token.clone(), true)),
                token_type::USER_DEFINED => added.push(AddedToken::from(token.clone(), false).normalized(false)),
                _ => {}
            }
        }
        crate_call(Status::BadModel, "GGUF control tokens", || inner.add_tokens(added))?
            .map_err(|e| tokenizer_error("GGUF control tokens", e))?;

        let mut tokenizer = Tokenizer::wrap(inner, Some(tokens.len()))?;
        // The GGUF's list is the vocabulary: its length and order, even where strings repeat.
        let rules = PieceRules { byte_level: true, ..PieceRules::default() };
        let char_bytes = char_bytes();
        tokenizer.pieces = tokens
            .iter()
            .enumerate()
            .map(
                |(id, t)| {
                    if is_padding(t, token_types.get(id).copied()) { Vec::new() } else { rules.piece(t, &char_bytes) }
                },
            )
            .collect();
        tokenizer.special = special_ids(token_types);
        tokenizer.notes = notes;
        tokenizer.default_add_bos = Some(family.add_bos);
        Ok(tokenizer)
    }

    /// The SentencePiece vocabulary a GGUF describes (`model == "llama"`): pieces, scores and token
    /// types, run as llama.cpp runs it (`spm.rs`).
    pub fn from_gguf_spm(
        tokens: &[String],
        scores: &[f32],
        token_types: &[i32],
        add_space_prefix: bool,
    ) -> Result<Tokenizer> {
        check_token_types(tokens, token_types)?;
        let model = spm::Spm::new(tokens, scores, token_types, add_space_prefix)?;
        let pieces = tokens
            .iter()
            .enumerate()
            .map(|(id, t)| {
                let kind = token_types.get(id).copied();
                if is_padding(t, kind) { Vec::new() } else { spm::piece(t, kind.unwrap_or(token_type::NORMAL)) }
            })
            .collect();
        Ok(Tokenizer {
            model: Model::Spm(Box::new(model)),
            pieces,
            special: special_ids(token_types),
            notes: Vec::new(),
            default_add_bos: Some(true),
        })
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

/// GGUF's token types, when given, are one per token.
fn check_token_types(tokens: &[String], token_types: &[i32]) -> Result<()> {
    if !token_types.is_empty() && token_types.len() != tokens.len() {
        bail!(BadModel, "GGUF tokenizer.ggml.token_type has {} entries for {} tokens", token_types.len(), tokens.len());
    }
    if tokens.len() > u32::MAX as usize {
        bail!(BadModel, "GGUF tokenizer.ggml.tokens: {} tokens do not fit u32 ids", tokens.len());
    }
    Ok(())
}

/// Padding rows of a GGUF vocabulary: type UNUSED, or the `[PAD123]` names converters fill them with.
/// Their piece is empty, as it is for the ids a tokenizer.json lacks.
/// The ids a GGUF vocabulary marks as control or unknown tokens, ascending.
fn special_ids(token_types: &[i32]) -> Vec<u32> {
    let special = |&(_, &kind): &(usize, &i32)| kind == token_type::CONTROL || kind == token_type::UNKNOWN;
    token_types.iter().enumerate().filter(special).map(|(id, _)| id as u32).collect()
}

fn is_padding(token: &str, kind: Option<i32>) -> bool {
    kind == Some(token_type::UNUSED)
        || token
            .strip_prefix("[PAD")
            .and_then(|rest| rest.strip_suffix(']'))
            .is_some_and(|digits| !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
}

fn char_bytes() -> std::collections::HashMap<char, u8> {
    byte_level_chars().iter().enumerate().map(|(b, &c)| (c, b as u8)).collect()
}

/// A byte-level BPE's vocabulary in GGUF's terms: tokens by id, merges as "left right", token types.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufBpeVocab {
    pub tokens: Vec<String>,
    pub merges: Vec<String>,
    pub token_types: Vec<i32>,
}

impl GgufBpeVocab {
    /// The `tokenizer.ggml.*` keys llama.cpp reads for this byte-level BPE; `pre` names its split
    /// ("gpt-2", "llama-bpe", "qwen2").
    pub fn gguf_kv(&self, pre: &str) -> Vec<(String, GgufValue)> {
        vec![
            ("tokenizer.ggml.model".into(), GgufValue::String("gpt2".into())),
            ("tokenizer.ggml.pre".into(), GgufValue::String(pre.into())),
            ("tokenizer.ggml.tokens".into(), GgufValue::ArrayString(self.tokens.clone())),
            ("tokenizer.ggml.merges".into(), GgufValue::ArrayString(self.merges.clone())),
            ("tokenizer.ggml.token_type".into(), GgufValue::ArrayI32(self.token_types.clone())),
        ]
    }
}

/// Reads the BPE vocabulary, merges and special tokens of a byte-level `tokenizer.json`, for writing
/// them into a GGUF. BAD_MODEL when the file is not a BPE model or its ids have gaps.
pub fn gguf_bpe_vocab(path: &Path) -> Result<GgufBpeVocab> {
    let bytes = crate::checkpoint::read_regular(path)?;
    let json: Value = serde_json::from_slice(&bytes).map_err(|e| err!(BadModel, "{}: {e}", path.display()))?;
    let bad = |what: &str| err!(BadModel, "{}: {what}", path.display());
    let model = json.get("model").ok_or_else(|| bad("no \"model\""))?;
    if model.get("type").and_then(Value::as_str) != Some("BPE") {
        return Err(bad("model.type is not \"BPE\""));
    }
    let entries = model.get("vocab").and_then(Value::as_object).map_or(0, |v| v.len())
        + json.get("added_tokens").and_then(Value::as_array).map_or(0, |a| a.len());
    let mut by_id: Vec<Option<(String, i32)>> = Vec::new();
    let mut put = |token: &str, id: u64, kind: i32| -> Result<()> {
        // Ids past the entries leave a gap, refused below; refusing them here keeps the table small.
        let id =
            usize::try_from(id).ok().filter(|&id| id < entries).ok_or_else(|| bad("token id past the vocabulary"))?;
        if id >= by_id.len() {
            by_id.resize(id + 1, None);
        }
        by_id[id] = Some((token.to_string(), kind));
        Ok(())
    };
    for (token, id) in model.get("vocab").and_then(Value::as_object).ok_or_else(|| bad("no model.vocab"))? {
        put(token, id.as_u64().ok_or_else(|| bad("model.vocab id is not a number"))?, token_type::NORMAL)?;
    }
    for added in json.get("added_tokens").and_then(Value::as_array).into_iter().flatten() {
        let content = added.get("content").and_then(Value::as_str).ok_or_else(|| bad("added token without content"))?;
        let id = added.get("id").and_then(Value::as_u64).ok_or_else(|| bad("added token without id"))?;
        let special = added.get("special").and_then(Value::as_bool).unwrap_or(false);
        put(content, id, if special { token_type::CONTROL } else { token_type::USER_DEFINED })?;
    }
    let mut tokens = Vec::with_capacity(by_id.len());
    let mut token_types = Vec::with_capacity(by_id.len());
    for (id, entry) in by_id.into_iter().enumerate() {
        let (token, kind) = entry.ok_or_else(|| bad(&format!("no token has id {id}")))?;
        tokens.push(token);
        token_types.push(kind);
    }
    // Merges are "a b" strings in older files and ["a", "b"] pairs in newer ones.
    let mut merges = Vec::new();
    for merge in model.get("merges").and_then(Value::as_array).ok_or_else(|| bad("no model.merges"))? {
        merges.push(match merge {
            Value::String(s) => s.clone(),
            Value::Array(pair) => match pair.as_slice() {
                [Value::String(a), Value::String(b)] => format!("{a} {b}"),
                _ => return Err(bad("a merge is not a pair of strings")),
            },
            _ => return Err(bad("a merge is neither a string nor a pair")),
        });
    }
    Ok(GgufBpeVocab { tokens, merges, token_types })
}

/// Trains a byte-level BPE of `vocab_size` ids on `text`, `special` first (ids 0, 1, ..), then the 256
/// byte characters, then merges. The trainer breaks ties by ids, so the same text gives the same file.
pub fn train_byte_level_bpe(text: &str, vocab_size: usize, special: &[&str]) -> Result<Tokenizer> {
    let alphabet: HashSet<char> = byte_level_chars().into_iter().collect();
    let trainer = BpeTrainer::builder()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(special.iter().map(|s| AddedToken::from(*s, true)).collect())
        .initial_alphabet(alphabet)
        .build();
    let mut inner = tokenizers::Tokenizer::new(BPE::default());
    inner.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    inner.with_decoder(Some(ByteLevel::default()));
    let mut trainer = tokenizers::models::TrainerWrapper::from(trainer);
    inner.train(&mut trainer, text.split_inclusive('\n')).map_err(|e| err!(InvalidArgument, "training BPE: {e}"))?;
    Tokenizer::wrap(inner, None)
}

/// Swaps the BPE the crate deserialized for the same model built without a cache: the crate's cache is
/// thread-local and keyed per model, so its entries would outlive the engine on every thread that
/// tokenized. `merges` are the file's, checked.
fn without_thread_cache(inner: &mut tokenizers::Tokenizer, merges: Vec<(String, String)>, what: &str) -> Result<()> {
    let tokenizers::ModelWrapper::BPE(bpe) = inner.get_model() else {
        return Ok(());
    };
    let vocab: Vocab = bpe.get_vocab().into_iter().collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .cache_capacity(0)
        .fuse_unk(bpe.fuse_unk)
        .byte_fallback(bpe.byte_fallback)
        .ignore_merges(bpe.ignore_merges);
    if let Some(dropout) = bpe.dropout {
        builder = builder.dropout(dropout);
    }
    if let Some(unk) = &bpe.unk_token {
        builder = builder.unk_token(unk.clone());
    }
    if let Some(prefix) = &bpe.continuing_subword_prefix {
        builder = builder.continuing_subword_prefix(prefix.clone());
    }
    if let Some(suffix) = &bpe.end_of_word_suffix {
        builder = builder.end_of_word_suffix(suffix.clone());
    }
    let rebuilt = crate_call(Status::BadModel, what, || builder.build())?.map_err(|e| tokenizer_error(what, e))?;
    inner.with_model(rebuilt);
    Ok(())
}
