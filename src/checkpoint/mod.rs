//! (in progress)
pub mod gguf;
pub mod safetensors;
pub mod write;
