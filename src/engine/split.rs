//! `Engine::init_fit` over `options.devices` N > 1 CUDA devices (ARCHITECTURE.md, "Tensor
//! parallelism"): the model cut N ways (`shard::ShardPlan`), each device planned with its own shards,
//! KV heads, head gather and room (`fit::plan_devices`), the rows on each card or once in host memory
//! as each device's plan says, and the ranks loaded into one `gpu::split::SplitBackend` behind the
//! same `Streams` as one device's model.

use super::load::{HeldCheckpoint, Logger, device_view, rows_source};
use super::options::{gpu_kv_types, max_batch_of, resolve_prefix_cache, sampling_of, window_of};
use super::plan::{KvPool, device_label, device_pool, rank_fit_inputs};
use super::{InitStep, engine_options};
use crate::abi::engine_device_info;
use crate::backend::{Decoder, Streams};
use crate::cuda;
use crate::fit::{self, engine_fit_inputs, engine_placement, engine_plan};
use crate::gpu::split::SplitBackend;
use crate::gpu::{RowsOnDevice, Sizing};
use crate::kv::KvTypes;
use crate::model::TensorSource;
use crate::placement::Rows;
use crate::shard::{RankSource, ShardPlan, rank_config};
use crate::status::Result;
use crate::tensor::DType;
use crate::tuning::Tuning;

/// What a split load hands the engine: the backend over the ranks, rank 0's rows (the engine's
/// `rows`, which `engine_embed` gathers from) and the other rows the ranks read, rank 0's plan and
/// figures with the engine's stream count, and every device's plan.
pub(super) struct SplitLoad {
    pub backend: Box<dyn Decoder>,
    pub rows: Rows,
    pub rank_rows: Vec<Rows>,
    pub plan: engine_plan,
    pub inputs: engine_fit_inputs,
    /// Every device's plan, rank order.
    pub device_plans: Vec<engine_plan>,
}

/// The devices of the ranks: `options.device` and the N - 1 after it, or N times `options.device`
/// with `Tuning::split_one_device`.
fn rank_devices(opts: &engine_options, tuning: &Tuning) -> Vec<i32> {
    let world = opts.devices.max(1) as i32;
    (0..world).map(|r| if tuning.split_one_device { opts.device } else { opts.device + r }).collect()
}

/// Each rank's room: a device's (`options.room_bytes` when set, else its free bytes), shared evenly by
/// the ranks on it.
fn rank_rooms(opts: &engine_options, devices: &[i32], infos: &[engine_device_info]) -> Vec<u64> {
    devices
        .iter()
        .zip(infos)
        .map(|(d, info)| {
            let sharing = devices.iter().filter(|&e| e == d).count() as u64;
            let room = if opts.room_bytes > 0 { opts.room_bytes } else { info.free_bytes };
            room / sharing
        })
        .collect()
}

/// The KV pool every rank keeps: the fewest pages any rank's plan leaves room for (the page ids are
/// the engine's, shared by every rank), and the streams the fewest allow.
fn shared_pool(
    cfgs: &[crate::model::ModelConfig],
    plans: &[engine_plan],
    inputs: &[engine_fit_inputs],
    streams: u32,
    kv: KvTypes,
    opts: &engine_options,
    tuning: &Tuning,
) -> (u32, KvPool) {
    let each: Vec<(u32, KvPool)> = plans
        .iter()
        .zip(inputs)
        .zip(cfgs)
        .map(|((p, i), cfg)| device_pool(&engine_plan { streams, ..*p }, i, 0, cfg, kv, opts, tuning))
        .collect();
    let streams = each.iter().map(|(s, _)| *s).min().unwrap_or(0);
    let pool = each.iter().map(|(_, p)| *p).min_by_key(|p| p.pages).expect("a split has ranks");
    (streams, pool)
}

