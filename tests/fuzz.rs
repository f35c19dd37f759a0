//! A bounded, deterministic mutation fuzzer over both checkpoint formats: the safetensors header (dtypes,
//! shapes, offsets, its length), GGUF metadata (typed values and raw bytes), config.json and
//! tokenizer.json of a tiny generated model. Each case loads in a forked child through the C ABI (and
//! steps, tokenizes and reads a piece when it loads); a crash, an abort, a signal, a hang, a PANIC status
//! or a byte on stderr fails the run, with the case's files kept under target/fuzz-failures/<case>/.
//!
//! Runs without the test harness so the process stays single-threaded and `fork` is safe.
//! HOSTEMBED_FUZZ_CASES sets the number of cases (default 2000), HOSTEMBED_FUZZ_SEED the seed.

mod common;

use common::{Rng, c_path, quiet};
use hostembed::Status;
use hostembed::checkpoint::gguf::GgufValue;
use hostembed::checkpoint::write::{gguf_metadata, synthetic_weights, write_gguf, write_hf_folder};
use hostembed::engine::{self, engine_backend, engine_options};
use hostembed::ffi;
use hostembed::model::{Arch, ModelConfig, RopeScaling};
use hostembed::tensor::DType;
use hostembed::tokenizer;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The child's exit code when a call after a successful load returned PANIC.
const EXIT_PANIC_AFTER_LOAD: i32 = 70;
/// How long a case may run before it counts as a hang.
const CASE_LIMIT: Duration = Duration::from_secs(5);

fn config() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab: 512,
        hidden: 32,
        layers: 1,
        heads: 2,
        kv_heads: 1,
        head_dim: 16,
        intermediate: 64,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 128,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: Some(0),
        eos: Some(1),
        moe: None,
    }
}

fn asset(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("assets").join(name)
}

/// Values that sit on the edges every parser has to check.
fn odd_json(rng: &mut Rng) -> Value {
    match rng.below(16) {
        0 => json!(0),
        1 => json!(-1),
        2 => json!(1u64 << 28),
        3 => json!(u32::MAX),
        4 => json!(u64::MAX),
        5 => json!(1e308),
        6 => json!(""),
        7 => json!("x"),
        8 => Value::Null,
        9 => json!(true),
        10 => json!([]),
        11 => json!({}),
        12 => json!("F64"),
        13 => json!([u32::MAX, 1]),
        14 => json!(i64::MIN),
        _ => json!(rng.below(1 << 20)),
    }
}

/// Every place in a JSON tree, as a path of keys and indices.
fn places(v: &Value, at: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    out.push(at.clone());
    match v {
        Value::Object(map) => map.iter().for_each(|(k, c)| {
            at.push(k.clone());
            places(c, at, out);
            at.pop();
        }),
        Value::Array(items) => items.iter().enumerate().for_each(|(i, c)| {
            at.push(i.to_string());
            places(c, at, out);
            at.pop();
        }),
        _ => {}
    }
}

fn place_mut<'a>(v: &'a mut Value, path: &[String]) -> &'a mut Value {
    path.iter().fold(v, |v, key| match v {
        Value::Object(map) => map.get_mut(key).unwrap(),
        Value::Array(items) => &mut items[key.parse::<usize>().unwrap()],
        _ => unreachable!(),
    })
}

/// One to three edits of a JSON tree: a value replaced by an odd one, a key removed, a number nudged,
/// a string emptied or grown.
fn mutate_json(v: &mut Value, rng: &mut Rng) {
    for _ in 0..1 + rng.below(3) {
        let mut all = Vec::new();
        places(v, &mut Vec::new(), &mut all);
        // Leaves deep in big lists would crowd out the top-level keys: pick the depth first.
        let depth = rng.below(all.iter().map(|p| p.len() as u64).max().unwrap_or(0) + 1) as usize;
        let at_depth: Vec<&Vec<String>> = all.iter().filter(|p| p.len() == depth).collect();
        let path = at_depth[rng.below(at_depth.len() as u64) as usize].clone();
        if path.is_empty() {
            continue;
        }
        let (parent, key) = path.split_at(path.len() - 1);
        let node = place_mut(v, &path);
        match rng.below(5) {
            0 => {
                if let Value::Object(map) = place_mut(v, parent) {
                    map.remove(&key[0]);
                }
            }
            1 => {
                if let Some(n) = node.as_i64() {
                    *node = json!(n + rng.below(5) as i64 - 2);
                } else {
                    *node = odd_json(rng);
                }
            }
            2 => {
                if node.is_string() {
                    *node = json!(if rng.below(2) == 0 { String::new() } else { "\u{0120}".repeat(64) });
                } else {
                    *node = odd_json(rng);
                }
            }
            _ => *node = odd_json(rng),
        }
    }
}

