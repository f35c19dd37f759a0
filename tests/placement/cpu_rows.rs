//! The CPU backend's rows read from the mapping, and the parallel copy.

use super::{config, cpu_options};
use crate::common::{Rng, Scratch, c_path, serial, stats};
use hostembed::checkpoint::Checkpoint;
use hostembed::checkpoint::write::{write_synthetic_gguf, write_synthetic_hf};
use hostembed::engine::engine_options;
use hostembed::fit::{engine_placement, engine_plan};
use hostembed::placement::engine_rows;
use hostembed::status::last_error;
use hostembed::tensor::{DType, FORMATS, decode_row};
use hostembed::{Status, ffi};
use std::ffi::{CStr, c_char, c_void};

fn expect_row(ckpt: &Checkpoint, id: usize) -> Vec<f32> {
    let t = ckpt.embed();
    let rb = t.row_bytes();
    let mut v = vec![0f32; t.cols()];
    decode_row(t.dtype, &ckpt.bytes_of(t)[id * rb..(id + 1) * rb], &mut v);
    v
}

unsafe extern "C" fn collect_lines(user: *mut c_void, line: *const c_char) {
    // SAFETY: the user pointer is the `Vec<String>` this test's options gave the engine, alive and not otherwise
    // borrowed while it logs.
    let lines = unsafe { &mut *(user as *mut Vec<String>) };
    // SAFETY: the engine passes a NUL-terminated line alive for the call.
    lines.push(unsafe { CStr::from_ptr(line) }.to_string_lossy().into_owned());
}

