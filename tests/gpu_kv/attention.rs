//! Decode and flash attention over caches of every type and pairs of types, and sliding windows, against the CPU.

use super::{DeviceTables, HostPool, NULL_STREAM, download, fits, launch_tuning, ok, pairs, poisoned};
use crate::common::{Rng, gpu_present, rel_l2};
use hostembed::cuda::DeviceBuffer;
use hostembed::gpu::PAGE_TOKENS;
use hostembed::kv::{KvType, KvTypes};
use hostembed::tensor::DType;
use hostembed::{cpu, cuda, kernels as kn};
use std::ffi::c_void;
use std::os::raw::{c_int, c_uint};
use std::ptr;

/// The K and V of streams of (context, queries) in a typed pool, the queries at the last positions of
/// their context; the CPU's attention over the values the pool holds (each query's last `window`
/// positions when it is not 0).
struct AttentionCase {
    window: usize,
    q: Vec<f32>,
    q_stride: usize,
    pos: Vec<i32>,
    token_stream: Vec<usize>,
    tables: Vec<Vec<u32>>,
    pool: HostPool,
    want: Vec<f32>,
}

fn attention_case(
    rng: &mut Rng,
    kv: KvTypes,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    streams: &[(usize, usize)],
) -> AttentionCase {
    windowed_case(rng, kv, heads, kv_heads, hd, streams, 0)
}

/// `attention_case` with each query seeing its last `window` positions (0: all of them).
fn windowed_case(
    rng: &mut Rng,
    kv: KvTypes,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    streams: &[(usize, usize)],
    window: usize,
) -> AttentionCase {
    let kv_dim = kv_heads * hd;
    let q_stride = heads * hd + 16;
    let windows: Vec<usize> = streams.iter().map(|&(ctx, _)| ctx + 7).collect();
    let pages: usize = windows.iter().map(|w| w.div_ceil(PAGE_TOKENS)).sum::<usize>() + 5;
    let mut pool = HostPool::new(kv, kv_heads, hd, pages);
    let tables = pool.tables(rng, &windows);
    let (mut q, mut pos, mut token_stream, mut want) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (si, &(n_ctx, n)) in streams.iter().enumerate() {
        // [pos][kv_heads * hd] as cpu::attention reads them: the values the typed cache holds.
        let (mut k, mut v) = (vec![0f32; n_ctx * kv_dim], vec![0f32; n_ctx * kv_dim]);
        for p in 0..n_ctx {
            for h in 0..kv_heads {
                let (kr, vr) = (rng.vec(hd, 1.0), rng.vec(hd, 1.0));
                pool.write(&tables[si], false, h, p, &kr);
                pool.write(&tables[si], true, h, p, &vr);
                k[p * kv_dim + h * hd..][..hd].copy_from_slice(&pool.read(&tables[si], false, h, p));
                v[p * kv_dim + h * hd..][..hd].copy_from_slice(&pool.read(&tables[si], true, h, p));
            }
        }
        let qs = rng.vec(n * q_stride, 1.0);
        for t in 0..n {
            let p = n_ctx - n + t;
            let mut o = vec![0f32; heads * hd];
            // A window is attention over the positions it keeps (the keys are rotated already).
            let first = if window == 0 { 0 } else { (p + 1).saturating_sub(window) };
            let (k, v) = (&k[first * kv_dim..], &v[first * kv_dim..]);
            cpu::attention(
                &qs[t * q_stride..t * q_stride + heads * hd],
                k,
                v,
                p + 1 - first,
                heads,
                kv_heads,
                hd,
                &mut o,
            );
            want.extend(o);
            pos.push(p as i32);
            token_stream.push(si);
        }
        q.extend(qs);
    }
    AttentionCase { window, q, q_stride, pos, token_stream, tables, pool, want }
}

