//! A tokenizer from the vocabulary a GGUF carries in `tokenizer.ggml.*`: byte-level BPE (`gpt2`)
//! or SentencePiece (`llama`).

use super::json::check_merges;
use super::{Model, PieceRules, Tokenizer, char_bytes, crate_call, is_padding, pre, spm, token_type, tokenizer_error};
use crate::status::{Result, Status};
use crate::{bail, err};
use std::collections::HashMap;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

impl Tokenizer {
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

/// The ids a GGUF vocabulary marks as control or unknown tokens, ascending.
fn special_ids(token_types: &[i32]) -> Vec<u32> {
    let special = |&(_, &kind): &(usize, &i32)| kind == token_type::CONTROL || kind == token_type::UNKNOWN;
    token_types.iter().enumerate().filter(special).map(|(id, _)| id as u32).collect()
}
