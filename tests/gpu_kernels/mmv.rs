//! The batched mmv kernels against the CPU, the tile kernel against the integer ones, the workspace, refusals.

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
    download::<f32>(&yb, n * ldy)
}

/// The CPU's y[t] = W x[t] (+ bias) (+ residual[t], rows of `ldy`) for `n` tokens, rows packed.
fn cpu_product(
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
    download::<f32>(&y, n * rows)
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

/// A product case: its shape and token count, whether it adds a bias and a residual, the padding of y's
/// rows past `rows`, and whether to check it against the CPU.
#[derive(Clone, Copy)]
struct MmvCase {
    rows: usize,
    cols: usize,
    n: usize,
    bias: bool,
    residual: bool,
    pad: usize,
    cpu_check: bool,
}

impl From<(usize, usize, usize, bool, bool, usize, bool)> for MmvCase {
    fn from((rows, cols, n, bias, residual, pad, cpu_check): (usize, usize, usize, bool, bool, usize, bool)) -> Self {
        MmvCase { rows, cols, n, bias, residual, pad, cpu_check }
    }
}

/// Two launcher settings `settings` (named `names`) that must give the same bits on `case`: every output
/// equal, nothing written outside the rows, and (cpu_check) the first's within the bound of the CPU's
/// product. `big_first`: token 0's activations times 1e5, beside the others'.
fn assert_same_bits(
    rng: &mut Rng,
    dtype: DType,
    case: MmvCase,
    big_first: bool,
    settings: [kn::hostembed_tuning; 2],
    names: [&str; 2],
) {
    let MmvCase { rows, cols, n, bias: with_bias, residual: with_residual, pad, cpu_check } = case;
    let ldy = rows + pad;
    let bytes = encode(dtype, cols, &rng.vec(rows * cols, 1.0));
    let mut x = rng.vec(n * cols, 1.0);
    if big_first {
        x[..cols].iter_mut().for_each(|v| *v *= 1e5);
    }
    let bias = rng.vec(rows, 0.5);
    let res = rng.vec(n * ldy, 1.0);
    let wd = DeviceBuffer::from_slice(&bytes).unwrap();
    let bd = DeviceBuffer::from_slice(&bias).unwrap();
    let run = |tuning: kn::hostembed_tuning| {
        let (b, r) = (with_bias.then_some(&bd), with_residual.then_some(&res[..]));
        run_mmv_tuned(wd.ptr(), dtype, rows, cols, &x, n, b, r, ldy, tuning)
    };
    let (first, second) = (run(settings[0]), run(settings[1]));
    let what = format!("mmv {} {rows}x{cols} n={n} bias {with_bias} residual {with_residual}", dtype.name());
    if let Some((i, a, b)) = first_difference(&first, &second) {
        panic!("{what}: {} gives y[{}][{}] = {a:e}, {} {b:e}", names[0], i / ldy, i % ldy, names[1]);
    }
    for t in 0..n {
        for r in rows..ldy {
            // The residual where y started as it, else `poisoned`'s bytes.
            let before = if with_residual { res[t * ldy + r] } else { f32::from_bits(u32::MAX) };
            assert!(first[t * ldy + r].to_bits() == before.to_bits(), "{what}: wrote y[{t}][{r}] outside its rows");
        }
    }
    if cpu_check {
        let w = TensorRef { dtype, shape: &[rows, cols], bytes: &bytes };
        let want = cpu_product(&w, &x, n, with_bias.then_some(&bias[..]), with_residual.then_some(&res[..]), ldy);
        let got: Vec<f32> = (0..n).flat_map(|t| first[t * ldy..t * ldy + rows].to_vec()).collect();
        assert_close(&format!("{what} ({})", names[0]), &got, &want, MMV_TOL);
    }
}

/// The fused gate/up product of (rows, cols, n) under two settings that must give the same bits: every
/// output equal, and the first's within the bound of the CPU's.
fn assert_same_bits_swiglu(
    rng: &mut Rng,
    dtype: DType,
    (rows, cols, n): (usize, usize, usize),
    settings: [kn::hostembed_tuning; 2],
    names: [&str; 2],
) {
    let case = swiglu_case(rng, dtype, rows, cols, n);
    let first = run_mmv_swiglu(&case, dtype, rows, n, settings[0]);
    let second = run_mmv_swiglu(&case, dtype, rows, n, settings[1]);
    let what = format!("mmv_swiglu {} {rows}x{} n={n}", dtype.name(), case.cols);
    if let Some((i, a, b)) = first_difference(&first, &second) {
        panic!("{what}: {} gives y[{}][{}] = {a:e}, {} {b:e}", names[0], i / rows, i % rows, names[1]);
    }
    assert_close(&format!("{what} ({})", names[0]), &first, &case.want, MMV_TOL);
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
        for &case in &cases {
            let case = MmvCase { cols: cols_for(dtype, case.1), ..MmvCase::from(case) };
            assert_same_bits(
                &mut rng,
                dtype,
                case,
                false,
                [tile_tuning(true), tile_tuning(false)],
                ["the tile kernel", "the integer kernel"],
            );
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
            let settings = [tile_tuning(true), tile_tuning(false)];
            assert_same_bits_swiglu(
                &mut rng,
                dtype,
                (rows, cols, n),
                settings,
                ["the tile kernel", "the integer kernel"],
            );
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

/// The half formats' launches of more than 8 tokens on the warpgroup products (`Tuning::mmv_wgmma`, an
/// sm_90 card; elsewhere both settings take mma.sync and this checks nothing new) compute mma.sync's sums
/// in its order: every output the same bits with the setting on and off, plain and fused gate/up, for
/// one column range and many, a short last range and every tile count, and nothing written outside the
/// rows; against the CPU within the bound.
#[test]
fn mmv_warpgroup_kernel_gives_the_mma_kernels_bits() {
    if !gpu_present("mmv_warpgroup_kernel_gives_the_mma_kernels_bits") {
        return;
    }
    let mut rng = Rng::fresh("mmv_warpgroup_kernel_gives_the_mma_kernels_bits");
    // On: the environment's choice of warpgroup kernel (HOSTEMBED_MMV_WGMMA), or the default.
    let tuning = |on: bool| {
        let env = launch_tuning();
        kn::hostembed_tuning { mmv_wgmma: if on { env.mmv_wgmma.max(1) } else { 0 }, ..env }
    };
    // (rows, cols, n, bias, residual, ldy pad)
    let cases = [
        (4096, 4096, 64, false, false, 0),  // 8 column ranges, 8 tiles
        (1000, 1536, 9, true, true, 0),     // the fewest tokens it takes: 2 tiles
        (200, 4128, 16, true, false, 3),    // a last range of 32 columns
        (333, 768, 33, false, true, 0),     // 8 tiles, 33 tokens
        (14336, 1024, 40, false, false, 0), // two column ranges, 112 row blocks
        (40000, 512, 17, false, false, 0),  // one range: more row blocks than a split product has
        (130, 1024, 70, true, false, 0),    // 64 tokens, then 6 on the 1-tile kernel
        (64, 14336, 24, false, false, 0),   // a half row block, 4 tiles, 14 ranges
    ];
    for dtype in [DType::F16, DType::Bf16] {
        for &(rows, cols, n, bias, residual, pad) in &cases {
            let case = MmvCase { rows, cols, n, bias, residual, pad, cpu_check: true };
            assert_same_bits(
                &mut rng,
                dtype,
                case,
                true,
                [tuning(true), tuning(false)],
                ["the warpgroup kernel", "mma.sync"],
            );
        }
        for shape in [(14336, 512, 24), (64, 256, 20), (1000, 1024, 64), (300, 4096, 12)] {
            assert_same_bits_swiglu(
                &mut rng,
                dtype,
                shape,
                [tuning(true), tuning(false)],
                ["the warpgroup kernel", "mma.sync"],
            );
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
