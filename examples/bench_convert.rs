//! The prompt path's weight conversion on the GPU (`hostembed_convert_matrix`: a matrix in a block format
//! decoded into the half-format slab the tensor-core products read before a prompt chunk's product), in
//! bytes moved per second against the device's copy bandwidth.
//!
//!     cargo run --release --example bench_convert -- [--all] [--out bf16|f16] [--runs 7]
//!
//! Prints a markdown table: Q8_0, Q4_K, Q6_K, Q5_K and Q4_0 (every format but the output's own with
//! `--all`) at 4096 x 14336 and 14336 x 4096, each the median microseconds of one conversion over weight
//! copies that together exceed the L2, the bytes read (the blocks) and written (2 a value), GB/s of both
//! together, its share of the copy bandwidth (read + written) and the time that bandwidth predicts. The
//! matrices repeat 64 encoded random rows (the reference encoders are too slow for 58M values; the
//! conversion's work does not depend on the values).

use std::os::raw::{c_int, c_uint};

use hostembed::cuda::{self, DeviceBuffer, Event, Stream};
use hostembed::cudart as rt;
use hostembed::kernels as kn;
use hostembed::tensor::{DType, FORMATS, encode_row};

/// cudaMemcpyDeviceToDevice (the runtime's constants are crate-private).
const MEMCPY_DEVICE_TO_DEVICE: rt::cudaMemcpyKind = 3;

fn check(code: c_int, what: &str) {
    cuda::check(code, what).unwrap_or_else(|e| panic!("{what}: {e}"));
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median milliseconds of `iters` launches of `launch(i)` (after a warm-up), over `runs` timings.
fn time_ms(stream: &Stream, runs: usize, iters: usize, mut launch: impl FnMut(usize)) -> f64 {
    for i in 0..iters.min(4) {
        launch(i);
    }
    let times: Vec<f64> = (0..runs)
        .map(|_| {
            let (e0, e1) = (Event::new().unwrap(), Event::new().unwrap());
            e0.record(stream.raw()).unwrap();
            for i in 0..iters {
                launch(i);
            }
            e1.record(stream.raw()).unwrap();
            e1.elapsed_ms_since(&e0).unwrap() as f64 / iters as f64
        })
        .collect();
    median(times)
}

/// Device-to-device copy bandwidth (bytes read plus written), the ceiling the table compares with.
fn copy_bandwidth(stream: &Stream, runs: usize) -> f64 {
    let bytes = 1usize << 30;
    let (a, b) = (DeviceBuffer::new(bytes).unwrap(), DeviceBuffer::new(bytes).unwrap());
    a.fill_bytes(1).unwrap();
    let ms = time_ms(stream, runs, 4, |_| {
        check(
            // SAFETY: two live device buffers of `bytes` each.
            unsafe { rt::cudaMemcpyAsync(b.ptr(), a.ptr(), bytes, MEMCPY_DEVICE_TO_DEVICE, stream.raw()) },
            "cudaMemcpyAsync",
        )
    });
    2.0 * bytes as f64 / (ms * 1e-3) / 1e9
}

/// A rows x cols matrix in `dtype`: 64 encoded random rows, repeated.
fn matrix(dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    let mut state = 0x5eed_u64 ^ dtype as u64;
    let mut sample = Vec::new();
    for _ in 0..rows.min(64) {
        let values: Vec<f32> = (0..cols)
            .map(|_| {
                state = hostembed::sampler::splitmix64(state);
                ((state >> 40) as f32 / 16_777_216.0 * 2.0 - 1.0) / (cols as f32).sqrt()
            })
            .collect();
        sample.extend(encode_row(dtype, &values));
    }
    let row_bytes = dtype.row_bytes(cols).expect("rows of whole blocks");
    sample.iter().copied().cycle().take(rows * row_bytes).collect()
}

fn main() {
    let (mut all, mut out, mut runs) = (false, DType::Bf16, 7usize);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--all" => all = true,
            "--out" => {
                out = match it.next().unwrap_or_default().to_ascii_lowercase().as_str() {
                    "bf16" => DType::Bf16,
                    "f16" => DType::F16,
                    other => panic!("--out: bf16 or f16, not {other:?}"),
                }
            }
            "--runs" => runs = it.next().and_then(|v| v.parse().ok()).expect("--runs takes a number"),
            other => panic!("unknown flag {other} (see the comment at the top of examples/bench_convert.rs)"),
        }
    }
    cuda::require_device(0).unwrap_or_else(|e| {
        eprintln!("bench_convert: {e}");
        std::process::exit(1);
    });
    let stream = Stream::new().unwrap();
    let peak = copy_bandwidth(&stream, runs);
    println!("device-to-device copy {peak:.0} GB/s (read + write); conversions into {}", out.name());

    let formats: Vec<DType> = if all {
        FORMATS.iter().map(|f| f.dtype).filter(|&d| d != out).collect()
    } else {
        vec![DType::Q8_0, DType::Q4_K, DType::Q6_K, DType::Q5_K, DType::Q4_0]
    };
    println!(
        "\n| format | rows x cols | MB read | MB written | us | GB/s | of copy bandwidth | us at copy bandwidth |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for dtype in formats {
        for (rows, cols) in [(4096usize, 14336usize), (14336, 4096)] {
            let host = matrix(dtype, rows, cols);
            let read = host.len();
            let written = rows * cols * 2;
            // Weight copies that together exceed the L2, so every conversion reads from memory.
            let copies = (256usize << 20).div_ceil(read).max(2);
            let weights: Vec<DeviceBuffer> = (0..copies).map(|_| DeviceBuffer::from_slice(&host).unwrap()).collect();
            let slab = DeviceBuffer::new(written).unwrap();
            let ms = time_ms(&stream, runs, 20, |i| {
                check(
                    // SAFETY: a live copy of the rows x cols matrix, and a slab of rows x cols halves.
                    unsafe {
                        kn::hostembed_convert_matrix(
                            weights[i % copies].ptr(),
                            dtype as c_int,
                            rows as c_uint,
                            cols as c_uint,
                            slab.ptr(),
                            out as c_int,
                            stream.raw(),
                        )
                    },
                    "hostembed_convert_matrix",
                )
            });
            let moved = (read + written) as f64;
            let gbs = moved / (ms * 1e-3) / 1e9;
            println!(
                "| {} | {rows} x {cols} | {:.1} | {:.1} | {:.1} | {gbs:.0} | {:.0}% | {:.1} |",
                dtype.name(),
                read as f64 / 1e6,
                written as f64 / 1e6,
                ms * 1e3,
                100.0 * gbs / peak,
                moved / (peak * 1e9) * 1e6
            );
        }
    }
}
