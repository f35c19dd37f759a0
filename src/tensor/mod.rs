//! Tensor element formats: one type per format (its block layout, decode and encode of a row, its ids
//! in GGUF, safetensors and the C enum), and [`FORMATS`], the one list every table of formats reads.
//! kernels/formats/ holds the device side of the same formats.

use safetensors::Dtype;

mod bfloat16;
pub mod dot;
mod float16;
mod float32;
pub mod k_quants;
mod q2_k;
mod q3_k;
mod q4_0;
mod q4_1;
mod q4_k;
mod q5_0;
mod q5_1;
mod q5_k;
mod q6_k;
mod q8_0;

use half::f16;

pub use self::bfloat16::Bf16;
pub use self::dot::{LANES, Lanes, Simd, Vector, dot_rows_into};
pub use self::float16::F16;
pub use self::float32::F32;
pub use self::q2_k::{BlockQ2_K, Q2_K};
pub use self::q3_k::{BlockQ3_K, Q3_K};
pub use self::q4_0::{BlockQ4_0, Q4_0};
pub use self::q4_1::{BlockQ4_1, Q4_1};
pub use self::q4_k::{BlockQ4_K, Q4_K};
pub use self::q5_0::{BlockQ5_0, Q5_0};
pub use self::q5_1::{BlockQ5_1, Q5_1};
pub use self::q5_k::{BlockQ5_K, Q5_K};
pub use self::q6_k::{BlockQ6_K, Q6_K};
pub use self::q8_0::{BlockQ8_0, Q8_0};

pub use crate::abi::engine_dtype;
pub use engine_dtype as DType;

/// One weight format. A row is a whole number of blocks, each `BLOCK_VALUES` values stored as
/// `size_of::<Block>()` bytes, little-endian.
pub trait Format {
    /// The C enum value.
    const DTYPE: DType;
    /// The name messages and GGUF use.
    const NAME: &'static str;
    /// ggml's type id in a GGUF tensor info.
    const GGML_TYPE: u32;
    /// The safetensors dtype; None when safetensors has no such dtype.
    const SAFETENSORS: Option<Dtype>;
    /// One block as stored; its size is the block's size in a file.
    type Block;
    const BLOCK_VALUES: usize;
    /// Byte offsets in a block of its f16 scales (and minimums): a file is refused where one is NaN or
    /// infinite. None for the float formats.
    const F16_SCALES: &'static [usize] = &[];

    /// Decodes one block's bytes into `out` (`BLOCK_VALUES` values).
    fn decode_block(block: &[u8], out: &mut [f32]);
    /// Appends `values` (`BLOCK_VALUES` of them) encoded as one block.
    fn encode_block(values: &[f32], out: &mut Vec<u8>);

    /// Multiply-adds `R` rows (their bytes as stored) with `x` into each row's lanes, as `dot` defines
    /// it: every value decoded exactly as `decode_block` decodes it, value c into lane c % LANES, in
    /// column order. The default decodes a block at a time onto the stack; a format overrides it to
    /// decode in registers. Everything it calls must be `#[inline(always)]`.
    ///
    /// # Safety
    /// Inside V's build (see `dot::Vector`).
    #[inline(always)]
    unsafe fn dot_lanes<V: Vector, const R: usize>(rows: [&[u8]; R], x: &[f32], acc: &mut [V; R])
    where
        Self: Sized,
    {
        // SAFETY: the caller runs this inside V's build.
        unsafe { dot::dot_lanes_by_block::<Self, V, R>(rows, x, acc) }
    }
}

/// A format as a value: what [`FORMATS`] lists and [`DType::format`] returns.
#[derive(Debug)]
pub struct FormatInfo {
    pub dtype: DType,
    pub name: &'static str,
    pub ggml_type: u32,
    pub safetensors: Option<Dtype>,
    pub block_values: usize,
    pub block_bytes: usize,
    pub f16_scales: &'static [usize],
    decode_row: fn(&[u8], &mut [f32]),
    encode_row: fn(&[f32], &mut Vec<u8>),
    /// `dot::dot_rows` for one row and for four.
    dot_rows1: fn(Simd, [&[u8]; 1], &[f32]) -> [f32; 1],
    dot_rows4: fn(Simd, [&[u8]; 4], &[f32]) -> [f32; 4],
}

impl FormatInfo {
    const fn of<F: Format>() -> FormatInfo {
        FormatInfo {
            dtype: F::DTYPE,
            name: F::NAME,
            ggml_type: F::GGML_TYPE,
            safetensors: F::SAFETENSORS,
            block_values: F::BLOCK_VALUES,
            block_bytes: size_of::<F::Block>(),
            f16_scales: F::F16_SCALES,
            decode_row: decode_blocks::<F>,
            encode_row: encode_blocks::<F>,
            dot_rows1: dot::dot_rows::<F, 1>,
            dot_rows4: dot::dot_rows::<F, 4>,
        }
    }
}

