//! Round trips through GGUF files: formats, llama.cpp's layout and names, rope scaling, tokenizer keys, streaming.

use super::{
    after_string, all_cfgs, assert_refused, edited_gguf, llama_cfg, qwen2_cfg, replace_bytes, write_hf,
    write_small_gguf,
};
use crate::common::{Rng, Scratch};
use hostembed::Status;
use hostembed::checkpoint::gguf::GgufValue;
use hostembed::checkpoint::write::{OwnedTensor, synthetic_weights, unpermute_qk_rows, write_gguf};
use hostembed::checkpoint::{
    Checkpoint, Format, ROPE_FREQS, TokenizerSource, expected_tensors, gguf, llama3_rope_factors, write,
};
use hostembed::model::{Arch, ModelConfig, RopeScaling, TensorSource, names};
use hostembed::tensor::{DType, FORMATS};
use std::path::Path;

// ---------------------------------------------------------------------------------------------
// GGUF round trips.

/// Checks a GGUF checkpoint against the HF-ordered tensors written: llama Q/K rows are in llama.cpp's
/// order (pair (2j, 2j+1) of a head holds HF rows (j, j + d/2)), everything else byte for byte.
fn assert_gguf_holds(ckpt: &Checkpoint, cfg: &ModelConfig, written: &[OwnedTensor]) {
    for t in written {
        let info = ckpt.info(&t.name).unwrap();
        assert_eq!((info.dtype, &info.shape), (t.dtype, &t.shape), "{}", t.name);
        let stored = ckpt.bytes_of(info);
        let heads = match t.name.rsplit_once("self_attn.") {
            Some((_, "q_proj.weight")) if cfg.arch == Arch::Llama => cfg.heads,
            Some((_, "k_proj.weight")) if cfg.arch == Arch::Llama => cfg.kv_heads,
            _ => {
                assert!(stored == t.data.as_slice(), "{}: bytes differ", t.name);
                continue;
            }
        };
        let rb = info.row_bytes();
        let (d, half) = (cfg.head_dim, cfg.head_dim / 2);
        for h in 0..heads {
            for j in 0..half {
                for (pair, hf_row) in [(0, h * d + j), (1, h * d + half + j)] {
                    let gguf_row = h * d + 2 * j + pair;
                    assert_eq!(
                        &stored[gguf_row * rb..(gguf_row + 1) * rb],
                        &t.data[hf_row * rb..(hf_row + 1) * rb],
                        "{}: head {h} pair {j}",
                        t.name
                    );
                }
            }
        }
        assert_eq!(unpermute_qk_rows(stored, rb, heads), t.data, "{}", t.name);
        assert_ne!(stored, t.data.as_slice(), "{}: rows were not permuted", t.name);
    }
}

#[test]
fn gguf_round_trip_every_arch_and_dtype() {
    let mut rng = Rng::fresh("gguf_round_trip_every_arch_and_dtype");
    let dir = Scratch::new("gguf-round-trip");
    for cfg in all_cfgs() {
        for dtype in FORMATS.iter().map(|f| f.dtype) {
            let path = dir.join(&format!("{:?}-{}.gguf", cfg.arch, dtype.name()));
            let written = write_small_gguf(&path, &cfg, rng.next_u64(), dtype);
            let ckpt = Checkpoint::open(&path).unwrap();
            assert_eq!(ckpt.format, Format::Gguf);
            let expected = ModelConfig { rope_interleaved: cfg.arch == Arch::Llama, ..cfg.clone() };
            assert_eq!(ckpt.config, expected);
            assert_gguf_holds(&ckpt, &cfg, &written);
            let written_bytes: u64 = written.iter().map(|t| t.data.len() as u64).sum();
            match llama3_rope_factors(&cfg).filter(|_| cfg.arch == Arch::Llama) {
                Some(factors) => {
                    let stored = ckpt.tensor(ROPE_FREQS).unwrap().to_f32();
                    assert_eq!(stored, factors);
                    assert!(factors.iter().any(|&f| f == 1.0) && factors.iter().any(|&f| f == 8.0));
                    assert_eq!(ckpt.tensors.len(), written.len() + 1);
                    assert_eq!(ckpt.weight_bytes(), written_bytes + 4 * factors.len() as u64);
                }
                None => {
                    assert_eq!(ckpt.tensors.len(), written.len());
                    assert_eq!(ckpt.weight_bytes(), written_bytes);
                }
            }
        }
    }
}

