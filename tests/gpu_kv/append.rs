//! The KV append's bytes in every type against the CPU's rounding of the kernel's own rotated K and V.

use super::{DeviceTables, HostPool, NULL_STREAM, download, launch_tuning, ok, pairs, poisoned, rope_config};
use crate::common::{Rng, gpu_present};
use hostembed::cuda::DeviceBuffer;
use hostembed::gpu::PAGE_TOKENS;
use hostembed::kv::KvType;
use hostembed::{cpu, kernels as kn};
use std::os::raw::{c_int, c_uint};
use std::ptr;

#[test]
fn the_kv_append_rounds_as_the_cpu_in_every_type() {
    if !gpu_present("the_kv_append_rounds_as_the_cpu_in_every_type") {
        return;
    }
    let mut rng = Rng::fresh("the_kv_append_rounds_as_the_cpu_in_every_type");
    for kv in pairs() {
        for (heads, kv_heads, hd, interleaved, qk_norm) in
            [(8, 2, 128, false, false), (6, 3, 64, true, true), (4, 4, 32, false, true), (2, 1, 256, true, false)]
        {
            let what = format!("{} append, {heads}/{kv_heads} heads of {hd}", kv.describe());
            let cfg = rope_config(heads, kv_heads, hd, interleaved);
            let inv_freq = cpu::rope_inv_freq(&cfg);
            let (q_dim, kv_dim) = (heads * hd, kv_heads * hd);
            let stride = q_dim + 2 * kv_dim + 5;
            // Tokens 0 and 1 of one stream, token 2 of another.
            let (n, window, token_stream) = (3usize, 2000usize, [0usize, 0, 1]);
            let mut pos: Vec<i32> = (0..n).map(|_| rng.below(window as u64) as i32).collect();
            if pos[1] == pos[0] {
                pos[1] = (pos[0] + 1) % window as i32;
            }
            // Values of several sizes, so blocks meet small and large maxima.
            let qkv: Vec<f32> = (0..n * stride).map(|i| rng.uniform() * [0.01, 1.0, 40.0][i % 3]).collect();
            let (qn, kn_w) = (rng.vec(hd, 1.0), rng.vec(hd, 1.0));
            let mut host = HostPool::new(kv, kv_heads, hd, 2 * window.div_ceil(PAGE_TOKENS) + 3);
            let tables = host.tables(&mut rng, &[window, window]);
            let dt = DeviceTables::new(&tables, &token_stream);
            let qkv_d = DeviceBuffer::from_slice(&qkv).unwrap();
            let pos_d = DeviceBuffer::from_slice(&pos).unwrap();
            let inv_d = DeviceBuffer::from_slice(&inv_freq).unwrap();
            let (qn_d, kn_d) = (DeviceBuffer::from_slice(&qn).unwrap(), DeviceBuffer::from_slice(&kn_w).unwrap());
            let pool = poisoned(host.bytes.len());
            ok(
                // SAFETY: device buffers sized for `n` rows of `stride` floats and a pool of `host.pages` pages with
                // their tables, alive until the synchronous check after the launch.
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
                        1e-6,
                        pool.ptr(),
                        dt.ptr(),
                        host.pages as c_uint,
                        kv.k as c_int,
                        kv.v as c_int,
                        launch_tuning(),
                        NULL_STREAM,
                    )
                },
                &what,
            );
            // The kernel's own rotated k (in qkv) and the v heads, rounded by the CPU into the host pool:
            // the device pool must hold exactly those bytes, and 0xFF everywhere else.
            let got_qkv: Vec<f32> = download(&qkv_d, n * stride);
            for t in 0..n {
                let table = &tables[token_stream[t]];
                for h in 0..kv_heads {
                    let k = &got_qkv[t * stride + q_dim + h * hd..][..hd];
                    let v = &got_qkv[t * stride + q_dim + kv_dim + h * hd..][..hd];
                    assert_eq!(v, &qkv[t * stride + q_dim + kv_dim + h * hd..][..hd], "{what}: v changed");
                    host.write(table, false, h, pos[t] as usize, k);
                    host.write(table, true, h, pos[t] as usize, v);
                }
            }
            let got: Vec<u8> = download(&pool, host.bytes.len());
            if let Some(i) = (0..got.len()).find(|&i| got[i] != host.bytes[i]) {
                let page = i / host.layout.page_bytes();
                panic!(
                    "{what}: pool byte {i} (page {page}, byte {} of it) is {:#04x}, the CPU's rounding {:#04x}",
                    i % host.layout.page_bytes(),
                    got[i],
                    host.bytes[i]
                );
            }
        }
    }
    // The launcher refuses a block type with heads of partial blocks, and an unknown type: every
    // pointer real and aligned, so only the type can be at fault.
    let buf = poisoned(1 << 16);
    let p = buf.ptr();
    // SAFETY: every pointer is one live, 16-byte aligned device buffer of 64 KiB, more than a single row reads; the
    // launcher refuses before launching.
    let call = |k: c_int, hd: usize| unsafe {
        kn::hostembed_rope_kv(
            p as *mut f32,
            1024,
            1,
            p as *const c_int,
            1,
            1,
            hd as c_uint,
            p as *const f32,
            0,
            ptr::null(),
            ptr::null(),
            1e-6,
            p,
            p as *const *const c_uint,
            1,
            k,
            KvType::Bf16 as c_int,
            launch_tuning(),
            NULL_STREAM,
        )
    };
    let invalid = 1; // cudaErrorInvalidValue
    assert_eq!(call(KvType::Q8_0 as c_int, 48), invalid, "Q8_0 with heads of 48");
    assert_eq!(call(KvType::Fp8E4m3 as c_int, 16), invalid, "FP8 with heads of 16");
    assert_eq!(call(0, 64), invalid, "ENGINE_KV_DEFAULT is not a type the kernels store");
    assert_eq!(call(6, 64), invalid, "no type 6");
}
