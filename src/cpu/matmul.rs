//! The CPU backend's matrix product: out[t][r] = w[r] . x[t] for a batch of tokens over a weight in
//! any stored format, each dot as `tensor::dot` defines it (f32 lanes, fused multiply-adds in column
//! order, a fixed tree), so a token's result does not depend on the batch, the tiling, the threads or
//! the SIMD build. One token reads the rows as stored, four at a time, decoding in registers; a batch
//! decodes a tile of rows once (exactly: the same values) and dots it with every token. Rows are split
//! across threads.

use std::ops::Range;

use super::parallel::{run_parts, threads_for};
use crate::model::TensorRef;
use crate::tensor::dot::{Kernel, LANES, Vector};
use crate::tensor::{Simd, dot_rows_into};

/// Rows decoded and dotted together: ROW_TILE x TOKEN_TILE dots of LANES lanes side by side.
pub(super) const ROW_TILE: usize = 4;
/// Tokens dotted together with a decoded row tile.
pub(super) const TOKEN_TILE: usize = 2;

/// What one thread needs for a batch's product: `ROW_TILE` rows decoded to f32, for the widest weight.
pub(super) struct RowTile {
    pub(super) decoded: Vec<f32>,
}

impl RowTile {
    /// f32 values of a tile for weights of up to `cols` columns.
    pub(super) fn len(cols: usize) -> usize {
        ROW_TILE * cols
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

/// out[t][r] (= or +=) w[r] . x[t] for the `n` tokens of `x` (n rows of w.cols() values); `out` holds
/// n rows of w.rows() values. Rows are split over as many threads as the work is worth, up to one a
/// `RowTile`.
pub(super) fn matmul(w: &TensorRef, x: &[f32], n: usize, out: &mut [f32], mode: Write, tiles: &mut [RowTile]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(x.len(), n * cols, "matmul: input is not n tokens of the weight's columns");
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
    let simd = Simd::best();
    run_parts(parts, &mut tiles[..threads], |part, tile| part.run(w, x, mode, tile, simd));
}

/// A run of weight rows and, for each token, the slice of its output those rows fill.
struct Part<'o> {
    rows: Range<usize>,
    outs: Vec<&'o mut [f32]>,
}

impl Part<'_> {
    fn run(mut self, w: &TensorRef, x: &[f32], mode: Write, tile: &mut RowTile, simd: Simd) {
        let cols = w.cols();
        let row_bytes = w.dtype.row_bytes(cols).expect("matmul: row size invalid for the weight's format");
        let row = |r: usize| &w.bytes[r * row_bytes..(r + 1) * row_bytes];
        if let [out] = &mut self.outs[..] {
            // One token: the rows as stored, a group at a time.
            let mut dots = [0f32; ROW_TILE];
            for first in self.rows.clone().step_by(ROW_TILE) {
                let count = ROW_TILE.min(self.rows.end - first);
                let group: [&[u8]; ROW_TILE] = std::array::from_fn(|i| row(first + i.min(count - 1)));
                let dots = &mut dots[..count];
                dot_rows_into(w.dtype, simd, &group[..count], x, dots);
                store(dots, &mut out[first - self.rows.start..], mode);
            }
            return;
        }
        simd.run(BatchPart { part: self, w, x, mode, tile })
    }
}

/// A part of a batch's product: each tile of rows decoded once, then dotted with every token.
struct BatchPart<'p, 'o> {
    part: Part<'o>,
    w: &'p TensorRef<'p>,
    x: &'p [f32],
    mode: Write,
    tile: &'p mut RowTile,
}

impl Kernel for BatchPart<'_, '_> {
    type Output = ();

