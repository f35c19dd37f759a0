//! Tensor parallelism on one card: models split over 2 and 4 ranks that share device 0
//! (`collectives::SharedDevice`, each rank's passes on a thread of its own, the sums in rank order),
//! every rank loaded from its own slices (`shard::RankSource`, `GpuModel::load_rank`), against the same
//! model whole on the same card: a prompt's logits at every position (the prompt path) and then single
//! steps' logits (the decode path) within 2e-3 relative L2, every rank's logits the same bits, and the
//! same greedy tokens where the top two logits are apart. Llama (KV heads copied to more ranks than
//! there are), Qwen2 (biases, a tied head), the Q4_K_M mix, a Mixture of Experts and Gemma 3 (post-norms
//! after the sums, sliding windows). What this does not run is NCCL's transport between cards.

mod common;
use common::batches::{Mix, batches_match_stepping_alone};
use common::card::{POOL_PAGES, random_tokens};
use common::gemma3::Gemma3;
use common::{
    Rng, Scratch, cuda_options, gpu_present, info, init, kv_stats, logits, prompt_configs, qwen3_moe, rel_l2,
    rows_on_card, serial, set_env, step, stream_len, top_two_gap,
};

use hostembed::backend::{Batch, BatchItem, Decoder, Streams};
use hostembed::checkpoint::write::{MemSource, Recipe, write_synthetic_hf};
use hostembed::engine::{engine_options, engine_tristate};
use hostembed::fit::engine_plan;
use hostembed::gpu::collectives::SharedDevice;
use hostembed::gpu::split::SplitBackend;
use hostembed::gpu::{CudaBackend, GpuModel, PAGE_TOKENS, Sizing};
use hostembed::kv::KvTypes;
use hostembed::model::{ModelConfig, TensorSource};
use hostembed::sampler::Sampling;
use hostembed::shard::{RankSource, ShardPlan};
use hostembed::tensor::DType;
use hostembed::tuning::{SPLIT_ONE_DEVICE_ENV, Tuning};
use hostembed::{Status, cuda, ffi};

const WINDOW: usize = POOL_PAGES * PAGE_TOKENS;
const MAX_BATCH: usize = 32;

/// A model's buffers for `pages` pages of the default cache types and streams of `window` positions.
fn sizing(pages: usize, window: usize) -> Sizing {
    Sizing { max_batch: MAX_BATCH, pool_pages: pages, local_pages: None, kv: KvTypes::GPU_DEFAULT, window }
}

/// What one model (whole, or one rank of a split) gives for a prompt and then single steps.
#[derive(PartialEq)]
struct Run {
    prompt: Vec<Vec<f32>>,
    steps: Vec<Vec<f32>>,
    drawn: Vec<u32>,
}

/// `prompt` at once (every position's logits), then each of `steps` alone, greedy.
fn run(model: &mut GpuModel, prompt: &[u32], steps: &[u32]) -> Run {
    cuda::require_device(0).unwrap();
    let mut pool = model.page_pool().unwrap();
    let mut stream = model.new_stream(WINDOW).unwrap();
    let prompt = model.all_logits(&mut pool, &mut stream, prompt).unwrap();
    let (mut logits, mut drawn) = (Vec::new(), Vec::new());
    for &t in steps {
        drawn.push(model.step(&mut pool, &mut stream, &[t], &Sampling::GREEDY, 0).unwrap());
        logits.push(model.logits(0).unwrap());
    }
    Run { prompt, steps: logits, drawn }
}

/// `src` split `world` ways on device 0, every rank run on a thread of its own; rank 0's run, after
/// checking every rank's is the same bits.
fn split_run(src: &MemSource, world: usize, prompt: &[u32], steps: &[u32]) -> Run {
    let plan = ShardPlan::new(src.config(), world, |w| src.tensor(&w.name).unwrap().dtype).unwrap();
    let (_rows_buf, rows) = rows_on_card(src);
    let tuning = Tuning::from_env();
    let mut models: Vec<GpuModel> = SharedDevice::ranks(world)
        .into_iter()
        .enumerate()
        .map(|(r, comm)| {
            let rank = RankSource::new(src, &plan, r).unwrap();
            GpuModel::load_rank(&rank, Box::new(comm), rows, sizing(POOL_PAGES, WINDOW), &tuning).unwrap()
        })
        .collect();
    assert_eq!(models[world - 1].head_ids().end, src.config().vocab);
    let runs: Vec<Run> = std::thread::scope(|sc| {
        let ranks: Vec<_> = models.iter_mut().map(|m| sc.spawn(move || run(m, prompt, steps))).collect();
        ranks.into_iter().map(|h| h.join().expect("a rank's thread")).collect()
    });
    assert!(runs.iter().all(|r| *r == runs[0]), "every rank sums in the same order, so all hold the same bits");
    runs.into_iter().next().unwrap()
}

