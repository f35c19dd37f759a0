//! The KV cache types on the GPU against the CPU: the KV append's bytes bit for bit in every type (the
//! CPU's rounding of the kernel's own rotated K and V), decode and flash attention over caches of every
//! type and pairs of types against the CPU's attention on the values those caches hold, the whole
//! model's last-prompt and decoded logits in every type against the CPU backend in that type and against
//! an f32 cache (a table is printed), an all-F32 model with an F32 cache within 1e-4 of the CPU, the KV
//! pool's bytes as the planner predicts them, FP8 against the device's compute capability, sliding
//! windows in decode and flash attention, and the engine's report of its types. Every output buffer starts poisoned; every CUDA call is checked. Skips
//! where no CUDA device is present.

mod common;
use common::{decode_configs as configs, rows_on_card};

use std::ffi::{c_char, c_void};
use std::os::raw::{c_int, c_uint};
use std::ptr;
use std::sync::Mutex;

use common::{Rng, Scratch, device_info, gpu_present, info, init, logits, rel_l2, serial, step};
use hostembed::Status;
use hostembed::checkpoint::write::MemSource;
use hostembed::cpu::{self, CpuModel};
use hostembed::cuda::{self, DeviceBuffer};
use hostembed::engine::{self, engine_backend, engine_options, engine_tristate};
use hostembed::gpu::{GpuModel, PAGE_TOKENS, PageLayout};
use hostembed::kernels as kn;
use hostembed::kv::{KvType, KvTypes};
use hostembed::model::ModelConfig;
use hostembed::sampler::Sampling;
use hostembed::status::last_error;
use hostembed::tensor::DType;
use hostembed::tuning::Tuning;

/// The launchers' settings as the environment gives them (what an engine would run with).
fn launch_tuning() -> kn::hostembed_tuning {
    kn::hostembed_tuning::of(&Tuning::from_env())
}

const NULL_STREAM: *mut c_void = ptr::null_mut();

fn ok(code: c_int, what: &str) {
    cuda::check(code, what).unwrap_or_else(|e| panic!("{what}: {e}"));
    cuda::synchronize().unwrap_or_else(|e| panic!("{what} while running: {e}"));
}

fn poisoned(bytes: usize) -> DeviceBuffer {
    let b = DeviceBuffer::new(bytes.max(1)).unwrap();
    b.fill_bytes(0xFF).unwrap();
    b
}

fn download<T: Copy + Default>(b: &DeviceBuffer, n: usize) -> Vec<T> {
    let mut out = vec![T::default(); n];
    b.download(&mut out).unwrap();
    out
}

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

