//! Every decode kernel against the CPU oracle (src/cpu.rs) and the sampler (src/sampler.rs), on fresh
//! random data, with outputs poisoned (0xFF bytes, a NaN) before each launch and every element checked.
//! Skips (with a SKIP line) where no CUDA device is present.

mod common;

use std::os::raw::{c_int, c_uint, c_void};
use std::ptr;

use common::{PagedKv, Rng, gpu_present};
use hostembed::cpu;
use hostembed::cuda::{self, DeviceBuffer};
use hostembed::gpu::PAGE_TOKENS;
use hostembed::kernels as kn;
use hostembed::kv::KvType;
use hostembed::model::{ModelConfig, RopeScaling, TensorRef};
use hostembed::sampler::{self, Sampling};
use hostembed::tensor::{DType, FORMATS, encode_row};
use hostembed::tuning::Tuning;

/// The launchers' settings as the environment gives them (what an engine would run with).
fn launch_tuning() -> kn::hostembed_tuning {
    kn::hostembed_tuning::of(&Tuning::from_env())
}

const NULL_STREAM: *mut c_void = ptr::null_mut();

/// Fails on a launch error and on any error the kernel raised while running.
fn ok(code: c_int, what: &str) {
    cuda::check(code, what).unwrap_or_else(|e| panic!("{what}: {e}"));
    cuda::synchronize().unwrap_or_else(|e| panic!("{what} while running: {e}"));
}

/// A device buffer of `bytes` with every byte 0xFF (every f32 a NaN).
fn poisoned(bytes: usize) -> DeviceBuffer {
    let b = DeviceBuffer::new(bytes).unwrap();
    b.fill_bytes(0xFF).unwrap();
    b
}

/// `data` uploaded `offset` bytes into a fresh buffer (to test misaligned pointers).
fn upload_at<T: Copy>(data: &[T], offset: usize) -> (DeviceBuffer, *mut c_void) {
    let b = poisoned(std::mem::size_of_val(data) + offset);
    b.upload(data, offset).unwrap();
    // SAFETY: `offset` is within `b`, which has room for `data` after it; only the address is formed.
    let p = unsafe { (b.ptr() as *mut u8).add(offset) } as *mut c_void;
    (b, p)
}

fn download_f32(b: &DeviceBuffer, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    b.download(&mut out).unwrap();
    out
}

/// Relative L2 error, after checking that every element was written (no NaN left from the poison).
fn rel_l2(what: &str, got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("{what}: element {i} of {} is {} (not written?)", got.len(), got[i]);
    }
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

#[test]
fn rmsnorm_matches_cpu() {
    if !gpu_present("rmsnorm_matches_cpu") {
        return;
    }
    let mut rng = Rng::fresh("rmsnorm_matches_cpu");
    for (n, cols, in_place) in [(1, 4096, false), (3, 1000, false), (5, 1027, false), (2, 896, true)] {
        let x = rng.vec(n * cols, 3.0);
        let w = rng.vec(cols, 1.0);
        let eps = 1e-5;
        let mut want = vec![0f32; n * cols];
        for (xr, wr) in x.chunks(cols).zip(want.chunks_mut(cols)) {
            cpu::rmsnorm(xr, &w, eps, wr);
        }
        let xb = DeviceBuffer::from_slice(&x).unwrap();
        let wb = DeviceBuffer::from_slice(&w).unwrap();
        let out = if in_place { None } else { Some(poisoned(n * cols * 4)) };
        let out_ptr = out.as_ref().map_or(xb.ptr(), |o| o.ptr()) as *mut f32;
        ok(
            // SAFETY: device buffers of `n` rows of `cols` floats (and `cols` of weights), alive until the synchronous
            // check after the launch.
            unsafe {
                kn::hostembed_rmsnorm(
                    xb.ptr() as *const f32,
                    wb.ptr() as *const f32,
                    eps,
                    out_ptr,
                    n as c_uint,
                    cols as c_uint,
                    launch_tuning(),
                    NULL_STREAM,
                )
            },
            "hostembed_rmsnorm",
        );
        let got = download_f32(out.as_ref().unwrap_or(&xb), n * cols);
        assert_close(&format!("rmsnorm {n}x{cols} in place {in_place}"), &got, &want, 1e-5);
    }
}

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
    let bytes = encode(dtype, cols, &rng.vec(rows * cols, 1.0));
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
    let all = download_f32(&yb, n * ldy);
    let got: Vec<f32> = (0..n).flat_map(|t| all[t * ldy..t * ldy + rows].to_vec()).collect();
    let what = format!(
        "matvec {} {rows}x{cols} n={n} offsets w+{} x+{} bias {} residual {} ldy {ldy}",
        dtype.name(),
        c.w_offset,
        c.x_offset,
        c.bias,
        c.residual
    );
    assert_close(&what, &got, &want, weight_tol(dtype));
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
            let got = download_f32(&y, n * rows);
            assert_close(
                &format!("matvec_swiglu {} {rows}x{cols} n={n}", dtype.name()),
                &got,
                &want,
                weight_tol(dtype),
            );
        }
    }
}

/// The formats the tensor-core decode product reads (the others stay on the matrix-vector kernel).
fn mmv_dtypes() -> Vec<DType> {
    // SAFETY: a host-side check on a format id, an address and a width; nothing is read.
    dtypes().filter(|&d| unsafe { kn::hostembed_mmv_supports(d as c_int, 256 as *const c_void, 256) } == 0).collect()
}

