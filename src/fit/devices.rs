//! The fit rule over the devices of a tensor-parallel engine (ARCHITECTURE.md, "Tensor parallelism"):
//! each device is asked `plan` with its own figures (its shards' bytes, its share of a stream's KV, its
//! room), and decides for itself whether it holds the embedding rows or reads them from the one pinned
//! copy in host memory that every device maps. The page ids are shared, so the engine starts as many
//! streams as the device with the fewest allows.

use super::{article, describe, engine_fit_inputs, engine_placement, engine_plan, gib, plan, refusal};
use crate::status::Result;
use crate::{bail, err};

/// Every device's plan and what the engine starts from them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DevicesPlan {
    /// Device i's plan (rank i), its `streams` what that device alone would allow.
    pub plans: Vec<engine_plan>,
    /// The fewest of the devices' streams; 0 is a refusal.
    pub streams: u32,
    /// The rows held once in host memory when any device maps them, else 0.
    pub embed_host_bytes: u64,
}

/// Device `rank`'s inputs from the one-device figures `one` (the whole model's): its shards' bytes,
/// the fraction `kv_heads.0 / kv_heads.1` of a stream (its KV heads of the model's; a stream is its KV
/// rows, the same bytes a head) and its own room. Scratch stays the one-device figure, an upper bound.
pub fn device_inputs(
    one: &engine_fit_inputs,
    weight_bytes: u64,
    kv_heads: (usize, usize),
    room_bytes: u64,
) -> Result<engine_fit_inputs> {
    let (part, whole) = (kv_heads.0 as u128, kv_heads.1 as u128);
    if part == 0 || part > whole {
        bail!(InvalidArgument, "a device's {} of {} KV heads", kv_heads.0, kv_heads.1);
    }
    let share = |bytes: u64| (bytes as u128 * part).div_ceil(whole) as u64;
    Ok(engine_fit_inputs {
        room_bytes,
        weight_bytes,
        embed_bytes: one.embed_bytes.min(weight_bytes),
        stream_bytes: share(one.stream_bytes),
        stream_bytes_per_token: share(one.stream_bytes_per_token),
        ..*one
    })
}

/// The rule on each device's inputs; INVALID_ARGUMENT naming the device whose figures `plan` refuses,
/// or for no devices.
pub fn plan_devices(inputs: &[engine_fit_inputs]) -> Result<DevicesPlan> {
    if inputs.is_empty() {
        bail!(InvalidArgument, "a plan over no devices");
    }
    let plans = inputs
        .iter()
        .enumerate()
        .map(|(d, i)| plan(i).map_err(|e| err!(InvalidArgument, "device {d}: {}", e.message)))
        .collect::<Result<Vec<_>>>()?;
    let streams = plans.iter().map(|p| p.streams).min().unwrap_or(0);
    let embed_host_bytes = plans.iter().map(|p| p.embed_host_bytes).max().unwrap_or(0);
    Ok(DevicesPlan { plans, streams, embed_host_bytes })
}

/// The start-up line over N devices: `2 devices, 4 streams at an 8192-token window; device 0: model ...;
/// device 1: ...`, each device's clause `describe`'s; or which device refuses and why.
pub fn describe_devices(p: &DevicesPlan) -> String {
    let each = p.plans.iter().enumerate().map(|(d, plan)| format!("device {d}: {}", describe(plan)));
    let each = each.collect::<Vec<_>>().join("; ");
    let n = p.plans.len();
    match p.plans.iter().position(|plan| plan.streams == 0) {
        Some(d) => format!(
            "{n} devices refuse: device {d} has {}; {each}",
            refusal(&p.plans[d]).unwrap_or_else(|| "no stream".into())
        ),
        None => {
            let window = p.plans[0].window.to_string();
            let host = if p.embed_host_bytes > 0 {
                format!(", rows once in host memory ({} GiB)", gib(p.embed_host_bytes))
            } else {
                String::new()
            };
            let s = if p.streams == 1 { "" } else { "s" };
            format!("{n} devices, {} stream{s} at {} {window}-token window{host}; {each}", p.streams, article(&window))
        }
    }
}

