//! The decode engine on the GPU through its C ABI, on one small untied Llama-like model written as HF
//! safetensors (BF16) and as GGUF (F16, Q8_0, BF16): the three placements give identical token streams,
//! greedy and sampled, after a prompt of several chunks (SHA-256 of the token ids printed, as in the seed
//! receipt); max_batch 0 is the default on CUDA too; CUDA against the CPU
//! engine on the same files; safetensors against GGUF of the same weights; refused steps on CUDA;
//! batches (the KV page pool, truncate, per-stream sampling, and random batches of single tokens and
//! prompt chunks against stepping alone in every weight format, the Q4_K_M mix and the `gguf` Python
//! package's F16 file). Prints SKIP without a device.

mod common;
use common::{bits, compare_greedy, rel_l2};

use common::{Held, Scratch, device_info, info, init, logits, serial, stats, step, try_step};
use common::{Rng, kv_stats, on_threads, reset, set_env, set_sampling, stream_len, truncate, try_batch};
use hostembed::sampler::{self, Sampling};

use common::{Mix, cuda_options, every_recipe_batches_like_alone, gpu_present, model_file, twins_batch_like_alone};
use hostembed::Status;
use hostembed::checkpoint::Checkpoint;
use hostembed::checkpoint::write::{write_synthetic_gguf, write_synthetic_hf};
use hostembed::engine::{self, engine_backend, engine_options, engine_tristate};
use hostembed::ffi::{self};
use hostembed::fit::{self, engine_placement};
use hostembed::model::{Arch, ModelConfig, RopeScaling};
use hostembed::placement::engine_memory;
use hostembed::status::last_error;
use hostembed::tensor::DType;
use sha2::{Digest, Sha256};
use std::ffi::{c_char, c_void};
use std::path::{Path, PathBuf};

/// The weights' seed: fixed, so the printed SHA-256 lines compare across runs and machines.
const WEIGHTS_SEED: u64 = 0x6870_6f73_7465_6d62;
/// The sampled runs' seed.
const SAMPLING_SEED: u64 = 1;
const PROMPT: usize = 16;
const STEPS: usize = 64;
const WINDOW: u32 = 256;

/// Untied Llama 3 with GQA 4:1 and llama3 rope scaling; every matrix's rows are whole Q8_0 blocks.
fn config() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab: 1536,
        hidden: 256,
        layers: 2,
        heads: 8,
        kv_heads: 2,
        head_dim: 32,
        intermediate: 768,
        rms_eps: 1e-5,
        rope_theta: 500000.0,
        rope_scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 64,
        },
        rope_interleaved: false,
        max_position: 4096,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: Some(1),
        eos: Some(2),
        moe: None,
    }
}

/// One checkpoint of the model: a label and the path to open.
struct Format {
    label: &'static str,
    path: PathBuf,
}

/// The same weights as an HF folder in BF16 and as GGUF in `gguf` dtypes, in that order.
fn write_formats(dir: &Path, gguf: &[DType]) -> Vec<Format> {
    let cfg = config();
    let hf = dir.join("hf-bf16");
    write_synthetic_hf(&hf, &cfg, WEIGHTS_SEED, DType::Bf16).unwrap();
    let mut out = vec![Format { label: "safetensors BF16", path: hf }];
    for &dtype in gguf {
        let path = dir.join(format!("model-{}.gguf", dtype.name()));
        write_synthetic_gguf(&path, &cfg, WEIGHTS_SEED, dtype).unwrap();
        let label = match dtype {
            DType::F16 => "GGUF F16",
            DType::Q8_0 => "GGUF Q8_0",
            DType::Bf16 => "GGUF BF16",
            DType::F32 => "GGUF F32",
            other => panic!("write_formats: no label for {}", other.name()),
        };
        assert_eq!(Checkpoint::open(&path).unwrap().embed().dtype, dtype, "{label}: the rows' format");
        out.push(Format { label, path });
    }
    out
}

