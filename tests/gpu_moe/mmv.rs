//! kernels/moe_mmv.cu's expert products of decode rows against a host computation: slots routed and
//! grouped by hostembed_moe_route, each slot's f32 row times its expert's matrix (SwiGLU of the gate and
//! up products, and a down product), in block formats; experts holding more slots than a block's pass
//! and matrices cut in several column ranges; the rows of a smaller batch the same bits (each cut of the
//! columns); and what it refuses.

use std::os::raw::{c_int, c_uint, c_void};
use std::ptr;

use super::grouped::{route, stack};
use crate::common::launch::{NULL_STREAM, launch_tuning, ok};
use crate::common::{Rng, gpu_present, rel_l2};
use hostembed::cuda::DeviceBuffer;
use hostembed::kernels as kn;
use hostembed::tensor::DType;

/// The workspace of a launch over `n` rows: the split sums and the zeroed arrival counters.
fn workspace(rows: usize, cols: usize, glu: bool, experts: usize, n: usize, k: usize) -> (DeviceBuffer, DeviceBuffer) {
    let (mut floats, mut counters) = (0usize, 0 as c_uint);
    let (r, c, e, nn, kk) = (rows as u32, cols as u32, experts as u32, n as u32, k as u32);
    // SAFETY: host arithmetic on sizes, writing the two out-parameters only.
    let code = unsafe { kn::hostembed_moe_mmv_workspace(r, c, glu as c_int, e, nn, kk, &mut floats, &mut counters) };
    assert_eq!(code, 0, "hostembed_moe_mmv_workspace");
    let partial = DeviceBuffer::new(floats.max(1) * 4).unwrap();
    let counts = DeviceBuffer::new((counters as usize).max(1) * 4).unwrap();
    counts.fill_bytes(0).unwrap();
    (partial, counts)
}

/// One launch: y[slot] = W_e x[slot / x_div] (with `up`: silu of it times the up product), each expert's
/// columns cut as `cut` says (`kn::MOE_CUT_*`).
#[allow(clippy::too_many_arguments)]
fn launch(
    cut: c_int,
    w: &DeviceBuffer,
    up: Option<&DeviceBuffer>,
    dtype: DType,
    (rows, cols): (usize, usize),
    x: &DeviceBuffer,
    x_div: usize,
    groups: &DeviceBuffer,
    (experts, n, k): (usize, usize, usize),
    y: &DeviceBuffer,
    work: &(DeviceBuffer, DeviceBuffer),
) -> c_int {
    let tuning = kn::hostembed_tuning { moe_mmv_cut: cut, ..launch_tuning() };
    let expert_bytes = dtype.row_bytes(cols).unwrap() * rows;
    let w2 = up.map_or(ptr::null(), |u| u.ptr() as *const c_void);
    // SAFETY: device buffers sized for these shapes (the callers'), the workspace as the launcher sized it,
    // alive until the synchronize in ok.
    unsafe {
        kn::hostembed_moe_mmv(
            w.ptr(),
            w2,
            dtype as c_int,
            expert_bytes,
            rows as u32,
            cols as u32,
            x.ptr() as *const f32,
            x_div as u32,
            groups.ptr() as *const c_int,
            experts as u32,
            n as u32,
            k as u32,
            y.ptr() as *mut f32,
            work.0.ptr() as *mut f32,
            work.1.ptr() as *mut c_uint,
            tuning,
            NULL_STREAM,
        )
    }
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

#[test]
fn decode_row_products_match_the_host_and_ignore_the_batch() {
    let test = "decode_row_products_match_the_host_and_ignore_the_batch";
    if !gpu_present(test) {
        return;
    }
    let mut rng = Rng::fresh(test);
    // 40 rows choosing 3 of 10 experts: groups past a block's 16 slots. Gate and up of 200 x 512 (a part
    // row block, two column ranges), down of 300 x 256 (one range).
    let (experts, n, k) = (10usize, 40usize, 3usize);
    let (width, hidden, down_cols) = (200usize, 512usize, 256usize);
    for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q5_K, DType::Q6_K] {
        let what = dtype.name();
        let (gb, gv) = stack(&mut rng, dtype, experts, width, hidden);
        let (ub, uv) = stack(&mut rng, dtype, experts, width, hidden);
        let (db, dv) = stack(&mut rng, dtype, experts, 300, down_cols);
        let (gd, ud, dd) = (
            DeviceBuffer::from_slice(&gb).unwrap(),
            DeviceBuffer::from_slice(&ub).unwrap(),
            DeviceBuffer::from_slice(&db).unwrap(),
        );
        let logits: Vec<f32> = (0..n * experts).map(|_| rng.uniform()).collect();
        let (ids, groups) = route(&logits, experts, n, k);
        let x: Vec<f32> = (0..n * hidden).map(|_| rng.uniform()).collect();
        let xd = DeviceBuffer::from_slice(&x).unwrap();
        let act: Vec<f32> = (0..n * k * down_cols).map(|_| rng.uniform()).collect();
        let ad = DeviceBuffer::from_slice(&act).unwrap();
        let dot = |m: &[f32], cols: usize, e: usize, rows: usize, r: usize, v: &[f32]| -> f64 {
            let wr = &m[(e * rows + r) * cols..][..cols];
            v.iter().zip(wr).map(|(&p, &q)| p as f64 * q as f64).sum()
        };

        let run = |cut: c_int, rows_in: usize, groups: &DeviceBuffer| -> (Vec<f32>, Vec<f32>) {
            let glu_work = workspace(width, hidden, true, experts, rows_in, k);
            let down_work = workspace(300, down_cols, false, experts, rows_in, k);
            let (glu_out, down_out) = (
                DeviceBuffer::new(rows_in * k * width * 4).unwrap(),
                DeviceBuffer::new(rows_in * k * 300 * 4).unwrap(),
            );
            glu_out.fill_bytes(0xFF).unwrap();
            down_out.fill_bytes(0xFF).unwrap();
            let shape = (experts, rows_in, k);
            let (gate, down) = ((width, hidden), (300, down_cols));
            ok(launch(cut, &gd, Some(&ud), dtype, gate, &xd, k, groups, shape, &glu_out, &glu_work), what);
            ok(launch(cut, &dd, None, dtype, down, &ad, 1, groups, shape, &down_out, &down_work), what);
            let (mut g, mut d) = (vec![0f32; rows_in * k * width], vec![0f32; rows_in * k * 300]);
            glu_out.download(&mut g).unwrap();
            down_out.download(&mut d).unwrap();
            (g, d)
        };
        let want_glu: Vec<f32> = (0..n * k * width)
            .map(|i| {
                let (s, r) = (i / width, i % width);
                let xs = &x[(s / k) * hidden..][..hidden];
                let e = ids[s] as usize;
                (silu(dot(&gv, hidden, e, width, r, xs)) * dot(&uv, hidden, e, width, r, xs)) as f32
            })
            .collect();
        let want_down: Vec<f32> = (0..n * k * 300)
            .map(|i| {
                let (s, r) = (i / 300, i % 300);
                dot(&dv, down_cols, ids[s] as usize, 300, r, &act[s * down_cols..][..down_cols]) as f32
            })
            .collect();
        // Each cut of the columns (the gate and up's in two ranges or one) against the host, each with its
        // own bits the same for the first 5 rows routed alone.
        let few = 5;
        let (_, few_groups) = route(&logits, experts, few, k);
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        for cut in [kn::MOE_CUT_FILL, kn::MOE_CUT_WAVES, kn::MOE_CUT_ONE] {
            let (glu, down) = run(cut, n, &groups);
            let (eg, ed) = (rel_l2(&glu, &want_glu), rel_l2(&down, &want_down));
            println!("{what}, cut {cut}: SwiGLU relative L2 {eg:.2e}, down {ed:.2e}");
            assert!(eg < 1e-4 && ed < 1e-4, "{what}, cut {cut}: relative L2 {eg:.3e} (SwiGLU), {ed:.3e} (down)");

            let (g, d) = run(cut, few, &few_groups);
            assert!(
                same(&g, &glu[..g.len()]),
                "{what}, cut {cut}: {few} rows' SwiGLU alone differs from theirs in a batch of {n}"
            );
            assert!(
                same(&d, &down[..d.len()]),
                "{what}, cut {cut}: {few} rows' down alone differs from theirs in a batch of {n}"
            );
        }
    }
}

