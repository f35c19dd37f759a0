//! kernels/moe_gemm.cu's grouped products against a host computation: slots routed and grouped by
//! hostembed_moe_route, each slot's row times its expert's matrix (every weight rounded to the half
//! format as the conversion rounds it), in several formats and both half formats; with SwiGLU of a gate;
//! the rows of a smaller batch the same bits; and bad shapes refused.

use std::os::raw::c_int;
use std::ptr;

use crate::common::launch::{NULL_STREAM, ok};
use crate::common::{Rng, gpu_present};
use hostembed::cuda::DeviceBuffer;
use hostembed::kernels as kn;
use hostembed::tensor::{DType, decode_row, encode_row};

/// `values` rounded to the half format `half` as the device rounds them (to nearest, ties to even).
fn round_half(half: DType, values: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; values.len()];
    decode_row(half, &encode_row(half, values), &mut out);
    out
}

fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// Relative L2 distance of `got` from `want`, every value written.
fn rel_l2(what: &str, got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("{what}: value {i} of {} is {} (not written?)", got.len(), got[i]);
    }
    let (mut d, mut w) = (0f64, 0f64);
    for (&g, &r) in got.iter().zip(want) {
        d += (g as f64 - r as f64).powi(2);
        w += (r as f64).powi(2);
    }
    (d / w.max(1e-30)).sqrt()
}

/// A stack of `experts` matrices of `rows` x `cols` in `dtype` (bytes), and its decoded values.
pub(super) fn stack(rng: &mut Rng, dtype: DType, experts: usize, rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let (mut bytes, mut values) = (Vec::new(), Vec::new());
    for _ in 0..experts * rows {
        let row: Vec<f32> = (0..cols).map(|_| rng.uniform()).collect();
        let encoded = encode_row(dtype, &row);
        let mut decoded = vec![0f32; cols];
        decode_row(dtype, &encoded, &mut decoded);
        bytes.extend_from_slice(&encoded);
        values.extend(decoded);
    }
    (bytes, values)
}

/// The first `n` rows of `logits` routed (top `k` of `experts`): each slot's expert, and the groups on
/// the device.
pub(super) fn route(logits: &[f32], experts: usize, n: usize, k: usize) -> (Vec<i32>, DeviceBuffer) {
    let ld = DeviceBuffer::from_slice(&logits[..n * experts]).unwrap();
    let ids = DeviceBuffer::new(n * k * 4).unwrap();
    let weights = DeviceBuffer::new(n * k * 4).unwrap();
    let groups = DeviceBuffer::new((1 + 3 * experts + n * k) * 4).unwrap();
    // SAFETY: device buffers of the sizes the launcher's comment gives, alive until the synchronize in ok.
    let code = unsafe {
        kn::hostembed_moe_route(
            ld.ptr() as *const f32,
            experts as u32,
            n as u32,
            k as u32,
            1,
            ids.ptr() as *mut c_int,
            weights.ptr() as *mut f32,
            groups.ptr() as *mut c_int,
            NULL_STREAM,
        )
    };
    ok(code, "hostembed_moe_route");
    let mut out = vec![0i32; n * k];
    ids.download(&mut out).unwrap();
    (out, groups)
}

/// One grouped product on the device (`gate` null: f32 out; else half out).
#[allow(clippy::too_many_arguments)]
fn grouped(
    a: &DeviceBuffer,
    lda: usize,
    per: usize,
    half: DType,
    w: &DeviceBuffer,
    dtype: DType,
    (rows, cols): (usize, usize),
    groups: &DeviceBuffer,
    experts: usize,
    slots: usize,
    gate: *const f32,
    out: &DeviceBuffer,
) -> c_int {
    // SAFETY: device buffers sized for these shapes (the callers'), alive until the synchronize in ok.
    unsafe {
        kn::hostembed_moe_grouped(
            a.ptr(),
            lda as u32,
            per as u32,
            half as c_int,
            w.ptr(),
            dtype as c_int,
            rows as u32,
            cols as u32,
            groups.ptr() as *const c_int,
            experts as u32,
            slots as u32,
            gate,
            out.ptr(),
            rows as u32,
            NULL_STREAM,
        )
    }
}

