//! Whole models in every type against the CPU, the pool's bytes, FP8's compute capability, the engine's report.

use super::pairs;
use crate::common::{
    self, Rng, Scratch, decode_configs as configs, device_info, gpu_present, info, init, logits, rel_l2, rows_on_card,
    serial, step,
};
use hostembed::checkpoint::write::MemSource;
use hostembed::cpu::CpuModel;
use hostembed::engine::{engine_backend, engine_options, engine_tristate};
use hostembed::gpu::{GpuModel, PAGE_TOKENS, PageLayout};
use hostembed::kv::{KvType, KvTypes};
use hostembed::model::ModelConfig;
use hostembed::sampler::Sampling;
use hostembed::status::last_error;
use hostembed::tensor::DType;
use hostembed::tuning::Tuning;
use hostembed::{Status, engine};
use std::ffi::{c_char, c_void};
use std::ptr;
use std::sync::Mutex;

// ---------------------------------------------------------------------------------------------------
// Whole models.

fn random_tokens(rng: &mut Rng, vocab: usize, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
}

/// Whether this device runs FP8 E4M3 (compute capability 8.9 or newer).
fn fp8_here() -> bool {
    let d = device_info();
    (d.compute_major, d.compute_minor) >= (8, 9)
}

/// Relative L2 a type's rounding of K and V may move a small random model's logits by, beside the GPU's
/// own arithmetic (several times what the CPU measures; tests/kv/cpu_backend.rs).
fn rounding_bound(kv: KvTypes) -> f64 {
    let one = |t: KvType| match t {
        KvType::F32 => 0.0,
        KvType::F16 => 2e-3,
        KvType::Bf16 => 1e-2,
        KvType::Q8_0 => 3e-2,
        KvType::Fp8E4m3 => 1e-1,
    };
    one(kv.k) + one(kv.v)
}

/// The GPU's logits after a prompt and after each of `steps` greedy tokens chosen by the CPU, in `kv`.
fn gpu_run(gpu: &mut GpuModel, prompt: &[u32], next: &[u32]) -> Vec<Vec<f32>> {
    let mut pool = gpu.page_pool().unwrap();
    let mut s = gpu.new_stream(prompt.len() + next.len() + 1).unwrap();
    let mut out = Vec::new();
    gpu.step(&mut pool, &mut s, prompt, &Sampling::GREEDY, 0).unwrap();
    out.push(gpu.last_logits().unwrap());
    for &t in next {
        gpu.step(&mut pool, &mut s, &[t], &Sampling::GREEDY, 0).unwrap();
        out.push(gpu.last_logits().unwrap());
    }
    out
}

fn cpu_run(model: &CpuModel, prompt: &[u32], next: &[u32]) -> Vec<Vec<f32>> {
    let mut s = model.new_stream(prompt.len() + next.len() + 1);
    let mut out = vec![model.forward(&mut s, prompt).unwrap()];
    for &t in next {
        out.push(model.forward(&mut s, &[t]).unwrap());
    }
    out
}

