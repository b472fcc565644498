//! Block quantisation (NUMERICS.md §1): blocks of 32 along the reduction dimension, a scale
//! `m · 2^e` with `m` in `[128, 255]`, elements rounded half to even.
//!
//! The scale is found with integer arithmetic on the exact f32 value of the block's amax, so it
//! is the same on every machine. Elements have three implementations: the reference divides
//! exact integers; the portable fast one divides in f64, which is exact here because `x · 2^-e`
//! is always representable in f64 for f32 inputs and a correctly rounded quotient by
//! `m <= 255` can neither create nor destroy a tie; the activation quantiser
//! ([`QuantizedRows::quantize`]) does the same in f32 with AVX2, eight elements at a time (its
//! own exactness argument is in the `avx2` module below). Tests check all three agree bit for
//! bit.

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
        // For d < 0, ceil(a / (127 · 2^-d)) = ceil(ceil(a / 2^-d) / 127) (nested ceilings of
        // positive integer quotients compose), which keeps the divisor the constant 127.
        let m = if d >= 0 {
            (a << d).div_ceil(127)
        } else {
            a.div_ceil(1 << -d).div_ceil(127)
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

/// `2^e` as an f64, built from its bits (exact; `powi` may be a library call), for
/// `-1022 <= e <= 1023`, which every block exponent of f32 data satisfies.
#[inline(always)]
pub fn pow2_f64(e: i32) -> f64 {
    f64::from_bits(((e.clamp(-1022, 1023) + 1023) as u64) << 52)
}

/// Round half to even, for `|x| < 2^52` (always the case for quantised values): adding and
/// subtracting 2^52 rounds in the default IEEE mode, ties to even, in two instructions, where
/// `f64::round_ties_even` becomes a libm call on baseline x86-64 (no SSE4.1).
#[inline(always)]
pub fn round_half_even(x: f64) -> f64 {
    const C: f64 = 4_503_599_627_370_496.0; // 2^52
    let a = x.abs();
    if a < C {
        ((a + C) - C).copysign(x)
    } else {
        x
    }
}

/// Fast element quantiser (f64 division); equal to the reference for every f32 input.
#[inline]
pub fn quantize_element(x: f32, s: BlockScale) -> i8 {
    let scaled = x as f64 * pow2_f64(-(s.e as i32));
    let q = round_half_even(scaled / s.m as f64);
    q.clamp(-QMAX as f64, QMAX as f64) as i8
}

/// Quantises one block (up to 32 values; missing values are zero padding) into `out`.
/// Returns the block's scale. Values must be finite (callers check).
pub fn quantize_block(values: &[f32], out: &mut [i8; BLOCK]) -> BlockScale {
    let amax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
    let s = BlockScale::for_amax(amax);
    out.fill(0);
    if amax != 0.0 {
        let inv = pow2_f64(-(s.e as i32));
        let m = s.m as f64;
        for (o, &v) in out.iter_mut().zip(values) {
            *o = round_half_even((v as f64 * inv) / m).clamp(-QMAX as f64, QMAX as f64) as i8;
        }
    }
    s
}

/// Quantises one row (`k` values) into `q` and `abs_q` (`blocks × 32`, zero padded; `abs_q`
/// holds the bits of `|q|` as a `u8`) and its block scales. Returns `false`, leaving the
/// outputs unspecified, when the row holds a NaN or an infinity (the caller reports it).
fn quantize_row(row: &[f32], q: &mut [i8], abs_q: &mut [i8], scales: &mut [BlockScale]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 detected.
        return unsafe { avx2::quantize_row(row, q, abs_q, scales) };
    }
    if row.iter().any(|v| !v.is_finite()) {
        return false;
    }
    quantize_row_scalar(row, q, abs_q, scales);
    true
}

/// The portable row quantiser (finite values only), block by block with [`quantize_block`].
fn quantize_row_scalar(row: &[f32], q: &mut [i8], abs_q: &mut [i8], scales: &mut [BlockScale]) {
    for (b, s) in scales.iter_mut().enumerate() {
        let vals = &row[b * BLOCK..((b + 1) * BLOCK).min(row.len())];
        let dst: &mut [i8; BLOCK] = (&mut q[b * BLOCK..(b + 1) * BLOCK])
            .try_into()
            .expect("block slice is BLOCK long");
        *s = quantize_block(vals, dst);
        for (a, v) in abs_q[b * BLOCK..(b + 1) * BLOCK].iter_mut().zip(dst.iter()) {
            *a = v.unsigned_abs() as i8;
        }
    }
}

