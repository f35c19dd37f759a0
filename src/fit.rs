//! The fit rule: from byte counts alone, where the embedding rows live and how many streams start.
//!
//! A pure function with no CUDA, so a server can ask it before it loads anything. The rule:
//! - `need = weight + scratch + stream + drafter_weight + drafter_stream + reserve`;
//! - placement: tied → DEVICE (the output head reads the whole table every token, mapping saves
//!   nothing); else mmap_rows → FILE_MAPPED; else unified → DEVICE (host memory is device memory);
//!   else room ≥ need → DEVICE; else HOST_MAPPED;
//! - `on_card = weight − (rows in host memory ? embed : 0) + scratch + drafter_weight`,
//!   `left = room − on_card` (0 when negative): the reserve enters the decision to map, not the admission;
//! - `streams = left / (stream + drafter_stream)`, capped by `max_streams`; zero streams is a refusal.
//!
//! Window model for the largest windows: a stream at window `w` is
//! `stream_bytes + (w − window) × stream_bytes_per_token`, i.e. a fixed part
//! (`stream_bytes − window × stream_bytes_per_token`, which must not be negative) that stays, plus
//! the per-token part; the drafter's stream does not grow with the window.

use crate::kv::KvTypes;
use crate::status::{Error, Result, Status};

pub use crate::abi::{ENGINE_FIT_DEFAULT_RESERVE_BYTES, engine_fit_inputs, engine_placement, engine_plan};

mod devices;
pub use devices::{DevicesPlan, describe_devices, device_inputs, maps_rows, plan_devices};

const GIB: u64 = 1 << 30;

/// Reserve 256 MiB, every other figure 0 and every flag false.
pub fn default_inputs() -> engine_fit_inputs {
    engine_fit_inputs {
        room_bytes: 0,
        weight_bytes: 0,
        embed_bytes: 0,
        scratch_bytes: 0,
        stream_bytes: 0,
        stream_bytes_per_token: 0,
        drafter_weight_bytes: 0,
        drafter_stream_bytes: 0,
        reserve_bytes: ENGINE_FIT_DEFAULT_RESERVE_BYTES,
        window: 0,
        max_streams: 0,
        unified: false,
        embed_tied: false,
        mmap_rows: false,
    }
}

/// The rule evaluated for one stream size, in 128-bit arithmetic so no sum of 64-bit figures can wrap.
struct Outcome {
    placement: engine_placement,
    need: u128,
    on_card: u128,
    left: u128,
    stream: u128,
    streams: u128,
}

fn evaluate(i: &engine_fit_inputs, stream_bytes: u128) -> Outcome {
    let weights = i.weight_bytes as u128 + i.scratch_bytes as u128 + i.drafter_weight_bytes as u128;
    let stream = stream_bytes + i.drafter_stream_bytes as u128;
    let need = weights + stream + i.reserve_bytes as u128;
    let placement = if i.embed_tied {
        engine_placement::Device
    } else if i.mmap_rows {
        engine_placement::FileMapped
    } else if i.unified || i.room_bytes as u128 >= need {
        engine_placement::Device
    } else {
        engine_placement::HostMapped
    };
    let rows_in_host = if placement == engine_placement::Device { 0 } else { i.embed_bytes as u128 };
    let on_card = weights - rows_in_host;
    let left = (i.room_bytes as u128).saturating_sub(on_card);
    // A zero-sized stream (rejected by `plan`) would fit any number of times.
    let streams = left.checked_div(stream).unwrap_or(u128::MAX);
    let streams = if i.max_streams == 0 { streams } else { streams.min(i.max_streams as u128) };
    Outcome { placement, need, on_card, left, stream, streams }
}

/// The target's stream at window `w` under the model in the module comment.
fn stream_at(i: &engine_fit_inputs, fixed: u128, w: u32) -> u128 {
    fixed + w as u128 * i.stream_bytes_per_token as u128
}

