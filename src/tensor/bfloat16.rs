use half::bf16;

use super::dot::bf16_bits_to_f32;
use super::float_format;

float_format! {
    /// bfloat16 (the top half of an f32), little-endian; encoded with round to nearest even, decoded by
    /// a shift (NaN payloads kept as they are) so that a row of them vectorizes.
    Bf16 { dtype: Bf16, name: "BF16", ggml_type: 30, safetensors: BF16, bytes: 2,
           decode: |b| bf16_bits_to_f32(u16::from_le_bytes(b)), encode: |v| bf16::from_f32(v).to_le_bytes(),
           lanes: from_bf16_bytes }
}
