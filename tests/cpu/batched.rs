//! Prompts as batches: the products and the model against plain f64 definitions and token by token; refusals.

use super::{ARCHS, layer_major_logits_with, small_config, synthetic_model, token_by_token, tokens};
use crate::common::{self, Rng, rel_l2};
use hostembed::cpu::CpuModel;
use hostembed::model::{Arch, ModelConfig, TensorRef};
use hostembed::tensor::{DType, FORMATS, Simd, encode_row};
use hostembed::{Status, cpu, tensor};

// ---------------------------------------------------------------------------------------------
// Prompts as batches: the batched model against the plain definitions and against itself token by
// token.

/// matvec as a plain loop: each row decoded, then one f64 sum from zero in column order.
fn plain_matvec(w: &TensorRef, x: &[f32]) -> Vec<f32> {
    (0..w.rows())
        .map(|r| {
            let row = w.row_f32(r);
            let mut acc = 0f64;
            for c in 0..x.len() {
                acc += row[c] as f64 * x[c] as f64;
            }
            acc as f32
        })
        .collect()
}

/// Attention as a plain loop over one query: the exact max, the host's exp, each sum in position order.
#[allow(clippy::too_many_arguments)]
fn plain_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_ctx: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    let (kv_dim, group) = (kv_heads * head_dim, heads / kv_heads);
    let scale = 1.0 / (head_dim as f64).sqrt();
    for h in 0..heads {
        let (qh, off) = (&q[h * head_dim..(h + 1) * head_dim], (h / group) * head_dim);
        let scores: Vec<f64> = (0..n_ctx)
            .map(|t| (0..head_dim).map(|d| qh[d] as f64 * k[t * kv_dim + off + d] as f64).sum::<f64>() * scale)
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        for d in 0..head_dim {
            let acc: f64 = weights.iter().enumerate().map(|(t, &p)| p * v[t * kv_dim + off + d] as f64).sum();
            out[h * head_dim + d] = (acc / total) as f32;
        }
    }
}

/// Every format the crate reads.
fn formats() -> impl Iterator<Item = DType> {
    FORMATS.iter().map(|f| f.dtype)
}

/// The formats a model of `cfg` can be stored in: every matrix width a whole number of blocks.
fn formats_for(cfg: &ModelConfig) -> impl Iterator<Item = DType> + '_ {
    formats().filter(|d| [cfg.hidden, cfg.q_dim(), cfg.intermediate].iter().all(|&c| d.row_bytes(c).is_some()))
}

