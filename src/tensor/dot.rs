//! Dot products of weight rows, as stored, with f32 activations: the one definition every CPU path
//! shares. Each stored value is decoded exactly to f32 (the value the format's `decode_block` gives),
//! value c of a row is multiply-added, fused with one rounding, into lane c % LANES of that row's
//! accumulator in column order, and the lanes are summed in a fixed halving tree.
//!
//! The loops are written once over [`Vector`], sixteen f32 lanes, and compiled for each build [`Simd`]
//! names: AVX-512, AVX2 with FMA and F16C (x86-64, chosen at run time), and the portable one (plain
//! arrays; on aarch64 the compiler vectorizes it with NEON, its baseline). Every build performs the
//! same operations in the same order, so every build, batch and thread count gives the same bits.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU8, Ordering};

use super::{DType, Format};

/// Accumulator lanes of one dot: one AVX-512 vector, two AVX2 vectors, four NEON vectors.
pub const LANES: usize = 16;
/// One row's lanes as values.
pub type Lanes = [f32; LANES];
/// The longest block a format's default `dot_lanes` decodes onto the stack.
pub const MAX_BLOCK_VALUES: usize = 256;

/// The lanes' total: lane l + lane l + 8, then l + 4, l + 2, l + 1.
#[inline(always)]
pub fn sum_lanes(acc: &Lanes) -> f32 {
    let mut v = *acc;
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            v[l] += v[l + width];
        }
        width /= 2;
    }
    v[0]
}

/// Sixteen f32 lanes in one build's registers. Every conversion is exact.
///
/// # Safety
/// Each method may use instructions of its build: call them only inside `Simd::run` of that build
/// (that is, from a `Kernel` that `Simd::run` runs with this vector type).
// The section above is every method's: each may be called only inside its vector's build.
#[allow(clippy::missing_safety_doc)]
pub trait Vector: Copy {
    unsafe fn zero() -> Self;
    unsafe fn splat(value: f32) -> Self;
    unsafe fn load(values: &[f32; LANES]) -> Self;
    /// Sixteen little-endian f32s.
    unsafe fn from_f32_bytes(bytes: &[u8; 4 * LANES]) -> Self;
    /// Sixteen little-endian IEEE binary16 values.
    unsafe fn from_f16_bytes(bytes: &[u8; 2 * LANES]) -> Self;
    /// Sixteen little-endian bfloat16 values.
    unsafe fn from_bf16_bytes(bytes: &[u8; 2 * LANES]) -> Self;
    /// Sixteen int8 values.
    unsafe fn from_i8_bytes(bytes: &[u8; LANES]) -> Self;
    /// Sixteen unsigned bytes.
    unsafe fn from_u8_bytes(bytes: &[u8; LANES]) -> Self;
    /// The low four bits of sixteen bytes, as values 0..=15.
    unsafe fn from_low_nibbles(bytes: &[u8; LANES]) -> Self;
    /// The high four bits of sixteen bytes, as values 0..=15.
    unsafe fn from_high_nibbles(bytes: &[u8; LANES]) -> Self;
    /// One little-endian IEEE binary16 value in every lane.
    unsafe fn splat_f16_bytes(bytes: [u8; 2]) -> Self;
    unsafe fn mul(self, other: Self) -> Self;
    unsafe fn add(self, other: Self) -> Self;
    /// self + w * x, fused (one rounding).
    unsafe fn fma(self, w: Self, x: Self) -> Self;
    unsafe fn to_array(self) -> Lanes;

