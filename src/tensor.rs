//! Tensor element formats and their decoding to f32: the one place that knows each format's bytes.

use half::{bf16, f16};

/// Row and weight formats. Values match HE_DTYPE_* in kernels/hostembed_kernels.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum engine_dtype {
    F32 = 0,
    F16 = 1,
    Bf16 = 2,
    /// GGUF Q8_0: blocks of 32 values, a little-endian f16 scale then 32 int8 (34 bytes).
    Q8_0 = 3,
}

pub use engine_dtype as DType;

/// Values in one Q8_0 block, and its size in bytes.
pub const Q8_0_BLOCK: usize = 32;
pub const Q8_0_BLOCK_BYTES: usize = 34;

impl DType {
    /// Bytes of a row of `cols` values; None when Q8_0 and `cols` is not a multiple of 32.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        match self {
            DType::F32 => cols.checked_mul(4),
            DType::F16 | DType::Bf16 => cols.checked_mul(2),
            DType::Q8_0 => cols.is_multiple_of(Q8_0_BLOCK).then(|| cols / Q8_0_BLOCK * Q8_0_BLOCK_BYTES),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::Bf16 => "BF16",
            DType::Q8_0 => "Q8_0",
        }
    }
}

/// Decodes one row's bytes (exactly `row_bytes(out.len())` of them) into f32.
pub fn decode_row(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    assert_eq!(
        Some(bytes.len()),
        dtype.row_bytes(out.len()),
        "row bytes do not match {} x {}",
        out.len(),
        dtype.name()
    );
    match dtype {
        DType::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        DType::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        DType::Bf16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        DType::Q8_0 => {
            for (o, block) in out.chunks_exact_mut(Q8_0_BLOCK).zip(bytes.chunks_exact(Q8_0_BLOCK_BYTES)) {
                let scale = f16::from_le_bytes([block[0], block[1]]).to_f32();
                for (v, q) in o.iter_mut().zip(&block[2..]) {
                    *v = scale * (*q as i8) as f32;
                }
            }
        }
    }
}

/// Encodes f32 values in `dtype` (round to nearest even; Q8_0 as llama.cpp quantizes: scale = max|x|/127).
pub fn encode_row(dtype: DType, values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(dtype.row_bytes(values.len()).expect("Q8_0 rows are multiples of 32"));
    match dtype {
        DType::F32 => values.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::F16 => values.iter().for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        DType::Bf16 => values.iter().for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        DType::Q8_0 => {
            for block in values.chunks_exact(Q8_0_BLOCK) {
                let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                let scale = amax / 127.0;
                let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(scale).to_le_bytes());
                out.extend(block.iter().map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_round_trip_stays_within_half_a_step() {
        let values: Vec<f32> = (0..64).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let bytes = encode_row(DType::Q8_0, &values);
        assert_eq!(bytes.len(), 68);
        let mut back = vec![0f32; 64];
        decode_row(DType::Q8_0, &bytes, &mut back);
        for (block, back) in values.chunks(32).zip(back.chunks(32)) {
            let step = block.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            for (a, b) in block.iter().zip(back) {
                assert!((a - b).abs() <= step * 0.5 + 1e-3 * step, "{a} vs {b} (step {step})");
            }
        }
    }

    #[test]
    fn row_bytes_refuses_partial_q8_0_blocks() {
        assert_eq!(DType::Q8_0.row_bytes(33), None);
        assert_eq!(DType::Bf16.row_bytes(5120), Some(10240));
    }
}
