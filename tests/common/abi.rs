//! The C ABI calls the tests make: options, engines held until dropped, steps, batches, streams, pool counts.

use super::c_path;
use hostembed::engine::engine_options;
use hostembed::model::ModelConfig;
use hostembed::placement::engine_memory;
use hostembed::status::last_error;
use hostembed::{Status, ffi};
use std::path::Path;

/// What the library holds now, through the C ABI.
pub fn stats() -> engine_memory {
    let mut m = engine_memory::default();
    // SAFETY: a writable engine_memory for the call.
    assert_eq!(unsafe { ffi::engine_memory_stats(&mut m) }, Status::Ok);
    m
}

pub fn device_info() -> ffi::engine_device_info {
    // SAFETY: engine_device_info is numbers, bools and a byte array: all zeros is a value of it.
    let mut info: ffi::engine_device_info = unsafe { std::mem::zeroed() };
    // SAFETY: a writable engine_device_info for the call.
    assert_eq!(unsafe { ffi::engine_device_info(0, &mut info) }, Status::Ok, "{}", last_error());
    info
}

/// A log callback that drops every line, for engines whose start-up lines the test does not read.
pub unsafe extern "C" fn quiet(_user: *mut std::ffi::c_void, _line: *const std::ffi::c_char) {}

/// `streams` streams of `window` tokens on the CPU backend, quiet.
pub fn cpu_options(window: u32, streams: u32) -> engine_options {
    engine_options {
        backend: hostembed::engine::engine_backend::Cpu,
        context: window,
        max_streams: streams,
        log: Some(quiet),
        ..hostembed::engine::default_options()
    }
}

/// `streams` streams of `window` tokens on the CUDA backend in passes of up to `max_batch` tokens, quiet;
/// room without limit and the embedding rows on the card whatever the environment says.
pub fn cuda_options(window: u32, streams: u32, max_batch: u32) -> engine_options {
    engine_options {
        backend: hostembed::engine::engine_backend::Cuda,
        room_bytes: 1 << 50,
        mmap_rows: hostembed::engine::engine_tristate::No,
        context: window,
        max_streams: streams,
        max_batch,
        log: Some(quiet),
        ..hostembed::engine::default_options()
    }
}

/// An engine freed when dropped, so a failed assertion does not leave it to the next test's counters.
pub struct Held(pub *mut ffi::engine);

impl Drop for Held {
    fn drop(&mut self) {
        // SAFETY: the handle came from engine_init_fit and is freed here once, as its only holder drops.
        unsafe { ffi::engine_free(self.0) };
    }
}

/// Host room for `tokens` positions of KV cache beside the step scratch and `streams` stream slots: the
/// CPU plan's own figures.
pub fn room_for_tokens(cfg: &ModelConfig, window: u32, streams: u32, tokens: u64) -> u64 {
    let slot = std::mem::size_of::<Option<hostembed::cpu::CpuStream>>() as u64;
    let probe = engine_options { room_bytes: 1 << 40, ..cpu_options(window, streams) };
    let threads = hostembed::engine::tuning_for(&probe).cpu_threads;
    let inputs = hostembed::fit::cpu_inputs(
        cfg,
        window,
        streams,
        slot,
        hostembed::engine::cpu_kv_types(&probe),
        &probe,
        threads,
    )
    .unwrap();
    let per_token = (hostembed::fit::plan_cpu(&inputs).stream_bytes.unwrap() - slot) / window as u64;
    inputs.scratch_bytes + streams as u64 * slot + tokens * per_token
}

