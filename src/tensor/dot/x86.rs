//! The x86-64 builds of the lane loops: AVX2 with FMA and F16C, and AVX-512, each a `Vector` whose
//! operations give the portable build's bits.

use std::arch::x86_64::*;

use super::{LANES, Lanes, Vector};

/// The AVX2 build: lanes 0..8 and 8..16 in two vectors.
#[derive(Clone, Copy)]
pub struct Avx2(__m256, __m256);

// Every method runs inside the AVX2 build (AVX2, FMA and F16C enabled and present: the trait's
// contract); loads are unaligned and read exactly the array they are given.
impl Vector for Avx2 {
    #[inline(always)]
    unsafe fn zero() -> Self {
        // SAFETY: inside the AVX2 build (the trait's contract); registers only.
        unsafe { Avx2(_mm256_setzero_ps(), _mm256_setzero_ps()) }
    }
    #[inline(always)]
    unsafe fn splat(value: f32) -> Self {
        // SAFETY: inside the AVX2 build (the trait's contract); registers only.
        unsafe { Avx2(_mm256_set1_ps(value), _mm256_set1_ps(value)) }
    }
    #[inline(always)]
    unsafe fn load(values: &[f32; LANES]) -> Self {
        // SAFETY: inside the AVX2 build; the two unaligned loads read the array's 16 floats, 8 from 0 and 8 from 8.
        unsafe { Avx2(_mm256_loadu_ps(values.as_ptr()), _mm256_loadu_ps(values.as_ptr().add(8))) }
    }
    #[inline(always)]
    unsafe fn from_f32_bytes(bytes: &[u8; 4 * LANES]) -> Self {
        let p = bytes.as_ptr() as *const f32;
        // SAFETY: inside the AVX2 build; the two unaligned loads of 8 floats read exactly the 64-byte array.
        unsafe { Avx2(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))) }
    }
    #[inline(always)]
    unsafe fn from_f16_bytes(bytes: &[u8; 2 * LANES]) -> Self {
        let p = bytes.as_ptr() as *const __m128i;
        // SAFETY: inside the AVX2 build (F16C); the two unaligned 16-byte loads read exactly the 32-byte array.
        unsafe { Avx2(_mm256_cvtph_ps(_mm_loadu_si128(p)), _mm256_cvtph_ps(_mm_loadu_si128(p.add(1)))) }
    }
    #[inline(always)]
    unsafe fn from_bf16_bytes(bytes: &[u8; 2 * LANES]) -> Self {
        let p = bytes.as_ptr() as *const __m128i;
        // SAFETY: inside the AVX2 build; the two unaligned 16-byte loads read exactly the 32-byte array.
        unsafe {
            let widen = |h: __m128i| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)));
            Avx2(widen(_mm_loadu_si128(p)), widen(_mm_loadu_si128(p.add(1))))
        }
    }
    #[inline(always)]
    unsafe fn from_i8_bytes(bytes: &[u8; LANES]) -> Self {
        // SAFETY: inside the AVX2 build; the one unaligned 16-byte load reads exactly the array.
        unsafe {
            let q = _mm_loadu_si128(bytes.as_ptr() as *const __m128i);
            let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
            let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(q)));
            Avx2(lo, hi)
        }
    }
    #[inline(always)]
    unsafe fn from_u8_bytes(bytes: &[u8; LANES]) -> Self {
        // SAFETY: inside the AVX2 build, which `widen_u8` needs; `load16` reads exactly the 16-byte array.
        unsafe { Avx2::widen_u8(load16(bytes)) }
    }
    #[inline(always)]
    unsafe fn from_low_nibbles(bytes: &[u8; LANES]) -> Self {
        // SAFETY: inside the AVX2 build, which `widen_u8` needs; `load16` reads exactly the 16-byte array.
        unsafe { Avx2::widen_u8(low_nibbles(load16(bytes))) }
    }
    #[inline(always)]
    unsafe fn from_high_nibbles(bytes: &[u8; LANES]) -> Self {
        // SAFETY: inside the AVX2 build, which `widen_u8` needs; `load16` reads exactly the 16-byte array.
        unsafe { Avx2::widen_u8(high_nibbles(load16(bytes))) }
    }
    #[inline(always)]
    unsafe fn splat_f16_bytes(bytes: [u8; 2]) -> Self {
        // SAFETY: inside the AVX2 build (F16C for the conversion); registers only.
        unsafe {
            let v = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le_bytes(bytes) as i32)));
            Avx2(v, v)
        }
    }
    #[inline(always)]
    unsafe fn mul(self, other: Self) -> Self {
        // SAFETY: inside the AVX2 build (the trait's contract); registers only.
        unsafe { Avx2(_mm256_mul_ps(self.0, other.0), _mm256_mul_ps(self.1, other.1)) }
    }
    #[inline(always)]
    unsafe fn add(self, other: Self) -> Self {
        // SAFETY: inside the AVX2 build (the trait's contract); registers only.
        unsafe { Avx2(_mm256_add_ps(self.0, other.0), _mm256_add_ps(self.1, other.1)) }
    }
    #[inline(always)]
    unsafe fn fma(self, w: Self, x: Self) -> Self {
        // SAFETY: inside the AVX2 build, which enables FMA; registers only.
        unsafe { Avx2(_mm256_fmadd_ps(w.0, x.0, self.0), _mm256_fmadd_ps(w.1, x.1, self.1)) }
    }
    #[inline(always)]
    unsafe fn to_array(self) -> Lanes {
        let mut out = [0f32; LANES];
        // SAFETY: inside the AVX2 build; the two unaligned stores write `out`'s 16 floats, 8 from 0 and 8 from 8.
        unsafe {
            _mm256_storeu_ps(out.as_mut_ptr(), self.0);
            _mm256_storeu_ps(out.as_mut_ptr().add(8), self.1);
        }
        out
    }
}

