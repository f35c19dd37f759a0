//! Every decode kernel against the CPU oracle (src/cpu.rs) and the sampler (src/sampler.rs), on fresh
//! random data, with outputs poisoned (0xFF bytes, a NaN) before each launch and every element checked.
//! Skips (with a SKIP line) where no CUDA device is present.

#[path = "../common/mod.rs"]
mod common;

mod attention;
mod batched_sampling;
mod elementwise;
mod matvec;
mod mmv;
mod mmv_kernels;
mod sampling;

use common::Rng;
use common::launch::{NULL_STREAM, download, launch_tuning, ok, poisoned};
use hostembed::cuda::DeviceBuffer;
use hostembed::model::TensorRef;
use hostembed::sampler::Sampling;
use hostembed::tensor::{DType, FORMATS, encode_row};
use hostembed::{cpu, kernels as kn};
use std::os::raw::{c_int, c_uint, c_void};

/// `data` uploaded `offset` bytes into a fresh buffer (to test misaligned pointers).
fn upload_at<T: Copy>(data: &[T], offset: usize) -> (DeviceBuffer, *mut c_void) {
    let b = poisoned(std::mem::size_of_val(data) + offset);
    b.upload(data, offset).unwrap();
    // SAFETY: `offset` is within `b`, which has room for `data` after it; only the address is formed.
    let p = unsafe { (b.ptr() as *mut u8).add(offset) } as *mut c_void;
    (b, p)
}

/// Fails where an element is not finite (a NaN left from the poison: not written).
fn assert_written(what: &str, got: &[f32]) {
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("{what}: element {i} of {} is {} (not written?)", got.len(), got[i]);
    }
}

/// Relative L2 error, after checking that every element was written (no NaN left from the poison).
fn rel_l2(what: &str, got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    assert_written(what, got);
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        num += (g as f64 - w as f64).powi(2);
        den += (w as f64).powi(2);
    }
    (num / den.max(1e-300)).sqrt()
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let err = rel_l2(what, got, want);
    println!("{what}: relative L2 error {err:.2e} (bound {tol:.0e})");
    assert!(err < tol, "{what}: relative L2 error {err:.3e} >= {tol:.0e}");
}

/// The matvec bound: F32 products differ from the CPU's f64 sums only by f32 accumulation; every other
/// format is decoded in registers to the CPU's f32 values (block formats within one rounding, where the
/// kernel fuses scale and offset into one FMA) and multiplied in f32, so the error is f32 rounding over
/// a few thousand terms (~1e-6 relative); 1e-3 still fails on any misread value (one wrong quant in a
/// row of 256 moves the row by ~1e-2).
fn weight_tol(dtype: DType) -> f64 {
    if dtype == DType::F32 { 1e-5 } else { 1e-3 }
}

fn encode(dtype: DType, cols: usize, values: &[f32]) -> Vec<u8> {
    values.chunks(cols).flat_map(|row| encode_row(dtype, row)).collect()
}

