//! The decode engine on the GPU through its C ABI, on one small untied Llama-like model written as HF
//! safetensors (BF16) and as GGUF (F16, Q8_0, BF16): the three placements give identical token streams,
//! greedy and sampled, after a prompt of several chunks (SHA-256 of the token ids printed, as in the seed
//! receipt); max_batch 0 is the default on CUDA too; CUDA against the CPU
//! engine on the same files; safetensors against GGUF of the same weights; refused steps on CUDA;
//! batches (the KV page pool, truncate, per-stream sampling, and random batches of single tokens and
//! prompt chunks against stepping alone in every weight format, the Q4_K_M mix and the `gguf` Python
//! package's F16 file). Prints SKIP without a device.

#[path = "../common/mod.rs"]
mod common;

mod batch_streams;
mod batches;
mod streams;

use common::{Held, Rng, cuda_options, device_info, step};
use hostembed::checkpoint::Checkpoint;
use hostembed::checkpoint::write::{write_synthetic_gguf, write_synthetic_hf};
use hostembed::engine::{engine_backend, engine_options, engine_tristate};
use hostembed::fit::engine_placement;
use hostembed::model::{Arch, ModelConfig, RopeScaling};
use hostembed::tensor::DType;
use hostembed::{engine, fit};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// The weights' seed: fixed, so the printed SHA-256 lines compare across runs and machines.
const WEIGHTS_SEED: u64 = 0x6870_6f73_7465_6d62;

/// The sampled runs' seed.
const SAMPLING_SEED: u64 = 1;

const PROMPT: usize = 16;

const STEPS: usize = 64;

const WINDOW: u32 = 256;

/// Untied Llama 3 with GQA 4:1 and llama3 rope scaling; every matrix's rows are whole Q8_0 blocks.
fn config() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab: 1536,
        hidden: 256,
        layers: 2,
        heads: 8,
        kv_heads: 2,
        head_dim: 32,
        intermediate: 768,
        rms_eps: 1e-5,
        rope_theta: 500000.0,
        rope_scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 64,
        },
        rope_interleaved: false,
        max_position: 4096,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: Some(1),
        eos: Some(2),
        moe: None,
    }
}

/// One checkpoint of the model: a label and the path to open.
struct Format {
    label: &'static str,
    path: PathBuf,
}

/// The same weights as an HF folder in BF16 and as GGUF in `gguf` dtypes, in that order.
fn write_formats(dir: &Path, gguf: &[DType]) -> Vec<Format> {
    let cfg = config();
    let hf = dir.join("hf-bf16");
    write_synthetic_hf(&hf, &cfg, WEIGHTS_SEED, DType::Bf16).unwrap();
    let mut out = vec![Format { label: "safetensors BF16", path: hf }];
    for &dtype in gguf {
        let path = dir.join(format!("model-{}.gguf", dtype.name()));
        write_synthetic_gguf(&path, &cfg, WEIGHTS_SEED, dtype).unwrap();
        let label = match dtype {
            DType::F16 => "GGUF F16",
            DType::Q8_0 => "GGUF Q8_0",
            DType::Bf16 => "GGUF BF16",
            DType::F32 => "GGUF F32",
            other => panic!("write_formats: no label for {}", other.name()),
        };
        assert_eq!(Checkpoint::open(&path).unwrap().embed().dtype, dtype, "{label}: the rows' format");
        out.push(Format { label, path });
    }
    out
}

/// The prompt: fixed ids spread over the vocabulary.
fn prompt() -> Vec<i32> {
    prompt_of(PROMPT)
}

fn prompt_of(n: usize) -> Vec<i32> {
    (0..n as i32).map(|i| (i * 7919 + 13) % config().vocab as i32).collect()
}

/// A prompt of several chunks at `greedy_cuda`'s max_batch of 32, the last one partial.
const LONG_PROMPT: usize = 3 * 32 + 17;

fn greedy_cuda() -> engine_options {
    cuda_options(WINDOW, 1, 32)
}

fn sampled(o: engine_options) -> engine_options {
    engine_options { temperature: 0.8, top_k: 40, top_p: 0.95, seed: SAMPLING_SEED, ..o }
}

fn cpu() -> engine_options {
    engine_options { backend: engine_backend::Cpu, room_bytes: 0, ..greedy_cuda() }
}

/// `base` changed to put the rows in each placement: all the room there is, one byte short of the
/// rule's need (HOST_MAPPED), and mmap_rows set (FILE_MAPPED).
fn placements(path: &Path, base: engine_options) -> Vec<(engine_placement, engine_options)> {
    let ckpt = Checkpoint::open(path).unwrap();
    let inputs = engine::fit_inputs(&ckpt, &base, Some(&device_info())).unwrap();
    let need = fit::plan(&inputs).unwrap().need_bytes;
    vec![
        (engine_placement::Device, base),
        (engine_placement::HostMapped, engine_options { room_bytes: need - 1, ..base }),
        (engine_placement::FileMapped, engine_options { mmap_rows: engine_tristate::Yes, ..base }),
    ]
}

/// Steps the prompt, then feeds each chosen token back `steps` times: the chosen tokens.
fn decode(e: &Held, prompt: &[i32], steps: usize) -> Vec<i32> {
    let mut tokens = vec![step(e, 0, prompt)];
    for _ in 0..steps {
        tokens.push(step(e, 0, &[*tokens.last().unwrap()]));
    }
    tokens
}

/// SHA-256 of the token ids as little-endian i32s, in hex.
fn sha256_hex(tokens: &[i32]) -> String {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect()
}

// ---------------------------------------------------------------------------------------------
// Batches: engine_step_batch, the KV page pool, truncate and per-stream sampling on CUDA.

/// `streams` streams of `window` tokens on CUDA, in a pool of their full windows.
fn batch_cuda(window: u32, streams: u32) -> engine_options {
    engine_options { context: window, max_streams: streams, ..greedy_cuda() }
}

/// `n` ids from a seeded walk over the vocabulary.
fn ids(rng: &mut Rng, n: usize) -> Vec<i32> {
    rng.ids(config().vocab, n)
}
