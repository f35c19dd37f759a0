//! Tokenizers in both checkpoint formats and through the C ABI, and the log line of an unknown pre-tokenizer.

use super::{CpuEngine, asset, committed, committed_vocab, tiny_config};
use crate::common::Scratch;
use hostembed::abi::{ENGINE_BOS_NO, ENGINE_BOS_YES};
use hostembed::checkpoint::Checkpoint;
use hostembed::checkpoint::gguf::GgufValue;
use hostembed::checkpoint::write::{synthetic_weights, write_gguf, write_hf_folder};
use hostembed::engine::{default_options, engine_backend};
use hostembed::ffi::{engine_init_fit, engine_token_piece, engine_tokenize};
use hostembed::model::ModelConfig;
use hostembed::tensor::DType;
use hostembed::tokenizer::Tokenizer;
use hostembed::{Status, tokenizer};
use std::ffi::CString;
use std::os::raw::c_char;

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
