//! What a constraint costs on the host, for a real model's vocabulary (SmolLM2-135M's 49,152 tokens by
//! default): the vocabulary's llguidance trie built once, each constraint's compile, then, feeding a
//! valid output token by token as a stream would, the mask's computation and the token's consumption
//! at each step, and the masked draw (greedy and sampled) against the free one on random logits. Prints
//! a table; the figures are per token, on one thread.
//!
//!     cargo run --release --example bench_constraint -- [MODEL.gguf or HF folder] [--runs 3]
//!
//! With `--backend cuda` (or cpu), what a constraint adds to a decode step instead: the engine's own
//! stream table (`Streams`) over the backend on a random model, the Llama-3-8B shape (BF16) on CUDA and a
//! small Llama on the CPU unless `--shape` says, MODEL's tokenizer as the vocabulary (ids past its own
//! count are never allowed; pass Llama-3's own, a GGUF or HF folder, for its 128,256 ids). Steps of 1 and
//! of 16 streams, greedy and drawn (temperature 0.8, top-p 0.95), free and each stream held to the first
//! JSON schema below: the mean step time, the aggregate tokens/s, and the constraint's share of the
//! constrained step. The mask is computed on a host thread while the device runs the forward; the device's
//! sampler applies it, so its cost there is the wait for masks the forward did not cover, one copy of the
//! masks a pass, and the masked draw. A constraint that completes is set again between steps (untimed).
//!
//! MODEL may be a tokenizer.json alone (its end-of-generation ids: those of the usual names it has).
//!
//!     cargo run --release --example bench_constraint -- [MODEL] --backend cuda [--shape 8b|small]
//!         [--layers N] [--prompt 128] [--steps 64] [--streams 16]

use std::sync::Arc;
use std::time::Instant;

use hostembed::abi::engine_constraint;
use hostembed::backend::{Batch, BatchItem, Decoder, Streams};
use hostembed::checkpoint::Checkpoint;
use hostembed::checkpoint::write::{MemSource, Recipe};
use hostembed::constraint::Grammars;
use hostembed::cpu::CpuBackend;
use hostembed::cuda::{self, DeviceBuffer};
use hostembed::gpu::{CudaBackend, RowsOnDevice};
use hostembed::kv::KvTypes;
use hostembed::model::{ModelConfig, TensorSource, names};
use hostembed::sampler::{self, Sampling, splitmix64};
use hostembed::tensor::DType;
use hostembed::tokenizer::{Tokenizer, special};
use hostembed::tuning::Tuning;

/// (name, kind, constraint text, a valid output).
const CASES: &[(&str, engine_constraint, &str, &str)] = &[
    (
        "JSON schema: flat object",
        engine_constraint::JsonSchema,
        r#"{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer","minimum":0,"maximum":120},"email":{"type":"string"},"tags":{"type":"array","items":{"type":"string"}}},"required":["name","age","email","tags"]}"#,
        r#"{"name": "John Smith", "age": 45, "email": "john.smith@example.com", "tags": ["admin", "early adopter"]}"#,
    ),
    (
        "JSON schema: nested, enums",
        engine_constraint::JsonSchema,
        r#"{"type":"object","properties":{"forecast":{"type":"array","items":{"type":"object","properties":{"day":{"enum":["Monday","Tuesday","Wednesday"]},"high":{"type":"integer","minimum":-30,"maximum":50},"low":{"type":"integer","minimum":-40,"maximum":40}},"required":["day","high","low"]}}},"required":["forecast"]}"#,
        "{\n  \"forecast\": [\n    {\"day\": \"Monday\", \"high\": 25, \"low\": 20},\n    {\"day\": \"Tuesday\", \"high\": 30, \"low\": 25}\n  ]\n}",
    ),
    (
        "JSON schema: free text in a string",
        engine_constraint::JsonSchema,
        r#"{"type":"object","properties":{"comment":{"type":"string","maxLength":300}},"required":["comment"]}"#,
        r#"{"comment": "The hotel was lovely, the staff were kind to us during our stay, and the breakfast had fresh bread every morning."}"#,
    ),
    (
        "any JSON value",
        engine_constraint::Json,
        "",
        r#"{"id": 1234, "items": [{"sku": "A-1", "qty": 2, "price": 9.99}, {"sku": "B-7", "qty": 1, "price": 120.5}], "paid": true, "note": null}"#,
    ),
    (
        "regex: email",
        engine_constraint::Regex,
        r"[a-z]{2,10}\.[a-z]{2,10}@[a-z]{2,12}\.(com|org|net)",
        "john.smith@example.com",
    ),
    (
        "Lark: arithmetic",
        engine_constraint::Lark,
        "start: sum\nsum: product ((\"+\" | \"-\") product)*\nproduct: factor ((\"*\" | \"/\") factor)*\nfactor: NUMBER | \"(\" sum \")\"\nNUMBER: /[0-9]+/\n",
        "(12+3)*4-5/6+(7*(8-9))",
    ),
];

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// The command line of the step benchmark (`--backend`).
struct StepArgs {
    cuda: bool,
    cfg: ModelConfig,
    recipe: Recipe,
    prompt: usize,
    steps: usize,
    streams: usize,
}

