/* hostembed: embedding rows in GPU-mapped host memory, and a dense decode engine around them.
 * Generated from the Rust sources by cbindgen; do not edit. */

#ifndef HOSTEMBED_H
#define HOSTEMBED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// The version of the library this header belongs to; `engine_version()` gives the loaded one's.
#define HOSTEMBED_VERSION_MAJOR 0
#define HOSTEMBED_VERSION_MINOR 1
#define HOSTEMBED_VERSION_PATCH 0
#define HOSTEMBED_VERSION "0.1.0"

// The ABI this header describes; a caller compares it with `engine_abi_version()`.
#define HOSTEMBED_ABI_VERSION 6

// The default reserve for the load's other buffers (kernel modules, the kit): about 85 MB measured.
#define ENGINE_FIT_DEFAULT_RESERVE_BYTES (256 << 20)

// The most tokens a stream may propose a step.
#define ENGINE_SPECULATION_MAX_TOKENS 32

// `engine_tokenize`'s `add_bos`: no BOS (C's `false`).
#define ENGINE_BOS_NO 0

// BOS first when the model has one (C's `true`; any value but the two others means this too).
#define ENGINE_BOS_YES 1

// As the model says: BOS first when `engine_model_info.add_bos`, EOS last when `add_eos`.
#define ENGINE_BOS_MODEL -1

// What a call did; `ENGINE_STATUS_OK` is 0 so C can test `if (status)`.
typedef enum engine_status {
  ENGINE_STATUS_OK = 0,
  // A NULL pointer, a bad enum value, a size that overflows, an option out of range.
  ENGINE_STATUS_INVALID_ARGUMENT = 1,
  // The model, the window or the asked streams do not fit in the room given.
  ENGINE_STATUS_NO_ROOM = 2,
  // The library was built without nvcc, so no GPU code is in it.
  ENGINE_STATUS_NO_CUDA = 3,
  // No CUDA driver or no device with that index.
  ENGINE_STATUS_NO_DEVICE = 4,
  // A CUDA call failed; the message names the call and the error.
  ENGINE_STATUS_CUDA_ERROR = 5,
  // A file could not be opened, mapped or read.
  ENGINE_STATUS_IO_ERROR = 6,
  // A checkpoint is malformed: the message names the file and the tensor or key.
  ENGINE_STATUS_BAD_MODEL = 7,
  // A valid request this build or this model does not support.
  ENGINE_STATUS_UNSUPPORTED = 8,
  // A token id, stream index or position outside its range.
  ENGINE_STATUS_OUT_OF_RANGE = 9,
  // A bug inside the library, caught at the C boundary.
  ENGINE_STATUS_PANIC = 10,
} engine_status;

// Where the embedding rows live.
typedef enum engine_placement {
  // On the card, like every other weight.
  ENGINE_PLACEMENT_DEVICE = 0,
  // In pinned, device-mapped host memory the kernels read directly.
  ENGINE_PLACEMENT_HOST_MAPPED = 1,
  // Read from the checkpoint's file mapping (registered with CUDA, or pageable on unified systems).
  ENGINE_PLACEMENT_FILE_MAPPED = 2,
} engine_placement;

// A yes/no option that can also be left to the library.
typedef enum engine_tristate {
  // Decided by the library (the option's documentation says how).
  ENGINE_TRISTATE_AUTO = 0,
  ENGINE_TRISTATE_YES = 1,
  ENGINE_TRISTATE_NO = 2,
} engine_tristate;

// Which backend decodes.
typedef enum engine_backend {
  // CUDA when the library has kernels and a device is present, else the CPU.
  ENGINE_BACKEND_AUTO = 0,
  ENGINE_BACKEND_CUDA = 1,
  ENGINE_BACKEND_CPU = 2,
} engine_backend;

// What a stream's K and V caches are stored in (`engine_options.kv_type_k` / `kv_type_v`). Rounding
// happens once, when a position's K and V are written; attention reads every type directly.
typedef enum engine_kv_type {
  // The backend's own: BF16 on CUDA, F32 on the CPU backend.
  ENGINE_KV_DEFAULT = 0,
  // bfloat16, rounded to nearest even.
  ENGINE_KV_BF16 = 1,
  // IEEE half, rounded to nearest even.
  ENGINE_KV_F16 = 2,
  // f32: the values as computed.
  ENGINE_KV_F32 = 3,
  // GGUF Q8_0 blocks of 32 values of one head (an f16 scale, max|x| / 127, and int8 quants): half of
  // BF16's bytes. head_dim must be a multiple of 32.
  ENGINE_KV_Q8_0 = 4,
  // FP8 E4M3 codes in blocks of 32 values of one head, each block with a bf16 scale (max|x| / 448):
  // half of BF16's bytes. head_dim must be a multiple of 32; on CUDA, compute capability 8.9 or newer.
  ENGINE_KV_FP8_E4M3 = 5,
} engine_kv_type;

