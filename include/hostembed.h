/* hostembed: embedding rows in GPU-mapped host memory, and a dense decode engine around them.
 * Generated from the Rust sources by cbindgen; do not edit. */

#ifndef HOSTEMBED_H
#define HOSTEMBED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// The ABI this header describes; a caller compares it with `engine_abi_version()`.
#define HOSTEMBED_ABI_VERSION 1

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

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* HOSTEMBED_H */
