//! The CUDA backend against the CPU reference on small random models (Llama, Qwen2, Qwen3; BF16, F16,
//! F32, every GGUF block format, the Q4_K_M mix): logits at every position, greedy and sampled decoding, the byte predictions the fit
//! rule relies on, the refusals, and rows in mapped host memory. Skips where no CUDA device is present.

mod common;
use common::{rel_l2, top_two_gap};

use common::{Rng, gpu_present};
use hostembed::Status;
use hostembed::checkpoint::write::{MemSource, Recipe};
use hostembed::cpu::CpuModel;
use hostembed::cuda::{DeviceBuffer, PinnedBuffer};
use hostembed::gpu::{GpuModel, RowsOnDevice};
use hostembed::model::{Arch, ModelConfig, RopeScaling, TensorSource, names};
use hostembed::sampler::{self, Sampling};
use hostembed::tensor::DType;

fn model(cfg: ModelConfig, dtype: DType, seed: u64) -> MemSource {
    MemSource::synthetic(&cfg, seed, dtype)
}

fn base(arch: Arch) -> ModelConfig {
    ModelConfig {
        arch,
        vocab: 1000,
        hidden: 256,
        layers: 2,
        heads: 8,
        kv_heads: 2,
        head_dim: 32,
        intermediate: 512,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 4096,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        bos: Some(1),
        eos: Some(2),
    }
}

/// Llama with GQA 4:1, llama3 rope scaling and the pairs rotated as GGUF llama stores them; Qwen2 with
/// biases, a tied head and an odd vocabulary; Qwen3 with q/k norms and head_dim 128 beside hidden 256.
fn configs() -> Vec<(&'static str, ModelConfig)> {
    let llama = ModelConfig {
        rope_scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 64,
        },
        rope_interleaved: true,
        rope_theta: 500000.0,
        ..base(Arch::Llama)
    };
    let qwen2 = ModelConfig {
        vocab: 777,
        hidden: 224,
        heads: 7,
        kv_heads: 1,
        tied: true,
        qkv_bias: true,
        intermediate: 480,
        ..base(Arch::Qwen2)
    };
    let qwen3 = ModelConfig { heads: 4, head_dim: 128, qk_norm: true, rope_theta: 1000000.0, ..base(Arch::Qwen3) };
    vec![("llama", llama), ("qwen2", qwen2), ("qwen3", qwen3)]
}

/// The embedding rows on the card, as the engine's DEVICE placement hands them over.
fn rows_on_card(src: &MemSource) -> (DeviceBuffer, RowsOnDevice) {
    let e = src.tensor(names::EMBED).unwrap();
    let buf = DeviceBuffer::from_slice(e.bytes).unwrap();
    let rows = RowsOnDevice { ptr: buf.ptr(), dtype: e.dtype, vocab: e.rows(), cols: e.cols() };
    (buf, rows)
}

fn random_tokens(rng: &mut Rng, vocab: usize, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
}

#[test]
fn gpu_logits_match_cpu_at_every_position() {
    if !gpu_present("gpu_logits_match_cpu_at_every_position") {
        return;
    }
    let mut rng = Rng::fresh("gpu_logits_match_cpu_at_every_position");
    let mut cases: Vec<(&str, ModelConfig, DType)> =
        configs().into_iter().map(|(name, cfg)| (name, cfg, DType::Bf16)).collect();
    let llama = configs()[0].1.clone();
    // Every block format whose blocks fit the Llama shape (hidden 256, intermediate 512), and (below, as
    // "Q4_K_M") the mixed recipe most quantized files use.
    for dtype in [
        DType::F16,
        DType::F32,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
    ] {
        cases.push(("llama", llama.clone(), dtype));
    }
    cases.push(("llama Q4_K_M", llama.clone(), DType::Q4_K));
    for (name, cfg, dtype) in cases {
        let src = if name.ends_with("Q4_K_M") {
            MemSource::synthetic(&cfg, rng.next_u64(), Recipe::Q4KM)
        } else {
            model(cfg.clone(), dtype, rng.next_u64())
        };
        if !name.ends_with("Q4_K_M") {
            let head = if cfg.tied { names::EMBED } else { names::LM_HEAD };
            assert_eq!(src.tensor(head).unwrap().dtype, dtype, "{name}: the synthetic model is in {}", dtype.name());
        }
        let cpu = CpuModel::new(&src).unwrap();
        let (_rows_buf, rows) = rows_on_card(&src);
        let max_batch = 16;
        let mut gpu = GpuModel::load(&src, rows, max_batch).unwrap();
        assert_eq!(
            gpu.allocated_bytes(),
            (GpuModel::weight_bytes(&src), GpuModel::scratch_bytes(&src, max_batch)),
            "{name}: allocations differ from the predicted bytes"
        );

        let tokens = random_tokens(&mut rng, cfg.vocab, 40); // chunks of 16, 16 and 8
        let window = 64;
        let mut gs = gpu.new_stream(window).unwrap();
        let mut cs = cpu.new_stream(window);
        let got = gpu.all_logits(&mut gs, &tokens).unwrap();
        let want = cpu.forward_all(&mut cs, &tokens).unwrap();
        assert_eq!(gs.len(), tokens.len());
        let worst = got.iter().zip(&want).map(|(g, w)| rel_l2(g, w)).fold(0f64, f64::max);
        println!(
            "{name} {}: worst relative L2 of the logits over {} positions {worst:.2e}",
            dtype.name(),
            tokens.len()
        );
        assert!(worst < 2e-2, "{name} {}: logits differ from the CPU's by {worst:.3e}", dtype.name());
        assert_eq!(gpu.last_logits().unwrap(), *got.last().unwrap(), "{name}: last_logits after all_logits");
    }
}

