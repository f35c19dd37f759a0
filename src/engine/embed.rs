//! `Engine::embed`: the placed rows of a batch of ids gathered into the caller's buffer, on the
//! device or the host as the backend is.

use super::{BackendKind, Engine};
use crate::cuda;
use crate::cudart as rt;
use crate::status::Result;
use crate::tensor::DType;
use std::os::raw::c_void;

impl Engine {
    /// Gathers the rows of `n` ids into `out` as `out_dtype` (F32 or BF16). On CUDA, `ids` and `out`
    /// are device pointers and the gather runs on `stream`, which this call then synchronizes to read the
    /// out-of-range flag; on the CPU backend they are host pointers and `stream` is ignored. Any id
    /// outside the vocabulary: OUT_OF_RANGE, that id's row never read.
    ///
    /// # Safety
    /// `ids` must hold `n` ints and `out` room for `n` rows of `cols` values in `out_dtype`, where the
    /// backend reads and writes them.
    pub unsafe fn embed(
        &self,
        ids: *const i32,
        n: usize,
        out: *mut c_void,
        out_dtype: DType,
        stream: rt::cudaStream_t,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if ids.is_null() || out.is_null() {
            crate::bail!(InvalidArgument, "engine_embed: ids or out is NULL with {n} ids");
        }
        if !matches!(out_dtype, DType::F32 | DType::Bf16) {
            crate::bail!(
                InvalidArgument,
                "engine_embed: output in {}; only F32 and BF16 are written",
                out_dtype.name()
            );
        }
        let vocab = self.rows.vocab();
        match (self.kind, &self.bad_ids) {
            (BackendKind::Cuda, Some(flag)) => {
                let flag = flag.lock().unwrap_or_else(|p| p.into_inner());
                // SAFETY: plain runtime call on a device index; an invalid one returns an error code.
                cuda::check(unsafe { rt::cudaSetDevice(self.options.device) }, "cudaSetDevice")?;
                let host_flag = flag.host_ptr() as *mut i32;
                // SAFETY: the previous call synchronized before releasing the lock, so no kernel writes this now.
                unsafe { host_flag.write_volatile(0) };
                // SAFETY: the caller's pointers, as this function's contract states; the flag is mapped and live.
                unsafe { self.rows.gather_device(ids, n, out, out_dtype, flag.device_ptr() as *mut i32, stream) }?;
                // SAFETY: the caller's stream, on which the gather above was queued.
                cuda::check(unsafe { rt::cudaStreamSynchronize(stream) }, "cudaStreamSynchronize")?;
                // SAFETY: the stream is synchronized, so the kernel's write to the mapped flag is visible and done.
                if unsafe { host_flag.read_volatile() } != 0 {
                    crate::bail!(
                        OutOfRange,
                        "engine_embed: a token id outside the vocabulary (0..{vocab}); its row was not read"
                    );
                }
                Ok(())
            }
            _ => {
                let size = if out_dtype == DType::F32 { 4 } else { 2 };
                // SAFETY: the contract: `ids` holds `n` ints on the host here.
                let ids = unsafe { std::slice::from_raw_parts(ids, n) };
                let len = n
                    .checked_mul(self.rows.cols() * size)
                    .ok_or_else(|| crate::err!(InvalidArgument, "engine_embed: {n} rows overflow"))?;
                // SAFETY: the contract: `out` has room for `n` rows of `cols` values in `out_dtype` on the host here.
                let out = unsafe { std::slice::from_raw_parts_mut(out as *mut u8, len) };
                self.rows.gather_host(ids, out, out_dtype)
            }
        }
    }
}
