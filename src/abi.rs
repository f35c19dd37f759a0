//! Every type and constant C callers see, in the one module cbindgen reads beside the functions of
//! `ffi` (build.rs names the two files). The modules that work with these types import them from here;
//! nothing here has behaviour beyond reading raw enum values C passed.
#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_void};

/// `from_raw` for a C enum: the variant a raw value C passed names, or None. The list names every
/// variant; a match on it fails to build when one is left out.
macro_rules! from_raw {
    ($ty:ident($raw:ty): $($variant:ident),+ $(,)?) => {
        impl $ty {
            /// The variant a raw value C passed names; None when it names none.
            pub fn from_raw(raw: $raw) -> Option<$ty> {
                [$($ty::$variant),+].into_iter().find(|v| *v as $raw == raw)
            }
        }

        const _: fn($ty) = |v| match v {
            $($ty::$variant)|+ => (),
        };
    };
}

/// The ABI this header describes; a caller compares it with `engine_abi_version()`.
pub const HOSTEMBED_ABI_VERSION: u32 = 6;

// ---------------------------------------------------------------------------------------------
// Status

/// What a call did; `ENGINE_STATUS_OK` is 0 so C can test `if (status)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum engine_status {
    Ok = 0,
    /// A NULL pointer, a bad enum value, a size that overflows, an option out of range.
    InvalidArgument = 1,
    /// The model, the window or the asked streams do not fit in the room given.
    NoRoom = 2,
    /// The library was built without nvcc, so no GPU code is in it.
    NoCuda = 3,
    /// No CUDA driver or no device with that index.
    NoDevice = 4,
    /// A CUDA call failed; the message names the call and the error.
    CudaError = 5,
    /// A file could not be opened, mapped or read.
    IoError = 6,
    /// A checkpoint is malformed: the message names the file and the tensor or key.
    BadModel = 7,
    /// A valid request this build or this model does not support.
    Unsupported = 8,
    /// A token id, stream index or position outside its range.
    OutOfRange = 9,
    /// A bug inside the library, caught at the C boundary.
    Panic = 10,
}

from_raw!(engine_status(i64):
    Ok, InvalidArgument, NoRoom, NoCuda, NoDevice, CudaError, IoError, BadModel, Unsupported, OutOfRange, Panic
);

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

from_raw!(engine_placement(u32): Device, HostMapped, FileMapped);

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

/// Row and weight formats. Values match HE_DTYPE_* in kernels/hostembed_kernels.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum engine_dtype {
    F32 = 0,
    F16 = 1,
    Bf16 = 2,
    /// GGUF Q8_0: blocks of 32 values, a little-endian f16 scale then 32 int8 (34 bytes).
    Q8_0 = 3,
    /// GGUF Q4_0: blocks of 32 values, an f16 scale then 4-bit quants (18 bytes).
    Q4_0 = 4,
    /// GGUF Q4_1: blocks of 32 values, an f16 scale and minimum then 4-bit quants (20 bytes).
    Q4_1 = 5,
    /// GGUF Q5_0: blocks of 32 values, an f16 scale, the fifth bits, then the low nibbles (22 bytes).
    Q5_0 = 6,
    /// GGUF Q5_1: blocks of 32 values, an f16 scale and minimum, the fifth bits, the low nibbles (24 bytes).
    Q5_1 = 7,
    /// GGUF Q2_K: super-blocks of 256 values, 4-bit sub-block scales and minimums (84 bytes).
    Q2_K = 8,
    /// GGUF Q3_K: super-blocks of 256 values, 6-bit sub-block scales, 3-bit quants (110 bytes).
    Q3_K = 9,
    /// GGUF Q4_K: super-blocks of 256 values, 6-bit sub-block scales and minimums (144 bytes).
    Q4_K = 10,
    /// GGUF Q5_K: super-blocks of 256 values, 6-bit sub-block scales and minimums (176 bytes).
    Q5_K = 11,
    /// GGUF Q6_K: super-blocks of 256 values, 8-bit sub-block scales, 6-bit quants (210 bytes).
    Q6_K = 12,
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