    /// The lanes' total, in `sum_lanes`' order.
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        // SAFETY: the caller runs this inside this vector's build.
        sum_lanes(&unsafe { self.to_array() })
    }

    /// Lane l + w[k] * x[k] for values k = `col`.. of a row that fall in lane l = (col + k) % LANES.
    #[inline(always)]
    unsafe fn fma_values(self, col: usize, w: &[f32], x: &[f32]) -> Self {
        // SAFETY: the caller runs this inside this vector's build.
        unsafe {
            if col.is_multiple_of(LANES) && w.len().is_multiple_of(LANES) {
                let mut acc = self;
                for (w, x) in w.as_chunks::<LANES>().0.iter().zip(x.as_chunks::<LANES>().0) {
                    acc = acc.fma(Self::load(w), Self::load(x));
                }
                return acc;
            }
            let mut lanes = self.to_array();
            for (k, (&w, &x)) in w.iter().zip(x).enumerate() {
                let lane = (col + k) % LANES;
                lanes[lane] = w.mul_add(x, lanes[lane]);
            }
            Self::load(&lanes)
        }
    }
}

/// The portable build: plain arrays, one `mul_add` a lane.
#[derive(Clone, Copy)]
pub struct Portable(Lanes);

impl Vector for Portable {
    #[inline(always)]
    unsafe fn zero() -> Self {
        Portable([0.0; LANES])
    }
    #[inline(always)]
    unsafe fn splat(value: f32) -> Self {
        Portable([value; LANES])
    }
    #[inline(always)]
    unsafe fn load(values: &[f32; LANES]) -> Self {
        Portable(*values)
    }
    #[inline(always)]
    unsafe fn from_f32_bytes(bytes: &[u8; 4 * LANES]) -> Self {
        let b = bytes.as_chunks::<4>().0;
        Portable(std::array::from_fn(|l| f32::from_le_bytes(b[l])))
    }
    #[inline(always)]
    unsafe fn from_f16_bytes(bytes: &[u8; 2 * LANES]) -> Self {
        let b = bytes.as_chunks::<2>().0;
        Portable(std::array::from_fn(|l| f16_bits_to_f32(u16::from_le_bytes(b[l]))))
    }
    #[inline(always)]
    unsafe fn from_bf16_bytes(bytes: &[u8; 2 * LANES]) -> Self {
        let b = bytes.as_chunks::<2>().0;
        Portable(std::array::from_fn(|l| bf16_bits_to_f32(u16::from_le_bytes(b[l]))))
    }
    #[inline(always)]
    unsafe fn from_i8_bytes(bytes: &[u8; LANES]) -> Self {
        Portable(std::array::from_fn(|l| bytes[l] as i8 as f32))
    }
    #[inline(always)]
    unsafe fn from_u8_bytes(bytes: &[u8; LANES]) -> Self {
        Portable(std::array::from_fn(|l| bytes[l] as f32))
    }
    #[inline(always)]
    unsafe fn from_low_nibbles(bytes: &[u8; LANES]) -> Self {
        Portable(std::array::from_fn(|l| (bytes[l] & 0x0F) as f32))
    }
    #[inline(always)]
    unsafe fn from_high_nibbles(bytes: &[u8; LANES]) -> Self {
        Portable(std::array::from_fn(|l| (bytes[l] >> 4) as f32))
    }
    #[inline(always)]
    unsafe fn splat_f16_bytes(bytes: [u8; 2]) -> Self {
        Portable([f16_bits_to_f32(u16::from_le_bytes(bytes)); LANES])
    }
    #[inline(always)]
    unsafe fn mul(self, other: Self) -> Self {
        Portable(std::array::from_fn(|l| self.0[l] * other.0[l]))
    }
    #[inline(always)]
    unsafe fn add(self, other: Self) -> Self {
        Portable(std::array::from_fn(|l| self.0[l] + other.0[l]))
    }
    #[inline(always)]
    unsafe fn fma(self, w: Self, x: Self) -> Self {
        Portable(std::array::from_fn(|l| w.0[l].mul_add(x.0[l], self.0[l])))
    }
    #[inline(always)]
    unsafe fn to_array(self) -> Lanes {
        self.0
    }
}

#[cfg(target_arch = "x86_64")]
mod x86;

