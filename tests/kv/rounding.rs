//! Every type's rounding: Q8_0 as GGUF's, precision bounds, row bytes and names, the device check, GPU page rows.

use super::small;
use crate::common::{self, Rng, rel_l2};
use hostembed::Status;
use hostembed::abi::engine_kv_type;
use hostembed::gpu::{PAGE_TOKENS, PageLayout};
use hostembed::kv::{KvType, KvTypes};
use hostembed::model::{Arch, ModelConfig};
use hostembed::tensor::{DType, decode_row, encode_row};

// ---------------------------------------------------------------------------------------------
// Every type's rounding.

#[test]
fn q8_0_rounds_as_ggufs_q8_0_encoder() {
    let mut rng = Rng::fresh("q8_0_rounds_as_ggufs_q8_0_encoder");
    let t = KvType::Q8_0;
    for case in 0..100 {
        let head_dim = 32 * (1 + rng.below(8) as usize);
        let mut values = rng.vec(head_dim, [1e-4, 1.0, 100.0][case % 3]);
        if case % 10 == 0 {
            values[rng.below(head_dim as u64) as usize] = 0.0;
        }
        let mut bytes = vec![0u8; t.row_bytes(head_dim)];
        t.encode(&values, &mut bytes);
        assert_eq!(bytes, encode_row(DType::Q8_0, &values), "case {case}: the GGUF Q8_0 encoder's bytes");
        let mut want = vec![0f32; head_dim];
        decode_row(DType::Q8_0, &bytes, &mut want);
        assert_eq!(common::bits(&t.round(&values, head_dim)), common::bits(&want), "case {case}: decoded");
    }
    // llama.cpp's quantizer on non-finite values: a NaN reads as 0, an infinity makes its block NaN.
    let mut values = rng.vec(64, 1.0);
    values[5] = f32::NAN;
    values[33] = f32::NEG_INFINITY;
    let back = t.round(&values, 64);
    assert_eq!(back[5], 0.0);
    assert!(back[..32].iter().all(|v| v.is_finite()) && back[32..].iter().all(|v| v.is_nan()), "{back:?}");
}

#[test]
fn every_type_is_a_rounding_within_its_precision() {
    let mut rng = Rng::fresh("every_type_is_a_rounding_within_its_precision");
    let values = rng.vec(128 * 40, 3.0);
    // Relative L2 bounds a few times each type's typical error on uniform values.
    for (t, bound) in
        [(KvType::F32, 0.0), (KvType::F16, 1e-3), (KvType::Bf16, 5e-3), (KvType::Q8_0, 1e-2), (KvType::Fp8E4m3, 6e-2)]
    {
        let back = t.round(&values, 128);
        let err = rel_l2(&back, &values);
        println!("{}: relative L2 of the rounding {err:.2e}", t.name());
        assert!(err <= bound, "{}: {err:.3e} > {bound}", t.name());
        assert_eq!(
            common::bits(&t.round(&back, 128)),
            common::bits(&back),
            "{}: rounding twice changes nothing",
            t.name()
        );
        if t != KvType::F32 {
            assert!(err > 0.0, "{}: rounds nothing", t.name());
        }
    }
    // The float types round each value to nearest even, as the half crate does.
    let v = rng.vec(64, 10.0);
    let bf16: Vec<f32> = v.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect();
    let f16: Vec<f32> = v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect();
    assert_eq!(KvType::Bf16.round(&v, 32), bf16);
    assert_eq!(KvType::F16.round(&v, 32), f16);
}

