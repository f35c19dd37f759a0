//! Gemma 3 on the CPU backend: the forward against a plain definition written here (scaled embedding,
//! pre- and post-norms, per-head q/k norms, GeGLU, sliding windows with their own rotary base), prompts
//! and batches against token-by-token steps bit for bit, HF folders against GGUF files, HF
//! transformers' logits (scripts/hf_reference.py), the readers' refusals, and the chat template.

mod common;
use common::gemma3::Gemma3;
use common::{Rng, Scratch, rel_l2};

use std::path::Path;

use hostembed::Status;
use hostembed::checkpoint::write::{self, MemSource, OwnedTensor};
use hostembed::checkpoint::{Checkpoint, safetensors};
use hostembed::cpu::{self, CpuModel};
use hostembed::model::{
    Arch, AttentionConfig, ModelConfig, RopeScaling, SlidingWindow, TensorSource, names, rope_inv_freq,
    rope_inv_freq_local,
};
use hostembed::tensor::DType;
use hostembed::tokenizer::chat::{self, ChatMessage};

/// Four layers, local ones 0 and 2 (a global layer every second) over 7 positions; q_dim 128 against
/// hidden 64; scores scaled by 1/sqrt(24) rather than 1/sqrt(head_dim); linear rope scaling on the global
/// layers only.
fn small() -> ModelConfig {
    Gemma3::on_cpu(256)
}

/// A model GGUF and HF spell alike (`common::gemma3::gguf_shaped`), local windows of 9.
fn gguf_shaped() -> ModelConfig {
    common::gemma3::gguf_shaped(small(), 9)
}

fn tokens(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
}

