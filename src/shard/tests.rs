//! The shard rules on real model shapes: ranges that partition each cut dimension, the GQA rules, block
//! boundaries and the refusals' messages, and `take` against the decoded full tensor.

use super::*;
use crate::model::{Arch, MoeConfig, names};
use crate::status::Status;

fn weight(cfg: &ModelConfig, name: &str) -> Weight {
    weight_list(cfg).into_iter().find(|w| w.name == name).unwrap_or_else(|| panic!("no {name}"))
}

fn layer(cfg: &ModelConfig, part: &str) -> Weight {
    weight(cfg, &names::layer(0, part))
}

fn llama_8b() -> ModelConfig {
    ModelConfig::llama(4096, 2, 32, 8, 14336, 128256)
}

/// Every matrix in `dtype`, norms and biases in F32 as the readers give them.
fn plan(cfg: &ModelConfig, world: usize, dtype: DType) -> Result<ShardPlan> {
    ShardPlan::new(cfg, world, |w| if w.is_vector() { DType::F32 } else { dtype })
}

fn refusal(r: Result<ShardPlan>) -> (Status, String) {
    let e = r.expect_err("refused");
    (e.status, e.message)
}

/// Each rank's ranges of `part`, in rank order.
fn ranges(p: &ShardPlan, part: Part) -> Vec<Range<usize>> {
    (0..p.world()).map(|r| p.range(r, part)).collect()
}

fn assert_partition(rs: &[Range<usize>], total: usize) {
    let mut at = 0;
    for r in rs {
        assert_eq!(r.start, at, "{rs:?}");
        assert!(r.end > r.start, "{rs:?}");
        at = r.end;
    }
    assert_eq!(at, total, "{rs:?}");
}

#[test]
fn one_rank_holds_every_weight_whole() {
    let cfg = llama_8b();
    let p = plan(&cfg, 1, DType::Q4_K).unwrap();
    for w in weight_list(&cfg) {
        let s = p.slice(0, &w).unwrap();
        assert_eq!(s, Slice { rows: 0..shape_rows(&w.shape), cols: 0..shape_cols(&w.shape) }, "{}", w.name);
    }
    assert_eq!(p.head(0), Slice { rows: 0..cfg.vocab, cols: 0..cfg.hidden });
}

#[test]
fn the_8b_shape_splits_two_four_and_eight_ways() {
    let cfg = llama_8b();
    for world in [2, 4, 8] {
        let p = plan(&cfg, world, DType::Q8_0).unwrap();
        assert_partition(&ranges(&p, Part::QueryHeads), cfg.q_dim());
        assert_partition(&ranges(&p, Part::KvHeads), cfg.kv_dim());
        assert_partition(&ranges(&p, Part::Ffn), cfg.intermediate);
        assert_partition(&ranges(&p, Part::Vocab), cfg.vocab);
        for r in 0..world {
            let s = p.rank(r);
            assert_eq!(s.q_heads.len(), 32 / world);
            assert_eq!(s.kv_heads, r * 8 / world..(r + 1) * 8 / world);
            assert_eq!(s.ffn.len(), 14336 / world);
            assert!(s.expert_ffn.is_empty());
            let (q, o) = (p.slice(r, &layer(&cfg, names::Q)).unwrap(), p.slice(r, &layer(&cfg, names::O)).unwrap());
            assert_eq!(q.rows, p.range(r, Part::QueryHeads));
            assert_eq!((o.rows.clone(), o.cols.clone()), (0..4096, q.rows.clone()), "o reads the rank's heads");
            let (k, v) = (p.slice(r, &layer(&cfg, names::K)).unwrap(), p.slice(r, &layer(&cfg, names::V)).unwrap());
            assert_eq!((k.rows.clone(), k.cols), (p.range(r, Part::KvHeads), 0..4096));
            assert_eq!(v.rows, k.rows);
            let (gate, up, down) = (
                p.slice(r, &layer(&cfg, names::GATE)).unwrap(),
                p.slice(r, &layer(&cfg, names::UP)).unwrap(),
                p.slice(r, &layer(&cfg, names::DOWN)).unwrap(),
            );
            assert_eq!(gate.rows, s.ffn);
            assert_eq!(up, gate);
            assert_eq!((down.rows, down.cols), (0..4096, s.ffn.clone()));
            let head = p.slice(r, &weight(&cfg, names::LM_HEAD)).unwrap();
            assert_eq!(head, p.head(r));
            for whole in [names::EMBED, names::FINAL_NORM] {
                let w = weight(&cfg, whole);
                assert_eq!(p.slice(r, &w).unwrap().rows.len(), shape_rows(&w.shape), "{whole}");
            }
            assert_eq!(p.slice(r, &layer(&cfg, names::ATTN_NORM)).unwrap().cols, 0..4096);
        }
    }
}

