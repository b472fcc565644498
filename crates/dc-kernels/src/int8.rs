//! The two exact int8 loops attention runs once per key: a block's dot product (scores) and a
//! row of values times one quantised probability added to i32 accumulators (context). SSE2 on
//! x86_64 (part of the baseline: no detection needed), the scalar definition elsewhere; both
//! forms are property-tested against each other. Every product of two int8s fits an i16, and
//! every sum here fits an i32, so the vector forms compute the same integers.

use crate::quant::BLOCK;

/// `Σ a_i · b_i` over one block.
#[inline]
pub fn block_dot(a: &[i8; BLOCK], b: &[i8; BLOCK]) -> i32 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE2 is part of the x86_64 baseline every build targets.
    unsafe {
        sse2::block_dot(a, b)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        block_dot_scalar(a, b)
    }
}

/// The definition of [`block_dot`].
pub fn block_dot_scalar(a: &[i8; BLOCK], b: &[i8; BLOCK]) -> i32 {
    a.iter().zip(b).map(|(&x, &y)| x as i32 * y as i32).sum()
}

/// `acc_i += q · v_i` for every `i` (`acc` and `v` the same length; no sum may overflow an
/// i32, which holds for any 2^17 additions).
#[inline]
pub fn add_scaled(acc: &mut [i32], q: i8, v: &[i8]) {
    debug_assert_eq!(acc.len(), v.len());
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as in `block_dot`.
    unsafe {
        sse2::add_scaled(acc, q, v)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        add_scaled_scalar(acc, q, v)
    }
}

/// The definition of [`add_scaled`].
pub fn add_scaled_scalar(acc: &mut [i32], q: i8, v: &[i8]) {
    for (a, &x) in acc.iter_mut().zip(v) {
        *a += q as i32 * x as i32;
    }
}

#[cfg(target_arch = "x86_64")]
mod sse2 {
    use std::arch::x86_64::*;

    use crate::quant::BLOCK;

    /// The low and high eight int8s of `x`, sign-extended to i16.
    #[inline]
    #[target_feature(enable = "sse2")]
    fn widen(x: __m128i) -> (__m128i, __m128i) {
        // Each byte doubled into an i16 (b·256 + b as u8), then shifted back arithmetically.
        (
            _mm_srai_epi16(_mm_unpacklo_epi8(x, x), 8),
            _mm_srai_epi16(_mm_unpackhi_epi8(x, x), 8),
        )
    }

    /// 16 int8s from `v[at..at + 16]`.
    #[inline]
    #[target_feature(enable = "sse2")]
    fn load16(v: &[i8], at: usize) -> __m128i {
        let chunk: &[i8; 16] = v[at..at + 16].try_into().expect("16 bytes");
        // SAFETY: `chunk` is 16 readable bytes; the load is unaligned.
        unsafe { _mm_loadu_si128(chunk.as_ptr().cast()) }
    }

    #[inline]
    #[target_feature(enable = "sse2")]
    pub(super) fn block_dot(a: &[i8; BLOCK], b: &[i8; BLOCK]) -> i32 {
        let mut sum = _mm_setzero_si128();
        for at in (0..BLOCK).step_by(16) {
            let (al, ah) = widen(load16(a, at));
            let (bl, bh) = widen(load16(b, at));
            // Pairs of i16 products (each at most 2^14) summed into i32 lanes.
            sum = _mm_add_epi32(sum, _mm_madd_epi16(al, bl));
            sum = _mm_add_epi32(sum, _mm_madd_epi16(ah, bh));
        }
        let s = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }

    #[inline]
    #[target_feature(enable = "sse2")]
    pub(super) fn add_scaled(acc: &mut [i32], q: i8, v: &[i8]) {
        let n = acc.len().min(v.len());
        let qv = _mm_set1_epi16(q as i16);
        let whole = n / 16 * 16;
        for at in (0..whole).step_by(16) {
            let (lo, hi) = widen(load16(v, at));
            // Exact: |q · v| <= 2^14 fits an i16.
            for (k, p) in [_mm_mullo_epi16(lo, qv), _mm_mullo_epi16(hi, qv)]
                .into_iter()
                .enumerate()
            {
                let words = [
                    _mm_srai_epi32(_mm_unpacklo_epi16(p, p), 16),
                    _mm_srai_epi32(_mm_unpackhi_epi16(p, p), 16),
                ];
                for (w, word) in words.into_iter().enumerate() {
                    let slot: &mut [i32; 4] = (&mut acc
                        [at + k * 8 + w * 4..at + k * 8 + w * 4 + 4])
                        .try_into()
                        .expect("4 lanes");
                    // SAFETY: `slot` is 4 readable and writable i32s; both accesses unaligned.
                    unsafe {
                        let sum = _mm_add_epi32(_mm_loadu_si128(slot.as_ptr().cast()), word);
                        _mm_storeu_si128(slot.as_mut_ptr().cast(), sum);
                    }
                }
            }
        }
        super::add_scaled_scalar(&mut acc[whole..n], q, &v[whole..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn block_dot_is_its_definition(a in prop::array::uniform32(any::<i8>()),
                                       b in prop::array::uniform32(any::<i8>())) {
            prop_assert_eq!(block_dot(&a, &b), block_dot_scalar(&a, &b));
        }

        #[test]
        fn add_scaled_is_its_definition(q in any::<i8>(),
                                        v in prop::collection::vec(any::<i8>(), 0..100),
                                        start in prop::collection::vec(-(1i32 << 24)..(1 << 24), 100)) {
            let mut fast = start[..v.len()].to_vec();
            let mut slow = fast.clone();
            add_scaled(&mut fast, q, &v);
            add_scaled_scalar(&mut slow, q, &v);
            prop_assert_eq!(fast, slow);
        }
    }

    #[test]
    fn extremes_are_exact() {
        let (a, b) = ([-128i8; BLOCK], [-128i8; BLOCK]);
        assert_eq!(block_dot(&a, &b), 32 * 16384);
        let mut acc = vec![i32::MAX - 16384; 33];
        add_scaled(&mut acc, -128, &[-128; 33]);
        assert!(acc.iter().all(|&x| x == i32::MAX));
    }
}