// Row and weight formats. Values match HE_DTYPE_* in kernels/hostembed_kernels.cuh.
typedef enum engine_dtype {
  ENGINE_DTYPE_F32 = 0,
  ENGINE_DTYPE_F16 = 1,
  ENGINE_DTYPE_BF16 = 2,
  // GGUF Q8_0: blocks of 32 values, a little-endian f16 scale then 32 int8 (34 bytes).
  ENGINE_DTYPE_Q8_0 = 3,
  // GGUF Q4_0: blocks of 32 values, an f16 scale then 4-bit quants (18 bytes).
  ENGINE_DTYPE_Q4_0 = 4,
  // GGUF Q4_1: blocks of 32 values, an f16 scale and minimum then 4-bit quants (20 bytes).
  ENGINE_DTYPE_Q4_1 = 5,
  // GGUF Q5_0: blocks of 32 values, an f16 scale, the fifth bits, then the low nibbles (22 bytes).
  ENGINE_DTYPE_Q5_0 = 6,
  // GGUF Q5_1: blocks of 32 values, an f16 scale and minimum, the fifth bits, the low nibbles (24 bytes).
  ENGINE_DTYPE_Q5_1 = 7,
  // GGUF Q2_K: super-blocks of 256 values, 4-bit sub-block scales and minimums (84 bytes).
  ENGINE_DTYPE_Q2_K = 8,
  // GGUF Q3_K: super-blocks of 256 values, 6-bit sub-block scales, 3-bit quants (110 bytes).
  ENGINE_DTYPE_Q3_K = 9,
  // GGUF Q4_K: super-blocks of 256 values, 6-bit sub-block scales and minimums (144 bytes).
  ENGINE_DTYPE_Q4_K = 10,
  // GGUF Q5_K: super-blocks of 256 values, 6-bit sub-block scales and minimums (176 bytes).
  ENGINE_DTYPE_Q5_K = 11,
  // GGUF Q6_K: super-blocks of 256 values, 8-bit sub-block scales, 6-bit quants (210 bytes).
  ENGINE_DTYPE_Q6_K = 12,
} engine_dtype;

// Where a stream's speculative proposals come from.
typedef enum engine_draft {
  // No speculation: a step produces one token.
  ENGINE_DRAFT_NONE = 0,
  // Prompt lookup: the stream's last n tokens matched in its own history, the tokens that followed
  // them proposed.
  ENGINE_DRAFT_NGRAM = 1,
  // A drafter model (`engine_options.draft_model`): its greedy tokens after the stream's, one
  // batched drafter step per proposed token for all of a batch's drafting items.
  ENGINE_DRAFT_MODEL = 2,
} engine_draft;

// What `engine_set_constraint` holds a stream's output to.
typedef enum engine_constraint {
  // No constraint: the stream samples from every token.
  ENGINE_CONSTRAINT_NONE = 0,
  // A JSON schema (its text); the output is one JSON value the schema accepts.
  ENGINE_CONSTRAINT_JSON_SCHEMA = 1,
  // A regular expression (Rust `regex` syntax) the whole output matches.
  ENGINE_CONSTRAINT_REGEX = 2,
  // A grammar in llguidance's Lark syntax (`start: ...`).
  ENGINE_CONSTRAINT_LARK = 3,
  // Any one JSON value; takes no text.
  ENGINE_CONSTRAINT_JSON = 4,
} engine_constraint;

// A loaded model with its embedding rows placed; opaque to C.
//
// Threads: an engine may be called from several threads at once. Calls that touch its decode state
// (steps, logits, resets, the rows) are serialized inside the library, so a stream's tokens are the same
// as in a serial run; `engine_tokenize`, `engine_token_piece`, `engine_model_info`, `engine_is_eog`,
// `engine_eog_ids`, `engine_chat_template` and `engine_chat_template_json` read only what the load
// fixed and run beside them without waiting. `engine_free` while another thread is still inside a call
// on the same engine is the caller's bug.
typedef struct engine engine;

// What the placements decide on, read from the device.
struct engine_device_info {
  // NUL-terminated device name.
  char name[256];
  int32_t compute_major;
  int32_t compute_minor;
  int32_t multiprocessors;
  uint64_t total_bytes;
  uint64_t free_bytes;
  bool integrated;
  bool can_map_host_memory;
  bool pageable_memory_access;
  bool pageable_memory_access_uses_host_page_tables;
  bool host_register_supported;
  bool host_register_read_only_supported;
  bool can_use_host_pointer_for_registered_mem;
  // Driver and runtime versions as CUDA encodes them (13000 = 13.0).
  int32_t driver_version;
  int32_t runtime_version;
};

// The figures the rule decides on, in bytes.
typedef struct engine_fit_inputs {
  // Free device memory: the server's room probe.
  uint64_t room_bytes;
  // All weights on the card with the rows on the card (rows included).
  uint64_t weight_bytes;
  // The embedding rows alone.
  uint64_t embed_bytes;
  // Activations and other per-engine buffers.
  uint64_t scratch_bytes;
  // One stream (KV cache and state) at the asked window.
  uint64_t stream_bytes;
  // Growth of one stream per token of window; 0 = unknown.
  uint64_t stream_bytes_per_token;
  // A speculative drafter's weights, 0 = none.
  uint64_t drafter_weight_bytes;
  // One drafter stream: ring, taps, frame scratch.
  uint64_t drafter_stream_bytes;
  // The load's other buffers; default 256 MiB.
  uint64_t reserve_bytes;
  // The asked window, tokens.
  uint32_t window;
  // 0 = no cap.
  uint32_t max_streams;
  // Host and device share memory (GB10 class).
  bool unified;
  // The output head is the embedding table.
  bool embed_tied;
  // Read rows from the checkpoint's file mapping.
  bool mmap_rows;
} engine_fit_inputs;