/// The largest `w` in 1..=u32::MAX for which `holds` is true, given it is true up to some window and
/// false beyond; 0 when it holds nowhere.
fn largest_window(holds: impl Fn(u32) -> bool) -> u32 {
    if !holds(1) {
        return 0;
    }
    if holds(u32::MAX) {
        return u32::MAX;
    }
    let (mut yes, mut no) = (1u32, u32::MAX);
    while no - yes > 1 {
        let mid = yes + (no - yes) / 2;
        if holds(mid) { yes = mid } else { no = mid }
    }
    yes
}

fn to_u64(value: u128, what: &str) -> Result<u64> {
    u64::try_from(value)
        .map_err(|_| Error::new(Status::InvalidArgument, format!("engine_fit_inputs: {what} overflows 64 bits")))
}

/// The rule for `inputs`. Err(INVALID_ARGUMENT) only for figures that overflow or contradict each
/// other; a plan with zero streams is Ok (see `refusal`).
pub fn plan(inputs: &engine_fit_inputs) -> Result<engine_plan> {
    let i = inputs;
    if i.embed_bytes > i.weight_bytes {
        return Err(Error::new(
            Status::InvalidArgument,
            format!(
                "engine_fit_inputs: embed_bytes ({}) exceeds weight_bytes ({}), which includes the rows",
                i.embed_bytes, i.weight_bytes
            ),
        ));
    }
    if i.stream_bytes == 0 && i.drafter_stream_bytes == 0 {
        return Err(Error::new(
            Status::InvalidArgument,
            "engine_fit_inputs: stream_bytes and drafter_stream_bytes are both 0; a stream has a size",
        ));
    }
    let grown = i.window as u128 * i.stream_bytes_per_token as u128;
    let Some(fixed) = (i.stream_bytes as u128).checked_sub(grown) else {
        return Err(Error::new(
            Status::InvalidArgument,
            format!(
                "engine_fit_inputs: stream_bytes ({}) is less than window ({}) x stream_bytes_per_token ({}); a stream's fixed part cannot be negative",
                i.stream_bytes, i.window, i.stream_bytes_per_token
            ),
        ));
    };
    let at = evaluate(i, i.stream_bytes as u128);
    to_u64(
        i.weight_bytes as u128 + i.scratch_bytes as u128 + i.drafter_weight_bytes as u128,
        "weight_bytes + scratch_bytes + drafter_weight_bytes",
    )?;
    to_u64(at.stream, "stream_bytes + drafter_stream_bytes")?;
    let need = to_u64(
        at.need,
        "need (weight_bytes + scratch_bytes + stream_bytes + drafter_weight_bytes + drafter_stream_bytes + reserve_bytes)",
    )?;

    let mut out = engine_plan {
        placement: at.placement,
        streams: at.streams.min(u32::MAX as u128) as u32,
        window: i.window,
        need_bytes: need,
        on_card_bytes: at.on_card as u64,
        left_bytes: at.left as u64,
        stream_bytes: at.stream as u64,
        embed_host_bytes: if at.placement == engine_placement::Device { 0 } else { i.embed_bytes },
        max_window_on_card: 0,
        max_window: 0,
        max_window_placement: at.placement,
        max_window_unmapped: 0,
    };
    if i.stream_bytes_per_token > 0 {
        // Both predicates are monotone in w: the rows leave the card only as the stream grows, and
        // leaving frees room, so every window that starts on the card also starts mapped.
        out.max_window_on_card = largest_window(|w| {
            let o = evaluate(i, stream_at(i, fixed, w));
            o.placement == engine_placement::Device && o.streams >= 1
        });
        out.max_window = largest_window(|w| evaluate(i, stream_at(i, fixed, w)).streams >= 1);
        if out.max_window > 0 {
            out.max_window_placement = evaluate(i, stream_at(i, fixed, out.max_window)).placement;
        }
        let all_on_card = i.weight_bytes as u128 + i.scratch_bytes as u128 + i.drafter_weight_bytes as u128;
        let left_all_on_card = (i.room_bytes as u128).saturating_sub(all_on_card);
        out.max_window_unmapped =
            largest_window(|w| stream_at(i, fixed, w) + i.drafter_stream_bytes as u128 <= left_all_on_card);
    }
    Ok(out)
}