/// IEEE binary16 bits to f32, exactly, with no branch or table (so a row of them vectorizes): the
/// bits shifted into f32's fields and scaled by 2^112 (which also makes subnormals normal); infinities
/// and NaNs (quieted, as the F16C instruction does) are set apart.
#[inline(always)]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let magnitude = h & 0x7fff;
    let scaled = f32::from_bits(magnitude << 13) * f32::from_bits(0x7780_0000);
    let special = f32::from_bits(0x7f80_0000 | (magnitude << 13) | if magnitude > 0x7c00 { 0x0040_0000 } else { 0 });
    let v = if magnitude >= 0x7c00 { special } else { scaled };
    f32::from_bits(v.to_bits() | ((h & 0x8000) << 16))
}

/// bfloat16 bits to f32: the top half of its bits (every value, NaN payloads included, kept as is).
#[inline(always)]
pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Which build of the lane loops runs. Only made by detection, so holding one says this CPU runs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Simd(Level);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Level {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

/// The detected level: 0 until the first call, then 1 + its index in `Simd::available`.
static BEST: AtomicU8 = AtomicU8::new(0);

impl Simd {
    /// The portable build: every CPU runs it.
    pub fn portable() -> Simd {
        Simd(Level::Portable)
    }

    /// Every build this CPU runs, the portable one first and the widest last.
    pub fn available() -> Vec<Simd> {
        #[allow(unused_mut)]
        let mut all = vec![Simd(Level::Portable)];
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") && has!("f16c") {
                all.push(Simd(Level::Avx2));
                if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512dq") {
                    all.push(Simd(Level::Avx512));
                }
            }
        }
        all
    }

    /// The widest build this CPU runs (detected once).
    pub fn best() -> Simd {
        let known = BEST.load(Ordering::Relaxed);
        if known != 0 {
            return Simd::LEVELS[known as usize - 1];
        }
        let best = *Simd::available().last().expect("the portable build is always available");
        let index = Simd::LEVELS.iter().position(|&s| s == best).expect("every level is listed");
        BEST.store(index as u8 + 1, Ordering::Relaxed);
        best
    }

    /// Every level this target has a build of, narrowest first.
    const LEVELS: &[Simd] = &[
        Simd(Level::Portable),
        #[cfg(target_arch = "x86_64")]
        Simd(Level::Avx2),
        #[cfg(target_arch = "x86_64")]
        Simd(Level::Avx512),
    ];

    pub fn name(self) -> &'static str {
        match self.0 {
            Level::Portable => "portable",
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => "avx2+fma",
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => "avx512",
        }
    }

    /// Runs `kernel` compiled for this build.
    #[inline(always)]
    pub fn run<K: Kernel>(self, kernel: K) -> K::Output {
        match self.0 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a Simd of this level is only made where the CPU has AVX-512 F/BW/VL/DQ.
            Level::Avx512 => unsafe { run_avx512(kernel) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a Simd of this level is only made where the CPU has AVX2, FMA and F16C.
            Level::Avx2 => unsafe { run_avx2(kernel) },
            // SAFETY: the portable vector uses no instruction the target does not have.
            Level::Portable => unsafe { kernel.run::<Portable>() },
        }
    }
}