// What the rule decided for the asked window, and the largest windows it would accept.
typedef struct engine_plan {
  // Where the embedding rows live.
  enum engine_placement placement;
  // Streams that start at the asked window; 0 = the engine refuses to start.
  uint32_t streams;
  // The asked window, tokens.
  uint32_t window;
  // What the rule compared with the room: weights, scratch, one stream, the drafter's, the reserve.
  uint64_t need_bytes;
  // What the load puts on the card: weights (less the rows in host memory), scratch, drafter weights.
  uint64_t on_card_bytes;
  // Room left for streams after the load (0 when the load alone does not fit).
  uint64_t left_bytes;
  // One stream including the drafter's.
  uint64_t stream_bytes;
  // Embedding rows held in host memory (0 when they are on the card).
  uint64_t embed_host_bytes;
  // Largest window at which the rows stay on the card and one stream starts; 0 = none or unknown.
  uint32_t max_window_on_card;
  // Largest window at which the engine starts at all; 0 = none or unknown (stream_bytes_per_token 0).
  uint32_t max_window;
  // The placement the rule picks at `max_window` (the asked window's when `max_window` is 0).
  enum engine_placement max_window_placement;
  // Largest window at which one stream fits beside every weight on the card without the reserve,
  // i.e. where an engine that never maps starts; windows above `max_window_on_card` up to this one
  // are those the reserve maps. 0 = none or unknown.
  uint32_t max_window_unmapped;
} engine_plan;

// Receives each log line (no trailing newline); `user` is `engine_options.log_user`.
typedef void (*engine_log_fn)(void *user, const char *line);

// How to start an engine; take `engine_default_options()` and change what you need.
typedef struct engine_options {
  // CUDA device index.
  int32_t device;
  // The window in tokens; 0 = the model's own (max_position_embeddings / context_length).
  uint32_t context;
  // Free device memory to plan with; 0 = probe with cudaMemGetInfo. A server passes its own probe.
  uint64_t room_bytes;
  // The load's other buffers, counted in the decision to map rows (default 256 MiB).
  uint64_t reserve_bytes;
  // A speculative drafter's weights on the card, 0 = none; with `draft_model` set, the drafter's
  // own bytes (weights, rows and scratch) are counted instead.
  uint64_t drafter_weight_bytes;
  // One drafter stream: ring, taps, frame scratch; with `draft_model` set, its KV at the window.
  uint64_t drafter_stream_bytes;
  // Most streams to start; 0 = as many as fit.
  uint32_t max_streams;
  // Most prompt tokens in one batch (sizes the scratch); 0 = the default, 512; at most 4096.
  uint32_t max_batch;
  // Host and device share memory. Auto = the device is integrated and has pageable memory access.
  enum engine_tristate unified;
  // Read the rows from the checkpoint's file mapping. Auto = DS4_EMBD_MMAP is "1".
  enum engine_tristate mmap_rows;
  enum engine_backend backend;
  // Sampling: 0 = greedy.
  float temperature;
  // 0 = no top-k cut.
  uint32_t top_k;
  // 1 = no nucleus cut.
  float top_p;
  uint64_t seed;
  // 0 = no min-p cut; else tokens less likely than min_p times the likeliest are dropped.
  float min_p;
  // 1 = no penalty; else the logits of tokens among the last `repeat_last_n` are made less likely.
  float repeat_penalty;
  // How many of a stream's last tokens the repetition penalty looks at; 0 = none.
  uint32_t repeat_last_n;
  // Log lines go here; NULL = standard error, prefixed "hostembed: ".
  engine_log_fn log;
  void *log_user;
  // What the K and V caches are stored in; ENGINE_KV_DEFAULT keeps the backend's own. The fit rule,
  // the KV pool and the start-up line count their bytes.
  enum engine_kv_type kv_type_k;
  enum engine_kv_type kv_type_v;
  // CUDA: YES runs the single-token items of a batch of 16 or more through shared tensor-core
  // products (with many streams much faster; a stream's logits then depend on what else is in its
  // batch). NO keeps every stream's bits the same alone or in any batch. AUTO = the environment's
  // HOSTEMBED_BATCH_TENSOR_CORES is "1". The CPU backend is always batch invariant.
  enum engine_tristate batch_tensor_cores;
  // A prompt whose first whole KV pages hold the same tokens as pages in the pool (a live stream's,
  // or kept from a reset or truncated one) takes those pages instead of computing them; pages no
  // stream holds are kept until a step needs their room. AUTO = on. See `engine_kv_usage`.
  enum engine_tristate prefix_cache;
  // A drafter checkpoint (HF folder or .gguf) sharing the target's vocabulary, for
  // `ENGINE_DRAFT_MODEL`; NULL: none. It is loaded beside the target on the same backend, with its own
  // KV pool of one stream per target stream; a drafter whose vocabulary differs is refused with
  // BAD_MODEL. On CUDA the fit rule counts its real bytes in place of `drafter_weight_bytes` and
  // `drafter_stream_bytes` below.
  const char *draft_model;
  // Devices to run the model over with tensor parallelism (ARCHITECTURE.md, "Tensor parallelism"):
  // 0 or 1 = one device, `device`, as before. N > 1 (at most 64) runs one model over the CUDA devices
  // `device` to `device` + N - 1, each holding a slice of every layer, summed through NCCL
  // (libnccl.so.2, loaded at run time: its absence fails the load with its reason); each device is
  // planned with its own room (or `room_bytes` each). Not with the CPU backend (INVALID_ARGUMENT) or
  // a drafter model (UNSUPPORTED).
  uint32_t devices;
} engine_options;

// Where a caller's kernels can find the rows, in whatever placement they live.
typedef struct engine_rows {
  // The rows as kernels read them: a device pointer (device memory, or host memory mapped into the
  // device's address space); a host pointer when `device_usable` is false (the CPU backend).
  const void *data;
  // The same rows as the host reads them when they live in host memory; NULL when on the card.
  const void *host_data;
  enum engine_dtype dtype;
  enum engine_placement placement;
  // False on the CPU backend: `data` is a host pointer and no device reads it.
  bool device_usable;
  uint64_t row_bytes;
  uint64_t rows;
  uint64_t cols;
} engine_rows;

