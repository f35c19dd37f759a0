//! Token streams on CUDA: placements, max_batch's default, the CPU, safetensors and GGUF, refusals, threads.

use super::{
    LONG_PROMPT, STEPS, config, cpu, decode, greedy_cuda, placements, prompt, prompt_of, sampled, sha256_hex,
    write_formats,
};
use crate::common::{
    Held, Scratch, bits, compare_greedy, gpu_present, info, init, logits, on_threads, serial, stats, step, try_step,
};
use hostembed::checkpoint::Checkpoint;
use hostembed::engine::engine_options;
use hostembed::fit::engine_placement;
use hostembed::placement::engine_memory;
use hostembed::status::last_error;
use hostembed::tensor::DType;
use hostembed::{Status, engine, ffi};

#[test]
fn placements_give_identical_token_streams() {
    if !gpu_present("placements_give_identical_token_streams") {
        return;
    }
    let _g = serial();
    let dir = Scratch::new("placements");
    let prompt = prompt_of(LONG_PROMPT);
    for format in write_formats(&dir.0, &[DType::F16, DType::Q8_0]) {
        let mut by_mode = Vec::new();
        for (mode, base) in [("greedy", greedy_cuda()), ("sampled", sampled(greedy_cuda()))] {
            let mut runs: Vec<(engine_placement, Vec<i32>, Vec<f32>)> = Vec::new();
            for (placement, opts) in placements(&format.path, base) {
                let e = init(&format.path, &opts);
                let i = info(&e);
                assert_eq!((i.placement, i.cuda), (placement, true), "{} {mode}: where the rows went", format.label);
                let tokens = decode(&e, &prompt, STEPS);
                let last = logits(&e, 0);
                println!(
                    "{} {mode} {placement:?}: token_sha256 {} ({} tokens after a {}-token prompt)",
                    format.label,
                    sha256_hex(&tokens),
                    tokens.len(),
                    prompt.len()
                );
                runs.push((placement, tokens, last));
                drop(e);
                assert_eq!(stats(), engine_memory::default(), "{} {mode} {placement:?}: held after free", format.label);
            }
            let (_, want, want_logits) = &runs[0];
            for (placement, tokens, last) in &runs[1..] {
                assert_eq!(tokens, want, "{} {mode}: {placement:?} against DEVICE", format.label);
                assert!(bits(last) == bits(want_logits), "{} {mode}: {placement:?} logits", format.label);
            }
            by_mode.push(want.clone());
        }
        assert_ne!(by_mode[0], by_mode[1], "{}: sampled decoding gave the greedy tokens", format.label);
    }
}

/// max_batch 0 means the default (512) for the fit rule's scratch and for the load alike: such an engine
/// loads and gives the bits of one asked for 512 outright.
#[test]
fn max_batch_zero_is_the_default_on_cuda() {
    if !gpu_present("max_batch_zero_is_the_default_on_cuda") {
        return;
    }
    let _g = serial();
    let dir = Scratch::new("max-batch-zero");
    let path = &write_formats(&dir.0, &[])[0].path;
    let prompt = prompt_of(LONG_PROMPT);
    let mut runs = Vec::new();
    for max_batch in [0, engine::DEFAULT_MAX_BATCH] {
        let e = init(path, &engine_options { max_batch, ..greedy_cuda() });
        let tokens = decode(&e, &prompt, 8);
        runs.push((tokens, bits(&logits(&e, 0))));
    }
    assert_eq!(runs[0].0, runs[1].0, "tokens with max_batch 0 and {}", engine::DEFAULT_MAX_BATCH);
    assert!(runs[0].1 == runs[1].1, "logits with max_batch 0 and {}", engine::DEFAULT_MAX_BATCH);
    assert_eq!(stats(), engine_memory::default());
}

#[test]
fn cuda_matches_cpu_on_the_same_files() {
    if !gpu_present("cuda_matches_cpu_on_the_same_files") {
        return;
    }
    let _g = serial();
    let dir = Scratch::new("cpu");
    for format in write_formats(&dir.0, &[DType::F16, DType::Q8_0]) {
        let gpu = init(&format.path, &greedy_cuda());
        let reference = init(&format.path, &cpu());
        assert!(info(&gpu).cuda && !info(&reference).cuda);
        let what = format!("{}: CUDA against CPU", format.label);
        let (_, differ) = compare_greedy(&what, &gpu, &reference, &prompt(), STEPS);
        assert!(differ.len() <= 3, "{what}: {} near-tie differences in {} tokens", differ.len(), STEPS + 1);
        drop((gpu, reference));
        assert_eq!(stats(), engine_memory::default(), "{what}");
    }
}

