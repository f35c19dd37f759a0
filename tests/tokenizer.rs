//! The committed byte-level BPE: it loads, it round-trips any UTF-8 through its pieces, and the GGUF
//! form of the same vocabulary tokenizes exactly as the tokenizer.json does. Every GGUF pre-tokenizer
//! name and the SentencePiece tokenizer against ids another implementation gave
//! (scripts/tokenizer_reference.py, tests/data/tokenizer/); BOS, EOS and end-of-generation ids as the
//! model's files say; chat templates against transformers' renderings.

mod common;

use common::Scratch;

use common::Rng;
use hostembed::Status;
use hostembed::abi::{ENGINE_BOS_MODEL, ENGINE_BOS_NO, ENGINE_BOS_YES, engine_chat_message};
use hostembed::checkpoint::Checkpoint;
use hostembed::checkpoint::gguf::GgufValue;
use hostembed::checkpoint::write::{synthetic_weights, write_gguf, write_hf_folder};
use hostembed::engine::{default_options, engine_backend};
use hostembed::ffi::{
    engine, engine_chat_template, engine_chat_template_json, engine_eog_ids, engine_free, engine_init_fit,
    engine_is_eog, engine_model_info, engine_token_piece, engine_tokenize,
};
use hostembed::model::{Arch, ModelConfig, RopeScaling};
use hostembed::tensor::DType;
use hostembed::tokenizer::chat::{self, ChatMessage};
use hostembed::tokenizer::pre;
use hostembed::tokenizer::{self, GgufBpeVocab, Tokenizer, token_type};
use serde_json::Value;
use std::ffi::CString;
use std::os::raw::c_char;
use std::path::{Path, PathBuf};

fn asset(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("assets").join(name)
}

fn committed() -> Tokenizer {
    Tokenizer::from_json(&asset("tokenizer.json")).expect("committed tokenizer.json loads")
}

fn committed_vocab() -> GgufBpeVocab {
    tokenizer::gguf_bpe_vocab(&asset("tokenizer.json")).expect("committed tokenizer.json reads as GGUF vocab")
}

fn gguf_form(pre: Option<&str>) -> Tokenizer {
    let v = committed_vocab();
    Tokenizer::from_gguf_bpe("gpt2", pre, &v.tokens, &v.merges, &v.token_types).expect("GGUF BPE builds")
}

fn pieces_joined(t: &Tokenizer, ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|&id| t.piece(id).unwrap()).collect()
}

/// Text mixing the training text's words, ASCII noise, multi-byte characters and control tokens.
fn random_text(rng: &mut Rng, words: &[&str]) -> String {
    const ODD: &[&str] = &[
        "é", "ß", "Ω", "中", "文", "😀", "👍🏽", "\u{301}", "ﬁ", "\t", "\n", "\r\n", "  ", "12345", "'s", "'LL",
        "<|eos|>", "<|bos|>", "<|", "|>", "\u{0}", "\u{7f}", "\u{a0}", "\u{2581}", "Ġ", "ĉ",
    ];
    let mut s = String::new();
    for _ in 0..rng.below(60) {
        match rng.below(4) {
            0 | 1 => s.push_str(words[rng.below(words.len() as u64) as usize]),
            2 => s.push_str(ODD[rng.below(ODD.len() as u64) as usize]),
            _ => s.push(char::from(b' ' + rng.below(95) as u8)),
        }
        if rng.below(3) == 0 {
            s.push(' ');
        }
    }
    s
}

fn training_words() -> Vec<String> {
    std::fs::read_to_string(asset("hostembed.txt")).unwrap().split_whitespace().map(str::to_string).collect()
}

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

fn tiny_config() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab: 512,
        hidden: 32,
        layers: 1,
        heads: 2,
        kv_heads: 1,
        head_dim: 16,
        intermediate: 64,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 64,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: Some(0),
        eos: Some(1),
        moe: None,
    }
}

/// The tokenizer a checkpoint points at: tokenizer.json beside safetensors, the tokenizer.ggml.* keys
/// of a GGUF; both tokenize as the committed file does.
#[test]
fn checkpoints_carry_the_same_tokenizer_in_both_formats() {
    let dir = Scratch::new("checkpoints");
    let cfg = tiny_config();
    let weights = synthetic_weights(&cfg, 7, DType::F32);
    let hf = dir.0.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    write_hf_folder(&hf, &cfg, &weights, 1).unwrap();

    let without = Checkpoint::open(&hf).unwrap();
    assert!(Tokenizer::from_source(&without.tokenizer, cfg.vocab).unwrap().is_none());

    std::fs::copy(asset("tokenizer.json"), hf.join("tokenizer.json")).unwrap();
    let gguf = dir.0.join("tiny.gguf");
    write_gguf(&gguf, &cfg, &weights, &committed_vocab().gguf_kv("gpt-2")).unwrap();

    let json = committed();
    let text = std::fs::read_to_string(asset("hostembed.txt")).unwrap();
    for path in [&hf, &gguf] {
        let ckpt = Checkpoint::open(path).unwrap();
        let t = Tokenizer::from_source(&ckpt.tokenizer, cfg.vocab).unwrap().expect("a tokenizer");
        assert_eq!(t.vocab_size(), 512, "{}", path.display());
        assert_eq!(t.encode(&text, Some(0)).unwrap(), json.encode(&text, Some(0)).unwrap(), "{}", path.display());
    }

    // A GGUF whose tokenizer is neither byte-level BPE nor SentencePiece still opens; its text
    // tokenizer is refused by name.
    let mut kv = committed_vocab().gguf_kv("gpt-2");
    kv[0].1 = GgufValue::String("bert".into());
    write_gguf(&gguf, &cfg, &weights, &kv).unwrap();
    let ckpt = Checkpoint::open(&gguf).unwrap();
    let e = Tokenizer::from_source(&ckpt.tokenizer, cfg.vocab).unwrap_err();
    assert_eq!(e.status, Status::Unsupported);
    assert!(e.message.contains("\"bert\""), "{e}");
}

