//! Aggregate decode speed of many streams stepped together on the GPU, on a random model of a given
//! shape (Llama-3-8B BF16 by default): every stream is prefilled to the cache length, then each step is
//! one batch of one token per stream. Rows for 1, 8, 16 and 64 streams at a 512-token cache, each in the
//! batch-invariant default and with the batch tensor-core option; then 64 streams of 2,048 tokens in a
//! pool sized for two 64k windows; then (unless --no-host-rows) the largest stream count again with the
//! embedding rows in mapped host memory instead of on the card.
//!
//!     cargo run --release --example bench_batch -- [--layers 32] [--dtype bf16|f16|q8_0|...|q4_k_m]
//!         [--cache 512] [--steps 64] [--streams 1,8,16,64] [--max-batch 512] [--no-long] [--no-host-rows]
//!         [--qwen3-30b-a3b] [--model FILE]
//!
//! `--qwen3-30b-a3b` measures Qwen3-30B-A3B's Mixture-of-Experts shape (`ModelConfig::qwen3_30b_a3b`;
//! `--layers` still sets its depth) in place of Llama 3 8B's. `--model` reads a checkpoint (a GGUF file
//! or an HF folder: the file llama.cpp is measured on) instead of a random model of a shape.
//!
//! HOSTEMBED_CUDA_GRAPHS=0 runs without CUDA graphs.

use std::time::Instant;

use hostembed::backend::StepItem;
use hostembed::checkpoint::Checkpoint;
use hostembed::checkpoint::write::{MemSource, Recipe};
use hostembed::cuda::{self, DeviceBuffer, PinnedBuffer};
use hostembed::gpu::{GpuModel, GpuStream, PAGE_TOKENS, RowsOnDevice, reserve_pages, truncate_stream};
use hostembed::model::{ModelConfig, TensorSource, names};
use hostembed::sampler::Sampling;
use hostembed::tensor::DType;
use hostembed::tuning::Tuning;

struct Args {
    cfg: ModelConfig,
    recipe: Recipe,
    cache: usize,
    steps: usize,
    streams: Vec<usize>,
    max_batch: usize,
    long: bool,
    host_rows: bool,
    model: Option<std::path::PathBuf>,
}

fn parse() -> Args {
    let mut cfg = ModelConfig::llama(4096, 32, 32, 8, 14336, 128256);
    let mut a = Args {
        cfg: cfg.clone(),
        recipe: Recipe::Uniform(DType::Bf16),
        cache: 512,
        steps: 64,
        streams: vec![1, 8, 16, 64],
        max_batch: 512,
        long: true,
        host_rows: true,
        model: None,
    };
    let mut layers = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} takes a value"));
        match flag.as_str() {
            "--layers" => layers = Some(value().parse().expect("--layers takes a number")),
            "--qwen3-30b-a3b" => cfg = ModelConfig::qwen3_30b_a3b(),
            "--cache" => a.cache = value().parse().expect("--cache takes a number"),
            "--steps" => a.steps = value().parse().expect("--steps takes a number"),
            "--max-batch" => a.max_batch = value().parse().expect("--max-batch takes a number"),
            "--streams" => {
                a.streams = value().split(',').map(|s| s.parse().expect("--streams takes numbers: 1,8,16,64")).collect()
            }
            "--no-long" => a.long = false,
            "--no-host-rows" => a.host_rows = false,
            "--model" => a.model = Some(value().into()),
            "--dtype" => {
                let name = value();
                a.recipe = Recipe::from_name(&name)
                    .unwrap_or_else(|| panic!("--dtype: a format name (bf16, f16, q8_0, ...) or q4_k_m, not {name}"))
            }
            other => panic!("unknown flag {other} (see the comment at the top of examples/bench_batch.rs)"),
        }
    }
    cfg.layers = layers.unwrap_or(cfg.layers);
    a.cfg = cfg;
    a
}

/// Steps one batch: each stream in `streams` with its tokens, greedy, after taking its pages from `pool`.
/// Returns each item's sampled token; panics on any failure, naming the stream.
fn step(
    gpu: &mut GpuModel,
    pool: &mut hostembed::backend::PagePool,
    streams: &mut [GpuStream],
    tokens: &[Vec<u32>],
) -> Vec<u32> {
    for (i, (s, t)) in streams.iter_mut().zip(tokens).enumerate() {
        reserve_pages(pool, s, t.len()).unwrap_or_else(|e| panic!("stream {i}: {e}"));
    }
    let mut items: Vec<StepItem<'_, _>> = streams
        .iter_mut()
        .zip(tokens)
        .enumerate()
        .map(|(i, (stream, tokens))| StepItem::new(stream, i as u32, tokens, Sampling::GREEDY))
        .collect();
    gpu.step_batch(&mut items).unwrap_or_else(|e| panic!("step_batch: {e}"));
    items.into_iter().enumerate().map(|(i, it)| it.next.unwrap_or_else(|e| panic!("stream {i}: {e}"))).collect()
}