// Process-wide bytes the library holds now, by kind.
typedef struct engine_memory {
  // cudaMalloc'd device memory.
  uint64_t device_bytes;
  // Pinned host memory from cudaHostAlloc.
  uint64_t pinned_bytes;
  // Host ranges registered with cudaHostRegister by the library (borrowed registrations excluded).
  uint64_t registered_bytes;
  // Checkpoint file mappings held by live engines.
  uint64_t mapped_bytes;
} engine_memory;

// One stream's part of `engine_step_batch`: its input, and what the call wrote back.
typedef struct engine_batch_item {
  // The stream to advance.
  uint32_t stream;
  // A prompt (or a chunk of one), or the last sampled token: `n` ids.
  const int32_t *tokens;
  size_t n;
  // Out: the token this stream's sampler picks next (-1 when the item failed).
  int32_t next;
  // Out: this item's status; a failed item appends nothing.
  enum engine_status status;
  // Room for every token the step produces for this stream (with speculation, the accepted proposals
  // and then the target's own token). NULL or `out_cap` 0: the item steps one token, as without it;
  // else `out_cap` must hold the stream's `max_tokens` + 1.
  int32_t *out;
  size_t out_cap;
  // Out: tokens written to `out`, the last equal to `next` (1 without speculation; 0 when failed).
  size_t n_out;
} engine_batch_item;

// A stream's speculative decoding settings (`engine_set_speculation`); `engine_default_speculation()`
// is off. Proposals are verified in one forward of the target; greedy and sampled output are the
// tokens the stream would produce without speculation.
typedef struct engine_speculation {
  enum engine_draft draft;
  // Most tokens proposed a step (1..=ENGINE_SPECULATION_MAX_TOKENS when drafting).
  uint32_t max_tokens;
  // NGRAM: the lengths of the stream's last tokens matched against its history, the longest first
  // (1 <= ngram_min <= ngram_max).
  uint32_t ngram_min;
  uint32_t ngram_max;
} engine_speculation;

// How one stream picks its next token; `engine_default_sampling()` is greedy with no penalty.
// A stream starts with the engine options' settings; `engine_set_sampling` changes them.
typedef struct engine_sampling {
  // Not above 0 picks greedily (the largest logit).
  float temperature;
  // 0 keeps every token.
  uint32_t top_k;
  // 1 keeps every token; else the smallest set of likeliest tokens holding top_p of the probability.
  float top_p;
  // 0 keeps every token; else only tokens at least min_p times as likely as the likeliest (0..=1).
  float min_p;
  // 1 = none; above 1 a token among the last `repeat_last_n` has its logit divided by it (positive
  // logits) or multiplied by it (negative ones) before sampling, greedy included.
  float repeat_penalty;
  // How many of the stream's last tokens (prompt included) the penalty looks at; 0 = none.
  uint32_t repeat_last_n;
  // The draw depends on (seed, stream index, position) only.
  uint64_t seed;
} engine_sampling;

// The KV pool's positions by state, in whole pages (`engine_kv_usage`). `tokens_total - tokens_free`
// are the positions of the pages streams hold, each page counted once however many hold it.
struct engine_kv_usage {
  // As `engine_kv_stats`: every position of the pool, and those of pages no stream holds (which a
  // step takes when it needs room; `tokens_cached` among them).
  uint64_t tokens_total;
  uint64_t tokens_free;
  // Positions of pages more than one stream holds (`engine_fork`, or the prefix cache's matches).
  uint64_t tokens_shared;
  // Positions of pages the prefix cache keeps that no stream holds.
  uint64_t tokens_cached;
};

// What a caller needs to drive the engine.
struct engine_model_info {
  uint32_t vocab;
  uint32_t layers;
  uint32_t hidden;
  uint32_t heads;
  uint32_t kv_heads;
  uint32_t head_dim;
  // Tokens each stream holds.
  uint32_t window;
  // Streams the fit admitted (each steppable independently).
  uint32_t streams;
  // Begin- and end-of-sequence ids; -1 when the model has none.
  int32_t bos;
  int32_t eos;
  // Where the embedding rows live.
  enum engine_placement placement;
  // True when decoding runs on CUDA, false on the CPU backend.
  bool cuda;
  // The model wants BOS before a prompt / EOS after it (GGUF `tokenizer.ggml.add_bos_token`,
  // tokenizer_config.json's `add_bos_token`, else what its tokenizer does); false without the id.
  bool add_bos;
  bool add_eos;
  // The K and V cache types in use (never ENGINE_KV_DEFAULT: the backend's choice is resolved).
  enum engine_kv_type kv_type_k;
  enum engine_kv_type kv_type_v;
};

// One message of a chat for `engine_chat_template`: NUL-terminated UTF-8 role ("system", "user",
// "assistant", ...) and content.
typedef struct engine_chat_message {
  const char *role;
  const char *content;
} engine_chat_message;

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// The ABI version of the loaded library; equal to `HOSTEMBED_ABI_VERSION` when header and library match.
uint32_t engine_abi_version(void);

// The loaded library's version, "MAJOR.MINOR.PATCH", a static string: `HOSTEMBED_VERSION` of the header
// it was built with.
const char *engine_version(void);

// A static, human-readable name for a status ("no room", "bad model", ...); any value is accepted
// (-1 arrives as `UINT32_MAX`), and one outside `engine_status` gives "unknown status".
const char *engine_status_str(uint32_t status);

// The message of the last failure on the calling thread ("" when none); valid until the next failure.
const char *engine_last_error(void);

// Fills `out` for CUDA device `device`. NO_CUDA without GPU code, NO_DEVICE without a driver or device.
enum engine_status engine_device_info(int32_t device,
                                      struct engine_device_info *out);

// The fit rule's defaults: a 256 MiB reserve, every other figure 0 and every flag false.
struct engine_fit_inputs engine_fit_default_inputs(void);