/// The rows every rank reads: one copy on each device whose plan keeps them there, and one in host
/// memory for every device whose plan maps them. Returns the owners, rank 0's first, and each rank's
/// view.
fn place_rows(
    ckpt: &HeldCheckpoint,
    devices: &[i32],
    plans: &[engine_plan],
    info: &engine_device_info,
    logger: &Logger,
) -> Result<(Vec<Rows>, Vec<RowsOnDevice>)> {
    let src = rows_source(ckpt);
    let mut owners: Vec<(Option<i32>, Rows)> = Vec::new();
    let mut views = Vec::with_capacity(devices.len());
    for (&device, plan) in devices.iter().zip(plans) {
        let key = (plan.placement == engine_placement::Device).then_some(device);
        let i = match owners.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                let rows = match plan.placement {
                    engine_placement::Device => {
                        cuda::require_device(device)?;
                        Rows::on_device(&src)?
                    }
                    engine_placement::HostMapped => Rows::host_mapped(&src)?,
                    // SAFETY: the rows point into `ckpt`, which the engine drops after them; the
                    // registration is portable, so every device reads it.
                    engine_placement::FileMapped => unsafe { Rows::file_mapped(&src, info, &|l| logger.line(l)) }?,
                };
                owners.push((key, rows));
                owners.len() - 1
            }
        };
        views.push(device_view(&owners[i].1));
    }
    Ok((owners.into_iter().map(|(_, rows)| rows).collect(), views))
}

/// Plans, places and loads the model over `rank_devices(opts, tuning)`. NO_ROOM naming the device that
/// has no room for a stream; NCCL's absence or failure as it reports it.
pub(super) fn load_split(
    ckpt: &HeldCheckpoint,
    opts: &engine_options,
    tuning: &Tuning,
    logger: &Logger,
    injected: &dyn Fn(InitStep) -> Result<()>,
) -> Result<SplitLoad> {
    let devices = rank_devices(opts, tuning);
    let world = devices.len();
    let kv = gpu_kv_types(opts);
    kv.check(&ckpt.config)?;
    let infos = devices.iter().map(|&d| cuda::device_info(d)).collect::<Result<Vec<_>>>()?;
    for (&d, i) in devices.iter().zip(&infos) {
        kv.check_device(i.compute_major, i.compute_minor, &device_label(d, i))?;
    }
    let cfg = &ckpt.config;
    let shards = ShardPlan::new(cfg, world, |w| ckpt.try_tensor(&w.name).map_or(DType::F32, |t| t.dtype))?;
    let rooms = rank_rooms(opts, &devices, &infos);
    // Each rank's slices are copied to measure them and dropped; the load copies them again one at a time.
    let inputs = (0..world)
        .map(|r| rank_fit_inputs(ckpt, &RankSource::new(&**ckpt, &shards, r)?, opts, &infos[r], rooms[r], tuning))
        .collect::<Result<Vec<_>>>()?;
    let planned = fit::plan_devices(&inputs)?;
    let cfgs: Vec<_> = (0..world).map(|r| rank_config(cfg, &shards, r)).collect();
    let (streams, pool) = shared_pool(&cfgs, &planned.plans, &inputs, planned.streams, kv, opts, tuning);
    let line = format!("{}: {}", fit::describe_parameters(cfg), fit::describe_devices(&planned));
    if planned.streams == 0 {
        logger.line(&line);
        crate::bail!(NoRoom, "{}", fit::describe_devices(&planned));
    }
    logger.line(&format!("{line}; each device's {}", pool.describe_with(kv)));
    injected(InitStep::Planned)?;

    // A file mapping's registration is asked of rank 0's device and is portable to the others.
    let (mut rows, views) = place_rows(ckpt, &devices, &planned.plans, &infos[0], logger)?;
    injected(InitStep::RowsPlaced)?;
    let window = window_of(cfg, opts)? as usize;
    let local = pool.local.map(|(pages, _)| pages);
    let sizing = Sizing { max_batch: max_batch_of(opts), pool_pages: pool.pages, local_pages: local, kv, window };
    let split = SplitBackend::load(&**ckpt, &shards, &devices, &views, sizing, tuning)?;
    logger.line(split.rank(0).prompt_route());
    logger.line(&match tuning.split_one_device {
        true => format!("tensor parallelism over {world} ranks on device {} (host-met sums, no graphs)", opts.device),
        false => format!("tensor parallelism over devices {devices:?} through NCCL"),
    });
    // The engine's own calls (the row gather, its flag) run on rank 0's device.
    cuda::require_device(opts.device)?;
    let prefix_cache = resolve_prefix_cache(opts.prefix_cache);
    let backend =
        Streams::new(split, window, streams as usize, pool.pages, sampling_of(opts))?.with_prefix_cache(prefix_cache);
    let rank0 = rows.remove(0);
    Ok(SplitLoad {
        backend: Box::new(backend),
        rows: rank0,
        rank_rows: rows,
        plan: engine_plan { streams, ..planned.plans[0] },
        inputs: inputs[0],
        device_plans: planned.plans,
    })
}
