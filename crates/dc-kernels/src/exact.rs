//! Exact dyadic values: the accumulators of the integer product, their canonical form, exact
//! summation of block terms with any exponent span, and the one rounding to f32.
//!
//! Every kernel ends here. The SIMD kernels hand over an `i64` sum and its exponent; the
//! reference kernel and the wide fallback hand over arbitrary block terms. Both reach the same
//! canonical [`Exact`] and the same rounding, so agreement between kernels is a property of
//! integers, not of code paths.

/// The canonical form of an exact value: `mant · 2^exp` with `mant` odd, or zero as `(0, 0)`.
///
/// A value whose odd mantissa does not fit in an `i64` is [`Exact::Wide`]; a value that fits is
/// always [`Exact::Small`], so the form is unique and can be hashed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Exact {
    /// `mant · 2^exp`, `mant` odd (or the zero `(0, 0)`).
    Small {
        /// Odd mantissa, or 0 for zero.
        mant: i64,
        /// Power of two.
        exp: i32,
    },
    /// `±mag · 2^exp` with `mag` odd and at least 2^63, little-endian limbs, no leading zero limb.
    Wide {
        /// Sign.
        neg: bool,
        /// Magnitude limbs, little-endian.
        mag: Vec<u64>,
        /// Power of two.
        exp: i32,
    },
}

impl Exact {
    /// Zero.
    pub const ZERO: Exact = Exact::Small { mant: 0, exp: 0 };

    /// The canonical form of `sum · 2^exp`.
    #[inline]
    pub fn from_i64(sum: i64, exp: i32) -> Exact {
        if sum == 0 {
            return Exact::ZERO;
        }
        let tz = sum.trailing_zeros();
        Exact::Small {
            mant: sum >> tz,
            exp: exp + tz as i32,
        }
    }

    /// The canonical form of `sum · 2^exp` for a 128-bit sum.
    pub fn from_i128(sum: i128, exp: i32) -> Exact {
        if sum == 0 {
            return Exact::ZERO;
        }
        let tz = sum.trailing_zeros();
        let mant = sum >> tz;
        let exp = exp + tz as i32;
        match i64::try_from(mant) {
            Ok(mant) => Exact::Small { mant, exp },
            Err(_) => {
                let mag = mant.unsigned_abs();
                let mut limbs = vec![mag as u64, (mag >> 64) as u64];
                trim(&mut limbs);
                Exact::Wide {
                    neg: mant < 0,
                    mag: limbs,
                    exp,
                }
            }
        }
    }

    /// Rounds to the nearest f32, ties to even, as IEEE-754 would round the exact value.
    /// `None` when the rounded value is outside the f32 range (the contract makes that an error).
    #[inline]
    pub fn to_f32(&self) -> Option<f32> {
        match self {
            Exact::Small { mant, exp } => round_u64(*mant < 0, mant.unsigned_abs(), *exp),
            Exact::Wide { neg, mag, exp } => round_limbs(*neg, mag, *exp),
        }
    }

    /// Whether this is exactly zero.
    pub fn is_zero(&self) -> bool {
        matches!(self, Exact::Small { mant: 0, .. })
    }
}

fn trim(limbs: &mut Vec<u64>) {
    while limbs.len() > 1 && limbs.last() == Some(&0) {
        limbs.pop();
    }
}