/// `src` split over each of `worlds` against it whole: every position's logits within 2e-3, and the
/// same greedy token where the whole model's top two are 1e-2 apart. The worst distance.
fn check(name: &str, src: &MemSource, worlds: &[usize]) -> f64 {
    let mut rng = Rng::fresh(name);
    let vocab = src.config().vocab;
    let (prompt, steps) = (random_tokens(&mut rng, vocab, 20), random_tokens(&mut rng, vocab, 6));
    let (_rows_buf, rows) = rows_on_card(src);
    let tuning = Tuning::from_env();
    let mut whole =
        GpuModel::load_for_window(src, rows, MAX_BATCH, POOL_PAGES, KvTypes::GPU_DEFAULT, WINDOW, &tuning).unwrap();
    let want = run(&mut whole, &prompt, &steps);
    drop(whole);
    let mut worst = 0f64;
    for &world in worlds {
        let got = split_run(src, world, &prompt, &steps);
        let pairs = got.prompt.iter().zip(&want.prompt).chain(got.steps.iter().zip(&want.steps));
        for (pos, (g, w)) in pairs.enumerate() {
            let d = rel_l2(g, w);
            assert!(d < 2e-3, "{name} over {world}: position {pos} is {d:e} from the whole model's logits");
            worst = worst.max(d);
        }
        for (k, (g, w)) in got.drawn.iter().zip(&want.drawn).enumerate() {
            if top_two_gap(&want.steps[k]) > 1e-2 {
                assert_eq!(g, w, "{name} over {world}: step {k} drew another token");
            }
        }
    }
    println!("{name}: worst relative L2 {worst:e} over {worlds:?} ranks");
    worst
}

#[test]
fn gpu_split_llama_and_qwen2_match_the_whole_model() {
    if !gpu_present("gpu_split_llama_and_qwen2_match_the_whole_model") {
        return;
    }
    let configs = prompt_configs();
    let (llama, qwen2) = (configs[0].1.clone(), configs[1].1.clone());
    // Llama's one KV head goes to every rank; Qwen2's two split over 2 and are copied over 4.
    check("llama BF16", &MemSource::synthetic(&llama, 11, DType::Bf16), &[2, 4]);
    check("llama Q8_0", &MemSource::synthetic(&llama, 12, DType::Q8_0), &[2]);
    check("qwen2 BF16", &MemSource::synthetic(&qwen2, 13, DType::Bf16), &[2, 4]);
}

/// The Q4_K_M mix: o's and down's column cuts on whole 256-value super-blocks (8 heads of 64, a width
/// of 4 super-blocks).
#[test]
fn gpu_split_q4_k_m_matches_the_whole_model() {
    if !gpu_present("gpu_split_q4_k_m_matches_the_whole_model") {
        return;
    }
    let cfg = ModelConfig::llama(512, 2, 8, 2, 1024, 1000);
    check("llama Q4_K_M", &MemSource::synthetic(&cfg, 14, Recipe::Q4KM), &[2]);
}

/// Each expert's width split; Gemma 3's post-norms after the sums and its local layers.
#[test]
fn gpu_split_moe_and_gemma3_match_the_whole_model() {
    if !gpu_present("gpu_split_moe_and_gemma3_match_the_whole_model") {
        return;
    }
    check("qwen3-moe BF16", &MemSource::synthetic(&qwen3_moe(), 15, DType::Bf16), &[2]);
    let gemma = Gemma3::on_card(4096, 64.0, 7).config();
    check("gemma3 BF16", &MemSource::synthetic(&gemma, 16, DType::Bf16), &[2]);
}

/// A rank's weights with another rank's collectives are refused, nothing allocated.
#[test]
fn gpu_a_rank_with_the_wrong_collectives_is_refused() {
    if !gpu_present("gpu_a_rank_with_the_wrong_collectives_is_refused") {
        return;
    }
    let src = MemSource::synthetic(&prompt_configs()[0].1, 17, DType::Bf16);
    let plan = ShardPlan::new(src.config(), 2, |_| DType::Bf16).unwrap();
    let (_rows_buf, rows) = rows_on_card(&src);
    let rank = RankSource::new(&src, &plan, 1).unwrap();
    let mut comms = SharedDevice::ranks(2);
    let wrong = Box::new(comms.remove(0));
    let e = GpuModel::load_rank(&rank, wrong, rows, sizing(POOL_PAGES, WINDOW), &Tuning::from_env())
        .err()
        .expect("refused");
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    assert!(e.to_string().contains("rank 0 of 2") && e.to_string().contains("rank 1 of 2"), "{e}");
}

