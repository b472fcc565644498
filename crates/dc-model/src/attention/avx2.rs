//! AVX2 forms of the fast kernel's per-key f64 loops, four keys at a time: each key's score
//! from its block dot products and scales, and a block of keys' scaled and quantised
//! probabilities. Every lane performs the scalar loop's IEEE operations on the same operands
//! in the same order (exact products, the same single roundings), so every form gives the
//! scalar one's bits; the property tests hold both to the reference (`AttentionKernel`).
//! A key the f64 path cannot take (block exponents too far apart, a score out of the f32
//! range) is redone by the scalar code, which takes the exact path or names the overflow.

use std::arch::x86_64::*;

use dc_kernels::quant::{BlockScale, QMAX};

use super::{redo_key, KeyScales, SCORE_F64_SPAN};

/// Whether this CPU runs these loops (detected once by the standard library).
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2")
}

/// `2^e` per lane for exponents in the f64 normal range: [`super::pow2`]'s bits.
#[inline]
#[target_feature(enable = "avx2")]
fn pow2(e: __m128i) -> __m256d {
    let biased = _mm256_add_epi64(_mm256_cvtepi32_epi64(e), _mm256_set1_epi64x(1023));
    _mm256_castsi256_pd(_mm256_slli_epi64::<52>(biased))
}

/// [`super::scores_of`] for `HB` blocks per head: every key's score, scaled, into `scores`.
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
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
    let (scale4, span) = (_mm_set1_ps(scale), _mm_set1_epi32(SCORE_F64_SPAN));
    let (magnitude, infinity) = (_mm_set1_epi32(0x7fff_ffff), _mm_set1_epi32(0x7f80_0000));
    let whole = n / 4 * 4;
    for i in (0..whole).step_by(4) {
        let (mut sum, mut emin, mut emax) = (
            _mm256_setzero_pd(),
            _mm_set1_epi32(i32::MAX),
            _mm_set1_epi32(i32::MIN),
        );
        for (b, q) in qs.iter().enumerate() {
            let d = |k: usize| dots[(i + k) * HB + b];
            let ks = |k: usize| keys.scales[(i + k) * keys.stride + b];
            let (k0, k1, k2, k3) = (ks(0), ks(1), ks(2), ks(3));
            let d = _mm_set_epi32(d(3), d(2), d(1), d(0));
            let mk = _mm_set_epi32(k3.m as i32, k2.m as i32, k1.m as i32, k0.m as i32);
            let ek = _mm_set_epi32(k3.e as i32, k2.e as i32, k1.e as i32, k0.e as i32);
            // `D · (m_q · m_k)`: below 2^35, so the f64 product is the scalar's exact i64.
            let m = _mm_mullo_epi32(mk, _mm_set1_epi32(q.m as i32));
            let t = _mm256_mul_pd(_mm256_cvtepi32_pd(d), _mm256_cvtepi32_pd(m));
            let e = _mm_add_epi32(ek, _mm_set1_epi32(q.e as i32));
            sum = _mm256_add_pd(sum, _mm256_mul_pd(t, pow2(e)));
            emin = _mm_min_epi32(emin, e);
            emax = _mm_max_epi32(emax, e);
        }
        let dot = _mm256_cvtpd_ps(sum);
        let dst: &mut [f32; 4] = (&mut scores[i..i + 4]).try_into().expect("4 lanes");
        // SAFETY: `dst` is 4 writable f32s; the store is unaligned.
        unsafe { _mm_storeu_ps(dst.as_mut_ptr(), _mm_mul_ps(dot, scale4)) };
        // Lanes to redo: exponents too far apart for the f64 sum, or a score out of range.
        let wide = _mm_cmpgt_epi32(_mm_sub_epi32(emax, emin), span);
        let bits = _mm_and_si128(_mm_castps_si128(dot), magnitude);
        let overflow = _mm_cmpeq_epi32(_mm_min_epu32(bits, infinity), infinity);
        let redo = _mm_movemask_ps(_mm_castsi128_ps(_mm_or_si128(wide, overflow)));
        for k in 0..4 {
            if redo & (1 << k) != 0 {
                scalar(i + k, scores)?;
            }
        }
    }
    for i in whole..n {
        scalar(i, scores)?;
    }
    Ok(())
}