#[test]
fn prompt_and_decode_logits_in_every_type_against_the_cpu() {
    if !gpu_present("prompt_and_decode_logits_in_every_type_against_the_cpu") {
        return;
    }
    let mut rng = Rng::fresh("prompt_and_decode_logits_in_every_type_against_the_cpu");
    println!(
        "| model | KV cache | prompt vs CPU (same type) | decode vs CPU (same type) | prompt vs F32 cache | decode vs F32 cache |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    for (name, cfg) in configs() {
        let src = MemSource::synthetic(&cfg, rng.next_u64(), DType::Bf16);
        let (_rows_buf, rows) = rows_on_card(&src);
        // 100 prompt tokens in chunks of 64 and 36 (tensor cores, flash attention), then 12 decoded.
        let prompt = random_tokens(&mut rng, cfg.vocab, 100);
        let f32_cache = CpuModel::new(&src).unwrap();
        let first = cpu_run(&f32_cache, &prompt, &[]);
        let mut next = vec![hostembed::sampler::argmax(&first[0])];
        let mut s = f32_cache.new_stream(128);
        f32_cache.forward(&mut s, &prompt).unwrap();
        for _ in 0..11 {
            let l = f32_cache.forward(&mut s, &[*next.last().unwrap()]).unwrap();
            next.push(hostembed::sampler::argmax(&l));
        }
        let plain = cpu_run(&f32_cache, &prompt, &next);
        for kv in pairs() {
            if (kv.k == KvType::Fp8E4m3 || kv.v == KvType::Fp8E4m3) && !fp8_here() {
                continue;
            }
            let mut gpu = GpuModel::load_with_kv(&src, rows, 64, 16, kv, &Tuning::from_env()).unwrap();
            assert_eq!(gpu.allocated_pool_bytes(), GpuModel::pool_bytes(&cfg, kv, 16), "{name}: pool bytes");
            let got = gpu_run(&mut gpu, &prompt, &next);
            let same = cpu_run(&CpuModel::new(&src).unwrap().with_kv_types(kv).unwrap(), &prompt, &next);
            let worst =
                |a: &[Vec<f32>], b: &[Vec<f32>]| a.iter().zip(b).map(|(x, y)| rel_l2(x, y)).fold(0f64, f64::max);
            let (p_same, d_same) = (rel_l2(&got[0], &same[0]), worst(&got[1..], &same[1..]));
            let (p_plain, d_plain) = (rel_l2(&got[0], &plain[0]), worst(&got[1..], &plain[1..]));
            println!("| {name} | {} | {p_same:.2e} | {d_same:.2e} | {p_plain:.2e} | {d_plain:.2e} |", kv.describe());
            let what = format!("{name} {}", kv.describe());
            assert!(
                p_same < 2e-2 && d_same < 2e-2,
                "{what}: against the CPU in the same type {p_same:.3e} / {d_same:.3e}"
            );
            let bound = 2e-2 + rounding_bound(kv);
            assert!(p_plain < bound && d_plain < bound, "{what}: against an f32 cache {p_plain:.3e} / {d_plain:.3e}");
        }
    }
}

#[test]
fn an_all_f32_model_with_an_f32_cache_stays_within_1e_4_of_the_cpu() {
    if !gpu_present("an_all_f32_model_with_an_f32_cache_stays_within_1e_4_of_the_cpu") {
        return;
    }
    let mut rng = Rng::fresh("an_all_f32_model_with_an_f32_cache_stays_within_1e_4_of_the_cpu");
    let f32_kv = KvTypes::same(KvType::F32);
    for (name, cfg) in configs() {
        let src = MemSource::synthetic(&cfg, rng.next_u64(), DType::F32);
        let (_rows_buf, rows) = rows_on_card(&src);
        let mut gpu = GpuModel::load_with_kv(&src, rows, 64, 32, f32_kv, &Tuning::from_env()).unwrap();
        let route = gpu.prompt_route().to_string();
        println!("{name}: {route}");
        assert!(route.contains("f32 matrix-vector"), "{name}: an all-F32 model's prompt route: {route}");
        // Every position of a 150-token prompt (chunks of 64, 64 and 22), then 16 decoded tokens.
        let tokens = random_tokens(&mut rng, cfg.vocab, 150);
        let mut pool = gpu.page_pool().unwrap();
        let mut gs = gpu.new_stream(200).unwrap();
        let got = gpu.all_logits(&mut pool, &mut gs, &tokens).unwrap();
        let cpu = CpuModel::new(&src).unwrap().with_kv_types(f32_kv).unwrap();
        let mut cs = cpu.new_stream(200);
        let want = cpu.forward_all(&mut cs, &tokens).unwrap();
        let worst = got.iter().zip(&want).map(|(g, w)| rel_l2(g, w)).fold(0f64, f64::max);
        let mut decode_worst = 0f64;
        for _ in 0..16 {
            let t = random_tokens(&mut rng, cfg.vocab, 1);
            gpu.step(&mut pool, &mut gs, &t, &Sampling::GREEDY, 0).unwrap();
            let w = cpu.forward(&mut cs, &t).unwrap();
            decode_worst = decode_worst.max(rel_l2(&gpu.last_logits().unwrap(), &w));
        }
        println!(
            "{name}: all F32, worst relative L2 over the prompt {worst:.2e}, over 16 decoded tokens {decode_worst:.2e}"
        );
        assert!(worst < 1e-4 && decode_worst < 1e-4, "{name}: {worst:.3e} / {decode_worst:.3e} from the CPU");

        // BF16 weights with an F32 cache keep the tensor-core products, with split attention.
        let bf16 = MemSource::synthetic(&cfg, rng.next_u64(), DType::Bf16);
        let (_b, rows) = rows_on_card(&bf16);
        let gpu = GpuModel::load_with_kv(&bf16, rows, 64, 32, f32_kv, &Tuning::from_env()).unwrap();
        assert!(gpu.prompt_route().contains("split attention (an F32 KV cache"), "{}", gpu.prompt_route());
        // And an all-F32 model with a BF16 cache keeps the tensor-core path.
        let (_c, rows) = rows_on_card(&src);
        let gpu = GpuModel::load_with_kv(&src, rows, 64, 32, KvTypes::GPU_DEFAULT, &Tuning::from_env()).unwrap();
        assert!(!gpu.prompt_route().contains("f32 matrix-vector"), "{}", gpu.prompt_route());
    }
}