/// Prefills `count` streams to `cache` tokens, then times `steps` batched single-token steps; returns
/// (aggregate tokens per second, milliseconds a step). The streams are emptied after.
fn decode_rate(gpu: &mut GpuModel, count: usize, cache: usize, steps: usize, tensor_cores: bool) -> (f64, f64) {
    gpu.set_batch_tensor_cores(tensor_cores);
    let vocab = gpu.config().vocab as u32;
    let window = cache + steps + 8;
    let mut pool = gpu.page_pool().unwrap();
    let mut streams: Vec<GpuStream> = (0..count).map(|_| gpu.new_stream(window).unwrap()).collect();
    let prompts: Vec<Vec<u32>> = (0..count)
        .map(|s| (0..cache as u32).map(|i| (i.wrapping_mul(7919) + 13 + s as u32 * 101) % vocab).collect())
        .collect();
    let mut next: Vec<Vec<u32>> = step(gpu, &mut pool, &mut streams, &prompts).into_iter().map(|t| vec![t]).collect();
    // Warm-up: the first steps of a size run plain, then capture its graph.
    let warm = 3;
    let mut t = Instant::now();
    for k in 0..warm + steps {
        if k == warm {
            t = Instant::now();
        }
        next = step(gpu, &mut pool, &mut streams, &next).into_iter().map(|t| vec![t]).collect();
    }
    let secs = t.elapsed().as_secs_f64();
    for s in streams.iter_mut() {
        truncate_stream(&mut pool, s, 0).unwrap();
    }
    assert_eq!(pool.free_pages(), pool.total_pages(), "pages not given back");
    ((count * steps) as f64 / secs, secs * 1e3 / steps as f64)
}

fn main() {
    let args = parse();
    cuda::require_device(0).unwrap_or_else(|e| {
        eprintln!("bench_batch: {e}");
        std::process::exit(1);
    });
    let t0 = Instant::now();
    let (src, what): (Box<dyn TensorSource>, String) = match &args.model {
        Some(path) => {
            let ckpt = Checkpoint::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            (Box::new(ckpt), path.display().to_string())
        }
        None => (Box::new(MemSource::benchmark(&args.cfg, args.recipe)), args.recipe.name().to_string()),
    };
    let (src, cfg) = (&*src, src.config());
    let embed = src.tensor(names::EMBED).unwrap();
    let rows_buf = DeviceBuffer::from_slice(embed.bytes).unwrap();
    let rows = RowsOnDevice { ptr: rows_buf.ptr(), dtype: embed.dtype, vocab: embed.rows(), cols: embed.cols() };
    // The pool holds two 64k windows: enough for every row below and the 64 x 2,048 run.
    let most = args.streams.iter().copied().max().unwrap_or(1) * (args.cache + args.steps + 8 + PAGE_TOKENS);
    let pages = (2 * 65536usize).max(most).div_ceil(PAGE_TOKENS);
    let mut gpu =
        GpuModel::load(src, rows, args.max_batch, pages, &Tuning::from_env()).unwrap_or_else(|e| panic!("load: {e}"));
    println!(
        "{} layers {what}: weights {:.2} GB, KV pool {:.2} GiB ({} pages of {PAGE_TOKENS}), loaded in {:.1} s",
        cfg.layers,
        GpuModel::weight_bytes(src) as f64 / 1e9,
        GpuModel::pool_bytes(cfg, gpu.kv_types(), pages) as f64 / (1u64 << 30) as f64,
        pages,
        t0.elapsed().as_secs_f64()
    );

    println!(
        "\naggregate decode, each stream at a {}-token cache, {} steps after 3 warm-up steps",
        args.cache, args.steps
    );
    println!(
        "| streams | tok/s (batch invariant) | ms/step | tok/s (batch tensor cores) | ms/step | invariance costs |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    for &count in &args.streams {
        let (inv, inv_ms) = decode_rate(&mut gpu, count, args.cache, args.steps, false);
        let (tc, tc_ms) = decode_rate(&mut gpu, count, args.cache, args.steps, true);
        println!(
            "| {count} | {inv:.0} | {inv_ms:.2} | {tc:.0} | {tc_ms:.2} | {:.0}% |",
            100.0 * (1.0 - inv / tc.max(1e-9)).max(0.0)
        );
    }

    if args.long {
        // 64 streams of 2,048 positions fill the two-window pool exactly: prompts of 2,048 - steps.
        let (count, total, steps) = (64, 2048, 32);
        let pool_tokens = pages * PAGE_TOKENS;
        println!("\n{count} streams of {total} tokens in a pool of {pool_tokens} tokens (two 64k windows)");
        println!("| mode | tok/s | ms/step |");
        println!("| --- | --- | --- |");
        for tensor_cores in [false, true] {
            let (rate, ms) = decode_rate(&mut gpu, count, total - steps - 3, steps, tensor_cores);
            println!(
                "| {} | {rate:.0} | {ms:.2} |",
                if tensor_cores { "batch tensor cores" } else { "batch invariant" }
            );
        }
    }

    if args.host_rows {
        // The same model reading its embedding rows from mapped host memory.
        let count = args.streams.iter().copied().max().unwrap_or(1);
        let mut pinned = PinnedBuffer::new_mapped(embed.bytes.len()).unwrap();
        pinned.as_mut_slice().copy_from_slice(embed.bytes);
        let mapped = RowsOnDevice { ptr: pinned.device_ptr(), ..rows };
        drop(gpu);
        let mut host = GpuModel::load(src, mapped, args.max_batch, pages, &Tuning::from_env())
            .unwrap_or_else(|e| panic!("load: {e}"));
        println!("\n{count} streams at a {}-token cache, rows in mapped host memory", args.cache);
        println!("| mode | tok/s | ms/step |");
        println!("| --- | --- | --- |");
        for tensor_cores in [false, true] {
            let (rate, ms) = decode_rate(&mut host, count, args.cache, args.steps, tensor_cores);
            let mode = if tensor_cores { "batch tensor cores" } else { "batch invariant" };
            println!("| {mode} | {rate:.0} | {ms:.2} |");
        }
    }
}
