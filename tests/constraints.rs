//! Constrained output (`engine_set_constraint`). On the real SmolLM2-135M-Instruct (Q4_1, CPU backend;
//! scripts/fetch-smollm.sh fetches it, those tests print a SKIP line without it): 50 JSON schemas asked
//! for in chat prompts, each decoded greedily and sampled in one batch of 100 streams, every output
//! parsing and (Python `jsonschema`) validating against its schema; 100 sampled runs of a regex all
//! matching it; a Lark grammar of arithmetic giving only its sentences; a constrained stream leaving
//! the bits of the streams beside it unchanged; truncate and step again giving the same tokens; bad
//! input refused with nothing changed; engine_allowed_tokens giving the mask a step draws from. Without a model: the token bytes llguidance matches for byte-level
//! BPE and SentencePiece vocabularies.

mod common;

use common::{
    Held, bits, init, logits, model_file, piece, quiet, reset, set_sampling, stream_len, tokenize, truncate, try_batch,
    try_step,
};
use hostembed::Status;
use hostembed::abi::{engine_chat_message, engine_constraint, engine_sampling};
use hostembed::constraint::Grammars;
use hostembed::engine::{self, engine_backend, engine_options};
use hostembed::ffi;
use hostembed::status::last_error;
use hostembed::tokenizer::{Tokenizer, token_type};
use std::ffi::CString;
use std::path::PathBuf;
use std::sync::Arc;

fn model() -> Option<PathBuf> {
    model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "scripts/fetch-smollm.sh fetches it")
}

fn cpu_options(streams: u32, window: u32) -> engine_options {
    engine_options {
        backend: engine_backend::Cpu,
        context: window,
        max_streams: streams,
        log: Some(quiet),
        ..engine::default_options()
    }
}

fn try_constrain(e: &Held, stream: u32, kind: engine_constraint, text: &str) -> Status {
    // SAFETY: a live engine and text.len() bytes of text at text.as_ptr().
    unsafe { ffi::engine_set_constraint(e.0, stream, kind, text.as_ptr() as *const std::ffi::c_char, text.len()) }
}

fn constrain(e: &Held, stream: u32, kind: engine_constraint, text: &str) {
    let st = try_constrain(e, stream, kind, text);
    assert_eq!(st, Status::Ok, "engine_set_constraint({stream}, {kind:?}, {text:?}): {}", last_error());
}

/// The chat `user` asks, rendered with the model's template up to the assistant's reply, as ids.
fn chat_prompt(e: &Held, user: &str) -> Vec<i32> {
    let (role, content) = (CString::new("user").unwrap(), CString::new(user).unwrap());
    let m = [engine_chat_message { role: role.as_ptr(), content: content.as_ptr() }];
    let mut buf = vec![0 as std::ffi::c_char; 4096];
    // SAFETY: a live engine, one message of NUL-terminated strings, and a buffer of buf.len() chars to write.
    let n = unsafe { ffi::engine_chat_template(e.0, m.as_ptr(), 1, true, buf.as_mut_ptr(), buf.len()) };
    assert!(n > 0 && (n as usize) < buf.len(), "engine_chat_template: {n}: {}", last_error());
    let text: Vec<u8> = buf[..n as usize].iter().map(|&c| c as u8).collect();
    tokenize(e, std::str::from_utf8(&text).unwrap())
}

fn is_eog(e: &Held, id: i32) -> bool {
    // SAFETY: a live engine.
    unsafe { ffi::engine_is_eog(e.0, id) }
}

