//! The embedding rows' speed in each placement, on the seed's table (248,320 rows x 5,120 BF16,
//! 10 KiB a row, 2.37 GiB): single-token gather latency, 4096-id gather bandwidth, and the time to
//! place the rows. Prints a table; needs a CUDA device.
//!
//! `bench_embed [DIR]` writes its table file into DIR (default: $HOSTEMBED_TEST_TMP or the temp dir).

use hostembed::cuda::{self, DeviceBuffer, Event, Stream};
use hostembed::ffi::engine_device_info;
use hostembed::hostmem;
use hostembed::placement::{Rows, RowsSource};
use hostembed::tensor::{DType, encode_row};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

const VOCAB: usize = 248_320;
const COLS: usize = 5_120;
const SINGLE_ITERS: usize = 2_000;
const BATCH: usize = 4_096;
const BATCH_ITERS: usize = 50;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Writes the table file once (random rows; each 10 KiB row is a few random rows repeated).
fn table_file(dir: &std::path::Path) -> std::io::Result<PathBuf> {
    let path = dir.join(format!("bench_embed_{VOCAB}x{COLS}_bf16.bin"));
    let bytes = VOCAB * COLS * 2;
    if std::fs::metadata(&path).map(|m| m.len() as usize == bytes).unwrap_or(false) {
        return Ok(path);
    }
    let mut rng = Rng(7);
    let samples: Vec<Vec<u8>> = (0..64)
        .map(|_| {
            let v: Vec<f32> = (0..COLS).map(|_| ((rng.next() >> 40) as f32 / (1u64 << 24) as f32) - 0.5).collect();
            encode_row(DType::Bf16, &v)
        })
        .collect();
    let mut f = std::io::BufWriter::with_capacity(64 << 20, std::fs::File::create(&path)?);
    for r in 0..VOCAB {
        f.write_all(&samples[(r * 31 + (r >> 6)) % samples.len()])?;
    }
    f.flush()?;
    Ok(path)
}

struct Timings {
    single_us: f64,
    batch_gbs: f64,
}

