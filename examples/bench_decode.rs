//! Decode speed on the GPU: the matvec kernel's bandwidth on the shapes of a Llama-3-8B layer and head,
//! and batch-1 decode tokens per second on a random model of a given shape (Llama-3-8B by default).
//!
//!     cargo run --release --example bench_decode -- [--hidden 4096] [--layers 32] [--heads 32]
//!         [--kv-heads 8] [--head-dim 128] [--inter 14336] [--vocab 128256] [--dtype bf16|f16|f32|q8_0|
//!         q4_0|q4_1|q5_0|q5_1|q2_k|q3_k|q4_k|q5_k|q6_k|q4_k_m] [--prompt 64[,N...]] [--tokens 128] [--runs 5]
//!         [--greedy]
//!         [--tied] [--kernels-only] [--no-matvec] [--no-mmv] [--mmv-only DTYPE]
//!         [--kv bf16|f16|f32|q8_0|fp8_e4m3[,V]] [--host-rows] [--qwen3-30b-a3b] [--model FILE]
//!
//! `--model` decodes a checkpoint (a GGUF file or an HF folder: the file llama.cpp is measured on)
//! instead of a random model of a shape; the kernel tables keep the shape flags.
//! `--qwen3-30b-a3b` is Qwen3-30B-A3B's Mixture-of-Experts shape (48 layers, 128 experts, 8 a token,
//! hidden 2048, expert width 768; `ModelConfig::qwen3_30b_a3b`) in place of the dense one; shape flags
//! after it change it.
//! `--prompt` is the cache the decode reads (the "32k cache" is `--prompt 32768`; several, comma
//! separated, decode after each on one loaded model); `--greedy` skips the sampled runs; `--kv` picks
//! the KV cache type (K and V, or K,V apart; BF16 by default), e.g. to compare 8-bit caches with BF16:
//! `--prompt 32768 --kv q8_0` against `--prompt 32768`. The prompt goes in as chunks of up to 2,048 tokens
//! (the prompt benchmark's chunk), so a long cache is filled in seconds. `--host-rows` decodes once more
//! with the embedding rows in mapped host memory (the HOST_MAPPED placement) after the rows on the card,
//! on the same weights, and prints the change: the placements' cost in any format, Q4_K_M's included.
//!
//! The tensor-core decode product (mmv) gets its own table: each format it reads at 1 to 64 tokens. `--no-matvec` (or `--no-kernels`) and `--no-mmv` skip those tables;
//! `--mmv-only DTYPE` times only that format on the two large shapes at 1 to 64 tokens (1 and 64 on
//! 4096 x 14336 first, for a profiler).
//! Prints one table per part; HOSTEMBED_CUDA_GRAPHS=0 runs the decode without CUDA graphs. The matvec
//! table's GB/s counts the bytes of the stored blocks read per second. `--dtype q4_k_m` is llama.cpp's
//! Q4_K_M mix (`Recipe::Q4KM`: Q4_K, with Q6_K for the head and for attn_v / ffn_down of about half the
//! layers). For the block formats the decode model's matrices repeat 64 encoded random rows (the
//! reference encoders are too slow for 8B values, and the bytes read per token are the same).

use std::os::raw::{c_int, c_uint};
use std::ptr;
use std::time::Instant;

use hostembed::checkpoint::Checkpoint;
use hostembed::checkpoint::write::{MemSource, Recipe, random_matrix};
use hostembed::cuda::{self, DeviceBuffer, Event, PinnedBuffer, Stream};
use hostembed::cudart as rt;
use hostembed::gpu::{GpuModel, PAGE_TOKENS, RowsOnDevice, truncate_stream};
use hostembed::kernels as kn;
use hostembed::kv::{KvType, KvTypes};
use hostembed::model::{Arch, ModelConfig, RopeScaling, TensorSource, names};
use hostembed::sampler::Sampling;
use hostembed::tensor::{DType, FORMATS};
use hostembed::tuning::Tuning;

/// The launchers' settings as the environment gives them (what an engine would run with).
fn launch_tuning() -> kn::hostembed_tuning {
    kn::hostembed_tuning::of(&Tuning::from_env())
}

