//! Prompt lookup's speed: SmolLM2-135M-Instruct (or `--model`) decoding greedily, one stream, with and
//! without `ENGINE_DRAFT_NGRAM`, on two prompts: a passage of code to repeat with one line changed (what
//! lookup pays off on) and an ordinary chat question (where it should cost next to nothing). Prints a
//! table of tokens a second (the best of `--runs`), the speed-up, the acceptance, and whether both runs
//! produced the same tokens (they must). With `--draft DRAFTER` the speculative runs propose with that
//! drafter model (`ENGINE_DRAFT_MODEL`) instead of prompt lookup. `--f32-of FILE` makes the model FILE
//! with every tensor decoded to F32 (written to a temporary file), so that FILE can draft for it.
//!
//!     cargo run --release --example bench_speculative -- [--model models/SmolLM2-135M-Instruct.Q4_1.gguf]
//!         [--backend cpu|cuda] [--tokens 128] [--max-tokens 8] [--ngram 2,4] [--runs 2] [--draft DRAFTER]
//!         [--f32-of FILE]

use std::path::PathBuf;
use std::time::Instant;

use hostembed::abi::{engine_draft, engine_speculation};
use hostembed::engine::{self, Engine, engine_backend, engine_options, engine_tristate};

/// The code the first prompt asks to repeat (about 300 tokens), and the change asked for.
const CODE: &str = r#"fn parse_config(text: &str) -> Result<Config, Error> {
    let mut config = Config::default();
    for (number, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            return Err(Error::new(number + 1, "expected key = value"));
        };
        match key.trim() {
            "name" => config.name = value.trim().to_string(),
            "threads" => config.threads = value.trim().parse().map_err(|_| Error::new(number + 1, "bad number"))?,
            "verbose" => config.verbose = value.trim() == "true",
            "path" => config.path = PathBuf::from(value.trim()),
            other => return Err(Error::new(number + 1, &format!("unknown key {other}"))),
        }
    }
    if config.threads == 0 {
        config.threads = 4;
    }
    Ok(config)
}
"#;

fn chat(user: &str) -> String {
    format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
}

/// Decodes `tokens` greedily after `prompt` on stream 0; (tokens, seconds of decoding, proposed, accepted).
fn decode(
    e: &mut Engine,
    prompt: &[i32],
    tokens: usize,
    spec: Option<engine_speculation>,
) -> (Vec<i32>, f64, u64, u64) {
    e.reset(0).expect("stream 0");
    let s = spec.unwrap_or(hostembed::speculative::DEFAULT);
    e.set_speculation(0, &s).expect("the settings are valid");
    let most = spec.map_or(1, |s| s.max_tokens as usize + 1);
    let mut out = Vec::with_capacity(tokens + most);
    let mut input = prompt.to_vec();
    let start = Instant::now();
    let mut started = None;
    while out.len() < tokens {
        let produced = e.step_tokens(0, &input, most).expect("the window holds every token");
        let next = *produced.last().expect("a step produces its next token");
        out.extend(produced.iter().map(|&t| t as i32));
        input = vec![next as i32];
        // The prompt's step is the same with and without lookup: time the decoding after it.
        started.get_or_insert_with(Instant::now);
    }
    let from = started.unwrap_or(start);
    let decoded = out.len() - 1;
    out.truncate(tokens);
    let (p, a) = e.speculation_stats(0).expect("stream 0");
    (out, from.elapsed().as_secs_f64() / decoded.max(1) as f64 * tokens as f64, p, a)
}

