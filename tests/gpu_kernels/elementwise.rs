//! RMSNorm and the GLU-and-add kernels against the CPU.

use super::{NULL_STREAM, assert_close, download, launch_tuning, ok, poisoned};
use crate::common::{Rng, gpu_present};
use hostembed::cuda::DeviceBuffer;
use hostembed::tensor::DType;
use hostembed::{cpu, kernels as kn};
use std::os::raw::{c_int, c_uint};

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
        let got = download::<f32>(out.as_ref().unwrap_or(&xb), n * cols);
        assert_close(&format!("rmsnorm {n}x{cols} in place {in_place}"), &got, &want, 1e-5);
    }
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
        assert_close(name, &download::<f32>(&out, len), &want, tol);
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
    assert_close("add", &download::<f32>(&gd, len), &sum, 1e-7);
}
