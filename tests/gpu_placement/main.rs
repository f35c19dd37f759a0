//! The embedding rows on the GPU: every placement gathers the file's rows bit for bit in every format
//! (and at both seed shapes), host placements free the table's size of device memory, the engine's
//! predicted on-card bytes match cudaMemGetInfo, the fit rule's boundary is where the engine flips, and
//! nothing is held after engine_free or after any failed engine_init_fit. Prints SKIP without a device.

#[path = "../common/mod.rs"]
mod common;

mod gather;
mod memory;

use common::{Held, Rng, device_info, init};
use hostembed::checkpoint::Checkpoint;
use hostembed::checkpoint::write::{write_synthetic_gguf, write_synthetic_hf};
use hostembed::cuda::{DeviceBuffer, Stream};
use hostembed::engine::{engine_backend, engine_options, engine_tristate};
use hostembed::fit::{engine_placement, engine_plan};
use hostembed::model::{Arch, ModelConfig, RopeScaling};
use hostembed::placement::engine_rows;
use hostembed::status::last_error;
use hostembed::tensor::{DType, decode_row};
use hostembed::{Status, cuda, engine, ffi, fit};
use std::ffi::{CStr, c_char, c_void};
use std::path::{Path, PathBuf};

const MIB: u64 = 1 << 20;

/// A valid model whose rows are `vocab` x `hidden` and whose rest is as small as a model can be.
fn config(vocab: usize, hidden: usize) -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab,
        hidden,
        layers: 1,
        heads: 2,
        kv_heads: 1,
        head_dim: 64,
        intermediate: 64,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 4096,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: Some(1),
        eos: Some(2),
        moe: None,
    }
}

/// Writes safetensors for F32/BF16 rows and GGUF for the other formats; returns the path to open.
fn write_model(dir: &Path, cfg: &ModelConfig, dtype: DType, seed: u64) -> PathBuf {
    match dtype {
        DType::F32 | DType::Bf16 => {
            let p = dir.join(format!("hf-{}-{}x{}", dtype.name(), cfg.vocab, cfg.hidden));
            write_synthetic_hf(&p, cfg, seed, dtype).unwrap();
            p
        }
        _ => {
            let p = dir.join(format!("m-{}-{}x{}.gguf", dtype.name(), cfg.vocab, cfg.hidden));
            write_synthetic_gguf(&p, cfg, seed, dtype).unwrap();
            p
        }
    }
}

fn free_bytes() -> u64 {
    cuda::mem_info().unwrap().0
}

unsafe extern "C" fn collect_lines(user: *mut c_void, line: *const c_char) {
    // SAFETY: the test passes a live Vec<String> as `user`, and nothing else touches it during the call.
    let lines = unsafe { &mut *(user as *mut Vec<String>) };
    // SAFETY: the library passes a NUL-terminated line that lives for the call.
    lines.push(unsafe { CStr::from_ptr(line) }.to_string_lossy().into_owned());
}

/// CUDA backend, one stream at most, a small window; `lines` receives the log.
fn options(room: u64, mmap: engine_tristate, lines: &mut Vec<String>) -> engine_options {
    engine_options {
        backend: engine_backend::Cuda,
        room_bytes: room,
        mmap_rows: mmap,
        context: 1024,
        max_streams: 1,
        max_batch: 16,
        log: Some(collect_lines),
        log_user: lines as *mut Vec<String> as *mut c_void,
        ..engine::default_options()
    }
}

/// The room at which the fit rule maps the rows (one byte short of its need).
fn need_of(path: &Path, opts: &engine_options) -> (fit::engine_fit_inputs, engine_plan) {
    let ckpt = Checkpoint::open(path).unwrap();
    let inputs = engine::fit_inputs(&ckpt, opts, Some(&device_info())).unwrap();
    (inputs, fit::plan(&inputs).unwrap())
}

/// The three placements and the options that produce each.
fn placements(path: &Path, lines: &mut Vec<String>) -> Vec<(engine_placement, engine_options)> {
    let big = options(1 << 50, engine_tristate::No, lines);
    let (_, plan) = need_of(path, &big);
    vec![
        (engine_placement::Device, big),
        (engine_placement::HostMapped, options(plan.need_bytes - 1, engine_tristate::No, lines)),
        (engine_placement::FileMapped, options(1 << 50, engine_tristate::Yes, lines)),
    ]
}