#[test]
fn the_kv_append_rounds_as_the_cpu_in_every_type() {
    if !gpu_present("the_kv_append_rounds_as_the_cpu_in_every_type") {
        return;
    }
    let mut rng = Rng::fresh("the_kv_append_rounds_as_the_cpu_in_every_type");
    for kv in pairs() {
        for (heads, kv_heads, hd, interleaved, qk_norm) in
            [(8, 2, 128, false, false), (6, 3, 64, true, true), (4, 4, 32, false, true), (2, 1, 256, true, false)]
        {
            let what = format!("{} append, {heads}/{kv_heads} heads of {hd}", kv.describe());
            let cfg = rope_config(heads, kv_heads, hd, interleaved);
            let inv_freq = cpu::rope_inv_freq(&cfg);
            let (q_dim, kv_dim) = (heads * hd, kv_heads * hd);
            let stride = q_dim + 2 * kv_dim + 5;
            // Tokens 0 and 1 of one stream, token 2 of another.
            let (n, window, token_stream) = (3usize, 2000usize, [0usize, 0, 1]);
            let mut pos: Vec<i32> = (0..n).map(|_| rng.below(window as u64) as i32).collect();
            if pos[1] == pos[0] {
                pos[1] = (pos[0] + 1) % window as i32;
            }
            // Values of several sizes, so blocks meet small and large maxima.
            let qkv: Vec<f32> = (0..n * stride).map(|i| rng.uniform() * [0.01, 1.0, 40.0][i % 3]).collect();
            let (qn, kn_w) = (rng.vec(hd, 1.0), rng.vec(hd, 1.0));
            let mut host = HostPool::new(kv, kv_heads, hd, 2 * window.div_ceil(PAGE_TOKENS) + 3);
            let tables = host.tables(&mut rng, &[window, window]);
            let dt = DeviceTables::new(&tables, &token_stream);
            let qkv_d = DeviceBuffer::from_slice(&qkv).unwrap();
            let pos_d = DeviceBuffer::from_slice(&pos).unwrap();
            let inv_d = DeviceBuffer::from_slice(&inv_freq).unwrap();
            let (qn_d, kn_d) = (DeviceBuffer::from_slice(&qn).unwrap(), DeviceBuffer::from_slice(&kn_w).unwrap());
            let pool = poisoned(host.bytes.len());
            ok(
                // SAFETY: device buffers sized for `n` rows of `stride` floats and a pool of `host.pages` pages with
                // their tables, alive until the synchronous check after the launch.
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
                        1e-6,
                        pool.ptr(),
                        dt.ptr(),
                        host.pages as c_uint,
                        kv.k as c_int,
                        kv.v as c_int,
                        launch_tuning(),
                        NULL_STREAM,
                    )
                },
                &what,
            );
            // The kernel's own rotated k (in qkv) and the v heads, rounded by the CPU into the host pool:
            // the device pool must hold exactly those bytes, and 0xFF everywhere else.
            let got_qkv: Vec<f32> = download(&qkv_d, n * stride);
            for t in 0..n {
                let table = &tables[token_stream[t]];
                for h in 0..kv_heads {
                    let k = &got_qkv[t * stride + q_dim + h * hd..][..hd];
                    let v = &got_qkv[t * stride + q_dim + kv_dim + h * hd..][..hd];
                    assert_eq!(v, &qkv[t * stride + q_dim + kv_dim + h * hd..][..hd], "{what}: v changed");
                    host.write(table, false, h, pos[t] as usize, k);
                    host.write(table, true, h, pos[t] as usize, v);
                }
            }
            let got: Vec<u8> = download(&pool, host.bytes.len());
            if let Some(i) = (0..got.len()).find(|&i| got[i] != host.bytes[i]) {
                let page = i / host.layout.page_bytes();
                panic!(
                    "{what}: pool byte {i} (page {page}, byte {} of it) is {:#04x}, the CPU's rounding {:#04x}",
                    i % host.layout.page_bytes(),
                    got[i],
                    host.bytes[i]
                );
            }
        }
    }
    // The launcher refuses a block type with heads of partial blocks, and an unknown type: every
    // pointer real and aligned, so only the type can be at fault.
    let buf = poisoned(1 << 16);
    let p = buf.ptr();
    // SAFETY: every pointer is one live, 16-byte aligned device buffer of 64 KiB, more than a single row reads; the
    // launcher refuses before launching.
    let call = |k: c_int, hd: usize| unsafe {
        kn::hostembed_rope_kv(
            p as *mut f32,
            1024,
            1,
            p as *const c_int,
            1,
            1,
            hd as c_uint,
            p as *const f32,
            0,
            ptr::null(),
            ptr::null(),
            1e-6,
            p,
            p as *const *const c_uint,
            1,
            k,
            KvType::Bf16 as c_int,
            launch_tuning(),
            NULL_STREAM,
        )
    };
    let invalid = 1; // cudaErrorInvalidValue
    assert_eq!(call(KvType::Q8_0 as c_int, 48), invalid, "Q8_0 with heads of 48");
    assert_eq!(call(KvType::Fp8E4m3 as c_int, 16), invalid, "FP8 with heads of 16");
    assert_eq!(call(0, 64), invalid, "ENGINE_KV_DEFAULT is not a type the kernels store");
    assert_eq!(call(6, 64), invalid, "no type 6");
}

/// The K and V of streams of (context, queries) in a typed pool, the queries at the last positions of
/// their context; the CPU's attention over the values the pool holds (each query's last `window`
/// positions when it is not 0).
struct AttentionCase {
    window: usize,
    q: Vec<f32>,
    q_stride: usize,
    pos: Vec<i32>,
    token_stream: Vec<usize>,
    tables: Vec<Vec<u32>>,
    pool: HostPool,
    want: Vec<f32>,
}

fn attention_case(
    rng: &mut Rng,
    kv: KvTypes,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    streams: &[(usize, usize)],
) -> AttentionCase {
    windowed_case(rng, kv, heads, kv_heads, hd, streams, 0)
}

/// `attention_case` with each query seeing its last `window` positions (0: all of them).
fn windowed_case(
    rng: &mut Rng,
    kv: KvTypes,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    streams: &[(usize, usize)],
    window: usize,
) -> AttentionCase {
    let kv_dim = kv_heads * hd;
    let q_stride = heads * hd + 16;
    let windows: Vec<usize> = streams.iter().map(|&(ctx, _)| ctx + 7).collect();
    let pages: usize = windows.iter().map(|w| w.div_ceil(PAGE_TOKENS)).sum::<usize>() + 5;
    let mut pool = HostPool::new(kv, kv_heads, hd, pages);
    let tables = pool.tables(rng, &windows);
    let (mut q, mut pos, mut token_stream, mut want) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (si, &(n_ctx, n)) in streams.iter().enumerate() {
        // [pos][kv_heads * hd] as cpu::attention reads them: the values the typed cache holds.
        let (mut k, mut v) = (vec![0f32; n_ctx * kv_dim], vec![0f32; n_ctx * kv_dim]);
        for p in 0..n_ctx {
            for h in 0..kv_heads {
                let (kr, vr) = (rng.vec(hd, 1.0), rng.vec(hd, 1.0));
                pool.write(&tables[si], false, h, p, &kr);
                pool.write(&tables[si], true, h, p, &vr);
                k[p * kv_dim + h * hd..][..hd].copy_from_slice(&pool.read(&tables[si], false, h, p));
                v[p * kv_dim + h * hd..][..hd].copy_from_slice(&pool.read(&tables[si], true, h, p));
            }
        }
        let qs = rng.vec(n * q_stride, 1.0);
        for t in 0..n {
            let p = n_ctx - n + t;
            let mut o = vec![0f32; heads * hd];
            // A window is attention over the positions it keeps (the keys are rotated already).
            let first = if window == 0 { 0 } else { (p + 1).saturating_sub(window) };
            let (k, v) = (&k[first * kv_dim..], &v[first * kv_dim..]);
            cpu::attention(
                &qs[t * q_stride..t * q_stride + heads * hd],
                k,
                v,
                p + 1 - first,
                heads,
                kv_heads,
                hd,
                &mut o,
            );
            want.extend(o);
            pos.push(p as i32);
            token_stream.push(si);
        }
        q.extend(qs);
    }
    AttentionCase { window, q, q_stride, pos, token_stream, tables, pool, want }
}

