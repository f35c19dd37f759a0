//! Writes the tiny demo model: the same random weights as an HF folder (OUT_DIR/tiny: config.json,
//! model.safetensors, tokenizer.json) and as GGUF (OUT_DIR/tiny.gguf in BF16, OUT_DIR/tiny-q8_0.gguf,
//! and OUT_DIR/tiny-q4_k_m.gguf in llama.cpp's Q4_K_M mix of Q4_K and Q6_K), with the repo's byte-level
//! BPE tokenizer. Deterministic: the same command writes the same bytes.
//!
//! cargo run --release --example gen_tiny -- [OUT_DIR (default models)] [--retrain-tokenizer]
//!
//! --retrain-tokenizer trains assets/tokenizer.json again from assets/hostembed.txt before writing.

use hostembed::checkpoint::write::{Recipe, synthetic_weights, write_gguf, write_hf_folder};
use hostembed::model::{Arch, ModelConfig, RopeScaling};
use hostembed::tensor::DType;
use hostembed::tokenizer::{self, Tokenizer};
use std::path::{Path, PathBuf};

const SPECIAL_TOKENS: [&str; 2] = ["<|bos|>", "<|eos|>"];
const TOKENIZER_VOCAB: usize = 512;
/// The weights' seed; changing it changes every file written.
const SEED: u64 = 0x686f_7374_656d_6264;

/// A two-layer Llama with grouped-query attention and an untied head, sized for the tokenizer. Every
/// matrix row is a multiple of 256 values, so the k-quants' super-blocks fit it.
fn tiny_config(vocab: usize, bos: u32, eos: u32) -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab,
        hidden: 256,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        intermediate: 512,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 1024,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: Some(bos),
        eos: Some(eos),
    }
}

fn write_models(out_dir: &Path, tokenizer_json: &Path, tokenizer: &Tokenizer) -> hostembed::Result<()> {
    let special = |t: &str| {
        tokenizer.token_id(t).ok_or_else(|| hostembed::err!(BadModel, "{}: no token {t}", tokenizer_json.display()))
    };
    let cfg = tiny_config(tokenizer.vocab_size(), special(SPECIAL_TOKENS[0])?, special(SPECIAL_TOKENS[1])?);
    let io = |path: &Path, e: std::io::Error| hostembed::err!(IoError, "{}: {e}", path.display());

    let hf_dir = out_dir.join("tiny");
    std::fs::create_dir_all(&hf_dir).map_err(|e| io(&hf_dir, e))?;
    let weights = synthetic_weights(&cfg, SEED, DType::Bf16);
    write_hf_folder(&hf_dir, &cfg, &weights, 1)?;
    let copy = hf_dir.join("tokenizer.json");
    std::fs::copy(tokenizer_json, &copy).map_err(|e| io(&copy, e))?;
    println!("wrote {}", hf_dir.display());

    let tokenizer_kv = tokenizer::gguf_bpe_vocab(tokenizer_json)?.gguf_kv("gpt-2");
    let gguf = out_dir.join("tiny.gguf");
    write_gguf(&gguf, &cfg, &weights, &tokenizer_kv)?;
    println!("wrote {}", gguf.display());

    let q8 = out_dir.join("tiny-q8_0.gguf");
    write_gguf(&q8, &cfg, &synthetic_weights(&cfg, SEED, DType::Q8_0), &tokenizer_kv)?;
    println!("wrote {}", q8.display());

    let q4_k_m = out_dir.join("tiny-q4_k_m.gguf");
    write_gguf(&q4_k_m, &cfg, &synthetic_weights(&cfg, SEED, Recipe::Q4KM), &tokenizer_kv)?;
    println!("wrote {}", q4_k_m.display());
    Ok(())
}

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
    let tokenizer_json = assets().join("tokenizer.json");
    let tokenizer = Tokenizer::from_json(&tokenizer_json)?;
    write_models(&out_dir, &tokenizer_json, &tokenizer)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("gen_tiny: {e}");
        std::process::exit(1);
    }
}
