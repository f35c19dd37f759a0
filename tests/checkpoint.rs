//! Checkpoint reading and writing: round trips through HF folders (single and sharded) and GGUF files,
//! the llama Q/K permutation, rope scaling in GGUF, tokenizer sources, the synthetic weight formula, and
//! malformed files of every kind each refused with a status and a message naming the file and the
//! tensor or key at fault.

mod common;

use common::Scratch;

use std::path::{Path, PathBuf};

use common::Rng;
use hostembed::Status;
use hostembed::checkpoint::gguf::{self, GgufValue};
use hostembed::checkpoint::write::{
    self, OwnedTensor, hf_config_json, synthetic_element, synthetic_weights, unpermute_qk_rows, write_gguf,
    write_hf_folder,
};
use hostembed::checkpoint::{Checkpoint, Format, ROPE_FREQS, TokenizerSource, expected_tensors, llama3_rope_factors};
use hostembed::model::{Arch, ModelConfig, RopeScaling, TensorSource, names};
use hostembed::tensor::{DType, FORMATS};

// ---------------------------------------------------------------------------------------------
// Helpers.

fn llama_cfg() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab: 96,
        hidden: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        intermediate: 96,
        rms_eps: 1e-5,
        rope_theta: 500000.0,
        // With head_dim 16 the wavelengths straddle 16..64: one pair kept, one smoothed, the rest divided.
        rope_scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 64,
        },
        rope_interleaved: false,
        max_position: 256,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: Some(1),
        eos: Some(2),
    }
}

fn qwen2_cfg() -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen2,
        vocab: 100,
        hidden: 64,
        layers: 2,
        heads: 4,
        kv_heads: 1,
        head_dim: 16,
        intermediate: 128,
        rms_eps: 1e-6,
        rope_theta: 1000000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 512,
        tied: true,
        qkv_bias: true,
        qk_norm: false,
        attention: Default::default(),
        bos: None,
        eos: Some(7),
    }
}

fn qwen3_cfg() -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen3,
        vocab: 80,
        hidden: 64,
        layers: 1,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        intermediate: 64,
        rms_eps: 1e-6,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::Linear { factor: 2.0 },
        rope_interleaved: false,
        max_position: 128,
        tied: false,
        qkv_bias: false,
        qk_norm: true,
        attention: Default::default(),
        bos: Some(0),
        eos: Some(3),
    }
}

fn all_cfgs() -> [ModelConfig; 3] {
    [llama_cfg(), qwen2_cfg(), qwen3_cfg()]
}

/// Asserts `r` failed with `status` and a message holding every one of `needles`.
#[track_caller]
fn assert_refused<T: std::fmt::Debug>(r: hostembed::Result<T>, status: Status, needles: &[&str]) {
    let e = r.expect_err("expected a refusal");
    println!("refused as expected: {e}");
    assert_eq!(e.status, status, "{e}");
    for n in needles {
        assert!(e.message.contains(n), "message {:?} does not name {n:?}", e.message);
    }
}

fn write_hf(dir: &Path, cfg: &ModelConfig, seed: u64, dtype: DType) -> Vec<OwnedTensor> {
    let tensors = synthetic_weights(cfg, seed, dtype);
    write_hf_folder(dir, cfg, &tensors, 1).unwrap();
    tensors
}

fn write_small_gguf(path: &Path, cfg: &ModelConfig, seed: u64, dtype: DType) -> Vec<OwnedTensor> {
    let tensors = synthetic_weights(cfg, seed, dtype);
    write_gguf(path, cfg, &tensors, &[]).unwrap();
    tensors
}

/// Every written tensor is in the checkpoint with its dtype, shape and bytes.
fn assert_same_tensors(ckpt: &Checkpoint, written: &[OwnedTensor]) {
    for t in written {
        let info = ckpt.info(&t.name).unwrap();
        assert_eq!((info.dtype, &info.shape), (t.dtype, &t.shape), "{}", t.name);
        assert!(ckpt.bytes_of(info) == t.data.as_slice(), "{}: bytes differ", t.name);
    }
}

fn replace_bytes(bytes: &mut [u8], from: &[u8], to: &[u8]) {
    assert_eq!(from.len(), to.len());
    let at = bytes.windows(from.len()).position(|w| w == from).unwrap_or_else(|| panic!("{from:?} not found"));
    bytes[at..at + from.len()].copy_from_slice(to);
}

