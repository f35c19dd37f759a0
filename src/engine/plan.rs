//! The engine's figures for the fit rule (`fit_inputs`: from the GPU model's own layouts and the
//! device), the KV pool the plan leaves room for, and the start-up line's words about both.

use super::options::{gpu_kv_types, max_batch_of, resolve_mmap_rows, resolve_unified, tuning_for, window_of};
use super::{MMAP_ROWS_ENV, engine_options, engine_tristate};
use crate::abi::engine_device_info;
use crate::checkpoint::Checkpoint;
use crate::fit::{self, engine_fit_inputs, engine_placement, engine_plan};
use crate::gpu::{GpuModel, local_piece};
use crate::kv::KvTypes;
use crate::model::{ModelConfig, TensorSource};
use crate::shard::RankSource;
use crate::status::Result;
use crate::tuning::Tuning;

/// The KV pool: `pages` pages of `page_tokens` positions, `bytes` of memory; `local`: the pages of the
/// sliding-window layers' own pool, and their window, where they have one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvPool {
    pub page_tokens: usize,
    pub pages: usize,
    pub bytes: u64,
    pub local: Option<(usize, usize)>,
}

impl KvPool {
    /// Pages for `windows` full windows of `window` tokens, or for `room` bytes at `per_token` bytes a
    /// position, whichever is more.
    pub fn sized(page_tokens: usize, window: usize, windows: u64, room: u64, per_token: u64) -> KvPool {
        let per_page = per_token.max(1).saturating_mul(page_tokens as u64);
        let for_windows = windows.saturating_mul(window.div_ceil(page_tokens) as u64);
        let pages = for_windows.max(room / per_page).min(u32::MAX as u64) as usize;
        KvPool { page_tokens, pages, bytes: (pages as u64).saturating_mul(per_page), local: None }
    }

    /// The same pool with `cfg`'s sliding-window layers in a pool of their own for `streams` streams
    /// of `window` tokens stepping long items in pieces of `piece` tokens (`fit::local_share`: each
    /// stream's pages of what the window still reaches, with the margin, and of a piece; a step holds
    /// every position it computes until it ends), at most the main pool's pages (a local page stands
    /// beside a main one). Unchanged where the model has no such layers or their pages would hold the
    /// whole window anyway.
    pub fn with_local(mut self, cfg: &ModelConfig, window: usize, streams: usize, piece: usize) -> KvPool {
        let Some(share) = fit::local_share(cfg, window, self.page_tokens, piece) else { return self };
        let pages = streams.saturating_mul(share.positions as usize / self.page_tokens).min(self.pages);
        self.local = Some((pages, share.window as usize));
        self
    }

    pub fn tokens(&self) -> u64 {
        self.pages as u64 * self.page_tokens as u64
    }

    /// Streams to admit when `want` are asked for: no more than the pool has pages, so that each can
    /// hold a token.
    pub fn streams(&self, want: u32) -> u32 {
        want.min(u32::try_from(self.pages).unwrap_or(u32::MAX))
    }

    /// The start-up line's words for it.
    pub fn describe(&self) -> String {
        format!(
            "KV pool of {} tokens ({} GiB, {} pages of {} tokens{})",
            self.tokens(),
            fit::gib(self.bytes),
            self.pages,
            self.page_tokens,
            self.describe_local()
        )
    }

    fn describe_local(&self) -> String {
        match self.local {
            Some((pages, w)) => {
                format!("; the sliding-window layers' own pool of {pages} pages, a stream's last {w} tokens")
            }
            None => String::new(),
        }
    }

    /// `describe` naming the cache types too: "KV pool of 4096 tokens in Q8_0 (...)".
    pub fn describe_with(&self, kv: KvTypes) -> String {
        format!(
            "KV pool of {} tokens in {} ({} GiB, {} pages of {} tokens{})",
            self.tokens(),
            kv.describe(),
            fit::gib(self.bytes),
            self.pages,
            self.page_tokens,
            self.describe_local()
        )
    }
}

