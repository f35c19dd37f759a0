//! The CUDA backend against the CPU reference on small random models (Llama, Qwen2, Qwen3; BF16, F16,
//! F32, every GGUF block format, the Q4_K_M mix): logits at every position, greedy and sampled decoding,
//! the byte predictions the fit rule relies on, the refusals, and rows in mapped host memory; and its
//! batched step over the paged KV pool: every stream's logits in a batch against the same stream stepped
//! alone (bit for bit for single tokens), truncation, and a pool that runs out. Skips where no CUDA
//! device is present.

mod common;
use common::card::{OnBoth, POOL_PAGES, random_tokens};
use common::{decode_configs as configs, rows_on_card};
use common::{rel_l2, top_two_gap};

use common::{Rng, gpu_present};
use hostembed::backend::{PagePool, StepItem};
use hostembed::checkpoint::write::{MemSource, Recipe};
use hostembed::cpu::CpuModel;
use hostembed::cuda::PinnedBuffer;
use hostembed::gpu::{GpuModel, RowsOnDevice, reserve_pages, truncate_stream};
use hostembed::gpu::{GpuStream, PAGE_TOKENS};
use hostembed::kv::KvTypes;
use hostembed::model::{ModelConfig, TensorSource, names};
use hostembed::sampler::{self, Sampling};
use hostembed::tensor::DType;
use hostembed::tuning::Tuning;
use hostembed::{Error, Status};