/// Position just after the length-prefixed string `s` in a GGUF header.
fn after_string(bytes: &[u8], s: &str) -> usize {
    let mut needle = (s.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(s.as_bytes());
    bytes.windows(needle.len()).position(|w| w == needle).unwrap_or_else(|| panic!("{s} not found")) + needle.len()
}

/// Where a GGUF tensor info's fields are: (n_dims, first dim, type, offset) positions.
fn tensor_fields(bytes: &[u8], gguf_name: &str) -> (usize, usize, usize, usize) {
    let at = after_string(bytes, gguf_name);
    let n_dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    let ty = at + 4 + 8 * n_dims;
    (at, at + 4, ty, ty + 4)
}

fn put_u64(bytes: &mut [u8], at: usize, v: u64) {
    bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn get_u64(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

fn put_u32(bytes: &mut [u8], at: usize, v: u32) {
    bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// A valid small GGUF's bytes, then `edit` applied, written beside it; returns the edited file's path.
fn edited_gguf(dir: &Scratch, name: &str, cfg: &ModelConfig, dtype: DType, edit: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let good = dir.join(&format!("{name}-good.gguf"));
    write_small_gguf(&good, cfg, 5, dtype);
    let mut bytes = std::fs::read(&good).unwrap();
    edit(&mut bytes);
    let bad = dir.join(&format!("{name}.gguf"));
    std::fs::write(&bad, bytes).unwrap();
    bad
}

/// Rewrites the JSON header of a safetensors file through `edit`, keeping its data.
fn edit_safetensors_header(path: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut header);
    let mut text = serde_json::to_vec(&header).unwrap();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(path, out).unwrap();
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let path = dir.join("config.json");
    let mut json: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(json.as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_vec_pretty(&json).unwrap()).unwrap();
}

// ---------------------------------------------------------------------------------------------
// The synthetic formula.

/// Values printed by `scripts/hf_reference.py --selftest` (numpy's float32 arithmetic), as f32 bits.
#[test]
fn synthetic_values_match_the_numpy_generator() {
    let cases: [(&str, &[usize], u64, [(usize, u32); 4]); 4] = [
        (
            "model.embed_tokens.weight",
            &[8, 16],
            11,
            [(0, 0x3de86eb0), (1, 0xbf5a314a), (2, 0xbf6ecb4c), (127, 0xbec43238)],
        ),
        (
            "model.layers.0.self_attn.q_proj.weight",
            &[32, 48],
            22,
            [(0, 0xbbd385d3), (1, 0x3e0b5b5e), (2, 0x3dceb48b), (1535, 0x3daf2fb4)],
        ),
        (
            "model.layers.1.input_layernorm.weight",
            &[64],
            33,
            [(0, 0x3f86d226), (1, 0x3f80b720), (2, 0x3f7abb61), (63, 0x3f86a45e)],
        ),
        (
            "model.layers.0.self_attn.k_proj.bias",
            &[40],
            44,
            [(0, 0xbd1eb1d8), (1, 0x3ccc71f3), (2, 0x3d453bfa), (39, 0xbccb8e6d)],
        ),
    ];
    assert_eq!(write::fnv1a64(b"model.embed_tokens.weight"), 0xa88fd795d5c6d156);
    for (name, shape, seed, picks) in cases {
        for (i, bits) in picks {
            let v = synthetic_element(name, shape, seed, i);
            assert_eq!(v.to_bits(), bits, "{name}[{i}] = {v}");
        }
    }
}

/// The threaded generator in `synthetic_weights` writes, element for element, what the formula gives,
/// on a table large enough to be split across threads; norms and biases are F32, matrices as asked.
#[test]
fn synthetic_weights_follow_the_formula_across_threads() {
    let mut rng = Rng::fresh("synthetic_weights_follow_the_formula_across_threads");
    let seed = rng.next_u64();
    let cfg = ModelConfig { vocab: 20000, layers: 1, ..qwen2_cfg() };
    let weights = synthetic_weights(&cfg, seed, DType::F32);
    let names: Vec<String> = expected_tensors(&cfg).into_iter().map(|(n, _)| n).collect();
    assert_eq!(weights.iter().map(|t| t.name.clone()).collect::<Vec<_>>(), names);
    for t in &weights {
        let values = t.to_f32();
        for (i, v) in values.iter().enumerate() {
            assert_eq!(v.to_bits(), synthetic_element(&t.name, &t.shape, seed, i).to_bits(), "{}[{i}]", t.name);
        }
    }
    for t in synthetic_weights(&cfg, seed, DType::Bf16) {
        let vector = t.name.ends_with("norm.weight") || t.name.ends_with(".bias");
        assert_eq!(t.dtype, if vector { DType::F32 } else { DType::Bf16 }, "{}", t.name);
    }
    // Same seed, same bytes; another seed, other bytes.
    assert_eq!(synthetic_weights(&cfg, seed, DType::Q8_0), synthetic_weights(&cfg, seed, DType::Q8_0));
    assert_ne!(
        synthetic_weights(&cfg, seed ^ 1, DType::F16)[0].data,
        synthetic_weights(&cfg, seed, DType::F16)[0].data
    );
}

// ---------------------------------------------------------------------------------------------
// HF round trips.

#[test]
fn hf_round_trip_every_arch_and_dtype() {
    let mut rng = Rng::fresh("hf_round_trip_every_arch_and_dtype");
    let dir = Scratch::new("hf-round-trip");
    for cfg in all_cfgs() {
        for dtype in [DType::F32, DType::F16, DType::Bf16] {
            let folder = dir.join(&format!("{:?}-{}", cfg.arch, dtype.name()));
            let written = write_hf(&folder, &cfg, rng.next_u64(), dtype);
            let ckpt = Checkpoint::open(&folder).unwrap();
            assert_eq!(ckpt.format, Format::Safetensors);
            assert_eq!(ckpt.config, cfg);
            assert_eq!(ckpt.files.len(), 1);
            assert_eq!(ckpt.tensors.len(), written.len());
            assert_same_tensors(&ckpt, &written);
            assert_eq!(ckpt.weight_bytes(), written.iter().map(|t| t.data.len() as u64).sum::<u64>());
            assert_eq!(ckpt.embed().shape, [cfg.vocab, cfg.hidden]);
            // The TensorSource view decodes what was written.
            let norm = ckpt.tensor(names::FINAL_NORM).unwrap().to_f32();
            assert_eq!(norm, written.iter().find(|t| t.name == names::FINAL_NORM).unwrap().to_f32());
            assert_eq!(ckpt.tokenizer, TokenizerSource::None);
        }
    }
}

#[test]
fn hf_sharded_folder_reads_like_one_file() {
    let mut rng = Rng::fresh("hf_sharded_folder_reads_like_one_file");
    let dir = Scratch::new("hf-sharded");
    let cfg = llama_cfg();
    let tensors = synthetic_weights(&cfg, rng.next_u64(), DType::Bf16);
    write_hf_folder(&dir.0, &cfg, &tensors, 3).unwrap();
    assert!(!dir.join("model.safetensors").exists());
    for k in 1..=3 {
        assert!(dir.join(&format!("model-0000{k}-of-00003.safetensors")).is_file());
    }
    let ckpt = Checkpoint::open(&dir.0).unwrap();
    assert_eq!(ckpt.files.len(), 3);
    assert_eq!(ckpt.config, cfg);
    assert_same_tensors(&ckpt, &tensors);
    let files_used: std::collections::BTreeSet<usize> = ckpt.tensors.values().map(|t| t.file).collect();
    assert_eq!(files_used.len(), 3, "every shard holds tensors");

    // A shard the index names but the folder lacks: IoError naming the shard.
    std::fs::remove_file(dir.join("model-00002-of-00003.safetensors")).unwrap();
    assert_refused(Checkpoint::open(&dir.0), Status::IoError, &["model-00002-of-00003.safetensors"]);
}

#[test]
fn hf_index_refuses_paths_outside_the_folder() {
    let dir = Scratch::new("hf-index-escape");
    let cfg = qwen3_cfg();
    write_hf_folder(&dir.0, &cfg, &synthetic_weights(&cfg, 1, DType::F16), 2).unwrap();
    let index = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).unwrap().replace("model-00002-of-00002", "../model-00002-of-00002");
    std::fs::write(&index, text).unwrap();
    assert_refused(
        Checkpoint::open(&dir.0),
        Status::BadModel,
        &["model.safetensors.index.json", "not a file in this folder"],
    );
}

#[test]
fn hf_tied_and_untied_heads() {
    let dir = Scratch::new("hf-tied");
    // Tied by the config: no lm_head written, the output is the embedding.
    let cfg = qwen2_cfg();
    let written = write_hf(&dir.join("tied"), &cfg, 3, DType::Bf16);
    assert!(written.iter().all(|t| t.name != names::LM_HEAD));
    let ckpt = Checkpoint::open(&dir.join("tied")).unwrap();
    assert!(ckpt.config.tied);
    assert_eq!(ckpt.output(), ckpt.embed());

    // Untied in the config but lm_head absent: tied.
    let cfg = llama_cfg();
    let mut tensors = synthetic_weights(&cfg, 4, DType::Bf16);
    let head_bytes = tensors.iter().find(|t| t.name == names::LM_HEAD).unwrap().data.len() as u64;
    let all_bytes: u64 = tensors.iter().map(|t| t.data.len() as u64).sum();
    tensors.retain(|t| t.name != names::LM_HEAD);
    write_hf_folder(&dir.join("no-head"), &cfg, &tensors, 1).unwrap();
    let ckpt = Checkpoint::open(&dir.join("no-head")).unwrap();
    assert!(ckpt.config.tied);
    assert_eq!(ckpt.weight_bytes(), all_bytes - head_bytes);

    // Untied with its head: the head is lm_head and counts in the weight bytes.
    write_hf(&dir.join("untied"), &cfg, 4, DType::Bf16);
    let ckpt = Checkpoint::open(&dir.join("untied")).unwrap();
    assert!(!ckpt.config.tied);
    assert_eq!(ckpt.output().name, names::LM_HEAD);
    assert_eq!(ckpt.weight_bytes(), all_bytes);

    // tie_word_embeddings = true with an lm_head present: tied, the head file unused and uncounted.
    edit_config(&dir.join("untied"), |c| {
        c.insert("tie_word_embeddings".into(), true.into());
    });
    let ckpt = Checkpoint::open(&dir.join("untied")).unwrap();
    assert!(ckpt.config.tied);
    assert_eq!(ckpt.weight_bytes(), all_bytes - head_bytes);
}

#[test]
fn hf_config_variants_transformers_writes() {
    let dir = Scratch::new("hf-config-variants");
    let cfg = llama_cfg();
    write_hf(&dir.0, &cfg, 9, DType::F16);
    // transformers 5 writes rope_parameters (theta and scaling together) and may give eos as a list.
    edit_config(&dir.0, |c| {
        let scaling = c.remove("rope_scaling").unwrap();
        let theta = c.remove("rope_theta").unwrap();
        let mut params = scaling.as_object().unwrap().clone();
        params.insert("rope_theta".into(), theta);
        c.insert("rope_parameters".into(), params.into());
        c.insert("eos_token_id".into(), serde_json::json!([2, 9]));
        c.remove("head_dim");
        c.remove("num_key_value_heads");
    });
    let read = Checkpoint::open(&dir.0);
    // Without num_key_value_heads the KV heads default to the heads, which the k_proj shape refutes.
    assert_refused(read, Status::BadModel, &["model.layers.0.self_attn.k_proj.weight", "[32, 64]", "[64, 64]"]);
    edit_config(&dir.0, |c| {
        c.insert("num_key_value_heads".into(), 2.into());
    });
    assert_eq!(Checkpoint::open(&dir.0).unwrap().config, cfg);

    // The legacy spelling "type" and a null rope_scaling.
    edit_config(&dir.0, |c| {
        let mut params = c.remove("rope_parameters").unwrap().as_object().unwrap().clone();
        c.insert("rope_theta".into(), params.remove("rope_theta").unwrap());
        let kind = params.remove("rope_type").unwrap();
        params.insert("type".into(), kind);
        c.insert("rope_scaling".into(), params.into());
    });
    assert_eq!(Checkpoint::open(&dir.0).unwrap().config, cfg);
    edit_config(&dir.0, |c| {
        c.insert("rope_scaling".into(), serde_json::Value::Null);
    });
    assert_eq!(Checkpoint::open(&dir.0).unwrap().config.rope_scaling, RopeScaling::None);
}

#[test]
fn hf_config_json_has_the_keys_transformers_reads() {
    let json = hf_config_json(&llama_cfg());
    assert_eq!(json["model_type"], "llama");
    assert_eq!(json["architectures"][0], "LlamaForCausalLM");
    assert_eq!(json["rms_norm_eps"].as_f64(), Some(1e-5), "written through the shortest decimal");
    assert_eq!(json["rope_scaling"]["rope_type"], "llama3");
    assert_eq!(json["rope_scaling"]["original_max_position_embeddings"], 64);
    assert_eq!(json["num_key_value_heads"], 2);
    let json = hf_config_json(&qwen2_cfg());
    assert_eq!(json["tie_word_embeddings"], true);
    assert!(json["rope_scaling"].is_null());
    assert!(json["bos_token_id"].is_null());
}

#[test]
fn hf_tokenizer_json_beside_the_weights() {
    let dir = Scratch::new("hf-tokenizer");
    write_hf(&dir.0, &qwen3_cfg(), 2, DType::Bf16);
    std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
    let ckpt = Checkpoint::open(&dir.0).unwrap();
    assert_eq!(ckpt.tokenizer, TokenizerSource::Json(dir.join("tokenizer.json")));
    // A path to the weights file or to config.json opens the folder.
    let by_file = Checkpoint::open(&dir.join("model.safetensors")).unwrap();
    assert_eq!(by_file.path, dir.0);
    assert_eq!(Checkpoint::open(&dir.join("config.json")).unwrap().config, ckpt.config);
}

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

// ---------------------------------------------------------------------------------------------
// Malformed GGUF.

#[test]
fn gguf_truncated_after_the_rows() {
    let dir = Scratch::new("gguf-truncated");
    let path = dir.join("cut.gguf");
    write_small_gguf(&path, &llama_cfg(), 1, DType::F16);
    let ckpt = Checkpoint::open(&path).unwrap();
    let rows_end = ckpt.embed().offset + ckpt.embed().bytes;
    drop(ckpt);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..rows_end]).unwrap();
    assert_refused(Checkpoint::open(&path), Status::BadModel, &["cut.gguf", "run past the end of the file"]);
}

