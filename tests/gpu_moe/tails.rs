//! The fused tails of kernels/moe.cu and kernels/moe_mmv.cu against the launches they replace: the route
//! in the router's last block (hostembed_moe_router_route against hostembed_moe_router then
//! hostembed_moe_route), and each row's weighted sum in the down product's last blocks
//! (hostembed_moe_mmv_sum against hostembed_moe_mmv then hostembed_moe_sum): the same bits, the arrival
//! counters left zero for the next launch, and what they refuse; and the whole model with every tail fused
//! against every tail launched apart.

use std::os::raw::{c_int, c_uint, c_void};

use super::grouped::stack;
use crate::common::launch::{NULL_STREAM, download, launch_tuning, ok};
use crate::common::{Rng, bits, gpu_present, rows_on_card, serial};
use hostembed::backend::StepItem;
use hostembed::checkpoint::write::{MemSource, Recipe};
use hostembed::cuda::DeviceBuffer;
use hostembed::gpu::{GpuModel, GpuStream, reserve_pages};
use hostembed::kernels as kn;
use hostembed::sampler::Sampling;
use hostembed::tensor::{DType, encode_row};
use hostembed::tuning::{FusedTails, Tuning};

/// What a route left: each row's ids and weights (as bits), and the groups.
#[derive(Debug, PartialEq)]
struct Routed {
    ids: Vec<i32>,
    weights: Vec<u32>,
    groups: Vec<i32>,
}

/// The groups with each expert's slots sorted: a slot's place within its group is its order of
/// arrival, which the launches need not share (kernels/moe.cu's note: it changes no bits).
fn canonical(mut groups: Vec<i32>, experts: usize) -> Vec<i32> {
    let list = 1 + 3 * experts;
    for e in 0..experts {
        let (start, count) = (groups[1 + experts + e] as usize, groups[1 + 2 * experts + e] as usize);
        groups[list + start..list + start + count].sort_unstable();
    }
    groups
}

/// Device buffers for a route of `n` rows.
struct RouteBuffers {
    logits: DeviceBuffer,
    ids: DeviceBuffer,
    weights: DeviceBuffer,
    groups: DeviceBuffer,
}

impl RouteBuffers {
    fn new(experts: usize, n: usize, k: usize) -> RouteBuffers {
        let b = |bytes: usize| {
            let d = DeviceBuffer::new(bytes.max(4)).unwrap();
            d.fill_bytes(0xFF).unwrap();
            d
        };
        RouteBuffers {
            logits: b(n * experts * 4),
            ids: b(n * k * 4),
            weights: b(n * k * 4),
            groups: b((1 + 3 * experts + n * k) * 4),
        }
    }

    fn read(&self, experts: usize, route_n: usize, k: usize) -> Routed {
        let groups = download::<i32>(&self.groups, 1 + 3 * experts + route_n * k);
        Routed {
            ids: download(&self.ids, route_n * k),
            weights: download(&self.weights, route_n * k),
            groups: canonical(groups, experts),
        }
    }
}