/// Every format this crate reads, in the C enum's order.
pub static FORMATS: [FormatInfo; 13] = [
    FormatInfo::of::<F32>(),
    FormatInfo::of::<F16>(),
    FormatInfo::of::<Bf16>(),
    FormatInfo::of::<Q8_0>(),
    FormatInfo::of::<Q4_0>(),
    FormatInfo::of::<Q4_1>(),
    FormatInfo::of::<Q5_0>(),
    FormatInfo::of::<Q5_1>(),
    FormatInfo::of::<Q2_K>(),
    FormatInfo::of::<Q3_K>(),
    FormatInfo::of::<Q4_K>(),
    FormatInfo::of::<Q5_K>(),
    FormatInfo::of::<Q6_K>(),
];

/// The largest block any format has, in values (the k-quants' super-block).
pub const MAX_BLOCK_VALUES: usize = k_quants::SUPER_BLOCK;

// Buffers sized by MAX_BLOCK_VALUES hold a block of every format.
const _: () = {
    let mut i = 0;
    while i < FORMATS.len() {
        assert!(FORMATS[i].block_values <= MAX_BLOCK_VALUES, "a format's block exceeds MAX_BLOCK_VALUES");
        i += 1;
    }
};

// DType::format indexes FORMATS by the enum value.
const _: () = {
    let mut i = 0;
    while i < FORMATS.len() {
        assert!(FORMATS[i].dtype as usize == i, "FORMATS is not in the C enum's order");
        i += 1;
    }
};

fn decode_blocks<F: Format>(bytes: &[u8], out: &mut [f32]) {
    for (o, block) in out.chunks_exact_mut(F::BLOCK_VALUES).zip(bytes.chunks_exact(size_of::<F::Block>())) {
        F::decode_block(block, o);
    }
}

fn encode_blocks<F: Format>(values: &[f32], out: &mut Vec<u8>) {
    values.chunks_exact(F::BLOCK_VALUES).for_each(|block| F::encode_block(block, out));
}

impl DType {
    pub fn format(self) -> &'static FormatInfo {
        &FORMATS[self as usize]
    }

    /// Bytes of a row of `cols` values; None when `cols` is not a whole number of blocks.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        let f = self.format();
        cols.is_multiple_of(f.block_values).then(|| cols / f.block_values).and_then(|b| b.checked_mul(f.block_bytes))
    }

    pub fn name(self) -> &'static str {
        self.format().name
    }

    pub fn ggml_type(self) -> u32 {
        self.format().ggml_type
    }

    /// The format named `name` as messages and GGUF spell it ("Q4_K", "BF16"), in any case.
    pub fn from_name(name: &str) -> Option<DType> {
        FORMATS.iter().find(|f| f.name.eq_ignore_ascii_case(name)).map(|f| f.dtype)
    }

    pub fn from_ggml_type(ggml_type: u32) -> Option<DType> {
        FORMATS.iter().find(|f| f.ggml_type == ggml_type).map(|f| f.dtype)
    }

    pub fn from_safetensors(dtype: Dtype) -> Option<DType> {
        FORMATS.iter().find(|f| f.safetensors == Some(dtype)).map(|f| f.dtype)
    }
}

/// The formats' names for messages about one this crate does not read: "F32, F16, BF16, Q8_0, ...".
pub fn supported_names() -> String {
    FORMATS.iter().map(|f| f.name).collect::<Vec<_>>().join(", ")
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
    (dtype.format().decode_row)(bytes, out)
}

/// Encodes f32 values in `dtype` (floats round to nearest even; quantized formats as llama.cpp's
/// reference quantizers do it).
pub fn encode_row(dtype: DType, values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(dtype.row_bytes(values.len()).expect("rows are whole blocks"));
    (dtype.format().encode_row)(values, &mut out);
    out
}

/// The first block of `bytes` (whole blocks of `dtype`) whose f16 scale or minimum is NaN or infinite:
/// its index and that scale's value. Such a block decodes to non-finite values that would reach every
/// logit, so a checkpoint holding one is refused when it is opened.
pub fn first_non_finite_scale(dtype: DType, bytes: &[u8]) -> Option<(usize, f32)> {
    let f = dtype.format();
    if f.f16_scales.is_empty() {
        return None;
    }
    for (i, block) in bytes.chunks_exact(f.block_bytes).enumerate() {
        for &at in f.f16_scales {
            let bits = u16::from_le_bytes([block[at], block[at + 1]]);
            // All exponent bits set: an infinity or a NaN.
            if bits & 0x7C00 == 0x7C00 {
                return Some((i, f16::from_bits(bits).to_f32()));
            }
        }
    }
    None
}

