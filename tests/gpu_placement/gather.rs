//! Every placement's gather: every format bit for bit, DS4_EMBD_MMAP, seed shapes, alignments, registrations.

use super::{MIB, check_exact, config, free_bytes, options, placements, reference_row, rows_of, warm_up, write_model};
use crate::common::{Held, Rng, Scratch, device_info, gpu_present, init, serial, stats};
use hostembed::checkpoint::Checkpoint;
use hostembed::cuda::{DeviceBuffer, HostRegistration};
use hostembed::engine::engine_tristate;
use hostembed::fit::{engine_placement, engine_plan};
use hostembed::placement::{Rows, RowsSource, engine_memory};
use hostembed::status::last_error;
use hostembed::tensor::{DType, decode_row, encode_row};
use hostembed::{Status, engine, ffi, hostmem};

/// Ids outside the vocabulary: OUT_OF_RANGE, their rows zeros (never read), the others exact.
fn check_out_of_range(e: &Held, ckpt: &Checkpoint, what: &str) {
    let (vocab, cols) = (ckpt.embed().rows(), ckpt.embed().cols());
    let ids = [vocab as i32, 5, -1, i32::MIN];
    let ids_dev = DeviceBuffer::from_slice(&ids).unwrap();
    let out = DeviceBuffer::new(ids.len() * cols * 4).unwrap();
    out.fill_bytes(0xff).unwrap();
    // SAFETY: a live engine, ids.len() ids and room for as many rows of f32 on the device.
    let st = unsafe {
        ffi::engine_embed(e.0, ids_dev.ptr() as *const i32, ids.len(), out.ptr(), DType::F32, std::ptr::null_mut())
    };
    assert_eq!(st, Status::OutOfRange, "{what}");
    let mut got = vec![0f32; ids.len() * cols];
    out.download(&mut got).unwrap();
    for (k, &id) in ids.iter().enumerate() {
        let g = &got[k * cols..(k + 1) * cols];
        if id == 5 {
            let w = reference_row(ckpt, 5);
            assert!(g.iter().zip(&w).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: the valid id beside bad ones");
        } else {
            assert!(g.iter().all(|v| v.to_bits() == 0), "{what}: id {id} is written as zeros");
        }
    }
    // The flag is cleared per call: a clean call after a bad one is OK.
    // SAFETY: a live engine, one id (the second of four) and room for a row of f32 on the device.
    let st = unsafe {
        ffi::engine_embed(
            e.0,
            (ids_dev.ptr() as *const i32).wrapping_add(1),
            1,
            out.ptr(),
            DType::F32,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(st, Status::Ok, "{what}: {}", last_error());
}

/// What an engine in `placement` must report about its rows.
fn check_rows_report(e: &Held, ckpt: &Checkpoint, placement: engine_placement, what: &str) {
    let r = rows_of(e);
    let t = ckpt.embed();
    assert_eq!(r.placement, placement, "{what}");
    assert_eq!(
        (r.dtype, r.rows, r.cols, r.row_bytes),
        (t.dtype, t.rows() as u64, t.cols() as u64, t.row_bytes() as u64),
        "{what}"
    );
    assert!(r.device_usable && !r.data.is_null(), "{what}");
    // SAFETY: a live engine; the call only reads where its rows are.
    let host_ptr = unsafe { ffi::engine_host_embed_ptr(e.0) };
    // SAFETY: engine_plan is numbers and enums with a variant at 0: all zeros is a value of it.
    let mut plan: engine_plan = unsafe { std::mem::zeroed() };
    // SAFETY: a live engine and a writable engine_plan.
    assert_eq!(unsafe { ffi::engine_plan_of(e.0, &mut plan) }, Status::Ok);
    assert_eq!(plan.placement, placement, "{what}: the plan reports where the rows went");
    if placement == engine_placement::Device {
        assert!(host_ptr.is_null() && r.host_data.is_null(), "{what}");
        assert_eq!(plan.embed_host_bytes, 0);
    } else {
        assert_eq!(host_ptr, r.data, "{what}: engine_host_embed_ptr is the rows' device pointer");
        assert_eq!(plan.embed_host_bytes, t.bytes as u64);
        // SAFETY: host_data is the engine's host copy of the t.bytes bytes of rows, alive with the engine `e`.
        let host = unsafe { std::slice::from_raw_parts(r.host_data as *const u8, t.bytes) };
        assert!(host == ckpt.bytes_of(t), "{what}: the host copy is the file's bytes");
    }
}

#[test]
fn every_placement_gathers_every_format_exactly() {
    if !gpu_present("every_placement_gathers_every_format_exactly") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("every_placement_gathers_every_format_exactly");
    let dir = Scratch::new("formats");
    let formats = [
        DType::Bf16,
        DType::F16,
        DType::Q8_0,
        DType::F32,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
    ];
    for dtype in formats {
        // Rows of whole blocks (256 values for the K formats), else the writer falls back to F16.
        let unit = dtype.format().block_values.max(64);
        let cfg = config(1000 + rng.below(3000) as usize, unit * (2 + rng.below(8) as usize / (unit / 64)));
        let path = write_model(&dir.0, &cfg, dtype, rng.next_u64());
        let ckpt = Checkpoint::open(&path).unwrap();
        assert_eq!(ckpt.embed().dtype, dtype);
        let mut lines = Vec::new();
        for (placement, opts) in placements(&path, &mut lines) {
            let what = format!("{} rows {}x{} {placement:?}", dtype.name(), cfg.vocab, cfg.hidden);
            lines.clear();
            let e = init(&path, &opts);
            check_rows_report(&e, &ckpt, placement, &what);
            check_exact(&e, &ckpt, &mut rng, 300, &what);
            check_out_of_range(&e, &ckpt, &what);
            match placement {
                // The plan line (and the prompt path's route line, logged by the backend's load).
                engine_placement::Device => {
                    assert_eq!(
                        lines.iter().filter(|l| !l.starts_with("prompt products")).count(),
                        1,
                        "{what}: {lines:?}"
                    )
                }
                engine_placement::HostMapped => assert_eq!(
                    lines[1], "embedding rows read from host memory: no room beside a 1024-token stream",
                    "{what}"
                ),
                engine_placement::FileMapped => {
                    assert_eq!(lines[1], "embedding rows read from the file mapping: options.mmap_rows is set");
                    let span = hostmem::page_span(ckpt.bytes_of(ckpt.embed())).1 as u64;
                    assert_eq!(stats().registered_bytes, span, "{what}: the page-aligned span is registered");
                }
            }
            drop(e);
            assert_eq!(stats(), engine_memory::default(), "{what}: nothing held after engine_free");
        }
    }
}

#[test]
fn ds4_embd_mmap_reads_rows_from_the_file_mapping() {
    if !gpu_present("ds4_embd_mmap_reads_rows_from_the_file_mapping") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("ds4_embd_mmap_reads_rows_from_the_file_mapping");
    let dir = Scratch::new("env");
    let path = write_model(&dir.0, &config(777, 256), DType::Q8_0, rng.next_u64());
    let ckpt = Checkpoint::open(&path).unwrap();
    let mut lines = Vec::new();
    let opts = options(1 << 50, engine_tristate::Auto, &mut lines);
    // SAFETY: the test holds serial(), which every test that reads or writes the environment takes.
    unsafe { std::env::set_var(engine::MMAP_ROWS_ENV, "1") };
    let e = init(&path, &opts);
    // SAFETY: the test holds serial(), which every test that reads or writes the environment takes.
    unsafe { std::env::remove_var(engine::MMAP_ROWS_ENV) };
    check_rows_report(&e, &ckpt, engine_placement::FileMapped, "DS4_EMBD_MMAP=1");
    assert_eq!(lines[1], "embedding rows read from the file mapping: DS4_EMBD_MMAP=1");
    check_exact(&e, &ckpt, &mut rng, 100, "DS4_EMBD_MMAP=1");
    drop(e);
    let e = init(&path, &opts);
    assert_eq!(rows_of(&e).placement, engine_placement::Device, "unset: rows on the card");
    drop(e);
    assert_eq!(stats(), engine_memory::default());
}

/// Both seed tables: exact in every placement, the device bytes a host placement frees, and the
/// baseline after engine_free.
#[test]
fn seed_shapes_exact_and_freed() {
    if !gpu_present("seed_shapes_exact_and_freed") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("seed_shapes_exact_and_freed");
    let dir = Scratch::new("seed");
    warm_up(&dir.0);
    for (vocab, hidden, dtype) in [(248_320, 5_120, DType::Bf16), (129_280, 4_096, DType::F16)] {
        let cfg = config(vocab, hidden);
        let path = write_model(&dir.0, &cfg, dtype, rng.next_u64());
        let ckpt = Checkpoint::open(&path).unwrap();
        let table = ckpt.embed().bytes as u64;
        let mut lines = Vec::new();
        let mut used = Vec::new();
        for (placement, opts) in placements(&path, &mut lines) {
            let what = format!("{} rows {vocab}x{hidden} {placement:?}", dtype.name());
            let base = free_bytes();
            let e = init(&path, &opts);
            let taken = base.saturating_sub(free_bytes());
            println!("{what}: {} MiB of device memory taken", taken / MIB);
            used.push((placement, taken));
            check_rows_report(&e, &ckpt, placement, &what);
            check_exact(&e, &ckpt, &mut rng, 500, &what);
            drop(e);
            assert_eq!(stats(), engine_memory::default(), "{what}");
            let back = free_bytes();
            assert!(back.abs_diff(base) <= 2 * MIB, "{what}: device memory {back} after engine_free, {base} before");
        }
        let on_card = used[0].1;
        for &(placement, taken) in &used[1..] {
            let saved = on_card as i64 - taken as i64;
            println!(
                "{} {vocab}x{hidden}: {placement:?} frees {} MiB of device memory (table {} MiB)",
                dtype.name(),
                saved / MIB as i64,
                table / MIB
            );
            assert!(
                saved.abs_diff(table as i64) <= 4 * MIB,
                "{placement:?}: {saved} bytes freed for a {table}-byte table"
            );
        }
        drop(ckpt);
        let _ = std::fs::remove_dir_all(&path).or_else(|_| std::fs::remove_file(&path));
    }
}

/// The gather itself on rows at every byte offset (Q8_0 rows are 2-byte aligned), row widths that
/// leave partial 16-byte groups, and rows wider than one 32 KiB stage.
#[test]
fn gather_reads_any_alignment_and_width() {
    if !gpu_present("gather_reads_any_alignment_and_width") {
        return;
    }
    let _g = serial();
    let mut rng = Rng::fresh("gather_reads_any_alignment_and_width");
    let info = device_info();
    let dir = Scratch::new("align");
    let cases = [
        (DType::F32, 102),
        (DType::F32, 10_000),
        (DType::F16, 102),
        (DType::Bf16, 5_120),
        (DType::Bf16, 20_002),
        (DType::Q8_0, 96),
        (DType::Q8_0, 32 * 1000),
        (DType::Q4_0, 96),
        (DType::Q4_1, 32 * 300),
        (DType::Q5_0, 64),
        (DType::Q5_1, 160),
        (DType::Q2_K, 256),
        (DType::Q3_K, 512),
        (DType::Q4_K, 256 * 300), // 43200 bytes a row: more than one stage
        (DType::Q5_K, 768),
        (DType::Q6_K, 256 * 200),
    ];
    let bad = DeviceBuffer::new(4).unwrap();
    for (dtype, cols) in cases {
        let vocab = 37;
        let rb = dtype.row_bytes(cols).unwrap();
        let values: Vec<Vec<f32>> = (0..vocab).map(|_| rng.vec(cols, 3.0)).collect();
        let table: Vec<u8> = values.iter().flat_map(|r| encode_row(dtype, r)).collect();
        for offset in [0usize, 1, 2, 6, 15] {
            let file = dir.0.join(format!("rows-{}-{cols}-{offset}.bin", dtype.name()));
            let mut bytes = vec![0xabu8; offset];
            bytes.extend(&table);
            std::fs::write(&file, &bytes).unwrap();
            let f = std::fs::File::open(&file).unwrap();
            // SAFETY: the test's own file, which nothing writes or truncates while it is mapped.
            let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
            let src = RowsSource { bytes: &map[offset..], dtype, vocab, cols };
            let log = |l: &str| println!("{l}");
            let all: Vec<Rows> = vec![
                Rows::on_device(&src).unwrap(),
                Rows::host_mapped(&src).unwrap(),
                // SAFETY: `map` outlives `all`, declared after it in the same block.
                unsafe { Rows::file_mapped(&src, &info, &log) }.unwrap(),
            ];
            let ids: Vec<i32> = vec![0, vocab as i32 - 1, 17, 17, 3, vocab as i32, -7];
            let ids_dev = DeviceBuffer::from_slice(&ids).unwrap();
            for rows in &all {
                for out_dtype in [DType::F32, DType::Bf16] {
                    let size = if out_dtype == DType::F32 { 4 } else { 2 };
                    let out = DeviceBuffer::new(ids.len() * cols * size).unwrap();
                    out.fill_bytes(0x5a).unwrap();
                    bad.fill_bytes(0).unwrap();
                    // SAFETY: ids.len() ids, room for as many rows of `out_dtype` and one flag int, all on the device.
                    unsafe {
                        rows.gather_device(
                            ids_dev.ptr() as *const i32,
                            ids.len(),
                            out.ptr(),
                            out_dtype,
                            bad.ptr() as *mut i32,
                            std::ptr::null_mut(),
                        )
                    }
                    .unwrap();
                    let mut got = vec![0u8; ids.len() * cols * size];
                    out.download(&mut got).unwrap();
                    let mut flag = [0i32];
                    bad.download(&mut flag).unwrap();
                    assert_eq!(flag[0], 1, "the flag is set for the bad ids");
                    let what = format!(
                        "{} cols {cols} offset {offset} {:?} out {}",
                        dtype.name(),
                        rows.placement(),
                        out_dtype.name()
                    );
                    for (k, &id) in ids.iter().enumerate() {
                        let g = &got[k * cols * size..(k + 1) * cols * size];
                        if id < 0 || id as usize >= vocab {
                            assert!(g.iter().all(|&b| b == 0), "{what}: bad id {id} row is zeros");
                            continue;
                        }
                        let mut w = vec![0f32; cols];
                        decode_row(dtype, &src.bytes[id as usize * rb..(id as usize + 1) * rb], &mut w);
                        let want: Vec<u8> = if out_dtype == DType::F32 {
                            w.iter().flat_map(|v| v.to_le_bytes()).collect()
                        } else {
                            w.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect()
                        };
                        assert!(g == &want[..], "{what}: id {id}");
                    }
                }
            }
        }
    }
    drop(bad);
    assert_eq!(stats(), engine_memory::default());
}

/// A range the host process registered first (cudaErrorHostMemoryAlreadyRegistered) is used as it is,
/// and left registered for its owner.
#[test]
fn an_existing_registration_is_borrowed() {
    if !gpu_present("an_existing_registration_is_borrowed") {
        return;
    }
    let _g = serial();
    let info = device_info();
    if !info.host_register_read_only_supported {
        println!("SKIP an_existing_registration_is_borrowed: no read-only registration on this device");
        return;
    }
    let mut rng = Rng::fresh("an_existing_registration_is_borrowed");
    let dir = Scratch::new("borrow");
    let (vocab, cols) = (300, 256);
    let values: Vec<f32> = rng.vec(vocab * cols, 1.0);
    let table: Vec<u8> = values.chunks(cols).flat_map(|r| encode_row(DType::Bf16, r)).collect();
    let file = dir.0.join("rows.bin");
    std::fs::write(&file, &table).unwrap();
    // SAFETY: the test's own file, which nothing writes or truncates while it is mapped.
    let map = unsafe { memmap2::Mmap::map(&std::fs::File::open(&file).unwrap()) }.unwrap();
    let src = RowsSource { bytes: &map[..], dtype: DType::Bf16, vocab, cols };
    let (start, len) = hostmem::page_span(src.bytes);
    // cudaHostRegisterMapped | cudaHostRegisterReadOnly, as a host process would register its mapping.
    // SAFETY: page_span gives a page-aligned range of `map`, which stays mapped until after `theirs` is dropped.
    let theirs = unsafe { HostRegistration::new(start, len, 0x02 | 0x08) }.unwrap();
    let registered = stats().registered_bytes;
    // SAFETY: `map` outlives `rows`, dropped before the end of the test.
    let rows = unsafe { Rows::file_mapped(&src, &info, &|l| println!("{l}")) }.unwrap();
    assert_eq!(rows.placement(), engine_placement::FileMapped);
    assert_eq!(rows.registration_owned(), Some(false), "error 712 borrows the registration");
    assert_eq!(stats().registered_bytes, registered, "a borrowed registration is not counted twice");
    let ids = [0i32, 299, 150];
    let ids_dev = DeviceBuffer::from_slice(&ids).unwrap();
    let out = DeviceBuffer::new(ids.len() * cols * 4).unwrap();
    // SAFETY: 3 ids and room for 3 rows of f32 on the device; no flag (NULL), all ids being in range.
    unsafe {
        rows.gather_device(
            ids_dev.ptr() as *const i32,
            3,
            out.ptr(),
            DType::F32,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    }
    .unwrap();
    let mut got = vec![0f32; 3 * cols];
    out.download(&mut got).unwrap();
    for (k, &id) in ids.iter().enumerate() {
        let mut w = vec![0f32; cols];
        decode_row(DType::Bf16, &table[id as usize * cols * 2..(id as usize + 1) * cols * 2], &mut w);
        assert!(got[k * cols..(k + 1) * cols].iter().zip(&w).all(|(a, b)| a.to_bits() == b.to_bits()), "id {id}");
    }
    drop((rows, ids_dev, out));
    assert!(theirs.owned());
    drop(theirs);
    assert_eq!(stats(), engine_memory::default());
}
