//! The embedding rows' three homes and the gather that reads them from any of them.
//!
//! - DEVICE: a cudaMalloc'd copy.
//! - HOST_MAPPED: a pinned, device-mapped copy (cudaHostAlloc Mapped|Portable), filled from the file
//!   mapping by several threads.
//! - FILE_MAPPED: no copy. With pageable memory access (unified systems) kernels read the mapping
//!   itself; otherwise the page-aligned span covering the rows is registered Mapped|ReadOnly. A device
//!   that cannot register read-only memory gets a HOST_MAPPED copy instead, and the log says why.
//!
//! Each `Rows` owns what it allocated through the RAII owners of `cuda`, so dropping it (or failing
//! half-way through building it) releases everything. Rows that point into the file mapping borrow it:
//! their owner keeps the mapping alive for as long as they live.
use crate::abi::{engine_device_info, engine_placement};
pub use crate::abi::{engine_memory, engine_rows};
use crate::cuda::{self, DeviceBuffer, HostRegistration, PinnedBuffer, StagedUploader};
use crate::cudart as rt;
use crate::hostmem::{page_span, parallel_copy, read_ahead};
use crate::status::Result;
use crate::tensor::{self, DType};
use half::bf16;
use std::os::raw::c_void;
use std::sync::atomic::Ordering;

/// The counters of `cuda::MEMORY` as they are now.
pub fn memory_stats() -> engine_memory {
    let m = &cuda::MEMORY;
    engine_memory {
        device_bytes: m.device.load(Ordering::Relaxed),
        pinned_bytes: m.pinned.load(Ordering::Relaxed),
        registered_bytes: m.registered.load(Ordering::Relaxed),
        mapped_bytes: m.mapped.load(Ordering::Relaxed),
    }
}

/// The embedding table as it sits in the checkpoint's mapping.
#[derive(Clone, Copy, Debug)]
pub struct RowsSource<'a> {
    pub bytes: &'a [u8],
    pub dtype: DType,
    pub vocab: usize,
    pub cols: usize,
}

impl RowsSource<'_> {
    /// Row bytes, checked against the tensor's size.
    pub fn row_bytes(&self) -> Result<usize> {
        let rb = self.dtype.row_bytes(self.cols).ok_or_else(|| {
            crate::err!(BadModel, "embedding rows: {} columns are not whole {} blocks", self.cols, self.dtype.name())
        })?;
        if rb.checked_mul(self.vocab) != Some(self.bytes.len()) {
            crate::bail!(
                BadModel,
                "embedding rows: {} bytes for {} rows of {} {} values",
                self.bytes.len(),
                self.vocab,
                self.cols,
                self.dtype.name()
            );
        }
        Ok(rb)
    }
}

/// What holds the rows' memory; dropping it releases that memory.
#[allow(dead_code)] // the owners are held for their Drop
enum Holder {
    /// The file mapping itself, read by the host (CPU backend) or by a device with pageable access.
    Mapping,
    Device(DeviceBuffer),
    Pinned(PinnedBuffer),
    Registered(HostRegistration),
}

/// The embedding rows in one placement, and the pointers that read them.
pub struct Rows {
    holder: Holder,
    placement: engine_placement,
    device_usable: bool,
    data: *const c_void,
    host: *const u8,
    dtype: DType,
    vocab: usize,
    cols: usize,
    row_bytes: usize,
}

// SAFETY: the pointers are owned by `holder` or point into a mapping the engine keeps alive, and
// nothing writes through them; the owners in `holder` are Send themselves.
unsafe impl Send for Rows {}
// SAFETY: `&self` only reads the rows (or hands their addresses to kernels that read them).
unsafe impl Sync for Rows {}

impl Rows {
    /// Rows of `src`'s format and shape, owned by `holder`, read by kernels at `data` (or only by the
    /// host, when `device_usable` is false). The host view follows from where the holder keeps them.
    fn of(
        src: &RowsSource,
        row_bytes: usize,
        holder: Holder,
        placement: engine_placement,
        device_usable: bool,
        data: *const c_void,
    ) -> Rows {
        let host = match &holder {
            Holder::Device(_) => std::ptr::null(),
            Holder::Pinned(buf) => buf.host_ptr() as *const u8,
            Holder::Mapping | Holder::Registered(_) => src.bytes.as_ptr(),
        };
        Rows {
            holder,
            placement,
            device_usable,
            data,
            host,
            dtype: src.dtype,
            vocab: src.vocab,
            cols: src.cols,
            row_bytes,
        }
    }