// The byte helpers both builds widen from: SSE2 only, which either build has.

/// Sixteen bytes, unaligned.
#[inline(always)]
unsafe fn load16(bytes: &[u8; LANES]) -> __m128i {
    // SAFETY: SSE2, which every x86-64 CPU has; the one unaligned load reads exactly the 16-byte array.
    unsafe { _mm_loadu_si128(bytes.as_ptr() as *const __m128i) }
}

/// Each byte's low four bits.
#[inline(always)]
unsafe fn low_nibbles(q: __m128i) -> __m128i {
    // SAFETY: SSE2, which every x86-64 CPU has; registers only.
    unsafe { _mm_and_si128(q, _mm_set1_epi8(0x0F)) }
}

/// Each byte's high four bits, as a value 0..=15 in that byte.
#[inline(always)]
unsafe fn high_nibbles(q: __m128i) -> __m128i {
    // SAFETY: SSE2, which every x86-64 CPU has; registers only.
    unsafe { low_nibbles(_mm_srli_epi16::<4>(q)) }
}

impl Avx2 {
    /// Sixteen unsigned bytes as f32 lanes.
    #[inline(always)]
    unsafe fn widen_u8(q: __m128i) -> Self {
        // SAFETY: inside the AVX2 build (the callers' contract).
        unsafe {
            let lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
            let hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(q)));
            Avx2(lo, hi)
        }
    }
}

/// The AVX-512 build: the sixteen lanes in one vector.
#[derive(Clone, Copy)]
pub struct Avx512(__m512);

