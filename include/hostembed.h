/* hostembed: embedding rows in GPU-mapped host memory, and a dense decode engine around them.
 * Generated from the Rust sources by cbindgen; do not edit. */

#ifndef HOSTEMBED_H
#define HOSTEMBED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// The ABI this header describes; a caller compares it with `engine_abi_version()`.
#define HOSTEMBED_ABI_VERSION 1

// The default reserve for the load's other buffers (kernel modules, the kit): about 85 MB measured.
#define ENGINE_FIT_DEFAULT_RESERVE_BYTES (256 << 20)

#define NORMAL 1

#define UNKNOWN 2

#define CONTROL 3

#define USER_DEFINED 4

#define UNUSED 5

#define BYTE 6

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

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// The ABI version of the loaded library; equal to `HOSTEMBED_ABI_VERSION` when header and library match.
uint32_t engine_abi_version(void);

// A static, human-readable name for a status ("no room", "bad model", ...).
const char *engine_status_str(enum engine_status status);

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

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* HOSTEMBED_H */