    /// Rows the CPU backend reads straight from the mapping; nothing is allocated.
    ///
    /// # Safety
    /// The mapping behind `src.bytes` must outlive the returned `Rows`.
    pub unsafe fn in_mapping(src: &RowsSource) -> Result<Rows> {
        let row_bytes = src.row_bytes()?;
        let data = src.bytes.as_ptr() as *const c_void;
        Ok(Self::of(src, row_bytes, Holder::Mapping, engine_placement::FileMapped, false, data))
    }

    /// The rows in device memory, copied from the mapping.
    pub fn on_device(src: &RowsSource) -> Result<Rows> {
        let row_bytes = src.row_bytes()?;
        read_ahead(src.bytes);
        let buf = DeviceBuffer::new(src.bytes.len())?;
        StagedUploader::new()?.upload(&buf, 0, src.bytes)?;
        let data = buf.ptr() as *const c_void;
        Ok(Self::of(src, row_bytes, Holder::Device(buf), engine_placement::Device, true, data))
    }

    /// The rows in pinned, device-mapped host memory, copied from the mapping.
    pub fn host_mapped(src: &RowsSource) -> Result<Rows> {
        let row_bytes = src.row_bytes()?;
        read_ahead(src.bytes);
        let mut buf = PinnedBuffer::new_mapped(src.bytes.len())?;
        parallel_copy(&mut buf.as_mut_slice()[..src.bytes.len()], src.bytes);
        let data = buf.device_ptr() as *const c_void;
        Ok(Self::of(src, row_bytes, Holder::Pinned(buf), engine_placement::HostMapped, true, data))
    }

    /// The rows read in place from the file mapping by device `info`; falls back to `host_mapped`
    /// (saying why through `log`) where the device cannot read a read-only file mapping.
    ///
    /// # Safety
    /// The mapping behind `src.bytes` must outlive the returned `Rows`.
    pub unsafe fn file_mapped(src: &RowsSource, info: &engine_device_info, log: &dyn Fn(&str)) -> Result<Rows> {
        let row_bytes = src.row_bytes()?;
        read_ahead(src.bytes);
        let host = src.bytes.as_ptr();
        let rows = |holder, data| Self::of(src, row_bytes, holder, engine_placement::FileMapped, true, data);
        if info.pageable_memory_access {
            return Ok(rows(Holder::Mapping, host as *const c_void));
        }
        if !info.host_register_supported || !info.host_register_read_only_supported {
            log(&format!(
                "embedding rows copied to pinned host memory: the device cannot register a read-only file mapping (hostRegisterSupported {}, hostRegisterReadOnlySupported {})",
                info.host_register_supported as u8, info.host_register_read_only_supported as u8
            ));
            return Self::host_mapped(src);
        }
        let (start, len) = page_span(src.bytes);
        let flags = rt::cudaHostRegisterMapped | rt::cudaHostRegisterReadOnly | rt::cudaHostRegisterPortable;
        // SAFETY: the span covers the caller's mapping, which outlives the rows (see this function's contract).
        match unsafe { HostRegistration::new(start, len, flags) } {
            Ok(reg) => {
                let offset = host as usize - start as usize;
                // SAFETY: the registration covers `[start, start + len)`, which holds the rows at `offset`.
                let data = unsafe { (reg.device_ptr() as *const u8).add(offset) } as *const c_void;
                Ok(rows(Holder::Registered(reg), data))
            }
            Err(e) if e.status == crate::Status::CudaError => {
                log(&format!(
                    "embedding rows copied to pinned host memory: registering the file mapping failed ({})",
                    e.message
                ));
                // A failed registration can leave its error for the next launch check to find.
                // SAFETY: takes no arguments; reads and clears the runtime's last error.
                unsafe { rt::cudaGetLastError() };
                Self::host_mapped(src)
            }
            Err(e) => Err(e),
        }
    }

    pub fn placement(&self) -> engine_placement {
        self.placement
    }

