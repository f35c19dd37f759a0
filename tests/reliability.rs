//! Inputs and misuse that once killed or corrupted the host process, each written here as a small file,
//! now return clear statuses and print nothing; one engine stepped from 8 threads gives every stream
//! the tokens of a serial run; load-tokenize-free cycles hold no memory after the engine is freed.

mod common;

use common::{Held, Rng, Scratch, c_path, info, init, serial, step, tokenize};
use hostembed::Status;
use hostembed::checkpoint::write::{synthetic_weights, write_gguf};
use hostembed::engine::{self, engine_backend, engine_options};
use hostembed::ffi;
use hostembed::fit;
use hostembed::model::ModelConfig;
use hostembed::status::last_error;
use hostembed::tensor::DType;
use hostembed::tokenizer;
use serde_json::{Value, json};
use std::ffi::{CStr, c_char, c_void};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

/// A small Llama whose vocabulary is the committed tokenizer's.
fn config() -> ModelConfig {
    ModelConfig {
        rope_theta: 10000.0,
        max_position: 256,
        bos: Some(0),
        eos: Some(1),
        ..ModelConfig::llama(64, 2, 4, 2, 128, 512)
    }
}

fn asset(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("assets").join(name)
}

fn committed_tokenizer() -> Value {
    serde_json::from_slice(&std::fs::read(asset("tokenizer.json")).unwrap()).unwrap()
}

/// Log lines the library wrote, kept for the test to read (nothing goes to stderr).
static LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn keep(_user: *mut c_void, line: *const c_char) {
    // SAFETY: the library passes a NUL-terminated line valid for the call.
    let line = unsafe { CStr::from_ptr(line) }.to_string_lossy().into_owned();
    LOG.lock().unwrap_or_else(|p| p.into_inner()).push(line);
}

fn cpu_options() -> engine_options {
    engine_options { backend: engine_backend::Cpu, log: Some(keep), ..engine::default_options() }
}

/// engine_init_fit's status (the engine freed at once when it loaded).
fn try_init(path: &Path, opts: &engine_options) -> Status {
    let mut e = std::ptr::null_mut();
    // SAFETY: a NUL-terminated path that lives across the call, live options and a writable handle.
    let st = unsafe { ffi::engine_init_fit(c_path(path).as_ptr(), opts, &mut e) };
    assert_eq!(st == Status::Ok, !e.is_null(), "an engine exactly when the status is OK");
    // SAFETY: the engine from engine_init_fit, or NULL, which engine_free accepts; no other call on it.
    unsafe { ffi::engine_free(e) };
    st
}

/// An HF folder of `cfg` with `tokenizer` (a tokenizer.json's text) beside it when given.
fn hf_with(dir: &Scratch, name: &str, cfg: &ModelConfig, tokenizer: Option<&str>) -> PathBuf {
    let path = dir.hf(name, cfg, 5, DType::F32);
    if let Some(text) = tokenizer {
        std::fs::write(path.join("tokenizer.json"), text).unwrap();
    }
    path
}

fn expect(what: &str, got: Status, want: Status) {
    assert_eq!(got, want, "{what}: {}", last_error());
}