/// The decode attention of the case's tokens `tokens` (indices into its queries).
fn launch_attention(c: &AttentionCase, pool: &DeviceBuffer, tokens: &[usize], heads: usize, splits: usize) -> Vec<f32> {
    let (kv_heads, hd) = (c.pool.layout.kv_heads, c.pool.layout.head_dim);
    let n = tokens.len();
    let q: Vec<f32> = tokens.iter().flat_map(|&t| c.q[t * c.q_stride..(t + 1) * c.q_stride].to_vec()).collect();
    let pos: Vec<i32> = tokens.iter().map(|&t| c.pos[t]).collect();
    let streams: Vec<usize> = tokens.iter().map(|&t| c.token_stream[t]).collect();
    let dt = DeviceTables::new(&c.tables, &streams);
    let (qd, pd) = (DeviceBuffer::from_slice(&q).unwrap(), DeviceBuffer::from_slice(&pos).unwrap());
    let partial = poisoned(n * heads * splits * (hd + 2) * 4);
    let out = poisoned(n * heads * hd * 4);
    let kv = c.pool.layout.kv;
    ok(
        // SAFETY: device buffers sized for `n` queries, the pool's pages and tables, and `splits` parts of partial
        // results, alive until the synchronous check after the launch.
        unsafe {
            kn::hostembed_attention(
                qd.ptr() as *const f32,
                c.q_stride as c_uint,
                pool.ptr(),
                dt.ptr(),
                c.pool.pages as c_uint,
                kv.k as c_int,
                kv.v as c_int,
                pd.ptr() as *const c_int,
                n as c_uint,
                heads as c_uint,
                kv_heads as c_uint,
                hd as c_uint,
                1.0 / (hd as f32).sqrt(),
                c.window as c_uint,
                splits as c_uint,
                hostembed::gpu::attention_grid_parts(
                    pos.iter().map(|&p| (p + 1).max(0) as usize).max().unwrap_or(0),
                    splits,
                ) as c_uint,
                partial.ptr() as *mut f32,
                out.ptr() as *mut f32,
                launch_tuning(),
                NULL_STREAM,
            )
        },
        "hostembed_attention",
    );
    download(&out, n * heads * hd)
}

#[test]
fn decode_attention_reads_every_type_exactly() {
    if !gpu_present("decode_attention_reads_every_type_exactly") {
        return;
    }
    let mut rng = Rng::fresh("decode_attention_reads_every_type_exactly");
    // (heads, kv_heads, head_dim, streams of (context, tokens), parts)
    type Shape = (usize, usize, usize, &'static [(usize, usize)], usize);
    let shapes: [Shape; 6] = [
        (32, 8, 128, &[(300, 1), (17, 1), (513, 1)], 32), // the Llama-3 8B heads, a decode batch
        (14, 2, 64, &[(1000, 3), (40, 2)], 16),           // groups of 7
        (16, 2, 256, &[(200, 1)], 9),                     // the largest head, groups of 8
        (8, 2, 96, &[(129, 4), (33, 1)], 3),              // a head between the kernel's sizes
        (8, 8, 32, &[(77, 2)], 1),                        // no grouping, one part
        (8, 4, 128, &[(3, 2), (2, 1)], 16),               // more parts than positions
    ];
    for kv in pairs() {
        for &(heads, kv_heads, hd, streams, splits) in &shapes {
            if !fits(kv, hd) {
                continue;
            }
            let c = attention_case(&mut rng, kv, heads, kv_heads, hd, streams);
            let pool = DeviceBuffer::from_slice(&c.pool.bytes).unwrap();
            let all: Vec<usize> = (0..c.pos.len()).collect();
            let got = launch_attention(&c, &pool, &all, heads, splits);
            let what = format!("{} attention, {heads}/{kv_heads} heads of {hd}, streams {streams:?}", kv.describe());
            assert!(got.iter().all(|v| v.is_finite()), "{what}: an output not written");
            let err = rel_l2(&got, &c.want);
            println!("{what}: relative L2 {err:.2e}");
            assert!(err < 1e-4, "{what}: relative L2 {err:.3e} against the CPU on the cache's values");
            // A stream's tokens alone give the bits they give in the batch.
            let width = heads * hd;
            for si in 0..streams.len() {
                let mine: Vec<usize> = all.iter().copied().filter(|&t| c.token_stream[t] == si).collect();
                let alone = launch_attention(&c, &pool, &mine, heads, splits);
                for (k, &t) in mine.iter().enumerate() {
                    let (a, b) = (&alone[k * width..(k + 1) * width], &got[t * width..(t + 1) * width]);
                    assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "{what}: stream {si} alone");
                }
            }
        }
    }
}

