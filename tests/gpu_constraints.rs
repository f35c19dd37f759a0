//! Constrained output on CUDA (prints SKIP without a device): the device sampler draws a constrained
//! stream's token among the ids its mask allows, the logits staying on the card. On a tiny random model
//! with the repository's byte-level BPE tokenizer, under a regular expression and a JSON schema:
//! every constrained token, greedy and sampled (top-k, top-p, min-p, the penalty), is the host's masked
//! sampler's choice (`sampler::sample_stream_masked`, the CPU backend's) on the logits the engine
//! reports, which stay unmasked; a batch mixing constrained and free streams gives every stream the tokens
//! and logits bits of stepping it alone; and sampled outputs all end and satisfy their constraint.

mod common;
use common::shared::no_cache;
use common::{
    Held, Rng, Scratch, bits, cuda_options, gpu_present, init, logits, piece, random_sampling, serial, try_batch,
};

use hostembed::Status;
use hostembed::abi::engine_constraint;
use hostembed::checkpoint::Checkpoint;
use hostembed::checkpoint::write::{synthetic_weights, write_gguf};
use hostembed::constraint::{Constraint, Grammars};
use hostembed::engine::engine_options;
use hostembed::ffi;
use hostembed::model::ModelConfig;
use hostembed::sampler::{self, Sampling};
use hostembed::status::last_error;
use hostembed::tensor::DType;
use hostembed::tokenizer::{self, Tokenizer, special};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Ends within 40 bytes: every stream under it reaches end of generation.
const EMAIL: &str = r"[a-z]{2,10}\.[a-z]{2,10}@[a-z]{2,12}\.(com|org|net)";
/// A bounded object: its whitespace is bounded too (`constraint::JSON_WHITESPACE`), so it ends.
const SCHEMA: &str = r#"{"type":"object","properties":{"n":{"type":"integer","minimum":0,"maximum":999},"ok":{"type":"boolean"},"color":{"enum":["red","green","blue"]}},"required":["n","ok","color"],"additionalProperties":false}"#;
/// Steps a stream may take before it must have ended.
const MOST_STEPS: usize = 400;

fn asset(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("assets").join(name)
}

/// `rng.ids` of 1 to `most` ids.
fn prompt(rng: &mut Rng, vocab: usize, most: u64) -> Vec<i32> {
    let n = 1 + rng.below(most) as usize;
    rng.ids(vocab, n)
}

/// A two-layer Llama over the committed tokenizer's 512 ids, written as GGUF with that tokenizer.
fn tiny_model(dir: &Scratch, seed: u64) -> PathBuf {
    let t = Tokenizer::from_json(&asset("tokenizer.json")).unwrap();
    let id = |name: &str| t.token_id(name).unwrap_or_else(|| panic!("the committed tokenizer has no {name}"));
    let cfg = ModelConfig {
        rope_theta: 10000.0,
        max_position: 2048,
        bos: Some(id("<|bos|>")),
        eos: Some(id("<|eos|>")),
        ..ModelConfig::llama(128, 2, 4, 2, 256, t.vocab_size())
    };
    let path = dir.join("tiny.gguf");
    let kv = tokenizer::gguf_bpe_vocab(&asset("tokenizer.json")).unwrap().gguf_kv("gpt-2");
    write_gguf(&path, &cfg, &synthetic_weights(&cfg, seed, DType::Bf16), &kv).unwrap();
    path
}

fn cuda(streams: u32) -> engine_options {
    cuda_options(1024, streams, 64)
}

/// The host's view of the model's constraints: the engine's own vocabulary for llguidance, built the
/// way the engine builds it, and its end-of-generation ids.
struct Host {
    grammars: Grammars,
    eog: Vec<u32>,
}

fn host(path: &Path) -> Host {
    let ckpt = Checkpoint::open(path).unwrap();
    let vocab = ckpt.config.vocab;
    let t = Arc::new(Tokenizer::from_source(&ckpt.tokenizer, vocab).unwrap().expect("the model's tokenizer"));
    let rules = special::resolve(&ckpt.special, ckpt.config.bos, ckpt.config.eos, vocab, Some(&*t));
    let grammars = Grammars::new(Arc::clone(&t), vocab, &rules.eog).unwrap();
    Host { grammars, eog: rules.eog.clone() }
}

