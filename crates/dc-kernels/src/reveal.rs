//! Revealing one row of a committed product: the canonical encoding of the row's exact
//! accumulators travels as bytes, is decoded back into exact values for a check (Freivalds, or
//! recomputing what depends on it), and is tied to the product's commitment by its roundings'
//! leaf and Merkle path.
//!
//! Everything a revealed row carries comes from a peer that may lie, so decoding refuses
//! malformed bytes with a reason and bounds what it allocates.

use crate::commit::{
    encode_row, encode_values, gemm_commitment, product_row_leaf, verify_merkle, Commitment,
};
use crate::exact::{round_i64_fast, Exact};
use crate::gemm::Accumulators;

/// Most limbs a wide value may have on the wire (a real accumulator needs at most a handful).
pub const MAX_WIDE_LIMBS: usize = 64;

/// The canonical encoding of row `row` of `acc` (what its Merkle leaf hashes).
pub fn row_encoding(acc: &Accumulators, row: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(acc.cols * 12);
    encode_row(acc, row, &mut out);
    out
}

/// The canonical encoding of a row of exact values.
pub fn values_encoding(values: &[Exact]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 12);
    encode_values(values, &mut out);
    out
}

/// The Merkle leaf of a row at absolute `position` whose `cols` exact values are encoded as
/// `encoding`: the leaf of their roundings (the same leaf [`crate::commit::row_leaf_at`] and
/// [`crate::commit::exact_row_leaf`] make). Refuses what [`decode_for_check`] refuses.
pub fn leaf_of_encoding(
    position: usize,
    cols: usize,
    encoding: &[u8],
) -> Result<Commitment, String> {
    let want = Decode {
        residues: false,
        rounded: true,
    };
    let row = decode_for_check(encoding, cols, want)?;
    Ok(product_row_leaf(position, &row.rounded))
}

/// Decodes a row of `cols` canonical encodings. Refuses short, long or malformed input.
pub fn decode_row(bytes: &[u8], cols: usize) -> Result<Vec<Exact>, String> {
    let mut out = Vec::with_capacity(cols.min(bytes.len() / 12));
    let mut rest = bytes;
    for c in 0..cols {
        let (mant, exp) = match (take::<8>(&mut rest), take::<4>(&mut rest)) {
            (Some(m), Some(e)) => (i64::from_le_bytes(m), i32::from_le_bytes(e)),
            _ => return Err("the row's encoding ends early".into()),
        };
        if exp != i32::MIN {
            out.push(Exact::Small { mant, exp });
            continue;
        }
        if mant != 0 {
            return Err(format!("value {c}: a wide marker with a mantissa"));
        }
        let (Some(exp), Some([sign]), Some(limbs)) = (
            take::<4>(&mut rest),
            take::<1>(&mut rest),
            take::<4>(&mut rest),
        ) else {
            return Err("the row's encoding ends early".into());
        };
        let neg = match sign {
            0 => false,
            1 => true,
            s => return Err(format!("value {c}: sign byte {s}")),
        };
        let limbs = u32::from_le_bytes(limbs) as usize;
        if limbs == 0 || limbs > MAX_WIDE_LIMBS {
            return Err(format!("value {c}: {limbs} limbs"));
        }
        let mag = (0..limbs)
            .map(|_| take::<8>(&mut rest).map(u64::from_le_bytes))
            .collect::<Option<Vec<u64>>>()
            .ok_or("the row's encoding ends early")?;
        out.push(Exact::Wide {
            neg,
            mag,
            exp: i32::from_le_bytes(exp),
        });
    }
    if !rest.is_empty() {
        return Err(format!(
            "{} bytes after the row's {cols} values",
            rest.len()
        ));
    }
    Ok(out)
}

/// A revealed row decoded for a check: each value modulo Freivalds' prime
/// ([`crate::freivalds::exact_mod`]) and rounded to f32 as the stage's epilogue rounded it
/// ([`rounded`]), each only when asked for ([`Decode`]; empty otherwise). The same numbers as
/// [`decode_row`] then those two maps, in one pass over the bytes and without building the
/// exact values (property-tested against that).
#[derive(Clone, Debug, PartialEq)]
pub struct CheckedRow {
    /// Each value modulo p.
    pub residues: Vec<u64>,
    /// Each value rounded to f32.
    pub rounded: Vec<f32>,
}

