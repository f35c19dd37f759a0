//! Malformed HF folders refused with a message naming the file, tensor or key, and the writers' refusals.

use super::{assert_refused, edit_config, edit_safetensors_header, llama_cfg, put_u64, qwen2_cfg, qwen3_cfg, write_hf};
use crate::common::Scratch;
use hostembed::Status;
use hostembed::checkpoint::Checkpoint;
use hostembed::checkpoint::gguf::GgufValue;
use hostembed::checkpoint::write::{OwnedTensor, hf_config_json, synthetic_weights, write_gguf, write_hf_folder};
use hostembed::model::names;
use hostembed::tensor::DType;

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
