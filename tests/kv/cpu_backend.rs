//! The CPU backend in every type against the model recomputed layer by layer, and the CPU pool's and plan's bytes.

use super::{small, type_pairs};
use crate::common::{Rng, rel_l2};
use hostembed::checkpoint::write::MemSource;
use hostembed::cpu::{CpuBackend, CpuModel};
use hostembed::kv::{KvType, KvTypes};
use hostembed::model::{Arch, ModelConfig, TensorSource, names};
use hostembed::tensor::DType;
use hostembed::tuning::Tuning;
use hostembed::{Status, cpu, fit};
use std::sync::Arc;

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