#[test]
fn row_bytes_names_and_head_checks() {
    // One head of 128 values: 2 or 4 bytes a value; 4 blocks of 34 bytes.
    let bytes: Vec<usize> = KvType::ALL.iter().map(|t| t.row_bytes(128)).collect();
    assert_eq!(bytes, [256, 256, 512, 136, 136]);
    for t in KvType::ALL {
        assert_eq!(KvType::from_c(t.to_c()), Some(t));
        assert_eq!(KvType::parse(t.name()), Some(Some(t)));
        assert_eq!(KvType::parse(&t.name().to_ascii_lowercase()), Some(Some(t)));
        assert_eq!(t as u32, t.to_c() as u32, "{}: the C value", t.name());
    }
    assert_eq!(KvType::from_c(engine_kv_type::ENGINE_KV_DEFAULT), None);
    assert_eq!(KvType::parse("fp8"), Some(Some(KvType::Fp8E4m3)));
    assert_eq!(KvType::parse("default"), Some(None));
    assert_eq!(KvType::parse("q4_0"), None);
    for d in [32, 64, 96, 128, 256] {
        assert!(KvType::ALL.iter().all(|t| t.check(d, "k").is_ok()), "head_dim {d}");
    }
    for d in [8, 16, 48, 80, 100] {
        for t in [KvType::Q8_0, KvType::Fp8E4m3] {
            let e = t.check(d, "options.kv_type_k").unwrap_err();
            assert_eq!(e.status, Status::Unsupported, "{} at head_dim {d}", t.name());
            assert!(e.message.contains("options.kv_type_k") && e.message.contains(&d.to_string()), "{e}");
        }
        assert!([KvType::Bf16, KvType::F16, KvType::F32].iter().all(|t| t.check(d, "k").is_ok()));
    }
    assert_eq!(KvTypes { k: KvType::Q8_0, v: KvType::F16 }.describe(), "K Q8_0, V F16");
    assert_eq!(KvTypes::same(KvType::Fp8E4m3).describe(), "FP8_E4M3");
}

#[test]
fn fp8_wants_compute_capability_8_9_on_cuda() {
    let fp8 = KvTypes { k: KvType::Bf16, v: KvType::Fp8E4m3 };
    for (major, minor, ok) in [(7, 5, false), (8, 0, false), (8, 6, false), (8, 9, true), (9, 0, true), (12, 0, true)] {
        let got = fp8.check_device(major, minor, "device 0 (test card)");
        assert_eq!(got.is_ok(), ok, "compute capability {major}.{minor}");
        if let Err(e) = got {
            assert_eq!(e.status, Status::Unsupported);
            assert!(e.message.contains("kv_type_v") && e.message.contains(&format!("{major}.{minor}")), "{e}");
            assert!(e.message.contains("8.9") && e.message.contains("test card"), "{e}");
        }
        // The other types run anywhere.
        for t in [KvType::Bf16, KvType::F16, KvType::F32, KvType::Q8_0] {
            assert!(KvTypes::same(t).check_device(major, minor, "x").is_ok());
        }
    }
}

#[test]
fn gpu_page_rows_round_trip_in_their_slabs() {
    let mut rng = Rng::fresh("gpu_page_rows_round_trip_in_their_slabs");
    let cfg = ModelConfig { kv_heads: 3, head_dim: 64, ..small(Arch::Llama, 64) };
    for k in KvType::ALL {
        for v in KvType::ALL {
            let layout = PageLayout::new(&cfg, KvTypes { k, v });
            let slabs = 3 * (k.row_bytes(64) + v.row_bytes(64)) * PAGE_TOKENS;
            assert_eq!(layout.page_bytes(), slabs, "{}/{}", k.name(), v.name());
            assert_eq!(layout.page_bytes() % 16, 0, "pages hold whole 16-byte pieces");
            let mut page = vec![0xA5u8; layout.page_bytes()];
            let mut rows = Vec::new();
            for _ in 0..20 {
                let (is_v, head, slot) = (rng.below(2) == 1, rng.below(3) as usize, rng.below(16) as usize);
                let values = rng.vec(64, 2.0);
                layout.write_row(&mut page, is_v, head, slot, &values);
                rows.retain(|r: &(bool, usize, usize, Vec<f32>)| (r.0, r.1, r.2) != (is_v, head, slot));
                rows.push((is_v, head, slot, values));
            }
            for (is_v, head, slot, values) in &rows {
                let t = if *is_v { v } else { k };
                assert_eq!(layout.read_row(&page, *is_v, *head, *slot), t.round(values, 64), "{}", t.name());
            }
            // A block type's scales sit after its slab's codes: a row's codes and its scales move apart.
            if k.is_block() {
                let mut blank = vec![0u8; layout.page_bytes()];
                layout.write_row(&mut blank, false, 1, 5, &[1.0; 64]);
                let slab = layout.slab_at(false, 1);
                assert!(blank[slab + 5 * 64..slab + 6 * 64].iter().all(|&c| c != 0), "codes of row 5");
                let scales = slab + PAGE_TOKENS * 64 + 5 * 2 * 2;
                assert!(blank[scales..scales + 4].iter().any(|&c| c != 0), "two scales of row 5");
                assert_eq!(blank.iter().filter(|&&c| c != 0).count(), 64 + 4, "nothing else written");
            }
        }
    }
}