/// Bytes as GiB with two decimals, rounded half up in integers so every caller prints the same text.
pub fn gib(bytes: u64) -> String {
    let hundredths = (bytes as u128 * 100 + (GIB as u128) / 2) / GIB as u128;
    format!("{}.{:02}", hundredths / 100, hundredths % 100)
}

/// "a" or "an" as the number is spoken: an 8.90, an 11, an 18, an 80-something, an 8192-token.
fn article(number: &str) -> &'static str {
    let whole: u64 = number.split('.').next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let mut lead = whole;
    while lead >= 1000 {
        lead /= 1000;
    }
    let mut first = lead;
    while first >= 10 {
        first /= 10;
    }
    if lead == 11 || lead == 18 || (whole > 0 && first == 8) { "an" } else { "a" }
}

/// Why the engine refuses to start, worded like the seed ("a 10.90 GiB stream, 8.93 GiB left");
/// None when at least one stream starts.
pub fn refusal(plan: &engine_plan) -> Option<String> {
    if plan.streams > 0 {
        return None;
    }
    let stream = gib(plan.stream_bytes);
    Some(format!("{} {stream} GiB stream, {} GiB left", article(&stream), gib(plan.left_bytes)))
}

/// The start-up line's first words: the architecture and its parameters, those a token reads too when
/// it has experts: `llama, 8.03 B parameters` or `qwen3_moe, 30.53 B parameters (3.34 B active a token)`.
pub fn describe_parameters(cfg: &crate::model::ModelConfig) -> String {
    let count = |n: u64| {
        if n >= 1_000_000_000 { format!("{:.2} B", n as f64 / 1e9) } else { format!("{:.2} M", n as f64 / 1e6) }
    };
    let (active, total) = cfg.parameters();
    match cfg.moe {
        None => format!("{}, {} parameters", cfg.arch.name(), count(total)),
        Some(m) => format!(
            "{}, {} parameters ({} active a token: {} of {} experts)",
            cfg.arch.name(),
            count(total),
            count(active),
            m.used,
            m.experts
        ),
    }
}