/// Sliding windows (of fewer, as many and more positions than the kernels' 32-position units and
/// 128-position tiles, and wider than the context) in the decode kernel and in flash attention, against
/// the CPU's attention over the window's positions; a stream alone gives the bits it gives in a batch.
#[test]
fn windowed_attention_sees_only_the_window() {
    if !gpu_present("windowed_attention_sees_only_the_window") {
        return;
    }
    let mut rng = Rng::fresh("windowed_attention_sees_only_the_window");
    let streams: &[(usize, usize)] = &[(300, 3), (17, 1), (513, 2), (129, 1)];
    for kv in [KvTypes::GPU_DEFAULT, KvTypes::same(KvType::F32), KvTypes::same(KvType::Q8_0)] {
        for window in [1, 7, 31, 32, 33, 100, 128, 129, 1000] {
            let (heads, kv_heads, hd) = (8, 2, 64);
            let c = windowed_case(&mut rng, kv, heads, kv_heads, hd, streams, window);
            let pool = DeviceBuffer::from_slice(&c.pool.bytes).unwrap();
            let all: Vec<usize> = (0..c.pos.len()).collect();
            let what = format!("{} window {window}", kv.describe());
            for splits in [1, 7, 32] {
                let got = launch_attention(&c, &pool, &all, heads, splits);
                let err = rel_l2(&got, &c.want);
                assert!(err < 1e-4, "{what}, {splits} parts: relative L2 {err:.3e} against the CPU");
                let width = heads * hd;
                for si in 0..streams.len() {
                    let mine: Vec<usize> = all.iter().copied().filter(|&t| c.token_stream[t] == si).collect();
                    let alone = launch_attention(&c, &pool, &mine, heads, splits);
                    for (k, &t) in mine.iter().enumerate() {
                        let (a, b) = (&alone[k * width..(k + 1) * width], &got[t * width..(t + 1) * width]);
                        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "{what}: stream {si} alone");
                    }
                }
            }
            if kv.k == KvType::F32 {
                continue; // flash takes no F32 cache
            }
            // A prompt chunk of 150 queries from position 90 (flash attention over one stream).
            let c = windowed_case(&mut rng, kv, heads, kv_heads, hd, &[(240, 150)], window);
            let pool = DeviceBuffer::from_slice(&c.pool.bytes).unwrap();
            let out = poisoned(150 * heads * hd * 2);
            ok(flash(&c, &pool, kv, hd, heads, kv_heads, 150, &out, DType::F16, 0), &what);
            let bits: Vec<u16> = download(&out, 150 * heads * hd);
            let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
            let mut got = vec![0f32; 150 * heads * hd];
            hostembed::tensor::decode_row(DType::F16, &bytes, &mut got);
            let err = rel_l2(&got, &c.want);
            println!("{what}: flash relative L2 {err:.2e}");
            assert!(err < 1e-2, "{what}: flash relative L2 {err:.3e}");
        }
    }
}

#[test]
fn decode_attention_at_a_long_context_in_the_8_bit_types() {
    if !gpu_present("decode_attention_at_a_long_context_in_the_8_bit_types") {
        return;
    }
    let mut rng = Rng::fresh("decode_attention_at_a_long_context_in_the_8_bit_types");
    for t in [KvType::Q8_0, KvType::Fp8E4m3, KvType::Bf16] {
        let c = attention_case(&mut rng, KvTypes::same(t), 32, 8, 128, &[(16384, 1), (5, 1)]);
        let pool = DeviceBuffer::from_slice(&c.pool.bytes).unwrap();
        let got = launch_attention(&c, &pool, &[0, 1], 32, 32);
        let err = rel_l2(&got, &c.want);
        println!("{} attention at 16k: relative L2 {err:.2e}", t.name());
        assert!(err < 1e-4, "{} at 16k: {err:.3e}", t.name());
    }
}

#[test]
fn flash_attention_reads_every_type_but_f32() {
    if !gpu_present("flash_attention_reads_every_type_but_f32") {
        return;
    }
    let mut rng = Rng::fresh("flash_attention_reads_every_type_but_f32");
    for kv in pairs().into_iter().filter(|p| p.k != KvType::F32 && p.v != KvType::F32) {
        for d in [16usize, 32, 64, 128] {
            if !fits(kv, d) {
                continue;
            }
            for &(heads, kv_heads) in &[(8usize, 2usize), (7, 1)] {
                for &(p0, n) in &[(0usize, 64usize), (37, 63), (130, 200)] {
                    for out in [DType::Bf16, DType::F16] {
                        run_flash(&mut rng, kv, d, heads, kv_heads, p0, n, out);
                    }
                }
            }
        }
    }
    // F32 goes to the split kernel: flash attention refuses it, and a block type on partial blocks.
    let c = attention_case(&mut rng, KvTypes::same(KvType::F32), 4, 2, 64, &[(8, 8)]);
    let pool = DeviceBuffer::from_slice(&c.pool.bytes).unwrap();
    for (k, v, d) in
        [(KvType::F32, KvType::Bf16, 64), (KvType::Bf16, KvType::F32, 64), (KvType::Q8_0, KvType::Q8_0, 16)]
    {
        let code = flash(&c, &pool, KvTypes { k, v }, d, 4, 2, 8, &poisoned(8 * 4 * d * 2), DType::Bf16, 0);
        assert_eq!(code, 1, "flash attention with K {} and V {} at head_dim {d}", k.name(), v.name());
    }
}

