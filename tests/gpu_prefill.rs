//! The prompt path on the GPU: the tensor-core product, the weight conversion, the half-format writers
//! and flash attention against the CPU oracle on fresh random data with poisoned outputs; then whole
//! prompts (2,048 tokens on each architecture, 32,768 on a small model, chunk boundaries) against the
//! CPU backend and against stepping the same prompt one token at a time. Skips where no CUDA device is
//! present. Run it once more with HOSTEMBED_CUBLASLT=0 to cover the library's own product kernel.

mod common;
use common::{prompt_base as base, prompt_configs as configs, rows_on_card};

use std::os::raw::{c_int, c_uint, c_void};
use std::ptr;

use common::{PagedKv, Rng, gpu_present, rel_l2};
use hostembed::Status;
use hostembed::checkpoint::write::MemSource;
use hostembed::cpu::{self, CpuModel};
use hostembed::cuda::{self, DeviceBuffer};
use hostembed::gpu::{GpuModel, PAGE_TOKENS};
use hostembed::kernels as kn;
use hostembed::kv::KvType;
use hostembed::model::{Arch, ModelConfig};
use hostembed::sampler::Sampling;
use hostembed::tensor::{DType, FORMATS, decode_row, encode_row};
use hostembed::tuning::Tuning;

/// The launchers' settings as the environment gives them (what an engine would run with).
fn launch_tuning() -> kn::hostembed_tuning {
    kn::hostembed_tuning::of(&Tuning::from_env())
}

const NULL_STREAM: *mut c_void = ptr::null_mut();

fn ok(code: c_int, what: &str) {
    cuda::check(code, what).unwrap_or_else(|e| panic!("{what}: {e}"));
    cuda::synchronize().unwrap_or_else(|e| panic!("{what} while running: {e}"));
}

fn poisoned(bytes: usize) -> DeviceBuffer {
    let b = DeviceBuffer::new(bytes.max(1)).unwrap();
    b.fill_bytes(0xFF).unwrap();
    b
}

fn download<T: Copy + Default>(b: &DeviceBuffer, n: usize) -> Vec<T> {
    let mut out = vec![T::default(); n];
    b.download(&mut out).unwrap();
    out
}

/// Values of a half format (2 bytes each, little-endian) as f32.
fn halves_to_f32(dtype: DType, bits: &[u16]) -> Vec<f32> {
    let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
    let mut out = vec![0f32; bits.len()];
    decode_row(dtype, &bytes, &mut out);
    out
}

/// `values` rounded to the half format, as its bits and as the f32 they now are.
fn to_half(dtype: DType, values: &[f32]) -> (Vec<u16>, Vec<f32>) {
    let bytes = encode_row(dtype, values);
    let bits: Vec<u16> = bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
    let back = halves_to_f32(dtype, &bits);
    (bits, back)
}

fn finite(what: &str, v: &[f32]) {
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        panic!("{what}: element {i} of {} is {} (not written?)", v.len(), v[i]);
    }
}

const HALVES: [DType; 2] = [DType::Bf16, DType::F16];

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

#[test]
fn flash_attention_matches_cpu() {
    if !gpu_present("flash_attention_matches_cpu") {
        return;
    }
    let mut rng = Rng::fresh("flash_attention_matches_cpu");
    for d in [16usize, 32, 64, 128] {
        // SAFETY: a host-side check on a head size; nothing is read.
        assert_eq!(unsafe { kn::hostembed_flash_head_dim(d as c_uint) }, 0, "head_dim {d} has a kernel");
        for &(heads, kv_heads) in &[(8usize, 2usize), (4, 4), (7, 1)] {
            for &(p0, n) in &[(0usize, 1usize), (0, 64), (0, 65), (37, 63), (130, 200), (5, 300)] {
                for out in HALVES {
                    run_flash(&mut rng, d, heads, kv_heads, p0, n, out);
                }
            }
        }
    }
    for d in [8u32, 24, 96, 256] {
        // SAFETY: a host-side check on a head size; nothing is read.
        assert_ne!(unsafe { kn::hostembed_flash_head_dim(d) }, 0, "head_dim {d} claims a kernel");
    }
}