/// The prompt: fixed ids spread over the vocabulary.
fn prompt() -> Vec<i32> {
    prompt_of(PROMPT)
}

fn prompt_of(n: usize) -> Vec<i32> {
    (0..n as i32).map(|i| (i * 7919 + 13) % config().vocab as i32).collect()
}

/// A prompt of several chunks at `greedy_cuda`'s max_batch of 32, the last one partial.
const LONG_PROMPT: usize = 3 * 32 + 17;

fn greedy_cuda() -> engine_options {
    cuda_options(WINDOW, 1, 32)
}

fn sampled(o: engine_options) -> engine_options {
    engine_options { temperature: 0.8, top_k: 40, top_p: 0.95, seed: SAMPLING_SEED, ..o }
}

fn cpu() -> engine_options {
    engine_options { backend: engine_backend::Cpu, room_bytes: 0, ..greedy_cuda() }
}

/// `base` changed to put the rows in each placement: all the room there is, one byte short of the
/// rule's need (HOST_MAPPED), and mmap_rows set (FILE_MAPPED).
fn placements(path: &Path, base: engine_options) -> Vec<(engine_placement, engine_options)> {
    let ckpt = Checkpoint::open(path).unwrap();
    let inputs = engine::fit_inputs(&ckpt, &base, Some(&device_info())).unwrap();
    let need = fit::plan(&inputs).unwrap().need_bytes;
    vec![
        (engine_placement::Device, base),
        (engine_placement::HostMapped, engine_options { room_bytes: need - 1, ..base }),
        (engine_placement::FileMapped, engine_options { mmap_rows: engine_tristate::Yes, ..base }),
    ]
}

/// Steps the prompt, then feeds each chosen token back `steps` times: the chosen tokens.
fn decode(e: &Held, prompt: &[i32], steps: usize) -> Vec<i32> {
    let mut tokens = vec![step(e, 0, prompt)];
    for _ in 0..steps {
        tokens.push(step(e, 0, &[*tokens.last().unwrap()]));
    }
    tokens
}

/// SHA-256 of the token ids as little-endian i32s, in hex.
fn sha256_hex(tokens: &[i32]) -> String {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect()
}

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

// ---------------------------------------------------------------------------------------------
// Batches: engine_step_batch, the KV page pool, truncate and per-stream sampling on CUDA.

/// `streams` streams of `window` tokens on CUDA, in a pool of their full windows.
fn batch_cuda(window: u32, streams: u32) -> engine_options {
    engine_options { context: window, max_streams: streams, ..greedy_cuda() }
}

/// `n` ids from a seeded walk over the vocabulary.
fn ids(rng: &mut Rng, n: usize) -> Vec<i32> {
    rng.ids(config().vocab, n)
}