#[test]
fn the_pool_allocates_the_predicted_bytes_in_every_type() {
    if !gpu_present("the_pool_allocates_the_predicted_bytes_in_every_type") {
        return;
    }
    let mut rng = Rng::fresh("the_pool_allocates_the_predicted_bytes_in_every_type");
    for (name, cfg) in configs() {
        let src = MemSource::synthetic(&cfg, rng.next_u64(), DType::Bf16);
        let (_rows_buf, rows) = rows_on_card(&src);
        for kv in pairs() {
            if (kv.k == KvType::Fp8E4m3 || kv.v == KvType::Fp8E4m3) && !fp8_here() {
                continue;
            }
            for pages in [1, 7, 130] {
                let gpu = GpuModel::load_with_kv(&src, rows, 16, pages, kv, &Tuning::from_env()).unwrap();
                let what = format!("{name} {} with {pages} pages", kv.describe());
                assert_eq!(gpu.kv_types(), kv, "{what}");
                assert_eq!(gpu.allocated_pool_bytes(), GpuModel::pool_bytes(&cfg, kv, pages), "{what}");
                let layout = PageLayout::new(&cfg, kv);
                assert_eq!(
                    GpuModel::pool_bytes(&cfg, kv, pages),
                    (cfg.layers * pages * layout.page_bytes()) as u64,
                    "{what}: every layer's pages"
                );
                assert_eq!(
                    gpu.allocated_bytes(),
                    (
                        GpuModel::weight_bytes(&src),
                        GpuModel::scratch_bytes(&src, 16, kv, pages * PAGE_TOKENS, &Tuning::from_env())
                    )
                );
            }
        }
        // A block type on heads of partial blocks is refused before anything is allocated.
        let narrow = ModelConfig { head_dim: 16, heads: 16, ..cfg.clone() };
        let narrow_src = MemSource::synthetic(&narrow, 1, DType::Bf16);
        let (_n, rows) = rows_on_card(&narrow_src);
        let e = GpuModel::load_with_kv(&narrow_src, rows, 16, 4, KvTypes::same(KvType::Q8_0), &Tuning::from_env())
            .err()
            .unwrap();
        assert_eq!(e.status, Status::Unsupported, "{e}");
    }
}

#[test]
fn fp8_follows_the_compute_capability() {
    if !gpu_present("fp8_follows_the_compute_capability") {
        return;
    }
    let d = device_info();
    let (_, cfg) = configs().remove(0);
    let src = MemSource::synthetic(&cfg, 5, DType::Bf16);
    let (_rows_buf, rows) = rows_on_card(&src);
    let got =
        GpuModel::load_with_kv(&src, rows, 16, 4, KvTypes { k: KvType::Fp8E4m3, v: KvType::Q8_0 }, &Tuning::from_env());
    println!(
        "compute capability {}.{}: FP8 E4M3 {}",
        d.compute_major,
        d.compute_minor,
        if got.is_ok() { "loads" } else { "refused" }
    );
    match got {
        Ok(_) => assert!(fp8_here(), "FP8 loaded on {}.{}", d.compute_major, d.compute_minor),
        Err(e) => {
            assert!(!fp8_here(), "FP8 refused on {}.{}: {e}", d.compute_major, d.compute_minor);
            assert_eq!(e.status, Status::Unsupported, "{e}");
            assert!(e.message.contains("8.9"), "{e}");
        }
    }
}

