//! The CPU's KV memory: pages of K and V rows in the engine's cache types, one pool for an engine's
//! streams or a pool of its own for a stream made by `CpuModel::new_stream`.

use super::PAGE_TOKENS;
use super::attention::KvRows;
use crate::backend::KvStream;
use crate::kv::KvTypes;
use crate::model::ModelConfig;
use crate::status::Result;
use crate::{bail, err};

/// KV memory in pages of `PAGE_TOKENS` positions, each holding every layer's K and V rows:
/// [page][layer][K rows, V rows], each PAGE_TOKENS rows of kv_heads heads, a head's row as its type
/// stores it (`KvType::encode`). K and V are rounded to their types once, when written. Fresh pages
/// are zero pages the host has not touched yet, so a pool costs memory only as streams fill it.
pub struct KvPages {
    /// The pages' bytes, kept in f32s so that F32 rows (whose offsets are all multiples of 4) read as
    /// aligned floats.
    pub(super) data: Vec<f32>,
    pub(super) layers: usize,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
    pub(super) kv: KvTypes,
    /// Bytes of one position's K row and of its V row (every head).
    pub(super) row: [usize; 2],
    pub(super) pages: usize,
}

impl KvPages {
    /// `pages` pages of f32 K and V for the model `cfg`; NO_ROOM when the host cannot give them.
    pub fn new(cfg: &ModelConfig, pages: usize) -> Result<KvPages> {
        Self::with_types(cfg, pages, KvTypes::CPU_DEFAULT)
    }

    /// `pages` pages of K and V in `kv`'s types; UNSUPPORTED when a type cannot hold the model's heads,
    /// NO_ROOM when the host cannot give them.
    pub fn with_types(cfg: &ModelConfig, pages: usize, kv: KvTypes) -> Result<KvPages> {
        kv.check(cfg)?;
        let row = [kv.k, kv.v].map(|t| cfg.kv_heads * t.row_bytes(cfg.head_dim));
        let len = (PAGE_TOKENS * (row[0] + row[1]))
            .checked_mul(cfg.layers)
            .and_then(|page| page.checked_mul(pages))
            .ok_or_else(|| err!(NoRoom, "a KV pool of {pages} pages overflows the address space"))?;
        let data = zeroed_f32(len.div_ceil(4))?;
        Ok(KvPages { data, layers: cfg.layers, kv_heads: cfg.kv_heads, head_dim: cfg.head_dim, kv, row, pages })
    }

    pub fn pages(&self) -> usize {
        self.pages
    }

    /// The K and V types the pages store.
    pub fn kv_types(&self) -> KvTypes {
        self.kv
    }

    /// Bytes the pages hold.
    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }

    fn data(&self) -> &[u8] {
        // SAFETY: the f32 storage read as its bytes: u8 has no alignment, f32 no padding.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr() as *const u8, self.data.len() * 4) }
    }

    fn data_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `data`; every byte pattern written is a valid f32, and the borrow is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.data.as_mut_ptr() as *mut u8, self.data.len() * 4) }
    }

    /// Bytes of one layer's K (`which` 0) or V (1) rows in a page.
    fn block(&self, which: usize) -> usize {
        PAGE_TOKENS * self.row[which]
    }

    /// Where page `page`'s K (`which` 0) or V (1) rows of `layer` start.
    fn at(&self, page: u32, layer: usize, which: usize) -> usize {
        (page as usize * self.layers + layer) * (self.block(0) + self.block(1)) + which * self.block(0)
    }

    /// Page `page`'s K (`which` 0) or V (1) rows of `layer`.
    fn rows(&self, page: u32, layer: usize, which: usize) -> &[u8] {
        let at = self.at(page, layer, which);
        &self.data()[at..at + self.block(which)]
    }

    /// Copies page `from`'s rows of every layer into page `to`.
    pub fn copy_page(&mut self, from: u32, to: u32) {
        assert!((from as usize) < self.pages && (to as usize) < self.pages, "a page outside the pool");
        let bytes = self.layers * (self.block(0) + self.block(1));
        let (src, dst) = (self.at(from, 0, 0), self.at(to, 0, 0));
        self.data_mut().copy_within(src..src + bytes, dst);
    }

    /// Writes `values` (kv_heads x head_dim) as the K (`which` 0) or V (1) row of `layer` at position `pos`
    /// of a stream holding `pages`, rounded to its type.
    pub(super) fn store(&mut self, pages: &[u32], pos: usize, layer: usize, which: usize, values: &[f32]) {
        let at = self.at(pages[pos / PAGE_TOKENS], layer, which) + (pos % PAGE_TOKENS) * self.row[which];
        let ty = if which == 0 { self.kv.k } else { self.kv.v };
        let (row_bytes, head_dim) = (self.row[which], self.head_dim);
        let row = &mut self.data_mut()[at..at + row_bytes];
        let head_bytes = ty.row_bytes(head_dim);
        for (head, out) in values.chunks_exact(head_dim).zip(row.chunks_exact_mut(head_bytes)) {
            ty.encode(head, out);
        }
    }

    /// One layer's K or V rows of a stream holding `pages`, for its first `positions` positions.
    pub(super) fn stream_rows(&self, pages: &[u32], positions: usize, layer: usize, which: usize) -> KvRows<'_> {
        let pages = pages[..positions.div_ceil(PAGE_TOKENS)].iter().map(|&p| self.rows(p, layer, which)).collect();
        let ty = if which == 0 { self.kv.k } else { self.kv.v };
        KvRows { pages, page_tokens: PAGE_TOKENS, ty, kv_heads: self.kv_heads, head_dim: self.head_dim }
    }
}

/// A CPU stream's own KV memory: the pages of a stream made by `CpuModel::new_stream`, outside any
/// pool; None for an engine's streams, whose pages are in the backend's pool.
pub struct CpuCache {
    pub(super) own: Option<KvPages>,
}

pub type CpuStream = KvStream<CpuCache>;

/// `len` zeros, or NO_ROOM when the allocator refuses; fresh zeroed pages are only touched when written.
fn zeroed_f32(len: usize) -> Result<Vec<f32>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<f32>(len)
        .map_err(|_| err!(NoRoom, "a KV cache of {len} floats overflows the address space"))?;
    // SAFETY: the layout's size is not zero (len > 0).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut f32;
    if ptr.is_null() {
        bail!(NoRoom, "the host has no room for a KV cache of {} bytes", layout.size());
    }
    // SAFETY: `ptr` comes from the global allocator with Vec's layout for `len` f32s, all zero bits.
    Ok(unsafe { Vec::from_raw_parts(ptr, len, len) })
}
