//! Freivalds' check of an exact product: `C · r == A · (W · r)` for a random vector `r` the
//! stage never sees, in arithmetic modulo the Mersenne prime `p = 2^61 − 1`.
//!
//! Why it is exact: every value in a product is a dyadic rational `n · 2^e`, and `n · 2^e ↦
//! n · 2^e mod p` is a ring homomorphism from the dyadic rationals to `Z_p` because 2 is
//! invertible modulo an odd prime (`2^61 ≡ 1`, so `2^e ≡ 2^(e mod 61)`). The block-scaled
//! product `C_ij = Σ_b m_x m_w 2^(e_x + e_w) Σ_t q_x q_w` maps term by term, so an honest `C`
//! always passes, and a wrong one passes with probability at most `1/p ≈ 4·10⁻¹⁹` over the
//! choice of `r` (Schwartz–Zippel: `(C − AW) · r` is a non-zero linear form).
//!
//! Cost: `W · r` (`u` below) is precomputed once per weight matrix and secret `r` in O(k·n);
//! each checked row then costs O(k + n) instead of the O(k·n) of re-running it.

use crate::exact::Exact;
use crate::gemm::Accumulators;
use crate::pack::PackedWeights;
use crate::quant::{QuantizedRows, BLOCK};

/// The prime: 2^61 − 1.
pub const P: u64 = (1 << 61) - 1;

/// `x mod p` for `x < 2^125` (the high part must fit a u64).
#[inline]
fn reduce(x: u128) -> u64 {
    // x mod (2^61 − 1) by folding: 2^61 ≡ 1.
    let lo = (x as u64) & P;
    let hi = (x >> 61) as u64;
    let s = lo + (hi & P) + (hi >> 61);
    let s = (s & P) + (s >> 61);
    if s >= P {
        s - P
    } else {
        s
    }
}

#[inline]
fn mul(a: u64, b: u64) -> u64 {
    reduce(a as u128 * b as u128)
}

#[inline]
fn add(a: u64, b: u64) -> u64 {
    let s = a + b;
    if s >= P {
        s - P
    } else {
        s
    }
}

/// `2^e mod p` for any integer `e`.
#[inline]
fn pow2(e: i32) -> u64 {
    1u64 << e.rem_euclid(61)
}

/// `x · 2^e mod p` for `x < p`: multiplying by a power of two modulo a Mersenne prime is a
/// rotation of its 61 bits.
#[inline]
fn times_pow2(x: u64, e: i32) -> u64 {
    let k = e.rem_euclid(61) as u32;
    ((x << k) & P) | (x >> (61 - k))
}

#[cfg(test)]
/// A signed 128-bit integer modulo p (`reduce` takes values below 2^125, so first fold the
/// magnitude below `p · 2^64`).
#[inline]
fn signed_wide(v: i128) -> u64 {
    let m = reduce(v.unsigned_abs() % ((P as u128) << 64));
    if v < 0 && m != 0 {
        P - m
    } else {
        m
    }
}

/// A signed integer modulo p.
#[inline]
fn signed(v: i64) -> u64 {
    // |v| <= 2^63 folds below 2^61 + 4, and one conditional subtraction finishes: 2^61 ≡ 1.
    let a = v.unsigned_abs();
    let f = (a & P) + (a >> 61);
    let m = if f >= P { f - P } else { f };
    if v < 0 && m != 0 {
        P - m
    } else {
        m
    }
}

/// A signed 128-bit integer of magnitude below 2^127 modulo p: folded once in 128 bits
/// (`2^61 ≡ 1`) to below 2^67, which [`reduce`] takes.
#[inline]
fn signed_i128(v: i128) -> u64 {
    let a = v.unsigned_abs();
    let m = reduce((a & P as u128) + (a >> 61));
    if v < 0 && m != 0 {
        P - m
    } else {
        m
    }
}

/// `mant · 2^exp` modulo p: [`exact_mod`] of a small value.
#[inline]
pub fn small_mod(mant: i64, exp: i32) -> u64 {
    times_pow2(signed(mant), exp)
}

/// An exact value modulo p.
#[inline]
pub fn exact_mod(e: &Exact) -> u64 {
    match e {
        Exact::Small { mant, exp } => small_mod(*mant, *exp),
        Exact::Wide { neg, mag, exp } => {
            // Σ limb_i · 2^(64 i), then the sign and the power of two.
            let mut acc = 0u64;
            for (i, l) in mag.iter().enumerate() {
                acc = add(acc, mul(*l % P, pow2(64 * i as i32)));
            }
            let v = mul(acc, pow2(*exp));
            if *neg && v != 0 {
                P - v
            } else {
                v
            }
        }
    }
}

