//! KV cache types: the formats a stream's K and V rows are kept in, their bytes, and the one rounding
//! each applies when a position is written. Both backends round with the functions here (the kernels in
//! `kernels/rope.cu` follow them operation for operation), so the CPU backend stays the oracle for every
//! type: what attention reads is the same values on both.
//!
//! - BF16, F16, F32: each value rounded to nearest even (F32 keeps it).
//! - Q8_0: blocks of 32 consecutive values of one head's row, as GGUF's Q8_0 (`tensor::Q8_0`'s encoder:
//!   scale = max|x| / 127 stored as f16, each value x / scale rounded half away from zero to an int8).
//! - FP8_E4M3: the same blocks of 32, each with a bf16 scale s = max|x| / 448 (E4M3's largest finite
//!   value) rounded to nearest even, and each x / s rounded to E4M3 (nearest even, saturating at ±448,
//!   NaN kept as NaN); a value decodes as s x E4M3 value, exact in f32. The scale is bf16, not f16: an f16
//!   scale goes subnormal (and loses bits) for blocks under 448 x 2^-14, about 0.03, which K and V rows
//!   reach; bf16's 8 bits are still 5 more than the codes carry. A block whose s is below f32's smallest
//!   normal (max|x| under about 448 x 2^-126) stores zeros.
//!
//! A block never crosses a head, so the block types need head_dim a multiple of 32 (UNSUPPORTED
//! otherwise, on every backend). A non-finite value poisons its Q8_0 block as llama.cpp's quantizer does
//! (an infinity makes the block NaN, a NaN reads as 0); in FP8 a NaN stays a NaN and an infinity makes the
//! block NaN.

use half::{bf16, f16};

use crate::abi::engine_kv_type;
use crate::model::ModelConfig;
use crate::status::Result;
use crate::tensor::dot::bf16_bits_to_f32;
use crate::tensor::{DType, Format, Q8_0, decode_row};

/// Values of one block of the block types (Q8_0, FP8_E4M3).
pub const BLOCK_VALUES: usize = 32;
/// Bytes of one block in the CPU backend's rows: the scale (f16 for Q8_0, bf16 for FP8_E4M3), then 32
/// one-byte codes (GGUF's layout).
pub const BLOCK_BYTES: usize = 2 + BLOCK_VALUES;
/// E4M3's largest finite value: an FP8 block's scale maps max|x| onto it.
pub const E4M3_MAX: f32 = 448.0;

/// A KV cache type in use (the engine resolves `ENGINE_KV_DEFAULT` to one). The values are
/// `engine_kv_type`'s and the kernels' `HE_KV_*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum KvType {
    Bf16 = 1,
    F16 = 2,
    F32 = 3,
    Q8_0 = 4,
    Fp8E4m3 = 5,
}

impl KvType {
    pub const ALL: [KvType; 5] = [KvType::Bf16, KvType::F16, KvType::F32, KvType::Q8_0, KvType::Fp8E4m3];

    /// The type a C value names; None for `ENGINE_KV_DEFAULT`, which the backend decides.
    pub fn from_c(t: engine_kv_type) -> Option<KvType> {
        match t {
            engine_kv_type::ENGINE_KV_DEFAULT => None,
            engine_kv_type::ENGINE_KV_BF16 => Some(KvType::Bf16),
            engine_kv_type::ENGINE_KV_F16 => Some(KvType::F16),
            engine_kv_type::ENGINE_KV_F32 => Some(KvType::F32),
            engine_kv_type::ENGINE_KV_Q8_0 => Some(KvType::Q8_0),
            engine_kv_type::ENGINE_KV_FP8_E4M3 => Some(KvType::Fp8E4m3),
        }
    }

    pub fn to_c(self) -> engine_kv_type {
        match self {
            KvType::Bf16 => engine_kv_type::ENGINE_KV_BF16,
            KvType::F16 => engine_kv_type::ENGINE_KV_F16,
            KvType::F32 => engine_kv_type::ENGINE_KV_F32,
            KvType::Q8_0 => engine_kv_type::ENGINE_KV_Q8_0,
            KvType::Fp8E4m3 => engine_kv_type::ENGINE_KV_FP8_E4M3,
        }
    }

