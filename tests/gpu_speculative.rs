//! Speculative decoding on CUDA (prints SKIP without a device): prompt lookup's verification runs the
//! proposals as a short piece on the matrix-vector kernels, each head row drawn by the device sampler,
//! so greedy output with lookup is the output without it, token for token (tiny models in the cache
//! types, and SmolLM2-135M Q4_1 when present); random batches mixing speculative and plain items give
//! each stream the tokens of stepping it alone, with the pool's counts exact after every rejection; and
//! the CPU backend agrees on the F32 route.

mod common;
use common::shared::{self, no_cache};
use common::spec::{lookup, shaped};
use common::{Held, Rng, Scratch, cpu_options, gpu_present, init, model_file, reset, serial};

use hostembed::Status;
use hostembed::abi::{engine_batch_item, engine_draft, engine_speculation};
use hostembed::engine::{engine_kv_type, engine_options};
use hostembed::ffi;
use hostembed::model::{Arch, ModelConfig};
use hostembed::status::last_error;
use hostembed::tensor::DType;

const PAGE: usize = hostembed::gpu::PAGE_TOKENS;

/// The CPU tests' tiny models on a shape the card's kernels take: hidden 128, vocabulary 512.
fn config(arch: Arch) -> ModelConfig {
    shaped(arch, ModelConfig::llama(128, 2, 4, 2, 256, 512))
}

/// The prefix cache off: a cache hit computes a prompt's tail alone, maybe on other kernels than the
/// whole prompt, and the engines compared here evict different pages, so a near tie could flip a token.
fn cuda(window: u32, streams: u32) -> engine_options {
    no_cache(common::cuda_options(window, streams, 64))
}

fn set_speculation(e: &Held, stream: u32, s: &engine_speculation) {
    // SAFETY: a live engine and a live struct.
    let st = unsafe { ffi::engine_set_speculation(e.0, stream, s) };
    assert_eq!(st, Status::Ok, "{}", last_error());
}

/// One step of each (stream, tokens, out room) item: each item's (status, tokens out).
fn batch(e: &Held, items: &[(u32, &[i32], usize)]) -> Vec<(Status, Vec<i32>)> {
    let mut outs: Vec<Vec<i32>> = items.iter().map(|i| vec![-9; i.2]).collect();
    let mut c: Vec<engine_batch_item> = items
        .iter()
        .zip(outs.iter_mut())
        .map(|(&(stream, tokens, cap), out)| engine_batch_item {
            stream,
            tokens: tokens.as_ptr(),
            n: tokens.len(),
            next: -7,
            status: Status::Panic,
            out: if cap == 0 { std::ptr::null_mut() } else { out.as_mut_ptr() },
            out_cap: cap,
            n_out: 0,
        })
        .collect();
    // SAFETY: a live engine and items whose pointers live across the call.
    let st = unsafe { ffi::engine_step_batch(e.0, c.as_mut_ptr(), c.len()) };
    assert_eq!(st, Status::Ok, "{}", last_error());
    c.iter()
        .zip(&outs)
        .map(|(i, out)| {
            let got = if i.out.is_null() { vec![i.next] } else { out[..i.n_out].to_vec() };
            if i.status == Status::Ok {
                assert_eq!(got.last(), Some(&i.next));
            }
            (i.status, got)
        })
        .collect()
}

fn generate(e: &Held, prompt: &[i32], n: usize, cap: usize) -> Vec<i32> {
    let (mut got, mut input) = (Vec::new(), prompt.to_vec());
    while got.len() < n {
        let (st, out) = batch(e, &[(0, &input, cap)]).remove(0);
        assert_eq!(st, Status::Ok, "{}", last_error());
        input = vec![*out.last().unwrap()];
        got.extend(out);
    }
    got.truncate(n);
    got
}

fn repeating_prompt(rng: &mut Rng, vocab: usize) -> Vec<i32> {
    let len = 6 + rng.below(10) as usize;
    let line = rng.ids(vocab, len);
    let mut p = Vec::new();
    for _ in 0..3 {
        let mut l = line.clone();
        let at = rng.below(len as u64) as usize;
        l[at] = rng.below(vocab as u64) as i32;
        p.extend(l);
    }
    p
}