/// The logits after each token, computed position by position from the definition (every value in
/// f32 as the model keeps it; the softmax and GELU in f64): norms multiply by the stored weights
/// (the readers hold 1 + w), local layers see their last `window` positions with their own rotary base.
fn plain_logits(src: &dyn TensorSource, toks: &[u32]) -> Vec<Vec<f32>> {
    let cfg = src.config();
    let (q_dim, kv_dim, hd, hidden) = (cfg.q_dim(), cfg.kv_dim(), cfg.head_dim, cfg.hidden);
    let w = |name: &str| src.tensor(name).unwrap();
    let v = |name: &str| w(name).to_f32();
    let matvec = |name: &str, x: &[f32]| {
        let t = w(name);
        let mut out = vec![0f32; t.rows()];
        cpu::matvec(&t, x, &mut out);
        out
    };
    let norm = |x: &[f32], g: &[f32]| {
        let mut out = vec![0f32; x.len()];
        cpu::rmsnorm(x, g, cfg.rms_eps, &mut out);
        out
    };
    let (global, local) = (rope_inv_freq(cfg), rope_inv_freq_local(cfg).unwrap_or_default());
    let scale = (hidden as f64).sqrt() as f32;
    let mut xs: Vec<Vec<f32>> =
        toks.iter().map(|&t| w(names::EMBED).row_f32(t as usize).iter().map(|e| e * scale).collect()).collect();
    let group = cfg.heads / cfg.kv_heads;
    let score_scale = 1.0 / cfg.attention.query_scale_base.map_or(hd as f64, |b| b as f64).sqrt();
    for i in 0..cfg.layers {
        let l = |part: &str| names::layer(i, part);
        let window = cfg.attention.window(i);
        let inv_freq = if window.is_some() { &local } else { &global };
        let (mut qs, mut ks, mut vs) = (vec![], vec![], vec![]);
        for (pos, x) in xs.iter().enumerate() {
            let h = norm(x, &v(&l(names::ATTN_NORM)));
            let (mut q, mut k) = (matvec(&l(names::Q), &h), matvec(&l(names::K), &h));
            let (qn, kn) = (v(&l(names::Q_NORM)), v(&l(names::K_NORM)));
            q = q.chunks(hd).flat_map(|head| norm(head, &qn)).collect();
            k = k.chunks(hd).flat_map(|head| norm(head, &kn)).collect();
            cpu::rope(&mut q, cfg.heads, hd, pos, inv_freq, false);
            cpu::rope(&mut k, cfg.kv_heads, hd, pos, inv_freq, false);
            qs.push(q);
            ks.push(k);
            vs.push(matvec(&l(names::V), &h));
        }
        for (pos, x) in xs.iter_mut().enumerate() {
            let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let mut attn = vec![0f32; q_dim];
            for head in 0..cfg.heads {
                let kvh = head / group;
                let q = &qs[pos][head * hd..(head + 1) * hd];
                let scores: Vec<f64> = (first..=pos)
                    .map(|j| {
                        let k = &ks[j][kvh * hd..(kvh + 1) * hd];
                        q.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * score_scale
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for d in 0..hd {
                    let acc: f64 = (first..=pos).zip(&weights).map(|(j, p)| p * vs[j][kvh * hd + d] as f64).sum();
                    attn[head * hd + d] = (acc / total) as f32;
                }
            }
            assert_eq!(kv_dim, ks[pos].len());
            cpu::add(x, &norm(&matvec(&l(names::O), &attn), &v(&l(names::POST_ATTN_NORM))));
            let h = norm(x, &v(&l(names::PRE_FFN_NORM)));
            let (gate, up) = (matvec(&l(names::GATE), &h), matvec(&l(names::UP), &h));
            let gated: Vec<f32> = gate
                .iter()
                .zip(&up)
                .map(|(&g, &u)| {
                    let g = g as f64;
                    let c = (2.0 / std::f64::consts::PI).sqrt();
                    (0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh()) * u as f64) as f32
                })
                .collect();
            cpu::add(x, &norm(&matvec(&l(names::DOWN), &gated), &v(&l(names::POST_FFN_NORM))));
        }
    }
    xs.iter().map(|x| matvec(names::EMBED, &norm(x, &v(names::FINAL_NORM)))).collect()
}

fn assert_close(got: &[Vec<f32>], want: &[Vec<f32>], bound: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (pos, (g, w)) in got.iter().zip(want).enumerate() {
        let err = rel_l2(g, w);
        assert!(err < bound, "{what} position {pos}: relative L2 {err:.3e}");
    }
}

#[test]
fn the_forward_is_the_plain_definition_and_the_window_matters() {
    let mut rng = Rng::fresh("the_forward_is_the_plain_definition_and_the_window_matters");
    let cfg = small();
    let src = MemSource::synthetic(&cfg, rng.next_u64(), DType::F32);
    let toks = tokens(&mut rng, 24, cfg.vocab);
    let model = CpuModel::new(&src).unwrap();
    let got = model.forward_all(&mut model.new_stream(toks.len()), &toks).unwrap();
    assert_close(&got, &plain_logits(&src, &toks), 1e-5, "gemma3");

    // Without the window (and with a wider one) the positions past it see more: the logits move there
    // and only there.
    for sliding in [None, Some(SlidingWindow { window: 12, ..cfg.attention.sliding.unwrap() })] {
        let other = ModelConfig { attention: AttentionConfig { sliding, ..cfg.attention }, ..cfg.clone() };
        let src = MemSource { cfg: other.clone(), tensors: src.tensors.clone() };
        let model = CpuModel::new(&src).unwrap();
        let wide = model.forward_all(&mut model.new_stream(toks.len()), &toks).unwrap();
        assert_close(&wide, &plain_logits(&src, &toks), 1e-5, &format!("gemma3 with {sliding:?}"));
        let window = 7;
        if sliding.is_some() {
            // Local layers also rotate with the local base: equal only while both windows hold everything.
            assert_eq!(wide[..window], got[..window], "within both windows");
        }
        assert!(wide[window..].iter().zip(&got[window..]).all(|(a, b)| a != b), "{sliding:?}: past the window");
    }
}

#[test]
fn prompts_and_batches_give_the_token_by_token_bits() {
    let mut rng = Rng::fresh("prompts_and_batches_give_the_token_by_token_bits");
    // A window of 40 across the attention's 32-position blocks, prompts across its 64-token passes.
    let mut cfg = small();
    cfg.attention.sliding = Some(SlidingWindow { window: 40, global_every: 3, rope_theta: 10_000.0 });
    cfg.layers = 3;
    let src = MemSource::synthetic(&cfg, rng.next_u64(), DType::Q8_0);
    let model = CpuModel::new(&src).unwrap();
    let toks = tokens(&mut rng, 150, cfg.vocab);
    let all = model.forward_all(&mut model.new_stream(toks.len()), &toks).unwrap();
    let mut one = model.new_stream(toks.len());
    for (i, &t) in toks.iter().enumerate() {
        let logits = model.forward(&mut one, &[t]).unwrap();
        assert_eq!(common::bits(&logits), common::bits(&all[i]), "token {i}");
    }
    let mut chunked = model.new_stream(toks.len());
    let mut at = 0;
    while at < toks.len() {
        let n = (1 + rng.below(70) as usize).min(toks.len() - at);
        let logits = model.forward(&mut chunked, &toks[at..at + n]).unwrap();
        at += n;
        assert_eq!(common::bits(&logits), common::bits(&all[at - 1]), "after {at} tokens in chunks");
    }
}

/// Engines over a GGUF Gemma 3: random batches of prompt chunks and single tokens, with truncation,
/// resets and the prefix cache, give each stream the bits of stepping it alone.
#[test]
fn engine_batches_match_stepping_alone() {
    let _serial = common::serial();
    let mut rng = Rng::fresh("engine_batches_match_stepping_alone");
    let dir = Scratch::new("gemma3-batches");
    let cfg = ModelConfig { max_position: 160, ..gguf_shaped() };
    let path = dir.gguf("gemma3", &cfg, rng.next_u64(), DType::Q8_0);
    let mix = common::Mix { rounds: 120, widest: 4, chunk: 6, long_chunk: 40 };
    let opts = common::cpu_options(160, 4);
    common::twins_batch_like_alone("gemma3 Q8_0", &path, &opts, &mix, hostembed::cpu::PAGE_TOKENS as u64, &mut rng);
}

#[test]
fn hf_folders_and_gguf_files_give_the_same_model() {
    let mut rng = Rng::fresh("hf_folders_and_gguf_files_give_the_same_model");
    let dir = Scratch::new("gemma3-hf-gguf");
    let cfg = gguf_shaped();
    let seed = rng.next_u64();
    let hf = Checkpoint::open(&dir.hf("hf", &cfg, seed, DType::F32)).unwrap();
    let gguf = Checkpoint::open(&dir.gguf("model", &cfg, seed, DType::F32)).unwrap();
    assert_eq!(hf.config, cfg);
    assert_eq!(gguf.config, cfg);
    // Both hold the multiplier 1 + w of HF's weight w: the HF reader adds the 1, llama.cpp's converter
    // stored it (the GGUF writer does as it does).
    for name in [names::FINAL_NORM.to_string(), names::layer(3, names::POST_FFN_NORM), names::layer(1, names::K_NORM)] {
        let shape = hf.tensor(&name).unwrap().shape.to_vec();
        let want: Vec<f32> = (0..shape[0]).map(|i| 1.0 + write::synthetic_element(&name, &shape, seed, i)).collect();
        assert_eq!(hf.tensor(&name).unwrap().to_f32(), want, "{name} from HF");
        assert_eq!(gguf.tensor(&name).unwrap().to_f32(), want, "{name} from GGUF");
    }
    let toks = tokens(&mut rng, 20, cfg.vocab);
    let run = |c: &Checkpoint| {
        let m = CpuModel::new(c).unwrap();
        m.forward_all(&mut m.new_stream(toks.len()), &toks).unwrap()
    };
    let (a, b) = (run(&hf), run(&gguf));
    assert_eq!(a, b, "HF and GGUF logits");
    assert_close(&a, &plain_logits(&hf, &toks), 1e-5, "HF folder");
}

#[test]
fn config_json_in_either_transformers_spelling() {
    let base = serde_json::json!({
        "model_type": "gemma3_text_placeholder",
        "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 24,
        "sliding_window": 5, "tie_word_embeddings": true,
    });
    let with = |extra: serde_json::Value| {
        let mut v = base.clone();
        v["model_type"] = "gemma3_text".into();
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        safetensors::parse_config(&v, "config.json")
    };
    // transformers 4: rope_theta, rope_scaling and rope_local_base_freq; the pattern of every sixth layer.
    let v4 = with(serde_json::json!({
        "rope_theta": 1000000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6,
    }))
    .unwrap();
    assert_eq!(v4.rope_scaling, RopeScaling::Linear { factor: 8.0 });
    assert_eq!((v4.rope_theta, v4.attention.query_scale_base), (1e6, Some(24.0)));
    assert_eq!(v4.attention.sliding, Some(SlidingWindow { window: 5, global_every: 6, rope_theta: 10_000.0 }));
    assert_eq!((0..8).map(|l| v4.attention.window(l)).collect::<Vec<_>>(), {
        let mut w = vec![Some(5); 8];
        w[5] = None;
        w
    });
    // transformers 5: one rope_parameters object a layer type, and layer_types.
    let types: Vec<&str> =
        (0..8).map(|l| if (l + 1) % 4 == 0 { "full_attention" } else { "sliding_attention" }).collect();
    let v5 = with(serde_json::json!({
        "layer_types": types,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
        },
    }))
    .unwrap();
    assert_eq!((v5.rope_theta, v5.rope_scaling), (1e6, RopeScaling::Linear { factor: 8.0 }));
    assert_eq!(v5.attention.sliding, Some(SlidingWindow { window: 5, global_every: 4, rope_theta: 20_000.0 }));

    // What this engine does not compute is refused by name.
    let refused = [
        (serde_json::json!({"final_logit_softcapping": 30.0}), Status::Unsupported, "final_logit_softcapping"),
        (serde_json::json!({"attn_logit_softcapping": 50.0}), Status::Unsupported, "attn_logit_softcapping"),
        (serde_json::json!({"hidden_activation": "silu"}), Status::Unsupported, "hidden_activation"),
        (serde_json::json!({"use_bidirectional_attention": true}), Status::Unsupported, "bidirectional"),
        (
            serde_json::json!({"layer_types": ["sliding_attention", "full_attention", "full_attention", "sliding_attention",
                "sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention"]}),
            Status::Unsupported,
            "layer_types",
        ),
        (serde_json::json!({"layer_types": ["sliding_attention"]}), Status::BadModel, "layer_types"),
        (serde_json::json!({"query_pre_attn_scalar": -1.0}), Status::BadModel, "query_pre_attn_scalar"),
    ];
    for (extra, status, needle) in refused {
        let e = with(extra.clone()).expect_err(&extra.to_string());
        assert_eq!(e.status, status, "{extra}: {e}");
        assert!(e.message.contains(needle), "{extra}: {e}");
    }
}