/// The activation quantiser in AVX2, eight elements per instruction.
///
/// Exactness argument (it must equal [`quantize_element_reference`] for every finite input):
/// - `amax` is the integer maximum of the magnitude bits, which orders finite non-negative
///   floats exactly like their values; the scale then comes from the same integer
///   [`BlockScale::for_amax`] as everywhere else.
/// - `y = x · 2^-e` is computed in f32 by one or two multiplications by powers of two. Scaling
///   up never rounds (`|y| <= 127 · 255 < 2^15`, no overflow); scaling down can only round when
///   `|y| < 2^-126`, and then both the exact and the computed quotient are far below 1/2, so
///   both give 0.
/// - `z = fl(y / m)` is one correctly rounded f32 division, and rounding `z` to an integer
///   (ties to even) gives the same integer as rounding the exact quotient `t = y / m`. Every
///   half-integer `h` with `|h| < 128` is an f32, so the monotone rounding never carries `t`
///   across one; what remains is that it never turns a non-tie into a tie (`fl(t) = h`,
///   `t ≠ h`). Let `2^j` be the lowest set bit of `y` (so `|y| < 2^(j+24)`) and
///   `2^E <= |h| < 2^(E+1)`; `fl(t) = h` needs `|t − h| <= 2^(E−24)`.
///   If `j >= −1`, `y − h·m` is a multiple of 1/2, so `|t − h| >= 1/(2m) > 2^−9`, far more.
///   If `j < −1`, `y − h·m` is an odd multiple of `2^j`, so `2^j / m <= 2^(E−24)`, i.e.
///   `m >= 2^(j+24−E)`; and `|y| = |t|·m >= (2^E − 2^(E−24))·m` with `|y| < 2^(j+24)` gives
///   `m < 2^(j+24−E) / (1 − 2^−24)`. Both together force `m = 2^(j+24−E)`, a power of two in
///   [128, 255]: `m = 128`, where the division is exact and `t = fl(t) = h` was a tie anyway.
///   Quotients below 2^−126 are far below 1/2 whichever way they round.
/// - `|x| <= amax <= 127 · s`, so the rounded quotient is at most 127 in magnitude: no clamp,
///   and −128 never appears.
///
/// Property tests compare it with the reference on random bits, ties and extreme exponents.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{BlockScale, BLOCK};

    /// `2^e` as an f32, for `-126 <= e <= 127`.
    #[inline]
    fn pow2f(e: i32) -> f32 {
        debug_assert!((-126..=127).contains(&e));
        f32::from_bits(((e + 127) as u32) << 23)
    }

    /// See [`super::quantize_row`]. Two passes over the row: all block scales first, then
    /// all elements, so that neither pass waits on the other's long dependency chains (the
    /// integer scale search, the divisions).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_row(
        row: &[f32],
        q: &mut [i8],
        abs_q: &mut [i8],
        scales: &mut [BlockScale],
    ) -> bool {
        let blocks = scales.len();
        assert!(row.len() <= blocks * BLOCK);
        assert!(q.len() == blocks * BLOCK && abs_q.len() == blocks * BLOCK);
        let full = row.len() / BLOCK;
        let mut padded = [0f32; BLOCK];
        if full < blocks {
            let tail = &row[full * BLOCK..];
            padded[..tail.len()].copy_from_slice(tail);
        }
        let block_of = |b: usize| -> &[f32; BLOCK] {
            if b < full {
                row[b * BLOCK..(b + 1) * BLOCK]
                    .try_into()
                    .expect("block slice is BLOCK long")
            } else {
                &padded
            }
        };
        for (b, s) in scales.iter_mut().enumerate() {
            match scale(block_of(b)) {
                Some(v) => *s = v,
                None => return false,
            }
        }
        for (b, &s) in scales.iter().enumerate() {
            let qb: &mut [i8; BLOCK] = (&mut q[b * BLOCK..(b + 1) * BLOCK])
                .try_into()
                .expect("block slice is BLOCK long");
            let ab: &mut [i8; BLOCK] = (&mut abs_q[b * BLOCK..(b + 1) * BLOCK])
                .try_into()
                .expect("block slice is BLOCK long");
            elements(block_of(b), s, qb, ab);
        }
        true
    }

    /// Loads a block as four vectors.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn load(v: &[f32; BLOCK]) -> [__m256; 4] {
        let p = v.as_ptr();
        // SAFETY: `v` holds 32 f32s: four loads of eight.
        unsafe {
            [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ]
        }
    }

    /// A block's scale; `None` if it holds a NaN or an infinity.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn scale(v: &[f32; BLOCK]) -> Option<BlockScale> {
        let mag = _mm256_set1_epi32(0x7fff_ffff);
        let bits = load(v).map(|x| _mm256_and_si256(_mm256_castps_si256(x), mag));
        let m4 = _mm256_max_epi32(
            _mm256_max_epi32(bits[0], bits[1]),
            _mm256_max_epi32(bits[2], bits[3]),
        );
        let m2 = _mm_max_epi32(
            _mm256_castsi256_si128(m4),
            _mm256_extracti128_si256::<1>(m4),
        );
        let m1 = _mm_max_epi32(m2, _mm_shuffle_epi32::<0b01_00_11_10>(m2));
        let m0 = _mm_max_epi32(m1, _mm_shuffle_epi32::<0b10_11_00_01>(m1));
        // Magnitude bits order finite values like the values themselves; anything at or
        // above the bits of infinity is a NaN or an infinity.
        let amax_bits = _mm_cvtsi128_si32(m0) as u32;
        if amax_bits >= 0x7f80_0000 {
            return None;
        }
        Some(BlockScale::for_amax(f32::from_bits(amax_bits)))
    }

    /// A block's elements with its scale `s` (see the module's exactness argument).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn elements(v: &[f32; BLOCK], s: BlockScale, q: &mut [i8; BLOCK], abs_q: &mut [i8; BLOCK]) {
        // 2^-e in one or two factors, each a normal f32: -e is in [-114, 163] for finite
        // non-zero amax, and the second factor is only needed above 2^127. (An all-zero block
        // has e = -7 and quantises to zeros like any other.)
        let ne = -(s.e as i32);
        let (f1, f2) = if ne <= 127 {
            (pow2f(ne), 1.0)
        } else {
            (pow2f(127), pow2f(ne - 127))
        };
        let (f1, f2) = (_mm256_set1_ps(f1), _mm256_set1_ps(f2));
        let m = _mm256_set1_ps(s.m as f32);
        let qi = load(v).map(|x| {
            let y = _mm256_mul_ps(_mm256_mul_ps(x, f1), f2);
            let z = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_div_ps(y, m),
            );
            _mm256_cvttps_epi32(z)
        });
        // i32 → i8 (values are within ±127, so the saturating packs are exact); the packs
        // interleave 128-bit lanes, which the final permutation undoes.
        let w = _mm256_packs_epi16(
            _mm256_packs_epi32(qi[0], qi[1]),
            _mm256_packs_epi32(qi[2], qi[3]),
        );
        let w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: both outputs are 32 bytes.
        unsafe {
            _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, w);
            _mm256_storeu_si256(abs_q.as_mut_ptr() as *mut __m256i, _mm256_abs_epi8(w));
        }
    }
}

