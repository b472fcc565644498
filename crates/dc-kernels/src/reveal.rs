//! Revealing one row of a committed product: the row's canonical encoding travels as bytes, is
//! tied to the product's commitment by its Merkle path, and is decoded back into exact values
//! for a check (Freivalds, or recomputing what depends on it).
//!
//! Everything a revealed row carries comes from a peer that may lie, so decoding refuses
//! malformed bytes with a reason and bounds what it allocates.

use crate::commit::{
    encode_row, encode_values, gemm_commitment, verify_merkle, Commitment, Domain,
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

/// The Merkle leaf of a row at absolute `position` with `cols` values encoded as `encoding`
/// (the same leaf [`crate::commit::row_leaf_at`] and [`crate::commit::exact_row_leaf`] make).
pub fn leaf_of_encoding(position: usize, cols: usize, encoding: &[u8]) -> Commitment {
    let mut h = Domain::GemmRow.hasher();
    h.update(&(position as u64).to_le_bytes());
    h.update(&(cols as u64).to_le_bytes());
    h.update(encoding);
    Commitment(*h.finalize().as_bytes())
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
    use crate::freivalds::{exact_mod, small_mod};
    if bytes.len() == cols * 12 {
        // Every value small (12 bytes) is what a product nearly always gives: one tight pass,
        // leaving anything unusual (a wide value, an extreme exponent, an overflow) to the
        // general path below, which gives the same numbers and the errors.
        let mut row = CheckedRow {
            residues: Vec::with_capacity(if want.residues { cols } else { 0 }),
            rounded: Vec::with_capacity(if want.rounded { cols } else { 0 }),
        };
        let mut usual = true;
        for rec in bytes.chunks_exact(12) {
            let (m, e) = rec.split_at(8);
            let mant = i64::from_le_bytes(m.try_into().expect("8 bytes"));
            let exp = i32::from_le_bytes(e.try_into().expect("4 bytes"));
            // The range where `rounded` takes the fast rounding (and i32::MIN, the wide
            // marker, is outside it).
            if !(-1000..=900).contains(&exp) {
                usual = false;
                break;
            }
            if want.residues {
                row.residues.push(small_mod(mant, exp));
            }
            // Below 2^127 a value cannot round past f32::MAX, so unless its rounding is
            // wanted it need not be computed.
            let top = exp + (64 - mant.unsigned_abs().leading_zeros() as i32);
            if want.rounded || top > 127 {
                let f = round_i64_fast(mant, exp);
                if !f.is_finite() {
                    usual = false;
                    break;
                }
                if want.rounded {
                    row.rounded.push(f);
                }
            }
        }
        if usual {
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
    /// the commitment, and the row's leaf with its path makes the root.
    pub fn holds(&self) -> bool {
        self.holds_for(&leaf_of_encoding(self.position, self.cols, self.encoding))
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
    use crate::commit::{exact_row_leaf, merkle_proof, merkle_root};

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
        assert_eq!(leaf_of_encoding(9, v.len(), &bytes), exact_row_leaf(9, &v));
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
