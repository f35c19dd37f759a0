//! Prompt speed on the GPU: a whole prompt in one step (what `engine_step` runs), on a random model of
//! the Llama-3-8B shape, median of several runs; decode right after a long prompt; the chunk size; rows
//! in mapped host memory; Q8_0 weights against BF16; with `--q4-k-m`, llama.cpp's Q4_K_M mix against BF16.
//!
//!     cargo run --release --example bench_prefill -- [--lengths 512,4096,16384,65536] [--runs 5]
//!         [--chunk 2048] [--layers 32] [--quick] [--q4-k-m] [--kv bf16|f16|f32|q8_0|fp8_e4m3[,V]]
//!         [--dtype bf16|f16|...] [--qwen3-30b-a3b]
//!
//! `--qwen3-30b-a3b` measures Qwen3-30B-A3B's Mixture-of-Experts shape (`ModelConfig::qwen3_30b_a3b`;
//! `--layers` still sets its depth) in place of Llama 3 8B's, its matrices 64 random rows repeated (as
//! bench_decode builds it), in `--dtype` or with `--q4-k-m` in the Q4_K_M mix alone, then again with its
//! prompt rows on the warp-a-row expert kernels (`HOSTEMBED_MOE_GROUPED=0`).
//! `--dtype` gives the first tables' weight format (BF16 by default; F16 is what converters write).
//!
//! `--kv` keeps the KV cache in another type (K and V, or K,V apart; BF16 by default): every table then
//! runs with it, so an 8-bit cache's prompt rates and its decode right after a long prompt compare with
//! a run without the flag.
//!
//! `--quick` measures BF16 at 512 and 4096 tokens only (or the `--lengths` given) (for comparing the product routes:
//! HOSTEMBED_CUBLASLT=0 runs the library's own tensor-core kernel), then Q4_K_M when asked. Prints
//! markdown tables. The Q4_K_M model's matrices repeat 64 encoded random rows (the reference encoders
//! are too slow for 8B values; the bytes and the conversions per product are the same).

use std::collections::HashMap;
use std::time::Instant;

use hostembed::checkpoint::write::{MemSource, Recipe};
use hostembed::cuda::{self, DeviceBuffer, PinnedBuffer};
use hostembed::gpu::{GpuModel, PAGE_TOKENS, RowsOnDevice};
use hostembed::kv::{KvType, KvTypes};
use hostembed::model::{ModelConfig, TensorSource, names};
use hostembed::sampler::Sampling;
use hostembed::tensor::{DType, encode_row};
use hostembed::tuning::Tuning;

struct Args {
    lengths: Vec<usize>,
    runs: usize,
    chunk: usize,
    layers: usize,
    quick: bool,
    q4_k_m: bool,
    kv: KvTypes,
    dtype: DType,
    /// Qwen3-30B-A3B's shape in place of Llama 3 8B's.
    moe: bool,
}

fn parse() -> Args {
    let mut a = Args {
        lengths: vec![512, 4096, 16384, 65536],
        runs: 5,
        chunk: 2048,
        layers: 32,
        quick: false,
        q4_k_m: false,
        kv: KvTypes::GPU_DEFAULT,
        dtype: DType::Bf16,
        moe: false,
    };
    let mut layers_given = false;
    let mut lengths_given = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} takes a value"));
        let num = |v: String| -> usize { v.parse().unwrap_or_else(|_| panic!("not a number: {v}")) };
        match flag.as_str() {
            "--lengths" => {
                a.lengths = value().split(',').map(|v| num(v.to_string())).collect();
                lengths_given = true;
            }
            "--runs" => a.runs = num(value()),
            "--chunk" => a.chunk = num(value()),
            "--layers" => {
                a.layers = num(value());
                layers_given = true;
            }
            "--qwen3-30b-a3b" => a.moe = true,
            "--quick" => a.quick = true,
            "--q4-k-m" => a.q4_k_m = true,
            "--kv" => a.kv = parse_kv(&value()),
            "--dtype" => {
                let name = value();
                a.dtype = DType::from_name(&name).unwrap_or_else(|| panic!("--dtype: no format {name}"));
            }
            other => panic!("unknown flag {other} (see the comment at the top of examples/bench_prefill.rs)"),
        }
    }
    if a.moe && !layers_given {
        a.layers = ModelConfig::qwen3_30b_a3b().layers;
    }
    if a.quick && !lengths_given {
        a.lengths = vec![512, 4096];
    }
    a
}