// Runs the fit rule on `inputs` into `out`. NO_ROOM when no stream starts: `out` is still filled and
// `engine_last_error()` says why ("a 10.90 GiB stream, 8.93 GiB left"). INVALID_ARGUMENT for NULL,
// figures that overflow 64 bits, or figures that contradict each other.
enum engine_status engine_fit_plan(const struct engine_fit_inputs *inputs,
                                   struct engine_plan *out);

// Writes the plan's start-up line into `buf` (NUL-terminated, truncated to `len`) and returns the
// length it needed, like snprintf; 0 with `engine_last_error()` set for NULL or a bad placement.
size_t engine_plan_describe(const struct engine_plan *plan, char *buf, size_t len);

// Runs the fit rule for a model split over `devices` devices with tensor parallelism: `inputs[i]` is
// device i's own figures (its shards' bytes, its share of a stream, its room; ARCHITECTURE.md, "Tensor
// parallelism"), `plans[i]` gets its plan, `*streams` the streams the engine starts on all of them (the
// fewest any device allows: the page ids are shared). Each device keeps the embedding rows or maps
// the one host copy by its own plan. NO_ROOM when a device allows none: every plan is still filled,
// `*streams` is 0 and `engine_last_error()` names the device. INVALID_ARGUMENT for NULL, 0 or more
// than 64 devices, or a device's figures the one-device rule refuses (naming the device).
enum engine_status engine_fit_plan_devices(const struct engine_fit_inputs *inputs,
                                           size_t devices,
                                           struct engine_plan *plans,
                                           uint32_t *streams);

// Writes the start-up line of a plan over `devices` devices (`plans` as `engine_fit_plan_devices`
// filled them) into `buf` like `engine_plan_describe`: "2 devices, 9 streams at an 8192-token window;
// device 0: ...". 0 with `engine_last_error()` set for NULL, a bad count or a bad placement.
size_t engine_plan_describe_devices(const struct engine_plan *plans,
                                    size_t devices,
                                    char *buf,
                                    size_t len);

// The defaults: device 0, the model's window, probed room, a 256 MiB reserve, no drafter, every
// stream that fits, rows placed by the fit rule (DS4_EMBD_MMAP=1 reads them from the file mapping),
// backend auto, greedy sampling, log lines to standard error, the backend's own KV cache types.
struct engine_options engine_default_options(void);

// Opens the checkpoint at `model_path` (an HF folder or a .gguf file), plans with the fit rule, logs
// the start-up line, places the embedding rows and stores the engine in `*out` (NULL on failure).
// `opts` NULL = `engine_default_options()`. NO_ROOM when no stream fits (the message says why, in the
// start-up line's words); BAD_MODEL/IO_ERROR for a checkpoint that cannot be read; NO_CUDA/NO_DEVICE
// when the CUDA backend is asked for and absent; INVALID_ARGUMENT for an option out of its range (an
// enum value that names none among them); UNSUPPORTED for a KV cache type the model or the device
// cannot take (Q8_0 / FP8_E4M3 with a head_dim that is not a multiple of 32, FP8_E4M3 on a device
// older than compute capability 8.9). With `draft_model` set the drafter is opened too: BAD_MODEL,
// naming both sizes, when its vocabulary is not the target's. Whatever failed, nothing is held afterwards.
enum engine_status engine_init_fit(const char *model_path,
                                   const struct engine_options *opts,
                                   struct engine **out);

// Frees the engine and everything it holds: device memory, pinned memory, registrations, mappings.
// NULL is accepted. No other thread may be inside a call on the same engine, or enter one later.
void engine_free(struct engine *e);

// The device-usable pointer to embedding rows in host memory (pinned, or the registered file
// mapping); NULL when the rows are on the card, on the CPU backend, or `e` is NULL.
const void *engine_host_embed_ptr(const struct engine *e);

// Where the embedding rows are and how to read them, in every placement.
enum engine_status engine_embed_rows(const struct engine *e, struct engine_rows *out);

// Gathers the embedding rows of `n` token ids into `device_out` as `out_dtype` (F32 or BF16), on
// `cuda_stream` (NULL = the default stream), and synchronizes that stream. On the CPU backend both
// pointers are host pointers. OUT_OF_RANGE when any id is outside the vocabulary: such a row is never
// read (on CUDA it is written as zeros).
enum engine_status engine_embed(const struct engine *e,
                                const int32_t *device_ids,
                                size_t n,
                                void *device_out,
                                enum engine_dtype out_dtype,
                                void *cuda_stream);

// Process-wide bytes the library holds now: device, pinned, registered and mapped (checkpoints of
// live engines). All zero once every engine is freed.
enum engine_status engine_memory_stats(struct engine_memory *out);

// The plan the engine started with; its placement is where the rows went (a device that cannot
// register the file mapping gets HOST_MAPPED). UNSUPPORTED on the CPU backend, which has no device plan.
enum engine_status engine_plan_of(const struct engine *e,
                                  struct engine_plan *out);

// Device `index`'s plan of an engine over `options.devices` (index 0 is `options.device`, rank order):
// that device's own figures, its `streams` what it alone allows (the engine starts the fewest of them,
// which `engine_plan_of` gives). On one device, index 0 is `engine_plan_of`'s plan. INVALID_ARGUMENT
// past the engine's devices, UNSUPPORTED on the CPU backend.
enum engine_status engine_plan_of_device(const struct engine *e,
                                         uint32_t index,
                                         struct engine_plan *out);

