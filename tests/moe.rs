//! Mixture-of-Experts models (Qwen3-MoE, Mixtral) on the CPU backend: the experts as a GGUF file stacks
//! them and as an HF folder names them read as the same model (the stacks split into views, quantized
//! ones included), a MoE layer whose experts are copies of one dense feed-forward computing that
//! feed-forward, batches giving each stream the bits it gets alone, the start-up line's parameters,
//! malformed files refused with BAD_MODEL naming the tensor or key with nothing held, and parity with
//! HF transformers (tests/data/hf_reference/qwen3_moe and mixtral, from scripts/hf_reference.py; a
//! SKIP line without them).

mod common;
use common::{Mix, Rng, Scratch, c_path, cpu_options, gguf_of_recipe, rel_l2, serial, stats, twins_batch_like_alone};
use common::{mixtral, moe_configs as configs, qwen3_moe};

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_void};
use std::path::Path;

use hostembed::Status;
use hostembed::checkpoint::write::{
    MemSource, OwnedTensor, Recipe, synthetic_weights, write_gguf, write_gguf_dequantized, write_gguf_experts_apart,
    write_hf_folder,
};
use hostembed::checkpoint::{Checkpoint, gguf::GgufValue};
use hostembed::cpu::CpuModel;
use hostembed::engine::engine_options;
use hostembed::ffi;
use hostembed::model::{Arch, ModelConfig, MoeConfig, names};
use hostembed::placement::engine_memory;
use hostembed::status::last_error;
use hostembed::tensor::DType;

/// Logits after each of `tokens`, teacher-forced.
fn logits_of(src: &dyn hostembed::model::TensorSource, tokens: &[u32]) -> Vec<Vec<f32>> {
    let model = CpuModel::new(src).unwrap_or_else(|e| panic!("{e}"));
    model.forward_all(&mut model.new_stream(tokens.len()), tokens).unwrap()
}

fn bits(rows: &[Vec<f32>]) -> Vec<u32> {
    rows.iter().flatten().map(|v| v.to_bits()).collect()
}

/// The same weights as an HF folder (per-expert tensors, Mixtral's `block_sparse_moe` names) and as
/// GGUF (one stack a role and layer): the same config and expert bytes, and the same logits: bit for
/// bit for Qwen3-MoE; within rounding for Mixtral, whose GGUF rotates the permuted Q/K rows' adjacent
/// pairs (its attention sums the same products in another order).
#[test]
fn hf_folders_and_gguf_stacks_are_the_same_model() {
    let mut rng = Rng::fresh("hf_folders_and_gguf_stacks_are_the_same_model");
    let dir = Scratch::new("hf-gguf");
    for (name, cfg) in configs() {
        let seed = rng.next_u64();
        let hf = Checkpoint::open(&dir.hf(name, &cfg, seed, DType::F32)).unwrap();
        let gguf = Checkpoint::open(&dir.gguf(name, &cfg, seed, DType::F32)).unwrap();
        assert_eq!(hf.config, cfg, "{name}: HF config");
        assert_eq!(gguf.config, ModelConfig { rope_interleaved: cfg.arch == Arch::Mixtral, ..cfg.clone() });
        if cfg.arch == Arch::Mixtral {
            let stored = std::fs::read_to_string(hf.path.join("model.safetensors.index.json")).ok();
            assert!(stored.is_none(), "one file");
            let header = std::fs::read(hf.path.join("model.safetensors")).unwrap();
            let text = String::from_utf8_lossy(&header[..4096.min(header.len())]).into_owned();
            assert!(text.contains("block_sparse_moe.experts.0.w1.weight"), "Mixtral's spelling in the folder");
        }
        let m = cfg.moe.unwrap();
        for l in 0..cfg.layers {
            for part in [names::EXPERT_GATE, names::EXPERT_UP, names::EXPERT_DOWN] {
                for e in 0..m.experts {
                    let n = names::layer(l, &names::expert(part, e));
                    let (a, b) = (hf.info(&n).unwrap(), gguf.info(&n).unwrap());
                    assert_eq!((a.dtype, &a.shape), (b.dtype, &b.shape), "{n}");
                    assert!(hf.bytes_of(a) == gguf.bytes_of(b), "{n}: bytes differ");
                }
            }
        }
        assert_eq!(hf.weight_bytes(), gguf.weight_bytes(), "{name}: the fit counts every expert");
        let tokens: Vec<u32> = (0..24).map(|_| rng.below(cfg.vocab as u64) as u32).collect();
        let (a, b) = (logits_of(&hf, &tokens), logits_of(&gguf, &tokens));
        if cfg.arch == Arch::Mixtral {
            let worst = a.iter().zip(&b).map(|(a, b)| rel_l2(b, a)).fold(0f64, f64::max);
            assert!(worst < 1e-6, "{name}: GGUF logits differ from HF's by {worst:.3e}");
            println!("{name}: HF and GGUF within {worst:.2e}");
        } else {
            assert_eq!(bits(&a), bits(&b), "{name}: HF and GGUF logits differ");
            println!("{name}: HF and GGUF logits bit for bit");
        }
    }
}