/// `work(engine, i)` for i in 0..n, each on a thread of its own, all on the one engine `e` (which the
/// library makes safe to share); the results in order of i.
pub fn on_threads<T: Send>(e: &Held, n: u32, work: impl Fn(&Held, u32) -> T + Sync) -> Vec<T> {
    let handle = e.0 as usize;
    std::thread::scope(|scope| {
        let threads: Vec<_> = (0..n)
            .map(|i| {
                let work = &work;
                scope.spawn(move || {
                    // The engine stays owned by `e`; this view must not free it.
                    let view = std::mem::ManuallyDrop::new(Held(handle as *mut ffi::engine));
                    work(&view, i)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

pub fn init(path: &Path, opts: &engine_options) -> Held {
    let mut e = std::ptr::null_mut();
    // SAFETY: a NUL-terminated path, options and a handle slot, all alive across the call.
    let st = unsafe { ffi::engine_init_fit(c_path(path).as_ptr(), opts, &mut e) };
    assert_eq!(st, Status::Ok, "engine_init_fit({}): {}", path.display(), last_error());
    assert!(!e.is_null());
    Held(e)
}

/// engine_step's status, and `next` (left at -7 unless the call succeeded).
pub fn try_step(e: &Held, stream: u32, tokens: &[i32]) -> (Status, i32) {
    let mut next = -7;
    // SAFETY: a live engine, `tokens.len()` readable ids and a writable `next`.
    let st = unsafe { ffi::engine_step(e.0, stream, tokens.as_ptr(), tokens.len(), &mut next) };
    (st, next)
}

pub fn step(e: &Held, stream: u32, tokens: &[i32]) -> i32 {
    let (st, next) = try_step(e, stream, tokens);
    assert_eq!(st, Status::Ok, "engine_step(stream {stream}, {} tokens): {}", tokens.len(), last_error());
    next
}

pub fn info(e: &Held) -> ffi::engine_model_info {
    // SAFETY: engine_model_info is numbers, bools and enums with a variant at 0: all zeros is a value of it.
    let mut out: ffi::engine_model_info = unsafe { std::mem::zeroed() };
    // SAFETY: a live engine and a writable engine_model_info.
    assert_eq!(unsafe { ffi::engine_model_info(e.0, &mut out) }, Status::Ok, "{}", last_error());
    out
}

pub fn logits(e: &Held, stream: u32) -> Vec<f32> {
    let mut out = vec![f32::NAN; info(e).vocab as usize];
    // SAFETY: a live engine and `out.len()` writable floats.
    let st = unsafe { ffi::engine_logits(e.0, stream, out.as_mut_ptr(), out.len()) };
    assert_eq!(st, Status::Ok, "engine_logits(stream {stream}): {}", last_error());
    out
}

/// engine_tokenize of `text`, without BOS.
pub fn tokenize(e: &Held, text: &str) -> Vec<i32> {
    let mut ids = vec![-7i32; 4 * text.len() + 4];
    let mut n = usize::MAX;
    // SAFETY: a live engine, the text's bytes and length, room for `ids.len()` ids.
    let st = unsafe {
        ffi::engine_tokenize(
            e.0,
            text.as_ptr() as *const std::ffi::c_char,
            text.len(),
            hostembed::abi::ENGINE_BOS_NO,
            ids.as_mut_ptr(),
            ids.len(),
            &mut n,
        )
    };
    assert_eq!(st, Status::Ok, "{text:?}: {}", last_error());
    ids.truncate(n);
    ids
}

/// engine_token_piece of `id`.
pub fn piece(e: &Held, id: i32) -> Vec<u8> {
    let mut buf = vec![0 as std::ffi::c_char; 64];
    // SAFETY: a live engine and room for `buf.len()` bytes.
    let n = unsafe { ffi::engine_token_piece(e.0, id, buf.as_mut_ptr(), buf.len()) };
    assert!(n >= 0 && (n as usize) < buf.len(), "piece of {id}: {n}");
    buf[..n as usize].iter().map(|&b| b as u8).collect()
}

/// engine_step_batch's status and each item's (status, next); items with no tokens pass NULL.
pub fn try_batch(e: &Held, items: &[(u32, &[i32])]) -> (Status, Vec<(Status, i32)>) {
    let mut c: Vec<hostembed::abi::engine_batch_item> = items
        .iter()
        .map(|&(stream, tokens)| hostembed::abi::engine_batch_item {
            stream,
            tokens: if tokens.is_empty() { std::ptr::null() } else { tokens.as_ptr() },
            n: tokens.len(),
            next: -7,
            status: Status::Panic,
            out: std::ptr::null_mut(),
            out_cap: 0,
            n_out: 0,
        })
        .collect();
    // SAFETY: a live engine and `c.len()` items whose tokens point into `items`' slices (or are NULL with n 0), all
    // alive across the call.
    let st = unsafe { ffi::engine_step_batch(e.0, c.as_mut_ptr(), c.len()) };
    (st, c.iter().map(|i| (i.status, i.next)).collect())
}

/// (positions in the KV pool, positions free).
pub fn kv_stats(e: &Held) -> (u64, u64) {
    let (mut total, mut free) = (0, 0);
    // SAFETY: a live engine and two writable counts.
    assert_eq!(unsafe { ffi::engine_kv_stats(e.0, &mut total, &mut free) }, Status::Ok, "{}", last_error());
    (total, free)
}

pub fn stream_len(e: &Held, stream: u32) -> u32 {
    let mut len = u32::MAX;
    // SAFETY: a live engine and a writable length.
    assert_eq!(unsafe { ffi::engine_stream_len(e.0, stream, &mut len) }, Status::Ok, "{}", last_error());
    len
}

pub fn truncate(e: &Held, stream: u32, len: u32) {
    // SAFETY: a live engine; the call takes no pointer.
    let st = unsafe { ffi::engine_truncate(e.0, stream, len) };
    assert_eq!(st, Status::Ok, "engine_truncate({stream}, {len}): {}", last_error());
}

pub fn reset(e: &Held, stream: u32) {
    // SAFETY: a live engine; the call takes no pointer.
    assert_eq!(unsafe { ffi::engine_reset(e.0, stream) }, Status::Ok, "engine_reset({stream}): {}", last_error());
}

pub fn set_sampling(e: &Held, stream: u32, s: &hostembed::abi::engine_sampling) {
    // SAFETY: a live engine and settings alive across the call.
    let st = unsafe { ffi::engine_set_sampling(e.0, stream, s) };
    assert_eq!(st, Status::Ok, "engine_set_sampling({stream}): {}", last_error());
}