/// The streams a device's `plan` admits and its KV pool: the room the plan leaves beside the reserve
/// and `beside` bytes (a drafter's pool), and at least its full windows; no more than max_streams full
/// windows, which is all those streams could fill. `cfg` is the model the device holds (a rank's KV
/// heads on a split model's device).
pub fn device_pool(
    plan: &engine_plan,
    inputs: &engine_fit_inputs,
    beside: u64,
    cfg: &ModelConfig,
    kv: KvTypes,
    opts: &engine_options,
    tuning: &Tuning,
) -> (u32, KvPool) {
    let page = crate::gpu::PAGE_TOKENS;
    let room = plan.left_bytes.saturating_sub(inputs.reserve_bytes).saturating_sub(beside);
    let room = match opts.max_streams {
        0 => room,
        most => room.min((most as u64).saturating_mul(plan.stream_bytes)),
    };
    // With the sliding-window layers in a pool of their own (the plan counted each stream's share of
    // it), the main pool holds the other layers in the room the local pool leaves.
    let piece = local_piece(max_batch_of(opts));
    let share = tuning.cuda_local_pool.then(|| fit::local_share(cfg, plan.window as usize, page, piece)).flatten();
    let local_stream =
        share.map_or(0, |l| l.positions * l.layers * (kv.bytes_per_token(cfg) / cfg.layers.max(1) as u64));
    let sized =
        |room: u64| KvPool::sized(page, plan.window as usize, plan.streams as u64, room, inputs.stream_bytes_per_token);
    // `max_streams` bounds the streams, which share the pool however many full windows it holds.
    let streams = if opts.max_streams > 0 { sized(room).streams(opts.max_streams) } else { plan.streams };
    let pool = sized(room.saturating_sub(local_stream.saturating_mul(streams as u64)));
    let pool = match share {
        Some(_) => pool.with_local(cfg, plan.window as usize, streams as usize, piece),
        None => pool,
    };
    (streams, pool)
}

/// "device 0 (NVIDIA H200)" for messages about the device.
pub(super) fn device_label(device: i32, info: &engine_device_info) -> String {
    let bytes: Vec<u8> = info.name.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    format!("device {device} ({})", String::from_utf8_lossy(&bytes))
}

/// The figures the fit rule decides on, from a checkpoint and the options (the KV cache in
/// `gpu_kv_types`; UNSUPPORTED when a type cannot hold the model's heads), for the tuning an engine
/// would run with (`tuning_for`). `device` is the device the engine would run on (None: no device;
/// then `room_bytes` must be given and unified Auto is false).
pub fn fit_inputs(
    ckpt: &Checkpoint,
    opts: &engine_options,
    device: Option<&engine_device_info>,
) -> Result<engine_fit_inputs> {
    fit_inputs_with_drafter(ckpt, None, opts, device, &tuning_for(opts))
}

/// `fit_inputs` for `tuning`, with a drafter model beside the target: its terms are the drafter's real
/// bytes (its weights, embedding rows and scratch; one stream at the drafter's window) instead of the
/// options'.
pub fn fit_inputs_with_drafter(
    ckpt: &Checkpoint,
    drafter: Option<&Checkpoint>,
    opts: &engine_options,
    device: Option<&engine_device_info>,
    tuning: &Tuning,
) -> Result<engine_fit_inputs> {
    let cfg = &ckpt.config;
    let window = window_of(cfg, opts)?;
    let room = match (opts.room_bytes, device) {
        (0, Some(d)) => d.free_bytes,
        (0, None) => crate::bail!(InvalidArgument, "options.room_bytes is 0 and there is no device to probe"),
        (room, _) => room,
    };
    let embed = ckpt.bytes_of(ckpt.embed()).len() as u64;
    let kv = gpu_kv_types(opts);
    let label = ckpt.path.display().to_string();
    let f = model_figures(ckpt, &label, opts, window as usize, kv, tuning)?;
    let (drafter_weight_bytes, drafter_stream_bytes) = match drafter {
        None => (opts.drafter_weight_bytes, opts.drafter_stream_bytes),
        Some(d) => {
            let weights = GpuModel::weight_bytes(d);
            if weights == 0 {
                crate::bail!(BadModel, "{}: the GPU backend cannot lay out the drafter's weights", d.path.display());
            }
            kv.check(&d.config)?;
            let window = drafter_window(&d.config, window as usize);
            let embed = d.bytes_of(d.embed()).len() as u64;
            let scratch = GpuModel::scratch_bytes(d, max_batch_of(opts), kv, window, tuning);
            (weights + embed + scratch, GpuModel::stream_bytes(&d.config, kv, window))
        }
    };
    Ok(engine_fit_inputs {
        drafter_weight_bytes,
        drafter_stream_bytes,
        ..f.inputs(embed, room, window, cfg.tied, opts, device)
    })
}

/// What the GPU model of `src` allocates beside its rows, from the same layouts its load uses.
struct ModelFigures {
    weights: u64,
    scratch: u64,
    /// A stream's full window of KV.
    stream: u64,
    /// A position's KV in the main pool.
    per_token: u64,
}