/// hostembed_flash_attention over the case's first `n` queries (one stream), into `out`; with a stage
/// of `stage_tokens` positions (hostembed_flash_stage over the stream's `n` positions first) unless 0.
#[allow(clippy::too_many_arguments)]
fn flash(
    c: &AttentionCase,
    pool: &DeviceBuffer,
    kv: KvTypes,
    d: usize,
    heads: usize,
    kv_heads: usize,
    n: usize,
    out: &DeviceBuffer,
    dtype: DType,
    stage_tokens: usize,
) -> c_int {
    let (qb, tb, pb) = (
        DeviceBuffer::from_slice(&c.q).unwrap(),
        DeviceBuffer::from_slice(&c.tables[0]).unwrap(),
        DeviceBuffer::from_slice(&c.pos).unwrap(),
    );
    let ctx = c.pos[..n].iter().map(|&p| p + 1).max().unwrap_or(0) as usize;
    // Poisoned, so that a tile the stage kernel should write and does not shows in the output.
    let stage = poisoned((2 * stage_tokens * kv_heads * d * 2).max(16));
    if stage_tokens > 0 {
        // SAFETY: the pool, its table and the stage are live device buffers sized for the case and `stage_tokens`,
        // alive until the synchronize below (a launch that fails queues nothing).
        let code = unsafe {
            kn::hostembed_flash_stage(
                pool.ptr(),
                tb.ptr() as *const c_uint,
                c.pool.pages as c_uint,
                kv.k as c_int,
                kv.v as c_int,
                kv_heads as c_uint,
                d as c_uint,
                ctx as c_uint,
                stage.ptr(),
                stage_tokens as c_uint,
                NULL_STREAM,
            )
        };
        if code != 0 {
            return code;
        }
    }
    // SAFETY: device buffers sized for the case's `n` queries, its pool and table, and `n` rows of `heads * d` out,
    // alive until the synchronize below.
    let code = unsafe {
        kn::hostembed_flash_attention(
            qb.ptr() as *const f32,
            c.q_stride as c_uint,
            pool.ptr(),
            tb.ptr() as *const c_uint,
            c.pool.pages as c_uint,
            kv.k as c_int,
            kv.v as c_int,
            pb.ptr() as *const c_int,
            n as c_uint,
            heads as c_uint,
            kv_heads as c_uint,
            d as c_uint,
            1.0 / (d as f32).sqrt(),
            c.window as c_uint,
            out.ptr(),
            dtype as c_int,
            (heads * d) as c_uint,
            if stage_tokens > 0 { stage.ptr() as *const c_void } else { ptr::null() },
            stage_tokens as c_uint,
            ctx as c_uint,
            NULL_STREAM,
        )
    };
    cuda::synchronize().unwrap_or_else(|e| panic!("flash attention while running: {e}"));
    code
}

#[allow(clippy::too_many_arguments)]
fn run_flash(rng: &mut Rng, kv: KvTypes, d: usize, heads: usize, kv_heads: usize, p0: usize, n: usize, out: DType) {
    let c = attention_case(rng, kv, heads, kv_heads, d, &[(p0 + n, n)]);
    let pool = DeviceBuffer::from_slice(&c.pool.bytes).unwrap();
    let ob = poisoned(n * heads * d * 2);
    let what = format!("flash {} d {d} heads {heads}/{kv_heads} from {p0}, {n} queries, {}", kv.describe(), out.name());
    ok(flash(&c, &pool, kv, d, heads, kv_heads, n, &ob, out, 0), &what);
    let bits: Vec<u16> = download(&ob, n * heads * d);
    // An 8-bit half read from a stage (one tile of it, then all) gives the same bits.
    if kv.k.is_block() || kv.v.is_block() {
        for stage_tokens in [64, (p0 + n).next_multiple_of(64) + 64] {
            let staged = poisoned(n * heads * d * 2);
            ok(flash(&c, &pool, kv, d, heads, kv_heads, n, &staged, out, stage_tokens), &what);
            let got: Vec<u16> = download(&staged, n * heads * d);
            assert!(got == bits, "{what}: a stage of {stage_tokens} positions changed the output");
        }
    }
    let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
    let mut got = vec![0f32; n * heads * d];
    hostembed::tensor::decode_row(out, &bytes, &mut got);
    assert!(got.iter().all(|v| v.is_finite()), "{what}: an output not written");
    let err = rel_l2(&got, &c.want);
    println!("{what}: relative L2 {err:.2e}");
    assert!(err < 1e-2, "{what}: relative L2 {err:.3e}");
}

// ---------------------------------------------------------------------------------------------------
// Whole models.

fn random_tokens(rng: &mut Rng, vocab: usize, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
}

/// Whether this device runs FP8 E4M3 (compute capability 8.9 or newer).
fn fp8_here() -> bool {
    let d = device_info();
    (d.compute_major, d.compute_minor) >= (8, 9)
}

