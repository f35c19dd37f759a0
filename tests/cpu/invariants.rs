//! The model's invariants: the KV cache against layer-major recomputation, GQA, tied heads, stored formats.

use super::{
    ARCHS, MemSource, Tensor, layer_major_logits, rounding_bound, small_config, synthetic_model, token_by_token, tokens,
};
use crate::common::{Rng, rel_l2};
use hostembed::cpu::CpuModel;
use hostembed::model::{Arch, ModelConfig, names};
use hostembed::tensor::{DType, FORMATS};
use std::collections::HashMap;

#[test]
fn cached_forward_equals_layer_major_recomputation_in_any_chunking() {
    let mut rng = Rng::fresh("cached_forward_equals_layer_major_recomputation_in_any_chunking");
    for arch in ARCHS {
        let cfg = small_config(arch);
        let src = synthetic_model(&cfg, rng.next_u64(), DType::F32);
        let model = CpuModel::new(&src).unwrap();
        let toks = tokens(&mut rng, 20, cfg.vocab);
        let mut stream = model.new_stream(32);
        let all = model.forward_all(&mut stream, &toks).unwrap();
        assert_eq!(all.len(), toks.len());
        assert_eq!(stream.len(), toks.len());
        assert_eq!(all, layer_major_logits(&src, &toks), "{arch:?}");

        // The same tokens in random chunks through forward: the cache carries the rest.
        let mut chunked = model.new_stream(32);
        let mut at = 0;
        while at < toks.len() {
            let n = (1 + rng.below(5) as usize).min(toks.len() - at);
            let logits = model.forward(&mut chunked, &toks[at..at + n]).unwrap();
            at += n;
            assert_eq!(logits, all[at - 1], "{arch:?} after {at} tokens");
        }

        // A reset stream decodes as a fresh one; a second stream is independent of the first.
        chunked.reset();
        let mut other = model.new_stream(32);
        model.forward(&mut other, &toks[5..9]).unwrap();
        assert_eq!(model.forward_all(&mut chunked, &toks).unwrap(), all);

        // Position matters: the same token later gives other logits.
        assert_ne!(all[0], model.forward(&mut other, &toks[..1]).unwrap());
    }
}

#[test]
fn gqa_equals_mha_with_kv_heads_repeated() {
    let mut rng = Rng::fresh("gqa_equals_mha_with_kv_heads_repeated");
    for arch in ARCHS {
        let cfg = small_config(arch);
        let gqa = synthetic_model(&cfg, rng.next_u64(), DType::F32);
        let group = cfg.heads / cfg.kv_heads;
        assert!(group > 1);
        let mha_cfg = ModelConfig { kv_heads: cfg.heads, ..cfg.clone() };
        let mut mha = MemSource { cfg: mha_cfg, tensors: HashMap::new() };
        for (name, t) in &gqa.tensors {
            mha.tensors.insert(name.clone(), Tensor { dtype: t.dtype, shape: t.shape.clone(), bytes: t.bytes.clone() });
        }
        // KV head j becomes heads j*group .. j*group+group-1, so query head h still reads j = h/group.
        let repeat = |values: &[f32], row_len: usize| -> Vec<f32> {
            values
                .chunks(cfg.head_dim * row_len)
                .flat_map(|head| (0..group).flat_map(move |_| head.iter().copied()))
                .collect()
        };
        for i in 0..cfg.layers {
            for part in [names::K, names::V] {
                let name = names::layer(i, part);
                let values = repeat(&gqa.f32_values(&name), cfg.hidden);
                mha.set_f32(&name, vec![cfg.q_dim(), cfg.hidden], &values);
            }
            if cfg.qkv_bias {
                for part in [names::K_BIAS, names::V_BIAS] {
                    let name = names::layer(i, part);
                    let values = repeat(&gqa.f32_values(&name), 1);
                    mha.set_f32(&name, vec![cfg.q_dim()], &values);
                }
            }
        }
        let toks = tokens(&mut rng, 12, cfg.vocab);
        let a =
            CpuModel::new(&gqa).unwrap().forward_all(&mut CpuModel::new(&gqa).unwrap().new_stream(12), &toks).unwrap();
        let mha_model = CpuModel::new(&mha).unwrap();
        let b = mha_model.forward_all(&mut mha_model.new_stream(12), &toks).unwrap();
        for (pos, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(rel_l2(x, y) < 1e-6, "{arch:?} position {pos}: {}", rel_l2(x, y));
        }
    }
}

