//! The seed receipt's placement table on real decoding: a random-weight checkpoint of the Llama-3-8B shape
//! (BF16, untied) decoded at batch 1 through the C ABI with the embedding rows on the card (DEVICE), in
//! pinned host memory (HOST_MAPPED) and in the registered file mapping (FILE_MAPPED), greedy and sampled.
//!
//!     cargo run --release --example bench_placements -- [DIR] [--layers 32] [--prompt 64] [--tokens 128]
//!         [--runs 5] [--window 4096] [--max-batch N]
//!
//! --max-batch 8 keeps a 64-token prompt on the matrix-vector path (chunks under 16 tokens), as before
//! prompts ran on tensor cores, so the token hashes compare with figures from before that path.
//!
//! DIR (default $HOSTEMBED_TEST_TMP, else the system's temp dir) receives the checkpoint as an HF folder,
//! written one tensor at a time (16 GB at 32 layers) and reused when already there. --layers 4 makes a
//! quick run. Prints the start-up line of each engine, a markdown table of median decode and prompt tok/s
//! per placement, the SHA-256 of every run's token ids (identical across placements and runs, or DIFFER
//! and exit status 1), and the device memory each placement's load takes.

use hostembed::Status;
use hostembed::checkpoint::Checkpoint;
use hostembed::checkpoint::write::write_synthetic_hf;
use hostembed::cuda;
use hostembed::engine::{self, engine_backend, engine_options, engine_tristate};
use hostembed::ffi::{self, engine_device_info, engine_model_info};
use hostembed::fit::{self, engine_placement};
use hostembed::model::{Arch, ModelConfig, RopeScaling};
use hostembed::placement::engine_memory;
use hostembed::status::last_error;
use hostembed::tensor::DType;
use sha2::{Digest, Sha256};
use std::ffi::{CStr, CString, c_char, c_void};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

/// The weights' seed: the same files on every machine.
const WEIGHTS_SEED: u64 = 8;
const GIB: f64 = (1u64 << 30) as f64;
const PLACEMENTS: [engine_placement; 3] =
    [engine_placement::Device, engine_placement::HostMapped, engine_placement::FileMapped];

struct Args {
    dir: PathBuf,
    layers: usize,
    prompt: usize,
    tokens: usize,
    runs: usize,
    window: u32,
    max_batch: u32,
}

fn parse() -> Args {
    let default_dir = std::env::var_os("HOSTEMBED_TEST_TMP").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let mut args = Args { dir: default_dir, layers: 32, prompt: 64, tokens: 128, runs: 5, window: 4096, max_batch: 0 };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut num = || -> usize {
            it.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| fail(&format!("{arg} takes a number")))
        };
        match arg.as_str() {
            "--layers" => args.layers = num(),
            "--prompt" => args.prompt = num(),
            "--tokens" => args.tokens = num(),
            "--runs" => args.runs = num(),
            "--window" => args.window = num() as u32,
            "--max-batch" => args.max_batch = num() as u32,
            flag if flag.starts_with("--") => {
                fail(&format!("unknown flag {flag} (see the comment at the top of examples/bench_placements.rs)"))
            }
            dir => args.dir = PathBuf::from(dir),
        }
    }
    if args.layers == 0 || args.prompt == 0 || args.runs == 0 {
        fail("--layers, --prompt and --runs must be positive");
    }
    if args.prompt + args.tokens + 1 > args.window as usize {
        fail(&format!(
            "a {}-token window holds no {}-token prompt and {} tokens",
            args.window, args.prompt, args.tokens
        ));
    }
    args
}

fn fail(message: &str) -> ! {
    eprintln!("bench_placements: {message}");
    std::process::exit(2)
}

/// Llama-3-8B's shape with `layers` layers.
fn llama3_8b(layers: usize) -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab: 128_256,
        hidden: 4096,
        layers,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 14_336,
        rms_eps: 1e-5,
        rope_theta: 500_000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 8192,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: Some(128_000),
        eos: Some(128_001),
        moe: None,
    }
}

fn same_shape(a: &ModelConfig, b: &ModelConfig) -> bool {
    let shape = |c: &ModelConfig| {
        (c.arch, c.vocab, c.hidden, c.layers, c.heads, c.kv_heads, c.head_dim, c.intermediate, c.tied, c.max_position)
    };
    shape(a) == shape(b) && a.rope_theta == b.rope_theta
}