/// A stream's logits alone and in a batch of up to 64 single-token items, whatever the others are:
/// bit for bit, token for token. Each stream's prompt is stepped alone on both engines (so their caches
/// hold the same bits); then every round steps a random subset of the streams, in a random order, one
/// token each, on one engine in one call and on the other one stream at a time. Streams are truncated
/// and reset (and prompted again alone) between rounds.
#[test]
fn single_token_items_are_batch_invariant_on_cuda() {
    if !gpu_present("single_token_items_are_batch_invariant_on_cuda") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("single_token_items_are_batch_invariant_on_cuda");
    let dir = Scratch::new("batch-invariance");
    let path = &write_formats(&dir.0, &[])[0].path;
    let (window, streams) = (256u32, 64u32);
    let batched = init(path, &batch_cuda(window, streams));
    let alone = init(path, &batch_cuda(window, streams));
    assert_eq!(info(&batched).streams, streams);
    for s in 0..streams {
        // Half greedy, half drawn with every cut and the penalty: the device sampler per item.
        let mut sampling = ffi::engine_default_sampling();
        if s % 2 == 1 {
            sampling = hostembed::abi::engine_sampling {
                temperature: 0.9,
                top_k: 40,
                top_p: 0.95,
                min_p: 0.02,
                repeat_penalty: 1.3,
                repeat_last_n: 32,
                seed: rng.next_u64(),
            };
        }
        set_sampling(&batched, s, &sampling);
        set_sampling(&alone, s, &sampling);
    }
    let mut last = vec![0i32; streams as usize];
    let prompt_both = |s: u32, rng: &mut Rng, last: &mut Vec<i32>| {
        let n = 1 + rng.below(40) as usize;
        let p = ids(rng, n);
        let t = step(&batched, s, &p);
        assert_eq!(step(&alone, s, &p), t, "stream {s}: the prompt, alone on both engines");
        last[s as usize] = t;
    };
    for s in 0..streams {
        prompt_both(s, &mut rng, &mut last);
    }
    let (mut items, mut widest) = (0usize, 0usize);
    for round in 0..48 {
        for s in 0..streams {
            let len = stream_len(&batched, s);
            if len + 1 >= window || rng.below(40) == 0 {
                reset(&batched, s);
                reset(&alone, s);
                prompt_both(s, &mut rng, &mut last);
            } else if rng.below(40) == 0 {
                let keep = 1 + rng.below(len as u64) as u32;
                truncate(&batched, s, keep);
                truncate(&alone, s, keep);
                // Re-step the last kept position's token so both have a token to feed.
                let t = ids(&mut rng, 1);
                let (a, b) = (step(&batched, s, &t), step(&alone, s, &t));
                assert_eq!(a, b, "round {round} stream {s}: after truncating to {keep}");
                last[s as usize] = a;
            }
        }
        let width = [1usize, 2, 7, 16, 33, 64][round % 6];
        let mut order: Vec<u32> = (0..streams).collect();
        rng.shuffle(&mut order);
        order.truncate(width);
        let inputs: Vec<[i32; 1]> = order.iter().map(|&s| [last[s as usize]]).collect();
        let batch: Vec<(u32, &[i32])> = order.iter().zip(&inputs).map(|(&s, t)| (s, t.as_slice())).collect();
        let (st, out) = try_batch(&batched, &batch);
        assert_eq!(st, Status::Ok, "round {round}: {}", last_error());
        for (&(s, t), &(item, next)) in batch.iter().zip(&out) {
            assert_eq!(item, Status::Ok, "round {round} stream {s}: {}", last_error());
            let want = step(&alone, s, t);
            assert_eq!(next, want, "round {round} (batch of {width}) stream {s}: token");
            assert!(
                bits(&logits(&batched, s)) == bits(&logits(&alone, s)),
                "round {round} (batch of {width}) stream {s}: logits differ by {:.3e} relative L2",
                rel_l2(&logits(&batched, s), &logits(&alone, s))
            );
            last[s as usize] = next;
            items += 1;
        }
        widest = widest.max(width);
    }
    println!("{items} single-token items in batches of up to {widest}: every logit bit-identical to stepping alone");
}

unsafe extern "C" fn collect_lines(user: *mut c_void, line: *const c_char) {
    // SAFETY: the test passes a live Vec<String> as `user`, and nothing else touches it during the call.
    let lines = unsafe { &mut *(user as *mut Vec<String>) };
    // SAFETY: the library passes a NUL-terminated line that lives for the call.
    lines.push(unsafe { std::ffi::CStr::from_ptr(line) }.to_string_lossy().into_owned());
}

