//! `libm::exp`, four lanes at a time (AVX2) or eight (AVX-512): the same f64 operations in the
//! same order as the `libm` crate's `exp` (FreeBSD's `e_exp.c`: reduction by `k · ln 2` in two
//! parts, a degree-5 rational correction, a scale by `2^k`), so every lane gives `libm::exp`'s
//! bits. The vector forms take the arguments whose magnitude is below 708.39 (the range where
//! `libm` neither overflows nor underflows and `2^k` is a normal number); a group of lanes with
//! any other lane (or a NaN) goes through `libm::exp` itself. Softmax uses it: every argument
//! there is at most 0 and nearly all are far from the limits.
//!
//! Why it is exact: IEEE-754 addition, subtraction, multiplication, division and the
//! int ↔ f64 conversions are correctly rounded in vector registers exactly as in scalar ones;
//! no operation is fused (no FMA is emitted by these intrinsics) or reordered; the branches of
//! the scalar code become selects on the same conditions, and in the branch `|x| <= 0.5 ln 2`
//! (`k = 0`) the shared formula adds and subtracts exact zeros only. Property-tested against
//! `libm::exp` over every branch and its boundaries.

/// `out[i] = exp(x[i] − shift)` in f64 as `libm::exp` computes it, or 0 where `x[i]` is
/// `−inf` (a masked entry). `out` is cleared first.
pub fn exp_shifted(x: &[f32], shift: f64, out: &mut Vec<f64>) {
    out.clear();
    out.resize(x.len(), 0.0);
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F was detected.
        unsafe { avx512::exp_shifted(x, shift, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected.
        unsafe { avx2::exp_shifted(x, shift, out) };
        return;
    }
    exp_shifted_scalar(x, shift, out);
}

/// The definition of [`exp_shifted`] (`out` as long as `x`).
pub fn exp_shifted_scalar(x: &[f32], shift: f64, out: &mut [f64]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = if v == f32::NEG_INFINITY {
            0.0
        } else {
            libm::exp(v as f64 - shift)
        };
    }
}

