//! GGUF (v2/v3, little-endian, one file): a strict parse of the header, metadata and tensor infos, and
//! the mapping of llama.cpp's tensor names and `{arch}.*` keys onto the canonical model.
//!
//! Every count and length is checked against the bytes left in the file before anything is allocated
//! or read, so a hostile file gets `BAD_MODEL` naming the key or tensor at fault, never a panic.
//!
//! `parse` reads the file's structure, `names` maps llama.cpp's tensor names to the canonical ones,
//! and `open` turns a parsed file into a `Checkpoint`.

mod names;
mod open;
mod parse;

pub use self::names::{
    EXPERT_STACKS, canonical_name, canonical_name_in, expert_stack_name, expert_stack_of, expert_tensor_name,
    expert_tensor_name_of, gguf_name, gguf_name_in,
};
pub use self::open::open_file;
#[cfg(feature = "fixtures")]
pub(crate) use self::parse::put_string;
pub use self::parse::{GgufFile, GgufTensor, GgufValue, parse};

pub const MAGIC: &[u8; 4] = b"GGUF";
pub const VERSION: u32 = 3;
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// A GGUF tensor has at most this many dimensions (ggml's limit).
pub const MAX_DIMS: usize = 4;

/// Keys this crate writes for Llama 3 rope scaling, which GGUF has no keys for (llama.cpp's converter
/// writes a `rope_freqs.weight` tensor instead; both are written, and the reader checks they agree).
pub const KEY_LLAMA3_FACTOR: &str = "hostembed.rope.llama3.factor";
pub const KEY_LLAMA3_LOW: &str = "hostembed.rope.llama3.low_freq_factor";
pub const KEY_LLAMA3_HIGH: &str = "hostembed.rope.llama3.high_freq_factor";
pub const KEY_LLAMA3_ORIGINAL: &str = "hostembed.rope.llama3.original_context_length";
