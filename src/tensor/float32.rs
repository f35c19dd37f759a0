//! IEEE binary32, little-endian.

use super::{DType, Dtype, Format, decode_value, encode_value};

pub struct F32;

impl Format for F32 {
    const DTYPE: DType = DType::F32;
    const NAME: &'static str = "F32";
    const GGML_TYPE: u32 = 0;
    const SAFETENSORS: Option<Dtype> = Some(Dtype::F32);
    type Block = [u8; 4];
    const BLOCK_VALUES: usize = 1;

    fn decode_block(block: &[u8], out: &mut [f32]) {
        decode_value(block, out, f32::from_le_bytes)
    }

    fn encode_block(values: &[f32], out: &mut Vec<u8>) {
        encode_value(values, out, f32::to_le_bytes)
    }
}