/// `--kv`'s value: one type for K and V, or "K,V".
fn parse_kv(value: &str) -> KvTypes {
    let one = |name: &str| match KvType::parse(name) {
        Some(Some(t)) => t,
        _ => panic!("--kv: bf16, f16, f32, q8_0 or fp8_e4m3 (or K,V), not {value:?}"),
    };
    match value.split_once(',') {
        Some((k, v)) => KvTypes { k: one(k), v: one(v) },
        None => KvTypes::same(one(value)),
    }
}

/// The benchmark's shape at `layers` layers: Llama 3 8B's, or Qwen3-30B-A3B's.
fn shape(layers: usize, moe: bool) -> ModelConfig {
    let cfg = if moe { ModelConfig::qwen3_30b_a3b() } else { ModelConfig::llama(4096, 32, 32, 8, 14336, 128256) };
    ModelConfig { layers, ..cfg }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn prompt_of(len: usize, vocab: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (i.wrapping_mul(7919) + 13) % vocab as u32).collect()
}

/// Median tokens per second of a `len`-token prompt in one step (after one warm-up run), and the
/// tokens per second of `decode` greedy steps right after the last run's prompt.
fn prompt_rate(gpu: &mut GpuModel, len: usize, runs: usize, decode: usize) -> (f64, f64) {
    let prompt = prompt_of(len, gpu.config().vocab);
    let mut rates = Vec::new();
    let mut decode_rate = 0.0;
    for run in 0..runs + 1 {
        let mut pool = gpu.page_pool().unwrap();
        let mut stream = gpu.new_stream(len + decode + 1).unwrap();
        let t = Instant::now();
        let mut next = gpu.step(&mut pool, &mut stream, &prompt, &Sampling::GREEDY, 0).unwrap();
        let s = t.elapsed().as_secs_f64();
        if run > 0 {
            rates.push(len as f64 / s);
        }
        if run == runs && decode > 0 {
            let t = Instant::now();
            for _ in 0..decode {
                next = gpu.step(&mut pool, &mut stream, &[next], &Sampling::GREEDY, 0).unwrap();
            }
            decode_rate = decode as f64 / t.elapsed().as_secs_f64();
        }
    }
    (median(rates), decode_rate)
}

/// The model's rows on the card, or in pinned mapped host memory: held to keep them alive.
#[allow(dead_code)]
enum Rows {
    Card(DeviceBuffer),
    Host(PinnedBuffer),
}

impl Rows {
    fn new(src: &MemSource, host: bool) -> (Rows, RowsOnDevice) {
        let e = src.tensor(names::EMBED).unwrap();
        let (rows, ptr) = if host {
            let mut p = PinnedBuffer::new_mapped(e.bytes.len()).unwrap();
            p.as_mut_slice().copy_from_slice(e.bytes);
            let ptr = p.device_ptr();
            (Rows::Host(p), ptr)
        } else {
            let b = DeviceBuffer::from_slice(e.bytes).unwrap();
            let ptr = b.ptr();
            (Rows::Card(b), ptr)
        };
        (rows, RowsOnDevice { ptr, dtype: e.dtype, vocab: e.rows(), cols: e.cols() })
    }
}

fn build(cfg: &ModelConfig, dtype: DType) -> MemSource {
    let t = Instant::now();
    let src = MemSource::synthetic(cfg, 1, dtype);
    println!("built the {} model in {:.1} s", dtype.name(), t.elapsed().as_secs_f64());
    src
}