/// The sum of a block's magnitudes (each at most 128), eight bytes per step: the bytes are
/// added in 16-bit lanes (at most 4 · 2 · 128 per lane, no carry between lanes), then the
/// lanes are folded by one multiplication whose top 16 bits collect their sum (< 2^13).
fn byte_sum(abs: &[i8]) -> u64 {
    const LOW: u64 = 0x00ff_00ff_00ff_00ff;
    let lanes = abs.chunks_exact(8).fold(0u64, |acc, c| {
        let c: [i8; 8] = c.try_into().expect("8 bytes");
        let w = u64::from_le_bytes(c.map(|v| v as u8));
        acc + (w & LOW) + ((w >> 8) & LOW)
    });
    let tail: u64 = abs
        .chunks_exact(8)
        .remainder()
        .iter()
        .map(|&v| v as u8 as u64)
        .sum();
    (lanes.wrapping_mul(0x0001_0001_0001_0001) >> 48) + tail
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

/// Largest block exponent magnitude the SIMD kernels accept (rows and columns): the exponent
/// of a fast-path sum (row + column, plus at most 11 in the rounding) then stays far inside
/// the range of the exact f64 scaling in `exact::round_i64_fast` and the vector rounding.
/// Quantised f32 data never comes close (its exponents lie in [−163, 114]); only scales made
/// up by hand through `from_parts` or `from_columns` can go past it, and take the exact path.
pub const EXP_FAST: i32 = 400;

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
    /// Per row, its `blocks × 32` elements followed by their magnitudes (the bits of `|q|`,
    /// read as `u8` by the kernels), so a kernel reaches both through one row pointer.
    qa: Vec<i8>,
    scales: Vec<BlockScale>,
    mult: Vec<i32>,
    /// Per row and block, `−128 · Σ_t q_t`: a kernel that feeds the weights to `vpdpbusd` as
    /// unsigned bytes `w + 128` starts each block's sum here, so it ends at the block's `D`.
    offset_sums: Vec<i32>,
    meta: Vec<RowMeta>,
}

