//! KV cache types on the CPU: the FP8 E4M3 codes against their definition and a brute-force rounding,
//! Q8_0 against GGUF's encoder, each type's rounding bounds and byte sizes, the GPU page layout's rows,
//! the CPU backend in every type against the model recomputed layer by layer with the same rounding (bit
//! for bit) and against an f32 cache (within the type's rounding), the CPU plan's bytes, and the options
//! through the C ABI: bad enum values, types a model cannot take, the device check, what
//! engine_model_info and the start-up line report.

mod common;

use std::ffi::{c_char, c_void};
use std::sync::{Arc, Mutex};

use common::{Rng, Scratch, info, init, logits, rel_l2, serial, step};
use hostembed::Status;
use hostembed::abi::engine_kv_type;
use hostembed::checkpoint::write::MemSource;
use hostembed::cpu::{self, CpuBackend, CpuModel};
use hostembed::engine::{self, engine_backend, engine_options};
use hostembed::ffi;
use hostembed::fit;
use hostembed::gpu::{PAGE_TOKENS, PageLayout};
use hostembed::kv::{self, KvType, KvTypes};
use hostembed::model::{Arch, ModelConfig, RopeScaling, TensorSource, names};
use hostembed::status::last_error;
use hostembed::tensor::{DType, decode_row, encode_row};
use hostembed::tuning::Tuning;

// ---------------------------------------------------------------------------------------------
// FP8 E4M3.

/// An E4M3 code's value from the format's definition, in f64: sign, 4 exponent bits of bias 7 (0 is
/// subnormal: m/8 x 2^-6), 3 mantissa bits; S.1111.111 is NaN.
fn e4m3_definition(code: u8) -> f64 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (((code >> 3) & 0xF) as i32, (code & 7) as f64);
    if e == 15 && m == 7.0 {
        return f64::NAN;
    }
    let magnitude = if e == 0 { m / 8.0 * 2f64.powi(-6) } else { (1.0 + m / 8.0) * 2f64.powi(e - 7) };
    sign * magnitude
}

/// The E4M3 code nearest `x` found by trying every finite code (ties to the code with an even
/// mantissa), saturating at ±448, NaN as 0x7F with x's sign: the rounding `e4m3_from_f32` promises.
fn e4m3_brute_force(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    if x.is_nan() {
        return sign | 0x7F;
    }
    let a = x.abs() as f64;
    if a >= 448.0 {
        return sign | 0x7E;
    }
    let mut best = 0u8;
    for code in 1..=0x7Eu8 {
        let (d, b) = ((e4m3_definition(code) - a).abs(), (e4m3_definition(best) - a).abs());
        if d < b || (d == b && code % 2 == 0) {
            best = code;
        }
    }
    sign | best
}

#[test]
fn e4m3_codes_decode_to_their_definition() {
    for code in 0..=255u8 {
        let (got, want) = (kv::e4m3_to_f32(code), e4m3_definition(code));
        if want.is_nan() {
            assert!(got.is_nan(), "code {code:#04x} is NaN, decoded {got}");
        } else {
            assert_eq!(got as f64, want, "code {code:#04x}");
            assert_eq!(got.is_sign_negative(), code & 0x80 != 0, "code {code:#04x}: sign");
        }
        assert_eq!(got.to_bits(), kv::e4m3_value(code).to_bits(), "code {code:#04x}: the table");
    }
    assert_eq!(kv::e4m3_to_f32(0x7E), 448.0, "the largest finite value");
    assert_eq!(kv::e4m3_to_f32(0x01), 2f32.powi(-9), "the smallest subnormal");
    assert_eq!(kv::e4m3_to_f32(0x08), 2f32.powi(-6), "the smallest normal");
    // Positive codes increase with their value: one code a value, no gaps or repeats.
    for code in 1..=0x7Eu8 {
        assert!(kv::e4m3_to_f32(code) > kv::e4m3_to_f32(code - 1), "code {code:#04x}");
    }
}