/// Work compiled once for each `Simd` build, over that build's `Vector`.
pub trait Kernel {
    type Output;
    /// # Safety
    /// Only `Simd::run` calls this, inside the build `V` belongs to. Everything it calls down to the
    /// loops must be `#[inline(always)]`, so that it is compiled into that build.
    unsafe fn run<V: Vector>(self) -> Self::Output;
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_avx2<K: Kernel>(kernel: K) -> K::Output {
    // SAFETY: this function is compiled for AVX2, FMA and F16C, which its caller checked.
    unsafe { kernel.run::<x86::Avx2>() }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")]
unsafe fn run_avx512<K: Kernel>(kernel: K) -> K::Output {
    // SAFETY: this function is compiled for AVX-512, which its caller checked.
    unsafe { kernel.run::<x86::Avx512>() }
}

/// `R` rows of `F` (their bytes as stored) dotted with `x`, on the `simd` build.
#[inline(never)]
pub(super) fn dot_rows<F: Format, const R: usize>(simd: Simd, rows: [&[u8]; R], x: &[f32]) -> [f32; R] {
    simd.run(DotRows::<F, R> { rows, x, format: PhantomData })
}

struct DotRows<'a, F, const R: usize> {
    rows: [&'a [u8]; R],
    x: &'a [f32],
    format: PhantomData<F>,
}

impl<F: Format, const R: usize> Kernel for DotRows<'_, F, R> {
    type Output = [f32; R];

    #[inline(always)]
    unsafe fn run<V: Vector>(self) -> [f32; R] {
        // SAFETY: `Simd::run` runs this inside V's build.
        unsafe {
            let mut acc = [V::zero(); R];
            F::dot_lanes(self.rows, self.x, &mut acc);
            acc.map(|a| a.sum())
        }
    }
}

/// The default `Format::dot_lanes`: each block decoded onto the stack, then multiply-added.
///
/// # Safety
/// Inside V's build (see `Vector`).
#[inline(always)]
pub(super) unsafe fn dot_lanes_by_block<F: Format, V: Vector, const R: usize>(
    rows: [&[u8]; R],
    x: &[f32],
    acc: &mut [V; R],
) {
    assert!(F::BLOCK_VALUES <= MAX_BLOCK_VALUES, "{}: blocks longer than the stack buffer", F::NAME);
    let block_bytes = size_of::<F::Block>();
    let mut decoded = [0f32; MAX_BLOCK_VALUES];
    let decoded = &mut decoded[..F::BLOCK_VALUES];
    for (b, x) in x.chunks_exact(F::BLOCK_VALUES).enumerate() {
        for (row, acc) in rows.iter().zip(acc.iter_mut()) {
            F::decode_block(&row[b * block_bytes..(b + 1) * block_bytes], decoded);
            // SAFETY: the caller runs this inside V's build.
            *acc = unsafe { acc.fma_values(b * F::BLOCK_VALUES, decoded, x) };
        }
    }
}

/// `dot_lanes` block by block: for each block of `VALUES` columns (`BLOCK_BYTES` bytes a row), each row's
/// `block_dot` multiply-adds that block (its bytes, and its columns of `x` in runs of LANES) into the
/// row's lanes. Blocks outer, rows inner: each row's lanes are a chain of their own, R chains side by side.
///
/// # Safety
/// Inside V's build (see `Vector`), which `block_dot` may rely on.
#[inline(always)]
pub(super) unsafe fn dot_lanes_by_blocks<const VALUES: usize, const BLOCK_BYTES: usize, V: Vector, const R: usize>(
    rows: [&[u8]; R],
    x: &[f32],
    acc: &mut [V; R],
    block_dot: impl Fn(&[u8; BLOCK_BYTES], &[Lanes], &mut V),
) {
    let x_blocks = x.as_chunks::<VALUES>().0;
    let blocks = rows.map(|row| row.as_chunks::<BLOCK_BYTES>().0);
    assert!(blocks.iter().all(|b| b.len() == x_blocks.len()), "rows of whole blocks do not match the columns");
    for (b, x) in x_blocks.iter().enumerate() {
        let x = x.as_chunks::<LANES>().0;
        for (blocks, acc) in blocks.iter().zip(acc.iter_mut()) {
            block_dot(&blocks[b], x, acc);
        }
    }
}

/// `dot_lanes` of a format of 32-value blocks of `BLOCK_BYTES` bytes that `decode` turns, in registers,
/// into the block's two runs of LANES values (each the value `decode_block` gives).
///
/// # Safety
/// Inside V's build (see `Vector`).
#[inline(always)]
pub(super) unsafe fn dot_lanes_of_pairs<const BLOCK_BYTES: usize, V: Vector, const R: usize>(
    rows: [&[u8]; R],
    x: &[f32],
    acc: &mut [V; R],
    decode: unsafe fn(&[u8; BLOCK_BYTES]) -> (V, V),
) {
    // SAFETY: the caller runs this inside V's build.
    unsafe {
        dot_lanes_by_blocks::<{ 2 * LANES }, BLOCK_BYTES, V, R>(rows, x, acc, |block, x, acc| {
            let (w0, w1) = decode(block);
            *acc = acc.fma(w0, V::load(&x[0])).fma(w1, V::load(&x[1]));
        })
    }
}

/// `dot_lanes` of a one-value format of `N` bytes a value: LANES columns at a time through `lanes`
/// (the vector's conversion of LANES values), then the tail through `decode` (one value).
///
/// # Safety
/// Inside V's build (see `Vector`).
#[inline(always)]
pub(super) unsafe fn dot_lanes_of_values<const N: usize, const CHUNK: usize, V: Vector, const R: usize>(
    rows: [&[u8]; R],
    x: &[f32],
    acc: &mut [V; R],
    lanes: unsafe fn(&[u8; CHUNK]) -> V,
    decode: fn([u8; N]) -> f32,
) {
    assert_eq!(CHUNK, N * LANES, "a chunk is LANES values");
    let (x_chunks, x_tail) = x.as_chunks::<LANES>();
    let full = x_chunks.len() * CHUNK;
    let split = rows.map(|row| row.split_at(full));
    assert!(split.iter().all(|(_, tail)| tail.len() == x_tail.len() * N), "rows do not match the columns");
    let chunks = split.map(|(values, _)| values.as_chunks::<CHUNK>().0);
    // SAFETY: the caller runs this inside V's build.
    unsafe {
        // Chunks outer, rows inner: each row's lanes are a chain of their own, R chains side by side.
        for (k, x) in x_chunks.iter().enumerate() {
            let x = V::load(x);
            for (chunks, acc) in chunks.iter().zip(acc.iter_mut()) {
                *acc = acc.fma(lanes(&chunks[k]), x);
            }
        }
        if !x_tail.is_empty() {
            for ((_, tail), acc) in split.iter().zip(acc.iter_mut()) {
                let mut w = [0f32; LANES];
                for (w, bytes) in w.iter_mut().zip(tail.as_chunks::<N>().0) {
                    *w = decode(*bytes);
                }
                *acc = acc.fma_values(full / N, &w[..x_tail.len()], x_tail);
            }
        }
    }
}

/// `rows` (each `row_bytes(x.len())` bytes of `dtype`) dotted with `x` into `out`, on the `simd` build.
pub fn dot_rows_into(dtype: DType, simd: Simd, rows: &[&[u8]], x: &[f32], out: &mut [f32]) {
    assert_eq!(rows.len(), out.len(), "dot_rows_into: one output a row");
    let row_bytes = dtype.row_bytes(x.len()).expect("dot_rows_into: columns are not whole blocks");
    assert!(rows.iter().all(|r| r.len() == row_bytes), "dot_rows_into: row bytes do not match the columns");
    let f = dtype.format();
    let mut groups = rows.chunks_exact(4);
    let mut outs = out.chunks_exact_mut(4);
    for (group, out) in (&mut groups).zip(&mut outs) {
        out.copy_from_slice(&(f.dot_rows4)(simd, [group[0], group[1], group[2], group[3]], x));
    }
    for (row, out) in groups.remainder().iter().zip(outs.into_remainder()) {
        *out = (f.dot_rows1)(simd, [row], x)[0];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_bits_convert_as_half_does_for_every_value() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = f16_bits_to_f32(h);
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{h:#06x}: {got} vs {want}");
        }
    }

    #[test]
    fn the_lane_tree_adds_in_its_fixed_order() {
        let mut acc = [0f32; LANES];
        acc[0] = 1e8;
        acc[8] = -1e8;
        acc[1] = 1.0;
        assert_eq!(sum_lanes(&acc), 1.0);
        let acc: Lanes = std::array::from_fn(|l| l as f32);
        assert_eq!(sum_lanes(&acc), 120.0);
    }

    /// `dot_lanes` by the block, as `dot_lanes_by_block` defines it: what every format's own must give.
    struct ByBlock<'a, F, const R: usize> {
        rows: [&'a [u8]; R],
        x: &'a [f32],
        format: PhantomData<F>,
    }

    impl<F: Format, const R: usize> Kernel for ByBlock<'_, F, R> {
        type Output = [f32; R];

        #[inline(always)]
        unsafe fn run<V: Vector>(self) -> [f32; R] {
            // SAFETY: `Simd::run` runs this inside V's build.
            unsafe {
                let mut acc = [V::zero(); R];
                dot_lanes_by_block::<F, V, R>(self.rows, self.x, &mut acc);
                acc.map(|a| a.sum())
            }
        }
    }