/// The engine's streams over the ranks (`SplitBackend`: 2 ranks sharing this card) against the same
/// streams over the whole model (`CudaBackend`): random batches of prompts and single tokens over 4
/// streams, forks, truncates and resets, the prefix cache on; every stream's logits within 2e-3 of the
/// whole model's after every call, the pool's audit clean, and a score's log-probabilities close.
#[test]
fn gpu_streams_over_a_split_model_match_the_whole_model() {
    let test = "gpu_streams_over_a_split_model_match_the_whole_model";
    if !gpu_present(test) {
        return;
    }
    const STREAMS: usize = 4;
    let mut rng = Rng::fresh(test);
    let src = MemSource::synthetic(&prompt_configs()[1].1, 18, DType::Bf16);
    let vocab = src.config().vocab;
    let (_rows_buf, rows) = rows_on_card(&src);
    let tuning = Tuning::from_env();
    let pages = STREAMS * 512usize.div_ceil(PAGE_TOKENS);
    let kv = KvTypes::GPU_DEFAULT;
    let plan = ShardPlan::new(src.config(), 2, |_| DType::Bf16).unwrap();
    let ranks: Vec<GpuModel> = SharedDevice::ranks(2)
        .into_iter()
        .enumerate()
        .map(|(r, comm)| {
            let rank = RankSource::new(&src, &plan, r).unwrap();
            GpuModel::load_rank(&rank, Box::new(comm), rows, sizing(pages, 512), &tuning).unwrap()
        })
        .collect();
    let mut split =
        Streams::new(SplitBackend::new(ranks, vec![0, 0]).unwrap(), 512, STREAMS, pages, Sampling::GREEDY).unwrap();
    let whole = CudaBackend::load(&src, rows, MAX_BATCH, 0, pages, kv, 512, &tuning).unwrap();
    let mut one = Streams::new(whole, 512, STREAMS, pages, Sampling::GREEDY).unwrap();
    let mut lens = [0usize; STREAMS];
    for round in 0..60 {
        let at = format!("round {round}");
        let s = rng.below(STREAMS as u64) as usize;
        match rng.below(8) {
            0..5 => {
                let order: Vec<usize> = (0..STREAMS).filter(|&o| o == s || rng.below(2) == 0).collect();
                let inputs: Vec<Vec<u32>> = order
                    .iter()
                    .map(|&o| {
                        let n = if rng.below(3) == 0 { 1 + rng.below(40) as usize } else { 1 };
                        if lens[o] + n > 500 { Vec::new() } else { random_tokens(&mut rng, vocab, n) }
                    })
                    .collect();
                let run: Vec<(usize, &Vec<u32>)> =
                    order.iter().copied().zip(&inputs).filter(|(_, t)| !t.is_empty()).collect();
                if run.is_empty() {
                    continue;
                }
                for d in [&mut split as &mut dyn Decoder, &mut one] {
                    let items = run.iter().map(|&(o, t)| BatchItem::new(o as u32, t)).collect();
                    let mut batch = Batch::new(items).unwrap();
                    d.step_batch(&mut batch).unwrap();
                    for b in batch.into_items() {
                        b.next.unwrap_or_else(|e| panic!("{at}: {e}"));
                    }
                }
                for &(o, t) in &run {
                    lens[o] += t.len();
                    let (a, b) = (split.logits(o as u32).unwrap(), one.logits(o as u32).unwrap());
                    let d = rel_l2(&a, &b);
                    assert!(d < 2e-3, "{at}: stream {o} at {} is {d:e} from the whole model", lens[o]);
                }
            }
            5 => {
                let (dst, len) = ((s + 1) % STREAMS, rng.below(lens[s] as u64 + 1) as usize);
                split.fork(s as u32, dst as u32, len).unwrap();
                one.fork(s as u32, dst as u32, len).unwrap();
                lens[dst] = len;
            }
            6 => {
                let len = rng.below(lens[s] as u64 + 1) as usize;
                split.truncate(s as u32, len).unwrap();
                one.truncate(s as u32, len).unwrap();
                lens[s] = len;
            }
            _ => {
                split.reset(s as u32).unwrap();
                one.reset(s as u32).unwrap();
                lens[s] = 0;
            }
        }
        split.audit().unwrap_or_else(|e| panic!("{at}: {e}"));
        assert_eq!(split.kv_stats(), one.kv_stats(), "{at}: the pools' accounting");
    }
    // A score (its prompt in chunks, a log-probability a position) on both, then a step after it.
    for d in [&mut split as &mut dyn Decoder, &mut one] {
        d.reset(0).unwrap();
    }
    let tokens = random_tokens(&mut rng, vocab, 80);
    let (mut a, mut b) = (vec![0f32; 80], vec![0f32; 80]);
    split.score(0, &tokens, &mut a).unwrap();
    one.score(0, &tokens, &mut b).unwrap();
    assert!(a[0].is_nan() && b[0].is_nan(), "an empty stream's first token has no log-probability");
    // The logits' 2e-3 scaled to the log-probability: a random model's are as low as -130.
    for (k, (x, y)) in a.iter().zip(&b).enumerate().skip(1) {
        assert!((x - y).abs() < 2e-3 * (1.0 + y.abs()), "score: position {k} gives {x} split, {y} whole");
    }
    let d = rel_l2(&split.logits(0).unwrap(), &one.logits(0).unwrap());
    assert!(d < 2e-3, "the logits after the score are {d:e} apart");
    split.audit().unwrap();
}