fn main() {
    let mut model = PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut backend = engine_backend::Cpu;
    let (mut tokens, mut max_tokens, mut runs) = (128usize, 8u32, 2usize);
    let (mut ngram_min, mut ngram_max) = (2u32, 4u32);
    let mut drafter: Option<std::ffi::CString> = None;
    let mut dequantized = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("{flag} takes a value"));
        let num = || -> usize { value.parse().unwrap_or_else(|_| panic!("{flag} takes a number")) };
        match flag.as_str() {
            "--model" => model = PathBuf::from(&value),
            "--f32-of" => {
                let f32_model = std::env::temp_dir().join(format!("bench-speculative-{}.F32.gguf", std::process::id()));
                hostembed::checkpoint::write::write_gguf_dequantized(std::path::Path::new(&value), &f32_model)
                    .unwrap_or_else(|err| panic!("{value}: {err}"));
                model = f32_model;
                dequantized = true;
            }
            "--draft" => drafter = Some(std::ffi::CString::new(value.as_str()).expect("a path without NUL")),
            "--backend" => {
                backend = match value.as_str() {
                    "cpu" => engine_backend::Cpu,
                    "cuda" => engine_backend::Cuda,
                    other => panic!("--backend is cpu or cuda, not {other}"),
                }
            }
            "--tokens" => tokens = num().max(2),
            "--max-tokens" => max_tokens = num() as u32,
            "--runs" => runs = num().max(1),
            "--ngram" => {
                let (a, b) = value.split_once(',').expect("--ngram MIN,MAX");
                (ngram_min, ngram_max) = (a.parse().expect("a number"), b.parse().expect("a number"));
            }
            other => panic!("unknown flag {other}"),
        }
    }
    let draft_model = drafter.as_ref().map_or(std::ptr::null(), |d| d.as_ptr());
    // Without the prefix cache: a run after the first would take the prompt's cached pages and compute the
    // rest as a shorter chunk, on other kernels than the first run's whole prompt (other bits).
    let opts = engine_options {
        backend,
        context: 2048,
        max_streams: 1,
        draft_model,
        prefix_cache: engine_tristate::No,
        ..engine::default_options()
    };
    let mut e = Engine::init_fit(&model, &opts).unwrap_or_else(|err| panic!("{}: {err}", model.display()));
    let tok = e.shared_tokenizer().expect("the model has a tokenizer");
    let edited = CODE.replace("config.threads = 4;", "config.threads = num_cpus();");
    let prompts = [
        (
            "code, one line changed",
            chat(&format!(
                "Repeat this function exactly, but set the default threads to num_cpus() instead of 4:\n\n{CODE}"
            )) + &edited[..40],
        ),
        ("chat", chat("What are three good habits for staying healthy? Explain each briefly.")),
    ];
    let draft = if drafter.is_some() { engine_draft::Model } else { engine_draft::Ngram };
    let spec = engine_speculation { draft, max_tokens, ngram_min, ngram_max };
    let kind = match &drafter {
        Some(d) => format!("drafter {}", d.to_string_lossy()),
        None => format!("lookup ngram {ngram_min}..{ngram_max}"),
    };
    println!(
        "{} on {:?}, greedy, {tokens} tokens after the prompt, best of {runs}; {kind}, max_tokens {max_tokens}",
        model.display(),
        backend
    );
    let label = if drafter.is_some() { "draft tok/s" } else { "lookup tok/s" };
    println!(
        "{:<24} {:>7} {:>11} {:>11} {:>8} {:>10} {:>9}",
        "prompt", "tokens", "plain tok/s", label, "speed-up", "accepted", "same"
    );
    for (name, text) in &prompts {
        let prompt: Vec<i32> =
            tok.encode(text, None).expect("the prompt tokenizes").iter().map(|&t| t as i32).collect();
        let (mut plain_best, mut spec_best) = (f64::MAX, f64::MAX);
        let (mut same, mut pa) = (true, (0, 0));
        for _ in 0..runs {
            let (want, t_plain, _, _) = decode(&mut e, &prompt, tokens, None);
            let (got, t_spec, p, a) = decode(&mut e, &prompt, tokens, Some(spec));
            same &= want == got;
            pa = (p, a);
            plain_best = plain_best.min(t_plain);
            spec_best = spec_best.min(t_spec);
        }
        let (p_rate, s_rate) = (tokens as f64 / plain_best, tokens as f64 / spec_best);
        println!(
            "{:<24} {:>7} {:>11.1} {:>11.1} {:>7.2}x {:>10} {:>9}",
            name,
            prompt.len(),
            p_rate,
            s_rate,
            s_rate / p_rate,
            format!("{}/{}", pa.1, pa.0),
            if same { "yes" } else { "NO" }
        );
    }
    if dequantized {
        let _ = std::fs::remove_file(&model);
    }
}
