//! The CPU backend's matrix product: out[t][r] = sum_c w[r][c] * x[t][c] for a batch of tokens over a
//! weight in any stored format. Rows are decoded once per product, a tile at a time, and each tile is
//! dotted with every token; rows are split across threads. Every dot is one f64 sum from zero in
//! column order (products of f32 values, exact in f64), as the token-by-token matvec always formed
//! it, so a token's result does not depend on the batch, the tiling or the threads.

use std::ops::Range;

use super::parallel::{run_parts, threads_for};
use crate::model::TensorRef;

/// Rows decoded and dotted together: four accumulator chains per token hide the adds' latency.
pub(super) const ROW_TILE: usize = 4;
/// Tokens dotted together with each decoded row, side by side in the packed layout.
pub(super) const TOKEN_TILE: usize = 4;

/// What one thread needs for a product: `ROW_TILE` decoded rows, column-interleaved, and one row as
/// its format decodes it. Sized for the widest weight.
pub(super) struct RowTile {
    pub(super) rows: Vec<f64>,
    pub(super) decoded: Vec<f32>,
}

impl RowTile {
    /// f64 values of the tile, then f32 values of the decoded row, for weights of up to `cols` columns.
    pub(super) fn len(cols: usize) -> (usize, usize) {
        (ROW_TILE * cols, cols)
    }
}

/// `n` tokens of `cols` values, packed for the kernel: tiles of `TOKEN_TILE` tokens, column-major
/// within a tile (tile[c][j] = token j's value c), then the last tile of the `n % TOKEN_TILE` left.
pub(super) fn pack_tokens(x: &[f32], cols: usize, packed: &mut [f64]) {
    assert!(cols > 0 && x.len().is_multiple_of(cols), "pack_tokens: input is not whole tokens");
    let packed = &mut packed[..x.len()];
    for (tile, out) in x.chunks(TOKEN_TILE * cols).zip(packed.chunks_mut(TOKEN_TILE * cols)) {
        let tokens = tile.len() / cols;
        for (j, token) in tile.chunks_exact(cols).enumerate() {
            for (c, &v) in token.iter().enumerate() {
                out[c * tokens + j] = v as f64;
            }
        }
    }
}

/// How a product's result meets its output.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Write {
    /// out = w x
    Set,
    /// out += w x, rounded to f32 first: the residual add of a projection, as `add` forms it.
    Add,
}

/// out[t][r] (= or +=) w[r] . x[t] for the `n` tokens packed in `packed`; `out` holds n rows of
/// w.rows() values. Rows are split over as many threads as the work is worth, up to one a `RowTile`.
pub(super) fn matmul(w: &TensorRef, packed: &[f64], n: usize, out: &mut [f32], mode: Write, tiles: &mut [RowTile]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(packed.len(), n * cols, "matmul: packed input is not n tokens of the weight's columns");
    assert_eq!(out.len(), n * rows, "matmul: output is not n tokens of the weight's rows");
    let row_tiles = rows.div_ceil(ROW_TILE);
    let work = (rows as u64) * (cols as u64) * (n as u64);
    let threads = threads_for(work, row_tiles, tiles.len());
    // Two parts a thread, so a thread slowed by the host still leaves little for the others to wait on.
    let part_count = if threads == 1 { 1 } else { (2 * threads).min(row_tiles) };
    let bounds: Vec<usize> = (0..=part_count).map(|p| (p * row_tiles / part_count * ROW_TILE).min(rows)).collect();
    let mut parts: Vec<Part> =
        bounds.windows(2).map(|b| Part { rows: b[0]..b[1], outs: Vec::with_capacity(n) }).collect();
    for mut token_out in out.chunks_exact_mut(rows) {
        for part in parts.iter_mut() {
            let (mine, rest) = token_out.split_at_mut(part.rows.len());
            part.outs.push(mine);
            token_out = rest;
        }
    }
    run_parts(parts, &mut tiles[..threads], |part, tile| part.run(w, packed, n, mode, tile));
}

