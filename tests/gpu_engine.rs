//! The decode engine on the GPU through its C ABI, on one small untied Llama-like model written as HF
//! safetensors (BF16) and as GGUF (F16, Q8_0, BF16): the three placements give identical token streams,
//! greedy and sampled (SHA-256 of the token ids printed, as in the seed receipt); CUDA against the CPU
//! engine on the same files; safetensors against GGUF of the same weights; refused steps on CUDA.
//! Prints SKIP without a device.

mod common;
use common::{bits, max_abs_diff, rel_l2, top_two_gap};

use common::{Held, Scratch, device_info, info, init, logits, serial, stats, step, try_step};

use common::gpu_present;
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
        bos: Some(1),
        eos: Some(2),
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
    (0..PROMPT as i32).map(|i| (i * 7919 + 13) % config().vocab as i32).collect()
}

unsafe extern "C" fn quiet(_user: *mut c_void, _line: *const c_char) {}

fn greedy_cuda() -> engine_options {
    engine_options {
        backend: engine_backend::Cuda,
        room_bytes: 1 << 50,
        mmap_rows: engine_tristate::No,
        context: WINDOW,
        max_streams: 1,
        max_batch: 32,
        log: Some(quiet),
        ..engine::default_options()
    }
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
    let prompt = prompt();
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

/// Both engines step the same tokens (the reference's greedy choice); logits compared at every step, and
/// a differing choice allowed only where the reference's own gap is within twice the measured error.
/// Returns the worst relative L2 and the differing steps (step, gap between the choices, top-two gap, error).
fn compare_greedy(what: &str, test: &Held, reference: &Held, steps: usize) -> (f64, Vec<(usize, f32, f32, f32)>) {
    let prompt = prompt();
    let (mut got, mut want) = (step(test, 0, &prompt), step(reference, 0, &prompt));
    let (mut worst, mut differ) = (0f64, Vec::new());
    for i in 0..=steps {
        let (lt, lr) = (logits(test, 0), logits(reference, 0));
        let rel = rel_l2(&lt, &lr);
        worst = worst.max(rel);
        assert!(rel < 2e-2, "{what} step {i}: relative L2 {rel:.3e} of the logits");
        if got != want {
            let err = max_abs_diff(&lt, &lr);
            let gap = lr[want as usize] - lr[got as usize];
            assert!(gap <= 2.0 * err, "{what} step {i}: chose {got} over {want}, gap {gap} > 2 x error {err}");
            differ.push((i, gap, top_two_gap(&lr), err));
        }
        if i < steps {
            let input = [want];
            (got, want) = (step(test, 0, &input), step(reference, 0, &input));
        }
    }
    println!(
        "{what}: {} greedy tokens, worst relative L2 {worst:.2e}, {} near-tie differences (step, gap, top-two gap, \
         max error): {differ:?}",
        steps + 1,
        differ.len()
    );
    (worst, differ)
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
        let (_, differ) = compare_greedy(&what, &gpu, &reference, STEPS);
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
    let (_, differ) = compare_greedy(&what, &g, &h, STEPS);
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
    assert_eq!(unsafe { ffi::engine_step(e.0, 0, std::ptr::null(), 1, &mut next) }, Status::InvalidArgument);
    assert_eq!(unsafe { ffi::engine_step(e.0, 0, prompt.as_ptr(), 0, &mut next) }, Status::InvalidArgument);
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
    let handle = shared.0 as usize;
    let got: Vec<Vec<i32>> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..STREAMS)
            .map(|s| {
                scope.spawn(move || {
                    // The engine stays owned by `shared`; this view must not free it.
                    let e = std::mem::ManuallyDrop::new(Held(handle as *mut ffi::engine));
                    run(&e, s)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    for s in 0..STREAMS as usize {
        assert_eq!(got[s], want[s], "stream {s}: threads against the serial run");
    }
}
