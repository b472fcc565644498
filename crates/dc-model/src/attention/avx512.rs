//! The AVX-512 forms of the per-key f64 loops. Scores, sixteen keys at a time: their block
//! scales loaded from the cache's packed columns (`m | e << 16`, one per block) and their
//! block dot products from the dots, then the AVX2 form's f64 operations on the same operands
//! in the same order, in two halves of eight. Quantised probabilities, eight keys at a time.
//! Every lane gives the scalar loop's bits; a key the scores' f64 path cannot take (block
//! exponents too far apart, a score out of the f32 range) is redone by the scalar code.

use std::arch::x86_64::*;

use dc_kernels::quant::{BlockScale, QMAX};

use super::{redo_key, KeyScales, SCORE_F64_SPAN};

/// Whether this CPU runs the loop (detected once by the standard library).
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx512f")
}

/// `2^e` per lane for eight exponents in the f64 normal range: [`super::pow2`]'s bits.
#[inline]
#[target_feature(enable = "avx512f")]
fn pow2(e: __m256i) -> __m512d {
    let biased = _mm512_add_epi64(_mm512_cvtepi32_epi64(e), _mm512_set1_epi64(1023));
    _mm512_castsi512_pd(_mm512_slli_epi64::<52>(biased))
}

/// The exact block terms `d · (m_q · m_k) · 2^e` of eight keys, added to `sum`.
#[inline]
#[target_feature(enable = "avx512f")]
fn add_terms(sum: __m512d, d: __m256i, m: __m256i, e: __m256i) -> __m512d {
    // `D · (m_q · m_k)`: below 2^35, so the f64 product is the scalar's exact i64.
    let t = _mm512_mul_pd(_mm512_cvtepi32_pd(d), _mm512_cvtepi32_pd(m));
    _mm512_add_pd(sum, _mm512_mul_pd(t, pow2(e)))
}