/// A float format: blocks of one value of `$bytes` little-endian bytes, read by `$decode` and written
/// by `$encode` (both on byte arrays); `$lanes` is the `Vector` conversion of LANES values.
macro_rules! float_format {
    ($(#[$doc:meta])* $ty:ident {
        dtype: $dtype:ident, name: $name:literal, ggml_type: $ggml:literal, safetensors: $st:ident,
        bytes: $bytes:literal, decode: $decode:expr, encode: $encode:expr, lanes: $lanes:ident $(,)?
    }) => {
        $(#[$doc])*
        pub struct $ty;

        impl $crate::tensor::Format for $ty {
            const DTYPE: $crate::tensor::DType = $crate::tensor::DType::$dtype;
            const NAME: &'static str = $name;
            const GGML_TYPE: u32 = $ggml;
            const SAFETENSORS: Option<safetensors::Dtype> = Some(safetensors::Dtype::$st);
            type Block = [u8; $bytes];
            const BLOCK_VALUES: usize = 1;

            fn decode_block(block: &[u8], out: &mut [f32]) {
                $crate::tensor::decode_value::<$bytes>(block, out, $decode)
            }

            fn encode_block(values: &[f32], out: &mut Vec<u8>) {
                $crate::tensor::encode_value::<$bytes>(values, out, $encode)
            }

            #[inline(always)]
            unsafe fn dot_lanes<V: $crate::tensor::Vector, const R: usize>(rows: [&[u8]; R], x: &[f32], acc: &mut [V; R]) {
                // SAFETY: the caller runs this inside V's build.
                unsafe {
                    $crate::tensor::dot::dot_lanes_of_values::<$bytes, { $bytes * $crate::tensor::LANES }, V, R>(
                        rows, x, acc, V::$lanes, $decode,
                    )
                }
            }
        }
    };
}
use float_format;

/// The little-endian f16 at byte `at` of a block, as f32.
fn f16_at(block: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([block[at], block[at + 1]]).to_f32()
}

/// `v` rounded to f16 (nearest even), as little-endian bytes.
fn f16_le(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

/// `v` as it reads back after a round trip through f16: what a decoder sees of a stored scale.
fn f16_round(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// The value of largest magnitude, its sign kept (the first of equal magnitudes; 0 when all are zero).
fn signed_absmax(values: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in values {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// The smallest and largest value, starting from (f32::MAX, -f32::MAX) as llama.cpp does.
fn min_max(values: &[f32]) -> (f32, f32) {
    values.iter().fold((f32::MAX, -f32::MAX), |(lo, hi), &v| (if v < lo { v } else { lo }, if v > hi { v } else { hi }))
}

fn decode_value<const N: usize>(block: &[u8], out: &mut [f32], from_le: fn([u8; N]) -> f32) {
    out[0] = from_le(block.try_into().expect("one value's bytes"));
}

fn encode_value<const N: usize>(values: &[f32], out: &mut Vec<u8>, to_le: fn(f32) -> [u8; N]) {
    out.extend_from_slice(&to_le(values[0]));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_bytes_refuses_partial_q8_0_blocks() {
        assert_eq!(DType::Q8_0.row_bytes(Q8_0::BLOCK_VALUES + 1), None);
        assert_eq!(DType::Bf16.row_bytes(5120), Some(10240));
    }

    #[test]
    fn every_format_is_found_by_each_of_its_ids() {
        for f in &FORMATS {
            assert_eq!(f.dtype.format().name, f.name);
            assert_eq!(DType::from_ggml_type(f.ggml_type), Some(f.dtype));
            assert_eq!(DType::from_name(&f.name.to_lowercase()), Some(f.dtype));
            if let Some(st) = f.safetensors {
                assert_eq!(DType::from_safetensors(st), Some(f.dtype));
            }
        }
        assert_eq!(supported_names(), "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K");
    }

    /// Root-mean-square error of a round trip over rms(x), for uniform values in [-1, 1) with an offset.
    fn relative_rms_error(dtype: DType, offset: f32) -> f64 {
        let n = 4 * MAX_BLOCK_VALUES;
        let values: Vec<f32> =
            (0..n).map(|i| ((i as u64 * 2_654_435_761 % 1000) as f32 / 500.0 - 1.0) + offset).collect();
        let mut back = vec![0f32; n];
        decode_row(dtype, &encode_row(dtype, &values), &mut back);
        let err: f64 = values.iter().zip(&back).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
        let norm: f64 = values.iter().map(|a| (*a as f64).powi(2)).sum();
        (err / norm).sqrt()
    }

    #[test]
    fn quantized_rows_round_trip_within_their_bits() {
        // Uniform values: the error of b bits is about 2^-b of the range, times a margin.
        let bounds = [
            (DType::Q8_0, 0.006),
            (DType::Q6_K, 0.02),
            (DType::Q5_0, 0.04),
            (DType::Q5_1, 0.04),
            (DType::Q5_K, 0.04),
            (DType::Q4_0, 0.08),
            (DType::Q4_1, 0.08),
            (DType::Q4_K, 0.08),
            (DType::Q3_K, 0.18),
            (DType::Q2_K, 0.4),
        ];
        for (dtype, bound) in bounds {
            for offset in [0.0, 0.5] {
                let e = relative_rms_error(dtype, offset);
                assert!(e < bound, "{} offset {offset}: relative error {e}", dtype.name());
            }
        }
    }

    #[test]
    fn zero_rows_decode_to_zero() {
        for f in &FORMATS {
            let zeros = vec![0f32; 2 * MAX_BLOCK_VALUES];
            let bytes = encode_row(f.dtype, &zeros);
            assert_eq!(bytes.len(), f.dtype.row_bytes(zeros.len()).unwrap(), "{}", f.name);
            let mut back = vec![1f32; zeros.len()];
            decode_row(f.dtype, &bytes, &mut back);
            assert!(back.iter().all(|v| *v == 0.0), "{}", f.name);
        }
    }

    /// NaN, infinities, f32's extremes and subnormals: every encoder writes whole blocks and never
    /// panics, and every decoder reads them back.
    #[test]
    fn encoders_take_any_f32() {
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN, 1e-40, -0.0, 3e38, 1.0];
        for f in &FORMATS {
            for (k, special) in specials.iter().enumerate() {
                let mut values: Vec<f32> = (0..MAX_BLOCK_VALUES).map(|i| (i as f32 - 100.0) / 64.0).collect();
                values.iter_mut().skip(k).step_by(7).for_each(|v| *v = *special);
                let bytes = encode_row(f.dtype, &values);
                assert_eq!(Some(bytes.len()), f.dtype.row_bytes(values.len()), "{}", f.name);
                let mut back = vec![0f32; values.len()];
                decode_row(f.dtype, &bytes, &mut back);
            }
        }
    }

    /// Every scale and minimum of every block format is checked, at whichever block it stands; finite
    /// extremes (f16's largest, a subnormal, negative zero) pass.
    #[test]
    fn non_finite_scales_are_found_in_every_block_format() {
        let blocks = 5;
        for f in FORMATS.iter().filter(|f| !f.f16_scales.is_empty()) {
            let values: Vec<f32> =
                (0..blocks * f.block_values).map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0).collect();
            let clean = encode_row(f.dtype, &values);
            assert_eq!(first_non_finite_scale(f.dtype, &clean), None, "{}", f.name);
            for &at in f.f16_scales {
                for finite in [0x7BFFu16, 0xFBFF, 0x0001, 0x8000, 0x0000] {
                    let mut bytes = clean.clone();
                    bytes[3 * f.block_bytes + at..][..2].copy_from_slice(&finite.to_le_bytes());
                    assert_eq!(first_non_finite_scale(f.dtype, &bytes), None, "{} {finite:#06x} at {at}", f.name);
                }
                for (bad, block) in [(0x7C00u16, 0), (0xFC00, 2), (0x7E00, 4), (0xFD01, 1)] {
                    let mut bytes = clean.clone();
                    bytes[block * f.block_bytes + at..][..2].copy_from_slice(&bad.to_le_bytes());
                    let (found, value) = first_non_finite_scale(f.dtype, &bytes)
                        .unwrap_or_else(|| panic!("{}: {bad:#06x} at byte {at} of block {block} not found", f.name));
                    assert_eq!(found, block, "{} {bad:#06x} at {at}", f.name);
                    assert!(!value.is_finite(), "{} {bad:#06x}: {value}", f.name);
                }
            }
        }
        assert_eq!(first_non_finite_scale(DType::F16, &[0x00, 0x7C]), None, "float formats carry no scales");
    }

    #[test]
    fn float_rows_round_trip_exactly_when_representable() {
        let values = [0.0f32, 1.5, -2.25, 1024.0, -0.125];
        for dtype in [DType::F32, DType::F16, DType::Bf16] {
            let mut back = [0f32; 5];
            decode_row(dtype, &encode_row(dtype, &values), &mut back);
            assert_eq!(back, values, "{}", dtype.name());
        }
    }
}