#[test]
fn gguf_header_corruptions_name_what_is_wrong() {
    let dir = Scratch::new("gguf-header");
    let cfg = llama_cfg();
    type Edit = fn(&mut Vec<u8>);
    let cases: [(&str, Edit, Status, &[&str]); 9] = [
        ("magic", |b| b[..4].copy_from_slice(b"GGUX"), Status::BadModel, &["not a GGUF file"]),
        ("version", |b| put_u32(b, 4, 4), Status::BadModel, &["version 4"]),
        ("tensor-count", |b| put_u64(b, 8, 1 << 60), Status::BadModel, &["tensor count"]),
        ("kv-count", |b| put_u64(b, 16, u64::MAX), Status::BadModel, &["metadata count"]),
        // The first key's length.
        ("key-length", |b| put_u64(b, 24, u64::MAX / 2), Status::BadModel, &["metadata entry 0", "string length"]),
        // general.architecture's value: type, then the string's length.
        (
            "value-length",
            |b| {
                let at = after_string(b, "general.architecture");
                put_u64(b, at + 4, 1 << 40);
            },
            Status::BadModel,
            &["key general.architecture", "string length"],
        ),
        (
            "value-type",
            |b| {
                let at = after_string(b, "general.architecture");
                put_u32(b, at, 99);
            },
            Status::BadModel,
            &["key general.architecture", "unknown value type 99"],
        ),
        (
            "alignment",
            |b| {
                let at = after_string(b, "general.alignment");
                put_u32(b, at + 4, 48);
            },
            Status::BadModel,
            &["general.alignment", "power of two"],
        ),
        (
            "dims",
            |b| {
                let (n_dims, ..) = tensor_fields(b, "blk.0.attn_k.weight");
                put_u32(b, n_dims, 5);
            },
            Status::BadModel,
            &["blk.0.attn_k.weight", "5 dimensions"],
        ),
    ];
    for (name, edit, status, needles) in cases {
        let path = edited_gguf(&dir, name, &cfg, DType::F16, edit);
        let mut needles = needles.to_vec();
        let file = format!("{name}.gguf");
        needles.push(&file);
        assert_refused(Checkpoint::open(&path), status, &needles);
    }
}

