// Device queries that need cudaDeviceProp, kept on the C++ side so Rust declares scalars only.
#include "hostembed_kernels.cuh"
#include <cuda_runtime.h>
#include <string.h>

extern "C" cudaError_t hostembed_device_name(int device, char *name, size_t len) {
    if (name == nullptr || len == 0) return cudaErrorInvalidValue;
    cudaDeviceProp prop;
    cudaError_t err = cudaGetDeviceProperties(&prop, device);
    if (err != cudaSuccess) return err;
    strncpy(name, prop.name, len - 1);
    name[len - 1] = '\0';
    return cudaSuccess;
}