/// A Llama whose rows are all whole k-quant super-blocks (256 values).
fn llama_256() -> ModelConfig {
    ModelConfig { hidden: 256, heads: 4, kv_heads: 2, head_dim: 64, intermediate: 512, vocab: 300, ..llama_cfg() }
}

/// Every quantized format through a GGUF file and back on rows of whole super-blocks, with no
/// fallback; the stored values decode as the writer's blocks do.
#[test]
fn gguf_round_trip_quantized_formats_on_super_block_rows() {
    let dir = Scratch::new("gguf-round-trip-quantized");
    let cfg = llama_256();
    for f in FORMATS.iter().filter(|f| f.block_values > 1) {
        let path = dir.join(&format!("{}.gguf", f.name));
        let written = write_small_gguf(&path, &cfg, 11, f.dtype);
        let ckpt = Checkpoint::open(&path).unwrap();
        assert_gguf_holds(&ckpt, &cfg, &written);
        let matrices: Vec<_> = written.iter().filter(|t| t.shape.len() == 2).collect();
        assert!(matrices.iter().all(|t| t.dtype == f.dtype), "{}: a matrix fell back", f.name);
        let embed = ckpt.tensor(names::EMBED).unwrap();
        assert_eq!(embed.dtype, f.dtype);
        assert_eq!(embed.bytes.len(), cfg.vocab * 256 / f.block_values * f.block_bytes, "{}", f.name);
        let values = embed.to_f32();
        let max = values.iter().fold(0f32, |m, v| m.max(v.abs()));
        // Values in [-1, 1), within the coarsest format's rounding (Q2_K's 4-bit scales reach past 1).
        assert!(values.iter().all(|v| v.is_finite()) && max > 0.5 && max < 1.5, "{}: max {max}", f.name);
    }
}

/// llama.cpp's Q4_K_M mix: Q6_K for the head and for attn_v / ffn_down of the layers that get more
/// bits, Q4_K elsewhere, F32 vectors; rows that are not whole super-blocks fall back as llama.cpp does.
#[test]
fn q4_k_m_recipe_picks_llama_cpp_formats() {
    let cfg = ModelConfig { layers: 16, ..llama_256() };
    let weights = synthetic_weights(&cfg, 3, write::Recipe::Q4KM);
    let dtype = |name: &str| weights.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("{name}")).dtype;
    assert_eq!(dtype(names::LM_HEAD), DType::Q6_K);
    assert_eq!(dtype(names::EMBED), DType::Q4_K);
    assert_eq!(dtype(&names::layer(3, names::ATTN_NORM)), DType::F32);
    // 16 layers: the first 2 and last 2, and layers 2 + 3k + 2 between, get Q6_K.
    let more_bits = [0, 1, 4, 7, 10, 13, 14, 15];
    for i in 0..16 {
        let want = if more_bits.contains(&i) { DType::Q6_K } else { DType::Q4_K };
        assert_eq!(dtype(&names::layer(i, names::V)), want, "layer {i} v");
        assert_eq!(dtype(&names::layer(i, names::DOWN)), want, "layer {i} down");
        for part in [names::Q, names::K, names::O, names::GATE, names::UP] {
            assert_eq!(dtype(&names::layer(i, part)), DType::Q4_K, "layer {i} {part}");
        }
    }
    assert_eq!(write::Recipe::from_name("q4_k_m"), Some(write::Recipe::Q4KM));
    assert_eq!(write::Recipe::from_name("Q6_K"), Some(write::Recipe::Uniform(DType::Q6_K)));
    assert_eq!(write::Recipe::from_name("Q4_K_S"), None);
    let tied = ModelConfig { tied: true, ..cfg.clone() };
    let tied_weights = synthetic_weights(&tied, 3, write::Recipe::Q4KM);
    assert_eq!(tied_weights.iter().find(|t| t.name == names::EMBED).unwrap().dtype, DType::Q6_K);
    // 64-value rows: Q4_K falls back to Q5_0 and Q6_K to Q8_0.
    let small = synthetic_weights(&llama_cfg(), 3, write::Recipe::Q4KM);
    assert_eq!(small.iter().find(|t| t.name == names::LM_HEAD).unwrap().dtype, DType::Q8_0);
    assert_eq!(small.iter().find(|t| t.name == names::EMBED).unwrap().dtype, DType::Q5_0);
    let dir = Scratch::new("q4_k_m");
    let path = dir.join("m.gguf");
    write_gguf(&path, &cfg, &weights, &[]).unwrap();
    assert_gguf_holds(&Checkpoint::open(&path).unwrap(), &cfg, &weights);
}