/// A yes/no option that can also be left to the library.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum engine_tristate {
    /// Decided by the library (the option's documentation says how).
    Auto = 0,
    Yes = 1,
    No = 2,
}

from_raw!(engine_tristate(u32): Auto, Yes, No);

/// Which backend decodes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum engine_backend {
    /// CUDA when the library has kernels and a device is present, else the CPU.
    Auto = 0,
    Cuda = 1,
    Cpu = 2,
}

from_raw!(engine_backend(u32): Auto, Cuda, Cpu);

/// What a stream's K and V caches are stored in (`engine_options.kv_type_k` / `kv_type_v`). Rounding
/// happens once, when a position's K and V are written; attention reads every type directly.
/// cbindgen:prefix-with-name=false
/// cbindgen:rename-all=None
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum engine_kv_type {
    /// The backend's own: BF16 on CUDA, F32 on the CPU backend.
    ENGINE_KV_DEFAULT = 0,
    /// bfloat16, rounded to nearest even.
    ENGINE_KV_BF16 = 1,
    /// IEEE half, rounded to nearest even.
    ENGINE_KV_F16 = 2,
    /// f32: the values as computed.
    ENGINE_KV_F32 = 3,
    /// GGUF Q8_0 blocks of 32 values of one head (an f16 scale, max|x| / 127, and int8 quants): half of
    /// BF16's bytes. head_dim must be a multiple of 32.
    ENGINE_KV_Q8_0 = 4,
    /// FP8 E4M3 codes in blocks of 32 values of one head, each block with a bf16 scale (max|x| / 448):
    /// half of BF16's bytes. head_dim must be a multiple of 32; on CUDA, compute capability 8.9 or newer.
    ENGINE_KV_FP8_E4M3 = 5,
}

from_raw!(engine_kv_type(u32):
    ENGINE_KV_DEFAULT, ENGINE_KV_BF16, ENGINE_KV_F16, ENGINE_KV_F32, ENGINE_KV_Q8_0, ENGINE_KV_FP8_E4M3
);

/// Receives each log line (no trailing newline); `user` is `engine_options.log_user`.
pub type engine_log_fn = Option<unsafe extern "C" fn(user: *mut c_void, line: *const c_char)>;