/// What [`decode_for_check`] computes: a tested product needs its residues (Freivalds), a
/// product whose output the check computes on needs its rounded values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decode {
    /// The values modulo p.
    pub residues: bool,
    /// The values rounded to f32.
    pub rounded: bool,
}

impl Decode {
    /// Both.
    pub const BOTH: Decode = Decode {
        residues: true,
        rounded: true,
    };
}

/// Decodes a row of `cols` canonical encodings for a check (see [`CheckedRow`]), computing
/// what `want` asks for; refuses what [`decode_row`] refuses, and a value that overflows f32
/// (no honest epilogue produces one) whatever is asked for.
pub fn decode_for_check(bytes: &[u8], cols: usize, want: Decode) -> Result<CheckedRow, String> {
    use crate::freivalds::exact_mod;
    if bytes.len() == cols * 12 {
        // Every value small (12 bytes) is what a product nearly always gives: one tight pass,
        // leaving anything unusual (a wide value, an extreme exponent, an overflow) to the
        // general path below, which gives the same numbers and the errors.
        let mut row = CheckedRow {
            residues: vec![0; if want.residues { cols } else { 0 }],
            rounded: vec![0.0; if want.rounded { cols } else { 0 }],
        };
        if decode_small(bytes, &mut row.residues, &mut row.rounded) {
            return Ok(row);
        }
    }
    let values = decode_row(bytes, cols)?;
    let rounded = values
        .iter()
        .enumerate()
        .map(|(c, v)| rounded(v).ok_or_else(|| format!("value {c} overflows f32")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(CheckedRow {
        residues: match want.residues {
            true => values.iter().map(exact_mod).collect(),
            false => Vec::new(),
        },
        rounded: match want.rounded {
            true => rounded,
            false => Vec::new(),
        },
    })
}

/// The exponents of the usual values: where `round_i64_fast` takes its fast rounding (and
/// `i32::MIN`, the wide marker, is outside).
const USUAL_EXP: std::ops::RangeInclusive<i32> = -1000..=900;

/// [`decode_for_check`] of a row of small 12-byte values (`bytes` is whole values), into
/// `residues` and `rounded` unless they are empty (otherwise each is one per value). Returns
/// false, with the outputs meaningless, when any value is unusual: an exponent outside
/// [`USUAL_EXP`] or a rounding past f32 (checked whether or not the roundings are wanted).
pub fn decode_small(bytes: &[u8], residues: &mut [u64], rounded: &mut [f32]) -> bool {
    let n = bytes.len() / 12;
    assert!(
        bytes.len() == n * 12
            && (residues.is_empty() || residues.len() == n)
            && (rounded.is_empty() || rounded.len() == n),
        "whole values, and one output per value"
    );
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected.
        return unsafe { avx2::decode_small(bytes, residues, rounded) };
    }
    decode_small_scalar(bytes, residues, rounded)
}

/// The definition of [`decode_small`], value by value.
pub fn decode_small_scalar(bytes: &[u8], residues: &mut [u64], rounded: &mut [f32]) -> bool {
    use crate::freivalds::small_mod;
    for (i, rec) in bytes.chunks_exact(12).enumerate() {
        let (m, e) = rec.split_at(8);
        let mant = i64::from_le_bytes(m.try_into().expect("8 bytes"));
        let exp = i32::from_le_bytes(e.try_into().expect("4 bytes"));
        if !USUAL_EXP.contains(&exp) {
            return false;
        }
        if !residues.is_empty() {
            residues[i] = small_mod(mant, exp);
        }
        // Below 2^127 a value cannot round past f32::MAX, so unless its rounding is wanted it
        // need not be computed.
        let top = exp + (64 - mant.unsigned_abs().leading_zeros() as i32);
        if !rounded.is_empty() || top > 127 {
            let f = round_i64_fast(mant, exp);
            if !f.is_finite() {
                return false;
            }
            if !rounded.is_empty() {
                rounded[i] = f;
            }
        }
    }
    true
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! Four values at a time. The residue: `|m|` folded below p (2^61 ≡ 1), negated for a
    //! negative `m`, rotated by `e mod 61` (a multiply-shift division, exact for the usual
    //! exponents). The rounding: `|m|` below 2^52 converts to f64 exactly by the 2^52 bias
    //! trick; a larger one is shifted right by 12 with the bits shifted out kept as a sticky
    //! bit (still ≥ 40 significant bits, so rounding to f32's 24 is unchanged), then scaled by
    //! `2^(e + shift)` exactly in f64 (the usual exponents keep it normal) and rounded once to
    //! f32, to nearest even as `as f32` does: the same bits as `round_i64_fast`.
    use std::arch::x86_64::*;

    use super::USUAL_EXP;
    use crate::freivalds::P;

    /// See [`super::decode_small`] (which checked the lengths).
    #[target_feature(enable = "avx2")]
    pub(super) fn decode_small(bytes: &[u8], residues: &mut [u64], rounded: &mut [f32]) -> bool {
        let n = bytes.len() / 12;
        let (want_res, want_f32) = (!residues.is_empty(), !rounded.is_empty());
        let p = _mm256_set1_epi64x(P as i64);
        let zero = _mm256_setzero_si256();
        let (lo, hi) = (
            _mm_set1_epi32(*USUAL_EXP.start()),
            _mm_set1_epi32(*USUAL_EXP.end()),
        );
        // e + 61·17 is in 0..2048 for the usual exponents, where ⌊x · 2149 / 2^17⌋ = ⌊x / 61⌋.
        let (bias, magic, c61) = (
            _mm_set1_epi32(61 * 17),
            _mm_set1_epi32(2149),
            _mm_set1_epi32(61),
        );
        let two52 = _mm256_set1_epi64x(0x4330_0000_0000_0000);
        let (low12, one, twelve) = (
            _mm256_set1_epi64x(0xfff),
            _mm256_set1_epi64x(1),
            _mm256_set1_epi64x(12),
        );
        let high_halves = _mm256_setr_epi32(1, 3, 5, 7, 0, 0, 0, 0);
        let (sign32, inf32) = (_mm_set1_epi32(i32::MIN), _mm_set1_epi32(0x7f80_0000));
        let mut unusual = _mm_setzero_si128();
        let mut i = 0;
        while i + 4 <= n {
            let group: &[u8; 48] = bytes[i * 12..i * 12 + 48].try_into().expect("4 values");
            let mant = |j: usize| {
                i64::from_le_bytes(group[j * 12..j * 12 + 8].try_into().expect("8 bytes"))
            };
            let exp = |j: usize| {
                i32::from_le_bytes(group[j * 12 + 8..j * 12 + 12].try_into().expect("4 bytes"))
            };
            let m = _mm256_set_epi64x(mant(3), mant(2), mant(1), mant(0));
            let e = _mm_set_epi32(exp(3), exp(2), exp(1), exp(0));
            unusual = _mm_or_si128(
                unusual,
                _mm_or_si128(_mm_cmplt_epi32(e, lo), _mm_cmpgt_epi32(e, hi)),
            );
            let neg = _mm256_cmpgt_epi64(zero, m);
            let mag = _mm256_sub_epi64(_mm256_xor_si256(m, neg), neg);
            if want_res {
                // |m| ≤ 2^63 folds below 2^61 + 4; one conditional subtraction finishes.
                let f = _mm256_add_epi64(_mm256_and_si256(mag, p), _mm256_srli_epi64(mag, 61));
                let f = _mm256_sub_epi64(
                    f,
                    _mm256_and_si256(_mm256_cmpgt_epi64(f, _mm256_sub_epi64(p, one)), p),
                );
                let nonzero = _mm256_xor_si256(_mm256_cmpeq_epi64(f, zero), _mm256_set1_epi64x(-1));
                let x =
                    _mm256_blendv_epi8(f, _mm256_sub_epi64(p, f), _mm256_and_si256(neg, nonzero));
                let eb = _mm_add_epi32(e, bias);
                let q = _mm_srli_epi32(_mm_mullo_epi32(eb, magic), 17);
                let k = _mm256_cvtepu32_epi64(_mm_sub_epi32(eb, _mm_mullo_epi32(q, c61)));
                let r = _mm256_or_si256(
                    _mm256_and_si256(_mm256_sllv_epi64(x, k), p),
                    _mm256_srlv_epi64(x, _mm256_sub_epi64(_mm256_set1_epi64x(61), k)),
                );
                let out = &mut residues[i..i + 4];
                // SAFETY: `out` is four u64s; the store is unaligned.
                unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), r) };
            }
            let big = _mm256_xor_si256(
                _mm256_cmpeq_epi64(_mm256_srli_epi64(mag, 52), zero),
                _mm256_set1_epi64x(-1),
            );
            let shift = _mm256_and_si256(big, twelve);
            let sticky = _mm256_andnot_si256(
                _mm256_cmpeq_epi64(_mm256_and_si256(mag, low12), zero),
                _mm256_and_si256(big, one),
            );
            let kept = _mm256_or_si256(_mm256_srlv_epi64(mag, shift), sticky);
            let whole = _mm256_sub_pd(
                _mm256_castsi256_pd(_mm256_or_si256(kept, two52)),
                _mm256_castsi256_pd(two52),
            );
            let scale = _mm256_slli_epi64(
                _mm256_add_epi64(
                    _mm256_add_epi64(_mm256_cvtepi32_epi64(e), shift),
                    _mm256_set1_epi64x(1023),
                ),
                52,
            );
            let v = _mm_castps_si128(_mm256_cvtpd_ps(_mm256_mul_pd(
                whole,
                _mm256_castsi256_pd(scale),
            )));
            let sign = _mm_and_si128(
                _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(m, high_halves)),
                sign32,
            );
            // Rounded past f32::MAX: infinity (a lane with an unusual exponent may hold
            // anything; it is refused anyway).
            unusual = _mm_or_si128(unusual, _mm_cmpeq_epi32(v, inf32));
            if want_f32 {
                let out = &mut rounded[i..i + 4];
                // SAFETY: `out` is four f32s; the store is unaligned.
                unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), _mm_or_si128(v, sign)) };
            }
            i += 4;
        }
        let tail_res = if want_res {
            &mut residues[i..]
        } else {
            &mut [][..]
        };
        let tail_f32 = if want_f32 {
            &mut rounded[i..]
        } else {
            &mut [][..]
        };
        _mm_testz_si128(unusual, unusual) == 1
            && super::decode_small_scalar(&bytes[i * 12..], tail_res, tail_f32)
    }
}