fn run_flash(rng: &mut Rng, d: usize, heads: usize, kv_heads: usize, p0: usize, n: usize, out: DType) {
    let window = p0 + n + 19;
    let kv_dim = kv_heads * d;
    let q_stride = heads * d + 2 * kv_dim;
    let ctx = p0 + n;
    // The stream's pages, scattered over a pool with pages to spare: K and V rounded to bf16 for the
    // first ctx positions, 0xFFFF (NaN) everywhere else.
    let mut kv = PagedKv::new(window.div_ceil(PAGE_TOKENS) + 7, kv_heads, d);
    let table = kv.tables(rng, &[window]).remove(0);
    let mut k = vec![0f32; ctx * kv_dim]; // [pos][kv_head * d], as cpu::attention reads it
    let mut v = k.clone();
    for (is_v, flat) in [(false, &mut k), (true, &mut v)] {
        let (b, f) = to_half(DType::Bf16, &rng.vec(kv_heads * ctx * d, 1.0));
        for h in 0..kv_heads {
            for p in 0..ctx {
                for c in 0..d {
                    let i = (h * ctx + p) * d + c;
                    let at = kv.at(&table, is_v, h, p, c);
                    kv.bits[at] = b[i];
                    flat[p * kv_dim + h * d + c] = f[i];
                }
            }
        }
    }
    let q = rng.vec(n * q_stride, 1.0);
    let pos: Vec<i32> = (0..n).map(|t| (p0 + t) as i32).collect();
    let mut want = vec![0f32; n * heads * d];
    for t in 0..n {
        let qt = &q[t * q_stride..t * q_stride + heads * d];
        cpu::attention(qt, &k, &v, p0 + t + 1, heads, kv_heads, d, &mut want[t * heads * d..(t + 1) * heads * d]);
    }
    let (qb, kvb, tb, pb) = (
        DeviceBuffer::from_slice(&q).unwrap(),
        DeviceBuffer::from_slice(&kv.bits).unwrap(),
        DeviceBuffer::from_slice(&table).unwrap(),
        DeviceBuffer::from_slice(&pos).unwrap(),
    );
    let ob = poisoned(n * heads * d * 2);
    let what = format!("flash d {d} heads {heads}/{kv_heads} from {p0}, {n} queries, {}", out.name());
    ok(
        // SAFETY: device buffers sized for these shapes (q, the pool's pages and its table, positions, and `n` rows of
        // `heads * d` halves out), alive until the check after the launch.
        unsafe {
            kn::hostembed_flash_attention(
                qb.ptr() as *const f32,
                q_stride as c_uint,
                kvb.ptr(),
                tb.ptr() as *const c_uint,
                kv.pages as c_uint,
                KvType::Bf16 as c_int,
                KvType::Bf16 as c_int,
                pb.ptr() as *const c_int,
                n as c_uint,
                heads as c_uint,
                kv_heads as c_uint,
                d as c_uint,
                1.0 / (d as f32).sqrt(),
                0,
                ob.ptr(),
                out as c_int,
                (heads * d) as c_uint,
                ptr::null(),
                0,
                0,
                NULL_STREAM,
            )
        },
        &what,
    );
    let got = halves_to_f32(out, &download::<u16>(&ob, n * heads * d));
    finite(&what, &got);
    let err = rel_l2(&got, &want);
    println!("{what}: relative L2 {err:.2e}");
    assert!(err < 1e-2, "{what}: relative L2 {err:.3e}");
}

// ---------------------------------------------------------------------------------------------------
// Whole prompts.

fn model(cfg: ModelConfig, dtype: DType, seed: u64) -> MemSource {
    MemSource::synthetic(&cfg, seed, dtype)
}

fn random_tokens(rng: &mut Rng, vocab: usize, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
}

