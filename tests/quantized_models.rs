//! Quantized GGUF models through the C ABI on the CPU backend: a Q4_K_M file decodes to exactly the
//! logits of an F32 file holding its decoded values (so the reader, llama's permuted Q/K rows of whole
//! super-blocks and the backend take the blocks as stored) and the fit counts its rows as stored; a
//! file whose blocks carry a NaN or infinite scale is refused when it is opened.

mod common;

use common::{Held, Rng, Scratch, bits, init, logits, quiet, step, try_step};

use hostembed::Status;
use hostembed::checkpoint::write::{OwnedTensor, Recipe, synthetic_weights, write_gguf};
use hostembed::checkpoint::{Checkpoint, gguf};
use hostembed::engine::{self, engine_backend, engine_options};
use hostembed::ffi;
use hostembed::model::{Arch, ModelConfig, RopeScaling};
use hostembed::status::last_error;
use hostembed::tensor::DType;
use std::ffi::c_void;

/// A Llama with GQA 2:1 whose rows are whole super-blocks; 16 layers so Q4_K_M mixes Q4_K and Q6_K.
fn config() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab: 320,
        hidden: 256,
        layers: 16,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        intermediate: 512,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 256,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: Some(1),
        eos: Some(2),
        moe: None,
    }
}

fn cpu_options() -> engine_options {
    engine_options { backend: engine_backend::Cpu, context: 64, log: Some(quiet), ..engine::default_options() }
}

fn embed(e: &Held, ids: &[i32], cols: usize) -> (Status, Vec<f32>) {
    let mut out = vec![7f32; ids.len() * cols];
    // SAFETY: a live engine, ids.len() ids, and room for ids.len() x cols floats at `out` on the host (NULL stream).
    let st = unsafe {
        ffi::engine_embed(
            e.0,
            ids.as_ptr(),
            ids.len(),
            out.as_mut_ptr() as *mut c_void,
            DType::F32,
            std::ptr::null_mut(),
        )
    };
    (st, out)
}

#[test]
fn q4_k_m_decodes_to_the_logits_of_its_decoded_values() {
    // The other test compares the process's memory counters: engines here must not overlap its.
    let _g = common::serial();
    let mut rng = Rng::fresh("q4_k_m_decodes_to_the_logits_of_its_decoded_values");
    let dir = Scratch::new("q4_k_m");
    let cfg = config();
    let weights = synthetic_weights(&cfg, rng.next_u64(), Recipe::Q4KM);
    assert!(weights.iter().any(|t| t.dtype == DType::Q4_K) && weights.iter().any(|t| t.dtype == DType::Q6_K));
    let decoded: Vec<OwnedTensor> =
        weights.iter().map(|t| OwnedTensor::from_f32(&t.name, DType::F32, &t.shape, &t.to_f32()).unwrap()).collect();
    let (quantized, plain) = (dir.join("q4_k_m.gguf"), dir.join("f32.gguf"));
    write_gguf(&quantized, &cfg, &weights, &[]).unwrap();
    write_gguf(&plain, &cfg, &decoded, &[]).unwrap();
    assert!(std::fs::metadata(&quantized).unwrap().len() * 5 < std::fs::metadata(&plain).unwrap().len());

    let prompt: Vec<i32> = (0..9).map(|_| rng.below(cfg.vocab as u64) as i32).collect();
    let (q, f) = (init(&quantized, &cpu_options()), init(&plain, &cpu_options()));
    let (mut a, mut b) = (step(&q, 0, &prompt), step(&f, 0, &prompt));
    assert_eq!(bits(&logits(&q, 0)), bits(&logits(&f, 0)), "prompt logits");
    for _ in 0..6 {
        assert_eq!(a, b);
        (a, b) = (step(&q, 0, &[a]), step(&f, 0, &[b]));
    }
    assert_eq!(bits(&logits(&q, 0)), bits(&logits(&f, 0)), "logits after decoding");
    let (st, rows) = embed(&q, &prompt, cfg.hidden);
    assert_eq!(st, Status::Ok, "{}", last_error());
    let (st, plain_rows) = embed(&f, &prompt, cfg.hidden);
    assert_eq!(st, Status::Ok, "{}", last_error());
    assert_eq!(bits(&rows), bits(&plain_rows), "engine_embed dequantizes the Q4_K rows");

    // The fit counts the rows as stored: vocab rows of hidden / 256 Q4_K super-blocks of 144 bytes.
    let ckpt = Checkpoint::open(&quantized).unwrap();
    let inputs = engine::fit_inputs(&ckpt, &engine_options { room_bytes: 1 << 34, ..cpu_options() }, None).unwrap();
    assert_eq!(inputs.embed_bytes, (cfg.vocab * cfg.hidden / 256 * 144) as u64);
    let plain_inputs = engine::fit_inputs(
        &Checkpoint::open(&plain).unwrap(),
        &engine_options { room_bytes: 1 << 34, ..cpu_options() },
        None,
    )
    .unwrap();
    assert_eq!(plain_inputs.embed_bytes, (cfg.vocab * cfg.hidden * 4) as u64);
}

