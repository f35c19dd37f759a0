use half::f16;

use super::float_format;

float_format! {
    /// IEEE binary16, little-endian; encoded with round to nearest even.
    F16 { dtype: F16, name: "F16", ggml_type: 1, safetensors: F16, bytes: 2,
          decode: |b| f16::from_le_bytes(b).to_f32(), encode: |v| f16::from_f32(v).to_le_bytes() }
}
