//! GGML tensor types and their conversion to f32.
//!
//! This module owns the block layouts of the GGML types we can read and the exact float
//! operations that turn a block into f32 values. It must never depend on the CPU it runs on:
//! every conversion is plain scalar code (including f16 → f32, done in software rather than
//! with F16C) so that two peers on different machines produce the same bits.
//!
//! Exactness: every formula below is the one gguf-py's numpy code evaluates
//! (`gguf/quants.py`), with the same operations in the same order. Beyond that, the order
//! cannot matter. Converting an f16 scale or a small integer to f32 is exact, and every
//! product here is exact in f32 because its factors have short significands: an f16 scale
//! has at most 11 significant bits, a sub-block scale at most 6 (Q4_K, Q5_K) or 7 (Q6_K's
//! i8), a quant value at most 7 (Q8_0's i8), 5 (Q5_*, Q6_K) or 4 (Q4_*). The longest product,
//! Q6_K's d·scale·q, needs 11 + 7 + 5 = 23 bits, below f32's 24, and no product comes near
//! f32's exponent limits (the largest is 65504·128·32). So the only operation that rounds is
//! the final addition of the minimum in Q4_1, Q5_1, Q4_K and Q5_K, and it rounds once whether
//! or not a compiler fuses `d * q + m` into an FMA: llama.cpp (which may be built with FP
//! contraction), gguf-py (which is not) and this code agree bit for bit.

use std::fmt;

/// A GGML tensor element type, as numbered in the GGUF file (`ggml_type`).
///
/// Every type GGUF files are known to carry is listed so that a file can be laid out and
/// validated even when we cannot convert some of its tensors; [`GgmlType::can_dequantize`]
/// says which ones [`dequantize`] supports.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// 32 values: f16 scale, 16 bytes of 4-bit values offset by 8.
    Q4_0,
    /// 32 values: f16 scale, f16 minimum, 16 bytes of 4-bit values.
    Q4_1,
    /// 32 values: f16 scale, 32 high bits, 16 bytes of low nibbles, offset by 16.
    Q5_0,
    /// 32 values: f16 scale, f16 minimum, 32 high bits, 16 bytes of low nibbles.
    Q5_1,
    /// 32 values: f16 scale, 32 signed bytes.
    Q8_0,
    /// k-quant, 2 bits.
    Q2_K,
    /// k-quant, 3 bits.
    Q3_K,
    /// k-quant, 4 bits: 256 values in 8 sub-blocks with 6-bit scales and minimums.
    Q4_K,
    /// k-quant, 5 bits: like Q4_K plus one high bit per value.
    Q5_K,
    /// k-quant, 6 bits: 256 values in 16 sub-blocks with signed 8-bit scales.
    Q6_K,
    /// k-quant, 8 bits (intermediate type, rarely stored).
    Q8_K,
    /// i-quant.
    IQ2_XXS,
    /// i-quant.
    IQ2_XS,
    /// i-quant.
    IQ3_XXS,
    /// i-quant.
    IQ1_S,
    /// i-quant, non-linear 4 bits.
    IQ4_NL,
    /// i-quant.
    IQ3_S,
    /// i-quant.
    IQ2_S,
    /// i-quant.
    IQ4_XS,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// IEEE binary64.
    F64,
    /// i-quant.
    IQ1_M,
    /// bfloat16.
    BF16,
    /// Ternary quant.
    TQ1_0,
    /// Ternary quant.
    TQ2_0,
    /// Microscaling FP4.
    MXFP4,
}