#[test]
fn e4m3_rounds_to_nearest_even_and_saturates() {
    let mut rng = Rng::fresh("e4m3_rounds_to_nearest_even_and_saturates");
    let check = |x: f32| {
        let (got, want) = (kv::e4m3_from_f32(x), e4m3_brute_force(x));
        assert_eq!(got, want, "{x:e} ({:#010x}): {got:#04x}, nearest-even {want:#04x}", x.to_bits());
    };
    // Every code's value, and the midpoints between neighbours (the ties) and just around them.
    for code in 0..0x7Eu8 {
        let (lo, hi) = (kv::e4m3_to_f32(code), kv::e4m3_to_f32(code + 1));
        let mid = (lo + hi) / 2.0;
        for x in [lo, hi, mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1)] {
            check(x);
            check(-x);
        }
    }
    // Saturation, infinities, NaN, zeros, f32 subnormals.
    for x in [448.0, 449.0, 463.9, 464.0, 480.0, 1e6, f32::MAX, f32::INFINITY, 0.0, 1e-40, f32::MIN_POSITIVE] {
        check(x);
        check(-x);
    }
    assert_eq!(kv::e4m3_from_f32(f32::INFINITY), 0x7E);
    assert_eq!(kv::e4m3_from_f32(f32::NEG_INFINITY), 0xFE);
    assert_eq!(kv::e4m3_from_f32(f32::NAN), 0x7F);
    assert_eq!(kv::e4m3_from_f32(-f32::NAN), 0xFF);
    assert_eq!(kv::e4m3_from_f32(-0.0), 0x80, "-0 keeps its sign");
    // Every f16 value (the range a block's values fall in), and random f32 bit patterns near E4M3's range.
    for bits in 0..=u16::MAX {
        check(half::f16::from_bits(bits).to_f32());
    }
    for _ in 0..200_000 {
        let exponent = 127 - 14 + rng.below(26) as u32;
        check(f32::from_bits((rng.below(2) as u32) << 31 | exponent << 23 | rng.below(1 << 23) as u32));
    }
}

/// An FP8 block as the module comment defines it, step by step in the test: the bf16 scale s of
/// max|x| / 448 (NaN ignored) and each x times 1/s (0 where s is not normal), brute-force rounded.
fn fp8_block_by_hand(values: &[f32]) -> Vec<u8> {
    let mut amax = 0f32;
    for v in values {
        if v.abs() > amax {
            amax = v.abs();
        }
    }
    let scale = half::bf16::from_f32(amax / 448.0);
    let s = scale.to_f32();
    let inv = if s.is_normal() { 1.0 / s } else { 0.0 };
    let mut out = scale.to_le_bytes().to_vec();
    out.extend(values.iter().map(|&v| e4m3_brute_force(v * inv)));
    out
}

#[test]
fn fp8_blocks_follow_their_rule_and_keep_nan_visible() {
    let mut rng = Rng::fresh("fp8_blocks_follow_their_rule_and_keep_nan_visible");
    let t = KvType::Fp8E4m3;
    for case in 0..200 {
        let head_dim = 32 * (1 + rng.below(8) as usize);
        let scale = [1e-3, 1.0, 37.0, 3e4, 1e-30][case % 5];
        let values = rng.vec(head_dim, scale);
        let mut bytes = vec![0u8; t.row_bytes(head_dim)];
        t.encode(&values, &mut bytes);
        let want: Vec<u8> = values.chunks(32).flat_map(fp8_block_by_hand).collect();
        assert_eq!(bytes, want, "case {case}: head_dim {head_dim}, values of size {scale}");
        let mut back = vec![0f32; head_dim];
        t.decode(&bytes, &mut back);
        for (block, (v, b)) in values.chunks(32).zip(back.chunks(32)).enumerate() {
            let s = half::bf16::from_le_bytes([bytes[34 * block], bytes[34 * block + 1]]).to_f32();
            let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert!((s * 448.0 - amax).abs() <= amax / 256.0, "the scale maps max|x| {amax} onto 448: {s}");
            for (x, y) in v.iter().zip(b) {
                let code = bytes[34 * block + 2 + v.iter().position(|z| z.to_bits() == x.to_bits()).unwrap()];
                assert_eq!(y.to_bits(), (s * e4m3_definition(code) as f32).to_bits(), "scale x code");
                // Three mantissa bits: half a step is 1/16 of the value, or half a subnormal step of the block;
                // the scale's own rounding is 1/256 at most.
                let bound = x.abs() / 16.0 + amax / 256.0 + s * 2f32.powi(-10);
                assert!((x - y).abs() <= bound, "{x} read as {y} (block max {amax})");
            }
        }
    }
    // A NaN stays a NaN and leaves its block's other values alone; an infinity makes the block NaN.
    let mut values = rng.vec(64, 1.0);
    values[3] = f32::NAN;
    values[40] = f32::INFINITY;
    let back = t.round(&values, 64);
    assert!(back[3].is_nan(), "a NaN value reads as {}", back[3]);
    assert!(back.iter().enumerate().filter(|(i, _)| *i != 3 && *i < 32).all(|(_, v)| v.is_finite()));
    assert!(back[32..].iter().all(|v| v.is_nan()), "the block with an infinity: {:?}", &back[32..]);
    assert_eq!(t.round(&[0.0; 32], 32), vec![0.0; 32], "a block of zeros");
}

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