/// Random rows of `dtype` and their `TensorRef`'s pieces.
fn random_weight(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> (Vec<u8>, [usize; 2]) {
    let values = rng.vec(rows * cols, 1.0);
    (values.chunks(cols).flat_map(|r| encode_row(dtype, r)).collect(), [rows, cols])
}

#[test]
fn fast_products_stay_within_1e_5_of_the_plain_f64_products_in_every_format_and_build() {
    let mut rng = Rng::fresh("fast_products_stay_within_1e_5_of_the_plain_f64_products_in_every_format_and_build");
    let builds = Simd::available();
    println!("builds: {:?}", builds.iter().map(|s| s.name()).collect::<Vec<_>>());
    // 13 rows: three groups of four and one row alone; 100 columns leave a tail of 4 lanes.
    for (rows, cols) in [(13, 96), (13, 100), (7, 576), (3, 1536), (5, 8)] {
        for dtype in formats() {
            if dtype.row_bytes(cols).is_none() {
                continue;
            }
            let (bytes, shape) = random_weight(&mut rng, dtype, rows, cols);
            let w = TensorRef { dtype, shape: &shape, bytes: &bytes };
            let x = rng.vec(cols, 2.0);
            let want = plain_matvec(&w, &x);
            let row_bytes: Vec<&[u8]> = bytes.chunks(bytes.len() / rows).collect();
            let mut portable = vec![f32::NAN; rows];
            tensor::dot_rows_into(dtype, Simd::portable(), &row_bytes, &x, &mut portable);
            for &simd in &builds {
                let mut got = vec![f32::NAN; rows];
                tensor::dot_rows_into(dtype, simd, &row_bytes, &x, &mut got);
                let err = rel_l2(&got, &want);
                assert!(err < 1e-5, "{dtype:?} {rows}x{cols} on {}: relative L2 {err}", simd.name());
                assert_eq!(common::bits(&got), common::bits(&portable), "{dtype:?} {rows}x{cols} on {}", simd.name());
            }
            let mut got = vec![f32::NAN; rows];
            cpu::matvec(&w, &x, &mut got);
            assert_eq!(common::bits(&got), common::bits(&portable), "{dtype:?} {rows}x{cols}: matvec");
        }
    }
}

#[test]
fn a_batched_product_gives_each_token_the_bits_of_its_own_matvec() {
    let mut rng = Rng::fresh("a_batched_product_gives_each_token_the_bits_of_its_own_matvec");
    for (rows, cols, tokens) in [(13, 96, 7), (9, 100, 2), (6, 64, 1), (4, 576, 5)] {
        for dtype in formats() {
            if dtype.row_bytes(cols).is_none() {
                continue;
            }
            let (bytes, shape) = random_weight(&mut rng, dtype, rows, cols);
            let w = TensorRef { dtype, shape: &shape, bytes: &bytes };
            let x = rng.vec(tokens * cols, 2.0);
            let mut batched = vec![f32::NAN; tokens * rows];
            cpu::matmul(&w, &x, &mut batched);
            for (t, (x, got)) in x.chunks(cols).zip(batched.chunks(rows)).enumerate() {
                let mut want = vec![f32::NAN; rows];
                cpu::matvec(&w, x, &mut want);
                assert_eq!(common::bits(got), common::bits(&want), "{dtype:?} {rows}x{cols}, token {t} of {tokens}");
            }
        }
    }
}

#[test]
fn attention_stays_within_rounding_of_the_plain_softmax() {
    let mut rng = Rng::fresh("attention_stays_within_rounding_of_the_plain_softmax");
    // head_dim 20 takes every column path (16, then 4); 6 heads over 2 KV heads make groups of 3.
    for (heads, kv_heads, head_dim) in [(6, 2, 20), (4, 4, 8), (8, 1, 16)] {
        let kv_dim = kv_heads * head_dim;
        let most = 300;
        let (k, v) = (rng.vec(most * kv_dim, 1.5), rng.vec(most * kv_dim, 1.0));
        for n_ctx in [1, 2, 31, 32, 33, 64, 65, 100, most] {
            let q = rng.vec(heads * head_dim, 3.0);
            let (mut got, mut want) = (vec![0f32; heads * head_dim], vec![0f32; heads * head_dim]);
            cpu::attention(&q, &k, &v, n_ctx, heads, kv_heads, head_dim, &mut got);
            plain_attention(&q, &k, &v, n_ctx, heads, kv_heads, head_dim, &mut want);
            let err = rel_l2(&got, &want);
            assert!(err < 1e-12, "{heads}:{kv_heads} x {head_dim} over {n_ctx}: relative L2 {err}");
        }
    }
}

#[test]
fn the_model_stays_within_rounding_of_the_plain_definitions() {
    let mut rng = Rng::fresh("the_model_stays_within_rounding_of_the_plain_definitions");
    for arch in ARCHS {
        let cfg = small_config(arch);
        let src = synthetic_model(&cfg, rng.next_u64(), DType::F32);
        let model = CpuModel::new(&src).unwrap();
        let toks = tokens(&mut rng, 64, cfg.vocab);
        let got = model.forward_all(&mut model.new_stream(64), &toks).unwrap();
        let want = layer_major_logits_with(&src, &toks, cpu::matvec, plain_attention);
        for (pos, (g, want)) in got.iter().zip(want).enumerate() {
            let err = rel_l2(g, &want);
            assert!(err < 1e-9, "{arch:?} position {pos}: relative L2 {err}");
        }
    }
}

/// `plain_matvec` into `out`.
fn plain_matvec_into(w: &TensorRef, x: &[f32], out: &mut [f32]) {
    out.copy_from_slice(&plain_matvec(w, x));
}

#[test]
fn the_model_stays_within_1e_5_of_the_plain_f64_model_in_every_format() {
    let mut rng = Rng::fresh("the_model_stays_within_1e_5_of_the_plain_f64_model_in_every_format");
    for arch in ARCHS {
        let cfg = small_config(arch);
        let seed = rng.next_u64();
        let toks = tokens(&mut rng, 24, cfg.vocab);
        for dtype in formats_for(&cfg) {
            let src = synthetic_model(&cfg, seed, dtype);
            let model = CpuModel::new(&src).unwrap();
            let got = model.forward_all(&mut model.new_stream(24), &toks).unwrap();
            let want = layer_major_logits_with(&src, &toks, plain_matvec_into, plain_attention);
            for (pos, (g, want)) in got.iter().zip(want).enumerate() {
                let err = rel_l2(g, &want);
                assert!(err < 1e-5, "{arch:?} {dtype:?} position {pos}: relative L2 {err}");
            }
        }
    }
}

#[test]
fn step_scratch_is_bounded_by_a_chunk_not_by_the_prompt_or_the_window() {
    let cfg = long_context_config(1 << 20);
    // Past one chunk the window adds nothing but threads, and here both windows get all of them.
    let threads = cpu::step_threads(&cfg, 1 << 14, 2);
    assert_eq!((threads, cpu::step_threads(&cfg, 1 << 20, 2)), (2, 2));
    assert_eq!(cpu::scratch_bytes(&cfg, 1 << 14, 2), cpu::scratch_bytes(&cfg, 1 << 20, 2));
    assert!(cpu::scratch_bytes(&cfg, 1 << 20, 2) < 1 << 20, "{} bytes", cpu::scratch_bytes(&cfg, 1 << 20, 2));
    // A short window holds a shorter chunk; a tiny model at a tiny window is not worth many threads.
    assert!(cpu::scratch_bytes(&cfg, 8, 2) < cpu::scratch_bytes(&cfg, 1 << 14, 2));
    assert!(cpu::step_threads(&cfg, 8, 64) < 64);
    assert_eq!(cpu::step_threads(&cfg, 1 << 14, 1), 1);
}

#[test]
fn a_prompt_in_one_step_gives_the_logits_of_the_prompt_token_by_token() {
    let mut rng = Rng::fresh("a_prompt_in_one_step_gives_the_logits_of_the_prompt_token_by_token");
    for arch in ARCHS {
        let cfg = small_config(arch);
        let src = synthetic_model(&cfg, rng.next_u64(), DType::Bf16);
        // Longer than a chunk of the batch and than a block of attention, and not a multiple of either.
        let n = 2 * cpu::CHUNK_TOKENS + 37;
        let toks = tokens(&mut rng, n, cfg.vocab);
        let one = CpuModel::new(&src).unwrap().with_threads(1);
        let want = token_by_token(&one, &toks, n);
        for threads in [1, 2, 5] {
            let model = CpuModel::new(&src).unwrap().with_threads(threads);
            let at_once = model.forward(&mut model.new_stream(n), &toks).unwrap();
            assert_eq!(common::bits(&at_once), common::bits(&want[n - 1]), "{arch:?} on {threads} threads");
            let all = model.forward_all(&mut model.new_stream(n), &toks).unwrap();
            for (pos, (got, want)) in all.iter().zip(&want).enumerate() {
                assert_eq!(common::bits(got), common::bits(want), "{arch:?} on {threads} threads, position {pos}");
            }
        }
    }
}

#[test]
fn a_prompt_in_one_step_gives_the_token_by_token_bits_in_every_format() {
    let mut rng = Rng::fresh("a_prompt_in_one_step_gives_the_token_by_token_bits_in_every_format");
    let n = cpu::CHUNK_TOKENS + 5;
    for arch in ARCHS {
        let cfg = small_config(arch);
        let seed = rng.next_u64();
        let toks = tokens(&mut rng, n, cfg.vocab);
        for dtype in formats_for(&cfg) {
            let src = synthetic_model(&cfg, seed, dtype);
            let want = token_by_token(&CpuModel::new(&src).unwrap().with_threads(1), &toks, n);
            let model = CpuModel::new(&src).unwrap().with_threads(3);
            let all = model.forward_all(&mut model.new_stream(n), &toks).unwrap();
            for (pos, (got, want)) in all.iter().zip(&want).enumerate() {
                assert_eq!(common::bits(got), common::bits(want), "{arch:?} {dtype:?}, position {pos}");
            }
        }
    }
}

/// A small GQA model (hidden 64, 2 layers, 4 heads over 2 KV heads of 16) with a `window`-token window.
fn long_context_config(window: usize) -> ModelConfig {
    ModelConfig { max_position: window, ..small_config(Arch::Llama) }
}

#[test]
fn a_4096_token_prompt_matches_the_token_by_token_run_at_its_last_position() {
    let mut rng = Rng::fresh("a_4096_token_prompt_matches_the_token_by_token_run_at_its_last_position");
    let n = 4096;
    let cfg = long_context_config(n);
    let src = synthetic_model(&cfg, rng.next_u64(), DType::F16);
    let model = CpuModel::new(&src).unwrap();
    let toks = tokens(&mut rng, n, cfg.vocab);
    let start = std::time::Instant::now();
    let at_once = model.forward(&mut model.new_stream(n), &toks).unwrap();
    println!("{n} tokens in one step: {:.2} s on {} threads", start.elapsed().as_secs_f64(), model.threads());
    let start = std::time::Instant::now();
    let mut stream = model.new_stream(n);
    let mut last = Vec::new();
    for &t in &toks {
        last = model.forward(&mut stream, &[t]).unwrap();
    }
    println!("{n} tokens one a step: {:.2} s", start.elapsed().as_secs_f64());
    assert!(at_once.iter().all(|v| v.is_finite()));
    assert_eq!(common::bits(&at_once), common::bits(&last), "relative L2 {}", rel_l2(&at_once, &last));
}

/// Run with `cargo test --release --test cpu -- --ignored`: the long-prompt budget, printed.
#[test]
#[ignore = "a 32k-token prompt: about half a minute on two cores"]
fn a_32768_token_prompt_runs_in_well_under_a_minute() {
    let mut rng = Rng::fresh("a_32768_token_prompt_runs_in_well_under_a_minute");
    let n = 32768;
    let cfg = long_context_config(n);
    let src = synthetic_model(&cfg, rng.next_u64(), DType::Bf16);
    let model = CpuModel::new(&src).unwrap();
    let toks = tokens(&mut rng, n, cfg.vocab);
    let start = std::time::Instant::now();
    let at_once = model.forward(&mut model.new_stream(n), &toks).unwrap();
    let seconds = start.elapsed().as_secs_f64();
    println!("{n} tokens in one step: {seconds:.2} s on {} threads", model.threads());
    // The same prompt less its last token, then that token: the same logits.
    let mut stream = model.new_stream(n);
    model.forward(&mut stream, &toks[..n - 1]).unwrap();
    assert_eq!(common::bits(&at_once), common::bits(&model.forward(&mut stream, &toks[n - 1..]).unwrap()));
    assert!(seconds < 60.0, "{seconds:.1} s");
}

#[test]
fn out_of_range_token_appends_nothing() {
    let cfg = small_config(Arch::Llama);
    let src = synthetic_model(&cfg, 5, DType::F32);
    let model = CpuModel::new(&src).unwrap();
    let mut stream = model.new_stream(16);
    let first = model.forward(&mut stream, &[3, 4]).unwrap();
    let e = model.forward(&mut stream, &[5, cfg.vocab as u32, 6]).unwrap_err();
    assert_eq!(e.status, Status::OutOfRange);
    assert!(e.message.contains(&cfg.vocab.to_string()), "{}", e.message);
    let e = model.forward_all(&mut stream, &[u32::MAX]).unwrap_err();
    assert_eq!(e.status, Status::OutOfRange);
    assert_eq!(stream.len(), 2);
    // The stream carries on exactly as if the bad calls never happened.
    let mut fresh = model.new_stream(16);
    model.forward(&mut fresh, &[3, 4]).unwrap();
    assert_eq!(model.forward(&mut stream, &[5]).unwrap(), model.forward(&mut fresh, &[5]).unwrap());
    assert_ne!(first, model.forward(&mut fresh, &[5]).unwrap());
    assert_eq!(model.forward(&mut stream, &[]).unwrap_err().status, Status::InvalidArgument);
}

#[test]
fn tokens_beyond_the_window_are_refused_with_no_room() {
    let cfg = small_config(Arch::Qwen3);
    let src = synthetic_model(&cfg, 6, DType::F32);
    let model = CpuModel::new(&src).unwrap();
    let mut stream = model.new_stream(4);
    model.forward(&mut stream, &[1, 2, 3]).unwrap();
    let e = model.forward(&mut stream, &[4, 5]).unwrap_err();
    assert_eq!(e.status, Status::NoRoom);
    assert!(e.message.contains("window of 4"), "{}", e.message);
    assert_eq!(stream.len(), 3);
    model.forward(&mut stream, &[4]).unwrap();
    assert_eq!(model.forward_all(&mut stream, &[1]).unwrap_err().status, Status::NoRoom);
    assert_eq!(stream.len(), 4);
}
