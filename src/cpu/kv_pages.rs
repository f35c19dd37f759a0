//! The CPU's KV memory: pages of K and V rows in the engine's cache types, one pool for an engine's
//! streams or a pool of its own for a stream made by `CpuModel::new_stream`.

use super::PAGE_TOKENS;
use super::attention::KvRows;
use crate::backend::{KvStream, NO_PAGE};
use crate::kv::KvTypes;
use crate::model::ModelConfig;
use crate::status::Result;
use crate::{bail, err};

/// KV memory in pages of `PAGE_TOKENS` positions, each holding every layer's K and V rows:
/// [page][layer][K rows, V rows], each PAGE_TOKENS rows of kv_heads heads, a head's row as its type
/// stores it (`KvType::encode`). With a local layers' pool (`with_local`) the sliding-window layers'
/// rows are in pages of their own, laid out the same over those layers alone, which a stream names in
/// its `local` list. K and V are rounded to their types once, when written. Fresh pages are zero pages
/// the host has not touched yet, so a pool costs memory only as streams fill them.
pub struct KvPages {
    main: Region,
    local: Option<Region>,
    /// Each model layer's pool (true: the local one) and its place among that pool's layers.
    slot: Vec<(bool, usize)>,
    pub(super) layers: usize,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
    pub(super) kv: KvTypes,
    /// Bytes of one position's K row and of its V row (every head).
    pub(super) row: [usize; 2],
}

/// One pool's pages: `layers` layers' K and V rows a page.
struct Region {
    /// The pages' bytes, kept in f32s so that F32 rows (whose offsets are all multiples of 4) read as
    /// aligned floats.
    data: Vec<f32>,
    layers: usize,
    pages: usize,
}

impl Region {
    fn new(layers: usize, pages: usize, row: [usize; 2]) -> Result<Region> {
        let len = (PAGE_TOKENS * (row[0] + row[1]))
            .checked_mul(layers)
            .and_then(|page| page.checked_mul(pages))
            .ok_or_else(|| err!(NoRoom, "a KV pool of {pages} pages overflows the address space"))?;
        Ok(Region { data: zeroed_f32(len.div_ceil(4))?, layers, pages })
    }

    fn data(&self) -> &[u8] {
        // SAFETY: the f32 storage read as its bytes: u8 has no alignment, f32 no padding.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr() as *const u8, self.data.len() * 4) }
    }

    fn data_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `data`; every byte pattern written is a valid f32, and the borrow is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.data.as_mut_ptr() as *mut u8, self.data.len() * 4) }
    }
}

impl KvPages {
    /// `pages` pages of f32 K and V for the model `cfg`; NO_ROOM when the host cannot give them.
    pub fn new(cfg: &ModelConfig, pages: usize) -> Result<KvPages> {
        Self::with_types(cfg, pages, KvTypes::CPU_DEFAULT)
    }

    /// `pages` pages of K and V in `kv`'s types; UNSUPPORTED when a type cannot hold the model's heads,
    /// NO_ROOM when the host cannot give them.
    pub fn with_types(cfg: &ModelConfig, pages: usize, kv: KvTypes) -> Result<KvPages> {
        Self::with_local(cfg, pages, None, kv)
    }

    /// `with_types` with the sliding-window layers' rows in a pool of `local` pages of their own (when
    /// given and the model has such layers).
    pub fn with_local(cfg: &ModelConfig, pages: usize, local: Option<usize>, kv: KvTypes) -> Result<KvPages> {
        kv.check(cfg)?;
        let row = [kv.k, kv.v].map(|t| cfg.kv_heads * t.row_bytes(cfg.head_dim));
        let apart = |l: usize| local.is_some() && cfg.attention.window(l).is_some();
        let mut counts = [0usize; 2];
        let slot = (0..cfg.layers)
            .map(|l| {
                let here = apart(l);
                counts[here as usize] += 1;
                (here, counts[here as usize] - 1)
            })
            .collect();
        let main = Region::new(counts[0], pages, row)?;
        let local = match local {
            Some(n) if counts[1] > 0 => Some(Region::new(counts[1], n, row)?),
            _ => None,
        };
        Ok(KvPages { main, local, slot, layers: cfg.layers, kv_heads: cfg.kv_heads, head_dim: cfg.head_dim, kv, row })
    }