#[test]
fn grouped_products_match_the_host_and_ignore_the_batch() {
    if !gpu_present("grouped_products_match_the_host_and_ignore_the_batch") {
        return;
    }
    let mut rng = Rng::fresh("grouped_products_match_the_host_and_ignore_the_batch");
    // 200 rows: a part-filled row tile; 150 tokens of 2 among 6 experts: groups of several slot tiles.
    let (experts, rows, cols, n, k) = (6usize, 200usize, 256usize, 150usize, 2usize);
    let cases = [
        (DType::Bf16, DType::Bf16),
        (DType::F16, DType::F16),
        (DType::F32, DType::F16),
        (DType::Q8_0, DType::F16),
        (DType::Q4_K, DType::F16),
        (DType::Q6_K, DType::Bf16),
    ];
    for (dtype, half) in cases {
        let what = format!("{} weights, {} operands", dtype.name(), half.name());
        let (bytes, w) = stack(&mut rng, dtype, experts, rows, cols);
        let w = round_half(half, &w);
        let wd = DeviceBuffer::from_slice(&bytes).unwrap();
        let logits: Vec<f32> = (0..n * experts).map(|_| rng.uniform()).collect();
        let (ids, groups) = route(&logits, experts, n, k);

        // Each token's row read by its k slots (per = k), f32 out.
        let a = round_half(half, &(0..n * cols).map(|_| rng.uniform()).collect::<Vec<_>>());
        let ad = DeviceBuffer::from_slice(&encode_row(half, &a)).unwrap();
        let out = DeviceBuffer::new(n * k * rows * 4).unwrap();
        out.fill_bytes(0xFF).unwrap();
        ok(grouped(&ad, cols, k, half, &wd, dtype, (rows, cols), &groups, experts, n * k, ptr::null(), &out), &what);
        let mut got = vec![0f32; n * k * rows];
        out.download(&mut got).unwrap();
        let dot = |x: &[f32], e: usize, r: usize| -> f32 {
            let wr = &w[(e * rows + r) * cols..][..cols];
            x.iter().zip(wr).map(|(&p, &q)| p as f64 * q as f64).sum::<f64>() as f32
        };
        let want: Vec<f32> = (0..n * k * rows)
            .map(|i| {
                let (s, r) = (i / rows, i % rows);
                dot(&a[(s / k) * cols..][..cols], ids[s] as usize, r)
            })
            .collect();
        let err = rel_l2(&what, &got, &want);
        assert!(err < 1e-5, "{what}: relative L2 {err:.3e}");

        // The first 37 tokens routed alone: their slots' outputs are the same bits.
        let few = 37;
        let (_, few_groups) = route(&logits, experts, few, k);
        let few_out = DeviceBuffer::new(few * k * rows * 4).unwrap();
        let code =
            grouped(&ad, cols, k, half, &wd, dtype, (rows, cols), &few_groups, experts, few * k, ptr::null(), &few_out);
        ok(code, &what);
        let mut alone = vec![0f32; few * k * rows];
        few_out.download(&mut alone).unwrap();
        let same = alone.iter().zip(&got).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{what}: {few} tokens alone differ from the same tokens in a batch of {n}");

        // A row a slot (per = 1) with SwiGLU of a gate: half out.
        let slots_a = round_half(half, &(0..n * k * cols).map(|_| rng.uniform()).collect::<Vec<_>>());
        let sd = DeviceBuffer::from_slice(&encode_row(half, &slots_a)).unwrap();
        let gate: Vec<f32> = (0..n * k * rows).map(|_| 4.0 * rng.uniform()).collect();
        let gd = DeviceBuffer::from_slice(&gate).unwrap();
        let hout = DeviceBuffer::new(n * k * rows * 2).unwrap();
        hout.fill_bytes(0xFF).unwrap();
        let g = gd.ptr() as *const f32;
        ok(grouped(&sd, cols, 1, half, &wd, dtype, (rows, cols), &groups, experts, n * k, g, &hout), &what);
        let mut raw = vec![0u8; n * k * rows * 2];
        hout.download(&mut raw).unwrap();
        let mut got = vec![0f32; n * k * rows];
        decode_row(half, &raw, &mut got);
        let want: Vec<f32> = (0..n * k * rows)
            .map(|i| {
                let (s, r) = (i / rows, i % rows);
                silu(gate[i]) * dot(&slots_a[s * cols..][..cols], ids[s] as usize, r)
            })
            .collect();
        let err = rel_l2(&what, &got, &want);
        assert!(err < 1e-2, "{what} with SwiGLU: relative L2 {err:.3e}");
    }
}

#[test]
fn grouped_products_refuse_bad_shapes() {
    if !gpu_present("grouped_products_refuse_bad_shapes") {
        return;
    }
    let (experts, rows, cols, n, k) = (4usize, 16usize, 32usize, 8usize, 2usize);
    let w = DeviceBuffer::new(experts * rows * cols * 2).unwrap();
    let a = DeviceBuffer::new(n * cols * 2).unwrap();
    let out = DeviceBuffer::new(n * k * rows * 4).unwrap();
    let logits = vec![0.5f32; n * experts];
    let (_, groups) = route(&logits, experts, n, k);
    let none = ptr::null();
    let f16 = DType::F16;
    // Columns not in whole 8-value pieces, a format that is not a half one for the operands, none routed.
    let bad = grouped(&a, cols, k, f16, &w, f16, (rows, 20), &groups, experts, n * k, none, &out);
    assert_ne!(bad, 0, "20 columns were taken");
    let bad = grouped(&a, cols, k, DType::Q8_0, &w, f16, (rows, cols), &groups, experts, n * k, none, &out);
    assert_ne!(bad, 0, "Q8_0 operands were taken");
    let bad = grouped(&a, cols, k, f16, &w, f16, (rows, cols), &groups, 0, n * k, none, &out);
    assert_ne!(bad, 0, "no experts were taken");
    ok(grouped(&a, cols, k, f16, &w, f16, (rows, cols), &groups, experts, 0, none, &out), "no slots");
}
