//! What the CUDA model tests share: a synthetic model on the card beside the CPU oracle, a page pool and
//! one stream on each, and their logits compared at every position.

use super::{Rng, rel_l2, rows_on_card};
use hostembed::backend::PagePool;
use hostembed::checkpoint::write::MemSource;
use hostembed::cpu::{CpuModel, CpuStream};
use hostembed::cuda::DeviceBuffer;
use hostembed::gpu::{GpuModel, GpuStream};
use hostembed::kv::KvTypes;
use hostembed::tuning::Tuning;

/// KV pages the tests' models get: 2,048 positions.
pub const POOL_PAGES: usize = 128;

/// `n` ids below `vocab`.
pub fn random_tokens(rng: &mut Rng, vocab: usize, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
}

/// A model on the card (its embedding rows there too, `POOL_PAGES` pages) and on the CPU, the oracle,
/// with a page pool and one stream on each.
pub struct OnBoth<'a> {
    pub gs: GpuStream,
    pub cs: CpuStream,
    pub pool: PagePool,
    pub gpu: GpuModel,
    pub cpu: CpuModel<'a>,
    // Declared after `gpu`, so dropped after it: the model reads its embedding rows here.
    _rows: DeviceBuffer,
}

impl<'a> OnBoth<'a> {
    /// `src` at `max_batch` rows a pass, with streams of `window` positions; the KV types `kv` on both,
    /// or each backend's default for None (the card's BF16, the CPU's F32).
    pub fn new(src: &'a MemSource, max_batch: usize, kv: Option<KvTypes>, window: usize) -> OnBoth<'a> {
        let (rows_buf, rows) = rows_on_card(src);
        let tuning = Tuning::from_env();
        let (cpu, gpu) = match kv {
            Some(kv) => (
                CpuModel::new(src).unwrap().with_kv_types(kv).unwrap(),
                GpuModel::load_with_kv(src, rows, max_batch, POOL_PAGES, kv, &tuning).unwrap(),
            ),
            None => (CpuModel::new(src).unwrap(), GpuModel::load(src, rows, max_batch, POOL_PAGES, &tuning).unwrap()),
        };
        let pool = gpu.page_pool().unwrap();
        let (gs, cs) = (gpu.new_stream(window).unwrap(), cpu.new_stream(window));
        OnBoth { gs, cs, pool, gpu, cpu, _rows: rows_buf }
    }

    /// `tokens` through both streams: the card's logits at every position (`all_logits`), and their
    /// worst relative L2 against the CPU's (`forward_all`).
    pub fn all_logits(&mut self, tokens: &[u32]) -> (Vec<Vec<f32>>, f64) {
        let got = self.gpu.all_logits(&mut self.pool, &mut self.gs, tokens).unwrap();
        let want = self.cpu.forward_all(&mut self.cs, tokens).unwrap();
        let worst = got.iter().zip(&want).map(|(g, w)| rel_l2(g, w)).fold(0f64, f64::max);
        (got, worst)
    }
}
