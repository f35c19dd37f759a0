//! hostembed: embedding rows in GPU-mapped host memory when the card has no room for them, and a
//! dense decode engine around them, behind a C ABI (include/hostembed.h).

// Every unsafe block and unsafe impl says why it is sound in a `// SAFETY:` comment above it.
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod abi;
pub mod arch;
pub mod backend;
pub mod checkpoint;
pub mod constraint;
pub mod cpu;
pub mod cuda;
pub mod cudart;
pub mod engine;
pub mod ffi;
pub mod fit;
pub mod gpu;
pub mod hostmem;
pub mod kernels;
pub mod kv;
pub mod model;
pub mod placement;
pub mod sampler;
pub mod shard;
pub mod speculative;
pub mod status;
pub mod tensor;
pub mod tokenizer;
pub mod tuning;

pub use status::{Error, Result, Status};