/// options.batch_tensor_cores YES reaches the CUDA engine: its start-up log says so, and a batch of 24
/// single tokens gives logits near (not the bits of) those of the same engine options with NO, which are
/// the bits of stepping each stream alone, though HOSTEMBED_BATCH_TENSOR_CORES=1 is set.
#[test]
fn the_batch_tensor_core_option_reaches_cuda() {
    if !gpu_present("the_batch_tensor_core_option_reaches_cuda") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("the_batch_tensor_core_option_reaches_cuda");
    let dir = Scratch::new("batch-tensor-cores");
    let path = &write_formats(&dir.0, &[])[0].path;
    let streams = 24u32;
    let said = "share tensor-core products";
    let mut engines = Vec::new();
    // The variable says on: only AUTO may read it, so NO stays batch invariant.
    let saved = std::env::var_os(engine::BATCH_TENSOR_CORES_ENV);
    set_env(engine::BATCH_TENSOR_CORES_ENV, Some(std::ffi::OsStr::new("1")));
    for option in [engine_tristate::No, engine_tristate::Yes] {
        let mut lines: Vec<String> = Vec::new();
        let opts = engine_options {
            batch_tensor_cores: option,
            log: Some(collect_lines),
            log_user: &mut lines as *mut Vec<String> as *mut c_void,
            ..batch_cuda(128, streams)
        };
        let e = init(path, &opts);
        assert_eq!(lines.iter().any(|l| l.contains(said)), option == engine_tristate::Yes, "{option:?}: {lines:?}");
        engines.push(e);
    }
    set_env(engine::BATCH_TENSOR_CORES_ENV, saved.as_deref());
    let alone = init(path, &batch_cuda(128, streams));
    let prompts: Vec<Vec<i32>> = (0..streams).map(|s| ids(&mut rng, 3 + s as usize)).collect();
    for e in engines.iter().chain([&alone]) {
        for (s, p) in prompts.iter().enumerate() {
            step(e, s as u32, p);
        }
    }
    let next: Vec<[i32; 1]> = (0..streams).map(|_| [ids(&mut rng, 1)[0]]).collect();
    let batch: Vec<(u32, &[i32])> = next.iter().enumerate().map(|(s, t)| (s as u32, &t[..])).collect();
    for e in &engines {
        let (st, out) = try_batch(e, &batch);
        assert_eq!(st, Status::Ok, "{}", last_error());
        assert!(out.iter().all(|(item, _)| *item == Status::Ok), "{out:?}: {}", last_error());
    }
    let (mut worst, mut exact_on) = (0f64, 0);
    for (s, t) in batch.iter() {
        step(&alone, *s, t);
        let want = logits(&alone, *s);
        assert!(bits(&logits(&engines[0], *s)) == bits(&want), "stream {s}: option NO is not stepping alone");
        let on = logits(&engines[1], *s);
        worst = worst.max(rel_l2(&on, &want));
        exact_on += (bits(&on) == bits(&want)) as usize;
    }
    println!("{streams} single tokens with the option on: worst relative L2 {worst:.2e}, {exact_on} bit-identical");
    assert!(worst < 2e-2, "the option's logits differ by {worst:.3e}");
    assert!(exact_on < streams as usize, "every stream's bits equal stepping alone: the option did not apply");
}