/// Relative L2 a type's rounding of K and V may move a small random model's logits by, beside the GPU's
/// own arithmetic (several times what the CPU measures; tests/kv.rs).
fn rounding_bound(kv: KvTypes) -> f64 {
    let one = |t: KvType| match t {
        KvType::F32 => 0.0,
        KvType::F16 => 2e-3,
        KvType::Bf16 => 1e-2,
        KvType::Q8_0 => 3e-2,
        KvType::Fp8E4m3 => 1e-1,
    };
    one(kv.k) + one(kv.v)
}

/// The GPU's logits after a prompt and after each of `steps` greedy tokens chosen by the CPU, in `kv`.
fn gpu_run(gpu: &mut GpuModel, prompt: &[u32], next: &[u32]) -> Vec<Vec<f32>> {
    let mut pool = gpu.page_pool().unwrap();
    let mut s = gpu.new_stream(prompt.len() + next.len() + 1).unwrap();
    let mut out = Vec::new();
    gpu.step(&mut pool, &mut s, prompt, &Sampling::GREEDY, 0).unwrap();
    out.push(gpu.last_logits().unwrap());
    for &t in next {
        gpu.step(&mut pool, &mut s, &[t], &Sampling::GREEDY, 0).unwrap();
        out.push(gpu.last_logits().unwrap());
    }
    out
}

fn cpu_run(model: &CpuModel, prompt: &[u32], next: &[u32]) -> Vec<Vec<f32>> {
    let mut s = model.new_stream(prompt.len() + next.len() + 1);
    let mut out = vec![model.forward(&mut s, prompt).unwrap()];
    for &t in next {
        out.push(model.forward(&mut s, &[t]).unwrap());
    }
    out
}

#[test]
fn prompt_and_decode_logits_in_every_type_against_the_cpu() {
    if !gpu_present("prompt_and_decode_logits_in_every_type_against_the_cpu") {
        return;
    }
    let mut rng = Rng::fresh("prompt_and_decode_logits_in_every_type_against_the_cpu");
    println!(
        "| model | KV cache | prompt vs CPU (same type) | decode vs CPU (same type) | prompt vs F32 cache | decode vs F32 cache |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    for (name, cfg) in configs() {
        let src = MemSource::synthetic(&cfg, rng.next_u64(), DType::Bf16);
        let (_rows_buf, rows) = rows_on_card(&src);
        // 100 prompt tokens in chunks of 64 and 36 (tensor cores, flash attention), then 12 decoded.
        let prompt = random_tokens(&mut rng, cfg.vocab, 100);
        let f32_cache = CpuModel::new(&src).unwrap();
        let first = cpu_run(&f32_cache, &prompt, &[]);
        let mut next = vec![hostembed::sampler::argmax(&first[0])];
        let mut s = f32_cache.new_stream(128);
        f32_cache.forward(&mut s, &prompt).unwrap();
        for _ in 0..11 {
            let l = f32_cache.forward(&mut s, &[*next.last().unwrap()]).unwrap();
            next.push(hostembed::sampler::argmax(&l));
        }
        let plain = cpu_run(&f32_cache, &prompt, &next);
        for kv in pairs() {
            if (kv.k == KvType::Fp8E4m3 || kv.v == KvType::Fp8E4m3) && !fp8_here() {
                continue;
            }
            let mut gpu = GpuModel::load_with_kv(&src, rows, 64, 16, kv, &Tuning::from_env()).unwrap();
            assert_eq!(gpu.allocated_pool_bytes(), GpuModel::pool_bytes(&cfg, kv, 16), "{name}: pool bytes");
            let got = gpu_run(&mut gpu, &prompt, &next);
            let same = cpu_run(&CpuModel::new(&src).unwrap().with_kv_types(kv).unwrap(), &prompt, &next);
            let worst =
                |a: &[Vec<f32>], b: &[Vec<f32>]| a.iter().zip(b).map(|(x, y)| rel_l2(x, y)).fold(0f64, f64::max);
            let (p_same, d_same) = (rel_l2(&got[0], &same[0]), worst(&got[1..], &same[1..]));
            let (p_plain, d_plain) = (rel_l2(&got[0], &plain[0]), worst(&got[1..], &plain[1..]));
            println!("| {name} | {} | {p_same:.2e} | {d_same:.2e} | {p_plain:.2e} | {d_plain:.2e} |", kv.describe());
            let what = format!("{name} {}", kv.describe());
            assert!(
                p_same < 2e-2 && d_same < 2e-2,
                "{what}: against the CPU in the same type {p_same:.3e} / {d_same:.3e}"
            );
            let bound = 2e-2 + rounding_bound(kv);
            assert!(p_plain < bound && d_plain < bound, "{what}: against an f32 cache {p_plain:.3e} / {d_plain:.3e}");
        }
    }
}