/// 20 prompts x 128 tokens per model and cache type: lookup's tokens are plain decoding's.
#[test]
fn gpu_greedy_lookup_is_token_for_token() {
    if !gpu_present("gpu_greedy_lookup_is_token_for_token") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("gpu_greedy_lookup_is_token_for_token");
    let dir = Scratch::new("gpu-spec-greedy");
    for (arch, dtype, kv) in [
        (Arch::Llama, DType::Bf16, engine_kv_type::ENGINE_KV_DEFAULT),
        (Arch::Qwen2, DType::Q8_0, engine_kv_type::ENGINE_KV_Q8_0),
        (Arch::Llama, DType::F32, engine_kv_type::ENGINE_KV_F32),
    ] {
        let cfg = config(arch);
        let path = dir.gguf(&format!("{arch:?}-{}", dtype.name()), &cfg, rng.next_u64(), dtype);
        let opts = engine_options { kv_type_k: kv, kv_type_v: kv, ..cuda(512, 1) };
        let spec = init(&path, &opts);
        let plain = init(&path, &opts);
        let cpu = (dtype == DType::F32).then(|| init(&path, &cpu_options(512, 1)));
        for p in 0..20 {
            let max = 1 + rng.below(12) as u32;
            set_speculation(&spec, 0, &lookup(max));
            let prompt = repeating_prompt(&mut rng, cfg.vocab);
            let want = generate(&plain, &prompt, 128, 0);
            let got = generate(&spec, &prompt, 128, max as usize + 1);
            assert_eq!(got, want, "{arch:?} {} prompt {p}, max_tokens {max}", dtype.name());
            if let Some(cpu) = &cpu {
                reset(cpu, 0);
                let on_cpu = generate(cpu, &prompt, 32, 0);
                let agree = on_cpu.iter().zip(&got).take_while(|(a, b)| a == b).count();
                println!("{arch:?} F32 prompt {p}: CUDA and CPU agree on the first {agree} of 32 tokens");
            }
            reset(&spec, 0);
            reset(&plain, 0);
        }
    }
}

#[test]
fn gpu_smollm2_lookup_is_token_for_token() {
    if !gpu_present("gpu_smollm2_lookup_is_token_for_token") {
        return;
    }
    let Some(path) = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "scripts/fetch-smollm.sh fetches it") else {
        return;
    };
    let _g = serial();
    let spec = init(&path, &cuda(1024, 1));
    let plain = init(&path, &cuda(1024, 1));
    set_speculation(&spec, 0, &lookup(8));
    let mut rng = Rng::fresh("gpu_smollm2_lookup_is_token_for_token");
    for p in 0..20 {
        let prompt = repeating_prompt(&mut rng, 49152);
        assert_eq!(generate(&spec, &prompt, 128, 9), generate(&plain, &prompt, 128, 0), "prompt {p}");
        reset(&spec, 0);
        reset(&plain, 0);
    }
}

#[test]
fn gpu_random_batches_mixing_speculative_and_plain_items_match_stepping_alone() {
    if !gpu_present("gpu_random_batches_mixing_speculative_and_plain_items_match_stepping_alone") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("gpu_random_batches_mixing_speculative_and_plain_items_match_stepping_alone");
    let dir = Scratch::new("gpu-spec-batches");
    let cfg = config(Arch::Llama);
    let path = dir.gguf("m", &cfg, rng.next_u64(), DType::Bf16);
    const STREAMS: usize = 8;
    let e = init(&path, &cuda(1024, STREAMS as u32));
    // Each stream stepped alone with the same calls, one token at a time: on the card a prompt of more
    // than 64 rows takes the tensor-core products, so replaying a stream's history as one prompt would
    // round differently from the decode steps that built it.
    let reference = init(&path, &cuda(1024, STREAMS as u32));
    let total = shared::kv_usage(&e).tokens_total;
    let mut history: Vec<Vec<i32>> = vec![Vec::new(); STREAMS];
    let mut input: Vec<Vec<i32>> = (0..STREAMS).map(|_| repeating_prompt(&mut rng, cfg.vocab)).collect();
    let caps: Vec<usize> = (0..STREAMS)
        .map(|s| {
            let max = 1 + rng.below(10) as u32;
            set_speculation(&e, s as u32, &lookup(max));
            max as usize + 1
        })
        .collect();
    for round in 0..40 {
        let chosen: Vec<usize> = (0..STREAMS).filter(|_| rng.below(3) > 0).collect();
        let items: Vec<(u32, &[i32], usize)> =
            chosen.iter().map(|&s| (s as u32, &input[s][..], if rng.below(2) == 0 { 0 } else { caps[s] })).collect();
        let res = batch(&e, &items);
        for (&s, (st, out)) in chosen.iter().zip(res) {
            assert_eq!(st, Status::Ok, "round {round} stream {s}: {}", last_error());
            history[s].extend_from_slice(&input[s]);
            let mut want = vec![common::step(&reference, s as u32, &input[s])];
            while want.len() < out.len() {
                want.push(common::step(&reference, s as u32, &want[want.len() - 1..]));
            }
            assert_eq!(out, want, "round {round} stream {s}");
            history[s].extend_from_slice(&out[..out.len() - 1]);
            input[s] = vec![*out.last().unwrap()];
        }
        let lens: Vec<usize> = history.iter().map(Vec::len).collect();
        shared::check_pool(&e, &lens, total, PAGE, &format!("round {round}"));
    }
}