#[test]
fn greedy_decoding_matches_cpu_except_near_ties() {
    if !gpu_present("greedy_decoding_matches_cpu_except_near_ties") {
        return;
    }
    let mut rng = Rng::fresh("greedy_decoding_matches_cpu_except_near_ties");
    for (name, cfg) in configs() {
        let src = model(cfg.clone(), DType::Bf16, rng.next_u64());
        let cpu = CpuModel::new(&src).unwrap();
        let (_rows_buf, rows) = rows_on_card(&src);
        let mut gpu = GpuModel::load(&src, rows, 8).unwrap();
        let window = 128;
        let mut gs = gpu.new_stream(window).unwrap();
        let mut cs = cpu.new_stream(window);
        let prompt = random_tokens(&mut rng, cfg.vocab, 21); // three chunks of 8, 8 and 5
        let (mut input, mut near_ties) = (prompt, 0);
        for step in 0..64 {
            let got = gpu.step(&mut gs, &input, &Sampling::GREEDY, 0).unwrap();
            let logits = cpu.forward(&mut cs, &input).unwrap();
            let want = sampler::argmax(&logits);
            // The GPU's logits at this step: the error they carry bounds the gaps it may misjudge.
            let gl = gpu.last_logits().unwrap();
            let err = gl.iter().zip(&logits).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            if got != want {
                let gap = top_two_gap(&logits);
                assert!(
                    gap <= 2.0 * err,
                    "{name} step {step}: GPU chose {got}, CPU {want}, top-two gap {gap} > 2 x {err}"
                );
                near_ties += 1;
            }
            assert_eq!(gs.len(), cs.len());
            input = vec![want]; // both continue from the CPU's choice
        }
        println!("{name}: 64 greedy steps, {near_ties} near-tie differences");
        assert!(near_ties <= 3, "{name}: {near_ties} near-tie differences in 64 steps");
    }
}

#[test]
fn sampled_steps_follow_the_sampler_on_the_gpu_logits() {
    if !gpu_present("sampled_steps_follow_the_sampler_on_the_gpu_logits") {
        return;
    }
    let mut rng = Rng::fresh("sampled_steps_follow_the_sampler_on_the_gpu_logits");
    let (name, cfg) = configs().remove(2);
    let src = model(cfg.clone(), DType::Bf16, rng.next_u64());
    let (_rows_buf, rows) = rows_on_card(&src);
    let mut gpu = GpuModel::load(&src, rows, 8).unwrap();
    let stream_index = 3;
    let s = Sampling { temperature: 0.9, top_k: 40, top_p: 0.95, seed: rng.next_u64(), ..Sampling::GREEDY };
    let prompt = random_tokens(&mut rng, cfg.vocab, 5);
    let run = |gpu: &mut GpuModel, check: bool| -> Vec<u32> {
        let mut gs = gpu.new_stream(64).unwrap();
        let (mut input, mut out) = (prompt.clone(), Vec::new());
        for step in 0..40 {
            let got = gpu.step(&mut gs, &input, &s, stream_index).unwrap();
            if check {
                // The draw is for the position the new token takes: the stream's length after the step.
                let want = sampler::sample(&gpu.last_logits().unwrap(), &s, stream_index, gs.len() as u64);
                assert_eq!(got, want, "{name} step {step}");
            }
            out.push(got);
            input = vec![got];
        }
        out
    };
    let first = run(&mut gpu, true);
    // A fresh stream with the same seed repeats the run exactly.
    assert_eq!(run(&mut gpu, false), first, "{name}: a sampled run does not repeat");
}

#[test]
fn rows_in_mapped_host_memory_give_the_same_logits() {
    if !gpu_present("rows_in_mapped_host_memory_give_the_same_logits") {
        return;
    }
    let mut rng = Rng::fresh("rows_in_mapped_host_memory_give_the_same_logits");
    for (name, cfg) in configs() {
        let src = model(cfg.clone(), DType::Bf16, rng.next_u64());
        let e = src.tensor(names::EMBED).unwrap();
        let mut pinned = PinnedBuffer::new_mapped(e.bytes.len()).unwrap();
        pinned.as_mut_slice().copy_from_slice(e.bytes);
        let mapped = RowsOnDevice { ptr: pinned.device_ptr(), dtype: e.dtype, vocab: e.rows(), cols: e.cols() };
        let (_rows_buf, on_card) = rows_on_card(&src);
        let tokens = random_tokens(&mut rng, cfg.vocab, 12);
        let logits = |rows: RowsOnDevice| {
            let mut gpu = GpuModel::load(&src, rows, 4).unwrap();
            let mut gs = gpu.new_stream(16).unwrap();
            let all = gpu.all_logits(&mut gs, &tokens).unwrap();
            let next = gpu.step(&mut gs, &[tokens[0]], &Sampling::GREEDY, 0).unwrap();
            (all, next, gpu.last_logits().unwrap())
        };
        assert!(logits(mapped) == logits(on_card), "{name}: mapped rows change the results");
    }
}