/// The start-up line, e.g. `model 13.29 GiB, rows mapped (2.37 GiB in host memory), 1 stream at a
/// 98304-token window, 8.93 GiB left`.
pub fn describe(plan: &engine_plan) -> String {
    let rows = match plan.placement {
        engine_placement::Device => "rows on the card".to_string(),
        engine_placement::HostMapped => format!("rows mapped ({} GiB in host memory)", gib(plan.embed_host_bytes)),
        engine_placement::FileMapped => {
            format!("rows read from the file mapping ({} GiB in host memory)", gib(plan.embed_host_bytes))
        }
    };
    let model = gib(plan.on_card_bytes);
    match refusal(plan) {
        Some(why) => format!("model {model} GiB, {rows}, refuses: {why}"),
        None => {
            let window = plan.window.to_string();
            format!(
                "model {model} GiB, {rows}, {} stream{} at {} {window}-token window, {} GiB left",
                plan.streams,
                if plan.streams == 1 { "" } else { "s" },
                article(&window),
                gib(plan.left_bytes)
            )
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The CPU backend: streams against host memory.

/// What the CPU backend plans its streams from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuFitInputs {
    pub layers: u64,
    pub window: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    /// What the K and V caches are stored in.
    pub kv: KvTypes,
    /// Streams asked for (the option, or the backend's default).
    pub want_streams: u32,
    /// One entry of the stream table, paid for every admitted stream even before it is used.
    pub slot_bytes: u64,
    /// What one step takes beside the caches (a prompt chunk's activations, each thread's buffers),
    /// paid once: only one step runs at a time.
    pub scratch_bytes: u64,
    /// Host memory the streams and the step scratch may take.
    pub room_bytes: u64,
    /// Where `room_bytes` came from: None = the caller's `room_bytes`, Some((available, reserve)) =
    /// MemAvailable less the reserve.
    pub probed: Option<(u64, u64)>,
    /// The sliding-window layers' share where they keep only their window (counted at its positions,
    /// the other layers at the window).
    pub local: Option<LocalShare>,
}

/// Positions before a stream's length that its sliding-window layers keep beyond their window: a
/// backend's attention reach (a block of positions: 32 on the CPU, a 64-position tile on CUDA, 128
/// counted) and a verification's longest rejection with the position a score computes again.
pub const LOCAL_MARGIN: usize = 128 + crate::abi::ENGINE_SPECULATION_MAX_TOKENS as usize + 1;

/// A model's sliding-window layers in a pool of their own: how many, their window, and the positions
/// of them a stream holds at most (the window's reach with the margin and a piece with a
/// verification's proposals, in whole pages).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalShare {
    pub layers: u64,
    pub window: u64,
    pub positions: u64,
}

/// `cfg`'s `LocalShare` for streams of `window` tokens in pages of `page` stepping long items in pieces
/// of `piece`; None where it has no sliding-window layers or their pages would hold the whole window.
pub fn local_share(cfg: &crate::model::ModelConfig, window: usize, page: usize, piece: usize) -> Option<LocalShare> {
    let w = (0..cfg.layers).filter_map(|l| cfg.attention.window(l)).max()?;
    let layers = (0..cfg.layers).filter(|&l| cfg.attention.window(l).is_some()).count();
    let step = (piece + crate::abi::ENGINE_SPECULATION_MAX_TOKENS as usize).div_ceil(page) + 1;
    let pages = (w + LOCAL_MARGIN).div_ceil(page) + 1 + step;
    if pages >= window.div_ceil(page) {
        return None;
    }
    Some(LocalShare { layers: layers as u64, window: w as u64, positions: (pages * page) as u64 })
}

/// The CPU backend's decision: how many streams start, and the figures it was made from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuPlan {
    pub inputs: CpuFitInputs,
    /// One stream's KV cache (in the plan's types) plus its table entry; None when it overflows 64 bits.
    pub stream_bytes: Option<u64>,
    /// 0 is a refusal.
    pub streams: u32,
}

/// One stream's KV cache: layers x window x kv_heads x (a head's K row + its V row in their types, scales
/// included); None on overflow.
pub fn cpu_kv_bytes(layers: u64, window: u64, kv_heads: u64, head_dim: u64, kv: KvTypes) -> Option<u64> {
    let head_dim = usize::try_from(head_dim).ok()?;
    let row = (kv.k.row_bytes(head_dim) as u64).checked_add(kv.v.row_bytes(head_dim) as u64)?;
    layers.checked_mul(window)?.checked_mul(kv_heads)?.checked_mul(row)
}

/// Decides the CPU backend's streams: as many as asked that fit the room left beside the step
/// scratch, none when one does not.
pub fn plan_cpu(i: &CpuFitInputs) -> CpuPlan {
    let (apart, positions) = i.local.map_or((0, 0), |l| (l.layers.min(i.layers), l.positions));
    let stream_bytes = cpu_kv_bytes(i.layers - apart, i.window, i.kv_heads, i.head_dim, i.kv)
        .and_then(|main| main.checked_add(cpu_kv_bytes(apart, positions, i.kv_heads, i.head_dim, i.kv)?))
        .and_then(|kv| kv.checked_add(i.slot_bytes));
    let room = i.room_bytes.saturating_sub(i.scratch_bytes);
    let fit = stream_bytes.map_or(0, |s| room.checked_div(s).unwrap_or(u64::MAX));
    let streams = fit.min(i.want_streams as u64) as u32;
    CpuPlan { inputs: *i, stream_bytes, streams }
}