/// The checkpoint at `dir/name`: reused when it opens with this shape in BF16, else written beside it and
/// renamed into place when complete (an interrupted write is never mistaken for a checkpoint).
fn checkpoint(dir: &Path, cfg: &ModelConfig) -> PathBuf {
    let path = dir.join(format!("llama3-8b-shape-{}-layers-bf16", cfg.layers));
    if let Ok(c) = Checkpoint::open(&path) {
        if same_shape(&c.config, cfg) && c.embed().dtype == DType::Bf16 {
            println!("reusing {} ({:.2} GiB)", path.display(), c.weight_bytes() as f64 / GIB);
            return path;
        }
        println!("{} holds another model: writing it again", path.display());
    }
    let partial = dir.join(format!("llama3-8b-shape-{}-layers-bf16.partial", cfg.layers));
    let _ = std::fs::remove_dir_all(&partial);
    let _ = std::fs::remove_dir_all(&path);
    std::fs::create_dir_all(dir).unwrap_or_else(|e| fail(&format!("{}: {e}", dir.display())));
    let t = Instant::now();
    write_synthetic_hf(&partial, cfg, WEIGHTS_SEED, DType::Bf16).unwrap_or_else(|e| fail(&e.to_string()));
    std::fs::rename(&partial, &path).unwrap_or_else(|e| fail(&format!("{}: {e}", path.display())));
    let bytes = Checkpoint::open(&path).unwrap_or_else(|e| fail(&e.to_string())).weight_bytes();
    let secs = t.elapsed().as_secs_f64();
    println!(
        "wrote {} ({:.2} GiB in {secs:.0} s, {:.1} GB/s)",
        path.display(),
        bytes as f64 / GIB,
        bytes as f64 / secs / 1e9
    );
    path
}

/// The log lines of the engine being started.
static LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn collect_lines(_user: *mut c_void, line: *const c_char) {
    // SAFETY: the library passes a NUL-terminated line that lives for the call.
    let line = unsafe { CStr::from_ptr(line) }.to_string_lossy().into_owned();
    LOG.lock().unwrap_or_else(|p| p.into_inner()).push(line);
}

fn take_log() -> Vec<String> {
    std::mem::take(&mut *LOG.lock().unwrap_or_else(|p| p.into_inner()))
}

fn device_info() -> engine_device_info {
    // SAFETY: engine_device_info is numbers, bools and a byte array: all zeros is a value of it.
    let mut info: engine_device_info = unsafe { std::mem::zeroed() };
    // SAFETY: a writable engine_device_info.
    if unsafe { ffi::engine_device_info(0, &mut info) } != Status::Ok {
        fail(&format!("no CUDA device: {}", last_error()));
    }
    info
}

fn free_device_bytes() -> u64 {
    cuda::mem_info().unwrap_or_else(|e| fail(&e.to_string())).0
}

fn memory_stats() -> engine_memory {
    let mut m = engine_memory::default();
    // SAFETY: a writable engine_memory.
    unsafe { ffi::engine_memory_stats(&mut m) };
    m
}

/// The options that put the rows in `placement`: the probed room (DEVICE), one byte short of the fit
/// rule's need (HOST_MAPPED), or the probed room with mmap_rows set (FILE_MAPPED).
fn options_for(placement: engine_placement, base: engine_options, need: u64) -> engine_options {
    match placement {
        engine_placement::Device => engine_options { mmap_rows: engine_tristate::No, ..base },
        engine_placement::HostMapped => engine_options { room_bytes: need - 1, mmap_rows: engine_tristate::No, ..base },
        engine_placement::FileMapped => engine_options { mmap_rows: engine_tristate::Yes, ..base },
    }
}

fn name(p: engine_placement) -> &'static str {
    match p {
        engine_placement::Device => "DEVICE",
        engine_placement::HostMapped => "HOST_MAPPED",
        engine_placement::FileMapped => "FILE_MAPPED",
    }
}

/// An engine freed when dropped.
struct Held(*mut ffi::engine);

impl Drop for Held {
    fn drop(&mut self) {
        // SAFETY: the engine from engine_init_fit that this Held alone holds; nothing uses it after the drop.
        unsafe { ffi::engine_free(self.0) };
    }
}

fn step(e: &Held, tokens: &[i32]) -> i32 {
    let mut next = -1;
    // SAFETY: a live engine, tokens.len() ids and a writable `next`.
    let st = unsafe { ffi::engine_step(e.0, 0, tokens.as_ptr(), tokens.len(), &mut next) };
    if st != Status::Ok {
        fail(&format!("engine_step: {}", last_error()));
    }
    next
}

