//! Block quantisation (NUMERICS.md §1): blocks of 32 along the reduction dimension, a scale
//! `m · 2^e` with `m` in `[128, 255]`, elements rounded half to even.
//!
//! The scale is found with integer arithmetic on the exact f32 value of the block's amax, so it
//! is the same on every machine. Elements have two implementations: the reference divides exact
//! integers; the fast one divides in f64, which is exact here because `x · 2^-e` is always
//! representable in f64 for f32 inputs and a correctly rounded quotient by `m <= 255` can
//! neither create nor destroy a tie. Tests check the two agree bit for bit.

use crate::error::{KernelError, Result};

/// Elements per quantisation block along the reduction dimension.
pub const BLOCK: usize = 32;

/// Largest magnitude of a quantised element. −128 never appears, which keeps the AVX2
/// sign trick (`vpsignb` + `vpmaddubsw`) free of saturation.
pub const QMAX: i32 = 127;

/// A block's scale `m · 2^e`, `m` in `[128, 255]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockScale {
    /// Mantissa, 8 significant bits.
    pub m: u8,
    /// Power of two.
    pub e: i16,
}

impl BlockScale {
    /// The scale of an all-zero block: `(128, -7)`, i.e. exactly 1.
    pub const ZERO_BLOCK: BlockScale = BlockScale { m: 128, e: -7 };

    /// The smallest `m · 2^e >= amax / 127` with `m` in `[128, 255]`. `amax` must be finite
    /// and non-negative (callers check).
    pub fn for_amax(amax: f32) -> BlockScale {
        if amax == 0.0 {
            return BlockScale::ZERO_BLOCK;
        }
        let (a, p) = decompose(amax);
        let a = a as u64;
        // d is the largest integer with a · 2^d <= 127 · 255; then a · 2^d > 16192.5, so
        // m = ceil(a · 2^d / 127) lands in [128, 255]. A smaller e (larger d) always gives a
        // finer, hence smaller, scale, which is why the largest d is the one we want.
        const TOP: u64 = 127 * 255;
        let bits = 64 - a.leading_zeros() as i32;
        let fits = |d: i32| -> bool {
            if d >= 0 {
                (a << d) <= TOP
            } else {
                a <= TOP << (-d)
            }
        };
        let d = if fits(15 - bits) {
            15 - bits
        } else {
            14 - bits
        };
        let m = if d >= 0 {
            (a << d).div_ceil(127)
        } else {
            a.div_ceil(127u64 << (-d))
        };
        debug_assert!((128..=255).contains(&m), "m = {m}");
        BlockScale {
            m: m as u8,
            e: (p - d) as i16,
        }
    }

    /// The scale as an f64 (exact).
    pub fn to_f64(self) -> f64 {
        self.m as f64 * 2f64.powi(self.e as i32)
    }
}

/// `|x| = a · 2^p` with `a < 2^24` (exact, subnormals included). `x` must be finite and non-zero.
fn decompose(x: f32) -> (u32, i32) {
    let bits = x.to_bits() & 0x7fff_ffff;
    let exp = (bits >> 23) as i32;
    let frac = bits & 0x7f_ffff;
    if exp == 0 {
        (frac, -149)
    } else {
        (frac | 0x80_0000, exp - 150)
    }
}

/// Reference element quantiser: `round_half_even(x / s)` in exact integer arithmetic.
pub fn quantize_element_reference(x: f32, s: BlockScale) -> i8 {
    if x == 0.0 {
        return 0;
    }
    let (a, p) = decompose(x);
    let sh = p - s.e as i32;
    // |x / s| = a · 2^sh / m.
    let (num, den): (u128, u128) = if sh >= 0 {
        if sh > 40 {
            // Only reachable for elements far above the block's amax, which cannot happen.
            return if x > 0.0 { QMAX as i8 } else { -QMAX as i8 };
        }
        ((a as u128) << sh, s.m as u128)
    } else {
        if -sh > 100 {
            return 0;
        }
        (a as u128, (s.m as u128) << (-sh))
    };
    let (quo, rem) = (num / den, num % den);
    let q = match (2 * rem).cmp(&den) {
        std::cmp::Ordering::Greater => quo + 1,
        std::cmp::Ordering::Equal => quo + (quo & 1),
        std::cmp::Ordering::Less => quo,
    };
    let q = (q as i32).min(QMAX);
    if x < 0.0 {
        -q as i8
    } else {
        q as i8
    }
}

