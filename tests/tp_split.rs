//! The CPU proof of tensor parallelism's shard rules (`hostembed::shard`): a small random model's
//! forward run by N ranks, each holding only its slices of the weights (`shard::RankSource`, what a
//! multi-device loader reads) and its own KV heads' cache, computing its partial products;
//! the partial outputs of o and of the feed-forward's down summed in rank order as an all-reduce sums
//! them, and the head's vocabulary rows gathered in equal chunks as an all-gather places them. The
//! architecture files themselves run it (`arch::forward` over the split's `Ops`), so every
//! architecture's graph is split as the CUDA backend would split it. Each position's logits are held
//! to the unsplit CPU model's: only the order of the sums differs, so they agree to about 2e-7
//! relative L2 (asserted below 1e-4, far inside the 2e-3 the CUDA engine will be held to).

mod common;
use common::{Rng, rel_l2};

use std::collections::HashMap;

use hostembed::arch::{self, Feeds, Ops, Rotary};
use hostembed::checkpoint::write::{MemSource, Recipe};
use hostembed::cpu::{self, CpuModel};
use hostembed::gpu::{GpuModel, RowsOnDevice};
use hostembed::model::{
    Activation, Arch, AttentionConfig, Layers, ModelConfig, ModelWeights, MoeConfig, SlidingWindow, TensorRef,
    TensorSource, Weight, names, rope_inv_freq, rope_inv_freq_local, weight_list,
};
use hostembed::shard::{self, RankShare, RankSource, ShardPlan};
use hostembed::status::Result;
use hostembed::tensor::DType;
use hostembed::tuning::Tuning;

/// A tensor a rank holds: its slice's bytes and shape.
struct Held {
    dtype: DType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl Held {
    fn of(t: TensorRef) -> Held {
        Held { dtype: t.dtype, shape: t.shape.to_vec(), bytes: t.bytes.to_vec() }
    }

    fn view(&self) -> TensorRef<'_> {
        TensorRef { dtype: self.dtype, shape: &self.shape, bytes: &self.bytes }
    }

    fn times(&self, x: &[f32]) -> Vec<f32> {
        let t = self.view();
        let mut out = vec![0f32; t.rows()];
        cpu::matvec(&t, x, &mut out);
        out
    }
}

/// The key of the head's slice among a rank's tensors.
const HEAD: &str = "head";

/// One rank: what it holds of each weight, and its own activations and KV heads' cache.
struct Rank {
    share: RankShare,
    held: HashMap<String, Held>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    /// [layer][position]: the rank's KV heads' rows.
    k_cache: Vec<Vec<Vec<f32>>>,
    v_cache: Vec<Vec<Vec<f32>>>,
}

impl Rank {
    /// Rank `r`'s model as a multi-device loader reads it (`shard::RankSource`): its slices of every
    /// weight of `src` under the rank's config, whose shapes every loader's checks hold, and its head.
    fn load(src: &MemSource, plan: &ShardPlan, r: usize) -> Rank {
        let rank = RankSource::new(src, plan, r).unwrap();
        ModelWeights::read(&rank).unwrap();
        assert_eq!(rank.head_rows(), plan.head(r).rows);
        let cfg = rank.config();
        let mut held = HashMap::new();
        for w in weight_list(cfg) {
            held.insert(w.name.clone(), Held::of(rank.tensor(&w.name).unwrap()));
        }
        held.insert(HEAD.into(), Held::of(rank.tensor(shard::RANK_HEAD).unwrap()));
        let layers = vec![Vec::new(); cfg.layers];
        let share = plan.rank(r).clone();
        Rank { share, held, q: vec![], k: vec![], v: vec![], attn: vec![], k_cache: layers.clone(), v_cache: layers }
    }

    fn get(&self, w: &Weight) -> &Held {
        &self.held[&w.name]
    }

    fn vector(&self, w: &Weight) -> Vec<f32> {
        self.get(w).view().to_f32()
    }
}

/// The split forward of one token at `pos`: x and h (hidden wide) are the same on every rank, so they
/// are kept once; everything else is a rank's.
struct Split<'s> {
    cfg: &'s ModelConfig,
    ranks: Vec<Rank>,
    token: u32,
    pos: usize,
    x: Vec<f32>,
    h: Vec<f32>,
    inv_freq: Vec<f32>,
    inv_freq_local: Vec<f32>,
}