/// Batches mixing prompt chunks with single tokens (continuous batching): a chunk's logits within 2e-3
/// relative L2 of the same chunk stepped alone, the single tokens beside it bit-identical, and every
/// stream's later logits close to its alone twin's (both engines fed the batched engine's tokens).
#[test]
fn mixed_batches_match_stepping_alone_on_cuda() {
    if !gpu_present("mixed_batches_match_stepping_alone_on_cuda") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("mixed_batches_match_stepping_alone_on_cuda");
    let dir = Scratch::new("batch-mixed");
    let path = &write_formats(&dir.0, &[])[0].path;
    let (window, streams) = (512u32, 12u32);
    let batched = init(path, &batch_cuda(window, streams));
    let alone = init(path, &batch_cuda(window, streams));
    // Whether a stream's cache holds the same bits on both engines (no chunk of it was batched yet).
    let mut exact = vec![true; streams as usize];
    let mut last: Vec<Option<i32>> = vec![None; streams as usize];
    let (mut worst_chunk, mut worst_after, mut chunks) = (0f64, 0f64, 0usize);
    for round in 0..40 {
        let mut order: Vec<u32> = (0..streams).filter(|_| rng.below(4) > 0).collect();
        rng.shuffle(&mut order);
        let inputs: Vec<Vec<i32>> = order
            .iter()
            .map(|&s| {
                let room = window - stream_len(&batched, s);
                match last[s as usize] {
                    Some(t) if rng.below(3) > 0 => vec![t],
                    _ => {
                        let n = (1 + rng.below(100) as u32).min(room.saturating_sub(1)).max(1);
                        ids(&mut rng, n as usize)
                    }
                }
            })
            .collect();
        let batch: Vec<(u32, &[i32])> = order.iter().zip(&inputs).map(|(&s, t)| (s, t.as_slice())).collect();
        let (st, out) = try_batch(&batched, &batch);
        assert_eq!(st, Status::Ok, "round {round}: {}", last_error());
        let others = batch.len() > 1;
        for (&(s, t), &(item, next)) in batch.iter().zip(&out) {
            let (want_status, _) = try_step(&alone, s, t);
            assert_eq!(item, want_status, "round {round} stream {s}: status ({})", last_error());
            if item != Status::Ok {
                // The window is full: both start again.
                reset(&batched, s);
                reset(&alone, s);
                (exact[s as usize], last[s as usize]) = (true, None);
                continue;
            }
            let (got, want) = (logits(&batched, s), logits(&alone, s));
            let rel = rel_l2(&got, &want);
            if t.len() > 1 {
                assert!(rel <= 2e-3, "round {round} stream {s}: a {}-token chunk {rel:.3e} from alone", t.len());
                worst_chunk = worst_chunk.max(rel);
                chunks += 1;
                exact[s as usize] &= !others;
            } else if exact[s as usize] {
                assert!(bits(&got) == bits(&want), "round {round} stream {s}: a single token, {rel:.3e} from alone");
            } else {
                assert!(rel <= 5e-3, "round {round} stream {s}: {rel:.3e} from alone after a batched chunk");
                worst_after = worst_after.max(rel);
            }
            last[s as usize] = Some(next);
        }
    }
    println!(
        "{chunks} prompt chunks: worst {worst_chunk:.2e} relative L2 from alone; later tokens of batched chunks {worst_after:.2e}"
    );
    assert!(chunks > 20);
}

/// 64 streams of 256 tokens on CUDA, in passes of up to 32 tokens; calls of 1 to 64 items with prompt
/// chunks of 1 to 12 tokens (the decode rows' products), one in four up to 100 (the prompt path's, over
/// several passes).
fn mixed_batches() -> (engine_options, Mix) {
    (batch_cuda(256, 64), Mix { rounds: 15, widest: 64, chunk: 12, long_chunk: 100 })
}

/// Every weight format, and llama.cpp's Q4_K_M mix, on CUDA: random batches of 1 to 64 items (single
/// tokens and prompt chunks; streams joining, leaving, truncated and reset) give each stream the
/// status, the token and the logits bits of stepping it alone, and the pool follows the streams.
#[test]
fn random_batches_match_stepping_alone_in_every_format_on_cuda() {
    if !gpu_present("random_batches_match_stepping_alone_in_every_format_on_cuda") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("random_batches_match_stepping_alone_in_every_format_on_cuda");
    let (opts, mix) = mixed_batches();
    every_recipe_batches_like_alone(&config(), &opts, &mix, hostembed::gpu::PAGE_TOKENS as u64, &mut rng);
}