fn model(cfg: ModelConfig, dtype: DType, seed: u64) -> MemSource {
    MemSource::synthetic(&cfg, seed, dtype)
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
        let max_batch = 16;
        let mut b = OnBoth::new(&src, max_batch, None, 64);
        assert_eq!(
            b.gpu.allocated_bytes(),
            (
                GpuModel::weight_bytes(&src),
                GpuModel::scratch_bytes(
                    &src,
                    max_batch,
                    KvTypes::GPU_DEFAULT,
                    POOL_PAGES * PAGE_TOKENS,
                    &Tuning::from_env()
                )
            ),
            "{name}: allocations differ from the predicted bytes"
        );

        let tokens = random_tokens(&mut rng, cfg.vocab, 40); // chunks of 16, 16 and 8
        let (got, worst) = b.all_logits(&tokens);
        assert_eq!(b.gs.len(), tokens.len());
        println!(
            "{name} {}: worst relative L2 of the logits over {} positions {worst:.2e}",
            dtype.name(),
            tokens.len()
        );
        assert!(worst < 2e-2, "{name} {}: logits differ from the CPU's by {worst:.3e}", dtype.name());
        assert_eq!(b.gpu.last_logits().unwrap(), *got.last().unwrap(), "{name}: last_logits after all_logits");
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
        let mut b = OnBoth::new(&src, 8, None, 128);
        let prompt = random_tokens(&mut rng, cfg.vocab, 21); // three chunks of 8, 8 and 5
        let (mut input, mut near_ties) = (prompt, 0);
        for step in 0..64 {
            let got = b.gpu.step(&mut b.pool, &mut b.gs, &input, &Sampling::GREEDY, 0).unwrap();
            let logits = b.cpu.forward(&mut b.cs, &input).unwrap();
            let want = sampler::argmax(&logits);
            // The GPU's logits at this step: the error they carry bounds the gaps it may misjudge.
            let gl = b.gpu.last_logits().unwrap();
            let err = gl.iter().zip(&logits).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            if got != want {
                let gap = top_two_gap(&logits);
                assert!(
                    gap <= 2.0 * err,
                    "{name} step {step}: GPU chose {got}, CPU {want}, top-two gap {gap} > 2 x {err}"
                );
                near_ties += 1;
            }
            assert_eq!(b.gs.len(), b.cs.len());
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
    let mut gpu = GpuModel::load(&src, rows, 8, POOL_PAGES, &Tuning::from_env()).unwrap();
    let stream_index = 3;
    let s = Sampling { temperature: 0.9, top_k: 40, top_p: 0.95, seed: rng.next_u64(), ..Sampling::GREEDY };
    let prompt = random_tokens(&mut rng, cfg.vocab, 5);
    let run = |gpu: &mut GpuModel, check: bool| -> Vec<u32> {
        let mut pool = gpu.page_pool().unwrap();
        let mut gs = gpu.new_stream(64).unwrap();
        let (mut input, mut out) = (prompt.clone(), Vec::new());
        for step in 0..40 {
            let got = gpu.step(&mut pool, &mut gs, &input, &s, stream_index).unwrap();
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
            let mut gpu = GpuModel::load(&src, rows, 4, POOL_PAGES, &Tuning::from_env()).unwrap();
            let mut pool = gpu.page_pool().unwrap();
            let mut gs = gpu.new_stream(16).unwrap();
            let all = gpu.all_logits(&mut pool, &mut gs, &tokens).unwrap();
            let next = gpu.step(&mut pool, &mut gs, &[tokens[0]], &Sampling::GREEDY, 0).unwrap();
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
    let mut gpu = GpuModel::load(&src, rows, 4, POOL_PAGES, &Tuning::from_env()).unwrap();
    let window = 8;
    let mut pool = gpu.page_pool().unwrap();
    let mut gs = gpu.new_stream(window).unwrap();
    let g = Sampling::GREEDY;

    assert!(gpu.last_logits().is_err(), "logits before any step");
    let e = gpu.step(&mut pool, &mut gs, &[], &g, 0).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    let e = gpu.step(&mut pool, &mut gs, &[3, cfg.vocab as u32, 4], &g, 0).unwrap_err();
    assert_eq!(e.status, Status::OutOfRange, "{e}");
    assert!(e.message.contains(&cfg.vocab.to_string()), "{e}");
    assert_eq!(gs.len(), 0, "a refused step appended tokens");
    assert_eq!(pool.free_pages(), POOL_PAGES, "a refused step kept pages");
    let e = gpu.step(&mut pool, &mut gs, &random_tokens(&mut rng, cfg.vocab, window + 1), &g, 0).unwrap_err();
    assert_eq!(e.status, Status::NoRoom, "{e}");
    assert_eq!(gs.len(), 0);

    // After the refusals the stream decodes as if they never happened.
    let tokens = random_tokens(&mut rng, cfg.vocab, window);
    gpu.step(&mut pool, &mut gs, &tokens[..window - 1], &g, 0).unwrap();
    let e = gpu.step(&mut pool, &mut gs, &tokens[window - 1..].repeat(2), &g, 0).unwrap_err();
    assert_eq!(e.status, Status::NoRoom, "{e}");
    gpu.step(&mut pool, &mut gs, &tokens[window - 1..], &g, 0).unwrap();
    let mut cs = cpu.new_stream(window);
    let want = cpu.forward(&mut cs, &tokens).unwrap();
    let err = rel_l2(&gpu.last_logits().unwrap(), &want);
    assert!(err < 2e-2, "logits after refused calls differ by {err:.3e}");
    let e = gpu.step(&mut pool, &mut gs, &[1], &g, 0).unwrap_err();
    assert_eq!(e.status, Status::NoRoom, "{e}");

    // A stream of another model, rows of the wrong shape, a window of nothing.
    let (_rows2, rows2) = rows_on_card(&src);
    let other = GpuModel::load(&src, rows2, 4, POOL_PAGES, &Tuning::from_env()).unwrap();
    let mut foreign = other.new_stream(window).unwrap();
    let e = gpu.step(&mut pool, &mut foreign, &[1], &g, 0).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    let e = GpuModel::load(&src, RowsOnDevice { vocab: cfg.vocab - 1, ..rows }, 4, POOL_PAGES, &Tuning::from_env())
        .err()
        .unwrap();
    assert_eq!(e.status, Status::BadModel, "{e}");
    let e = GpuModel::load(&src, rows, 0, POOL_PAGES, &Tuning::from_env()).err().unwrap();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    assert_eq!(gpu.new_stream(0).err().unwrap().status, Status::InvalidArgument);

    // A missing tensor is named.
    let mut broken = model(cfg.clone(), DType::Bf16, 1);
    broken.tensors.remove(&names::layer(1, names::UP));
    let e = GpuModel::load(&broken, rows, 4, POOL_PAGES, &Tuning::from_env()).err().unwrap();
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
                let gpu = GpuModel::load(&src, rows, max_batch, POOL_PAGES, &Tuning::from_env()).unwrap();
                assert_eq!(
                    gpu.allocated_bytes(),
                    (
                        GpuModel::weight_bytes(&src),
                        GpuModel::scratch_bytes(
                            &src,
                            max_batch,
                            KvTypes::GPU_DEFAULT,
                            POOL_PAGES * PAGE_TOKENS,
                            &Tuning::from_env()
                        )
                    ),
                    "{name} {} max_batch {max_batch}",
                    dtype.name()
                );
                let kv = KvTypes::GPU_DEFAULT;
                assert_eq!(gpu.kv_types(), kv, "{name}: load keeps BF16 K and V");
                assert_eq!(
                    gpu.allocated_pool_bytes(),
                    GpuModel::pool_bytes(&cfg, kv, POOL_PAGES),
                    "{name}: pool bytes"
                );
                // BF16: layers x K and V x kv_heads x head_dim x 2 bytes a position.
                let per_token = (cfg.layers * 2 * cfg.kv_heads * cfg.head_dim * 2) as u64;
                assert_eq!(GpuModel::pool_bytes(&cfg, kv, 3), per_token * 3 * PAGE_TOKENS as u64);
                assert_eq!(GpuModel::stream_bytes(&cfg, kv, 100), per_token * 100);
                let stream = gpu.new_stream(100).unwrap();
                // 100 positions take 7 pages of 16: a page table of 7 ids.
                assert_eq!(stream.allocated_bytes(), 7 * 4, "{name}: a 100-token page table");
                drop(stream);
            }
        }
    }
}