/// llama.cpp's reading of a `gemma3` file: the window from `gemma3.attention.sliding_window`, every
/// sixth layer global, the query scaling 1/sqrt(hidden / heads) at 62 layers (27B) only.
#[test]
fn gguf_keys_as_llama_cpp_reads_them() {
    let dir = Scratch::new("gemma3-keys");
    let mut cfg = gguf_shaped();
    cfg.layers = 62;
    cfg.hidden = 96;
    cfg.intermediate = 32;
    let expected = AttentionConfig { query_scale_base: Some(24.0), ..cfg.attention };
    let path = dir.gguf("g62", &cfg, 1, DType::F32);
    assert_eq!(Checkpoint::open(&path).unwrap().config, ModelConfig { attention: expected, ..cfg.clone() });
    // Without the window key every layer is global.
    let tensors = write::synthetic_weights(&cfg, 1, DType::F32);
    let plain = ModelConfig { attention: AttentionConfig { sliding: None, ..cfg.attention }, ..cfg.clone() };
    let path = dir.join("global.gguf");
    write::write_gguf(&path, &plain, &tensors, &[]).unwrap();
    assert_eq!(Checkpoint::open(&path).unwrap().config.attention, AttentionConfig { sliding: None, ..expected });
}

/// A file that lacks a Gemma tensor or holds one of the wrong shape is BAD_MODEL naming it.
#[test]
fn malformed_files_are_bad_models_naming_the_tensor() {
    let dir = Scratch::new("gemma3-malformed");
    let cfg = gguf_shaped();
    let tensors = write::synthetic_weights(&cfg, 3, DType::F32);
    let check = |r: hostembed::Result<Checkpoint>, needles: &[&str]| {
        let e = r.err().expect("refused");
        assert_eq!(e.status, Status::BadModel, "{e}");
        for n in needles {
            assert!(e.message.contains(n), "{n}: {e}");
        }
    };
    for part in [names::POST_FFN_NORM, names::POST_ATTN_NORM, names::PRE_FFN_NORM, names::Q_NORM] {
        let name = names::layer(4, part);
        let without: Vec<OwnedTensor> = tensors.iter().filter(|t| t.name != name).cloned().collect();
        let path = dir.join("missing.gguf");
        write::write_gguf(&path, &cfg, &without, &[]).unwrap();
        check(Checkpoint::open(&path), &[&name, "missing"]);
        let folder = dir.join("missing-hf");
        write::write_hf_folder(&folder, &cfg, &without, 1).unwrap();
        check(Checkpoint::open(&folder), &[&name, "missing"]);
    }
    let name = names::layer(2, names::K_NORM);
    let mut wrong = tensors.clone();
    let t = wrong.iter_mut().find(|t| t.name == name).unwrap();
    *t = OwnedTensor::from_f32(&name, DType::F32, &[cfg.head_dim / 2], &vec![0.5; cfg.head_dim / 2]).unwrap();
    let folder = dir.join("shape-hf");
    write::write_hf_folder(&folder, &cfg, &wrong, 1).unwrap();
    check(Checkpoint::open(&folder), &[&name, "[16]", "[32]"]);
    let path = dir.join("shape.gguf");
    write::write_gguf(&path, &cfg, &wrong, &[]).unwrap();
    check(Checkpoint::open(&path), &[&name, "[16]", "[32]"]);
}