/// The step scratch and where the room came from, in the start-up line's words.
fn cpu_room(i: &CpuFitInputs) -> String {
    let room = match i.probed {
        None => format!("{} GiB of host memory (options.room_bytes)", gib(i.room_bytes)),
        Some((available, reserve)) => format!(
            "{} GiB of host memory (MemAvailable {} GiB less a {} GiB reserve)",
            gib(i.room_bytes),
            gib(available),
            gib(reserve)
        ),
    };
    format!("beside {} GiB of step scratch, in {room}", gib(i.scratch_bytes))
}

/// Why the CPU backend refuses to start, with the start-up line's figures; None when a stream starts.
pub fn refusal_cpu(p: &CpuPlan) -> Option<String> {
    if p.streams > 0 {
        return None;
    }
    let i = &p.inputs;
    Some(match p.stream_bytes {
        None => format!(
            "a {}-token window's {} KV cache ({} layers x {} KV heads x {} dims) overflows 64 bits, {}",
            i.window,
            i.kv.describe(),
            i.layers,
            i.kv_heads,
            i.head_dim,
            cpu_room(i)
        ),
        Some(bytes) => {
            let stream = gib(bytes);
            format!(
                "{} {stream} GiB stream ({} KV cache) at a {}-token window, {}",
                article(&stream),
                i.kv.describe(),
                i.window,
                cpu_room(i)
            )
        }
    })
}

/// The CPU backend's part of the start-up line: `16 streams of 0.01 GiB at a 512-token window, beside
/// 0.01 GiB of step scratch, in 21.33 GiB of host memory (...)`, or `refuses: ...`.
pub fn describe_cpu(p: &CpuPlan) -> String {
    match refusal_cpu(p) {
        Some(why) => format!("refuses: {why}"),
        None => format!(
            "{} stream{} of {} GiB ({} KV cache) at a {}-token window, {}",
            p.streams,
            if p.streams == 1 { "" } else { "s" },
            gib(p.stream_bytes.unwrap_or(0)),
            p.inputs.kv.describe(),
            p.inputs.window,
            cpu_room(&p.inputs)
        ),
    }
}

/// `MemAvailable` of a /proc/meminfo text, in bytes.
pub fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let value: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => value.checked_mul(1024),
        None => Some(value),
        Some(_) => None,
    }
}

/// The CPU plan's inputs for a model at `window` with `want` streams and caches in `kv`: the room is
/// `options.room_bytes` when given, else MemAvailable less `options.reserve_bytes`; the step scratch is
/// the CPU backend's at `threads` threads. IO_ERROR when /proc/meminfo cannot tell.
pub fn cpu_inputs(
    cfg: &crate::model::ModelConfig,
    window: u32,
    want: u32,
    slot_bytes: u64,
    kv: KvTypes,
    opts: &crate::engine::engine_options,
    threads: usize,
) -> Result<CpuFitInputs> {
    let (room_bytes, probed) = if opts.room_bytes > 0 {
        (opts.room_bytes, None)
    } else {
        let text = std::fs::read_to_string("/proc/meminfo")
            .map_err(|e| Error::new(Status::IoError, format!("/proc/meminfo: {e}; pass options.room_bytes")))?;
        let available = mem_available(&text).ok_or_else(|| {
            Error::new(Status::IoError, "/proc/meminfo has no MemAvailable line; pass options.room_bytes")
        })?;
        (available.saturating_sub(opts.reserve_bytes), Some((available, opts.reserve_bytes)))
    };
    Ok(CpuFitInputs {
        layers: cfg.layers as u64,
        window: window as u64,
        kv_heads: cfg.kv_heads as u64,
        head_dim: cfg.head_dim as u64,
        kv,
        want_streams: want,
        slot_bytes,
        scratch_bytes: crate::cpu::scratch_bytes(cfg, window as usize, threads),
        room_bytes,
        probed,
        local: local_share(cfg, window as usize, crate::cpu::PAGE_TOKENS, crate::cpu::LOCAL_PIECE_TOKENS),
    })
}