/// A quantized tensor cut short at the end of the file names the tensor.
#[test]
fn gguf_truncated_quantized_rows() {
    let dir = Scratch::new("gguf-truncated-quantized");
    let path = dir.join("cut.gguf");
    let cfg = llama_256();
    write_small_gguf(&path, &cfg, 1, DType::Q4_K);
    let bytes = std::fs::read(&path).unwrap();
    let g = gguf::parse(&bytes, "cut.gguf").unwrap();
    // The last quantized tensor; only rope_freqs.weight, which the reader checks after it, follows.
    let last = g.tensors.iter().filter(|t| t.dtype == DType::Q4_K).max_by_key(|t| t.start).unwrap();
    // Half a super-block short.
    std::fs::write(&path, &bytes[..last.start + last.bytes - 72]).unwrap();
    let name = last.name.clone();
    assert_refused(Checkpoint::open(&path), Status::BadModel, &["cut.gguf", &name, "run past the end of the file"]);
}

/// The file as llama.cpp's gguf reader sees it: v3, 32-byte alignment, every tensor aligned, names and
/// dims in ggml order, the keys llama.cpp's loader reads present with their types.
#[test]
fn gguf_writer_layout_follows_llama_cpp() {
    let dir = Scratch::new("gguf-layout");
    let cfg = llama_cfg();
    let path = dir.join("m.gguf");
    write_small_gguf(&path, &cfg, 8, DType::Q8_0);
    let bytes = std::fs::read(&path).unwrap();
    let g = gguf::parse(&bytes, "m.gguf").unwrap();
    assert_eq!((g.version, g.alignment), (3, 32));
    assert_eq!(g.metadata[0], ("general.architecture".to_string(), GgufValue::String("llama".into())));
    assert_eq!(g.data_start % 32, 0);
    let key = |k: &str| g.metadata.iter().find(|(name, _)| name == k).map(|(_, v)| v.clone());
    assert_eq!(key("general.alignment"), Some(GgufValue::U32(32)));
    assert_eq!(key("llama.embedding_length"), Some(GgufValue::U32(64)));
    assert_eq!(key("llama.attention.head_count_kv"), Some(GgufValue::U32(2)));
    assert_eq!(key("llama.rope.dimension_count"), Some(GgufValue::U32(16)));
    assert_eq!(key("llama.attention.layer_norm_rms_epsilon"), Some(GgufValue::F32(1e-5)));
    assert_eq!(key("tokenizer.ggml.eos_token_id"), Some(GgufValue::U32(2)));
    for t in &g.tensors {
        assert_eq!(t.start % 32, 0, "{}", t.name);
        assert_eq!(t.offset % 32, 0, "{}", t.name);
    }
    let embd = g.tensors.iter().find(|t| t.name == "token_embd.weight").unwrap();
    assert_eq!((embd.dims.as_slice(), embd.dtype), (&[64u64, 96][..], DType::Q8_0));
    let down = g.tensors.iter().find(|t| t.name == "blk.1.ffn_down.weight").unwrap();
    assert_eq!(down.dims, [96, 64]);
    let norm = g.tensors.iter().find(|t| t.name == "blk.0.attn_norm.weight").unwrap();
    assert_eq!((norm.dims.as_slice(), norm.dtype), (&[64u64][..], DType::F32));
    assert!(g.tensors.iter().any(|t| t.name == "rope_freqs.weight" && t.dims == [8]));
    assert!(g.tensors.iter().any(|t| t.name == "output.weight"));
}

#[test]
fn gguf_name_mapping_is_a_bijection_on_model_tensors() {
    for cfg in all_cfgs() {
        for (name, _) in expected_tensors(&cfg) {
            let g = gguf::gguf_name(&name).unwrap_or_else(|| panic!("{name} has no GGUF name"));
            assert_eq!(gguf::canonical_name(&g), name);
        }
    }
    assert_eq!(gguf::canonical_name("blk.3.ffn_gate.weight"), "model.layers.3.mlp.gate_proj.weight");
    assert_eq!(gguf::canonical_name("blk.03.ffn_gate.weight"), "blk.03.ffn_gate.weight");
    assert_eq!(gguf::canonical_name("output.weight"), names::LM_HEAD);
    assert_eq!(gguf::gguf_name("model.layers.1.self_attn.k_norm.weight").unwrap(), "blk.1.attn_k_norm.weight");
}

