//! Round trips through HF folders: every arch and dtype, shards, tied heads, config variants, tokenizer.json.

use super::{all_cfgs, assert_refused, assert_same_tensors, edit_config, llama_cfg, qwen2_cfg, qwen3_cfg, write_hf};
use crate::common::{Rng, Scratch};
use hostembed::Status;
use hostembed::checkpoint::write::{hf_config_json, synthetic_weights, write_hf_folder};
use hostembed::checkpoint::{Checkpoint, Format, TokenizerSource};
use hostembed::model::{RopeScaling, TensorSource, names};
use hostembed::tensor::DType;

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