impl QuantizedRows {
    /// Quantises a row-major `rows × k` matrix. `tensor` names it in errors.
    ///
    /// The first non-finite value in row-major order is the error, whatever the path.
    pub fn quantize(x: &[f32], rows: usize, k: usize, tensor: &str) -> Result<QuantizedRows> {
        if x.len() != rows * k {
            return Err(KernelError::Shape {
                op: "quantize",
                detail: format!("{tensor}: {} values for {rows} × {k}", x.len()),
            });
        }
        let blocks = k.div_ceil(BLOCK);
        let width = blocks * BLOCK;
        let mut qa = vec![0i8; rows * 2 * width];
        let mut scales = vec![BlockScale::ZERO_BLOCK; rows * blocks];
        for r in 0..rows {
            let row = &x[r * k..(r + 1) * k];
            let (qr, ar) = qa[2 * r * width..2 * (r + 1) * width].split_at_mut(width);
            let sr = &mut scales[r * blocks..(r + 1) * blocks];
            if !quantize_row(row, qr, ar, sr) {
                check_finite(row, tensor, r)?;
                // Not reached: only rows with a non-finite value are refused. Kept total.
                quantize_row_scalar(row, qr, ar, sr);
            }
        }
        Ok(Self::assemble(rows, k, qa, scales))
    }

    /// Builds from already quantised blocks (`q`: rows × blocks × 32, `scales`: rows × blocks).
    /// Used where the contract quantises differently (attention probabilities, tests).
    pub fn from_parts(rows: usize, k: usize, q: Vec<i8>, scales: Vec<BlockScale>) -> Self {
        let blocks = k.div_ceil(BLOCK);
        assert_eq!(q.len(), rows * blocks * BLOCK, "q length");
        assert_eq!(scales.len(), rows * blocks, "scales length");
        debug_assert!(q.iter().all(|&v| v != i8::MIN));
        let width = blocks * BLOCK;
        let mut qa = Vec::with_capacity(2 * q.len());
        for row in q.chunks_exact(width.max(1)) {
            qa.extend_from_slice(row);
            qa.extend(row.iter().map(|v| v.unsigned_abs() as i8));
        }
        Self::assemble(rows, k, qa, scales)
    }