// Appends `n` tokens (a prompt, or the last sampled token) to stream `stream` and writes the token the
// stream's sampler picks next to `*next` (its `engine_sampling`, the options' unless
// `engine_set_sampling` changed it; the draw depends on (seed, stream, position) only): a batch of one
// item. OUT_OF_RANGE for an id outside the vocabulary or a stream the engine does not have, NO_ROOM past
// the window (checked before any id is read) or when the KV pool has no free page for it; either way
// nothing is appended. Steps of one engine are serialized: threads may step different streams of it at
// once.
enum engine_status engine_step(struct engine *e,
                               uint32_t stream,
                               const int32_t *tokens,
                               size_t n,
                               int32_t *next);

// Steps several streams at once: each item appends its `n` tokens (a prompt, a chunk of one, or the
// last sampled token) to its stream and gets the token that stream's sampler picks next in `next`,
// with its own status in `status` (a failed item appends nothing and gets `next` -1; the others
// proceed). Items may mix prompt chunks and single tokens. Per item: OUT_OF_RANGE for a stream that
// does not exist or an id outside the vocabulary, NO_ROOM past the window (checked before its tokens
// are read) or when the KV pool has no free page for it, INVALID_ARGUMENT for `n` 0. The call returns
// INVALID_ARGUMENT, stepping nothing, only when it is malformed: `e` NULL, `items` NULL with
// `n_items` > 0, an item's `tokens` NULL with `n` > 0, a stream named twice, an item's `out` given
// with `out_cap` below its stream's `max_tokens` + 1 while the stream speculates; otherwise OK (or the
// device's failure). A stream's tokens and logits are the same whether it steps alone or in a batch.
//
// Speculation (`engine_set_speculation`): an item with `out` and `out_cap` given may produce several
// tokens: its stream's proposals are verified in the same forward as the batch's other items, and
// `out` receives the accepted ones and then the target's own token (`n_out` of them, the last equal to
// `next`); the stream holds the item's tokens and the accepted proposals. The tokens are those stepping
// one token at a time would produce; `engine_logits` gives the logits after the last position kept.
enum engine_status engine_step_batch(struct engine *e,
                                     struct engine_batch_item *items,
                                     size_t n_items);

// Speculation off (`ENGINE_DRAFT_NONE`), with the settings prompt lookup starts from when `draft` is
// set: max_tokens 8, ngram_min 2, ngram_max 4.
struct engine_speculation engine_default_speculation(void);

// Sets stream `stream`'s speculative decoding from its next step on, and starts its counts again.
// A step proposes only for an item given `out` (see `engine_step_batch`). INVALID_ARGUMENT for NULL,
// a `draft` that names no `engine_draft`, `max_tokens` outside 1..=ENGINE_SPECULATION_MAX_TOKENS or
// NGRAM lengths with `ngram_min` 0 or above `ngram_max` (while `draft` is not NONE); UNSUPPORTED for
// `ENGINE_DRAFT_MODEL` on an engine that loaded no drafter (`engine_options.draft_model`); OUT_OF_RANGE
// for a stream the engine does not have.
enum engine_status engine_set_speculation(struct engine *e,
                                          uint32_t stream,
                                          const struct engine_speculation *s);

// Tokens stream `stream` proposed and tokens verification accepted since its speculation was last set
// (either pointer may be NULL). OUT_OF_RANGE for a stream the engine does not have.
enum engine_status engine_speculation_stats(const struct engine *e,
                                            uint32_t stream,
                                            uint64_t *proposed,
                                            uint64_t *accepted);

// Of the tokens stream `stream` was given by steps and `engine_score` since it was last reset
// (`engine_reset`, or `engine_fork` onto it): those whose positions the prefix cache gave (whole KV pages
// a step had computed before, `engine_options.prefix_cache`) into `*cached`, and those computed into
// `*computed` (either pointer may be NULL). Proposals of speculative decoding are not counted
// (`engine_speculation_stats` counts them). OUT_OF_RANGE for a stream the engine does not have.
enum engine_status engine_prefix_stats(const struct engine *e,
                                       uint32_t stream,
                                       uint64_t *cached,
                                       uint64_t *computed);

// Greedy sampling with no cut and no penalty (temperature 0, top_k 0, top_p 1, min_p 0,
// repeat_penalty 1, repeat_last_n 64, seed 0).
struct engine_sampling engine_default_sampling(void);

// Sets stream `stream`'s sampler from its next step on (a stream starts with the engine options'
// settings, and keeps its own across `engine_reset`). INVALID_ARGUMENT for NULL or a setting out of its
// range (temperature < 0, top_p outside (0, 1], min_p outside [0, 1], repeat_penalty <= 0, any NaN),
// OUT_OF_RANGE for a stream that does not exist.
enum engine_status engine_set_sampling(struct engine *e,
                                       uint32_t stream,
                                       const struct engine_sampling *s);

// Stream `stream`'s sampler settings, into `*out`.
enum engine_status engine_get_sampling(const struct engine *e,
                                       uint32_t stream,
                                       struct engine_sampling *out);

// Holds stream `stream`'s output to a constraint from its next step on: the token that step samples
// and every one after it are drawn only among the tokens the constraint allows (greedy or any sampling
// setting; min-p and top-p see the distribution renormalized over them), and once the constraint is
// complete only end-of-generation tokens (`engine_is_eog`) are. `text` is `len` bytes of UTF-8 (no NUL
// needed): a JSON schema for JSON_SCHEMA (local `#/...` refs; an `x-guidance` key sets llguidance's JSON
// options, e.g. `{"whitespace_flexible": false}`), a regular expression the whole output matches for
// REGEX, an llguidance Lark grammar for LARK; JSON (any one JSON value) and NONE (removes the
// constraint) take none. The constraint follows its stream: tokens the stream is given from then on
// must be ones it allows (else that step's item fails with INVALID_ARGUMENT and appends nothing),
// `engine_truncate` and `engine_reset` roll it back with the stream, and setting another replaces it.
// `engine_logits` and `engine_top_logprobs` still report the model's logits before the mask. The first
// call builds the vocabulary's token trie (tens of milliseconds). INVALID_ARGUMENT, with the stream
// unchanged, for a schema, regex or grammar llguidance refuses (its message in `engine_last_error()`),
// a `kind` outside the enum, text that is not UTF-8, `text` NULL with `len` > 0; OUT_OF_RANGE for a
// stream the engine does not have; UNSUPPORTED when the model has no usable tokenizer.
enum engine_status engine_set_constraint(struct engine *e,
                                         uint32_t stream,
                                         enum engine_constraint kind,
                                         const char *text,
                                         size_t len);

