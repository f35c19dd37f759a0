use half::bf16;

use super::float_format;

float_format! {
    /// bfloat16 (the top half of an f32), little-endian; encoded with round to nearest even.
    Bf16 { dtype: Bf16, name: "BF16", ggml_type: 30, safetensors: BF16, bytes: 2,
           decode: |b| bf16::from_le_bytes(b).to_f32(), encode: |v| bf16::from_f32(v).to_le_bytes() }
}
