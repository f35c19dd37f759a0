//! IEEE binary16, little-endian; encoded with round to nearest even.

use half::f16;

use super::{DType, Dtype, Format, decode_value, encode_value};

pub struct F16;

impl Format for F16 {
    const DTYPE: DType = DType::F16;
    const NAME: &'static str = "F16";
    const GGML_TYPE: u32 = 1;
    const SAFETENSORS: Option<Dtype> = Some(Dtype::F16);
    type Block = [u8; 2];
    const BLOCK_VALUES: usize = 1;

    fn decode_block(block: &[u8], out: &mut [f32]) {
        decode_value(block, out, |b| f16::from_le_bytes(b).to_f32())
    }

    fn encode_block(values: &[f32], out: &mut Vec<u8>) {
        encode_value(values, out, |v| f16::from_f32(v).to_le_bytes())
    }
}
