//! Every type and constant C callers see, in one module that cbindgen reads beside the functions of
//! `ffi`. The modules that work with these types import them from here; nothing here has behaviour
//! beyond reading raw enum values C passed.
#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_void};

use crate::tensor::engine_dtype;

/// The ABI this header describes; a caller compares it with `engine_abi_version()`.
pub const HOSTEMBED_ABI_VERSION: u32 = 1;

// ---------------------------------------------------------------------------------------------
// Fit

/// The default reserve for the load's other buffers (kernel modules, the kit): about 85 MB measured.
pub const ENGINE_FIT_DEFAULT_RESERVE_BYTES: u64 = 256 << 20;

/// Where the embedding rows live.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum engine_placement {
    /// On the card, like every other weight.
    Device = 0,
    /// In pinned, device-mapped host memory the kernels read directly.
    HostMapped = 1,
    /// Read from the checkpoint's file mapping (registered with CUDA, or pageable on unified systems).
    FileMapped = 2,
}

impl engine_placement {
    /// The placement a C caller stored as a raw enum value, or None when it names none.
    pub fn from_raw(raw: u32) -> Option<engine_placement> {
        match raw {
            0 => Some(engine_placement::Device),
            1 => Some(engine_placement::HostMapped),
            2 => Some(engine_placement::FileMapped),
            _ => None,
        }
    }
}

/// The figures the rule decides on, in bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct engine_fit_inputs {
    /// Free device memory: the server's room probe.
    pub room_bytes: u64,
    /// All weights on the card with the rows on the card (rows included).
    pub weight_bytes: u64,
    /// The embedding rows alone.
    pub embed_bytes: u64,
    /// Activations and other per-engine buffers.
    pub scratch_bytes: u64,
    /// One stream (KV cache and state) at the asked window.
    pub stream_bytes: u64,
    /// Growth of one stream per token of window; 0 = unknown.
    pub stream_bytes_per_token: u64,
    /// A speculative drafter's weights, 0 = none.
    pub drafter_weight_bytes: u64,
    /// One drafter stream: ring, taps, frame scratch.
    pub drafter_stream_bytes: u64,
    /// The load's other buffers; default 256 MiB.
    pub reserve_bytes: u64,
    /// The asked window, tokens.
    pub window: u32,
    /// 0 = no cap.
    pub max_streams: u32,
    /// Host and device share memory (GB10 class).
    pub unified: bool,
    /// The output head is the embedding table.
    pub embed_tied: bool,
    /// Read rows from the checkpoint's file mapping.
    pub mmap_rows: bool,
}

/// What the rule decided for the asked window, and the largest windows it would accept.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct engine_plan {
    /// Where the embedding rows live.
    pub placement: engine_placement,
    /// Streams that start at the asked window; 0 = the engine refuses to start.
    pub streams: u32,
    /// The asked window, tokens.
    pub window: u32,
    /// What the rule compared with the room: weights, scratch, one stream, the drafter's, the reserve.
    pub need_bytes: u64,
    /// What the load puts on the card: weights (less the rows in host memory), scratch, drafter weights.
    pub on_card_bytes: u64,
    /// Room left for streams after the load (0 when the load alone does not fit).
    pub left_bytes: u64,
    /// One stream including the drafter's.
    pub stream_bytes: u64,
    /// Embedding rows held in host memory (0 when they are on the card).
    pub embed_host_bytes: u64,
    /// Largest window at which the rows stay on the card and one stream starts; 0 = none or unknown.
    pub max_window_on_card: u32,
    /// Largest window at which the engine starts at all; 0 = none or unknown (stream_bytes_per_token 0).
    pub max_window: u32,
    /// The placement the rule picks at `max_window` (the asked window's when `max_window` is 0).
    pub max_window_placement: engine_placement,
    /// Largest window at which one stream fits beside every weight on the card without the reserve,
    /// i.e. where an engine that never maps starts; windows above `max_window_on_card` up to this one
    /// are those the reserve maps. 0 = none or unknown.
    pub max_window_unmapped: u32,
}

// ---------------------------------------------------------------------------------------------
// Device and rows

/// What the placements decide on, read from the device.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct engine_device_info {
    /// NUL-terminated device name.
    pub name: [c_char; 256],
    pub compute_major: i32,
    pub compute_minor: i32,
    pub multiprocessors: i32,
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub integrated: bool,
    pub can_map_host_memory: bool,
    pub pageable_memory_access: bool,
    pub pageable_memory_access_uses_host_page_tables: bool,
    pub host_register_supported: bool,
    pub host_register_read_only_supported: bool,
    pub can_use_host_pointer_for_registered_mem: bool,
    /// Driver and runtime versions as CUDA encodes them (13000 = 13.0).
    pub driver_version: i32,
    pub runtime_version: i32,
}

/// Where a caller's kernels can find the rows, in whatever placement they live.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct engine_rows {
    /// The rows as kernels read them: a device pointer (device memory, or host memory mapped into the
    /// device's address space); a host pointer when `device_usable` is false (the CPU backend).
    pub data: *const c_void,
    /// The same rows as the host reads them when they live in host memory; NULL when on the card.
    pub host_data: *const c_void,
    pub dtype: engine_dtype,
    pub placement: engine_placement,
    /// False on the CPU backend: `data` is a host pointer and no device reads it.
    pub device_usable: bool,
    pub row_bytes: u64,
    pub rows: u64,
    pub cols: u64,
}

/// Process-wide bytes the library holds now, by kind.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct engine_memory {
    /// cudaMalloc'd device memory.
    pub device_bytes: u64,
    /// Pinned host memory from cudaHostAlloc.
    pub pinned_bytes: u64,
    /// Host ranges registered with cudaHostRegister by the library (borrowed registrations excluded).
    pub registered_bytes: u64,
    /// Checkpoint file mappings held by live engines.
    pub mapped_bytes: u64,
}

// ---------------------------------------------------------------------------------------------
// Engine

/// What a caller needs to drive the engine.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct engine_model_info {
    pub vocab: u32,
    pub layers: u32,
    pub hidden: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Tokens each stream holds.
    pub window: u32,
    /// Streams the fit admitted (each steppable independently).
    pub streams: u32,
    /// Begin- and end-of-sequence ids; -1 when the model has none.
    pub bos: i32,
    pub eos: i32,
    /// Where the embedding rows live.
    pub placement: engine_placement,
    /// True when decoding runs on CUDA, false on the CPU backend.
    pub cuda: bool,
}
