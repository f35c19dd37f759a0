//! Shared by the test files: the GPU suite's skip rule, small deterministic random data, the C ABI calls
//! the tests make, the model files they find, and the loop that checks random batches against stepping
//! each stream alone.
#![allow(dead_code)]

pub mod abi;
pub mod batches;
pub mod card;
pub mod compare;
pub mod gemma3;
pub mod launch;
pub mod models;
pub mod shared;
pub mod spec;

// Each test file uses some of these; they keep the names the files use (common::init, common::Rng).
#[allow(unused_imports)]
pub use abi::*;
#[allow(unused_imports)]
pub use batches::*;
#[allow(unused_imports)]
pub use compare::*;
#[allow(unused_imports)]
pub use models::*;

use hostembed::Status;
use hostembed::checkpoint::write::{Recipe, write_synthetic_gguf, write_synthetic_hf};
use hostembed::model::ModelConfig;
use hostembed::sampler::splitmix64;
use hostembed::tensor::DType;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

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
        let out = splitmix64(self.0);
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        out
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

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.uniform() + 1.0) / 2.0
    }

    /// `n` token ids below `vocab`.
    pub fn ids(&mut self, vocab: usize, n: usize) -> Vec<i32> {
        (0..n).map(|_| self.below(vocab as u64) as i32).collect()
    }

    /// `items` shuffled.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i as u64 + 1) as usize);
        }
    }
}

/// A fresh folder under HOSTEMBED_TEST_TMP (or the system's temp dir), removed when dropped. Named
/// after the test binary, the test and the process, so concurrent runs never share one.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let base = std::env::var_os("HOSTEMBED_TEST_TMP").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
        let dir = base.join(format!("hostembed-{}-{name}-{}-{n}", env!("CARGO_CRATE_NAME"), std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// An HF folder of synthetic weights named `name` inside this folder.
    pub fn hf(&self, name: &str, cfg: &ModelConfig, seed: u64, dtype: DType) -> PathBuf {
        let p = self.0.join(name);
        write_synthetic_hf(&p, cfg, seed, dtype).unwrap();
        p
    }

    /// A GGUF file of synthetic weights named `name`.gguf inside this folder, its matrices in the
    /// recipe's formats (a `DType` for all of them).
    pub fn gguf(&self, name: &str, cfg: &ModelConfig, seed: u64, recipe: impl Into<Recipe>) -> PathBuf {
        let p = self.0.join(format!("{name}.gguf"));
        write_synthetic_gguf(&p, cfg, seed, recipe).unwrap();
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The environment and the process-wide memory counters are shared by every test in a binary.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

pub fn c_path(p: &Path) -> std::ffi::CString {
    std::ffi::CString::new(p.to_str().unwrap()).unwrap()
}

/// A model file the suite does not write itself (CI and scripts/gpu-build.sh put it there): under
/// HOSTEMBED_TEST_MODELS when set (the GPU bundle's copy), else the source tree's models/. None, after
/// a SKIP line saying what writes it, when it is absent.
pub fn model_file(name: &str, written_by: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("HOSTEMBED_TEST_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("models"));
    let path = dir.join(name);
    if path.is_file() {
        Some(path)
    } else {
        println!("SKIP: {} is absent ({written_by})", path.display());
        None
    }
}

/// Sets the environment variable `name` to `value`, or removes it for None.
pub fn set_env(name: &str, value: Option<&std::ffi::OsStr>) {
    // SAFETY: every test that reads or writes the environment holds `serial()`.
    unsafe {
        match value {
            Some(v) => std::env::set_var(name, v),
            None => std::env::remove_var(name),
        }
    }
}
