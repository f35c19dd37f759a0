//! Bad models named by their tensors, the synthetic formula against the Python generator, parity with HF transformers.

use super::{ARCHS, small_config, synthetic_model, synthetic_tensor, tensor_shapes};
use crate::common::rel_l2;
use hostembed::checkpoint::write;
use hostembed::cpu::CpuModel;
use hostembed::model::{Arch, ModelConfig, RopeScaling, names};
use hostembed::tensor::DType;
use hostembed::{Status, cpu};
use std::path::Path;

#[test]
fn missing_or_misshapen_tensors_are_bad_models_naming_them() {
    for arch in ARCHS {
        let cfg = small_config(arch);
        for (name, shape) in tensor_shapes(&cfg) {
            let mut src = synthetic_model(&cfg, 7, DType::F32);
            src.tensors.remove(&name);
            let e = CpuModel::new(&src).err().unwrap_or_else(|| panic!("{arch:?} loaded without {name}"));
            assert_eq!(e.status, Status::BadModel);
            assert!(e.message.contains(&name), "{arch:?}: {}", e.message);

            let mut src = synthetic_model(&cfg, 7, DType::F32);
            let mut wrong = shape.clone();
            *wrong.last_mut().unwrap() += 1;
            let values = vec![0.5f32; wrong.iter().product()];
            src.set_f32(&name, wrong, &values);
            let e = CpuModel::new(&src).err().unwrap_or_else(|| panic!("{arch:?} loaded a misshapen {name}"));
            assert_eq!(e.status, Status::BadModel);
            assert!(e.message.contains(&name), "{arch:?}: {}", e.message);
        }
    }
    // Bytes that do not hold the shape.
    let cfg = small_config(Arch::Llama);
    let mut src = synthetic_model(&cfg, 7, DType::F32);
    let name = names::layer(1, names::UP);
    src.tensors.get_mut(&name).unwrap().bytes.truncate(100);
    let e = CpuModel::new(&src).err().unwrap();
    assert!(e.status == Status::BadModel && e.message.contains(&name), "{}", e.message);
    // Heads that do not divide into KV groups.
    let src = synthetic_model(&ModelConfig { heads: 3, kv_heads: 2, ..cfg.clone() }, 7, DType::F32);
    assert_eq!(CpuModel::new(&src).err().unwrap().status, Status::BadModel);
}

// ---------------------------------------------------------------------------------------------
// Parity with HF transformers (scripts/hf_reference.py).

/// Values printed by `scripts/hf_reference.py --selftest` (numpy): FNV-1a of the name, then
/// element index: f32 bits.
#[test]
fn synthetic_formula_matches_the_python_generator() {
    let cases: [(&str, &[usize], u64, u64, [(usize, u32); 4]); 4] = [
        (
            "model.embed_tokens.weight",
            &[8, 16],
            11,
            0xa88fd795d5c6d156,
            [(0, 0x3de86eb0), (1, 0xbf5a314a), (2, 0xbf6ecb4c), (127, 0xbec43238)],
        ),
        (
            "model.layers.0.self_attn.q_proj.weight",
            &[32, 48],
            22,
            0x3a296639dc11febb,
            [(0, 0xbbd385d3), (1, 0x3e0b5b5e), (2, 0x3dceb48b), (1535, 0x3daf2fb4)],
        ),
        (
            "model.layers.1.input_layernorm.weight",
            &[64],
            33,
            0x6feb102c72cf8a89,
            [(0, 0x3f86d226), (1, 0x3f80b720), (2, 0x3f7abb61), (63, 0x3f86a45e)],
        ),
        (
            "model.layers.0.self_attn.k_proj.bias",
            &[40],
            44,
            0xc63519b3b8f76f48,
            [(0, 0xbd1eb1d8), (1, 0x3ccc71f3), (2, 0x3d453bfa), (39, 0xbccb8e6d)],
        ),
    ];
    for (name, shape, seed, fnv, picks) in cases {
        assert_eq!(write::fnv1a64(name.as_bytes()), fnv, "{name}");
        let values = synthetic_tensor(name, shape, seed);
        for (i, bits) in picks {
            assert_eq!(values[i].to_bits(), bits, "{name}[{i}] = {}", values[i]);
        }
    }
}