/// `2^e` as an f64, for `-1022 <= e <= 1023`.
#[inline]
fn pow2(e: i32) -> f64 {
    debug_assert!((-1022..=1023).contains(&e));
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// Smallest exponent of an f32 ulp (the subnormal grid).
const F32_MIN_LSB: i32 = -149;
/// Largest exponent an f32's leading bit can have.
const F32_MAX_TOP: i32 = 127;

/// Builds `±q · 2^lsb`, with `q <= 2^24` and `lsb >= -149`; `None` if it is not a finite f32.
#[inline]
fn assemble(neg: bool, q: u64, lsb: i32) -> Option<f32> {
    if q == 0 {
        return Some(if neg { -0.0 } else { 0.0 });
    }
    let top = 63 - q.leading_zeros() as i32 + lsb;
    if top > F32_MAX_TOP {
        return None;
    }
    // q has at most 25 bits and lsb is on the f32 grid, so both the f64 product and the
    // conversion to f32 are exact.
    let v = (q as f64 * pow2(lsb)) as f32;
    Some(if neg { -v } else { v })
}

/// Rounds `±mag · 2^exp` to f32 (round to nearest, ties to even).
#[inline]
pub fn round_u64(neg: bool, mag: u64, exp: i32) -> Option<f32> {
    if mag == 0 {
        return Some(0.0);
    }
    let bits = 64 - mag.leading_zeros() as i32;
    // A revealed value's exponent comes from a peer: anything far outside f32's range is
    // refused before the arithmetic below could overflow.
    if exp > F32_MAX_TOP {
        return None;
    }
    let lsb = (exp.saturating_add(bits - 24)).max(F32_MIN_LSB);
    let shift = lsb.saturating_sub(exp);
    if shift <= 0 {
        // Fits in 24 bits at its own exponent: exact.
        return assemble(neg, mag, exp);
    }
    let (mut q, half, sticky) = if shift > 64 {
        (0, false, true)
    } else if shift == 64 {
        (0, mag >> 63 == 1, mag << 1 != 0)
    } else {
        let q = mag >> shift;
        let half = (mag >> (shift - 1)) & 1 == 1;
        let sticky = shift > 1 && mag & ((1u64 << (shift - 1)) - 1) != 0;
        (q, half, sticky)
    };
    if half && (sticky || q & 1 == 1) {
        q += 1;
    }
    assemble(neg, q, lsb)
}

/// Rounds `sum · 2^exp` to f32 (ties to even) in a few instructions; ±inf when the rounded
/// value is outside the f32 range. Valid for `-900 <= exp <= 900`.
///
/// Why it is exact: the magnitude is first cut to at most 53 bits with *round to odd* (shifted
/// out bits are ORed into the last kept bit), which makes it exact in f64; the product with
/// `2^(exp + shift)` is exact in f64's wide exponent range; and the one real rounding, f64 to
/// f32, is correct because round-to-odd at 53 bits followed by round-to-nearest at 24 (or
/// fewer, for subnormals) bits equals a single round-to-nearest.
#[inline]
pub fn round_i64_fast(sum: i64, exp: i32) -> f32 {
    let mag = sum.unsigned_abs();
    let shift = (11 - mag.leading_zeros() as i32).max(0);
    let kept = (mag >> shift) | ((mag & ((1u64 << shift) - 1)) != 0) as u64;
    // `kept < 2^53`: the signed conversion is exact and a single instruction.
    let v = (kept as i64 as f64 * pow2(exp + shift)) as f32;
    if sum < 0 {
        -v
    } else {
        v
    }
}

fn bit(limbs: &[u64], i: i64) -> bool {
    if i < 0 {
        return false;
    }
    let (l, b) = ((i / 64) as usize, i % 64);
    l < limbs.len() && (limbs[l] >> b) & 1 == 1
}

fn any_below(limbs: &[u64], i: i64) -> bool {
    // Any bit set strictly below position i.
    if i <= 0 {
        return false;
    }
    let (l, b) = ((i / 64) as usize, i % 64);
    if limbs[..l.min(limbs.len())].iter().any(|&w| w != 0) {
        return true;
    }
    l < limbs.len() && b > 0 && limbs[l] & ((1u64 << b) - 1) != 0
}

/// Rounds `±mag · 2^exp` (little-endian limbs) to f32, ties to even.
pub fn round_limbs(neg: bool, mag: &[u64], exp: i32) -> Option<f32> {
    let Some(top_limb) = mag.iter().rposition(|&w| w != 0) else {
        return Some(0.0);
    };
    let bits = top_limb as i64 * 64 + 64 - mag[top_limb].leading_zeros() as i64;
    let exp = exp as i64;
    let lsb = (exp + bits - 24).max(F32_MIN_LSB as i64);
    if lsb > F32_MAX_TOP as i64 {
        return None;
    }
    let shift = lsb - exp;
    if shift <= 0 {
        return assemble(neg, mag[0], exp as i32);
    }
    let mut q = 0u64;
    for i in (shift..bits).rev() {
        q = (q << 1) | bit(mag, i) as u64;
    }
    let half = bit(mag, shift - 1);
    let sticky = any_below(mag, shift - 1);
    if half && (sticky || q & 1 == 1) {
        q += 1;
    }
    assemble(neg, q, lsb as i32)
}

/// Exact sum of terms `t · 2^e` with any exponent span: an `i128` when the span allows it,
/// two's-complement limbs when it does not.
///
/// This is the reference combination and the fallback of every fast path; it favours being
/// obviously right over being fast.
pub fn exact_sum(terms: &[(i64, i32)]) -> Exact {
    let nonzero = terms.iter().filter(|t| t.0 != 0);
    let Some(emin) = nonzero.clone().map(|t| t.1).min() else {
        return Exact::ZERO;
    };
    let emax = nonzero.clone().map(|t| t.1).max().unwrap_or(emin);
    let count = terms.len().max(1) as u64;
    // Each shifted term needs 64 + span bits; the sum needs log2(count) more.
    let need = 64 + (emax - emin) as u64 + (64 - count.leading_zeros()) as u64 + 1;
    if need <= 127 {
        let mut acc: i128 = 0;
        for &(t, e) in terms.iter().filter(|t| t.0 != 0) {
            acc += (t as i128) << (e - emin);
        }
        return Exact::from_i128(acc, emin);
    }
    let mut limbs = vec![0u64; need.div_ceil(64) as usize + 1];
    for &(t, e) in terms.iter().filter(|t| t.0 != 0) {
        add_shifted(&mut limbs, t, (e - emin) as u64);
    }
    from_twos_complement(limbs, emin)
}

/// Adds `t · 2^shift` into a two's-complement limb array.
fn add_shifted(limbs: &mut [u64], t: i64, shift: u64) {
    let (idx, off) = ((shift / 64) as usize, shift % 64);
    let v = (t as i128) << off; // |t| < 2^63 and off < 64: fits in 127 bits.
    let ext = if v < 0 { u64::MAX } else { 0 };
    let mut carry = false;
    for (j, limb) in limbs.iter_mut().enumerate().skip(idx) {
        let add = match j - idx {
            0 => v as u64,
            1 => (v >> 64) as u64,
            _ => ext,
        };
        let (s1, c1) = limb.overflowing_add(add);
        let (s2, c2) = s1.overflowing_add(carry as u64);
        *limb = s2;
        carry = c1 || c2;
    }
}

fn from_twos_complement(mut limbs: Vec<u64>, exp: i32) -> Exact {
    let neg = limbs.last().is_some_and(|&w| w >> 63 == 1);
    if neg {
        let mut carry = true;
        for w in limbs.iter_mut() {
            let (s, c) = (!*w).overflowing_add(carry as u64);
            *w = s;
            carry = c;
        }
    }
    let Some(first) = limbs.iter().position(|&w| w != 0) else {
        return Exact::ZERO;
    };
    let tz = first as u32 * 64 + limbs[first].trailing_zeros();
    shift_right(&mut limbs, tz);
    trim(&mut limbs);
    let exp = exp + tz as i32;
    if limbs.len() == 1 && limbs[0] <= i64::MAX as u64 {
        let m = limbs[0] as i64;
        return Exact::Small {
            mant: if neg { -m } else { m },
            exp,
        };
    }
    Exact::Wide {
        neg,
        mag: limbs,
        exp,
    }
}

fn shift_right(limbs: &mut [u64], by: u32) {
    let (words, bits) = ((by / 64) as usize, by % 64);
    let n = limbs.len();
    for i in 0..n {
        let lo = limbs.get(i + words).copied().unwrap_or(0);
        let hi = limbs.get(i + words + 1).copied().unwrap_or(0);
        limbs[i] = if bits == 0 {
            lo
        } else {
            (lo >> bits) | (hi << (64 - bits))
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extreme_exponents_round_without_overflow() {
        // A peer's revealed value may carry any exponent (a fuzzer found i32 overflow here).
        for mag in [1u64, 3, u64::MAX] {
            assert_eq!(round_u64(false, mag, i32::MAX), None);
            assert_eq!(round_u64(true, mag, i32::MAX - 5), None);
            assert_eq!(round_u64(false, mag, i32::MIN), Some(0.0));
            assert_eq!(round_u64(false, mag, i32::MIN + 30), Some(0.0));
            assert_eq!(round_limbs(false, &[mag, 1], i32::MAX), None);
            assert_eq!(round_limbs(false, &[mag, 1], i32::MIN), Some(0.0));
        }
        assert_eq!(round_u64(false, 1, 127), Some(f32::from_bits(0x7f00_0000)));
        assert_eq!(round_u64(false, 1, 128), None);
    }

    #[test]
    fn canonical_form_strips_powers_of_two() {
        assert_eq!(Exact::from_i64(12, 3), Exact::Small { mant: 3, exp: 5 });
        assert_eq!(Exact::from_i64(0, 9), Exact::ZERO);
        assert_eq!(
            Exact::from_i64(i64::MIN, 0),
            Exact::Small { mant: -1, exp: 63 }
        );
        assert_eq!(
            Exact::from_i128(3i128 << 70, -4),
            Exact::Small { mant: 3, exp: 66 }
        );
    }

    #[test]
    fn rounding_matches_ieee_for_f64_representable_values() {
        // Anything that fits in 53 bits can be rounded by the hardware as a cross-check.
        let cases: [(i64, i32); 8] = [
            (1, 0),
            ((1 << 24) + 1, 0),
            ((1 << 24) + 3, -10),
            (-((1 << 25) + 2), 5),
            ((1 << 52) - 1, -200),
            (123_456_789, -170),
            (5, -151),
            (-7, -152),
        ];
        for (s, e) in cases {
            let want = (s as f64 * 2f64.powi(e)) as f32;
            let got = Exact::from_i64(s, e).to_f32().expect("in range");
            assert_eq!(got.to_bits(), want.to_bits(), "{s} * 2^{e}");
            assert_eq!(round_u64(s < 0, s.unsigned_abs(), e), Some(want));
            assert_eq!(round_i64_fast(s, e).to_bits(), want.to_bits());
            let limbs = [s.unsigned_abs(), 0];
            assert_eq!(round_limbs(s < 0, &limbs, e), Some(want));
        }
    }

    #[test]
    fn overflow_is_reported() {
        assert_eq!(round_u64(false, 1, 128), None);
        assert_eq!(round_u64(false, (1 << 24) - 1, 104), Some(f32::MAX));
        // Rounds up to 2^128.
        assert_eq!(round_u64(false, (1 << 25) - 1, 103), None);
    }

    #[test]
    fn wide_sums_are_exact() {
        let terms = [(3i64, 200), (-1, -300), (1, -300)];
        assert_eq!(exact_sum(&terms), Exact::Small { mant: 3, exp: 200 });
        let terms = [(1i64, 200), (1, -300)];
        let s = exact_sum(&terms);
        match &s {
            Exact::Wide { neg, mag, exp } => {
                assert!(!neg);
                assert_eq!(*exp, -300);
                assert_eq!(mag.len(), 8);
                assert_eq!(mag[0], 1);
                assert_eq!(mag[7], 1 << (500 - 448));
            }
            other => panic!("expected wide, got {other:?}"),
        }
        assert_eq!(s.to_f32(), None, "2^200 is outside f32");
    }

    #[test]
    fn negative_wide_sum() {
        let terms = [(-1i64, 300), (1, 0), (-(1 << 40), 10)];
        let s = exact_sum(&terms);
        let Exact::Wide { neg, exp, .. } = &s else {
            panic!("expected wide: {s:?}")
        };
        assert!(*neg);
        assert_eq!(*exp, 0);
        assert_eq!(s.to_f32(), None, "2^300 is outside f32");
        let terms = [(-1i64, 100), (1, -200)];
        assert_eq!(exact_sum(&terms).to_f32(), Some(-(2f32.powi(100))));
    }
}