/// Files of early 2024 with one tensor an expert (`blk.N.ffn_gate.E.weight`, llama.cpp's spelling before
/// it stacked them): the stacked file's model, bit for bit, in F32 and Q8_0; an expert left out is
/// BAD_MODEL naming it, with nothing held.
#[test]
fn gguf_experts_one_tensor_each_are_the_stacked_model() {
    let _g = serial();
    let mut rng = Rng::fresh("gguf_experts_one_tensor_each_are_the_stacked_model");
    let dir = Scratch::new("experts-apart");
    for (name, cfg) in configs() {
        for dtype in [DType::F32, DType::Q8_0] {
            let what = format!("{name} {}", dtype.name());
            let tensors = synthetic_weights(&cfg, rng.next_u64(), dtype);
            let stacked = dir.join(&format!("{name}-{}-stacked.gguf", dtype.name()));
            let apart = dir.join(&format!("{name}-{}-apart.gguf", dtype.name()));
            write_gguf(&stacked, &cfg, &tensors, &[]).unwrap();
            write_gguf_experts_apart(&apart, &cfg, &tensors, &[]).unwrap();
            let raw = std::fs::read(&apart).unwrap();
            let has = |s: &str| raw.windows(s.len()).any(|w| w == s.as_bytes());
            assert!(has("blk.0.ffn_gate.1.weight") && !has("_exps"), "{what}: one tensor an expert");
            let (a, b) = (Checkpoint::open(&stacked).unwrap(), Checkpoint::open(&apart).unwrap());
            assert_eq!(a.config, b.config, "{what}: config");
            assert_eq!(a.weight_bytes(), b.weight_bytes(), "{what}: the fit counts every expert");
            let tokens: Vec<u32> = (0..20).map(|_| rng.below(cfg.vocab as u64) as u32).collect();
            assert_eq!(bits(&logits_of(&a, &tokens)), bits(&logits_of(&b, &tokens)), "{what}");
        }
        let tensors = synthetic_weights(&cfg, 9, DType::Q8_0);
        let gone = names::layer(1, &names::expert(names::EXPERT_UP, 1));
        let without: Vec<OwnedTensor> = tensors.iter().filter(|t| t.name != gone).cloned().collect();
        let path = dir.join(&format!("{name}-apart-missing.gguf"));
        write_gguf_experts_apart(&path, &cfg, &without, &[]).unwrap();
        refused(&path, &["tensor blk.1.ffn_up.1.weight is missing"]);
        // One expert more than the key says.
        let mut more = tensors.clone();
        let extra = tensors.iter().find(|t| t.name == names::layer(0, &names::expert(names::EXPERT_GATE, 0))).unwrap();
        more.push(OwnedTensor {
            name: names::layer(0, &names::expert(names::EXPERT_GATE, cfg.moe.unwrap().experts)),
            ..extra.clone()
        });
        let path = dir.join(&format!("{name}-apart-extra.gguf"));
        write_gguf_experts_apart(&path, &cfg, &more, &[]).unwrap();
        let past = format!("tensor blk.0.ffn_gate.{}.weight is past", cfg.moe.unwrap().experts);
        refused(&path, &[&past, &key(&cfg, "expert_count")]);
    }
}