#[test]
fn the_route_in_the_router_gives_the_route_kernels_bits() {
    let test = "the_route_in_the_router_gives_the_route_kernels_bits";
    if !gpu_present(test) {
        return;
    }
    let mut rng = Rng::fresh(test);
    let cols = 512;
    // (experts, k, rows, rows routed): one decode row; a piece routed of more rows; two lanes' registers;
    // the most experts the tail takes.
    for (experts, k, n, route_n) in [(128, 8, 1, 1), (40, 8, 37, 29), (64, 4, 16, 16), (256, 8, 3, 3)] {
        for (dtype, norm_topk) in [(DType::F32, 1), (DType::Q8_0, 0)] {
            let what = format!("{experts} experts, {k} a row, {route_n} of {n} rows, {}", dtype.name());
            let router: Vec<u8> = (0..experts).flat_map(|_| encode_row(dtype, &rng.vec(cols, 1.0))).collect();
            let rd = DeviceBuffer::from_slice(&router).unwrap();
            let xd = DeviceBuffer::from_slice(&rng.vec(n * cols, 1.0)).unwrap();
            let (apart, fused) = (RouteBuffers::new(experts, n, k), RouteBuffers::new(experts, n, k));
            let counter = DeviceBuffer::new(4).unwrap();
            counter.fill_bytes(0).unwrap();
            let (e, c, nn, rn, kk) = (experts as u32, cols as u32, n as u32, route_n as u32, k as u32);
            // SAFETY: device buffers of the sizes hostembed_kernels.cuh gives for these shapes, alive until
            // the synchronize in ok.
            unsafe {
                let x = xd.ptr() as *const f32;
                let logits = apart.logits.ptr() as *mut f32;
                ok(kn::hostembed_moe_router(rd.ptr(), dtype as c_int, e, c, x, nn, logits, NULL_STREAM), &what);
                ok(
                    kn::hostembed_moe_route(
                        logits,
                        e,
                        rn,
                        kk,
                        norm_topk,
                        apart.ids.ptr() as *mut c_int,
                        apart.weights.ptr() as *mut f32,
                        apart.groups.ptr() as *mut c_int,
                        NULL_STREAM,
                    ),
                    &what,
                );
                // Twice: the counter the first launch leaves serves the second.
                for _ in 0..2 {
                    ok(
                        kn::hostembed_moe_router_route(
                            rd.ptr(),
                            dtype as c_int,
                            e,
                            c,
                            x,
                            nn,
                            fused.logits.ptr() as *mut f32,
                            rn,
                            kk,
                            norm_topk,
                            fused.ids.ptr() as *mut c_int,
                            fused.weights.ptr() as *mut f32,
                            fused.groups.ptr() as *mut c_int,
                            counter.ptr() as *mut c_uint,
                            NULL_STREAM,
                        ),
                        &what,
                    );
                }
            }
            let same_logits =
                download::<u32>(&apart.logits, n * experts) == download::<u32>(&fused.logits, n * experts);
            assert!(same_logits, "{what}: the router's logits differ");
            assert_eq!(fused.read(experts, route_n, k), apart.read(experts, route_n, k), "{what}");
            assert_eq!(download::<u32>(&counter, 1), [0], "{what}: the counter is not left zero");
        }
    }

    // More experts than a lane's registers hold in the tail, and a bad k: refused, nothing launched.
    let d = DeviceBuffer::new(1 << 20).unwrap();
    let p = d.ptr();
    let f = p as *mut f32;
    let i = p as *mut c_int;
    let u = p as *mut c_uint;
    // SAFETY: the launcher refuses these before any launch; nothing is dereferenced.
    let (wide, bad_k) = unsafe {
        (
            kn::hostembed_moe_router_route(p, DType::F32 as c_int, 257, 64, f, 1, f, 1, 8, 1, i, f, i, u, NULL_STREAM),
            kn::hostembed_moe_router_route(p, DType::F32 as c_int, 64, 64, f, 1, f, 1, 65, 1, i, f, i, u, NULL_STREAM),
        )
    };
    assert_ne!(wide, 0, "257 experts were taken");
    assert_ne!(bad_k, 0, "k > experts was taken");
}