#[test]
fn gguf_tensor_info_corruptions_name_the_tensor() {
    let dir = Scratch::new("gguf-tensors");
    let cfg = llama_cfg();
    type Edit = fn(&mut Vec<u8>);
    let cases: [(&str, DType, Edit, Status, &[&str]); 8] = [
        (
            "misaligned",
            DType::F16,
            |b| {
                let (.., offset) = tensor_fields(b, "blk.0.attn_k.weight");
                let moved = get_u64(b, offset) + 2;
                put_u64(b, offset, moved);
            },
            Status::BadModel,
            &["blk.0.attn_k.weight", "not a multiple of the alignment 32"],
        ),
        (
            "overlap",
            DType::F16,
            |b| {
                let (.., q) = tensor_fields(b, "blk.0.attn_q.weight");
                let (.., k) = tensor_fields(b, "blk.0.attn_k.weight");
                let q_offset = get_u64(b, q);
                put_u64(b, k, q_offset);
            },
            Status::BadModel,
            &["blk.0.attn_q.weight", "blk.0.attn_k.weight", "overlap"],
        ),
        (
            "beyond-end",
            DType::F16,
            |b| {
                let (.., offset) = tensor_fields(b, "output_norm.weight");
                put_u64(b, offset, 1 << 50);
            },
            Status::BadModel,
            &["output_norm.weight", "run past the end of the file"],
        ),
        (
            // A larger row count than the data holds: it runs into the next tensor.
            "size-vs-shape",
            DType::F16,
            |b| {
                let (_, dim0, ..) = tensor_fields(b, "blk.0.attn_q.weight");
                put_u64(b, dim0 + 8, 128);
            },
            Status::BadModel,
            &["blk.0.attn_q.weight", "overlap"],
        ),
        (
            "partial-q8-block",
            DType::Q8_0,
            |b| {
                let (_, dim0, ..) = tensor_fields(b, "blk.0.attn_q.weight");
                put_u64(b, dim0, 48);
            },
            Status::BadModel,
            &["blk.0.attn_q.weight", "rows of 48 values", "not a whole number of Q8_0 blocks"],
        ),
        (
            "unknown-type",
            DType::F16,
            |b| {
                let (.., ty, _) = tensor_fields(b, "blk.1.ffn_up.weight");
                put_u32(b, ty, 99);
            },
            Status::BadModel,
            &["blk.1.ffn_up.weight", "unknown type 99"],
        ),
        (
            // 64 values a row: a quarter of a Q4_K super-block.
            "partial-q4_k-block",
            DType::F16,
            |b| {
                let (.., ty, _) = tensor_fields(b, "blk.1.ffn_up.weight");
                put_u32(b, ty, 12);
            },
            Status::BadModel,
            &["blk.1.ffn_up.weight", "rows of 64 values", "Q4_K blocks (256 values)"],
        ),
        (
            "iq2_xs",
            DType::F16,
            |b| {
                let (.., ty, _) = tensor_fields(b, "blk.1.ffn_up.weight");
                put_u32(b, ty, 17);
            },
            Status::Unsupported,
            &["blk.1.ffn_up.weight", "type IQ2_XS", "supported: F32, F16, BF16, Q8_0, Q4_0"],
        ),
    ];
    for (name, dtype, edit, status, needles) in cases {
        let path = edited_gguf(&dir, name, &cfg, dtype, edit);
        let file = format!("{name}.gguf");
        let mut needles = needles.to_vec();
        needles.push(&file);
        assert_refused(Checkpoint::open(&path), status, &needles);
    }
}