/// [`super::scores_of`] for `HB` blocks per head: every key's score, scaled, into `scores`.
///
/// # Safety
/// The CPU must have AVX-512F, and `keys.packed` must mirror `keys.scales`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn scores<const HB: usize>(
    qs: &[BlockScale],
    dots: &[i32],
    keys: KeyScales,
    scale: f32,
    pos: usize,
    scores: &mut Vec<f32>,
) -> Result<(), String> {
    let qs: &[BlockScale; HB] = qs.try_into().expect("HB query blocks");
    let n = dots.len() / HB;
    scores.clear();
    scores.resize(n, 0.0);
    let scalar = |i: usize, scores: &mut [f32]| redo_key(qs, dots, keys, scale, pos, i, scores);
    let whole = n / 16 * 16;
    assert!(
        whole == 0 || keys.packed.iter().all(|c| c.len() >= keys.first + whole),
        "every key's packed scales are held"
    );
    assert!(
        whole * HB <= i32::MAX as usize,
        "the gathered dots' indices fit an i32"
    );
    let lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    // Two blocks per key: the even and odd dots of 32 in a row.
    let (even, odd) = (
        _mm512_add_epi32(lane, lane),
        _mm512_add_epi32(_mm512_add_epi32(lane, lane), _mm512_set1_epi32(1)),
    );
    let (scale16, span) = (_mm512_set1_ps(scale), _mm512_set1_epi32(SCORE_F64_SPAN));
    for i in (0..whole).step_by(16) {
        let dot_at = _mm512_mullo_epi32(
            _mm512_add_epi32(lane, _mm512_set1_epi32(i as i32)),
            _mm512_set1_epi32(HB as i32),
        );
        let (mut lo, mut hi) = (_mm512_setzero_pd(), _mm512_setzero_pd());
        let (mut emin, mut emax) = (_mm512_set1_epi32(i32::MAX), _mm512_set1_epi32(i32::MIN));
        // SAFETY (the loads and gathers below): the sixteen keys' dots are inside `dots` (`i
        // + 16 <= n`) and their packed scales inside each column (asserted above); the loads
        // are unaligned.
        let pair = match HB {
            2 => unsafe {
                let (a, b) = (
                    _mm512_loadu_si512(dots.as_ptr().add(2 * i).cast()),
                    _mm512_loadu_si512(dots.as_ptr().add(2 * i + 16).cast()),
                );
                Some((
                    _mm512_permutex2var_epi32(a, even, b),
                    _mm512_permutex2var_epi32(a, odd, b),
                ))
            },
            _ => None,
        };
        for (b, q) in qs.iter().enumerate() {
            let me =
                unsafe { _mm512_loadu_si512(keys.packed[b][keys.first + i..].as_ptr().cast()) };
            let d = match (HB, pair) {
                (1, _) => unsafe { _mm512_loadu_si512(dots.as_ptr().add(i).cast()) },
                (_, Some((d0, d1))) => [d0, d1][b],
                _ => unsafe {
                    _mm512_i32gather_epi32::<4>(
                        _mm512_add_epi32(dot_at, _mm512_set1_epi32(b as i32)),
                        dots.as_ptr(),
                    )
                },
            };
            let m = _mm512_mullo_epi32(
                _mm512_and_si512(me, _mm512_set1_epi32(0xff)),
                _mm512_set1_epi32(q.m as i32),
            );
            let e = _mm512_add_epi32(_mm512_srai_epi32::<16>(me), _mm512_set1_epi32(q.e as i32));
            let half = |v: __m512i, h: bool| match h {
                false => _mm512_castsi512_si256(v),
                true => _mm512_extracti64x4_epi64::<1>(v),
            };
            lo = add_terms(lo, half(d, false), half(m, false), half(e, false));
            hi = add_terms(hi, half(d, true), half(m, true), half(e, true));
            emin = _mm512_min_epi32(emin, e);
            emax = _mm512_max_epi32(emax, e);
        }
        let dot = _mm512_castsi512_ps(_mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_castps_si256(_mm512_cvtpd_ps(lo))),
            _mm256_castps_si256(_mm512_cvtpd_ps(hi)),
        ));
        let dst: &mut [f32; 16] = (&mut scores[i..i + 16]).try_into().expect("16 lanes");
        // SAFETY: `dst` is 16 writable f32s; the store is unaligned.
        unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), _mm512_mul_ps(dot, scale16)) };
        // Lanes to redo: exponents too far apart for the f64 sum, or a score out of range.
        let wide = _mm512_cmpgt_epi32_mask(_mm512_sub_epi32(emax, emin), span);
        let bits = _mm512_and_si512(_mm512_castps_si512(dot), _mm512_set1_epi32(0x7fff_ffff));
        let overflow = _mm512_cmpge_epu32_mask(bits, _mm512_set1_epi32(0x7f80_0000));
        let mut redo = wide | overflow;
        while redo != 0 {
            scalar(i + redo.trailing_zeros() as usize, scores)?;
            redo &= redo - 1;
        }
    }
    for i in whole..n {
        scalar(i, scores)?;
    }
    Ok(())
}

/// [`super::scaled_probabilities`], eight keys at a time: the AVX2 form's operations (an
/// exact product by `2^e`, the maximum of values never negative nor NaN, so in any order).
///
/// # Safety
/// The CPU must have AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn scaled_probabilities(
    probabilities: &[f32],
    exponents: &[i16],
    out: &mut [f64],
) -> f64 {
    let n = out.len().min(probabilities.len()).min(exponents.len());
    let whole = n / 8 * 8;
    let mut amax8 = _mm512_setzero_pd();
    for j in (0..whole).step_by(8) {
        let e: &[i16; 8] = exponents[j..j + 8].try_into().expect("8 lanes");
        // SAFETY: `e` is 8 readable i16s (16 bytes); the load is unaligned.
        let e = _mm256_cvtepi16_epi32(unsafe { _mm_loadu_si128(e.as_ptr().cast()) });
        let src: &[f32; 8] = probabilities[j..j + 8].try_into().expect("8 lanes");
        // SAFETY: `src` is 8 readable f32s; the load is unaligned.
        let p = _mm512_cvtps_pd(unsafe { _mm256_loadu_ps(src.as_ptr()) });
        let p = _mm512_mul_pd(p, pow2(e));
        let dst: &mut [f64; 8] = (&mut out[j..j + 8]).try_into().expect("8 lanes");
        // SAFETY: `dst` is 8 writable f64s; the store is unaligned.
        unsafe { _mm512_storeu_pd(dst.as_mut_ptr(), p) };
        amax8 = _mm512_max_pd(amax8, p);
    }
    let mut lanes = [0f64; 8];
    // SAFETY: `lanes` is 8 writable f64s.
    unsafe { _mm512_storeu_pd(lanes.as_mut_ptr(), amax8) };
    let amax = lanes.iter().fold(0f64, |a, &l| a.max(l));
    let tail = super::scaled_probabilities(
        &probabilities[whole..n],
        &exponents[whole..n],
        &mut out[whole..n],
    );
    amax.max(tail)
}