/// Quantized stacks (Q8_0, and llama.cpp's Q4_K_M mix with its Q6_K expert downs) split into views of
/// whole blocks: the model computes exactly what the same file decoded to F32 computes.
#[test]
fn quantized_stacks_are_read_as_stored() {
    let mut rng = Rng::fresh("quantized_stacks_are_read_as_stored");
    let dir = Scratch::new("quantized");
    for (name, cfg) in configs() {
        for recipe in [Recipe::Uniform(DType::Q8_0), Recipe::Q4KM] {
            let what = format!("{name} {}", recipe.name());
            let path = gguf_of_recipe(&dir, &cfg, rng.next_u64(), recipe);
            let f32_path = dir.join(&format!("{name}-{}-f32.gguf", recipe.name()));
            write_gguf_dequantized(&path, &f32_path).unwrap();
            let (q, f) = (Checkpoint::open(&path).unwrap(), Checkpoint::open(&f32_path).unwrap());
            let down = names::layer(cfg.layers - 1, &names::expert(names::EXPERT_DOWN, 1));
            let want = if recipe == Recipe::Q4KM { DType::Q6_K } else { DType::Q8_0 };
            assert_eq!(q.info(&down).unwrap().dtype, want, "{what}: {down}");
            // llama-quantize leaves the router as the converter wrote it (F32).
            let router = names::layer(0, names::ROUTER);
            let want = if recipe == Recipe::Q4KM { DType::F32 } else { DType::Q8_0 };
            assert_eq!(q.info(&router).unwrap().dtype, want, "{what}: {router}");
            let tokens: Vec<u32> = (0..20).map(|_| rng.below(cfg.vocab as u64) as u32).collect();
            assert_eq!(bits(&logits_of(&q, &tokens)), bits(&logits_of(&f, &tokens)), "{what}");
            println!("{what}: the logits of its F32 decoding, bit for bit");
        }
    }
}

