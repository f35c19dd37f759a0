//! The paged KV cache on the device: every stream's K and V live in pages of one pool allocation
//! (`GpuModel::pool`, laid out as `kernels/hostembed_kernels.cuh` says at `HE_PAGE_TOKENS`), and each
//! stream keeps a device copy of its page table that the kernels read per token. The engine's
//! `PagePool` decides which pages a stream holds; this module mirrors `KvStream::pages` into the
//! device table before a step reads it, uploading only the entries that changed, so a captured graph
//! (which holds the table's address, not its contents) never needs capturing again.

use std::os::raw::{c_uint, c_void};

use super::GpuModel;
use crate::backend::KvStream;
use crate::bail;
use crate::cuda::{self, DeviceBuffer};
use crate::cudart as rt;
use crate::kernels as kn;
use crate::status::{Error, Result};

/// Positions in one KV page (the kernels' `HE_PAGE_TOKENS`; `load` checks that they agree).
pub const PAGE_TOKENS: usize = 16;

/// What a CUDA stream keeps beside its pages: the device copy of its page table.
pub struct GpuCache {
    /// Page ids in position order, room for a full window.
    table: DeviceBuffer,
    /// The entries the device table holds now (a prefix of it).
    on_device: Vec<u32>,
    pub(super) model_id: u64,
}

// SAFETY: the cache owns its allocation; device memory may be used from any thread.
unsafe impl Send for GpuCache {}

pub type GpuStream = KvStream<GpuCache>;

impl GpuStream {
    /// Device bytes this stream holds apart from its pages: its page table.
    pub fn allocated_bytes(&self) -> u64 {
        self.cache.table.bytes() as u64
    }
}

impl GpuCache {
    /// The device address of the page table.
    pub(super) fn table_ptr(&self) -> *const c_uint {
        self.table.ptr() as *const c_uint
    }
}

/// Fails when the kernels were built with another page size than `PAGE_TOKENS`.
pub(super) fn check_page_tokens() -> Result<()> {
    let mut tokens: c_uint = 0;
    // SAFETY: writes one unsigned int through a valid pointer.
    cuda::check(unsafe { kn::hostembed_kv_page_tokens(&mut tokens) }, "hostembed_kv_page_tokens")?;
    if tokens as usize != PAGE_TOKENS {
        bail!(Unsupported, "the kernels use KV pages of {tokens} tokens, the host {PAGE_TOKENS}");
    }
    Ok(())
}

impl GpuModel {
    /// A stream with no positions and no pages, with a device page table for `window` tokens.
    pub fn new_stream(&self, window: usize) -> Result<GpuStream> {
        if window == 0 || window > i32::MAX as usize {
            bail!(InvalidArgument, "a window of {window} tokens is outside 1..={}", i32::MAX);
        }
        let entries = window.div_ceil(PAGE_TOKENS);
        let table = DeviceBuffer::new(entries * 4)
            .map_err(|e| Error::new(e.status, format!("the page table of a {window}-token window: {}", e.message)))?;
        Ok(KvStream::new(GpuCache { table, on_device: Vec::new(), model_id: self.id }, window))
    }

    /// Queues the upload of the entries of `stream`'s page table that differ from the device copy.
    pub(super) fn sync_table(&self, stream: &mut GpuStream) -> Result<()> {
        let pages = &stream.pages;
        let cache = &mut stream.cache;
        if pages.len() * 4 > cache.table.bytes() {
            bail!(
                InvalidArgument,
                "a stream holds {} pages, more than its window's {}",
                pages.len(),
                cache.table.bytes() / 4
            );
        }
        if let Some(&bad) = pages.iter().find(|&&p| p as usize >= self.pool_pages) {
            bail!(InvalidArgument, "page {bad} is outside the KV pool of {} pages", self.pool_pages);
        }
        let same = pages.iter().zip(&cache.on_device).take_while(|(a, b)| a == b).count();
        if same == pages.len() {
            cache.on_device.truncate(same);
            return Ok(());
        }
        let fresh = &pages[same..];
        cuda::check(
            // SAFETY: the table holds room for every page of the window (checked above); pageable `fresh` is
            // staged before this returns, and the copy runs in stream order before any kernel that reads it.
            unsafe {
                rt::cudaMemcpyAsync(
                    (cache.table.ptr() as *mut u8).wrapping_add(same * 4) as *mut c_void,
                    fresh.as_ptr() as *const c_void,
                    std::mem::size_of_val(fresh),
                    rt::cudaMemcpyHostToDevice,
                    self.stream.raw(),
                )
            },
            "cudaMemcpyAsync(page table)",
        )?;
        cache.on_device.truncate(same);
        cache.on_device.extend_from_slice(fresh);
        Ok(())
    }
}