/// Log lines the engine wrote, collected by `collect`.
static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn collect(_user: *mut c_void, line: *const c_char) {
    // SAFETY: the engine passes a NUL-terminated line alive for the call.
    let line = unsafe { std::ffi::CStr::from_ptr(line) }.to_string_lossy().into_owned();
    LINES.lock().unwrap().push(line);
}

#[test]
fn the_cuda_engine_reports_and_plans_its_kv_types() {
    if !gpu_present("the_cuda_engine_reports_and_plans_its_kv_types") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("the_cuda_engine_reports_and_plans_its_kv_types");
    let dir = Scratch::new("gpu-kv");
    let (_, cfg) = configs().remove(0);
    let path = dir.hf("llama", &cfg, rng.next_u64(), DType::Bf16);
    let ckpt = hostembed::checkpoint::Checkpoint::open(&path).unwrap();
    let prompt: Vec<i32> = (0..40).map(|_| rng.below(cfg.vocab as u64) as i32).collect();
    let mut c_types = vec![(KvTypes::GPU_DEFAULT, true)];
    c_types.extend(pairs().into_iter().map(|p| (p, false)));
    for (kv, default) in c_types {
        let cuda_opts = engine_options {
            backend: engine_backend::Cuda,
            context: 512,
            max_streams: 2,
            max_batch: 32,
            mmap_rows: engine_tristate::No,
            log: Some(collect),
            kv_type_k: if default { engine::default_options().kv_type_k } else { kv.k.to_c() },
            kv_type_v: if default { engine::default_options().kv_type_v } else { kv.v.to_c() },
            ..engine::default_options()
        };
        let needs_fp8 = kv.k == KvType::Fp8E4m3 || kv.v == KvType::Fp8E4m3;
        if needs_fp8 && !fp8_here() {
            let mut e = ptr::null_mut();
            // SAFETY: a NUL-terminated path, options and a handle slot, all alive across the call.
            let st = unsafe { hostembed::ffi::engine_init_fit(common::c_path(&path).as_ptr(), &cuda_opts, &mut e) };
            assert_eq!(st, Status::Unsupported, "FP8 on a device older than 8.9: {}", last_error());
            assert!(last_error().contains("compute capability 8.9"), "{}", last_error());
            continue;
        }
        LINES.lock().unwrap().clear();
        let e = init(&path, &cuda_opts);
        let i = info(&e);
        assert!(i.cuda);
        assert_eq!((i.kv_type_k, i.kv_type_v), (kv.k.to_c(), kv.v.to_c()), "{}: engine_model_info", kv.describe());
        let inputs = engine::fit_inputs(&ckpt, &cuda_opts, Some(&device_info())).unwrap();
        assert_eq!(inputs.stream_bytes_per_token, kv.bytes_per_token(&cfg), "{}", kv.describe());
        assert_eq!(inputs.stream_bytes, kv.bytes_per_token(&cfg) * 512, "{}", kv.describe());
        let lines = LINES.lock().unwrap().clone();
        let start = lines.iter().find(|l| l.contains("KV pool of")).unwrap_or_else(|| panic!("{lines:?}"));
        assert!(start.contains(&format!("tokens in {} (", kv.describe())), "{start}");
        assert!(lines.iter().any(|l| l.contains(&format!("KV cache {}", kv.describe()))), "{lines:?}");
        // The same steps on the CPU engine in the same types.
        step(&e, 0, &prompt);
        let got = logits(&e, 0);
        let cpu_opts = engine_options { backend: engine_backend::Cpu, room_bytes: 1 << 32, ..cuda_opts };
        let c = init(&path, &cpu_opts);
        assert_eq!(
            (info(&c).kv_type_k, info(&c).kv_type_v),
            if default { (KvType::F32.to_c(), KvType::F32.to_c()) } else { (kv.k.to_c(), kv.v.to_c()) }
        );
        step(&c, 0, &prompt);
        let err = rel_l2(&got, &logits(&c, 0));
        println!("{}: CUDA engine against the CPU engine {err:.2e}", kv.describe());
        assert!(err < 2e-2 + rounding_bound(kv), "{}: {err:.3e}", kv.describe());
    }
}