fn constrain(e: &Held, stream: u32, kind: engine_constraint, text: &str) {
    // SAFETY: a live engine and the text's bytes.
    let st = unsafe { ffi::engine_set_constraint(e.0, stream, kind, text.as_ptr().cast(), text.len()) };
    assert_eq!(st, Status::Ok, "engine_set_constraint({stream}): {}", last_error());
}

/// A constrained stream as the host follows it: its constraint's matcher, fed each token drawn.
struct Mirror {
    c: Constraint,
    fed: usize,
}

impl Mirror {
    fn new(h: &Host, kind: engine_constraint, text: &str) -> Mirror {
        let mut c = h.grammars.compile(kind, text).unwrap().expect("a constraint");
        c.stepped(0);
        Mirror { c, fed: 0 }
    }

    /// The ids allowed next (llguidance's words).
    fn mask(&mut self) -> Vec<u32> {
        self.c.mask().unwrap().as_slice().to_vec()
    }

    fn take(&mut self, t: u32) {
        self.c.feed(self.fed, &[t]).unwrap_or_else(|e| panic!("token {t} refused: {e}"));
        self.fed += 1;
    }
}

fn allowed(mask: &[u32], id: usize) -> bool {
    mask.get(id / 32).is_some_and(|w| w >> (id % 32) & 1 == 1)
}

/// What a finished output must be: the whole regex, or JSON of the schema's shape.
fn check_output(kind: engine_constraint, text: &str, what: &str) {
    match kind {
        engine_constraint::Regex => {
            let full = regex::Regex::new(&format!("^(?:{EMAIL})$")).unwrap();
            assert!(full.is_match(text), "{what}: {text:?} is not the regex's");
        }
        _ => {
            let v: serde_json::Value =
                serde_json::from_str(text).unwrap_or_else(|e| panic!("{what}: {text:?} is not JSON: {e}"));
            let o = v.as_object().unwrap_or_else(|| panic!("{what}: {text:?} is not an object"));
            let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
            keys.sort_unstable();
            assert_eq!(keys, ["color", "n", "ok"], "{what}: {text:?}");
            assert!(o["n"].as_u64().is_some_and(|n| n <= 999), "{what}: {text:?}");
            assert!(o["ok"].is_boolean(), "{what}: {text:?}");
            assert!(["red", "green", "blue"].contains(&o["color"].as_str().unwrap_or("")), "{what}: {text:?}");
        }
    }
}