/// A model's vocabulary (a GGUF file or HF folder), or a tokenizer.json alone, whose end-of-generation
/// ids are then those of the usual names it has: (ids, tokenizer, end-of-generation ids).
fn vocabulary(model: &str) -> (usize, Arc<Tokenizer>, Vec<u32>) {
    let path = std::path::Path::new(model);
    if model.ends_with(".json") {
        let t = Tokenizer::from_json(path).unwrap_or_else(|e| panic!("{model}: {e}"));
        let names = ["<|eot_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>", "</s>", "<|eos|>"];
        let eog: Vec<u32> = names.iter().filter_map(|n| t.token_id(n)).collect();
        assert!(!eog.is_empty(), "{model}: none of {names:?} is a token; constraints need an end of generation");
        return (t.vocab_size(), Arc::new(t), eog);
    }
    let ckpt =
        Checkpoint::open(path).unwrap_or_else(|e| panic!("{model}: {e} (scripts/fetch-smollm.sh fetches SmolLM2)"));
    let vocab = ckpt.config.vocab;
    let tokenizer = Arc::new(Tokenizer::from_source(&ckpt.tokenizer, vocab).unwrap().expect("the model's tokenizer"));
    let rules = special::resolve(&ckpt.special, ckpt.config.bos, ckpt.config.eos, vocab, Some(&*tokenizer));
    (vocab, tokenizer, rules.eog)
}