// The ids stream `stream`'s constraint (`engine_set_constraint`) allows as its next token, the one its
// last step's logits draw: bit `i % 32` of `bits[i / 32]` is set when id `i` is allowed, for every id of
// the vocabulary (`words` must be at least `(vocab + 31) / 32`; bits past the vocabulary are 0). Every
// id's bit is set when the stream has no constraint; once the constraint is complete only the
// end-of-generation ids' are. A caller that samples a constrained stream itself from `engine_logits`
// draws among these, and the engine takes that token at the next step. INVALID_ARGUMENT for NULLs, too
// few words, or a constraint llguidance fails on (its message in `engine_last_error()`); OUT_OF_RANGE
// for a stream the engine does not have.
enum engine_status engine_allowed_tokens(struct engine *e,
                                         uint32_t stream,
                                         uint32_t *bits,
                                         size_t words);

// Keeps the first `len` positions of stream `stream` and gives the KV pages past them back to the
// pool; stepping the same tokens again in the same pieces gives the same logits, bit for bit (on CUDA, a
// prompt chunk the cut falls inside, stepped again as a shorter chunk, may take another product route:
// within 2e-3 relative L2; so may a prompt that takes the prefix cache's pages for its first whole pages,
// see `engine_options.prefix_cache`). OUT_OF_RANGE when `len` is more than the stream holds or the stream
// does not exist. INVALID_ARGUMENT, changing nothing, for a model whose sliding-window layers keep only
// their window (Gemma 3 on the CPU backend) when `len` is further back than the positions they still
// hold: a step keeps them from the stream's new length less the window and a margin of at least 32
// positions (a fork holds its source's). The stream's logits are dropped when it loses positions.
enum engine_status engine_truncate(struct engine *e,
                                   uint32_t stream,
                                   uint32_t len);

// Tokens stream `stream` holds now, into `*len`.
enum engine_status engine_stream_len(const struct engine *e, uint32_t stream, uint32_t *len);

// The KV pool: positions it holds in all, and positions free (whole pages no stream holds, those the
// prefix cache keeps included: a step takes them when it needs room), into the two outputs.
enum engine_status engine_kv_stats(const struct engine *e,
                                   uint64_t *tokens_total,
                                   uint64_t *tokens_free);

// The KV pool's positions by state into `*out`: in all, free (as `engine_kv_stats`), held by more than
// one stream, and kept by the prefix cache with no stream holding them (counted free too). Whole pages,
// each counted once however many streams hold it, so the positions streams hold are `tokens_total -
// tokens_free`. Where a model's sliding-window layers keep only their window in a pool of their own
// (Gemma 3 on the CPU backend), every figure is the two pools' positions added.
enum engine_status engine_kv_usage(const struct engine *e,
                                   struct engine_kv_usage *out);

// Stream `dst` is reset, then holds the first `len` positions of stream `src` (tokens and KV), sharing
// `src`'s KV pages: no position is computed or copied, and each stream goes on on its own (the first
// write into a page the other holds copies that page). `dst` keeps its own sampler settings and has
// no logits until it is stepped. No page is taken: a step that writes into a shared page takes one
// for the copy (NO_ROOM for that step when none is free). INVALID_ARGUMENT for `src == dst`, and for
// `len` further back than `src`'s sliding-window layers still hold (as `engine_truncate`); OUT_OF_RANGE
// for a stream the engine does not have or `len` past `src`'s length. A refused call changes nothing.
enum engine_status engine_fork(struct engine *e,
                               uint32_t src,
                               uint32_t dst,
                               uint32_t len);

// Appends `n` tokens to stream `stream` as `engine_step` would (its KV, its history for the repetition
// penalty; no token is sampled) and writes `logprobs[i]` = log p(tokens[i] | every token before it):
// the float64 log-softmax of the logits after the position before, as `engine_top_logprobs` reports
// them. `logprobs[0]` is NaN when the stream was empty; otherwise it comes from the stream's kept
// logits, or, when none are kept, from its last position computed again with the tokens. The tokens run
// as a prompt does (in chunks, the logits of every position computed), not one step a token; afterwards
// `engine_logits` gives the logits after the last of them. NO_ROOM past the window (checked before any
// id is read) or when the KV pool has no free page; OUT_OF_RANGE for an id outside the vocabulary or a
// stream the engine does not have; INVALID_ARGUMENT for NULLs or `n` 0. A refused call changes nothing.
enum engine_status engine_score(struct engine *e,
                                uint32_t stream,
                                const int32_t *tokens,
                                size_t n,
                                float *logprobs);

// Copies the logits of the last position of stream `stream` into `out` (`len` must be at least the
// vocabulary). Logits are kept for every stream the last step or batch that stepped anything stepped:
// with several threads stepping, another call's step in between makes this INVALID_ARGUMENT.
enum engine_status engine_logits(const struct engine *e,
                                 uint32_t stream,
                                 float *out,
                                 size_t len);

