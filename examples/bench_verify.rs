//! What verifying proposals costs, on the engine's stream table over the CUDA backend (the Llama-3-8B
//! shape in F16 unless told) or the CPU backend (a small Llama): one stream's step that verifies
//! `--proposals` tokens of prompt lookup against a plain one-token step, then `--streams` streams stepped
//! together with lookup on against off. The weights are random, so proposals are rejected: the second
//! table is the case where speculation buys nothing and the adaptive length has to keep it cheap.
//!
//!     cargo run --release --example bench_verify -- [--backend cpu|cuda] [--dtype f16|bf16|q4_k_m|...]
//!         [--layers N] [--proposals 8] [--streams 16] [--steps 32] [--prompt 512] [--trace 1]
//!
//! Each prompt is a random run of 64 tokens repeated, and every step feeds the run's next token rather
//! than the one drawn, so the stream's history always holds a match for lookup to propose from. The
//! one-stream figure sets the stream's proposal limit to `--proposals` before each timed step (the
//! adaptive rule starts at one and cuts it after a rejection).
//! `--trace 1` prints each many-stream step's time and the proposals it verified.

use std::sync::Arc;
use std::time::Instant;

use hostembed::abi::{engine_draft, engine_speculation};
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

/// The stream table and, on CUDA, the embedding rows it reads (declared after it: dropped later).
struct Table {
    d: Box<dyn Decoder>,
    _rows: Option<DeviceBuffer>,
}

fn table(cuda: bool, src: &Arc<MemSource>, streams: usize, window: usize) -> Table {
    let sampling = Sampling::GREEDY;
    if !cuda {
        let pages = streams * window.div_ceil(hostembed::cpu::PAGE_TOKENS);
        let backend = CpuBackend::with_kv(src.clone(), pages, KvTypes::CPU_DEFAULT, &Tuning::from_env()).unwrap();
        let d = Streams::new(backend, window, streams, pages, sampling).unwrap().with_prefix_cache(false);
        return Table { d: Box::new(d), _rows: None };
    }
    let pages = streams * window.div_ceil(hostembed::gpu::PAGE_TOKENS);
    let embed = src.tensor(names::EMBED).unwrap();
    let buf = DeviceBuffer::from_slice(embed.bytes).unwrap();
    let rows = RowsOnDevice { ptr: buf.ptr(), dtype: embed.dtype, vocab: embed.rows(), cols: embed.cols() };
    let backend = CudaBackend::load(&**src, rows, 512, 0, pages, KvTypes::GPU_DEFAULT, window, &Tuning::from_env())
        .unwrap_or_else(|e| panic!("load: {e}"));
    let d = Streams::new(backend, window, streams, pages, sampling).unwrap().with_prefix_cache(false);
    Table { d: Box::new(d), _rows: Some(buf) }
}

/// A run of 64 ids from a seeded walk over the vocabulary, repeated to `n` tokens.
fn repeating(seed: u32, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| run_token(seed, i, vocab)).collect()
}

/// Position `i` of seed `seed`'s repeated run.
fn run_token(seed: u32, i: usize, vocab: usize) -> u32 {
    let i = (i % 64) as u32;
    (i.wrapping_mul(7919).wrapping_add(seed.wrapping_mul(104729)) + 13) % vocab as u32
}

