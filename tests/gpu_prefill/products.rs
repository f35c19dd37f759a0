//! The tensor-core product, the weight conversion and the half-format writers against the CPU.

use super::{HALVES, NULL_STREAM, download, finite, halves_to_f32, launch_tuning, ok, poisoned, to_half};
use crate::common::{Rng, gpu_present, rel_l2};
use hostembed::cuda::DeviceBuffer;
use hostembed::tensor::{DType, FORMATS, decode_row, encode_row};
use hostembed::{cpu, kernels as kn};
use std::os::raw::{c_int, c_uint, c_void};
use std::ptr;

#[test]
fn tensor_core_product_matches_cpu() {
    if !gpu_present("tensor_core_product_matches_cpu") {
        return;
    }
    let mut rng = Rng::fresh("tensor_core_product_matches_cpu");
    // (weight rows, cols, tokens, bias, residual in place, ldy padding): tiles, tails in every dimension.
    let cases = [
        (128, 64, 128, false, false, 0),
        (300, 72, 17, true, false, 3),
        (1000, 512, 200, false, true, 0),
        (4096, 4096, 256, true, true, 0),
        (7, 8, 1, false, false, 1),
        (129, 264, 129, true, false, 0),
    ];
    for dtype in HALVES {
        for &(rows, cols, n, bias, in_place, pad) in &cases {
            let ldy = rows + pad;
            let (w_bits, w) = to_half(dtype, &rng.vec(rows * cols, 1.0));
            let (a_bits, a) = to_half(dtype, &rng.vec(n * cols, 1.0));
            let b = rng.vec(rows, 1.0);
            let res = rng.vec(n * ldy, 1.0);
            let mut want = vec![0f32; n * ldy];
            for t in 0..n {
                for r in 0..ldy {
                    let at = t * ldy + r;
                    if r >= rows {
                        want[at] = if in_place { res[at] } else { f32::NAN };
                        continue;
                    }
                    let dot: f64 = (0..cols).map(|c| w[r * cols + c] as f64 * a[t * cols + c] as f64).sum();
                    let extra = if bias { b[r] as f64 } else { 0.0 } + if in_place { res[at] as f64 } else { 0.0 };
                    want[at] = (dot + extra) as f32;
                }
            }
            let wb = DeviceBuffer::from_slice(&w_bits).unwrap();
            let ab = DeviceBuffer::from_slice(&a_bits).unwrap();
            let bb = DeviceBuffer::from_slice(&b).unwrap();
            let y = if in_place { DeviceBuffer::from_slice(&res).unwrap() } else { poisoned(n * ldy * 4) };
            let yp = y.ptr() as *mut f32;
            ok(
                // SAFETY: device buffers sized for these shapes (`ab` n x cols, `wb` rows x cols in `dtype`, `bb` rows,
                // `y` n rows of ldy), alive until the synchronous check after the launch.
                unsafe {
                    kn::hostembed_gemm(
                        ab.ptr(),
                        cols as c_uint,
                        wb.ptr(),
                        dtype as c_int,
                        rows as c_uint,
                        cols as c_uint,
                        n as c_uint,
                        if bias { bb.ptr() as *const f32 } else { ptr::null() },
                        if in_place { yp } else { ptr::null() },
                        yp,
                        ldy as c_uint,
                        NULL_STREAM,
                    )
                },
                "hostembed_gemm",
            );
            let got: Vec<f32> = download(&y, n * ldy);
            let what = format!("gemm {} {rows}x{cols} n {n} bias {bias} residual {in_place} ldy {ldy}", dtype.name());
            let (g, wv): (Vec<f32>, Vec<f32>) =
                got.iter().zip(&want).enumerate().filter(|(i, _)| i % ldy < rows).map(|(_, (g, w))| (*g, *w)).unzip();
            finite(&what, &g);
            // Padding columns are left as they were: poison (NaN) or the residual.
            for t in 0..n {
                for r in rows..ldy {
                    let (gv, wv) = (got[t * ldy + r], want[t * ldy + r]);
                    assert!(gv.to_bits() == wv.to_bits() || (gv.is_nan() && wv.is_nan()), "{what}: padding written");
                }
            }
            let err = rel_l2(&g, &wv);
            println!("{what}: relative L2 {err:.2e}");
            assert!(err < 2e-5, "{what}: relative L2 {err:.3e}");
        }
    }
}