#[test]
fn decode_row_products_refuse_what_they_do_not_take() {
    let test = "decode_row_products_refuse_what_they_do_not_take";
    if !gpu_present(test) {
        return;
    }
    let (experts, rows, cols, n, k) = (4usize, 64usize, 256usize, 4usize, 2usize);
    let w = DeviceBuffer::new(experts * DType::Q8_0.row_bytes(cols).unwrap() * rows).unwrap();
    let x = DeviceBuffer::new(n * cols * 4).unwrap();
    let y = DeviceBuffer::new(n * k * rows * 4).unwrap();
    let (_, groups) = route(&vec![0.5f32; n * experts], experts, n, k);
    let work = workspace(rows, cols, false, experts, n, k);
    let (shape, cut) = ((experts, n, k), launch_tuning().moe_mmv_cut);
    // SAFETY: host-side checks on a format id, an address, a stride and a width; nothing is dereferenced.
    let supports = |dtype: DType, cols: usize| unsafe {
        kn::hostembed_moe_mmv_supports(dtype as c_int, w.ptr(), dtype.row_bytes(cols).unwrap_or(0) * rows, cols as u32)
    };
    assert_eq!(supports(DType::Q8_0, cols), 0, "Q8_0 256 columns");
    assert_ne!(supports(DType::Bf16, cols), 0, "BF16 has no integer reader");
    assert_ne!(supports(DType::Q4_K, 32), 0, "32 columns of Q4_K are no whole super-block");
    assert_ne!(launch(cut, &w, None, DType::Bf16, (rows, cols), &x, 1, &groups, shape, &y, &work), 0, "BF16 was taken");
    assert_ne!(
        launch(cut, &w, None, DType::Q8_0, (rows, cols), &x, 0, &groups, shape, &y, &work),
        0,
        "x_div 0 was taken"
    );
    assert_ne!(
        launch(cut, &w, None, DType::Q8_0, (rows, cols), &x, 1, &groups, (1, n, k), &y, &work),
        0,
        "k > experts"
    );
    ok(launch(cut, &w, None, DType::Q8_0, (rows, cols), &x, 1, &groups, (experts, 0, k), &y, &work), "no rows");
}