/// The all-reduce: the ranks' partial rows summed in rank order.
fn all_reduce(partials: Vec<Vec<f32>>) -> Vec<f32> {
    let mut parts = partials.into_iter();
    let mut sum = parts.next().expect("one rank at least");
    for p in parts {
        sum.iter_mut().zip(&p).for_each(|(s, v)| *s += v);
    }
    sum
}

fn norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    cpu::rmsnorm(x, w, eps, &mut out);
    out
}

fn activate(act: Activation, gate: &[f32], up: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; gate.len()];
    match act {
        Activation::Silu => cpu::swiglu(gate, up, &mut out),
        Activation::GeluTanh => cpu::geglu(gate, up, &mut out),
    }
    out
}

impl Split<'_> {
    /// x += the all-reduced partials, through the whole-weight post-norm first when given.
    fn add_reduced(&mut self, partials: Vec<Vec<f32>>, post_norm: Option<&Weight>) {
        let sum = all_reduce(partials);
        let sum = match post_norm {
            Some(w) => norm(&sum, &self.ranks[0].vector(w), self.cfg.rms_eps),
            None => sum,
        };
        cpu::add(&mut self.x, &sum);
    }

    /// The logits after the token: the final norm on every rank, each rank's vocabulary rows, then the
    /// all-gather of chunks of ceil(vocab / N) rows, of which the first vocab values are the row.
    fn logits(&self, final_norm: &Weight) -> Vec<f32> {
        let hn = norm(&self.x, &self.ranks[0].vector(final_norm), self.cfg.rms_eps);
        let chunk = self.cfg.vocab.div_ceil(self.ranks.len());
        let mut gathered = vec![f32::NAN; chunk * self.ranks.len()];
        for (r, rank) in self.ranks.iter().enumerate() {
            let part = rank.held[HEAD].times(&hn);
            assert_eq!(rank.share.vocab.start, r * chunk);
            gathered[r * chunk..r * chunk + part.len()].copy_from_slice(&part);
        }
        gathered.truncate(self.cfg.vocab);
        gathered
    }
}