/// What one item of a batch left: its sampled token (or refusal) and its logits.
type ItemResult = (hostembed::Result<u32>, Option<Vec<f32>>);

/// Steps `items` (stream slot, tokens) in one batch, greedy, after taking each item's pages from `pool`
/// as the engine does (an item that cannot get them is refused here, as the engine refuses it).
fn step_items(
    gpu: &mut GpuModel,
    pool: &mut PagePool,
    streams: &mut [GpuStream],
    items: &[(usize, Vec<u32>)],
) -> Vec<ItemResult> {
    let mut out: Vec<ItemResult> = Vec::new();
    let mut ran = Vec::new();
    for (slot, tokens) in items {
        match reserve_pages(pool, &mut streams[*slot], tokens.len()) {
            Ok(()) => {
                ran.push(out.len());
                out.push((Err(Error::new(Status::Panic, "not stepped")), None));
            }
            Err(e) => out.push((Err(e), None)),
        }
    }
    let mut by_slot: Vec<Option<&mut GpuStream>> = streams.iter_mut().map(Some).collect();
    let mut batch: Vec<StepItem<'_, _>> = ran
        .iter()
        .map(|&k| {
            let (slot, tokens) = &items[k];
            let stream = by_slot[*slot].take().expect("a stream named once");
            StepItem::new(stream, *slot as u32, tokens, Sampling::GREEDY)
        })
        .collect();
    gpu.step_batch(&mut batch).expect("the device failed");
    let nexts: Vec<_> = batch.into_iter().map(|it| it.next).collect();
    for (j, (&k, next)) in ran.iter().zip(nexts).enumerate() {
        let logits = next.is_ok().then(|| gpu.logits(j).expect("logits of a stepped item"));
        out[k] = (next, logits);
    }
    out
}

/// The first element where two logit vectors differ in their bits, for the failure message.
fn first_difference(a: &[f32], b: &[f32]) -> Option<(usize, f32, f32)> {
    a.iter().zip(b).enumerate().find(|(_, (x, y))| x.to_bits() != y.to_bits()).map(|(i, (x, y))| (i, *x, *y))
}