// The `k` most likely next tokens after stream `stream`'s last step, most likely first (a tie to the
// lower id), in `ids[0..k)`, with their log-probabilities in `logprobs[0..k)`: the log-softmax of
// `engine_logits` in double precision, before the sampling transforms (temperature, penalties, cuts),
// as OpenAI's `top_logprobs` reports them. `k` may be 0 (the arrays may then be NULL); past the
// vocabulary it is INVALID_ARGUMENT. Available when `engine_logits` is; logits with a NaN are
// BAD_MODEL (no distribution to report).
enum engine_status engine_top_logprobs(const struct engine *e,
                                       uint32_t stream,
                                       size_t k,
                                       int32_t *ids,
                                       float *logprobs);

// Empties stream `stream` so it can take a new prompt, giving its KV pages back to the pool (with the
// prefix cache on, its whole pages stay there for a prompt that starts the same, until a step needs
// their room); its sampler settings stay.
enum engine_status engine_reset(struct engine *e,
                                uint32_t stream);

// The model's figures and the engine's window and streams; runs beside steps without waiting.
enum engine_status engine_model_info(const struct engine *e, struct engine_model_info *out);

// Tokenizes `len` bytes of UTF-8 `text` (no NUL needed) into `ids`. `add_bos`: `ENGINE_BOS_NO` (0,
// C's false) adds nothing; `ENGINE_BOS_MODEL` adds BOS and EOS as the model says
// (`engine_model_info.add_bos` / `add_eos`); any other value (C's true) puts the model's BOS first
// when it has one. `*n_out` is always set to the number of ids the text needs; `ids` may
// be NULL with `cap` 0 to ask only for that. OUT_OF_RANGE when `cap` is smaller (nothing written),
// UNSUPPORTED when the model has no usable tokenizer, INVALID_ARGUMENT for text that is not UTF-8,
// BAD_MODEL when the model's tokenizer fails on the text. Runs beside steps without waiting.
enum engine_status engine_tokenize(const struct engine *e,
                                   const char *text,
                                   size_t len,
                                   int32_t add_bos,
                                   int32_t *ids,
                                   size_t cap,
                                   size_t *n_out);

// The bytes token `id` adds to the text, written into `buf` like snprintf (at most `len - 1` bytes, then
// a NUL); returns the piece's length. Use that length rather than strlen: a piece may hold a NUL byte,
// and a byte-level piece may be part of a UTF-8 character. An id of the model that the tokenizer lacks
// (padding rows) is an empty piece. On failure a negative status: -OUT_OF_RANGE for an id outside the
// vocabulary, -UNSUPPORTED when the model has no usable tokenizer, -INVALID_ARGUMENT for NULLs. Runs
// beside steps without waiting.
int32_t engine_token_piece(const struct engine *e,
                           int32_t id,
                           char *buf,
                           size_t len);

// Whether `id` ends a generation: the model's EOS, its end-of-turn and end-of-message ids, every token
// whose text is a known end marker (`<|im_end|>`, `<|eot_id|>`, `<|end_of_text|>`, ...), and the eos
// ids of generation_config.json. False for NULL or an id outside the vocabulary. Runs beside steps.
bool engine_is_eog(const struct engine *e,
                   int32_t id);

// The end-of-generation ids (as `engine_is_eog` tests them), ascending, into `out`. `*n` is always set
// to their number; `out` may be NULL with `cap` 0 to ask only for that; OUT_OF_RANGE when `cap` is
// smaller (nothing written). Runs beside steps without waiting.
enum engine_status engine_eog_ids(const struct engine *e,
                                  int32_t *out,
                                  size_t cap,
                                  size_t *n);

// Renders `n` messages with the model's own chat template (GGUF `tokenizer.chat_template`, or an HF
// folder's tokenizer_config.json `chat_template` / chat_template.jinja) as transformers'
// `apply_chat_template` does, with the model's BOS and EOS texts as `bos_token` / `eos_token`; with
// `add_generation_prompt`, the text ends where the assistant's reply begins. The text is written into
// `buf` like snprintf (at most `len - 1` bytes, then a NUL; `buf` may be NULL with `len` 0) and its
// length is returned: call again with a larger buffer when it is `len` or more. The text is not
// tokenized: pass it to `engine_tokenize` with `ENGINE_BOS_NO` when the template writes BOS itself.
// On failure a negative status: -UNSUPPORTED when the model has no chat template, -BAD_MODEL for a
// template that does not parse, -INVALID_ARGUMENT for NULLs, text that is not UTF-8, or messages the
// template refuses (its raise_exception; the message says why). Runs beside steps without waiting.
int32_t engine_chat_template(const struct engine *e,
                             const struct engine_chat_message *messages,
                             size_t n,
                             bool add_generation_prompt,
                             char *buf,
                             size_t len);

// As `engine_chat_template`, with the conversation and the tools given as JSON, the way transformers'
// `apply_chat_template(messages, tools=tools)` receives them, for templates that call tools:
// `messages_json` a NUL-terminated array of message objects passed to the template as they are (an
// assistant message's `tool_calls`, a `"tool"` message's `tool_call_id`, any field the template
// reads), `tools_json` a NUL-terminated array of tools (OpenAI's `{"type": "function", "function":
// {"name", "description", "parameters"}}` objects, which the templates of Qwen2.5, Llama 3.1 and
// Hermes models print) or NULL for the template's `tools` being none. Objects keep their keys' order
// (Python's dicts do). Writes and returns as `engine_chat_template` does; -INVALID_ARGUMENT also for
// JSON that does not parse or is not an array (of objects, for the messages). Runs beside steps
// without waiting.
int32_t engine_chat_template_json(const struct engine *e,
                                  const char *messages_json,
                                  const char *tools_json,
                                  bool add_generation_prompt,
                                  char *buf,
                                  size_t len);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* HOSTEMBED_H */