/// A ModelConfig from an HF config.json (transformers 4 `rope_scaling` or 5 `rope_parameters`).
fn config_from_hf_json(v: &serde_json::Value) -> ModelConfig {
    let n = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("config.json: {k}")) as usize;
    let arch = match v["model_type"].as_str().unwrap() {
        "llama" => Arch::Llama,
        "qwen2" => Arch::Qwen2,
        "qwen3" => Arch::Qwen3,
        other => panic!("config.json: model_type {other}"),
    };
    let rope = if v["rope_parameters"].is_object() { &v["rope_parameters"] } else { &v["rope_scaling"] };
    let rope_theta = v["rope_theta"].as_f64().or_else(|| rope["rope_theta"].as_f64()).expect("rope_theta") as f32;
    let rope_type = rope["rope_type"].as_str().or_else(|| rope["type"].as_str()).unwrap_or("default");
    let f = |k: &str| rope[k].as_f64().unwrap_or_else(|| panic!("config.json: rope {k}")) as f32;
    let rope_scaling = match rope_type {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: f("factor") },
        "llama3" => RopeScaling::Llama3 {
            factor: f("factor"),
            low_freq_factor: f("low_freq_factor"),
            high_freq_factor: f("high_freq_factor"),
            original_max_position: f("original_max_position_embeddings") as u32,
        },
        other => panic!("config.json: rope type {other}"),
    };
    let (hidden, heads) = (n("hidden_size"), n("num_attention_heads"));
    ModelConfig {
        arch,
        vocab: n("vocab_size"),
        hidden,
        layers: n("num_hidden_layers"),
        heads,
        kv_heads: n("num_key_value_heads"),
        head_dim: v["head_dim"].as_u64().map_or(hidden / heads, |d| d as usize),
        intermediate: n("intermediate_size"),
        rms_eps: v["rms_norm_eps"].as_f64().unwrap() as f32,
        rope_theta,
        rope_scaling,
        rope_interleaved: false,
        max_position: n("max_position_embeddings"),
        tied: v["tie_word_embeddings"].as_bool().unwrap(),
        qkv_bias: arch == Arch::Qwen2 || v["attention_bias"].as_bool().unwrap_or(false),
        qk_norm: arch == Arch::Qwen3,
        attention: Default::default(),
        bos: v["bos_token_id"].as_u64().map(|t| t as u32),
        eos: v["eos_token_id"].as_u64().map(|t| t as u32),
        moe: None,
    }
}

fn read_le<T>(path: &Path, decode: fn([u8; 4]) -> T) -> Vec<T> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(bytes.len() % 4, 0, "{}", path.display());
    bytes.chunks_exact(4).map(|b| decode([b[0], b[1], b[2], b[3]])).collect()
}

/// The committed logits come from `scripts/hf_reference.py --out tests/data/hf_reference` (torch, transformers).
#[test]
fn matches_hf_reference() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf_reference");
    // The llama family's (Gemma 3's is tests/gemma3.rs's).
    let models: Vec<_> = ["llama", "qwen2", "qwen3"].map(|name| root.join(name)).into_iter().collect();
    for dir in &models {
        assert!(dir.join("logits.f32").is_file(), "{}: missing (run scripts/hf_reference.py)", dir.display());
    }
    // One thread a model: unoptimized test builds take tens of seconds for the hidden-1024 model.
    std::thread::scope(|scope| {
        for dir in &models {
            scope.spawn(move || check_against_hf(dir));
        }
    });
}

fn check_against_hf(dir: &Path) {
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let meta: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
    let cfg = config_from_hf_json(&json);
    let seed = meta["seed"].as_u64().unwrap();
    let toks = read_le(&dir.join("tokens.u32"), u32::from_le_bytes);
    let logits = read_le(&dir.join("logits.f32"), f32::from_le_bytes);
    assert_eq!(logits.len(), toks.len() * cfg.vocab, "{}", dir.display());

    // HF's own rotary frequencies, so a scaling mismatch shows as such rather than as logits.
    let hf_inv_freq = read_le(&dir.join("inv_freq.f32"), f32::from_le_bytes);
    let inv_freq = cpu::rope_inv_freq(&cfg);
    assert_eq!(inv_freq.len(), hf_inv_freq.len());
    for (i, (a, b)) in inv_freq.iter().zip(&hf_inv_freq).enumerate() {
        assert!((a - b).abs() <= 2e-7 * b.abs(), "{} inv_freq[{i}]: {a} vs HF {b}", dir.display());
    }

    // The script loaded exactly the tensors this model reads.
    let mut expected: Vec<String> = tensor_shapes(&cfg).into_iter().map(|(n, _)| n).collect();
    expected.sort();
    let loaded: Vec<String> =
        meta["tensors"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_string()).collect();
    assert_eq!(loaded, expected, "{}", dir.display());

    let src = synthetic_model(&cfg, seed, DType::F32);
    let model = CpuModel::new(&src).unwrap();
    let got = model.forward_all(&mut model.new_stream(toks.len()), &toks).unwrap();
    let mut worst = 0f64;
    for (pos, (g, want)) in got.iter().zip(logits.chunks(cfg.vocab)).enumerate() {
        let err = rel_l2(g, want);
        // The issue asks for 1e-4; this backend lands near 2e-7 (HF's own f32 run: 5e-7), so hold it tighter.
        assert!(err < 1e-5, "{} position {pos}: relative L2 {err:.3e}", dir.display());
        worst = worst.max(err);
    }
    println!("{}: {:?}, max relative L2 against HF {worst:.3e}", dir.display(), cfg.arch);
}
