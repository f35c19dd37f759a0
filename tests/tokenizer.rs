//! The committed byte-level BPE: it loads, it round-trips any UTF-8 through its pieces, and the GGUF
//! form of the same vocabulary tokenizes exactly as the tokenizer.json does.

mod common;

use common::Scratch;

use common::Rng;
use hostembed::Status;
use hostembed::checkpoint::Checkpoint;
use hostembed::checkpoint::gguf::GgufValue;
use hostembed::checkpoint::write::{synthetic_weights, write_gguf, write_hf_folder};
use hostembed::engine::{default_options, engine_backend};
use hostembed::ffi::{engine, engine_free, engine_init_fit, engine_token_piece, engine_tokenize};
use hostembed::model::{Arch, ModelConfig, RopeScaling};
use hostembed::tensor::DType;
use hostembed::tokenizer::{self, GgufBpeVocab, Tokenizer, token_type};
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
    let e = Tokenizer::from_gguf_bpe("gpt2", Some("made-up"), &v.tokens, &v.merges, &v.token_types).unwrap_err();
    assert_eq!(e.status, Status::Unsupported);
    assert!(e.message.contains("made-up"), "{e}");
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
        bos: Some(0),
        eos: Some(1),
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

    // A GGUF whose tokenizer is not byte-level BPE still opens; its text tokenizer is refused by name.
    let mut kv = committed_vocab().gguf_kv("gpt-2");
    kv[0].1 = GgufValue::String("llama".into());
    write_gguf(&gguf, &cfg, &weights, &kv).unwrap();
    let ckpt = Checkpoint::open(&gguf).unwrap();
    let e = Tokenizer::from_source(&ckpt.tokenizer, cfg.vocab).unwrap_err();
    assert_eq!(e.status, Status::Unsupported);
    assert!(e.message.contains("\"llama\""), "{e}");
}

/// An engine on the CPU backend over `model`, freed on drop.
struct CpuEngine(*mut engine);

impl CpuEngine {
    fn open(model: &Path) -> CpuEngine {
        let mut opts = default_options();
        opts.backend = engine_backend::Cpu;
        let path = CString::new(model.to_str().unwrap()).unwrap();
        let mut e = std::ptr::null_mut();
        let s = unsafe { engine_init_fit(path.as_ptr(), &opts, &mut e) };
        assert_eq!(s, Status::Ok, "{}: {}", model.display(), hostembed::status::last_error());
        CpuEngine(e)
    }

    fn tokenize(&self, text: &[u8], add_bos: bool, cap: usize) -> (Status, Vec<i32>, usize) {
        let mut ids = vec![-7i32; cap];
        let mut n = usize::MAX;
        let ptr = if cap == 0 { std::ptr::null_mut() } else { ids.as_mut_ptr() };
        let s =
            unsafe { engine_tokenize(self.0, text.as_ptr() as *const c_char, text.len(), add_bos, ptr, cap, &mut n) };
        (s, ids, n)
    }

    fn piece(&self, id: i32) -> Result<Vec<u8>, i32> {
        let need = unsafe { engine_token_piece(self.0, id, std::ptr::null_mut(), 0) };
        if need < 0 {
            return Err(need);
        }
        let mut buf = vec![0x55 as c_char; need as usize + 1];
        let again = unsafe { engine_token_piece(self.0, id, buf.as_mut_ptr(), buf.len()) };
        assert_eq!(again, need, "piece of {id}");
        assert_eq!(buf[need as usize], 0, "piece of {id} is NUL-terminated");
        Ok(buf[..need as usize].iter().map(|&b| b as u8).collect())
    }
}

impl Drop for CpuEngine {
    fn drop(&mut self) {
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
        let (s, _, n) = e.tokenize(text.as_bytes(), true, 0);
        assert_eq!((s, n), (Status::Ok, expected.len()), "{}", model.display());
        let (s, ids, n) = e.tokenize(text.as_bytes(), true, expected.len() - 1);
        assert_eq!((s, n), (Status::OutOfRange, expected.len()));
        assert!(ids.iter().all(|&i| i == -7), "a failed call wrote ids");
        assert!(hostembed::status::last_error().contains(&format!("{} ids", expected.len())));
        let (s, ids, n) = e.tokenize(text.as_bytes(), true, expected.len() + 3);
        assert_eq!((s, n), (Status::Ok, expected.len()));
        assert_eq!(&ids[..n], &expected[..]);
        assert_eq!(&ids[n..], &[-7, -7, -7]);
        let (_, ids, n) = e.tokenize(text.as_bytes(), false, 64);
        assert_eq!(&ids[..n], &expected[1..]);

        // The pieces give the text back byte for byte, a NUL byte included.
        let pieces: Vec<u8> = expected[1..].iter().flat_map(|&id| e.piece(id).unwrap()).collect();
        assert_eq!(pieces, text.as_bytes());
        let nul = json.token_id(&tokenizer::byte_level_chars()[0].to_string()).unwrap() as i32;
        assert_eq!(e.piece(nul).unwrap(), vec![0u8]);
        // Truncation follows snprintf: the length needed comes back, len - 1 bytes and a NUL are written.
        let mut small = [0x55 as c_char; 4];
        let eos_len = unsafe { engine_token_piece(e.0, 1, small.as_mut_ptr(), small.len()) };
        assert_eq!(eos_len, "<|eos|>".len() as i32);
        assert_eq!(small.map(|c| c as u8), *b"<|e\0");

        // Ids the model has and the tokenizer lacks are empty; ids outside the model are refused.
        assert_eq!(e.piece(515).unwrap(), Vec::<u8>::new());
        assert_eq!(e.piece(520), Err(-(Status::OutOfRange as i32)));
        assert_eq!(e.piece(-1), Err(-(Status::OutOfRange as i32)));

        let (s, _, n) = e.tokenize(&[b'a', 0xff, b'b'], false, 8);
        assert_eq!((s, n), (Status::InvalidArgument, 0));
        assert!(hostembed::status::last_error().contains("byte 1"), "{}", hostembed::status::last_error());
        let (s, _, n) = e.tokenize(b"", true, 8);
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
    let (s, _, n) = e.tokenize(b"text", false, 8);
    assert_eq!((s, n), (Status::Unsupported, 0));
    assert!(hostembed::status::last_error().contains("tokenizer"), "{}", hostembed::status::last_error());
    assert_eq!(e.piece(5), Err(-(Status::Unsupported as i32)));

    // NULLs: the engine, n_out, text with a length, ids with a capacity.
    let mut n = 0usize;
    let mut ids = [0i32; 4];
    let null_engine =
        unsafe { engine_tokenize(std::ptr::null(), c"x".as_ptr(), 1, false, ids.as_mut_ptr(), 4, &mut n) };
    assert_eq!(null_engine, Status::InvalidArgument);
    let null_n = unsafe { engine_tokenize(e.0, c"x".as_ptr(), 1, false, ids.as_mut_ptr(), 4, std::ptr::null_mut()) };
    assert_eq!(null_n, Status::InvalidArgument);
    let null_text = unsafe { engine_tokenize(e.0, std::ptr::null(), 3, false, ids.as_mut_ptr(), 4, &mut n) };
    assert_eq!(null_text, Status::InvalidArgument);
    assert_eq!(
        unsafe { engine_token_piece(std::ptr::null(), 3, std::ptr::null_mut(), 0) },
        -(Status::InvalidArgument as i32)
    );
}