/// The decode attention of the case's tokens `tokens` (indices into its queries).
fn launch_attention(c: &AttentionCase, pool: &DeviceBuffer, tokens: &[usize], heads: usize, splits: usize) -> Vec<f32> {
    let (kv_heads, hd) = (c.pool.layout.kv_heads, c.pool.layout.head_dim);
    let n = tokens.len();
    let q: Vec<f32> = tokens.iter().flat_map(|&t| c.q[t * c.q_stride..(t + 1) * c.q_stride].to_vec()).collect();
    let pos: Vec<i32> = tokens.iter().map(|&t| c.pos[t]).collect();
    let streams: Vec<usize> = tokens.iter().map(|&t| c.token_stream[t]).collect();
    let dt = DeviceTables::new(&c.tables, &streams);
    let (qd, pd) = (DeviceBuffer::from_slice(&q).unwrap(), DeviceBuffer::from_slice(&pos).unwrap());
    let partial = poisoned(n * heads * splits * (hd + 2) * 4);
    let out = poisoned(n * heads * hd * 4);
    let kv = c.pool.layout.kv;
    ok(
        // SAFETY: device buffers sized for `n` queries, the pool's pages and tables, and `splits` parts of partial
        // results, alive until the synchronous check after the launch.
        unsafe {
            kn::hostembed_attention(
                qd.ptr() as *const f32,
                c.q_stride as c_uint,
                pool.ptr(),
                dt.ptr(),
                c.pool.pages as c_uint,
                kv.k as c_int,
                kv.v as c_int,
                pd.ptr() as *const c_int,
                n as c_uint,
                heads as c_uint,
                kv_heads as c_uint,
                hd as c_uint,
                1.0 / (hd as f32).sqrt(),
                c.window as c_uint,
                splits as c_uint,
                hostembed::gpu::attention_grid_parts(
                    pos.iter().map(|&p| (p + 1).max(0) as usize).max().unwrap_or(0),
                    splits,
                ) as c_uint,
                partial.ptr() as *mut f32,
                out.ptr() as *mut f32,
                launch_tuning(),
                NULL_STREAM,
            )
        },
        "hostembed_attention",
    );
    download(&out, n * heads * hd)
}

#[test]
fn decode_attention_reads_every_type_exactly() {
    if !gpu_present("decode_attention_reads_every_type_exactly") {
        return;
    }
    let mut rng = Rng::fresh("decode_attention_reads_every_type_exactly");
    // (heads, kv_heads, head_dim, streams of (context, tokens), parts)
    type Shape = (usize, usize, usize, &'static [(usize, usize)], usize);
    let shapes: [Shape; 6] = [
        (32, 8, 128, &[(300, 1), (17, 1), (513, 1)], 32), // the Llama-3 8B heads, a decode batch
        (14, 2, 64, &[(1000, 3), (40, 2)], 16),           // groups of 7
        (16, 2, 256, &[(200, 1)], 9),                     // the largest head, groups of 8
        (8, 2, 96, &[(129, 4), (33, 1)], 3),              // a head between the kernel's sizes
        (8, 8, 32, &[(77, 2)], 1),                        // no grouping, one part
        (8, 4, 128, &[(3, 2), (2, 1)], 16),               // more parts than positions
    ];
    for kv in pairs() {
        for &(heads, kv_heads, hd, streams, splits) in &shapes {
            if !fits(kv, hd) {
                continue;
            }
            let c = attention_case(&mut rng, kv, heads, kv_heads, hd, streams);
            let pool = DeviceBuffer::from_slice(&c.pool.bytes).unwrap();
            let all: Vec<usize> = (0..c.pos.len()).collect();
            let got = launch_attention(&c, &pool, &all, heads, splits);
            let what = format!("{} attention, {heads}/{kv_heads} heads of {hd}, streams {streams:?}", kv.describe());
            assert!(got.iter().all(|v| v.is_finite()), "{what}: an output not written");
            let err = rel_l2(&got, &c.want);
            println!("{what}: relative L2 {err:.2e}");
            assert!(err < 1e-4, "{what}: relative L2 {err:.3e} against the CPU on the cache's values");
            // A stream's tokens alone give the bits they give in the batch.
            let width = heads * hd;
            for si in 0..streams.len() {
                let mine: Vec<usize> = all.iter().copied().filter(|&t| c.token_stream[t] == si).collect();
                let alone = launch_attention(&c, &pool, &mine, heads, splits);
                for (k, &t) in mine.iter().enumerate() {
                    let (a, b) = (&alone[k * width..(k + 1) * width], &got[t * width..(t + 1) * width]);
                    assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "{what}: stream {si} alone");
                }
            }
        }
    }
}