fn reset(e: &Held) {
    // SAFETY: a live engine.
    if unsafe { ffi::engine_reset(e.0, 0) } != Status::Ok {
        fail(&format!("engine_reset: {}", last_error()));
    }
}

/// One run: the prompt in one step, then `tokens` steps of one token. Prompt tok/s, decode tok/s, and
/// the chosen ids (the prompt's next token, then one per decode step).
fn run(e: &Held, prompt: &[i32], tokens: usize) -> (f64, f64, Vec<i32>) {
    let t = Instant::now();
    let mut ids = vec![step(e, prompt)];
    let prompt_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for _ in 0..tokens {
        ids.push(step(e, &[*ids.last().unwrap()]));
    }
    let decode_s = t.elapsed().as_secs_f64();
    reset(e);
    (prompt.len() as f64 / prompt_s, tokens as f64 / decode_s, ids)
}

/// SHA-256 of the token ids as little-endian i32s, in hex.
fn sha256_hex(tokens: &[i32]) -> String {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// What one engine measured.
struct Cell {
    prompt_rates: Vec<f64>,
    decode_rates: Vec<f64>,
    shas: Vec<String>,
    /// Device memory the load took (cudaMemGetInfo before and after engine_init_fit).
    load_bytes: u64,
    host_rows_bytes: u64,
}

/// Today's date in UTC, from the days since 1970 (the civil calendar's rule).
fn utc_date() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

fn change(base: f64, x: f64) -> String {
    let pct = 100.0 * (x - base) / base;
    if pct.abs() < 0.05 { "0.0%".to_string() } else { format!("{pct:+.1}%").replace('-', "\u{2212}") }
}

fn main() {
    let args = parse();
    let info = device_info();
    // SAFETY: device_info's engine_device_info holds a NUL-terminated `name`.
    let card = unsafe { CStr::from_ptr(info.name.as_ptr()) }.to_string_lossy().into_owned();
    let cfg = llama3_8b(args.layers);
    let path = checkpoint(&args.dir, &cfg);
    let ckpt = Checkpoint::open(&path).unwrap_or_else(|e| fail(&e.to_string()));
    let table_bytes = ckpt.embed().bytes as u64;

    let base = engine_options {
        backend: engine_backend::Cuda,
        context: args.window,
        max_streams: 1,
        max_batch: args.max_batch,
        log: Some(collect_lines),
        ..engine::default_options()
    };
    let need = {
        let inputs = engine::fit_inputs(&ckpt, &base, Some(&info)).unwrap_or_else(|e| fail(&e.to_string()));
        fit::plan(&inputs).unwrap_or_else(|e| fail(&e.to_string())).need_bytes
    };
    drop(ckpt);
    let prompt: Vec<i32> = (0..args.prompt as i32).map(|i| (i * 7919 + 13) % cfg.vocab as i32).collect();
    let sampled = engine_options { temperature: 0.8, top_k: 40, top_p: 0.95, seed: 1, ..base };
    println!(
        "{card}, {} (UTC): Llama-3-8B shape with {} layers, BF16, untied, random weights; batch 1, a {}-token \
         window, {} tokens after a {}-token prompt, median of {} runs after one warm-up",
        utc_date(),
        cfg.layers,
        args.window,
        args.tokens,
        args.prompt,
        args.runs
    );

    let mut ok = true;
    let mut cells: Vec<(&str, Vec<Cell>)> = Vec::new();
    for (mode, mode_opts) in [("greedy", base), ("sampled", sampled)] {
        let mut row = Vec::new();
        for placement in PLACEMENTS {
            let opts = options_for(placement, mode_opts, need);
            take_log();
            let before = free_device_bytes();
            let mut raw = std::ptr::null_mut();
            // SAFETY: a NUL-terminated path (a temporary living to the statement's end), options, a writable handle.
            let st = unsafe {
                ffi::engine_init_fit(CString::new(path.to_str().unwrap()).unwrap().as_ptr(), &opts, &mut raw)
            };
            if st != Status::Ok {
                fail(&format!("engine_init_fit ({} {mode}): {}", name(placement), last_error()));
            }
            let e = Held(raw);
            let load_bytes = before.saturating_sub(free_device_bytes());
            for l in take_log() {
                println!("{} {mode}: {l}", name(placement));
            }
            // SAFETY: engine_model_info is numbers, bools and enums with a variant at 0: all zeros is a value of it.
            let mut mi: engine_model_info = unsafe { std::mem::zeroed() };
            // SAFETY: a live engine and a writable engine_model_info.
            unsafe { ffi::engine_model_info(e.0, &mut mi) };
            if mi.placement != placement || !mi.cuda {
                println!("{} {mode}: the rows went to {} (cuda {})", name(placement), name(mi.placement), mi.cuda);
                ok = false;
            }
            // SAFETY: engine_plan is numbers and enums with a variant at 0: all zeros is a value of it.
            let mut plan: fit::engine_plan = unsafe { std::mem::zeroed() };
            // SAFETY: a live engine and a writable engine_plan.
            if unsafe { ffi::engine_plan_of(e.0, &mut plan) } != Status::Ok {
                fail(&format!("engine_plan_of: {}", last_error()));
            }
            // The warm-up run: first launches, graph captures, the stream's KV cache.
            run(&e, &prompt, args.tokens);
            let mut cell = Cell {
                prompt_rates: vec![],
                decode_rates: vec![],
                shas: vec![],
                load_bytes,
                host_rows_bytes: plan.embed_host_bytes,
            };
            for _ in 0..args.runs {
                let (p, d, ids) = run(&e, &prompt, args.tokens);
                cell.prompt_rates.push(p);
                cell.decode_rates.push(d);
                cell.shas.push(sha256_hex(&ids));
            }
            println!(
                "{} {mode}: decode {:.1} tok/s, prompt {:.0} tok/s (runs: {})",
                name(placement),
                median(&cell.decode_rates),
                median(&cell.prompt_rates),
                cell.decode_rates.iter().map(|r| format!("{r:.1}")).collect::<Vec<_>>().join(" ")
            );
            drop(e);
            let left = memory_stats();
            if left != engine_memory::default() {
                println!("{} {mode}: held after engine_free: {left:?}", name(placement));
                ok = false;
            }
            row.push(cell);
        }
        cells.push((mode, row));
    }

    println!();
    println!("| cell | DEVICE tok/s | HOST_MAPPED tok/s | change | FILE_MAPPED tok/s | change |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for (what, rates) in [("decode", 0), ("prompt", 1)] {
        for (mode, row) in &cells {
            let m: Vec<f64> =
                row.iter().map(|c| median(if rates == 0 { &c.decode_rates } else { &c.prompt_rates })).collect();
            let fmt = |x: f64| if rates == 0 { format!("{x:.1}") } else { format!("{x:.0}") };
            println!(
                "| {what}, {mode} | {} | {} | {} | {} | {} |",
                fmt(m[0]),
                fmt(m[1]),
                change(m[0], m[1]),
                fmt(m[2]),
                change(m[0], m[2])
            );
        }
    }

    let greedy = median(&cells[0].1[0].decode_rates);
    println!("\nbatch-1 decode, DEVICE, greedy: {greedy:.1} tok/s, {:.2} ms a token", 1e3 / greedy);
    println!();
    for (mode, row) in &cells {
        let first = &row[0].shas[0];
        let same = row.iter().all(|c| c.shas.iter().all(|s| s == first));
        let runs = row.iter().map(|c| c.shas.len()).sum::<usize>();
        if same {
            println!(
                "token_sha256 {mode}: {first} identical ({} placements x {} runs, {runs} runs)",
                row.len(),
                args.runs
            );
        } else {
            ok = false;
            println!("token_sha256 {mode}: DIFFER");
            for (placement, c) in PLACEMENTS.iter().zip(row) {
                println!("  {}: {}", name(*placement), c.shas.join(" "));
            }
        }
    }

    // The second pass's loads, made after every kernel module was loaded once.
    let (_, row) = cells.last().unwrap();
    println!();
    println!(
        "device memory taken by each load (cudaMemGetInfo before and after engine_init_fit; the embedding table \
         is {:.2} GiB, {table_bytes} bytes)",
        table_bytes as f64 / GIB
    );
    println!("| placement | on the card | saved | rows in host memory |");
    println!("| --- | --- | --- | --- |");
    for (placement, c) in PLACEMENTS.iter().zip(row) {
        let saved = row[0].load_bytes as f64 - c.load_bytes as f64;
        println!(
            "| {} | {:.2} GiB | {:.2} GiB | {:.2} GiB |",
            name(*placement),
            c.load_bytes as f64 / GIB,
            saved / GIB,
            c.host_rows_bytes as f64 / GIB
        );
    }
    if !ok {
        std::process::exit(1);
    }
}