impl GgmlType {
    /// The type with GGUF id `id`, if it is one we know the layout of.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            10 => Q2_K,
            11 => Q3_K,
            12 => Q4_K,
            13 => Q5_K,
            14 => Q6_K,
            15 => Q8_K,
            16 => IQ2_XXS,
            17 => IQ2_XS,
            18 => IQ3_XXS,
            19 => IQ1_S,
            20 => IQ4_NL,
            21 => IQ3_S,
            22 => IQ2_S,
            23 => IQ4_XS,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => IQ1_M,
            30 => BF16,
            34 => TQ1_0,
            35 => TQ2_0,
            39 => MXFP4,
            _ => return None,
        })
    }

    /// The GGUF id of this type.
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q2_K => 10,
            Q3_K => 11,
            Q4_K => 12,
            Q5_K => 13,
            Q6_K => 14,
            Q8_K => 15,
            IQ2_XXS => 16,
            IQ2_XS => 17,
            IQ3_XXS => 18,
            IQ1_S => 19,
            IQ4_NL => 20,
            IQ3_S => 21,
            IQ2_S => 22,
            IQ4_XS => 23,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            IQ1_M => 29,
            BF16 => 30,
            TQ1_0 => 34,
            TQ2_0 => 35,
            MXFP4 => 39,
        }
    }

    /// (values per block, bytes per block), as in ggml's type traits and gguf-py's
    /// `GGML_QUANT_SIZES`.
    pub fn block_layout(self) -> (u64, u64) {
        use GgmlType::*;
        match self {
            F32 => (1, 4),
            F16 => (1, 2),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q2_K => (256, 84),
            Q3_K => (256, 110),
            Q4_K => (256, 144),
            Q5_K => (256, 176),
            Q6_K => (256, 210),
            Q8_K => (256, 292),
            IQ2_XXS => (256, 66),
            IQ2_XS => (256, 74),
            IQ3_XXS => (256, 98),
            IQ1_S => (256, 50),
            IQ4_NL => (32, 18),
            IQ3_S => (256, 110),
            IQ2_S => (256, 82),
            IQ4_XS => (256, 136),
            I8 => (1, 1),
            I16 => (1, 2),
            I32 => (1, 4),
            I64 => (1, 8),
            F64 => (1, 8),
            IQ1_M => (256, 56),
            BF16 => (1, 2),
            TQ1_0 => (256, 54),
            TQ2_0 => (256, 66),
            MXFP4 => (32, 17),
        }
    }

    /// Whether [`dequantize`] converts this type.
    pub fn can_dequantize(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            F32 | F16 | BF16 | Q8_0 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q4_K | Q5_K | Q6_K
        )
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

/// Converts IEEE binary16 bits to f32, exactly, in software.
///
/// Every f16 value is representable in f32, so this is exact; NaN payloads are kept (shifted
/// into the top of the f32 mantissa, quiet bit untouched), as numpy's `npy_halfbits_to_floatbits`
/// does. Software rather than F16C so the result never depends on the CPU.
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x03ff);
    let bits = match exp {
        0 if man == 0 => sign,
        0 => {
            // Subnormal: value = man · 2^-24. Normalise the mantissa; each shift lowers the
            // exponent by one. `man` is non-zero and below 2^10, so at most 10 shifts.
            let mut e: u32 = 127 - 15 + 1;
            let mut m = man;
            while m & 0x0400 == 0 {
                m <<= 1;
                e -= 1;
            }
            sign | (e << 23) | ((m & 0x03ff) << 13)
        }
        0x1f => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + (127 - 15)) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// Converts bfloat16 bits to f32: the bits are the top half of an f32 (exact, NaNs kept).
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

/// Why a buffer could not be converted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DequantError {
    /// The type has no converter here.
    Unsupported(GgmlType),
    /// `data` and `out` do not hold the same whole number of blocks.
    Length {
        /// The type.
        ty: GgmlType,
        /// Bytes given.
        bytes: usize,
        /// Values requested.
        values: usize,
    },
}

impl fmt::Display for DequantError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DequantError::Unsupported(ty) => write!(f, "no f32 conversion for GGML type {ty}"),
            DequantError::Length { ty, bytes, values } => {
                let (bs, ts) = ty.block_layout();
                write!(
                    f,
                    "{bytes} bytes of {ty} cannot hold {values} values ({bs} values per {ts}-byte block)"
                )
            }
        }
    }
}

impl std::error::Error for DequantError {}

/// Values converted per parallel task: a multiple of every block size (256), large enough
/// that scheduling costs nothing next to the work.
const CHUNK_VALUES: usize = 1 << 16;

/// Converts `data`, a run of whole blocks of type `ty`, into `out` (one f32 per value).
///
/// Every value depends only on its own block, so the work is split across rayon's pool in
/// block-aligned chunks without changing a single bit of the result.
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    let (bs, ts) = check_lengths(ty, data, out)?;
    use rayon::prelude::*;
    let chunk_bytes = CHUNK_VALUES / bs * ts;
    out.par_chunks_mut(CHUNK_VALUES)
        .zip(data.par_chunks(chunk_bytes))
        .for_each(|(o, d)| dequantize_serial(ty, d, o));
    Ok(())
}

/// The block size and bytes of `ty`, once `data` is checked to be exactly the blocks of `out`.
fn check_lengths(ty: GgmlType, data: &[u8], out: &[f32]) -> Result<(usize, usize), DequantError> {
    if !ty.can_dequantize() {
        return Err(DequantError::Unsupported(ty));
    }
    let (bs, ts) = ty.block_layout();
    let (bs, ts) = (bs as usize, ts as usize);
    if !out.len().is_multiple_of(bs)
        || !data.len().is_multiple_of(ts)
        || out.len() / bs != data.len() / ts
    {
        return Err(DequantError::Length {
            ty,
            bytes: data.len(),
            values: out.len(),
        });
    }
    Ok((bs, ts))
}

