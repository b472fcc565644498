//! Revealing one row of a committed product: the row's exact accumulators travel as bytes —
//! in units form (the row's unit exponent and each value's `i64` sum, 8 bytes a value: what a
//! kernel keeps, the columns' units being the checker's own) or, for a row holding a value too
//! wide for that, in canonical encoding (12 bytes a small value) — are decoded back into exact
//! values for a check (Freivalds, or recomputing what depends on it), and are tied to the
//! product's commitment by their roundings' leaf and Merkle path.
//!
//! Everything a revealed row carries comes from a peer that may lie, so decoding refuses
//! malformed bytes with a reason and bounds what it allocates.

use crate::exact::{round_i64_fast, Exact};
use crate::gemm::{Accumulators, WIDE};
use crate::verify::commit::{
    encode_row, encode_values, gemm_commitment, product_row_leaf, verify_merkle, Commitment,
};

/// Most limbs a wide value may have on the wire (a real accumulator needs at most a handful).
pub const MAX_WIDE_LIMBS: usize = 64;

/// The canonical encoding of row `row` of `acc` (what its Merkle leaf hashes).
pub fn row_encoding(acc: &Accumulators, row: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(acc.cols * 12);
    encode_row(acc, row, &mut out);
    out
}

/// Row `row` of `acc` as a stage reveals it: in units form (`Some(unit)`, then each value's
/// `i64` sum, 8 bytes little-endian: column `c` is worth `sum · 2^(unit + acc.col_units()[c])`)
/// when every value has such a sum, which a kernel's row always does; otherwise (`None`) the
/// canonical encoding. Either way no value is put in canonical form on the stage's side.
pub fn row_for_reveal(acc: &Accumulators, row: usize) -> (Option<i32>, Vec<u8>) {
    let (unit, sums) = acc.row_as_kept(row);
    if sums.contains(&WIDE) {
        return (None, row_encoding(acc, row));
    }
    let bytes = match cfg!(target_endian = "little") {
        // SAFETY: an `i64` slice is valid as bytes (no padding, and `u8` needs no alignment),
        // and on a little-endian machine those bytes are the sums' LE encodings.
        true => unsafe { std::slice::from_raw_parts(sums.as_ptr().cast::<u8>(), sums.len() * 8) }
            .to_vec(),
        false => sums.iter().flat_map(|s| s.to_le_bytes()).collect(),
    };
    (Some(unit), bytes)
}

/// The exponents a value in units form may have (`unit + col_unit`): far beyond any product's
/// (block exponents stay within a few hundred of zero), near enough to zero that nothing
/// computed from them overflows.
const UNITS_EXP: std::ops::RangeInclusive<i32> = -(1 << 20)..=(1 << 20);

/// Value `c` of a row in units form: its sum and exponent, from its 8 bytes and units. Refuses
/// the wide marker (a row holding a wide value travels canonically) and an exponent outside
/// [`UNITS_EXP`].
#[inline]
fn unit_value(c: usize, bytes: &[u8], unit: i32, col_unit: i32) -> Result<(i64, i32), String> {
    let sum = i64::from_le_bytes(bytes.try_into().expect("8 bytes a value"));
    let exp = unit
        .checked_add(col_unit)
        .filter(|e| UNITS_EXP.contains(e))
        .ok_or_else(|| format!("value {c}: exponent {unit} + {col_unit} out of range"))?;
    match sum == i64::MIN {
        true => Err(format!("value {c}: the wide marker in units form")),
        false => Ok((sum, exp)),
    }
}

/// The values of a row in units form, checked for length (8 bytes per column of `col_units`).
fn units_values<'a>(
    unit: i32,
    bytes: &'a [u8],
    col_units: &'a [i32],
) -> Result<impl Iterator<Item = Result<(i64, i32), String>> + 'a, String> {
    if bytes.len() != col_units.len() * 8 {
        return Err(format!(
            "{} bytes in units form for {} values",
            bytes.len(),
            col_units.len()
        ));
    }
    Ok(bytes
        .chunks_exact(8)
        .zip(col_units)
        .enumerate()
        .map(move |(c, (b, &cu))| unit_value(c, b, unit, cu)))
}