/// hostembed_mmv's workspace for the largest of `shapes` (rows, cols, glu) over `n` tokens, counters zeroed.
fn mmv_work(shapes: &[(usize, usize, bool)], n: usize) -> (DeviceBuffer, DeviceBuffer) {
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
fn run_mmv(
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
fn run_mmv_tuned(
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
    download_f32(&yb, n * ldy)
}

/// The tensor-core decode product's bound: each activation enters as a bf16 pair (about 16 bits), so the
/// products keep f32-activation accuracy (~1e-6 here); bf16 activations alone would give ~2e-3, and one
/// misread quant ~1e-2.
const MMV_TOL: f64 = 1e-4;

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
            let w = TensorRef { dtype, shape: &[rows, cols], bytes: &bytes };
            let x = rng.vec(n * cols, 1.0);
            let bias = rng.vec(rows, 0.5);
            let res = rng.vec(n * ldy, 1.0);
            let mut want = vec![0f32; n * rows];
            for t in 0..n {
                cpu::matvec(&w, &x[t * cols..(t + 1) * cols], &mut want[t * rows..(t + 1) * rows]);
                for r in 0..rows {
                    want[t * rows + r] +=
                        if with_bias { bias[r] } else { 0.0 } + if with_residual { res[t * ldy + r] } else { 0.0 };
                }
            }
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
            let got = download_f32(&y, n * rows);
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

/// The launchers' settings as the environment gives them, with the block formats' tile kernel
/// (`Tuning::mmv_tc_blocks`) on or off.
fn tile_tuning(on: bool) -> kn::hostembed_tuning {
    kn::hostembed_tuning { mmv_tc_blocks: on as c_int, ..launch_tuning() }
}

/// The block formats the tensor-core decode product reads (those the tile kernel takes).
fn mmv_block_dtypes() -> Vec<DType> {
    mmv_dtypes().into_iter().filter(|d| !matches!(d, DType::Bf16 | DType::F16)).collect()
}

/// y[t] = silu(gate x[t]) * (up x[t]) on the tensor-core decode product with the launchers' settings `tuning`.
fn run_mmv_swiglu(case: &SwigluCase, dtype: DType, rows: usize, n: usize, tuning: kn::hostembed_tuning) -> Vec<f32> {
    let y = poisoned(n * rows * 4);
    let (partial, counters) = mmv_work(&[(rows, case.cols, true)], n);
    ok(
        // SAFETY: device buffers sized for the case and a workspace from hostembed_mmv_workspace for it, alive until
        // the synchronous check after the launch.
        unsafe {
            kn::hostembed_mmv_swiglu(
                case.gd.ptr(),
                case.ud.ptr(),
                dtype as c_int,
                rows as c_uint,
                case.cols as c_uint,
                case.xd.ptr() as *const f32,
                n as c_uint,
                y.ptr() as *mut f32,
                partial.ptr() as *mut f32,
                counters.ptr() as *mut c_uint,
                tuning,
                NULL_STREAM,
            )
        },
        "hostembed_mmv_swiglu",
    );
    assert_counters_reset(&counters, "hostembed_mmv_swiglu");
    download_f32(&y, n * rows)
}

/// A split product's last block resets its arrival counter for the next launch: all must read zero.
fn assert_counters_reset(counters: &DeviceBuffer, launcher: &str) {
    let mut left = vec![0u32; counters.bytes() / 4];
    counters.download(&mut left).unwrap();
    assert!(left.iter().all(|&c| c == 0), "{launcher} left its arrival counters non-zero: {left:?}");
}

/// The first element where two outputs' bits differ, as (index, a, b).
fn first_difference(a: &[f32], b: &[f32]) -> Option<(usize, f32, f32)> {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).position(|(x, y)| x.to_bits() != y.to_bits()).map(|i| (i, a[i], b[i]))
}

/// The tile kernel (launches of more than 8 tokens with `mmv_tc_blocks` on) computes the integer kernel's
/// sums and epilogue in the same order: every output the same bits as with the option off, for every
/// block format, token count and shape (one column range and many, a short last range, more row blocks
/// than a split product takes, a stub row block), within the bound of the CPU's product where checked,
/// and nothing written outside the rows.
#[test]
fn mmv_tile_kernel_gives_the_integer_kernels_bits() {
    if !gpu_present("mmv_tile_kernel_gives_the_integer_kernels_bits") {
        return;
    }
    let mut rng = Rng::fresh("mmv_tile_kernel_gives_the_integer_kernels_bits");
    let formats = mmv_block_dtypes();
    assert!(formats.contains(&DType::Q4_K) && formats.contains(&DType::Q8_0), "formats: {formats:?}");
    // (rows, cols, n, bias, residual, ldy pad, against the CPU)
    let cases = [
        (4096, 4096, 64, false, false, 0, false),  // 8 column ranges, one launch of 64
        (1000, 1536, 9, true, true, 0, true),      // the fewest tokens the tile kernel takes
        (200, 4128, 16, true, false, 3, true),     // a last 256-column group of 32 (32-value blocks)
        (333, 768, 33, false, true, 0, true),      // three tiles of tokens past 32
        (14336, 1024, 40, false, false, 0, false), // two column ranges, 112 row blocks
        (40000, 512, 17, false, false, 0, false),  // more row blocks than a split product has: one range
        (130, 1024, 70, true, false, 0, true),     // two launches: 64 tokens on the tile kernel, then 6
    ];
    for &dtype in &formats {
        for &(rows, cols, n, with_bias, with_residual, pad, cpu_check) in &cases {
            let cols = cols_for(dtype, cols);
            let ldy = rows + pad;
            let bytes = encode(dtype, cols, &rng.vec(rows * cols, 1.0));
            let x = rng.vec(n * cols, 1.0);
            let bias = rng.vec(rows, 0.5);
            let res = rng.vec(n * ldy, 1.0);
            let wd = DeviceBuffer::from_slice(&bytes).unwrap();
            let bd = DeviceBuffer::from_slice(&bias).unwrap();
            let run = |on: bool| {
                let (b, r) = (with_bias.then_some(&bd), with_residual.then_some(&res[..]));
                run_mmv_tuned(wd.ptr(), dtype, rows, cols, &x, n, b, r, ldy, tile_tuning(on))
            };
            let (tile, integer) = (run(true), run(false));
            let what = format!("mmv {} {rows}x{cols} n={n} bias {with_bias} residual {with_residual}", dtype.name());
            if let Some((i, a, b)) = first_difference(&tile, &integer) {
                panic!("{what}: the tile kernel gives y[{}][{}] = {a:e}, the integer kernel {b:e}", i / ldy, i % ldy);
            }
            for t in 0..n {
                for r in rows..ldy {
                    // The residual where y started as it, else `poisoned`'s bytes.
                    let before = if with_residual { res[t * ldy + r] } else { f32::from_bits(u32::MAX) };
                    assert!(
                        tile[t * ldy + r].to_bits() == before.to_bits(),
                        "{what}: wrote y[{t}][{r}] outside its rows"
                    );
                }
            }
            if cpu_check {
                let w = TensorRef { dtype, shape: &[rows, cols], bytes: &bytes };
                let mut want = vec![0f32; n * rows];
                for t in 0..n {
                    cpu::matvec(&w, &x[t * cols..(t + 1) * cols], &mut want[t * rows..(t + 1) * rows]);
                    for r in 0..rows {
                        want[t * rows + r] +=
                            if with_bias { bias[r] } else { 0.0 } + if with_residual { res[t * ldy + r] } else { 0.0 };
                    }
                }
                let got: Vec<f32> = (0..n).flat_map(|t| tile[t * ldy..t * ldy + rows].to_vec()).collect();
                assert_close(&format!("{what} (tile kernel)"), &got, &want, MMV_TOL);
            }
        }
    }
}

/// The fused gate/up product on the tile kernel: the integer kernel's bits, and the CPU's within the bound.
#[test]
fn mmv_tile_kernel_swiglu_gives_the_integer_kernels_bits() {
    if !gpu_present("mmv_tile_kernel_swiglu_gives_the_integer_kernels_bits") {
        return;
    }
    let mut rng = Rng::fresh("mmv_tile_kernel_swiglu_gives_the_integer_kernels_bits");
    for dtype in mmv_block_dtypes() {
        for (rows, cols, n) in [(14336, 512, 24), (64, 256, 20), (1000, 1024, 64), (300, 4096, 12)] {
            let case = swiglu_case(&mut rng, dtype, rows, cols, n);
            let tile = run_mmv_swiglu(&case, dtype, rows, n, tile_tuning(true));
            let integer = run_mmv_swiglu(&case, dtype, rows, n, tile_tuning(false));
            let what = format!("mmv_swiglu {} {rows}x{} n={n}", dtype.name(), case.cols);
            if let Some((i, a, b)) = first_difference(&tile, &integer) {
                panic!("{what}: the tile kernel gives y[{}][{}] = {a:e}, the integer kernel {b:e}", i / rows, i % rows);
            }
            assert_close(&format!("{what} (tile kernel)"), &tile, &case.want, MMV_TOL);
        }
    }
}

/// With the tile kernel on, a token's outputs are the bits it gets alone (a launch of one, on the
/// integer kernel), at any place in batches of 9 to 70, whatever its neighbours hold.
#[test]
fn mmv_tile_kernel_is_batch_invariant() {
    if !gpu_present("mmv_tile_kernel_is_batch_invariant") {
        return;
    }
    let mut rng = Rng::fresh("mmv_tile_kernel_is_batch_invariant");
    let tuning = tile_tuning(true);
    for dtype in mmv_block_dtypes() {
        for (rows, cols) in [(4096, 4096), (1000, 14336), (14336, 1024)] {
            let cols = cols_for(dtype, cols);
            let bytes = encode(dtype, cols, &rng.vec(rows * cols, 1.0));
            let wd = DeviceBuffer::from_slice(&bytes).unwrap();
            let probe = rng.vec(cols, 1.0);
            let alone = run_mmv_tuned(wd.ptr(), dtype, rows, cols, &probe, 1, None, None, rows, tuning);
            for (n, at, scale) in
                [(9, 8, 1.0), (16, 7, 1e4), (17, 16, 1.0), (33, 1, 1e-3), (64, 0, 1e-3), (64, 63, 1e6), (70, 66, 1.0)]
            {
                let mut x = rng.vec(n * cols, scale);
                x[at * cols..(at + 1) * cols].copy_from_slice(&probe);
                let all = run_mmv_tuned(wd.ptr(), dtype, rows, cols, &x, n, None, None, rows, tuning);
                let got = &all[at * rows..(at + 1) * rows];
                let differ = got.iter().zip(&alone).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                assert_eq!(
                    differ,
                    0,
                    "mmv {} {rows}x{cols} (tile kernel): token {at} of {n} differs from alone in {differ} rows",
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

fn config(heads: usize, kv_heads: usize, head_dim: usize, scaling: RopeScaling, interleaved: bool) -> ModelConfig {
    let llama = ModelConfig::llama(heads * head_dim, 1, heads, kv_heads, 64, 256);
    ModelConfig { rms_eps: 1e-6, rope_scaling: scaling, rope_interleaved: interleaved, ..llama }
}

#[test]
fn rope_and_kv_append_match_cpu() {
    if !gpu_present("rope_and_kv_append_match_cpu") {
        return;
    }
    let mut rng = Rng::fresh("rope_and_kv_append_match_cpu");
    let llama3 =
        RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192 };
    let cases = [
        (8, 2, 128, RopeScaling::None, false, false),
        (8, 2, 128, llama3, true, false),
        (4, 4, 64, RopeScaling::Linear { factor: 4.0 }, false, true),
        (6, 3, 256, RopeScaling::None, true, true),
        (5, 1, 80, RopeScaling::None, false, true),
    ];
    for (heads, kv_heads, hd, scaling, interleaved, qk_norm) in cases {
        let cfg = config(heads, kv_heads, hd, scaling, interleaved);
        let inv_freq = cpu::rope_inv_freq(&cfg);
        let (q_dim, kv_dim) = (heads * hd, kv_heads * hd);
        let stride = q_dim + 2 * kv_dim + 3;
        // Tokens 0 and 1 of one stream, token 2 of another, each stream's pages scattered over the pool.
        let n = 3;
        let window = 4000usize;
        let token_stream = [0, 0, 1];
        let mut pos: Vec<i32> = (0..n).map(|_| rng.below(window as u64) as i32).collect();
        if pos[1] == pos[0] {
            pos[1] = (pos[0] + 1) % window as i32;
        }
        let qkv = rng.vec(n * stride, 2.0);
        let (qn, kn_w) = (rng.vec(hd, 1.0), rng.vec(hd, 1.0));
        let eps = 1e-6;

        let mut want = qkv.clone();
        for t in 0..n {
            let row = &mut want[t * stride..(t + 1) * stride];
            let (q, rest) = row.split_at_mut(q_dim);
            let k = &mut rest[..kv_dim];
            if qk_norm {
                for (part, w) in [(&mut *q, &qn), (&mut *k, &kn_w)] {
                    for head in part.chunks_mut(hd) {
                        let mut normed = vec![0f32; hd];
                        cpu::rmsnorm(head, w, eps, &mut normed);
                        head.copy_from_slice(&normed);
                    }
                }
            }
            cpu::rope(q, heads, hd, pos[t] as usize, &inv_freq, interleaved);
            cpu::rope(k, kv_heads, hd, pos[t] as usize, &inv_freq, interleaved);
        }

        let qkv_d = DeviceBuffer::from_slice(&qkv).unwrap();
        let pos_d = DeviceBuffer::from_slice(&pos).unwrap();
        let inv_d = DeviceBuffer::from_slice(&inv_freq).unwrap();
        let qn_d = DeviceBuffer::from_slice(&qn).unwrap();
        let kn_d = DeviceBuffer::from_slice(&kn_w).unwrap();
        let mut kv = PagedKv::new(2 * window.div_ceil(PAGE_TOKENS) + 3, kv_heads, hd);
        let tables = kv.tables(&mut rng, &[window, window]);
        let dt = DeviceTables::new(&tables, &token_stream);
        let pool = poisoned(kv.bits.len() * 2);
        ok(
            // SAFETY: device buffers sized for the case (its rows, positions, tables and pool pages), alive until the
            // synchronous check after the launch.
            unsafe {
                kn::hostembed_rope_kv(
                    qkv_d.ptr() as *mut f32,
                    stride as c_uint,
                    n as c_uint,
                    pos_d.ptr() as *const c_int,
                    heads as c_uint,
                    kv_heads as c_uint,
                    hd as c_uint,
                    inv_d.ptr() as *const f32,
                    interleaved as c_int,
                    if qk_norm { qn_d.ptr() as *const f32 } else { ptr::null() },
                    if qk_norm { kn_d.ptr() as *const f32 } else { ptr::null() },
                    eps,
                    pool.ptr(),
                    dt.ptr(),
                    kv.pages as c_uint,
                    KvType::Bf16 as c_int,
                    KvType::Bf16 as c_int,
                    launch_tuning(),
                    NULL_STREAM,
                )
            },
            "hostembed_rope_kv",
        );
        let got = download_f32(&qkv_d, n * stride);
        let what =
            format!("rope {heads}/{kv_heads} heads of {hd}, {scaling:?}, interleaved {interleaved}, qk_norm {qk_norm}");
        // q and k rotated in place; v and the padding untouched.
        let pick = |v: &[f32], from: usize, to: usize| -> Vec<f32> {
            (0..n).flat_map(|t| v[t * stride + from..t * stride + to].to_vec()).collect()
        };
        assert_close(
            &format!("{what}: q and k"),
            &pick(&got, 0, q_dim + kv_dim),
            &pick(&want, 0, q_dim + kv_dim),
            1e-5,
        );
        assert_eq!(
            pick(&got, q_dim + kv_dim, stride),
            pick(&qkv, q_dim + kv_dim, stride),
            "{what}: v or padding changed"
        );

        // The pool holds bf16 k (rotated) and v at each token's position of its stream, nothing elsewhere.
        pool.download(&mut kv.bits).unwrap();
        let (mut got_k, mut want_k) = (Vec::new(), Vec::new());
        let mut written = std::collections::HashSet::new();
        for t in 0..n {
            let table = &tables[token_stream[t]];
            for h in 0..kv_heads {
                for d in 0..hd {
                    let (ka, va) =
                        (kv.at(table, false, h, pos[t] as usize, d), kv.at(table, true, h, pos[t] as usize, d));
                    written.extend([ka, va]);
                    got_k.push(half::bf16::from_bits(kv.bits[ka]).to_f32());
                    want_k.push(want[t * stride + q_dim + h * hd + d]);
                    let v = qkv[t * stride + q_dim + kv_dim + h * hd + d];
                    assert_eq!(
                        kv.bits[va],
                        half::bf16::from_f32(v).to_bits(),
                        "{what}: v of token {t} (stream {}) head {h} dim {d}",
                        token_stream[t]
                    );
                }
            }
        }
        assert_close(&format!("{what}: k cache"), &got_k, &want_k, 4e-3);
        if let Some(i) = (0..kv.bits.len()).find(|i| kv.bits[*i] != 0xFFFF && !written.contains(i)) {
            panic!("{what}: the pool was written at value {i}, which no token's position maps to");
        }
    }
}

/// Device copies of page tables and, per query token, the address of its stream's table.
struct DeviceTables {
    _tables: DeviceBuffer,
    per_token: DeviceBuffer,
}

impl DeviceTables {
    /// `token_stream[t]`: which of `tables` token t reads.
    fn new(tables: &[Vec<u32>], token_stream: &[usize]) -> DeviceTables {
        let flat: Vec<u32> = tables.iter().flatten().copied().collect();
        let all = DeviceBuffer::from_slice(&flat).unwrap();
        let starts: Vec<usize> = tables.iter().scan(0, |at, t| Some(std::mem::replace(at, *at + t.len()))).collect();
        let addrs: Vec<u64> = token_stream.iter().map(|&s| all.ptr() as u64 + 4 * starts[s] as u64).collect();
        DeviceTables { per_token: DeviceBuffer::from_slice(&addrs).unwrap(), _tables: all }
    }

    fn ptr(&self) -> *const *const c_uint {
        self.per_token.ptr() as *const *const c_uint
    }
}

/// Launches the attention of the tokens `tokens` (indices into q and pos) and returns their outputs.
#[allow(clippy::too_many_arguments)]
fn launch_attention(
    q: &[f32],
    q_stride: usize,
    pos: &[i32],
    tokens: &[usize],
    pool: &DeviceBuffer,
    pool_pages: usize,
    tables: &[Vec<u32>],
    token_stream: &[usize],
    heads: usize,
    kv_heads: usize,
    hd: usize,
    splits: usize,
    grid_parts: usize,
) -> Vec<f32> {
    let n = tokens.len();
    let q: Vec<f32> = tokens.iter().flat_map(|&t| q[t * q_stride..(t + 1) * q_stride].to_vec()).collect();
    let pos: Vec<i32> = tokens.iter().map(|&t| pos[t]).collect();
    let streams: Vec<usize> = tokens.iter().map(|&t| token_stream[t]).collect();
    let dt = DeviceTables::new(tables, &streams);
    let qd = DeviceBuffer::from_slice(&q).unwrap();
    let pd = DeviceBuffer::from_slice(&pos).unwrap();
    let partial = poisoned(n * heads * splits * (hd + 2) * 4);
    let out = poisoned(n * heads * hd * 4);
    ok(
        // SAFETY: device buffers sized for `n` queries, the pool's pages and tables, and their partial results, alive
        // until the synchronous check after the launch.
        unsafe {
            kn::hostembed_attention(
                qd.ptr() as *const f32,
                q_stride as c_uint,
                pool.ptr(),
                dt.ptr(),
                pool_pages as c_uint,
                KvType::Bf16 as c_int,
                KvType::Bf16 as c_int,
                pd.ptr() as *const c_int,
                n as c_uint,
                heads as c_uint,
                kv_heads as c_uint,
                hd as c_uint,
                1.0 / (hd as f32).sqrt(),
                0,
                splits as c_uint,
                grid_parts as c_uint,
                partial.ptr() as *mut f32,
                out.ptr() as *mut f32,
                launch_tuning(),
                NULL_STREAM,
            )
        },
        "hostembed_attention",
    );
    download_f32(&out, n * heads * hd)
}

/// One attention case: streams of (context, queries) whose query tokens sit at the last positions of
/// their context, all in one launch over one paged pool (each stream's pages scattered); checked
/// against the CPU, and each stream's outputs against its tokens launched alone (bit for bit).
fn run_attention(rng: &mut Rng, heads: usize, kv_heads: usize, hd: usize, streams: &[(usize, usize)], splits: usize) {
    let kv_dim = kv_heads * hd;
    let q_stride = heads * hd + 16;
    let windows: Vec<usize> = streams.iter().map(|&(ctx, _)| ctx + 7).collect();
    let pages: usize = windows.iter().map(|w| w.div_ceil(PAGE_TOKENS)).sum::<usize>() + 5;
    let mut kv = PagedKv::new(pages, kv_heads, hd);
    let tables = kv.tables(rng, &windows);
    let (mut q, mut pos, mut token_stream, mut want) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (si, &(n_ctx, n)) in streams.iter().enumerate() {
        // K and V as the cache stores them (bf16), so both sides read the same values.
        let k: Vec<f32> = rng.vec(n_ctx * kv_dim, 1.0).into_iter().map(bf16_round).collect();
        let v: Vec<f32> = rng.vec(n_ctx * kv_dim, 1.0).into_iter().map(bf16_round).collect();
        for p in 0..n_ctx {
            for h in 0..kv_heads {
                for d in 0..hd {
                    let i = p * kv_dim + h * hd + d;
                    let (ka, va) = (kv.at(&tables[si], false, h, p, d), kv.at(&tables[si], true, h, p, d));
                    kv.bits[ka] = half::bf16::from_f32(k[i]).to_bits();
                    kv.bits[va] = half::bf16::from_f32(v[i]).to_bits();
                }
            }
        }
        let qs = rng.vec(n * q_stride, 1.0);
        for t in 0..n {
            let p = n_ctx - n + t;
            let mut o = vec![0f32; heads * hd];
            cpu::attention(&qs[t * q_stride..t * q_stride + heads * hd], &k, &v, p + 1, heads, kv_heads, hd, &mut o);
            want.extend(o);
            pos.push(p as i32);
            token_stream.push(si);
        }
        q.extend(qs);
    }
    let pool = DeviceBuffer::from_slice(&kv.bits).unwrap();
    let all: Vec<usize> = (0..pos.len()).collect();
    // The grid the engine gives a launch: as many blocks a token as the longest context fills.
    let grid_of = |tokens: &[usize]| {
        let longest = tokens.iter().map(|&t| pos[t] as usize + 1).max().unwrap_or(0);
        hostembed::gpu::attention_grid_parts(longest, splits)
    };
    let launch = |tokens: &[usize], grid_parts: usize| {
        launch_attention(
            &q,
            q_stride,
            &pos,
            tokens,
            &pool,
            pages,
            &tables,
            &token_stream,
            heads,
            kv_heads,
            hd,
            splits,
            grid_parts,
        )
    };
    let got = launch(&all, grid_of(&all));
    let what =
        format!("attention {heads}/{kv_heads} heads of {hd}, streams (context, tokens) {streams:?}, {splits} splits");
    assert_close(&what, &got, &want, 1e-4);
    let width = heads * hd;
    let same_bits = |a: &[f32], b: &[f32], what: &str| {
        if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
            panic!("{what}: value {i}: {} against {} in the batch", a[i], b[i]);
        }
    };
    // The grid changes which block computes a part, never its bits: one block a token taking every
    // part in turn, and a block for every part.
    for grid_parts in [1, splits] {
        same_bits(&launch(&all, grid_parts), &got, &format!("{what}: {grid_parts} blocks a token"));
    }
    // Batch invariance: each stream's tokens launched without the others (on their own grid) give the
    // same bits.
    for si in 0..streams.len() {
        let mine: Vec<usize> = all.iter().copied().filter(|&t| token_stream[t] == si).collect();
        let alone = launch(&mine, grid_of(&mine));
        for (k, &t) in mine.iter().enumerate() {
            let (a, b) = (&alone[k * width..(k + 1) * width], &got[t * width..(t + 1) * width]);
            same_bits(a, b, &format!("{what}: stream {si} token {t} alone"));
        }
    }
}

#[test]
fn attention_matches_cpu() {
    if !gpu_present("attention_matches_cpu") {
        return;
    }
    let mut rng = Rng::fresh("attention_matches_cpu");
    run_attention(&mut rng, 32, 8, 128, &[(300, 1)], 7); // Llama-3 8B heads, a context not a multiple of a part
    run_attention(&mut rng, 32, 8, 128, &[(300, 1), (17, 1), (1, 1), (513, 1), (64, 1)], 32); // decode batch
    run_attention(&mut rng, 14, 2, 64, &[(1000, 3), (40, 2)], 16); // groups of 7 (a block of 8 heads, one masked)
    run_attention(&mut rng, 16, 16, 256, &[(513, 2)], 5); // no grouping, the largest head
    run_attention(&mut rng, 8, 2, 96, &[(129, 4), (33, 1)], 3); // a head_dim between the kernel's sizes
    run_attention(&mut rng, 40, 8, 128, &[(77, 5)], 1); // groups of 5, one part
    run_attention(&mut rng, 8, 4, 128, &[(3, 2), (2, 1)], 16); // more parts than positions: empty parts
    run_attention(&mut rng, 16, 2, 256, &[(200, 1)], 9); // groups of 8 with head_dim 256: two blocks a group
}

#[test]
fn attention_stays_right_at_long_context() {
    if !gpu_present("attention_stays_right_at_long_context") {
        return;
    }
    let mut rng = Rng::fresh("attention_stays_right_at_long_context");
    run_attention(&mut rng, 8, 2, 128, &[(32768, 1)], 33);
    run_attention(&mut rng, 8, 2, 64, &[(20000 + 13, 2), (16384, 1)], 64);
    run_attention(&mut rng, 32, 8, 128, &[(16384, 1), (16000, 1), (5, 1)], 32); // the decode shape at 16k
}

#[test]
fn glu_and_add_match_cpu() {
    if !gpu_present("glu_and_add_match_cpu") {
        return;
    }
    let mut rng = Rng::fresh("glu_and_add_match_cpu");
    let len = 14336 * 3 + 7;
    let (g, u) = (rng.vec(len, 6.0), rng.vec(len, 2.0));
    let (gd, ud) = (DeviceBuffer::from_slice(&g).unwrap(), DeviceBuffer::from_slice(&u).unwrap());
    // GeGLU's bound leaves room for the device's tanhf, a few ulps from the host's.
    let glus: [(&str, c_int, fn(&[f32], &[f32], &mut [f32]), f64); 2] =
        [("swiglu", kn::ACT_SILU, cpu::swiglu, 1e-6), ("geglu", kn::ACT_GELU_TANH, cpu::geglu, 1e-5)];
    for (name, act, cpu_glu, tol) in glus {
        let mut want = vec![0f32; len];
        cpu_glu(&g, &u, &mut want);
        let out = poisoned(len * 4);
        ok(
            // SAFETY: device buffers of `len` floats each, alive until the synchronous check after the launch.
            unsafe {
                kn::hostembed_glu_to(
                    gd.ptr() as *const f32,
                    ud.ptr() as *const f32,
                    out.ptr(),
                    DType::F32 as c_int,
                    act,
                    len,
                    NULL_STREAM,
                )
            },
            "hostembed_glu_to",
        );
        assert_close(name, &download_f32(&out, len), &want, tol);
    }

    let mut sum = g.clone();
    cpu::add(&mut sum, &u);
    // In place: out = a.
    ok(
        // SAFETY: device buffers of `len` floats each (out is a), alive until the synchronous check after the launch.
        unsafe {
            kn::hostembed_add(gd.ptr() as *const f32, ud.ptr() as *const f32, gd.ptr() as *mut f32, len, NULL_STREAM)
        },
        "hostembed_add",
    );
    assert_close("add", &download_f32(&gd, len), &sum, 1e-7);
}

/// Runs the device sampler once, on a poisoned scratch of the size GpuModel gives it (8 bytes a token).
fn device_sample(logits: &DeviceBuffer, vocab: usize, s: &Sampling, stream: u32, position: u64) -> u32 {
    device_sample_penalized(logits, vocab, s, stream, position, &[])
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
    let before = download_f32(logits, vocab);
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
    let after = download_f32(logits, vocab);
    assert!(before.iter().zip(&after).all(|(a, b)| a.to_bits() == b.to_bits()), "the sampler left the logits changed");
    t[0] as u32
}

/// The vocabularies the sampler tests run: one block below 8192 logits, many blocks from there, and the
/// Llama-3 and Qwen2 sizes.
const SAMPLE_VOCABS: [usize; 9] = [1, 2, 256, 4096, 8191, 8192, 32000, 128256, 151936];

#[test]
fn greedy_sampling_is_the_cpu_argmax() {
    if !gpu_present("greedy_sampling_is_the_cpu_argmax") {
        return;
    }
    let mut rng = Rng::fresh("greedy_sampling_is_the_cpu_argmax");
    for vocab in SAMPLE_VOCABS {
        let mut logits = rng.vec(vocab, 10.0);
        if vocab > 10 {
            // Several equal maxima: the lowest index wins.
            for _ in 0..3 {
                let i = rng.below(vocab as u64) as usize;
                logits[i] = 11.0;
            }
        }
        let d = DeviceBuffer::from_slice(&logits).unwrap();
        for temperature in [0.0, -1.0, f32::NAN] {
            let s = Sampling { temperature, ..Sampling::GREEDY };
            assert_eq!(
                device_sample(&d, vocab, &s, 0, 0),
                sampler::argmax(&logits),
                "vocab {vocab}, temperature {temperature}"
            );
        }
        // top_k = 1 is greedy at any temperature.
        let s = Sampling { temperature: 0.8, top_k: 1, top_p: 0.9, seed: rng.next_u64(), ..Sampling::GREEDY };
        assert_eq!(device_sample(&d, vocab, &s, 1, 5), sampler::argmax(&logits), "vocab {vocab}, top_k 1");
    }
    // The total order of f32: +0 above -0, and the largest logit at the very last index.
    let mut logits = vec![-0.0f32; 20000];
    logits[7] = 0.0;
    let d = DeviceBuffer::from_slice(&logits).unwrap();
    assert_eq!(device_sample(&d, logits.len(), &Sampling::GREEDY, 0, 0), 7);
    logits[19999] = 1.0;
    let d = DeviceBuffer::from_slice(&logits).unwrap();
    assert_eq!(device_sample(&d, logits.len(), &Sampling::GREEDY, 0, 0), 19999);
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

#[test]
fn sampled_tokens_match_the_cpu_sampler() {
    if !gpu_present("sampled_tokens_match_the_cpu_sampler") {
        return;
    }
    let mut rng = Rng::fresh("sampled_tokens_match_the_cpu_sampler");
    let (mut compared, mut not_argmax) = (0, 0);
    for vocab in SAMPLE_VOCABS {
        for kind in 0..3 {
            let logits = sample_logits(&mut rng, vocab, kind);
            let d = DeviceBuffer::from_slice(&logits).unwrap();
            let arg = sampler::argmax(&logits);
            for &(temperature, top_k, top_p) in &SAMPLE_SETTINGS {
                for _ in 0..3 {
                    let s = Sampling { temperature, top_k, top_p, seed: rng.next_u64(), ..Sampling::GREEDY };
                    let (stream, position) = (rng.below(8) as u32, rng.below(1 << 40));
                    let got = device_sample(&d, vocab, &s, stream, position);
                    let want = sampler::sample(&logits, &s, stream, position);
                    assert_eq!(got, want, "vocab {vocab} kind {kind} {s:?} stream {stream} position {position}");
                    assert_eq!(got, device_sample(&d, vocab, &s, stream, position), "repeat");
                    compared += 1;
                    not_argmax += (got != arg) as usize;
                }
            }
        }
    }
    println!("{compared} draws identical to src/sampler.rs, {not_argmax} of them not the argmax");
    // The draws did sample: most settings spread over many tokens.
    assert!(not_argmax * 3 > compared, "only {not_argmax} of {compared} draws left the argmax");
}

/// Min-p and the repetition penalty on the device: the same token as `sampler::sample_stream` from the
/// same logits and stream history, over every vocabulary size and kind of logits, with every other cut
/// beside them; the launch leaves the logits as they were (`device_sample_penalized` checks).
#[test]
fn min_p_and_repetition_penalty_match_the_cpu_sampler() {
    if !gpu_present("min_p_and_repetition_penalty_match_the_cpu_sampler") {
        return;
    }
    let mut rng = Rng::fresh("min_p_and_repetition_penalty_match_the_cpu_sampler");
    // (min_p, repeat_penalty, repeat_last_n) beside each (temperature, top_k, top_p).
    let extra: [(f32, f32, u32); 7] = [
        (0.05, 1.0, 64),
        (0.3, 1.0, 64),
        (1.0, 1.0, 64),
        (0.0, 1.3, 64),
        (0.1, 1.8, 256),
        (0.02, 0.7, 32),
        (0.5, 3.0, 4096),
    ];
    let (mut compared, mut changed) = (0, 0);
    for vocab in SAMPLE_VOCABS {
        for kind in 0..3 {
            let logits = sample_logits(&mut rng, vocab, kind);
            let d = DeviceBuffer::from_slice(&logits).unwrap();
            // A history that repeats the likeliest tokens, so the penalty moves the draw.
            let mut order: Vec<u32> = (0..vocab as u32).collect();
            order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
            let history: Vec<u32> = (0..300)
                .map(|i| {
                    if i % 3 == 0 {
                        order[rng.below(order.len().min(20) as u64) as usize]
                    } else {
                        rng.below(vocab as u64) as u32
                    }
                })
                .collect();
            let new = [history[0], order[0]];
            let greedy_settings = [(0.0f32, 0u32, 1.0f32)];
            for &(temperature, top_k, top_p) in SAMPLE_SETTINGS.iter().chain(&greedy_settings) {
                for &(min_p, repeat_penalty, repeat_last_n) in &extra {
                    let s = Sampling {
                        temperature,
                        top_k,
                        top_p,
                        min_p,
                        repeat_penalty,
                        repeat_last_n,
                        seed: rng.next_u64(),
                    };
                    let stream = rng.below(8) as u32;
                    let position = (history.len() + new.len()) as u64;
                    let ids = sampler::penalty_ids(&history, &new, &s);
                    let got = device_sample_penalized(&d, vocab, &s, stream, position, &ids);
                    let want = sampler::sample_stream(&logits, &s, stream, &history, &new);
                    assert_eq!(got, want, "vocab {vocab} kind {kind} {s:?} stream {stream}: {} ids", ids.len());
                    let plain =
                        sampler::sample(&logits, &Sampling { min_p: 0.0, repeat_penalty: 1.0, ..s }, stream, position);
                    changed += (want != plain) as usize;
                    compared += 1;
                }
            }
        }
    }
    println!("{compared} draws with min-p or a penalty identical to src/sampler.rs, {changed} moved by them");
    assert!(changed * 5 > compared, "min-p and the penalty moved only {changed} of {compared} draws");
}

#[test]
fn sampling_handles_degenerate_logits_like_the_cpu() {
    if !gpu_present("sampling_handles_degenerate_logits_like_the_cpu") {
        return;
    }
    let mut rng = Rng::fresh("sampling_handles_degenerate_logits_like_the_cpu");
    let vocab = 128256;
    let mut cases: Vec<(&str, Vec<f32>)> = vec![
        ("all equal", vec![0.25; vocab]),
        ("two values alternating", (0..vocab).map(|i| (i % 2) as f32).collect()),
        ("all -inf but three", {
            let mut l = vec![f32::NEG_INFINITY; vocab];
            (l[5], l[70000], l[vocab - 1]) = (1.0, 1.0, 0.5);
            l
        }),
        ("huge magnitudes", rng.vec(vocab, 1.0).into_iter().map(|l| l * 1e30).collect()),
        ("tiny differences", rng.vec(vocab, 1.0).into_iter().map(|l| 1000.0 + l * 1e-3).collect()),
        ("a +inf", {
            let mut l = rng.vec(vocab, 4.0);
            l[1234] = f32::INFINITY;
            l
        }),
        ("a NaN", {
            let mut l = rng.vec(vocab, 4.0);
            l[4321] = f32::NAN;
            l
        }),
    ];
    // The maximum at the last index, its run of ties crossing the last block boundary.
    let mut l = rng.vec(vocab, 2.0);
    l[vocab - 3000..].iter_mut().for_each(|x| *x = 3.0);
    cases.push(("ties at the end", l));
    let settings = [(1.0, 0, 1.0), (0.8, 40, 0.95), (1.0, 50000, 0.7), (f32::INFINITY, 0, 0.5), (1e-30, 0, 0.9)];
    for (name, logits) in &cases {
        let d = DeviceBuffer::from_slice(logits).unwrap();
        for &(temperature, top_k, top_p) in &settings {
            for _ in 0..4 {
                let s = Sampling { temperature, top_k, top_p, seed: rng.next_u64(), ..Sampling::GREEDY };
                let position = rng.below(1 << 30);
                let got = device_sample(&d, vocab, &s, 2, position);
                assert_eq!(got, sampler::sample(logits, &s, 2, position), "{name}: {s:?} position {position}");
            }
        }
    }
}

/// Scratch for `hostembed_sample_rows`: what the GPU model gives it (`launch::sample_rows_bytes`: 64 bytes
/// and a 33 KiB workspace a row, 8 bytes a vocabulary entry for the ids, 1 KiB of alignment).
fn rows_scratch_bytes(vocab: usize, rows: usize) -> usize {
    rows * (64 + (33 << 10)) + vocab * 8 + 1024
}

/// One batched draw of `rows` logits rows (`logits`: rows x vocab on the device) with `settings[r]`, the
/// penalized ids of row r `ids[r]`, into poisoned tokens, on a poisoned scratch of `scratch_bytes`; checks
/// the logits are left as they were and returns the launch's status and the tokens.
fn device_sample_rows(
    logits: &DeviceBuffer,
    vocab: usize,
    settings: &[(Sampling, u32, u64)],
    ids: &[Vec<u32>],
    scratch_bytes: usize,
) -> (c_int, Vec<i32>) {
    let rows = settings.len();
    let mut flat: Vec<i32> = Vec::new();
    let mut host = Vec::new();
    for ((s, stream, position), ids) in settings.iter().zip(ids) {
        host.push(kn::hostembed_sample_row {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            repeat_penalty: s.repeat_penalty,
            n_penalty: ids.len() as c_uint,
            penalty_at: flat.len() as c_uint,
            stream_index: *stream,
            seed: s.seed,
            position: *position,
            mask_row: kn::NO_MASK,
            reserved: 0,
        });
        flat.extend(ids.iter().map(|&t| t as i32));
    }
    let scratch = poisoned(scratch_bytes.max(1));
    let tokens = poisoned(rows.max(1) * 4);
    let before = download_f32(logits, rows * vocab);
    // SAFETY: host arrays of the lengths passed; device buffers of rows x vocab floats, rows tokens and
    // scratch_bytes of scratch.
    let code = unsafe {
        kn::hostembed_sample_rows(
            logits.ptr() as *mut f32,
            vocab as c_uint,
            rows as c_uint,
            host.as_ptr(),
            flat.as_ptr(),
            flat.len() as c_uint,
            ptr::null(),
            scratch.ptr(),
            scratch_bytes,
            tokens.ptr() as *mut c_int,
            NULL_STREAM,
        )
    };
    cuda::synchronize().unwrap_or_else(|e| panic!("hostembed_sample_rows while running: {e}"));
    let mut t = vec![0i32; rows];
    tokens.download(&mut t).unwrap();
    let after = download_f32(logits, rows * vocab);
    assert!(
        before.iter().zip(&after).all(|(a, b)| a.to_bits() == b.to_bits()),
        "the batched sampler left the logits changed"
    );
    (code, t)
}

/// Every row of a batched draw picks the token `hostembed_sample` picks for that row alone, which is
/// `sampler::sample_stream`'s: rows of fresh random logits of every kind, each with its own settings
/// (greedy, temperature with top-k / top-p / min-p, repetition penalties over its own history), stream
/// and position, in batches of 1 to 64 rows, with the scratch the GPU model gives and with one too small
/// for more than one block a row.
#[test]
fn batched_sampling_matches_the_single_row_sampler() {
    if !gpu_present("batched_sampling_matches_the_single_row_sampler") {
        return;
    }
    let mut rng = Rng::fresh("batched_sampling_matches_the_single_row_sampler");
    let extra: [(f32, f32, u32); 5] =
        [(0.0, 1.0, 64), (0.05, 1.0, 64), (0.0, 1.3, 64), (0.1, 1.8, 256), (0.3, 0.7, 32)];
    let (mut compared, mut not_argmax) = (0, 0);
    for vocab in [2usize, 256, 4096, 8192, 32000, 128256, 151936] {
        for rows in [1usize, 3, 17, 64] {
            if vocab >= 128256 && rows == 17 {
                continue; // the largest shapes at 1, 3 and 64 rows keep the test short
            }
            let logits: Vec<Vec<f32>> = (0..rows).map(|r| sample_logits(&mut rng, vocab, r % 3)).collect();
            let flat: Vec<f32> = logits.concat();
            let d = DeviceBuffer::from_slice(&flat).unwrap();
            let mut settings = Vec::new();
            let mut histories = Vec::new();
            let mut ids = Vec::new();
            for r in 0..rows {
                // A third of the rows greedy, the rest drawn with a setting of the single-row tests.
                let (temperature, top_k, top_p) = if r % 3 == 0 {
                    (0.0, 0, 1.0)
                } else {
                    SAMPLE_SETTINGS[rng.below(SAMPLE_SETTINGS.len() as u64) as usize]
                };
                let (min_p, repeat_penalty, repeat_last_n) = extra[rng.below(extra.len() as u64) as usize];
                let s =
                    Sampling { temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed: rng.next_u64() };
                let history: Vec<u32> = (0..rng.below(300)).map(|_| rng.below(vocab as u64) as u32).collect();
                let new = [rng.below(vocab as u64) as u32];
                let position = (history.len() + new.len()) as u64;
                ids.push(sampler::penalty_ids(&history, &new, &s));
                settings.push((s, rng.below(64) as u32, position));
                histories.push((history, new));
            }
            let full = rows_scratch_bytes(vocab, rows);
            let total_ids: usize = ids.iter().map(Vec::len).sum();
            // Only the settings, barrier words and ids fit: one block a row.
            let tight = (rows * std::mem::size_of::<kn::hostembed_sample_row>()).next_multiple_of(16)
                + (8 * rows).next_multiple_of(16)
                + 8 * total_ids
                + 256;
            for scratch in [full, tight] {
                let (code, got) = device_sample_rows(&d, vocab, &settings, &ids, scratch);
                ok(code, &format!("hostembed_sample_rows, vocab {vocab}, {rows} rows, {scratch} bytes of scratch"));
                for r in 0..rows {
                    let (s, stream, position) = settings[r];
                    let row = DeviceBuffer::from_slice(&logits[r]).unwrap();
                    let alone = device_sample_penalized(&row, vocab, &s, stream, position, &ids[r]);
                    let (history, new) = &histories[r];
                    let want = sampler::sample_stream(&logits[r], &s, stream, history, new);
                    assert_eq!(alone, want, "vocab {vocab} row {r}: hostembed_sample against src/sampler.rs");
                    assert_eq!(
                        got[r] as u32, want,
                        "vocab {vocab}, {rows} rows, scratch {scratch}: row {r} {s:?} stream {stream} position {position}"
                    );
                    compared += 1;
                    not_argmax += (want != sampler::argmax(&logits[r])) as usize;
                }
            }
        }
    }
    println!("{compared} batched draws identical to the single-row sampler, {not_argmax} of them not the argmax");
    assert!(not_argmax * 4 > compared, "only {not_argmax} of {compared} draws left the argmax");
}

#[test]
fn batched_sampler_refuses_bad_arguments() {
    if !gpu_present("batched_sampler_refuses_bad_arguments") {
        return;
    }
    let vocab = 1000;
    let logits = DeviceBuffer::from_slice(&vec![0.5f32; 2 * vocab]).unwrap();
    let greedy = (Sampling::GREEDY, 0u32, 1u64);
    let big = rows_scratch_bytes(vocab, 2);
    // Too small for even the settings, the barrier words and the ids.
    let (code, _) = device_sample_rows(&logits, vocab, &[greedy, greedy], &[vec![], vec![]], 64);
    assert_ne!(code, 0, "a scratch too small for the settings");
    // A row whose ids run past the ids passed.
    let mut host = kn::hostembed_sample_row {
        repeat_penalty: 1.5,
        n_penalty: 3,
        penalty_at: 0,
        mask_row: kn::NO_MASK,
        ..Default::default()
    };
    let ids = [1i32, 2];
    let scratch = poisoned(big);
    let tokens = poisoned(8);
    let call = |rows: &kn::hostembed_sample_row, scratch_ptr: *mut c_void, vocab: usize| {
        // SAFETY: every call here is refused before it reads or writes anything.
        unsafe {
            kn::hostembed_sample_rows(
                logits.ptr() as *mut f32,
                vocab as c_uint,
                1,
                rows,
                ids.as_ptr(),
                ids.len() as c_uint,
                ptr::null(),
                scratch_ptr,
                big,
                tokens.ptr() as *mut c_int,
                NULL_STREAM,
            )
        }
    };
    assert_ne!(call(&host, scratch.ptr(), vocab), 0, "3 ids of a row among 2");
    host.n_penalty = 1;
    host.penalty_at = 2;
    assert_ne!(call(&host, scratch.ptr(), vocab), 0, "a row's ids starting past the ids");
    host.penalty_at = 1;
    let misaligned = (scratch.ptr() as *mut u8).wrapping_add(16) as *mut c_void;
    assert_ne!(call(&host, misaligned, vocab), 0, "a scratch off its 256-byte boundary");
    assert_ne!(call(&host, scratch.ptr(), 0), 0, "no vocabulary");
    assert_ne!(call(&host, scratch.ptr(), 1 << 28), 0, "a vocabulary past 2^28 - 1");
    host.mask_row = 0;
    assert_ne!(call(&host, scratch.ptr(), vocab), 0, "a row's mask and no masks");
    host.mask_row = kn::NO_MASK;
    let mut t = [0i32; 2];
    tokens.download(&mut t).unwrap();
    assert_eq!(t, [-1, -1], "a refused call wrote tokens");
    // The same row accepted (id 2 penalized among equal logits): greedy takes the lowest index.
    assert_eq!(call(&host, scratch.ptr(), vocab), 0, "a valid call");
    cuda::synchronize().unwrap();
    tokens.download(&mut t).unwrap();
    assert_eq!(t[0], 0, "greedy over equal logits is the lowest index");
}

#[test]
fn sampler_refuses_bad_arguments() {
    if !gpu_present("sampler_refuses_bad_arguments") {
        return;
    }
    let b = poisoned(1 << 16);
    let p = b.ptr();
    // SAFETY: every pointer is into one live 64 KiB device buffer (or NULL, which the launcher refuses before
    // launching).
    let call = |logits: *mut f32, vocab: c_uint, scratch: *mut c_void, token: *mut c_int| unsafe {
        kn::hostembed_sample(
            logits,
            vocab,
            1.0,
            0,
            1.0,
            0.0,
            1.0,
            ptr::null_mut(),
            0,
            1,
            0,
            0,
            scratch,
            token,
            NULL_STREAM,
        )
    };
    // SAFETY: 4096 is within the 64 KiB buffer at `p`; only the address is formed.
    let (logits, token, scratch) = (p as *mut f32, p as *mut c_int, unsafe { (p as *mut u8).add(4096) } as *mut c_void);
    let invalid = 1; // cudaErrorInvalidValue
    assert_eq!(call(ptr::null_mut(), 16, scratch, token), invalid, "NULL logits");
    // SAFETY: the pointers of `call` above, the penalty ids NULL with a count, which the launcher refuses before
    // launching.
    let penalty_null = unsafe {
        kn::hostembed_sample(
            logits,
            16,
            1.0,
            0,
            1.0,
            0.0,
            1.3,
            ptr::null_mut(),
            2,
            1,
            0,
            0,
            scratch,
            token,
            NULL_STREAM,
        )
    };
    assert_eq!(penalty_null, invalid, "NULL penalty ids with 2 of them");
    assert_eq!(call(logits, 16, scratch, ptr::null_mut()), invalid, "NULL token");
    assert_eq!(call(logits, 16, ptr::null_mut(), token), invalid, "NULL scratch");
    // SAFETY: 4 is within the 64 KiB buffer; only the address is formed.
    assert_eq!(call(logits, 16, unsafe { (scratch as *mut u8).add(4) } as *mut c_void, token), invalid, "misaligned");
    assert_eq!(call(logits, 0, scratch, token), invalid, "no vocabulary");
    assert_eq!(call(logits, 1 << 28, scratch, token), invalid, "a vocabulary past 2^28 - 1");
}

/// Constrained rows in `hostembed_sample_rows`: in one launch beside free rows, each masked row's token is
/// `sampler::sample_stream_masked`'s (every cut, min-p, the penalty; masks of every id down to about one,
/// and allowed ids whose logits are all -inf), each free row's `sample_stream`'s; the logits are left as
/// they were.
#[test]
fn masked_rows_draw_the_host_masked_samplers_token() {
    if !gpu_present("masked_rows_draw_the_host_masked_samplers_token") {
        return;
    }
    let mut rng = Rng::fresh("masked_rows_draw_the_host_masked_samplers_token");
    let (mut compared, mut masked_away) = (0, 0);
    for vocab in [1usize, 33, 4096, 8192, 32000, 128256] {
        let words = vocab.div_ceil(32);
        for round in 0..6 {
            let rows = 1 + rng.below(12) as usize;
            let (mut logits, mut masks, mut ids) = (Vec::new(), Vec::<u32>::new(), Vec::<c_int>::new());
            let (mut settings, mut want, mut has_mask) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..rows {
                let kind = rng.below(3) as usize;
                let mut row = sample_logits(&mut rng, vocab, kind);
                let masked = rng.below(4) > 0;
                let mut allowed = vec![0u32; words];
                if masked {
                    // Every id, half, one in fifty, or about one.
                    let density = [1, 2, 50, vocab as u64 + 1][rng.below(4) as usize];
                    for i in 0..vocab {
                        if rng.below(density) == 0 {
                            allowed[i / 32] |= 1 << (i % 32);
                        }
                    }
                    let one = rng.below(vocab as u64) as usize;
                    allowed[one / 32] |= 1 << (one % 32);
                    if rng.below(6) == 0 {
                        for i in (0..vocab).filter(|&i| allowed[i / 32] >> (i % 32) & 1 == 1) {
                            row[i] = f32::NEG_INFINITY;
                        }
                    }
                }
                let (temperature, top_k, top_p) = if rng.below(4) == 0 {
                    (0.0, 0, 1.0)
                } else {
                    SAMPLE_SETTINGS[rng.below(SAMPLE_SETTINGS.len() as u64) as usize]
                };
                let (repeat_penalty, repeat_last_n) = [(1.0, 64), (1.3, 16), (0.8, 8)][rng.below(3) as usize];
                let min_p = [0.0, 0.05, 0.3][rng.below(3) as usize];
                let s =
                    Sampling { temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed: rng.next_u64() };
                let history: Vec<u32> = (0..rng.below(12)).map(|_| rng.below(vocab as u64) as u32).collect();
                let new = [rng.below(vocab as u64) as u32];
                let stream = rng.below(8) as u32;
                let penalty = sampler::penalty_ids(&history, &new, &s);
                want.push(if masked {
                    sampler::sample_stream_masked(&row, &allowed, &s, stream, &history, &new).unwrap()
                } else {
                    sampler::sample_stream(&row, &s, stream, &history, &new)
                });
                settings.push(kn::hostembed_sample_row {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    repeat_penalty,
                    n_penalty: penalty.len() as c_uint,
                    penalty_at: ids.len() as c_uint,
                    stream_index: stream,
                    seed: s.seed,
                    position: (history.len() + 1) as u64,
                    mask_row: if masked { (masks.len() / words) as c_uint } else { kn::NO_MASK },
                    reserved: 0,
                });
                ids.extend(penalty.iter().map(|&t| t as c_int));
                if masked {
                    masks.extend(&allowed);
                }
                has_mask.push(masked);
                logits.extend(row);
            }
            let d = DeviceBuffer::from_slice(&logits).unwrap();
            let m = DeviceBuffer::from_slice(&masks).unwrap();
            // What GpuModel gives the sampler: a row's settings and workspace, 8 bytes an id.
            let scratch_size = rows * (64 + (33 << 10)) + ids.len().max(vocab) * 8 + 1024;
            let (scratch, tokens) = (poisoned(scratch_size), poisoned(rows * 4));
            ok(
                // SAFETY: device buffers holding `rows` logits rows, their masks, settings and ids, a workspace sized
                // as GpuModel sizes it and `rows` tokens, alive until the synchronous check after the launch.
                unsafe {
                    kn::hostembed_sample_rows(
                        d.ptr() as *mut f32,
                        vocab as c_uint,
                        rows as c_uint,
                        settings.as_ptr(),
                        ids.as_ptr(),
                        ids.len() as c_uint,
                        m.ptr() as *const c_uint,
                        scratch.ptr(),
                        scratch_size,
                        tokens.ptr() as *mut c_int,
                        NULL_STREAM,
                    )
                },
                "hostembed_sample_rows",
            );
            let mut got = vec![0i32; rows];
            tokens.download(&mut got).unwrap();
            for r in 0..rows {
                let what = format!("vocab {vocab} round {round} row {r} (masked: {}) {:?}", has_mask[r], settings[r]);
                assert_eq!(got[r], want[r] as i32, "{what}");
                compared += 1;
                if has_mask[r] {
                    let row = &logits[r * vocab..(r + 1) * vocab];
                    // Would the free draw have left the mask? Then the mask decided this token.
                    masked_away += usize::from(sampler::argmax(row) != want[r]);
                }
            }
            let after = download_f32(&d, rows * vocab);
            assert!(logits.iter().zip(&after).all(|(a, b)| a.to_bits() == b.to_bits()), "the logits changed");
        }
    }
    println!("{compared} rows identical to src/sampler.rs, {masked_away} masked rows off their argmax");
    assert!(masked_away > 0, "no mask changed a draw");
}