/// Byte offsets of the weights from a 256-byte boundary: each format's fast path where its alignment
/// allows it (2 bytes for Q8_0, Q4_0, Q5_0, Q3_K, Q6_K; 4, 8 or 16 for the others), the by-value path
/// below it.
const WEIGHT_OFFSETS: [usize; 4] = [0, 2, 4, 8];

#[test]
fn weight_conversion_is_exact() {
    if !gpu_present("weight_conversion_is_exact") {
        return;
    }
    let mut rng = Rng::fresh("weight_conversion_is_exact");
    for src in FORMATS.iter().map(|f| f.dtype) {
        let bv = src.format().block_values;
        // (rows, cols): one block; rows of whole blocks over several of the kernel's 8192-value tiles
        // with a partial last one; one odd row; and for the float formats totals that are not whole
        // 8-value pieces (the tail values).
        let shapes = if bv == 1 {
            vec![(37, 96), (300, 104), (1, 8), (5, 7), (3, 10), (1, 1)]
        } else if bv == 32 {
            vec![(1, 32), (37, 96), (300, 96), (3, 4128)]
        } else {
            vec![(1, 256), (37, 512), (300, 256), (3, 2304)]
        };
        for out in HALVES {
            for &(rows, cols) in &shapes {
                let mut values = rng.vec(rows * cols, 3.0);
                let specials = [0.0, -0.0, 1e-7, 250.0, -1e-3];
                for (v, s) in values.iter_mut().zip(specials) {
                    *v = s;
                }
                if bv == 1 && values.len() > 8 {
                    values[6] = 1e5; // past f16's range: inf in F16, as the CPU rounds it
                    values[7] = -7e4;
                }
                let bytes: Vec<u8> = values.chunks(cols).flat_map(|r| encode_row(src, r)).collect();
                let row_bytes = src.row_bytes(cols).unwrap();
                assert_eq!(bytes.len(), rows * row_bytes);
                let mut want = Vec::new();
                for r in 0..rows {
                    let mut row = vec![0f32; cols];
                    decode_row(src, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut row);
                    want.extend(to_half(out, &row).0);
                }
                for &w_off in &WEIGHT_OFFSETS {
                    // The output at a 256-byte boundary (the pieces' 16-byte stores) and 2 bytes past one.
                    for o_off in [0usize, 2] {
                        let what = format!(
                            "{} to {}, {rows} x {cols}, weights at +{w_off}, output at +{o_off}",
                            src.name(),
                            out.name()
                        );
                        let wb = DeviceBuffer::new(bytes.len() + w_off + 16).unwrap();
                        wb.fill_bytes(0xA5).unwrap();
                        wb.upload(&bytes, w_off).unwrap();
                        // Poison around the output too: guard halves before and after must stay 0xFFFF.
                        let guard = 32;
                        let ob = poisoned(o_off + (rows * cols + guard) * 2);
                        let w_ptr = (wb.ptr() as *const u8).wrapping_add(w_off) as *const c_void;
                        let o_ptr = (ob.ptr() as *mut u8).wrapping_add(o_off) as *mut c_void;
                        ok(
                            // SAFETY: w_ptr holds the matrix's bytes, o_ptr room for rows x cols halves.
                            unsafe {
                                kn::hostembed_convert_matrix(
                                    w_ptr,
                                    src as c_int,
                                    rows as c_uint,
                                    cols as c_uint,
                                    o_ptr,
                                    out as c_int,
                                    NULL_STREAM,
                                )
                            },
                            &what,
                        );
                        let raw: Vec<u8> = download(&ob, o_off + (rows * cols + guard) * 2);
                        assert!(raw[..o_off].iter().all(|&b| b == 0xFF), "{what}: wrote before the output");
                        let got: Vec<u16> =
                            raw[o_off..].chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
                        assert!(got[rows * cols..].iter().all(|&g| g == 0xFFFF), "{what}: wrote past the output");
                        if let Some(i) = got[..rows * cols].iter().zip(&want).position(|(g, w)| g != w) {
                            panic!(
                                "{what}: value {i} (row {}, column {}) is {:#06x}, the CPU's {:#06x}",
                                i / cols,
                                i % cols,
                                got[i],
                                want[i]
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn weight_conversion_refuses_bad_arguments() {
    if !gpu_present("weight_conversion_refuses_bad_arguments") {
        return;
    }
    let wb = DeviceBuffer::new(4096).unwrap();
    let ob = poisoned(4096);
    let convert = |w: *const c_void, dtype: DType, rows: usize, cols: usize, o: *mut c_void, out: c_int| {
        // SAFETY: every call below is refused before it reads or writes, or converts at most 4096 bytes.
        unsafe { kn::hostembed_convert_matrix(w, dtype as c_int, rows as c_uint, cols as c_uint, o, out, NULL_STREAM) }
    };
    let bf16 = DType::Bf16 as c_int;
    let odd_out = (ob.ptr() as *mut u8).wrapping_add(1) as *mut c_void;
    // Rows that are not whole blocks, an output format that is not a half format, an unknown format, NULLs
    // and an odd output address: each refused before anything runs.
    for (what, code) in [
        ("Q8_0 rows of 48 values", convert(wb.ptr(), DType::Q8_0, 2, 48, ob.ptr(), bf16)),
        ("Q4_K rows of 128 values", convert(wb.ptr(), DType::Q4_K, 2, 128, ob.ptr(), bf16)),
        ("F32 output", convert(wb.ptr(), DType::Q8_0, 2, 32, ob.ptr(), DType::F32 as c_int)),
        // SAFETY: an unknown format is refused before anything is read.
        ("format 99", unsafe { kn::hostembed_convert_matrix(wb.ptr(), 99, 2, 32, ob.ptr(), bf16, NULL_STREAM) }),
        ("NULL weights", convert(ptr::null(), DType::Q8_0, 2, 32, ob.ptr(), bf16)),
        ("NULL output", convert(wb.ptr(), DType::Q8_0, 2, 32, ptr::null_mut(), bf16)),
        ("odd output", convert(wb.ptr(), DType::Q8_0, 2, 32, odd_out, bf16)),
    ] {
        assert_ne!(code, 0, "{what}: accepted");
    }
    // An empty matrix is done at once.
    assert_eq!(convert(wb.ptr(), DType::Q4_K, 0, 256, ob.ptr(), bf16), 0, "0 rows");
    ok(0, "the refusals left no error behind");
    assert!(download::<u8>(&ob, 4096).iter().all(|&b| b == 0xFF), "a refused conversion wrote");
}

#[test]
fn half_writers_round_once() {
    if !gpu_present("half_writers_round_once") {
        return;
    }
    let mut rng = Rng::fresh("half_writers_round_once");
    for out in HALVES {
        let (n, cols) = (5, 1000);
        let x = rng.vec(n * cols, 3.0);
        let w = rng.vec(cols, 1.0);
        let mut want = vec![0f32; n * cols];
        for (xr, wr) in x.chunks(cols).zip(want.chunks_mut(cols)) {
            cpu::rmsnorm(xr, &w, 1e-5, wr);
        }
        let (xb, wb) = (DeviceBuffer::from_slice(&x).unwrap(), DeviceBuffer::from_slice(&w).unwrap());
        let (ob, rb, alone) = (poisoned(n * cols * 2), poisoned(n * cols * 2), poisoned(n * cols * 2));
        for (o, residue) in [(&ob, rb.ptr()), (&alone, std::ptr::null_mut())] {
            // SAFETY: device buffers of n x cols values (cols for w), a half format for the residue.
            ok(
                unsafe {
                    kn::hostembed_rmsnorm_to(
                        xb.ptr() as *const f32,
                        wb.ptr() as *const f32,
                        1e-5,
                        o.ptr(),
                        residue,
                        out as c_int,
                        n as c_uint,
                        cols as c_uint,
                        launch_tuning(),
                        NULL_STREAM,
                    )
                },
                "hostembed_rmsnorm_to",
            );
        }
        let got = halves_to_f32(out, &download::<u16>(&ob, n * cols));
        assert_eq!(download::<u16>(&alone, n * cols), download::<u16>(&ob, n * cols), "the residue moved the values");
        let bound = if out == DType::Bf16 { 4e-3 } else { 5e-4 };
        finite("rmsnorm_to", &got);
        let err = rel_l2(&got, &want);
        println!("rmsnorm_to {}: relative L2 {err:.2e}", out.name());
        assert!(err < bound, "rmsnorm_to {}: {err:.3e}", out.name());
        // The value plus its residue is the f32 norm to the residue's own rounding (2^-18 at most).
        let residue = halves_to_f32(out, &download::<u16>(&rb, n * cols));
        finite("rmsnorm_to residue", &residue);
        let sum: Vec<f32> = got.iter().zip(&residue).map(|(a, b)| a + b).collect();
        let refined = rel_l2(&sum, &want);
        println!("rmsnorm_to {} with its residue: relative L2 {refined:.2e}", out.name());
        assert!(refined < 2e-5, "rmsnorm_to {} with its residue: {refined:.3e}", out.name());
        // SAFETY: as above; the call is refused before anything runs.
        let refused = unsafe {
            kn::hostembed_rmsnorm_to(
                xb.ptr() as *const f32,
                wb.ptr() as *const f32,
                1e-5,
                ob.ptr(),
                rb.ptr(),
                DType::F32 as c_int,
                n as c_uint,
                cols as c_uint,
                launch_tuning(),
                NULL_STREAM,
            )
        };
        assert_ne!(refused, 0, "an f32 output with a residue was taken");

        let len = 4099;
        let (gate, up) = (rng.vec(len, 3.0), rng.vec(len, 2.0));
        let (gb, ub) = (DeviceBuffer::from_slice(&gate).unwrap(), DeviceBuffer::from_slice(&up).unwrap());
        let glus: [(&str, c_int, fn(&[f32], &[f32], &mut [f32])); 2] =
            [("swiglu", kn::ACT_SILU, cpu::swiglu), ("geglu", kn::ACT_GELU_TANH, cpu::geglu)];
        for (name, act, cpu_glu) in glus {
            let mut want = vec![0f32; len];
            cpu_glu(&gate, &up, &mut want);
            let ob = poisoned(len * 2);
            ok(
                // SAFETY: device buffers of `len` values each (`ob` in the half format), alive until the check after
                // the launch.
                unsafe {
                    kn::hostembed_glu_to(
                        gb.ptr() as *const f32,
                        ub.ptr() as *const f32,
                        ob.ptr(),
                        out as c_int,
                        act,
                        len,
                        NULL_STREAM,
                    )
                },
                "hostembed_glu_to",
            );
            let got = halves_to_f32(out, &download::<u16>(&ob, len));
            finite(name, &got);
            let err = rel_l2(&got, &want);
            println!("{name} to {}: relative L2 {err:.2e}", out.name());
            assert!(err < bound, "{name} to {}: {err:.3e}", out.name());
        }

        let ob = poisoned(len * 2);
        ok(
            // SAFETY: `gb` holds `len` floats and `ob` room for `len` halves, alive until the check after the launch.
            unsafe { kn::hostembed_convert(gb.ptr() as *const f32, ob.ptr(), out as c_int, len, NULL_STREAM) },
            "hostembed_convert",
        );
        let got: Vec<u16> = download(&ob, len);
        assert_eq!(got, to_half(out, &gate).0, "convert {}: not the nearest half", out.name());
    }
}
