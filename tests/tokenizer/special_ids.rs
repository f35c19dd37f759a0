//! BOS, EOS and end-of-generation ids through the C ABI, as GGUF keys and HF configs say.

use super::{CpuEngine, asset, eog_ids, model_info, reference_bpe_vocab, reference_gguf, tiny_config};
use crate::common::Scratch;
use hostembed::Status;
use hostembed::abi::{ENGINE_BOS_MODEL, ENGINE_BOS_NO, ENGINE_BOS_YES};
use hostembed::checkpoint::gguf::GgufValue;
use hostembed::checkpoint::write::{synthetic_weights, write_gguf, write_hf_folder};
use hostembed::engine::{default_options, engine_backend};
use hostembed::ffi::{engine_init_fit, engine_is_eog};
use hostembed::model::ModelConfig;
use hostembed::tensor::DType;
use hostembed::tokenizer::GgufBpeVocab;
use serde_json::Value;
use std::ffi::CString;

/// GGUF keys decide BOS and EOS; ENGINE_BOS_MODEL follows them, the old true/false still work, and the
/// end-of-generation ids are EOS, the eot/eom keys and the vocabulary's known end markers.
#[test]
fn gguf_keys_decide_bos_eos_and_end_of_generation() {
    let dir = Scratch::new("gguf-special");
    let v = reference_bpe_vocab();
    let id = |t: &str| v.tokens.iter().position(|x| x == t).unwrap() as i32;
    let text = b"rows in host memory";

    // SmolLM2's keys: no BOS. The smollm pre-tokenizer loads without a note.
    let quiet = reference_gguf(
        &dir,
        "no-bos.gguf",
        vec![
            ("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(false)),
            ("tokenizer.ggml.eot_token_id".into(), GgufValue::U32(2)),
        ],
    );
    let e = CpuEngine::open(&quiet);
    let info = model_info(&e);
    assert_eq!((info.bos, info.eos, info.add_bos, info.add_eos), (0, 1, false, false));
    let (s, plain, n) = e.tokenize(text, ENGINE_BOS_NO, 64);
    assert_eq!(s, Status::Ok);
    let plain = plain[..n].to_vec();
    let (_, ids, n) = e.tokenize(text, ENGINE_BOS_MODEL, 64);
    assert_eq!(&ids[..n], &plain[..], "the model says no BOS");
    let (_, ids, n) = e.tokenize(text, ENGINE_BOS_YES, 64);
    assert_eq!(&ids[..n], &[&[0], &plain[..]].concat()[..], "asked for BOS, BOS comes first");
    // EOS (1), the eot key (2 = <|im_start|>, named so here), and the markers <|im_end|> and <|eot_id|>.
    let mut want = vec![1, 2, id("<|im_end|>"), id("<|eot_id|>")];
    want.sort_unstable();
    assert_eq!(eog_ids(&e), want);
    for i in 0..v.tokens.len() as i32 + 6 {
        // SAFETY: a live engine.
        assert_eq!(unsafe { engine_is_eog(e.0, i) }, want.contains(&i), "id {i}");
    }
    // SAFETY: a live engine.
    assert!(!unsafe { engine_is_eog(e.0, -1) });
    // SAFETY: a live engine.
    assert!(!unsafe { engine_is_eog(e.0, i32::MAX) });
    // SAFETY: a NULL engine is refused (false).
    assert!(!unsafe { engine_is_eog(std::ptr::null(), 1) });
    drop(e);

    // Keys asking for both: ENGINE_BOS_MODEL puts BOS first and EOS last.
    let both = reference_gguf(
        &dir,
        "both.gguf",
        vec![
            ("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(true)),
            ("tokenizer.ggml.add_eos_token".into(), GgufValue::Bool(true)),
        ],
    );
    let e = CpuEngine::open(&both);
    let info = model_info(&e);
    assert_eq!((info.add_bos, info.add_eos), (true, true));
    let (_, ids, n) = e.tokenize(text, ENGINE_BOS_MODEL, 64);
    assert_eq!(&ids[..n], &[&[0], &plain[..], &[1]].concat()[..]);
    drop(e);

    // No keys: the pre-tokenizer family decides (llama-bpe wants BOS, as llama.cpp has it).
    let dir2 = Scratch::new("gguf-special-default");
    let v2 = reference_bpe_vocab();
    let cfg = ModelConfig { vocab: v2.tokens.len(), bos: Some(0), eos: Some(1), ..tiny_config() };
    let vocab = GgufBpeVocab { tokens: v2.tokens, merges: v2.merges, token_types: v2.types };
    for (pre, want) in [("llama-bpe", true), ("qwen2", false)] {
        let path = dir2.0.join(format!("{pre}.gguf"));
        write_gguf(&path, &cfg, &synthetic_weights(&cfg, 3, DType::F32), &vocab.gguf_kv(pre)).unwrap();
        let e = CpuEngine::open(&path);
        assert_eq!(model_info(&e).add_bos, want, "{pre}");
    }
}

/// tokenizer_config.json decides BOS and EOS on the HF path, else the tokenizer.json post-processor;
/// config.json and generation_config.json eos lists end generation.
#[test]
fn hf_configs_decide_bos_eos_and_end_of_generation() {
    let dir = Scratch::new("hf-special");
    let cfg = tiny_config();
    let hf = dir.0.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    write_hf_folder(&hf, &cfg, &synthetic_weights(&cfg, 5, DType::F32), 1).unwrap();
    std::fs::copy(asset("tokenizer.json"), hf.join("tokenizer.json")).unwrap();
    let text = b"host memory";

    // Nothing says: the committed tokenizer.json has no post-processor, so no BOS.
    let e = CpuEngine::open(&hf);
    assert_eq!((model_info(&e).add_bos, model_info(&e).add_eos), (false, false));
    assert_eq!(eog_ids(&e), vec![1]);
    let (_, plain, n) = e.tokenize(text, ENGINE_BOS_NO, 64);
    let plain = plain[..n].to_vec();
    drop(e);

    std::fs::write(hf.join("tokenizer_config.json"), r#"{"add_bos_token": true, "add_eos_token": false, "bos_token": {"content": "<|bos|>"}, "eos_token": "<|eos|>"}"#).unwrap();
    std::fs::write(hf.join("generation_config.json"), r#"{"eos_token_id": [1, 7, 9]}"#).unwrap();
    let e = CpuEngine::open(&hf);
    assert_eq!((model_info(&e).add_bos, model_info(&e).add_eos), (true, false));
    let (_, ids, n) = e.tokenize(text, ENGINE_BOS_MODEL, 64);
    assert_eq!(&ids[..n], &[&[0], &plain[..]].concat()[..]);
    assert_eq!(eog_ids(&e), vec![1, 7, 9]);
    drop(e);

    // A post-processor that puts BOS first is what transformers applies when the config is silent.
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(asset("tokenizer.json")).unwrap()).unwrap();
    json["post_processor"] = serde_json::json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [0], "tokens": ["<|bos|>"]}}
    });
    std::fs::write(hf.join("tokenizer.json"), serde_json::to_string(&json).unwrap()).unwrap();
    std::fs::write(hf.join("tokenizer_config.json"), "{}").unwrap();
    let e = CpuEngine::open(&hf);
    assert!(model_info(&e).add_bos, "the post-processor adds BOS");
    drop(e);

    // A broken optional file is a clear BAD_MODEL naming it.
    std::fs::write(hf.join("tokenizer_config.json"), r#"{"add_bos_token": "yes"}"#).unwrap();
    let path = CString::new(hf.to_str().unwrap()).unwrap();
    let mut opts = default_options();
    opts.backend = engine_backend::Cpu;
    let mut e = std::ptr::null_mut();
    // SAFETY: a NUL-terminated path, live options and a writable handle (left NULL on failure).
    assert_eq!(unsafe { engine_init_fit(path.as_ptr(), &opts, &mut e) }, Status::BadModel);
    assert!(e.is_null());
    assert!(hostembed::status::last_error().contains("tokenizer_config.json"), "{}", hostembed::status::last_error());
}