/// Fast element quantiser (f64 division); equal to the reference for every f32 input.
#[inline]
pub fn quantize_element(x: f32, s: BlockScale) -> i8 {
    let scaled = x as f64 * 2f64.powi(-(s.e as i32));
    let q = (scaled / s.m as f64).round_ties_even();
    q.clamp(-QMAX as f64, QMAX as f64) as i8
}

/// Quantises one block (up to 32 values; missing values are zero padding) into `out`.
/// Returns the block's scale. Values must be finite (callers check).
pub fn quantize_block(values: &[f32], out: &mut [i8; BLOCK]) -> BlockScale {
    let amax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
    let s = BlockScale::for_amax(amax);
    out.fill(0);
    if amax != 0.0 {
        let inv = 2f64.powi(-(s.e as i32));
        let m = s.m as f64;
        for (o, &v) in out.iter_mut().zip(values) {
            *o = ((v as f64 * inv) / m)
                .round_ties_even()
                .clamp(-QMAX as f64, QMAX as f64) as i8;
        }
    }
    s
}

/// Finds the first non-finite value of a row and reports it.
pub(crate) fn check_finite(values: &[f32], tensor: &str, row: usize) -> Result<()> {
    if let Some(col) = values.iter().position(|v| !v.is_finite()) {
        return Err(KernelError::NonFinite {
            tensor: tensor.to_string(),
            row,
            col,
            value: values[col],
        });
    }
    Ok(())
}

/// Largest exponent span within a row for which the SIMD kernels can fold `m · 2^(e - e_min)`
/// into one positive `i32` multiplier (255 · 2^23 < 2^31).
pub const ROW_SPAN_FAST: i32 = 23;

/// Per-row facts the fast kernels need, computed once per quantisation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowMeta {
    /// Smallest block exponent of the row.
    pub exp_min: i32,
    /// `Σ_b (Σ_t |q_t|) · m_b · 2^(e_b - exp_min)`: with a column's bound it caps every
    /// partial sum of the fast path. Zero when `fast` is false.
    pub bound: u64,
    /// Whether the row's exponent span is at most [`ROW_SPAN_FAST`].
    pub fast: bool,
}

/// Activations (or any left operand) quantised per row along k.
#[derive(Clone, Debug)]
pub struct QuantizedRows {
    rows: usize,
    k: usize,
    blocks: usize,
    q: Vec<i8>,
    abs_q: Vec<u8>,
    scales: Vec<BlockScale>,
    mult: Vec<i32>,
    meta: Vec<RowMeta>,
}

impl QuantizedRows {
    /// Quantises a row-major `rows × k` matrix. `tensor` names it in errors.
    pub fn quantize(x: &[f32], rows: usize, k: usize, tensor: &str) -> Result<QuantizedRows> {
        if x.len() != rows * k {
            return Err(KernelError::Shape {
                op: "quantize",
                detail: format!("{tensor}: {} values for {rows} × {k}", x.len()),
            });
        }
        let blocks = k.div_ceil(BLOCK);
        let mut q = vec![0i8; rows * blocks * BLOCK];
        let mut scales = vec![BlockScale::ZERO_BLOCK; rows * blocks];
        for r in 0..rows {
            let row = &x[r * k..(r + 1) * k];
            check_finite(row, tensor, r)?;
            for b in 0..blocks {
                let vals = &row[b * BLOCK..((b + 1) * BLOCK).min(k)];
                let dst: &mut [i8; BLOCK] = (&mut q
                    [(r * blocks + b) * BLOCK..(r * blocks + b + 1) * BLOCK])
                    .try_into()
                    .expect("block slice is BLOCK long");
                scales[r * blocks + b] = quantize_block(vals, dst);
            }
        }
        Ok(Self::from_parts(rows, k, q, scales))
    }