/// The next `N` bytes of `rest`, if there are that many.
fn take<const N: usize>(rest: &mut &[u8]) -> Option<[u8; N]> {
    let (a, b) = rest.split_first_chunk::<N>()?;
    *rest = b;
    Some(*a)
}

/// [`Exact::to_f32`] with the kernels' fast rounding for the values a product really produces
/// (an odd mantissa below 2^63 and a moderate exponent); anything else takes the general path.
/// The same rounding either way (property-tested).
pub fn rounded(value: &Exact) -> Option<f32> {
    match value {
        // kept < 2^53 and 2^(exp + shift) inside f64's normal range: the f64 product is exact.
        Exact::Small { mant, exp } if (-1000..=900).contains(exp) => {
            let v = round_i64_fast(*mant, *exp);
            v.is_finite().then_some(v)
        }
        _ => value.to_f32(),
    }
}

/// One revealed row of a product committed over `rows` positions starting at `first`.
#[derive(Clone, Copy, Debug)]
pub struct Opening<'a> {
    /// The product's commitment (from the signed trace).
    pub commitment: &'a Commitment,
    /// Positions the commitment covers.
    pub rows: usize,
    /// The first of them.
    pub first: usize,
    /// The revealed row's absolute position.
    pub position: usize,
    /// Values per row.
    pub cols: usize,
    /// The row's canonical encoding.
    pub encoding: &'a [u8],
    /// The Merkle root of the product's rows (claimed; bound by the commitment).
    pub root: &'a Commitment,
    /// The row's Merkle path to that root.
    pub path: &'a [Commitment],
}