#[test]
fn cpu_backend_reads_rows_from_the_mapping() {
    let _g = serial();
    let mut rng = Rng::fresh("cpu_backend_reads_rows_from_the_mapping");
    let dir = Scratch::new("cpu");
    for dtype in FORMATS.iter().map(|f| f.dtype) {
        // Rows of whole blocks: one k-quant super-block, or two Q8_0 blocks.
        let hidden = if dtype.format().block_values > 32 { 256 } else { 64 };
        let cfg = config(200 + rng.below(100) as usize, hidden, false);
        let path = if dtype == DType::Bf16 || dtype == DType::F32 {
            let p = dir.0.join(format!("hf-{}", dtype.name()));
            write_synthetic_hf(&p, &cfg, rng.next_u64(), dtype).unwrap();
            p
        } else {
            let p = dir.0.join(format!("m-{}.gguf", dtype.name()));
            write_synthetic_gguf(&p, &cfg, rng.next_u64(), dtype).unwrap();
            p
        };
        let ckpt = Checkpoint::open(&path).unwrap();
        assert_eq!(ckpt.embed().dtype, dtype);
        let file_bytes: u64 = ckpt.files.iter().map(|f| f.map.len() as u64).sum();

        let mut lines: Vec<String> = Vec::new();
        let opts = engine_options {
            log: Some(collect_lines),
            log_user: &mut lines as *mut Vec<String> as *mut c_void,
            ..cpu_options()
        };
        let before = stats();
        let mut e = std::ptr::null_mut();
        assert_eq!(
            // SAFETY: a NUL-terminated path, options and a handle slot, all alive across the call.
            unsafe { ffi::engine_init_fit(c_path(&path).as_ptr(), &opts, &mut e) },
            Status::Ok,
            "{}",
            last_error()
        );
        assert!(!e.is_null());
        assert_eq!(stats().mapped_bytes - before.mapped_bytes, file_bytes, "the engine's mapping is counted");
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].contains("CPU backend") && lines[0].contains(&format!("{}-token window", cfg.max_position)),
            "{lines:?}"
        );

        // SAFETY: engine_rows is pointers, numbers, a bool and enums with a variant at 0: all zeros is a value of it.
        let mut rows: engine_rows = unsafe { std::mem::zeroed() };
        // SAFETY: a live engine and a writable engine_rows.
        assert_eq!(unsafe { ffi::engine_embed_rows(e, &mut rows) }, Status::Ok);
        assert_eq!((rows.dtype, rows.placement, rows.device_usable), (dtype, engine_placement::FileMapped, false));
        assert_eq!((rows.rows, rows.cols), (cfg.vocab as u64, cfg.hidden as u64));
        assert_eq!(rows.row_bytes, dtype.row_bytes(cfg.hidden).unwrap() as u64);
        // No copy: the engine's own mapping, whose bytes are the file's.
        assert_eq!(rows.data, rows.host_data);
        // SAFETY: on the CPU backend the rows are the file mapping's `rows * row_bytes` bytes, alive while the engine
        // is.
        let mapped =
            unsafe { std::slice::from_raw_parts(rows.data as *const u8, (rows.rows * rows.row_bytes) as usize) };
        assert!(mapped == ckpt.bytes_of(ckpt.embed()), "the rows are the file's bytes");
        // SAFETY: a live engine.
        assert!(unsafe { ffi::engine_host_embed_ptr(e) }.is_null(), "no device reads these rows");
        // SAFETY: engine_plan is numbers and an enum with a variant at 0: all zeros is a value of it.
        let mut plan: engine_plan = unsafe { std::mem::zeroed() };
        // SAFETY: a live engine and a writable engine_plan.
        assert_eq!(unsafe { ffi::engine_plan_of(e, &mut plan) }, Status::Unsupported);
        // SAFETY: as above.
        assert_eq!(unsafe { ffi::engine_plan_of_device(e, 0, &mut plan) }, Status::Unsupported);

        let mut ids: Vec<i32> = (0..16).map(|_| rng.below(cfg.vocab as u64) as i32).collect();
        ids.extend([0, cfg.vocab as i32 - 1]);
        let mut out = vec![0f32; ids.len() * cfg.hidden];
        // SAFETY: a live engine, `ids.len()` ids and room for as many F32 rows of `hidden` values in `out`; host
        // memory, as the CPU backend reads and writes.
        let st = unsafe {
            ffi::engine_embed(
                e,
                ids.as_ptr(),
                ids.len(),
                out.as_mut_ptr() as *mut c_void,
                DType::F32,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(st, Status::Ok, "{}", last_error());
        for (k, &id) in ids.iter().enumerate() {
            let want = expect_row(&ckpt, id as usize);
            let got = &out[k * cfg.hidden..(k + 1) * cfg.hidden];
            assert!(want.iter().zip(got).all(|(a, b)| a.to_bits() == b.to_bits()), "{} row {id}", dtype.name());
        }
        let mut bf = vec![0u16; ids.len() * cfg.hidden];
        // SAFETY: a live engine, `ids.len()` ids and room for as many BF16 rows of `hidden` values in `bf`; host
        // memory, as the CPU backend reads and writes.
        let st = unsafe {
            ffi::engine_embed(
                e,
                ids.as_ptr(),
                ids.len(),
                bf.as_mut_ptr() as *mut c_void,
                DType::Bf16,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(st, Status::Ok, "{}", last_error());
        for (k, &id) in ids.iter().enumerate() {
            let want: Vec<u16> =
                expect_row(&ckpt, id as usize).iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect();
            assert_eq!(&bf[k * cfg.hidden..(k + 1) * cfg.hidden], &want[..], "{} row {id} as bf16", dtype.name());
        }

        // An id outside the vocabulary: OUT_OF_RANGE and nothing written.
        for bad in [-1, cfg.vocab as i32, i32::MAX] {
            let ids = [3, bad];
            let mut out = vec![7f32; 2 * cfg.hidden];
            // SAFETY: a live engine, two ids and room for two F32 rows of `hidden` values in `out`, in host memory.
            let st = unsafe {
                ffi::engine_embed(e, ids.as_ptr(), 2, out.as_mut_ptr() as *mut c_void, DType::F32, std::ptr::null_mut())
            };
            assert_eq!(st, Status::OutOfRange);
            assert!(last_error().contains(&bad.to_string()), "{}", last_error());
            assert!(out.iter().all(|&v| v == 7.0), "nothing written for a call with a bad id");
        }
        // SAFETY: the engine came from engine_init_fit and is freed here, once.
        unsafe { ffi::engine_free(e) };
        assert_eq!(stats(), before, "the engine's mapping is released");
    }
}

#[test]
fn parallel_copy_copies_every_byte() {
    let mut rng = Rng::fresh("parallel_copy_copies_every_byte");
    for len in [0usize, 1, 4095, (16 << 20) + 1, (53 << 20) + 12_345] {
        let src: Vec<u8> = (0..len.div_ceil(8)).flat_map(|_| rng.next_u64().to_le_bytes()).take(len).collect();
        let mut dst = vec![0u8; len];
        hostembed::hostmem::parallel_copy(&mut dst, &src);
        assert!(dst == src, "{len} bytes");
    }
}