/// models/gguf-f16.gguf, which the `gguf` Python package wrote as llama.cpp's converter lays out an F16
/// Llama (scripts/gpu-build.sh bundles it; a SKIP line without it), on CUDA: its rows F16 on the card,
/// and random batches bit-identical to stepping alone.
#[test]
fn the_gguf_packages_f16_file_decodes_batch_invariant_on_cuda() {
    if !gpu_present("the_gguf_packages_f16_file_decodes_batch_invariant_on_cuda") {
        return;
    }
    let Some(path) =
        model_file("gguf-f16.gguf", "scripts/write-gguf-f16.sh writes it, scripts/gpu-build.sh bundles it")
    else {
        return;
    };
    let _g = serial();
    let mut rng = Rng::fresh("the_gguf_packages_f16_file_decodes_batch_invariant_on_cuda");
    let (opts, mix) = mixed_batches();
    {
        let e = init(&path, &opts);
        // SAFETY: engine_rows is plain C data (integers and pointers) for which all zeros is a value.
        let mut rows: hostembed::abi::engine_rows = unsafe { std::mem::zeroed() };
        // SAFETY: a live engine and a struct to fill.
        assert_eq!(unsafe { ffi::engine_embed_rows(e.0, &mut rows) }, Status::Ok, "{}", last_error());
        assert_eq!((rows.dtype, rows.device_usable), (DType::F16, true));
    }
    twins_batch_like_alone("gguf-f16.gguf", &path, &opts, &mix, hostembed::gpu::PAGE_TOKENS as u64, &mut rng);
}

/// engine_truncate on CUDA: stepping the same tokens again after a truncate gives the same logits, bit
/// for bit, and the pool gets back the pages past the new length.
#[test]
fn truncate_then_restep_is_bit_identical_on_cuda() {
    if !gpu_present("truncate_then_restep_is_bit_identical_on_cuda") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("truncate_then_restep_is_bit_identical_on_cuda");
    let dir = Scratch::new("batch-truncate");
    let path = &write_formats(&dir.0, &[])[0].path;
    // The prefix cache off: re-stepped from 0, the prompt would take its own cached pages and run its
    // last page as a chunk of its own (tests/gpu_prefix.rs holds that to its own bound).
    let e = init(path, &engine_options { prefix_cache: engine_tristate::No, ..batch_cuda(512, 2) });
    let (total, free) = kv_stats(&e);
    assert_eq!(free, total);
    let mut fed = ids(&mut rng, 150);
    let mut want = vec![(fed.len(), step(&e, 0, &fed.clone()), logits(&e, 0))];
    for _ in 0..40 {
        let t = want.last().unwrap().1;
        fed.push(t);
        want.push((fed.len(), step(&e, 0, &[t]), logits(&e, 0)));
    }
    // Past the prompt every position was a single token: re-stepping from there repeats every bit. From 0
    // the whole prompt chunk runs again: every bit too. From inside the prompt the rest of it runs as a
    // shorter chunk, which may take another path: within the prompt-chunk bound.
    for keep in [189u32, 160, 151, 150, 0, 149, 100, 17, 1] {
        truncate(&e, 0, keep);
        assert_eq!(stream_len(&e, 0), keep);
        let (_, free_now) = kv_stats(&e);
        assert!(total - free_now >= keep as u64, "kept {keep}: {} positions held", total - free_now);
        let keep = keep as usize;
        let exact = keep == 0 || keep >= 150;
        let mut at = keep;
        // A truncate drops the stream's logits: compare only after something was stepped again.
        let mut stepped = false;
        if keep < 150 {
            step(&e, 0, &fed[keep..150]);
            at = 150;
            stepped = true;
        }
        let mut compared = 0;
        loop {
            if let Some((_, _, l)) = want.iter().find(|(n, _, _)| *n == at).filter(|_| stepped) {
                let got = logits(&e, 0);
                if exact {
                    assert!(bits(&got) == bits(l), "kept {keep}: logits after {at}");
                } else {
                    let rel = rel_l2(&got, l);
                    assert!(rel <= 2e-3, "kept {keep}: logits after {at} {rel:.3e} from the first run");
                }
                compared += 1;
            }
            if at == fed.len() {
                break;
            }
            let got = step(&e, 0, &fed[at..at + 1]);
            at += 1;
            stepped = true;
            let first_run = want.iter().find(|(n, _, _)| *n == at).map(|w| w.1);
            if exact && first_run.is_some() {
                assert_eq!(Some(got), first_run, "kept {keep}: token after {at}");
            }
        }
        assert!(compared > 0, "kept {keep}: nothing compared");
    }
    reset(&e, 0);
    assert_eq!(kv_stats(&e), (total, total), "whole after the reset");
}

