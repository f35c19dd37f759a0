//! The batched mmv kernels against the CPU, batch invariance, the workspace, refusals (the other kernels of
//! the same product against these in `mmv_kernels`).

use super::{
    NULL_STREAM, SwigluCase, assert_close, cols_for, download, dtypes, encode, launch_tuning, ok, poisoned, swiglu_case,
};
use crate::common::{Rng, gpu_present};
use hostembed::cuda::DeviceBuffer;
use hostembed::model::TensorRef;
use hostembed::tensor::DType;
use hostembed::{cpu, cuda, kernels as kn};
use std::os::raw::{c_int, c_uint, c_void};
use std::ptr;

/// The formats the tensor-core decode product reads (the others stay on the matrix-vector kernel).
pub(crate) fn mmv_dtypes() -> Vec<DType> {
    // SAFETY: a host-side check on a format id, an address and a width; nothing is read.
    dtypes().filter(|&d| unsafe { kn::hostembed_mmv_supports(d as c_int, 256 as *const c_void, 256) } == 0).collect()
}

/// hostembed_mmv's workspace for the largest of `shapes` (rows, cols, glu) over `n` tokens, counters zeroed.
pub(crate) fn mmv_work(shapes: &[(usize, usize, bool)], n: usize) -> (DeviceBuffer, DeviceBuffer) {
    let (mut floats, mut counters) = (1usize, 1usize);
    for &(rows, cols, glu) in shapes {
        let (mut f, mut c) = (0usize, 0 as c_uint);
        ok(
            // SAFETY: host arithmetic into two writable locals; nothing on the device.
            unsafe {
                kn::hostembed_mmv_workspace(rows as c_uint, cols as c_uint, glu as c_int, n as c_uint, &mut f, &mut c)
            },
            "hostembed_mmv_workspace",
        );
        floats = floats.max(f);
        counters = counters.max(c as usize);
    }
    let partial = poisoned(floats * 4);
    let count = DeviceBuffer::from_slice(&vec![0u32; counters]).unwrap();
    (partial, count)
}

/// y = W x (+ bias) (+ residual) on the tensor-core decode product, downloaded (rows of `ldy`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_mmv(
    w: *const c_void,
    dtype: DType,
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    bias: Option<&DeviceBuffer>,
    residual: Option<&[f32]>,
    ldy: usize,
) -> Vec<f32> {
    run_mmv_tuned(w, dtype, rows, cols, x, n, bias, residual, ldy, launch_tuning())
}

/// `run_mmv` with the launchers' settings `tuning`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_mmv_tuned(
    w: *const c_void,
    dtype: DType,
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    bias: Option<&DeviceBuffer>,
    residual: Option<&[f32]>,
    ldy: usize,
    tuning: kn::hostembed_tuning,
) -> Vec<f32> {
    let xd = DeviceBuffer::from_slice(x).unwrap();
    let yb = match residual {
        Some(r) => DeviceBuffer::from_slice(r).unwrap(),
        None => poisoned(n * ldy * 4),
    };
    let (partial, counters) = mmv_work(&[(rows, cols, false)], n);
    ok(
        // SAFETY: device buffers sized for the case and a workspace from hostembed_mmv_workspace for it, alive until
        // the synchronous check after the launch.
        unsafe {
            kn::hostembed_mmv(
                w,
                dtype as c_int,
                rows as c_uint,
                cols as c_uint,
                xd.ptr() as *const f32,
                n as c_uint,
                bias.map_or(ptr::null(), |b| b.ptr() as *const f32),
                if residual.is_some() { yb.ptr() as *const f32 } else { ptr::null() },
                yb.ptr() as *mut f32,
                ldy as c_uint,
                partial.ptr() as *mut f32,
                counters.ptr() as *mut c_uint,
                tuning,
                NULL_STREAM,
            )
        },
        "hostembed_mmv",
    );
    assert_counters_reset(&counters, "hostembed_mmv");
    download::<f32>(&yb, n * ldy)
}

/// A split product's last block resets its arrival counter for the next launch: all must read zero.
pub(crate) fn assert_counters_reset(counters: &DeviceBuffer, launcher: &str) {
    let mut left = vec![0u32; counters.bytes() / 4];
    counters.download(&mut left).unwrap();
    assert!(left.iter().all(|&c| c == 0), "{launcher} left its arrival counters non-zero: {left:?}");
}