/// Single-row latency: events around each of many back-to-back gathers (read once at the end, so the
/// card stays busy as in a decode loop); then the bandwidth of 4096-id gathers.
fn time_rows(rows: &Rows, stream: &Stream, ids: &DeviceBuffer, out: &DeviceBuffer) -> hostembed::Result<Timings> {
    // SAFETY: the callers' ids are below SINGLE_ITERS + BATCH, the ids `ids` holds: the pointer stays inside it.
    let id_ptr = |i: usize| unsafe { (ids.ptr() as *const i32).add(i) };
    // SAFETY: first + n is at most the SINGLE_ITERS + BATCH ids of `ids`, and `out` holds BATCH rows of f32.
    let gather = |first: usize, n: usize| unsafe {
        rows.gather_device(id_ptr(first), n, out.ptr(), DType::F32, std::ptr::null_mut(), stream.raw())
    };
    for i in 0..20 {
        gather(i, 1)?;
    }
    stream.synchronize()?;
    let events: Vec<(Event, Event)> =
        (0..SINGLE_ITERS).map(|_| Ok((Event::new()?, Event::new()?))).collect::<hostembed::Result<_>>()?;
    for (i, (start, end)) in events.iter().enumerate() {
        start.record(stream.raw())?;
        gather(i, 1)?;
        end.record(stream.raw())?;
    }
    let single = events
        .iter()
        .map(|(s, e)| Ok(e.elapsed_ms_since(s)? as f64 * 1000.0))
        .collect::<hostembed::Result<Vec<_>>>()?;
    let (start, end) = (Event::new()?, Event::new()?);
    let mut batch = Vec::with_capacity(BATCH_ITERS);
    for it in 0..BATCH_ITERS {
        start.record(stream.raw())?;
        gather((it * 997) % SINGLE_ITERS, BATCH)?;
        end.record(stream.raw())?;
        let s = end.elapsed_ms_since(&start)? as f64 / 1000.0;
        batch.push((BATCH * rows.row_bytes()) as f64 / s / 1e9);
    }
    Ok(Timings { single_us: median(single), batch_gbs: median(batch) })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if let Err(e) = cuda::require_device(0) {
        println!("SKIP bench_embed: {e}");
        return Ok(());
    }
    // SAFETY: engine_device_info is numbers, bools and a byte array: all zeros is a value of it.
    let mut info = unsafe { std::mem::zeroed::<engine_device_info>() };
    // SAFETY: a writable engine_device_info.
    let st = unsafe { hostembed::ffi::engine_device_info(0, &mut info) };
    if st != hostembed::Status::Ok {
        return Err(format!("engine_device_info: {}", hostembed::status::last_error()).into());
    }
    // SAFETY: engine_device_info filled `name` with a NUL-terminated string.
    let name = unsafe { std::ffi::CStr::from_ptr(info.name.as_ptr()) }.to_string_lossy().into_owned();
    let dir = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOSTEMBED_TEST_TMP").map(PathBuf::from))
        .unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&dir)?;
    let path = table_file(&dir)?;
    let file = std::fs::File::open(&path)?;
    // SAFETY: the benchmark's own table file, which nothing writes or truncates while it is mapped.
    let map = unsafe { memmap2::Mmap::map(&file) }?;
    let src = RowsSource { bytes: &map[..], dtype: DType::Bf16, vocab: VOCAB, cols: COLS };
    let table = src.bytes.len();

    println!("bench_embed on {name}: {VOCAB} rows x {COLS} BF16, {} KiB a row, {:.2} GiB", COLS * 2 / 1024, gib(table));
    println!("copy threads: {}", hostmem::copy_threads());
    println!();

    // Placing the rows, each from a page-cache-warm mapping.
    hostmem::read_ahead(src.bytes);
    let _ = src.bytes.iter().step_by(4096).fold(0u8, |a, b| a ^ b);
    let t = Instant::now();
    let mut pinned = cuda::PinnedBuffer::new_mapped(table)?;
    let alloc_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    hostmem::parallel_copy(&mut pinned.as_mut_slice()[..table], src.bytes);
    let copy_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    drop(pinned);
    let free_s = t.elapsed().as_secs_f64();
    let mut scratch = vec![0u8; table];
    let t = Instant::now();
    scratch.copy_from_slice(src.bytes);
    let one_thread_s = t.elapsed().as_secs_f64();
    drop(scratch);
    // For comparison: anonymous memory filled by the copy threads, then registered (pinning resident pages).
    let t = Instant::now();
    let mut anon = memmap2::MmapMut::map_anon(table)?;
    hostmem::parallel_copy(&mut anon[..], src.bytes);
    let anon_copy_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    // SAFETY: `anon` is page-aligned and outlives `reg`, which is dropped first.
    let reg =
        unsafe { cuda::HostRegistration::new(anon.as_mut_ptr() as *mut std::os::raw::c_void, table, 0x01 | 0x02) }?;
    let anon_reg_s = t.elapsed().as_secs_f64();
    drop(reg);
    drop(anon);
    let t = Instant::now();
    let host = Rows::host_mapped(&src)?;
    let host_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let device = Rows::on_device(&src)?;
    let device_s = t.elapsed().as_secs_f64();
    let log = |l: &str| println!("log: {l}");
    let t = Instant::now();
    // SAFETY: `map` outlives `file_rows`, declared after it in the same function.
    let file_rows = unsafe { Rows::file_mapped(&src, &info, &log) }?;
    let file_s = t.elapsed().as_secs_f64();
    let g = gib(table);
    println!("| placing {:.2} GiB of rows                          | seconds | GiB/s |", g);
    println!("|---------------------------------------------------|---------|-------|");
    println!("| cudaHostAlloc(Mapped|Portable)                    | {alloc_s:7.3} | {:5.1} |", g / alloc_s);
    println!(
        "| {:2}-thread copy from the mapping into it           | {copy_s:7.3} | {:5.1} |",
        hostmem::copy_threads(),
        g / copy_s
    );
    println!("| cudaFreeHost                                      | {free_s:7.3} |       |");
    println!("| one-thread memcpy from the mapping (pageable dst) | {one_thread_s:7.3} | {:5.1} |", g / one_thread_s);
    println!("| HOST_MAPPED as placed (Rows::host_mapped)         | {host_s:7.3} | {:5.1} |", g / host_s);
    println!("| alternative: anonymous map + copy                 | {anon_copy_s:7.3} | {:5.1} |", g / anon_copy_s);
    println!("| alternative: then cudaHostRegister(Mapped)        | {anon_reg_s:7.3} | {:5.1} |", g / anon_reg_s);
    println!("| DEVICE: cudaMalloc + upload                       | {device_s:7.3} | {:5.1} |", g / device_s);
    println!(
        "| FILE_MAPPED: register + madvise ({:<16}) | {file_s:7.3} | {:5.1} |",
        format!("{:?}", file_rows.placement()),
        g / file_s
    );
    println!();

    let stream = Stream::new()?;
    let mut rng = Rng(11);
    let ids: Vec<i32> = (0..SINGLE_ITERS + BATCH).map(|_| (rng.next() % VOCAB as u64) as i32).collect();
    let ids_dev = DeviceBuffer::from_slice(&ids)?;
    let out = DeviceBuffer::new(BATCH * COLS * 4)?;
    let placements: [(&str, &Rows); 3] =
        [("DEVICE", &device), ("HOST_MAPPED", &host), ("FILE_MAPPED (registered)", &file_rows)];
    let mut results = Vec::new();
    for (label, rows) in placements {
        results.push((label, time_rows(rows, &stream, &ids_dev, &out)?));
    }
    let base = results[0].1.single_us;
    println!("| placement                 | 1 row (10 KiB), us median | vs DEVICE, us | {BATCH} ids, GB/s median |");
    println!("|---------------------------|---------------------------|---------------|--------------------|");
    for (label, t) in &results {
        println!("| {label:<25} | {:25.2} | {:+13.2} | {:18.1} |", t.single_us, t.single_us - base, t.batch_gbs);
    }
    std::io::stdout().flush()?;
    Ok(())
}