/// Reproducer 1: windows and stream counts the input asks for are planned against host memory.
fn huge_windows_and_stream_counts(dir: &Scratch) {
    let cfg = ModelConfig { max_position: 1 << 28, ..config() };
    let big = hf_with(dir, "window-2-28", &cfg, None);
    LOG.lock().unwrap().clear();
    expect("a config asking a 2^28 window", try_init(&big, &cpu_options()), Status::NoRoom);
    let why = last_error();
    assert!(why.contains("268435456-token window"), "{why}");
    // The refusal carries the start-up line's figures.
    let line = LOG.lock().unwrap().last().cloned().unwrap_or_default();
    assert!(line.ends_with(&why), "start-up line {line:?} does not end with the refusal {why:?}");

    let small = hf_with(dir, "small", &config(), None);
    let opts = engine_options { context: u32::MAX, ..cpu_options() };
    expect("options.context = UINT32_MAX", try_init(&small, &opts), Status::NoRoom);
    assert!(last_error().contains("4294967295-token window"), "{}", last_error());

    // A pool of every full window that fits the room given; as many streams as it has pages.
    let room = 64u64 << 20;
    let opts = engine_options { max_streams: u32::MAX, room_bytes: room, ..cpu_options() };
    let e = init(&small, &opts);
    let c = config();
    let f32_kv = hostembed::kv::KvTypes::CPU_DEFAULT;
    let kv = fit::cpu_kv_bytes(c.layers as u64, c.max_position as u64, c.kv_heads as u64, c.head_dim as u64, f32_kv)
        .unwrap();
    let (mut pool, mut free) = (0u64, 0u64);
    // SAFETY: a live engine and two writable counters.
    assert_eq!(unsafe { ffi::engine_kv_stats(e.0, &mut pool, &mut free) }, Status::Ok);
    let windows = pool / c.max_position as u64;
    assert!(windows > engine::CPU_STREAMS as u64 && windows * kv <= room, "{windows} windows of {kv} bytes in {room}");
    assert!(room / kv - windows <= room / kv / 100, "{windows} windows where {} fit", room / kv);
    let streams = info(&e).streams as u64;
    assert_eq!(streams, pool / hostembed::cpu::PAGE_TOKENS as u64, "a stream a page");
    let last = (streams - 1) as u32;
    assert!(step(&e, last, &[3, 4]) >= 0);
    drop(e);

    // A caller's room that is not there: the plan admits the stream, its KV pool (2^48 bytes per layer,
    // past any address space) is refused at the load instead of aborting.
    let wide =
        ModelConfig { heads: 128, kv_heads: 128, head_dim: 128, hidden: 32, intermediate: 32, layers: 1, ..config() };
    let wide = hf_with(dir, "wide", &wide, None);
    let opts = engine_options { context: u32::MAX, max_streams: 1, room_bytes: u64::MAX, ..cpu_options() };
    expect("a KV pool that cannot be had", try_init(&wide, &opts), Status::NoRoom);
    assert!(last_error().contains("KV"), "{}", last_error());
}

/// Reproducers 2 and 3: tokenizer data the `tokenizers` crate would abort or panic on.
fn broken_tokenizers(dir: &Scratch) {
    let mut huge_id = committed_tokenizer();
    huge_id["added_tokens"].as_array_mut().unwrap().push(json!({
        "id": u32::MAX, "content": "<|huge|>", "single_word": false, "lstrip": false, "rstrip": false,
        "normalized": false, "special": true
    }));
    let path = hf_with(dir, "huge-id", &config(), Some(&huge_id.to_string()));
    expect("an id of 2^32-1 in tokenizer.json", try_init(&path, &cpu_options()), Status::BadModel);
    assert!(last_error().contains("4294967295"), "{}", last_error());

    // An id the tokenizer has but the model lacks.
    let path =
        hf_with(dir, "past-model", &ModelConfig { vocab: 500, ..config() }, Some(&committed_tokenizer().to_string()));
    expect("tokenizer ids past the model's vocabulary", try_init(&path, &cpu_options()), Status::BadModel);

    let mut empty_replace = committed_tokenizer();
    empty_replace["normalizer"] = json!({"type": "Replace", "pattern": {"String": ""}, "content": "x"});
    let path = hf_with(dir, "empty-replace", &config(), Some(&empty_replace.to_string()));
    expect("a Replace with an empty pattern", try_init(&path, &cpu_options()), Status::BadModel);
    assert!(last_error().contains("empty pattern"), "{}", last_error());

    // An escape error inside "decoder", and a decoder the crate cannot read at all (it panics there).
    let text = committed_tokenizer().to_string();
    let bad_escape = text.replacen("\"decoder\":{", "\"decoder\":{\"bad\":\"\\uZZ\",", 1);
    assert_ne!(bad_escape, text, "the decoder is where the escape goes");
    let path = hf_with(dir, "bad-escape", &config(), Some(&bad_escape));
    expect("a JSON escape error inside decoder", try_init(&path, &cpu_options()), Status::BadModel);
    let mut odd_decoder = committed_tokenizer();
    odd_decoder["decoder"] = json!(5);
    let path = hf_with(dir, "odd-decoder", &config(), Some(&odd_decoder.to_string()));
    expect("a decoder that is a number", try_init(&path, &cpu_options()), Status::BadModel);
    assert!(last_error().contains("tokenizer"), "{}", last_error());

    // GGUF merges that build a token longer than any in the vocabulary.
    let cfg = config();
    let mut vocab = tokenizer::gguf_bpe_vocab(&asset("tokenizer.json")).unwrap();
    let longest = vocab.tokens.iter().max_by_key(|t| t.len()).unwrap().clone();
    vocab.merges.push(format!("{longest} {longest}"));
    let gguf = dir.path().join("long-merge.gguf");
    write_gguf(&gguf, &cfg, &synthetic_weights(&cfg, 5, DType::F32), &vocab.gguf_kv("gpt-2")).unwrap();
    expect("a GGUF merge longer than any token", try_init(&gguf, &cpu_options()), Status::BadModel);
    assert!(last_error().contains("merges"), "{}", last_error());
}

