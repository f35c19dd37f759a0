//! Small random models the suites share: decode, prompt and MoE shapes, rows on the card, a paged KV pool.

use super::Rng;
use hostembed::checkpoint::write::MemSource;
use hostembed::cuda::DeviceBuffer;
use hostembed::gpu::RowsOnDevice;
use hostembed::model::{Arch, ModelConfig, MoeConfig, RopeScaling, TensorSource, names};

/// One layer's paged KV pool as the kernels lay it out (`HE_PAGE_TOKENS` positions a page, each page
/// bf16 [K, V][kv_heads][PAGE_TOKENS][head_dim]), every value 0xFFFF (a NaN) until written, and page
/// tables that scatter a stream's positions over the pool in a shuffled order.
pub struct PagedKv {
    pub bits: Vec<u16>,
    pub pages: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl PagedKv {
    pub fn new(pages: usize, kv_heads: usize, head_dim: usize) -> PagedKv {
        let page_tokens = hostembed::gpu::PAGE_TOKENS;
        PagedKv { bits: vec![0xFFFF; pages * 2 * kv_heads * page_tokens * head_dim], pages, kv_heads, head_dim }
    }

    /// Where value `c` of kv head `h` at position `p` lies for the stream of `table` (`v`: the V half).
    pub fn at(&self, table: &[u32], v: bool, h: usize, p: usize, c: usize) -> usize {
        let pt = hostembed::gpu::PAGE_TOKENS;
        let page = table[p / pt] as usize;
        (((page * 2 + v as usize) * self.kv_heads + h) * pt + p % pt) * self.head_dim + c
    }

    /// Page tables for streams of the given lengths: disjoint pages in a shuffled order.
    pub fn tables(&self, rng: &mut Rng, lens: &[usize]) -> Vec<Vec<u32>> {
        let pt = hostembed::gpu::PAGE_TOKENS;
        let mut ids: Vec<u32> = (0..self.pages as u32).collect();
        rng.shuffle(&mut ids);
        let mut next = ids.into_iter();
        lens.iter().map(|&len| (0..len.div_ceil(pt)).map(|_| next.next().expect("pool too small")).collect()).collect()
    }
}

// ---- small random models the GPU suites share ----

pub fn decode_base(arch: Arch) -> ModelConfig {
    ModelConfig {
        arch,
        vocab: 1000,
        hidden: 256,
        layers: 2,
        heads: 8,
        kv_heads: 2,
        head_dim: 32,
        intermediate: 512,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 4096,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: Some(1),
        eos: Some(2),
        moe: None,
    }
}

/// Llama with GQA 4:1, llama3 rope scaling and the pairs rotated as GGUF llama stores them; Qwen2 with
/// biases, a tied head and an odd vocabulary; Qwen3 with q/k norms and head_dim 128 beside hidden 256.
pub fn decode_configs() -> Vec<(&'static str, ModelConfig)> {
    let llama = ModelConfig {
        rope_scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 64,
        },
        rope_interleaved: true,
        rope_theta: 500000.0,
        ..decode_base(Arch::Llama)
    };
    let qwen2 = ModelConfig {
        vocab: 777,
        hidden: 224,
        heads: 7,
        kv_heads: 1,
        tied: true,
        qkv_bias: true,
        intermediate: 480,
        ..decode_base(Arch::Qwen2)
    };
    let qwen3 =
        ModelConfig { heads: 4, head_dim: 128, qk_norm: true, rope_theta: 1000000.0, ..decode_base(Arch::Qwen3) };
    vec![("llama", llama), ("qwen2", qwen2), ("qwen3", qwen3)]
}

/// The prompt suites' shape (tests/gpu_prefill/prompts.rs, and its CPU emulation tests/prompt_roundings.rs).
pub fn prompt_base(arch: Arch) -> ModelConfig {
    ModelConfig {
        arch,
        vocab: 1000,
        hidden: 256,
        layers: 2,
        heads: 4,
        kv_heads: 1,
        head_dim: 64,
        intermediate: 512,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 65536,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: None,
        eos: None,
        moe: None,
    }
}

/// Llama (GQA 4:1, head_dim 64, llama3 rope), Qwen2 (biases, tied head, head_dim 32), Qwen3 (q/k norms,
/// head_dim 128 beside hidden 256).
pub fn prompt_configs() -> Vec<(&'static str, ModelConfig)> {
    let llama = ModelConfig {
        rope_scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 512,
        },
        rope_interleaved: true,
        rope_theta: 500000.0,
        ..prompt_base(Arch::Llama)
    };
    let qwen2 = ModelConfig {
        heads: 8,
        kv_heads: 2,
        head_dim: 32,
        tied: true,
        qkv_bias: true,
        vocab: 777,
        ..prompt_base(Arch::Qwen2)
    };
    let qwen3 = ModelConfig {
        heads: 4,
        kv_heads: 2,
        head_dim: 128,
        qk_norm: true,
        attention: Default::default(),
        rope_theta: 1000000.0,
        ..prompt_base(Arch::Qwen3)
    };
    vec![("llama", llama), ("qwen2", qwen2), ("qwen3", qwen3)]
}

/// The embedding rows on the card, as the engine's DEVICE placement hands them over.
pub fn rows_on_card(src: &MemSource) -> (DeviceBuffer, RowsOnDevice) {
    let e = src.tensor(names::EMBED).unwrap();
    let buf = DeviceBuffer::from_slice(e.bytes).unwrap();
    let rows = RowsOnDevice { ptr: buf.ptr(), dtype: e.dtype, vocab: e.rows(), cols: e.cols() };
    (buf, rows)
}

/// A small Qwen3-MoE (tests/moe.rs, tests/gpu_moe.rs) whose matrices' rows are whole k-quant super-blocks: 8 experts, 2 a token, the top-k
/// weights not renormalized (transformers' default for the architecture).
pub fn qwen3_moe() -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen3Moe,
        vocab: 300,
        hidden: 256,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        intermediate: 768,
        rms_eps: 1e-6,
        rope_theta: 1000000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 256,
        tied: false,
        qkv_bias: false,
        qk_norm: true,
        bos: Some(1),
        eos: Some(2),
        moe: Some(MoeConfig { experts: 8, used: 2, intermediate: 256, norm_topk: false }),
        attention: Default::default(),
    }
}

/// A Mixtral (GQA 2:1, GGUF's permuted Q/K rows): 4 experts, 2 a token, renormalized; its experts as
/// wide as its intermediate_size, as Mixtral's config says.
pub fn mixtral() -> ModelConfig {
    ModelConfig {
        arch: Arch::Mixtral,
        qk_norm: false,
        intermediate: 512,
        rope_theta: 10000.0,
        tied: true,
        moe: Some(MoeConfig { experts: 4, used: 2, intermediate: 512, norm_topk: true }),
        ..qwen3_moe()
    }
}

pub fn moe_configs() -> [(&'static str, ModelConfig); 2] {
    [("qwen3_moe", qwen3_moe()), ("mixtral", mixtral())]
}