/// The CPU's y[t] = W x[t] (+ bias) (+ residual[t], rows of `ldy`) for `n` tokens, rows packed.
pub(crate) fn cpu_product(
    w: &TensorRef,
    x: &[f32],
    n: usize,
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
    ldy: usize,
) -> Vec<f32> {
    let (rows, cols) = (w.shape[0], w.shape[1]);
    let mut want = vec![0f32; n * rows];
    for t in 0..n {
        cpu::matvec(w, &x[t * cols..(t + 1) * cols], &mut want[t * rows..(t + 1) * rows]);
        for r in 0..rows {
            want[t * rows + r] += bias.map_or(0.0, |b| b[r]) + residual.map_or(0.0, |res| res[t * ldy + r]);
        }
    }
    want
}

/// The tensor-core decode product's bound: each activation enters as a bf16 pair (about 16 bits), so the
/// products keep f32-activation accuracy (~1e-6 here); bf16 activations alone would give ~2e-3, and one
/// misread quant ~1e-2.
pub(crate) const MMV_TOL: f64 = 1e-4;

#[test]
fn mmv_matches_cpu_for_every_format_it_takes() {
    if !gpu_present("mmv_matches_cpu_for_every_format_it_takes") {
        return;
    }
    let mut rng = Rng::fresh("mmv_matches_cpu_for_every_format_it_takes");
    let formats = mmv_dtypes();
    assert!(formats.contains(&DType::Bf16) && formats.contains(&DType::Q4_K), "formats: {formats:?}");
    // (rows, cols, n, bias, residual, ldy pad)
    let cases = [
        (4096, 4096, 1, false, false, 0), // column ranges split 8 ways, batch 1
        (200, 2048, 5, true, false, 0),   // two row blocks, one a stub; many ranges
        (128, 256, 16, false, true, 3),   // one chunk, one range, a full m-tile, ldy past rows
        (1000, 1536, 17, true, true, 0),  // two m-tiles, the second with one token
        (333, 768, 33, false, false, 0),  // three m-tiles
        (96, 512, 64, false, true, 0),    // four m-tiles
        (130, 1024, 70, true, false, 0),  // two launches: 64 tokens, then 6
        (40000, 512, 2, false, false, 0), // more row blocks than a split product has: one range
    ];
    for &dtype in &formats {
        for &(rows, cols, n, with_bias, with_residual, pad) in &cases {
            let cols = cols_for(dtype, cols);
            let ldy = rows + pad;
            let bytes = encode(dtype, cols, &rng.vec(rows * cols, 1.0));
            let x = rng.vec(n * cols, 1.0);
            let bias = rng.vec(rows, 0.5);
            let res = rng.vec(n * ldy, 1.0);
            let w = TensorRef { dtype, shape: &[rows, cols], bytes: &bytes };
            let want = cpu_product(&w, &x, n, with_bias.then_some(&bias[..]), with_residual.then_some(&res[..]), ldy);
            let wd = DeviceBuffer::from_slice(&bytes).unwrap();
            let bd = DeviceBuffer::from_slice(&bias).unwrap();
            let all = run_mmv(
                wd.ptr(),
                dtype,
                rows,
                cols,
                &x,
                n,
                with_bias.then_some(&bd),
                with_residual.then_some(&res[..]),
                ldy,
            );
            let got: Vec<f32> = (0..n).flat_map(|t| all[t * ldy..t * ldy + rows].to_vec()).collect();
            let what =
                format!("mmv {} {rows}x{cols} n={n} bias {with_bias} residual {with_residual} ldy {ldy}", dtype.name());
            assert_close(&what, &got, &want, MMV_TOL);
            for t in 0..n {
                for r in rows..ldy {
                    let before = if with_residual { res[t * ldy + r] } else { f32::NAN };
                    assert!(
                        all[t * ldy + r].to_bits() == before.to_bits(),
                        "{what}: wrote y[{t}][{r}] outside its rows"
                    );
                }
            }
        }
    }
}