/// Reproducer 4: any integer names a status or "unknown status".
fn status_strings() {
    // SAFETY: engine_status_str gives a static NUL-terminated string for any integer.
    let name = |s: u32| unsafe { CStr::from_ptr(ffi::engine_status_str(s)) }.to_str().unwrap().to_string();
    let known: Vec<String> = (0..=10).map(name).collect();
    assert!(known.iter().all(|n| !n.is_empty() && n != "unknown status"), "{known:?}");
    assert_eq!(known.iter().collect::<std::collections::HashSet<_>>().len(), 11, "{known:?}");
    // -1, INT_MIN and INT_MAX as a C caller's int arrives.
    for outside in [11, 99, -1i32 as u32, i32::MIN as u32, i32::MAX as u32] {
        assert_eq!(name(outside), "unknown status", "engine_status_str({outside})");
    }
}

/// Runs `f` on a thread; false when it has not returned within `limit` (the thread is left behind).
fn returns_within(limit: Duration, f: impl FnOnce() + Send + 'static) -> bool {
    let (done, wait) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        f();
        let _ = done.send(());
    });
    wait.recv_timeout(limit).is_ok()
}

/// Reproducer 6: FIFOs (and devices) where files belong are IO_ERROR at once.
fn fifos_and_devices(dir: &Scratch) {
    let fifo = dir.path().join("model.gguf");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path; mkfifo touches nothing of ours.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    let folder = hf_with(dir, "fifo-config", &config(), None);
    std::fs::remove_file(folder.join("config.json")).unwrap();
    let config_fifo = std::ffi::CString::new(folder.join("config.json").to_str().unwrap()).unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::mkfifo(config_fifo.as_ptr(), 0o600) }, 0, "mkfifo");
    let tok = hf_with(dir, "fifo-tokenizer", &config(), None);
    let tok_fifo = std::ffi::CString::new(tok.join("tokenizer.json").to_str().unwrap()).unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::mkfifo(tok_fifo.as_ptr(), 0o600) }, 0, "mkfifo");
    for path in [fifo, folder, tok, PathBuf::from("/dev/zero")] {
        let (sent, got) = std::sync::mpsc::channel();
        let shown = path.display().to_string();
        let returned = returns_within(Duration::from_secs(10), move || {
            let st = try_init(&path, &cpu_options());
            let _ = sent.send((st, last_error()));
        });
        assert!(returned, "engine_init_fit({shown}) blocked");
        let (st, why) = got.recv().unwrap();
        assert_eq!(st, Status::IoError, "{shown}: {why}");
        assert!(why.contains("not a regular file"), "{shown}: {why}");
    }
}