// Every method runs inside the AVX-512 build (AVX-512 F/BW/VL/DQ enabled and present: the trait's
// contract); loads are unaligned and read exactly the array they are given.
impl Vector for Avx512 {
    #[inline(always)]
    unsafe fn zero() -> Self {
        // SAFETY: inside the AVX-512 build (the trait's contract); registers only.
        unsafe { Avx512(_mm512_setzero_ps()) }
    }
    #[inline(always)]
    unsafe fn splat(value: f32) -> Self {
        // SAFETY: inside the AVX-512 build (the trait's contract); registers only.
        unsafe { Avx512(_mm512_set1_ps(value)) }
    }
    #[inline(always)]
    unsafe fn load(values: &[f32; LANES]) -> Self {
        // SAFETY: inside the AVX-512 build; the one unaligned load reads exactly the array's 16 floats.
        unsafe { Avx512(_mm512_loadu_ps(values.as_ptr())) }
    }
    #[inline(always)]
    unsafe fn from_f32_bytes(bytes: &[u8; 4 * LANES]) -> Self {
        // SAFETY: inside the AVX-512 build; the one unaligned load of 16 floats reads exactly the 64-byte array.
        unsafe { Avx512(_mm512_loadu_ps(bytes.as_ptr() as *const f32)) }
    }
    #[inline(always)]
    unsafe fn from_f16_bytes(bytes: &[u8; 2 * LANES]) -> Self {
        // SAFETY: inside the AVX-512 build; the one unaligned 32-byte load reads exactly the array.
        unsafe { Avx512(_mm512_cvtph_ps(_mm256_loadu_si256(bytes.as_ptr() as *const __m256i))) }
    }
    #[inline(always)]
    unsafe fn from_bf16_bytes(bytes: &[u8; 2 * LANES]) -> Self {
        // SAFETY: inside the AVX-512 build (BW for the shift); the one unaligned 32-byte load reads exactly the array.
        unsafe {
            let h = _mm256_loadu_si256(bytes.as_ptr() as *const __m256i);
            Avx512(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h))))
        }
    }
    #[inline(always)]
    unsafe fn from_i8_bytes(bytes: &[u8; LANES]) -> Self {
        // SAFETY: inside the AVX-512 build; the one unaligned 16-byte load reads exactly the array.
        unsafe {
            let q = _mm_loadu_si128(bytes.as_ptr() as *const __m128i);
            Avx512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)))
        }
    }
    #[inline(always)]
    unsafe fn from_u8_bytes(bytes: &[u8; LANES]) -> Self {
        // SAFETY: inside the AVX-512 build, which `widen_u8` needs; `load16` reads exactly the 16-byte array.
        unsafe { Avx512::widen_u8(load16(bytes)) }
    }
    #[inline(always)]
    unsafe fn from_low_nibbles(bytes: &[u8; LANES]) -> Self {
        // SAFETY: inside the AVX-512 build, which `widen_u8` needs; `load16` reads exactly the 16-byte array.
        unsafe { Avx512::widen_u8(low_nibbles(load16(bytes))) }
    }
    #[inline(always)]
    unsafe fn from_high_nibbles(bytes: &[u8; LANES]) -> Self {
        // SAFETY: inside the AVX-512 build, which `widen_u8` needs; `load16` reads exactly the 16-byte array.
        unsafe { Avx512::widen_u8(high_nibbles(load16(bytes))) }
    }
    #[inline(always)]
    unsafe fn splat_f16_bytes(bytes: [u8; 2]) -> Self {
        // SAFETY: inside the AVX-512 build (F16C for the conversion); registers only.
        unsafe { Avx512(_mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le_bytes(bytes) as i32)))) }
    }
    #[inline(always)]
    unsafe fn mul(self, other: Self) -> Self {
        // SAFETY: inside the AVX-512 build (the trait's contract); registers only.
        unsafe { Avx512(_mm512_mul_ps(self.0, other.0)) }
    }
    #[inline(always)]
    unsafe fn add(self, other: Self) -> Self {
        // SAFETY: inside the AVX-512 build (the trait's contract); registers only.
        unsafe { Avx512(_mm512_add_ps(self.0, other.0)) }
    }
    #[inline(always)]
    unsafe fn fma(self, w: Self, x: Self) -> Self {
        // SAFETY: inside the AVX-512 build (the trait's contract); registers only.
        unsafe { Avx512(_mm512_fmadd_ps(w.0, x.0, self.0)) }
    }
    #[inline(always)]
    unsafe fn to_array(self) -> Lanes {
        let mut out = [0f32; LANES];
        // SAFETY: inside the AVX-512 build; the one unaligned store writes exactly `out`'s 16 floats.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), self.0) };
        out
    }
}

impl Avx512 {
    /// Sixteen unsigned bytes as f32 lanes.
    #[inline(always)]
    unsafe fn widen_u8(q: __m128i) -> Self {
        // SAFETY: inside the AVX-512 build (the callers' contract).
        unsafe { Avx512(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q))) }
    }
}
