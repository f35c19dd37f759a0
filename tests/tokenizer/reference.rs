//! Every GGUF pre-tokenizer name and the SentencePiece tokenizer against the ids of scripts/tokenizer_reference.py.

use super::{CpuEngine, data, eog_ids, ids_of, model_info, pieces_joined, reference_bpe_vocab, strings, tiny_config};
use crate::common::Scratch;
use hostembed::Status;
use hostembed::abi::{ENGINE_BOS_MODEL, ENGINE_BOS_NO};
use hostembed::checkpoint::gguf::GgufValue;
use hostembed::checkpoint::write::{synthetic_weights, write_gguf};
use hostembed::model::ModelConfig;
use hostembed::tensor::DType;
use hostembed::tokenizer::{Tokenizer, pre, token_type};

/// Each `tokenizer.ggml.pre` name gives, on a vocabulary trained on mixed scripts, the ids the Python
/// `tokenizers` package gives with the model family's own pre-tokenizer; and the reference covers
/// exactly the names hostembed knows.
#[test]
fn every_pre_tokenizer_name_matches_the_reference() {
    let v = reference_bpe_vocab();
    let expected = data("bpe_expected.json");
    let texts = strings(&expected["texts"]);
    let names = expected["names"].as_object().unwrap();
    let known: Vec<&str> = pre::PRE_TOKENIZERS.iter().flat_map(|p| p.names.iter().copied()).collect();
    let mut reference: Vec<&str> = names.keys().map(String::as_str).collect();
    let mut ours = known.clone();
    reference.sort_unstable();
    ours.sort_unstable();
    assert_eq!(ours, reference, "the table and the reference name different pre-tokenizers");
    assert!(known.len() >= 60, "{} names", known.len());
    let mut distinct = std::collections::HashSet::new();
    for (name, index) in names {
        let results = &expected["results"][index.as_u64().unwrap() as usize];
        let t = Tokenizer::from_gguf_bpe("gpt2", Some(name), &v.tokens, &v.merges, &v.types)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(t.notes().is_empty(), "{name}: {:?}", t.notes());
        let mut all = Vec::new();
        for (i, text) in texts.iter().enumerate() {
            let ids = t.encode(text, None).unwrap();
            assert_eq!(ids, ids_of(&results[i]), "pre-tokenizer {name}, text {i} {text:?}");
            // Whatever the split, the pieces give the text back.
            assert_eq!(pieces_joined(&t, &ids), text.as_bytes(), "{name}: text {text:?}");
            all.extend(ids);
        }
        distinct.insert(all);
    }
    // The texts tell the families apart: most give ids of their own.
    assert!(distinct.len() >= 12, "only {} distinct tokenizations", distinct.len());
}

/// Padding rows (type UNUSED, `[PAD123]` names) are empty pieces, as ids a tokenizer.json lacks are.
#[test]
fn padding_tokens_are_empty_pieces() {
    let mut v = reference_bpe_vocab();
    let pads: Vec<usize> = (0..v.tokens.len()).filter(|&i| v.types[i] == token_type::UNUSED).collect();
    assert_eq!(pads.len(), 2);
    // A [PAD..] name marked NORMAL, as some converters write them, and a look-alike that is not one.
    v.tokens.push(format!("[PAD{}]", v.tokens.len()));
    v.types.push(token_type::NORMAL);
    v.tokens.push("[PAD]x".into());
    v.types.push(token_type::NORMAL);
    let t = Tokenizer::from_gguf_bpe("gpt2", Some("qwen2"), &v.tokens, &v.merges, &v.types).unwrap();
    for &id in &pads {
        assert!(v.tokens[id].starts_with("[PAD"), "{}", v.tokens[id]);
        assert_eq!(t.piece(id as u32).unwrap(), b"", "piece of {}", v.tokens[id]);
    }
    let n = v.tokens.len() as u32;
    assert_eq!(t.piece(n - 2).unwrap(), b"");
    assert_eq!(t.piece(n - 1).unwrap(), b"[PAD]x");
    assert_eq!(t.piece(0).unwrap(), b"<|bos|>", "control tokens keep their text");
}

/// The SentencePiece form (Llama 2's `tokenizer.ggml.model = "llama"`) gives the ids the
/// `sentencepiece` package gives for the same model, and its pieces give the text back after the
/// space it puts first.
#[test]
fn sentencepiece_matches_the_reference() {
    let v = data("spm_vocab.json");
    let tokens = strings(&v["tokens"]);
    let scores: Vec<f32> = v["scores"].as_array().unwrap().iter().map(|s| s.as_f64().unwrap() as f32).collect();
    let types: Vec<i32> = v["token_types"].as_array().unwrap().iter().map(|t| t.as_i64().unwrap() as i32).collect();
    let t = Tokenizer::from_gguf_spm(&tokens, &scores, &types, true).unwrap();
    let expected = data("spm_expected.json");
    let texts = strings(&expected["texts"]);
    let mut saw_bytes = false;
    for (i, text) in texts.iter().enumerate() {
        let ids = t.encode(text, None).unwrap();
        assert_eq!(ids, ids_of(&expected["ids"][i]), "text {i} {text:?}");
        let joined = pieces_joined(&t, &ids);
        let want = if text.is_empty() { String::new() } else { format!(" {text}") };
        assert_eq!(joined, want.as_bytes(), "text {text:?}");
        saw_bytes |= ids.iter().any(|&id| types[id as usize] == token_type::BYTE);
    }
    assert!(saw_bytes, "no text fell back to byte pieces");
    assert!(texts.len() >= 15, "{} texts", texts.len());
    // Control tokens written in the text are their ids; the text after one gets the space again.
    let (bos, eos) = (t.token_id("<s>").unwrap(), t.token_id("</s>").unwrap());
    let ids = t.encode("the</s><s>the", None).unwrap();
    let the = t.encode("the", None).unwrap();
    assert_eq!(ids, [the.clone(), vec![eos, bos], the].concat());
    // Without the space prefix, text starts as written.
    let bare = Tokenizer::from_gguf_spm(&tokens, &scores, &types, false).unwrap();
    assert_eq!(pieces_joined(&bare, &bare.encode("the row", None).unwrap()), b"the row");
}