/// An engine on the CPU backend over `model`, freed on drop.
struct CpuEngine(*mut engine);

impl CpuEngine {
    fn open(model: &Path) -> CpuEngine {
        let mut opts = default_options();
        opts.backend = engine_backend::Cpu;
        let path = CString::new(model.to_str().unwrap()).unwrap();
        let mut e = std::ptr::null_mut();
        // SAFETY: a NUL-terminated path, live options and a writable handle.
        let s = unsafe { engine_init_fit(path.as_ptr(), &opts, &mut e) };
        assert_eq!(s, Status::Ok, "{}: {}", model.display(), hostembed::status::last_error());
        CpuEngine(e)
    }

    fn tokenize(&self, text: &[u8], add_bos: i32, cap: usize) -> (Status, Vec<i32>, usize) {
        let mut ids = vec![-7i32; cap];
        let mut n = usize::MAX;
        let ptr = if cap == 0 { std::ptr::null_mut() } else { ids.as_mut_ptr() };
        // SAFETY: a live engine, text.len() bytes of text, room for `cap` ids at `ptr` (NULL when 0), a writable count.
        let s =
            unsafe { engine_tokenize(self.0, text.as_ptr() as *const c_char, text.len(), add_bos, ptr, cap, &mut n) };
        (s, ids, n)
    }

    fn piece(&self, id: i32) -> Result<Vec<u8>, i32> {
        // SAFETY: a live engine; a NULL buffer of length 0 is never written.
        let need = unsafe { engine_token_piece(self.0, id, std::ptr::null_mut(), 0) };
        if need < 0 {
            return Err(need);
        }
        let mut buf = vec![0x55 as c_char; need as usize + 1];
        // SAFETY: a live engine and a buffer of buf.len() chars to write.
        let again = unsafe { engine_token_piece(self.0, id, buf.as_mut_ptr(), buf.len()) };
        assert_eq!(again, need, "piece of {id}");
        assert_eq!(buf[need as usize], 0, "piece of {id} is NUL-terminated");
        Ok(buf[..need as usize].iter().map(|&b| b as u8).collect())
    }
}

impl Drop for CpuEngine {
    fn drop(&mut self) {
        // SAFETY: the engine this CpuEngine alone holds, loaded in `open`; nothing uses it after the drop.
        unsafe { engine_free(self.0) };
    }
}

