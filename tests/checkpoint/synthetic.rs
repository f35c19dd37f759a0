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
