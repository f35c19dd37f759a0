//! Shared prefixes and scoring, on the engine's own stream table (`Streams`) over the CPU or the CUDA
//! backend, on a random model: 64 streams with one system prompt (2,000 tokens) and 64 different
//! questions (100 tokens), with the prefix cache and without (each stream's time to its first token,
//! the pool's positions held and shared, the positions computed in all); then a 4,096-token prompt
//! through engine_score against engine_step.
//!
//!     cargo run --release --example bench_prefix -- [--backend cpu|cuda] [--shape small|8b]
//!         [--layers N] [--dtype bf16|q8_0|...] [--system 2000] [--question 100] [--streams 64]
//!         [--uncached 2] [--score 4096] [--max-batch 512]
//!
//! The shape is Llama-3-8B (BF16) on CUDA and a small Llama (hidden 256, 8 layers, Q8_0, vocab 8192) on
//! the CPU unless told. Without the cache every stream computes its whole prompt, so only the first
//! `--uncached` streams after the first are timed that way.

use std::sync::Arc;
use std::time::Instant;

use hostembed::backend::{Batch, BatchItem, Decoder, Streams};
use hostembed::checkpoint::write::{MemSource, Recipe};
use hostembed::cpu::CpuBackend;
use hostembed::cuda::{self, DeviceBuffer};
use hostembed::gpu::{CudaBackend, RowsOnDevice};
use hostembed::kv::KvTypes;
use hostembed::model::{ModelConfig, TensorSource, names};
use hostembed::sampler::Sampling;
use hostembed::tensor::DType;
use hostembed::tuning::Tuning;

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Cpu,
    Cuda,
}

struct Args {
    kind: Kind,
    cfg: ModelConfig,
    recipe: Recipe,
    system: usize,
    question: usize,
    streams: usize,
    uncached: usize,
    score: usize,
    max_batch: usize,
}

fn parse() -> Args {
    let mut kind = Kind::Cpu;
    let (mut shape, mut layers, mut dtype) = (None::<String>, None::<usize>, None::<Recipe>);
    let mut a = Args {
        kind,
        cfg: ModelConfig::llama(256, 8, 8, 2, 768, 8192),
        recipe: Recipe::Uniform(DType::Q8_0),
        system: 2000,
        question: 100,
        streams: 64,
        uncached: 2,
        score: 4096,
        max_batch: 512,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("{flag} takes a value"));
        let num = || -> usize { value.parse().unwrap_or_else(|_| panic!("{flag} takes a number")) };
        match flag.as_str() {
            "--backend" => {
                kind = match value.as_str() {
                    "cpu" => Kind::Cpu,
                    "cuda" => Kind::Cuda,
                    other => panic!("--backend: cpu or cuda, not {other}"),
                }
            }
            "--shape" => shape = Some(value.clone()),
            "--layers" => layers = Some(num()),
            "--dtype" => {
                dtype = Some(Recipe::from_name(&value).unwrap_or_else(|| panic!("--dtype: no format {value}")))
            }
            "--system" => a.system = num(),
            "--question" => a.question = num(),
            "--streams" => a.streams = num(),
            "--uncached" => a.uncached = num(),
            "--score" => a.score = num(),
            "--max-batch" => a.max_batch = num(),
            other => panic!("unknown flag {other} (see the comment at the top of examples/bench_prefix.rs)"),
        }
    }
    a.kind = kind;
    let shape = shape.unwrap_or_else(|| if kind == Kind::Cuda { "8b".into() } else { "small".into() });
    (a.cfg, a.recipe) = match shape.as_str() {
        "small" => (ModelConfig::llama(256, 8, 8, 2, 768, 8192), Recipe::Uniform(DType::Q8_0)),
        "8b" => (ModelConfig::llama(4096, 32, 32, 8, 14336, 128256), Recipe::Uniform(DType::Bf16)),
        other => panic!("--shape: small or 8b, not {other}"),
    };
    if let Some(l) = layers {
        a.cfg.layers = l;
    }
    if let Some(r) = dtype {
        a.recipe = r;
    }
    a
}

/// The engine's stream table over the backend, with the prefix cache on or off, and what it reads.
struct Engine {
    d: Box<dyn Decoder>,
    page: usize,
    // Declared after `d`: the CUDA backend reads the rows until it is dropped.
    _rows: Option<DeviceBuffer>,
}

