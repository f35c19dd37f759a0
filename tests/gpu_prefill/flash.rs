//! Flash attention against the CPU.

use super::{HALVES, NULL_STREAM, download, finite, halves_to_f32, ok, poisoned, to_half};
use crate::common::{PagedKv, Rng, gpu_present, rel_l2};
use hostembed::cuda::DeviceBuffer;
use hostembed::gpu::PAGE_TOKENS;
use hostembed::kv::KvType;
use hostembed::tensor::DType;
use hostembed::{cpu, kernels as kn};
use std::os::raw::{c_int, c_uint};
use std::ptr;

#[test]
fn flash_attention_matches_cpu() {
    if !gpu_present("flash_attention_matches_cpu") {
        return;
    }
    let mut rng = Rng::fresh("flash_attention_matches_cpu");
    for d in [16usize, 32, 64, 128, 256] {
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
    for d in [8u32, 24, 96, 192, 512] {
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