fn flip_bytes(bytes: &mut Vec<u8>, rng: &mut Rng, within: usize) {
    let within = within.min(bytes.len()).max(1);
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(within as u64) as usize;
        if at >= bytes.len() {
            continue;
        }
        match rng.below(4) {
            0 => bytes[at] = rng.below(256) as u8,
            1 => bytes[at] ^= 1 << rng.below(8),
            2 => {
                let odd = [0u64, 1, 0xFFFF_FFFF, 0x7FFF_FFFF, 1 << 28, u64::MAX, 1 << 40][rng.below(7) as usize];
                let end = (at + 8).min(bytes.len());
                bytes[at..end].copy_from_slice(&odd.to_le_bytes()[..end - at]);
            }
            _ => bytes.truncate(at),
        }
    }
}

/// The unmutated model, both formats, kept in memory.
struct Base {
    cfg: ModelConfig,
    config_json: Value,
    safetensors: Vec<u8>,
    tokenizer_json: Value,
    gguf_kv: Vec<(String, GgufValue)>,
    gguf: Vec<u8>,
}

fn base(dir: &Path) -> Base {
    let cfg = config();
    let hf = dir.join("base-hf");
    std::fs::create_dir_all(&hf).unwrap();
    let weights = synthetic_weights(&cfg, 3, DType::F32);
    write_hf_folder(&hf, &cfg, &weights, 1).unwrap();
    let vocab = tokenizer::gguf_bpe_vocab(&asset("tokenizer.json")).unwrap();
    let tokenizer_kv = vocab.gguf_kv("gpt-2");
    let gguf_path = dir.join("base.gguf");
    write_gguf(&gguf_path, &cfg, &weights, &tokenizer_kv).unwrap();
    let mut gguf_kv = gguf_metadata(&cfg).unwrap();
    gguf_kv.extend(tokenizer_kv);
    Base {
        config_json: serde_json::from_slice(&std::fs::read(hf.join("config.json")).unwrap()).unwrap(),
        safetensors: std::fs::read(hf.join("model.safetensors")).unwrap(),
        tokenizer_json: serde_json::from_slice(&std::fs::read(asset("tokenizer.json")).unwrap()).unwrap(),
        gguf: std::fs::read(&gguf_path).unwrap(),
        gguf_kv,
        cfg,
    }
}

/// A GGUF value of a random kind, near the edges.
fn odd_gguf(rng: &mut Rng, old: &GgufValue) -> GgufValue {
    match rng.below(9) {
        0 => GgufValue::U32([0, 1, u32::MAX, 1 << 28][rng.below(4) as usize]),
        1 => GgufValue::U64([0, u64::MAX, 1 << 40][rng.below(3) as usize]),
        2 => GgufValue::F32([0.0, -1.0, f32::NAN, f32::INFINITY, 1e30][rng.below(5) as usize]),
        3 => GgufValue::String(["", "llama", "qwen2", "gpt2", "x"][rng.below(5) as usize].into()),
        4 => GgufValue::ArrayString(vec![String::new(); rng.below(4) as usize]),
        5 => GgufValue::ArrayI32(vec![-1, 7, i32::MAX]),
        6 => match old {
            GgufValue::ArrayString(items) if !items.is_empty() => {
                let mut items = items.clone();
                let i = rng.below(items.len() as u64) as usize;
                match rng.below(3) {
                    0 => items[i] = items[rng.below(items.len() as u64) as usize].repeat(2),
                    1 => items[i] = format!("{} {}", items[i], items[i]),
                    _ => {
                        items.truncate(i);
                    }
                }
                GgufValue::ArrayString(items)
            }
            _ => GgufValue::U32(u32::MAX),
        },
        _ => match old {
            GgufValue::U32(v) => GgufValue::U32(v.wrapping_add(rng.below(3) as u32).wrapping_sub(1)),
            _ => GgufValue::Bool(true),
        },
    }
}