/// A secret challenge for one weight matrix: `r` (one value per output column) and
/// `u = W · r` (one value per position along k, block scales folded in).
#[derive(Clone, Debug)]
pub struct FreivaldsKey {
    /// `r`, each value times its column's unit `2^col_units[j]`: a row revealed in units form
    /// (the sums as the kernels keep them, [`Accumulators::row_as_kept`]) is dotted with these
    /// as it travelled, none of its values reduced modulo p or shifted by its column's unit
    /// first.
    r_units: Vec<u64>,
    /// `u` split as `u_lo + 2^32 · u_hi`, so that a block's `Σ q · u` is two i64 dot products
    /// of int8s by u32s (vectorisable) instead of 32 i128 products.
    u_lo: Vec<u32>,
    u_hi: Vec<u32>,
    /// Each output column's unit exponent (a row revealed in units form is read with them).
    col_units: std::sync::Arc<[i32]>,
}

impl FreivaldsKey {
    /// Draws `r` from `secret` (keep it from the stage being checked) and precomputes `W · r`.
    pub fn new(w: &PackedWeights, secret: &[u8; 32]) -> FreivaldsKey {
        let mut xof = blake3::Hasher::new_keyed(secret).finalize_xof();
        let r: Vec<u64> = (0..w.n())
            .map(|_| {
                let mut b = [0u8; 8];
                xof.fill(&mut b);
                u64::from_le_bytes(b) % P
            })
            .collect();
        let mut u = vec![0u64; w.blocks() * BLOCK];
        for (j, &rj) in r.iter().enumerate() {
            for b in 0..w.blocks() {
                let s = w.scale(j, b);
                let f = mul(mul(s.m as u64, pow2(s.e as i32)), rj);
                for (t, &q) in w.column_block(j, b).iter().enumerate() {
                    if q != 0 {
                        let i = b * BLOCK + t;
                        u[i] = add(u[i], mul(signed(q as i64), f));
                    }
                }
            }
        }
        let col_units = w.col_units();
        FreivaldsKey {
            r_units: r
                .iter()
                .zip(col_units.iter())
                .map(|(&rj, &cu)| times_pow2(rj, cu))
                .collect(),
            u_lo: u.iter().map(|&v| v as u32).collect(),
            u_hi: u.iter().map(|&v| (v >> 32) as u32).collect(),
            col_units,
        }
    }

    /// The unit exponent of each output column, as the kernels keep the product's exact
    /// accumulators ([`Accumulators::col_units`]): what a row revealed in units form is read
    /// with ([`crate::verify::reveal::decode_units_for_check`]).
    pub fn col_units(&self) -> &[i32] {
        &self.col_units[..self.r_units.len()]
    }

    /// Checks row `row` of `acc` (the claimed exact accumulators of `x · W`).
    pub fn check_row(&self, x: &QuantizedRows, row: usize, acc: &Accumulators) -> bool {
        let residues: Vec<u64> = (0..acc.cols).map(|j| exact_mod(&acc.get(row, j))).collect();
        self.check_residues(x, row, &residues)
    }

    /// Checks claimed exact values of row `row` of `x · W` (a row revealed by a stage).
    pub fn check_values(&self, x: &QuantizedRows, row: usize, values: &[Exact]) -> bool {
        let residues: Vec<u64> = values.iter().map(exact_mod).collect();
        self.check_residues(x, row, &residues)
    }

    /// [`Self::check_values`] with the values already reduced modulo p ([`exact_mod`]).
    pub fn check_residues(&self, x: &QuantizedRows, row: usize, residues: &[u64]) -> bool {
        self.output_side_of_residues(residues)
            .is_some_and(|side| self.holds(x, row, side))
    }

    /// Whether `output_side`, the `C_row · r` of a claimed row of `x · W` (from
    /// [`Self::output_side_of_units`] or [`Self::output_side_of_residues`]), is `x_row · (W ·
    /// r)`: Freivalds' test of the row.
    pub fn holds(&self, x: &QuantizedRows, row: usize, output_side: u64) -> bool {
        row < x.rows()
            && x.blocks() * BLOCK == self.u_lo.len()
            && output_side == self.input_side(x, row)
    }

    /// `C_row · r` from the row's values modulo p, in order; none unless there is one per
    /// column. The rare row revealed in the canonical encoding comes this way.
    pub fn output_side_of_residues(&self, residues: &[u64]) -> Option<u64> {
        if residues.len() != self.r_units.len() {
            return None;
        }
        // `r` is `r_units` shifted back by each column's unit. Products are below 2^122;
        // `reduce` takes sums below 2^125, so 8 at a time.
        let mut lhs = 0u64;
        let units = self.col_units.chunks(8);
        for ((v8, r8), cu8) in residues.chunks(8).zip(self.r_units.chunks(8)).zip(units) {
            let mut sum = 0u128;
            for ((&v, &ru), &cu) in v8.iter().zip(r8).zip(cu8) {
                sum += v as u128 * times_pow2(ru, -cu) as u128;
            }
            lhs = add(lhs, reduce(sum));
        }
        Some(lhs)
    }