/// A run of weight rows and, for each token, the slice of its output those rows fill.
struct Part<'o> {
    rows: Range<usize>,
    outs: Vec<&'o mut [f32]>,
}

impl Part<'_> {
    fn run(self, w: &TensorRef, packed: &[f64], n: usize, mode: Write, tile: &mut RowTile) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: this CPU has AVX2, the one feature `run_avx2` is compiled for.
            return unsafe { self.run_avx2(w, packed, n, mode, tile) };
        }
        self.run_here(w, packed, n, mode, tile)
    }

    /// `run_here` compiled for AVX2: four f64 lanes a vector, the same operations in the same order
    /// (no fused multiply-add), so the same bits.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn run_avx2(self, w: &TensorRef, packed: &[f64], n: usize, mode: Write, tile: &mut RowTile) {
        self.run_here(w, packed, n, mode, tile)
    }

    #[inline(always)]
    fn run_here(mut self, w: &TensorRef, packed: &[f64], n: usize, mode: Write, tile: &mut RowTile) {
        let cols = w.cols();
        let row_bytes = w.dtype.row_bytes(cols).expect("matmul: row size invalid for the weight's format");
        let mut r = self.rows.start;
        while r < self.rows.end {
            let count = ROW_TILE.min(self.rows.end - r);
            let rows = &mut tile.rows[..count * cols];
            for i in 0..count {
                let decoded = &mut tile.decoded[..cols];
                crate::tensor::decode_row(w.dtype, &w.bytes[(r + i) * row_bytes..(r + i + 1) * row_bytes], decoded);
                for (c, &v) in decoded.iter().enumerate() {
                    rows[c * count + i] = v as f64;
                }
            }
            let at = r - self.rows.start;
            match count {
                ROW_TILE => dot_tokens::<ROW_TILE>(rows, cols, packed, n, &mut self.outs, at, mode),
                1 => dot_tokens::<1>(rows, cols, packed, n, &mut self.outs, at, mode),
                2 => dot_tokens::<2>(rows, cols, packed, n, &mut self.outs, at, mode),
                _ => dot_tokens::<3>(rows, cols, packed, n, &mut self.outs, at, mode),
            }
            r += count;
        }
    }
}

/// Dots `R` interleaved rows with every packed token and writes the results at column `at` of `outs`.
#[inline(always)]
fn dot_tokens<const R: usize>(
    rows: &[f64],
    cols: usize,
    packed: &[f64],
    n: usize,
    outs: &mut [&mut [f32]],
    at: usize,
    mode: Write,
) {
    let mut first = 0;
    for tile in packed.chunks(TOKEN_TILE * cols) {
        let tokens = tile.len() / cols;
        match tokens {
            TOKEN_TILE => store(dots::<R, TOKEN_TILE>(rows, tile), &mut outs[first..], at, mode),
            1 => store(dots::<R, 1>(rows, tile), &mut outs[first..], at, mode),
            2 => store(dots::<R, 2>(rows, tile), &mut outs[first..], at, mode),
            _ => store(dots::<R, 3>(rows, tile), &mut outs[first..], at, mode),
        }
        first += tokens;
    }
    debug_assert_eq!(first, n);
}

/// The R x T dots of a row tile with a token tile, each summed from zero in column order.
#[inline(always)]
fn dots<const R: usize, const T: usize>(rows: &[f64], tokens: &[f64]) -> [[f64; T]; R] {
    let mut acc = [[0f64; T]; R];
    for (w, x) in rows.chunks_exact(R).zip(tokens.chunks_exact(T)) {
        for i in 0..R {
            for j in 0..T {
                acc[i][j] += w[i] * x[j];
            }
        }
    }
    acc
}

#[inline(always)]
fn store<const R: usize, const T: usize>(acc: [[f64; T]; R], outs: &mut [&mut [f32]], at: usize, mode: Write) {
    for (j, out) in outs.iter_mut().take(T).enumerate() {
        for (i, row) in acc.iter().enumerate() {
            let v = row[j] as f32;
            match mode {
                Write::Set => out[at + i] = v,
                Write::Add => out[at + i] += v,
            }
        }
    }
}