/// [`dequantize`] on this thread: for a few blocks (a table row), where handing them to the
/// pool would cost more than converting them.
pub fn dequantize_here(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    check_lengths(ty, data, out)?;
    dequantize_serial(ty, data, out);
    Ok(())
}

/// The scalar converter: `d` holds exactly `o.len() / block_size` blocks (checked by the caller).
fn dequantize_serial(ty: GgmlType, d: &[u8], o: &mut [f32]) {
    let (bs, ts) = ty.block_layout();
    let blocks = d
        .chunks_exact(ts as usize)
        .zip(o.chunks_exact_mut(bs as usize));
    match ty {
        GgmlType::F32 => {
            for (b, y) in blocks {
                y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (b, y) in blocks {
                y[0] = f16_at(b, 0);
            }
        }
        GgmlType::BF16 => {
            for (b, y) in blocks {
                y[0] = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        GgmlType::Q8_0 => blocks.for_each(|(b, y)| q8_0(b, y)),
        GgmlType::Q4_0 => blocks.for_each(|(b, y)| q4_0(b, y)),
        GgmlType::Q4_1 => blocks.for_each(|(b, y)| q4_1(b, y)),
        GgmlType::Q5_0 => blocks.for_each(|(b, y)| q5_0(b, y)),
        GgmlType::Q5_1 => blocks.for_each(|(b, y)| q5_1(b, y)),
        GgmlType::Q4_K => blocks.for_each(|(b, y)| q4_k(b, y)),
        GgmlType::Q5_K => blocks.for_each(|(b, y)| q5_k(b, y)),
        GgmlType::Q6_K => blocks.for_each(|(b, y)| q6_k(b, y)),
        // `dequantize` refuses every other type before splitting the work.
        _ => {}
    }
}

/// Q8_0: `[d: f16][q: i8; 32]`, value `q · d` (gguf-py: `x * d`).
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, &q) in b[2..34].iter().enumerate() {
        y[j] = f32::from(q as i8) * d;
    }
}

/// Q4_0: `[d: f16][qs: u8; 16]`; element j < 16 is the low nibble of `qs[j]`, element j + 16
/// its high nibble; value `d · (q − 8)`.
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        let q = b[2 + j];
        y[j] = d * f32::from((q & 0x0f) as i8 - 8);
        y[j + 16] = d * f32::from((q >> 4) as i8 - 8);
    }
}

/// Q4_1: `[d: f16][m: f16][qs: u8; 16]`, nibbles as Q4_0; value `(d · q) + m`, two roundings
/// (gguf-py: `(d * qs) + m`).
fn q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    for j in 0..16 {
        let q = b[4 + j];
        y[j] = d * f32::from(q & 0x0f) + m;
        y[j + 16] = d * f32::from(q >> 4) + m;
    }
}

/// Q5_0: `[d: f16][qh: u32 LE][qs: u8; 16]`; bit j of `qh` is element j's fifth bit; value
/// `d · (q − 16)`.
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for j in 0..16 {
        let q = b[6 + j];
        let lo = (q & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
        let hi = (q >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
        y[j] = d * f32::from(lo as i8 - 16);
        y[j + 16] = d * f32::from(hi as i8 - 16);
    }
}

/// Q5_1: `[d: f16][m: f16][qh: u32 LE][qs: u8; 16]`; value `(d · q) + m`.
fn q5_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for j in 0..16 {
        let q = b[8 + j];
        let lo = (q & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
        let hi = (q >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
        y[j] = d * f32::from(lo) + m;
        y[j + 16] = d * f32::from(hi) + m;
    }
}

/// The eight 6-bit (scale, minimum) pairs packed in the 12 scale bytes of Q4_K and Q5_K
/// (gguf-py `Q4_K.get_scale_min`).
fn k_scale_min(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 0x3f;
        mn[j] = s[j + 4] & 0x3f;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
    (sc, mn)
}

/// Q4_K: `[d: f16][dmin: f16][scales: 12][qs: 128]`. Sub-block s (32 values) takes the low
/// (s even) or high (s odd) nibbles of `qs[32·(s/2)..][..32]`; value `(d·sc[s])·q − (dmin·m[s])`,
/// each product rounded first, as gguf-py computes `d * qs - dm`.
fn q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let (sc, mn) = k_scale_min(&b[4..16]);
    let qs = &b[16..144];
    for s in 0..8 {
        let dl = d * f32::from(sc[s]);
        let ml = dmin * f32::from(mn[s]);
        let shift = 4 * (s % 2);
        let bytes = &qs[32 * (s / 2)..32 * (s / 2) + 32];
        for l in 0..32 {
            let q = (bytes[l] >> shift) & 0x0f;
            y[32 * s + l] = dl * f32::from(q) - ml;
        }
    }
}

/// Q5_K: `[d: f16][dmin: f16][scales: 12][qh: 32][qs: 128]`; as Q4_K, plus bit s of `qh[l]`
/// as the fifth bit of value l of sub-block s.
fn q5_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let (sc, mn) = k_scale_min(&b[4..16]);
    let qh = &b[16..48];
    let qs = &b[48..176];
    for s in 0..8 {
        let dl = d * f32::from(sc[s]);
        let ml = dmin * f32::from(mn[s]);
        let shift = 4 * (s % 2);
        let bytes = &qs[32 * (s / 2)..32 * (s / 2) + 32];
        for l in 0..32 {
            let q = ((bytes[l] >> shift) & 0x0f) | (((qh[l] >> s) & 1) << 4);
            y[32 * s + l] = dl * f32::from(q) - ml;
        }
    }
}