    /// True when the rows were registered by this library (not borrowed from an earlier registration).
    pub fn registration_owned(&self) -> Option<bool> {
        match &self.holder {
            Holder::Registered(r) => Some(r.owned()),
            _ => None,
        }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    pub fn bytes(&self) -> usize {
        self.row_bytes * self.vocab
    }

    /// False for the CPU backend's rows.
    pub fn device_usable(&self) -> bool {
        self.device_usable
    }

    /// The device-usable pointer to rows in host memory; NULL when they are on the card or no device reads them.
    pub fn host_embed_ptr(&self) -> *const c_void {
        match self.placement {
            engine_placement::Device => std::ptr::null(),
            _ if !self.device_usable => std::ptr::null(),
            _ => self.data,
        }
    }

    /// The C view of these rows.
    pub fn describe(&self) -> engine_rows {
        engine_rows {
            data: self.data,
            host_data: self.host as *const c_void,
            dtype: self.dtype,
            placement: self.placement,
            device_usable: self.device_usable,
            row_bytes: self.row_bytes as u64,
            rows: self.vocab as u64,
            cols: self.cols as u64,
        }
    }

    /// Gathers rows on the device: `ids` and `out` are device pointers, launched on `stream`.
    /// Ids outside the vocabulary are not read; their rows are zeros and `*bad` (device-writable) is set.
    ///
    /// # Safety
    /// `ids` must hold `n` ints and `out` room for `n` rows of `cols` values in `out_dtype`, both
    /// readable/writable by the device on `stream`, and `bad` one device-writable int.
    pub unsafe fn gather_device(
        &self,
        ids: *const i32,
        n: usize,
        out: *mut c_void,
        out_dtype: DType,
        bad: *mut i32,
        stream: rt::cudaStream_t,
    ) -> Result<()> {
        if !self.device_usable {
            crate::bail!(Unsupported, "the rows are on the CPU backend; no device reads them");
        }
        check_out_dtype(out_dtype)?;
        let n = u32::try_from(n)
            .map_err(|_| crate::err!(InvalidArgument, "{n} ids in one gather (at most {})", u32::MAX))?;
        // SAFETY: `data` is the device-readable rows this owner keeps alive, `vocab` rows of `cols` in
        // `dtype`; `ids`, `out` and `bad` are the device memory this function's contract asks for.
        let code = unsafe {
            crate::kernels::hostembed_embed_gather(
                self.data,
                self.dtype as i32,
                self.vocab as u32,
                self.cols as u32,
                ids,
                n,
                out,
                out_dtype as i32,
                bad,
                stream,
            )
        };
        cuda::check(code, "hostembed_embed_gather")
    }

    /// Gathers rows on the host into `out` (`ids.len()` rows of `cols` values in `out_dtype`);
    /// OUT_OF_RANGE for any id outside the vocabulary, with nothing written.
    pub fn gather_host(&self, ids: &[i32], out: &mut [u8], out_dtype: DType) -> Result<()> {
        check_out_dtype(out_dtype)?;
        if self.host.is_null() {
            crate::bail!(Unsupported, "the rows are on the card; gather them with the device");
        }
        let size = if out_dtype == DType::F32 { 4 } else { 2 };
        if out.len() != ids.len() * self.cols * size {
            crate::bail!(
                InvalidArgument,
                "output of {} bytes for {} rows of {} values",
                out.len(),
                ids.len(),
                self.cols
            );
        }
        if let Some(bad) = ids.iter().find(|&&id| id < 0 || id as usize >= self.vocab) {
            crate::bail!(OutOfRange, "token id {bad} is outside the vocabulary (0..{})", self.vocab);
        }
        let mut values = vec![0f32; self.cols];
        for (&id, o) in ids.iter().zip(out.chunks_exact_mut(self.cols * size)) {
            // SAFETY: `host` is non-NULL (checked) and holds `vocab` rows of `row_bytes` that outlive self; `id < vocab`.
            let row =
                unsafe { std::slice::from_raw_parts(self.host.add(id as usize * self.row_bytes), self.row_bytes) };
            tensor::decode_row(self.dtype, row, &mut values);
            if out_dtype == DType::F32 {
                o.chunks_exact_mut(4).zip(&values).for_each(|(d, v)| d.copy_from_slice(&v.to_le_bytes()));
            } else {
                o.chunks_exact_mut(2)
                    .zip(&values)
                    .for_each(|(d, v)| d.copy_from_slice(&bf16::from_f32(*v).to_le_bytes()));
            }
        }
        Ok(())
    }
}

fn check_out_dtype(out_dtype: DType) -> Result<()> {
    match out_dtype {
        DType::F32 | DType::Bf16 => Ok(()),
        other => crate::bail!(InvalidArgument, "gather output in {}: only F32 and BF16 are written", other.name()),
    }
}