/// More ranks than KV heads: each KV head on the ranks whose query heads read it.
#[test]
fn kv_heads_are_replicated_past_their_count() {
    let cfg = ModelConfig::llama(512, 1, 8, 2, 1024, 1000);
    let p = plan(&cfg, 4, DType::F32).unwrap();
    let kv: Vec<_> = (0..4).map(|r| p.rank(r).kv_heads.clone()).collect();
    assert_eq!(kv, [0..1, 0..1, 1..2, 1..2]);
    let q: Vec<_> = (0..4).map(|r| p.rank(r).q_heads.clone()).collect();
    assert_eq!(q, [0..2, 2..4, 4..6, 6..8]);
    let p = plan(&cfg, 8, DType::F32).unwrap();
    assert_eq!(p.rank(7).kv_heads, 1..2);
}

#[test]
fn head_counts_that_do_not_split_are_unsupported() {
    let (status, msg) = refusal(plan(&ModelConfig::llama(768, 1, 12, 4, 1024, 1000), 8, DType::F32));
    assert_eq!(status, Status::Unsupported);
    assert!(msg.contains("over 8 devices") && msg.contains("12 attention heads"), "{msg}");
    // 12 heads split 4 ways, but 3 KV heads neither split 4 ways nor divide 4.
    let (status, msg) = refusal(plan(&ModelConfig::llama(768, 1, 12, 3, 1024, 1000), 4, DType::F32));
    assert_eq!(status, Status::Unsupported);
    assert!(msg.contains("3 KV heads"), "{msg}");
    assert_eq!(refusal(plan(&llama_8b(), 0, DType::F32)).0, Status::InvalidArgument);
}

/// o's cut falls every heads/N x head_dim columns: 4 heads of 64 are one Q4_K block, 2 are half of one.
#[test]
fn a_column_cut_inside_a_block_names_the_tensor() {
    let cfg = ModelConfig::llama(1024, 1, 16, 8, 2048, 1000);
    plan(&cfg, 4, DType::Q4_K).unwrap();
    let (status, msg) = refusal(plan(&cfg, 8, DType::Q4_K));
    assert_eq!(status, Status::Unsupported);
    assert!(msg.contains("self_attn.o_proj.weight (Q4_K)") && msg.contains("blocks of 256"), "{msg}");
    plan(&cfg, 8, DType::Q8_0).unwrap();
    // Only o is in a block format: the rest does not matter.
    let o_only = |w: &Weight| if w.spec.role == "o" { DType::Q4_K } else { DType::F16 };
    assert_eq!(refusal(ShardPlan::new(&cfg, 8, o_only)).0, Status::Unsupported);
}

/// Qwen2.5-7B's feed-forward, 18944 = 74 x 256, over four ranks with Q4_K downs: 19, 19, 18, 18
/// blocks; the largest block of any down matrix is the unit. (Its o in Q4_K does not split four ways:
/// 7 heads of 128 are 3.5 blocks.)
#[test]
fn the_feed_forward_is_dealt_in_blocks_of_its_down_matrices() {
    let mut cfg = ModelConfig::llama(3584, 2, 28, 4, 18944, 152064);
    cfg.arch = Arch::Qwen2;
    cfg.qkv_bias = true;
    let (status, msg) = refusal(plan(&cfg, 4, DType::Q4_K));
    assert_eq!(status, Status::Unsupported);
    assert!(msg.contains("o_proj.weight (Q4_K) would be cut at columns 0..896"), "{msg}");
    let q4k_downs = |w: &Weight| match w.spec.role {
        "down" => DType::Q4_K,
        _ if w.is_vector() => DType::F32,
        _ => DType::Q8_0,
    };
    let p = ShardPlan::new(&cfg, 4, q4k_downs).unwrap();
    let lens: Vec<_> = (0..4).map(|r| p.rank(r).ffn.len()).collect();
    assert_eq!(lens, [19 * 256, 19 * 256, 18 * 256, 18 * 256]);
    assert_partition(&ranges(&p, Part::Ffn), 18944);
    let p = plan(&cfg, 4, DType::Q8_0).unwrap();
    assert_eq!(p.rank(0).ffn.len(), 18944 / 4, "148 blocks of 32 split evenly");
    let bias = p.slice(1, &layer(&cfg, names::Q_BIAS)).unwrap();
    assert_eq!((bias.rows, bias.cols), (0..1, p.range(1, Part::QueryHeads)), "a bias is cut with its matrix");
    // 512 values in Q4_K are two blocks: not enough for four ranks.
    let (status, msg) = refusal(plan(&ModelConfig::llama(1024, 1, 16, 8, 512, 1000), 4, DType::Q4_K));
    assert_eq!(status, Status::Unsupported);
    assert!(msg.contains("feed-forward width 512 is 2 blocks of 256"), "{msg}");
}