/// Sliding windows (of fewer, as many and more positions than the kernels' 32-position units and
/// 128-position tiles, and wider than the context) in the decode kernel and in flash attention, against
/// the CPU's attention over the window's positions; a stream alone gives the bits it gives in a batch.
#[test]
fn windowed_attention_sees_only_the_window() {
    if !gpu_present("windowed_attention_sees_only_the_window") {
        return;
    }
    let mut rng = Rng::fresh("windowed_attention_sees_only_the_window");
    let streams: &[(usize, usize)] = &[(300, 3), (17, 1), (513, 2), (129, 1)];
    for kv in [KvTypes::GPU_DEFAULT, KvTypes::same(KvType::F32), KvTypes::same(KvType::Q8_0)] {
        for window in [1, 7, 31, 32, 33, 100, 128, 129, 1000] {
            let (heads, kv_heads, hd) = (8, 2, 64);
            let c = windowed_case(&mut rng, kv, heads, kv_heads, hd, streams, window);
            let pool = DeviceBuffer::from_slice(&c.pool.bytes).unwrap();
            let all: Vec<usize> = (0..c.pos.len()).collect();
            let what = format!("{} window {window}", kv.describe());
            for splits in [1, 7, 32] {
                let got = launch_attention(&c, &pool, &all, heads, splits);
                let err = rel_l2(&got, &c.want);
                assert!(err < 1e-4, "{what}, {splits} parts: relative L2 {err:.3e} against the CPU");
                let width = heads * hd;
                for si in 0..streams.len() {
                    let mine: Vec<usize> = all.iter().copied().filter(|&t| c.token_stream[t] == si).collect();
                    let alone = launch_attention(&c, &pool, &mine, heads, splits);
                    for (k, &t) in mine.iter().enumerate() {
                        let (a, b) = (&alone[k * width..(k + 1) * width], &got[t * width..(t + 1) * width]);
                        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "{what}: stream {si} alone");
                    }
                }
            }
            if kv.k == KvType::F32 {
                continue; // flash takes no F32 cache
            }
            // A prompt chunk of 150 queries from position 90 (flash attention over one stream).
            let c = windowed_case(&mut rng, kv, heads, kv_heads, hd, &[(240, 150)], window);
            let pool = DeviceBuffer::from_slice(&c.pool.bytes).unwrap();
            let out = poisoned(150 * heads * hd * 2);
            ok(flash(&c, &pool, kv, hd, heads, kv_heads, 150, &out, DType::F16, 0), &what);
            let bits: Vec<u16> = download(&out, 150 * heads * hd);
            let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
            let mut got = vec![0f32; 150 * heads * hd];
            hostembed::tensor::decode_row(DType::F16, &bytes, &mut got);
            let err = rel_l2(&got, &c.want);
            println!("{what}: flash relative L2 {err:.2e}");
            assert!(err < 1e-2, "{what}: flash relative L2 {err:.3e}");
        }
    }
}

#[test]
fn decode_attention_at_a_long_context_in_the_8_bit_types() {
    if !gpu_present("decode_attention_at_a_long_context_in_the_8_bit_types") {
        return;
    }
    let mut rng = Rng::fresh("decode_attention_at_a_long_context_in_the_8_bit_types");
    for t in [KvType::Q8_0, KvType::Fp8E4m3, KvType::Bf16] {
        let c = attention_case(&mut rng, KvTypes::same(t), 32, 8, 128, &[(16384, 1), (5, 1)]);
        let pool = DeviceBuffer::from_slice(&c.pool.bytes).unwrap();
        let got = launch_attention(&c, &pool, &[0, 1], 32, 32);
        let err = rel_l2(&got, &c.want);
        println!("{} attention at 16k: relative L2 {err:.2e}", t.name());
        assert!(err < 1e-4, "{} at 16k: {err:.3e}", t.name());
    }
}

#[test]
fn flash_attention_reads_every_type_but_f32() {
    if !gpu_present("flash_attention_reads_every_type_but_f32") {
        return;
    }
    let mut rng = Rng::fresh("flash_attention_reads_every_type_but_f32");
    for kv in pairs().into_iter().filter(|p| p.k != KvType::F32 && p.v != KvType::F32) {
        for d in [16usize, 32, 64, 128] {
            if !fits(kv, d) {
                continue;
            }
            for &(heads, kv_heads) in &[(8usize, 2usize), (7, 1)] {
                for &(p0, n) in &[(0usize, 64usize), (37, 63), (130, 200)] {
                    for out in [DType::Bf16, DType::F16] {
                        run_flash(&mut rng, kv, d, heads, kv_heads, p0, n, out);
                    }
                }
            }
        }
    }
    // F32 goes to the split kernel: flash attention refuses it, and a block type on partial blocks.
    let c = attention_case(&mut rng, KvTypes::same(KvType::F32), 4, 2, 64, &[(8, 8)]);
    let pool = DeviceBuffer::from_slice(&c.pool.bytes).unwrap();
    for (k, v, d) in
        [(KvType::F32, KvType::Bf16, 64), (KvType::Bf16, KvType::F32, 64), (KvType::Q8_0, KvType::Q8_0, 16)]
    {
        let code = flash(&c, &pool, KvTypes { k, v }, d, 4, 2, 8, &poisoned(8 * 4 * d * 2), DType::Bf16, 0);
        assert_eq!(code, 1, "flash attention with K {} and V {} at head_dim {d}", k.name(), v.name());
    }
}

