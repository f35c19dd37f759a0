//! hostembed: embedding rows in GPU-mapped host memory when the card has no room for them, and a
//! dense decode engine around them, behind a C ABI (include/hostembed.h).

pub mod status;
pub mod tensor;
pub mod model;
pub mod cudart;
pub mod kernels;
pub mod cuda;
pub mod fit;
pub mod checkpoint;
pub mod placement;
pub mod cpu;
pub mod sampler;
pub mod gpu;
pub mod tokenizer;
pub mod engine;
pub mod ffi;

pub use status::{Error, Result, Status};
