//! The paged KV cache on the device: every stream's K and V live in pages of one pool allocation
//! (`GpuModel::pool`, laid out as `kernels/hostembed_kernels.cuh` says at `HE_PAGE_TOKENS`, in the KV
//! cache types `PageLayout` describes), and each
//! stream keeps a device copy of its page table that the kernels read per token. The engine's
//! `PagePool` decides which pages a stream holds; this module mirrors `KvStream::pages` into the
//! device table before a step reads it, uploading only the entries that changed, so a captured graph
//! (which holds the table's address, not its contents) never needs capturing again.

use std::os::raw::{c_uint, c_void};

use super::GpuModel;
use crate::backend::{KvStream, NO_PAGE};
use crate::bail;
use crate::cuda::{self, DeviceBuffer};
use crate::cudart as rt;
use crate::kernels as kn;
use crate::kv::{self, KvType, KvTypes};
use crate::model::ModelConfig;
use crate::status::{Error, Result};

/// Positions in one KV page (the kernels' `HE_PAGE_TOKENS`; `load` checks that they agree).
pub const PAGE_TOKENS: usize = 16;

/// How one page of one layer's pool holds K and V, as the kernels read it: the K slab of every kv head,
/// then the V slab of every kv head. A slab is `PAGE_TOKENS` rows of one head's `head_dim` values in
/// its type (2 bytes a value for BF16 and F16, 4 for F32); for the block types (Q8_0, FP8_E4M3) the
/// rows are one-byte codes, followed by the slab's f16 scales, [PAGE_TOKENS][head_dim / 32]. Every slab
/// is a multiple of 16 bytes (head_dim a multiple of 8, of 32 for the block types), so rows load in
/// 16-byte pieces. A layer's pool is `pages` pages one after the other, the layers one after the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageLayout {
    pub kv: KvTypes,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl PageLayout {
    pub fn new(cfg: &ModelConfig, kv: KvTypes) -> PageLayout {
        PageLayout { kv, kv_heads: cfg.kv_heads, head_dim: cfg.head_dim }
    }

    fn ty(&self, v: bool) -> KvType {
        if v { self.kv.v } else { self.kv.k }
    }

    /// Bytes of one head's K (`v` false) or V slab.
    pub fn slab_bytes(&self, v: bool) -> usize {
        PAGE_TOKENS * self.ty(v).row_bytes(self.head_dim)
    }

    /// Bytes of one page of one layer.
    pub fn page_bytes(&self) -> usize {
        self.kv_heads * (self.slab_bytes(false) + self.slab_bytes(true))
    }

    /// Where head `head`'s K or V slab starts in a page.
    pub fn slab_at(&self, v: bool, head: usize) -> usize {
        if v {
            self.kv_heads * self.slab_bytes(false) + head * self.slab_bytes(true)
        } else {
            head * self.slab_bytes(false)
        }
    }

    /// Writes `values` (one head's row) at slot `slot` of `page` (one page's bytes) as K or V, rounded to
    /// the type as the kernels round it.
    pub fn write_row(&self, page: &mut [u8], v: bool, head: usize, slot: usize, values: &[f32]) {
        let (ty, d) = (self.ty(v), self.head_dim);
        let mut row = vec![0u8; ty.row_bytes(d)];
        ty.encode(values, &mut row);
        let slab = &mut page[self.slab_at(v, head)..][..self.slab_bytes(v)];
        if !ty.is_block() {
            slab[slot * row.len()..(slot + 1) * row.len()].copy_from_slice(&row);
            return;
        }
        let blocks = d / kv::BLOCK_VALUES;
        for (b, block) in row.chunks_exact(kv::BLOCK_BYTES).enumerate() {
            let codes = slot * d + b * kv::BLOCK_VALUES;
            slab[codes..codes + kv::BLOCK_VALUES].copy_from_slice(&block[2..]);
            let scale = PAGE_TOKENS * d + (slot * blocks + b) * 2;
            slab[scale..scale + 2].copy_from_slice(&block[..2]);
        }
    }

    /// The values of one head's row at slot `slot` of `page`, as attention reads them.
    pub fn read_row(&self, page: &[u8], v: bool, head: usize, slot: usize) -> Vec<f32> {
        let (ty, d) = (self.ty(v), self.head_dim);
        let slab = &page[self.slab_at(v, head)..][..self.slab_bytes(v)];
        let mut row = vec![0u8; ty.row_bytes(d)];
        if ty.is_block() {
            let blocks = d / kv::BLOCK_VALUES;
            for (b, block) in row.chunks_exact_mut(kv::BLOCK_BYTES).enumerate() {
                let codes = slot * d + b * kv::BLOCK_VALUES;
                block[2..].copy_from_slice(&slab[codes..codes + kv::BLOCK_VALUES]);
                let scale = PAGE_TOKENS * d + (slot * blocks + b) * 2;
                block[..2].copy_from_slice(&slab[scale..scale + 2]);
            }
        } else {
            let n = row.len();
            row.copy_from_slice(&slab[slot * n..(slot + 1) * n]);
        }
        let mut out = vec![0f32; d];
        ty.decode(&row, &mut out);
        out
    }
}

/// What a CUDA stream keeps beside its pages: the device copies of its page tables.
pub struct GpuCache {
    table: DeviceTable,
    /// Its table of the local layers' pool, where the model keeps one.
    local: Option<DeviceTable>,
    pub(super) model_id: u64,
}

/// A device copy of a page table with room for a full window, and the entries it holds now.
struct DeviceTable {
    buf: DeviceBuffer,
    on_device: Vec<u32>,
}

// SAFETY: the cache owns its allocations; device memory may be used from any thread.
unsafe impl Send for GpuCache {}