#[test]
fn the_chat_template_renders_gemma_turns() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer/templates/gemma3.jinja");
    let template = std::fs::read_to_string(path).unwrap();
    let m = |role, content| ChatMessage { role, content };
    let conversation =
        [m("system", "Be brief."), m("user", "  Hi there\n"), m("assistant", "Hello!"), m("user", "Bye")];
    let text = chat::render(&template, &conversation, true, "<bos>", "<eos>").unwrap();
    assert_eq!(
        text,
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n\
         <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    );
    let text = chat::render(&template, &conversation[1..2], false, "<bos>", "<eos>").unwrap();
    assert_eq!(text, "<bos><start_of_turn>user\nHi there<end_of_turn>\n");
    let e = chat::render(&template, &[m("user", "a"), m("user", "b")], true, "<bos>", "<eos>").unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("alternate"), "{e}");
}

/// The committed logits come from `scripts/hf_reference.py --out tests/data/hf_reference --only gemma3`
/// (torch, transformers); without them the test says so and passes.
#[test]
fn matches_hf_reference() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf_reference/gemma3");
    if !dir.join("logits.f32").exists() {
        println!(
            "SKIP matches_hf_reference: no {}; run scripts/hf_reference.py --out tests/data/hf_reference --only gemma3",
            dir.display()
        );
        return;
    }
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let meta: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
    let cfg = safetensors::parse_config(&json, "config.json").unwrap();
    assert_eq!(cfg.arch, Arch::Gemma3);
    assert!(cfg.attention.sliding.is_some() && cfg.attention.query_scale_base != Some(cfg.head_dim as f32));
    let seed = meta["seed"].as_u64().unwrap();
    let read = |name: &str| -> Vec<[u8; 4]> {
        let bytes = std::fs::read(dir.join(name)).unwrap();
        bytes.chunks_exact(4).map(|b| b.try_into().unwrap()).collect()
    };
    let toks: Vec<u32> = read("tokens.u32").into_iter().map(u32::from_le_bytes).collect();
    let logits: Vec<f32> = read("logits.f32").into_iter().map(f32::from_le_bytes).collect();
    assert_eq!(logits.len(), toks.len() * cfg.vocab);
    // HF's own rotary frequencies, global and local, so a base or scaling mismatch shows as such.
    for (file, ours) in
        [("inv_freq.f32", rope_inv_freq(&cfg)), ("inv_freq_local.f32", rope_inv_freq_local(&cfg).unwrap())]
    {
        let hf: Vec<f32> = read(file).into_iter().map(f32::from_le_bytes).collect();
        assert_eq!(hf.len(), ours.len(), "{file}");
        for (i, (a, b)) in ours.iter().zip(&hf).enumerate() {
            assert!((a - b).abs() <= 2e-7 * b.abs(), "{file}[{i}]: {a} vs HF {b}");
        }
    }
    // The script filled exactly the tensors this model reads, with HF's weights (norms as w, the
    // reader adds the 1): written here as an HF folder and opened as one.
    let mut expected: Vec<String> = hostembed::checkpoint::expected_tensors(&cfg).into_iter().map(|(n, _)| n).collect();
    expected.sort();
    let loaded: Vec<&str> = meta["tensors"].as_array().unwrap().iter().map(|n| n.as_str().unwrap()).collect();
    assert_eq!(loaded, expected);
    let scratch = Scratch::new("gemma3-hf-reference");
    let folder = scratch.hf("gemma3", &cfg, seed, DType::F32);
    let ckpt = Checkpoint::open(&folder).unwrap();
    assert_eq!(ckpt.config, cfg);
    let model = CpuModel::new(&ckpt).unwrap();
    let got = model.forward_all(&mut model.new_stream(toks.len()), &toks).unwrap();
    let mut worst = 0f64;
    for (pos, (g, want)) in got.iter().zip(logits.chunks(cfg.vocab)).enumerate() {
        let err = rel_l2(g, want);
        // The issue asks for 1e-4; this backend lands near 6e-7 (HF's own f32 run: 1.3e-6), so hold it tighter.
        assert!(err < 1e-5, "position {pos}: relative L2 {err:.3e} against HF");
        worst = worst.max(err);
    }
    println!("gemma3: max relative L2 against HF {worst:.3e}");
}