/// Each token's activations at their own magnitude, from 1e-7 to 3e5 (past f16's range: the F16 product
/// scales each 256 columns), and one token whose 256-column groups span ten orders: every token within
/// the bound of its own outputs.
#[test]
fn mmv_takes_activations_of_any_magnitude() {
    if !gpu_present("mmv_takes_activations_of_any_magnitude") {
        return;
    }
    let mut rng = Rng::fresh("mmv_takes_activations_of_any_magnitude");
    let (rows, n) = (300, 5);
    for dtype in mmv_dtypes() {
        let cols = cols_for(dtype, 2048);
        let bytes = encode(dtype, cols, &rng.vec(rows * cols, 1.0));
        let w = TensorRef { dtype, shape: &[rows, cols], bytes: &bytes };
        let mut x = rng.vec(n * cols, 1.0);
        for (t, scale) in [1e-7f32, 1.0, 3e5, 7e4].into_iter().enumerate() {
            x[t * cols..(t + 1) * cols].iter_mut().for_each(|v| *v *= scale);
        }
        for (c, v) in x[4 * cols..].iter_mut().enumerate() {
            *v *= 10f32.powi((c / 256 % 11) as i32 - 5);
        }
        let wd = DeviceBuffer::from_slice(&bytes).unwrap();
        let all = run_mmv(wd.ptr(), dtype, rows, cols, &x, n, None, None, rows);
        for t in 0..n {
            let mut want = vec![0f32; rows];
            cpu::matvec(&w, &x[t * cols..(t + 1) * cols], &mut want);
            let what = format!("mmv {} {rows}x{cols} token {t} of {n}", dtype.name());
            assert_close(&what, &all[t * rows..(t + 1) * rows], &want, MMV_TOL);
        }
    }
}

#[test]
fn mmv_swiglu_matches_cpu() {
    if !gpu_present("mmv_swiglu_matches_cpu") {
        return;
    }
    let mut rng = Rng::fresh("mmv_swiglu_matches_cpu");
    for dtype in mmv_dtypes() {
        for (rows, cols, n) in [(14336, 512, 1), (300, 4096, 3), (64, 256, 20), (1000, 1024, 64)] {
            let SwigluCase { cols, gd, ud, xd, want } = swiglu_case(&mut rng, dtype, rows, cols, n);
            let y = poisoned(n * rows * 4);
            let (partial, counters) = mmv_work(&[(rows, cols, true)], n);
            ok(
                // SAFETY: device buffers sized for the case and a workspace from hostembed_mmv_workspace for it, alive
                // until the synchronous check after the launch.
                unsafe {
                    kn::hostembed_mmv_swiglu(
                        gd.ptr(),
                        ud.ptr(),
                        dtype as c_int,
                        rows as c_uint,
                        cols as c_uint,
                        xd.ptr() as *const f32,
                        n as c_uint,
                        y.ptr() as *mut f32,
                        partial.ptr() as *mut f32,
                        counters.ptr() as *mut c_uint,
                        launch_tuning(),
                        NULL_STREAM,
                    )
                },
                "hostembed_mmv_swiglu",
            );
            let got = download::<f32>(&y, n * rows);
            assert_close(&format!("mmv_swiglu {} {rows}x{cols} n={n}", dtype.name()), &got, &want, MMV_TOL);
        }
    }
}

/// A token's outputs are the same bits alone, in any batch, at any place in it, whatever its neighbours
/// hold (huge values included).
#[test]
fn mmv_is_batch_invariant() {
    if !gpu_present("mmv_is_batch_invariant") {
        return;
    }
    let mut rng = Rng::fresh("mmv_is_batch_invariant");
    for dtype in mmv_dtypes() {
        for (rows, cols) in [(4096, 4096), (1000, 14336), (14336, 1024)] {
            let cols = cols_for(dtype, cols);
            let bytes = encode(dtype, cols, &rng.vec(rows * cols, 1.0));
            let wd = DeviceBuffer::from_slice(&bytes).unwrap();
            let probe = rng.vec(cols, 1.0);
            let alone = run_mmv(wd.ptr(), dtype, rows, cols, &probe, 1, None, None, rows);
            for (n, at, scale) in
                [(2, 1, 1.0), (16, 7, 1e4), (17, 16, 1.0), (64, 0, 1e-3), (64, 63, 1e6), (70, 66, 1.0)]
            {
                let mut x = rng.vec(n * cols, scale);
                x[at * cols..(at + 1) * cols].copy_from_slice(&probe);
                let all = run_mmv(wd.ptr(), dtype, rows, cols, &x, n, None, None, rows);
                let got = &all[at * rows..(at + 1) * rows];
                let differ = got.iter().zip(&alone).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                assert_eq!(
                    differ,
                    0,
                    "mmv {} {rows}x{cols}: token {at} of {n} differs from alone in {differ} rows",
                    dtype.name()
                );
            }
        }
    }
}

