//! RoPE with the KV append, and decode attention (at long context too), against the CPU.

use super::{NULL_STREAM, assert_close, bf16_round, download, launch_tuning, ok, poisoned};
use crate::common::{PagedKv, Rng, gpu_present};
use hostembed::cuda::DeviceBuffer;
use hostembed::gpu::PAGE_TOKENS;
use hostembed::kv::KvType;
use hostembed::model::{ModelConfig, RopeScaling};
use hostembed::{cpu, kernels as kn};
use std::os::raw::{c_int, c_uint};
use std::ptr;

fn config(heads: usize, kv_heads: usize, head_dim: usize, scaling: RopeScaling, interleaved: bool) -> ModelConfig {
    let llama = ModelConfig::llama(heads * head_dim, 1, heads, kv_heads, 64, 256);
    ModelConfig { rms_eps: 1e-6, rope_scaling: scaling, rope_interleaved: interleaved, ..llama }
}

#[test]
fn rope_and_kv_append_match_cpu() {
    if !gpu_present("rope_and_kv_append_match_cpu") {
        return;
    }
    let mut rng = Rng::fresh("rope_and_kv_append_match_cpu");
    let llama3 =
        RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192 };
    let cases = [
        (8, 2, 128, RopeScaling::None, false, false),
        (8, 2, 128, llama3, true, false),
        (4, 4, 64, RopeScaling::Linear { factor: 4.0 }, false, true),
        (6, 3, 256, RopeScaling::None, true, true),
        (5, 1, 80, RopeScaling::None, false, true),
    ];
    for (heads, kv_heads, hd, scaling, interleaved, qk_norm) in cases {
        let cfg = config(heads, kv_heads, hd, scaling, interleaved);
        let inv_freq = cpu::rope_inv_freq(&cfg);
        let (q_dim, kv_dim) = (heads * hd, kv_heads * hd);
        let stride = q_dim + 2 * kv_dim + 3;
        // Tokens 0 and 1 of one stream, token 2 of another, each stream's pages scattered over the pool.
        let n = 3;
        let window = 4000usize;
        let token_stream = [0, 0, 1];
        let mut pos: Vec<i32> = (0..n).map(|_| rng.below(window as u64) as i32).collect();
        if pos[1] == pos[0] {
            pos[1] = (pos[0] + 1) % window as i32;
        }
        let qkv = rng.vec(n * stride, 2.0);
        let (qn, kn_w) = (rng.vec(hd, 1.0), rng.vec(hd, 1.0));
        let eps = 1e-6;

        let mut want = qkv.clone();
        for t in 0..n {
            let row = &mut want[t * stride..(t + 1) * stride];
            let (q, rest) = row.split_at_mut(q_dim);
            let k = &mut rest[..kv_dim];
            if qk_norm {
                for (part, w) in [(&mut *q, &qn), (&mut *k, &kn_w)] {
                    for head in part.chunks_mut(hd) {
                        let mut normed = vec![0f32; hd];
                        cpu::rmsnorm(head, w, eps, &mut normed);
                        head.copy_from_slice(&normed);
                    }
                }
            }
            cpu::rope(q, heads, hd, pos[t] as usize, &inv_freq, interleaved);
            cpu::rope(k, kv_heads, hd, pos[t] as usize, &inv_freq, interleaved);
        }

        let qkv_d = DeviceBuffer::from_slice(&qkv).unwrap();
        let pos_d = DeviceBuffer::from_slice(&pos).unwrap();
        let inv_d = DeviceBuffer::from_slice(&inv_freq).unwrap();
        let qn_d = DeviceBuffer::from_slice(&qn).unwrap();
        let kn_d = DeviceBuffer::from_slice(&kn_w).unwrap();
        let mut kv = PagedKv::new(2 * window.div_ceil(PAGE_TOKENS) + 3, kv_heads, hd);
        let tables = kv.tables(&mut rng, &[window, window]);
        let dt = DeviceTables::new(&tables, &token_stream);
        let pool = poisoned(kv.bits.len() * 2);
        ok(
            // SAFETY: device buffers sized for the case (its rows, positions, tables and pool pages), alive until the
            // synchronous check after the launch.
            unsafe {
                kn::hostembed_rope_kv(
                    qkv_d.ptr() as *mut f32,
                    stride as c_uint,
                    n as c_uint,
                    pos_d.ptr() as *const c_int,
                    heads as c_uint,
                    kv_heads as c_uint,
                    hd as c_uint,
                    inv_d.ptr() as *const f32,
                    interleaved as c_int,
                    if qk_norm { qn_d.ptr() as *const f32 } else { ptr::null() },
                    if qk_norm { kn_d.ptr() as *const f32 } else { ptr::null() },
                    eps,
                    pool.ptr(),
                    dt.ptr(),
                    kv.pages as c_uint,
                    KvType::Bf16 as c_int,
                    KvType::Bf16 as c_int,
                    launch_tuning(),
                    NULL_STREAM,
                )
            },
            "hostembed_rope_kv",
        );
        let got = download::<f32>(&qkv_d, n * stride);
        let what =
            format!("rope {heads}/{kv_heads} heads of {hd}, {scaling:?}, interleaved {interleaved}, qk_norm {qk_norm}");
        // q and k rotated in place; v and the padding untouched.
        let pick = |v: &[f32], from: usize, to: usize| -> Vec<f32> {
            (0..n).flat_map(|t| v[t * stride + from..t * stride + to].to_vec()).collect()
        };
        assert_close(
            &format!("{what}: q and k"),
            &pick(&got, 0, q_dim + kv_dim),
            &pick(&want, 0, q_dim + kv_dim),
            1e-5,
        );
        assert_eq!(
            pick(&got, q_dim + kv_dim, stride),
            pick(&qkv, q_dim + kv_dim, stride),
            "{what}: v or padding changed"
        );

        // The pool holds bf16 k (rotated) and v at each token's position of its stream, nothing elsewhere.
        pool.download(&mut kv.bits).unwrap();
        let (mut got_k, mut want_k) = (Vec::new(), Vec::new());
        let mut written = std::collections::HashSet::new();
        for t in 0..n {
            let table = &tables[token_stream[t]];
            for h in 0..kv_heads {
                for d in 0..hd {
                    let (ka, va) =
                        (kv.at(table, false, h, pos[t] as usize, d), kv.at(table, true, h, pos[t] as usize, d));
                    written.extend([ka, va]);
                    got_k.push(half::bf16::from_bits(kv.bits[ka]).to_f32());
                    want_k.push(want[t * stride + q_dim + h * hd + d]);
                    let v = qkv[t * stride + q_dim + kv_dim + h * hd + d];
                    assert_eq!(
                        kv.bits[va],
                        half::bf16::from_f32(v).to_bits(),
                        "{what}: v of token {t} (stream {}) head {h} dim {d}",
                        token_stream[t]
                    );
                }
            }
        }
        assert_close(&format!("{what}: k cache"), &got_k, &want_k, 4e-3);
        if let Some(i) = (0..kv.bits.len()).find(|i| kv.bits[*i] != 0xFFFF && !written.contains(i)) {
            panic!("{what}: the pool was written at value {i}, which no token's position maps to");
        }
    }
}

