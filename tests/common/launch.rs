//! What the kernel tests share: the launchers' settings, a launch's check, and device buffers poisoned
//! before a kernel writes them and read back after.

use hostembed::cuda::{self, DeviceBuffer};
use hostembed::kernels as kn;
use hostembed::tuning::Tuning;
use std::os::raw::{c_int, c_void};

/// The launchers' settings as the environment gives them (what an engine would run with).
pub fn launch_tuning() -> kn::hostembed_tuning {
    kn::hostembed_tuning::of(&Tuning::from_env())
}

pub const NULL_STREAM: *mut c_void = std::ptr::null_mut();

/// Fails on a launch error and on any error the kernel raised while running.
pub fn ok(code: c_int, what: &str) {
    cuda::check(code, what).unwrap_or_else(|e| panic!("{what}: {e}"));
    cuda::synchronize().unwrap_or_else(|e| panic!("{what} while running: {e}"));
}

/// A device buffer of `bytes` (at least one) with every byte 0xFF (every f32 a NaN).
pub fn poisoned(bytes: usize) -> DeviceBuffer {
    let b = DeviceBuffer::new(bytes.max(1)).unwrap();
    b.fill_bytes(0xFF).unwrap();
    b
}

/// The first `n` values of `b`.
pub fn download<T: Copy + Default>(b: &DeviceBuffer, n: usize) -> Vec<T> {
    let mut out = vec![T::default(); n];
    b.download(&mut out).unwrap();
    out
}