// ---------------------------------------------------------------------------------------------
// The CPU backend in every type.

fn small(arch: Arch, window: usize) -> ModelConfig {
    let mut cfg = ModelConfig {
        arch,
        vocab: 96,
        hidden: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        intermediate: 96,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: window,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: Some(1),
        eos: Some(2),
        moe: None,
    };
    match arch {
        Arch::Llama => {
            cfg.rope_scaling = RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 16,
            };
            cfg.rope_interleaved = true;
        }
        Arch::Qwen2 => {
            cfg.qkv_bias = true;
            cfg.tied = true;
        }
        Arch::Qwen3 => {
            cfg.qk_norm = true;
            cfg.head_dim = 64;
        }
        Arch::Gemma3 => unreachable!("these tests run the llama family"),
        Arch::Qwen3Moe | Arch::Mixtral => panic!("{arch:?}: these tests' reference computes dense models"),
    }
    cfg
}

/// The model computed layer by layer over the whole sequence with no cache carried between tokens,
/// with K and V rounded to `kv`'s types before attention reads them: the CPU backend's ops (its
/// matvec, rope and attention), so a cache that stores, rounds or reads the wrong values shows.
fn layer_major_logits(src: &MemSource, toks: &[u32], kv: KvTypes) -> Vec<Vec<f32>> {
    let cfg = &src.cfg;
    let (q_dim, kv_dim, hd) = (cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
    let w = |name: &str| src.tensor(name).unwrap();
    let inv_freq = cpu::rope_inv_freq(cfg);
    let matvec = |name: &str, x: &[f32], rows: usize| {
        let mut out = vec![0f32; rows];
        cpu::matvec(&w(name), x, &mut out);
        out
    };
    let norm = |x: &[f32], weight: &[f32]| {
        let mut out = vec![0f32; x.len()];
        cpu::rmsnorm(x, weight, cfg.rms_eps, &mut out);
        out
    };
    let vector = |name: &str| w(name).to_f32();
    let mut xs: Vec<Vec<f32>> = toks.iter().map(|&t| w(names::EMBED).row_f32(t as usize)).collect();
    for i in 0..cfg.layers {
        let l = |part: &str| names::layer(i, part);
        let (mut qs, mut ks, mut vs) = (vec![], vec![], vec![]);
        for (pos, x) in xs.iter().enumerate() {
            let h = norm(x, &vector(&l(names::ATTN_NORM)));
            let (mut q, mut k, mut v) =
                (matvec(&l(names::Q), &h, q_dim), matvec(&l(names::K), &h, kv_dim), matvec(&l(names::V), &h, kv_dim));
            if cfg.qkv_bias {
                cpu::add(&mut q, &vector(&l(names::Q_BIAS)));
                cpu::add(&mut k, &vector(&l(names::K_BIAS)));
                cpu::add(&mut v, &vector(&l(names::V_BIAS)));
            }
            if cfg.qk_norm {
                let (qn, kn) = (vector(&l(names::Q_NORM)), vector(&l(names::K_NORM)));
                q = q.chunks(hd).flat_map(|head| norm(head, &qn)).collect();
                k = k.chunks(hd).flat_map(|head| norm(head, &kn)).collect();
            }
            cpu::rope(&mut q, cfg.heads, hd, pos, &inv_freq, cfg.rope_interleaved);
            cpu::rope(&mut k, cfg.kv_heads, hd, pos, &inv_freq, cfg.rope_interleaved);
            qs.push(q);
            ks.extend(kv.k.round(&k, hd));
            vs.extend(kv.v.round(&v, hd));
        }
        for (pos, x) in xs.iter_mut().enumerate() {
            let mut attn = vec![0f32; q_dim];
            cpu::attention(&qs[pos], &ks, &vs, pos + 1, cfg.heads, cfg.kv_heads, hd, &mut attn);
            cpu::add(x, &matvec(&l(names::O), &attn, cfg.hidden));
            let h = norm(x, &vector(&l(names::FFN_NORM)));
            let mut gated = vec![0f32; cfg.intermediate];
            let (gate, up) =
                (matvec(&l(names::GATE), &h, cfg.intermediate), matvec(&l(names::UP), &h, cfg.intermediate));
            cpu::swiglu(&gate, &up, &mut gated);
            cpu::add(x, &matvec(&l(names::DOWN), &gated, cfg.hidden));
        }
    }
    let head = if cfg.tied { names::EMBED } else { names::LM_HEAD };
    xs.iter().map(|x| matvec(head, &norm(x, &vector(names::FINAL_NORM)), cfg.vocab)).collect()
}

/// The pairs the CPU tests run: each type for K and V, and K and V apart.
fn type_pairs() -> Vec<KvTypes> {
    let mut pairs: Vec<KvTypes> = KvType::ALL.iter().map(|&t| KvTypes::same(t)).collect();
    pairs.push(KvTypes { k: KvType::Q8_0, v: KvType::F16 });
    pairs.push(KvTypes { k: KvType::Bf16, v: KvType::Fp8E4m3 });
    pairs
}

/// Relative L2 a type's rounding of K and V may move a small random model's logits by (several times
/// what it does): a bound that fails where a type reads garbage, not where it rounds.
fn logit_bound(kv: KvTypes) -> f64 {
    let one = |t: KvType| match t {
        KvType::F32 => 0.0,
        KvType::F16 => 2e-3,
        KvType::Bf16 => 1e-2,
        KvType::Q8_0 => 3e-2,
        KvType::Fp8E4m3 => 1e-1,
    };
    one(kv.k) + one(kv.v)
}

#[test]
fn the_cpu_backend_rounds_k_and_v_once_in_every_type() {
    let mut rng = Rng::fresh("the_cpu_backend_rounds_k_and_v_once_in_every_type");
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
        let cfg = small(arch, 64);
        let src = MemSource::synthetic(&cfg, rng.next_u64(), DType::F32);
        let toks: Vec<u32> = (0..40).map(|_| rng.below(cfg.vocab as u64) as u32).collect();
        let f32_cache = CpuModel::new(&src).unwrap();
        let plain = f32_cache.forward_all(&mut f32_cache.new_stream(64), &toks).unwrap();
        assert_eq!(f32_cache.kv_types(), KvTypes::CPU_DEFAULT, "{arch:?}: f32 unless told");
        for kv in type_pairs() {
            let what = format!("{arch:?} {}", kv.describe());
            let model = CpuModel::new(&src).unwrap().with_kv_types(kv).unwrap();
            let got = model.forward_all(&mut model.new_stream(64), &toks).unwrap();
            // The same rounding in the layer-major recomputation: the same bits.
            assert_eq!(got, layer_major_logits(&src, &toks, kv), "{what}: against the layer-major model");
            let worst = got.iter().zip(&plain).map(|(g, p)| rel_l2(g, p)).fold(0f64, f64::max);
            println!("{what}: worst relative L2 against the f32 cache {worst:.2e}");
            assert!(worst <= logit_bound(kv), "{what}: {worst:.3e} from the f32 cache's logits");
            if kv != KvTypes::CPU_DEFAULT {
                assert!(worst > 0.0, "{what}: the cache rounded nothing");
            }
            // A prompt in one step gives the bits it gives token by token, in every type.
            let mut stream = model.new_stream(64);
            let mut by_token = Vec::new();
            for &t in &toks {
                by_token = model.forward(&mut stream, &[t]).unwrap();
            }
            assert_eq!(&by_token, got.last().unwrap(), "{what}: token by token");
        }
    }
}