/// The Q4_K_M mix of the model: the BF16 synthetic model with every matrix replaced by 64 encoded random
/// rows repeated, each in the format `Recipe::Q4KM` gives it.
fn build_q4_k_m(cfg: &ModelConfig) -> MemSource {
    let t = Instant::now();
    let mut src = MemSource::synthetic(cfg, 1, DType::Bf16);
    let mut state = 0x5eed_u64;
    for tensor in src.tensors.values_mut() {
        if tensor.shape.len() != 2 {
            continue;
        }
        let dtype = Recipe::Q4KM.dtype(cfg, &tensor.name, &tensor.shape);
        let (rows, cols) = (tensor.shape[0], tensor.shape[1]);
        let Some(row_bytes) = dtype.row_bytes(cols) else { continue };
        let mut sample = Vec::new();
        for _ in 0..rows.min(64) {
            let values: Vec<f32> = (0..cols)
                .map(|_| {
                    state = hostembed::sampler::splitmix64(state);
                    ((state >> 40) as f32 / 16_777_216.0 * 2.0 - 1.0) / (cols as f32).sqrt()
                })
                .collect();
            sample.extend(encode_row(dtype, &values));
        }
        tensor.data = sample.iter().copied().cycle().take(rows * row_bytes).collect();
        tensor.dtype = dtype;
    }
    println!("built the Q4_K_M model in {:.1} s", t.elapsed().as_secs_f64());
    src
}

/// Prompt speed of the Q4_K_M mix against the BF16 rates measured before.
fn q4_k_m_table(cfg: &ModelConfig, args: &Args, bf16_at: &HashMap<usize, f64>) {
    let src = build_q4_k_m(cfg);
    let (_rows, rows) = Rows::new(&src, false);
    let mut gpu = load(&src, rows, args.chunk, 4096 + 129, args.kv);
    println!("{}", gpu.prompt_route());
    println!("\n| prompt tokens | Q4_K_M tok/s | of BF16 |");
    println!("| --- | --- | --- |");
    for len in [512, 4096] {
        let (rate, _) = prompt_rate(&mut gpu, len, args.runs, 0);
        let of = bf16_at.get(&len).map_or("-".to_string(), |b| format!("{:.0}%", 100.0 * rate / b));
        println!("| {len} | {rate:.0} | {of} |");
    }
    let (_, decode) = prompt_rate(&mut gpu, 64, args.runs, 128);
    println!("\nQ4_K_M decode after a 64-token prompt: {decode:.1} tok/s");
}

/// The model with a KV pool in `kv`'s types for one stream of `positions`.
fn load(src: &MemSource, rows: RowsOnDevice, chunk: usize, positions: usize, kv: KvTypes) -> GpuModel {
    GpuModel::load_for_window(src, rows, chunk, positions.div_ceil(PAGE_TOKENS), kv, positions, &Tuning::from_env())
        .unwrap_or_else(|e| panic!("load: {e}"))
}