impl Ops for Split<'_> {
    type Weight = Weight;

    fn embed(&mut self) -> Result<()> {
        let e = &self.ranks[0].held[names::EMBED];
        self.x = e.view().row_f32(self.token as usize);
        Ok(())
    }

    fn scale(&mut self, factor: f32) -> Result<()> {
        self.x.iter_mut().for_each(|v| *v *= factor);
        Ok(())
    }

    fn norm(&mut self, w: &Weight, _feeds: Feeds) -> Result<()> {
        self.h = norm(&self.x, &self.ranks[0].vector(w), self.cfg.rms_eps);
        Ok(())
    }

    fn qkv(&mut self, q: &Weight, k: &Weight, v: &Weight, bias: Option<[&Weight; 3]>) -> Result<()> {
        for rank in &mut self.ranks {
            let mut out = [q, k, v].map(|w| rank.get(w).times(&self.h));
            if let Some(b) = bias {
                out.iter_mut().zip(b).for_each(|(o, b)| cpu::add(o, &rank.vector(b)));
            }
            [rank.q, rank.k, rank.v] = out;
        }
        Ok(())
    }

    fn rope_append(&mut self, layer: usize, head_norms: Option<[&Weight; 2]>, rotary: Rotary) -> Result<()> {
        let (cfg, hd) = (self.cfg, self.cfg.head_dim);
        let freq = if rotary == Rotary::Global { &self.inv_freq } else { &self.inv_freq_local };
        for rank in &mut self.ranks {
            if let Some([qn, kn]) = head_norms {
                let (qn, kn) = (rank.vector(qn), rank.vector(kn));
                rank.q = rank.q.chunks(hd).flat_map(|h| norm(h, &qn, cfg.rms_eps)).collect();
                rank.k = rank.k.chunks(hd).flat_map(|h| norm(h, &kn, cfg.rms_eps)).collect();
            }
            cpu::rope(&mut rank.q, rank.share.q_heads.len(), hd, self.pos, freq, cfg.rope_interleaved);
            cpu::rope(&mut rank.k, rank.share.kv_heads.len(), hd, self.pos, freq, cfg.rope_interleaved);
            rank.k_cache[layer].push(rank.k.clone());
            rank.v_cache[layer].push(rank.v.clone());
        }
        Ok(())
    }

    /// Each of the rank's query heads over its KV head's cached rows, in f64.
    fn attention(&mut self, layer: usize, window: Option<usize>) -> Result<()> {
        let (hd, group, scale) = (self.cfg.head_dim, self.cfg.heads / self.cfg.kv_heads, self.cfg.score_scale());
        let first = window.map_or(0, |w| (self.pos + 1).saturating_sub(w));
        for rank in &mut self.ranks {
            let mut attn = Vec::with_capacity(rank.q.len());
            for (i, q) in rank.q.chunks(hd).enumerate() {
                let kv = (rank.share.q_heads.start + i) / group - rank.share.kv_heads.start;
                let row = |cache: &Vec<f32>| cache[kv * hd..(kv + 1) * hd].to_vec();
                let keys: Vec<_> = rank.k_cache[layer][first..].iter().map(row).collect();
                let values: Vec<_> = rank.v_cache[layer][first..].iter().map(row).collect();
                let scores: Vec<f64> = keys
                    .iter()
                    .map(|k| q.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale)
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for d in 0..hd {
                    let sum: f64 = weights.iter().zip(&values).map(|(w, v)| w * v[d] as f64).sum();
                    attn.push((sum / total) as f32);
                }
            }
            rank.attn = attn;
        }
        Ok(())
    }

    fn add_attention_out(&mut self, o: &Weight, post_norm: Option<&Weight>) -> Result<()> {
        let partials = self.ranks.iter().map(|r| r.get(o).times(&r.attn)).collect();
        self.add_reduced(partials, post_norm);
        Ok(())
    }

    fn add_gated_ffn(
        &mut self,
        act: Activation,
        gate: &Weight,
        up: &Weight,
        down: &Weight,
        post_norm: Option<&Weight>,
    ) -> Result<()> {
        let h = &self.h;
        let partials =
            self.ranks.iter().map(|r| r.get(down).times(&activate(act, &r.get(gate).times(h), &r.get(up).times(h))));
        let partials = partials.collect();
        self.add_reduced(partials, post_norm);
        Ok(())
    }

    /// The router whole on every rank, so every rank makes the same choice; each sums its slice of the
    /// chosen experts, weighted.
    fn add_moe_ffn(&mut self, router: &Weight, gate: &[Weight], up: &[Weight], down: &[Weight]) -> Result<()> {
        let moe = self.cfg.moe.expect("a router's model has experts");
        let logits = self.ranks[0].get(router).times(&self.h);
        let mut order: Vec<usize> = (0..moe.experts).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let chosen = &order[..moe.used];
        let max = logits[chosen[0]] as f64;
        let share = |e: usize| (logits[e] as f64 - max).exp();
        let total: f64 =
            if moe.norm_topk { chosen.iter().map(|&e| share(e)).sum() } else { (0..moe.experts).map(share).sum() };
        let h = &self.h;
        let partials = self.ranks.iter().map(|r| {
            let mut sum = vec![0f32; h.len()];
            for &e in chosen {
                let a = activate(Activation::Silu, &r.get(&gate[e]).times(h), &r.get(&up[e]).times(h));
                let w = (share(e) / total) as f32;
                sum.iter_mut().zip(r.get(&down[e]).times(&a)).for_each(|(s, o)| *s += o * w);
            }
            sum
        });
        let partials = partials.collect();
        self.add_reduced(partials, None);
        Ok(())
    }
}