#[test]
fn tied_head_equals_an_untied_copy_of_the_embedding() {
    let mut rng = Rng::fresh("tied_head_equals_an_untied_copy_of_the_embedding");
    let cfg = small_config(Arch::Qwen2);
    assert!(cfg.tied);
    let tied = synthetic_model(&cfg, rng.next_u64(), DType::F32);
    let mut untied = MemSource { cfg: ModelConfig { tied: false, ..cfg.clone() }, tensors: HashMap::new() };
    for (name, t) in &tied.tensors {
        untied.tensors.insert(name.clone(), Tensor { dtype: t.dtype, shape: t.shape.clone(), bytes: t.bytes.clone() });
    }
    let embed = tied.f32_values(names::EMBED);
    untied.set_f32(names::LM_HEAD, vec![cfg.vocab, cfg.hidden], &embed);
    let toks = tokens(&mut rng, 8, cfg.vocab);
    let run = |src: &MemSource| {
        let m = CpuModel::new(src).unwrap();
        m.forward_all(&mut m.new_stream(8), &toks).unwrap()
    };
    let expect = run(&untied);
    assert_eq!(run(&tied), expect);
    // And the head is really read: another head gives other logits.
    let other: Vec<f32> = embed.iter().map(|v| -v).collect();
    untied.set_f32(names::LM_HEAD, vec![cfg.vocab, cfg.hidden], &other);
    assert_ne!(run(&untied), expect);
}

#[test]
fn stored_formats_decode_to_the_same_model() {
    let mut rng = Rng::fresh("stored_formats_decode_to_the_same_model");
    // Q8_0 needs every matrix's columns to be multiples of 32.
    let cfg = ModelConfig { vocab: 64, ..small_config(Arch::Llama) };
    let seed = rng.next_u64();
    let toks = tokens(&mut rng, 10, cfg.vocab);
    let reference = {
        let src = synthetic_model(&cfg, seed, DType::F32);
        let m = CpuModel::new(&src).unwrap();
        m.forward_all(&mut m.new_stream(10), &toks).unwrap()
    };
    for (dtype, bound) in [(DType::Bf16, 3e-2), (DType::F16, 3e-3), (DType::Q8_0, 3e-2)] {
        let src = synthetic_model(&cfg, seed, dtype);
        // The same values, rounded through the format and stored as F32: exactly the same model.
        let mut rounded = MemSource { cfg: cfg.clone(), tensors: HashMap::new() };
        for (name, t) in &src.tensors {
            let values = src.f32_values(name);
            rounded.set_f32(name, t.shape.clone(), &values);
        }
        let m = CpuModel::new(&src).unwrap();
        let got = m.forward_all(&mut m.new_stream(10), &toks).unwrap();
        let r = CpuModel::new(&rounded).unwrap();
        assert_eq!(got, r.forward_all(&mut r.new_stream(10), &toks).unwrap(), "{dtype:?}");
        for (pos, (g, want)) in got.iter().zip(&reference).enumerate() {
            let err = rel_l2(g, want);
            assert!(err < bound && err > 0.0, "{dtype:?} position {pos}: relative L2 {err}");
        }
    }
}

/// Every quantized format, on a model whose rows are whole super-blocks: the model as stored equals,
/// bit for bit, the F32 model of its decoded values (weights are decoded as read, nothing else), in
/// one batch and token by token, and stays within its rounding of the unquantized model.
#[test]
fn quantized_formats_decode_to_the_same_model() {
    let mut rng = Rng::fresh("quantized_formats_decode_to_the_same_model");
    let cfg = ModelConfig { vocab: 64, hidden: 256, head_dim: 64, intermediate: 256, ..small_config(Arch::Llama) };
    let seed = rng.next_u64();
    let toks = tokens(&mut rng, 6, cfg.vocab);
    let reference = {
        let src = synthetic_model(&cfg, seed, DType::F32);
        let m = CpuModel::new(&src).unwrap();
        m.forward_all(&mut m.new_stream(6), &toks).unwrap()
    };
    for dtype in FORMATS.iter().filter(|f| f.block_values > 1).map(|f| f.dtype) {
        let src = synthetic_model(&cfg, seed, dtype);
        let mut rounded = MemSource { cfg: cfg.clone(), tensors: HashMap::new() };
        for (name, t) in &src.tensors {
            rounded.set_f32(name, t.shape.clone(), &src.f32_values(name));
        }
        let m = CpuModel::new(&src).unwrap();
        let got = m.forward_all(&mut m.new_stream(6), &toks).unwrap();
        let r = CpuModel::new(&rounded).unwrap();
        assert_eq!(got, r.forward_all(&mut r.new_stream(6), &toks).unwrap(), "{dtype:?}");
        assert_eq!(got, token_by_token(&m, &toks, 6), "{dtype:?} token by token");
        let err = got.iter().zip(&reference).map(|(g, want)| rel_l2(g, want)).fold(0f64, f64::max);
        println!("{dtype:?}: largest relative L2 of the logits {err:.4}");
        assert!(err > 0.0 && err < 2.0 * rounding_bound(dtype), "{dtype:?}: relative L2 {err}");
    }
}