#[test]
fn malformed_sentencepiece_vocabularies_are_bad_models() {
    let v = data("spm_vocab.json");
    let tokens = strings(&v["tokens"]);
    let types: Vec<i32> = v["token_types"].as_array().unwrap().iter().map(|t| t.as_i64().unwrap() as i32).collect();
    let e = Tokenizer::from_gguf_spm(&tokens, &[0.0; 3], &types, true).unwrap_err();
    assert_eq!(e.status, Status::BadModel);
    assert!(e.message.contains("scores"), "{e}");
    let mut bad = types.clone();
    bad[10] = token_type::BYTE;
    let mut named = tokens.clone();
    named[10] = "<0xZZ>".into();
    let e = Tokenizer::from_gguf_spm(&named, &[], &bad, true).unwrap_err();
    assert_eq!(e.status, Status::BadModel);
    assert!(e.message.contains("<0xZZ>"), "{e}");
    // Neither byte pieces nor an unknown token: some text could not be spelled, so no text tokenizer.
    let words: Vec<String> = ["a", "b", "ab"].map(String::from).to_vec();
    let e = Tokenizer::from_gguf_spm(&words, &[0.0, 0.0, 1.0], &[token_type::NORMAL; 3], true).unwrap_err();
    assert_eq!(e.status, Status::Unsupported, "{e}");
}

/// A GGUF carrying a SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`, scores, byte pieces)
/// loads with a text tokenizer that gives the sentencepiece package's ids, BOS first by default as
/// llama.cpp does, and `tokenizer.ggml.add_space_prefix = false` honoured.
#[test]
fn gguf_sentencepiece_through_the_c_abi() {
    let v = data("spm_vocab.json");
    let tokens = strings(&v["tokens"]);
    let scores: Vec<f32> = v["scores"].as_array().unwrap().iter().map(|s| s.as_f64().unwrap() as f32).collect();
    let types: Vec<i32> = v["token_types"].as_array().unwrap().iter().map(|t| t.as_i64().unwrap() as i32).collect();
    let expected = data("spm_expected.json");
    let texts = strings(&expected["texts"]);
    let dir = Scratch::new("gguf-spm");
    let cfg = ModelConfig { vocab: tokens.len(), bos: Some(1), eos: Some(2), ..tiny_config() };
    let weights = synthetic_weights(&cfg, 9, DType::F32);
    let kv = |extra: Vec<(String, GgufValue)>| {
        let mut kv = vec![
            ("tokenizer.ggml.model".to_string(), GgufValue::String("llama".into())),
            ("tokenizer.ggml.tokens".to_string(), GgufValue::ArrayString(tokens.clone())),
            ("tokenizer.ggml.scores".to_string(), GgufValue::ArrayF32(scores.clone())),
            ("tokenizer.ggml.token_type".to_string(), GgufValue::ArrayI32(types.clone())),
        ];
        kv.extend(extra);
        kv
    };
    let path = dir.0.join("spm.gguf");
    write_gguf(&path, &cfg, &weights, &kv(vec![])).unwrap();
    let e = CpuEngine::open(&path);
    let info = model_info(&e);
    assert_eq!((info.add_bos, info.add_eos), (true, false));
    assert_eq!(eog_ids(&e), vec![2]);
    for (i, text) in texts.iter().enumerate() {
        let want: Vec<i32> =
            [1].into_iter().chain(ids_of(&expected["ids"][i]).into_iter().map(|id| id as i32)).collect();
        let (s, ids, n) = e.tokenize(text.as_bytes(), ENGINE_BOS_MODEL, 4096);
        assert_eq!(s, Status::Ok, "{}", hostembed::status::last_error());
        assert_eq!(&ids[..n], &want[..], "text {text:?}");
    }
    // Byte pieces come back as their bytes through the C ABI.
    let newline = tokens.iter().position(|t| t == "<0x0A>").unwrap() as i32;
    assert_eq!(e.piece(newline).unwrap(), b"\n");
    drop(e);

    let bare = dir.0.join("bare.gguf");
    write_gguf(&bare, &cfg, &weights, &kv(vec![("tokenizer.ggml.add_space_prefix".into(), GgufValue::Bool(false))]))
        .unwrap();
    let e = CpuEngine::open(&bare);
    let (_, ids, n) = e.tokenize(b"the row", ENGINE_BOS_NO, 64);
    let joined: Vec<u8> = ids[..n].iter().flat_map(|&id| e.piece(id).unwrap()).collect();
    assert_eq!(joined, b"the row");
}
