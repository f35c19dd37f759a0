//! The small Gemma 3 models the CPU and CUDA tests build: one shape each, the rest shared, and the
//! layer pattern GGUF files carry.

use hostembed::model::{Arch, AttentionConfig, ModelConfig, RopeScaling, SlidingWindow};

/// What the CPU and CUDA tests choose apart in a small Gemma 3.
pub struct Gemma3 {
    pub hidden: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub max_position: usize,
    /// Scores are scaled by 1/sqrt(this) rather than 1/sqrt(head_dim).
    pub query_scale_base: f32,
    /// The local layers' window, in positions.
    pub window: usize,
}

impl Gemma3 {
    /// The CPU tests' shape: head size 32, q_dim 128 beside hidden 64, a vocabulary of 96, scores scaled
    /// by 1/sqrt(24), local windows of 7, bos 2 and eos 1.
    pub fn on_cpu(max_position: usize) -> ModelConfig {
        let shape = Gemma3 {
            hidden: 64,
            head_dim: 32,
            intermediate: 96,
            vocab: 96,
            max_position,
            query_scale_base: 24.0,
            window: 7,
        };
        ModelConfig { bos: Some(2), eos: Some(1), ..shape.config() }
    }

    /// The CUDA tests' shape: head size 64 (a flash kernel's), q_dim 256 beside hidden 128, a vocabulary
    /// of 320.
    pub fn on_card(max_position: usize, query_scale_base: f32, window: usize) -> Gemma3 {
        Gemma3 { hidden: 128, head_dim: 64, intermediate: 256, vocab: 320, max_position, query_scale_base, window }
    }

    /// Four layers of 4 heads over 2 KV heads, tied, with q/k norms; local layers 0 and 2 (a global
    /// layer every second) with a rotary base of 10000, linear rope scaling (8) on the global ones.
    pub fn config(&self) -> ModelConfig {
        let mut cfg = ModelConfig::llama(self.hidden, 4, 4, 2, self.intermediate, self.vocab);
        cfg.arch = Arch::Gemma3;
        cfg.head_dim = self.head_dim;
        cfg.tied = true;
        cfg.qk_norm = true;
        cfg.rms_eps = 1e-6;
        cfg.rope_theta = 1_000_000.0;
        cfg.rope_scaling = RopeScaling::Linear { factor: 8.0 };
        cfg.max_position = self.max_position;
        cfg.attention = AttentionConfig {
            query_scale_base: Some(self.query_scale_base),
            sliding: Some(SlidingWindow { window: self.window, global_every: 2, rope_theta: 10_000.0 }),
        };
        cfg
    }
}

/// `cfg` as GGUF and HF spell it alike: 7 layers in llama.cpp's pattern (every sixth global, a local
/// base of 10000, local windows of `window`) and its query scaling (1/sqrt(head_dim) below 62 layers).
pub fn gguf_shaped(mut cfg: ModelConfig, window: usize) -> ModelConfig {
    cfg.layers = 7;
    cfg.attention = AttentionConfig {
        query_scale_base: Some(cfg.head_dim as f32),
        sliding: Some(SlidingWindow { window, global_every: 6, rope_theta: 10_000.0 }),
    };
    cfg
}