pub type GpuStream = KvStream<GpuCache>;

impl GpuStream {
    /// Device bytes this stream holds apart from its pages: its page tables.
    pub fn allocated_bytes(&self) -> u64 {
        (self.cache.table.buf.bytes() + self.cache.local.as_ref().map_or(0, |t| t.buf.bytes())) as u64
    }
}

impl GpuCache {
    /// The device address of the page table.
    pub(super) fn table_ptr(&self) -> *const c_uint {
        self.table.buf.ptr() as *const c_uint
    }

    /// The device address of the local layers' pool's page table; null without one.
    pub(super) fn local_table_ptr(&self) -> *const c_uint {
        self.local.as_ref().map_or(std::ptr::null(), |t| t.buf.ptr() as *const c_uint)
    }
}

impl DeviceTable {
    /// A table for `window` tokens' pages.
    fn new(window: usize) -> Result<DeviceTable> {
        let entries = window.div_ceil(PAGE_TOKENS);
        let buf = DeviceBuffer::new(entries * 4)
            .map_err(|e| Error::new(e.status, format!("the page table of a {window}-token window: {}", e.message)))?;
        Ok(DeviceTable { buf, on_device: Vec::new() })
    }

    /// Queues the upload of the entries of `pages` that differ from the device copy on `stream`;
    /// INVALID_ARGUMENT for more pages than the window's or an id outside a pool of `pool_pages`
    /// (`NO_PAGE`, a page given back, is kept: the kernels never read it).
    fn sync(&mut self, pages: &[u32], pool_pages: usize, stream: &crate::cuda::Stream) -> Result<()> {
        if pages.len() * 4 > self.buf.bytes() {
            bail!(
                InvalidArgument,
                "a stream holds {} pages, more than its window's {}",
                pages.len(),
                self.buf.bytes() / 4
            );
        }
        if let Some(&bad) = pages.iter().find(|&&p| p != NO_PAGE && p as usize >= pool_pages) {
            bail!(InvalidArgument, "page {bad} is outside the KV pool of {pool_pages} pages");
        }
        let same = pages.iter().zip(&self.on_device).take_while(|(a, b)| a == b).count();
        if same == pages.len() {
            self.on_device.truncate(same);
            return Ok(());
        }
        let fresh = &pages[same..];
        cuda::check(
            // SAFETY: the table holds room for every page of the window (checked above); pageable `fresh` is
            // staged before this returns, and the copy runs in stream order before any kernel that reads it.
            unsafe {
                rt::cudaMemcpyAsync(
                    (self.buf.ptr() as *mut u8).wrapping_add(same * 4) as *mut c_void,
                    fresh.as_ptr() as *const c_void,
                    std::mem::size_of_val(fresh),
                    rt::cudaMemcpyHostToDevice,
                    stream.raw(),
                )
            },
            "cudaMemcpyAsync(page table)",
        )?;
        self.on_device.truncate(same);
        self.on_device.extend_from_slice(fresh);
        Ok(())
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
    /// A stream with no positions and no pages, with a device page table for `window` tokens (and one
    /// of the local layers' pool where the model keeps one).
    pub fn new_stream(&self, window: usize) -> Result<GpuStream> {
        if window == 0 || window > i32::MAX as usize {
            bail!(InvalidArgument, "a window of {window} tokens is outside 1..={}", i32::MAX);
        }
        let table = DeviceTable::new(window)?;
        let local = if self.local_pages > 0 { Some(DeviceTable::new(window)?) } else { None };
        Ok(KvStream::new(GpuCache { table, local, model_id: self.id }, window))
    }

    /// Queues a copy of pool page `from`'s K and V into page `to`, every layer of the main pool (`local`
    /// false) or of the local layers' pool (copy on write): stream order puts it before any later
    /// step's reads and writes.
    pub fn copy_pool_page(&self, local: bool, from: u32, to: u32) -> Result<()> {
        let pages = if local { self.local_pages } else { self.pool_pages };
        if from as usize >= pages || to as usize >= pages {
            bail!(InvalidArgument, "pages {from} and {to}: the KV pool has {pages}");
        }
        let page = self.page.page_bytes();
        for l in (0..self.cfg.layers).filter(|&l| self.layer_region(l).2 == local) {
            let (region, _, _) = self.layer_region(l);
            let (src, dst) = (from as usize * page, to as usize * page);
            cuda::check(
                // SAFETY: both pages lie inside the layer's region of the pool allocation (ids checked
                // above), distinct pages do not overlap, and the copy runs in stream order with every
                // kernel that reads the pool.
                unsafe {
                    rt::cudaMemcpyAsync(
                        region.wrapping_add(dst) as *mut c_void,
                        region.wrapping_add(src) as *const c_void,
                        page,
                        rt::cudaMemcpyDeviceToDevice,
                        self.stream.raw(),
                    )
                },
                "cudaMemcpyAsync(KV page)",
            )?;
        }
        Ok(())
    }

    /// `copy_pool_page` of the main pool.
    pub fn copy_page(&self, from: u32, to: u32) -> Result<()> {
        self.copy_pool_page(false, from, to)
    }

    /// Queues the upload of the entries of `stream`'s page tables that differ from the device copies.
    pub(super) fn sync_table(&self, stream: &mut GpuStream) -> Result<()> {
        stream.cache.table.sync(&stream.pages, self.pool_pages, &self.stream)?;
        match stream.cache.local.as_mut() {
            Some(t) => t.sync(&stream.local, self.local_pages, &self.stream),
            None if self.local_pages > 0 => bail!(InvalidArgument, "the stream has no table of the local layers' pool"),
            None => Ok(()),
        }
    }
}
