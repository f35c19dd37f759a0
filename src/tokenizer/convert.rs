//! Vocabularies for writing models: a `tokenizer.json`'s BPE in GGUF's terms, and a byte-level BPE
//! trained on a text.

use super::{Tokenizer, byte_level_chars, token_type};
use crate::checkpoint::gguf::GgufValue;
use crate::err;
use crate::status::Result;
use serde_json::Value;
use std::collections::HashSet;
use std::path::Path;
use tokenizers::AddedToken;
use tokenizers::models::bpe::{BPE, BpeTrainer};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;

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