/// `out[i] = exp(x[i])` as `libm::exp` computes it (`out` as long as `x`).
pub fn exp_into(x: &[f64], out: &mut [f64]) {
    assert_eq!(x.len(), out.len(), "one output per input");
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F was detected.
        unsafe { avx512::exp_into(x, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected.
        unsafe { avx2::exp_into(x, out) };
        return;
    }
    for (o, &v) in out.iter_mut().zip(x) {
        *o = libm::exp(v);
    }
}

/// `exp` of four f64s as `libm::exp` computes each.
#[inline]
pub fn exp4(x: [f64; 4]) -> [f64; 4] {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected.
        return unsafe { avx2::exp4(x) };
    }
    x.map(libm::exp)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    // libm's constants (exp.rs), by their bit patterns.
    pub(super) const LN2HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
    pub(super) const LN2LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
    pub(super) const INVLN2: f64 = f64::from_bits(0x3ff7_1547_652b_82fe);
    pub(super) const P1: f64 = f64::from_bits(0x3fc5_5555_5555_553e);
    pub(super) const P2: f64 = f64::from_bits(0xbf66_c16c_16be_bd93);
    pub(super) const P3: f64 = f64::from_bits(0x3f11_566a_af25_de2c);
    pub(super) const P4: f64 = f64::from_bits(0xbebb_bd41_c5d2_6bf1);
    pub(super) const P5: f64 = f64::from_bits(0x3e66_3769_72be_a4d0);

    /// The smallest `|x|` whose high word is above (or at) `hi`, as an f64: comparing
    /// magnitudes as f64 is comparing their bits, so these are the scalar code's thresholds.
    const fn from_high(hi: u64) -> f64 {
        f64::from_bits(hi << 32)
    }
    /// `hx >= 0x4086232b`: the scalar code's special cases (overflow, underflow).
    pub(super) const LIMIT: f64 = from_high(0x4086_232b);
    /// `hx > 0x3fd62e42`: `|x| > 0.5 ln 2`, reduced by `k ≠ 0`.
    pub(super) const REDUCE: f64 = from_high(0x3fd6_2e43);
    /// `hx >= 0x3ff0a2b2`: `|x| >= 1.5 ln 2`, `k` from the rounded quotient.
    pub(super) const ROUND_K: f64 = from_high(0x3ff0_a2b2);
    /// `hx > 0x3e300000`: below it, `exp(x) = 1 + x`.
    pub(super) const TINY: f64 = from_high(0x3e30_0001);

    /// Four lanes, each `libm::exp(x)` for `|x| < LIMIT` (the caller checked).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn exp_in_range(x: __m256d) -> __m256d {
        let sign_bit = _mm256_set1_pd(-0.0);
        let ax = _mm256_andnot_pd(sign_bit, x);
        let negative = _mm256_cmp_pd::<_CMP_LT_OQ>(x, _mm256_setzero_pd());
        let reduce = _mm256_cmp_pd::<_CMP_GE_OQ>(ax, _mm256_set1_pd(REDUCE));
        let round_k = _mm256_cmp_pd::<_CMP_GE_OQ>(ax, _mm256_set1_pd(ROUND_K));
        let tiny = _mm256_cmp_pd::<_CMP_LT_OQ>(ax, _mm256_set1_pd(TINY));
        // k = (INVLN2 · x + ±0.5) truncated, or 1 − 2 · sign, or 0.
        let half = _mm256_blendv_pd(_mm256_set1_pd(0.5), _mm256_set1_pd(-0.5), negative);
        let q = _mm256_add_pd(_mm256_mul_pd(_mm256_set1_pd(INVLN2), x), half);
        let k_round = _mm256_cvtepi32_pd(_mm256_cvttpd_epi32(q));
        let k_one = _mm256_blendv_pd(_mm256_set1_pd(1.0), _mm256_set1_pd(-1.0), negative);
        let k = _mm256_blendv_pd(k_one, k_round, round_k);
        let k = _mm256_and_pd(k, reduce);
        // hi = x − k · LN2HI, lo = k · LN2LO, x = hi − lo (exact zeros added when k = 0).
        let hi = _mm256_sub_pd(x, _mm256_mul_pd(k, _mm256_set1_pd(LN2HI)));
        let lo = _mm256_mul_pd(k, _mm256_set1_pd(LN2LO));
        let r = _mm256_sub_pd(hi, lo);
        // c = r − rr · (P1 + rr · (P2 + rr · (P3 + rr · (P4 + rr · P5)))).
        let rr = _mm256_mul_pd(r, r);
        let mut p = _mm256_mul_pd(rr, _mm256_set1_pd(P5));
        p = _mm256_mul_pd(rr, _mm256_add_pd(_mm256_set1_pd(P4), p));
        p = _mm256_mul_pd(rr, _mm256_add_pd(_mm256_set1_pd(P3), p));
        p = _mm256_mul_pd(rr, _mm256_add_pd(_mm256_set1_pd(P2), p));
        let c = _mm256_sub_pd(r, _mm256_mul_pd(rr, _mm256_add_pd(_mm256_set1_pd(P1), p)));
        // y = 1 + (r · c / (2 − c) − lo + hi).
        let t = _mm256_div_pd(_mm256_mul_pd(r, c), _mm256_sub_pd(_mm256_set1_pd(2.0), c));
        let y = _mm256_add_pd(_mm256_set1_pd(1.0), _mm256_add_pd(_mm256_sub_pd(t, lo), hi));
        // scalbn(y, k) is y · 2^k for -1022 <= k <= 1023 (|x| < LIMIT keeps k in there); 2^k
        // built from its exponent bits.
        let k64 = _mm256_cvtepi32_epi64(_mm256_cvttpd_epi32(k));
        let scale = _mm256_castsi256_pd(_mm256_slli_epi64::<52>(_mm256_add_epi64(
            k64,
            _mm256_set1_epi64x(1023),
        )));
        let scaled = _mm256_mul_pd(y, scale);
        // |x| <= 2^-28: 1 + x.
        _mm256_blendv_pd(scaled, _mm256_add_pd(_mm256_set1_pd(1.0), x), tiny)
    }

    /// Whether every lane is inside the vector form's range (false for a NaN).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn in_range(x: __m256d) -> bool {
        let ax = _mm256_andnot_pd(_mm256_set1_pd(-0.0), x);
        _mm256_movemask_pd(_mm256_cmp_pd::<_CMP_LT_OQ>(ax, _mm256_set1_pd(LIMIT))) == 0b1111
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn exp4(x: [f64; 4]) -> [f64; 4] {
        // SAFETY: `x` is four readable f64s; the load is unaligned.
        let v = unsafe { _mm256_loadu_pd(x.as_ptr()) };
        if !in_range(v) {
            return x.map(libm::exp);
        }
        let mut out = [0f64; 4];
        // SAFETY: `out` is four writable f64s; the store is unaligned.
        unsafe { _mm256_storeu_pd(out.as_mut_ptr(), exp_in_range(v)) };
        out
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn exp_into(x: &[f64], out: &mut [f64]) {
        let whole = x.len() / 4 * 4;
        for (o, v) in out[..whole].chunks_exact_mut(4).zip(x.chunks_exact(4)) {
            let v: &[f64; 4] = v.try_into().expect("4 lanes");
            let o: &mut [f64; 4] = o.try_into().expect("4 lanes");
            // SAFETY: `v` is four readable f64s; the load is unaligned.
            let a = unsafe { _mm256_loadu_pd(v.as_ptr()) };
            if in_range(a) {
                // SAFETY: `o` is four writable f64s; the store is unaligned.
                unsafe { _mm256_storeu_pd(o.as_mut_ptr(), exp_in_range(a)) };
            } else {
                *o = v.map(libm::exp);
            }
        }
        for (o, &v) in out[whole..].iter_mut().zip(&x[whole..]) {
            *o = libm::exp(v);
        }
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn exp_shifted(x: &[f32], shift: f64, out: &mut [f64]) {
        let whole = x.len() / 4 * 4;
        let s = _mm256_set1_pd(shift);
        for i in (0..whole).step_by(4) {
            let chunk: &[f32; 4] = x[i..i + 4].try_into().expect("4 lanes");
            // SAFETY: `chunk` is four readable f32s; the load is unaligned. f32 → f64 is exact.
            let v = unsafe { _mm256_cvtps_pd(_mm_loadu_ps(chunk.as_ptr())) };
            // −inf minus a finite shift is −inf: out of range, so masked entries take the
            // scalar definition.
            let a = _mm256_sub_pd(v, s);
            let dst: &mut [f64; 4] = (&mut out[i..i + 4]).try_into().expect("4 lanes");
            if in_range(a) {
                // SAFETY: `dst` is four writable f64s; the store is unaligned.
                unsafe { _mm256_storeu_pd(dst.as_mut_ptr(), exp_in_range(a)) };
            } else {
                super::exp_shifted_scalar(chunk, shift, dst);
            }
        }
        super::exp_shifted_scalar(&x[whole..], shift, &mut out[whole..]);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The AVX2 form's operations eight lanes at a time, its selects as mask blends.
    use std::arch::x86_64::*;

    use super::avx2::{INVLN2, LIMIT, LN2HI, LN2LO, P1, P2, P3, P4, P5, REDUCE, ROUND_K, TINY};

    /// Eight lanes, each `libm::exp(x)` for `|x| < LIMIT` (the caller checked).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp_in_range(x: __m512d) -> __m512d {
        let ax = _mm512_abs_pd(x);
        let negative = _mm512_cmp_pd_mask::<_CMP_LT_OQ>(x, _mm512_setzero_pd());
        let reduce = _mm512_cmp_pd_mask::<_CMP_GE_OQ>(ax, _mm512_set1_pd(REDUCE));
        let round_k = _mm512_cmp_pd_mask::<_CMP_GE_OQ>(ax, _mm512_set1_pd(ROUND_K));
        let tiny = _mm512_cmp_pd_mask::<_CMP_LT_OQ>(ax, _mm512_set1_pd(TINY));
        // k = (INVLN2 · x + ±0.5) truncated, or 1 − 2 · sign, or 0.
        let half = _mm512_mask_blend_pd(negative, _mm512_set1_pd(0.5), _mm512_set1_pd(-0.5));
        let q = _mm512_add_pd(_mm512_mul_pd(_mm512_set1_pd(INVLN2), x), half);
        let k_round = _mm512_cvtepi32_pd(_mm512_cvttpd_epi32(q));
        let k_one = _mm512_mask_blend_pd(negative, _mm512_set1_pd(1.0), _mm512_set1_pd(-1.0));
        let k = _mm512_mask_blend_pd(round_k, k_one, k_round);
        let k = _mm512_maskz_mov_pd(reduce, k);
        // hi = x − k · LN2HI, lo = k · LN2LO, x = hi − lo (exact zeros added when k = 0).
        let hi = _mm512_sub_pd(x, _mm512_mul_pd(k, _mm512_set1_pd(LN2HI)));
        let lo = _mm512_mul_pd(k, _mm512_set1_pd(LN2LO));
        let r = _mm512_sub_pd(hi, lo);
        // c = r − rr · (P1 + rr · (P2 + rr · (P3 + rr · (P4 + rr · P5)))).
        let rr = _mm512_mul_pd(r, r);
        let mut p = _mm512_mul_pd(rr, _mm512_set1_pd(P5));
        p = _mm512_mul_pd(rr, _mm512_add_pd(_mm512_set1_pd(P4), p));
        p = _mm512_mul_pd(rr, _mm512_add_pd(_mm512_set1_pd(P3), p));
        p = _mm512_mul_pd(rr, _mm512_add_pd(_mm512_set1_pd(P2), p));
        let c = _mm512_sub_pd(r, _mm512_mul_pd(rr, _mm512_add_pd(_mm512_set1_pd(P1), p)));
        // y = 1 + (r · c / (2 − c) − lo + hi).
        let t = _mm512_div_pd(_mm512_mul_pd(r, c), _mm512_sub_pd(_mm512_set1_pd(2.0), c));
        let y = _mm512_add_pd(_mm512_set1_pd(1.0), _mm512_add_pd(_mm512_sub_pd(t, lo), hi));
        // y · 2^k, 2^k built from its exponent bits (|x| < LIMIT keeps k normal).
        let k64 = _mm512_cvtepi32_epi64(_mm512_cvttpd_epi32(k));
        let scale = _mm512_castsi512_pd(_mm512_slli_epi64::<52>(_mm512_add_epi64(
            k64,
            _mm512_set1_epi64(1023),
        )));
        let scaled = _mm512_mul_pd(y, scale);
        // |x| <= 2^-28: 1 + x.
        _mm512_mask_blend_pd(tiny, scaled, _mm512_add_pd(_mm512_set1_pd(1.0), x))
    }

    /// Whether every lane is inside the vector form's range (false for a NaN).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn in_range(x: __m512d) -> bool {
        _mm512_cmp_pd_mask::<_CMP_LT_OQ>(_mm512_abs_pd(x), _mm512_set1_pd(LIMIT)) == 0xff
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn exp_into(x: &[f64], out: &mut [f64]) {
        let whole = x.len() / 8 * 8;
        for (o, v) in out[..whole].chunks_exact_mut(8).zip(x.chunks_exact(8)) {
            let v: &[f64; 8] = v.try_into().expect("8 lanes");
            let o: &mut [f64; 8] = o.try_into().expect("8 lanes");
            // SAFETY: `v` is eight readable f64s; the load is unaligned.
            let a = unsafe { _mm512_loadu_pd(v.as_ptr()) };
            if in_range(a) {
                // SAFETY: `o` is eight writable f64s; the store is unaligned.
                unsafe { _mm512_storeu_pd(o.as_mut_ptr(), exp_in_range(a)) };
            } else {
                *o = v.map(libm::exp);
            }
        }
        for (o, &v) in out[whole..].iter_mut().zip(&x[whole..]) {
            *o = libm::exp(v);
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn exp_shifted(x: &[f32], shift: f64, out: &mut [f64]) {
        let whole = x.len() / 8 * 8;
        let s = _mm512_set1_pd(shift);
        for i in (0..whole).step_by(8) {
            let chunk: &[f32; 8] = x[i..i + 8].try_into().expect("8 lanes");
            // SAFETY: `chunk` is eight readable f32s; the load is unaligned. f32 → f64 is exact.
            let v = unsafe { _mm512_cvtps_pd(_mm256_loadu_ps(chunk.as_ptr())) };
            // −inf minus a finite shift is −inf: out of range, so masked entries take the
            // scalar definition.
            let a = _mm512_sub_pd(v, s);
            let dst: &mut [f64; 8] = (&mut out[i..i + 8]).try_into().expect("8 lanes");
            if in_range(a) {
                // SAFETY: `dst` is eight writable f64s; the store is unaligned.
                unsafe { _mm512_storeu_pd(dst.as_mut_ptr(), exp_in_range(a)) };
            } else {
                super::exp_shifted_scalar(chunk, shift, dst);
            }
        }
        super::exp_shifted_scalar(&x[whole..], shift, &mut out[whole..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn same(x: [f64; 4]) {
        let fast = exp4(x);
        for (f, &v) in fast.iter().zip(&x) {
            assert_eq!(
                f.to_bits(),
                libm::exp(v).to_bits(),
                "exp({v:e}) = {f:e}, libm says {:e}",
                libm::exp(v)
            );
        }
    }

    /// f64s around the scalar code's thresholds: each boundary, its neighbours and both signs.
    fn boundaries() -> Vec<f64> {
        let mut v = Vec::new();
        for hi in [0x4086_232bu64, 0x3fd6_2e42, 0x3ff0_a2b2, 0x3e30_0000] {
            for bits in [
                hi << 32,
                (hi << 32) - 1,
                (hi << 32) + 1,
                (hi + 1) << 32,
                ((hi + 1) << 32) - 1,
            ] {
                let x = f64::from_bits(bits);
                v.extend([x, -x]);
            }
        }
        v.extend([
            0.0,
            -0.0,
            709.782_712_893_384,
            -708.396_418_532_264_1,
            -745.133_219_101_941_1,
            -745.2,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            f64::MIN_POSITIVE,
            1e-300,
            -1e-300,
        ]);
        v
    }

    #[test]
    fn every_branch_boundary_is_libm() {
        let b = boundaries();
        for (i, &x) in b.iter().enumerate() {
            // Alone in range, and beside a lane that sends the group to libm.
            same([x, -1.0, 0.25, -3.5]);
            same([x, b[(i + 1) % b.len()], b[(i + 7) % b.len()], x * 0.5]);
            // The same in eight lanes, each lane of the boundary in turn.
            for lane in 0..8 {
                let mut alone = [-1.0, 0.25, -3.5, 0.1, -0.7, 2.0, -20.0, 0.0];
                alone[lane] = x;
                each_form_is_libm(&alone);
                let mut crowd = [x * 0.5; 8];
                for (j, c) in crowd.iter_mut().enumerate() {
                    *c = b[(i + 3 * j + 1) % b.len()];
                }
                crowd[lane] = x;
                each_form_is_libm(&crowd);
            }
        }
    }

    /// `exp_into`'s every vector form this CPU has, each against `libm::exp`.
    fn each_form_is_libm(x: &[f64]) {
        let want: Vec<u64> = x.iter().map(|&v| libm::exp(v).to_bits()).collect();
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut out = vec![0.0; x.len()];
        exp_into(x, &mut out);
        assert_eq!(bits(&out), want, "exp_into({x:?})");
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") {
                // SAFETY: AVX2 was detected.
                unsafe { avx2::exp_into(x, &mut out) };
                assert_eq!(bits(&out), want, "AVX2 exp_into({x:?})");
            }
            if is_x86_feature_detected!("avx512f") {
                // SAFETY: AVX-512F was detected.
                unsafe { avx512::exp_into(x, &mut out) };
                assert_eq!(bits(&out), want, "AVX-512 exp_into({x:?})");
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]

        #[test]
        fn any_f64_is_libm(bits in prop::array::uniform4(any::<u64>())) {
            same(bits.map(f64::from_bits));
        }

        #[test]
        fn softmax_arguments_are_libm(x in prop::array::uniform4(-800.0f64..1.0)) {
            same(x);
        }

        #[test]
        fn small_arguments_are_libm(x in prop::array::uniform4(-2.0f64..2.0),
                                    tiny in prop::array::uniform4(-1e-8f64..1e-8)) {
            same(x);
            same(tiny);
        }

        #[test]
        fn rows_are_libm(x in prop::collection::vec(prop::num::f64::ANY, 0..40),
                         softmax in prop::collection::vec(-800.0f64..1.0, 0..40)) {
            each_form_is_libm(&x);
            each_form_is_libm(&softmax);
        }

        #[test]
        fn shifted_rows_are_the_definition(x in prop::collection::vec(-100.0f32..30.0, 0..40),
                                           masked in prop::collection::vec(any::<bool>(), 40),
                                           shift in -10.0f64..40.0) {
            let x: Vec<f32> = x.iter().zip(&masked)
                .map(|(&v, &m)| if m { f32::NEG_INFINITY } else { v }).collect();
            let mut fast = Vec::new();
            exp_shifted(&x, shift, &mut fast);
            let mut slow = vec![0.0; x.len()];
            exp_shifted_scalar(&x, shift, &mut slow);
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&fast), bits(&slow));
            // Each vector form on its own, whichever the dispatch picks on this CPU.
            #[cfg(target_arch = "x86_64")]
            {
                if is_x86_feature_detected!("avx2") {
                    fast.fill(f64::NAN);
                    // SAFETY: AVX2 was detected.
                    unsafe { avx2::exp_shifted(&x, shift, &mut fast) };
                    prop_assert_eq!(bits(&fast), bits(&slow));
                }
                if is_x86_feature_detected!("avx512f") {
                    fast.fill(f64::NAN);
                    // SAFETY: AVX-512F was detected.
                    unsafe { avx512::exp_shifted(&x, shift, &mut fast) };
                    prop_assert_eq!(bits(&fast), bits(&slow));
                }
            }
        }
    }
}
