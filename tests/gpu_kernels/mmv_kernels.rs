//! The tensor-core decode product's other kernels give the bits of the ones they stand in for: the tile
//! kernel (block formats past 8 tokens) the integer kernel's, the warpgroup products (half formats on
//! sm_90) mma.sync's.

use super::mmv::{MMV_TOL, assert_counters_reset, cpu_product, mmv_dtypes, mmv_work, run_mmv_tuned};
use super::{
    NULL_STREAM, SwigluCase, assert_close, cols_for, download, encode, launch_tuning, ok, poisoned, swiglu_case,
};
use crate::common::{Rng, gpu_present};
use hostembed::cuda::DeviceBuffer;
use hostembed::kernels as kn;
use hostembed::model::TensorRef;
use hostembed::tensor::DType;
use std::os::raw::{c_int, c_uint};

/// The launchers' settings as the environment gives them, with the block formats' kernel past 8 tokens
/// (`Tuning::mmv_tc_blocks`): 0 the integer kernel, 1 the tile kernel, 2 the tile kernel with two warps a
/// row set (in a build with `-DMMV_TUNING_KERNELS=1`; else the tile kernel again).
fn tile_tuning(kernel: c_int) -> kn::hostembed_tuning {
    kn::hostembed_tuning { mmv_tc_blocks: kernel, ..launch_tuning() }
}

/// The tile kernel's two builds, each named.
const TILE_KERNELS: [(c_int, &str); 2] = [(1, "the tile kernel"), (2, "the tile kernel, two warps a row set")];

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
            for (kernel, name) in TILE_KERNELS {
                let case = MmvCase { cols: cols_for(dtype, case.1), ..MmvCase::from(case) };
                assert_same_bits(
                    &mut rng,
                    dtype,
                    case,
                    false,
                    [tile_tuning(kernel), tile_tuning(0)],
                    [name, "the integer kernel"],
                );
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
            for (kernel, name) in TILE_KERNELS {
                let settings = [tile_tuning(kernel), tile_tuning(0)];
                assert_same_bits_swiglu(&mut rng, dtype, (rows, cols, n), settings, [name, "the integer kernel"]);
            }
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
    for (dtype, (kernel, name)) in mmv_block_dtypes().into_iter().flat_map(|d| TILE_KERNELS.map(|k| (d, k))) {
        let tuning = tile_tuning(kernel);
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
                    "mmv {} {rows}x{cols} ({name}): token {at} of {n} differs from alone in {differ} rows",
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