/// Writes case `case`'s files into `dir` and returns the path to load and what was mutated.
fn write_case(base: &Base, dir: &Path, rng: &mut Rng) -> (PathBuf, &'static str) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    let mut config_json = base.config_json.clone();
    let mut safetensors = base.safetensors.clone();
    let mut tokenizer_json = serde_json::to_vec(&base.tokenizer_json).unwrap();
    let kind = match rng.below(8) {
        0 | 1 => {
            // The safetensors header: its JSON (dtypes, shapes, offsets) and sometimes its length.
            let len = u64::from_le_bytes(safetensors[..8].try_into().unwrap()) as usize;
            let mut header: Value = serde_json::from_slice(&safetensors[8..8 + len]).unwrap();
            mutate_json(&mut header, rng);
            let text = serde_json::to_vec(&header).unwrap();
            let mut out = (text.len() as u64).to_le_bytes().to_vec();
            out.extend_from_slice(&text);
            out.extend_from_slice(&safetensors[8 + len..]);
            if rng.below(4) == 0 {
                flip_bytes(&mut out, rng, 8 + text.len());
            }
            safetensors = out;
            "safetensors header"
        }
        2 => {
            mutate_json(&mut config_json, rng);
            "config.json"
        }
        3 | 4 => {
            let mut t = base.tokenizer_json.clone();
            mutate_json(&mut t, rng);
            tokenizer_json = serde_json::to_vec(&t).unwrap();
            if rng.below(4) == 0 {
                let len = tokenizer_json.len();
                flip_bytes(&mut tokenizer_json, rng, len);
            }
            "tokenizer.json"
        }
        5 | 6 => {
            // GGUF metadata, typed: one key's value replaced.
            let mut kv = base.gguf_kv.clone();
            let i = rng.below(kv.len() as u64) as usize;
            kv[i].1 = odd_gguf(rng, &kv[i].1);
            let weights = synthetic_weights(&base.cfg, 3, DType::F32);
            let path = dir.join("model.gguf");
            if write_gguf(&path, &base.cfg, &weights, &kv).is_ok() {
                return (path, "GGUF metadata");
            }
            std::fs::write(&path, &base.gguf).unwrap();
            return (path, "GGUF metadata");
        }
        _ => {
            // GGUF bytes: the metadata and tensor table at the front, or a truncation.
            let mut gguf = base.gguf.clone();
            let front = gguf.len() / 3;
            flip_bytes(&mut gguf, rng, front);
            let path = dir.join("model.gguf");
            std::fs::write(&path, &gguf).unwrap();
            return (path, "GGUF bytes");
        }
    };
    std::fs::write(hf.join("config.json"), serde_json::to_vec(&config_json).unwrap()).unwrap();
    std::fs::write(hf.join("model.safetensors"), &safetensors).unwrap();
    std::fs::write(hf.join("tokenizer.json"), &tokenizer_json).unwrap();
    (hf, kind)
}

/// In the child: load, and use what loaded; the exit code says how it went.
fn child(path: &Path) -> i32 {
    let opts = engine_options {
        backend: engine_backend::Cpu,
        room_bytes: 1 << 30,
        log: Some(quiet),
        ..engine::default_options()
    };
    let mut e = std::ptr::null_mut();
    // SAFETY: a NUL-terminated path that lives across the call, live options and a writable handle.
    let st = unsafe { ffi::engine_init_fit(c_path(path).as_ptr(), &opts, &mut e) };
    if st != Status::Ok {
        return st as i32;
    }
    let mut next = 0;
    let mut n = 0usize;
    let mut ids = [0i32; 64];
    let text = "hostembed rows, 12345 and é";
    let statuses = [
        // SAFETY: a live engine, two token ids and a writable `next`.
        unsafe { ffi::engine_step(e, 0, [1i32, 2].as_ptr(), 2, &mut next) },
        // SAFETY: a live engine, text.len() bytes of text, room for 64 ids and a writable count.
        unsafe { ffi::engine_tokenize(e, text.as_ptr() as *const _, text.len(), 1, ids.as_mut_ptr(), 64, &mut n) },
        // SAFETY: a live engine.
        unsafe { ffi::engine_reset(e, 0) },
    ];
    // SAFETY: a live engine; a NULL buffer of length 0 is never written.
    let piece = unsafe { ffi::engine_token_piece(e, 5, std::ptr::null_mut(), 0) };
    // SAFETY: the engine from engine_init_fit, no other call on it running or to come.
    unsafe { ffi::engine_free(e) };
    if statuses.contains(&Status::Panic) || piece == -(Status::Panic as i32) {
        return EXIT_PANIC_AFTER_LOAD;
    }
    0
}

enum Outcome {
    Exited(i32),
    Signal(i32),
    Hung,
}