struct Args {
    cfg: ModelConfig,
    dtype: DType,
    /// The Q4_K_M mix (dtype is then Q4_K).
    q4_k_m: bool,
    /// The caches to decode after, one model load for all.
    prompts: Vec<usize>,
    tokens: usize,
    /// Greedy decoding only (no sampled runs).
    greedy: bool,
    runs: usize,
    kernels_only: bool,
    matvec_table: bool,
    mmv_table: bool,
    mmv_only: Option<DType>,
    kv: KvTypes,
    /// Decode again with the rows in mapped host memory.
    host_rows: bool,
    /// A checkpoint to decode instead of a random model of `cfg`'s shape.
    model: Option<std::path::PathBuf>,
}

fn parse() -> Args {
    let mut cfg = ModelConfig {
        arch: Arch::Llama,
        vocab: 128256,
        hidden: 4096,
        layers: 32,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 14336,
        rms_eps: 1e-5,
        rope_theta: 500000.0,
        rope_scaling: RopeScaling::None,
        rope_interleaved: false,
        max_position: 8192,
        tied: false,
        qkv_bias: false,
        qk_norm: false,
        attention: Default::default(),
        bos: None,
        eos: None,
        moe: None,
    };
    let (mut dtype, mut prompts, mut tokens, mut runs, mut kernels_only) = (DType::Bf16, vec![64], 128, 5, false);
    let mut greedy = false;
    let (mut matvec_table, mut mmv_table, mut mmv_only) = (true, true, None);
    let mut q4_k_m = false;
    let mut kv = KvTypes::GPU_DEFAULT;
    let mut host_rows = false;
    let mut model = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut num =
            || -> usize { it.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{flag} takes a number")) };
        match flag.as_str() {
            "--hidden" => cfg.hidden = num(),
            "--layers" => cfg.layers = num(),
            "--heads" => cfg.heads = num(),
            "--kv-heads" => cfg.kv_heads = num(),
            "--head-dim" => cfg.head_dim = num(),
            "--inter" => cfg.intermediate = num(),
            "--vocab" => cfg.vocab = num(),
            "--prompt" => {
                prompts =
                    it.next().unwrap_or_default().split(',').map(|v| v.parse().expect("--prompt N[,N...]")).collect()
            }
            "--greedy" => greedy = true,
            "--tokens" => tokens = num(),
            "--runs" => runs = num(),
            "--tied" => cfg.tied = true,
            "--kernels-only" => kernels_only = true,
            "--no-matvec" | "--no-kernels" => matvec_table = false,
            "--no-mmv" => mmv_table = false,
            "--mmv-only" => {
                let name = it.next().unwrap_or_default();
                mmv_only = Some(DType::from_name(&name).unwrap_or_else(|| panic!("--mmv-only: no format {name}")));
            }
            "--dtype" => {
                let name = it.next().unwrap_or_default().to_ascii_lowercase();
                q4_k_m = name == "q4_k_m";
                let lookup = if q4_k_m { "q4_k" } else { name.as_str() };
                dtype = FORMATS
                    .iter()
                    .find(|f| f.name.eq_ignore_ascii_case(lookup))
                    .unwrap_or_else(|| panic!("--dtype: a format name or q4_k_m, not {name:?}"))
                    .dtype;
            }
            "--kv" => kv = parse_kv(&it.next().unwrap_or_default()),
            "--host-rows" => host_rows = true,
            "--model" => model = Some(std::path::PathBuf::from(it.next().unwrap_or_default())),
            "--qwen3-30b-a3b" => cfg = ModelConfig::qwen3_30b_a3b(),
            other => panic!("unknown flag {other} (see the comment at the top of examples/bench_decode.rs)"),
        }
    }
    // The window the decode needs, whatever the shape's own.
    cfg.max_position = cfg.max_position.max(longest_prompt(&prompts) + tokens + 1);
    Args {
        cfg,
        dtype,
        q4_k_m,
        prompts,
        tokens,
        runs,
        greedy,
        kernels_only,
        matvec_table,
        mmv_table,
        mmv_only,
        kv,
        host_rows,
        model,
    }
}