    /// The name in messages and log lines.
    pub fn name(self) -> &'static str {
        match self {
            KvType::Bf16 => "BF16",
            KvType::F16 => "F16",
            KvType::F32 => "F32",
            KvType::Q8_0 => "Q8_0",
            KvType::Fp8E4m3 => "FP8_E4M3",
        }
    }

    /// The type a command-line name gives (any case; "fp8" for FP8_E4M3, "default" is None).
    pub fn parse(name: &str) -> Option<Option<KvType>> {
        let lower = name.to_ascii_lowercase();
        if lower == "default" {
            return Some(None);
        }
        if lower == "fp8" {
            return Some(Some(KvType::Fp8E4m3));
        }
        KvType::ALL.into_iter().find(|t| t.name().eq_ignore_ascii_case(&lower)).map(Some)
    }

    /// Whether values are stored in blocks of 32 with a scale.
    pub fn is_block(self) -> bool {
        matches!(self, KvType::Q8_0 | KvType::Fp8E4m3)
    }

    /// Bytes one head's row of `head_dim` values takes at one position, scales included.
    pub fn row_bytes(self, head_dim: usize) -> usize {
        match self {
            KvType::Bf16 | KvType::F16 => 2 * head_dim,
            KvType::F32 => 4 * head_dim,
            KvType::Q8_0 | KvType::Fp8E4m3 => head_dim / BLOCK_VALUES * BLOCK_BYTES,
        }
    }

    /// UNSUPPORTED when a head of `head_dim` values is not whole blocks of this type.
    pub fn check(self, head_dim: usize, field: &str) -> Result<()> {
        if self.is_block() && (head_dim == 0 || !head_dim.is_multiple_of(BLOCK_VALUES)) {
            crate::bail!(
                Unsupported,
                "{field} is {}, which stores blocks of {BLOCK_VALUES} values of a head; the model's head_dim {head_dim} is not a multiple of {BLOCK_VALUES}",
                self.name()
            );
        }
        Ok(())
    }

    /// One head's row of values in this type, as the CPU backend lays it out (`row_bytes` bytes into
    /// `out`; the block types as GGUF blocks: the scale, then the 32 codes).
    pub fn encode(self, values: &[f32], out: &mut [u8]) {
        assert_eq!(out.len(), self.row_bytes(values.len()), "kv encode: output is not one row");
        match self {
            KvType::Bf16 => {
                for (o, &v) in out.as_chunks_mut::<2>().0.iter_mut().zip(values) {
                    *o = bf16::from_f32(v).to_le_bytes();
                }
            }
            KvType::F16 => {
                for (o, &v) in out.as_chunks_mut::<2>().0.iter_mut().zip(values) {
                    *o = f16::from_f32(v).to_le_bytes();
                }
            }
            KvType::F32 => {
                for (o, &v) in out.as_chunks_mut::<4>().0.iter_mut().zip(values) {
                    *o = v.to_le_bytes();
                }
            }
            KvType::Q8_0 => {
                let mut block = Vec::with_capacity(BLOCK_BYTES);
                for (v, o) in values.chunks_exact(BLOCK_VALUES).zip(out.chunks_exact_mut(BLOCK_BYTES)) {
                    block.clear();
                    Q8_0::encode_block(v, &mut block);
                    o.copy_from_slice(&block);
                }
            }
            KvType::Fp8E4m3 => {
                for (v, o) in values.chunks_exact(BLOCK_VALUES).zip(out.chunks_exact_mut(BLOCK_BYTES)) {
                    let (scale, codes) = fp8_block(v);
                    o[..2].copy_from_slice(&scale.to_le_bytes());
                    for (c, code) in o[2..].iter_mut().zip(codes) {
                        *c = code;
                    }
                }
            }
        }
    }

    /// The values of one head's row `encode` wrote.
    pub fn decode(self, bytes: &[u8], out: &mut [f32]) {
        assert_eq!(bytes.len(), self.row_bytes(out.len()), "kv decode: input is not one row");
        match self {
            KvType::Bf16 | KvType::F16 | KvType::F32 | KvType::Q8_0 => decode_row(self.dtype(), bytes, out),
            KvType::Fp8E4m3 => {
                for (b, o) in bytes.chunks_exact(BLOCK_BYTES).zip(out.chunks_exact_mut(BLOCK_VALUES)) {
                    let scale = bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
                    for (&code, v) in b[2..].iter().zip(o) {
                        *v = scale * e4m3_value(code);
                    }
                }
            }
        }
    }

    /// `values` (whole heads of `head_dim`) as this type stores them, read back.
    pub fn round(self, values: &[f32], head_dim: usize) -> Vec<f32> {
        let mut bytes = vec![0u8; self.row_bytes(head_dim)];
        let mut out = vec![0f32; values.len()];
        for (head, o) in values.chunks_exact(head_dim).zip(out.chunks_exact_mut(head_dim)) {
            self.encode(head, &mut bytes);
            self.decode(&bytes, o);
        }
        out
    }

    /// The weight format whose rows this type's CPU rows are (FP8_E4M3 has none).
    fn dtype(self) -> DType {
        match self {
            KvType::Bf16 => DType::Bf16,
            KvType::F16 => DType::F16,
            KvType::F32 | KvType::Fp8E4m3 => DType::F32,
            KvType::Q8_0 => DType::Q8_0,
        }
    }
}