/// [`super::scaled_probabilities`], four keys at a time.
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn scaled_probabilities(
    probabilities: &[f32],
    exponents: &[i16],
    out: &mut [f64],
) -> f64 {
    let n = out.len().min(probabilities.len()).min(exponents.len());
    let whole = n / 4 * 4;
    let mut amax4 = _mm256_setzero_pd();
    for j in (0..whole).step_by(4) {
        let e: &[i16; 4] = exponents[j..j + 4].try_into().expect("4 lanes");
        // SAFETY: `e` is 4 readable i16s (8 bytes); the load is unaligned.
        let e = _mm_cvtepi16_epi32(unsafe { _mm_loadl_epi64(e.as_ptr().cast()) });
        let src: &[f32; 4] = probabilities[j..j + 4].try_into().expect("4 lanes");
        // SAFETY: `src` is 4 readable f32s; the load is unaligned.
        let p = _mm256_cvtps_pd(unsafe { _mm_loadu_ps(src.as_ptr()) });
        let p = _mm256_mul_pd(p, pow2(e));
        let dst: &mut [f64; 4] = (&mut out[j..j + 4]).try_into().expect("4 lanes");
        // SAFETY: `dst` is 4 writable f64s; the store is unaligned.
        unsafe { _mm256_storeu_pd(dst.as_mut_ptr(), p) };
        // The values are never negative nor NaN: the maximum is the scalar's in any order.
        amax4 = _mm256_max_pd(amax4, p);
    }
    let mut lanes = [0f64; 4];
    // SAFETY: `lanes` is 4 writable f64s.
    unsafe { _mm256_storeu_pd(lanes.as_mut_ptr(), amax4) };
    let amax = lanes.iter().fold(0f64, |a, &l| a.max(l));
    let tail = super::scaled_probabilities(
        &probabilities[whole..n],
        &exponents[whole..n],
        &mut out[whole..n],
    );
    amax.max(tail)
}

/// [`super::quantized_probabilities`].
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantized_probabilities(pv: &[f64], inv: f64, m: f64, out: &mut [i32]) {
    let n = out.len().min(pv.len());
    let whole = n / 4 * 4;
    let (inv4, m4, most) = (
        _mm256_set1_pd(inv),
        _mm256_set1_pd(m),
        _mm256_set1_pd(QMAX as f64),
    );
    for j in (0..whole).step_by(4) {
        let src: &[f64; 4] = pv[j..j + 4].try_into().expect("4 lanes");
        // SAFETY: `src` is 4 readable f64s; the load is unaligned.
        let p = unsafe { _mm256_loadu_pd(src.as_ptr()) };
        let x = _mm256_div_pd(_mm256_mul_pd(p, inv4), m4);
        // Round half to even, as `round_half_even` does for these non-negative values below
        // 2^52; then at most QMAX, a whole number the truncating conversion keeps.
        let r = _mm256_round_pd::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let q = _mm256_cvttpd_epi32(_mm256_min_pd(r, most));
        let dst: &mut [i32; 4] = (&mut out[j..j + 4]).try_into().expect("4 lanes");
        // SAFETY: `dst` is 4 writable i32s; the store is unaligned.
        unsafe { _mm_storeu_si128(dst.as_mut_ptr().cast(), q) };
    }
    super::quantized_probabilities(&pv[whole..n], inv, m, &mut out[whole..n]);
}

#[cfg(test)]
mod tests {
    use super::super::pow2 as pow2_scalar;
    use super::super::scores_forms::{far_apart_terms, random_case, scaled_case};
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_key_with_far_apart_block_terms_takes_the_exact_sum() {
        if available() {
            far_apart_terms(scores::<2>, 5);
        }
    }

    proptest! {
        #[test]
        fn scores_are_the_scalar_loop_bit_for_bit(hb in 1usize..5, n in 0usize..40,
                                                  pad in 0usize..3, wide: bool, seed: u64) {
            // A CPU without the instructions has nothing to compare (not a rejected case).
            if !available() {
                return Ok(());
            }
            let forms = [scores::<1>, scores::<2>, scores::<3>, scores::<4>];
            let [fast, slow] = random_case(forms, hb, n, pad, wide, seed);
            prop_assert_eq!(fast, slow);
        }

        #[test]
        fn probabilities_are_the_scalar_loops_bit_for_bit(n in 0usize..33, seed: u64, tiny: bool) {
            // A CPU without the instructions has nothing to compare (not a rejected case).
            if !available() {
                return Ok(());
            }
            let [fast, slow] = scaled_case(scaled_probabilities, n, seed, tiny);
            prop_assert_eq!(&fast, &slow);
            // Then their quantisation, from the scaled values both forms agree on.
            let (amax, pv) = (f64::from_bits(slow[0]), slow[1..].iter().map(|&b| f64::from_bits(b)));
            let pv: Vec<f64> = pv.collect();
            if amax > 0.0 {
                let s = super::super::scale_for_amax_f64(amax);
                let (inv, m) = (pow2_scalar(-(s.e as i32)), s.m as f64);
                let (mut qf, mut qs) = (vec![0i32; n], vec![0i32; n]);
                // SAFETY: AVX2 was detected.
                unsafe { quantized_probabilities(&pv, inv, m, &mut qf) };
                super::super::quantized_probabilities(&pv, inv, m, &mut qs);
                prop_assert_eq!(qf, qs);
            }
        }
    }
}