/// Decodes every stream of `prompts` together, each its prompt then its sampled tokens, until each
/// samples an end-of-generation token or has `max_new` tokens; each stream's output text and whether
/// it ended.
fn decode_all(e: &Held, prompts: &[(u32, Vec<i32>)], max_new: usize) -> Vec<(String, bool)> {
    let mut outs: Vec<Vec<i32>> = vec![Vec::new(); prompts.len()];
    let mut ended = vec![false; prompts.len()];
    let mut feed: Vec<Vec<i32>> = prompts.iter().map(|p| p.1.clone()).collect();
    for _ in 0..=max_new {
        let live: Vec<usize> = (0..prompts.len()).filter(|&k| !ended[k] && outs[k].len() < max_new).collect();
        if live.is_empty() {
            break;
        }
        let items: Vec<(u32, &[i32])> = live.iter().map(|&k| (prompts[k].0, feed[k].as_slice())).collect();
        let (st, got) = try_batch(e, &items);
        assert_eq!(st, Status::Ok, "engine_step_batch: {}", last_error());
        for (&k, (st, next)) in live.iter().zip(got) {
            assert_eq!(st, Status::Ok, "stream {}: {}", prompts[k].0, last_error());
            if is_eog(e, next) {
                ended[k] = true;
            } else {
                outs[k].push(next);
                feed[k] = vec![next];
            }
        }
    }
    outs.iter()
        .zip(ended)
        .map(|(ids, ended)| {
            let bytes: Vec<u8> = ids.iter().flat_map(|&id| piece(e, id)).collect();
            (String::from_utf8(bytes).expect("a constrained output is UTF-8"), ended)
        })
        .collect()
}

/// The schemas and the requests that ask for them (tests/data/constraints/schemas.json).
fn schemas() -> Vec<(String, String)> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/constraints/schemas.json");
    let cases: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    cases
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["prompt"].as_str().unwrap().to_string(), c["schema"].to_string()))
        .collect()
}

/// Sampler settings for the `k`-th sampled run: temperatures from 0.6 to 1.2 with top-k, top-p,
/// min-p and a repetition penalty in turn.
fn sampled(k: usize) -> engine_sampling {
    let mut s = ffi::engine_default_sampling();
    s.temperature = 0.6 + (k % 7) as f32 * 0.1;
    s.seed = 1000 + k as u64;
    match k % 4 {
        0 => s.top_p = 0.9,
        1 => s.top_k = 40,
        2 => s.min_p = 0.05,
        _ => (s.repeat_penalty, s.repeat_last_n) = (1.1, 32),
    }
    s
}

/// Validates each (schema, output) with Python's `jsonschema`: None when python3 or the package is
/// absent (CI installs it, and there its absence fails), else the failures' lines.
fn jsonschema_failures(cases: &[(serde_json::Value, String)]) -> Option<Vec<String>> {
    const SCRIPT: &str = r#"
import json, sys
from jsonschema import Draft202012Validator
for i, (schema, output) in enumerate(json.load(open(sys.argv[1]))):
    for error in Draft202012Validator(schema).iter_errors(json.loads(output)):
        print(f"{i}: {error.message}: {output!r}")
"#;
    let probe = std::process::Command::new("python3").args(["-c", "import jsonschema"]).output();
    if !probe.is_ok_and(|o| o.status.success()) {
        assert!(std::env::var_os("CI").is_none(), "CI must have python3 with jsonschema (.ci/run installs it)");
        println!("SKIP: the schema validation: python3 with the jsonschema package is absent (pip install jsonschema)");
        return None;
    }
    let dir = common::Scratch::new("jsonschema");
    let file = dir.join("cases.json");
    std::fs::write(&file, serde_json::to_vec(cases).unwrap()).unwrap();
    let out = std::process::Command::new("python3").args(["-c", SCRIPT]).arg(&file).output().unwrap();
    assert!(out.status.success(), "the validator failed: {}", String::from_utf8_lossy(&out.stderr));
    Some(String::from_utf8(out.stdout).unwrap().lines().map(str::to_string).collect())
}

