//! The committed byte-level BPE: loading, retraining, UTF-8 round trips, its GGUF form, bad vocabularies.

use super::{asset, committed, committed_vocab, gguf_form, pieces_joined, random_text, training_words};
use crate::common::{Rng, Scratch};
use hostembed::tokenizer::{Tokenizer, token_type};
use hostembed::{Status, tokenizer};
use std::path::Path;

#[test]
fn committed_tokenizer_loads_with_its_special_tokens() {
    let t = committed();
    assert_eq!(t.vocab_size(), 512);
    assert_eq!(t.token_id("<|bos|>"), Some(0));
    assert_eq!(t.token_id("<|eos|>"), Some(1));
    assert_eq!(t.piece(1).unwrap(), b"<|eos|>");
    // Trained merges make the repo's own prose shorter than one id a byte.
    let text = "hostembed moves the embedding rows into host memory";
    let ids = t.encode(text, None).unwrap();
    assert!(ids.len() * 2 < text.len(), "{} ids for {} bytes", ids.len(), text.len());
    assert_eq!(pieces_joined(&t, &ids), text.as_bytes());
}

#[test]
fn retraining_reproduces_the_committed_tokenizer() {
    let text = std::fs::read_to_string(asset("hostembed.txt")).unwrap();
    let trained = tokenizer::train_byte_level_bpe(&text, 512, &["<|bos|>", "<|eos|>"]).unwrap();
    let dir = Scratch::new("retrain");
    let path = dir.0.join("tokenizer.json");
    trained.save_json(&path).unwrap();
    let again = std::fs::read(&path).unwrap();
    let committed = std::fs::read(asset("tokenizer.json")).unwrap();
    assert!(again == committed, "training on assets/hostembed.txt no longer gives assets/tokenizer.json");
}

#[test]
fn add_bos_prepends_the_given_id_only() {
    let t = committed();
    let plain = t.encode("decode a prompt", None).unwrap();
    let with_bos = t.encode("decode a prompt", Some(0)).unwrap();
    assert_eq!(with_bos[0], 0);
    assert_eq!(&with_bos[1..], &plain[..]);
    assert!(!plain.contains(&0));
    assert_eq!(t.encode("", None).unwrap(), Vec::<u32>::new());
    assert_eq!(t.encode("", Some(0)).unwrap(), vec![0]);
}

#[test]
fn control_tokens_in_text_become_their_ids() {
    let t = committed();
    let ids = t.encode("one row<|eos|>two rows", None).unwrap();
    assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 1, "{ids:?}");
    assert_eq!(pieces_joined(&t, &ids), b"one row<|eos|>two rows");
}

#[test]
fn every_byte_is_one_token_whose_piece_is_that_byte() {
    let t = committed();
    let chars = tokenizer::byte_level_chars();
    let distinct: std::collections::HashSet<char> = chars.iter().copied().collect();
    assert_eq!(distinct.len(), 256, "the byte map is not one to one");
    for (byte, c) in chars.iter().enumerate() {
        let id = t.token_id(&c.to_string()).unwrap_or_else(|| panic!("byte {byte:#04x} ({c:?}) has no token"));
        assert_eq!(t.piece(id).unwrap(), vec![byte as u8], "piece of byte {byte:#04x}");
    }
}

#[test]
fn utf8_round_trips_through_pieces() {
    let t = committed();
    let words = training_words();
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    let mut rng = Rng::fresh("utf8_round_trips_through_pieces");
    let mut saw_split_char = false;
    for _ in 0..300 {
        let text = random_text(&mut rng, &words);
        let ids = t.encode(&text, None).unwrap();
        assert_eq!(pieces_joined(&t, &ids), text.as_bytes(), "text {text:?} ids {ids:?}");
        assert_eq!(t.decode(&ids).unwrap(), text);
        saw_split_char |= ids.iter().any(|&id| std::str::from_utf8(&t.piece(id).unwrap()).is_err());
    }
    // Multi-byte characters outside the training text must have been split into byte pieces.
    assert!(saw_split_char, "no piece was a partial UTF-8 character");
}