fn main() {
    let mut model = "models/SmolLM2-135M-Instruct.Q4_1.gguf".to_string();
    let mut runs = 3usize;
    let (mut backend, mut shape, mut layers) = (None::<String>, None::<String>, None::<usize>);
    let (mut prompt, mut steps, mut streams) = (128usize, 64usize, 16usize);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |flag: &str| args.next().unwrap_or_else(|| panic!("{flag} takes a value"));
        let num = |v: String, flag: &str| -> usize { v.parse().unwrap_or_else(|_| panic!("{flag} takes a number")) };
        match a.as_str() {
            "--runs" => runs = num(value("--runs"), "--runs"),
            "--backend" => backend = Some(value("--backend")),
            "--shape" => shape = Some(value("--shape")),
            "--layers" => layers = Some(num(value("--layers"), "--layers")),
            "--prompt" => prompt = num(value("--prompt"), "--prompt"),
            "--steps" => steps = num(value("--steps"), "--steps"),
            "--streams" => streams = num(value("--streams"), "--streams"),
            flag if flag.starts_with("--") => panic!("unknown flag {flag} (see examples/bench_constraint.rs)"),
            _ => model = a,
        }
    }
    let (vocab, tokenizer, eog) = vocabulary(&model);
    if let Some(backend) = backend {
        let cuda = match backend.as_str() {
            "cuda" => true,
            "cpu" => false,
            other => panic!("--backend: cpu or cuda, not {other}"),
        };
        let shape = shape.unwrap_or_else(|| if cuda { "8b".into() } else { "small".into() });
        let (mut cfg, recipe) = match shape.as_str() {
            "small" => (ModelConfig::llama(256, 8, 8, 2, 768, 8192), Recipe::Uniform(DType::Q8_0)),
            "8b" => (ModelConfig::llama(4096, 32, 32, 8, 14336, 128256), Recipe::Uniform(DType::Bf16)),
            other => panic!("--shape: small or 8b, not {other}"),
        };
        cfg.layers = layers.unwrap_or(cfg.layers);
        // The logits are the shape's; the tokenizer's ids are the first of them.
        cfg.vocab = cfg.vocab.max(vocab);
        let a = StepArgs { cuda, cfg, recipe, prompt, steps, streams };
        return step_costs(&a, &model, tokenizer, &eog);
    }
    let t = Instant::now();
    let grammars = Grammars::new(Arc::clone(&tokenizer), vocab, &eog).unwrap();
    println!("{model}: vocabulary of {vocab}; llguidance's trie and factory built in {:.1} ms", ms(t));

    let mut rng = 0x5EEDu64;
    let mut logits = vec![0f32; vocab];
    let greedy = Sampling::GREEDY;
    let drawn = Sampling { temperature: 0.8, top_p: 0.95, seed: 7, ..Sampling::GREEDY };
    println!();
    println!(
        "| constraint | tokens | compile ms | mask us mean | mask us p50 | mask us max | consume us | allowed mean | masked greedy us | masked top-p us |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let (mut free_greedy, mut free_drawn) = (Vec::new(), Vec::new());
    for &(name, kind, text, output) in CASES {
        let ids = tokenizer.encode(output, None).unwrap();
        let (mut compile, mut masks, mut consume, mut allowed, mut mg, mut md) =
            (Vec::new(), Vec::new(), Vec::new(), 0usize, Vec::new(), Vec::new());
        for _ in 0..runs {
            let t = Instant::now();
            let mut c = grammars.compile(kind, text).unwrap().expect("a constraint");
            compile.push(ms(t));
            c.stepped(0);
            for (k, &id) in ids.iter().enumerate() {
                let t = Instant::now();
                let mask = c.mask().unwrap();
                masks.push(us(t));
                assert!(mask.is_allowed(id), "{name}: token {k} ({id}) is not allowed");
                allowed += mask.num_set();
                for l in logits.iter_mut() {
                    rng = splitmix64(rng);
                    *l = (rng >> 40) as f32 / (1u64 << 20) as f32;
                }
                let words = mask.as_slice();
                let t = Instant::now();
                std::hint::black_box(sampler::sample_stream_masked(&logits, words, &greedy, 0, &ids[..k], &[]));
                mg.push(us(t));
                let t = Instant::now();
                std::hint::black_box(sampler::sample_stream_masked(&logits, words, &drawn, 0, &ids[..k], &[]));
                md.push(us(t));
                let t = Instant::now();
                std::hint::black_box(sampler::sample_stream(&logits, &greedy, 0, &ids[..k], &[]));
                free_greedy.push(us(t));
                let t = Instant::now();
                std::hint::black_box(sampler::sample_stream(&logits, &drawn, 0, &ids[..k], &[]));
                free_drawn.push(us(t));
                let t = Instant::now();
                c.feed(k, &[id]).unwrap();
                consume.push(us(t));
            }
        }
        compile.sort_by(f64::total_cmp);
        masks.sort_by(f64::total_cmp);
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        println!(
            "| {name} | {} | {:.2} | {:.1} | {:.1} | {:.0} | {:.1} | {:.0} | {:.1} | {:.1} |",
            ids.len(),
            percentile(&compile, 0.5),
            mean(&masks),
            percentile(&masks, 0.5),
            masks[masks.len() - 1],
            mean(&consume),
            allowed as f64 / masks.len() as f64,
            mean(&mg),
            mean(&md),
        );
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    println!(
        "| no constraint (the same logits) | | | | | | | {vocab} | {:.1} | {:.1} |",
        mean(&free_greedy),
        mean(&free_drawn)
    );
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn us(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}

/// The engine's stream table over the backend `a` names, its streams holding `window` positions, and what
/// it reads.
struct Engine {
    d: Box<dyn Decoder>,
    // Declared after `d`: the CUDA backend reads the rows until it is dropped.
    _rows: Option<DeviceBuffer>,
}

fn engine(a: &StepArgs, src: &Arc<MemSource>, window: usize) -> Engine {
    let sampling = Sampling::GREEDY;
    if !a.cuda {
        let pages = a.streams * window.div_ceil(hostembed::cpu::PAGE_TOKENS);
        let backend = CpuBackend::with_kv(src.clone(), pages, KvTypes::CPU_DEFAULT, &Tuning::from_env()).unwrap();
        let d = Streams::new(backend, window, a.streams, pages, sampling).unwrap();
        return Engine { d: Box::new(d), _rows: None };
    }
    let pages = a.streams * window.div_ceil(hostembed::gpu::PAGE_TOKENS);
    let embed = src.tensor(names::EMBED).unwrap();
    let buf = DeviceBuffer::from_slice(embed.bytes).unwrap();
    let rows = RowsOnDevice { ptr: buf.ptr(), dtype: embed.dtype, vocab: embed.rows(), cols: embed.cols() };
    let backend = CudaBackend::load(&**src, rows, 64, 0, pages, KvTypes::GPU_DEFAULT, window, &Tuning::from_env())
        .unwrap_or_else(|e| panic!("load: {e}"));
    let d = Streams::new(backend, window, a.streams, pages, sampling).unwrap();
    Engine { d: Box::new(d), _rows: Some(buf) }
}

/// Mean seconds of a step of streams 0..n, free or each held to the first JSON schema, after a prompt each
/// and a few untimed steps; a constraint that completes is set again between steps.
fn mean_step(e: &mut Engine, a: &StepArgs, grammars: &Grammars, eog: &[u32], n: usize, constrained: bool) -> f64 {
    let vocab = a.cfg.vocab as u64;
    let (_, kind, text, _) = CASES[0];
    let fresh = || grammars.compile(kind, text).unwrap();
    let mut feed: Vec<Vec<u32>> = (0..n)
        .map(|s| {
            e.d.reset(s as u32).unwrap();
            e.d.set_constraint(s as u32, if constrained { fresh() } else { None }).unwrap();
            (0..a.prompt as u64).map(|i| (splitmix64(s as u64 * 7919 + i) % vocab) as u32).collect()
        })
        .collect();
    const WARM: usize = 8;
    let mut timed = 0.0;
    for step in 0..WARM + a.steps {
        let items = feed.iter().enumerate().map(|(s, t)| BatchItem::new(s as u32, t)).collect();
        let mut batch = Batch::new(items).unwrap_or_else(|err| panic!("{err}"));
        let t = Instant::now();
        e.d.step_batch(&mut batch).unwrap_or_else(|err| panic!("step_batch: {err}"));
        if step >= WARM {
            timed += t.elapsed().as_secs_f64();
        }
        let next: Vec<u32> = batch
            .iter()
            .map(|b| *b.next.as_ref().unwrap_or_else(|err| panic!("stream {}: {err}", b.stream())))
            .collect();
        for (s, t) in next.into_iter().enumerate() {
            if constrained && eog.contains(&t) {
                e.d.set_constraint(s as u32, fresh()).unwrap();
            }
            feed[s] = vec![t];
        }
    }
    timed / a.steps as f64
}

/// The `--backend` benchmark: free and constrained steps of 1 and of `--streams` streams.
fn step_costs(a: &StepArgs, model: &str, tokenizer: Arc<Tokenizer>, eog: &[u32]) {
    if a.cuda {
        cuda::require_device(0).unwrap_or_else(|e| {
            eprintln!("bench_constraint: {e}");
            std::process::exit(1);
        });
    }
    let cfg = &a.cfg;
    let t = Instant::now();
    let src =
        Arc::new(if a.cuda { MemSource::benchmark(cfg, a.recipe) } else { MemSource::synthetic(cfg, 7, a.recipe) });
    let grammars = Grammars::new(Arc::clone(&tokenizer), cfg.vocab, eog).unwrap();
    println!(
        "{}: hidden {}, {} layers, {} logits, {}; {model}'s {} ids as the vocabulary; built in {:.1} s",
        if a.cuda { "CUDA" } else { "CPU" },
        cfg.hidden,
        cfg.layers,
        cfg.vocab,
        a.recipe.name(),
        tokenizer.vocab_size(),
        t.elapsed().as_secs_f64()
    );
    println!(
        "constraint: {} (set again whenever it completes); a {}-token prompt a stream, then {} timed steps",
        CASES[0].0, a.prompt, a.steps
    );
    let window = a.prompt + a.steps + 16;
    let mut e = engine(a, &src, window);
    let drawn = Sampling { temperature: 0.8, top_p: 0.95, seed: 7, ..Sampling::GREEDY };
    println!();
    println!(
        "| streams | sampler | free ms/step | constrained ms/step | free tok/s | constrained tok/s | constraint's share |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for n in [1, a.streams] {
        for (name, sampling) in [("greedy", Sampling::GREEDY), ("T 0.8, top-p 0.95", drawn)] {
            for s in 0..n as u32 {
                e.d.set_sampling(s, sampling).unwrap();
            }
            let free = mean_step(&mut e, a, &grammars, eog, n, false);
            let held = mean_step(&mut e, a, &grammars, eog, n, true);
            println!(
                "| {n} | {name} | {:.3} | {:.3} | {:.0} | {:.0} | {:.1}% |",
                free * 1e3,
                held * 1e3,
                n as f64 / free,
                n as f64 / held,
                100.0 * (held - free) / held
            );
        }
    }
}