/// Gemma's GGUF names map both ways onto its HF names, one to one, as llama.cpp spells them.
#[test]
fn gguf_names_map_both_ways() {
    use hostembed::checkpoint::gguf::{canonical_name_in, gguf_name_in};
    let cfg = small();
    let mut seen = std::collections::HashSet::new();
    for (name, _) in hostembed::checkpoint::expected_tensors(&cfg) {
        let g = gguf_name_in(Arch::Gemma3, &name).unwrap_or_else(|| panic!("{name} has no GGUF name"));
        assert_eq!(canonical_name_in(Arch::Gemma3, &g), name);
        assert!(seen.insert(g.clone()), "{g} given twice");
    }
    for (hf, gguf) in [
        (names::POST_ATTN_NORM, "post_attention_norm.weight"),
        (names::PRE_FFN_NORM, "ffn_norm.weight"),
        (names::POST_FFN_NORM, "post_ffw_norm.weight"),
        (names::Q_NORM, "attn_q_norm.weight"),
        (names::ATTN_NORM, "attn_norm.weight"),
    ] {
        assert_eq!(gguf_name_in(Arch::Gemma3, &names::layer(3, hf)).unwrap(), format!("blk.3.{gguf}"));
    }
    // The llama family's feed-forward norm keeps its name.
    assert_eq!(canonical_name_in(Arch::Llama, "blk.0.ffn_norm.weight"), names::layer(0, names::FFN_NORM));
}