#[test]
fn safetensors_and_gguf_of_the_same_weights_agree_on_cuda() {
    if !gpu_present("safetensors_and_gguf_of_the_same_weights_agree_on_cuda") {
        return;
    }
    let _g = serial();
    let dir = Scratch::new("formats");
    let formats = write_formats(&dir.0, &[DType::Bf16]);
    let (hf, gguf) = (&formats[0], &formats[1]);
    assert!(Checkpoint::open(&gguf.path).unwrap().config.rope_interleaved, "GGUF llama rotates adjacent pairs");
    let h = init(&hf.path, &greedy_cuda());
    let g = init(&gguf.path, &greedy_cuda());
    let what = format!("CUDA: {} against {}", gguf.label, hf.label);
    let (_, differ) = compare_greedy(&what, &g, &h, &prompt(), STEPS);
    assert!(differ.len() <= 3, "{what}: {} near-tie differences", differ.len());
    drop((h, g));
    assert_eq!(stats(), engine_memory::default());
}

/// On CUDA as on the CPU: a step past the window, an id outside the vocabulary, a stream not admitted,
/// NULLs and no tokens are refused, and the stream then decodes exactly as one that never saw them.
#[test]
fn refused_cuda_steps_append_nothing() {
    if !gpu_present("refused_cuda_steps_append_nothing") {
        return;
    }
    let _g = serial();
    let dir = Scratch::new("refusals");
    let formats = write_formats(&dir.0, &[]);
    let path = &formats[0].path;
    let window = 24;
    let opts = engine_options { context: window, max_streams: 2, ..greedy_cuda() };
    let e = init(path, &opts);
    let reference = init(path, &opts);
    let streams = info(&e).streams;
    assert_eq!(streams, 2);
    let vocab = config().vocab as i32;
    let prompt = prompt();
    let first = step(&e, 0, &prompt);
    assert_eq!(step(&reference, 0, &prompt), first);

    assert_eq!(try_step(&e, 0, &[first; 9]), (Status::NoRoom, -7), "16 + 9 tokens in 24: {}", last_error());
    for bad in [-1, vocab, i32::MAX, i32::MIN] {
        assert_eq!(try_step(&e, 0, &[first, bad]), (Status::OutOfRange, -7), "id {bad}: {}", last_error());
    }
    assert_eq!(try_step(&e, streams, &[first]), (Status::OutOfRange, -7), "stream {streams}");
    let mut next = -7;
    // SAFETY: a live engine; the NULL tokens are refused before anything is read.
    assert_eq!(unsafe { ffi::engine_step(e.0, 0, std::ptr::null(), 1, &mut next) }, Status::InvalidArgument);
    // SAFETY: a live engine; n = 0 is refused before anything is read.
    assert_eq!(unsafe { ffi::engine_step(e.0, 0, prompt.as_ptr(), 0, &mut next) }, Status::InvalidArgument);
    // SAFETY: a live engine; the NULL out is refused before anything runs.
    assert_eq!(unsafe { ffi::engine_step(e.0, 0, prompt.as_ptr(), 1, std::ptr::null_mut()) }, Status::InvalidArgument);
    assert_eq!(next, -7);

    assert_eq!(bits(&logits(&e, 0)), bits(&logits(&reference, 0)), "logits after the refusals");
    let fill = [first; 8];
    assert_eq!(step(&e, 0, &fill), step(&reference, 0, &fill), "the step that fills the window");
    assert_eq!(bits(&logits(&e, 0)), bits(&logits(&reference, 0)), "logits at a full window");
    assert_eq!(try_step(&e, 0, &[first]), (Status::NoRoom, -7), "a full window");
    assert_eq!(step(&e, 1, &prompt), first, "the second stream starts empty");
    drop((e, reference));
    assert_eq!(stats(), engine_memory::default());
}

/// 8 threads step 8 streams of one CUDA engine at once; every stream's tokens are the serial run's.
#[test]
fn eight_threads_on_one_engine_match_the_serial_run() {
    if !gpu_present("eight_threads_on_one_engine_match_the_serial_run") {
        return;
    }
    let _g = serial();
    let dir = Scratch::new("threads");
    let model = &write_formats(dir.path(), &[])[0].path;
    const STREAMS: u32 = 8;
    let opts = engine_options { max_streams: STREAMS, ..greedy_cuda() };
    let vocab = config().vocab as i32;
    let prompt_of = |s: u32| -> Vec<i32> { prompt().iter().map(|&t| (t + s as i32 * 31) % vocab).collect() };
    let run = |e: &Held, s: u32| -> Vec<i32> {
        let mut tokens = vec![step(e, s, &prompt_of(s))];
        for _ in 0..STEPS / 4 {
            tokens.push(step(e, s, &[*tokens.last().unwrap()]));
        }
        tokens
    };
    let serial_engine = init(model, &opts);
    assert_eq!(info(&serial_engine).streams, STREAMS);
    let want: Vec<Vec<i32>> = (0..STREAMS).map(|s| run(&serial_engine, s)).collect();
    drop(serial_engine);

    let shared = init(model, &opts);
    let got = on_threads(&shared, STREAMS, run);
    for s in 0..STREAMS as usize {
        assert_eq!(got[s], want[s], "stream {s}: threads against the serial run");
    }
}
