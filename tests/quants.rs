//! The quantized formats against independent references: tests/data/quants/ holds blocks and the
//! values the `gguf` Python package decodes them to, and rows with the blocks it quantizes them to
//! (scripts/quant_vectors.py made them), and rows with the blocks llama.cpp's own reference
//! quantizers make of them (scripts/llama_cpp_quant_vectors.sh). Decoding must match bit for bit (any
//! NaN for a NaN), and so must encoding, for every format.

use std::path::PathBuf;

use hostembed::tensor::{DType, FORMATS, decode_row, encode_row};

fn data(name: &str) -> Option<Vec<u8>> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/quants").join(name);
    std::fs::read(path).ok()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

fn quantized_formats() -> impl Iterator<Item = DType> {
    FORMATS.iter().filter(|f| f.block_values > 1).map(|f| f.dtype)
}

#[test]
fn decoding_matches_the_reference_bit_for_bit() {
    let mut checked = 0;
    for dtype in quantized_formats() {
        let name = dtype.name();
        let blocks = data(&format!("{name}.blocks")).unwrap_or_else(|| panic!("no vectors for {name}"));
        let expected = f32s(&data(&format!("{name}.values")).unwrap());
        let f = dtype.format();
        assert_eq!(blocks.len() % f.block_bytes, 0, "{name}: whole blocks");
        assert_eq!(expected.len(), blocks.len() / f.block_bytes * f.block_values, "{name}: values");
        let mut got = vec![f32::from_bits(0x7FC0_1234); expected.len()];
        decode_row(dtype, &blocks, &mut got);
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            let same = g.to_bits() == e.to_bits() || (g.is_nan() && e.is_nan());
            assert!(
                same,
                "{name}: value {i} (block {}): {g:e} ({:#010x}), reference {e:e} ({:#010x})",
                i / f.block_values,
                g.to_bits(),
                e.to_bits()
            );
        }
        assert!(expected.iter().any(|v| !v.is_finite()), "{name}: the vectors hold an infinite scale");
        assert!(expected.iter().any(|v| *v != 0.0 && v.abs() < 1e-6), "{name}: and a subnormal one");
        checked += 1;
    }
    assert_eq!(checked, 10);
}

#[test]
fn encoding_matches_the_reference_where_it_quantizes() {
    let mut checked = Vec::new();
    for dtype in quantized_formats() {
        let name = dtype.name();
        let Some(input) = data(&format!("{name}.input")) else { continue };
        let expected = data(&format!("{name}.quantized")).unwrap();
        let got = encode_row(dtype, &f32s(&input));
        assert_eq!(got.len(), expected.len(), "{name}");
        let block = dtype.format().block_bytes;
        for (b, (g, e)) in got.chunks(block).zip(expected.chunks(block)).enumerate() {
            assert_eq!(g, e, "{name}: block {b}");
        }
        checked.push(name);
    }
    assert_eq!(checked, ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]);
}

/// Every encoder against llama.cpp's reference quantizers themselves (quantize_row_*_ref, compiled by
/// scripts/llama_cpp_quant_vectors.sh), on rows with every edge it has: the k-quants' sub-block fits
/// included, bit for bit.
#[test]
fn encoding_matches_llama_cpp_reference_quantizers() {
    let input = f32s(&data("llama_cpp.input").expect("tests/data/quants/llama_cpp.input"));
    let mut checked = 0;
    for dtype in quantized_formats() {
        let name = dtype.name();
        let expected = data(&format!("{name}.llama_cpp")).unwrap_or_else(|| panic!("no llama.cpp blocks for {name}"));
        let got = encode_row(dtype, &input);
        assert_eq!(got.len(), expected.len(), "{name}");
        let block = dtype.format().block_bytes;
        for (b, (g, e)) in got.chunks(block).zip(expected.chunks(block)).enumerate() {
            assert_eq!(g, e, "{name}: block {b} (row {})", b * dtype.format().block_values / 256);
        }
        checked += 1;
    }
    assert_eq!(checked, 10);
}

/// Round trips of the gguf rows through the k-quants stay within their bits.
#[test]
fn k_quant_encodings_of_extreme_rows_decode_close() {
    let input = f32s(&data("Q4_0.input").unwrap());
    let rows: Vec<f32> = input.iter().cycle().take(4096).copied().collect();
    for (dtype, bound) in
        [(DType::Q6_K, 0.03), (DType::Q5_K, 0.06), (DType::Q4_K, 0.12), (DType::Q3_K, 0.3), (DType::Q2_K, 0.6)]
    {
        for block in rows.chunks(256) {
            let mut back = vec![0f32; 256];
            decode_row(dtype, &encode_row(dtype, block), &mut back);
            let scale = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in block.iter().zip(&back) {
                assert!(b.is_finite(), "{}: {a} decodes to {b}", dtype.name());
                assert!((a - b).abs() <= bound * scale + 1e-30, "{}: {a} vs {b} (max {scale})", dtype.name());
            }
        }
    }
}