/// The Rust mirror of the product's cut (the scratch sizes the fit predicts) answers as the kernels do.
/// Host arithmetic only: runs wherever the kernels were built, GPU or not.
#[test]
fn mmv_workspace_matches_the_kernels() {
    let mut f = 0usize;
    let mut c: c_uint = 0;
    // SAFETY: host arithmetic into two writable locals; nothing on the device.
    if unsafe { kn::hostembed_mmv_workspace(1, 1, 0, 1, &mut f, &mut c) } != 0 {
        println!("SKIP mmv_workspace_matches_the_kernels: built without the kernels");
        return;
    }
    let mut checked = 0;
    for rows in [1, 8, 64, 65, 127, 128, 129, 1000, 4096, 6144, 14336, 32768, 128256] {
        for cols in [32, 256, 257, 1000, 2048, 4096, 5120, 14336] {
            for glu in [false, true] {
                for n in [1, 16, 64, 100] {
                    // SAFETY: host arithmetic into two writable locals; nothing on the device.
                    let code = unsafe { kn::hostembed_mmv_workspace(rows, cols, glu as c_int, n, &mut f, &mut c) };
                    assert_eq!(code, 0, "hostembed_mmv_workspace({rows}, {cols}, {glu}, {n})");
                    let want = hostembed::gpu::mmv_workspace(rows as usize, cols as usize, glu, n as usize);
                    assert_eq!((f, c as usize), want, "rows {rows} cols {cols} glu {glu} n {n}");
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 0);
}

#[test]
fn mmv_refuses_bad_arguments() {
    if !gpu_present("mmv_refuses_bad_arguments") {
        return;
    }
    let (rows, cols) = (256usize, 4096usize);
    let w = DeviceBuffer::new(rows * cols * 2).unwrap();
    let x = DeviceBuffer::new(cols * 4 + 16).unwrap();
    let y = DeviceBuffer::new(rows * 4).unwrap();
    let (partial, counters) = mmv_work(&[(rows, cols, false)], 1);
    // SAFETY: live device buffers sized for a product of `rows` x `cols` over one token; each case breaks one argument,
    // which the launcher refuses before launching (the device is synchronized below).
    let call = |w: *const c_void, dtype: DType, cols: usize, x: *const f32, partial: *mut f32| unsafe {
        kn::hostembed_mmv(
            w,
            dtype as c_int,
            rows as c_uint,
            cols as c_uint,
            x,
            1,
            ptr::null(),
            ptr::null(),
            y.ptr() as *mut f32,
            rows as c_uint,
            partial,
            counters.ptr() as *mut c_uint,
            launch_tuning(),
            NULL_STREAM,
        )
    };
    let (xp, pp) = (x.ptr() as *const f32, partial.ptr() as *mut f32);
    let invalid = 1; // cudaErrorInvalidValue
    let unsupported = 801; // cudaErrorNotSupported
    assert_eq!(call(ptr::null(), DType::Bf16, cols, xp, pp), invalid, "NULL weights");
    assert_eq!(call(w.ptr(), DType::Bf16, cols, ptr::null(), pp), invalid, "NULL activations");
    assert_eq!(call(w.ptr(), DType::Bf16, cols, xp.wrapping_add(1), pp), invalid, "misaligned activations");
    assert_eq!(call(w.ptr(), DType::Bf16, cols, xp, ptr::null_mut()), invalid, "a split product without workspace");
    assert_eq!(call(w.ptr(), DType::F32, cols, xp, pp), unsupported, "a format without a lane reader");
    assert_eq!(call(w.ptr(), DType::Bf16, 40, xp, pp), unsupported, "columns not whole 32-column steps");
    assert_eq!(call((w.ptr() as *const u8).wrapping_add(2) as *const c_void, DType::Bf16, cols, xp, pp), unsupported);
    cuda::synchronize().unwrap();
}