/// The drafter model on CUDA: a second GPU model beside the target (itself, or a Q8_0 copy), greedy,
/// 20 prompts x 128 tokens alone and then four streams drafting in one batch: the plain tokens.
#[test]
fn gpu_greedy_drafter_is_token_for_token() {
    if !gpu_present("gpu_greedy_drafter_is_token_for_token") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("gpu_greedy_drafter_is_token_for_token");
    let dir = Scratch::new("gpu-spec-drafter");
    let cfg = config(Arch::Llama);
    let seed = rng.next_u64();
    let target = dir.gguf("target", &cfg, seed, DType::Bf16);
    let copy = dir.gguf("copy", &cfg, seed, DType::Q8_0);
    let plain = init(&target, &cuda(512, 4));
    for drafter in [&target, &copy] {
        let d = common::c_path(drafter);
        let spec = init(&target, &engine_options { draft_model: d.as_ptr(), ..cuda(512, 4) });
        let draft = |max| engine_speculation { draft: engine_draft::Model, ..lookup(max) };
        let prompts: Vec<Vec<i32>> = (0..20).map(|_| repeating_prompt(&mut rng, cfg.vocab)).collect();
        for (p, prompt) in prompts.iter().enumerate() {
            let max = 1 + rng.below(8) as u32;
            set_speculation(&spec, 0, &draft(max));
            let want = generate(&plain, prompt, 128, 0);
            let got = generate(&spec, prompt, 128, max as usize + 1);
            assert_eq!(got, want, "drafter {} prompt {p}, max_tokens {max}", drafter.display());
            reset(&spec, 0);
            reset(&plain, 0);
        }
        let (mut proposed, mut accepted) = (0u64, 0u64);
        // SAFETY: a live engine and two writable counters.
        assert_eq!(unsafe { ffi::engine_speculation_stats(spec.0, 0, &mut proposed, &mut accepted) }, Status::Ok);
        println!("drafter {}: proposed {proposed}, accepted {accepted}", drafter.display());
        assert!(accepted > 0 && accepted <= proposed);

        // Four streams drafting in one batch, each against its plain tokens alone.
        let want: Vec<Vec<i32>> = prompts[..4]
            .iter()
            .map(|prompt| {
                let w = generate(&plain, prompt, 64, 0);
                reset(&plain, 0);
                w
            })
            .collect();
        for s in 0..4u32 {
            set_speculation(&spec, s, &draft(6));
        }
        let mut got: Vec<Vec<i32>> = vec![Vec::new(); 4];
        let mut input: Vec<Vec<i32>> = prompts[..4].to_vec();
        while got.iter().any(|g| g.len() < 64) {
            let live: Vec<u32> = (0..4u32).filter(|&s| got[s as usize].len() < 64).collect();
            let items: Vec<(u32, &[i32], usize)> = live.iter().map(|&s| (s, &input[s as usize][..], 7)).collect();
            let res = batch(&spec, &items);
            for (&s, (st, out)) in live.iter().zip(res) {
                assert_eq!(st, Status::Ok, "{}", last_error());
                input[s as usize] = vec![*out.last().unwrap()];
                got[s as usize].extend(out);
            }
        }
        for s in 0..4 {
            got[s].truncate(64);
            assert_eq!(got[s], want[s], "drafter {} stream {s} in a batch", drafter.display());
        }
        let lens: Vec<usize> = (0..4).map(|s| common::stream_len(&spec, s) as usize).collect();
        shared::check_pool(&spec, &lens, shared::kv_usage(&spec).tokens_total, PAGE, "after the drafted batch");
    }
}