    /// `C_row · r` of a row revealed in units form: `sums` holding one little-endian `i64` per
    /// column, each value `sums_j · 2^(unit + col_units[j])` (none unless there is one per
    /// column). `Σ_j sums_j · 2^(unit + cu_j) · r_j = 2^unit · Σ_j sums_j · r_units_j`: the
    /// sums enter as they are, so a decoder need not reduce them. The caller refuses the wide
    /// marker `i64::MIN` (it stands for no value); here it would count as −2^63.
    pub fn output_side_of_units(&self, unit: i32, sums: &[u8]) -> Option<u64> {
        if sums.len() != self.r_units.len() * 8 {
            return None;
        }
        let mut lhs = 0u64;
        for (m8, r8) in sums.chunks(64).zip(self.r_units.chunks(8)) {
            // |sum · r_units| < 2^63 · 2^61, so eight of them stay below 2^127 in an i128.
            let mut acc = 0i128;
            for (b, &ru) in m8.chunks_exact(8).zip(r8) {
                let m = i64::from_le_bytes(b.try_into().expect("8 bytes"));
                // Both sign-extended from 64 bits (`ru < p < 2^63`): one 64 × 64 → 128 multiply.
                acc += m as i128 * (ru as i64) as i128;
            }
            lhs = add(lhs, signed_i128(acc));
        }
        Some(times_pow2(lhs, unit))
    }

    /// `x_row · (W · r)`.
    fn input_side(&self, x: &QuantizedRows, row: usize) -> u64 {
        let mut rhs = 0u64;
        for b in 0..x.blocks() {
            let s = x.scale(row, b);
            let q = x.block(row, b);
            let at = b * BLOCK..(b + 1) * BLOCK;
            // `Σ q · u = Σ q · u_lo + 2^32 · Σ q · u_hi`, each half exact in an i64 (|q| <= 128
            // and u_lo < 2^32, u_hi < 2^29: a block's 32 terms stay below 2^44).
            let half =
                |u: &[u32]| -> i64 { q.iter().zip(u).map(|(&q, &u)| q as i64 * u as i64).sum() };
            let (lo, hi) = (half(&self.u_lo[at.clone()]), half(&self.u_hi[at]));
            let dot = add(signed(lo), times_pow2(signed(hi), 32));
            let scale = times_pow2(s.m as u64, s.e as i32);
            rhs = add(rhs, mul(dot, scale));
        }
        rhs
    }

    /// The definition of [`Self::input_side`]: each block's `Σ q · u` in an i128.
    #[cfg(test)]
    fn input_side_by_definition(&self, x: &QuantizedRows, row: usize) -> u64 {
        let mut rhs = 0u64;
        for b in 0..x.blocks() {
            let s = x.scale(row, b);
            // |q · u| < 2^68, so a block's 32 terms sum exactly in an i128.
            let dot: i128 = x
                .block(row, b)
                .iter()
                .zip(&self.u_lo[b * BLOCK..(b + 1) * BLOCK])
                .zip(&self.u_hi[b * BLOCK..(b + 1) * BLOCK])
                .map(|((&q, &lo), &hi)| q as i128 * (lo as u64 | (hi as u64) << 32) as i128)
                .sum();
            let scale = times_pow2(s.m as u64, s.e as i32);
            rhs = add(rhs, mul(signed_wide(dot), scale));
        }
        rhs
    }

    /// Output columns the key checks.
    pub fn cols(&self) -> usize {
        self.r_units.len()
    }