/// Device copies of page tables and, per query token, the address of its stream's table.
struct DeviceTables {
    _tables: DeviceBuffer,
    per_token: DeviceBuffer,
}

impl DeviceTables {
    /// `token_stream[t]`: which of `tables` token t reads.
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

/// Launches the attention of the tokens `tokens` (indices into q and pos) and returns their outputs; with
/// `combined`, the split kernel combines the parts itself (hostembed_attention_combined), and its arrival
/// counters are checked to be left zero.
#[allow(clippy::too_many_arguments)]
fn launch_attention(
    q: &[f32],
    q_stride: usize,
    pos: &[i32],
    tokens: &[usize],
    pool: &DeviceBuffer,
    pool_pages: usize,
    tables: &[Vec<u32>],
    token_stream: &[usize],
    heads: usize,
    kv_heads: usize,
    hd: usize,
    splits: usize,
    grid_parts: usize,
    tuning: kn::hostembed_tuning,
    combined: bool,
) -> Vec<f32> {
    let n = tokens.len();
    let q: Vec<f32> = tokens.iter().flat_map(|&t| q[t * q_stride..(t + 1) * q_stride].to_vec()).collect();
    let pos: Vec<i32> = tokens.iter().map(|&t| pos[t]).collect();
    let streams: Vec<usize> = tokens.iter().map(|&t| token_stream[t]).collect();
    let dt = DeviceTables::new(tables, &streams);
    let qd = DeviceBuffer::from_slice(&q).unwrap();
    let pd = DeviceBuffer::from_slice(&pos).unwrap();
    let partial = poisoned(n * heads * splits * (hd + 2) * 4);
    let out = poisoned(n * heads * hd * 4);
    let counters = DeviceBuffer::new(n.max(1) * heads * 4).unwrap();
    counters.fill_bytes(0).unwrap();
    let counters_ptr = if combined { counters.ptr() as *mut c_uint } else { std::ptr::null_mut() };
    ok(
        // SAFETY: device buffers sized for `n` queries, the pool's pages and tables, their partial results and
        // (n * heads) arrival counters, alive until the synchronous check after the launch.
        unsafe {
            kn::hostembed_attention_combined(
                qd.ptr() as *const f32,
                q_stride as c_uint,
                pool.ptr(),
                dt.ptr(),
                pool_pages as c_uint,
                KvType::Bf16 as c_int,
                KvType::Bf16 as c_int,
                pd.ptr() as *const c_int,
                n as c_uint,
                heads as c_uint,
                kv_heads as c_uint,
                hd as c_uint,
                1.0 / (hd as f32).sqrt(),
                0,
                splits as c_uint,
                grid_parts as c_uint,
                partial.ptr() as *mut f32,
                out.ptr() as *mut f32,
                counters_ptr,
                tuning,
                NULL_STREAM,
            )
        },
        "hostembed_attention_combined",
    );
    let left = download::<u32>(&counters, n.max(1) * heads);
    assert!(left.iter().all(|&c| c == 0), "the combine's arrival counters are not left zero");
    download::<f32>(&out, n * heads * hd)
}

/// One attention case: streams of (context, queries) whose query tokens sit at the last positions of
/// their context, all in one launch over one paged pool (each stream's pages scattered); checked
/// against the CPU, and each stream's outputs against its tokens launched alone (bit for bit).
fn run_attention(rng: &mut Rng, heads: usize, kv_heads: usize, hd: usize, streams: &[(usize, usize)], splits: usize) {
    let kv_dim = kv_heads * hd;
    let q_stride = heads * hd + 16;
    let windows: Vec<usize> = streams.iter().map(|&(ctx, _)| ctx + 7).collect();
    let pages: usize = windows.iter().map(|w| w.div_ceil(PAGE_TOKENS)).sum::<usize>() + 5;
    let mut kv = PagedKv::new(pages, kv_heads, hd);
    let tables = kv.tables(rng, &windows);
    let (mut q, mut pos, mut token_stream, mut want) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (si, &(n_ctx, n)) in streams.iter().enumerate() {
        // K and V as the cache stores them (bf16), so both sides read the same values.
        let k: Vec<f32> = rng.vec(n_ctx * kv_dim, 1.0).into_iter().map(bf16_round).collect();
        let v: Vec<f32> = rng.vec(n_ctx * kv_dim, 1.0).into_iter().map(bf16_round).collect();
        for p in 0..n_ctx {
            for h in 0..kv_heads {
                for d in 0..hd {
                    let i = p * kv_dim + h * hd + d;
                    let (ka, va) = (kv.at(&tables[si], false, h, p, d), kv.at(&tables[si], true, h, p, d));
                    kv.bits[ka] = half::bf16::from_f32(k[i]).to_bits();
                    kv.bits[va] = half::bf16::from_f32(v[i]).to_bits();
                }
            }
        }
        let qs = rng.vec(n * q_stride, 1.0);
        for t in 0..n {
            let p = n_ctx - n + t;
            let mut o = vec![0f32; heads * hd];
            cpu::attention(&qs[t * q_stride..t * q_stride + heads * hd], &k, &v, p + 1, heads, kv_heads, hd, &mut o);
            want.extend(o);
            pos.push(p as i32);
            token_stream.push(si);
        }
        q.extend(qs);
    }
    let pool = DeviceBuffer::from_slice(&kv.bits).unwrap();
    let all: Vec<usize> = (0..pos.len()).collect();
    // The grid the engine gives a launch: as many blocks a token as the longest context fills.
    let grid_of = |tokens: &[usize]| {
        let longest = tokens.iter().map(|&t| pos[t] as usize + 1).max().unwrap_or(0);
        hostembed::gpu::attention_grid_parts(longest, splits)
    };
    let launch_with = |tokens: &[usize], grid_parts: usize, tuning: kn::hostembed_tuning, combined: bool| {
        launch_attention(
            &q,
            q_stride,
            &pos,
            tokens,
            &pool,
            pages,
            &tables,
            &token_stream,
            heads,
            kv_heads,
            hd,
            splits,
            grid_parts,
            tuning,
            combined,
        )
    };
    let launch = |tokens: &[usize], grid_parts: usize| launch_with(tokens, grid_parts, launch_tuning(), false);
    let got = launch(&all, grid_of(&all));
    let what =
        format!("attention {heads}/{kv_heads} heads of {hd}, streams (context, tokens) {streams:?}, {splits} splits");
    assert_close(&what, &got, &want, 1e-4);
    let width = heads * hd;
    let same_bits = |a: &[f32], b: &[f32], what: &str| {
        if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
            panic!("{what}: value {i}: {} against {} in the batch", a[i], b[i]);
        }
    };
    // The grid changes which block computes a part, never its bits: one block a token taking every
    // part in turn, and a block for every part.
    for grid_parts in [1, splits] {
        same_bits(&launch(&all, grid_parts), &got, &format!("{what}: {grid_parts} blocks a token"));
    }
    // Either kernel (more loads in flight a thread, or more blocks a multiprocessor): the same bits.
    for blocks in [1, 2] {
        let tuning = kn::hostembed_tuning { attention_blocks: blocks, ..launch_tuning() };
        same_bits(
            &launch_with(&all, grid_of(&all), tuning, false),
            &got,
            &format!("{what}: attention kernel {blocks}"),
        );
    }
    // The parts combined by the split kernel's last block: the same bits, on any grid.
    for grid_parts in [1, grid_of(&all), splits] {
        let combined = launch_with(&all, grid_parts, launch_tuning(), true);
        same_bits(&combined, &got, &format!("{what}: combined in the split kernel, {grid_parts} blocks a token"));
    }
    // Batch invariance: each stream's tokens launched without the others (on their own grid) give the
    // same bits.
    for si in 0..streams.len() {
        let mine: Vec<usize> = all.iter().copied().filter(|&t| token_stream[t] == si).collect();
        let alone = launch(&mine, grid_of(&mine));
        for (k, &t) in mine.iter().enumerate() {
            let (a, b) = (&alone[k * width..(k + 1) * width], &got[t * width..(t + 1) * width]);
            same_bits(a, b, &format!("{what}: stream {si} token {t} alone"));
        }
    }
}