#[test]
fn fifty_json_schemas_hold_greedy_and_sampled() {
    let Some(path) = model() else { return };
    let cases = schemas();
    assert_eq!(cases.len(), 50);
    let n = cases.len() as u32;
    // Stream k decodes schema k greedily, stream 50 + k samples it.
    let e = init(&path, &cpu_options(2 * n, 512));
    let mut prompts = Vec::new();
    for (k, (ask, schema)) in cases.iter().enumerate() {
        let prompt = chat_prompt(&e, &format!("{ask} Reply with the JSON only."));
        for stream in [k as u32, n + k as u32] {
            constrain(&e, stream, engine_constraint::JsonSchema, schema);
            prompts.push((stream, prompt.clone()));
        }
        set_sampling(&e, n + k as u32, &sampled(k));
    }
    let t = std::time::Instant::now();
    let outs = decode_all(&e, &prompts, 200);
    println!("{} streams decoded in {:.1} s", outs.len(), t.elapsed().as_secs_f64());
    let mut checked = Vec::new();
    for ((stream, _), (text, ended)) in prompts.iter().zip(&outs) {
        let (k, how) = (*stream as usize % cases.len(), if *stream < n { "greedy" } else { "sampled" });
        println!("schema {k} {how}: {text}");
        assert!(ended, "schema {k} {how}: no end of generation within 200 tokens: {text:?}");
        let value: serde_json::Value = serde_json::from_str(text)
            .unwrap_or_else(|err| panic!("schema {k} {how}: the output does not parse ({err}): {text:?}"));
        assert!(!value.is_null() || text.trim() == "null");
        checked.push((serde_json::from_str(&cases[k].1).unwrap(), text.clone()));
    }
    if let Some(failures) = jsonschema_failures(&checked) {
        assert!(failures.is_empty(), "outputs the schemas refuse:\n{}", failures.join("\n"));
        println!("jsonschema: all {} outputs valid", checked.len());
    }
}

#[test]
fn a_regex_holds_a_hundred_sampled_runs() {
    let Some(path) = model() else { return };
    const RE: &str = r"[a-z]{2,10}\.[a-z]{2,10}@[a-z]{2,12}\.(com|org|net)";
    let full = regex::Regex::new(&format!("^(?:{RE})$")).unwrap();
    let e = init(&path, &cpu_options(50, 256));
    let prompt = chat_prompt(&e, "Give the work email address of a person at a company.");
    let mut matched = 0;
    for round in 0..2 {
        let prompts: Vec<(u32, Vec<i32>)> = (0..50u32).map(|s| (s, prompt.clone())).collect();
        for s in 0..50u32 {
            reset(&e, s);
            constrain(&e, s, engine_constraint::Regex, RE);
            set_sampling(&e, s, &sampled(round * 50 + s as usize));
        }
        for (s, (text, ended)) in decode_all(&e, &prompts, 48).into_iter().enumerate() {
            assert!(ended && full.is_match(&text), "round {round} stream {s}: {text:?} (ended: {ended})");
            matched += 1;
        }
    }
    assert_eq!(matched, 100);
}

/// The arithmetic grammar `a_lark_grammar_gives_only_its_sentences` holds outputs to: sums of up to four
/// products of up to three factors, a factor a number of up to three digits or such a sum in parentheses
/// (one level deep).
const ARITHMETIC: &str = r#"
start: sum
sum: product (ADD product)~0..3
product: factor (MUL factor)~0..2
factor: NUMBER | "(" inner ")"
inner: term (ADD term)~0..3
term: NUMBER (MUL NUMBER)~0..2
ADD: "+" | "-"
MUL: "*" | "/"
NUMBER: /[0-9]{1,3}/
"#;

