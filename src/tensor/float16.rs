use half::f16;

use super::dot::f16_bits_to_f32;
use super::float_format;

float_format! {
    /// IEEE binary16, little-endian; encoded with round to nearest even, decoded with no branch so that
    /// a row of them vectorizes.
    F16 { dtype: F16, name: "F16", ggml_type: 1, safetensors: F16, bytes: 2,
          decode: |b| f16_bits_to_f32(u16::from_le_bytes(b)), encode: |v| f16::from_f32(v).to_le_bytes(),
          lanes: from_f16_bytes }
}
