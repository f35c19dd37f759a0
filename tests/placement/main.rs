//! The placement side of engine_init_fit without a GPU: the fit inputs an engine derives from a
//! checkpoint, options and DS4_EMBD_MMAP, the CPU backend's rows, failed loads that hold nothing, bad
//! checkpoints and NULLs through the C functions.

#[path = "../common/mod.rs"]
mod common;

mod cpu_rows;
mod failures;
mod options;
mod plan;

use common::set_env;
use hostembed::engine;
use hostembed::engine::{engine_backend, engine_options};
use hostembed::model::{Arch, ModelConfig, RopeScaling};

fn config(vocab: usize, hidden: usize, tied: bool) -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab,
        hidden,
        layers: 3,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        intermediate: 96,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 2048,
        tied,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: Some(1),
        eos: Some(2),
        moe: None,
    }
}

fn cpu_options() -> engine_options {
    engine_options { backend: engine_backend::Cpu, ..engine::default_options() }
}

fn set_mmap_env(value: Option<&str>) {
    set_env(engine::MMAP_ROWS_ENV, value.map(std::ffi::OsStr::new));
}