/// 16 streams verifying 8 proposals each in one step: 144 head rows, past the scratch's 64 logits rows,
/// so the step runs as several passes and copies the earlier passes' heads to the host. Each stream's
/// tokens and the logits the engine hands back after the step are those of stepping it alone.
#[test]
fn gpu_verifications_past_the_logits_rows_give_each_stream_its_own_tokens_and_logits() {
    use hostembed::backend::{Batch, BatchItem, Decoder, Streams};
    use hostembed::checkpoint::write::MemSource;
    use hostembed::cuda::DeviceBuffer;
    use hostembed::gpu::{CudaBackend, RowsOnDevice};
    use hostembed::kv::KvTypes;
    use hostembed::model::{TensorSource, names};
    use hostembed::sampler::Sampling;
    use hostembed::tuning::Tuning;
    use std::sync::Arc;

    let test = "gpu_verifications_past_the_logits_rows_give_each_stream_its_own_tokens_and_logits";
    if !gpu_present(test) {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh(test);
    let cfg = config(Arch::Llama);
    let src = Arc::new(MemSource::synthetic(&cfg, rng.next_u64(), DType::F16));
    let embed = src.tensor(names::EMBED).unwrap();
    let buf = DeviceBuffer::from_slice(embed.bytes).unwrap();
    const STREAMS: usize = 16;
    const WINDOW: usize = 256;
    let pages = STREAMS * WINDOW.div_ceil(PAGE);
    let table = || {
        let rows = RowsOnDevice { ptr: buf.ptr(), dtype: embed.dtype, vocab: embed.rows(), cols: embed.cols() };
        let backend =
            CudaBackend::load(&*src, rows, 512, 0, pages, KvTypes::GPU_DEFAULT, WINDOW, &Tuning::from_env()).unwrap();
        Streams::new(backend, WINDOW, STREAMS, pages, Sampling::GREEDY).unwrap().with_prefix_cache(false)
    };
    let (mut spec, mut alone) = (table(), table());
    let step = |d: &mut dyn Decoder, items: Vec<BatchItem<'_>>| -> Vec<Vec<u32>> {
        let mut batch = Batch::new(items).unwrap();
        d.step_batch(&mut batch).unwrap();
        batch
            .into_items()
            .into_iter()
            .map(|b| {
                let next = b.next.unwrap_or_else(|e| panic!("{e}"));
                if b.out.is_empty() { vec![next] } else { b.out }
            })
            .collect()
    };
    // Each prompt a line of 20 ids three times, then the line's first id: lookup proposes the rest.
    let lines: Vec<Vec<u32>> =
        (0..STREAMS).map(|_| rng.ids(cfg.vocab, 20).into_iter().map(|t| t as u32).collect()).collect();
    let prompts: Vec<Vec<u32>> = lines.iter().map(|l| l.repeat(3)).collect();
    for d in [&mut spec, &mut alone] {
        step(d, (0..STREAMS).map(|s| BatchItem::new(s as u32, &prompts[s])).collect());
    }
    for s in 0..STREAMS as u32 {
        spec.set_speculation(s, lookup(8)).unwrap();
        spec.set_proposal_limit(s, 8).unwrap();
    }
    let inputs: Vec<Vec<u32>> = lines.iter().map(|l| vec![l[0]]).collect();
    let outs = step(&mut spec, (0..STREAMS).map(|s| BatchItem::new(s as u32, &inputs[s]).with_most(9)).collect());
    let proposed: u64 = (0..STREAMS as u32).map(|s| spec.speculation_stats(s).unwrap().0).sum();
    assert!(proposed > 64, "the step verified {proposed} proposals; the test needs more heads than 64 rows");
    for (s, out) in outs.iter().enumerate() {
        let s32 = s as u32;
        let mut want = step(&mut alone, vec![BatchItem::new(s32, &inputs[s])]).remove(0);
        while want.len() < out.len() {
            let t = [*want.last().unwrap()];
            want.extend(step(&mut alone, vec![BatchItem::new(s32, &t)]).remove(0));
        }
        assert_eq!(out, &want, "stream {s}");
        let (got, expect) = (spec.logits(s32).unwrap(), alone.logits(s32).unwrap());
        let differ = got.iter().zip(&expect).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differ, 0, "stream {s}: {differ} of {} logits differ from stepping alone", got.len());
    }
}