#[test]
fn the_sum_in_the_down_product_gives_the_sum_kernels_bits() {
    let test = "the_sum_in_the_down_product_gives_the_sum_kernels_bits";
    if !gpu_present(test) {
        return;
    }
    let mut rng = Rng::fresh(test);
    // (experts, k, rows, down rows, down columns): 300 x 768 of 3 row blocks cuts its columns in 3 ranges
    // (the last block of each row block writes); 2,048 x 256 of 16 row blocks takes one range; 40 rows put
    // more than a block's 16 slots on some experts.
    for (experts, k, n, rows, cols) in [(10, 3, 40, 300, 768), (128, 8, 1, 2048, 256), (16, 4, 5, 640, 512)] {
        for dtype in [DType::Q4_K, DType::Q6_K, DType::Q8_0] {
            let what = format!("{experts} experts, {k} a row, {n} rows, down {rows} x {cols}, {}", dtype.name());
            let (bytes, _) = stack(&mut rng, dtype, experts, rows, cols);
            let wd = DeviceBuffer::from_slice(&bytes).unwrap();
            let logits: Vec<f32> = (0..n * experts).map(|_| rng.uniform()).collect();
            let routed = RouteBuffers::new(experts, n, k);
            routed.logits.upload(&logits, 0).unwrap();
            // SAFETY: device buffers of the sizes hostembed_moe_route takes, alive until the synchronize in ok.
            ok(
                unsafe {
                    kn::hostembed_moe_route(
                        routed.logits.ptr() as *const f32,
                        experts as u32,
                        n as u32,
                        k as u32,
                        1,
                        routed.ids.ptr() as *mut c_int,
                        routed.weights.ptr() as *mut f32,
                        routed.groups.ptr() as *mut c_int,
                        NULL_STREAM,
                    )
                },
                &what,
            );
            let act = DeviceBuffer::from_slice(&rng.vec(n * k * cols, 1.0)).unwrap();
            let x0 = rng.vec(n * rows, 1.0);
            let (mut floats, mut count) = (0usize, 0 as c_uint);
            let (r, c, e, nn, kk) = (rows as u32, cols as u32, experts as u32, n as u32, k as u32);
            // SAFETY: host arithmetic on sizes, writing the two out-parameters only.
            ok(unsafe { kn::hostembed_moe_mmv_workspace(r, c, 0, e, nn, kk, &mut floats, &mut count) }, &what);
            let partial = DeviceBuffer::new(floats.max(1) * 4).unwrap();
            let counters = DeviceBuffer::new((count as usize).max(1) * 4).unwrap();
            counters.fill_bytes(0).unwrap();
            let sum_count = n * rows.div_ceil(128);
            let sum_counters = DeviceBuffer::new(sum_count * 4).unwrap();
            sum_counters.fill_bytes(0).unwrap();
            let expert_bytes = dtype.row_bytes(cols).unwrap() * rows;
            let (out_apart, out_fused) =
                (DeviceBuffer::new(n * k * rows * 4).unwrap(), DeviceBuffer::new(n * k * rows * 4).unwrap());
            let (x_apart, x_fused) = (DeviceBuffer::from_slice(&x0).unwrap(), DeviceBuffer::from_slice(&x0).unwrap());
            let (w, a, g) = (wd.ptr() as *const c_void, act.ptr() as *const f32, routed.groups.ptr() as *const c_int);
            let weights = routed.weights.ptr() as *const f32;
            let (pp, cp) = (partial.ptr() as *mut f32, counters.ptr() as *mut c_uint);
            let dt = dtype as c_int;
            // SAFETY: device buffers sized for these shapes and the workspace as the launcher sized it, alive
            // until the synchronize in ok.
            unsafe {
                let y = out_apart.ptr() as *mut f32;
                let code = kn::hostembed_moe_mmv(
                    w,
                    std::ptr::null(),
                    dt,
                    expert_bytes,
                    r,
                    c,
                    a,
                    1,
                    g,
                    e,
                    nn,
                    kk,
                    y,
                    pp,
                    cp,
                    launch_tuning(),
                    NULL_STREAM,
                );
                ok(code, &what);
                ok(kn::hostembed_moe_sum(y, weights, r, nn, kk, x_apart.ptr() as *mut f32, NULL_STREAM), &what);
                let y = out_fused.ptr() as *mut f32;
                let sc = sum_counters.ptr() as *mut c_uint;
                let sums = x_fused.ptr() as *mut f32;
                let sum = |count: usize| {
                    kn::hostembed_moe_mmv_sum(
                        w,
                        dt,
                        expert_bytes,
                        r,
                        c,
                        a,
                        g,
                        e,
                        nn,
                        kk,
                        y,
                        pp,
                        cp,
                        weights,
                        sums,
                        sc,
                        count as c_uint,
                        launch_tuning(),
                        NULL_STREAM,
                    )
                };
                assert_ne!(sum(sum_count - 1), 0, "{what}: too few sum counters were taken");
                ok(sum(sum_count), &what);
            }
            let same =
                |a: &DeviceBuffer, b: &DeviceBuffer, len: usize| download::<u32>(a, len) == download::<u32>(b, len);
            assert!(same(&out_apart, &out_fused, n * k * rows), "{what}: the down products differ");
            assert!(same(&x_apart, &x_fused, n * rows), "{what}: the weighted sums differ");
            let left = download::<u32>(&sum_counters, sum_count);
            assert!(left.iter().all(|&v| v == 0), "{what}: the sum counters are not left zero");
            assert!(
                download::<u32>(&counters, (count as usize).max(1)).iter().all(|&v| v == 0),
                "{what}: split counters"
            );
        }
    }
}

