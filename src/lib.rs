//! hostembed: embedding rows in GPU-mapped host memory when the card has no room for them, and a
//! dense decode engine around them, behind a C ABI (include/hostembed.h).

pub mod status;
pub mod tensor;
pub mod model;
pub mod cudart;
pub mod kernels;
pub mod cuda;
pub mod ffi;

pub use status::{Error, Result, Status};
