//! The committed byte-level BPE: it loads, it round-trips any UTF-8 through its pieces, and the GGUF
//! form of the same vocabulary tokenizes exactly as the tokenizer.json does. Every GGUF pre-tokenizer
//! name and the SentencePiece tokenizer against ids another implementation gave
//! (scripts/tokenizer_reference.py, tests/data/tokenizer/); BOS, EOS and end-of-generation ids as the
//! model's files say; chat templates against transformers' renderings.

#[path = "../common/mod.rs"]
mod common;

mod c_abi;
mod chat;
mod committed;
mod reference;
mod special_ids;

use common::{Rng, Scratch};
use hostembed::checkpoint::gguf::GgufValue;
use hostembed::checkpoint::write::{synthetic_weights, write_gguf};
use hostembed::engine::{default_options, engine_backend};
use hostembed::ffi::{
    engine, engine_eog_ids, engine_free, engine_init_fit, engine_model_info, engine_token_piece, engine_tokenize,
};
use hostembed::model::{Arch, ModelConfig, RopeScaling};
use hostembed::tensor::DType;
use hostembed::tokenizer::{GgufBpeVocab, Tokenizer};
use hostembed::{Status, tokenizer};
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