#[test]
fn gguf_bpe_gives_the_same_ids_as_the_json() {
    let json = committed();
    let gguf = gguf_form(Some("gpt2"));
    assert_eq!(gguf.vocab_size(), json.vocab_size());
    for id in 0..json.vocab_size() as u32 {
        assert_eq!(gguf.piece(id).unwrap(), json.piece(id).unwrap(), "piece of id {id}");
    }
    let words = training_words();
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    let mut texts: Vec<String> = vec![
        "hostembed".into(),
        "The embedding rows live in pinned host memory.".into(),
        "  two spaces, a tab\tand\na newline\n".into(),
        "números 1234567 and 中文 and 😀<|eos|>".into(),
        std::fs::read_to_string(asset("hostembed.txt")).unwrap(),
    ];
    let mut rng = Rng::fresh("gguf_bpe_gives_the_same_ids_as_the_json");
    texts.extend((0..100).map(|_| random_text(&mut rng, &words)));
    for text in &texts {
        let a = json.encode(text, Some(0)).unwrap();
        let b = gguf.encode(text, Some(0)).unwrap();
        assert_eq!(a, b, "text {text:?}");
    }
    // No pre-tokenizer name means GPT-2's split, as llama.cpp reads it.
    assert_eq!(gguf_form(None).encode(&texts[4], None).unwrap(), json.encode(&texts[4], None).unwrap());
}

#[test]
fn gguf_vocab_of_the_committed_file_is_complete() {
    let v = committed_vocab();
    assert_eq!(v.tokens.len(), 512);
    assert_eq!(v.token_types.len(), 512);
    assert_eq!(&v.tokens[..2], &["<|bos|>".to_string(), "<|eos|>".to_string()]);
    assert_eq!(&v.token_types[..2], &[token_type::CONTROL, token_type::CONTROL]);
    assert!(v.token_types[2..].iter().all(|&k| k == token_type::NORMAL));
    // 2 special + 256 bytes + one new token per merge.
    assert_eq!(v.merges.len(), 512 - 258);
    assert!(v.merges.iter().all(|m| m.split(' ').count() == 2), "{:?}", v.merges);
}

#[test]
fn llama3_and_qwen2_splits_round_trip() {
    let words = training_words();
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    let mut rng = Rng::fresh("llama3_and_qwen2_splits_round_trip");
    for pre in ["llama-bpe", "qwen2"] {
        let t = gguf_form(Some(pre));
        for _ in 0..100 {
            let text = random_text(&mut rng, &words);
            let ids = t.encode(&text, None).unwrap();
            assert_eq!(pieces_joined(&t, &ids), text.as_bytes(), "{pre}: text {text:?}");
        }
    }
}

/// The pre-tokenizer name decides the split: GPT-2 keeps a run of digits whole, Llama 3 cuts it into
/// threes, Qwen2 into ones; Llama 3 also takes a whole word the vocabulary has without merging.
#[test]
fn gguf_pre_tokenizer_names_change_the_split() {
    let mut tokens: Vec<String> = tokenizer::byte_level_chars().iter().map(char::to_string).collect();
    let merges: Vec<String> = ["1 2", "3 4", "12 34", "a b"].map(String::from).to_vec();
    tokens.extend(["12", "34", "1234", "ab", "abc"].map(String::from));
    let id = |t: &str| tokens.iter().position(|x| x == t).unwrap() as u32;
    let types = vec![token_type::NORMAL; tokens.len()];
    let ids = |pre: &str, text: &str| {
        Tokenizer::from_gguf_bpe("gpt2", Some(pre), &tokens, &merges, &types).unwrap().encode(text, None).unwrap()
    };
    assert_eq!(ids("gpt2", "1234"), vec![id("1234")]);
    assert_eq!(ids("llama-bpe", "1234"), vec![id("12"), id("3"), id("4")]);
    assert_eq!(ids("qwen2", "1234"), vec![id("1"), id("2"), id("3"), id("4")]);
    assert_eq!(ids("gpt2", "abc"), vec![id("ab"), id("c")]);
    assert_eq!(ids("llama-bpe", "abc"), vec![id("abc")]);
}

#[test]
fn unsupported_gguf_tokenizers_are_named() {
    let v = committed_vocab();
    for model in ["llama", "bert", "t5", ""] {
        let e = Tokenizer::from_gguf_bpe(model, None, &v.tokens, &v.merges, &v.token_types).unwrap_err();
        assert_eq!(e.status, Status::Unsupported, "{model}: {e}");
        assert!(e.message.contains(&format!("\"{model}\"")), "{e}");
    }
}

/// A pre-tokenizer name no family lists still loads: GPT-2's split, and one note naming it.
#[test]
fn unknown_pre_tokenizer_names_fall_back_to_gpt2_with_a_note() {
    let v = committed_vocab();
    let made_up = Tokenizer::from_gguf_bpe("gpt2", Some("made-up"), &v.tokens, &v.merges, &v.token_types).unwrap();
    assert_eq!(made_up.notes().len(), 1, "{:?}", made_up.notes());
    assert!(made_up.notes()[0].contains("\"made-up\""), "{:?}", made_up.notes());
    let gpt2 = gguf_form(Some("gpt-2"));
    assert!(gpt2.notes().is_empty(), "{:?}", gpt2.notes());
    let text = std::fs::read_to_string(asset("hostembed.txt")).unwrap() + " 12345 (x) 中文";
    assert_eq!(made_up.encode(&text, None).unwrap(), gpt2.encode(&text, None).unwrap());
}