/// engine_tokenize and engine_token_piece through the C ABI, from safetensors and GGUF, with a model
/// vocabulary padded past the tokenizer's.
#[test]
fn c_abi_tokenizes_and_returns_pieces() {
    let dir = Scratch::new("c-abi");
    let cfg = ModelConfig { vocab: 520, ..tiny_config() };
    let weights = synthetic_weights(&cfg, 11, DType::F32);
    let hf = dir.0.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    write_hf_folder(&hf, &cfg, &weights, 1).unwrap();
    std::fs::copy(asset("tokenizer.json"), hf.join("tokenizer.json")).unwrap();
    let gguf = dir.0.join("tiny.gguf");
    write_gguf(&gguf, &cfg, &weights, &committed_vocab().gguf_kv("gpt-2")).unwrap();

    let json = committed();
    let text = "hostembed 中文 😀 <|eos|> rows";
    let expected: Vec<i32> = json.encode(text, Some(0)).unwrap().iter().map(|&t| t as i32).collect();
    for model in [&hf, &gguf] {
        let e = CpuEngine::open(model);
        // Asking for the count, then too small a buffer (nothing written), then enough.
        let (s, _, n) = e.tokenize(text.as_bytes(), ENGINE_BOS_YES, 0);
        assert_eq!((s, n), (Status::Ok, expected.len()), "{}", model.display());
        let (s, ids, n) = e.tokenize(text.as_bytes(), ENGINE_BOS_YES, expected.len() - 1);
        assert_eq!((s, n), (Status::OutOfRange, expected.len()));
        assert!(ids.iter().all(|&i| i == -7), "a failed call wrote ids");
        assert!(hostembed::status::last_error().contains(&format!("{} ids", expected.len())));
        let (s, ids, n) = e.tokenize(text.as_bytes(), ENGINE_BOS_YES, expected.len() + 3);
        assert_eq!((s, n), (Status::Ok, expected.len()));
        assert_eq!(&ids[..n], &expected[..]);
        assert_eq!(&ids[n..], &[-7, -7, -7]);
        let (_, ids, n) = e.tokenize(text.as_bytes(), ENGINE_BOS_NO, 64);
        assert_eq!(&ids[..n], &expected[1..]);

        // The pieces give the text back byte for byte, a NUL byte included.
        let pieces: Vec<u8> = expected[1..].iter().flat_map(|&id| e.piece(id).unwrap()).collect();
        assert_eq!(pieces, text.as_bytes());
        let nul = json.token_id(&tokenizer::byte_level_chars()[0].to_string()).unwrap() as i32;
        assert_eq!(e.piece(nul).unwrap(), vec![0u8]);
        // Truncation follows snprintf: the length needed comes back, len - 1 bytes and a NUL are written.
        let mut small = [0x55 as c_char; 4];
        // SAFETY: a live engine and a buffer of small.len() chars to write.
        let eos_len = unsafe { engine_token_piece(e.0, 1, small.as_mut_ptr(), small.len()) };
        assert_eq!(eos_len, "<|eos|>".len() as i32);
        assert_eq!(small.map(|c| c as u8), *b"<|e\0");

        // Ids the model has and the tokenizer lacks are empty; ids outside the model are refused.
        assert_eq!(e.piece(515).unwrap(), Vec::<u8>::new());
        assert_eq!(e.piece(520), Err(-(Status::OutOfRange as i32)));
        assert_eq!(e.piece(-1), Err(-(Status::OutOfRange as i32)));

        let (s, _, n) = e.tokenize(&[b'a', 0xff, b'b'], ENGINE_BOS_NO, 8);
        assert_eq!((s, n), (Status::InvalidArgument, 0));
        assert!(hostembed::status::last_error().contains("byte 1"), "{}", hostembed::status::last_error());
        let (s, _, n) = e.tokenize(b"", ENGINE_BOS_YES, 8);
        assert_eq!((s, n), (Status::Ok, 1));
    }
}

#[test]
fn c_abi_without_a_tokenizer_refuses_text_only() {
    let dir = Scratch::new("c-abi-none");
    let cfg = tiny_config();
    let hf = dir.0.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    write_hf_folder(&hf, &cfg, &synthetic_weights(&cfg, 3, DType::F32), 1).unwrap();
    let e = CpuEngine::open(&hf);
    let (s, _, n) = e.tokenize(b"text", ENGINE_BOS_NO, 8);
    assert_eq!((s, n), (Status::Unsupported, 0));
    assert!(hostembed::status::last_error().contains("tokenizer"), "{}", hostembed::status::last_error());
    assert_eq!(e.piece(5), Err(-(Status::Unsupported as i32)));

    // NULLs: the engine, n_out, text with a length, ids with a capacity.
    let mut n = 0usize;
    let mut ids = [0i32; 4];
    // SAFETY: a NULL engine is refused before the one byte of text or the ids are touched.
    let null_engine =
        unsafe { engine_tokenize(std::ptr::null(), c"x".as_ptr(), 1, ENGINE_BOS_NO, ids.as_mut_ptr(), 4, &mut n) };
    assert_eq!(null_engine, Status::InvalidArgument);
    // SAFETY: a live engine, one byte of text and room for 4 ids; the NULL count is refused before any write.
    let null_n =
        unsafe { engine_tokenize(e.0, c"x".as_ptr(), 1, ENGINE_BOS_NO, ids.as_mut_ptr(), 4, std::ptr::null_mut()) };
    assert_eq!(null_n, Status::InvalidArgument);
    // SAFETY: a live engine; the NULL text is refused before it is read.
    let null_text = unsafe { engine_tokenize(e.0, std::ptr::null(), 3, ENGINE_BOS_NO, ids.as_mut_ptr(), 4, &mut n) };
    assert_eq!(null_text, Status::InvalidArgument);
    assert_eq!(
        // SAFETY: a NULL engine is refused; a NULL buffer of length 0 is never written.
        unsafe { engine_token_piece(std::ptr::null(), 3, std::ptr::null_mut(), 0) },
        -(Status::InvalidArgument as i32)
    );
}

// ---------------------------------------------------------------------------------------------
// Reference data from scripts/tokenizer_reference.py

fn data(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer").join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|id| id.as_u64().unwrap() as u32).collect()
}

struct BpeVocab {
    tokens: Vec<String>,
    merges: Vec<String>,
    types: Vec<i32>,
}

fn reference_bpe_vocab() -> BpeVocab {
    let v = data("bpe_vocab.json");
    BpeVocab {
        tokens: strings(&v["tokens"]),
        merges: strings(&v["merges"]),
        types: v["token_types"].as_array().unwrap().iter().map(|t| t.as_i64().unwrap() as i32).collect(),
    }
}

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

// ---------------------------------------------------------------------------------------------
// BOS, EOS and end of generation through the C ABI