/// The logits after each of `tokens`, `src` split `world` ways.
fn split_logits(src: &MemSource, world: usize, tokens: &[u32]) -> Vec<Vec<f32>> {
    let cfg = src.config();
    let plan = ShardPlan::new(cfg, world, |w| src.tensor(&w.name).unwrap().dtype).unwrap();
    let layers = Layers::build(cfg, |w| Ok(w.clone())).unwrap();
    let final_norm = weight_list(cfg).into_iter().find(|w| w.name == names::FINAL_NORM).unwrap();
    let mut split = Split {
        cfg,
        ranks: (0..world).map(|r| Rank::load(src, &plan, r)).collect(),
        token: 0,
        pos: 0,
        x: vec![],
        h: vec![],
        inv_freq: rope_inv_freq(cfg),
        inv_freq_local: rope_inv_freq_local(cfg).unwrap_or_default(),
    };
    let mut out = Vec::new();
    for (pos, &t) in tokens.iter().enumerate() {
        (split.token, split.pos) = (t, pos);
        arch::forward(cfg, &mut split, &layers).unwrap();
        out.push(split.logits(&final_norm));
    }
    out
}

fn unsplit_logits(src: &MemSource, tokens: &[u32]) -> Vec<Vec<f32>> {
    let model = CpuModel::new(src).unwrap();
    let mut stream = model.new_stream(tokens.len());
    model.forward_all(&mut stream, tokens).unwrap()
}

/// The split's logits at every position against the unsplit model's, `world` ways; the worst distance.
fn check(name: &str, cfg: &ModelConfig, recipe: impl Into<Recipe>, worlds: &[usize]) -> f64 {
    let src = MemSource::synthetic(cfg, 7, recipe);
    let mut rng = Rng::fresh(name);
    let tokens: Vec<u32> = (0..12).map(|_| rng.below(cfg.vocab as u64) as u32).collect();
    let want = unsplit_logits(&src, &tokens);
    let mut worst = 0f64;
    for &world in worlds {
        for (pos, (got, want)) in split_logits(&src, world, &tokens).iter().zip(&want).enumerate() {
            let d = rel_l2(got, want);
            assert!(d < 1e-4, "{name} over {world}: position {pos} is {d:e} from the unsplit logits");
            worst = worst.max(d);
        }
    }
    println!("{name}: worst relative L2 {worst:e} over {worlds:?} ranks");
    worst
}

/// 8 heads over 4 KV heads; a vocabulary of 99 leaves the fourth rank a short chunk.
fn llama() -> ModelConfig {
    let mut cfg = ModelConfig::llama(128, 3, 8, 4, 256, 99);
    cfg.max_position = 64;
    cfg
}

#[test]
fn llama_splits_one_two_and_four_ways_in_f32_and_q8_0() {
    check("llama f32", &llama(), DType::F32, &[1, 2, 4]);
    check("llama q8_0", &llama(), DType::Q8_0, &[2, 4]);
}

/// Qwen2's biases cut with their rows; Qwen3's per-head norms whole, with two KV heads on four ranks
/// (each replicated on two) and the head tied to the embedding.
#[test]
fn qwen2_biases_and_qwen3_replicated_kv_heads_split() {
    let mut qwen2 = llama();
    (qwen2.arch, qwen2.qkv_bias) = (Arch::Qwen2, true);
    check("qwen2 q8_0", &qwen2, DType::Q8_0, &[2, 4]);
    let mut qwen3 = llama();
    (qwen3.arch, qwen3.qk_norm, qwen3.kv_heads, qwen3.tied) = (Arch::Qwen3, true, 2, true);
    check("qwen3 bf16", &qwen3, DType::Bf16, &[2, 4]);
}

/// Gemma 3's post-norms after each all-reduce, its scaled embedding, sliding windows with their own
/// rotary base and its query scale.
#[test]
fn gemma3_splits_with_post_norms_after_the_sums() {
    let mut cfg = ModelConfig::llama(64, 4, 4, 2, 96, 96);
    (cfg.arch, cfg.head_dim, cfg.tied, cfg.qk_norm, cfg.max_position) = (Arch::Gemma3, 32, true, true, 64);
    cfg.attention = AttentionConfig {
        query_scale_base: Some(24.0),
        sliding: Some(SlidingWindow { window: 5, global_every: 2, rope_theta: 10_000.0 }),
    };
    check("gemma3 f32", &cfg, DType::F32, &[2, 4]);
}

