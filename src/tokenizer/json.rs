//! The checks a `tokenizer.json` passes before the `tokenizers` crate builds it (what the crate would
//! assert or panic on), and the rebuild of its BPE without the crate's thread-local cache.

use super::{crate_call, tokenizer_error};
use crate::bail;
use crate::status::{Error, Result, Status};
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use tokenizers::models::bpe::{BPE, Vocab};

/// Merges as (left, right) pairs, from ["a", "b"] pairs or the older "a b" strings, as the crate reads them.
pub(super) fn json_merges(merges: &Value, bad: &dyn Fn(&str) -> Error) -> Result<Vec<(String, String)>> {
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
pub(super) fn check_merges(
    vocab: &HashMap<String, u32>,
    merges: &[(String, String)],
    prefix: &str,
    what: &str,
) -> Result<()> {
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
pub(super) fn check_patterns(node: &Value, path: &str) -> Result<()> {
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
pub(super) fn check_json_ids(json: &Value, limit: Option<usize>, bad: &dyn Fn(&str) -> Error) -> Result<()> {
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

/// Swaps the BPE the crate deserialized for the same model built without a cache: the crate's cache is
/// thread-local and keyed per model, so its entries would outlive the engine on every thread that
/// tokenized. `merges` are the file's, checked.
pub(super) fn without_thread_cache(
    inner: &mut tokenizers::Tokenizer,
    merges: Vec<(String, String)>,
    what: &str,
) -> Result<()> {
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
