//! Gemma 3's sliding-window layers in a KV pool of their own on the CUDA backend
//! (`CudaBackend::load_with_pools`): random prompts longer than a piece, chunks, single tokens, batches,
//! forks, truncates, resets and scores give every stream the bits of the same calls on one pool of every
//! layer (a long score's log-probability at a piece's end only close: see below), in a BF16 and a Q8_0 cache (whose flash prompts stage the local layers' pages), while the
//! local pool holds a fraction of the positions and the engine's audit agrees after every call. Skips
//! where no CUDA device is present.

mod common;
use common::gemma3::{Gemma3, gguf_shaped};
use common::{Rng, bits, gpu_present, serial};

use std::sync::Arc;

use hostembed::Status;
use hostembed::backend::{Batch, BatchItem, Decoder, Streams};
use hostembed::checkpoint::write::MemSource;
use hostembed::cuda::DeviceBuffer;
use hostembed::gpu::{CudaBackend, GpuModel, PAGE_TOKENS, RowsOnDevice, Sizing, local_piece};
use hostembed::kv::{KvType, KvTypes};
use hostembed::model::{ModelConfig, TensorSource, names};
use hostembed::sampler::Sampling;
use hostembed::tensor::DType;
use hostembed::tuning::Tuning;

const STREAMS: usize = 4;
const WINDOW: usize = 4096;
const MAX_BATCH: usize = 128;

/// Seven layers, six of them local over 40 positions; head size 64 (a flash kernel's).
fn config() -> ModelConfig {
    gguf_shaped(Gemma3::on_card(WINDOW, 64.0, 40).config(), 40)
}

