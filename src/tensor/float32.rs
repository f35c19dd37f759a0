use super::float_format;

float_format! {
    /// IEEE binary32, little-endian.
    F32 { dtype: F32, name: "F32", ggml_type: 0, safetensors: F32, bytes: 4,
          decode: f32::from_le_bytes, encode: f32::to_le_bytes, lanes: from_f32_bytes }
}