#[test]
fn gguf_missing_tensor_key_and_unknown_architecture() {
    let dir = Scratch::new("gguf-missing");
    let cfg = llama_cfg();
    let path = edited_gguf(&dir, "no-up", &cfg, DType::F16, |b| {
        replace_bytes(b, b"blk.1.ffn_up.weight", b"blk.1.ffn_uq.weight")
    });
    assert_refused(
        Checkpoint::open(&path),
        Status::BadModel,
        &["no-up.gguf", "model.layers.1.mlp.up_proj.weight", "missing"],
    );

    let path = edited_gguf(&dir, "twice", &cfg, DType::F16, |b| {
        replace_bytes(b, b"blk.0.ffn_up.weight", b"blk.1.ffn_up.weight")
    });
    assert_refused(Checkpoint::open(&path), Status::BadModel, &["twice.gguf", "blk.1.ffn_up.weight", "appears twice"]);

    let path = edited_gguf(&dir, "no-key", &cfg, DType::F16, |b| {
        replace_bytes(b, b"llama.embedding_length", b"llama.embedding_lengtX")
    });
    assert_refused(
        Checkpoint::open(&path),
        Status::BadModel,
        &["no-key.gguf", "key llama.embedding_length is missing"],
    );

    let path = edited_gguf(&dir, "key-type", &cfg, DType::F16, |b| {
        let at = after_string(b, "llama.block_count");
        put_u32(b, at, 6); // u32 -> f32, same width
    });
    assert_refused(Checkpoint::open(&path), Status::BadModel, &["key-type.gguf", "llama.block_count", "integer"]);

    let path = edited_gguf(&dir, "arch", &cfg, DType::F16, |b| {
        replace_bytes(b, b"\x05\0\0\0\0\0\0\0llama", b"\x05\0\0\0\0\0\0\0mamba")
    });
    assert_refused(Checkpoint::open(&path), Status::Unsupported, &["arch.gguf", "\"mamba\""]);

    // A tensor of the wrong shape: named with both shapes.
    let mut tensors = synthetic_weights(&cfg, 1, DType::F16);
    let k = tensors.iter_mut().find(|t| t.name == "model.layers.1.self_attn.k_proj.weight").unwrap();
    *k = OwnedTensor::from_f32(&k.name, DType::F16, &[64, 64], &vec![0.5; 64 * 64]).unwrap();
    let path = dir.join("shape.gguf");
    write_gguf(&path, &cfg, &tensors, &[]).unwrap();
    assert_refused(
        Checkpoint::open(&path),
        Status::BadModel,
        &["shape.gguf", "model.layers.1.self_attn.k_proj.weight", "[64, 64]", "[32, 64]"],
    );

    assert_refused(Checkpoint::open(&dir.join("absent.gguf")), Status::IoError, &["absent.gguf"]);
    std::fs::write(dir.join("empty.gguf"), b"").unwrap();
    assert_refused(Checkpoint::open(&dir.join("empty.gguf")), Status::BadModel, &["empty.gguf", "not a GGUF file"]);
}

