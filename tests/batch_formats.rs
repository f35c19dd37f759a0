//! Batch invariance in every weight format on the CPU backend: a small Llama written as GGUF with its
//! matrices in each format `FORMATS` lists, and in llama.cpp's Q4_K_M mix, stepped in random batches of
//! 1 to 64 items (single tokens and prompt chunks; streams joining, leaving, truncated and reset) against
//! the same steps one stream at a time on a twin engine: the same statuses, tokens and logits bits, and
//! the KV pool's accounting. Then models/gguf-f16.gguf, which the `gguf` Python package writes as
//! llama.cpp's converter lays out an F16 Llama (scripts/write-gguf-f16.sh; a SKIP line without it): the
//! crate's writer's keys with the same values, F16 matrices, the tiny model's tokenizer, and the same
//! batch invariance.

mod common;
use common::{Mix, Rng, cpu_options, every_recipe_batches_like_alone, twins_batch_like_alone};
use common::{decode_base, init, model_file, piece, serial, tokenize};

use hostembed::checkpoint::write::gguf_metadata;
use hostembed::checkpoint::{Checkpoint, gguf};
use hostembed::ffi;
use hostembed::model::{Arch, ModelConfig};
use hostembed::status::last_error;
use hostembed::tensor::DType;
use hostembed::tokenizer::{self, Tokenizer};
use hostembed::{Status, abi};
use std::path::{Path, PathBuf};

const PAGE: u64 = hostembed::cpu::PAGE_TOKENS as u64;
const STREAMS: u32 = 64;
const WINDOW: u32 = 96;
/// Calls of up to 64 items with chunks of up to 8 tokens, one in four up to 40 (some past the window).
const MIX: Mix = Mix { rounds: 15, widest: STREAMS, chunk: 8, long_chunk: 40 };

/// A Llama with GQA 2:1 whose every matrix row is whole k-quant super-blocks (256 values), so each
/// format stores every matrix as itself; two layers, so Q4_K_M gives the second one's V and down Q6_K.
fn config() -> ModelConfig {
    ModelConfig { vocab: 300, heads: 4, head_dim: 64, intermediate: 256, ..decode_base(Arch::Llama) }
}

#[test]
fn random_batches_match_stepping_alone_in_every_format() {
    let _g = serial();
    let mut rng = Rng::fresh("random_batches_match_stepping_alone_in_every_format");
    every_recipe_batches_like_alone(&config(), &cpu_options(WINDOW, STREAMS), &MIX, PAGE, &mut rng);
}

/// scripts/gguf_f16_model.py's file.
const GGUF_F16: &str = "gguf-f16.gguf";

fn gguf_f16() -> Option<PathBuf> {
    model_file(GGUF_F16, "scripts/write-gguf-f16.sh writes it with the gguf package")
}

/// The keys the crate's writer gives this config and the tiny model's tokenizer are in the file with the
/// same types and values (the converter adds general.* keys of its own and no alignment); llama.cpp's
/// F16 layout: MOSTLY_F16, 2-D matrices F16, norms F32; the script's shape.
#[test]
fn the_gguf_packages_f16_file_is_the_converters_layout() {
    let Some(path) = gguf_f16() else { return };
    let ckpt = Checkpoint::open(&path).unwrap();
    let c = &ckpt.config;
    assert_eq!(c.arch, Arch::Llama);
    assert!(c.rope_interleaved, "GGUF llama rotates adjacent pairs");
    let shape = (c.vocab, c.hidden, c.layers, c.heads, c.kv_heads, c.head_dim, c.intermediate, c.tied);
    assert_eq!(shape, (512, 128, 2, 2, 1, 64, 384, false), "the script's config");
    for t in ckpt.tensors.values() {
        let want = if t.shape.len() == 2 { DType::F16 } else { DType::F32 };
        assert_eq!(t.dtype, want, "tensor {} of {:?}", t.name, t.shape);
    }

    let bytes = std::fs::read(&path).unwrap();
    let file = gguf::parse(&bytes, GGUF_F16).unwrap();
    let assets = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tokenizer.json");
    let mut want = gguf_metadata(c).unwrap();
    want.extend(tokenizer::gguf_bpe_vocab(&assets).unwrap().gguf_kv("gpt-2"));
    want.push(("general.file_type".into(), gguf::GgufValue::U32(1)));
    for (key, value) in want.iter().filter(|(k, _)| k != "general.alignment") {
        let got = file.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v);
        assert_eq!(got, Some(value), "{key}");
    }
    assert!(!file.metadata.iter().any(|(k, _)| k == "general.alignment"), "the converter leaves the default");
}

/// The file on the CPU backend: the rows reported F16, the text tokenized as the tiny model's
/// tokenizer.json tokenizes it, and random batches bit-identical to stepping alone.
#[test]
fn the_gguf_packages_f16_file_decodes_batch_invariant() {
    let Some(path) = gguf_f16() else { return };
    let _g = serial();
    let mut rng = Rng::fresh("the_gguf_packages_f16_file_decodes_batch_invariant");
    {
        let e = init(&path, &cpu_options(WINDOW, 1));
        // SAFETY: engine_rows is plain C data (integers and a pointer) for which all zeros is a value.
        let mut rows: abi::engine_rows = unsafe { std::mem::zeroed() };
        // SAFETY: a live engine and a struct to fill.
        assert_eq!(unsafe { ffi::engine_embed_rows(e.0, &mut rows) }, Status::Ok, "{}", last_error());
        assert_eq!((rows.dtype, rows.rows, rows.cols), (DType::F16, 512, 128));
        let json = Tokenizer::from_json(&Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tokenizer.json")).unwrap();
        let text = "hostembed moves the embedding rows, and a dense decode engine around them.";
        let ids = tokenize(&e, text);
        let want: Vec<i32> = json.encode(text, None).unwrap().into_iter().map(|i| i as i32).collect();
        assert_eq!(ids, want, "{text:?}");
        let back: Vec<u8> = ids.iter().flat_map(|&id| piece(&e, id)).collect();
        assert_eq!(String::from_utf8_lossy(&back), text);
    }
    twins_batch_like_alone("gguf-f16.gguf", &path, &cpu_options(WINDOW, STREAMS), &MIX, PAGE, &mut rng);
}