fn main() {
    let args = parse();
    cuda::require_device(0).unwrap_or_else(|e| {
        eprintln!("bench_prefill: {e}");
        std::process::exit(1);
    });
    let cfg = shape(args.layers, args.moe);
    let src = match (args.moe, args.q4_k_m) {
        (false, _) => build(&cfg, args.dtype),
        (true, q4_k_m) => {
            let t = Instant::now();
            let src = MemSource::benchmark(&cfg, if q4_k_m { Recipe::Q4KM } else { Recipe::Uniform(args.dtype) });
            println!("built the Mixture-of-Experts model in {:.1} s", t.elapsed().as_secs_f64());
            src
        }
    };
    let name = if args.moe && args.q4_k_m { "Q4_K_M".to_string() } else { args.dtype.name().to_uppercase() };
    let (_rows, rows) = Rows::new(&src, false);
    // Room for the longest prompt and the decode after it.
    let positions = args.lengths.iter().copied().max().unwrap_or(4096).max(4096) + 65;
    let mut gpu = load(&src, rows, args.chunk, positions, args.kv);
    println!("{}", gpu.prompt_route());
    println!("KV cache {} ({} bytes a position)", args.kv.describe(), args.kv.bytes_per_token(&cfg));
    let scratch = GpuModel::scratch_bytes(&src, args.chunk, args.kv, positions, &Tuning::from_env());
    println!(
        "chunk {} tokens: scratch {:.2} GiB (weights {:.2} GiB)",
        args.chunk,
        scratch as f64 / (1u64 << 30) as f64,
        GpuModel::weight_bytes(&src) as f64 / (1u64 << 30) as f64
    );

    println!("\n| prompt tokens | {name} tok/s | seconds | decode right after, tok/s |");
    println!("| --- | --- | --- | --- |");
    let mut bf16_at = HashMap::new();
    for &len in &args.lengths {
        let decode = if len >= 16384 { 64 } else { 0 };
        let runs = if len >= 65536 { args.runs.min(3) } else { args.runs };
        let (rate, dec) = prompt_rate(&mut gpu, len, runs, decode);
        bf16_at.insert(len, rate);
        let dec = if decode > 0 { format!("{dec:.1}") } else { "-".into() };
        println!("| {len} | {rate:.0} | {:.2} | {dec} |", len as f64 / rate);
    }
    if args.moe {
        // The same model again with its prompt rows on the decode rows' warp-a-row expert kernels.
        drop(gpu);
        let warp = Tuning { moe_grouped: false, ..Tuning::from_env() };
        gpu = GpuModel::load_for_window(
            &src,
            rows,
            args.chunk,
            positions.div_ceil(PAGE_TOKENS),
            args.kv,
            positions,
            &warp,
        )
        .unwrap_or_else(|e| panic!("load: {e}"));
        println!("\n| prompt tokens | {name} tok/s, experts warp a row | against the grouped products |");
        println!("| --- | --- | --- |");
        for &len in &args.lengths {
            let (rate, _) = prompt_rate(&mut gpu, len, args.runs, 0);
            println!("| {len} | {rate:.0} | {:.2}x |", bf16_at[&len] / rate);
        }
    }
    if args.quick {
        if args.q4_k_m && !args.moe {
            drop(gpu);
            drop(_rows);
            drop(src);
            q4_k_m_table(&cfg, &args, &bf16_at);
        }
        return;
    }
    let (_, short) = prompt_rate(&mut gpu, 64, args.runs, 128);
    println!("\ndecode after a 64-token prompt: {short:.1} tok/s");

    println!("\n| chunk (tokens) | 4096-token prompt, tok/s | scratch GiB |");
    println!("| --- | --- | --- |");
    for chunk in [512, 1024, 2048, 4096] {
        drop(gpu);
        gpu = load(&src, rows, chunk, positions, args.kv);
        let (rate, _) = prompt_rate(&mut gpu, 4096, args.runs, 0);
        let gib =
            GpuModel::scratch_bytes(&src, chunk, args.kv, positions, &Tuning::from_env()) as f64 / (1u64 << 30) as f64;
        println!("| {chunk} | {rate:.0} | {gib:.2} |");
    }
    drop(gpu);

    // Rows in pinned host memory the card reads over the bus.
    let (_host_rows, host) = Rows::new(&src, true);
    let mut gpu = load(&src, host, args.chunk, positions, args.kv);
    let (mapped, _) = prompt_rate(&mut gpu, 4096, args.runs, 0);
    let card = bf16_at.get(&4096).copied().unwrap_or(f64::NAN);
    println!(
        "\nrows in mapped host memory, 4096-token prompt: {mapped:.0} tok/s against {card:.0} on the card ({:+.1}%)",
        100.0 * (mapped / card - 1.0)
    );
    drop(gpu);
    drop(_host_rows);
    drop(_rows);
    drop(src);

    let q8 = build(&cfg, DType::Q8_0);
    let (_q8_rows, rows) = Rows::new(&q8, false);
    let mut gpu = load(&q8, rows, args.chunk, positions, args.kv);
    println!("\n| prompt tokens | Q8_0 tok/s | of BF16 |");
    println!("| --- | --- | --- |");
    for len in [512, 4096] {
        let (rate, _) = prompt_rate(&mut gpu, len, args.runs, 0);
        let of = bf16_at.get(&len).map_or("-".to_string(), |b| format!("{:.0}%", 100.0 * rate / b));
        println!("| {len} | {rate:.0} | {of} |");
    }
    if args.q4_k_m && !args.moe {
        drop(gpu);
        drop(_q8_rows);
        drop(q8);
        q4_k_m_table(&cfg, &args, &bf16_at);
    }
}