/// A Qwen3-MoE layer whose experts are all copies of one dense feed-forward computes that feed-forward
/// (its weights sum to 1 when renormalized, or when every expert is used): against the Qwen3 of the
/// same weights, within rounding; and a router that matters (distinct experts) moves the logits.
#[test]
fn experts_that_are_copies_of_one_ffn_compute_it() {
    let dense = ModelConfig { arch: Arch::Qwen3, moe: None, hidden: 64, head_dim: 16, intermediate: 96, ..qwen3_moe() };
    let src = MemSource::synthetic(&dense, 5, DType::F32);
    let tokens: Vec<u32> = (0..16).map(|t| (t * 37 % 300) as u32).collect();
    let want = logits_of(&src, &tokens);
    let moe = |used: usize, norm_topk: bool| {
        let cfg = ModelConfig {
            arch: Arch::Qwen3Moe,
            moe: Some(MoeConfig { experts: 4, used, intermediate: 96, norm_topk }),
            ..dense.clone()
        };
        let mut tensors: HashMap<String, OwnedTensor> = HashMap::new();
        for t in synthetic_weights(&cfg, 5, DType::F32) {
            let copied = names::expert_of(&t.name).and_then(|(l, e)| {
                let part = t.name.strip_prefix(&names::layer(l, ""))?;
                let dense_part = [(names::EXPERT_GATE, names::GATE), (names::EXPERT_UP, names::UP)]
                    .into_iter()
                    .chain([(names::EXPERT_DOWN, names::DOWN)])
                    .find(|(p, _)| names::expert(p, e) == part)?
                    .1;
                Some(src.tensors[&names::layer(l, dense_part)].data.clone())
            });
            let data = copied.unwrap_or(t.data.clone());
            tensors.insert(t.name.clone(), OwnedTensor { data, ..t });
        }
        MemSource { cfg, tensors }
    };
    for (used, norm_topk) in [(2, true), (4, false), (4, true)] {
        let m = moe(used, norm_topk);
        let got = logits_of(&m, &tokens);
        let worst = got.iter().zip(&want).map(|(g, w)| rel_l2(g, w)).fold(0f64, f64::max);
        assert!(worst < 1e-5, "{used} experts, renormalized {norm_topk}: {worst:.3e} from the dense model");
    }
    // Two of four not renormalized: the weights sum below 1, so the feed-forward shrinks.
    let m = moe(2, false);
    let got = logits_of(&m, &tokens);
    let worst = got.iter().zip(&want).map(|(g, w)| rel_l2(g, w)).fold(0f64, f64::max);
    assert!(worst > 1e-3, "weights below 1 changed nothing: {worst:.3e}");
    // Distinct experts: the router's choice shows.
    let distinct = MemSource::synthetic(&m.cfg, 5, DType::F32);
    let got = logits_of(&distinct, &tokens);
    let worst = got.iter().zip(&want).map(|(g, w)| rel_l2(g, w)).fold(0f64, f64::max);
    assert!(worst > 1e-2, "distinct experts gave the dense logits: {worst:.3e}");
}

const PAGE: u64 = hostembed::cpu::PAGE_TOKENS as u64;
/// 40 calls of up to 16 items, prompt chunks of up to 6 tokens, one in four up to 24.
const MIX: Mix = Mix { rounds: 40, widest: 16, chunk: 6, long_chunk: 24 };

/// Random batches (single tokens and prompt chunks of several streams; streams joining, leaving,
/// truncated and reset) against the same steps one stream at a time: every status, token and logit bit
/// the same, in F32 and in Q4_K_M, for both architectures. Each row's experts are its own.
#[test]
fn a_batch_gives_each_stream_the_bits_it_gets_alone() {
    let _g = serial();
    let mut rng = Rng::fresh("a_batch_gives_each_stream_the_bits_it_gets_alone");
    let dir = Scratch::new("batch");
    for (name, cfg) in configs() {
        let small = ModelConfig { layers: 1, ..cfg };
        for recipe in [Recipe::Uniform(DType::F32), Recipe::Q4KM] {
            let path = gguf_of_recipe(&dir, &small, rng.next_u64(), recipe);
            let what = format!("{name} {}", recipe.name());
            twins_batch_like_alone(&what, &path, &cpu_options(64, MIX.widest), &MIX, PAGE, &mut rng);
        }
    }
}

unsafe extern "C" fn collect_lines(user: *mut c_void, line: *const c_char) {
    // SAFETY: `user` is the Vec the test handed the engine, alive for the call; `line` is a C string.
    let lines = unsafe { &mut *(user as *mut Vec<String>) };
    // SAFETY: the engine passes a NUL-terminated line that lives for the call.
    lines.push(unsafe { CStr::from_ptr(line) }.to_string_lossy().into_owned());
}

