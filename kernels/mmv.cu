// The C entry points of the decode products on tensor cores (kernels/mmv_readers.cuh says the design):
// which formats and shapes they take, the workspace a launch needs, and the launch itself, handed to the
// kernel file of its kind (mmv_half.cu, mmv_int.cu and through it mmv_tile.cu).
#include "mmv.cuh"

extern "C" cudaError_t hostembed_mmv_supports(int dtype, const void *w, unsigned int cols) {
    bool ok = false;
    const bool has = with_reader(dtype, [&](auto reader) { ok = mmv_fits<decltype(reader)>(dtype, w, cols); });
    return has && ok ? cudaSuccess : cudaErrorNotSupported;
}

extern "C" cudaError_t hostembed_mmv_workspace(unsigned int rows, unsigned int cols, int glu, unsigned int n,
                                               size_t *partial_floats, unsigned int *counters) {
    if (partial_floats == nullptr || counters == nullptr || rows == 0 || cols == 0) return cudaErrorInvalidValue;
    const MmvShape s = mmv_shape(rows, cols, glu != 0);
    const unsigned int nt = min(n, MMV_MAX_TOKENS);
    // The split sums, then (half kernels past MMV_PREP_AFTER tokens) the activations staged once.
    // (rows for every token of the launch's tiles: the warpgroup kernel's layout holds absent ones too).
    *partial_floats = nt > MMV_PREP_AFTER ? mmv_prep_offset(s, glu != 0, nt, rows) + mmv_prep_floats(mmv_prep_tiles(nt) * 8, cols)
                                          : (s.splits > 1 ? (size_t)s.splits * (glu ? 2 : 1) * nt * rows : 0);
    *counters = s.splits > 1 ? s.row_blocks : 0;
    return cudaSuccess;
}

template <bool GLU>
static cudaError_t mmv_entry(const void *w, const void *w2, int dtype, unsigned int rows, unsigned int cols,
                             const float *x, unsigned int n, const float *bias, const float *residual, float *y,
                             unsigned int ldy, float *partial, unsigned int *counters, const hostembed_tuning &tuning,
                             cudaStream_t stream) {
    if (w == nullptr || (GLU && w2 == nullptr) || x == nullptr || y == nullptr) return cudaErrorInvalidValue;
    if (rows == 0 || cols == 0 || ldy < rows || reinterpret_cast<uintptr_t>(x) % 16 != 0) return cudaErrorInvalidValue;
    if (hostembed_mmv_supports(dtype, w, cols) != cudaSuccess) return cudaErrorNotSupported;
    if (GLU && hostembed_mmv_supports(dtype, w2, cols) != cudaSuccess) return cudaErrorNotSupported;
    const MmvShape s = mmv_shape(rows, cols, GLU);
    if (s.splits > 1 && (partial == nullptr || counters == nullptr)) return cudaErrorInvalidValue;
    // The half kernels past MMV_PREP_AFTER tokens stage the activations in the workspace (16-byte rows).
    if (n > MMV_PREP_AFTER && (partial == nullptr || reinterpret_cast<uintptr_t>(partial) % 16 != 0))
        return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    size_t row_bytes = 0;
    bool integer = false;
    with_reader(dtype, [&](auto reader) { integer = decltype(reader)::INT; });
    he::with_format(dtype, [&](auto format) { row_bytes = he::row_bytes<decltype(format)>(cols); });
    const he::mmv::Args a{dtype, static_cast<const unsigned char *>(w), static_cast<const unsigned char *>(w2), rows, cols,
                          row_bytes, x, n, bias, residual, y, ldy, partial, counters, tuning, stream};
    return integer ? he::mmv::integer(GLU, a) : he::mmv::half(GLU, a);
}

extern "C" cudaError_t hostembed_mmv(const void *w, int dtype, unsigned int rows, unsigned int cols, const float *x,
                                     unsigned int n, const float *bias, const float *residual, float *y,
                                     unsigned int ldy, float *partial, unsigned int *counters, hostembed_tuning tuning,
                                     cudaStream_t stream) {
    return mmv_entry<false>(w, nullptr, dtype, rows, cols, x, n, bias, residual, y, ldy, partial, counters, tuning,
                            stream);
}

extern "C" cudaError_t hostembed_mmv_swiglu(const void *w_gate, const void *w_up, int dtype, unsigned int rows,
                                            unsigned int cols, const float *x, unsigned int n, float *y,
                                            float *partial, unsigned int *counters, hostembed_tuning tuning,
                                            cudaStream_t stream) {
    return mmv_entry<true>(w_gate, w_up, dtype, rows, cols, x, n, nullptr, nullptr, y, rows, partial, counters, tuning,
                           stream);
}