#[test]
fn prompt_logits_match_cpu_on_every_architecture() {
    if !gpu_present("prompt_logits_match_cpu_on_every_architecture") {
        return;
    }
    let mut rng = Rng::fresh("prompt_logits_match_cpu_on_every_architecture");
    let n = 2048;
    for (name, cfg) in configs() {
        let src = model(cfg.clone(), DType::Bf16, rng.next_u64());
        let (_rows_buf, rows) = rows_on_card(&src);
        let mut gpu = GpuModel::load(&src, rows, 512, 3 * (n + 64) / PAGE_TOKENS, &Tuning::from_env()).unwrap();
        let mut pool = gpu.page_pool().unwrap();
        println!("{name}: {}", gpu.prompt_route());
        // HOSTEMBED_CUBLASLT=0 (the suite's second run) is the library's own kernel, and the route says so.
        let own = std::env::var("HOSTEMBED_CUBLASLT").is_ok_and(|v| v == "0");
        let says_own =
            gpu.prompt_route().contains("hostembed's tensor-core kernel (no cuBLASLt: HOSTEMBED_CUBLASLT=0)");
        assert_eq!(says_own, own, "{name}: {}", gpu.prompt_route());
        let tokens = random_tokens(&mut rng, cfg.vocab, n);
        let mut gs = gpu.new_stream(n + 64).unwrap();
        let got = gpu.all_logits(&mut pool, &mut gs, &tokens).unwrap();
        // The CPU with the GPU's cache type rounds K and V as the GPU does: what is left is the GPU's own
        // arithmetic (at the first positions a BF16 cache's rounding of V alone is ~1e-3).
        let cpu = CpuModel::new(&src).unwrap().with_kv_types(gpu.kv_types()).unwrap();
        let mut cs = cpu.new_stream(n + 64);
        let want = cpu.forward_all(&mut cs, &tokens).unwrap();
        // The CPU backend as it runs by default (an F32 cache): printed beside, for the cache's share.
        let cpu_f32 = CpuModel::new(&src).unwrap();
        let mut fs = cpu_f32.new_stream(n + 64);
        let want_f32 = cpu_f32.forward_all(&mut fs, &tokens).unwrap();
        let mut worst = 0f64;
        for p in [0, 1, 15, 16, 511, 512, 1000, 1537, n - 1] {
            let e = rel_l2(&got[p], &want[p]);
            let e_f32 = rel_l2(&got[p], &want_f32[p]);
            println!("{name}: position {p}: relative L2 {e:.2e} (against an F32-cache CPU {e_f32:.2e})");
            worst = worst.max(e);
        }
        assert!(worst <= 2e-3, "{name}: prompt logits differ from the CPU's by {worst:.3e}");

        // The same prompt in one step, then 64 greedy tokens, against the prompt stepped token by token.
        let mut one = gpu.new_stream(n + 64).unwrap();
        let mut by_token = gpu.new_stream(n + 64).unwrap();
        let mut a = gpu.step(&mut pool, &mut one, &tokens, &Sampling::GREEDY, 0).unwrap();
        let mut b = 0;
        for &t in &tokens {
            b = gpu.step(&mut pool, &mut by_token, &[t], &Sampling::GREEDY, 0).unwrap();
        }
        let mut differ = 0;
        for i in 0..64 {
            differ += (a != b) as usize;
            assert_eq!(a, b, "{name}: greedy token {i} after the prompt: {a} in one step, {b} token by token");
            a = gpu.step(&mut pool, &mut one, &[a], &Sampling::GREEDY, 0).unwrap();
            b = gpu.step(&mut pool, &mut by_token, &[b], &Sampling::GREEDY, 0).unwrap();
        }
        println!("{name}: 64 greedy tokens after the prompt, {differ} differ between one step and token by token");
    }
}