/// The start-up line gives the total parameters and those a token reads.
#[test]
fn the_start_up_line_gives_total_and_active_parameters() {
    let _g = serial();
    let dir = Scratch::new("start-up");
    let cfg = qwen3_moe();
    let path = dir.gguf("qwen3-moe", &cfg, 3, DType::F32);
    let mut lines: Vec<String> = Vec::new();
    let opts = engine_options {
        log: Some(collect_lines),
        log_user: &mut lines as *mut Vec<String> as *mut c_void,
        ..cpu_options(64, 2)
    };
    let mut e = std::ptr::null_mut();
    // SAFETY: a valid path, options and out-pointer; the lines outlive the engine.
    let st = unsafe { ffi::engine_init_fit(c_path(&path).as_ptr(), &opts, &mut e) };
    assert_eq!(st, Status::Ok, "{}", last_error());
    // SAFETY: `e` is the engine just made, freed once.
    unsafe { ffi::engine_free(e) };
    let (active, total) = cfg.parameters();
    // Attention and norms a layer, the router, 8 experts of 3 matrices, the embedding and the head.
    let (h, l, m) = (256u64, 2u64, cfg.moe.unwrap());
    let attention = h * (256 + 2 * 128) + 256 * h + 2 * h + 2 * 64;
    let expert = 3 * h * m.intermediate as u64;
    let around = 2 * 300 * h + h;
    assert_eq!(total, around + l * (attention + 8 * h + 8 * expert));
    assert_eq!(active, around + l * (attention + 8 * h + 2 * expert));
    let line = lines.first().unwrap_or_else(|| panic!("no start-up line: {lines:?}"));
    println!("{line}");
    assert!(line.starts_with("qwen3_moe, "), "{line}");
    let count = |n: u64| format!("{:.2} M", n as f64 / 1e6);
    let want = format!("{} parameters ({} active a token: 2 of 8 experts)", count(total), count(active));
    assert!(line.contains(&want), "{line:?} lacks {want:?}");

    assert_eq!(stats(), engine_memory::default());
}

// ---------------------------------------------------------------------------------------------
// Malformed files.

/// engine_init_fit on `path` is BAD_MODEL with a message holding each of `needles`, and nothing held.
#[track_caller]
fn refused(path: &Path, needles: &[&str]) {
    let mut e = std::ptr::null_mut();
    // SAFETY: a valid path, options and out-pointer.
    let st = unsafe { ffi::engine_init_fit(c_path(path).as_ptr(), &cpu_options(64, 2), &mut e) };
    let msg = last_error();
    println!("refused as expected: {msg}");
    assert_eq!(st, Status::BadModel, "{msg}");
    assert!(e.is_null());
    for n in needles {
        assert!(msg.contains(n), "message {msg:?} does not name {n:?}");
    }
    assert_eq!(stats(), engine_memory::default(), "held after a refused load");
}

fn key(cfg: &ModelConfig, k: &str) -> String {
    format!("{}.{k}", cfg.arch.gguf_name())
}

#[test]
fn gguf_expert_counts_that_disagree_with_the_stacks_are_bad_models() {
    let _g = serial();
    let dir = Scratch::new("bad-gguf");
    for (name, cfg) in configs() {
        let tensors = synthetic_weights(&cfg, 9, DType::Q8_0);
        let m = cfg.moe.unwrap();
        let write = |file: &str, tensors: &[OwnedTensor], kv: &[(String, GgufValue)]| {
            let path = dir.join(&format!("{name}-{file}.gguf"));
            write_gguf(&path, &cfg, tensors, kv).unwrap();
            path
        };
        // The stacks hold one expert more than the key says.
        let fewer = [(key(&cfg, "expert_count"), GgufValue::U32(m.experts as u32 - 1))];
        let what = format!("holds {} experts, key {} says {}", m.experts, key(&cfg, "expert_count"), m.experts - 1);
        refused(&write("count", &tensors, &fewer), &["blk.0.ffn_gate_exps.weight", &what]);
        // Top-k past the experts.
        let topk = [(key(&cfg, "expert_used_count"), GgufValue::U32(m.experts as u32 + 1))];
        refused(&write("topk", &tensors, &topk), &["top-k", &format!("1..={}", m.experts)]);
        // A stack missing: layer 1's up experts.
        let up1 = names::layer(1, "mlp.experts.");
        let without: Vec<OwnedTensor> = tensors
            .iter()
            .filter(|t| !(t.name.starts_with(&up1) && t.name.ends_with("up_proj.weight")))
            .cloned()
            .collect();
        refused(&write("missing", &without, &[]), &["tensor blk.1.ffn_up_exps.weight is missing"]);
        // The router of layer 0 missing.
        let router = names::layer(0, names::ROUTER);
        let without: Vec<OwnedTensor> = tensors.iter().filter(|t| t.name != router).cloned().collect();
        refused(&write("router", &without, &[]), &[&format!("tensor {router} is missing")]);
        // Experts twice as wide as the stacks hold.
        let wide = [(key(&cfg, "expert_feed_forward_length"), GgufValue::U32(m.intermediate as u32 * 2))];
        if cfg.arch == Arch::Qwen3Moe {
            refused(&write("width", &tensors, &wide), &["blk.0.ffn_gate_exps.weight", "the config asks for"]);
        }
    }
    // A dense llama with a stack, or without its expert count: the stack names the key.
    let cfg = mixtral();
    let tensors = synthetic_weights(&cfg, 9, DType::F32);
    let path = dir.join("dense-with-experts.gguf");
    write_gguf(&path, &cfg, &tensors, &[(key(&cfg, "expert_count"), GgufValue::U32(0))]).unwrap();
    refused(&path, &["blk.0.ffn_gate_exps.weight holds experts", "llama.expert_count"]);
}