/// `src`'s figures (`label` names it in the refusal when the GPU backend cannot lay it out) for the
/// options' prompt chunks, streams of `window` positions in `kv`'s types and `tuning`.
fn model_figures(
    src: &dyn TensorSource,
    label: &str,
    opts: &engine_options,
    window: usize,
    kv: KvTypes,
    tuning: &Tuning,
) -> Result<ModelFigures> {
    let cfg = src.config();
    let weights = GpuModel::weight_bytes(src);
    if weights == 0 {
        crate::bail!(BadModel, "{label}: the GPU backend cannot lay out this model's weights");
    }
    kv.check(cfg)?;
    let scratch = GpuModel::scratch_bytes(src, max_batch_of(opts), kv, window, tuning);
    // The sliding-window layers in a pool of their own count their share's positions, the others the window.
    let share = tuning
        .cuda_local_pool
        .then(|| fit::local_share(cfg, window, crate::gpu::PAGE_TOKENS, local_piece(max_batch_of(opts))))
        .flatten();
    let per_layer = kv.bytes_per_token(cfg) / cfg.layers.max(1) as u64;
    let (stream, per_token) = match share {
        None => (GpuModel::stream_bytes(cfg, kv, window), kv.bytes_per_token(cfg)),
        Some(l) => {
            let main = per_layer * (cfg.layers as u64 - l.layers);
            (main * window as u64 + per_layer * l.layers * l.positions, main)
        }
    };
    Ok(ModelFigures { weights, scratch, stream, per_token })
}

impl ModelFigures {
    /// The fit rule's inputs: these figures beside the checkpoint's whole rows (`embed` bytes; `tied`
    /// when the head reads them), `room` bytes on `device`, streams of `window` positions, the options'
    /// reserve and limits, and no drafter.
    fn inputs(
        self,
        embed: u64,
        room: u64,
        window: u32,
        tied: bool,
        opts: &engine_options,
        device: Option<&engine_device_info>,
    ) -> engine_fit_inputs {
        engine_fit_inputs {
            room_bytes: room,
            weight_bytes: self.weights + embed,
            embed_bytes: embed,
            scratch_bytes: self.scratch,
            stream_bytes: self.stream,
            stream_bytes_per_token: self.per_token,
            drafter_weight_bytes: 0,
            drafter_stream_bytes: 0,
            reserve_bytes: opts.reserve_bytes,
            window,
            max_streams: opts.max_streams,
            unified: resolve_unified(opts.unified, device),
            embed_tied: tied,
            mmap_rows: resolve_mmap_rows(opts.mmap_rows),
        }
    }
}

/// The fit rule's figures for rank `rank` of a tensor-parallel model on its device: `fit_inputs`' for
/// the rank's shards and KV heads, its head's gather in the scratch, the whole embedding rows, `room`
/// bytes of room and no drafter.
pub fn rank_fit_inputs(
    ckpt: &Checkpoint,
    rank: &RankSource,
    opts: &engine_options,
    device: &engine_device_info,
    room: u64,
    tuning: &Tuning,
) -> Result<engine_fit_inputs> {
    let window = window_of(&ckpt.config, opts)?;
    let kv = gpu_kv_types(opts);
    let label = format!("{} (rank {} of {})", ckpt.path.display(), rank.rank(), rank.world());
    let f = model_figures(rank, &label, opts, window as usize, kv, tuning)?;
    let gather = GpuModel::gather_bytes(ckpt.config.vocab, rank.world(), max_batch_of(opts));
    let embed = ckpt.bytes_of(ckpt.embed()).len() as u64;
    let inputs = f.inputs(embed, room, window, ckpt.config.tied, opts, Some(device));
    Ok(engine_fit_inputs { scratch_bytes: inputs.scratch_bytes + gather, ..inputs })
}

/// The line logged when the rows leave the card, in the seed's words.
pub fn host_rows_reason(plan: &engine_plan, inputs: &engine_fit_inputs, opts: &engine_options) -> Option<String> {
    match plan.placement {
        engine_placement::Device => None,
        engine_placement::HostMapped => {
            Some(format!("embedding rows read from host memory: no room beside a {}-token stream", plan.window))
        }
        engine_placement::FileMapped => Some(match opts.mmap_rows {
            engine_tristate::Yes => "embedding rows read from the file mapping: options.mmap_rows is set".to_string(),
            _ if inputs.mmap_rows => format!("embedding rows read from the file mapping: {MMAP_ROWS_ENV}=1"),
            _ => "embedding rows read from the file mapping".to_string(),
        }),
    }
}

/// The window a drafter's streams have beside a target's of `window`: the target's, or the drafter's
/// own positions where those are fewer (its streams then stop proposing before the target's end).
pub fn drafter_window(cfg: &ModelConfig, window: usize) -> usize {
    window.min(cfg.max_position)
}