/// How to start an engine; take `engine_default_options()` and change what you need.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct engine_options {
    /// CUDA device index.
    pub device: i32,
    /// The window in tokens; 0 = the model's own (max_position_embeddings / context_length).
    pub context: u32,
    /// Free device memory to plan with; 0 = probe with cudaMemGetInfo. A server passes its own probe.
    pub room_bytes: u64,
    /// The load's other buffers, counted in the decision to map rows (default 256 MiB).
    pub reserve_bytes: u64,
    /// A speculative drafter's weights on the card, 0 = none; with `draft_model` set, the drafter's
    /// own bytes (weights, rows and scratch) are counted instead.
    pub drafter_weight_bytes: u64,
    /// One drafter stream: ring, taps, frame scratch; with `draft_model` set, its KV at the window.
    pub drafter_stream_bytes: u64,
    /// Most streams to start; 0 = as many as fit.
    pub max_streams: u32,
    /// Most prompt tokens in one batch (sizes the scratch); 0 = the default, 512; at most 4096.
    pub max_batch: u32,
    /// Host and device share memory. Auto = the device is integrated and has pageable memory access.
    pub unified: engine_tristate,
    /// Read the rows from the checkpoint's file mapping. Auto = DS4_EMBD_MMAP is "1".
    pub mmap_rows: engine_tristate,
    pub backend: engine_backend,
    /// Sampling: 0 = greedy.
    pub temperature: f32,
    /// 0 = no top-k cut.
    pub top_k: u32,
    /// 1 = no nucleus cut.
    pub top_p: f32,
    pub seed: u64,
    /// 0 = no min-p cut; else tokens less likely than min_p times the likeliest are dropped.
    pub min_p: f32,
    /// 1 = no penalty; else the logits of tokens among the last `repeat_last_n` are made less likely.
    pub repeat_penalty: f32,
    /// How many of a stream's last tokens the repetition penalty looks at; 0 = none.
    pub repeat_last_n: u32,
    /// Log lines go here; NULL = standard error, prefixed "hostembed: ".
    pub log: engine_log_fn,
    pub log_user: *mut c_void,
    /// What the K and V caches are stored in; ENGINE_KV_DEFAULT keeps the backend's own. The fit rule,
    /// the KV pool and the start-up line count their bytes.
    pub kv_type_k: engine_kv_type,
    pub kv_type_v: engine_kv_type,
    /// CUDA: YES runs the single-token items of a batch of 16 or more through shared tensor-core
    /// products (with many streams much faster; a stream's logits then depend on what else is in its
    /// batch). NO keeps every stream's bits the same alone or in any batch. AUTO = the environment's
    /// HOSTEMBED_BATCH_TENSOR_CORES is "1". The CPU backend is always batch invariant.
    pub batch_tensor_cores: engine_tristate,
    /// A prompt whose first whole KV pages hold the same tokens as pages in the pool (a live stream's,
    /// or kept from a reset or truncated one) takes those pages instead of computing them; pages no
    /// stream holds are kept until a step needs their room. AUTO = on. See `engine_kv_usage`.
    pub prefix_cache: engine_tristate,
    /// A drafter checkpoint (HF folder or .gguf) sharing the target's vocabulary, for
    /// `ENGINE_DRAFT_MODEL`; NULL: none. It is loaded beside the target on the same backend, with its own
    /// KV pool of one stream per target stream; a drafter whose vocabulary differs is refused with
    /// BAD_MODEL. On CUDA the fit rule counts its real bytes in place of `drafter_weight_bytes` and
    /// `drafter_stream_bytes` below.
    pub draft_model: *const c_char,
    /// Devices to run the model over with tensor parallelism (ARCHITECTURE.md, "Tensor parallelism"):
    /// 0 or 1 = one device, `device`, as before. N > 1 (at most 64) runs one model over the CUDA devices
    /// `device` to `device` + N - 1, each holding a slice of every layer, summed through NCCL
    /// (libnccl.so.2, loaded at run time: its absence fails the load with its reason); each device is
    /// planned with its own room (or `room_bytes` each). Not with the CPU backend (INVALID_ARGUMENT) or
    /// a drafter model (UNSUPPORTED).
    pub devices: u32,
}

/// How one stream picks its next token; `engine_default_sampling()` is greedy with no penalty.
/// A stream starts with the engine options' settings; `engine_set_sampling` changes them.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct engine_sampling {
    /// Not above 0 picks greedily (the largest logit).
    pub temperature: f32,
    /// 0 keeps every token.
    pub top_k: u32,
    /// 1 keeps every token; else the smallest set of likeliest tokens holding top_p of the probability.
    pub top_p: f32,
    /// 0 keeps every token; else only tokens at least min_p times as likely as the likeliest (0..=1).
    pub min_p: f32,
    /// 1 = none; above 1 a token among the last `repeat_last_n` has its logit divided by it (positive
    /// logits) or multiplied by it (negative ones) before sampling, greedy included.
    pub repeat_penalty: f32,
    /// How many of the stream's last tokens (prompt included) the penalty looks at; 0 = none.
    pub repeat_last_n: u32,
    /// The draw depends on (seed, stream index, position) only.
    pub seed: u64,
}

/// What `engine_set_constraint` holds a stream's output to.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum engine_constraint {
    /// No constraint: the stream samples from every token.
    None = 0,
    /// A JSON schema (its text); the output is one JSON value the schema accepts.
    JsonSchema = 1,
    /// A regular expression (Rust `regex` syntax) the whole output matches.
    Regex = 2,
    /// A grammar in llguidance's Lark syntax (`start: ...`).
    Lark = 3,
    /// Any one JSON value; takes no text.
    Json = 4,
}

from_raw!(engine_constraint(u32): None, JsonSchema, Regex, Lark, Json);

