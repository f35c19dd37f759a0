//! What a constraint costs on the host, for a real model's vocabulary (SmolLM2-135M's 49,152 tokens by
//! default): the vocabulary's llguidance trie built once, each constraint's compile, then, feeding a
//! valid output token by token as a stream would, the mask's computation and the token's consumption
//! at each step, and the masked draw (greedy and sampled) against the free one on random logits. Prints
//! a table; the figures are per token, on one thread.
//!
//!     cargo run --release --example bench_constraint -- [MODEL.gguf or HF folder] [--runs 3]
//!
//! On CUDA the mask is computed on its own thread while the device runs the step's forward, so what it
//! adds there is the part of it the forward does not cover, plus the masked draw on the host.

use std::sync::Arc;
use std::time::Instant;

use hostembed::abi::engine_constraint;
use hostembed::checkpoint::Checkpoint;
use hostembed::constraint::Grammars;
use hostembed::sampler::{self, Sampling, splitmix64};
use hostembed::tokenizer::{Tokenizer, special};

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

fn main() {
    let mut model = "models/SmolLM2-135M-Instruct.Q4_1.gguf".to_string();
    let mut runs = 3usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--runs" => runs = args.next().and_then(|v| v.parse().ok()).expect("--runs N"),
            _ => model = a,
        }
    }
    let ckpt = Checkpoint::open(std::path::Path::new(&model))
        .unwrap_or_else(|e| panic!("{model}: {e} (scripts/fetch-smollm.sh fetches SmolLM2)"));
    let vocab = ckpt.config.vocab;
    let tokenizer = Arc::new(Tokenizer::from_source(&ckpt.tokenizer, vocab).unwrap().expect("the model's tokenizer"));
    let rules = special::resolve(&ckpt.special, ckpt.config.bos, ckpt.config.eos, vocab, Some(&*tokenizer));
    let t = Instant::now();
    let grammars = Grammars::new(Arc::clone(&tokenizer), vocab, &rules.eog).unwrap();
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