fn model_info(e: &CpuEngine) -> engine_model_info {
    // SAFETY: engine_model_info is numbers, bools and enums with a variant at 0: all zeros is a value of it.
    let mut info: engine_model_info = unsafe { std::mem::zeroed() };
    // SAFETY: a live engine and a writable engine_model_info.
    assert_eq!(unsafe { hostembed::ffi::engine_model_info(e.0, &mut info) }, Status::Ok);
    info
}

fn eog_ids(e: &CpuEngine) -> Vec<i32> {
    let mut n = usize::MAX;
    // SAFETY: a live engine, a NULL buffer of length 0 (never written) and a writable count.
    assert_eq!(unsafe { engine_eog_ids(e.0, std::ptr::null_mut(), 0, &mut n) }, Status::Ok);
    let mut out = vec![-9i32; n + 2];
    let mut again = 0usize;
    if n > 0 {
        // SAFETY: a live engine and room for n + 2 ids; a capacity of n - 1 is refused before any is written.
        assert_eq!(unsafe { engine_eog_ids(e.0, out.as_mut_ptr(), n - 1, &mut again) }, Status::OutOfRange);
        assert_eq!(again, n);
        assert!(out.iter().all(|&i| i == -9), "a refused call wrote ids");
    }
    // SAFETY: a live engine, room for out.len() ids and a writable count.
    assert_eq!(unsafe { engine_eog_ids(e.0, out.as_mut_ptr(), out.len(), &mut again) }, Status::Ok);
    assert_eq!(again, n);
    assert_eq!(&out[n..], &[-9, -9]);
    out.truncate(n);
    out
}

/// The reference BPE vocabulary as a GGUF model, with extra tokenizer keys.
fn reference_gguf(dir: &Scratch, name: &str, extra: Vec<(String, GgufValue)>) -> PathBuf {
    let v = reference_bpe_vocab();
    let cfg = ModelConfig { vocab: v.tokens.len() + 6, bos: Some(0), eos: Some(1), ..tiny_config() };
    let mut kv = GgufBpeVocab { tokens: v.tokens, merges: v.merges, token_types: v.types }.gguf_kv("smollm");
    kv.extend(extra);
    let path = dir.0.join(name);
    write_gguf(&path, &cfg, &synthetic_weights(&cfg, 3, DType::F32), &kv).unwrap();
    path
}