/// Reproducer 7: a wrong `n` is refused before any id is read.
fn step_checks_n_first(dir: &Scratch) {
    let e = init(&hf_with(dir, "step-n", &config(), None), &engine_options { context: 16, ..cpu_options() });
    let ids = [3i32, 4];
    let mut next = -7;
    // Only two ids are there: reading `n` of them would run far past the buffer.
    // SAFETY: a live engine; the length is refused against the window before any id past the two is read.
    let st = unsafe { ffi::engine_step(e.0, 0, ids.as_ptr(), usize::MAX / 8, &mut next) };
    expect("n past the window", st, Status::NoRoom);
    // SAFETY: a live engine; 17 tokens are refused against the window before any id past the two is read.
    let st = unsafe { ffi::engine_step(e.0, 0, ids.as_ptr(), 17, &mut next) };
    expect("n one past the window", st, Status::NoRoom);
    // SAFETY: a live engine; the NULL tokens are refused before anything is read.
    let st = unsafe { ffi::engine_step(e.0, 0, std::ptr::null(), 1 << 40, &mut next) };
    expect("NULL tokens", st, Status::InvalidArgument);
    assert_eq!(next, -7, "a refused step wrote next");
    assert!(step(&e, 0, &ids) >= 0);
}

/// Every numbered reproducer of the reliability issue (5 and 8 have their own tests below).
#[test]
fn reproducers_return_clear_statuses() {
    let _g = serial();
    let dir = Scratch::new("reproducers");
    huge_windows_and_stream_counts(&dir);
    broken_tokenizers(&dir);
    status_strings();
    fifos_and_devices(&dir);
    step_checks_n_first(&dir);
    if std::env::var_os("HOSTEMBED_RELIABILITY_CHILD").is_some() {
        // The hook stays silent only inside the library: a panic of the host's own still reaches its hook.
        let _ = std::thread::spawn(|| panic!("host panic outside the library")).join();
    }
}

/// The reproducers again in a child process whose stderr is kept: nothing but the host's own panic.
#[test]
fn reproducers_print_nothing_on_stderr() {
    let _g = serial();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "reproducers_return_clear_statuses", "--nocapture", "--test-threads=1"])
        .env("HOSTEMBED_RELIABILITY_CHILD", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed: {stdout}\n{stderr}");
    assert!(stdout.contains("1 passed"), "the child ran the reproducers: {stdout}");
    // The host's panic, and nothing else: the library's own panics were caught and stayed silent.
    assert_eq!(stderr.matches("panicked at").count(), 1, "one panic message on stderr: {stderr}");
    assert!(stderr.contains("host panic outside the library"), "the host's panic reached its hook: {stderr}");
    let ours: Vec<&str> = stderr.lines().filter(|l| l.contains("hostembed")).collect();
    assert!(ours.is_empty(), "the library printed on stderr: {ours:?}");
}