/// [`super::quantized_probabilities`], eight keys at a time: the AVX2 form's operations (an
/// exact scaling, one correctly rounded division, rounding half to even, at most `QMAX`).
///
/// # Safety
/// The CPU must have AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn quantized_probabilities(pv: &[f64], inv: f64, m: f64, out: &mut [i32]) {
    let n = out.len().min(pv.len());
    let whole = n / 8 * 8;
    let (inv8, m8, most) = (
        _mm512_set1_pd(inv),
        _mm512_set1_pd(m),
        _mm512_set1_pd(QMAX as f64),
    );
    for j in (0..whole).step_by(8) {
        let src: &[f64; 8] = pv[j..j + 8].try_into().expect("8 lanes");
        // SAFETY: `src` is 8 readable f64s; the load is unaligned.
        let p = unsafe { _mm512_loadu_pd(src.as_ptr()) };
        let x = _mm512_div_pd(_mm512_mul_pd(p, inv8), m8);
        // Round half to even (scale 0, nearest, no exceptions) for these non-negative values
        // below 2^52; then at most QMAX, a whole number the truncating conversion keeps.
        let r = _mm512_roundscale_pd::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let q = _mm512_cvttpd_epi32(_mm512_min_pd(r, most));
        let dst: &mut [i32; 8] = (&mut out[j..j + 8]).try_into().expect("8 lanes");
        // SAFETY: `dst` is 8 writable i32s; the store is unaligned.
        unsafe { _mm256_storeu_si256(dst.as_mut_ptr().cast(), q) };
    }
    super::quantized_probabilities(&pv[whole..n], inv, m, &mut out[whole..n]);
}

#[cfg(test)]
mod tests {
    use super::super::scores_forms::{far_apart_terms, random_case, scaled_case};
    use super::*;
    use proptest::prelude::*;

    /// In every lane of a group of sixteen, and in the scalar tail.
    #[test]
    fn a_key_with_far_apart_block_terms_takes_the_exact_sum() {
        if available() {
            far_apart_terms(scores::<2>, 20);
        }
    }

    proptest! {
        #[test]
        fn quantised_probabilities_are_the_scalar_loop_bit_for_bit(
            pv in prop::collection::vec(prop_oneof![0f64..1.0, Just(0.0), Just(1.0), 0f64..1e-30], 0..40),
            e in -40i32..40,
            m in 128u8..=255,
        ) {
            // A CPU without the instructions has nothing to compare (not a rejected case).
            if !available() {
                return Ok(());
            }
            let inv = super::super::pow2(-e);
            let (mut fast, mut slow) = (vec![-1i32; pv.len()], vec![-1i32; pv.len()]);
            // SAFETY: AVX-512F was detected.
            unsafe { quantized_probabilities(&pv, inv, m as f64, &mut fast) };
            super::super::quantized_probabilities(&pv, inv, m as f64, &mut slow);
            prop_assert_eq!(fast, slow);
        }

        #[test]
        fn scaled_probabilities_are_the_scalar_loop_bit_for_bit(n in 0usize..40, seed: u64, tiny: bool) {
            // A CPU without the instructions has nothing to compare (not a rejected case).
            if !available() {
                return Ok(());
            }
            let [fast, slow] = scaled_case(scaled_probabilities, n, seed, tiny);
            prop_assert_eq!(fast, slow);
        }

        #[test]
        fn scores_are_the_scalar_loop_bit_for_bit(hb in 1usize..5, n in 0usize..70,
                                                  pad in 0usize..3, wide: bool, seed: u64) {
            // A CPU without the instructions has nothing to compare (not a rejected case).
            if !available() {
                return Ok(());
            }
            let forms = [scores::<1>, scores::<2>, scores::<3>, scores::<4>];
            let [fast, slow] = random_case(forms, hb, n, pad, wide, seed);
            prop_assert_eq!(fast, slow);
        }
    }
}