#[test]
fn a_32k_prompt_matches_cpu_at_the_last_position() {
    if !gpu_present("a_32k_prompt_matches_cpu_at_the_last_position") {
        return;
    }
    let mut rng = Rng::fresh("a_32k_prompt_matches_cpu_at_the_last_position");
    let cfg = ModelConfig { hidden: 128, heads: 2, kv_heads: 1, head_dim: 64, intermediate: 256, ..base(Arch::Llama) };
    let n = 32768;
    let src = model(cfg.clone(), DType::Bf16, rng.next_u64());
    let (_rows_buf, rows) = rows_on_card(&src);
    let mut gpu = GpuModel::load(&src, rows, 2048, n / PAGE_TOKENS, &Tuning::from_env()).unwrap();
    let mut pool = gpu.page_pool().unwrap();
    let tokens = random_tokens(&mut rng, cfg.vocab, n);
    let mut gs = gpu.new_stream(n).unwrap();
    gpu.step(&mut pool, &mut gs, &tokens, &Sampling::GREEDY, 0).unwrap();
    let got = gpu.last_logits().unwrap();
    let cpu = CpuModel::new(&src).unwrap();
    let mut cs = cpu.new_stream(n);
    let t = std::time::Instant::now();
    let want = cpu.forward(&mut cs, &tokens).unwrap();
    let err = rel_l2(&got, &want);
    println!(
        "32768-token prompt: relative L2 at the last position {err:.2e} (CPU took {:.1} s)",
        t.elapsed().as_secs_f64()
    );
    assert!(err <= 2e-3, "32k prompt: {err:.3e}");
}

#[test]
fn chunk_boundaries_and_refusals() {
    if !gpu_present("chunk_boundaries_and_refusals") {
        return;
    }
    let mut rng = Rng::fresh("chunk_boundaries_and_refusals");
    let (_, cfg) = configs().remove(0);
    let src = model(cfg.clone(), DType::Bf16, rng.next_u64());
    let (_rows_buf, rows) = rows_on_card(&src);
    let chunk = 64;
    let mut gpu = GpuModel::load(&src, rows, chunk, 512, &Tuning::from_env()).unwrap();
    let mut pool = gpu.page_pool().unwrap();
    let cpu = CpuModel::new(&src).unwrap();
    for len in [1, chunk - 1, chunk, chunk + 1, 3 * chunk + 17] {
        let tokens = random_tokens(&mut rng, cfg.vocab, len);
        // A stream that already holds 10 tokens, so a chunk starts in the middle of a KV tile.
        let lead = random_tokens(&mut rng, cfg.vocab, 10);
        let mut gs = gpu.new_stream(512).unwrap();
        let mut cs = cpu.new_stream(512);
        gpu.step(&mut pool, &mut gs, &lead, &Sampling::GREEDY, 0).unwrap();
        cpu.forward(&mut cs, &lead).unwrap();
        gpu.step(&mut pool, &mut gs, &tokens, &Sampling::GREEDY, 0).unwrap();
        let want = cpu.forward(&mut cs, &tokens).unwrap();
        let err = rel_l2(&gpu.last_logits().unwrap(), &want);
        println!("prompt of {len} after 10, chunks of {chunk}: relative L2 {err:.2e}");
        assert!(err <= 2e-3, "prompt of {len}: {err:.3e}");
    }
    // Past the window: NO_ROOM at any chunk count, nothing appended, the last logits kept.
    let mut gs = gpu.new_stream(200).unwrap();
    gpu.step(&mut pool, &mut gs, &random_tokens(&mut rng, cfg.vocab, 50), &Sampling::GREEDY, 0).unwrap();
    let before = gpu.last_logits().unwrap();
    for extra in [151, 200, 3 * chunk + 151] {
        let e =
            gpu.step(&mut pool, &mut gs, &random_tokens(&mut rng, cfg.vocab, extra), &Sampling::GREEDY, 0).unwrap_err();
        assert_eq!(e.status, Status::NoRoom, "{extra} tokens past a 200 window: {e}");
        assert_eq!(gs.len(), 50, "a refused prompt appended tokens");
        assert_eq!(gpu.last_logits().unwrap(), before, "a refused prompt changed the logits");
    }
}