impl Opening<'_> {
    /// Whether this is row `position` of the committed product: the root with the shape makes
    /// the commitment, and the leaf of the row's roundings with its path makes the root (a
    /// malformed encoding opens nothing).
    pub fn holds(&self) -> bool {
        leaf_of_encoding(self.position, self.cols, self.encoding)
            .is_ok_and(|leaf| self.holds_for(&leaf))
    }

    /// Whether `leaf` (which a checker computed itself; `encoding` is then unused) is the leaf
    /// of row `position` of the committed product.
    pub fn holds_for(&self, leaf: &Commitment) -> bool {
        let Some(index) = self.position.checked_sub(self.first) else {
            return false;
        };
        index < self.rows
            && gemm_commitment(self.rows, self.cols, self.root) == *self.commitment
            && verify_merkle(self.root, leaf, index, self.rows, self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commit::{exact_row_leaf, merkle_proof, merkle_root, Domain};

    fn values() -> Vec<Exact> {
        vec![
            Exact::from_i64(-5, -9),
            Exact::ZERO,
            Exact::from_i128(-(3i128 << 70) - 1, 4),
            Exact::from_i64(7, 100),
        ]
    }

    #[test]
    fn encodings_decode_back_to_the_same_values() {
        let v = values();
        let bytes = values_encoding(&v);
        assert_eq!(decode_row(&bytes, v.len()), Ok(v.clone()));
        assert_eq!(
            leaf_of_encoding(9, v.len(), &bytes),
            Ok(exact_row_leaf(9, &v))
        );
    }

    /// `decode_row`, then `exact_mod` and `rounded` value by value.
    fn checked_by_definition(bytes: &[u8], cols: usize) -> Result<CheckedRow, String> {
        let values = decode_row(bytes, cols)?;
        Ok(CheckedRow {
            residues: values.iter().map(crate::freivalds::exact_mod).collect(),
            rounded: values
                .iter()
                .enumerate()
                .map(|(c, v)| rounded(v).ok_or_else(|| format!("value {c} overflows f32")))
                .collect::<Result<_, _>>()?,
        })
    }

    #[test]
    fn decoding_for_a_check_is_decoding_then_reducing_and_rounding() {
        let mut rng = crate::rng::SplitMix64::new(11);
        for i in 0..3000u64 {
            let cols = (rng.next_u64() % 40) as usize;
            let values: Vec<Exact> = (0..cols)
                .map(|_| match rng.next_u64() % 16 {
                    0 => Exact::ZERO,
                    // Wide: needs more than 63 bits.
                    1 => Exact::from_i128(((rng.next_u64() as i128) << 40) | 1, -60),
                    // Past the f32 range once rounded.
                    2 if i % 7 == 0 => Exact::from_i64(3, 200),
                    // At the top of the f32 range: f32::MAX, and the first value past it.
                    4 if i % 5 == 0 => Exact::from_i64(0xff_ffff, 104),
                    4 if i % 5 == 1 => Exact::from_i64(0x1ff_ffff, 103),
                    3 => Exact::from_i64(rng.next_u64() as i64, -((rng.next_u64() % 1200) as i32)),
                    _ => Exact::from_i64(
                        (rng.next_u64() >> 20) as i64 - (1 << 43),
                        (rng.next_u64() % 80) as i32 - 60,
                    ),
                })
                .collect();
            let mut bytes = values_encoding(&values);
            if i % 13 == 0 && !bytes.is_empty() {
                // Malformed: cut short or one byte too many.
                if i % 2 == 0 {
                    bytes.pop();
                } else {
                    bytes.push(0);
                }
            }
            let whole = checked_by_definition(&bytes, cols);
            assert_eq!(
                decode_for_check(&bytes, cols, Decode::BOTH),
                whole,
                "case {i}"
            );
            // Either half alone: the same numbers, the same refusals.
            for (residues, rounded) in [(true, false), (false, true), (false, false)] {
                let part = decode_for_check(&bytes, cols, Decode { residues, rounded });
                let want = whole.clone().map(|w| CheckedRow {
                    residues: if residues { w.residues } else { Vec::new() },
                    rounded: if rounded { w.rounded } else { Vec::new() },
                });
                assert_eq!(part, want, "case {i} {residues} {rounded}");
            }
        }
    }

    /// A small value of one of the kinds that meet the fast decoding's edges: zero, ±1, the
    /// i64 extremes, mantissas around 2^52 (where the rounding starts shifting) with and
    /// without bits below the shift, and exponents at the usual range's ends, at f32's top and
    /// in its subnormals.
    fn edge_value(rng: &mut crate::rng::SplitMix64) -> (i64, i32) {
        const P: i64 = crate::freivalds::P as i64;
        let r = rng.next_u64();
        let mant = match r % 10 {
            0 => 0,
            // Multiples of p, negative ones too: residue 0 whatever the sign.
            1 => [
                1,
                -1,
                i64::MIN,
                i64::MAX,
                i64::MIN + 1,
                P,
                -P,
                2 * P,
                -2 * P,
                -3 * P,
            ][(r >> 8) as usize % 10],
            2 => ((1i64 << 52) + ((r >> 8) % 5) as i64 - 2) * if r & 1 << 20 == 0 { 1 } else { -1 },
            3 => ((r >> 12) as i64) << 12,
            4 => -(((r >> 13) as i64) << 12) - ((r >> 40) & 1) as i64,
            5 => (rng.next_u64() >> (rng.next_u64() % 64)) as i64,
            _ => rng.next_u64() as i64,
        };
        let bits = 64 - mant.unsigned_abs().leading_zeros() as i32;
        let exp = match rng.next_u64() % 8 {
            0 => [-1001, -1000, 900, 901][(r >> 24) as usize % 4],
            1 => 126 - bits + (rng.next_u64() % 4) as i32,
            2 => -149 - bits + (rng.next_u64() % 30) as i32 - 15,
            3 => (rng.next_u64() % 2100) as i32 - 1100,
            _ => (rng.next_u64() % 300) as i32 - 200,
        };
        (mant, exp)
    }

    #[test]
    fn the_fast_decoding_is_its_scalar_definition() {
        let mut rng = crate::rng::SplitMix64::new(23);
        let mut accepted = 0;
        for i in 0..20_000u64 {
            let cols = (rng.next_u64() % 41) as usize;
            // Mostly rows of ordinary values with an edge here and there, so that most rows
            // are accepted and every lane position meets every edge.
            let edges = rng.next_u64() % 3;
            let values: Vec<(i64, i32)> = (0..cols)
                .map(|_| match rng.next_u64() % 8 < edges {
                    true => edge_value(&mut rng),
                    false => (
                        (rng.next_u64() >> (rng.next_u64() % 40)) as i64 - (1 << 22),
                        (rng.next_u64() % 120) as i32 - 100,
                    ),
                })
                .collect();
            let bytes: Vec<u8> = values
                .iter()
                .flat_map(|(m, e)| m.to_le_bytes().into_iter().chain(e.to_le_bytes()))
                .collect();
            for (res, f32s) in [(true, true), (true, false), (false, true), (false, false)] {
                let outputs = || {
                    (
                        vec![0u64; if res { cols } else { 0 }],
                        vec![0f32; if f32s { cols } else { 0 }],
                    )
                };
                let (mut r1, mut f1) = outputs();
                let (mut r2, mut f2) = outputs();
                let fast = decode_small(&bytes, &mut r1, &mut f1);
                let scalar = decode_small_scalar(&bytes, &mut r2, &mut f2);
                assert_eq!(fast, scalar, "case {i} {values:?}");
                if fast {
                    accepted += 1;
                    assert_eq!(r1, r2, "case {i} {values:?}");
                    let bits = |f: &[f32]| f.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&f1), bits(&f2), "case {i} {values:?}");
                }
            }
            // And through the entry point, against decoding then reducing and rounding.
            assert_eq!(
                decode_for_check(&bytes, cols, Decode::BOTH),
                checked_by_definition(&bytes, cols),
                "case {i} {values:?}"
            );
        }
        assert!(accepted > 20_000, "the fast path must be taken: {accepted}");
        // Every usual exponent (and the two beyond), each lane position.
        let mants = [1i64, -3, (1 << 52) + 1, i64::MIN, 0x1234_5678_9abc_def1];
        for e in *USUAL_EXP.start() - 1..=*USUAL_EXP.end() + 1 {
            let bytes: Vec<u8> = mants
                .iter()
                .flat_map(|m| m.to_le_bytes().into_iter().chain(e.to_le_bytes()))
                .collect();
            let (mut r1, mut r2) = (vec![0u64; 5], vec![0u64; 5]);
            let fast = decode_small(&bytes, &mut r1, &mut []);
            assert_eq!(fast, decode_small_scalar(&bytes, &mut r2, &mut []), "{e}");
            // Refused: outside the usual range, or i64::MIN · 2^e rounds past f32 (e ≥ 65).
            assert_eq!(fast, USUAL_EXP.contains(&e) && e < 65, "{e}");
            if fast {
                assert_eq!(r1, r2, "{e}");
            }
        }
    }

    #[test]
    fn fast_rounding_is_the_general_rounding() {
        let mut rng = crate::rng::SplitMix64::new(7);
        for i in 0..200_000u64 {
            let mant = match i % 4 {
                0 => (rng.next_u64() >> (rng.next_u64() % 64)) as i64,
                1 => -((rng.next_u64() >> 1) as i64),
                2 => (rng.next_u64() % 1000) as i64 - 500,
                _ => rng.next_u64() as i64,
            };
            let exp = (rng.next_u64() % 2400) as i32 - 1200;
            for e in [
                exp,
                exp % 160,
                -149 - (mant.unsigned_abs().max(1).ilog2() as i32),
                127,
            ] {
                let v = Exact::from_i64(mant, e);
                let (a, b) = (rounded(&v), v.to_f32());
                assert_eq!(a.map(f32::to_bits), b.map(f32::to_bits), "{v:?}");
            }
        }
    }

    #[test]
    fn malformed_encodings_are_refused() {
        let v = values();
        let bytes = values_encoding(&v);
        assert!(decode_row(&bytes[..bytes.len() - 1], v.len()).is_err());
        assert!(decode_row(&bytes, v.len() - 1).is_err(), "trailing bytes");
        assert!(decode_row(&bytes, v.len() + 1).is_err(), "missing value");
        // The wide value (third) starts at byte 24: corrupt its sign byte and limb count.
        let mut bad = bytes.clone();
        bad[24 + 12 + 4] = 7;
        assert!(decode_row(&bad, v.len()).is_err());
        let mut bad = bytes.clone();
        bad[24 + 12 + 5..24 + 12 + 9].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_row(&bad, v.len()).is_err());
        let mut bad = bytes;
        bad[24] = 1;
        assert!(
            decode_row(&bad, v.len()).is_err(),
            "wide marker with a mantissa"
        );
    }

    #[test]
    fn only_the_committed_row_opens() {
        let rows: Vec<Vec<Exact>> = (0..5)
            .map(|r| (0..3).map(|c| Exact::from_i64(r * 10 + c, -2)).collect())
            .collect();
        let first = 40;
        let leaves: Vec<Commitment> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| exact_row_leaf(first + i, r))
            .collect();
        let root = merkle_root(&leaves);
        let commitment = gemm_commitment(5, 3, &root);
        for (i, r) in rows.iter().enumerate() {
            let enc = values_encoding(r);
            let path = merkle_proof(&leaves, i);
            let open = Opening {
                commitment: &commitment,
                rows: 5,
                first,
                position: first + i,
                cols: 3,
                encoding: &enc,
                root: &root,
                path: &path,
            };
            assert!(open.holds(), "row {i}");
            assert!(!Opening {
                position: first + (i + 1) % 5,
                ..open
            }
            .holds());
            assert!(!Opening { rows: 6, ..open }.holds());
            let other = values_encoding(&rows[(i + 1) % 5]);
            assert!(!Opening {
                encoding: &other,
                ..open
            }
            .holds());
            let wrong_root = Domain::MerkleNode.hash(b"x");
            assert!(!Opening {
                root: &wrong_root,
                ..open
            }
            .holds());
        }
    }
}