/// One stream's part of `engine_step_batch`: its input, and what the call wrote back.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct engine_batch_item {
    /// The stream to advance.
    pub stream: u32,
    /// A prompt (or a chunk of one), or the last sampled token: `n` ids.
    pub tokens: *const i32,
    pub n: usize,
    /// Out: the token this stream's sampler picks next (-1 when the item failed).
    pub next: i32,
    /// Out: this item's status; a failed item appends nothing.
    pub status: engine_status,
    /// Room for every token the step produces for this stream (with speculation, the accepted proposals
    /// and then the target's own token). NULL or `out_cap` 0: the item steps one token, as without it;
    /// else `out_cap` must hold the stream's `max_tokens` + 1.
    pub out: *mut i32,
    pub out_cap: usize,
    /// Out: tokens written to `out`, the last equal to `next` (1 without speculation; 0 when failed).
    pub n_out: usize,
}

/// Where a stream's speculative proposals come from.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum engine_draft {
    /// No speculation: a step produces one token.
    None = 0,
    /// Prompt lookup: the stream's last n tokens matched in its own history, the tokens that followed
    /// them proposed.
    Ngram = 1,
    /// A drafter model (`engine_options.draft_model`): its greedy tokens after the stream's, one
    /// batched drafter step per proposed token for all of a batch's drafting items.
    Model = 2,
}

from_raw!(engine_draft(u32): None, Ngram, Model);

/// A stream's speculative decoding settings (`engine_set_speculation`); `engine_default_speculation()`
/// is off. Proposals are verified in one forward of the target; greedy and sampled output are the
/// tokens the stream would produce without speculation.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct engine_speculation {
    pub draft: engine_draft,
    /// Most tokens proposed a step (1..=ENGINE_SPECULATION_MAX_TOKENS when drafting).
    pub max_tokens: u32,
    /// NGRAM: the lengths of the stream's last tokens matched against its history, the longest first
    /// (1 <= ngram_min <= ngram_max).
    pub ngram_min: u32,
    pub ngram_max: u32,
}

/// The most tokens a stream may propose a step.
pub const ENGINE_SPECULATION_MAX_TOKENS: u32 = 32;

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
    /// The model wants BOS before a prompt / EOS after it (GGUF `tokenizer.ggml.add_bos_token`,
    /// tokenizer_config.json's `add_bos_token`, else what its tokenizer does); false without the id.
    pub add_bos: bool,
    pub add_eos: bool,
    /// The K and V cache types in use (never ENGINE_KV_DEFAULT: the backend's choice is resolved).
    pub kv_type_k: engine_kv_type,
    pub kv_type_v: engine_kv_type,
}

/// The KV pool's positions by state, in whole pages (`engine_kv_usage`). `tokens_total - tokens_free`
/// are the positions of the pages streams hold, each page counted once however many hold it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct engine_kv_usage {
    /// As `engine_kv_stats`: every position of the pool, and those of pages no stream holds (which a
    /// step takes when it needs room; `tokens_cached` among them).
    pub tokens_total: u64,
    pub tokens_free: u64,
    /// Positions of pages more than one stream holds (`engine_fork`, or the prefix cache's matches).
    pub tokens_shared: u64,
    /// Positions of pages the prefix cache keeps that no stream holds.
    pub tokens_cached: u64,
}

// ---------------------------------------------------------------------------------------------
// Text

/// `engine_tokenize`'s `add_bos`: no BOS (C's `false`).
pub const ENGINE_BOS_NO: i32 = 0;
/// BOS first when the model has one (C's `true`; any value but the two others means this too).
pub const ENGINE_BOS_YES: i32 = 1;
/// As the model says: BOS first when `engine_model_info.add_bos`, EOS last when `add_eos`.
pub const ENGINE_BOS_MODEL: i32 = -1;

/// One message of a chat for `engine_chat_template`: NUL-terminated UTF-8 role ("system", "user",
/// "assistant", ...) and content.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct engine_chat_message {
    pub role: *const c_char,
    pub content: *const c_char,
}