#[test]
fn the_cpu_pool_and_plan_count_bytes_in_the_cache_types() {
    let cfg = small(Arch::Llama, 256);
    let src: Arc<dyn TensorSource + Send + Sync> = Arc::new(MemSource::synthetic(&cfg, 7, DType::F32));
    for kv in type_pairs() {
        let per_token = kv.bytes_per_token(&cfg);
        // layers x kv_heads x (a head's K row + its V row).
        let want = (cfg.layers * cfg.kv_heads * (kv.k.row_bytes(32) + kv.v.row_bytes(32))) as u64;
        assert_eq!(per_token, want, "{}", kv.describe());
        let pages = 9;
        let backend = CpuBackend::with_kv(Arc::clone(&src), pages, kv, &Tuning::from_env()).unwrap();
        assert_eq!(backend.pool_bytes(), per_token * (pages * cpu::PAGE_TOKENS) as u64, "{}", kv.describe());
        let c = &cfg;
        let stream = fit::cpu_kv_bytes(c.layers as u64, 256, c.kv_heads as u64, c.head_dim as u64, kv).unwrap();
        assert_eq!(stream, per_token * 256, "{}: the plan's stream", kv.describe());
    }
    let f32_stream = KvTypes::CPU_DEFAULT.bytes_per_token(&cfg);
    assert_eq!(KvTypes::same(KvType::Q8_0).bytes_per_token(&cfg) * 64, f32_stream * 17, "Q8_0: 17/64 of f32");
    let bad = ModelConfig { head_dim: 16, hidden: 64, ..cfg.clone() };
    let src16 = MemSource::synthetic(&bad, 1, DType::F32);
    let e = CpuModel::new(&src16).unwrap().with_kv_types(KvTypes::same(KvType::Q8_0)).err().unwrap();
    assert_eq!(e.status, Status::Unsupported, "{e}");
}