/// Steps the constrained streams `streams` (stream, kind, sampler) in one batch a round from a prompt
/// each until every one has drawn an end-of-generation id, checking each token against the host's masked
/// sampler on the engine's logits; returns each stream's output text.
fn run_checked(e: &Held, h: &Host, streams: &[(u32, engine_constraint, Sampling)], rng: &mut Rng) -> Vec<String> {
    let vocab = common::info(e).vocab as usize;
    let mut mirrors: Vec<Mirror> = streams
        .iter()
        .map(|&(s, kind, sampling)| {
            let text = if kind == engine_constraint::Regex { EMAIL } else { SCHEMA };
            constrain(e, s, kind, text);
            common::set_sampling(e, s, &sampling);
            Mirror::new(h, kind, text)
        })
        .collect();
    let mut history: Vec<Vec<u32>> = vec![Vec::new(); streams.len()];
    let mut feed: Vec<Vec<i32>> = streams.iter().map(|_| prompt(rng, vocab, 20)).collect();
    let mut out: Vec<Vec<u8>> = vec![Vec::new(); streams.len()];
    let mut ended = vec![false; streams.len()];
    let mut unmasked_seen = false;
    for round in 0..MOST_STEPS {
        let live: Vec<usize> = (0..streams.len()).filter(|&k| !ended[k]).collect();
        if live.is_empty() {
            break;
        }
        let items: Vec<(u32, &[i32])> = live.iter().map(|&k| (streams[k].0, feed[k].as_slice())).collect();
        let (st, got) = try_batch(e, &items);
        assert_eq!(st, Status::Ok, "round {round}: {}", last_error());
        for (&k, (st, next)) in live.iter().zip(got) {
            let (s, kind, sampling) = streams[k];
            assert_eq!(st, Status::Ok, "round {round} stream {s}: {}", last_error());
            let l = logits(e, s);
            let mask = mirrors[k].mask();
            let new: Vec<u32> = feed[k].iter().map(|&t| t as u32).collect();
            let want = sampler::sample_stream_masked(&l, &mask, &sampling, s, &history[k], &new)
                .expect("a constraint's mask allows some id");
            assert_eq!(next as u32, want, "round {round} stream {s} ({kind:?}, {sampling:?})");
            assert!(allowed(&mask, next as usize), "round {round} stream {s}: {next} is masked");
            // The engine reports the logits as computed: the mask shapes the draw, not the row.
            unmasked_seen |= (0..vocab).any(|i| !allowed(&mask, i) && l[i].is_finite());
            history[k].extend(&new);
            feed[k] = vec![next];
            if h.eog.contains(&(next as u32)) {
                ended[k] = true;
            } else {
                mirrors[k].take(next as u32);
                out[k].extend(piece(e, next));
            }
        }
    }
    assert!(unmasked_seen, "every reported logit outside the masks was -inf");
    streams
        .iter()
        .zip(out)
        .zip(ended)
        .map(|((&(s, kind, _), text), ended)| {
            let text = String::from_utf8(text).expect("a constrained output is UTF-8");
            assert!(ended, "stream {s} ({kind:?}): no end of generation in {MOST_STEPS} steps: {text:?}");
            check_output(kind, &text, &format!("stream {s} ({kind:?})"));
            text
        })
        .collect()
}

/// Greedy and sampled streams under each constraint, in one batch: every token is the host's masked
/// draw on the reported logits, and every output is the constraint's.
#[test]
fn gpu_constrained_tokens_are_the_host_masked_samplers_choice() {
    if !gpu_present("gpu_constrained_tokens_are_the_host_masked_samplers_choice") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("gpu_constrained_tokens_are_the_host_masked_samplers_choice");
    let dir = Scratch::new("gpu-constraints");
    let path = tiny_model(&dir, rng.next_u64());
    let h = host(&path);
    let e = init(&path, &cuda(8));
    let drawn = |seed: u64, k: usize| {
        let mut s = Sampling { temperature: 0.7 + k as f32 * 0.2, seed, ..Sampling::GREEDY };
        match k {
            0 => s.top_k = 40,
            1 => (s.top_p, s.min_p) = (0.9, 0.05),
            _ => (s.repeat_penalty, s.repeat_last_n, s.top_p) = (1.3, 16, 0.95),
        }
        s
    };
    for round in 0..3 {
        let mut streams = Vec::new();
        for (base, kind) in [(0u32, engine_constraint::Regex), (4, engine_constraint::JsonSchema)] {
            streams.push((base, kind, Sampling::GREEDY));
            for k in 0..3 {
                streams.push((base + 1 + k as u32, kind, drawn(rng.next_u64(), k)));
            }
        }
        for &(s, ..) in &streams {
            common::reset(&e, s);
        }
        for (text, (s, kind, _)) in run_checked(&e, &h, &streams, &mut rng).iter().zip(&streams) {
            println!("round {round} stream {s} {kind:?}: {text}");
        }
    }
}

/// Random sampler settings for 16 constrained streams at once: every output ends and is its constraint's.
#[test]
fn gpu_sampled_constrained_outputs_hold_their_constraint() {
    if !gpu_present("gpu_sampled_constrained_outputs_hold_their_constraint") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("gpu_sampled_constrained_outputs_hold_their_constraint");
    let dir = Scratch::new("gpu-constraints-sampled");
    let path = tiny_model(&dir, rng.next_u64());
    let h = host(&path);
    let e = init(&path, &cuda(16));
    for _ in 0..2 {
        let streams: Vec<(u32, engine_constraint, Sampling)> = (0..16u32)
            .map(|s| {
                let kind = if s % 2 == 0 { engine_constraint::Regex } else { engine_constraint::JsonSchema };
                common::reset(&e, s);
                (s, kind, random_sampling(&mut rng))
            })
            .collect();
        run_checked(&e, &h, &streams, &mut rng);
    }
}