#[test]
fn the_vocabulary_is_cut_in_equal_chunks_but_the_last() {
    let cfg = ModelConfig::llama(128, 1, 4, 4, 256, 99);
    let p = plan(&cfg, 4, DType::F32).unwrap();
    assert_eq!(ranges(&p, Part::Vocab), [0..25, 25..50, 50..75, 75..99]);
    let mut tied = cfg.clone();
    tied.tied = true;
    let p = plan(&tied, 4, DType::F32).unwrap();
    assert_eq!(p.head(3), Slice { rows: 75..99, cols: 0..128 });
    assert_eq!(p.slice(3, &weight(&tied, names::EMBED)).unwrap().rows, 0..99, "the gather reads any row");
    let small = ModelConfig::llama(128, 1, 4, 4, 256, 5);
    let (status, msg) = refusal(plan(&small, 4, DType::F32));
    assert_eq!(status, Status::Unsupported);
    assert!(msg.contains("vocabulary of 5"), "{msg}");
}

#[test]
fn experts_are_cut_by_their_width_and_the_router_stays_whole() {
    let mut cfg = ModelConfig::llama(2048, 1, 32, 4, 6144, 1000);
    cfg.arch = Arch::Qwen3Moe;
    cfg.qk_norm = true;
    cfg.moe = Some(MoeConfig { experts: 4, used: 2, intermediate: 768, norm_topk: true });
    let p = plan(&cfg, 2, DType::Q8_0).unwrap();
    assert_eq!(p.rank(1).expert_ffn, 384..768);
    assert!(p.rank(0).ffn.is_empty(), "no dense feed-forward");
    let g = layer(&cfg, &names::expert(names::EXPERT_GATE, 3));
    assert_eq!(p.slice(1, &g).unwrap().rows, 384..768);
    let d = layer(&cfg, &names::expert(names::EXPERT_DOWN, 0));
    assert_eq!(p.slice(0, &d).unwrap(), Slice { rows: 0..2048, cols: 0..384 });
    let router = layer(&cfg, names::ROUTER);
    assert_eq!(p.slice(1, &router).unwrap(), Slice { rows: 0..4, cols: 0..2048 });
    assert_eq!(p.slice(0, &layer(&cfg, names::Q_NORM)).unwrap().cols, 0..cfg.head_dim);
    // 768 in Q4_K is three blocks: four ranks get none.
    assert_eq!(refusal(plan(&cfg, 4, DType::Q4_K)).0, Status::Unsupported);
}

#[test]
fn slices_of_another_model_or_rank_are_invalid() {
    let p = plan(&llama_8b(), 2, DType::F32).unwrap();
    let small = ModelConfig::llama(128, 1, 4, 4, 256, 99);
    let e = p.slice(1, &layer(&small, names::GATE)).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("not a weight of the model"), "{}", e.message);
    assert_eq!(p.slice(2, &layer(&small, names::GATE)).unwrap_err().status, Status::InvalidArgument);
}

/// A Q8_0 matrix's column slice decodes to the full matrix's columns, its row slice to its rows.
#[test]
fn take_copies_whole_blocks_of_the_range() {
    let (rows, cols) = (6, 128);
    let values: Vec<f32> = (0..rows * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 16.0).collect();
    let mut bytes = Vec::new();
    values.chunks(cols).for_each(|row| bytes.extend(crate::tensor::encode_row(DType::Q8_0, row)));
    let shape = [rows, cols];
    let t = TensorRef { dtype: DType::Q8_0, shape: &shape, bytes: &bytes };
    let full = t.to_f32();
    let s = Slice { rows: 1..5, cols: 32..96 };
    let part = take(&t, &s).unwrap();
    assert_eq!(Some(part.len() as u64), s.bytes(DType::Q8_0));
    let part_shape = [4, 64];
    let got = TensorRef { dtype: DType::Q8_0, shape: &part_shape, bytes: &part }.to_f32();
    for (i, row) in got.chunks(64).enumerate() {
        assert_eq!(row, &full[(1 + i) * cols + 32..(1 + i) * cols + 96], "row {i}");
    }
    for bad in
        [Slice { rows: 0..1, cols: 16..64 }, Slice { rows: 0..7, cols: 0..32 }, Slice { rows: 0..1, cols: 0..160 }]
    {
        assert_eq!(take(&t, &bad).unwrap_err().status, Status::InvalidArgument, "{bad:?}");
    }
}

/// Over two ranks each holds half of every cut matrix and all of the rest: the embedding, the norms.
#[test]
fn a_rank_weighs_its_slices_and_the_whole_weights() {
    let cfg = llama_8b();
    let bytes = |world: usize, r: usize| {
        let dtype_of = |w: &Weight| if w.is_vector() { DType::F32 } else { DType::Q8_0 };
        ShardPlan::new(&cfg, world, dtype_of).unwrap().weight_bytes(r, &cfg, dtype_of).unwrap()
    };
    let (all, half) = (bytes(1, 0), bytes(2, 1));
    let whole: u64 = weight_list(&cfg)
        .iter()
        .filter(|w| cut_of(w).unwrap() == Cut::Whole)
        .map(|w| {
            Slice { rows: 0..shape_rows(&w.shape), cols: 0..shape_cols(&w.shape) }
                .bytes(if w.is_vector() { DType::F32 } else { DType::Q8_0 })
                .unwrap()
        })
        .sum();
    assert_eq!(half, whole + (all - whole) / 2);
    assert_eq!(bytes(2, 0), half);
}