#[test]
fn gpu_local_pool_gives_one_pools_bits() {
    let test = "gpu_local_pool_gives_one_pools_bits";
    if !gpu_present(test) {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh(test);
    let cfg = config();
    let src = Arc::new(MemSource::synthetic(&cfg, rng.next_u64(), DType::F16));
    let embed = src.tensor(names::EMBED).unwrap();
    let buf = DeviceBuffer::from_slice(embed.bytes).unwrap();
    let pages = STREAMS * WINDOW.div_ceil(PAGE_TOKENS);
    // Each stream's window reach with its margin, and a piece with proposals.
    let local_pages =
        STREAMS * ((40usize + 64 + 33).div_ceil(PAGE_TOKENS) + 2 + (local_piece(MAX_BATCH) + 32).div_ceil(PAGE_TOKENS));
    for kv in [KvTypes::GPU_DEFAULT, KvTypes::same(KvType::Q8_0)] {
        let what = format!("cache {}", kv.describe());
        let load = |local: Option<usize>| {
            let rows = RowsOnDevice { ptr: buf.ptr(), dtype: embed.dtype, vocab: embed.rows(), cols: embed.cols() };
            let tuning = Tuning::from_env();
            let sizing = Sizing { max_batch: MAX_BATCH, pool_pages: pages, local_pages: local, kv, window: WINDOW };
            let backend = CudaBackend::load_with_pools(&*src, rows, 0, sizing, &tuning).unwrap();
            Streams::new(backend, WINDOW, STREAMS, pages, Sampling::GREEDY).unwrap()
        };
        let (mut local, mut one) = (load(Some(local_pages)), load(None));
        assert_eq!(local.backend().model().local_pages(), local_pages, "{what}");
        let (bytes, one_bytes) =
            (local.backend().model().allocated_pool_bytes(), one.backend().model().allocated_pool_bytes());
        assert_eq!(bytes, GpuModel::pools_bytes(&cfg, kv, pages, Some(local_pages)), "{what}: the pools' bytes");
        assert!(bytes * 3 < one_bytes * 2, "{what}: {bytes} bytes against one pool's {one_bytes}");
        let mut hist: Vec<Vec<u32>> = vec![Vec::new(); STREAMS];
        let (mut refused, mut long) = (0, 0);
        for round in 0..160 {
            let at = format!("{what}, round {round}");
            let s = rng.below(STREAMS as u64) as usize;
            // Any stream a batch may take holds room for the longest item (2,348 tokens).
            for (o, h) in hist.iter_mut().enumerate() {
                if h.len() + 2400 > WINDOW {
                    local.reset(o as u32).unwrap();
                    one.reset(o as u32).unwrap();
                    h.clear();
                }
            }
            let next = |rng: &mut Rng| -> Vec<u32> {
                let n = match rng.below(8) {
                    // Longer than a piece (2,048 tokens): stepped in pieces on the local pool.
                    0 => 2049 + rng.below(300) as usize,
                    1 | 2 => 1 + rng.below(300) as usize,
                    _ => 1,
                };
                rng.ids(cfg.vocab, n).into_iter().map(|t| t as u32).collect()
            };
            match rng.below(10) {
                0..5 => {
                    let order: Vec<usize> = (0..STREAMS).filter(|&o| o == s || rng.below(3) == 0).collect();
                    let inputs: Vec<Vec<u32>> = order.iter().map(|_| next(&mut rng)).collect();
                    long += inputs.iter().filter(|t| t.len() > 2048).count();
                    for d in [&mut local as &mut dyn Decoder, &mut one] {
                        let items = order.iter().zip(&inputs).map(|(&o, t)| BatchItem::new(o as u32, t)).collect();
                        let mut batch = Batch::new(items).unwrap();
                        d.step_batch(&mut batch).unwrap();
                        for b in batch.into_items() {
                            b.next.unwrap_or_else(|e| panic!("{at}: {e}"));
                        }
                    }
                    for (&o, t) in order.iter().zip(&inputs) {
                        hist[o].extend(t);
                        let (a, b) = (local.logits(o as u32).unwrap(), one.logits(o as u32).unwrap());
                        assert_eq!(bits(&a), bits(&b), "{at}: stream {o} after {} tokens", hist[o].len());
                    }
                }
                5 | 6 => {
                    // A cut or a fork, within the margin or anywhere; one the local pool refuses is skipped.
                    let len = match rng.below(2) {
                        0 => hist[s].len().saturating_sub(rng.below(33) as usize),
                        _ => rng.below(hist[s].len() as u64 + 1) as usize,
                    };
                    let dst = (s + 1) % STREAMS;
                    let fork = rng.below(2) == 0;
                    let done = if fork { local.fork(s as u32, dst as u32, len) } else { local.truncate(s as u32, len) };
                    match done {
                        Ok(()) if fork => {
                            one.fork(s as u32, dst as u32, len).unwrap();
                            hist[dst] = hist[s][..len].to_vec();
                        }
                        Ok(()) => {
                            one.truncate(s as u32, len).unwrap();
                            hist[s].truncate(len);
                        }
                        Err(e) => {
                            assert_eq!(e.status, Status::InvalidArgument, "{at}: {e}");
                            refused += 1;
                        }
                    }
                }
                7 => {
                    local.reset(s as u32).unwrap();
                    one.reset(s as u32).unwrap();
                    hist[s].clear();
                }
                _ => {
                    let tokens = next(&mut rng);
                    let (mut a, mut b) = (vec![0f32; tokens.len()], vec![0f32; tokens.len()]);
                    local.score(s as u32, &tokens, &mut a).unwrap();
                    one.score(s as u32, &tokens, &mut b).unwrap();
                    // A piece's last token's log-probability comes from the logits a step's head gives
                    // it (the matrix-vector product), where one pool's is its chunk's tensor-core head:
                    // close there, the same bits everywhere else.
                    let pieces = tokens.len().div_ceil(local_piece(MAX_BATCH));
                    let apart: Vec<usize> = (0..a.len()).filter(|&i| a[i].to_bits() != b[i].to_bits()).collect();
                    assert!(apart.len() < pieces, "{at}: {} log-probabilities apart in {pieces} pieces", apart.len());
                    for &i in &apart {
                        assert!((a[i] - b[i]).abs() < 0.05, "{at}: token {i}: {} against {}", a[i], b[i]);
                    }
                    hist[s].extend(&tokens);
                }
            }
            local.audit().unwrap_or_else(|e| panic!("{at}: {e}"));
            one.audit().unwrap();
        }
        println!("{what}: {long} items in pieces, {refused} cuts refused");
        assert!(long > 5 && refused > 0, "{what}: {long} items in pieces, {refused} refused");
    }
}