// ---------------------------------------------------------------------------------------------
// Through the C ABI.

/// Log lines the engine wrote, collected by `collect`.
static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn collect(_user: *mut c_void, line: *const c_char) {
    // SAFETY: the engine passes a NUL-terminated line alive for the call.
    let line = unsafe { std::ffi::CStr::from_ptr(line) }.to_string_lossy().into_owned();
    LINES.lock().unwrap().push(line);
}

fn cpu_options(kv: (engine_kv_type, engine_kv_type)) -> engine_options {
    engine_options {
        backend: engine_backend::Cpu,
        context: 128,
        max_streams: 2,
        room_bytes: 1 << 30,
        log: Some(collect),
        kv_type_k: kv.0,
        kv_type_v: kv.1,
        ..engine::default_options()
    }
}

/// engine_init_fit's status and message for options whose `field` holds the raw value `raw`.
fn init_with_raw(path: &std::path::Path, field: usize, raw: u32) -> (Status, String) {
    let opts = cpu_options((engine_kv_type::ENGINE_KV_DEFAULT, engine_kv_type::ENGINE_KV_DEFAULT));
    let mut bytes = vec![0u8; std::mem::size_of::<engine_options>() + 8];
    let aligned = bytes.as_mut_ptr().wrapping_add(bytes.as_ptr().align_offset(8));
    let mut e = std::ptr::null_mut();
    // SAFETY: `aligned` is 8-byte aligned with room for engine_options in `bytes`; the raw value goes into the field at
    // `field`, a u32 inside it, which ffi reads raw before it treats it as an enum.
    let status = unsafe {
        std::ptr::copy_nonoverlapping(
            &opts as *const engine_options as *const u8,
            aligned,
            std::mem::size_of::<engine_options>(),
        );
        (aligned.add(field) as *mut u32).write(raw);
        ffi::engine_init_fit(common::c_path(path).as_ptr(), aligned as *const engine_options, &mut e)
    };
    let message = last_error();
    if status == Status::Ok {
        // SAFETY: the engine came from engine_init_fit and is freed here, once.
        unsafe { ffi::engine_free(e) };
    } else {
        assert!(e.is_null(), "a refused init left an engine");
    }
    (status, message)
}