#[test]
fn batched_streams_match_each_stream_stepped_alone_bit_for_bit() {
    if !gpu_present("batched_streams_match_each_stream_stepped_alone_bit_for_bit") {
        return;
    }
    let mut rng = Rng::fresh("batched_streams_match_each_stream_stepped_alone_bit_for_bit");
    for (name, cfg) in configs() {
        let src = model(cfg.clone(), DType::Bf16, rng.next_u64());
        let cpu = CpuModel::new(&src).unwrap();
        let (_rows_buf, rows) = rows_on_card(&src);
        // max_batch 48: chunks of 16 or more take tensor cores, and busy rounds need several passes.
        let mut gpu = GpuModel::load(&src, rows, 48, 256, &Tuning::from_env()).unwrap();
        let mut pool = gpu.page_pool().unwrap();
        let (count, window) = (6, 160);
        let mut solo: Vec<GpuStream> = (0..count).map(|_| gpu.new_stream(window).unwrap()).collect();
        let mut batched: Vec<GpuStream> = (0..count).map(|_| gpu.new_stream(window).unwrap()).collect();
        let mut cpu_streams: Vec<_> = (0..count).map(|_| cpu.new_stream(window)).collect();
        let (mut singles, mut chunks, mut truncations) = (0, 0, 0);
        for round in 0..30 {
            // Now and then a stream is cut back (or emptied) in both copies.
            if rng.below(4) == 0 {
                let slot = rng.below(count as u64) as usize;
                let len = if rng.below(3) == 0 { 0 } else { rng.below(solo[slot].len() as u64 + 1) as usize };
                truncate_stream(&mut pool, &mut solo[slot], len).unwrap();
                truncate_stream(&mut pool, &mut batched[slot], len).unwrap();
                cpu_streams[slot] = cpu.new_stream(window);
                truncations += 1;
            }
            let mut items = Vec::new();
            for slot in 0..count {
                if rng.below(10) < 3 {
                    continue;
                }
                let chunk = solo[slot].is_empty() || rng.below(4) == 0;
                let n = if chunk { 2 + rng.below(39) as usize } else { 1 };
                if solo[slot].len() + n > window {
                    truncate_stream(&mut pool, &mut solo[slot], 0).unwrap();
                    truncate_stream(&mut pool, &mut batched[slot], 0).unwrap();
                    cpu_streams[slot] = cpu.new_stream(window);
                }
                items.push((slot, random_tokens(&mut rng, cfg.vocab, n)));
            }
            if items.is_empty() {
                continue;
            }
            let got = step_items(&mut gpu, &mut pool, &mut batched, &items);
            for (k, (slot, tokens)) in items.iter().enumerate() {
                let want = step_items(&mut gpu, &mut pool, &mut solo, std::slice::from_ref(&items[k])).remove(0);
                let what = format!(
                    "{name} round {round}: stream {slot}, {} tokens after {}, item {k} of {}",
                    tokens.len(),
                    solo[*slot].len() - tokens.len(),
                    items.len()
                );
                let (want_next, want_logits) = (want.0.expect(&what), want.1.expect(&what));
                let (got_next, got_logits) = (got[k].0.as_ref().expect(&what), got[k].1.as_ref().expect(&what));
                if let Some((i, a, b)) = first_difference(got_logits, &want_logits) {
                    panic!("{what}: logit {i} is {a} in the batch, {b} alone (not bit-identical)");
                }
                assert_eq!(*got_next, want_next, "{what}: sampled token");
                assert_eq!(batched[*slot].len(), solo[*slot].len(), "{what}: stream length");
                // And the stream still decodes the model: the CPU reference from the same history.
                if cpu_streams[*slot].len() + tokens.len() == solo[*slot].len() {
                    let cpu_logits = cpu.forward(&mut cpu_streams[*slot], tokens).unwrap();
                    let err = rel_l2(&want_logits, &cpu_logits);
                    assert!(err < 2e-2, "{what}: logits differ from the CPU's by {err:.3e}");
                }
                if tokens.len() == 1 { singles += 1 } else { chunks += 1 }
            }
        }
        println!(
            "{name}: {singles} single tokens and {chunks} chunks in batches, {truncations} truncations: identical"
        );
        for s in solo.iter_mut().chain(batched.iter_mut()) {
            truncate_stream(&mut pool, s, 0).unwrap();
        }
        assert_eq!(pool.free_pages(), 256, "{name}: pages not given back after every stream emptied");
    }
}