    /// Builds from already quantised blocks (`q`: rows × blocks × 32, `scales`: rows × blocks).
    /// Used where the contract quantises differently (attention probabilities, tests).
    pub fn from_parts(rows: usize, k: usize, q: Vec<i8>, scales: Vec<BlockScale>) -> Self {
        let blocks = k.div_ceil(BLOCK);
        assert_eq!(q.len(), rows * blocks * BLOCK, "q length");
        assert_eq!(scales.len(), rows * blocks, "scales length");
        debug_assert!(q.iter().all(|&v| v != i8::MIN));
        let abs_q = q.iter().map(|v| v.unsigned_abs()).collect();
        let mut mult = vec![0i32; rows * blocks];
        let mut meta = Vec::with_capacity(rows);
        for r in 0..rows {
            let sc = &scales[r * blocks..(r + 1) * blocks];
            let exp_min = sc.iter().map(|s| s.e as i32).min().unwrap_or(0);
            let exp_max = sc.iter().map(|s| s.e as i32).max().unwrap_or(0);
            let fast = exp_max - exp_min <= ROW_SPAN_FAST;
            let mut bound = 0u64;
            if fast {
                for (b, s) in sc.iter().enumerate() {
                    let m = (s.m as i64) << (s.e as i32 - exp_min);
                    mult[r * blocks + b] = m as i32;
                    let abs_sum: u64 = q[(r * blocks + b) * BLOCK..(r * blocks + b + 1) * BLOCK]
                        .iter()
                        .map(|v| v.unsigned_abs() as u64)
                        .sum();
                    bound = bound.saturating_add(abs_sum * m as u64);
                }
            }
            meta.push(RowMeta {
                exp_min,
                bound,
                fast,
            });
        }
        QuantizedRows {
            rows,
            k,
            blocks,
            q,
            abs_q,
            scales,
            mult,
            meta,
        }
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Reduction length.
    pub fn k(&self) -> usize {
        self.k
    }
    /// Blocks per row.
    pub fn blocks(&self) -> usize {
        self.blocks
    }
    /// The quantised elements of a row's block.
    pub fn block(&self, row: usize, b: usize) -> &[i8] {
        let o = (row * self.blocks + b) * BLOCK;
        &self.q[o..o + BLOCK]
    }
    /// The scale of a row's block.
    pub fn scale(&self, row: usize, b: usize) -> BlockScale {
        self.scales[row * self.blocks + b]
    }
    /// All elements of a row (blocks × 32, zero padded).
    pub fn row_q(&self, row: usize) -> &[i8] {
        &self.q[row * self.blocks * BLOCK..(row + 1) * self.blocks * BLOCK]
    }
    /// Absolute values of a row's elements.
    pub(crate) fn row_abs(&self, row: usize) -> &[u8] {
        &self.abs_q[row * self.blocks * BLOCK..(row + 1) * self.blocks * BLOCK]
    }
    /// `m · 2^(e - exp_min)` per block of a fast row.
    pub(crate) fn row_mult(&self, row: usize) -> &[i32] {
        &self.mult[row * self.blocks..(row + 1) * self.blocks]
    }
    /// The fast-path facts of a row.
    pub fn meta(&self, row: usize) -> RowMeta {
        self.meta[row]
    }
    /// The row's scales.
    pub fn row_scales(&self, row: usize) -> &[BlockScale] {
        &self.scales[row * self.blocks..(row + 1) * self.blocks]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_block_has_unit_scale() {
        assert_eq!(BlockScale::for_amax(0.0), BlockScale::ZERO_BLOCK);
        assert_eq!(BlockScale::ZERO_BLOCK.to_f64(), 1.0);
    }

    #[test]
    fn scale_is_the_smallest_admissible() {
        for amax in [
            1e-40f32,
            1e-38,
            0.001,
            0.5,
            1.0,
            2.5167596,
            127.0,
            3.0e38,
            f32::MAX,
        ] {
            let s = BlockScale::for_amax(amax);
            let a = amax as f64;
            assert!(a / s.to_f64() <= 127.0, "{amax}: {s:?}");
            // The next smaller scale of the form: m-1 at the same e, or 255 at e-1.
            let smaller = if s.m > 128 {
                (s.m as f64 - 1.0) * 2f64.powi(s.e as i32)
            } else {
                255.0 * 2f64.powi(s.e as i32 - 1)
            };
            assert!(a / smaller > 127.0, "{amax}: {s:?} is not the smallest");
        }
    }

    #[test]
    fn fast_and_reference_elements_agree_on_ties() {
        let s = BlockScale { m: 128, e: -7 }; // s = 1
        for (x, q) in [
            (0.5f32, 0i8),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (126.5, 126),
        ] {
            assert_eq!(quantize_element_reference(x, s), q, "{x}");
            assert_eq!(quantize_element(x, s), q, "{x}");
        }
    }

    #[test]
    fn non_finite_is_named() {
        let x = [1.0, 2.0, f32::NAN, 4.0];
        let err = QuantizedRows::quantize(&x, 2, 2, "act").unwrap_err();
        assert_eq!(
            err.to_string(),
            "non-finite value NaN in act at row 1, column 0"
        );
        let err = QuantizedRows::quantize(&x, 3, 2, "act").unwrap_err();
        assert!(matches!(err, KernelError::Shape { .. }));
    }
}