fn rows_of(e: &Held) -> engine_rows {
    // SAFETY: engine_rows is pointers, numbers, a bool and enums with a variant at 0: all zeros is a value of it.
    let mut r: engine_rows = unsafe { std::mem::zeroed() };
    // SAFETY: a live engine and a writable engine_rows.
    assert_eq!(unsafe { ffi::engine_embed_rows(e.0, &mut r) }, Status::Ok);
    r
}

fn reference_row(ckpt: &Checkpoint, id: usize) -> Vec<f32> {
    let t = ckpt.embed();
    let rb = t.row_bytes();
    let mut v = vec![0f32; t.cols()];
    decode_row(t.dtype, &ckpt.bytes_of(t)[id * rb..(id + 1) * rb], &mut v);
    v
}

/// Gathers random ids (with 0 and vocab-1) through engine_embed in f32 and bf16 on a stream of the
/// test's own, and compares every bit with the CPU decoding of the file's bytes.
fn check_exact(e: &Held, ckpt: &Checkpoint, rng: &mut Rng, count: usize, what: &str) {
    let (vocab, cols) = (ckpt.embed().rows(), ckpt.embed().cols());
    let mut ids: Vec<i32> = (0..count).map(|_| rng.below(vocab as u64) as i32).collect();
    ids.extend([0, vocab as i32 - 1]);
    let n = ids.len();
    let ids_dev = DeviceBuffer::from_slice(&ids).unwrap();
    let out = DeviceBuffer::new(n * cols * 4).unwrap();
    let stream = Stream::new().unwrap();
    let want: Vec<Vec<f32>> = ids.iter().map(|&id| reference_row(ckpt, id as usize)).collect();

    out.fill_bytes(0xff).unwrap();
    // SAFETY: a live engine, `n` ids and room for n x cols f32 on the device, and the test's live stream.
    let st = unsafe { ffi::engine_embed(e.0, ids_dev.ptr() as *const i32, n, out.ptr(), DType::F32, stream.raw()) };
    assert_eq!(st, Status::Ok, "{what}: {}", last_error());
    let mut got = vec![0f32; n * cols];
    out.download(&mut got).unwrap();
    for (k, w) in want.iter().enumerate() {
        let g = &got[k * cols..(k + 1) * cols];
        if let Some(c) = (0..cols).find(|&c| g[c].to_bits() != w[c].to_bits()) {
            panic!("{what}: id {} column {c}: got {} want {} (f32 out)", ids[k], g[c], w[c]);
        }
    }

    out.fill_bytes(0xff).unwrap();
    // SAFETY: a live engine, `n` ids and room for n x cols bf16 (half the f32 room) on the device.
    let st =
        unsafe { ffi::engine_embed(e.0, ids_dev.ptr() as *const i32, n, out.ptr(), DType::Bf16, std::ptr::null_mut()) };
    assert_eq!(st, Status::Ok, "{what}: {}", last_error());
    let mut got = vec![0u16; n * cols];
    out.download(&mut got).unwrap();
    for (k, w) in want.iter().enumerate() {
        let g = &got[k * cols..(k + 1) * cols];
        if let Some(c) = (0..cols).find(|&c| g[c] != half::bf16::from_f32(w[c]).to_bits()) {
            panic!("{what}: id {} column {c}: got {:#06x} want {} (bf16 out)", ids[k], g[c], w[c]);
        }
    }
}

/// Module loading and the first allocations take device memory once; measure after them.
fn warm_up(dir: &Path) {
    let path = write_model(dir, &config(512, 128), DType::Bf16, 1);
    let mut lines = Vec::new();
    let e = init(&path, &options(1 << 50, engine_tristate::No, &mut lines));
    let ckpt = Checkpoint::open(&path).unwrap();
    check_exact(&e, &ckpt, &mut Rng(1), 4, "warm-up");
    drop(e);
}