/// The exact values of a revealed product row in either form ([`row_for_reveal`]), one per
/// column of `col_units` (the product's column units): for tools and tests.
pub fn revealed_values(
    unit: Option<i32>,
    bytes: &[u8],
    col_units: &[i32],
) -> Result<Vec<Exact>, String> {
    match unit {
        None => decode_row(bytes, col_units.len()),
        Some(unit) => units_values(unit, bytes, col_units)?
            .map(|v| v.map(|(sum, exp)| Exact::from_i64(sum, exp)))
            .collect(),
    }
}

/// [`decode_for_check`] of a row in units form: the row's `unit` and `bytes`, with the
/// product's `col_units` (one per value; the checker's own, from its copy of the weights). The
/// same numbers as decoding the same values' canonical encoding (property-tested); refuses
/// what [`revealed_values`] refuses and a value that overflows f32.
pub fn decode_units_for_check(
    unit: i32,
    bytes: &[u8],
    col_units: &[i32],
    want: Decode,
) -> Result<CheckedRow, String> {
    use crate::verify::freivalds::exact_mod;
    let cols = col_units.len();
    if bytes.len() == cols * 8 && UNITS_EXP.contains(&unit) {
        // The usual row, in one tight pass; anything unusual takes the general path below,
        // which gives the same numbers and the errors.
        let mut row = CheckedRow {
            residues: vec![0; if want.residues { cols } else { 0 }],
            rounded: vec![0.0; if want.rounded { cols } else { 0 }],
        };
        if decode_units_small(bytes, unit, col_units, &mut row.residues, &mut row.rounded) {
            return Ok(row);
        }
    }
    let mut row = CheckedRow {
        residues: Vec::with_capacity(if want.residues { cols } else { 0 }),
        rounded: Vec::with_capacity(if want.rounded { cols } else { 0 }),
    };
    for (c, value) in units_values(unit, bytes, col_units)?.enumerate() {
        let (sum, exp) = value?;
        let v = Exact::from_i64(sum, exp);
        let (residue, f) = (exact_mod(&v), rounded(&v).unwrap_or(f32::INFINITY));
        if !f.is_finite() {
            return Err(format!("value {c} overflows f32"));
        }
        if want.residues {
            row.residues.push(residue);
        }
        if want.rounded {
            row.rounded.push(f);
        }
    }
    Ok(row)
}

/// The canonical encoding of a row of exact values.
pub fn values_encoding(values: &[Exact]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 12);
    encode_values(values, &mut out);
    out
}

/// The Merkle leaf of a row at absolute `position` whose `cols` exact values are encoded as
/// `encoding`: the leaf of their roundings (the same leaf [`crate::verify::commit::row_leaf_at`] and
/// [`crate::verify::commit::exact_row_leaf`] make). Refuses what [`decode_for_check`] refuses.
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
/// ([`crate::verify::freivalds::exact_mod`]) and rounded to f32 as the stage's epilogue rounded it
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
    use crate::verify::freivalds::exact_mod;
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
    bytes.chunks_exact(12).enumerate().all(|(i, rec)| {
        let (m, e) = rec.split_at(8);
        let mant = i64::from_le_bytes(m.try_into().expect("8 bytes"));
        let exp = i32::from_le_bytes(e.try_into().expect("4 bytes"));
        small_value(mant, exp, i, residues, rounded)
    })
}

/// Value `i`, `mant · 2^exp`, into `residues[i]` and `rounded[i]` (each unless empty); false
/// when it is unusual (an exponent outside [`USUAL_EXP`], a rounding past f32).
#[inline]
fn small_value(mant: i64, exp: i32, i: usize, residues: &mut [u64], rounded: &mut [f32]) -> bool {
    use crate::verify::freivalds::small_mod;
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
    true
}