/// An FP8 block: its bf16 scale's bits and its 32 E4M3 codes: max|x| from 0, ignoring NaN (as
/// `Q8_0::encode_block`); s = bf16(max|x| / 448); each code E4M3(x x 1/s), with 1/s taken as 0 where s
/// is not a normal number (a block of zeros, or of values too small for a finite 1/s).
pub fn fp8_block(values: &[f32]) -> (u16, [u8; BLOCK_VALUES]) {
    assert_eq!(values.len(), BLOCK_VALUES, "an FP8 block is {BLOCK_VALUES} values");
    let amax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = bf16::from_f32(amax / E4M3_MAX);
    let s = scale.to_f32();
    let inv = if s >= f32::MIN_POSITIVE { 1.0 / s } else { 0.0 };
    let mut codes = [0u8; BLOCK_VALUES];
    for (c, &v) in codes.iter_mut().zip(values) {
        *c = e4m3_from_f32(v * inv);
    }
    (scale.to_bits(), codes)
}

/// `x` rounded to E4M3 (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities, NaN is
/// S.1111.111): to nearest, ties to even; magnitudes from 448 up, infinities included, saturate to ±448;
/// NaN gives 0x7F with x's sign.
pub fn e4m3_from_f32(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    if x.is_nan() {
        return sign | 0x7F;
    }
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    // Below 2^-6 the subnormal steps are 2^-9: a * 2^9 rounded is the code (8 is 2^-6, the first normal).
    if a < 1.0 / 64.0 {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // a in [2^e, 2^(e+1)), e in -6..=8: a * 2^(3-e) in [8, 16) rounded is 8 + the mantissa (16 carries
    // into the next exponent, which the sum below does by itself). Scaling by a power of two is exact.
    let e = ((a.to_bits() >> 23) as i32) - 127;
    let steps = (a * f32::from_bits(((127 + 3 - e) as u32) << 23)).round_ties_even() as i32;
    sign | (((e + 7) << 3) + steps - 8) as u8
}

/// The value of an E4M3 code (NaN for S.1111.111).
pub const fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((code >> 3) & 0xF, code & 7);
    if e == 0xF && m == 7 {
        return f32::NAN.copysign(sign);
    }
    let magnitude =
        if e == 0 { m as f32 / 512.0 } else { (8 + m) as f32 * f32::from_bits(((e as i32 - 10 + 127) as u32) << 23) };
    sign * magnitude
}

/// `e4m3_to_f32` of every code, for the readers' inner loops.
const E4M3_VALUES: [f32; 256] = {
    let mut table = [0f32; 256];
    let mut code = 0;
    while code < 256 {
        table[code] = e4m3_to_f32(code as u8);
        code += 1;
    }
    table
};

/// `e4m3_to_f32(code)`, from the table.
#[inline(always)]
pub fn e4m3_value(code: u8) -> f32 {
    E4M3_VALUES[code as usize]
}

/// The types of one engine's K and V caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvTypes {
    pub k: KvType,
    pub v: KvType,
}

impl KvTypes {
    /// What the CUDA backend keeps when the options leave both at ENGINE_KV_DEFAULT.
    pub const GPU_DEFAULT: KvTypes = KvTypes { k: KvType::Bf16, v: KvType::Bf16 };
    /// What the CPU backend keeps by default: its f32 reference cache.
    pub const CPU_DEFAULT: KvTypes = KvTypes { k: KvType::F32, v: KvType::F32 };

    pub fn same(t: KvType) -> KvTypes {
        KvTypes { k: t, v: t }
    }

    /// The options' types, each ENGINE_KV_DEFAULT taking the backend's `default`.
    pub fn resolve(k: engine_kv_type, v: engine_kv_type, default: KvTypes) -> KvTypes {
        KvTypes { k: KvType::from_c(k).unwrap_or(default.k), v: KvType::from_c(v).unwrap_or(default.v) }
    }

    /// UNSUPPORTED when either type cannot hold the model's heads.
    pub fn check(&self, cfg: &ModelConfig) -> Result<()> {
        self.k.check(cfg.head_dim, "options.kv_type_k")?;
        self.v.check(cfg.head_dim, "options.kv_type_v")
    }

    /// UNSUPPORTED when the CUDA device (compute capability `major`.`minor`, named `device`) cannot
    /// run these types: FP8 E4M3 wants 8.9 (Ada) or newer.
    pub fn check_device(&self, major: i32, minor: i32, device: &str) -> Result<()> {
        for (t, field) in [(self.k, "options.kv_type_k"), (self.v, "options.kv_type_v")] {
            if t == KvType::Fp8E4m3 && (major, minor) < (8, 9) {
                crate::bail!(
                    Unsupported,
                    "{field} is FP8_E4M3, which needs a CUDA device of compute capability 8.9 or newer; {device} is {major}.{minor}"
                );
            }
        }
        Ok(())
    }

    /// Bytes of K and V one position takes in every layer: the stream's growth per token.
    pub fn bytes_per_token(&self, cfg: &ModelConfig) -> u64 {
        (cfg.layers * cfg.kv_heads * (self.k.row_bytes(cfg.head_dim) + self.v.row_bytes(cfg.head_dim))) as u64
    }

    /// "BF16", or "K Q8_0, V F16" when they differ, for log lines.
    pub fn describe(&self) -> String {
        if self.k == self.v { self.k.name().to_string() } else { format!("K {}, V {}", self.k.name(), self.v.name()) }
    }
}