/// hostembed_flash_attention over the case's first `n` queries (one stream), into `out`; with a stage
/// of `stage_tokens` positions (hostembed_flash_stage over the stream's `n` positions first) unless 0.
#[allow(clippy::too_many_arguments)]
fn flash(
    c: &AttentionCase,
    pool: &DeviceBuffer,
    kv: KvTypes,
    d: usize,
    heads: usize,
    kv_heads: usize,
    n: usize,
    out: &DeviceBuffer,
    dtype: DType,
    stage_tokens: usize,
) -> c_int {
    let (qb, tb, pb) = (
        DeviceBuffer::from_slice(&c.q).unwrap(),
        DeviceBuffer::from_slice(&c.tables[0]).unwrap(),
        DeviceBuffer::from_slice(&c.pos).unwrap(),
    );
    let ctx = c.pos[..n].iter().map(|&p| p + 1).max().unwrap_or(0) as usize;
    // Poisoned, so that a tile the stage kernel should write and does not shows in the output.
    let stage = poisoned((2 * stage_tokens * kv_heads * d * 2).max(16));
    if stage_tokens > 0 {
        // SAFETY: the pool, its table and the stage are live device buffers sized for the case and `stage_tokens`,
        // alive until the synchronize below (a launch that fails queues nothing).
        let code = unsafe {
            kn::hostembed_flash_stage(
                pool.ptr(),
                tb.ptr() as *const c_uint,
                c.pool.pages as c_uint,
                kv.k as c_int,
                kv.v as c_int,
                kv_heads as c_uint,
                d as c_uint,
                ctx as c_uint,
                stage.ptr(),
                stage_tokens as c_uint,
                NULL_STREAM,
            )
        };
        if code != 0 {
            return code;
        }
    }
    // SAFETY: device buffers sized for the case's `n` queries, its pool and table, and `n` rows of `heads * d` out,
    // alive until the synchronize below.
    let code = unsafe {
        kn::hostembed_flash_attention(
            qb.ptr() as *const f32,
            c.q_stride as c_uint,
            pool.ptr(),
            tb.ptr() as *const c_uint,
            c.pool.pages as c_uint,
            kv.k as c_int,
            kv.v as c_int,
            pb.ptr() as *const c_int,
            n as c_uint,
            heads as c_uint,
            kv_heads as c_uint,
            d as c_uint,
            1.0 / (d as f32).sqrt(),
            c.window as c_uint,
            out.ptr(),
            dtype as c_int,
            (heads * d) as c_uint,
            if stage_tokens > 0 { stage.ptr() as *const c_void } else { ptr::null() },
            stage_tokens as c_uint,
            ctx as c_uint,
            NULL_STREAM,
        )
    };
    cuda::synchronize().unwrap_or_else(|e| panic!("flash attention while running: {e}"));
    code
}

#[allow(clippy::too_many_arguments)]
fn run_flash(rng: &mut Rng, kv: KvTypes, d: usize, heads: usize, kv_heads: usize, p0: usize, n: usize, out: DType) {
    let c = attention_case(rng, kv, heads, kv_heads, d, &[(p0 + n, n)]);
    let pool = DeviceBuffer::from_slice(&c.pool.bytes).unwrap();
    let ob = poisoned(n * heads * d * 2);
    let what = format!("flash {} d {d} heads {heads}/{kv_heads} from {p0}, {n} queries, {}", kv.describe(), out.name());
    ok(flash(&c, &pool, kv, d, heads, kv_heads, n, &ob, out, 0), &what);
    let bits: Vec<u16> = download(&ob, n * heads * d);
    // An 8-bit half read from a stage (one tile of it, then all) gives the same bits.
    if kv.k.is_block() || kv.v.is_block() {
        for stage_tokens in [64, (p0 + n).next_multiple_of(64) + 64] {
            let staged = poisoned(n * heads * d * 2);
            ok(flash(&c, &pool, kv, d, heads, kv_heads, n, &staged, out, stage_tokens), &what);
            let got: Vec<u16> = download(&staged, n * heads * d);
            assert!(got == bits, "{what}: a stage of {stage_tokens} positions changed the output");
        }
    }
    let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
    let mut got = vec![0f32; n * heads * d];
    hostembed::tensor::decode_row(out, &bytes, &mut got);
    assert!(got.iter().all(|v| v.is_finite()), "{what}: an output not written");
    let err = rel_l2(&got, &c.want);
    println!("{what}: relative L2 {err:.2e}");
    assert!(err < 1e-2, "{what}: relative L2 {err:.3e}");
}