/// Reproducer 5: 8 threads step 8 streams of one engine (and ask for logits, and tokenize beside them);
/// every stream's tokens and every logits copy match the serial run's.
#[test]
fn eight_threads_on_one_engine_match_the_serial_run() {
    let _g = serial();
    let mut rng = Rng::fresh("eight_threads_on_one_engine_match_the_serial_run");
    let dir = Scratch::new("threads");
    let model = hf_with(&dir, "threads", &config(), Some(&committed_tokenizer().to_string()));
    const STREAMS: u32 = 8;
    const STEPS: usize = 24;
    let opts = engine_options { max_streams: STREAMS, context: 64, ..cpu_options() };
    let prompts: Vec<Vec<i32>> = (0..STREAMS).map(|_| (0..6).map(|_| 2 + rng.below(500) as i32).collect()).collect();

    // The serial run, with the logits after every step.
    let serial_engine = init(&model, &opts);
    let mut want_tokens = Vec::new();
    let mut want_logits = Vec::new();
    for (s, prompt) in prompts.iter().enumerate() {
        let s = s as u32;
        let mut tokens = vec![step(&serial_engine, s, prompt)];
        let mut logits = vec![common::logits(&serial_engine, s)];
        for _ in 0..STEPS {
            tokens.push(step(&serial_engine, s, &[*tokens.last().unwrap()]));
            logits.push(common::logits(&serial_engine, s));
        }
        want_tokens.push(tokens);
        want_logits.push(logits);
    }
    drop(serial_engine);

    let text = std::fs::read_to_string(asset("hostembed.txt")).unwrap();
    let shared = init(&model, &opts);
    let want_ids = tokenize(&shared, &text);
    assert!(want_ids.len() > 100);
    let handle = shared.0 as usize;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (got, fresh_logits, tokenized) = std::thread::scope(|scope| {
        let tokenizers: Vec<_> = (0..2)
            .map(|_| {
                scope.spawn(|| {
                    let e = std::mem::ManuallyDrop::new(Held(handle as *mut ffi::engine));
                    let mut calls = 0;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        assert_eq!(tokenize(&e, &text), want_ids, "tokenize beside steps");
                        calls += 1;
                    }
                    calls
                })
            })
            .collect();
        let steppers: Vec<_> = (0..STREAMS)
            .map(|s| {
                let (prompt, want) = (&prompts[s as usize], &want_logits[s as usize]);
                scope.spawn(move || {
                    let e = std::mem::ManuallyDrop::new(Held(handle as *mut ffi::engine));
                    let mut out = vec![0f32; config().vocab];
                    let mut fresh = 0;
                    let mut tokens = Vec::new();
                    for (i, want) in want.iter().enumerate() {
                        let input = if i == 0 { prompt.clone() } else { vec![*tokens.last().unwrap()] };
                        tokens.push(step(&e, s, &input));
                        // SAFETY: a live engine and a buffer of out.len() floats to write.
                        let st = unsafe { ffi::engine_logits(e.0, s, out.as_mut_ptr(), out.len()) };
                        // Another stream may have stepped in between; a copy given must be this stream's.
                        if st == Status::Ok {
                            assert_eq!(common::bits(&out), common::bits(want), "stream {s} step {i}: logits");
                            fresh += 1;
                        } else {
                            assert_eq!(st, Status::InvalidArgument, "stream {s}: {}", last_error());
                        }
                    }
                    (tokens, fresh)
                })
            })
            .collect();
        let results: Vec<(Vec<i32>, usize)> = steppers.into_iter().map(|t| t.join().unwrap()).collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let calls: usize = tokenizers.into_iter().map(|t| t.join().unwrap()).sum();
        let fresh = results.iter().map(|r| r.1).sum::<usize>();
        (results.into_iter().map(|r| r.0).collect::<Vec<_>>(), fresh, calls)
    });
    for s in 0..STREAMS as usize {
        assert_eq!(got[s], want_tokens[s], "stream {s}: threads against the serial run");
    }
    println!(
        "8 threads x {} steps: tokens match the serial run; {fresh_logits} logits copies matched, {tokenized} tokenize calls beside",
        STEPS + 1
    );
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf reads a constant of the system.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}

/// Reproducer 8: nothing a load, a tokenize of words never seen before and a free leave behind on the
/// thread that made them grows the process.
#[test]
fn load_tokenize_free_cycles_hold_no_memory() {
    let _g = serial();
    let dir = Scratch::new("rss");
    let model = hf_with(&dir, "rss", &config(), Some(&committed_tokenizer().to_string()));
    let opts = cpu_options();
    let mut after_100 = 0;
    for cycle in 0..2000u32 {
        let e = init(&model, &opts);
        let words: String = (0..10).map(|w| format!("w{cycle}q{w}z{} ", cycle * 7 + w)).collect();
        assert!(!tokenize(&e, &words).is_empty());
        drop(e);
        LOG.lock().unwrap().clear();
        if cycle == 99 {
            after_100 = rss_bytes();
        }
    }
    let after_2000 = rss_bytes();
    println!("RSS after 100 cycles {after_100} bytes, after 2000 cycles {after_2000} bytes");
    assert!(after_2000 <= after_100 + (1 << 20), "RSS grew {} bytes over 1900 cycles", after_2000 - after_100);
}