fn engine(args: &Args, src: &Arc<MemSource>, streams: usize, window: usize, cache: bool) -> Engine {
    let sampling = Sampling::GREEDY;
    match args.kind {
        Kind::Cpu => {
            let page = hostembed::cpu::PAGE_TOKENS;
            let pages = streams * window.div_ceil(page);
            let backend = CpuBackend::with_kv(src.clone(), pages, KvTypes::CPU_DEFAULT, &Tuning::from_env()).unwrap();
            let d = Streams::new(backend, window, streams, pages, sampling).unwrap().with_prefix_cache(cache);
            Engine { d: Box::new(d), page, _rows: None }
        }
        Kind::Cuda => {
            let page = hostembed::gpu::PAGE_TOKENS;
            let pages = streams * window.div_ceil(page);
            let embed = src.tensor(names::EMBED).unwrap();
            let buf = DeviceBuffer::from_slice(embed.bytes).unwrap();
            let rows = RowsOnDevice { ptr: buf.ptr(), dtype: embed.dtype, vocab: embed.rows(), cols: embed.cols() };
            let kv = KvTypes::GPU_DEFAULT;
            let backend = CudaBackend::load(&**src, rows, args.max_batch, 0, pages, kv, window, &Tuning::from_env())
                .unwrap_or_else(|e| panic!("load: {e}"));
            let d = Streams::new(backend, window, streams, pages, sampling).unwrap().with_prefix_cache(cache);
            Engine { d: Box::new(d), page, _rows: Some(buf) }
        }
    }
}

/// Steps each (stream, tokens) in one call; returns its seconds. Panics on any failure.
fn step(e: &mut Engine, items: &[(u32, &[u32])]) -> f64 {
    let items = items.iter().map(|&(s, t)| BatchItem::new(s, t)).collect();
    let mut batch = Batch::new(items).unwrap_or_else(|err| panic!("{err}"));
    let t = Instant::now();
    e.d.step_batch(&mut batch).unwrap_or_else(|err| panic!("step_batch: {err}"));
    let secs = t.elapsed().as_secs_f64();
    for b in batch.iter() {
        b.next.as_ref().unwrap_or_else(|err| panic!("stream {}: {err}", b.stream()));
    }
    secs
}

/// `n` ids from a seeded walk over the vocabulary.
fn ids(seed: u32, n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(7919).wrapping_add(seed.wrapping_mul(104729)) + 13) % vocab as u32).collect()
}

