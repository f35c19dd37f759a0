//! The KV cache types on the GPU against the CPU: the KV append's bytes bit for bit in every type (the
//! CPU's rounding of the kernel's own rotated K and V), decode and flash attention over caches of every
//! type and pairs of types against the CPU's attention on the values those caches hold, the whole
//! model's last-prompt and decoded logits in every type against the CPU backend in that type and against
//! an f32 cache (a table is printed), an all-F32 model with an F32 cache within 1e-4 of the CPU, the KV
//! pool's bytes as the planner predicts them, FP8 against the device's compute capability, sliding
//! windows in decode and flash attention, and the engine's report of its types. Every output buffer starts poisoned; every CUDA call is checked. Skips
//! where no CUDA device is present.

#[path = "../common/mod.rs"]
mod common;

mod append;
mod attention;
mod models;

use common::Rng;
use common::launch::{NULL_STREAM, download, launch_tuning, ok, poisoned};
use hostembed::cuda::DeviceBuffer;
use hostembed::gpu::{PAGE_TOKENS, PageLayout};
use hostembed::kv::{KvType, KvTypes};
use hostembed::model::ModelConfig;
use std::os::raw::c_uint;

/// The pairs of K and V types the kernels are checked on: each type for both, and pairs apart (which
/// take the attention kernel that reads the types at run time).
fn pairs() -> Vec<KvTypes> {
    let mut p: Vec<KvTypes> = KvType::ALL.iter().map(|&t| KvTypes::same(t)).collect();
    p.push(KvTypes { k: KvType::Q8_0, v: KvType::F16 });
    p.push(KvTypes { k: KvType::Bf16, v: KvType::Fp8E4m3 });
    p.push(KvTypes { k: KvType::F32, v: KvType::Q8_0 });
    p.push(KvTypes { k: KvType::Fp8E4m3, v: KvType::Bf16 });
    p
}

/// Whether a head of `d` values fits both types (the block types want whole blocks of 32).
fn fits(kv: KvTypes, d: usize) -> bool {
    kv.k.check(d, "k").is_ok() && kv.v.check(d, "v").is_ok()
}

/// One layer's pool on the host, in the kernels' layout for `kv`: every byte 0xFF until written, and
/// page tables that scatter each stream's positions over the pool in a shuffled order.
struct HostPool {
    layout: PageLayout,
    pages: usize,
    bytes: Vec<u8>,
}

impl HostPool {
    fn new(kv: KvTypes, kv_heads: usize, head_dim: usize, pages: usize) -> HostPool {
        let layout = PageLayout { kv, kv_heads, head_dim };
        HostPool { layout, pages, bytes: vec![0xFF; pages * layout.page_bytes()] }
    }

    fn page(&mut self, id: u32) -> &mut [u8] {
        let n = self.layout.page_bytes();
        &mut self.bytes[id as usize * n..(id as usize + 1) * n]
    }

    /// Writes one head's K (`v` false) or V row at position `p` of the stream of `table`, rounded.
    fn write(&mut self, table: &[u32], v: bool, head: usize, p: usize, values: &[f32]) {
        let layout = self.layout;
        layout.write_row(self.page(table[p / PAGE_TOKENS]), v, head, p % PAGE_TOKENS, values);
    }

    /// The values attention reads for that row.
    fn read(&mut self, table: &[u32], v: bool, head: usize, p: usize) -> Vec<f32> {
        let layout = self.layout;
        layout.read_row(self.page(table[p / PAGE_TOKENS]), v, head, p % PAGE_TOKENS)
    }

    fn tables(&self, rng: &mut Rng, lens: &[usize]) -> Vec<Vec<u32>> {
        let mut ids: Vec<u32> = (0..self.pages as u32).collect();
        rng.shuffle(&mut ids);
        let mut next = ids.into_iter();
        lens.iter()
            .map(|&len| (0..len.div_ceil(PAGE_TOKENS)).map(|_| next.next().expect("pool too small")).collect())
            .collect()
    }
}

/// Device copies of page tables and, per query token, the address of its stream's table.
struct DeviceTables {
    _tables: DeviceBuffer,
    per_token: DeviceBuffer,
}

impl DeviceTables {
    fn new(tables: &[Vec<u32>], token_stream: &[usize]) -> DeviceTables {
        let flat: Vec<u32> = tables.iter().flatten().copied().collect();
        let all = DeviceBuffer::from_slice(&flat).unwrap();
        let starts: Vec<usize> = tables.iter().scan(0, |at, t| Some(std::mem::replace(at, *at + t.len()))).collect();
        let addrs: Vec<u64> = token_stream.iter().map(|&s| all.ptr() as u64 + 4 * starts[s] as u64).collect();
        DeviceTables { per_token: DeviceBuffer::from_slice(&addrs).unwrap(), _tables: all }
    }

    fn ptr(&self) -> *const *const c_uint {
        self.per_token.ptr() as *const *const c_uint
    }
}

fn rope_config(heads: usize, kv_heads: usize, head_dim: usize, interleaved: bool) -> ModelConfig {
    let llama = ModelConfig::llama(heads * head_dim, 1, heads, kv_heads, 64, 256);
    ModelConfig { rms_eps: 1e-6, rope_interleaved: interleaved, ..llama }
}