    /// Every format's `dot_lanes` gives the bits of decoding each block onto the stack, in every build,
    /// for one row and four, on values of both signs and blocks with large and tiny scales.
    fn same_as_by_block<F: Format>() {
        let cols = if F::BLOCK_VALUES == 1 { 100 } else { 3 * F::BLOCK_VALUES };
        let mut state = 0x5EED_u64 ^ F::GGML_TYPE as u64;
        let mut next = || {
            state = crate::sampler::splitmix64(state);
            (state >> 40) as f32 / 8_388_608.0 - 1.0
        };
        let rows: Vec<Vec<u8>> = (0..4)
            .map(|r| {
                let magnitude = [1.0, 1e3, 1e-4, 0.5][r];
                let values: Vec<f32> = (0..cols).map(|_| next() * magnitude).collect();
                crate::tensor::encode_row(F::DTYPE, &values)
            })
            .collect();
        let x: Vec<f32> = (0..cols).map(|_| next() * 2.0).collect();
        let four = [&rows[0][..], &rows[1][..], &rows[2][..], &rows[3][..]];
        for simd in Simd::available() {
            let want = simd.run(ByBlock::<F, 4> { rows: four, x: &x, format: PhantomData });
            let got = dot_rows::<F, 4>(simd, four, &x);
            assert_eq!(got.map(f32::to_bits), want.map(f32::to_bits), "{} on {}: four rows", F::NAME, simd.name());
            for (r, row) in four.iter().enumerate() {
                let one = dot_rows::<F, 1>(simd, [row], &x)[0];
                assert_eq!(one.to_bits(), want[r].to_bits(), "{} on {}: row {r} alone", F::NAME, simd.name());
            }
        }
    }

    #[test]
    fn every_formats_dot_gives_the_bits_of_decoding_by_block() {
        use crate::tensor::*;
        same_as_by_block::<F32>();
        same_as_by_block::<F16>();
        same_as_by_block::<Bf16>();
        same_as_by_block::<Q8_0>();
        same_as_by_block::<Q4_0>();
        same_as_by_block::<Q4_1>();
        same_as_by_block::<Q5_0>();
        same_as_by_block::<Q5_1>();
        same_as_by_block::<Q2_K>();
        same_as_by_block::<Q3_K>();
        same_as_by_block::<Q4_K>();
        same_as_by_block::<Q5_K>();
        same_as_by_block::<Q6_K>();
        assert_eq!(FORMATS.len(), 13, "a format added to FORMATS belongs in this list");
    }

    #[test]
    fn best_is_the_widest_available_build() {
        assert_eq!(Simd::best(), *Simd::available().last().unwrap());
        assert_eq!(Simd::best(), Simd::best());
        assert_eq!(Simd::available()[0], Simd::portable());
    }
}