/// GGUF keys decide BOS and EOS; ENGINE_BOS_MODEL follows them, the old true/false still work, and the
/// end-of-generation ids are EOS, the eot/eom keys and the vocabulary's known end markers.
#[test]
fn gguf_keys_decide_bos_eos_and_end_of_generation() {
    let dir = Scratch::new("gguf-special");
    let v = reference_bpe_vocab();
    let id = |t: &str| v.tokens.iter().position(|x| x == t).unwrap() as i32;
    let text = b"rows in host memory";

    // SmolLM2's keys: no BOS. The smollm pre-tokenizer loads without a note.
    let quiet = reference_gguf(
        &dir,
        "no-bos.gguf",
        vec![
            ("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(false)),
            ("tokenizer.ggml.eot_token_id".into(), GgufValue::U32(2)),
        ],
    );
    let e = CpuEngine::open(&quiet);
    let info = model_info(&e);
    assert_eq!((info.bos, info.eos, info.add_bos, info.add_eos), (0, 1, false, false));
    let (s, plain, n) = e.tokenize(text, ENGINE_BOS_NO, 64);
    assert_eq!(s, Status::Ok);
    let plain = plain[..n].to_vec();
    let (_, ids, n) = e.tokenize(text, ENGINE_BOS_MODEL, 64);
    assert_eq!(&ids[..n], &plain[..], "the model says no BOS");
    let (_, ids, n) = e.tokenize(text, ENGINE_BOS_YES, 64);
    assert_eq!(&ids[..n], &[&[0], &plain[..]].concat()[..], "asked for BOS, BOS comes first");
    // EOS (1), the eot key (2 = <|im_start|>, named so here), and the markers <|im_end|> and <|eot_id|>.
    let mut want = vec![1, 2, id("<|im_end|>"), id("<|eot_id|>")];
    want.sort_unstable();
    assert_eq!(eog_ids(&e), want);
    for i in 0..v.tokens.len() as i32 + 6 {
        // SAFETY: a live engine.
        assert_eq!(unsafe { engine_is_eog(e.0, i) }, want.contains(&i), "id {i}");
    }
    // SAFETY: a live engine.
    assert!(!unsafe { engine_is_eog(e.0, -1) });
    // SAFETY: a live engine.
    assert!(!unsafe { engine_is_eog(e.0, i32::MAX) });
    // SAFETY: a NULL engine is refused (false).
    assert!(!unsafe { engine_is_eog(std::ptr::null(), 1) });
    drop(e);

    // Keys asking for both: ENGINE_BOS_MODEL puts BOS first and EOS last.
    let both = reference_gguf(
        &dir,
        "both.gguf",
        vec![
            ("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(true)),
            ("tokenizer.ggml.add_eos_token".into(), GgufValue::Bool(true)),
        ],
    );
    let e = CpuEngine::open(&both);
    let info = model_info(&e);
    assert_eq!((info.add_bos, info.add_eos), (true, true));
    let (_, ids, n) = e.tokenize(text, ENGINE_BOS_MODEL, 64);
    assert_eq!(&ids[..n], &[&[0], &plain[..], &[1]].concat()[..]);
    drop(e);

    // No keys: the pre-tokenizer family decides (llama-bpe wants BOS, as llama.cpp has it).
    let dir2 = Scratch::new("gguf-special-default");
    let v2 = reference_bpe_vocab();
    let cfg = ModelConfig { vocab: v2.tokens.len(), bos: Some(0), eos: Some(1), ..tiny_config() };
    let vocab = GgufBpeVocab { tokens: v2.tokens, merges: v2.merges, token_types: v2.types };
    for (pre, want) in [("llama-bpe", true), ("qwen2", false)] {
        let path = dir2.0.join(format!("{pre}.gguf"));
        write_gguf(&path, &cfg, &synthetic_weights(&cfg, 3, DType::F32), &vocab.gguf_kv(pre)).unwrap();
        let e = CpuEngine::open(&path);
        assert_eq!(model_info(&e).add_bos, want, "{pre}");
    }
}

/// tokenizer_config.json decides BOS and EOS on the HF path, else the tokenizer.json post-processor;
/// config.json and generation_config.json eos lists end generation.
#[test]
fn hf_configs_decide_bos_eos_and_end_of_generation() {
    let dir = Scratch::new("hf-special");
    let cfg = tiny_config();
    let hf = dir.0.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    write_hf_folder(&hf, &cfg, &synthetic_weights(&cfg, 5, DType::F32), 1).unwrap();
    std::fs::copy(asset("tokenizer.json"), hf.join("tokenizer.json")).unwrap();
    let text = b"host memory";

    // Nothing says: the committed tokenizer.json has no post-processor, so no BOS.
    let e = CpuEngine::open(&hf);
    assert_eq!((model_info(&e).add_bos, model_info(&e).add_eos), (false, false));
    assert_eq!(eog_ids(&e), vec![1]);
    let (_, plain, n) = e.tokenize(text, ENGINE_BOS_NO, 64);
    let plain = plain[..n].to_vec();
    drop(e);

    std::fs::write(hf.join("tokenizer_config.json"), r#"{"add_bos_token": true, "add_eos_token": false, "bos_token": {"content": "<|bos|>"}, "eos_token": "<|eos|>"}"#).unwrap();
    std::fs::write(hf.join("generation_config.json"), r#"{"eos_token_id": [1, 7, 9]}"#).unwrap();
    let e = CpuEngine::open(&hf);
    assert_eq!((model_info(&e).add_bos, model_info(&e).add_eos), (true, false));
    let (_, ids, n) = e.tokenize(text, ENGINE_BOS_MODEL, 64);
    assert_eq!(&ids[..n], &[&[0], &plain[..]].concat()[..]);
    assert_eq!(eog_ids(&e), vec![1, 7, 9]);
    drop(e);

    // A post-processor that puts BOS first is what transformers applies when the config is silent.
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(asset("tokenizer.json")).unwrap()).unwrap();
    json["post_processor"] = serde_json::json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [0], "tokens": ["<|bos|>"]}}
    });
    std::fs::write(hf.join("tokenizer.json"), serde_json::to_string(&json).unwrap()).unwrap();
    std::fs::write(hf.join("tokenizer_config.json"), "{}").unwrap();
    let e = CpuEngine::open(&hf);
    assert!(model_info(&e).add_bos, "the post-processor adds BOS");
    drop(e);

    // A broken optional file is a clear BAD_MODEL naming it.
    std::fs::write(hf.join("tokenizer_config.json"), r#"{"add_bos_token": "yes"}"#).unwrap();
    let path = CString::new(hf.to_str().unwrap()).unwrap();
    let mut opts = default_options();
    opts.backend = engine_backend::Cpu;
    let mut e = std::ptr::null_mut();
    // SAFETY: a NUL-terminated path, live options and a writable handle (left NULL on failure).
    assert_eq!(unsafe { engine_init_fit(path.as_ptr(), &opts, &mut e) }, Status::BadModel);
    assert!(e.is_null());
    assert!(hostembed::status::last_error().contains("tokenizer_config.json"), "{}", hostembed::status::last_error());
}

// ---------------------------------------------------------------------------------------------
// Chat templates

fn template(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer/templates").join(name);
    std::fs::read_to_string(path).unwrap()
}

/// Llama 3, Llama 3.1, Qwen2.5 and SmolLM2 templates render what transformers' apply_chat_template
/// renders.
#[test]
fn chat_templates_match_transformers() {
    let cases = data("chat_expected.json");
    let cases = cases.as_array().unwrap();
    assert_eq!(cases.len(), 32);
    let today = chat::render("{{ strftime_now('%d %b %Y') }}", &[], false, "", "").unwrap();
    let mut dated = 0;
    let mut names = std::collections::BTreeSet::new();
    for case in cases {
        let name = case["template"].as_str().unwrap();
        names.insert(name);
        let messages: Vec<ChatMessage> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage { role: m["role"].as_str().unwrap(), content: m["content"].as_str().unwrap() })
            .collect();
        let generation = case["add_generation_prompt"].as_bool().unwrap();
        let got = chat::render(
            &template(name),
            &messages,
            generation,
            case["bos_token"].as_str().unwrap(),
            case["eos_token"].as_str().unwrap(),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        // Llama 3.1 writes the date it renders on: the reference's, here today's.
        let date = case["date"].as_str().unwrap();
        let want = case["text"].as_str().unwrap();
        dated += want.contains(&format!("Today Date: {date}")) as usize;
        let want = want.replace(&format!("Today Date: {date}"), &format!("Today Date: {today}"));
        assert_eq!(got, want, "{name}, {} messages, generation {generation}", messages.len());
    }
    assert_eq!(names.len(), 4);
    assert_eq!(dated, 4, "the Llama 3.1 cases with a system message carry a date");
}

