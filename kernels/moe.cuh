// What kernels/moe.cu and kernels/moe_gemm.cu share: the layout of hostembed_moe_route's groups.
#pragma once

namespace he {

// groups' layout (hostembed_moe_route): [0] the experts chosen by any row, then those experts in ascending
// order, each expert's first place and count in the list, then the list: every slot r*k + s, by expert.
struct MoeGroups {
    const int *g;
    unsigned experts;
    __device__ unsigned active() const { return (unsigned)g[0]; }
    __device__ unsigned expert(unsigned a) const { return (unsigned)g[1 + a]; }
    __device__ unsigned start(unsigned e) const { return (unsigned)g[1 + experts + e]; }
    __device__ unsigned count(unsigned e) const { return (unsigned)g[1 + 2 * experts + e]; }
    __device__ const int *list() const { return g + 1 + 3 * experts; }
};

}  // namespace he