/// Truncation at every header length and random byte flips: the reader returns, never panics, and a
/// refusal always names the file.
#[test]
fn gguf_random_corruption_never_panics() {
    let mut rng = Rng::fresh("gguf_random_corruption_never_panics");
    let dir = Scratch::new("gguf-fuzz");
    let good = dir.join("good.gguf");
    write_small_gguf(&good, &qwen3_cfg(), 2, DType::Q8_0);
    let bytes = std::fs::read(&good).unwrap();
    let header_end = gguf::parse(&bytes, "good").unwrap().data_start;
    let path = dir.join("bad.gguf");
    let check = |mutated: &[u8]| {
        std::fs::write(&path, mutated).unwrap();
        if let Err(e) = Checkpoint::open(&path) {
            assert!(e.message.contains("bad.gguf"), "{e}");
            assert!(matches!(e.status, Status::BadModel | Status::Unsupported), "{e}");
        }
    };
    for cut in (0..header_end).step_by(7).chain([bytes.len() - 1]) {
        check(&bytes[..cut]);
    }
    for _ in 0..300 {
        let mut mutated = bytes.clone();
        for _ in 0..1 + rng.below(4) {
            let at = rng.below(header_end as u64) as usize;
            mutated[at] = rng.next_u64() as u8;
        }
        check(&mutated);
    }
}