/// What templates use beyond plain Jinja: raise_exception, loop controls, Python string methods,
/// tojson as Python writes it, strftime_now.
#[test]
fn chat_template_functions() {
    let m = [ChatMessage { role: "user", content: "  Hi \"you\"\n" }];
    let render = |t: &str| chat::render(t, &m, false, "<s>", "</s>");
    let e = render("{{ raise_exception('roles must alternate') }}").unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("roles must alternate"), "{e}");
    assert_eq!(render("{% for i in [1,2,3,4] %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}").unwrap(), "13");
    assert_eq!(
        render("{{ messages[0].content.strip() }}|{{ messages[0]['role'].upper() }}|{{ 'a,b'.split(',') | length }}")
            .unwrap(),
        "Hi \"you\"|USER|2"
    );
    // Keys in the message's own order, as Python's json.dumps writes a dict (transformers does not sort them).
    assert_eq!(render("{{ messages[0] | tojson }}").unwrap(), r#"{"role": "user", "content": "  Hi \"you\"\n"}"#);
    assert_eq!(
        render("{{ messages[0] | tojson(sort_keys=true) }}").unwrap(),
        r#"{"content": "  Hi \"you\"\n", "role": "user"}"#
    );
    assert_eq!(
        render("{{ [1, 'é', none, true] | tojson(indent=2) }}").unwrap(),
        "[\n  1,\n  \"é\",\n  null,\n  true\n]"
    );
    assert_eq!(
        render("{{ bos_token }}{{ eos_token }}{{ tools is none }}").unwrap(),
        "<s></s>True",
        "Python's spelling"
    );
    let year = render("{{ strftime_now('%Y') }}").unwrap();
    assert!(year.len() == 4 && year.starts_with("20"), "{year}");
    let e = render("{% if %}").unwrap_err();
    assert_eq!(e.status, Status::BadModel, "{e}");
}

/// Tools and a tool-calling conversation given as JSON reach the template as transformers passes them:
/// Qwen2.5's prints each tool with `tojson` (keys in the caller's order), an assistant's call with its
/// arguments object, and a tool's result as a `<tool_response>`; plain messages render as
/// `render` renders them; JSON that is not an array of objects is refused.
#[test]
fn chat_templates_take_tools_and_tool_calls_as_json() {
    let qwen = template("qwen2.5.jinja");
    let tools = r#"[{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}]"#;
    let messages = r#"[{"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"unit": "c", "city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21"}]"#;
    let got = chat::render_json(&qwen, messages, Some(tools), true, "", "<|im_end|>").unwrap();
    let want = concat!(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n",
        "You may call one or more functions to assist with the user query.\n\nYou are provided with function ",
        "signatures within <tools></tools> XML tags:\n<tools>\n",
        r#"{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}"#,
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within ",
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}",
        "\n</tool_call><|im_end|>\n",
        "<|im_start|>user\nParis?<|im_end|>\n",
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"unit\": \"c\", \"city\": \"Paris\"}}\n</tool_call><|im_end|>\n",
        "<|im_start|>user\n<tool_response>\n21\n</tool_response><|im_end|>\n",
        "<|im_start|>assistant\n",
    );
    assert_eq!(got, want);
    // Without tools the template takes its other branch; plain messages render as `render` does.
    let plain = r#"[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello é"}]"#;
    for name in ["qwen2.5.jinja", "llama3.1.jinja", "smollm2.jinja"] {
        let t = template(name);
        let want = chat::render(
            &t,
            &[ChatMessage { role: "system", content: "Be brief." }, ChatMessage { role: "user", content: "Hello é" }],
            true,
            "<s>",
            "</s>",
        )
        .unwrap();
        assert_eq!(chat::render_json(&t, plain, None, true, "<s>", "</s>").unwrap(), want, "{name}");
    }
    for (messages, tools, why) in [
        ("{", None, "not valid JSON"),
        (r#"{"role": "user"}"#, None, "not a JSON array"),
        ("[1]", None, "messages[0] is not a JSON object"),
        (plain, Some("{}"), "tools is not a JSON array"),
    ] {
        let e = chat::render_json(&qwen, messages, tools, true, "", "").unwrap_err();
        assert_eq!(e.status, Status::InvalidArgument);
        assert!(e.message.contains(why), "{e}");
    }

    // Through C: the GGUF's template, NULL tools, the snprintf contract and NULLs refused.
    let dir = Scratch::new("chat-json-c");
    let gguf = reference_gguf(&dir, "chat.gguf", vec![("tokenizer.chat_template".into(), GgufValue::String(qwen))]);
    let e = CpuEngine::open(&gguf);
    let (m, t) = (CString::new(messages).unwrap(), CString::new(tools).unwrap());
    // SAFETY: a live engine and NUL-terminated JSON; a NULL buffer of 0 is never written.
    let need = unsafe { engine_chat_template_json(e.0, m.as_ptr(), t.as_ptr(), true, std::ptr::null_mut(), 0) };
    assert!(need > 0, "{need}: {}", hostembed::status::last_error());
    let mut buf = vec![0x55 as c_char; need as usize + 1];
    // SAFETY: a live engine, NUL-terminated JSON and buf.len() chars to write.
    let again = unsafe { engine_chat_template_json(e.0, m.as_ptr(), t.as_ptr(), true, buf.as_mut_ptr(), buf.len()) };
    assert_eq!(again, need);
    let text = String::from_utf8(buf[..need as usize].iter().map(|&c| c as u8).collect()).unwrap();
    assert!(
        text.starts_with("<|im_start|>system\nYou are Qwen") && text.contains("<tools>\n{\"type\": \"function\""),
        "{text}"
    );
    // SAFETY: a live engine, NUL-terminated JSON and NULL tools.
    let none = unsafe { engine_chat_template_json(e.0, m.as_ptr(), std::ptr::null(), true, std::ptr::null_mut(), 0) };
    assert!(none > 0 && none < need, "{none} {need}");
    // SAFETY: NULL messages are refused before anything is read.
    let s = unsafe { engine_chat_template_json(e.0, std::ptr::null(), t.as_ptr(), true, std::ptr::null_mut(), 0) };
    assert_eq!(s, -(Status::InvalidArgument as i32));
    // SAFETY: a NULL engine is refused before anything is read.
    let s =
        unsafe { engine_chat_template_json(std::ptr::null(), m.as_ptr(), t.as_ptr(), true, std::ptr::null_mut(), 0) };
    assert_eq!(s, -(Status::InvalidArgument as i32));
}

