//! Checkpoint reading and writing: round trips through HF folders (single and sharded) and GGUF files,
//! the llama Q/K permutation, rope scaling in GGUF, tokenizer sources, the synthetic weight formula, and
//! malformed files of every kind each refused with a status and a message naming the file and the
//! tensor or key at fault.

#[path = "../common/mod.rs"]
mod common;

mod gguf;
mod hf;
mod malformed_gguf;
mod malformed_hf;
mod synthetic;

use common::Scratch;
use hostembed::Status;
use hostembed::checkpoint::Checkpoint;
use hostembed::checkpoint::write::{OwnedTensor, synthetic_weights, write_gguf, write_hf_folder};
use hostembed::model::{Arch, ModelConfig, RopeScaling};
use hostembed::tensor::DType;
use std::path::{Path, PathBuf};

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
        moe: None,
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
        moe: None,
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
        moe: None,
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
