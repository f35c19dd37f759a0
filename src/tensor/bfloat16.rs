//! bfloat16 (the top half of an f32), little-endian; encoded with round to nearest even.

use half::bf16;

use super::{DType, Dtype, Format, decode_value, encode_value};

pub struct Bf16;

impl Format for Bf16 {
    const DTYPE: DType = DType::Bf16;
    const NAME: &'static str = "BF16";
    const GGML_TYPE: u32 = 30;
    const SAFETENSORS: Option<Dtype> = Some(Dtype::BF16);
    type Block = [u8; 2];
    const BLOCK_VALUES: usize = 1;

    fn decode_block(block: &[u8], out: &mut [f32]) {
        decode_value(block, out, |b| bf16::from_le_bytes(b).to_f32())
    }

    fn encode_block(values: &[f32], out: &mut Vec<u8>) {
        encode_value(values, out, |v| bf16::from_f32(v).to_le_bytes())
    }
}