/// The longest of the caches to decode after: it sizes the window and the prompt chunk.
fn longest_prompt(prompts: &[usize]) -> usize {
    prompts.iter().copied().max().unwrap_or(0)
}

/// `--kv`'s value: one type for K and V, or "K,V".
fn parse_kv(value: &str) -> KvTypes {
    let one = |name: &str| match KvType::parse(name) {
        Some(Some(t)) => t,
        _ => panic!("--kv: bf16, f16, f32, q8_0 or fp8_e4m3 (or K,V), not {value:?}"),
    };
    match value.split_once(',') {
        Some((k, v)) => KvTypes { k: one(k), v: one(v) },
        None => KvTypes::same(one(value)),
    }
}

/// cudaMemcpyDeviceToDevice (the runtime's constants are crate-private).
const MEMCPY_DEVICE_TO_DEVICE: rt::cudaMemcpyKind = 3;

fn check(code: c_int, what: &str) {
    cuda::check(code, what).unwrap_or_else(|e| panic!("{what}: {e}"));
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Device-to-device copy bandwidth (bytes read plus written), the practical ceiling, after a second of
/// copies that settles the card for every figure after it.
fn copy_bandwidth(stream: &Stream) -> f64 {
    let bytes = 2usize << 30;
    let (a, b) = (DeviceBuffer::new(bytes).unwrap(), DeviceBuffer::new(bytes).unwrap());
    a.fill_bytes(1).unwrap();
    let copy = || {
        check(
            // SAFETY: two live device buffers of `bytes` each; the last copy is waited for (`elapsed_ms_since`)
            // before they drop.
            unsafe { rt::cudaMemcpyAsync(b.ptr(), a.ptr(), bytes, MEMCPY_DEVICE_TO_DEVICE, stream.raw()) },
            "cudaMemcpyAsync",
        )
    };
    // A second of copies first: on a machine just started, this program's first products ran up to 1.6x
    // slower than the same products seconds later (BENCHMARKS.md, 2026-12-07, night).
    let warm = std::time::Instant::now();
    while warm.elapsed() < std::time::Duration::from_secs(1) {
        for _ in 0..32 {
            copy();
        }
        stream.synchronize().unwrap();
    }
    let times: Vec<f64> = (0..5)
        .map(|_| {
            let (e0, e1) = (Event::new().unwrap(), Event::new().unwrap());
            e0.record(stream.raw()).unwrap();
            copy();
            e1.record(stream.raw()).unwrap();
            e1.elapsed_ms_since(&e0).unwrap() as f64
        })
        .collect();
    2.0 * bytes as f64 / (median(times) * 1e-3) / 1e9
}

/// Median microseconds of one launch of `launch(copy)` over rotating copies of the weights.
fn time_kernel(stream: &Stream, copies: usize, mut launch: impl FnMut(usize)) -> f64 {
    for i in 0..copies.max(3) {
        launch(i % copies);
    }
    let iters = 50;
    let times: Vec<f64> = (0..7)
        .map(|_| {
            let (e0, e1) = (Event::new().unwrap(), Event::new().unwrap());
            e0.record(stream.raw()).unwrap();
            for i in 0..iters {
                launch(i % copies);
            }
            e1.record(stream.raw()).unwrap();
            e1.elapsed_ms_since(&e0).unwrap() as f64 * 1e3 / iters as f64
        })
        .collect();
    median(times)
}

fn bench_kernels(stream: &Stream, peak: f64) {
    println!("\nmatvec, batch 1 (weights rotated over copies that together exceed the L2)");
    println!("| kernel | dtype | rows x cols | MB | us | GB/s | of copy bandwidth |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let shapes = [(4096, 4096), (4096, 14336), (14336, 4096), (128256, 4096)];
    let mut cases: Vec<(DType, usize, usize)> = shapes.iter().map(|&(r, c)| (DType::Bf16, r, c)).collect();
    cases.extend([(DType::F16, 4096, 14336), (DType::F32, 4096, 4096)]);
    // Every block format on the down projection's shape, and Q4_K / Q6_K on the others of a Q4_K_M layer.
    cases.extend(FORMATS.iter().filter(|f| f.block_values > 1).map(|f| (f.dtype, 4096, 14336)));
    cases.extend([(DType::Q4_K, 4096, 4096), (DType::Q4_K, 14336, 4096), (DType::Q6_K, 128256, 4096)]);
    for (dtype, rows, cols) in cases {
        let bytes = rows * dtype.row_bytes(cols).unwrap();
        let copies = (512usize << 20).div_ceil(bytes).max(1);
        let host = random_matrix(dtype, rows, cols, 7);
        let weights: Vec<DeviceBuffer> = (0..copies).map(|_| DeviceBuffer::from_slice(&host).unwrap()).collect();
        let x = DeviceBuffer::from_slice(&vec![0.5f32; cols]).unwrap();
        let y = DeviceBuffer::new(rows * 4).unwrap();
        let us = time_kernel(stream, copies, |i| {
            check(
                // SAFETY: device buffers sized for one token's product of `rows` x `cols` in `dtype`, alive until
                // `time_kernel` has waited for its last launch.
                unsafe {
                    kn::hostembed_matvec(
                        weights[i].ptr(),
                        dtype as c_int,
                        rows as c_uint,
                        cols as c_uint,
                        x.ptr() as *const f32,
                        1,
                        ptr::null(),
                        ptr::null(),
                        y.ptr() as *mut f32,
                        rows as c_uint,
                        stream.raw(),
                    )
                },
                "hostembed_matvec",
            )
        });
        let gbs = bytes as f64 / (us * 1e-6) / 1e9;
        // What 70% of the copy bandwidth would take, the target for the block formats.
        let target_us = bytes as f64 / (0.7 * peak * 1e9) * 1e6;
        println!(
            "| matvec | {} | {rows} x {cols} | {:.1} | {us:.1} (70%: {target_us:.1}) | {gbs:.0} | {:.0}% |",
            dtype.name(),
            bytes as f64 / 1e6,
            100.0 * gbs / peak
        );
    }
    // Gate and up with SwiGLU in one pass: two matrices per launch.
    let (rows, cols) = (14336, 4096);
    for dtype in [DType::Bf16, DType::Q4_K, DType::Q8_0] {
        let bytes = rows * dtype.row_bytes(cols).unwrap();
        let copies = (512usize << 20).div_ceil(2 * bytes).max(1);
        let host = random_matrix(dtype, rows, cols, 9);
        let weights: Vec<DeviceBuffer> = (0..2 * copies).map(|_| DeviceBuffer::from_slice(&host).unwrap()).collect();
        let x = DeviceBuffer::from_slice(&vec![0.5f32; cols]).unwrap();
        let y = DeviceBuffer::new(rows * 4).unwrap();
        let us = time_kernel(stream, copies, |i| {
            check(
                // SAFETY: device buffers sized for one token's gate and up products of `rows` x `cols` in `dtype`,
                // alive until `time_kernel` has waited for its last launch.
                unsafe {
                    kn::hostembed_matvec_swiglu(
                        weights[2 * i].ptr(),
                        weights[2 * i + 1].ptr(),
                        dtype as c_int,
                        rows as c_uint,
                        cols as c_uint,
                        x.ptr() as *const f32,
                        1,
                        y.ptr() as *mut f32,
                        stream.raw(),
                    )
                },
                "hostembed_matvec_swiglu",
            )
        });
        let gbs = 2.0 * bytes as f64 / (us * 1e-6) / 1e9;
        println!(
            "| matvec_swiglu | {} | 2 x {rows} x {cols} | {:.1} | {us:.1} | {gbs:.0} | {:.0}% |",
            dtype.name(),
            2.0 * bytes as f64 / 1e6,
            100.0 * gbs / peak
        );
    }
}

/// The tensor-core decode product: every format it reads at 1 to 64 tokens on a layer's two large shapes
/// (and at 1 token on the others and the head), with the bytes of the weights per second and the tensor
/// work (two bf16 products a weight a token) per second.
fn bench_mmv(stream: &Stream, peak: f64, only: Option<DType>) {
    println!("\nmmv: the batch-invariant tensor-core decode product (weights rotated over copies beyond the L2)");
    println!("| kernel | dtype | rows x cols | tokens | MB | us | GB/s | of copy bandwidth | bf16 TFLOP/s |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    // SAFETY: a host-side check on a format id, an address and a width; nothing is read.
    let supported = |d: DType| unsafe { kn::hostembed_mmv_supports(d as c_int, 256 as *const _, 4096) } == 0;
    let formats: Vec<DType> = FORMATS.iter().map(|f| f.dtype).filter(|&d| supported(d)).collect();
    let mut cases: Vec<(DType, usize, usize, usize, bool)> = Vec::new();
    for &d in &formats {
        cases.push((d, 4096, 4096, 1, false));
        for (r, c) in [(4096, 14336), (14336, 4096)] {
            for n in [1, 2, 4, 8, 16, 32, 64] {
                cases.push((d, r, c, n, false));
            }
        }
        for n in [1, 8, 64] {
            cases.push((d, 14336, 4096, n, true));
        }
    }
    cases.extend([(DType::Bf16, 128256, 4096, 1, false), (DType::Q6_K, 128256, 4096, 1, false)]);
    if let Some(d) = only {
        // 1 and 64 tokens on 4096 x 14336 first: scripts/gpu-profile.sh profiles those two launches.
        cases = vec![(d, 4096, 14336, 1, false), (d, 4096, 14336, 64, false)];
        for n in [2, 4, 8, 16, 32] {
            cases.push((d, 4096, 14336, n, false));
        }
        cases.extend([1, 2, 4, 8, 16, 32, 64].map(|n| (d, 14336, 4096, n, false)));
    }
    let mut hosts: Vec<((DType, usize, usize), Vec<u8>)> = Vec::new();
    for (dtype, rows, cols, n, glu) in cases {
        let key = (dtype, rows, cols);
        if !hosts.iter().any(|(k, _)| *k == key) {
            hosts.push((key, random_matrix(dtype, rows, cols, 11)));
        }
        let host = &hosts.iter().find(|(k, _)| *k == key).unwrap().1;
        let mats = if glu { 2 } else { 1 };
        let bytes = mats * host.len();
        let copies = (512usize << 20).div_ceil(bytes).max(1);
        let weights: Vec<DeviceBuffer> = (0..mats * copies).map(|_| DeviceBuffer::from_slice(host).unwrap()).collect();
        let x = DeviceBuffer::from_slice(&vec![0.5f32; n * cols]).unwrap();
        let y = DeviceBuffer::new(n * rows * 4).unwrap();
        let (mut floats, mut counters) = (0usize, 0 as c_uint);
        check(
            // SAFETY: host arithmetic into two writable locals; nothing on the device.
            unsafe {
                kn::hostembed_mmv_workspace(
                    rows as c_uint,
                    cols as c_uint,
                    glu as c_int,
                    n as c_uint,
                    &mut floats,
                    &mut counters,
                )
            },
            "hostembed_mmv_workspace",
        );
        let partial = DeviceBuffer::new(floats.max(1) * 4).unwrap();
        let count = DeviceBuffer::from_slice(&vec![0u32; (counters as usize).max(1)]).unwrap();
        let (xp, yp, pp, cp) =
            (x.ptr() as *const f32, y.ptr() as *mut f32, partial.ptr() as *mut f32, count.ptr() as *mut c_uint);
        let us = time_kernel(stream, copies, |i| {
            // SAFETY: device buffers sized for `n` tokens' products of `rows` x `cols` and the workspace
            // hostembed_mmv_workspace asked for, alive until `time_kernel` has waited for its last launch.
            let code = unsafe {
                if glu {
                    let (g, u) = (weights[2 * i].ptr(), weights[2 * i + 1].ptr());
                    kn::hostembed_mmv_swiglu(
                        g,
                        u,
                        dtype as c_int,
                        rows as c_uint,
                        cols as c_uint,
                        xp,
                        n as c_uint,
                        yp,
                        pp,
                        cp,
                        launch_tuning(),
                        stream.raw(),
                    )
                } else {
                    let (w, none) = (weights[i].ptr(), ptr::null());
                    kn::hostembed_mmv(
                        w,
                        dtype as c_int,
                        rows as c_uint,
                        cols as c_uint,
                        xp,
                        n as c_uint,
                        none,
                        none,
                        yp,
                        rows as c_uint,
                        pp,
                        cp,
                        launch_tuning(),
                        stream.raw(),
                    )
                }
            };
            check(code, "hostembed_mmv")
        });
        let gbs = bytes as f64 / (us * 1e-6) / 1e9;
        let tflops = 4.0 * (mats * rows * cols * n) as f64 / (us * 1e-6) / 1e12;
        println!(
            "| {} | {} | {}{rows} x {cols} | {n} | {:.1} | {us:.1} | {gbs:.0} | {:.0}% | {tflops:.0} |",
            if glu { "mmv_swiglu" } else { "mmv" },
            dtype.name(),
            if glu { "2 x " } else { "" },
            bytes as f64 / 1e6,
            100.0 * gbs / peak
        );
    }
}

fn bench_decode(args: &Args, peak: f64) {
    let t0 = Instant::now();
    let (src, recipe): (Box<dyn TensorSource>, String) = match &args.model {
        Some(path) => {
            let ckpt = Checkpoint::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            (Box::new(ckpt), path.display().to_string())
        }
        None if args.q4_k_m => (Box::new(MemSource::benchmark(&args.cfg, Recipe::Q4KM)), "Q4_K_M".to_string()),
        None => (Box::new(MemSource::benchmark(&args.cfg, args.dtype)), args.dtype.name().to_string()),
    };
    let (src, cfg) = (&*src, src.config());
    let embed = src.tensor(names::EMBED).unwrap();
    let embed_dtype = embed.dtype;
    let longest = longest_prompt(&args.prompts);
    let window = longest + args.tokens + 1;
    let chunk = longest.clamp(64, 2048);
    let weight_bytes = GpuModel::weight_bytes(src);
    let token_weight_bytes = weight_bytes - unchosen_expert_bytes(src);
    // The median greedy decode rate of each placement and cache, to print the host rows' change.
    let mut on_card: Vec<f64> = Vec::new();
    for host_rows in std::iter::once(false).chain(args.host_rows.then_some(true)) {
        // Rows on the card, or a pinned mapped copy the kernels read over the bus.
        let device_rows;
        let mut pinned_rows;
        let ptr = if host_rows {
            pinned_rows = PinnedBuffer::new_mapped(embed.bytes.len()).unwrap();
            pinned_rows.as_mut_slice().copy_from_slice(embed.bytes);
            pinned_rows.device_ptr()
        } else {
            device_rows = DeviceBuffer::from_slice(embed.bytes).unwrap();
            device_rows.ptr()
        };
        let rows = RowsOnDevice { ptr, dtype: embed.dtype, vocab: embed.rows(), cols: embed.cols() };
        let mut gpu =
            GpuModel::load_with_kv(src, rows, chunk, window.div_ceil(PAGE_TOKENS), args.kv, &Tuning::from_env())
                .unwrap_or_else(|e| panic!("load: {e}"));
        let mut pool = gpu.page_pool().unwrap();
        let placement = if host_rows { "rows in mapped host memory" } else { "rows on the card" };
        println!(
            "\n{recipe} model built and loaded in {:.1} s: {:.2} GB of weights, KV cache {}, {placement}",
            t0.elapsed().as_secs_f64(),
            weight_bytes as f64 / 1e9,
            args.kv.describe()
        );

        let sampled = Sampling { temperature: 0.8, top_k: 40, top_p: 0.95, seed: 42, ..Sampling::GREEDY };
        let modes: &[(&str, Sampling)] = if args.greedy {
            &[("greedy", Sampling::GREEDY)]
        } else {
            &[("greedy", Sampling::GREEDY), ("sampled", sampled)]
        };
        for (p_index, &prompt_len) in args.prompts.iter().enumerate() {
            let prompt: Vec<u32> = (0..prompt_len as u32).map(|i| (i * 7919 + 13) % cfg.vocab as u32).collect();
            // Per decoded token, the bytes read: every weight but the embedding rows and the experts a token
            // does not choose, one row of the rows, and the KV cache (about half a window on average).
            let per_token = token_weight_bytes as f64
                + embed_row_bytes(cfg, embed_dtype) as f64
                + args.kv.bytes_per_token(cfg) as f64 * (prompt_len + args.tokens / 2) as f64;
            println!(
                "\nbatch-1 decode after a {prompt_len}-token prompt, {} tokens, median of {} runs, KV cache {}, {placement}",
                args.tokens,
                args.runs,
                args.kv.describe()
            );
            println!("| sampling | prompt tok/s | decode tok/s | ms/token | GB/s (weights + KV) | of copy bandwidth |");
            println!("| --- | --- | --- | --- | --- | --- |");
            for (m_index, (name, s)) in modes.iter().enumerate() {
                let mut prompt_rates = Vec::new();
                let mut rates = Vec::new();
                for _ in 0..args.runs + 1 {
                    let mut stream = gpu.new_stream(window).unwrap();
                    let t = Instant::now();
                    let mut next = gpu.step(&mut pool, &mut stream, &prompt, s, 0).unwrap();
                    let prompt_s = t.elapsed().as_secs_f64();
                    let t = Instant::now();
                    for _ in 0..args.tokens {
                        next = gpu.step(&mut pool, &mut stream, &[next], s, 0).unwrap();
                    }
                    truncate_stream(&mut pool, &mut stream, 0).unwrap();
                    prompt_rates.push(prompt_len as f64 / prompt_s);
                    rates.push(args.tokens as f64 / t.elapsed().as_secs_f64());
                }
                // The first run captures graphs and warms up.
                let (p, r) = (median(prompt_rates[1..].to_vec()), median(rates[1..].to_vec()));
                let gbs = per_token * r / 1e9;
                println!("| {name} | {p:.0} | {r:.1} | {:.2} | {gbs:.0} | {:.0}% |", 1e3 / r, 100.0 * gbs / peak);
                let cell = p_index * modes.len() + m_index;
                if !host_rows {
                    on_card.push(r);
                } else if let Some(card) = on_card.get(cell) {
                    println!("(rows on the card: {card:.1} tok/s; in host memory {:+.2}%)", 100.0 * (r / card - 1.0));
                }
            }
        }
    }
}

fn embed_row_bytes(cfg: &ModelConfig, dtype: DType) -> usize {
    dtype.row_bytes(cfg.hidden).unwrap_or(cfg.hidden * 2)
}

/// The expert weights one token does not read: all but `used` of each layer's experts (their mean bytes;
/// 0 for a dense model).
fn unchosen_expert_bytes(src: &dyn TensorSource) -> u64 {
    let cfg = src.config();
    let Some(m) = cfg.moe else { return 0 };
    let mut all = 0u64;
    for layer in 0..cfg.layers {
        for e in 0..m.experts {
            for part in [names::EXPERT_GATE, names::EXPERT_UP, names::EXPERT_DOWN] {
                let name = names::layer(layer, &names::expert(part, e));
                all += src.try_tensor(&name).map_or(0, |t| t.bytes.len() as u64);
            }
        }
    }
    all / m.experts as u64 * (m.experts - m.used) as u64
}

fn main() {
    let args = parse();
    cuda::require_device(0).unwrap_or_else(|e| {
        eprintln!("bench_decode: {e}");
        std::process::exit(1);
    });
    let mut name = vec![0 as std::os::raw::c_char; 256];
    // SAFETY: room for 256 characters at `name`, as the call is told.
    check(unsafe { kn::hostembed_device_name(0, name.as_mut_ptr(), name.len()) }, "hostembed_device_name");
    // SAFETY: hostembed_device_name wrote a NUL-terminated name into the 256 characters at `name`.
    let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
    let stream = Stream::new().unwrap();
    let peak = copy_bandwidth(&stream);
    println!("{name}: device-to-device copy {peak:.0} GB/s (read + write)");
    if args.mmv_table {
        bench_mmv(&stream, peak, args.mmv_only);
    }
    if args.matvec_table {
        bench_kernels(&stream, peak);
    }
    if !args.kernels_only {
        bench_decode(&args, peak);
    }
}