/// Whether `s` is a sentence of `ARITHMETIC`, by recursive descent.
fn is_arithmetic(s: &str) -> bool {
    fn number(b: &[u8], i: &mut usize) -> bool {
        let n = b[*i..].iter().take_while(|c| c.is_ascii_digit()).count();
        *i += n;
        (1..=3).contains(&n)
    }
    fn run(b: &[u8], i: &mut usize, ops: &[u8], most: usize, item: &dyn Fn(&[u8], &mut usize) -> bool) -> bool {
        if !item(b, i) {
            return false;
        }
        for _ in 0..most {
            if *i < b.len() && ops.contains(&b[*i]) {
                *i += 1;
                if !item(b, i) {
                    return false;
                }
            } else {
                break;
            }
        }
        true
    }
    fn term(b: &[u8], i: &mut usize) -> bool {
        run(b, i, b"*/", 2, &number)
    }
    fn factor(b: &[u8], i: &mut usize) -> bool {
        if b.get(*i) == Some(&b'(') {
            *i += 1;
            run(b, i, b"+-", 3, &term) && b.get(*i) == Some(&b')') && {
                *i += 1;
                true
            }
        } else {
            number(b, i)
        }
    }
    fn product(b: &[u8], i: &mut usize) -> bool {
        run(b, i, b"*/", 2, &factor)
    }
    let (b, mut i) = (s.as_bytes(), 0);
    run(b, &mut i, b"+-", 3, &product) && i == b.len()
}

#[test]
fn a_lark_grammar_gives_only_its_sentences() {
    assert!(is_arithmetic("(2+3)*4") && is_arithmetic("12-7/3+(1*2-5)") && is_arithmetic("999"));
    assert!(!is_arithmetic("(2+3") && !is_arithmetic("1+") && !is_arithmetic("1234") && !is_arithmetic("((1))"));
    let Some(path) = model() else { return };
    let e = init(&path, &cpu_options(16, 256));
    let prompt = chat_prompt(&e, "Write an arithmetic expression that equals 10, like (2+3)*2.");
    let prompts: Vec<(u32, Vec<i32>)> = (0..16u32).map(|s| (s, prompt.clone())).collect();
    for s in 0..16u32 {
        constrain(&e, s, engine_constraint::Lark, ARITHMETIC);
        if s > 0 {
            set_sampling(&e, s, &sampled(s as usize));
        }
    }
    for (s, (text, ended)) in decode_all(&e, &prompts, 64).into_iter().enumerate() {
        println!("stream {s}: {text}");
        assert!(ended && is_arithmetic(&text), "stream {s}: {text:?} (ended: {ended})");
    }
}

/// `steps` steps of `streams` in one batch each, from their prompts: each stream's sampled tokens and
/// the bits of its logits after each step.
fn run_batch(e: &Held, streams: &[(u32, Vec<i32>)], steps: usize) -> Vec<Vec<(i32, Vec<u32>)>> {
    let mut feed: Vec<Vec<i32>> = streams.iter().map(|s| s.1.clone()).collect();
    let mut out = vec![Vec::new(); streams.len()];
    for _ in 0..steps {
        let items: Vec<(u32, &[i32])> = streams.iter().zip(&feed).map(|(s, f)| (s.0, f.as_slice())).collect();
        let (st, got) = try_batch(e, &items);
        assert_eq!(st, Status::Ok, "{}", last_error());
        for (k, (st, next)) in got.into_iter().enumerate() {
            assert_eq!(st, Status::Ok, "stream {}: {}", streams[k].0, last_error());
            out[k].push((next, bits(&logits(e, streams[k].0))));
            feed[k] = vec![next];
        }
    }
    out
}