    /// Pages of the pool every layer not kept apart is in.
    pub fn pages(&self) -> usize {
        self.main.pages
    }

    /// Pages of the sliding-window layers' pool; None when those layers are in the main one.
    pub fn local_pages(&self) -> Option<usize> {
        self.local.as_ref().map(|r| r.pages)
    }

    /// The K and V types the pages store.
    pub fn kv_types(&self) -> KvTypes {
        self.kv
    }

    /// Bytes the pages hold.
    pub fn bytes(&self) -> usize {
        (self.main.data.len() + self.local.as_ref().map_or(0, |r| r.data.len())) * 4
    }

    /// Bytes of one layer's K (`which` 0) or V (1) rows in a page.
    fn block(&self, which: usize) -> usize {
        PAGE_TOKENS * self.row[which]
    }

    /// The pool `layer` is in, its place among that pool's layers, and of the two page lists of a
    /// stream (`main`, `local`) the one naming that pool's pages.
    fn region<'s>(&self, layer: usize, main: &'s [u32], local: &'s [u32]) -> (&Region, usize, &'s [u32]) {
        match self.slot[layer] {
            (true, i) => (self.local.as_ref().expect("a layer kept apart"), i, local),
            (false, i) => (&self.main, i, main),
        }
    }

    /// Where page `page`'s K (`which` 0) or V (1) rows of a region's layer `i` start.
    fn at(&self, region: &Region, page: u32, i: usize, which: usize) -> usize {
        (page as usize * region.layers + i) * (self.block(0) + self.block(1)) + which * self.block(0)
    }

    /// Copies page `from`'s rows of every layer of the main pool (`local` false) or the local one into
    /// page `to`.
    pub fn copy_page(&mut self, local: bool, from: u32, to: u32) {
        let per_page = self.block(0) + self.block(1);
        let region = if local { self.local.as_mut().expect("a local layers' pool") } else { &mut self.main };
        assert!((from as usize) < region.pages && (to as usize) < region.pages, "a page outside the pool");
        let bytes = region.layers * per_page;
        let (src, dst) = (from as usize * bytes, to as usize * bytes);
        region.data_mut().copy_within(src..src + bytes, dst);
    }

    /// Writes `values` (kv_heads x head_dim) as the K (`which` 0) or V (1) row of `layer` at position `pos`
    /// of a stream holding `pages` (and `local` pages of the local layers' pool), rounded to its type.
    pub(super) fn store(
        &mut self,
        pages: &[u32],
        local: &[u32],
        pos: usize,
        layer: usize,
        which: usize,
        values: &[f32],
    ) {
        let (region, i, list) = self.region(layer, pages, local);
        let at = self.at(region, list[pos / PAGE_TOKENS], i, which) + (pos % PAGE_TOKENS) * self.row[which];
        let ty = if which == 0 { self.kv.k } else { self.kv.v };
        let (row_bytes, head_dim) = (self.row[which], self.head_dim);
        let region = if self.slot[layer].0 { self.local.as_mut().expect("a layer kept apart") } else { &mut self.main };
        let row = &mut region.data_mut()[at..at + row_bytes];
        let head_bytes = ty.row_bytes(head_dim);
        for (head, out) in values.chunks_exact(head_dim).zip(row.chunks_exact_mut(head_bytes)) {
            ty.encode(head, out);
        }
    }

    /// One layer's K or V rows of a stream holding `pages` (and `local` pages of the local layers'
    /// pool), for its first `positions` positions; a released local page (`NO_PAGE`) reads as no rows.
    pub(super) fn stream_rows(
        &self,
        pages: &[u32],
        local: &[u32],
        positions: usize,
        layer: usize,
        which: usize,
    ) -> KvRows<'_> {
        let (region, i, list) = self.region(layer, pages, local);
        let block = self.block(which);
        let pages = list[..positions.div_ceil(PAGE_TOKENS)]
            .iter()
            .map(|&p| match p {
                NO_PAGE => &[][..],
                p => &region.data()[self.at(region, p, i, which)..][..block],
            })
            .collect();
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