#[test]
fn an_all_f32_model_with_an_f32_cache_stays_within_1e_4_of_the_cpu() {
    if !gpu_present("an_all_f32_model_with_an_f32_cache_stays_within_1e_4_of_the_cpu") {
        return;
    }
    let mut rng = Rng::fresh("an_all_f32_model_with_an_f32_cache_stays_within_1e_4_of_the_cpu");
    let f32_kv = KvTypes::same(KvType::F32);
    for (name, cfg) in configs() {
        let src = MemSource::synthetic(&cfg, rng.next_u64(), DType::F32);
        let (_rows_buf, rows) = rows_on_card(&src);
        let mut gpu = GpuModel::load_with_kv(&src, rows, 64, 32, f32_kv, &Tuning::from_env()).unwrap();
        let route = gpu.prompt_route().to_string();
        println!("{name}: {route}");
        assert!(route.contains("f32 matrix-vector"), "{name}: an all-F32 model's prompt route: {route}");
        // Every position of a 150-token prompt (chunks of 64, 64 and 22), then 16 decoded tokens.
        let tokens = random_tokens(&mut rng, cfg.vocab, 150);
        let mut pool = gpu.page_pool().unwrap();
        let mut gs = gpu.new_stream(200).unwrap();
        let got = gpu.all_logits(&mut pool, &mut gs, &tokens).unwrap();
        let cpu = CpuModel::new(&src).unwrap().with_kv_types(f32_kv).unwrap();
        let mut cs = cpu.new_stream(200);
        let want = cpu.forward_all(&mut cs, &tokens).unwrap();
        let worst = got.iter().zip(&want).map(|(g, w)| rel_l2(g, w)).fold(0f64, f64::max);
        let mut decode_worst = 0f64;
        for _ in 0..16 {
            let t = random_tokens(&mut rng, cfg.vocab, 1);
            gpu.step(&mut pool, &mut gs, &t, &Sampling::GREEDY, 0).unwrap();
            let w = cpu.forward(&mut cs, &t).unwrap();
            decode_worst = decode_worst.max(rel_l2(&gpu.last_logits().unwrap(), &w));
        }
        println!(
            "{name}: all F32, worst relative L2 over the prompt {worst:.2e}, over 16 decoded tokens {decode_worst:.2e}"
        );
        assert!(worst < 1e-4 && decode_worst < 1e-4, "{name}: {worst:.3e} / {decode_worst:.3e} from the CPU");

        // BF16 weights with an F32 cache keep the tensor-core products, with split attention.
        let bf16 = MemSource::synthetic(&cfg, rng.next_u64(), DType::Bf16);
        let (_b, rows) = rows_on_card(&bf16);
        let gpu = GpuModel::load_with_kv(&bf16, rows, 64, 32, f32_kv, &Tuning::from_env()).unwrap();
        assert!(gpu.prompt_route().contains("split attention (an F32 KV cache"), "{}", gpu.prompt_route());
        // And an all-F32 model with a BF16 cache keeps the tensor-core path.
        let (_c, rows) = rows_on_card(&src);
        let gpu = GpuModel::load_with_kv(&src, rows, 64, 32, KvTypes::GPU_DEFAULT, &Tuning::from_env()).unwrap();
        assert!(!gpu.prompt_route().contains("f32 matrix-vector"), "{}", gpu.prompt_route());
    }
}

#[test]
fn the_pool_allocates_the_predicted_bytes_in_every_type() {
    if !gpu_present("the_pool_allocates_the_predicted_bytes_in_every_type") {
        return;
    }
    let mut rng = Rng::fresh("the_pool_allocates_the_predicted_bytes_in_every_type");
    for (name, cfg) in configs() {
        let src = MemSource::synthetic(&cfg, rng.next_u64(), DType::Bf16);
        let (_rows_buf, rows) = rows_on_card(&src);
        for kv in pairs() {
            if (kv.k == KvType::Fp8E4m3 || kv.v == KvType::Fp8E4m3) && !fp8_here() {
                continue;
            }
            for pages in [1, 7, 130] {
                let gpu = GpuModel::load_with_kv(&src, rows, 16, pages, kv, &Tuning::from_env()).unwrap();
                let what = format!("{name} {} with {pages} pages", kv.describe());
                assert_eq!(gpu.kv_types(), kv, "{what}");
                assert_eq!(gpu.allocated_pool_bytes(), GpuModel::pool_bytes(&cfg, kv, pages), "{what}");
                let layout = PageLayout::new(&cfg, kv);
                assert_eq!(
                    GpuModel::pool_bytes(&cfg, kv, pages),
                    (cfg.layers * pages * layout.page_bytes()) as u64,
                    "{what}: every layer's pages"
                );
                assert_eq!(
                    gpu.allocated_bytes(),
                    (
                        GpuModel::weight_bytes(&src),
                        GpuModel::scratch_bytes(&src, 16, kv, pages * PAGE_TOKENS, &Tuning::from_env())
                    )
                );
            }
        }
        // A block type on heads of partial blocks is refused before anything is allocated.
        let narrow = ModelConfig { head_dim: 16, heads: 16, ..cfg.clone() };
        let narrow_src = MemSource::synthetic(&narrow, 1, DType::Bf16);
        let (_n, rows) = rows_on_card(&narrow_src);
        let e = GpuModel::load_with_kv(&narrow_src, rows, 16, 4, KvTypes::same(KvType::Q8_0), &Tuning::from_env())
            .err()
            .unwrap();
        assert_eq!(e.status, Status::Unsupported, "{e}");
    }
}