/// Constrained and free streams in random batches: each stream's tokens and logits bits are those of
/// stepping it alone (each stream of a second engine in a call of its own), constraint and all.
#[test]
fn gpu_constrained_and_free_streams_batch_like_stepping_alone() {
    if !gpu_present("gpu_constrained_and_free_streams_batch_like_stepping_alone") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("gpu_constrained_and_free_streams_batch_like_stepping_alone");
    let dir = Scratch::new("gpu-constraints-batch");
    let path = tiny_model(&dir, rng.next_u64());
    const STREAMS: u32 = 8;
    // Without the prefix cache: a prompt's pages then never depend on what else each engine holds.
    let batched = init(&path, &no_cache(cuda(STREAMS)));
    let alone = init(&path, &no_cache(cuda(STREAMS)));
    let vocab = common::info(&batched).vocab as usize;
    // Streams 0..4 constrained (the regex, then the schema), 4..8 free; half of each greedy.
    for s in 0..STREAMS {
        let sampling = if s % 2 == 0 { ffi::engine_default_sampling() } else { random_sampling(&mut rng) };
        for e in [&batched, &alone] {
            common::set_sampling(e, s, &sampling);
            if s < 2 {
                constrain(e, s, engine_constraint::Regex, EMAIL);
            } else if s < 4 {
                constrain(e, s, engine_constraint::JsonSchema, SCHEMA);
            }
        }
    }
    let mut feed: Vec<Vec<i32>> = (0..STREAMS).map(|_| prompt(&mut rng, vocab, 40)).collect();
    let mut constrained_steps = 0;
    for round in 0..60 {
        let mut chosen: Vec<u32> = (0..STREAMS).filter(|_| rng.below(3) > 0).collect();
        rng.shuffle(&mut chosen);
        if chosen.is_empty() {
            continue;
        }
        let items: Vec<(u32, &[i32])> = chosen.iter().map(|&s| (s, feed[s as usize].as_slice())).collect();
        let (st, got) = try_batch(&batched, &items);
        assert_eq!(st, Status::Ok, "round {round}: {}", last_error());
        for (&s, (st, next)) in chosen.iter().zip(got) {
            assert_eq!(st, Status::Ok, "round {round} stream {s}: {}", last_error());
            let (st_alone, got_alone) = try_batch(&alone, &[(s, feed[s as usize].as_slice())]);
            assert_eq!((st_alone, got_alone[0].0), (Status::Ok, Status::Ok), "{}", last_error());
            assert_eq!(next, got_alone[0].1, "round {round} stream {s}: batched and alone drew apart");
            assert_eq!(bits(&logits(&batched, s)), bits(&logits(&alone, s)), "round {round} stream {s}: logits");
            constrained_steps += usize::from(s < 4);
            feed[s as usize] = vec![next];
        }
        // A constrained stream that ended starts over, constraint and all, in both engines.
        for s in 0..4u32 {
            // SAFETY: a live engine; any id is a valid argument.
            let ended = feed[s as usize].len() == 1 && unsafe { ffi::engine_is_eog(batched.0, feed[s as usize][0]) };
            if ended {
                for e in [&batched, &alone] {
                    common::reset(e, s);
                    let (kind, text) =
                        if s < 2 { (engine_constraint::Regex, EMAIL) } else { (engine_constraint::JsonSchema, SCHEMA) };
                    constrain(e, s, kind, text);
                }
                feed[s as usize] = prompt(&mut rng, vocab, 20);
            }
        }
    }
    assert!(constrained_steps > 50, "only {constrained_steps} constrained steps ran");
}