/// 256-value blocks: 4 heads of 64 are one Q4_K block of o's columns, and the feed-forward's 512 are
/// two blocks of down's; llama.cpp's Q4_K_M mix (Q6_K downs and head) splits the same way.
#[test]
fn k_quants_split_on_super_block_boundaries() {
    let mut cfg = ModelConfig::llama(256, 2, 8, 4, 512, 120);
    (cfg.head_dim, cfg.max_position) = (64, 64);
    check("llama q4_k", &cfg, DType::Q4_K, &[2]);
    check("llama Q4_K_M", &cfg, Recipe::Q4KM, &[2]);
}

#[test]
fn mixture_of_experts_splits_each_expert_by_its_width() {
    let mut cfg = llama();
    (cfg.arch, cfg.qk_norm) = (Arch::Qwen3Moe, true);
    cfg.moe = Some(MoeConfig { experts: 4, used: 2, intermediate: 64, norm_topk: true });
    check("qwen3_moe q8_0", &cfg, DType::Q8_0, &[2]);
}

/// The comparison sees a wrong cut: rank 0 given rank 1's columns of o (and the reverse) is far off.
#[test]
fn a_wrong_cut_is_caught() {
    let cfg = llama();
    let src = MemSource::synthetic(&cfg, 7, DType::F32);
    let tokens = [3, 14, 15, 92, 65];
    let want = unsplit_logits(&src, &tokens);
    let plan = ShardPlan::new(&cfg, 2, |_| DType::F32).unwrap();
    let o = names::layer(1, names::O);
    let mut ranks: Vec<Rank> = (0..2).map(|r| Rank::load(&src, &plan, r)).collect();
    let (a, b) = (ranks[0].held.remove(&o).unwrap(), ranks[1].held.remove(&o).unwrap());
    ranks[0].held.insert(o.clone(), b);
    ranks[1].held.insert(o, a);
    let layers = Layers::build(&cfg, |w| Ok(w.clone())).unwrap();
    let final_norm = weight_list(&cfg).into_iter().find(|w| w.name == names::FINAL_NORM).unwrap();
    let (inv_freq, inv_freq_local) = (rope_inv_freq(&cfg), vec![]);
    let mut split = Split { cfg: &cfg, ranks, token: 0, pos: 0, x: vec![], h: vec![], inv_freq, inv_freq_local };
    let mut worst = 0f64;
    for (pos, &t) in tokens.iter().enumerate() {
        (split.token, split.pos) = (t, pos);
        arch::forward(&cfg, &mut split, &layers).unwrap();
        worst = worst.max(rel_l2(&split.logits(&final_norm), &want[pos]));
    }
    assert!(worst > 1e-2, "a swapped cut of o is only {worst:e} off");
}

/// A rank's source gives its head only as `RANK_HEAD`, and a loader of whole models refuses it rather
/// than run it as a smaller model.
#[test]
fn a_rank_alone_is_refused_by_whole_model_loaders() {
    let cfg = llama();
    let src = MemSource::synthetic(&ModelConfig { tied: false, ..cfg.clone() }, 7, DType::Q8_0);
    let plan = ShardPlan::new(src.config(), 2, |_| DType::Q8_0).unwrap();
    let rank = RankSource::new(&src, &plan, 1).unwrap();
    assert_eq!(rank.tensor(names::LM_HEAD).err().map(|e| e.status), Some(hostembed::Status::BadModel));
    let head = rank.tensor(shard::RANK_HEAD).unwrap();
    assert_eq!(head.shape, [49, 128], "the last rank's 49 of 99 ids");
    let e = CpuModel::new(&rank).err().expect("refused");
    assert_eq!(e.status, hostembed::Status::Unsupported, "{e}");
    assert!(e.to_string().contains("50..99"), "{e}");
    assert!(rank.copied_bytes() > 0 && rank.config().heads == 4 && rank.config().kv_heads == 2);
    // The CUDA loader refuses it before it asks for a device (`GpuModel::load_rank` takes a rank).
    let rows = RowsOnDevice { ptr: std::ptr::null(), dtype: DType::Q8_0, vocab: 99, cols: 128 };
    let e = GpuModel::load(&rank, rows, 16, 4, &Tuning::default()).err().expect("refused");
    assert_eq!(e.status, hostembed::Status::Unsupported, "{e}");
}