    /// Checks every row; returns the first failing one.
    pub fn check(&self, x: &QuantizedRows, acc: &Accumulators) -> Result<(), usize> {
        if acc.rows != x.rows() || acc.cols != self.r_units.len() {
            return Err(0);
        }
        match (0..x.rows()).find(|&i| !self.check_row(x, i, acc)) {
            Some(i) => Err(i),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_mod_p() {
        assert_eq!(reduce(P as u128), 0);
        assert_eq!(reduce((P as u128) * (P as u128) + 5), 5);
        assert_eq!(mul(pow2(-1), 2), 1, "2^-1 is the inverse of 2");
        assert_eq!(mul(pow2(-70), pow2(70)), 1);
        for x in [0, 1, 5, P - 1, 1 << 60, 123_456_789_012_345] {
            for e in [-200, -61, -1, 0, 1, 13, 60, 61, 62, 1000] {
                assert_eq!(times_pow2(x, e), mul(x, pow2(e)), "{x} · 2^{e}");
            }
        }
        for v in [
            0i128,
            1,
            -1,
            (P as i128) << 3,
            -((1i128 << 73) + 17),
            i128::MAX,
            i128::MIN + 1,
        ] {
            let want = if v < 0 {
                (P - (v.unsigned_abs() % P as u128) as u64) % P
            } else {
                (v as u128 % P as u128) as u64
            };
            assert_eq!(signed_wide(v), want, "{v}");
        }
        assert_eq!(add(signed(-3), 3), 0);
        // The folding reduction is `%` for every i64, at the edges and at random.
        let mut rng = crate::rng::SplitMix64::new(3);
        let edges = [
            0,
            1,
            -1,
            P as i64,
            -(P as i64),
            P as i64 + 1,
            i64::MAX,
            i64::MIN,
        ];
        for v in edges
            .into_iter()
            .chain((0..100_000).map(|_| rng.next_u64() as i64))
        {
            let m = (v as i128).rem_euclid(P as i128) as u64;
            assert_eq!(signed(v), m, "{v}");
        }
        let w = Exact::Wide {
            neg: true,
            mag: vec![5, 1],
            exp: -3,
        };
        // -(5 + 2^64) / 8
        let want = mul(P - add(5, pow2(64)), pow2(-3));
        assert_eq!(exact_mod(&w), want);
    }

    #[test]
    fn a_units_rows_side_is_its_residues_side() {
        let mut rng = crate::rng::SplitMix64::new(8);
        for case in 0..400 {
            let n = 1 + case % 37;
            // `r` below p, at its edges and at random; column units of either sign.
            let key = FreivaldsKey {
                r_units: (0..n)
                    .map(|_| match rng.next_u64() % 4 {
                        0 => [0, 1, P - 1][(rng.next_u64() % 3) as usize],
                        _ => rng.next_u64() % P,
                    })
                    .collect(),
                u_lo: Vec::new(),
                u_hi: Vec::new(),
                col_units: (0..n)
                    .map(|_| (rng.next_u64() % 400) as i32 - 200)
                    .collect(),
            };
            // Sums at the edges of an i64 (the eight-term blocks' bound) and at random.
            let sums: Vec<i64> = (0..n)
                .map(|_| match rng.next_u64() % 4 {
                    0 => [i64::MAX, i64::MIN + 1, -1, 0][(rng.next_u64() % 4) as usize],
                    _ => rng.next_u64() as i64,
                })
                .collect();
            let unit = (rng.next_u64() % 200) as i32 - 100;
            let residues: Vec<u64> = sums
                .iter()
                .zip(key.col_units.iter())
                .map(|(&m, &cu)| small_mod(m, unit + cu))
                .collect();
            let bytes: Vec<u8> = sums.iter().flat_map(|m| m.to_le_bytes()).collect();
            assert_eq!(
                key.output_side_of_units(unit, &bytes),
                key.output_side_of_residues(&residues),
                "case {case}"
            );
        }
        assert_eq!(signed_i128(i128::MIN + 1), signed_wide(i128::MIN + 1));
        assert_eq!(signed_i128(i128::MAX), signed_wide(i128::MAX));
    }

    #[test]
    fn the_input_side_in_halves_is_its_definition() {
        use crate::quant::BlockScale;
        let mut rng = crate::rng::SplitMix64::new(5);
        for case in 0..300 {
            let (rows, blocks) = (1 + case % 3, 1 + case % 7);
            let k = blocks * BLOCK;
            // `u` below p, at its edges (0, the u32 boundary, p − 1) and at random.
            let u: Vec<u64> = (0..k)
                .map(|_| match rng.next_u64() % 6 {
                    0 => P - 1,
                    1 => [0, u32::MAX as u64, 1 << 32][(rng.next_u64() % 3) as usize],
                    _ => rng.next_u64() % P,
                })
                .collect();
            let key = FreivaldsKey {
                r_units: vec![1],
                u_lo: u.iter().map(|&v| v as u32).collect(),
                u_hi: u.iter().map(|&v| (v >> 32) as u32).collect(),
                col_units: vec![0].into(),
            };
            let q: Vec<i8> = (0..rows * k)
                .map(|_| match rng.next_u64() % 4 {
                    0 => [127, -127][(rng.next_u64() % 2) as usize],
                    _ => (rng.next_u64() % 255) as i8,
                })
                .map(|v| if v == i8::MIN { -127 } else { v })
                .collect();
            let scales = (0..rows * blocks)
                .map(|_| BlockScale {
                    m: 128 | rng.next_u64() as u8,
                    e: (rng.next_u64() % 300) as i16 - 150,
                })
                .collect();
            let x = QuantizedRows::from_parts(rows, k, q, scales);
            for row in 0..rows {
                assert_eq!(
                    key.input_side(&x, row),
                    key.input_side_by_definition(&x, row),
                    "case {case} row {row}"
                );
            }
        }
    }
}