#[test]
fn truncating_and_stepping_the_same_tokens_again_gives_the_same_bits() {
    if !gpu_present("truncating_and_stepping_the_same_tokens_again_gives_the_same_bits") {
        return;
    }
    let mut rng = Rng::fresh("truncating_and_stepping_the_same_tokens_again_gives_the_same_bits");
    for (name, cfg) in configs() {
        let src = model(cfg.clone(), DType::Bf16, rng.next_u64());
        let (_rows_buf, rows) = rows_on_card(&src);
        let mut gpu = GpuModel::load(&src, rows, 32, POOL_PAGES, &Tuning::from_env()).unwrap();
        let mut pool = gpu.page_pool().unwrap();
        let mut streams = vec![gpu.new_stream(256).unwrap(), gpu.new_stream(256).unwrap()];
        // A 37-token prompt (tensor cores), then 30 single tokens: the logits after each item.
        let prompt = random_tokens(&mut rng, cfg.vocab, 37);
        let decoded = random_tokens(&mut rng, cfg.vocab, 30);
        let mut items = vec![prompt.clone()];
        items.extend(decoded.iter().map(|&t| vec![t]));
        let run = |gpu: &mut GpuModel, pool: &mut PagePool, streams: &mut [GpuStream], from: usize| {
            items[from..]
                .iter()
                .map(|tokens| step_items(gpu, pool, streams, &[(0, tokens.clone())]).remove(0).1.unwrap())
                .collect::<Vec<_>>()
        };
        let first = run(&mut gpu, &mut pool, &mut streams, 0);
        for (cut_item, what) in [(20, "into the decoded tokens"), (0, "to nothing")] {
            let len = if cut_item == 0 { 0 } else { 37 + cut_item - 1 };
            truncate_stream(&mut pool, &mut streams[0], len).unwrap();
            assert_eq!(streams[0].len(), len);
            // Another stream takes pages meanwhile, so the stepped-again positions land on other pages.
            step_items(&mut gpu, &mut pool, &mut streams, &[(1, random_tokens(&mut rng, cfg.vocab, 20))]);
            let again = run(&mut gpu, &mut pool, &mut streams, cut_item);
            for (k, (a, b)) in again.iter().zip(&first[cut_item..]).enumerate() {
                if let Some((i, x, y)) = first_difference(a, b) {
                    panic!("{name}: truncated {what}, item {}: logit {i} is {x}, was {y}", cut_item + k);
                }
            }
        }
        truncate_stream(&mut pool, &mut streams[0], 0).unwrap();
        truncate_stream(&mut pool, &mut streams[1], 0).unwrap();
        assert_eq!(pool.free_pages(), POOL_PAGES, "{name}: pages not given back");
    }
}