/// True when device `d` of the plan reads the rows from host memory.
pub fn maps_rows(p: &DevicesPlan, d: usize) -> bool {
    p.plans[d].placement != engine_placement::Device
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fit::default_inputs;
    use crate::status::Status;

    const GIB: u64 = 1 << 30;

    /// An 8B-like model over two devices: 16 GiB of weights (1 GiB of rows), 1 GiB a stream.
    fn one() -> engine_fit_inputs {
        engine_fit_inputs {
            weight_bytes: 16 * GIB,
            embed_bytes: GIB,
            scratch_bytes: GIB / 2,
            stream_bytes: GIB,
            window: 8192,
            ..default_inputs()
        }
    }

    #[test]
    fn each_device_plans_its_share_and_the_fewest_streams_start() {
        // 8 GiB of shards each plus the rows on both; 4 of 8 KV heads each.
        let inputs = [
            device_inputs(&one(), 9 * GIB, (4, 8), 20 * GIB).unwrap(),
            device_inputs(&one(), 9 * GIB, (4, 8), 14 * GIB).unwrap(),
        ];
        assert_eq!(inputs[0].stream_bytes, GIB / 2);
        let p = plan_devices(&inputs).unwrap();
        // 20 - 9.5 = 10.5 GiB left: 21 half-GiB streams; 14 - 9.5 = 4.5: 9.
        assert_eq!(p.plans.iter().map(|p| p.streams).collect::<Vec<_>>(), [21, 9]);
        assert_eq!(p.streams, 9);
        assert_eq!(p.embed_host_bytes, 0);
        let line = describe_devices(&p);
        assert!(line.starts_with("2 devices, 9 streams at an 8192-token window; device 0: model 9.50 GiB"), "{line}");
        assert!(line.contains("; device 1: model 9.50 GiB, rows on the card, 9 streams"), "{line}");
    }

    /// A device short of room for the rows reads them from the one host copy; the other keeps its own.
    #[test]
    fn a_device_short_of_room_maps_the_rows_alone() {
        let inputs = [
            device_inputs(&one(), 9 * GIB, (4, 8), 20 * GIB).unwrap(),
            device_inputs(&one(), 9 * GIB, (4, 8), 10 * GIB).unwrap(),
        ];
        let p = plan_devices(&inputs).unwrap();
        assert!(!maps_rows(&p, 0) && maps_rows(&p, 1));
        assert_eq!(p.embed_host_bytes, GIB);
        // Device 1: 8.5 GiB on the card, 1.5 left: 3 streams.
        assert_eq!((p.plans[1].on_card_bytes, p.streams), (8 * GIB + GIB / 2, 3));
        assert!(describe_devices(&p).contains("window, rows once in host memory (1.00 GiB); device 0"));
    }

    #[test]
    fn a_device_without_a_stream_refuses_the_engine_and_is_named() {
        let inputs = [
            device_inputs(&one(), 9 * GIB, (4, 8), 20 * GIB).unwrap(),
            device_inputs(&one(), 9 * GIB, (4, 8), 8 * GIB).unwrap(),
        ];
        let p = plan_devices(&inputs).unwrap();
        assert_eq!(p.streams, 0);
        let line = describe_devices(&p);
        assert!(line.starts_with("2 devices refuse: device 1 has a 0.50 GiB stream, 0.00 GiB left"), "{line}");
    }

    #[test]
    fn bad_figures_name_the_device() {
        assert_eq!(plan_devices(&[]).unwrap_err().status, Status::InvalidArgument);
        let bad = engine_fit_inputs { stream_bytes: 0, ..one() };
        let e = plan_devices(&[one(), bad]).unwrap_err();
        assert_eq!(e.status, Status::InvalidArgument);
        assert!(e.message.starts_with("device 1: "), "{}", e.message);
        assert_eq!(device_inputs(&one(), GIB, (0, 8), GIB).unwrap_err().status, Status::InvalidArgument);
        assert_eq!(device_inputs(&one(), GIB, (9, 8), GIB).unwrap_err().status, Status::InvalidArgument);
    }
}
