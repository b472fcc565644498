//! The exact int8 loops attention runs per key: block dot products (scores) and rows of values
//! times quantised probabilities added to i32 accumulators (context). SSE2 on x86_64 (part of
//! the baseline: no detection needed), AVX2 where the CPU has it, AVX-512 VNNI where it has
//! that (the block dot products of heads of an even number of blocks, the value rows of heads
//! of whole groups of 16 values), the scalar definition elsewhere; every form is property-tested
//! against the definition. Every product of two int8s fits an i16, and every sum here fits an
//! i32, so the vector forms compute the same integers whatever order they add them in.

use crate::quant::BLOCK;

/// `Σ a_i · b_i` over one block.
#[inline]
pub fn block_dot(a: &[i8; BLOCK], b: &[i8; BLOCK]) -> i32 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE2 is part of the x86_64 baseline every build targets.
    unsafe {
        sse2::block_dot(a, b)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        block_dot_scalar(a, b)
    }
}

/// The definition of [`block_dot`].
pub fn block_dot_scalar(a: &[i8; BLOCK], b: &[i8; BLOCK]) -> i32 {
    a.iter().zip(b).map(|(&x, &y)| x as i32 * y as i32).sum()
}

/// The block dot products of one query against `n` keys: key `i` is the `q.len()` int8s at
/// `keys[i · stride..]`, and `out[i · blocks + b]` receives block `b`'s dot product
/// (`blocks = q.len() / BLOCK`). `out` is resized to `n · blocks`; every entry is written (so
/// a reused buffer is not cleared first).
pub fn block_dots(q: &[i8], keys: &[i8], stride: usize, n: usize, out: &mut Vec<i32>) {
    let blocks = q.len() / BLOCK;
    assert!(q.len() == blocks * BLOCK, "the query is whole blocks");
    assert!(
        n == 0 || (n - 1) * stride + q.len() <= keys.len(),
        "every key is inside `keys`"
    );
    out.truncate(n * blocks);
    out.resize(n * blocks, 0);
    #[cfg(target_arch = "x86_64")]
    if avx512::takes(blocks) {
        // SAFETY: AVX-512 VNNI was detected; the bounds were checked above.
        unsafe { avx512::block_dots(q, keys, stride, n, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 was detected; the bounds were checked above.
        unsafe { avx2::block_dots(q, keys, stride, n, out) };
        return;
    }
    block_dots_scalar(q, keys, stride, n, out);
}

/// The definition of [`block_dots`] (`out` already `n · blocks` long).
pub fn block_dots_scalar(q: &[i8], keys: &[i8], stride: usize, n: usize, out: &mut [i32]) {
    let blocks = q.len() / BLOCK;
    for i in 0..n {
        for b in 0..blocks {
            let qb = q[b * BLOCK..(b + 1) * BLOCK]
                .try_into()
                .expect("BLOCK long");
            let at = i * stride + b * BLOCK;
            let kb = keys[at..at + BLOCK].try_into().expect("BLOCK long");
            out[i * blocks + b] = block_dot(qb, kb);
        }
    }
}

/// Rows of values a block holds: a block of keys.
pub const BLOCK_ROWS: usize = BLOCK;

/// Where row `j`'s value `d` sits in a block of [`BLOCK_ROWS`] rows of `width` values stored
/// four rows interleaved: the rows in groups of four, each group as `width` runs of four bytes
/// (value `d` of the group's four rows in turn). Four consecutive bytes are then the four
/// values one output takes from four rows, which is what one `vpdpbusd` lane multiplies.
#[inline]
pub fn interleaved_at(j: usize, d: usize, width: usize) -> usize {
    (j / 4) * 4 * width + 4 * d + j % 4
}

/// `acc_d += Σ_j w_j · block[interleaved_at(j, d, acc.len())]` for the [`BLOCK_ROWS`] weights
/// `w_j` in `[0, 127]` and every `d < acc.len()`: a block of keys' value rows, stored four
/// rows interleaved, times their quantised probabilities (a key outside the block's range
/// weighs zero). Four rows per multiply in AVX-512 VNNI (outputs in whole groups of 16) or
/// AVX2 (groups of 8) where the CPU has it, the definition otherwise.
pub fn add_interleaved_rows(acc: &mut [i32], block: &[i8], w: &[u8; BLOCK_ROWS]) {
    assert!(
        block.len() >= BLOCK_ROWS * acc.len(),
        "the block holds every row"
    );
    debug_assert!(w.iter().all(|&x| x <= 127), "weights in [0, 127]");
    #[cfg(target_arch = "x86_64")]
    if avx512::takes_interleaved(acc.len()) {
        // SAFETY: AVX-512 VNNI was detected; the bounds were checked above.
        unsafe { avx512::add_interleaved_rows(acc, block, w) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if acc.len().is_multiple_of(8) && has_avx2() {
        // SAFETY: AVX2 was detected; the bounds were checked above.
        unsafe { avx2::add_interleaved_rows(acc, block, w) };
        return;
    }
    add_interleaved_rows_scalar(acc, block, w);
}

/// The definition of [`add_interleaved_rows`].
pub fn add_interleaved_rows_scalar(acc: &mut [i32], block: &[i8], w: &[u8; BLOCK_ROWS]) {
    let n = acc.len();
    for (j, &wj) in w.iter().enumerate() {
        for (d, a) in acc.iter_mut().enumerate() {
            *a += wj as i32 * block[interleaved_at(j, d, n)] as i32;
        }
    }
}

/// The four weights of rows `4p..4p + 4` as one little-endian u32 (row `4p` in the low byte:
/// the order of the interleaved bytes).
#[cfg(target_arch = "x86_64")]
#[inline]
fn weight_quad(w: &[u8; BLOCK_ROWS], p: usize) -> i32 {
    i32::from_le_bytes([w[4 * p], w[4 * p + 1], w[4 * p + 2], w[4 * p + 3]])
}

/// Whether this CPU has AVX2 (detected once by the standard library, then a cached load).
#[cfg(target_arch = "x86_64")]
#[inline]
fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! Eight block dot products reduced at once (`vphaddd`), and value rows taken two at a
    //! time: their int8s sign-extended to i16 and interleaved, so one `vpmaddwd` by the pair of
    //! probabilities adds both rows' products into i32 lanes held in registers.
    use std::arch::x86_64::*;

    use crate::quant::BLOCK;

    /// The 32 int8s at `p` as two vectors of 16 i16s.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn widen32(p: *const i8) -> (__m256i, __m256i) {
        // SAFETY: the caller guarantees 32 readable bytes at `p`; the loads are unaligned.
        unsafe {
            (
                _mm256_cvtepi8_epi16(_mm_loadu_si128(p.cast())),
                _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(16).cast())),
            )
        }
    }

    /// The eight lane sums of `v[0..8]`, in order.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn reduce8(v: &[__m256i; 8]) -> __m256i {
        let a = _mm256_hadd_epi32(v[0], v[1]);
        let b = _mm256_hadd_epi32(v[2], v[3]);
        let c = _mm256_hadd_epi32(v[4], v[5]);
        let d = _mm256_hadd_epi32(v[6], v[7]);
        // Per 128-bit half: the partial sums of v0..v3 (ab) and v4..v7 (cd).
        let ab = _mm256_hadd_epi32(a, b);
        let cd = _mm256_hadd_epi32(c, d);
        _mm256_add_epi32(
            _mm256_permute2x128_si256(ab, cd, 0x20),
            _mm256_permute2x128_si256(ab, cd, 0x31),
        )
    }

    /// The sum of the eight lanes of `v`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn reduce1(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }

    /// See [`super::block_dots`]; the caller checked the bounds and that `out` has `n ·
    /// blocks` elements.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn block_dots(
        q: &[i8],
        keys: &[i8],
        stride: usize,
        n: usize,
        out: &mut [i32],
    ) {
        let blocks = q.len() / BLOCK;
        // The query widened once: two vectors per block.
        let qw: Vec<(__m256i, __m256i)> = (0..blocks)
            // SAFETY: block `b` of `q` is 32 readable bytes.
            .map(|b| unsafe { widen32(q.as_ptr().add(b * BLOCK)) })
            .collect();
        // (key, block) pairs in order, 8 lanes of pair sums each (|x| ≤ 2 · 128², exact),
        // reduced eight at a time.
        let mut pending = [_mm256_setzero_si256(); 8];
        let (mut held, mut at) = (0, 0);
        for i in 0..n {
            // SAFETY: key `i` lies inside `keys` (checked by the caller).
            let key = unsafe { keys.as_ptr().add(i * stride) };
            for (b, &(ql, qh)) in qw.iter().enumerate() {
                // SAFETY: block `b` of the key is inside it.
                let (lo, hi) = unsafe { widen32(key.add(b * BLOCK)) };
                pending[held] =
                    _mm256_add_epi32(_mm256_madd_epi16(lo, ql), _mm256_madd_epi16(hi, qh));
                held += 1;
                if held == 8 {
                    let dst: &mut [i32; 8] = (&mut out[at..at + 8]).try_into().expect("8 lanes");
                    // SAFETY: `dst` is 8 writable i32s; the store is unaligned.
                    unsafe { _mm256_storeu_si256(dst.as_mut_ptr().cast(), reduce8(&pending)) };
                    (held, at) = (0, at + 8);
                }
            }
        }
        for (o, &v) in out[at..].iter_mut().zip(&pending[..held]) {
            *o = reduce1(v);
        }
    }

    /// Output groups (eight values each) summed per pass over a block's rows.
    const GROUPS: usize = 4;

    /// See [`super::add_interleaved_rows`]; the caller checked the bounds and that
    /// `acc.len()` is a multiple of 8. Per group of four rows and eight outputs: `vpmaddubsw`
    /// multiplies the four weights (unsigned) by the 32 interleaved values (signed) and adds
    /// adjacent pairs into i16s (at most `2 · 127 · 128`, so it never saturates), and
    /// `vpmaddwd` by ones adds the two pairs of each output into its i32 lane.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn add_interleaved_rows(
        acc: &mut [i32],
        block: &[i8],
        w: &[u8; super::BLOCK_ROWS],
    ) {
        let n = acc.len();
        let quads: [__m256i; super::BLOCK_ROWS / 4] =
            std::array::from_fn(|p| _mm256_set1_epi32(super::weight_quad(w, p)));
        let ones = _mm256_set1_epi16(1);
        let base = block.as_ptr();
        for g0 in (0..n / 8).step_by(GROUPS) {
            let groups = (n / 8 - g0).min(GROUPS);
            let mut sums = [_mm256_setzero_si256(); GROUPS];
            for (p, &quad) in quads.iter().enumerate() {
                for (g, sum) in sums[..groups].iter_mut().enumerate() {
                    // SAFETY: rows `4p..4p + 4` hold `n` runs of four bytes inside `block`
                    // (checked by the caller), and group `g0 + g` is 32 of them.
                    let v =
                        unsafe { _mm256_loadu_si256(base.add(4 * (p * n + 8 * (g0 + g))).cast()) };
                    let pairs = _mm256_maddubs_epi16(quad, v);
                    *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(pairs, ones));
                }
            }
            for (g, &sum) in sums[..groups].iter().enumerate() {
                let at = 8 * (g0 + g);
                let slot: &mut [i32; 8] = (&mut acc[at..at + 8]).try_into().expect("8 lanes");
                // SAFETY: `slot` is 8 readable and writable i32s; both accesses unaligned.
                unsafe {
                    let old = _mm256_loadu_si256(slot.as_ptr().cast());
                    _mm256_storeu_si256(slot.as_mut_ptr().cast(), _mm256_add_epi32(old, sum));
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod sse2 {
    use std::arch::x86_64::*;

    use crate::quant::BLOCK;

    /// The low and high eight int8s of `x`, sign-extended to i16.
    #[inline]
    #[target_feature(enable = "sse2")]
    fn widen(x: __m128i) -> (__m128i, __m128i) {
        // Each byte doubled into an i16 (b·256 + b as u8), then shifted back arithmetically.
        (
            _mm_srai_epi16(_mm_unpacklo_epi8(x, x), 8),
            _mm_srai_epi16(_mm_unpackhi_epi8(x, x), 8),
        )
    }

    /// 16 int8s from `v[at..at + 16]`.
    #[inline]
    #[target_feature(enable = "sse2")]
    fn load16(v: &[i8], at: usize) -> __m128i {
        let chunk: &[i8; 16] = v[at..at + 16].try_into().expect("16 bytes");
        // SAFETY: `chunk` is 16 readable bytes; the load is unaligned.
        unsafe { _mm_loadu_si128(chunk.as_ptr().cast()) }
    }

    #[inline]
    #[target_feature(enable = "sse2")]
    pub(super) fn block_dot(a: &[i8; BLOCK], b: &[i8; BLOCK]) -> i32 {
        let mut sum = _mm_setzero_si128();
        for at in (0..BLOCK).step_by(16) {
            let (al, ah) = widen(load16(a, at));
            let (bl, bh) = widen(load16(b, at));
            // Pairs of i16 products (each at most 2^14) summed into i32 lanes.
            sum = _mm_add_epi32(sum, _mm_madd_epi16(al, bl));
            sum = _mm_add_epi32(sum, _mm_madd_epi16(ah, bh));
        }
        let s = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The AVX-512 VNNI forms (`vpdpbusd`: four unsigned bytes times four signed ones, added
    //! into an i32 lane).
    //!
    //! Block dot products, for heads of an even number of blocks: one zmm holds two blocks of
    //! a key, whose bytes are made unsigned (`k + 128`: the sign bit flipped) and multiplied by
    //! the query's signed bytes. That adds `128 · Σ q` to each block's sum, so each block's
    //! first lane starts that much below zero. Every lane stays far inside an i32 (`|lane| <=
    //! 4 · 255 · 128 + 128 · 32 · 128`), so the sums are the definition's integers. Sixteen
    //! (key, block) sums are reduced at once.
    //!
    //! Value rows: the weights (probabilities, at most 127) are the unsigned bytes, the four
    //! interleaved rows' values the signed ones (see [`super::add_interleaved_rows`]).
    use std::arch::x86_64::*;

    use crate::quant::BLOCK;

    /// Chunk vectors (two blocks each) reduced together.
    const HELD: usize = 8;

    /// Whether this CPU runs the VNNI form and a head of `blocks` blocks suits it: an even
    /// number, at most `2 · HELD`. (Key `i`'s chunk `c` holds its blocks `2c` and `2c + 1`,
    /// whose sums go to `out[2 · (i · chunks + c)..]`: consecutive chunks, wherever the keys
    /// start, fill consecutive sums.)
    pub(super) fn takes(blocks: usize) -> bool {
        blocks.is_multiple_of(2)
            && blocks <= 2 * HELD
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vnni")
    }

    /// The sixteen block sums of eight chunk vectors, in order (chunk 0's two blocks first):
    /// each block's eight lanes added up.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn reduce16(v: &[__m512i; HELD]) -> __m512i {
        // Per pair of vectors: each 128-bit lane the four partial sums of one block (a's first
        // block, a's second, b's first, b's second).
        let pair = |a, b| {
            _mm512_add_epi32(
                _mm512_shuffle_i32x4::<0b10_00_10_00>(a, b),
                _mm512_shuffle_i32x4::<0b11_01_11_01>(a, b),
            )
        };
        let (p01, p23, p45, p67) = (
            pair(v[0], v[1]),
            pair(v[2], v[3]),
            pair(v[4], v[5]),
            pair(v[6], v[7]),
        );
        // A 4 × 4 transpose-and-add within each 128-bit lane: lane k ends as the sums of block
        // k of p01, p23, p45, p67.
        let e = _mm512_add_epi32(
            _mm512_unpacklo_epi32(p01, p23),
            _mm512_unpackhi_epi32(p01, p23),
        );
        let f = _mm512_add_epi32(
            _mm512_unpacklo_epi32(p45, p67),
            _mm512_unpackhi_epi32(p45, p67),
        );
        let r = _mm512_add_epi32(_mm512_unpacklo_epi64(e, f), _mm512_unpackhi_epi64(e, f));
        // Sum `j` (pair j / 4, block j % 4 of it) is at 4 · (j % 4) + j / 4.
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_epi32(order, r)
    }

    /// Whether this CPU runs the VNNI form of [`super::add_interleaved_rows`] and rows of
    /// `width` values suit it (whole groups of 16).
    pub(super) fn takes_interleaved(width: usize) -> bool {
        width.is_multiple_of(16)
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vnni")
    }

    /// Output groups (16 values each) summed per pass over a block's rows.
    const GROUPS: usize = 8;

    /// See [`super::add_interleaved_rows`]; the caller checked [`takes_interleaved`] and the
    /// bounds. Per group of four rows and 16 outputs, one `vpdpbusd` of the four weights
    /// (unsigned) by the 64 interleaved values (signed); the even and odd groups of rows sum
    /// into separate registers, so two chains of additions run side by side.
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub(super) unsafe fn add_interleaved_rows(
        acc: &mut [i32],
        block: &[i8],
        w: &[u8; super::BLOCK_ROWS],
    ) {
        let n = acc.len();
        let quads: [__m512i; super::BLOCK_ROWS / 4] =
            std::array::from_fn(|p| _mm512_set1_epi32(super::weight_quad(w, p)));
        let base = block.as_ptr();
        for g0 in (0..n / 16).step_by(GROUPS) {
            let groups = (n / 16 - g0).min(GROUPS);
            let mut sums = [[_mm512_setzero_si512(); GROUPS]; 2];
            for (p, &quad) in quads.iter().enumerate() {
                for g in 0..groups {
                    // SAFETY: rows `4p..4p + 4` hold `n` runs of four bytes inside `block`
                    // (checked by the caller), and group `g0 + g` is 64 of them.
                    let v =
                        unsafe { _mm512_loadu_si512(base.add(4 * (p * n + 16 * (g0 + g))).cast()) };
                    sums[p % 2][g] = _mm512_dpbusd_epi32(sums[p % 2][g], quad, v);
                }
            }
            for g in 0..groups {
                let at = 16 * (g0 + g);
                let dst: &mut [i32; 16] = (&mut acc[at..at + 16]).try_into().expect("16 lanes");
                // SAFETY: `dst` is 16 readable and writable i32s; both accesses unaligned.
                unsafe {
                    let sum = _mm512_add_epi32(sums[0][g], sums[1][g]);
                    let old = _mm512_loadu_si512(dst.as_ptr().cast());
                    _mm512_storeu_si512(dst.as_mut_ptr().cast(), _mm512_add_epi32(old, sum));
                }
            }
        }
    }

    /// See [`super::block_dots`]; the caller checked [`takes`], the bounds, and that `out`
    /// has `n · blocks` elements.
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub(super) unsafe fn block_dots(
        q: &[i8],
        keys: &[i8],
        stride: usize,
        n: usize,
        out: &mut [i32],
    ) {
        let chunks = q.len() / (2 * BLOCK);
        let flip = _mm512_set1_epi8(i8::MIN);
        // Per chunk: the query's 64 bytes, and the lanes each sum starts at (minus 128 times
        // the block's query sum in the block's first lane).
        let (mut qv, mut start) = (
            [_mm512_setzero_si512(); HELD],
            [_mm512_setzero_si512(); HELD],
        );
        for c in 0..chunks {
            let at = c * 2 * BLOCK;
            // SAFETY: the query holds `chunks` whole pairs of blocks; the load is unaligned.
            qv[c] = unsafe { _mm512_loadu_si512(q.as_ptr().add(at).cast()) };
            let sum = |b: usize| -> i32 { q[b..b + BLOCK].iter().map(|&x| x as i32).sum() };
            let mut lanes = [0i32; 16];
            (lanes[0], lanes[8]) = (-128 * sum(at), -128 * sum(at + BLOCK));
            // SAFETY: `lanes` is 16 readable i32s; the load is unaligned.
            start[c] = unsafe { _mm512_loadu_si512(lanes.as_ptr().cast()) };
        }
        let mut pending = [_mm512_setzero_si512(); HELD];
        let (mut held, mut at) = (0, 0);
        for i in 0..n {
            // SAFETY: key `i` lies inside `keys` (checked by the caller).
            let key = unsafe { keys.as_ptr().add(i * stride) };
            for c in 0..chunks {
                // SAFETY: chunk `c` of the key is 64 readable bytes; the load is unaligned.
                let k = unsafe { _mm512_loadu_si512(key.add(c * 2 * BLOCK).cast()) };
                pending[held] = _mm512_dpbusd_epi32(start[c], _mm512_xor_si512(k, flip), qv[c]);
                held += 1;
                if held == HELD {
                    let dst: &mut [i32; 16] = (&mut out[at..at + 16]).try_into().expect("16 lanes");
                    // SAFETY: `dst` is 16 writable i32s; the store is unaligned.
                    unsafe { _mm512_storeu_si512(dst.as_mut_ptr().cast(), reduce16(&pending)) };
                    (held, at) = (0, at + 16);
                }
            }
        }
        for (h, &v) in pending[..held].iter().enumerate() {
            out[at + 2 * h] = _mm512_mask_reduce_add_epi32(0x00ff, v);
            out[at + 2 * h + 1] = _mm512_mask_reduce_add_epi32(0xff00, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn block_dot_is_its_definition(a in prop::array::uniform32(any::<i8>()),
                                       b in prop::array::uniform32(any::<i8>())) {
            prop_assert_eq!(block_dot(&a, &b), block_dot_scalar(&a, &b));
        }
    }

    proptest! {
        #[test]
        fn block_dots_are_their_definition(blocks in 1usize..17, n in 0usize..40, pad in 0usize..70,
                                           seed in any::<u64>(), extreme in any::<bool>()) {
            let stride = blocks * BLOCK + pad;
            let q = bytes(blocks * BLOCK, seed, extreme);
            let keys = bytes(n * stride + 3, seed ^ 1, extreme);
            let mut fast = Vec::new();
            block_dots(&q, &keys, stride, n, &mut fast);
            let mut slow = vec![0; n * blocks];
            block_dots_scalar(&q, &keys, stride, n, &mut slow);
            prop_assert_eq!(&fast, &slow);
            // Each vector form on its own, whichever the dispatch picks on this CPU.
            #[cfg(target_arch = "x86_64")]
            {
                let mut each = vec![i32::MIN; n * blocks];
                if has_avx2() {
                    // SAFETY: AVX2 was detected; the bounds hold by construction.
                    unsafe { avx2::block_dots(&q, &keys, stride, n, &mut each) };
                    prop_assert_eq!(&each, &slow);
                }
                if avx512::takes(blocks) {
                    each.fill(i32::MIN);
                    // SAFETY: AVX-512 VNNI was detected; the bounds hold by construction.
                    unsafe { avx512::block_dots(&q, &keys, stride, n, &mut each) };
                    prop_assert_eq!(&each, &slow);
                }
            }
        }

        #[test]
        fn add_interleaved_rows_are_their_definition(width in prop::sample::select(vec![0usize, 8, 16, 24, 40, 64, 128, 136, 192, 256, 320]),
                                                     pad in 0usize..70,
                                                     weights in prop::array::uniform32(prop_oneof![Just(0u8), 0u8..=127, Just(127)]),
                                                     seed in any::<u64>(), extreme in any::<bool>()) {
            let block = bytes(BLOCK_ROWS * width + pad, seed, extreme);
            let start: Vec<i32> = (0..width as i32).map(|i| i * 977 - 40_000).collect();
            let mut fast = start.clone();
            add_interleaved_rows(&mut fast, &block, &weights);
            let mut slow = start.clone();
            add_interleaved_rows_scalar(&mut slow, &block, &weights);
            prop_assert_eq!(&fast, &slow);
            // Each vector form on its own, whichever the dispatch picks on this CPU.
            #[cfg(target_arch = "x86_64")]
            {
                if width % 8 == 0 && has_avx2() {
                    let mut each = start.clone();
                    // SAFETY: AVX2 was detected; the bounds hold by construction.
                    unsafe { avx2::add_interleaved_rows(&mut each, &block, &weights) };
                    prop_assert_eq!(&each, &slow);
                }
                if avx512::takes_interleaved(width) {
                    let mut each = start.clone();
                    // SAFETY: AVX-512 VNNI was detected; the bounds hold by construction.
                    unsafe { avx512::add_interleaved_rows(&mut each, &block, &weights) };
                    prop_assert_eq!(&each, &slow);
                }
            }
        }
    }

    /// Deterministic int8s; with `extreme`, mostly ±127 and −128.
    fn bytes(n: usize, seed: u64, extreme: bool) -> Vec<i8> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                match extreme {
                    true => [-128i8, 127, -127, 0][(s % 4) as usize],
                    false => s as i8,
                }
            })
            .collect()
    }

    #[test]
    fn extremes_are_exact() {
        let (a, b) = ([-128i8; BLOCK], [-128i8; BLOCK]);
        assert_eq!(block_dot(&a, &b), 32 * 16384);
        // Every weight 127 times every value −128, for each form's width.
        for width in [8, 24, 64] {
            let mut acc = vec![i32::MIN + 32 * 127 * 128; width];
            add_interleaved_rows(
                &mut acc,
                &vec![-128; BLOCK_ROWS * width],
                &[127; BLOCK_ROWS],
            );
            assert!(acc.iter().all(|&x| x == i32::MIN), "width {width}");
        }
    }
}