#[test]
fn an_item_without_pages_fails_alone_and_the_others_proceed() {
    if !gpu_present("an_item_without_pages_fails_alone_and_the_others_proceed") {
        return;
    }
    let mut rng = Rng::fresh("an_item_without_pages_fails_alone_and_the_others_proceed");
    let (name, cfg) = configs().remove(0);
    let src = model(cfg.clone(), DType::Bf16, rng.next_u64());
    let (_rows_buf, rows) = rows_on_card(&src);
    // Four pages of 16 positions: 64 in all.
    let mut gpu = GpuModel::load(&src, rows, 64, 4, &Tuning::from_env()).unwrap();
    let mut pool = gpu.page_pool().unwrap();
    let mut streams: Vec<GpuStream> = (0..3).map(|_| gpu.new_stream(64).unwrap()).collect();
    let a = random_tokens(&mut rng, cfg.vocab, 20); // 2 pages
    let b = random_tokens(&mut rng, cfg.vocab, 30); // 2 pages
    let c = random_tokens(&mut rng, cfg.vocab, 5); // 1 page: none left
    let got = step_items(&mut gpu, &mut pool, &mut streams, &[(0, a.clone()), (1, b.clone()), (2, c.clone())]);
    let e = got[2].0.as_ref().unwrap_err();
    assert_eq!(e.status, Status::NoRoom, "{name}: the item past the pool: {e}");
    assert_eq!(streams[2].len(), 0, "{name}: a refused item appended");
    assert!(got[0].0.is_ok() && got[1].0.is_ok(), "{name}: the items with pages failed");
    assert_eq!((streams[0].len(), streams[1].len()), (20, 30));
    assert_eq!(pool.free_pages(), 0);

    // The same two items alone, on fresh pages: the same logits.
    truncate_stream(&mut pool, &mut streams[0], 0).unwrap();
    truncate_stream(&mut pool, &mut streams[1], 0).unwrap();
    assert_eq!(pool.free_pages(), 4, "{name}: pages not given back");
    for (slot, tokens) in [(1, &b), (0, &a)] {
        let alone = step_items(&mut gpu, &mut pool, &mut streams, &[(slot, tokens.clone())]).remove(0);
        let (x, y) = (alone.1.unwrap(), got[slot].1.clone().unwrap());
        if let Some((i, p, q)) = first_difference(&x, &y) {
            panic!("{name}: stream {slot} alone: logit {i} is {p}, in the batch {q}");
        }
    }

    // A step on a stream that holds too few pages is refused by the model itself, before anything runs.
    let mut fresh = gpu.new_stream(64).unwrap();
    let mut one = [StepItem::new(&mut fresh, 7, &c, Sampling::GREEDY)];
    gpu.step_batch(&mut one).unwrap();
    let e = one[0].next.as_ref().unwrap_err();
    assert_eq!(e.status, Status::NoRoom, "{name}: a stream without pages: {e}");
    assert_eq!(fresh.len(), 0);
    assert!(gpu.logits(0).is_err(), "{name}: logits of a refused item");
}

#[test]
fn the_batch_tensor_core_option_stays_close_to_stepping_alone() {
    if !gpu_present("the_batch_tensor_core_option_stays_close_to_stepping_alone") {
        return;
    }
    let mut rng = Rng::fresh("the_batch_tensor_core_option_stays_close_to_stepping_alone");
    for (name, cfg) in configs() {
        let src = model(cfg.clone(), DType::Bf16, rng.next_u64());
        let (_rows_buf, rows) = rows_on_card(&src);
        let mut gpu = GpuModel::load(&src, rows, 64, 512, &Tuning::from_env()).unwrap();
        let mut pool = gpu.page_pool().unwrap();
        let count = 24;
        let mut streams: Vec<GpuStream> = (0..count).map(|_| gpu.new_stream(128).unwrap()).collect();
        let prompts: Vec<(usize, Vec<u32>)> =
            (0..count).map(|slot| (slot, random_tokens(&mut rng, cfg.vocab, 3 + slot))).collect();
        for item in &prompts {
            step_items(&mut gpu, &mut pool, &mut streams, std::slice::from_ref(item));
        }
        let next: Vec<(usize, Vec<u32>)> =
            (0..count).map(|slot| (slot, random_tokens(&mut rng, cfg.vocab, 1))).collect();
        let mut alone = Vec::new();
        for item in &next {
            alone.push(step_items(&mut gpu, &mut pool, &mut streams, std::slice::from_ref(item)).remove(0).1.unwrap());
            truncate_stream(&mut pool, &mut streams[item.0], 3 + item.0).unwrap();
        }
        gpu.set_batch_tensor_cores(true);
        for pass in 0..3 {
            let got = step_items(&mut gpu, &mut pool, &mut streams, &next);
            for (slot, (r, want)) in got.iter().zip(&alone).enumerate() {
                let err = rel_l2(r.1.as_ref().unwrap(), want);
                assert!(err < 2e-2, "{name} pass {pass}: stream {slot} on tensor cores differs by {err:.3e}");
                truncate_stream(&mut pool, &mut streams[slot], 3 + slot).unwrap();
            }
        }
        gpu.set_batch_tensor_cores(false);
        let got = step_items(&mut gpu, &mut pool, &mut streams, &next);
        for (slot, (r, want)) in got.iter().zip(&alone).enumerate() {
            if let Some((i, p, q)) = first_difference(r.1.as_ref().unwrap(), want) {
                panic!("{name}: stream {slot} among {count}, option off: logit {i} is {p}, alone {q}");
            }
        }
    }
}