/// The engine over `options.devices = 2` with both ranks on this card (`HOSTEMBED_SPLIT_ONE_DEVICE=1`:
/// the engine's own plan a device, rows, shared pool and `SplitBackend`) against the same file on one
/// device, through the C ABI: a prompt and then single steps on each of 3 streams, every stream's
/// logits within 2e-3 relative L2 after every call and the same greedy tokens where the top two are
/// apart, with the rows on the card and read from the file mapping; then a split engine's batches
/// against the same calls stepped alone, bit for bit.
#[test]
fn gpu_engine_over_two_ranks_matches_one_device() {
    let test = "gpu_engine_over_two_ranks_matches_one_device";
    if !gpu_present(test) {
        return;
    }
    let _g = serial();
    set_env(SPLIT_ONE_DEVICE_ENV, Some("1".as_ref()));
    let dir = Scratch::new("tp-engine");
    let cfg = prompt_configs()[1].1.clone();
    let path = dir.join("qwen2");
    write_synthetic_hf(&path, &cfg, 19, DType::Bf16).unwrap();
    let mut rng = Rng::fresh(test);
    for mmap_rows in [engine_tristate::No, engine_tristate::Yes] {
        let one = engine_options { mmap_rows, ..cuda_options(512, 3, 64) };
        let (whole, split) = (init(&path, &one), init(&path, &engine_options { devices: 2, ..one }));
        assert_eq!(info(&split).streams, 3, "the split engine's streams");
        // SAFETY: engine_plan is numbers and enums with a variant at 0: all zeros is a value of it.
        let mut plans: [engine_plan; 3] = unsafe { std::mem::zeroed() };
        for (d, plan) in plans.iter_mut().enumerate() {
            // SAFETY: a live engine and a writable engine_plan.
            let st = unsafe { ffi::engine_plan_of_device(split.0, d as u32, plan) };
            assert_eq!(st, if d < 2 { Status::Ok } else { Status::InvalidArgument }, "device {d}");
        }
        assert!(plans[0].streams >= 3 && plans[1].streams >= 3, "each device's own streams");
        // Alike but for the head's rows: 777 of them cut in two leaves rank 0 one BF16 row more.
        let odd = plans[0].on_card_bytes as i128 - plans[1].on_card_bytes as i128;
        assert!(odd == 0 || odd == (cfg.hidden * 2) as i128, "two ranks of one split: {odd} bytes apart");
        for s in 0..3 {
            let n = 5 + rng.below(40) as usize;
            let prompt = rng.ids(cfg.vocab, n);
            let (mut drawn_whole, mut drawn_split) = (step(&whole, s, &prompt), step(&split, s, &prompt));
            for k in 0..8 {
                let at = format!("rows {mmap_rows:?}, stream {s}, call {k}");
                let (w, g) = (logits(&whole, s), logits(&split, s));
                let d = rel_l2(&g, &w);
                assert!(d < 2e-3, "{at}: {d:e} from the one-device engine's logits");
                if top_two_gap(&w) > 1e-2 {
                    assert_eq!(drawn_split, drawn_whole, "{at}: another greedy token");
                }
                // Both go on from the one-device engine's token, so a near tie cannot part them.
                let fed = [drawn_whole];
                (drawn_whole, drawn_split) = (step(&whole, s, &fed), step(&split, s, &fed));
            }
        }
        let held: u64 = (0..3).map(|s| (stream_len(&split, s) as u64).div_ceil(PAGE_TOKENS as u64)).sum();
        let (total, free) = kv_stats(&split);
        assert_eq!(free, total - held * PAGE_TOKENS as u64, "the shared pool's free positions");
    }
    let mix = Mix { rounds: 40, widest: 3, chunk: 24, long_chunk: 100 };
    let options = engine_options { devices: 2, ..cuda_options(512, 3, 64) };
    let (batched, alone) = (init(&path, &options), init(&path, &options));
    let counts =
        batches_match_stepping_alone("split over 2 ranks", &batched, &alone, &mut rng, &mix, PAGE_TOKENS as u64);
    assert!(counts.singles_beside_others > 10 && counts.chunks_beside_others > 5, "{counts:?}");
    set_env(SPLIT_ONE_DEVICE_ENV, None);
}