    #[inline(always)]
    unsafe fn run<V: Vector>(self) {
        let BatchPart { part: Part { rows, mut outs }, w, x, mode, tile } = self;
        let cols = w.cols();
        let row_bytes = w.dtype.row_bytes(cols).expect("matmul: row size invalid for the weight's format");
        let mut r = rows.start;
        while r < rows.end {
            let count = ROW_TILE.min(rows.end - r);
            let decoded = &mut tile.decoded[..count * cols];
            for (i, out) in decoded.chunks_exact_mut(cols).enumerate() {
                crate::tensor::decode_row(w.dtype, &w.bytes[(r + i) * row_bytes..(r + i + 1) * row_bytes], out);
            }
            let at = r - rows.start;
            // SAFETY: `Simd::run` runs this kernel inside V's build.
            unsafe {
                match count {
                    ROW_TILE => dot_tokens::<V, ROW_TILE>(decoded, cols, x, &mut outs, at, mode),
                    1 => dot_tokens::<V, 1>(decoded, cols, x, &mut outs, at, mode),
                    2 => dot_tokens::<V, 2>(decoded, cols, x, &mut outs, at, mode),
                    _ => dot_tokens::<V, 3>(decoded, cols, x, &mut outs, at, mode),
                }
            }
            r += count;
        }
    }
}

/// Dots `R` decoded rows with every token and writes the results at column `at` of `outs`.
///
/// # Safety
/// Inside V's build (see `Vector`).
#[inline(always)]
unsafe fn dot_tokens<V: Vector, const R: usize>(
    rows: &[f32],
    cols: usize,
    x: &[f32],
    outs: &mut [&mut [f32]],
    at: usize,
    mode: Write,
) {
    let rows: [&[f32]; R] = std::array::from_fn(|i| &rows[i * cols..(i + 1) * cols]);
    let mut tokens = x.chunks_exact(cols);
    let mut first = 0;
    while first < outs.len() {
        if outs.len() - first >= TOKEN_TILE {
            let xs: [&[f32]; TOKEN_TILE] = std::array::from_fn(|_| tokens.next().expect("one row of x a token"));
            // SAFETY: the caller runs this inside V's build.
            let acc = unsafe { dots::<V, R, TOKEN_TILE>(rows, xs) };
            for (j, out) in outs[first..first + TOKEN_TILE].iter_mut().enumerate() {
                store(&acc.map(|row| row[j]), &mut out[at..], mode);
            }
            first += TOKEN_TILE;
        } else {
            // SAFETY: the caller runs this inside V's build.
            let acc = unsafe { dots::<V, R, 1>(rows, [tokens.next().expect("one row of x a token")]) };
            store(&acc.map(|row| row[0]), &mut outs[first][at..], mode);
            first += 1;
        }
    }
}

/// The R x T dots of decoded rows with tokens: the lanes of `tensor::dot`, R x T chains side by side.
///
/// # Safety
/// Inside V's build (see `Vector`).
#[inline(always)]
unsafe fn dots<V: Vector, const R: usize, const T: usize>(rows: [&[f32]; R], xs: [&[f32]; T]) -> [[f32; T]; R] {
    let (row_chunks, x_chunks) = (rows.map(|r| r.as_chunks::<LANES>()), xs.map(|x| x.as_chunks::<LANES>()));
    let tail = LANES * row_chunks[0].0.len();
    // SAFETY: the caller runs this inside V's build.
    unsafe {
        let mut acc = [[V::zero(); T]; R];
        for k in 0..row_chunks[0].0.len() {
            let x: [V; T] = std::array::from_fn(|j| V::load(&x_chunks[j].0[k]));
            for (acc, (w, _)) in acc.iter_mut().zip(&row_chunks) {
                let w = V::load(&w[k]);
                for (acc, &x) in acc.iter_mut().zip(&x) {
                    *acc = acc.fma(w, x);
                }
            }
        }
        for (acc, (_, w_tail)) in acc.iter_mut().zip(&row_chunks) {
            for (acc, (_, x_tail)) in acc.iter_mut().zip(&x_chunks) {
                if !w_tail.is_empty() {
                    *acc = acc.fma_values(tail, w_tail, x_tail);
                }
            }
        }
        acc.map(|row| row.map(|lanes| lanes.sum()))
    }
}

/// Writes a group's dots into `out` (from its start).
#[inline(always)]
fn store(dots: &[f32], out: &mut [f32], mode: Write) {
    for (o, &v) in out.iter_mut().zip(dots) {
        match mode {
            Write::Set => *o = v,
            Write::Add => *o += v,
        }
    }
}
