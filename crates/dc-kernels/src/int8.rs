//! The exact int8 loops attention runs per key: block dot products (scores) and rows of values
//! times quantised probabilities added to i32 accumulators (context). SSE2 on x86_64 (part of
//! the baseline: no detection needed), AVX2 where the CPU has it, AVX-512 VNNI where it has
//! that (the block dot products of heads of an even number of blocks, the value rows of heads
//! of whole 64-byte chunks), the scalar definition elsewhere; every form is property-tested
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

/// `acc_i += q · v_i` for every `i` (`acc` and `v` the same length; no sum may overflow an
/// i32, which holds for any 2^17 additions).
#[inline]
pub fn add_scaled(acc: &mut [i32], q: i8, v: &[i8]) {
    debug_assert_eq!(acc.len(), v.len());
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as in `block_dot`.
    unsafe {
        sse2::add_scaled(acc, q, v)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        add_scaled_scalar(acc, q, v)
    }
}

/// The definition of [`add_scaled`].
pub fn add_scaled_scalar(acc: &mut [i32], q: i8, v: &[i8]) {
    for (a, &x) in acc.iter_mut().zip(v) {
        *a += q as i32 * x as i32;
    }
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

/// `acc_d += Σ_j q_j · v[at_j + d]` for every `(q_j, at_j)` of `rows` and every `d <
/// acc.len()` (no sum may overflow an i32, which holds for any 2^17 rows).
pub fn add_scaled_rows(acc: &mut [i32], v: &[i8], rows: &[(i8, usize)]) {
    assert!(
        rows.iter().all(|&(_, at)| at + acc.len() <= v.len()),
        "every row is inside `v`"
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 was detected; the bounds were checked above.
        unsafe { avx2::add_scaled_rows(acc, v, rows) };
        return;
    }
    add_scaled_rows_scalar(acc, v, rows);
}

/// Most rows [`add_block_rows`] takes at once: a block of keys.
pub const BLOCK_ROWS: usize = BLOCK;

/// `acc_d += Σ_j q_j · v[first + j · stride + d]` for the (at most [`BLOCK_ROWS`]) weights
/// `q_j` in `[0, 127]` and every `d < acc.len()`: a block of keys' value rows times their
/// quantised probabilities. Only the keys with a nonzero weight are added: in AVX-512 VNNI,
/// four at a time, where the CPU has it and the rows are whole 64-byte chunks; otherwise by
/// [`add_scaled_rows`].
pub fn add_block_rows(acc: &mut [i32], v: &[i8], first: usize, stride: usize, q: &[i32]) {
    assert!(q.len() <= BLOCK_ROWS, "at most a block of rows");
    assert!(
        q.is_empty() || first + (q.len() - 1) * stride + acc.len() <= v.len(),
        "every row is inside `v`"
    );
    debug_assert!(
        q.iter().all(|&x| (0..=127).contains(&x)),
        "weights in [0, 127]"
    );
    #[cfg(target_arch = "x86_64")]
    if avx512::takes_rows(acc.len()) {
        // SAFETY: AVX-512 VNNI was detected; the bounds were checked above.
        unsafe { avx512::add_block_rows(acc, v, first, stride, q) };
        return;
    }
    // Every key is written and only a nonzero one kept (the count moves by the test): which
    // weights are zero follows no pattern a branch predictor could learn.
    let mut picks = [(0i8, 0usize); BLOCK_ROWS];
    let mut kept = 0;
    for (j, &w) in q.iter().enumerate() {
        picks[kept] = (w as i8, first + j * stride);
        kept += usize::from(w != 0);
    }
    add_scaled_rows(acc, v, &picks[..kept]);
}

/// The definition of [`add_block_rows`].
pub fn add_block_rows_scalar(acc: &mut [i32], v: &[i8], first: usize, stride: usize, q: &[i32]) {
    for (j, &w) in q.iter().enumerate() {
        let at = first + j * stride;
        add_scaled_scalar(acc, w as i8, &v[at..at + acc.len()]);
    }
}

/// The definition of [`add_scaled_rows`].
pub fn add_scaled_rows_scalar(acc: &mut [i32], v: &[i8], rows: &[(i8, usize)]) {
    let n = acc.len();
    for &(q, at) in rows {
        add_scaled_scalar(acc, q, &v[at..at + n]);
    }
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

    /// Adds `q_a · v_a + q_b · v_b` for one group of 16 values at `va`, `vb` to the
    /// accumulators of that group (`lo` holds values 0–3 and 8–11, `hi` 4–7 and 12–15: the
    /// lane order of `vpunpck*wd`).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn pair16(
        lo: &mut __m256i,
        hi: &mut __m256i,
        va: *const i8,
        vb: *const i8,
        qq: __m256i,
    ) {
        // SAFETY: the caller guarantees 16 readable bytes at `va` and at `vb`.
        let (a, b) = unsafe {
            (
                _mm256_cvtepi8_epi16(_mm_loadu_si128(va.cast())),
                _mm256_cvtepi8_epi16(_mm_loadu_si128(vb.cast())),
            )
        };
        *lo = _mm256_add_epi32(*lo, _mm256_madd_epi16(_mm256_unpacklo_epi16(a, b), qq));
        *hi = _mm256_add_epi32(*hi, _mm256_madd_epi16(_mm256_unpackhi_epi16(a, b), qq));
    }

    /// Groups of 16 values taken per pass over the rows (eight accumulators in registers).
    const GROUPS: usize = 4;

    /// See [`super::add_scaled_rows`]; the caller checked the bounds.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn add_scaled_rows(acc: &mut [i32], v: &[i8], rows: &[(i8, usize)]) {
        let n = acc.len();
        let whole = n / 16 * 16;
        let base = v.as_ptr();
        let mut d0 = 0;
        while d0 < whole {
            let groups = ((whole - d0) / 16).min(GROUPS);
            let mut lo = [_mm256_setzero_si256(); GROUPS];
            let mut hi = [_mm256_setzero_si256(); GROUPS];
            for pair in rows.chunks(2) {
                // An odd last row pairs with itself times zero.
                let (a, b) = (pair[0], *pair.get(1).unwrap_or(&(0, pair[0].1)));
                // Each 32-bit lane holds (q_a, q_b) as i16s, the order the interleave uses.
                let qq = _mm256_set1_epi32((a.0 as i16 as u16 as i32) | ((b.0 as i32) << 16));
                for g in 0..groups {
                    let at = d0 + g * 16;
                    // SAFETY: rows lie inside `v` for `n` values (checked by the caller), and
                    // `at + 16 <= n`.
                    unsafe {
                        pair16(
                            &mut lo[g],
                            &mut hi[g],
                            base.add(a.1 + at),
                            base.add(b.1 + at),
                            qq,
                        )
                    };
                }
            }
            for g in 0..groups {
                let at = d0 + g * 16;
                let ordered = [
                    _mm256_permute2x128_si256(lo[g], hi[g], 0x20),
                    _mm256_permute2x128_si256(lo[g], hi[g], 0x31),
                ];
                for (h, sums) in ordered.into_iter().enumerate() {
                    let slot: &mut [i32; 8] = (&mut acc[at + h * 8..at + h * 8 + 8])
                        .try_into()
                        .expect("8 lanes");
                    // SAFETY: `slot` is 8 readable and writable i32s; both accesses unaligned.
                    unsafe {
                        let old = _mm256_loadu_si256(slot.as_ptr().cast());
                        _mm256_storeu_si256(slot.as_mut_ptr().cast(), _mm256_add_epi32(old, sums));
                    }
                }
            }
            d0 += groups * 16;
        }
        if whole < n {
            for &(q, at) in rows {
                super::add_scaled_scalar(&mut acc[whole..], q, &v[at + whole..at + n]);
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

    #[inline]
    #[target_feature(enable = "sse2")]
    pub(super) fn add_scaled(acc: &mut [i32], q: i8, v: &[i8]) {
        let n = acc.len().min(v.len());
        let qv = _mm_set1_epi16(q as i16);
        let whole = n / 16 * 16;
        for at in (0..whole).step_by(16) {
            let (lo, hi) = widen(load16(v, at));
            // Exact: |q · v| <= 2^14 fits an i16.
            for (k, p) in [_mm_mullo_epi16(lo, qv), _mm_mullo_epi16(hi, qv)]
                .into_iter()
                .enumerate()
            {
                let words = [
                    _mm_srai_epi32(_mm_unpacklo_epi16(p, p), 16),
                    _mm_srai_epi32(_mm_unpackhi_epi16(p, p), 16),
                ];
                for (w, word) in words.into_iter().enumerate() {
                    let slot: &mut [i32; 4] = (&mut acc
                        [at + k * 8 + w * 4..at + k * 8 + w * 4 + 4])
                        .try_into()
                        .expect("4 lanes");
                    // SAFETY: `slot` is 4 readable and writable i32s; both accesses unaligned.
                    unsafe {
                        let sum = _mm_add_epi32(_mm_loadu_si128(slot.as_ptr().cast()), word);
                        _mm_storeu_si128(slot.as_mut_ptr().cast(), sum);
                    }
                }
            }
        }
        super::add_scaled_scalar(&mut acc[whole..n], q, &v[whole..n]);
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
    //! Value rows: the weights (probabilities, at most 127) are the unsigned bytes, four rows'
    //! values interleaved the signed ones (see [`add_block_rows`]).
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

    /// Whether this CPU runs the VNNI form of [`super::add_block_rows`] and rows of `width`
    /// values suit it (whole 64-byte chunks, at most four).
    pub(super) fn takes_rows(width: usize) -> bool {
        width > 0
            && width.is_multiple_of(64)
            && width <= 256
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
    }

    /// See [`super::add_block_rows`]; the caller checked [`takes_rows`] and the bounds.
    ///
    /// Four rows at a time: their bytes interleaved so each i32 lane holds one value of each
    /// row (`vpunpck*bw`, then `*wd`), and `vpdpbusd` multiplies the four weights (unsigned,
    /// at most 127) by them and adds the four products into the lane. The interleave works
    /// within 128-bit lanes, so accumulator `a` lane `k` of 128-bit lane `L` holds value
    /// `16 L + 4 a + k`; a transpose of 128-bit lanes puts them in order at the end.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn add_block_rows(
        acc: &mut [i32],
        v: &[i8],
        first: usize,
        stride: usize,
        q: &[i32],
    ) {
        let chunks = acc.len() / 64;
        // The keys with a nonzero weight, compressed to the front (`vpcompressd`): a zero
        // weight adds nothing, and most of a block's keys round to zero when one dominates.
        let (mut weights, mut rows) = ([0i32; super::BLOCK_ROWS], [0usize; super::BLOCK_ROWS]);
        let mut kept = 0;
        for (h, part) in q.chunks(16).enumerate() {
            let lanes = ((1u32 << part.len()) - 1) as u16;
            // SAFETY: `part` holds `part.len()` readable i32s, the lanes the mask loads.
            let w = unsafe { _mm512_maskz_loadu_epi32(lanes, part.as_ptr()) };
            let nonzero = _mm512_test_epi32_mask(w, w);
            // SAFETY: `weights` has room for every lane after `kept` (at most 16 of them,
            // `kept + part.len() <= BLOCK_ROWS`); the store writes only the picked lanes.
            unsafe {
                _mm512_mask_compressstoreu_epi32(weights.as_mut_ptr().add(kept).cast(), nonzero, w)
            };
            let mut bits = nonzero;
            while bits != 0 {
                let j = bits.trailing_zeros() as usize;
                rows[kept] = first + (16 * h + j) * stride;
                kept += 1;
                bits &= bits - 1;
            }
        }
        let mut sums = [[_mm512_setzero_si512(); 4]; 4];
        let base = v.as_ptr();
        for g in 0..kept.div_ceil(4) {
            let mut packed = 0u32;
            // A missing row (past the last kept key) repeats the group's first, times zero.
            let mut at = [rows[4 * g]; 4];
            for i in 0..4.min(kept - 4 * g) {
                packed |= (weights[4 * g + i] as u32) << (8 * i);
                at[i] = rows[4 * g + i];
            }
            let packed = _mm512_set1_epi32(packed as i32);
            for (c, sum) in sums[..chunks].iter_mut().enumerate() {
                // SAFETY: each row holds `acc.len()` values inside `v` (checked by the
                // caller), so its chunk `c` is 64 readable bytes; the loads are unaligned.
                let r = at.map(|at| unsafe { _mm512_loadu_si512(base.add(at + 64 * c).cast()) });
                let (lo01, hi01) = (
                    _mm512_unpacklo_epi8(r[0], r[1]),
                    _mm512_unpackhi_epi8(r[0], r[1]),
                );
                let (lo23, hi23) = (
                    _mm512_unpacklo_epi8(r[2], r[3]),
                    _mm512_unpackhi_epi8(r[2], r[3]),
                );
                let quads = [
                    _mm512_unpacklo_epi16(lo01, lo23),
                    _mm512_unpackhi_epi16(lo01, lo23),
                    _mm512_unpacklo_epi16(hi01, hi23),
                    _mm512_unpackhi_epi16(hi01, hi23),
                ];
                for (s, quad) in sum.iter_mut().zip(quads) {
                    *s = _mm512_dpbusd_epi32(*s, packed, quad);
                }
            }
        }
        for (c, [a0, a1, a2, a3]) in sums[..chunks].iter().copied().enumerate() {
            // 128-bit lane L of the result `L` holds values 16 L.. in order: lanes L of
            // a0, a1, a2, a3.
            let u0 = _mm512_shuffle_i32x4::<0b01_00_01_00>(a0, a1);
            let u1 = _mm512_shuffle_i32x4::<0b11_10_11_10>(a0, a1);
            let u2 = _mm512_shuffle_i32x4::<0b01_00_01_00>(a2, a3);
            let u3 = _mm512_shuffle_i32x4::<0b11_10_11_10>(a2, a3);
            let ordered = [
                _mm512_shuffle_i32x4::<0b10_00_10_00>(u0, u2),
                _mm512_shuffle_i32x4::<0b11_01_11_01>(u0, u2),
                _mm512_shuffle_i32x4::<0b10_00_10_00>(u1, u3),
                _mm512_shuffle_i32x4::<0b11_01_11_01>(u1, u3),
            ];
            for (l, o) in ordered.into_iter().enumerate() {
                let dst: &mut [i32; 16] = (&mut acc[64 * c + 16 * l..64 * c + 16 * l + 16])
                    .try_into()
                    .expect("16 lanes");
                // SAFETY: `dst` is 16 readable and writable i32s; both accesses unaligned.
                unsafe {
                    let sum = _mm512_add_epi32(_mm512_loadu_si512(dst.as_ptr().cast()), o);
                    _mm512_storeu_si512(dst.as_mut_ptr().cast(), sum);
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

        #[test]
        fn add_scaled_is_its_definition(q in any::<i8>(),
                                        v in prop::collection::vec(any::<i8>(), 0..100),
                                        start in prop::collection::vec(-(1i32 << 24)..(1 << 24), 100)) {
            let mut fast = start[..v.len()].to_vec();
            let mut slow = fast.clone();
            add_scaled(&mut fast, q, &v);
            add_scaled_scalar(&mut slow, q, &v);
            prop_assert_eq!(fast, slow);
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
        fn add_block_rows_are_their_definition(width in prop::sample::select(vec![0usize, 8, 40, 64, 128, 192, 256, 320]),
                                               n in 0usize..=BLOCK_ROWS, pad in 0usize..70, first in 0usize..9,
                                               weights in prop::collection::vec(prop_oneof![Just(0i32), 0i32..=127, Just(127)], BLOCK_ROWS),
                                               seed in any::<u64>(), extreme in any::<bool>()) {
            let stride = width + pad;
            let v = bytes(first + n * stride + 5, seed, extreme);
            let q = &weights[..n];
            let start: Vec<i32> = (0..width as i32).map(|i| i * 977 - 40_000).collect();
            let mut fast = start.clone();
            add_block_rows(&mut fast, &v, first, stride, q);
            let mut slow = start.clone();
            add_block_rows_scalar(&mut slow, &v, first, stride, q);
            prop_assert_eq!(&fast, &slow);
            #[cfg(target_arch = "x86_64")]
            if avx512::takes_rows(width) {
                let mut each = start.clone();
                // SAFETY: AVX-512 VNNI was detected; the bounds hold by construction.
                unsafe { avx512::add_block_rows(&mut each, &v, first, stride, q) };
                prop_assert_eq!(&each, &slow);
            }
        }

        #[test]
        fn add_scaled_rows_are_their_definition(width in 0usize..150, picks in prop::collection::vec((any::<i8>(), 0usize..60), 0..40),
                                                seed in any::<u64>(), extreme in any::<bool>()) {
            let v = bytes(60 + width, seed, extreme);
            let mut fast: Vec<i32> = (0..width as i32).map(|i| i * 977 - 40_000).collect();
            let mut slow = fast.clone();
            add_scaled_rows(&mut fast, &v, &picks);
            add_scaled_rows_scalar(&mut slow, &v, &picks);
            prop_assert_eq!(fast, slow);
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
        let mut acc = vec![i32::MAX - 16384; 33];
        add_scaled(&mut acc, -128, &[-128; 33]);
        assert!(acc.iter().all(|&x| x == i32::MAX));
    }
}