/// Q6_K: `[ql: 128][qh: 64][scales: i8; 16][d: f16]`. For value e = 128·h + w (h ∈ {0, 1}):
/// low nibble from `ql[64·h + w % 64]` (high nibble when w ≥ 64), two high bits from
/// `qh[32·h + w % 32] >> (2·(w / 32))`; value `(d·scale[e/16])·(q − 32)`.
fn q6_k(b: &[u8], y: &mut [f32]) {
    let ql = &b[0..128];
    let qh = &b[128..192];
    let scales = &b[192..208];
    let d = f16_at(b, 208);
    let mut ds = [0f32; 16];
    for (i, &s) in scales.iter().enumerate() {
        ds[i] = d * f32::from(s as i8);
    }
    for h in 0..2 {
        for w in 0..128 {
            let lo = (ql[64 * h + w % 64] >> (4 * (w / 64))) & 0x0f;
            let hi = (qh[32 * h + w % 32] >> (2 * (w / 32))) & 0x03;
            let q = (lo | (hi << 4)) as i8 - 32;
            let e = 128 * h + w;
            y[e] = ds[e / 16] * f32::from(q);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversion_matches_the_half_crate_for_every_non_nan() {
        for h in 0..=u16::MAX {
            let ours = f16_to_f32(h);
            let theirs = half::f16::from_bits(h).to_f32();
            if theirs.is_nan() {
                assert!(ours.is_nan(), "{h:#06x}");
                // Payload kept, shifted into the top of the mantissa.
                assert_eq!(ours.to_bits() & 0x007f_ffff, u32::from(h & 0x3ff) << 13);
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{h:#06x}");
            }
        }
    }

    /// The module's exactness argument: every product the converters form is exact in f32
    /// (checked against f64, where these products are certainly exact), so the order of
    /// multiplications and FMA contraction cannot change a bit.
    #[test]
    fn every_product_is_exact_in_f32() {
        let finite = (0..=u16::MAX).map(f16_to_f32).filter(|d| d.is_finite());
        // Q6_K's worst case: the 5-bit |q| values with most set bits, every i8 scale.
        let qs6 = [-32i32, -31, -29, -27, -23, 31, 29, 27, 23];
        for d in finite {
            for q in -128i32..=127 {
                // Q8_0, Q4_*, Q5_*, Q4_K/Q5_K (d·sc with sc < 64 is covered by |q| < 128).
                let p = d * q as f32;
                assert_eq!(f64::from(p), f64::from(d) * f64::from(q), "d={d} q={q}");
                for &q6 in &qs6 {
                    let p6 = p * q6 as f32;
                    assert_eq!(
                        f64::from(p6),
                        f64::from(d) * f64::from(q) * f64::from(q6),
                        "d={d} scale={q} q={q6}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_listed_type_round_trips_its_id() {
        for id in 0..64 {
            if let Some(t) = GgmlType::from_id(id) {
                assert_eq!(t.id(), id);
            }
        }
    }

    #[test]
    fn mismatched_lengths_are_refused() {
        let mut out = [0f32; 32];
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 33], &mut out).is_err());
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 68], &mut out).is_err());
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 34], &mut out).is_ok());
        assert_eq!(
            dequantize(GgmlType::IQ2_XS, &[0u8; 74], &mut [0f32; 256]),
            Err(DequantError::Unsupported(GgmlType::IQ2_XS))
        );
    }
}