fn chat_through_c(e: &CpuEngine, messages: &[(&CString, &CString)], generation: bool) -> Result<String, i32> {
    let raw: Vec<engine_chat_message> =
        messages.iter().map(|(r, c)| engine_chat_message { role: r.as_ptr(), content: c.as_ptr() }).collect();
    // SAFETY: a live engine and raw.len() messages of live NUL-terminated strings; a NULL buffer of 0 is never written.
    let need = unsafe { engine_chat_template(e.0, raw.as_ptr(), raw.len(), generation, std::ptr::null_mut(), 0) };
    if need < 0 {
        return Err(need);
    }
    // Too small a buffer: truncated like snprintf, the full length still returned.
    let mut small = vec![0x55 as c_char; 5];
    // SAFETY: a live engine, raw.len() messages of live NUL-terminated strings, and 5 chars to write.
    let again = unsafe { engine_chat_template(e.0, raw.as_ptr(), raw.len(), generation, small.as_mut_ptr(), 5) };
    assert_eq!(again, need);
    assert_eq!(small[4], 0);
    let mut buf = vec![0x55 as c_char; need as usize + 1];
    // SAFETY: a live engine, raw.len() messages of live NUL-terminated strings, and buf.len() chars to write.
    let again = unsafe { engine_chat_template(e.0, raw.as_ptr(), raw.len(), generation, buf.as_mut_ptr(), buf.len()) };
    assert_eq!(again, need);
    assert_eq!(buf[need as usize], 0);
    assert_eq!(&small[..4], &buf[..4]);
    Ok(String::from_utf8(buf[..need as usize].iter().map(|&c| c as u8).collect()).unwrap())
}

