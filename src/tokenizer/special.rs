//! What a model says about its special tokens: whether BOS goes before a prompt and EOS after it,
//! which ids end a generation, its chat template and the BOS/EOS texts the template sees. The
//! checkpoint readers fill `SpecialTokens` from the files (GGUF `tokenizer.ggml.*` keys; an HF
//! folder's tokenizer_config.json and generation_config.json); `resolve` settles what the files leave
//! open from the tokenizer, as llama.cpp and transformers do.

use super::Tokenizer;
use crate::status::Status;

/// What the checkpoint's files say; None where they are silent.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpecialTokens {
    /// `tokenizer.ggml.add_bos_token`, or tokenizer_config.json's `add_bos_token`.
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token`, or tokenizer_config.json's `add_eos_token`.
    pub add_eos: Option<bool>,
    /// End-of-generation ids the files name: GGUF eot/eom ids, generation_config.json's eos ids.
    pub eog: Vec<u32>,
    /// The Jinja chat template (`tokenizer.chat_template`, tokenizer_config.json's `chat_template`
    /// or chat_template.jinja).
    pub chat_template: Option<String>,
    /// tokenizer_config.json's `bos_token` / `eos_token` texts.
    pub bos_text: Option<String>,
    pub eos_text: Option<String>,
}

/// Token texts that end a generation wherever a vocabulary has them (llama.cpp's list): end of turn,
/// end of message, end of text in the chat formats of Llama 3, ChatML, Gemma, Phi, Granite and others.
pub const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

/// What the engine serves: settled flags, the end-of-generation ids, the template and its strings.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TextRules {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// BOS before a prompt (only when the model has a BOS id).
    pub add_bos: bool,
    /// EOS after a prompt (only when the model has an EOS id).
    pub add_eos: bool,
    /// Sorted, distinct, each below the model's vocabulary.
    pub eog: Vec<u32>,
    pub chat_template: Option<String>,
    pub bos_text: String,
    pub eos_text: String,
}

impl TextRules {
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }
}

/// Settles the flags and ids: the files' word first, else what the tokenizer does (a tokenizer.json's
/// post-processor, SentencePiece's BOS, the GGUF pre-tokenizer family's); the end-of-generation ids
/// are EOS, the ids the files name and every token whose text is in `EOG_TEXTS`.
pub fn resolve(
    special: &SpecialTokens,
    bos: Option<u32>,
    eos: Option<u32>,
    vocab: usize,
    tokenizer: Option<&Tokenizer>,
) -> TextRules {
    let add_bos = special.add_bos.unwrap_or_else(|| tokenizer.is_some_and(|t| t.default_add_bos(bos)));
    let add_eos = special.add_eos.unwrap_or_else(|| tokenizer.is_some_and(|t| t.default_add_eos(eos)));
    let mut eog: Vec<u32> = eos.into_iter().chain(special.eog.iter().copied()).collect();
    if let Some(t) = tokenizer {
        eog.extend(EOG_TEXTS.iter().filter_map(|text| t.token_id(text)));
        // gpt-oss ends a turn with <|return|> or <|call|>; its <|end|> closes a message mid-turn.
        let has = |text: &str| t.token_id(text).is_some();
        if has("<|return|>")
            && has("<|call|>")
            && let Some(end) = t.token_id("<|end|>")
            && Some(end) != eos
        {
            eog.retain(|&id| id != end);
        }
    }
    eog.retain(|&id| (id as usize) < vocab);
    eog.sort_unstable();
    eog.dedup();
    let text_of = |id: Option<u32>, given: &Option<String>| -> String {
        given.clone().unwrap_or_else(|| match (id, tokenizer) {
            (Some(id), Some(t)) => t.piece_ref(id).map(|p| String::from_utf8_lossy(p).into_owned()).unwrap_or_default(),
            _ => String::new(),
        })
    };
    TextRules {
        bos,
        eos,
        add_bos: add_bos && bos.is_some(),
        add_eos: add_eos && eos.is_some(),
        eog,
        chat_template: special.chat_template.clone(),
        bos_text: text_of(bos, &special.bos_text),
        eos_text: text_of(eos, &special.eos_text),
    }
}

/// Whether a tokenizer.json's post-processor puts `id` first (`first`) or last around a text, asked
/// of the post-processor itself by encoding one letter with and without it.
pub(super) fn post_processor_adds(inner: &tokenizers::Tokenizer, id: Option<u32>, first: bool) -> bool {
    let Some(id) = id else { return false };
    let encode = |special: bool| {
        super::crate_call(Status::BadModel, "post-processor", || inner.encode_fast("a", special))
            .ok()
            .and_then(|r| r.ok())
            .map(|e| e.get_ids().to_vec())
    };
    let (Some(with), Some(without)) = (encode(true), encode(false)) else { return false };
    if with.len() <= without.len() {
        return false;
    }
    if first {
        with.first() == Some(&id) && without.first() != Some(&id)
    } else {
        with.last() == Some(&id) && without.last() != Some(&id)
    }
}