#[test]
fn hf_expert_counts_that_disagree_with_the_tensors_are_bad_models() {
    let _g = serial();
    let dir = Scratch::new("bad-hf");
    for (name, cfg) in configs() {
        let m = cfg.moe.unwrap();
        let tensors = synthetic_weights(&cfg, 4, DType::F32);
        let folder = |what: &str, tensors: &[OwnedTensor], edit: &dyn Fn(&mut serde_json::Value)| {
            let path = dir.join(&format!("{name}-{what}"));
            write_hf_folder(&path, &cfg, tensors, 1).unwrap();
            let config = path.join("config.json");
            let mut json: serde_json::Value = serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
            edit(&mut json);
            std::fs::write(&config, serde_json::to_vec(&json).unwrap()).unwrap();
            path
        };
        let (count_key, expert_up) = match cfg.arch {
            Arch::Mixtral => ("num_local_experts", "block_sparse_moe.experts.{e}.w3.weight"),
            _ => ("num_experts", "mlp.experts.{e}.up_proj.weight"),
        };
        let up = |l: usize, e: usize| names::layer(l, &expert_up.replace("{e}", &e.to_string()));
        // The config counts one expert more than the folder holds: the router's rows say so first.
        let more = folder("more", &tensors, &|j| j[count_key] = (m.experts + 1).into());
        let router = if cfg.arch == Arch::Mixtral { "block_sparse_moe.gate.weight" } else { names::ROUTER };
        let rows = format!("[{}, {}]", m.experts + 1, cfg.hidden);
        refused(&more, &[&format!("tensor {} has shape", names::layer(0, router)), &rows]);
        // One expert fewer: the folder's last expert belongs to none.
        let fewer = folder("fewer", &tensors, &|j| j[count_key] = (m.experts - 1).into());
        let last = if cfg.arch == Arch::Mixtral { "block_sparse_moe.experts" } else { "mlp.experts" };
        refused(&fewer, &[last, &format!("belongs to expert {}", m.experts - 1)]);
        // Top-k past the experts.
        let topk = folder("topk", &tensors, &|j| j["num_experts_per_tok"] = (m.experts + 1).into());
        refused(&topk, &["top-k"]);
        // Expert 1 of layer 1 lacks its up matrix: named as the folder spells it.
        let gone = names::layer(1, &names::expert(names::EXPERT_UP, 1));
        let without: Vec<OwnedTensor> = tensors.iter().filter(|t| t.name != gone).cloned().collect();
        let missing = folder("missing", &without, &|_| {});
        refused(&missing, &[&format!("tensor {} is missing", up(1, 1))]);
    }
    // Qwen3-MoE's dense layers among expert layers are refused, as UNSUPPORTED.
    let cfg = qwen3_moe();
    let path = dir.join("sparse-step");
    write_hf_folder(&path, &cfg, &synthetic_weights(&cfg, 4, DType::F32), 1).unwrap();
    let config = path.join("config.json");
    let mut json: serde_json::Value = serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    json["mlp_only_layers"] = serde_json::json!([1]);
    std::fs::write(&config, serde_json::to_vec(&json).unwrap()).unwrap();
    let e = Checkpoint::open(&path).unwrap_err();
    assert_eq!(e.status, Status::Unsupported, "{e}");
    assert!(e.message.contains("mlp_only_layers"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Parity with HF transformers.

/// The logits of tests/data/hf_reference/{qwen3_moe,mixtral} (scripts/hf_reference.py, float64
/// transformers over the synthetic weights) against the CPU backend: within 1e-5 relative L2 at every
/// position. A SKIP line where the script has not been run.
#[test]
fn matches_hf_reference() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf_reference");
    for name in ["qwen3_moe", "mixtral"] {
        let dir = root.join(name);
        if !dir.join("logits.f32").is_file() {
            println!(
                "SKIP {name}: no {} (python3 scripts/hf_reference.py --out tests/data/hf_reference --only qwen3_moe,mixtral)",
                dir.display()
            );
            continue;
        }
        let read = |f: &str| std::fs::read(dir.join(f)).unwrap_or_else(|e| panic!("{}: {e}", dir.join(f).display()));
        let json: serde_json::Value = serde_json::from_slice(&read("config.json")).unwrap();
        let meta: serde_json::Value = serde_json::from_slice(&read("reference.json")).unwrap();
        let cfg = hostembed::checkpoint::safetensors::parse_config(&json, name).unwrap();
        let seed = meta["seed"].as_u64().unwrap();
        let le = |b: &[u8]| -> Vec<[u8; 4]> { b.chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]).collect() };
        let tokens: Vec<u32> = le(&read("tokens.u32")).into_iter().map(u32::from_le_bytes).collect();
        let logits: Vec<f32> = le(&read("logits.f32")).into_iter().map(f32::from_le_bytes).collect();
        assert_eq!(logits.len(), tokens.len() * cfg.vocab, "{name}");
        // The script filled exactly the tensors this model reads, under their canonical names.
        let mut expected: Vec<String> =
            hostembed::checkpoint::expected_tensors(&cfg).into_iter().map(|(n, _)| n).collect();
        expected.sort();
        let loaded: Vec<String> =
            meta["tensors"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_string()).collect();
        assert_eq!(loaded, expected, "{name}");
        let src = MemSource::synthetic(&cfg, seed, DType::F32);
        let got = logits_of(&src, &tokens);
        let mut worst = 0f64;
        for (pos, (g, want)) in got.iter().zip(logits.chunks(cfg.vocab)).enumerate() {
            let err = rel_l2(g, want);
            assert!(err < 1e-5, "{name} position {pos}: relative L2 {err:.3e} against HF");
            worst = worst.max(err);
        }
        println!("{name}: {:?}, max relative L2 against HF {worst:.3e}", cfg.arch);
    }
}

/// The benchmarks' Qwen3-30B-A3B shape is the published model's: 30.5 B parameters, 3.3 B a token.
#[test]
fn the_qwen3_30b_a3b_shape_has_the_published_parameter_counts() {
    let cfg = ModelConfig::qwen3_30b_a3b();
    cfg.check("Qwen3-30B-A3B").unwrap();
    let (active, total) = cfg.parameters();
    let line = hostembed::fit::describe_parameters(&cfg);
    println!("{line}");
    assert!((30.4e9..30.6e9).contains(&(total as f64)), "{line}");
    assert!((3.3e9..3.4e9).contains(&(active as f64)), "{line}");
    assert!(line.ends_with("active a token: 8 of 128 experts)"), "{line}");
}