// ---------------------------------------------------------------------------------------------
// Malformed HF folders.

#[test]
fn hf_truncated_after_the_rows() {
    let dir = Scratch::new("hf-truncated");
    write_hf(&dir.0, &llama_cfg(), 1, DType::Bf16);
    let ckpt = Checkpoint::open(&dir.0).unwrap();
    let rows_end = ckpt.embed().offset + ckpt.embed().bytes;
    drop(ckpt);
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..rows_end]).unwrap();
    // Written sorted by name after the F32 vectors, the first tensor past the rows is layer 0's k_proj.
    assert_refused(Checkpoint::open(&dir.0), Status::BadModel, &["model.safetensors", "tensor model.layers.0"]);
}

#[test]
fn hf_safetensors_header_corruptions_name_the_tensor() {
    let dir = Scratch::new("hf-header");
    let cfg = qwen3_cfg();
    let embed = names::EMBED;
    type Edit = fn(&mut serde_json::Map<String, serde_json::Value>);
    let cases: [(&str, Edit, Status, &[&str]); 5] = [
        ("unknown-dtype", |h| h[names::EMBED]["dtype"] = "Q9".into(), Status::BadModel, &["Q9"]),
        ("unsupported-dtype", |h| h[names::EMBED]["dtype"] = "I16".into(), Status::Unsupported, &["I16"]),
        ("size-vs-shape", |h| h[names::EMBED]["shape"] = serde_json::json!([80, 65]), Status::BadModel, &["[80, 65]"]),
        (
            "offsets",
            |h| {
                let start = h[names::EMBED]["data_offsets"][0].as_u64().unwrap();
                h[names::EMBED]["data_offsets"][0] = (start + 2).into();
            },
            Status::BadModel,
            &["data offsets"],
        ),
        ("no-dtype", |h| drop(h[names::EMBED].as_object_mut().unwrap().remove("dtype")), Status::BadModel, &["dtype"]),
    ];
    for (name, edit, status, needles) in cases {
        let folder = dir.join(name);
        write_hf(&folder, &cfg, 1, DType::Bf16);
        edit_safetensors_header(&folder.join("model.safetensors"), edit);
        let mut needles = needles.to_vec();
        needles.extend([embed, "model.safetensors"]);
        assert_refused(Checkpoint::open(&folder), status, &needles);
    }

    let folder = dir.join("huge-header");
    write_hf(&folder, &cfg, 1, DType::Bf16);
    let path = folder.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    put_u64(&mut bytes, 0, u64::MAX);
    std::fs::write(&path, &bytes).unwrap();
    assert_refused(Checkpoint::open(&folder), Status::BadModel, &["model.safetensors"]);
    std::fs::write(&path, b"{}").unwrap();
    assert_refused(Checkpoint::open(&folder), Status::BadModel, &["model.safetensors"]);
}

#[test]
fn hf_missing_and_misshapen_tensors() {
    let dir = Scratch::new("hf-tensors");
    let cfg = qwen2_cfg();
    let q = "model.layers.1.self_attn.q_proj.weight";
    let mut tensors = synthetic_weights(&cfg, 1, DType::Bf16);
    tensors.retain(|t| t.name != q);
    write_hf_folder(&dir.join("missing"), &cfg, &tensors, 1).unwrap();
    assert_refused(Checkpoint::open(&dir.join("missing")), Status::BadModel, &["model.safetensors", q, "missing"]);

    let mut tensors = synthetic_weights(&cfg, 1, DType::Bf16);
    let bias = tensors.iter_mut().find(|t| t.name == "model.layers.0.self_attn.k_proj.bias").unwrap();
    *bias = OwnedTensor::from_f32(&bias.name, DType::F32, &[32], &[0.0; 32]).unwrap();
    write_hf_folder(&dir.join("shape"), &cfg, &tensors, 2).unwrap();
    assert_refused(
        Checkpoint::open(&dir.join("shape")),
        Status::BadModel,
        &["model-0000", "model.layers.0.self_attn.k_proj.bias", "[32]", "[16]"],
    );
}