#[test]
fn a_constrained_stream_leaves_the_other_streams_bits_alone() {
    let Some(path) = model() else { return };
    let e = init(&path, &cpu_options(6, 256));
    let free: Vec<(u32, Vec<i32>)> = (0..4u32)
        .map(|s| (s, chat_prompt(&e, ["Tell me a joke.", "What is 2+2?", "Name a color.", "Say hello."][s as usize])))
        .collect();
    for s in 0..4u32 {
        if s > 0 {
            set_sampling(&e, s, &sampled(s as usize));
        }
    }
    let alone = run_batch(&e, &free, 12);
    for s in 0..6 {
        reset(&e, s);
    }
    // The same streams beside two constrained ones, one greedy and one sampled.
    let mut mixed = free.clone();
    for s in [4u32, 5] {
        constrain(&e, s, engine_constraint::Json, "");
        mixed.push((s, chat_prompt(&e, "Give a person as JSON.")));
    }
    set_sampling(&e, 5, &sampled(5));
    let beside = run_batch(&e, &mixed, 12);
    for s in 0..4 {
        assert!(alone[s] == beside[s], "stream {s}: its tokens or logits changed beside constrained streams");
    }
    // A constrained stream's logits are the model's, before the mask: the same as a free stream's given
    // the same tokens.
    let json: Vec<i32> = beside[4].iter().map(|t| t.0).collect();
    assert_eq!(piece(&e, json[0]), b"{", "greedy JSON starts with an object here");
    reset(&e, 0);
    let mut fed = mixed[4].1.clone();
    for (k, &t) in json.iter().enumerate().take(6) {
        let (st, _) = try_step(&e, 0, &fed);
        assert_eq!(st, Status::Ok, "{}", last_error());
        assert_eq!(bits(&logits(&e, 0)), beside[4][k].1, "step {k}: the constrained stream's logits");
        fed = vec![t];
    }
}

/// Steps stream `s` from its current state with `first` (a prompt, or the last sampled token), then
/// with each token it samples, `n` steps in all; the tokens sampled.
fn generate(e: &Held, s: u32, first: &[i32], n: usize) -> Vec<i32> {
    let mut out = Vec::new();
    let mut feed = first.to_vec();
    for _ in 0..n {
        let (st, next) = try_step(e, s, &feed);
        assert_eq!(st, Status::Ok, "stream {s}: {}", last_error());
        out.push(next);
        if is_eog(e, next) {
            break;
        }
        feed = vec![next];
    }
    out
}

#[test]
fn truncate_and_reset_roll_the_constraint_back() {
    let Some(path) = model() else { return };
    let e = init(&path, &cpu_options(2, 256));
    let schema = r#"{"type":"object","properties":{"city":{"type":"string","maxLength":20},"people":{"type":"integer","minimum":0,"maximum":99999999}},"required":["city","people"]}"#;
    let prompt = chat_prompt(&e, "Give a city and its population as JSON.");
    for (s, sampling) in [(0u32, ffi::engine_default_sampling()), (1, sampled(3))] {
        set_sampling(&e, s, &sampling);
        constrain(&e, s, engine_constraint::JsonSchema, schema);
        let out = generate(&e, s, &prompt, 80);
        assert!(is_eog(&e, *out.last().unwrap()), "stream {s}: {out:?}");
        let all: Vec<i32> = prompt.iter().chain(&out).copied().collect();
        let p = prompt.len();
        // Cuts inside the output, at its first token, and inside the prompt.
        for cut in [p + out.len() / 2, p + out.len() - 2, p + 1, p, p - 1, p - 7] {
            truncate(&e, s, cut as u32);
            let (first, next) = if cut < p { (&all[cut..p], p) } else { (&all[cut..cut + 1], cut + 1) };
            let again = generate(&e, s, first, 80);
            assert_eq!(again, all[next..], "stream {s}: cut at {cut} (prompt {p})");
        }
        // A token the constraint refuses fails the step and appends nothing; the right one goes on.
        let cut = p + 2;
        truncate(&e, s, cut as u32);
        let len = stream_len(&e, s);
        let refused = tokenize(&e, "x")[0];
        assert_ne!(refused, all[cut]);
        let (st, next) = try_step(&e, s, &[refused]);
        assert_eq!((st, next), (Status::InvalidArgument, -7), "{}", last_error());
        assert!(last_error().contains("not allowed by the stream's constraint"), "{}", last_error());
        assert_eq!(stream_len(&e, s), len);
        assert_eq!(generate(&e, s, &all[cut..cut + 1], 80), all[cut + 1..]);
        // Reset starts the constraint afresh.
        reset(&e, s);
        assert_eq!(generate(&e, s, &prompt, 80), out, "stream {s} after reset");
    }
}