#[test]
fn malformed_gguf_vocabularies_are_bad_models() {
    let v = committed_vocab();
    let mut merges = v.merges.clone();
    merges[3] = "nospace".into();
    let e = Tokenizer::from_gguf_bpe("gpt2", None, &v.tokens, &merges, &v.token_types).unwrap_err();
    assert_eq!(e.status, Status::BadModel);
    assert!(e.message.contains("merges[3]"), "{e}");

    let e = Tokenizer::from_gguf_bpe("gpt2", None, &v.tokens, &v.merges, &v.token_types[1..]).unwrap_err();
    assert_eq!(e.status, Status::BadModel);
    assert!(e.message.contains("token_type"), "{e}");

    // A merge naming a token the vocabulary lacks.
    let mut merges = v.merges.clone();
    merges.push("zzzz qqqq".into());
    let e = Tokenizer::from_gguf_bpe("gpt2", None, &v.tokens, &merges, &v.token_types).unwrap_err();
    assert_eq!(e.status, Status::BadModel, "{e}");
}

#[test]
fn bad_ids_and_files_fail_clearly() {
    let t = committed();
    let e = t.piece(512).unwrap_err();
    assert_eq!(e.status, Status::OutOfRange);
    assert!(e.message.contains("512"), "{e}");
    assert_eq!(t.decode(&[5, u32::MAX]).unwrap_err().status, Status::OutOfRange);

    let e = Tokenizer::from_json(Path::new("no/such/tokenizer.json")).unwrap_err();
    assert_eq!(e.status, Status::IoError);
    assert!(e.message.contains("no/such/tokenizer.json"), "{e}");

    let dir = Scratch::new("bad");
    let path = dir.0.join("tokenizer.json");
    std::fs::write(&path, b"{\"model\": 3}").unwrap();
    let e = Tokenizer::from_json(&path).unwrap_err();
    assert_eq!(e.status, Status::BadModel);
    assert!(e.message.contains("tokenizer.json"), "{e}");
    let e = tokenizer::gguf_bpe_vocab(&path).unwrap_err();
    assert_eq!(e.status, Status::BadModel);
}

/// A sentencepiece-style tokenizer.json (Llama 2's shape): "▁" reads as a space, `<0xNN>` as one byte.
#[test]
fn sentencepiece_style_pieces_map_marks_and_bytes() {
    let json = r#"{"version":"1.0","truncation":null,"padding":null,
      "added_tokens":[{"id":0,"content":"<unk>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],
      "normalizer":{"type":"Sequence","normalizers":[{"type":"Prepend","prepend":"▁"},{"type":"Replace","pattern":{"String":" "},"content":"▁"}]},
      "pre_tokenizer":null,"post_processor":null,
      "decoder":{"type":"Sequence","decoders":[{"type":"Replace","pattern":{"String":"▁"},"content":" "},{"type":"ByteFallback"},{"type":"Fuse"},{"type":"Strip","content":" ","start":1,"stop":0}]},
      "model":{"type":"BPE","dropout":null,"unk_token":"<unk>","continuing_subword_prefix":null,"end_of_word_suffix":null,
        "fuse_unk":true,"byte_fallback":true,"ignore_merges":false,
        "vocab":{"<unk>":0,"<0x0A>":1,"<0xC3>":2,"<0xA9>":3,"▁":4,"h":5,"i":6,"▁h":7,"▁hi":8},
        "merges":["▁ h","▁h i"]}}"#;
    let dir = Scratch::new("sentencepiece");
    let path = dir.0.join("tokenizer.json");
    std::fs::write(&path, json).unwrap();
    let t = Tokenizer::from_json(&path).unwrap();
    let ids = t.encode("hi\né", None).unwrap();
    assert_eq!(ids, vec![8, 1, 2, 3]);
    let pieces: Vec<Vec<u8>> = ids.iter().map(|&id| t.piece(id).unwrap()).collect();
    assert_eq!(pieces, vec![b" hi".to_vec(), b"\n".to_vec(), vec![0xC3], vec![0xA9]]);
    assert_eq!(t.vocab_size(), 9);
}
