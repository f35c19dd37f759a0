//! The matvec kernels (plain and with SwiGLU) against the CPU in every format, and their refusals.

use super::{
    NULL_STREAM, SwigluCase, assert_close, assert_written, cols_for, download, dtypes, encode, ok, poisoned,
    swiglu_case, upload_at, weight_tol,
};
use crate::common::{Rng, gpu_present};
use hostembed::cuda::DeviceBuffer;
use hostembed::model::TensorRef;
use hostembed::tensor::DType;
use hostembed::{cpu, kernels as kn};
use std::os::raw::{c_int, c_uint, c_void};
use std::ptr;

/// One matvec case: W is rows x cols; `w_offset`/`x_offset` misalign the pointers by that many bytes.
struct MatvecCase {
    rows: usize,
    cols: usize,
    n: usize,
    w_offset: usize,
    x_offset: usize,
    bias: bool,
    residual: bool,
    ldy_pad: usize,
}

fn run_matvec(rng: &mut Rng, dtype: DType, c: &MatvecCase) {
    let (rows, cols, n) = (c.rows, cols_for(dtype, c.cols), c.n);
    let ldy = rows + c.ldy_pad;
    let values = rng.vec(rows * cols, 1.0);
    let bytes = encode(dtype, cols, &values);
    let w = TensorRef { dtype, shape: &[rows, cols], bytes: &bytes };
    let x = rng.vec(n * cols, 1.0);
    let bias = rng.vec(rows, 0.5);
    let res = rng.vec(n * ldy, 1.0);

    let mut want = vec![0f32; n * rows];
    for t in 0..n {
        cpu::matvec(&w, &x[t * cols..(t + 1) * cols], &mut want[t * rows..(t + 1) * rows]);
        for r in 0..rows {
            if c.bias {
                want[t * rows + r] += bias[r];
            }
            if c.residual {
                want[t * rows + r] += res[t * ldy + r];
            }
        }
    }

    let (_wb, wp) = upload_at(&bytes, c.w_offset);
    let (_xb, xp) = upload_at(&x, c.x_offset);
    let bb = DeviceBuffer::from_slice(&bias).unwrap();
    // With a residual, y starts as the residual and is updated in place; otherwise it starts poisoned.
    let yb = if c.residual { DeviceBuffer::from_slice(&res).unwrap() } else { poisoned(n * ldy * 4) };
    ok(
        // SAFETY: device buffers sized for the case (weights rows x cols in their format, `n` inputs, `n` rows of `ldy`
        // out), alive until the synchronous check after the launch.
        unsafe {
            kn::hostembed_matvec(
                wp,
                dtype as c_int,
                rows as c_uint,
                cols as c_uint,
                xp as *const f32,
                n as c_uint,
                if c.bias { bb.ptr() as *const f32 } else { ptr::null() },
                if c.residual { yb.ptr() as *const f32 } else { ptr::null() },
                yb.ptr() as *mut f32,
                ldy as c_uint,
                NULL_STREAM,
            )
        },
        "hostembed_matvec",
    );
    let all = download::<f32>(&yb, n * ldy);
    let got: Vec<f32> = (0..n).flat_map(|t| all[t * ldy..t * ldy + rows].to_vec()).collect();
    let what = format!(
        "matvec {} {rows}x{cols} n={n} offsets w+{} x+{} bias {} residual {} ldy {ldy}",
        dtype.name(),
        c.w_offset,
        c.x_offset,
        c.bias,
        c.residual
    );
    if dtype == DType::F32 {
        assert_written(&what, &got);
        // F32 differs from the CPU by accumulation order alone, an error relative to the sums of |w x|: a
        // few outputs that happen to sum near zero (2 rows of 106,496 columns) would fail a bound relative
        // to the outputs themselves. One misread value moves its output by about |w x|: past 1e-6 here.
        let mut magnitude = vec![0f32; n * rows];
        for t in 0..n {
            for r in 0..rows {
                let (wr, xt) = (&values[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                magnitude[t * rows + r] = wr.iter().zip(xt).map(|(a, b)| (a * b).abs()).sum::<f32>()
                    + if c.bias { bias[r].abs() } else { 0.0 }
                    + if c.residual { res[t * ldy + r].abs() } else { 0.0 };
            }
        }
        let err = got.iter().zip(&want).map(|(g, w)| (*g as f64 - *w as f64).powi(2)).sum::<f64>().sqrt()
            / magnitude.iter().map(|m| (*m as f64).powi(2)).sum::<f64>().sqrt();
        println!("{what}: L2 error relative to the sums of |w x| {err:.2e} (bound 1e-6)");
        assert!(err < 1e-6, "{what}: L2 error relative to the sums of |w x| {err:.3e} >= 1e-6");
    } else {
        assert_close(&what, &got, &want, weight_tol(dtype));
    }
    // The columns between rows and ldy are not the kernel's to write.
    for t in 0..n {
        for r in rows..ldy {
            let (g, before) = (all[t * ldy + r], if c.residual { res[t * ldy + r] } else { f32::NAN });
            assert!(g.to_bits() == before.to_bits(), "{what}: wrote y[{t}][{r}] outside its rows");
        }
    }
}

#[test]
fn matvec_matches_cpu_for_every_format() {
    if !gpu_present("matvec_matches_cpu_for_every_format") {
        return;
    }
    let mut rng = Rng::fresh("matvec_matches_cpu_for_every_format");
    let case = |rows, cols, n| MatvecCase {
        rows,
        cols,
        n,
        w_offset: 0,
        x_offset: 0,
        bias: false,
        residual: false,
        ldy_pad: 0,
    };
    for dtype in dtypes() {
        // A 2-byte offset keeps Q8_0 / Q4_0 / Q5_0 / Q3_K / Q6_K rows on the staged path (their blocks are
        // 2-byte aligned anyway) and sends the 4-byte aligned block formats and the floats to the slow one.
        let elem = match dtype {
            DType::F32 => 4,
            _ => 2,
        };
        let cases = [
            case(37, 4096, 1),                                              // few rows: 8 warps a row
            case(3000, 1000, 3), // 2 warps a row, a tail of chunks, 3 tokens in a tile of 4
            case(7000, 256, 8),  // one warp a row, a full tile of 8 tokens
            case(64, 2048, 11),  // two tiles: 8 tokens, then 3
            case(50, 1001, 2),   // cols not a multiple of the vector width (Q8_0: 33 blocks, odd)
            MatvecCase { w_offset: elem, x_offset: 4, ..case(45, 512, 2) }, // misaligned pointers
            MatvecCase { bias: true, residual: true, ldy_pad: 5, ..case(300, 768, 3) },
            MatvecCase { bias: true, ..case(20, 64, 1) },
            case(6144, 512, 1),                            // one warp a row, batch 1
            case(700, 14336, 2),                           // a few warps a row, rows of several stretches
            MatvecCase { w_offset: 1, ..case(9, 512, 1) }, // an odd address: the one-value path
            case(5, 32768 + 256, 1), // past the batch-1 sums table: offsets formats take the 2-token kernel
            case(2, 104 * 1024, 1),  // 8 warps a row, several stretches each: both buffers refilled
        ];
        for c in &cases {
            run_matvec(&mut rng, dtype, c);
        }
    }
}

#[test]
fn matvec_swiglu_matches_cpu() {
    if !gpu_present("matvec_swiglu_matches_cpu") {
        return;
    }
    let mut rng = Rng::fresh("matvec_swiglu_matches_cpu");
    for dtype in dtypes() {
        for (rows, cols, n) in [(300, 512, 1), (5000, 256, 5), (40, 1001, 2), (1000, 4096, 8)] {
            let SwigluCase { cols, gd, ud, xd, want } = swiglu_case(&mut rng, dtype, rows, cols, n);
            let y = poisoned(n * rows * 4);
            ok(
                // SAFETY: device buffers sized for the case (gate and up rows x cols, `n` inputs, `n` rows out), alive
                // until the synchronous check after the launch.
                unsafe {
                    kn::hostembed_matvec_swiglu(
                        gd.ptr(),
                        ud.ptr(),
                        dtype as c_int,
                        rows as c_uint,
                        cols as c_uint,
                        xd.ptr() as *const f32,
                        n as c_uint,
                        y.ptr() as *mut f32,
                        NULL_STREAM,
                    )
                },
                "hostembed_matvec_swiglu",
            );
            let got = download::<f32>(&y, n * rows);
            assert_close(
                &format!("matvec_swiglu {} {rows}x{cols} n={n}", dtype.name()),
                &got,
                &want,
                weight_tol(dtype),
            );
        }
    }
}

#[test]
fn matvec_refuses_bad_arguments() {
    if !gpu_present("matvec_refuses_bad_arguments") {
        return;
    }
    let b = poisoned(4096);
    let p = b.ptr();
    // SAFETY: every pointer is one live 4 KiB device buffer; each case breaks one argument, which the launcher refuses
    // before launching.
    let call = |w: *const c_void, dtype: c_int, rows: c_uint, cols: c_uint, ldy: c_uint| unsafe {
        kn::hostembed_matvec(
            w,
            dtype,
            rows,
            cols,
            p as *const f32,
            1,
            ptr::null(),
            ptr::null(),
            p as *mut f32,
            ldy,
            NULL_STREAM,
        )
    };
    let invalid = 1; // cudaErrorInvalidValue
    assert_eq!(call(ptr::null(), DType::F32 as c_int, 4, 4, 4), invalid, "NULL weights");
    assert_eq!(call(p, 9, 4, 4, 4), invalid, "unknown format");
    assert_eq!(call(p, DType::Q8_0 as c_int, 4, 33, 4), invalid, "Q8_0 rows of partial blocks");
    assert_eq!(call(p, DType::Q4_K as c_int, 4, 128, 4), invalid, "Q4_K rows of partial super-blocks");
    assert_eq!(call(p, 13, 4, 4, 4), invalid, "no format has id 13");
    assert_eq!(call(p, DType::F32 as c_int, 4, 4, 3), invalid, "ldy below rows");
    assert_eq!(call(p, DType::F32 as c_int, 0, 4, 4), invalid, "no rows");
}