/// engine_set_constraint with a raw kind, as C may pass any value.
/// engine_allowed_tokens' bits for stream `stream` (status, words).
fn allowed(e: &Held, stream: u32, words: usize) -> (Status, Vec<u32>) {
    let mut bits = vec![0xA5A5_A5A5u32; words];
    // SAFETY: a live engine and `words` writable u32s.
    let st = unsafe { ffi::engine_allowed_tokens(e.0, stream, bits.as_mut_ptr(), words) };
    (st, bits)
}

fn is_set(bits: &[u32], id: usize) -> bool {
    bits[id / 32] >> (id % 32) & 1 == 1
}

/// engine_allowed_tokens is the mask a step draws from: the engine's greedy token is the likeliest
/// allowed one, and a caller that draws its own tokens among the allowed ones (here the least likely)
/// has every one taken, ending with a full match; a stream without
/// a constraint allows every id and none past the vocabulary.
#[test]
fn allowed_tokens_are_the_mask_a_step_draws_from() {
    let Some(path) = model() else { return };
    const RE: &str = r"[a-z]{2,6} [0-9]{1,3}";
    let full = regex::Regex::new(&format!("^(?:{RE})$")).unwrap();
    let e = init(&path, &cpu_options(2, 256));
    let vocab = common::info(&e).vocab as usize;
    let words = vocab.div_ceil(32);
    let (st, free) = allowed(&e, 1, words + 1);
    assert_eq!(st, Status::Ok, "{}", last_error());
    assert!((0..vocab).all(|i| is_set(&free, i)) && (vocab..32 * (words + 1)).all(|i| !is_set(&free, i)));
    assert_eq!(allowed(&e, 1, words - 1).0, Status::InvalidArgument, "too few words");
    assert_eq!(allowed(&e, 9, words).0, Status::OutOfRange);
    // SAFETY: NULL bits are refused.
    assert_eq!(unsafe { ffi::engine_allowed_tokens(e.0, 0, std::ptr::null_mut(), words) }, Status::InvalidArgument);

    constrain(&e, 0, engine_constraint::Regex, RE);
    let (st, next) = try_step(&e, 0, &chat_prompt(&e, "Name an animal and a number."));
    assert_eq!(st, Status::Ok, "{}", last_error());
    let (st, mask) = allowed(&e, 0, words);
    assert_eq!(st, Status::Ok, "{}", last_error());
    let l = logits(&e, 0);
    let best = (0..vocab).filter(|&i| is_set(&mask, i)).max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a)));
    assert_eq!(best, Some(next as usize), "the engine's greedy token is the likeliest allowed one");
    assert!(!is_set(&mask, tokenize(&e, "7")[0] as usize), "a digit cannot come first");
    assert_eq!(try_step(&e, 0, &tokenize(&e, "7")).0, Status::InvalidArgument, "nor be stepped");

    let mut text = Vec::new();
    let mut ended = false;
    for _ in 0..40 {
        let (st, mask) = allowed(&e, 0, words);
        assert_eq!(st, Status::Ok, "{}", last_error());
        let l = logits(&e, 0);
        let pick = (0..vocab).filter(|&i| is_set(&mask, i)).min_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap() as i32;
        if is_eog(&e, pick) {
            ended = true;
            break;
        }
        text.extend(piece(&e, pick));
        assert_eq!(try_step(&e, 0, &[pick]).0, Status::Ok, "token {pick} drawn from the mask: {}", last_error());
    }
    let text = String::from_utf8(text).unwrap();
    assert!(ended && full.is_match(&text), "the least likely allowed tokens still make a match: {text:?}");
}