/// Steps `count` streams of `gpu` together, greedy: a prompt each (3 + its index tokens), then `rounds`
/// batches of one token a stream. Returns every item's logits (as bits) after every call, in order.
fn stepped_logits(gpu: &mut GpuModel, count: usize, rounds: usize) -> Vec<Vec<u32>> {
    let vocab = gpu.config().vocab as u32;
    let mut pool = gpu.page_pool().unwrap();
    let mut streams: Vec<GpuStream> = (0..count).map(|_| gpu.new_stream(64).unwrap()).collect();
    let mut inputs: Vec<Vec<u32>> =
        (0..count).map(|s| (0..3 + s as u32).map(|i| (i * 37 + 11 * s as u32 + 5) % vocab).collect()).collect();
    let mut all = Vec::new();
    for _ in 0..=rounds {
        for (s, tokens) in streams.iter_mut().zip(&inputs) {
            reserve_pages(&mut pool, s, tokens.len()).unwrap();
        }
        let mut items: Vec<StepItem<'_, _>> = streams
            .iter_mut()
            .zip(&inputs)
            .enumerate()
            .map(|(i, (stream, tokens))| StepItem::new(stream, i as u32, tokens, Sampling::GREEDY))
            .collect();
        gpu.step_batch(&mut items).unwrap();
        let next: Vec<u32> = items.into_iter().map(|it| it.next.unwrap()).collect();
        all.extend((0..count).map(|i| bits(&gpu.logits(i).unwrap())));
        inputs = next.into_iter().map(|t| vec![t]).collect();
    }
    all
}

/// The whole model with every tail fused gives the bits of every tail launched apart (`Tuning::fused_tails`),
/// and so does the down product's prefetch of its experts' rows (`Tuning::moe_prefetch`, which moves the
/// gate and up product's release of the next launch after its wait): Qwen3-MoE, Mixtral and the
/// 40-expert model in the Q4_K_M mix (whose decode rows take the expert products the route's and the
/// sums' tails ride on): prompts, then rounds of six streams' single tokens (a piece of six rows routed in
/// the router's launch, each row's sums in the down product's), at contexts short enough for one
/// attention part (its combine in the split kernel).
#[test]
fn a_model_with_every_tail_fused_gives_the_bits_of_the_launches_apart() {
    if !gpu_present("a_model_with_every_tail_fused_gives_the_bits_of_the_launches_apart") {
        return;
    }
    let _g = serial();
    for (name, cfg) in super::configs() {
        let src = MemSource::benchmark(&cfg, Recipe::Q4KM);
        let (_rows_buf, rows) = rows_on_card(&src);
        let run = |fused_tails: FusedTails, moe_prefetch: bool| {
            let tuning = Tuning { fused_tails, moe_prefetch, ..Tuning::from_env() };
            let mut gpu = GpuModel::load(&src, rows, 16, 64, &tuning).unwrap();
            stepped_logits(&mut gpu, 6, 24)
        };
        let apart = run(FusedTails::NONE, false);
        for (what, tails, prefetch) in
            [("the fused tails", FusedTails::ALL, false), ("the prefetch", FusedTails::NONE, true)]
        {
            let got = run(tails, prefetch);
            assert_eq!(got.len(), apart.len(), "{name}");
            for (i, (g, a)) in got.iter().zip(&apart).enumerate() {
                assert!(g == a, "{name}: call {} stream {}: {what} change the logits", i / 6, i % 6);
            }
        }
    }
}