#[test]
fn fp8_follows_the_compute_capability() {
    if !gpu_present("fp8_follows_the_compute_capability") {
        return;
    }
    let d = device_info();
    let (_, cfg) = configs().remove(0);
    let src = MemSource::synthetic(&cfg, 5, DType::Bf16);
    let (_rows_buf, rows) = rows_on_card(&src);
    let got =
        GpuModel::load_with_kv(&src, rows, 16, 4, KvTypes { k: KvType::Fp8E4m3, v: KvType::Q8_0 }, &Tuning::from_env());
    println!(
        "compute capability {}.{}: FP8 E4M3 {}",
        d.compute_major,
        d.compute_minor,
        if got.is_ok() { "loads" } else { "refused" }
    );
    match got {
        Ok(_) => assert!(fp8_here(), "FP8 loaded on {}.{}", d.compute_major, d.compute_minor),
        Err(e) => {
            assert!(!fp8_here(), "FP8 refused on {}.{}: {e}", d.compute_major, d.compute_minor);
            assert_eq!(e.status, Status::Unsupported, "{e}");
            assert!(e.message.contains("8.9"), "{e}");
        }
    }
}

/// Log lines the engine wrote, collected by `collect`.
static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn collect(_user: *mut c_void, line: *const c_char) {
    // SAFETY: the engine passes a NUL-terminated line alive for the call.
    let line = unsafe { std::ffi::CStr::from_ptr(line) }.to_string_lossy().into_owned();
    LINES.lock().unwrap().push(line);
}

#[test]
fn the_cuda_engine_reports_and_plans_its_kv_types() {
    if !gpu_present("the_cuda_engine_reports_and_plans_its_kv_types") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("the_cuda_engine_reports_and_plans_its_kv_types");
    let dir = Scratch::new("gpu-kv");
    let (_, cfg) = configs().remove(0);
    let path = dir.hf("llama", &cfg, rng.next_u64(), DType::Bf16);
    let ckpt = hostembed::checkpoint::Checkpoint::open(&path).unwrap();
    let prompt: Vec<i32> = (0..40).map(|_| rng.below(cfg.vocab as u64) as i32).collect();
    let mut c_types = vec![(KvTypes::GPU_DEFAULT, true)];
    c_types.extend(pairs().into_iter().map(|p| (p, false)));
    for (kv, default) in c_types {
        let cuda_opts = engine_options {
            backend: engine_backend::Cuda,
            context: 512,
            max_streams: 2,
            max_batch: 32,
            mmap_rows: engine_tristate::No,
            log: Some(collect),
            kv_type_k: if default { engine::default_options().kv_type_k } else { kv.k.to_c() },
            kv_type_v: if default { engine::default_options().kv_type_v } else { kv.v.to_c() },
            ..engine::default_options()
        };
        let needs_fp8 = kv.k == KvType::Fp8E4m3 || kv.v == KvType::Fp8E4m3;
        if needs_fp8 && !fp8_here() {
            let mut e = ptr::null_mut();
            // SAFETY: a NUL-terminated path, options and a handle slot, all alive across the call.
            let st = unsafe { hostembed::ffi::engine_init_fit(common::c_path(&path).as_ptr(), &cuda_opts, &mut e) };
            assert_eq!(st, Status::Unsupported, "FP8 on a device older than 8.9: {}", last_error());
            assert!(last_error().contains("compute capability 8.9"), "{}", last_error());
            continue;
        }
        LINES.lock().unwrap().clear();
        let e = init(&path, &cuda_opts);
        let i = info(&e);
        assert!(i.cuda);
        assert_eq!((i.kv_type_k, i.kv_type_v), (kv.k.to_c(), kv.v.to_c()), "{}: engine_model_info", kv.describe());
        let inputs = engine::fit_inputs(&ckpt, &cuda_opts, Some(&device_info())).unwrap();
        assert_eq!(inputs.stream_bytes_per_token, kv.bytes_per_token(&cfg), "{}", kv.describe());
        assert_eq!(inputs.stream_bytes, kv.bytes_per_token(&cfg) * 512, "{}", kv.describe());
        let lines = LINES.lock().unwrap().clone();
        let start = lines.iter().find(|l| l.contains("KV pool of")).unwrap_or_else(|| panic!("{lines:?}"));
        assert!(start.contains(&format!("tokens in {} (", kv.describe())), "{start}");
        assert!(lines.iter().any(|l| l.contains(&format!("KV cache {}", kv.describe()))), "{lines:?}");
        // The same steps on the CPU engine in the same types.
        step(&e, 0, &prompt);
        let got = logits(&e, 0);
        let cpu_opts = engine_options { backend: engine_backend::Cpu, room_bytes: 1 << 32, ..cuda_opts };
        let c = init(&path, &cpu_opts);
        assert_eq!(
            (info(&c).kv_type_k, info(&c).kv_type_v),
            if default { (KvType::F32.to_c(), KvType::F32.to_c()) } else { (kv.k.to_c(), kv.v.to_c()) }
        );
        step(&c, 0, &prompt);
        let err = rel_l2(&got, &logits(&c, 0));
        println!("{}: CUDA engine against the CPU engine {err:.2e}", kv.describe());
        assert!(err < 2e-2 + rounding_bound(kv), "{}: {err:.3e}", kv.describe());
    }
}