/// Room for two full 64k windows and 64 streams: 64 streams of 2,048 tokens are admitted and decoded
/// (the pool, not the window count, bounds them); one more page for any of them is NO_ROOM for that item
/// alone; each stream's logits match it stepped alone on a second engine; resets make the pool whole.
#[test]
fn sixty_four_streams_of_2048_tokens_share_two_64k_windows_on_cuda() {
    if !gpu_present("sixty_four_streams_of_2048_tokens_share_two_64k_windows_on_cuda") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("sixty_four_streams_of_2048_tokens_share_two_64k_windows_on_cuda");
    let dir = Scratch::new("batch-pool");
    let path = &write_formats(&dir.0, &[])[0].path;
    let window = 65536u32;
    let base = engine_options { reserve_bytes: 0, ..batch_cuda(window, 1) };
    let ckpt = Checkpoint::open(path).unwrap();
    let inputs = engine::fit_inputs(&ckpt, &base, Some(&device_info())).unwrap();
    let plan = fit::plan(&inputs).unwrap();
    let room = plan.on_card_bytes + 2 * plan.stream_bytes;
    let opts = engine_options { room_bytes: room, max_streams: 64, ..base };
    let e = init(path, &opts);
    assert_eq!(info(&e).streams, 64, "max_streams streams over a pool of two windows");
    // SAFETY: engine_plan is numbers and enums with a variant at 0: all zeros is a value of it.
    let mut plan_of = unsafe { std::mem::zeroed() };
    // SAFETY: a live engine and a writable engine_plan.
    assert_eq!(unsafe { ffi::engine_plan_of(e.0, &mut plan_of) }, Status::Ok);
    assert_eq!(plan_of.streams, 2, "the fit counts two full windows");
    let (total, free) = kv_stats(&e);
    println!("pool: {total} positions ({free} free) for two {window}-token windows");
    assert!(total >= 2 * window as u64 && total < 2 * window as u64 + 4096, "a pool of two windows: {total}");

    let prompts: Vec<Vec<i32>> = (0..64).map(|_| ids(&mut rng, 2047)).collect();
    // The prompts in batches of 8 chunks of up to 512 tokens.
    let mut at = vec![0usize; 64];
    let mut next = vec![0i32; 64];
    while at.iter().any(|&a| a < 2047) {
        let mut batch: Vec<(u32, &[i32])> = Vec::new();
        for s in 0..64 {
            if at[s] < 2047 && batch.len() < 8 {
                let end = (at[s] + 512).min(2047);
                batch.push((s as u32, &prompts[s][at[s]..end]));
                at[s] = end;
            }
        }
        let (st, out) = try_batch(&e, &batch);
        assert_eq!(st, Status::Ok, "{}", last_error());
        for (&(s, _), &(item, t)) in batch.iter().zip(&out) {
            assert_eq!(item, Status::Ok, "stream {s}'s prompt: {}", last_error());
            next[s as usize] = t;
        }
    }
    // One token each, all 64 in one call: 2,048 positions a stream.
    let inputs: Vec<[i32; 1]> = next.iter().map(|&t| [t]).collect();
    let batch: Vec<(u32, &[i32])> = (0..64u32).map(|s| (s, inputs[s as usize].as_slice())).collect();
    let (st, out) = try_batch(&e, &batch);
    assert_eq!(st, Status::Ok);
    assert!(out.iter().all(|o| o.0 == Status::Ok), "{out:?}: {}", last_error());
    assert!((0..64).all(|s| stream_len(&e, s) == 2048));
    let logits_4 = logits(&e, 4);
    let (_, free) = kv_stats(&e);
    assert_eq!(free, total - 64 * 2048, "every stream holds exactly its 2,048 positions");
    // Compare a few streams with themselves alone on an engine of one window.
    let reference = init(path, &batch_cuda(4096, 1));
    for s in [0u32, 17, 63] {
        reset(&reference, 0);
        step(&reference, 0, &prompts[s as usize]);
        step(&reference, 0, &inputs[s as usize]);
        let rel = rel_l2(&logits(&e, s), &logits(&reference, 0));
        assert!(rel <= 2e-3, "stream {s}: {rel:.3e} relative L2 from alone");
    }
    // Where the pool has no page left, the item that needs one fails alone.
    // Stream 4 steps its last position again (a page it holds); stream 3 needs a page past the pool's.
    if free < 64 {
        truncate(&e, 4, 2047);
        let more = ids(&mut rng, 64);
        let (st, out) = try_batch(&e, &[(3, &more), (4, &inputs[4])]);
        assert_eq!(st, Status::Ok);
        assert_eq!(out[0], (Status::NoRoom, -1), "{}", last_error());
        assert_eq!(stream_len(&e, 3), 2048, "the refused item appended nothing");
        assert_eq!((out[1], stream_len(&e, 4)), ((Status::Ok, out[1].1), 2048), "{}", last_error());
        assert!(bits(&logits(&e, 4)) == bits(&logits_4), "stream 4 re-stepped: the same logits");
    }
    for s in 0..64 {
        reset(&e, s);
    }
    assert_eq!(kv_stats(&e), (total, total), "whole after the resets");
    drop((e, reference));
    assert_eq!(stats(), engine_memory::default());
}

