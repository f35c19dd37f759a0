// Hopper's warpgroup products (wgmma, sm_90a only): the A operand from registers in mma.sync's m16n8k16
// fragment layout (each warp of the four its 16 rows), B from shared memory through a matrix descriptor,
// f32 accumulators in mma.sync's layout a tile of 8 columns after another. Compiled where
// __CUDA_ARCH_FEAT_SM90_ALL is defined; elsewhere the callers never launch a kernel that uses them.
#pragma once
#include <cstdint>

namespace he {
namespace wg {

// A descriptor of a no-swizzle operand at shared address `addr`: 8x16-byte core matrices, adjacent ones
// `lead` bytes apart along K and `stride` bytes apart along M or N (fields in 16-byte units).
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lead, uint32_t stride) {
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)(lead >> 4) << 16) | ((uint64_t)(stride >> 4) << 32);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Register writes before it are seen by the products after it (their A and accumulators).
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most N committed groups are in flight (their registers then free to change).
template <int N>
__device__ __forceinline__ void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
// Generic-proxy writes to shared memory (cp.async, stores) seen by the products' reads after a barrier.
__device__ __forceinline__ void fence_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// d += a b, m64n16k16, f16 inputs.
__device__ __forceinline__ void mma_n16_f16(float (&d)[8], const unsigned int (&a)[4], uint64_t b) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, 1, 0; "
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, "
        "{%8, %9, %10, %11}, %12, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// d += a b, m64n16k16, bf16 inputs.
__device__ __forceinline__ void mma_n16_bf16(float (&d)[8], const unsigned int (&a)[4], uint64_t b) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, 1, 0; "
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, "
        "{%8, %9, %10, %11}, %12, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// d += a b, m64n32k16, f16 inputs.
__device__ __forceinline__ void mma_n32_f16(float (&d)[16], const unsigned int (&a)[4], uint64_t b) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, 1, 0; "
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// d += a b, m64n32k16, bf16 inputs.
__device__ __forceinline__ void mma_n32_bf16(float (&d)[16], const unsigned int (&a)[4], uint64_t b) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, 1, 0; "
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// d += a b, m64n64k16, f16 inputs.
__device__ __forceinline__ void mma_n64_f16(float (&d)[32], const unsigned int (&a)[4], uint64_t b) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, 1, 0; "
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// d += a b, m64n64k16, bf16 inputs.
__device__ __forceinline__ void mma_n64_bf16(float (&d)[32], const unsigned int (&a)[4], uint64_t b) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, 1, 0; "
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// d += a b for a tile count NT (N = 8 NT) and the input type of Op (BF: bf16, else f16).
template <int NT, bool BF>
__device__ __forceinline__ void mma(float (&d)[NT * 4], const unsigned int (&a)[4], uint64_t b) {
    static_assert(NT == 2 || NT == 4 || NT == 8, "m64n16, m64n32 or m64n64");
    if constexpr (NT == 2) BF ? mma_n16_bf16(d, a, b) : mma_n16_f16(d, a, b);
    else if constexpr (NT == 4) BF ? mma_n32_bf16(d, a, b) : mma_n32_f16(d, a, b);
    else BF ? mma_n64_bf16(d, a, b) : mma_n64_f16(d, a, b);
}
#endif

}  // namespace wg
}  // namespace he
