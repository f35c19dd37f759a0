//! The tensor-core product's launchers (kernels/gemm.cu): the product, a matrix's conversion into a
//! half format, and the bias add after a cuBLASLt product. Pointers as `launch`'s module note says.

use std::os::raw::{c_int, c_uint, c_void};

use super::super::weights::DeviceWeight;
use crate::cuda;
use crate::cudart::cudaStream_t;
use crate::kernels as kn;
use crate::status::Result;
use crate::tensor::DType;

/// A matrix operand of the tensor-core product: `rows` x `cols` values of a half format, row-major.
#[derive(Clone, Copy)]
pub(in crate::gpu) struct HalfMatrix {
    pub ptr: *const c_void,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
}

/// y[t] = w a[t] (+ bias) (+ residual[t]) for `n` rows of `a` (`lda` apart, w's format), on this
/// library's tensor-core kernel.
pub(in crate::gpu) fn gemm(
    a: *const c_void,
    lda: usize,
    w: &HalfMatrix,
    n: usize,
    bias: *const f32,
    residual: *const f32,
    y: *mut f32,
    ldy: usize,
    s: cudaStream_t,
) -> Result<()> {
    let (rows, cols) = (w.rows as c_uint, w.cols as c_uint);
    // SAFETY: device pointers into live allocations sized for these shapes (see the module's note).
    let code = unsafe {
        kn::hostembed_gemm(
            a,
            lda as c_uint,
            w.ptr,
            w.dtype as c_int,
            rows,
            cols,
            n as c_uint,
            bias,
            residual,
            y,
            ldy as c_uint,
            s,
        )
    };
    cuda::check(code, "hostembed_gemm")
}

/// `w` decoded into `out` as a `dtype` matrix of the same shape.
pub(in crate::gpu) fn convert_matrix(w: &DeviceWeight, out: *mut c_void, dtype: DType, s: cudaStream_t) -> Result<()> {
    let (rows, cols) = (w.rows as c_uint, w.cols as c_uint);
    // SAFETY: `w` is a placed weight; `out` holds rows x cols values of `dtype` (see the module's note).
    let code = unsafe { kn::hostembed_convert_matrix(w.ptr, w.dtype as c_int, rows, cols, out, dtype as c_int, s) };
    cuda::check(code, "hostembed_convert_matrix")
}

/// y[t][r] += bias[r] for `n` rows of `rows` values, `ldy` apart.
pub(in crate::gpu) fn add_bias(
    y: *mut f32,
    ldy: usize,
    bias: *const f32,
    rows: usize,
    n: usize,
    s: cudaStream_t,
) -> Result<()> {
    // SAFETY: device pointers sized for these shapes (see the module's note).
    let code = unsafe { kn::hostembed_add_bias(y, ldy as c_uint, bias, rows as c_uint, n as c_uint, s) };
    cuda::check(code, "hostembed_add_bias")
}