/// The device sampler through the engine: each stream's token is `sampler::sample_stream` of its own
/// settings (min-p and the penalty included) on the logits the engine reports, stream by stream in
/// one batch.
#[test]
fn per_stream_sampling_on_cuda_is_the_cpu_samplers_choice() {
    if !gpu_present("per_stream_sampling_on_cuda_is_the_cpu_samplers_choice") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("per_stream_sampling_on_cuda_is_the_cpu_samplers_choice");
    let dir = Scratch::new("batch-sampling");
    let path = &write_formats(&dir.0, &[])[0].path;
    let e = init(path, &batch_cuda(256, 4));
    let settings = [
        Sampling::GREEDY,
        Sampling { repeat_penalty: 2.0, repeat_last_n: 64, ..Sampling::GREEDY },
        Sampling {
            temperature: 1.2,
            top_k: 50,
            min_p: 0.05,
            repeat_penalty: 1.4,
            repeat_last_n: 16,
            seed: 9,
            ..Sampling::GREEDY
        },
        Sampling { temperature: 0.8, top_p: 0.9, min_p: 0.2, seed: 4, ..Sampling::GREEDY },
    ];
    for (s, sampling) in settings.iter().enumerate() {
        set_sampling(&e, s as u32, sampling);
    }
    let mut history: Vec<Vec<u32>> = vec![Vec::new(); 4];
    let mut feed: Vec<Vec<i32>> = (0..4).map(|_| ids(&mut rng, 12)).collect();
    for round in 0..40 {
        let batch: Vec<(u32, &[i32])> = (0..4u32).map(|s| (s, feed[s as usize].as_slice())).collect();
        let (st, out) = try_batch(&e, &batch);
        assert_eq!(st, Status::Ok, "{}", last_error());
        for s in 0..4usize {
            assert_eq!(out[s].0, Status::Ok);
            let new: Vec<u32> = feed[s].iter().map(|&t| t as u32).collect();
            let want = sampler::sample_stream(&logits(&e, s as u32), &settings[s], s as u32, &history[s], &new);
            assert_eq!(out[s].1 as u32, want, "round {round} stream {s}: {:?}", settings[s]);
            history[s].extend(&new);
            feed[s] = vec![out[s].1];
        }
    }
}