#[test]
fn gguf_tied_when_output_is_absent() {
    let dir = Scratch::new("gguf-tied");
    let path = dir.join("tied.gguf");
    let written = write_small_gguf(&path, &qwen2_cfg(), 6, DType::F16);
    let ckpt = Checkpoint::open(&path).unwrap();
    assert!(ckpt.config.tied && ckpt.config.qkv_bias && !ckpt.config.rope_interleaved);
    assert_eq!(ckpt.output(), ckpt.embed());
    assert_eq!(ckpt.weight_bytes(), written.iter().map(|t| t.data.len() as u64).sum::<u64>());
}

/// llama.cpp's converter writes no scaling keys for Llama 3, only `rope_freqs.weight`. With Llama 3.1's
/// parameters the reader recognises them; other divisors are refused rather than guessed.
#[test]
fn gguf_llama3_from_rope_freqs_alone() {
    let dir = Scratch::new("gguf-rope-freqs");
    let hide_keys = |bytes: &mut Vec<u8>| {
        for _ in 0..4 {
            replace_bytes(bytes, b"hostembed.rope.llama3.", b"xostembed.rope.llama3.");
        }
    };
    let llama31 = ModelConfig {
        rope_scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        },
        head_dim: 64,
        heads: 2,
        kv_heads: 1,
        max_position: 16384,
        ..llama_cfg()
    };
    let path = edited_gguf(&dir, "llama31", &llama31, DType::F16, hide_keys);
    let ckpt = Checkpoint::open(&path).unwrap();
    assert_eq!(ckpt.config, ModelConfig { rope_interleaved: true, ..llama31 });

    let odd = edited_gguf(&dir, "odd", &llama_cfg(), DType::F16, hide_keys);
    assert_refused(Checkpoint::open(&odd), Status::Unsupported, &["odd.gguf", "rope_freqs.weight"]);

    // Keys and tensor disagreeing: BAD_MODEL.
    let path = edited_gguf(&dir, "disagree", &llama_cfg(), DType::F16, |bytes| {
        let at = after_string(bytes, gguf::KEY_LLAMA3_FACTOR);
        bytes[at + 4..at + 8].copy_from_slice(&4.0f32.to_le_bytes());
    });
    assert_refused(Checkpoint::open(&path), Status::BadModel, &["disagree.gguf", "rope_freqs.weight"]);
}

#[test]
fn gguf_tokenizer_keys() {
    let dir = Scratch::new("gguf-tokenizer");
    let cfg = qwen2_cfg();
    let tokens: Vec<String> = (0..cfg.vocab).map(|i| format!("t{i}")).collect();
    let merges = vec!["t 1".to_string(), "t1 0".to_string()];
    let types: Vec<i32> = (0..cfg.vocab as i32).map(|i| if i < 3 { 3 } else { 1 }).collect();
    let extra = vec![
        ("tokenizer.ggml.model".to_string(), GgufValue::String("gpt2".into())),
        ("tokenizer.ggml.pre".to_string(), GgufValue::String("qwen2".into())),
        ("tokenizer.ggml.tokens".to_string(), GgufValue::ArrayString(tokens.clone())),
        ("tokenizer.ggml.merges".to_string(), GgufValue::ArrayString(merges.clone())),
        ("tokenizer.ggml.token_type".to_string(), GgufValue::ArrayI32(types.clone())),
        ("tokenizer.ggml.eos_token_id".to_string(), GgufValue::U32(5)),
    ];
    let path = dir.join("tok.gguf");
    write_gguf(&path, &cfg, &synthetic_weights(&cfg, 1, DType::F16), &extra).unwrap();
    let ckpt = Checkpoint::open(&path).unwrap();
    let expected = TokenizerSource::GgufBpe {
        model: "gpt2".into(),
        pre: Some("qwen2".into()),
        tokens,
        merges,
        token_types: types,
    };
    assert_eq!(ckpt.tokenizer, expected);
    assert_eq!(ckpt.config.eos, Some(5), "an extra key replaces the generated one");

    // Without tokenizer keys: none.
    let plain = dir.join("plain.gguf");
    write_small_gguf(&plain, &cfg, 1, DType::F16);
    assert_eq!(Checkpoint::open(&plain).unwrap().tokenizer, TokenizerSource::None);

    // More tokens than embedding rows: refused.
    let many: Vec<String> = (0..cfg.vocab + 1).map(|i| format!("t{i}")).collect();
    let extra = vec![
        ("tokenizer.ggml.model".to_string(), GgufValue::String("gpt2".into())),
        ("tokenizer.ggml.tokens".to_string(), GgufValue::ArrayString(many)),
    ];
    let path = dir.join("many.gguf");
    write_gguf(&path, &cfg, &synthetic_weights(&cfg, 1, DType::F16), &extra).unwrap();
    assert_refused(Checkpoint::open(&path), Status::BadModel, &["many.gguf", "tokenizer.ggml.tokens"]);
}

