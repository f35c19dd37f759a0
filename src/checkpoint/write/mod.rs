//! Deterministic checkpoint writers, for tests, the tiny demo model and benchmarks: HF folders
//! (config.json + safetensors, optionally sharded) and GGUF files as llama.cpp's converter lays them out
//! (names, keys, Q/K row permutation for llama, `rope_freqs.weight` for Llama 3 scaling).
//!
//! `synthetic_weights` fills a model with values from a fixed formula that scripts/hf_reference.py
//! reproduces with numpy; the `write_synthetic_*` variants generate each tensor straight into the file.
//!
//! `synthetic` makes the weights and holds them in memory, `hf` writes HF folders and `gguf` GGUF
//! files; what they share is here.

mod gguf;
mod hf;
mod synthetic;

pub use self::gguf::{
    Fill, gguf_metadata, permute_qk_rows, unpermute_qk_rows, write_generated_gguf, write_gguf, write_gguf_dequantized,
    write_gguf_experts_apart, write_synthetic_gguf, write_synthetic_gguf_kv,
};
pub use self::hf::{hf_config_json, write_hf_folder, write_synthetic_hf};
pub use self::synthetic::{MemSource, Recipe, random_matrix, synthetic_dtype, synthetic_element, synthetic_weights};
pub use super::gguf::GgufValue;

use std::path::Path;

use crate::model::{shape_cols, shape_rows};
use crate::status::Result;
use crate::tensor::{DType, encode_row};
use crate::{bail, err};

/// A tensor held in memory, under its canonical name, in its stored format.
#[derive(Clone, Debug, PartialEq)]
pub struct OwnedTensor {
    pub name: String,
    pub dtype: DType,
    /// Outermost first.
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl OwnedTensor {
    /// Encodes `values` (row-major over `shape`) in `dtype`.
    pub fn from_f32(name: &str, dtype: DType, shape: &[usize], values: &[f32]) -> Result<OwnedTensor> {
        let cols = shape_cols(shape);
        if values.len() != shape.iter().product::<usize>() || dtype.row_bytes(cols).is_none() {
            bail!(InvalidArgument, "tensor {name}: {} values do not fill {shape:?} in {}", values.len(), dtype.name());
        }
        let data =
            if cols == 0 { Vec::new() } else { values.chunks(cols).flat_map(|r| encode_row(dtype, r)).collect() };
        Ok(OwnedTensor { name: name.to_string(), dtype, shape: shape.to_vec(), data })
    }

    /// The values decoded to f32, row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        crate::model::TensorRef { dtype: self.dtype, shape: &self.shape, bytes: &self.data }.to_f32()
    }

    fn check(&self) -> Result<()> {
        match stored_bytes(self.dtype, &self.shape) {
            Some(n) if n == self.data.len() => Ok(()),
            Some(expected) => bail!(
                InvalidArgument,
                "tensor {}: {} bytes, but {:?} of {} needs {expected}",
                self.name,
                self.data.len(),
                self.shape,
                self.dtype.name()
            ),
            None => bail!(
                InvalidArgument,
                "tensor {}: {:?} rows are not whole {} blocks",
                self.name,
                self.shape,
                self.dtype.name()
            ),
        }
    }
}

/// Bytes of a tensor of `shape` in `dtype`; None when its rows are not whole blocks of it.
pub fn stored_bytes(dtype: DType, shape: &[usize]) -> Option<usize> {
    dtype.row_bytes(shape_cols(shape))?.checked_mul(shape_rows(shape))
}

// ---------------------------------------------------------------------------------------------------
// The synthetic weight formula.

pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xCBF2_9CE4_8422_2325, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01B3))
}

fn io_error(path: &Path, e: impl std::fmt::Display) -> crate::status::Error {
    err!(IoError, "{}: {e}", path.display())
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| io_error(path, e))
}