#[test]
fn hf_config_problems_name_the_key() {
    let dir = Scratch::new("hf-config");
    let cfg = llama_cfg();
    type Edit = fn(&mut serde_json::Map<String, serde_json::Value>);
    let cases: [(&str, Edit, Status, &[&str]); 8] = [
        ("missing-key", |c| drop(c.remove("hidden_size")), Status::BadModel, &["hidden_size", "missing"]),
        (
            "wrong-type",
            |c| drop(c.insert("num_hidden_layers".into(), "2".into())),
            Status::BadModel,
            &["num_hidden_layers"],
        ),
        ("arch", |c| drop(c.insert("model_type".into(), "mistral".into())), Status::Unsupported, &["\"mistral\""]),
        (
            "rope-type",
            |c| drop(c.insert("rope_scaling".into(), serde_json::json!({"rope_type": "yarn", "factor": 4.0}))),
            Status::Unsupported,
            &["rope_scaling.rope_type", "yarn"],
        ),
        (
            "llama3-key",
            |c| drop(c["rope_scaling"].as_object_mut().unwrap().remove("low_freq_factor")),
            Status::BadModel,
            &["rope_scaling.low_freq_factor", "missing"],
        ),
        ("heads", |c| drop(c.insert("num_key_value_heads".into(), 3.into())), Status::BadModel, &["KV heads"]),
        ("bias", |c| drop(c.insert("attention_bias".into(), true.into())), Status::Unsupported, &["attention_bias"]),
        ("zero", |c| drop(c.insert("vocab_size".into(), 0.into())), Status::BadModel, &["vocab"]),
    ];
    for (name, edit, status, needles) in cases {
        let folder = dir.join(name);
        write_hf(&folder, &cfg, 1, DType::Bf16);
        edit_config(&folder, edit);
        let mut needles = needles.to_vec();
        needles.push("config.json");
        assert_refused(Checkpoint::open(&folder), status, &needles);
    }

    let folder = dir.join("bad-json");
    write_hf(&folder, &cfg, 1, DType::Bf16);
    std::fs::write(folder.join("config.json"), "{\"model_type\": \"llama\",").unwrap();
    assert_refused(Checkpoint::open(&folder), Status::BadModel, &["config.json", "not valid JSON"]);
    std::fs::write(folder.join("config.json"), "[1, 2]").unwrap();
    assert_refused(Checkpoint::open(&folder), Status::BadModel, &["config.json", "not a JSON object"]);
}

#[test]
fn hf_missing_files_are_io_errors_naming_the_path() {
    let dir = Scratch::new("hf-files");
    assert_refused(Checkpoint::open(&dir.join("nowhere")), Status::IoError, &["nowhere"]);
    // A folder without config.json.
    assert_refused(Checkpoint::open(&dir.0), Status::IoError, &["config.json"]);
    // config.json without weights.
    std::fs::write(dir.join("config.json"), serde_json::to_vec(&hf_config_json(&llama_cfg())).unwrap()).unwrap();
    assert_refused(Checkpoint::open(&dir.0), Status::IoError, &["model.safetensors"]);
}

#[test]
fn writers_refuse_bad_input() {
    let dir = Scratch::new("writers");
    let cfg = llama_cfg();
    let mut tensors = synthetic_weights(&cfg, 1, DType::Q8_0);
    assert_refused(write_hf_folder(&dir.join("q8"), &cfg, &tensors, 1), Status::InvalidArgument, &["Q8_0"]);
    tensors[3].data.pop();
    let name = tensors[3].name.clone();
    assert_refused(write_gguf(&dir.join("short.gguf"), &cfg, &tensors, &[]), Status::InvalidArgument, &[&name]);
    assert!(!dir.join("short.gguf").exists());
    let odd =
        OwnedTensor { name: "model.layers.0.odd.weight".into(), dtype: DType::F32, shape: vec![1], data: vec![0; 4] };
    assert_refused(write_gguf(&dir.join("odd.gguf"), &cfg, &[odd], &[]), Status::InvalidArgument, &["odd.weight"]);
    let extra = vec![("a.b".to_string(), GgufValue::U8(1)), ("a.b".to_string(), GgufValue::U8(2))];
    assert_refused(write_gguf(&dir.join("dup.gguf"), &cfg, &[], &extra), Status::InvalidArgument, &["a.b"]);
}