    /// Derives the kernels' per-row facts (multipliers and bounds) from quantised rows.
    fn assemble(rows: usize, k: usize, qa: Vec<i8>, scales: Vec<BlockScale>) -> Self {
        let blocks = k.div_ceil(BLOCK);
        let width = blocks * BLOCK;
        let mut mult = vec![0i32; rows * blocks];
        let offset_sums = qa
            .chunks_exact(width.max(1))
            .step_by(2)
            .flat_map(|row| row.chunks_exact(BLOCK))
            .map(|block| -128 * block.iter().map(|&q| q as i32).sum::<i32>())
            .collect();
        let mut meta = Vec::with_capacity(rows);
        for r in 0..rows {
            let sc = &scales[r * blocks..(r + 1) * blocks];
            let exp_min = sc.iter().map(|s| s.e as i32).min().unwrap_or(0);
            let exp_max = sc.iter().map(|s| s.e as i32).max().unwrap_or(0);
            let fast =
                exp_max - exp_min <= ROW_SPAN_FAST && exp_min >= -EXP_FAST && exp_max <= EXP_FAST;
            let mut bound = 0u64;
            if fast {
                for (b, s) in sc.iter().enumerate() {
                    let m = (s.m as i64) << (s.e as i32 - exp_min);
                    mult[r * blocks + b] = m as i32;
                    let abs = (2 * r + 1) * width + b * BLOCK;
                    let abs_sum = byte_sum(&qa[abs..abs + BLOCK]);
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
            qa,
            scales,
            mult,
            offset_sums,
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
        &self.row_q(row)[b * BLOCK..(b + 1) * BLOCK]
    }
    /// The scale of a row's block.
    pub fn scale(&self, row: usize, b: usize) -> BlockScale {
        self.scales[row * self.blocks + b]
    }
    /// All elements of a row (blocks × 32, zero padded).
    pub fn row_q(&self, row: usize) -> &[i8] {
        let width = self.blocks * BLOCK;
        &self.qa[2 * row * width..(2 * row + 1) * width]
    }
    /// `m · 2^(e - exp_min)` per block of a fast row.
    pub(crate) fn row_mult(&self, row: usize) -> &[i32] {
        &self.mult[row * self.blocks..(row + 1) * self.blocks]
    }
    /// `−128 · Σ q` per block of a row (see the field).
    pub(crate) fn row_offset_sums(&self, row: usize) -> &[i32] {
        &self.offset_sums[row * self.blocks..(row + 1) * self.blocks]
    }
    /// The fast-path facts of a row.
    pub fn meta(&self, row: usize) -> RowMeta {
        self.meta[row]
    }
    /// The row's scales.
    pub fn row_scales(&self, row: usize) -> &[BlockScale] {
        &self.scales[row * self.blocks..(row + 1) * self.blocks]
    }

    /// Appends the canonical bytes of row `row` ([`ROW_BYTES_PER_BLOCK`] per block): every
    /// block's scale as `m: u8, e: i16 LE`, then the row's `blocks × 32` elements (zero past
    /// `k`). What a committed quantised row's leaf hashes and what a reveal of it carries.
    pub fn encode_row(&self, row: usize, out: &mut Vec<u8>) {
        out.reserve(self.blocks * ROW_BYTES_PER_BLOCK);
        for s in self.row_scales(row) {
            out.push(s.m);
            out.extend_from_slice(&s.e.to_le_bytes());
        }
        out.extend(self.row_q(row).iter().map(|&q| q as u8));
    }

    /// Bytes of one row of `k` elements in its canonical encoding
    /// ([`QuantizedRows::encode_row`]).
    pub fn encoded_row_bytes(k: usize) -> usize {
        k.div_ceil(BLOCK) * ROW_BYTES_PER_BLOCK
    }

    /// One row of `k` elements from its canonical bytes ([`QuantizedRows::encode_row`]), as a
    /// peer revealed them: refuses a wrong length, a scale mantissa outside `[128, 255]`, an
    /// element of −128 (the quantiser never makes one) and a non-zero element past `k`, with
    /// the reason.
    pub fn decode_row(bytes: &[u8], k: usize) -> std::result::Result<QuantizedRows, String> {
        let blocks = k.div_ceil(BLOCK);
        if bytes.len() != Self::encoded_row_bytes(k) {
            return Err(format!(
                "a quantised row of {k} elements is {} bytes, not {}",
                Self::encoded_row_bytes(k),
                bytes.len()
            ));
        }
        let (head, elements) = bytes.split_at(blocks * 3);
        let mut scales = Vec::with_capacity(blocks);
        for (b, s) in head.chunks_exact(3).enumerate() {
            let scale = BlockScale {
                m: s[0],
                e: i16::from_le_bytes([s[1], s[2]]),
            };
            if scale.m < 128 {
                return Err(format!(
                    "block {b}'s scale mantissa {} is below 128",
                    scale.m
                ));
            }
            scales.push(scale);
        }
        if let Some(i) = elements.iter().position(|&q| q == 0x80) {
            return Err(format!("element {i} is -128"));
        }
        if let Some(i) = elements[k..].iter().position(|&q| q != 0) {
            return Err(format!("padding element {} is not zero", k + i));
        }
        let q = elements.iter().map(|&b| b as i8).collect();
        Ok(QuantizedRows::from_parts(1, k, q, scales))
    }
}

/// Bytes per block of a quantised row's canonical form: its scale (3) and its 32 elements.
pub const ROW_BYTES_PER_BLOCK: usize = 3 + BLOCK;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_decodes_from_its_canonical_bytes_and_malformed_bytes_are_refused() {
        let k = 70;
        let x: Vec<f32> = (0..2 * k).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let q = QuantizedRows::quantize(&x, 2, k, "x").unwrap();
        let mut bytes = Vec::new();
        q.encode_row(1, &mut bytes);
        assert_eq!(bytes.len(), 3 * ROW_BYTES_PER_BLOCK);
        let back = QuantizedRows::decode_row(&bytes, k).unwrap();
        assert_eq!((back.rows(), back.k()), (1, k));
        assert_eq!(back.row_q(0), q.row_q(1));
        assert_eq!(back.row_scales(0), q.row_scales(1));
        assert_eq!(back.meta(0), q.meta(1));
        let mut again = Vec::new();
        back.encode_row(0, &mut again);
        assert_eq!(again, bytes);
        let refused = |b: &[u8], why: &str| {
            let err = QuantizedRows::decode_row(b, k).unwrap_err();
            assert!(err.contains(why), "{err}");
        };
        refused(&bytes[1..], "bytes");
        refused(&[bytes.clone(), vec![0]].concat(), "bytes");
        let mut b = bytes.clone();
        b[3] = 127;
        refused(&b, "mantissa");
        let mut b = bytes.clone();
        b[9 + 5] = 0x80;
        refused(&b, "-128");
        let mut b = bytes.clone();
        b[9 + k + 1] = 1;
        refused(&b, "padding");
    }

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
