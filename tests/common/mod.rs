//! Shared by the test files: the GPU suite's skip rule, small deterministic random data, the C ABI calls
//! the tests make, the model files they find, and the loop that checks random batches against stepping
//! each stream alone.
#![allow(dead_code)]

pub mod card;
pub mod gemma3;
pub mod shared;
pub mod spec;

use hostembed::Status;
use hostembed::checkpoint::write::MemSource;
use hostembed::checkpoint::write::{Recipe, write_synthetic_gguf, write_synthetic_hf};
use hostembed::cuda::DeviceBuffer;
use hostembed::engine::engine_options;
use hostembed::ffi;
use hostembed::gpu::RowsOnDevice;
use hostembed::model::{Arch, ModelConfig, MoeConfig, RopeScaling, TensorSource, names};
use hostembed::placement::engine_memory;
use hostembed::sampler::splitmix64;
use hostembed::status::last_error;
use hostembed::tensor::DType;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// True when a CUDA device is usable; otherwise prints one skip line naming the reason.
pub fn gpu_present(test: &str) -> bool {
    match hostembed::cuda::require_device(0) {
        Ok(()) => true,
        Err(e) if matches!(e.status, Status::NoCuda | Status::NoDevice) => {
            println!("SKIP {test}: no CUDA device ({})", e.message);
            false
        }
        Err(e) => panic!("{test}: device probe failed: {e}"),
    }
}

/// splitmix64: fresh, reproducible data without a rand dependency.
pub struct Rng(pub u64);

impl Rng {
    /// Seeded from the clock so every run draws new data; the seed is printed for replay.
    pub fn fresh(test: &str) -> Rng {
        let seed = std::env::var("HOSTEMBED_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
        });
        println!("{test}: seed {seed} (HOSTEMBED_TEST_SEED={seed} replays it)");
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        let out = splitmix64(self.0);
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        out
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.uniform() + 1.0) / 2.0
    }

    /// `n` token ids below `vocab`.
    pub fn ids(&mut self, vocab: usize, n: usize) -> Vec<i32> {
        (0..n).map(|_| self.below(vocab as u64) as i32).collect()
    }

    /// `items` shuffled.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i as u64 + 1) as usize);
        }
    }
}