/// Runs one case in a forked child with stderr in `stderr_path`; kills it past `CASE_LIMIT`.
fn run_case(path: &Path, stderr_path: &Path) -> Outcome {
    let stderr_file = std::fs::File::create(stderr_path).unwrap();
    // SAFETY: this process has one thread (no test harness), so the child may run any code.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        use std::os::fd::AsRawFd;
        // SAFETY: in the child: stderr becomes the case's file, and an address-space cap turns an
        // allocation the library did not check into an abort the parent sees.
        unsafe {
            libc::dup2(stderr_file.as_raw_fd(), 2);
            let cap = libc::rlimit { rlim_cur: 8 << 30, rlim_max: 8 << 30 };
            libc::setrlimit(libc::RLIMIT_AS, &cap);
        }
        let code = child(path);
        // SAFETY: leaves the child at once, without running the parent's exit handlers.
        unsafe { libc::_exit(code) };
    }
    let start = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: waits for our own child without blocking.
        let done = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if done == pid {
            if libc::WIFEXITED(status) {
                return Outcome::Exited(libc::WEXITSTATUS(status));
            }
            return Outcome::Signal(libc::WTERMSIG(status));
        }
        if start.elapsed() > CASE_LIMIT {
            // SAFETY: kills and reaps our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return Outcome::Hung;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn status_name(code: i32) -> String {
    Status::from_raw(code as i64).map_or(format!("exit {code}"), |s| s.as_str().to_string())
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

fn main() {
    let cases: u64 = std::env::var("HOSTEMBED_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(2000);
    let seed: u64 = std::env::var("HOSTEMBED_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x66757a7a);
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    let work = target.join(format!("fuzz-work-{}", std::process::id()));
    let failures = target.join("fuzz-failures");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let base = base(&work);
    let started = Instant::now();
    let (mut loaded, mut refused, mut failed) = (0u64, BTreeMap::<String, u64>::new(), Vec::new());
    for case in 0..cases {
        let mut rng = Rng(seed ^ case.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let dir = work.join("case");
        let (path, kind) = write_case(&base, &dir, &mut rng);
        let stderr_path = work.join("stderr");
        let outcome = run_case(&path, &stderr_path);
        let printed = std::fs::read(&stderr_path).unwrap_or_default();
        let failure = match outcome {
            Outcome::Exited(0) => None,
            Outcome::Exited(EXIT_PANIC_AFTER_LOAD) => Some("a call after the load returned PANIC".to_string()),
            Outcome::Exited(code) if code == Status::Panic as i32 => Some("the load returned PANIC".to_string()),
            Outcome::Exited(code) if Status::from_raw(code as i64).is_some() => None,
            Outcome::Exited(code) => Some(format!("exited with {code}")),
            Outcome::Signal(signal) => Some(format!("killed by signal {signal}")),
            Outcome::Hung => Some(format!("still running after {CASE_LIMIT:?}")),
        };
        let failure = failure.or_else(|| {
            (!printed.is_empty()).then(|| format!("printed on stderr: {}", String::from_utf8_lossy(&printed)))
        });
        match (&failure, &outcome) {
            (Some(why), _) => {
                let keep = failures.join(format!("case-{case}"));
                let _ = std::fs::remove_dir_all(&keep);
                copy_dir(&dir, &keep);
                std::fs::write(keep.join("why.txt"), format!("{kind}: {why}\n")).unwrap();
                println!("case {case} ({kind}): {why}; files in {}", keep.display());
                failed.push((case, matches!(outcome, Outcome::Hung)));
            }
            (None, Outcome::Exited(0)) => loaded += 1,
            (None, Outcome::Exited(code)) => *refused.entry(status_name(*code)).or_default() += 1,
            (None, _) => unreachable!(),
        }
    }
    let _ = std::fs::remove_dir_all(&work);
    let refused_total: u64 = refused.values().sum();
    let breakdown: Vec<String> = refused.iter().map(|(s, n)| format!("{s} {n}")).collect();
    println!(
        "fuzz: {cases} cases (seed {seed}) in {:.1} s: {loaded} loaded, {refused_total} refused ({}), {} crashed or \
         misbehaved, {} hung",
        started.elapsed().as_secs_f64(),
        breakdown.join(", "),
        failed.iter().filter(|f| !f.1).count(),
        failed.iter().filter(|f| f.1).count()
    );
    if !failed.is_empty() {
        let cases: Vec<u64> = failed.iter().map(|f| f.0).collect();
        println!("fuzz: failing cases {cases:?}, kept under {}", failures.display());
        std::process::exit(1);
    }
}