fn main() {
    let args = parse();
    if args.kind == Kind::Cuda {
        cuda::require_device(0).unwrap_or_else(|e| {
            eprintln!("bench_prefix: {e}");
            std::process::exit(1);
        });
    }
    let cfg = &args.cfg;
    let t0 = Instant::now();
    // On CUDA the 8B shape's quick weights (block formats repeat 64 rows), read at the same speed.
    let src = Arc::new(match args.kind {
        Kind::Cpu => MemSource::synthetic(cfg, 7, args.recipe),
        Kind::Cuda => MemSource::benchmark(cfg, args.recipe),
    });
    let vocab = cfg.vocab;
    let backend = if args.kind == Kind::Cuda { "CUDA" } else { "CPU" };
    println!(
        "{backend}: hidden {}, {} layers, vocab {}, {}: built in {:.1} s",
        cfg.hidden,
        cfg.layers,
        vocab,
        args.recipe.name(),
        t0.elapsed().as_secs_f64()
    );

    let (n, sys) = (args.system + args.question, args.system);
    let system = ids(1, sys, vocab);
    let prompts: Vec<Vec<u32>> = (0..args.streams)
        .map(|s| system.iter().copied().chain(ids(100 + s as u32, args.question, vocab)).collect())
        .collect();
    let window = n + 8;
    println!(
        "\n{} streams: one {sys}-token system prompt, then a {}-token question each (a call a stream, \
         in turn; then the same with the other streams in one call)",
        args.streams, args.question
    );
    println!(
        "| prefix cache | first stream | each later stream (mean / max) | the slowest after the first later one | ratio to the first | \
         later streams in one call | positions computed | ÷ one prompt | system prompt's ÷ its length | \
         positions held | shared |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for cache in [true, false] {
        let mut e = engine(&args, &src, args.streams, window, cache);
        let page = e.page;
        // Warm-up on the last stream, a prompt and a question of their lengths (other ids): the first call
        // of a chunk's shape sets up its kernels and library plans, once in a server's life, not per prefix.
        let last = args.streams as u32 - 1;
        step(&mut e, &[(last, &ids(9, n, vocab))]);
        e.d.reset(last).unwrap();
        step(&mut e, &[(last, &ids(10, sys, vocab))]);
        step(&mut e, &[(last, &ids(11, args.question, vocab))]);
        e.d.reset(last).unwrap();
        let first = step(&mut e, &[(0, &prompts[0])]);
        let later_count = if cache { args.streams - 1 } else { args.uncached.min(args.streams - 1) };
        let later: Vec<f64> = (1..=later_count).map(|s| step(&mut e, &[(s as u32, &prompts[s])])).collect();
        let u = e.d.kv_usage();
        // What the cache gives a later stream: the system prompt's whole pages (its last token is computed).
        let skip = if cache { (sys / page * page).min(n - 1) } else { 0 };
        let computed = n + (args.streams - 1) * (n - skip);
        let system_computed = sys + (args.streams - 1) * (sys - skip.min(sys));
        // Positions the streams hold (free counts the cache's pages that no stream holds: the warm-up's).
        let held = (u.tokens_total - u.tokens_free) as f64 * args.streams as f64 / (later_count + 1) as f64;
        // The others again, in one call, from empty streams.
        let batch_secs = if cache {
            for s in 1..args.streams {
                e.d.reset(s as u32).unwrap();
            }
            let items: Vec<(u32, &[u32])> = (1..args.streams).map(|s| (s as u32, prompts[s].as_slice())).collect();
            Some(step(&mut e, &items))
        } else {
            None
        };
        let mean = later.iter().sum::<f64>() / later.len().max(1) as f64;
        let (slowest, max) =
            later.iter().copied().enumerate().fold((0, 0f64), |m, (i, t)| if t > m.1 { (i + 1, t) } else { m });
        let after_first = later.iter().skip(1).copied().fold(0f64, f64::max);
        println!(
            "| {} | {:.3} s | {:.3} / {:.3} s (stream {slowest}) | {after_first:.3} s ({:.1}%) | {:.1}% | {} | {computed} | {:.2}x | {:.2}x | {}{} | {} |",
            if cache { "on" } else { "off" },
            first,
            mean,
            max,
            100.0 * after_first / first,
            100.0 * mean / first,
            batch_secs.map_or("-".to_string(), |b| format!("{b:.3} s ({:.2}x the first)", b / first)),
            computed as f64 / n as f64,
            system_computed as f64 / sys as f64,
            held as u64,
            if cache { "" } else { " (extrapolated)" },
            u.tokens_shared,
        );
    }
    println!(
        "(positions computed: the first prompt's {n} and each later one's past the system prompt's whole pages; \
         without the cache, every prompt whole)"
    );

    let len = args.score;
    let text = ids(3, len, vocab);
    let mut e = engine(&args, &src, 2, len + 8, false);
    step(&mut e, &[(0, &ids(9, 64, vocab))]);
    e.d.reset(0).unwrap();
    let mut out = vec![0f32; len];
    let mut best = (f64::MAX, f64::MAX);
    for _ in 0..2 {
        e.d.reset(0).unwrap();
        e.d.reset(1).unwrap();
        let stepped = step(&mut e, &[(0, &text)]);
        let t = Instant::now();
        e.d.score(1, &text, &mut out).unwrap_or_else(|err| panic!("score: {err}"));
        let scored = t.elapsed().as_secs_f64();
        best = (best.0.min(stepped), best.1.min(scored));
    }
    let mean_lp = out[1..].iter().map(|&v| v as f64).sum::<f64>() / (len - 1) as f64;
    println!("\na {len}-token prompt, the faster of two runs (the mean log-probability scored: {mean_lp:.3})");
    println!("| call | seconds | tokens/s | ratio |");
    println!("| --- | --- | --- | --- |");
    println!("| engine_step | {:.3} | {:.0} | 1.00 |", best.0, len as f64 / best.0);
    println!("| engine_score | {:.3} | {:.0} | {:.2} |", best.1, len as f64 / best.1, best.0 / best.1);
}