#[test]
fn bad_calls_are_refused_before_anything_is_written() {
    if !gpu_present("bad_calls_are_refused_before_anything_is_written") {
        return;
    }
    let mut rng = Rng::fresh("bad_calls_are_refused_before_anything_is_written");
    let (_, cfg) = configs().remove(0);
    let src = model(cfg.clone(), DType::Bf16, rng.next_u64());
    let cpu = CpuModel::new(&src).unwrap();
    let (_rows_buf, rows) = rows_on_card(&src);
    let mut gpu = GpuModel::load(&src, rows, 4).unwrap();
    let window = 8;
    let mut gs = gpu.new_stream(window).unwrap();
    let g = Sampling::GREEDY;

    assert!(gpu.last_logits().is_err(), "logits before any step");
    let e = gpu.step(&mut gs, &[], &g, 0).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    let e = gpu.step(&mut gs, &[3, cfg.vocab as u32, 4], &g, 0).unwrap_err();
    assert_eq!(e.status, Status::OutOfRange, "{e}");
    assert!(e.message.contains(&cfg.vocab.to_string()), "{e}");
    assert_eq!(gs.len(), 0, "a refused step appended tokens");
    let e = gpu.step(&mut gs, &random_tokens(&mut rng, cfg.vocab, window + 1), &g, 0).unwrap_err();
    assert_eq!(e.status, Status::NoRoom, "{e}");
    assert_eq!(gs.len(), 0);

    // After the refusals the stream decodes as if they never happened.
    let tokens = random_tokens(&mut rng, cfg.vocab, window);
    gpu.step(&mut gs, &tokens[..window - 1], &g, 0).unwrap();
    let e = gpu.step(&mut gs, &tokens[window - 1..].repeat(2), &g, 0).unwrap_err();
    assert_eq!(e.status, Status::NoRoom, "{e}");
    gpu.step(&mut gs, &tokens[window - 1..], &g, 0).unwrap();
    let mut cs = cpu.new_stream(window);
    let want = cpu.forward(&mut cs, &tokens).unwrap();
    let err = rel_l2(&gpu.last_logits().unwrap(), &want);
    assert!(err < 2e-2, "logits after refused calls differ by {err:.3e}");
    let e = gpu.step(&mut gs, &[1], &g, 0).unwrap_err();
    assert_eq!(e.status, Status::NoRoom, "{e}");

    // A stream of another model, rows of the wrong shape, a window of nothing.
    let (_rows2, rows2) = rows_on_card(&src);
    let other = GpuModel::load(&src, rows2, 4).unwrap();
    let mut foreign = other.new_stream(window).unwrap();
    let e = gpu.step(&mut foreign, &[1], &g, 0).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    let e = GpuModel::load(&src, RowsOnDevice { vocab: cfg.vocab - 1, ..rows }, 4).err().unwrap();
    assert_eq!(e.status, Status::BadModel, "{e}");
    let e = GpuModel::load(&src, rows, 0).err().unwrap();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    assert_eq!(gpu.new_stream(0).err().unwrap().status, Status::InvalidArgument);

    // A missing tensor is named.
    let mut broken = model(cfg.clone(), DType::Bf16, 1);
    broken.tensors.remove(&names::layer(1, names::UP));
    let e = GpuModel::load(&broken, rows, 4).err().unwrap();
    assert_eq!(e.status, Status::BadModel, "{e}");
    assert!(e.message.contains("model.layers.1.mlp.up_proj.weight"), "{e}");
}

#[test]
fn byte_predictions_hold_for_every_shape() {
    if !gpu_present("byte_predictions_hold_for_every_shape") {
        return;
    }
    let mut rng = Rng::fresh("byte_predictions_hold_for_every_shape");
    for (name, cfg) in configs() {
        for dtype in [DType::Bf16, DType::Q8_0] {
            let src = model(cfg.clone(), dtype, rng.next_u64());
            let (_rows_buf, rows) = rows_on_card(&src);
            for max_batch in [1, 7, 64] {
                let gpu = GpuModel::load(&src, rows, max_batch).unwrap();
                assert_eq!(
                    gpu.allocated_bytes(),
                    (GpuModel::weight_bytes(&src), GpuModel::scratch_bytes(&src, max_batch)),
                    "{name} {} max_batch {max_batch}",
                    dtype.name()
                );
                let stream = gpu.new_stream(100).unwrap();
                assert_eq!(stream.allocated_bytes(), GpuModel::stream_bytes(&cfg, 100), "{name}: stream bytes");
                assert_eq!(GpuModel::stream_bytes(&cfg, 100), cfg.kv_bytes_per_token() * 100);
                drop(stream);
            }
        }
    }
}