#[test]
fn attention_matches_cpu() {
    if !gpu_present("attention_matches_cpu") {
        return;
    }
    let mut rng = Rng::fresh("attention_matches_cpu");
    run_attention(&mut rng, 32, 8, 128, &[(300, 1)], 7); // Llama-3 8B heads, a context not a multiple of a part
    run_attention(&mut rng, 32, 8, 128, &[(300, 1), (17, 1), (1, 1), (513, 1), (64, 1)], 32); // decode batch
    run_attention(&mut rng, 14, 2, 64, &[(1000, 3), (40, 2)], 16); // groups of 7 (a block of 8 heads, one masked)
    run_attention(&mut rng, 16, 16, 256, &[(513, 2)], 5); // no grouping, the largest head
    run_attention(&mut rng, 8, 2, 96, &[(129, 4), (33, 1)], 3); // a head_dim between the kernel's sizes
    run_attention(&mut rng, 40, 8, 128, &[(77, 5)], 1); // groups of 5, one part
    run_attention(&mut rng, 8, 4, 128, &[(3, 2), (2, 1)], 16); // more parts than positions: empty parts
    run_attention(&mut rng, 16, 2, 256, &[(200, 1)], 9); // groups of 8 with head_dim 256: two blocks a group
}

#[test]
fn attention_stays_right_at_long_context() {
    if !gpu_present("attention_stays_right_at_long_context") {
        return;
    }
    let mut rng = Rng::fresh("attention_stays_right_at_long_context");
    run_attention(&mut rng, 8, 2, 128, &[(32768, 1)], 33);
    run_attention(&mut rng, 8, 2, 64, &[(20000 + 13, 2), (16384, 1)], 64);
    run_attention(&mut rng, 32, 8, 128, &[(16384, 1), (16000, 1), (5, 1)], 32); // the decode shape at 16k
}