/// Sets the f16 at byte `at` of tensor `name`'s data.
fn set_f16(bytes: &mut [u8], name: &str, at: usize, value: u16) {
    let g = gguf::parse(bytes, "m.gguf").unwrap();
    let t = g.tensors.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("{name}"));
    let start = t.start + at;
    bytes[start..start + 2].copy_from_slice(&value.to_le_bytes());
}

/// A block whose f16 scale or minimum is NaN or infinite would make every logit non-finite: the file is
/// refused when it is opened (BAD_MODEL naming the tensor, its format, the block and its row), on every
/// backend, with nothing held; f16's finite extremes in the same places load and step.
#[test]
fn non_finite_scales_are_refused_at_load() {
    let _g = common::serial();
    let dir = Scratch::new("non-finite");
    let cfg = config();
    let path = dir.join("m.gguf");
    write_gguf(&path, &cfg, &synthetic_weights(&cfg, 5, Recipe::Q4KM), &[]).unwrap();
    let clean = std::fs::read(&path).unwrap();
    let row_bytes = DType::Q4_K.row_bytes(cfg.hidden).unwrap();
    let q6_row_bytes = DType::Q6_K.row_bytes(cfg.hidden).unwrap();
    // (tensor, byte in its data, f16 bits, what the message names): Q4_K's d is a block's first f16 and
    // dmin its second; Q6_K's d its last (byte 208 of 210).
    let cases = [
        ("token_embd.weight", 5 * row_bytes, 0x7C00u16, "Q4_K): block 5 (row 5) has a scale of inf"),
        ("token_embd.weight", 6 * row_bytes + 2, 0x7E00, "Q4_K): block 6 (row 6) has a scale of NaN"),
        ("blk.0.attn_v.weight", 3 * q6_row_bytes + 208, 0xFC00, "Q6_K): block 3 (row 3) has a scale of -inf"),
    ];
    let before = common::stats();
    for (tensor, at, value, says) in cases {
        let mut bytes = clean.clone();
        set_f16(&mut bytes, tensor, at, value);
        std::fs::write(&path, &bytes).unwrap();
        for backend in [engine_backend::Cpu, engine_backend::Auto] {
            let opts = engine_options { backend, ..cpu_options() };
            let mut e = std::ptr::null_mut();
            let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
            // SAFETY: a NUL-terminated path, live options and a writable handle (left NULL on failure).
            let st = unsafe { ffi::engine_init_fit(c.as_ptr(), &opts, &mut e) };
            assert_eq!(st, Status::BadModel, "{tensor} {value:#06x}: {}", last_error());
            assert!(e.is_null());
            let msg = last_error();
            let name = gguf::canonical_name(tensor);
            assert!(msg.contains(&format!("tensor {name} ({says}")), "{msg}");
            assert!(msg.contains("m.gguf"), "the message names the file: {msg}");
            assert_eq!(common::stats(), before, "held after a refused load");
        }
    }

    // The largest finite f16, a subnormal and negative zero as scales: the file loads and steps.
    let mut bytes = clean.clone();
    set_f16(&mut bytes, "token_embd.weight", 5 * row_bytes, 0x7BFF);
    set_f16(&mut bytes, "token_embd.weight", 6 * row_bytes + 2, 0x0001);
    set_f16(&mut bytes, "blk.0.attn_v.weight", 208, 0x8000);
    std::fs::write(&path, &bytes).unwrap();
    let e = init(&path, &cpu_options());
    let (st, rows) = embed(&e, &[4, 5, 6], cfg.hidden);
    assert_eq!(st, Status::Ok, "{}", last_error());
    assert!(rows.iter().all(|v| v.is_finite()), "finite scales decode to finite values");
    let next = step(&e, 0, &[5, 6]);
    assert!((0..cfg.vocab as i32).contains(&next), "{next}");
    assert_eq!(try_step(&e, 0, &[next]).0, Status::Ok, "{}", last_error());
}
