// The one header every kernel file shares: the C launchers Rust calls (src/kernels.rs repeats
// them, and build.rs checks the two agree), and the device helpers the kernels have in common.
#pragma once
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

// Row and weight formats, the values of src/tensor.rs's DType.
#define HE_DTYPE_F32 0
#define HE_DTYPE_F16 1
#define HE_DTYPE_BF16 2
#define HE_DTYPE_Q8_0 3

#ifdef __cplusplus
extern "C" {
#endif

// ---- embed.cu: the embedding gather ----
// Gathers rows[ids[i]] (vocab rows of cols values in `dtype`) into row i of `out` (HE_DTYPE_F32 or
// HE_DTYPE_BF16). An id outside [0, vocab) is never read: its row is written as zeros and *bad
// (when bad != NULL) is set to 1. `rows` may be device memory or mapped host memory.
cudaError_t hostembed_embed_gather(const void *rows, int dtype, unsigned int vocab, unsigned int cols,
                                   const int *ids, unsigned int n, void *out, int out_dtype, int *bad,
                                   cudaStream_t stream);

// ---- decode kernels (norm.cu, matvec.cu, rope.cu, attention.cu, act.cu, sample.cu) ----

// ---- device.cu ----
// Writes the device's name (NUL-terminated, truncated to len) without exposing cudaDeviceProp to Rust.
cudaError_t hostembed_device_name(int device, char *name, size_t len);

#ifdef __cplusplus
}
#endif
