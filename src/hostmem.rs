//! Host memory helpers the placements and the staged uploads share: page spans, read-ahead hints, and a
//! copy spread over several threads so page faults on a file mapping are taken by many cores at once.

use std::os::raw::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The page size, for aligning the spans given to madvise and cudaHostRegister.
pub fn page_size() -> usize {
    // SAFETY: sysconf reads a constant of the system and touches no memory of ours.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

/// The page-aligned span `[start, start + len)` that covers `bytes`.
pub fn page_span(bytes: &[u8]) -> (*mut c_void, usize) {
    let page = page_size();
    let start = bytes.as_ptr() as usize & !(page - 1);
    let end = (bytes.as_ptr() as usize + bytes.len()).div_ceil(page) * page;
    (start as *mut c_void, end - start)
}

/// Asks the kernel to read `bytes` ahead (a hint: a failure changes nothing but speed).
pub fn read_ahead(bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    let (start, len) = page_span(bytes);
    // SAFETY: madvise with WILLNEED only hints the kernel; the span covers pages of `bytes`.
    unsafe { libc::madvise(start, len, libc::MADV_WILLNEED) };
}

/// Threads `parallel_copy` uses: enough to keep memory bandwidth busy, not every core on big hosts.
pub fn copy_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(16)
}

/// Copies `src` into `dst` (same length) with `copy_threads()` threads taking 16 MiB pieces in turn,
/// so page faults on the source mapping are taken by many cores at once.
pub fn parallel_copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "parallel_copy: lengths differ");
    const PIECE: usize = 16 << 20;
    let threads = copy_threads().min(src.len().div_ceil(PIECE));
    if threads <= 1 {
        dst.copy_from_slice(src);
        return;
    }
    let pieces = src.len().div_ceil(PIECE);
    let next = AtomicUsize::new(0);
    let dst_addr = dst.as_mut_ptr() as usize;
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= pieces {
                        break;
                    }
                    let (start, end) = (i * PIECE, ((i + 1) * PIECE).min(src.len()));
                    // SAFETY: each piece index is taken by one thread only, so no two threads write one byte.
                    let d = unsafe { std::slice::from_raw_parts_mut((dst_addr as *mut u8).add(start), end - start) };
                    d.copy_from_slice(&src[start..end]);
                }
            });
        }
    });
}