/// [`decode_small`] of a row in units form: `bytes` holding one sum per column of
/// `col_units`, with `unit` within ±2^20; false, with the outputs meaningless, when any
/// value is unusual or the wide marker (which [`decode_units_for_check`] then refuses).
pub fn decode_units_small(
    bytes: &[u8],
    unit: i32,
    col_units: &[i32],
    residues: &mut [u64],
    rounded: &mut [f32],
) -> bool {
    let n = col_units.len();
    assert!(
        bytes.len() == n * 8
            && UNITS_EXP.contains(&unit)
            && (residues.is_empty() || residues.len() == n)
            && (rounded.is_empty() || rounded.len() == n),
        "a sum per column, a unit in range, and one output per value"
    );
    // A column unit far out (none of a real product's) is refused value by value as an
    // unusual exponent: the scalar path adds it checked, and in the lanes `unit + cu` wraps,
    // but never into `USUAL_EXP` (with `unit` within ±2^20 that takes a `cu` beyond i32). A
    // pass of its own over the units cost a twentieth of a check of the MLP's first products.
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected.
        return unsafe { avx2::decode_units_small(bytes, unit, col_units, residues, rounded) };
    }
    decode_units_small_scalar(bytes, unit, col_units, residues, rounded)
}

/// The definition of [`decode_units_small`], value by value.
pub fn decode_units_small_scalar(
    bytes: &[u8],
    unit: i32,
    col_units: &[i32],
    residues: &mut [u64],
    rounded: &mut [f32],
) -> bool {
    bytes
        .chunks_exact(8)
        .zip(col_units)
        .enumerate()
        .all(|(i, (b, &cu))| {
            let sum = i64::from_le_bytes(b.try_into().expect("8 bytes"));
            let exp = unit.checked_add(cu);
            sum != i64::MIN && exp.is_some_and(|e| small_value(sum, e, i, residues, rounded))
        })
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
    use crate::verify::freivalds::P;

    /// The constants of [`four`].
    struct Consts {
        p: __m256i,
        zero: __m256i,
        lo: __m128i,
        hi: __m128i,
        bias: __m128i,
        magic: __m128i,
        c61: __m128i,
        two52: __m256i,
        low12: __m256i,
        one: __m256i,
        twelve: __m256i,
        high_halves: __m256i,
        sign32: __m128i,
        inf32: __m128i,
    }

    impl Consts {
        #[target_feature(enable = "avx2")]
        fn new() -> Consts {
            Consts {
                p: _mm256_set1_epi64x(P as i64),
                zero: _mm256_setzero_si256(),
                lo: _mm_set1_epi32(*USUAL_EXP.start()),
                hi: _mm_set1_epi32(*USUAL_EXP.end()),
                // e + 61·17 is in 0..2048 for the usual exponents, where ⌊x · 2149 / 2^17⌋ =
                // ⌊x / 61⌋.
                bias: _mm_set1_epi32(61 * 17),
                magic: _mm_set1_epi32(2149),
                c61: _mm_set1_epi32(61),
                two52: _mm256_set1_epi64x(0x4330_0000_0000_0000),
                low12: _mm256_set1_epi64x(0xfff),
                one: _mm256_set1_epi64x(1),
                twelve: _mm256_set1_epi64x(12),
                high_halves: _mm256_setr_epi32(1, 3, 5, 7, 0, 0, 0, 0),
                sign32: _mm_set1_epi32(i32::MIN),
                inf32: _mm_set1_epi32(0x7f80_0000),
            }
        }
    }

    /// The residues and roundings of the four values `m · 2^e` into `residues[i..i + 4]` and
    /// `rounded[i..i + 4]` (each unless empty); returns a mask of the lanes that are unusual
    /// (an exponent outside [`USUAL_EXP`], a rounding past f32), whose outputs mean nothing.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn four(
        k: &Consts,
        m: __m256i,
        e: __m128i,
        residues: &mut [u64],
        rounded: &mut [f32],
        i: usize,
    ) -> __m128i {
        let mut unusual = _mm_or_si128(_mm_cmplt_epi32(e, k.lo), _mm_cmpgt_epi32(e, k.hi));
        let neg = _mm256_cmpgt_epi64(k.zero, m);
        let mag = _mm256_sub_epi64(_mm256_xor_si256(m, neg), neg);
        if !residues.is_empty() {
            // |m| ≤ 2^63 folds below 2^61 + 4; one conditional subtraction finishes.
            let p = k.p;
            let f = _mm256_add_epi64(_mm256_and_si256(mag, p), _mm256_srli_epi64(mag, 61));
            let f = _mm256_sub_epi64(
                f,
                _mm256_and_si256(_mm256_cmpgt_epi64(f, _mm256_sub_epi64(p, k.one)), p),
            );
            let nonzero = _mm256_xor_si256(_mm256_cmpeq_epi64(f, k.zero), _mm256_set1_epi64x(-1));
            let x = _mm256_blendv_epi8(f, _mm256_sub_epi64(p, f), _mm256_and_si256(neg, nonzero));
            let eb = _mm_add_epi32(e, k.bias);
            let q = _mm_srli_epi32(_mm_mullo_epi32(eb, k.magic), 17);
            let rot = _mm256_cvtepu32_epi64(_mm_sub_epi32(eb, _mm_mullo_epi32(q, k.c61)));
            let r = _mm256_or_si256(
                _mm256_and_si256(_mm256_sllv_epi64(x, rot), p),
                _mm256_srlv_epi64(x, _mm256_sub_epi64(_mm256_set1_epi64x(61), rot)),
            );
            let out = &mut residues[i..i + 4];
            // SAFETY: `out` is four u64s; the store is unaligned.
            unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), r) };
        }
        let big = _mm256_xor_si256(
            _mm256_cmpeq_epi64(_mm256_srli_epi64(mag, 52), k.zero),
            _mm256_set1_epi64x(-1),
        );
        let shift = _mm256_and_si256(big, k.twelve);
        let sticky = _mm256_andnot_si256(
            _mm256_cmpeq_epi64(_mm256_and_si256(mag, k.low12), k.zero),
            _mm256_and_si256(big, k.one),
        );
        let kept = _mm256_or_si256(_mm256_srlv_epi64(mag, shift), sticky);
        let whole = _mm256_sub_pd(
            _mm256_castsi256_pd(_mm256_or_si256(kept, k.two52)),
            _mm256_castsi256_pd(k.two52),
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
            _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(m, k.high_halves)),
            k.sign32,
        );
        // Rounded past f32::MAX: infinity (a lane with an unusual exponent may hold anything;
        // it is refused anyway).
        unusual = _mm_or_si128(unusual, _mm_cmpeq_epi32(v, k.inf32));
        if !rounded.is_empty() {
            let out = &mut rounded[i..i + 4];
            // SAFETY: `out` is four f32s; the store is unaligned.
            unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), _mm_or_si128(v, sign)) };
        }
        unusual
    }

    /// The outputs from `i` on, or empty when not wanted.
    fn tails<'a>(
        residues: &'a mut [u64],
        rounded: &'a mut [f32],
        i: usize,
    ) -> (&'a mut [u64], &'a mut [f32]) {
        let r = match residues.is_empty() {
            true => &mut [][..],
            false => &mut residues[i..],
        };
        let f = match rounded.is_empty() {
            true => &mut [][..],
            false => &mut rounded[i..],
        };
        (r, f)
    }

    /// See [`super::decode_small`] (which checked the lengths).
    #[target_feature(enable = "avx2")]
    pub(super) fn decode_small(bytes: &[u8], residues: &mut [u64], rounded: &mut [f32]) -> bool {
        let n = bytes.len() / 12;
        let k = Consts::new();
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
            unusual = _mm_or_si128(unusual, four(&k, m, e, residues, rounded, i));
            i += 4;
        }
        let (tail_res, tail_f32) = tails(residues, rounded, i);
        _mm_testz_si128(unusual, unusual) == 1
            && super::decode_small_scalar(&bytes[i * 12..], tail_res, tail_f32)
    }

    /// See [`super::decode_units_small`] (which checked the lengths and `unit`'s range).
    #[target_feature(enable = "avx2")]
    pub(super) fn decode_units_small(
        bytes: &[u8],
        unit: i32,
        col_units: &[i32],
        residues: &mut [u64],
        rounded: &mut [f32],
    ) -> bool {
        let n = col_units.len();
        let k = Consts::new();
        let (units, wide) = (_mm_set1_epi32(unit), _mm256_set1_epi64x(i64::MIN));
        let mut unusual = _mm_setzero_si128();
        let mut marked = _mm256_setzero_si256();
        let mut i = 0;
        while i + 4 <= n {
            let at = &bytes[i * 8..i * 8 + 32];
            // SAFETY: `at` is 32 bytes and `col_units[i..i + 4]` 16; the loads are unaligned.
            let (m, cu) = unsafe {
                (
                    _mm256_loadu_si256(at.as_ptr().cast()),
                    _mm_loadu_si128(col_units[i..i + 4].as_ptr().cast()),
                )
            };
            marked = _mm256_or_si256(marked, _mm256_cmpeq_epi64(m, wide));
            let e = _mm_add_epi32(cu, units);
            unusual = _mm_or_si128(unusual, four(&k, m, e, residues, rounded, i));
            i += 4;
        }
        let (tail_res, tail_f32) = tails(residues, rounded, i);
        _mm_testz_si128(unusual, unusual) == 1
            && _mm256_testz_si256(marked, marked) == 1
            && super::decode_units_small_scalar(
                &bytes[i * 8..],
                unit,
                &col_units[i..],
                tail_res,
                tail_f32,
            )
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
    use crate::verify::commit::{exact_row_leaf, merkle_proof, merkle_root, Domain};

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
            residues: values
                .iter()
                .map(crate::verify::freivalds::exact_mod)
                .collect(),
            rounded: values
                .iter()
                .enumerate()
                .map(|(c, v)| rounded(v).ok_or_else(|| format!("value {c} overflows f32")))
                .collect::<Result<_, _>>()?,
        })
    }

    #[test]
    fn a_row_in_units_decodes_as_its_values_canonical_encoding_does() {
        let mut rng = crate::rng::SplitMix64::new(23);
        for i in 0..3000u64 {
            let cols = (rng.next_u64() % 40) as usize;
            let unit = match i % 9 {
                // Values past the f32 range, or below its smallest subnormal.
                0 => 150,
                1 => -1200,
                _ => (rng.next_u64() % 120) as i32 - 90,
            };
            let col_units: Vec<i32> = (0..cols)
                .map(|_| (rng.next_u64() % 40) as i32 - 20)
                .collect();
            let sums: Vec<i64> = (0..cols)
                .map(|_| match rng.next_u64() % 8 {
                    0 => 0,
                    1 => i64::MAX,
                    2 => i64::MIN + 1,
                    // Even sums: a unit below the value's canonical exponent.
                    3 => (rng.next_u64() as i64) << 7,
                    _ => (rng.next_u64() >> 20) as i64 - (1 << 43),
                })
                .collect();
            let bytes: Vec<u8> = sums.iter().flat_map(|s| s.to_le_bytes()).collect();
            let values = revealed_values(Some(unit), &bytes, &col_units).unwrap();
            for (c, (v, &s)) in values.iter().zip(&sums).enumerate() {
                assert_eq!(*v, Exact::from_i64(s, unit + col_units[c]), "case {i}");
            }
            let canonical = values_encoding(&values);
            for want in [
                Decode::BOTH,
                Decode {
                    residues: true,
                    rounded: false,
                },
                Decode {
                    residues: false,
                    rounded: true,
                },
            ] {
                assert_eq!(
                    decode_units_for_check(unit, &bytes, &col_units, want),
                    decode_for_check(&canonical, cols, want),
                    "case {i}"
                );
            }
        }
    }

    #[test]
    fn malformed_rows_in_units_are_refused() {
        let bytes: Vec<u8> = [3i64, -4, 0].iter().flat_map(|s| s.to_le_bytes()).collect();
        let units = [0, 1, 2];
        let decode = |unit, bytes: &[u8], units: &[i32]| {
            decode_units_for_check(unit, bytes, units, Decode::BOTH).unwrap_err()
        };
        assert!(decode(0, &bytes[1..], &units).contains("23 bytes in units form for 3 values"));
        assert!(decode(0, &bytes, &units[..2]).contains("24 bytes in units form for 2 values"));
        assert!(decode(i32::MAX, &bytes, &units).contains("out of range"));
        assert!(decode(-(1 << 20), &bytes, &[0, -1, 0]).contains("value 1: exponent"));
        let mut wide = bytes.clone();
        wide[8..16].copy_from_slice(&i64::MIN.to_le_bytes());
        assert!(decode(0, &wide, &units).contains("value 1: the wide marker"));
        assert!(decode(200, &bytes, &units).contains("value 0 overflows f32"));
        assert!(revealed_values(Some(0), &wide, &units).is_err());
        assert_eq!(
            revealed_values(Some(-1), &bytes, &units),
            Ok(vec![
                Exact::from_i64(3, -1),
                Exact::from_i64(-4, 0),
                Exact::ZERO
            ])
        );
    }

    #[test]
    fn a_kernel_row_is_revealed_in_units_and_a_wide_one_canonically() {
        let values = vec![
            Exact::from_i64(12, 3),
            Exact::from_i64(-7, -4),
            Exact::from_i128(-((1i128 << 70) + 1), -5),
            Exact::ZERO,
        ];
        let acc = Accumulators::from_values(2, 2, &values);
        let (unit, bytes) = row_for_reveal(&acc, 0);
        assert!(unit.is_some() && bytes.len() == 16);
        assert_eq!(
            revealed_values(unit, &bytes, acc.col_units()),
            Ok(values[..2].to_vec())
        );
        let (unit, bytes) = row_for_reveal(&acc, 1);
        assert_eq!(unit, None);
        assert_eq!(
            revealed_values(unit, &bytes, acc.col_units()),
            Ok(values[2..].to_vec())
        );
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
        const P: i64 = crate::verify::freivalds::P as i64;
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

    /// Runs a fast decoding of a row of `cols` values and its scalar definition into every
    /// choice of outputs: the same verdict and, when accepted, the same bits. Returns how many
    /// choices were accepted.
    fn same_as_scalar(
        cols: usize,
        case: &str,
        fast: impl Fn(&mut [u64], &mut [f32]) -> bool,
        scalar: impl Fn(&mut [u64], &mut [f32]) -> bool,
    ) -> usize {
        let mut accepted = 0;
        for (res, f32s) in [(true, true), (true, false), (false, true), (false, false)] {
            let outputs = || {
                (
                    vec![0u64; if res { cols } else { 0 }],
                    vec![0f32; if f32s { cols } else { 0 }],
                )
            };
            let (mut r1, mut f1) = outputs();
            let (mut r2, mut f2) = outputs();
            let ok = fast(&mut r1, &mut f1);
            assert_eq!(ok, scalar(&mut r2, &mut f2), "{case}");
            if ok {
                accepted += 1;
                assert_eq!(r1, r2, "{case}");
                let bits = |f: &[f32]| f.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&f1), bits(&f2), "{case}");
            }
        }
        accepted
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
            accepted += same_as_scalar(
                cols,
                &format!("case {i} {values:?}"),
                |r, f| decode_small(&bytes, r, f),
                |r, f| decode_small_scalar(&bytes, r, f),
            );
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
    fn the_fast_units_decoding_is_its_scalar_definition() {
        let mut rng = crate::rng::SplitMix64::new(29);
        let mut accepted = 0;
        for i in 0..20_000u64 {
            let cols = (rng.next_u64() % 41) as usize;
            let edges = rng.next_u64() % 3;
            // Each value an edge (its exponent split between the row's unit and its column's)
            // now and then, or ordinary; the wide marker at times.
            let unit = (rng.next_u64() % 60) as i32 - 40;
            let values: Vec<(i64, i32)> = (0..cols)
                .map(|_| match rng.next_u64() % 8 < edges {
                    true => {
                        let (m, e) = edge_value(&mut rng);
                        (m, e - unit)
                    }
                    false => (
                        (rng.next_u64() >> (rng.next_u64() % 40)) as i64 - (1 << 22),
                        (rng.next_u64() % 60) as i32 - 50,
                    ),
                })
                .collect();
            let bytes: Vec<u8> = values.iter().flat_map(|(m, _)| m.to_le_bytes()).collect();
            let col_units: Vec<i32> = values.iter().map(|&(_, cu)| cu).collect();
            accepted += same_as_scalar(
                cols,
                &format!("case {i} {values:?}"),
                |r, f| decode_units_small(&bytes, unit, &col_units, r, f),
                |r, f| decode_units_small_scalar(&bytes, unit, &col_units, r, f),
            );
            // And through the entry point, against the definition value by value: the first
            // wide marker or overflow refused, otherwise each value reduced and rounded.
            let mut want = Ok(CheckedRow {
                residues: Vec::new(),
                rounded: Vec::new(),
            });
            for (c, &(m, cu)) in values.iter().enumerate() {
                if m == i64::MIN {
                    want = Err(format!("value {c}: the wide marker in units form"));
                    break;
                }
                let v = Exact::from_i64(m, unit + cu);
                let (Ok(row), Some(f)) = (&mut want, rounded(&v)) else {
                    want = Err(format!("value {c} overflows f32"));
                    break;
                };
                row.residues.push(crate::verify::freivalds::exact_mod(&v));
                row.rounded.push(f);
            }
            let got = decode_units_for_check(unit, &bytes, &col_units, Decode::BOTH);
            assert_eq!(got, want, "case {i} {values:?}");
            // A column unit far out, at any column, is refused by both fast paths (none
            // overflows into an exponent they take).
            if cols > 0 {
                let mut far = col_units.clone();
                let at = (rng.next_u64() % cols as u64) as usize;
                let edge = [i32::MIN, i32::MAX, (1 << 20) + 1, -(1 << 20) - 1, 1 << 30];
                far[at] = edge[(rng.next_u64() % 5) as usize];
                let mut outputs = (vec![0u64; cols], vec![0f32; cols]);
                let (r, f) = (&mut outputs.0, &mut outputs.1);
                assert!(!decode_units_small(&bytes, unit, &far, r, f), "case {i}");
                assert!(
                    !decode_units_small_scalar(&bytes, unit, &far, r, f),
                    "case {i}"
                );
                // (The general path then decides, refusing an exponent out of range.)
                let exp = unit.checked_add(far[at]);
                if exp.is_none_or(|e| !UNITS_EXP.contains(&e)) {
                    let got = decode_units_for_check(unit, &bytes, &far, Decode::BOTH);
                    assert!(got.is_err(), "case {i}");
                }
            }
        }
        assert!(accepted > 20_000, "the fast path must be taken: {accepted}");
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