fn try_constrain_raw(e: &Held, stream: u32, kind: u32, text: *const u8, len: usize) -> Status {
    type Raw = unsafe extern "C" fn(*mut ffi::engine, u32, u32, *const std::ffi::c_char, usize) -> Status;
    // SAFETY: the same C signature, the enum passed as the 32-bit integer C passes for it.
    let f: Raw = unsafe { std::mem::transmute(ffi::engine_set_constraint as *const ()) };
    // SAFETY: a live engine, and `len` bytes at `text` (or NULL with 0) as the callers pass them.
    unsafe { f(e.0, stream, kind, text as *const std::ffi::c_char, len) }
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let Some(path) = model() else { return };
    let e = init(&path, &cpu_options(2, 256));
    let prompt = chat_prompt(&e, "Give the name of a fruit.");
    let free = generate(&e, 1, &prompt, 12);
    reset(&e, 1);
    const RE: &str = "(apple|banana|cherry)";
    constrain(&e, 0, engine_constraint::Regex, RE);
    let refused: &[(engine_constraint, &str, &str)] = &[
        (engine_constraint::JsonSchema, "{\"type\": ", "not JSON"),
        (engine_constraint::JsonSchema, r#"{"type":"array","uniqueItems":true}"#, "uniqueItems"),
        (engine_constraint::JsonSchema, r##"{"$ref":"#/$defs/missing"}"##, "missing"),
        (engine_constraint::Regex, "(unclosed", "ENGINE_CONSTRAINT_REGEX"),
        (engine_constraint::Lark, "start: undefined_rule", "undefined_rule"),
        (engine_constraint::Lark, "", "ENGINE_CONSTRAINT_LARK"),
        (engine_constraint::Json, "{}", "takes no text"),
        (engine_constraint::None, "x", "takes no text"),
    ];
    for &(kind, text, says) in refused {
        for s in [0, 1] {
            assert_eq!(try_constrain(&e, s, kind, text), Status::InvalidArgument, "{kind:?} {text:?}");
            assert!(last_error().contains(says), "{kind:?} {text:?}: {}", last_error());
        }
    }
    let re = b"apple";
    assert_eq!(try_constrain_raw(&e, 0, 5, re.as_ptr(), re.len()), Status::InvalidArgument);
    assert!(last_error().contains("not an engine_constraint"), "{}", last_error());
    assert_eq!(try_constrain_raw(&e, 0, u32::MAX, re.as_ptr(), re.len()), Status::InvalidArgument);
    let bad_utf8 = b"(a|\xff)";
    assert_eq!(try_constrain_raw(&e, 0, 2, bad_utf8.as_ptr(), bad_utf8.len()), Status::InvalidArgument);
    assert!(last_error().contains("not UTF-8 at byte 3"), "{}", last_error());
    assert_eq!(try_constrain_raw(&e, 0, 2, std::ptr::null(), 4), Status::InvalidArgument);
    assert!(last_error().contains("NULL"), "{}", last_error());
    assert_eq!(try_constrain(&e, 2, engine_constraint::Regex, RE), Status::OutOfRange, "a stream past the engine's");
    let null = std::ptr::null_mut();
    // SAFETY: a NULL engine is refused before the (NULL, empty) text is read.
    let st = unsafe { ffi::engine_set_constraint(null, 0, engine_constraint::Json, std::ptr::null(), 0) };
    assert_eq!(st, Status::InvalidArgument);
    // Nothing changed: stream 0 still holds to its regex, stream 1 is still free.
    let held = generate(&e, 0, &prompt, 12);
    let text: Vec<u8> = held.iter().filter(|&&t| !is_eog(&e, t)).flat_map(|&t| piece(&e, t)).collect();
    let text = String::from_utf8(text).unwrap();
    assert!(["apple", "banana", "cherry"].contains(&text.as_str()), "{text:?}");
    assert_eq!(generate(&e, 1, &prompt, 12), free, "stream 1 stayed free");
    // NONE removes the constraint; NULL text with len 0 is no text.
    reset(&e, 0);
    assert_eq!(try_constrain_raw(&e, 0, 0, std::ptr::null(), 0), Status::Ok, "{}", last_error());
    // SAFETY: a live engine and live settings.
    let st = unsafe { ffi::engine_set_sampling(e.0, 0, &ffi::engine_default_sampling()) };
    assert_eq!(st, Status::Ok);
    assert_eq!(generate(&e, 0, &prompt, 12), free, "stream 0 free again");
}

/// The ids llguidance's first mask allows for `regex` over `tokenizer`.
fn first_mask(tokenizer: Tokenizer, eog: &[u32], regex: &str) -> Vec<u32> {
    let vocab = tokenizer.vocab_size();
    let grammars = Grammars::new(Arc::new(tokenizer), vocab, eog).unwrap();
    let mut c = grammars.compile(engine_constraint::Regex, regex).unwrap().unwrap();
    let mask = c.mask().unwrap();
    (0..vocab as u32).filter(|&id| mask.is_allowed(id)).collect()
}

#[test]
fn token_bytes_are_exact_for_byte_level_and_sentencepiece_vocabularies() {
    use token_type::{BYTE, CONTROL, NORMAL, UNKNOWN};
    // SentencePiece: "▁" is a space, <0xNN> a byte; control and unknown tokens are never text.
    let spm: &[(&str, i32)] = &[
        ("<unk>", UNKNOWN),
        ("<s>", CONTROL),
        ("</s>", CONTROL),
        ("<0x0A>", BYTE),
        ("<0xC3>", BYTE),
        ("<0xA9>", BYTE),
        ("a", NORMAL),
        ("▁a", NORMAL),
        ("é", NORMAL),
        ("▁é", NORMAL),
        ("ab", NORMAL),
        ("▁", NORMAL),
        ("<b>", NORMAL),
    ];
    let tokens: Vec<String> = spm.iter().map(|t| t.0.to_string()).collect();
    let types: Vec<i32> = spm.iter().map(|t| t.1).collect();
    let spm_tokenizer = || Tokenizer::from_gguf_spm(&tokens, &vec![0.0; tokens.len()], &types, true).unwrap();
    // Regexes whose first byte is not forced (llguidance narrows a forced text to its tokenization).
    assert_eq!(first_mask(spm_tokenizer(), &[2], "( é|a)"), vec![6, 9, 11], "\"▁\" is a space");
    assert_eq!(first_mask(spm_tokenizer(), &[2], "(é|a)b?"), vec![4, 6, 8, 10], "<0xC3> is é's first byte");
    assert_eq!(first_mask(spm_tokenizer(), &[2], "(<b>|x)"), vec![12], "a control token's name is not text");
    assert_eq!(first_mask(spm_tokenizer(), &[2], "a?"), vec![2, 6], "the empty output may end: EOG allowed");

    // Byte-level BPE: each character of a token stands for one byte (GPT-2's map).
    let bpe: &[(&str, i32)] = &[
        ("a", NORMAL),
        ("Ġa", NORMAL),
        ("Ã©", NORMAL),
        ("Ġ", NORMAL),
        ("Ċ", NORMAL),
        ("Ã", NORMAL),
        ("©", NORMAL),
        ("<|end|>", CONTROL),
        ("Ġ<", NORMAL),
    ];
    let tokens: Vec<String> = bpe.iter().map(|t| t.0.to_string()).collect();
    let types: Vec<i32> = bpe.iter().map(|t| t.1).collect();
    let merges = vec!["Ġ a".to_string(), "Ã ©".to_string()];
    let bpe_tokenizer = || Tokenizer::from_gguf_bpe("gpt2", None, &tokens, &merges, &types).unwrap();
    assert_eq!(first_mask(bpe_tokenizer(), &[7], "(é|a)\n"), vec![0, 2, 5], "é is C3 A9: the whole token or C3");
    assert_eq!(first_mask(bpe_tokenizer(), &[7], "( a| <|a)"), vec![0, 1, 3, 8], "\"Ġ\" is a space");
    assert_eq!(first_mask(bpe_tokenizer(), &[7], "(<|a)\\|end\\|>"), vec![0], "<|end|> is not its name as text");
}