/// A fresh folder under HOSTEMBED_TEST_TMP (or the system's temp dir), removed when dropped. Named
/// after the test binary, the test and the process, so concurrent runs never share one.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let base = std::env::var_os("HOSTEMBED_TEST_TMP").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
        let dir = base.join(format!("hostembed-{}-{name}-{}-{n}", env!("CARGO_CRATE_NAME"), std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// An HF folder of synthetic weights named `name` inside this folder.
    pub fn hf(&self, name: &str, cfg: &ModelConfig, seed: u64, dtype: DType) -> PathBuf {
        let p = self.0.join(name);
        write_synthetic_hf(&p, cfg, seed, dtype).unwrap();
        p
    }

    /// A GGUF file of synthetic weights named `name`.gguf inside this folder, its matrices in the
    /// recipe's formats (a `DType` for all of them).
    pub fn gguf(&self, name: &str, cfg: &ModelConfig, seed: u64, recipe: impl Into<Recipe>) -> PathBuf {
        let p = self.0.join(format!("{name}.gguf"));
        write_synthetic_gguf(&p, cfg, seed, recipe).unwrap();
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The environment and the process-wide memory counters are shared by every test in a binary.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

pub fn c_path(p: &Path) -> std::ffi::CString {
    std::ffi::CString::new(p.to_str().unwrap()).unwrap()
}

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

/// Relative L2 distance of `got` from `want`, in f64; both must be finite (a NaN is an unwritten output).
pub fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    assert!(got.iter().chain(want).all(|v| v.is_finite()), "non-finite logits");
    let num: f64 = got.iter().zip(want).map(|(&g, &w)| (g as f64 - w as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|&w| (w as f64).powi(2)).sum();
    (num / den).sqrt()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}

/// The gap between the two largest values: below the measured error, a greedy pick may flip.
pub fn top_two_gap(l: &[f32]) -> f32 {
    let mut v = l.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    v[0] - v[1]
}

/// Both engines step `prompt`, then the same tokens (the reference's greedy choice); logits compared at every
/// step, and a differing choice allowed only where the reference's own gap is within twice the measured
/// error. Returns the worst relative L2 and the differing steps (step, gap between the choices, top-two
/// gap, error).
pub fn compare_greedy(
    what: &str,
    test: &Held,
    reference: &Held,
    prompt: &[i32],
    steps: usize,
) -> (f64, Vec<(usize, f32, f32, f32)>) {
    let (mut got, mut want) = (step(test, 0, prompt), step(reference, 0, prompt));
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

/// Bit patterns, for comparing floats exactly.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
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

/// A random sampler: greedy or drawn, with or without top-k, top-p, min-p and a penalty.
pub fn random_sampling(rng: &mut Rng) -> hostembed::abi::engine_sampling {
    let pick = |rng: &mut Rng, p: f32| rng.unit() < p;
    let mut s = ffi::engine_default_sampling();
    if pick(rng, 0.7) {
        s.temperature = 0.5 + rng.unit() * 1.5;
    }
    if pick(rng, 0.4) {
        s.top_k = 1 + rng.below(60) as u32;
    }
    if pick(rng, 0.4) {
        s.top_p = 0.5 + rng.unit() * 0.5;
    }
    if pick(rng, 0.5) {
        s.min_p = rng.unit() * 0.3;
    }
    if pick(rng, 0.6) {
        s.repeat_penalty = 0.7 + rng.unit() * 1.3;
        s.repeat_last_n = rng.below(40) as u32;
    }
    s.seed = rng.next_u64();
    s
}

/// How `batches_match_stepping_alone` draws its rounds.
pub struct Mix {
    pub rounds: usize,
    /// Items in one call: 1 to this many (no more than the engines' streams).
    pub widest: u32,
    /// Prompt chunks of 1 to `chunk` tokens, one in four of 1 to `long_chunk`.
    pub chunk: u64,
    pub long_chunk: u64,
}

/// What a run of `batches_match_stepping_alone` stepped.
#[derive(Debug, Default)]
pub struct BatchCounts {
    /// Items that stepped, and of them the single tokens and the prompt chunks in calls of several items.
    pub items: usize,
    pub singles_beside_others: usize,
    pub chunks_beside_others: usize,
    /// Items refused, as they were alone (a chunk past the window).
    pub refused: usize,
    /// The most items one call held.
    pub widest: usize,
}

/// Random batches on `batched` and the same steps one stream at a time on `alone` (fresh engines of
/// one model and the same options, `page` positions a KV page). Each round truncates, resets or
/// re-samples some streams on both, then steps 1 to `mix.widest` streams in a random order in one call,
/// each with a prompt chunk (a stream joining, or going on) or its last sampled token. Every item's
/// status, token and logits must be those of stepping it alone, bit for bit; the pool's free positions
/// follow the streams' lengths every round and are whole after every stream's reset.
pub fn batches_match_stepping_alone(
    what: &str,
    batched: &Held,
    alone: &Held,
    rng: &mut Rng,
    mix: &Mix,
    page: u64,
) -> BatchCounts {
    let i = info(batched);
    let (streams, window, vocab) = (i.streams, i.window, i.vocab as usize);
    assert!(mix.widest <= streams, "{what}: {} items in a call of {streams} streams", mix.widest);
    let (total, free) = kv_stats(batched);
    assert_eq!(free, total, "{what}: a fresh engine's pool");
    for s in 0..streams {
        let sampling = random_sampling(rng);
        set_sampling(batched, s, &sampling);
        set_sampling(alone, s, &sampling);
    }
    // What each stream feeds next: its last sampled token once it has one.
    let mut last: Vec<Option<i32>> = vec![None; streams as usize];
    let mut counts = BatchCounts::default();
    for round in 0..mix.rounds {
        // Between calls: some streams leave (reset), are truncated, or are given new settings; a stream
        // at a full window starts again.
        for s in 0..streams {
            let len = stream_len(batched, s);
            assert_eq!(len, stream_len(alone, s), "{what} round {round} stream {s}: lengths");
            match rng.below(20) {
                r if r == 0 || len == window => {
                    reset(batched, s);
                    reset(alone, s);
                    last[s as usize] = None;
                }
                1 if len > 0 => {
                    let keep = rng.below(len as u64) as u32;
                    truncate(batched, s, keep);
                    truncate(alone, s, keep);
                    last[s as usize] = None;
                }
                2 => {
                    let sampling = random_sampling(rng);
                    set_sampling(batched, s, &sampling);
                    set_sampling(alone, s, &sampling);
                }
                _ => {}
            }
        }
        // Every fifth call is as wide as the mix allows and every fifth a single item.
        let width = match round % 5 {
            0 => mix.widest,
            2 => 1,
            _ => 1 + rng.below(mix.widest as u64) as u32,
        };
        let mut order: Vec<u32> = (0..streams).collect();
        rng.shuffle(&mut order);
        order.truncate(width as usize);
        let inputs: Vec<Vec<i32>> = order
            .iter()
            .map(|&s| match last[s as usize] {
                Some(t) if rng.below(3) > 0 => vec![t],
                _ => {
                    let longest = if rng.below(4) == 0 { mix.long_chunk } else { mix.chunk };
                    let n = 1 + rng.below(longest) as usize;
                    rng.ids(vocab, n)
                }
            })
            .collect();
        let items: Vec<(u32, &[i32])> = order.iter().zip(&inputs).map(|(&s, t)| (s, t.as_slice())).collect();
        let (st, out) = try_batch(batched, &items);
        assert_eq!(st, Status::Ok, "{what} round {round}: {}", last_error());
        let others = items.len() > 1;
        for (&(s, tokens), &(item_status, next)) in items.iter().zip(&out) {
            let at = format!("{what} round {round} stream {s} ({} tokens of a call of {})", tokens.len(), items.len());
            let (want_status, want_next) = try_step(alone, s, tokens);
            assert_eq!(item_status, want_status, "{at}: status");
            if want_status != Status::Ok {
                assert_eq!(next, -1, "{at}: a failed item's next");
                counts.refused += 1;
                continue;
            }
            assert_eq!(next, want_next, "{at}: token");
            let (got, want) = (logits(batched, s), logits(alone, s));
            if bits(&got) != bits(&want) {
                panic!("{at}: logits differ from stepping alone by {:.3e} relative L2", rel_l2(&got, &want));
            }
            last[s as usize] = Some(next);
            counts.items += 1;
            counts.singles_beside_others += (others && tokens.len() == 1) as usize;
            counts.chunks_beside_others += (others && tokens.len() > 1) as usize;
        }
        counts.widest = counts.widest.max(items.len());
        let held: u64 = (0..streams).map(|s| (stream_len(batched, s) as u64).div_ceil(page) * page).sum();
        assert_eq!(kv_stats(batched), (total, total - held), "{what} round {round}: free positions");
    }
    for s in 0..streams {
        reset(batched, s);
        reset(alone, s);
    }
    assert_eq!(kv_stats(batched), (total, total), "{what}: the pool after every stream's reset");
    println!("{what}: {counts:?}");
    counts
}

/// `batches_match_stepping_alone` on two fresh engines of `path` with `opts` (CUDA or the CPU, as
/// `opts.backend` says), with enough single tokens and prompt chunks beside others, and a call of every
/// stream, to mean anything; nothing held once they are freed.
pub fn twins_batch_like_alone(what: &str, path: &Path, opts: &engine_options, mix: &Mix, page: u64, rng: &mut Rng) {
    let batched = init(path, opts);
    let alone = init(path, opts);
    let i = info(&batched);
    let cuda = opts.backend == hostembed::engine::engine_backend::Cuda;
    assert_eq!((i.cuda, i.streams), (cuda, mix.widest), "{what}: the backend and the streams");
    let counts = batches_match_stepping_alone(what, &batched, &alone, rng, mix, page);
    assert!(
        counts.singles_beside_others > 100 && counts.chunks_beside_others > 50 && counts.widest == i.streams as usize,
        "{what}: too few items beside others to mean anything: {counts:?}"
    );
    drop((batched, alone));
    assert_eq!(stats(), engine_memory::default(), "{what}: held after the engines were freed");
}

/// `twins_batch_like_alone` on `cfg` written as GGUF in every recipe (`every_recipe`).
pub fn every_recipe_batches_like_alone(cfg: &ModelConfig, opts: &engine_options, mix: &Mix, page: u64, rng: &mut Rng) {
    let dir = Scratch::new("batch-formats");
    for recipe in every_recipe() {
        let started = std::time::Instant::now();
        let path = gguf_of_recipe(&dir, cfg, rng.next_u64(), recipe);
        twins_batch_like_alone(recipe.name(), &path, opts, mix, page, rng);
        println!("{}: {:.1} s", recipe.name(), started.elapsed().as_secs_f64());
    }
}

/// Every format `FORMATS` lists for all of a model's matrices, then llama.cpp's Q4_K_M mix.
pub fn every_recipe() -> Vec<Recipe> {
    hostembed::tensor::FORMATS.iter().map(|f| Recipe::Uniform(f.dtype)).chain([Recipe::Q4KM]).collect()
}

/// Writes `cfg` in `recipe` into `dir` and checks the file stores every tensor as the recipe asks, with
/// no fallback for rows that are not whole blocks (Q4_K_M: Q4_K and Q6_K both present).
pub fn gguf_of_recipe(dir: &Scratch, cfg: &ModelConfig, seed: u64, recipe: Recipe) -> PathBuf {
    let path = dir.gguf(recipe.name(), cfg, seed, recipe);
    let ckpt = hostembed::checkpoint::Checkpoint::open(&path).unwrap();
    for t in ckpt.tensors.values().filter(|t| t.shape.len() == 2) {
        let fits = match recipe {
            Recipe::Uniform(dtype) => t.dtype == dtype,
            Recipe::Q4KM => {
                matches!(t.dtype, DType::Q4_K | DType::Q6_K) && t.dtype == recipe.dtype(cfg, &t.name, &t.shape)
            }
        };
        assert!(fits, "{}: tensor {} of {:?} stored as {}", recipe.name(), t.name, t.shape, t.dtype.name());
    }
    if recipe == Recipe::Q4KM {
        for k in [DType::Q4_K, DType::Q6_K] {
            assert!(ckpt.tensors.values().any(|t| t.dtype == k), "Q4_K_M without {}", k.name());
        }
    }
    path
}

/// A model file the suite does not write itself (CI and scripts/gpu-build.sh put it there): under
/// HOSTEMBED_TEST_MODELS when set (the GPU bundle's copy), else the source tree's models/. None, after
/// a SKIP line saying what writes it, when it is absent.
pub fn model_file(name: &str, written_by: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("HOSTEMBED_TEST_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("models"));
    let path = dir.join(name);
    if path.is_file() {
        Some(path)
    } else {
        println!("SKIP: {} is absent ({written_by})", path.display());
        None
    }
}

/// One layer's paged KV pool as the kernels lay it out (`HE_PAGE_TOKENS` positions a page, each page
/// bf16 [K, V][kv_heads][PAGE_TOKENS][head_dim]), every value 0xFFFF (a NaN) until written, and page
/// tables that scatter a stream's positions over the pool in a shuffled order.
pub struct PagedKv {
    pub bits: Vec<u16>,
    pub pages: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl PagedKv {
    pub fn new(pages: usize, kv_heads: usize, head_dim: usize) -> PagedKv {
        let page_tokens = hostembed::gpu::PAGE_TOKENS;
        PagedKv { bits: vec![0xFFFF; pages * 2 * kv_heads * page_tokens * head_dim], pages, kv_heads, head_dim }
    }

    /// Where value `c` of kv head `h` at position `p` lies for the stream of `table` (`v`: the V half).
    pub fn at(&self, table: &[u32], v: bool, h: usize, p: usize, c: usize) -> usize {
        let pt = hostembed::gpu::PAGE_TOKENS;
        let page = table[p / pt] as usize;
        (((page * 2 + v as usize) * self.kv_heads + h) * pt + p % pt) * self.head_dim + c
    }

    /// Page tables for streams of the given lengths: disjoint pages in a shuffled order.
    pub fn tables(&self, rng: &mut Rng, lens: &[usize]) -> Vec<Vec<u32>> {
        let pt = hostembed::gpu::PAGE_TOKENS;
        let mut ids: Vec<u32> = (0..self.pages as u32).collect();
        rng.shuffle(&mut ids);
        let mut next = ids.into_iter();
        lens.iter().map(|&len| (0..len.div_ceil(pt)).map(|_| next.next().expect("pool too small")).collect()).collect()
    }
}

// ---- small random models the GPU suites share ----

pub fn decode_base(arch: Arch) -> ModelConfig {
    ModelConfig {
        arch,
        vocab: 1000,
        hidden: 256,
        layers: 2,
        heads: 8,
        kv_heads: 2,
        head_dim: 32,
        intermediate: 512,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
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

/// Llama with GQA 4:1, llama3 rope scaling and the pairs rotated as GGUF llama stores them; Qwen2 with
/// biases, a tied head and an odd vocabulary; Qwen3 with q/k norms and head_dim 128 beside hidden 256.
pub fn decode_configs() -> Vec<(&'static str, ModelConfig)> {
    let llama = ModelConfig {
        rope_scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 64,
        },
        rope_interleaved: true,
        rope_theta: 500000.0,
        ..decode_base(Arch::Llama)
    };
    let qwen2 = ModelConfig {
        vocab: 777,
        hidden: 224,
        heads: 7,
        kv_heads: 1,
        tied: true,
        qkv_bias: true,
        intermediate: 480,
        ..decode_base(Arch::Qwen2)
    };
    let qwen3 =
        ModelConfig { heads: 4, head_dim: 128, qk_norm: true, rope_theta: 1000000.0, ..decode_base(Arch::Qwen3) };
    vec![("llama", llama), ("qwen2", qwen2), ("qwen3", qwen3)]
}

/// The prompt suites' shape (tests/gpu_prefill.rs, and its CPU emulation tests/prompt_roundings.rs).
pub fn prompt_base(arch: Arch) -> ModelConfig {
    ModelConfig {
        arch,
        vocab: 1000,
        hidden: 256,
        layers: 2,
        heads: 4,
        kv_heads: 1,
        head_dim: 64,
        intermediate: 512,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 65536,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: None,
        eos: None,
        moe: None,
    }
}

/// Llama (GQA 4:1, head_dim 64, llama3 rope), Qwen2 (biases, tied head, head_dim 32), Qwen3 (q/k norms,
/// head_dim 128 beside hidden 256).
pub fn prompt_configs() -> Vec<(&'static str, ModelConfig)> {
    let llama = ModelConfig {
        rope_scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 512,
        },
        rope_interleaved: true,
        rope_theta: 500000.0,
        ..prompt_base(Arch::Llama)
    };
    let qwen2 = ModelConfig {
        heads: 8,
        kv_heads: 2,
        head_dim: 32,
        tied: true,
        qkv_bias: true,
        vocab: 777,
        ..prompt_base(Arch::Qwen2)
    };
    let qwen3 = ModelConfig {
        heads: 4,
        kv_heads: 2,
        head_dim: 128,
        qk_norm: true,
        attention: Default::default(),
        rope_theta: 1000000.0,
        ..prompt_base(Arch::Qwen3)
    };
    vec![("llama", llama), ("qwen2", qwen2), ("qwen3", qwen3)]
}

/// The embedding rows on the card, as the engine's DEVICE placement hands them over.
pub fn rows_on_card(src: &MemSource) -> (DeviceBuffer, RowsOnDevice) {
    let e = src.tensor(names::EMBED).unwrap();
    let buf = DeviceBuffer::from_slice(e.bytes).unwrap();
    let rows = RowsOnDevice { ptr: buf.ptr(), dtype: e.dtype, vocab: e.rows(), cols: e.cols() };
    (buf, rows)
}

/// Sets the environment variable `name` to `value`, or removes it for None.
pub fn set_env(name: &str, value: Option<&std::ffi::OsStr>) {
    // SAFETY: every test that reads or writes the environment holds `serial()`.
    unsafe {
        match value {
            Some(v) => std::env::set_var(name, v),
            None => std::env::remove_var(name),
        }
    }
}

/// A small Qwen3-MoE (tests/moe.rs, tests/gpu_moe.rs) whose matrices' rows are whole k-quant super-blocks: 8 experts, 2 a token, the top-k
/// weights not renormalized (transformers' default for the architecture).
pub fn qwen3_moe() -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen3Moe,
        vocab: 300,
        hidden: 256,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        intermediate: 768,
        rms_eps: 1e-6,
        rope_theta: 1000000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 256,
        tied: false,
        qkv_bias: false,
        qk_norm: true,
        bos: Some(1),
        eos: Some(2),
        moe: Some(MoeConfig { experts: 8, used: 2, intermediate: 256, norm_topk: false }),
        attention: Default::default(),
    }
}

/// A Mixtral (GQA 2:1, GGUF's permuted Q/K rows): 4 experts, 2 a token, renormalized; its experts as
/// wide as its intermediate_size, as Mixtral's config says.
pub fn mixtral() -> ModelConfig {
    ModelConfig {
        arch: Arch::Mixtral,
        qk_norm: false,
        intermediate: 512,
        rope_theta: 10000.0,
        tied: true,
        moe: Some(MoeConfig { experts: 4, used: 2, intermediate: 512, norm_topk: true }),
        ..qwen3_moe()
    }
}

pub fn moe_configs() -> [(&'static str, ModelConfig); 2] {
    [("qwen3_moe", qwen3_moe()), ("mixtral", mixtral())]
}
