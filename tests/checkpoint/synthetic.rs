//! The synthetic weight formula against the numpy generator and across threads.

use super::qwen2_cfg;
use crate::common::Rng;
use hostembed::checkpoint::write::{synthetic_element, synthetic_weights};
use hostembed::checkpoint::{expected_tensors, write};
use hostembed::model::ModelConfig;
use hostembed::tensor::DType;

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

/// A benchmark GGUF (`write_generated_gguf` with `Fill::SampledRows`): the same tensors, formats and metadata as the synthetic
/// file, its block-format matrices 64 random rows repeated (each matrix and each expert its own) and its
/// float matrices and norms the formula's; the CPU model decodes it.
#[test]
fn a_benchmark_gguf_repeats_64_rows_of_each_block_matrix() {
    use hostembed::checkpoint::Checkpoint;
    use hostembed::checkpoint::write::{Fill, Recipe, write_generated_gguf, write_synthetic_gguf};
    use hostembed::model::TensorSource;
    let dir = crate::common::Scratch::new("benchmark-gguf");
    let cfg = ModelConfig::qwen3_moe(256, 2, 4, 4, 2, 128, 1000);
    let (quick, full) = (dir.join("quick.gguf"), dir.join("full.gguf"));
    write_generated_gguf(&quick, &cfg, Fill::SampledRows { seed: 5 }, Recipe::Q4KM, &[]).unwrap();
    write_synthetic_gguf(&full, &cfg, 5, Recipe::Q4KM).unwrap();
    let (q, f) = (Checkpoint::open(&quick).unwrap(), Checkpoint::open(&full).unwrap());
    assert_eq!(q.config, f.config);
    let mut repeated = 0;
    for (name, shape) in expected_tensors(&cfg) {
        let (a, b) = (q.tensor(&name).unwrap(), f.tensor(&name).unwrap());
        assert_eq!((a.dtype, a.shape), (b.dtype, b.shape), "{name}");
        if shape.len() == 2 && a.dtype.format().block_values > 1 {
            let row = a.bytes.len() / shape[0];
            assert_ne!(a.bytes, b.bytes, "{name}: sampled rows, not the formula's");
            for (i, chunk) in a.bytes.chunks(row).enumerate().skip(64) {
                assert_eq!(chunk, &a.bytes[(i % 64) * row..(i % 64 + 1) * row], "{name} row {i}");
            }
            repeated += (shape[0] > 64) as usize;
        } else {
            assert_eq!(a.bytes, b.bytes, "{name}: the formula's");
        }
    }
    assert!(repeated > 4, "{repeated} matrices past 64 rows");
    let gate0 = q.tensor("model.layers.0.mlp.experts.0.gate_proj.weight").unwrap();
    let gate1 = q.tensor("model.layers.0.mlp.experts.1.gate_proj.weight").unwrap();
    assert_ne!(gate0.bytes, gate1.bytes, "each expert its own rows");
    let model = hostembed::cpu::CpuModel::new(&q).unwrap();
    let mut stream = model.new_stream(16);
    assert!(model.forward(&mut stream, &[1, 2, 3]).unwrap().iter().all(|v| v.is_finite()));
}