/// engine_chat_template renders the GGUF's tokenizer.chat_template and an HF folder's
/// tokenizer_config.json template with the model's BOS text; models without one are UNSUPPORTED.
#[test]
fn c_abi_renders_the_models_chat_template() {
    let dir = Scratch::new("chat-c");
    let llama3 = template("llama3.jinja");
    let gguf =
        reference_gguf(&dir, "chat.gguf", vec![("tokenizer.chat_template".into(), GgufValue::String(llama3.clone()))]);
    let (system, user) = (CString::new("system").unwrap(), CString::new("user").unwrap());
    let (be_brief, hello) = (CString::new("Be brief.").unwrap(), CString::new("Hello é").unwrap());
    let e = CpuEngine::open(&gguf);
    let text = chat_through_c(&e, &[(&system, &be_brief), (&user, &hello)], true).unwrap();
    let want = chat::render(
        &llama3,
        &[ChatMessage { role: "system", content: "Be brief." }, ChatMessage { role: "user", content: "Hello é" }],
        true,
        "<|bos|>",
        "<|eos|>",
    )
    .unwrap();
    assert_eq!(text, want);
    assert!(text.starts_with("<|bos|><|start_header_id|>system"), "{text}");
    assert!(text.ends_with("<|start_header_id|>assistant<|end_header_id|>\n\n"), "{text}");
    // NULLs and bad text are refused by name.
    let bad = engine_chat_message { role: std::ptr::null(), content: hello.as_ptr() };
    // SAFETY: a live engine; the NULL role is refused before anything is written.
    let s = unsafe { engine_chat_template(e.0, &bad, 1, true, std::ptr::null_mut(), 0) };
    assert_eq!(s, -(Status::InvalidArgument as i32));
    assert!(hostembed::status::last_error().contains("messages[0].role"), "{}", hostembed::status::last_error());
    // SAFETY: a live engine; NULL messages with a count of 2 are refused before anything is read.
    let s = unsafe { engine_chat_template(e.0, std::ptr::null(), 2, true, std::ptr::null_mut(), 0) };
    assert_eq!(s, -(Status::InvalidArgument as i32));
    // SAFETY: a NULL engine is refused before anything is read.
    let s = unsafe { engine_chat_template(std::ptr::null(), std::ptr::null(), 0, true, std::ptr::null_mut(), 0) };
    assert_eq!(s, -(Status::InvalidArgument as i32));
    let latin1 = [0xe9u8, 0];
    let bad = engine_chat_message { role: user.as_ptr(), content: latin1.as_ptr() as *const c_char };
    // SAFETY: a live engine and one message of NUL-terminated strings (not UTF-8, which is refused).
    let s = unsafe { engine_chat_template(e.0, &bad, 1, true, std::ptr::null_mut(), 0) };
    assert_eq!(s, -(Status::InvalidArgument as i32));
    drop(e);

    // HF folder: the template and the BOS text from tokenizer_config.json.
    let cfg = tiny_config();
    let hf = dir.0.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    write_hf_folder(&hf, &cfg, &synthetic_weights(&cfg, 5, DType::F32), 1).unwrap();
    std::fs::copy(asset("tokenizer.json"), hf.join("tokenizer.json")).unwrap();
    let e = CpuEngine::open(&hf);
    assert_eq!(chat_through_c(&e, &[(&user, &hello)], true), Err(-(Status::Unsupported as i32)));
    drop(e);
    let config = serde_json::json!({"chat_template": template("smollm2.jinja"), "bos_token": "<|bos|>"});
    std::fs::write(hf.join("tokenizer_config.json"), config.to_string()).unwrap();
    let e = CpuEngine::open(&hf);
    let text = chat_through_c(&e, &[(&user, &hello)], false).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHello é<|im_end|>\n"
    );
    // chat_template.jinja beside the weights wins, as transformers reads it.
    std::fs::write(hf.join("chat_template.jinja"), "{{ bos_token }}{{ messages | length }}").unwrap();
    drop(e);
    let e = CpuEngine::open(&hf);
    assert_eq!(chat_through_c(&e, &[(&user, &hello), (&user, &hello)], false).unwrap(), "<|bos|>2");
}

unsafe extern "C" fn collect_line(user: *mut std::os::raw::c_void, line: *const c_char) {
    // SAFETY: the test passes a live Vec<String> as `user`, and the library a NUL-terminated line.
    let lines = unsafe { &mut *(user as *mut Vec<String>) };
    // SAFETY: the library passes a NUL-terminated line that lives for the call.
    lines.push(unsafe { std::ffi::CStr::from_ptr(line) }.to_string_lossy().into_owned());
}

/// A GGUF whose pre-tokenizer name hostembed does not know loads, tokenizes, and logs one line naming it.
#[test]
fn unknown_pre_tokenizer_is_logged_once_at_load() {
    let dir = Scratch::new("unknown-pre");
    let cfg = tiny_config();
    let path = dir.0.join("made-up.gguf");
    write_gguf(&path, &cfg, &synthetic_weights(&cfg, 3, DType::F32), &committed_vocab().gguf_kv("made-up")).unwrap();
    let mut lines: Vec<String> = Vec::new();
    let mut opts = default_options();
    opts.backend = engine_backend::Cpu;
    opts.log = Some(collect_line);
    opts.log_user = &mut lines as *mut Vec<String> as *mut std::os::raw::c_void;
    let c_path = CString::new(path.to_str().unwrap()).unwrap();
    let mut e = std::ptr::null_mut();
    assert_eq!(
        // SAFETY: a NUL-terminated path, live options and a writable handle.
        unsafe { engine_init_fit(c_path.as_ptr(), &opts, &mut e) },
        Status::Ok,
        "{}",
        hostembed::status::last_error()
    );
    let e = CpuEngine(e);
    let named: Vec<&String> = lines.iter().filter(|l| l.contains("made-up")).collect();
    assert_eq!(named.len(), 1, "{lines:?}");
    assert!(named[0].contains("pre-tokenizer") && named[0].contains("GPT-2"), "{}", named[0]);
    let (s, ids, n) = e.tokenize(b"hostembed rows", ENGINE_BOS_NO, 16);
    assert_eq!(s, Status::Ok);
    assert_eq!(
        &ids[..n],
        &committed().encode("hostembed rows", None).unwrap().iter().map(|&i| i as i32).collect::<Vec<_>>()[..]
    );
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