/// The streaming writers produce the same files as the in-memory ones.
#[test]
fn streaming_writers_match_in_memory_writers() {
    let mut rng = Rng::fresh("streaming_writers_match_in_memory_writers");
    let seed = rng.next_u64();
    let dir = Scratch::new("streaming");
    for cfg in all_cfgs() {
        let a = dir.join(&format!("{:?}-a.gguf", cfg.arch));
        let b = dir.join(&format!("{:?}-b.gguf", cfg.arch));
        write_small_gguf(&a, &cfg, seed, DType::Q8_0);
        write::write_synthetic_gguf(&b, &cfg, seed, DType::Q8_0).unwrap();
        assert!(std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(), "{:?} GGUF", cfg.arch);

        let (fa, fb) = (dir.join(&format!("{:?}-a", cfg.arch)), dir.join(&format!("{:?}-b", cfg.arch)));
        write_hf(&fa, &cfg, seed, DType::Bf16);
        write::write_synthetic_hf(&fb, &cfg, seed, DType::Bf16).unwrap();
        for f in ["config.json", "model.safetensors"] {
            assert!(std::fs::read(fa.join(f)).unwrap() == std::fs::read(fb.join(f)).unwrap(), "{:?} {f}", cfg.arch);
        }
    }
    assert_refused(
        write::write_synthetic_hf(&dir.join("q8"), &llama_cfg(), 1, DType::Q8_0),
        Status::InvalidArgument,
        &["Q8_0"],
    );
}

/// `write_synthetic_gguf_kv` writes what `write_gguf` writes with the same keys; a byte-level BPE smaller
/// than the vocabulary, padded with named tokens as examples/write_model pads it, loads with text for
/// every id.
#[test]
fn streaming_gguf_with_tokenizer_keys() {
    let mut rng = Rng::fresh("streaming_gguf_with_tokenizer_keys");
    let seed = rng.next_u64();
    let dir = Scratch::new("streaming-kv");
    let json = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tokenizer.json");
    let mut vocab = hostembed::tokenizer::gguf_bpe_vocab(&json).unwrap();
    let cfg = ModelConfig { vocab: vocab.tokens.len() + 88, rope_scaling: RopeScaling::None, ..llama_cfg() };
    vocab.tokens.extend((vocab.tokens.len()..cfg.vocab).map(|id| format!("\u{120}w{id}")));
    vocab.token_types.resize(cfg.vocab, hostembed::tokenizer::token_type::NORMAL);
    let kv = vocab.gguf_kv("gpt-2");
    let (a, b) = (dir.join("a.gguf"), dir.join("b.gguf"));
    write_gguf(&a, &cfg, &synthetic_weights(&cfg, seed, DType::Bf16), &kv).unwrap();
    write::write_synthetic_gguf_kv(&b, &cfg, seed, DType::Bf16, &kv).unwrap();
    assert!(std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(), "the streamed file differs");

    let ckpt = Checkpoint::open(&b).unwrap();
    let tok = hostembed::tokenizer::Tokenizer::from_source(&ckpt.tokenizer, cfg.vocab).unwrap().unwrap();
    assert_eq!(tok.vocab_size(), cfg.vocab);
    let last = cfg.vocab as u32 - 1;
    assert_eq!(tok.piece(last).unwrap(), format!(" w{last}").into_bytes());
    let ids = tok.encode("the quick brown fox", None).unwrap();
    assert!(ids.iter().all(|&id| (id as usize) < cfg.vocab - 88), "a prompt took a padding id: {ids:?}");
}
