//! Shared by the test files: the GPU suite's skip rule and small deterministic random data.
#![allow(dead_code)]

use hostembed::Status;

/// True when a CUDA device is usable; otherwise prints one skip line naming the reason.
pub fn gpu_present(test: &str) -> bool {
    match hostembed::cuda::require_device(0) {
        Ok(()) => true,
        Err(e) if matches!(e.status, Status::NoCuda | Status::NoDevice) => {
            println!("SKIP {test}: no CUDA device ({})", e.message);
            false
        }
        Err(e) => panic!("{test}: device probe failed: {e}"),
    }
}

/// splitmix64: fresh, reproducible data without a rand dependency.
pub struct Rng(pub u64);

impl Rng {
    /// Seeded from the clock so every run draws new data; the seed is printed for replay.
    pub fn fresh(test: &str) -> Rng {
        let seed = std::env::var("HOSTEMBED_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
        });
        println!("{test}: seed {seed} (HOSTEMBED_TEST_SEED={seed} replays it)");
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}
