//! Writes a random-weights GGUF of a named shape with the repo's byte-level BPE tokenizer, one tensor
//! generated at a time as the file is written (the 8B shape is 16 GB; memory holds one tensor): what the
//! server's load benchmark serves where no real checkpoint can be carried, and the file llama.cpp and
//! hostembed are both measured on (llama.cpp reads its tokenizer and `{arch}.*` keys as its converter's).
//!
//! cargo run --release --example write_model -- --out FILE [--shape 8b|small|qwen3-30b-a3b|moe-small]
//!     [--dtype bf16|f16|q8_0|q4_k_m|...] [--tokenizer assets/tokenizer.json] [--seed N] [--quick]
//!
//! 8b is Llama-3-8B's shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336, vocabulary 128256);
//! small is a 4-layer model with a vocabulary of 8192 that the CPU serves quickly; qwen3-30b-a3b is
//! Qwen3-30B-A3B's Mixture-of-Experts shape (`qwen3moe`: 48 layers, 128 experts, 8 a token) and moe-small
//! 2 of its layers with 16 experts and a vocabulary of 8192. A dtype is any one format for every matrix,
//! or q4_k_m for llama-quantize's Q4_K_M mix (Q6_K for the head and half the layers' attn_v and
//! ffn_down). `--quick`: block-format matrices repeat 64 random rows each (`Fill::SampledRows`: read
//! at the same speed, written at the disk's rather than the encoder's; Qwen3-30B-A3B's Q4_K_M is 17 GB).
//! The tokenizer's ids come
//! first; the ids past them are padded with tokens no merge makes (` w512`, ` w513`, ...), so prompts
//! never hold them but every generated id has text to stream.

use std::path::{Path, PathBuf};
use std::time::Instant;

use hostembed::checkpoint::write::{Fill, GgufValue, Recipe, write_generated_gguf};
use hostembed::model::ModelConfig;
use hostembed::tensor::DType;
use hostembed::tokenizer::{self, token_type};

fn shape(name: &str) -> hostembed::Result<ModelConfig> {
    Ok(match name {
        "8b" => ModelConfig::llama(4096, 32, 32, 8, 14336, 128256),
        "small" => ModelConfig::llama(512, 4, 8, 2, 1536, 8192),
        "qwen3-30b-a3b" => ModelConfig::qwen3_30b_a3b(),
        "moe-small" => ModelConfig::qwen3_moe(2048, 2, 32, 16, 8, 768, 8192),
        _ => hostembed::bail!(InvalidArgument, "--shape is 8b, small, qwen3-30b-a3b or moe-small, not {name}"),
    })
}

/// A `--dtype`: q4_k_m, or any format's name.
fn recipe(name: &str) -> hostembed::Result<Recipe> {
    Recipe::from_name(name)
        .ok_or_else(|| hostembed::err!(InvalidArgument, "--dtype is q4_k_m or a format's name, not {name}"))
}

fn run() -> hostembed::Result<()> {
    let mut out: Option<PathBuf> = None;
    let mut cfg = shape("8b")?;
    let mut dtype = Recipe::Uniform(DType::Bf16);
    let mut tokenizer_json = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tokenizer.json");
    let mut seed = 1u64;
    let mut quick = false;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--quick" {
            quick = true;
            continue;
        }
        if flag == "-h" || flag == "--help" {
            println!(
                "usage: write_model --out FILE [--shape 8b|small|qwen3-30b-a3b|moe-small] [--dtype bf16|f16|q8_0|q4_k_m|...] [--tokenizer JSON] [--seed N] [--quick]"
            );
            return Ok(());
        }
        let value = args.next().ok_or_else(|| hostembed::err!(InvalidArgument, "{flag} takes a value"))?;
        match flag.as_str() {
            "--out" => out = Some(PathBuf::from(value)),
            "--shape" => cfg = shape(&value)?,
            "--dtype" => dtype = recipe(&value)?,
            "--tokenizer" => tokenizer_json = PathBuf::from(value),
            "--seed" => seed = value.parse().map_err(|_| hostembed::err!(InvalidArgument, "--seed takes a number"))?,
            _ => hostembed::bail!(InvalidArgument, "unknown flag {flag}"),
        }
    }
    let out = out.ok_or_else(|| hostembed::err!(InvalidArgument, "--out FILE is needed"))?;

    let mut vocab = tokenizer::gguf_bpe_vocab(&tokenizer_json)?;
    let own = vocab.tokens.len();
    if own > cfg.vocab {
        hostembed::bail!(InvalidArgument, "the tokenizer's {own} ids pass the shape's vocabulary of {}", cfg.vocab);
    }
    let id_of = |t: &str| vocab.tokens.iter().position(|x| x == t).map(|id| id as u32);
    (cfg.bos, cfg.eos) = (id_of("<|bos|>"), id_of("<|eos|>"));
    // `Ġ` is the byte-level space: each padding id decodes to " w<id>".
    let pads: Vec<String> = (own..cfg.vocab).map(|id| format!("\u{120}w{id}")).collect();
    if let Some(taken) = pads.iter().find(|p| vocab.tokens.contains(p)) {
        hostembed::bail!(InvalidArgument, "{}: already holds the padding token {taken}", tokenizer_json.display());
    }
    vocab.tokens.extend(pads);
    vocab.token_types.resize(cfg.vocab, token_type::NORMAL);

    let start = Instant::now();
    let mut kv = vocab.gguf_kv("gpt-2");
    // BOS first, as Llama 3 has it: every caller (the server, batch.c, decode.c) then reads the same ids.
    kv.push(("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(true)));
    let fill = if quick { Fill::SampledRows { seed } } else { Fill::Formula { seed } };
    write_generated_gguf(&out, &cfg, fill, dtype, &kv)?;
    let bytes = std::fs::metadata(&out).map_err(|e| hostembed::err!(IoError, "{}: {e}", out.display()))?.len();
    let secs = start.elapsed().as_secs_f64();
    println!(
        "wrote {}: {} layers, hidden {}, vocabulary {} ({own} from the tokenizer), {}, {:.2} GB in {secs:.1} s ({:.2} GB/s)",
        out.display(),
        cfg.layers,
        cfg.hidden,
        cfg.vocab,
        dtype.name(),
        bytes as f64 / 1e9,
        bytes as f64 / 1e9 / secs
    );
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("write_model: {e}");
        std::process::exit(1);
    }
}