fn bf16_round(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

/// Every format the crate reads, in the C enum's order.
fn dtypes() -> impl Iterator<Item = DType> {
    FORMATS.iter().map(|f| f.dtype)
}

/// Columns for a shape, rounded up to whole blocks of formats with blocks of more than one value.
fn cols_for(dtype: DType, cols: usize) -> usize {
    let block = dtype.format().block_values;
    cols.div_ceil(block) * block
}

/// Random gate and up weights (rows x cols, cols rounded to whole blocks) and n inputs on the device, and
/// the CPU's silu(gate x) * (up x).
struct SwigluCase {
    cols: usize,
    gd: DeviceBuffer,
    ud: DeviceBuffer,
    xd: DeviceBuffer,
    want: Vec<f32>,
}

fn swiglu_case(rng: &mut Rng, dtype: DType, rows: usize, cols: usize, n: usize) -> SwigluCase {
    let cols = cols_for(dtype, cols);
    let gb = encode(dtype, cols, &rng.vec(rows * cols, 1.0));
    let ub = encode(dtype, cols, &rng.vec(rows * cols, 1.0));
    let x = rng.vec(n * cols, 1.0);
    let g = TensorRef { dtype, shape: &[rows, cols], bytes: &gb };
    let u = TensorRef { dtype, shape: &[rows, cols], bytes: &ub };
    let mut want = vec![0f32; n * rows];
    let (mut gv, mut uv) = (vec![0f32; rows], vec![0f32; rows]);
    for t in 0..n {
        cpu::matvec(&g, &x[t * cols..(t + 1) * cols], &mut gv);
        cpu::matvec(&u, &x[t * cols..(t + 1) * cols], &mut uv);
        cpu::swiglu(&gv, &uv, &mut want[t * rows..(t + 1) * rows]);
    }
    SwigluCase {
        cols,
        gd: DeviceBuffer::from_slice(&gb).unwrap(),
        ud: DeviceBuffer::from_slice(&ub).unwrap(),
        xd: DeviceBuffer::from_slice(&x).unwrap(),
        want,
    }
}

/// `device_sample` with the repetition penalty on the distinct ids `penalty`; checks the launch leaves
/// the logits as they were.
fn device_sample_penalized(
    logits: &DeviceBuffer,
    vocab: usize,
    s: &Sampling,
    stream: u32,
    position: u64,
    penalty: &[u32],
) -> u32 {
    let scratch = poisoned(vocab * 8);
    let token = poisoned(4);
    let ids = poisoned(penalty.len().max(1) * 8);
    let ids_host: Vec<i32> = penalty.iter().map(|&t| t as i32).collect();
    ids.upload(&ids_host, 0).unwrap();
    let before = download::<f32>(logits, vocab);
    ok(
        // SAFETY: `logits` holds `vocab` floats, `scratch` 8 bytes an id, `ids` room for the penalty ids and their
        // saved logits, `token` one int; all alive until the synchronous check after the launch.
        unsafe {
            kn::hostembed_sample(
                logits.ptr() as *mut f32,
                vocab as c_uint,
                s.temperature,
                s.top_k,
                s.top_p,
                s.min_p,
                s.repeat_penalty,
                ids.ptr() as *mut c_int,
                penalty.len() as c_uint,
                s.seed,
                stream,
                position,
                scratch.ptr(),
                token.ptr() as *mut c_int,
                NULL_STREAM,
            )
        },
        "hostembed_sample",
    );
    let mut t = [0i32];
    token.download(&mut t).unwrap();
    assert!(t[0] >= 0 && (t[0] as usize) < vocab, "sampled token {} outside the vocabulary of {vocab}", t[0]);
    let after = download::<f32>(logits, vocab);
    assert!(before.iter().zip(&after).all(|(a, b)| a.to_bits() == b.to_bits()), "the sampler left the logits changed");
    t[0] as u32
}

/// (temperature, top_k, top_p): the bench's default first, then cuts of every size.
const SAMPLE_SETTINGS: [(f32, u32, f32); 13] = [
    (0.8, 40, 0.95),
    (1.0, 0, 1.0),
    (0.7, 0, 0.9),
    (1.3, 0, 0.5),
    (0.6, 5, 1.0),
    (1.0, 1000, 1.0),
    (1.0, 1000, 0.9),
    (2.0, 100, 0.5),
    (1.0, 20000, 0.95),
    (0.9, 3, 0.0),
    (1.0, 0, 1e-9),
    (0.05, 0, 0.99),
    (5.0, 0, 0.999),
];

/// Logits of one of three kinds: continuous, on a 0.5 grid (runs of thousands of equal logits spanning
/// many blocks, so every cut and the draw land inside one), or continuous with a tenth masked to -inf.
fn sample_logits(rng: &mut Rng, vocab: usize, kind: usize) -> Vec<f32> {
    let mut logits = rng.vec(vocab, 8.0);
    match kind {
        0 => {}
        1 => logits.iter_mut().for_each(|l| *l = (*l * 0.5).round() / 2.0),
        _ => {
            for _ in 0..vocab / 10 {
                logits[rng.below(vocab as u64) as usize] = f32::NEG_INFINITY;
            }
        }
    }
    logits
}