#[test]
fn kv_options_through_the_c_abi() {
    let _g = serial();
    let mut rng = Rng::fresh("kv_options_through_the_c_abi");
    let dir = Scratch::new("kv-options");
    let cfg = small(Arch::Qwen2, 128);
    let seed = rng.next_u64();
    let path = dir.hf("qwen2", &cfg, seed, DType::F32);

    // Out-of-range raw values are refused before anything is opened.
    for (field, name) in [
        (std::mem::offset_of!(engine_options, kv_type_k), "kv_type_k"),
        (std::mem::offset_of!(engine_options, kv_type_v), "kv_type_v"),
    ] {
        for raw in [6u32, 99, u32::MAX] {
            let (status, message) = init_with_raw(&path, field, raw);
            assert_eq!(status, Status::InvalidArgument, "{name} = {raw}: {message}");
            assert!(message.contains(name) && message.contains(&raw.to_string()), "{message}");
        }
        assert_eq!(init_with_raw(&path, field, 5).0, Status::Ok, "{name} = 5 (FP8_E4M3) is a type");
    }

    // Every type on the CPU backend (FP8 included: the CPU emulates it): the info and the start-up line
    // name it, and the logits are the CPU model's in that type.
    let src = MemSource::synthetic(&cfg, seed, DType::F32);
    let prompt: Vec<i32> = (0..20).map(|_| rng.below(cfg.vocab as u64) as i32).collect();
    let ids: Vec<u32> = prompt.iter().map(|&t| t as u32).collect();
    let mut c_types: Vec<(engine_kv_type, engine_kv_type)> =
        vec![(engine_kv_type::ENGINE_KV_DEFAULT, engine_kv_type::ENGINE_KV_DEFAULT)];
    c_types.extend(type_pairs().iter().map(|p| (p.k.to_c(), p.v.to_c())));
    for (k, v) in c_types {
        LINES.lock().unwrap().clear();
        let e = init(&path, &cpu_options((k, v)));
        let want = KvTypes::resolve(k, v, KvTypes::CPU_DEFAULT);
        let i = info(&e);
        assert_eq!((i.kv_type_k, i.kv_type_v), (want.k.to_c(), want.v.to_c()), "{k:?}/{v:?}: engine_model_info");
        let lines = LINES.lock().unwrap().clone();
        let start = lines.iter().find(|l| l.contains("KV pool of")).unwrap_or_else(|| panic!("{lines:?}"));
        assert!(start.contains(&format!("in {}", want.describe())), "{start}");
        assert!(start.contains(&format!("({} KV cache)", want.describe())), "{start}");
        step(&e, 0, &prompt);
        let model = CpuModel::new(&src).unwrap().with_kv_types(want).unwrap();
        let expect = model.forward(&mut model.new_stream(128), &ids).unwrap();
        assert_eq!(common::bits(&logits(&e, 0)), common::bits(&expect), "{}", want.describe());
    }

    // A block type on a model whose heads are not whole blocks: UNSUPPORTED, naming the option.
    let narrow = ModelConfig { head_dim: 16, ..cfg.clone() };
    let narrow_path = dir.hf("narrow", &narrow, seed, DType::F32);
    for (k, v, field) in [
        (engine_kv_type::ENGINE_KV_Q8_0, engine_kv_type::ENGINE_KV_DEFAULT, "kv_type_k"),
        (engine_kv_type::ENGINE_KV_F16, engine_kv_type::ENGINE_KV_FP8_E4M3, "kv_type_v"),
    ] {
        let mut e = std::ptr::null_mut();
        let opts = cpu_options((k, v));
        // SAFETY: a NUL-terminated path, options and a handle slot, all alive across the call.
        let status = unsafe { ffi::engine_init_fit(common::c_path(&narrow_path).as_ptr(), &opts, &mut e) };
        assert_eq!(status, Status::Unsupported, "{}", last_error());
        assert!(last_error().contains(field) && last_error().contains("head_dim 16"), "{}", last_error());
        assert!(e.is_null());
    }
    // The same model with types that take any head: loads.
    drop(init(&narrow_path, &cpu_options((engine_kv_type::ENGINE_KV_BF16, engine_kv_type::ENGINE_KV_F16))));
    assert_eq!(common::stats(), Default::default(), "everything freed");
}

#[test]
fn the_cpu_start_up_line_counts_the_cache_in_its_type() {
    let _g = serial();
    let dir = Scratch::new("kv-line");
    let cfg = small(Arch::Llama, 128);
    let path = dir.hf("llama", &cfg, 3, DType::F32);
    let mut stream_bytes = Vec::new();
    for t in KvType::ALL {
        LINES.lock().unwrap().clear();
        let opts = engine_options { max_streams: 1, ..cpu_options((t.to_c(), t.to_c())) };
        let e = init(&path, &opts);
        let (total, _) = common::kv_stats(&e);
        // One full window in the pool: the stream the plan counted.
        assert_eq!(total, 128, "{}", t.name());
        let line = LINES.lock().unwrap().iter().find(|l| l.contains("KV pool")).cloned().unwrap();
        assert!(line.contains(&format!("{} KV cache", t.name())), "{line}");
        stream_bytes.push(KvTypes::same(t).bytes_per_token(&cfg) * 128);
    }
    // BF16 and F16 half of F32; Q8_0 and FP8 17/32 of BF16.
    assert_eq!(stream_bytes[0], stream_bytes[2] / 2);
    assert_eq!(stream_bytes[1], stream_bytes[0]);
    assert_eq!(stream_bytes[3] * 32, stream_bytes[0] * 17);
    assert_eq!(stream_bytes[4], stream_bytes[3]);
}