/// Steps every (stream, input, most) at once; the seconds and each item's output tokens.
fn step(t: &mut Table, items: &[(u32, Vec<u32>, usize)]) -> (f64, Vec<Vec<u32>>) {
    let items = items.iter().map(|(s, input, most)| BatchItem::new(*s, input).with_most(*most)).collect();
    let mut batch = Batch::new(items).unwrap_or_else(|err| panic!("{err}"));
    let start = Instant::now();
    t.d.step_batch(&mut batch).unwrap_or_else(|err| panic!("step_batch: {err}"));
    let secs = start.elapsed().as_secs_f64();
    let outs = batch
        .into_items()
        .into_iter()
        .map(|b| {
            let stream = b.stream();
            let next = b.next.unwrap_or_else(|err| panic!("stream {stream}: {err}"));
            if b.out.is_empty() { vec![next] } else { b.out }
        })
        .collect();
    (secs, outs)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let (mut cuda_backend, mut dtype, mut layers) = (false, None::<Recipe>, None::<usize>);
    let (mut proposals, mut streams, mut steps, mut prompt) = (8usize, 16usize, 32usize, 512usize);
    let mut trace = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("{flag} takes a value"));
        let num = || -> usize { value.parse().unwrap_or_else(|_| panic!("{flag} takes a number")) };
        match flag.as_str() {
            "--backend" => {
                cuda_backend = match value.as_str() {
                    "cpu" => false,
                    "cuda" => true,
                    other => panic!("--backend: cpu or cuda, not {other}"),
                }
            }
            "--dtype" => {
                dtype = Some(Recipe::from_name(&value).unwrap_or_else(|| panic!("--dtype: no format {value}")))
            }
            "--layers" => layers = Some(num()),
            "--proposals" => proposals = num().clamp(1, 15),
            "--streams" => streams = num().max(1),
            "--steps" => steps = num().max(2),
            "--prompt" => prompt = num().max(64),
            "--trace" => trace = value == "1",
            other => panic!("unknown flag {other} (see the comment at the top of examples/bench_verify.rs)"),
        }
    }
    if cuda_backend {
        cuda::require_device(0).unwrap_or_else(|e| {
            eprintln!("bench_verify: {e}");
            std::process::exit(1);
        });
    }
    let (mut cfg, default_recipe) = if cuda_backend {
        (ModelConfig::llama(4096, 32, 32, 8, 14336, 128256), Recipe::Uniform(DType::F16))
    } else {
        (ModelConfig::llama(256, 8, 8, 2, 768, 8192), Recipe::Uniform(DType::Q8_0))
    };
    if let Some(l) = layers {
        cfg.layers = l;
    }
    let recipe = dtype.unwrap_or(default_recipe);
    let t0 = Instant::now();
    // On CUDA the 8B shape's quick weights (block formats repeat 64 rows), read at the same speed.
    let src =
        Arc::new(if cuda_backend { MemSource::benchmark(&cfg, recipe) } else { MemSource::synthetic(&cfg, 7, recipe) });
    println!(
        "{}: hidden {}, {} layers, vocab {}, {}: built in {:.1} s; prompts of {prompt}, {steps} timed steps",
        if cuda_backend { "CUDA" } else { "CPU" },
        cfg.hidden,
        cfg.layers,
        cfg.vocab,
        recipe.name(),
        t0.elapsed().as_secs_f64()
    );
    let lookup =
        engine_speculation { draft: engine_draft::Ngram, max_tokens: proposals as u32, ngram_min: 2, ngram_max: 4 };
    let off = engine_speculation { draft: engine_draft::None, max_tokens: 0, ngram_min: 0, ngram_max: 0 };
    let window = prompt + steps * (proposals + 1) * 2 + 64;

    // One stream: a verification of `proposals` positions against a one-token step, interleaved.
    let mut t = table(cuda_backend, &src, 1, window);
    step(&mut t, &[(0, repeating(1, prompt, cfg.vocab), 1)]);
    let (mut plain, mut verify, mut proposed) = (Vec::new(), Vec::new(), 0u64);
    for i in 0..steps * 2 {
        let verifying = i % 2 == 1;
        t.d.set_speculation(0, if verifying { lookup } else { off }).unwrap();
        if verifying {
            t.d.set_proposal_limit(0, proposals as u32).unwrap();
        }
        let input = vec![run_token(1, t.d.stream_len(0).unwrap(), cfg.vocab)];
        let (secs, _) = step(&mut t, &[(0, input, if verifying { proposals + 1 } else { 1 })]);
        if verifying {
            proposed += t.d.speculation_stats(0).unwrap().0;
            verify.push(secs);
        } else {
            plain.push(secs);
        }
    }
    let (p, v) = (median(plain), median(verify));
    println!("\none stream (median of {steps} steps each)");
    println!("| step | ms | ratio |");
    println!("| --- | --- | --- |");
    println!("| one token | {:.3} | 1.00 |", p * 1e3);
    println!(
        "| verifying {:.1} proposals on average ({proposed} in all) | {:.3} | {:.3} |",
        proposed as f64 / steps as f64,
        v * 1e3,
        v / p
    );
    drop(t);

    // Many streams together, lookup off then on; nothing the random model draws follows the lookup.
    println!("\n{streams} streams stepped together (aggregate tokens/s over {steps} steps after the prompts)");
    println!("| lookup | tokens/s | tokens proposed | accepted | ratio |");
    println!("| --- | --- | --- | --- | --- |");
    let mut base = 0f64;
    for on in [false, true] {
        let mut t = table(cuda_backend, &src, streams, window);
        let items: Vec<(u32, Vec<u32>, usize)> =
            (0..streams as u32).map(|s| (s, repeating(10 + s, prompt, cfg.vocab), 1)).collect();
        step(&mut t, &items);
        for s in 0..streams as u32 {
            t.d.set_speculation(s, if on { lookup } else { off }).unwrap();
        }
        let (mut secs, mut tokens) = (0f64, 0usize);
        for _ in 0..steps {
            let most = if on { proposals + 1 } else { 1 };
            let items: Vec<(u32, Vec<u32>, usize)> = (0..streams as u32)
                .map(|s| (s, vec![run_token(10 + s, t.d.stream_len(s).unwrap(), cfg.vocab)], most))
                .collect();
            let before: u64 = (0..streams as u32).map(|s| t.d.speculation_stats(s).unwrap().0).sum();
            let (dt, outs) = step(&mut t, &items);
            if trace {
                let after: u64 = (0..streams as u32).map(|s| t.d.speculation_stats(s).unwrap().0).sum();
                println!("step {:.3} ms, {} proposals", dt * 1e3, after - before);
            }
            secs += dt;
            tokens += outs.iter().map(Vec::len).sum::<usize>();
        }
        let (p, a) = (0..streams as u32)
            .map(|s| t.d.speculation_stats(s).unwrap())
            .fold((0, 0), |(p, a), (x, y)| (p + x, a + y));
        let rate = tokens as f64 / secs;
        if !on {
            base = rate;
        }
        println!("| {} | {rate:.0} | {p} | {a} | {:.3} |", if on { "on" } else { "off" }, rate / base);
    }
}
