//! The exact int8 loops attention runs per block of 32 keys: block dot products (scores) and
//! rows of values times quantised probabilities added to i32 accumulators (context), over
//! keys and values stored four keys' bytes together (the layouts [`key_interleaved_at`] and
//! [`interleaved_at`]), so one multiply-add instruction takes four keys. AVX-512 VNNI where the
//! CPU has it, AVX2 where it has that, the scalar definition elsewhere; every form is
//! property-tested against the definition. Every sum here fits an i32, so the vector forms
//! compute the same integers whatever order they add them in.

use crate::quant::BLOCK;

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

/// Where key `j`'s value `d` sits in a block of [`BLOCK_ROWS`] keys stored by quads of values:
/// per quad (values `4i..4i + 4`), the block's keys in turn, four bytes each. Sixteen
/// consecutive keys' bytes of one quad are then one 64-byte vector, which one `vpdpbusd`
/// multiplies by the query's four values of that quad.
#[inline]
pub fn key_interleaved_at(j: usize, d: usize) -> usize {
    (d / 4 * BLOCK_ROWS + j) * 4 + d % 4
}

/// The block dot products of one query (`q.len()` = `blocks · BLOCK`) against `n` blocks of
/// [`BLOCK_ROWS`] keys, each stored by quads ([`key_interleaved_at`]), block `i` at
/// `keys[i · stride..]`: `out[(i · BLOCK_ROWS + j) · blocks + b]` (`out` is `n · BLOCK_ROWS ·
/// blocks` long) receives the dot product of block `i`'s key `j` with the query over block
/// `b`. No key byte may be −128 (a cache never holds one: values are clamped to ±127). In
/// AVX-512 VNNI or AVX2 where the CPU has it, the definition otherwise.
pub fn interleaved_block_dots(q: &[i8], keys: &[i8], stride: usize, n: usize, out: &mut [i32]) {
    let blocks = q.len() / BLOCK;
    assert!(q.len() == blocks * BLOCK, "the query is whole blocks");
    assert!(
        n == 0 || (n - 1) * stride + BLOCK_ROWS * q.len() <= keys.len(),
        "every block of keys is inside `keys`"
    );
    assert_eq!(
        out.len(),
        n * BLOCK_ROWS * blocks,
        "one entry per key and block"
    );
    #[cfg(target_arch = "x86_64")]
    if avx512::takes_interleaved_dots(blocks) {
        // SAFETY: AVX-512 VNNI was detected; the bounds were checked above.
        unsafe { avx512::interleaved_block_dots(q, keys, stride, n, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if blocks <= MAX_QUERY_BLOCKS && has_avx2() {
        // SAFETY: AVX2 was detected; the bounds were checked above.
        unsafe { avx2::interleaved_block_dots(q, keys, stride, n, out) };
        return;
    }
    interleaved_block_dots_scalar(q, keys, stride, n, out);
}

/// The definition of [`interleaved_block_dots`].
pub fn interleaved_block_dots_scalar(
    q: &[i8],
    keys: &[i8],
    stride: usize,
    n: usize,
    out: &mut [i32],
) {
    let blocks = q.len() / BLOCK;
    for i in 0..n {
        let block = &keys[i * stride..];
        for j in 0..BLOCK_ROWS {
            for b in 0..blocks {
                out[(i * BLOCK_ROWS + j) * blocks + b] = (b * BLOCK..(b + 1) * BLOCK)
                    .map(|d| q[d] as i32 * block[key_interleaved_at(j, d)] as i32)
                    .sum();
            }
        }
    }
}

/// Query values `4i..4i + 4` as one little-endian i32 (value `4i` in the low byte: the order
/// of the interleaved bytes), for every quad of `q`.
#[cfg(target_arch = "x86_64")]
fn query_quads(q: &[i8]) -> [i32; 8 * MAX_QUERY_BLOCKS] {
    let mut quads = [0; 8 * MAX_QUERY_BLOCKS];
    for (quad, v) in quads.iter_mut().zip(q.chunks_exact(4)) {
        *quad = i32::from_le_bytes([v[0] as u8, v[1] as u8, v[2] as u8, v[3] as u8]);
    }
    quads
}

/// Widest query the vector forms of [`interleaved_block_dots`] take, in blocks (head_dim 256).
#[cfg(target_arch = "x86_64")]
const MAX_QUERY_BLOCKS: usize = 8;

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
    //! `vpmaddubsw` (unsigned bytes times signed ones, adjacent pairs added into i16s) then
    //! `vpmaddwd` by ones (the pairs into i32s): four bytes per i32 lane, as `vpdpbusd` does in
    //! one instruction.
    use std::arch::x86_64::*;

    use crate::quant::BLOCK;

    /// See [`super::interleaved_block_dots`]; the caller checked the bounds and that the query
    /// is at most `MAX_QUERY_BLOCKS` blocks. Per quad of the query and eight keys: `vpsignb`
    /// gives each key byte the sign of its query value, so `vpmaddubsw` can take the query's
    /// magnitudes as its unsigned bytes (pairs of products at most `2 · 128 · 127`: no key
    /// byte is −128, so none saturates), and `vpmaddwd` by ones adds each key's two pairs into
    /// its i32 lane.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn interleaved_block_dots(
        q: &[i8],
        keys: &[i8],
        stride: usize,
        n: usize,
        out: &mut [i32],
    ) {
        let blocks = q.len() / BLOCK;
        let quads = super::query_quads(q);
        let ones = _mm256_set1_epi16(1);
        let mut sums = [[0i32; 8]; super::MAX_QUERY_BLOCKS];
        let per_block = super::BLOCK_ROWS * blocks;
        for (k, out) in out.chunks_exact_mut(per_block).take(n).enumerate() {
            // SAFETY: block `k` of keys lies inside `keys` (checked by the caller).
            let base = unsafe { keys.as_ptr().add(k * stride) };
            for eighth in 0..super::BLOCK_ROWS / 8 {
                for (b, sum) in sums[..blocks].iter_mut().enumerate() {
                    let mut acc = _mm256_setzero_si256();
                    for i in 8 * b..8 * b + 8 {
                        let qv = _mm256_set1_epi32(quads[i]);
                        // SAFETY: quad `i` of keys `8 · eighth..` is 32 bytes inside the block
                        // (checked by the caller); the load is unaligned.
                        let k = unsafe {
                            _mm256_loadu_si256(
                                base.add((i * super::BLOCK_ROWS + 8 * eighth) * 4).cast(),
                            )
                        };
                        let pairs =
                            _mm256_maddubs_epi16(_mm256_abs_epi8(qv), _mm256_sign_epi8(k, qv));
                        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
                    }
                    // SAFETY: `sum` is 8 writable i32s; the store is unaligned.
                    unsafe { _mm256_storeu_si256(sum.as_mut_ptr().cast(), acc) };
                }
                for j in 0..8 {
                    for (b, sum) in sums[..blocks].iter().enumerate() {
                        out[(8 * eighth + j) * blocks + b] = sum[j];
                    }
                }
            }
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
mod avx512 {
    //! The AVX-512 VNNI forms (`vpdpbusd`: four unsigned bytes times four signed ones, added
    //! into an i32 lane).
    //!
    //! Block dot products: sixteen keys' bytes of one quad are made unsigned (`k + 128`: the
    //! sign bit flipped) and multiplied by the query's signed bytes. That adds `128 · Σ q` to
    //! each block's sum, so each block's sums start that much below zero. Every lane stays far
    //! inside an i32 (`|lane| <= 32 · 255 · 128 + 128 · 32 · 128`), so the sums are the
    //! definition's integers.
    //!
    //! Value rows: the weights (probabilities, at most 127) are the unsigned bytes, the four
    //! interleaved rows' values the signed ones (see [`super::add_interleaved_rows`]).
    use std::arch::x86_64::*;

    use crate::quant::BLOCK;

    /// Whether this CPU runs the VNNI form of [`super::add_interleaved_rows`] and rows of
    /// `width` values suit it (whole groups of 16).
    pub(super) fn takes_interleaved(width: usize) -> bool {
        width.is_multiple_of(16)
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vnni")
    }

    /// Whether this CPU runs the VNNI form of [`super::interleaved_block_dots`] and a query of
    /// `blocks` blocks suits it.
    pub(super) fn takes_interleaved_dots(blocks: usize) -> bool {
        blocks <= super::MAX_QUERY_BLOCKS
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vnni")
    }

    /// See [`super::interleaved_block_dots`]; the caller checked [`takes_interleaved_dots`]
    /// and the bounds. Per quad of the query and sixteen keys, one `vpdpbusd` of the keys'
    /// bytes made unsigned (the sign bit flipped: `k + 128`) by the query's four values; each
    /// block's sums start at `−128 · Σ q` over the block to take off what the flip added. The
    /// sixteen keys' sums of each block are then transposed into the output's key-major order.
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub(super) unsafe fn interleaved_block_dots(
        q: &[i8],
        keys: &[i8],
        stride: usize,
        n: usize,
        out: &mut [i32],
    ) {
        let blocks = q.len() / BLOCK;
        let quads = super::query_quads(q);
        let flip = _mm512_set1_epi8(i8::MIN);
        let mut start = [_mm512_setzero_si512(); super::MAX_QUERY_BLOCKS];
        for (b, s) in start[..blocks].iter_mut().enumerate() {
            let sum: i32 = q[b * BLOCK..(b + 1) * BLOCK]
                .iter()
                .map(|&x| x as i32)
                .sum();
            *s = _mm512_set1_epi32(-128 * sum);
        }
        let per_block = super::BLOCK_ROWS * blocks;
        for (k, out) in out.chunks_exact_mut(per_block).take(n).enumerate() {
            // SAFETY: block `k` of keys lies inside `keys` (checked by the caller).
            let base = unsafe { keys.as_ptr().add(k * stride) };
            for half in 0..super::BLOCK_ROWS / 16 {
                let mut sums = start;
                for (b, sum) in sums[..blocks].iter_mut().enumerate() {
                    for i in 8 * b..8 * b + 8 {
                        // SAFETY: quad `i` of keys `16 · half..` is 64 bytes inside the block
                        // (checked by the caller); the load is unaligned.
                        let k = unsafe {
                            _mm512_loadu_si512(
                                base.add((i * super::BLOCK_ROWS + 16 * half) * 4).cast(),
                            )
                        };
                        *sum = _mm512_dpbusd_epi32(
                            *sum,
                            _mm512_xor_si512(k, flip),
                            _mm512_set1_epi32(quads[i]),
                        );
                    }
                }
                let dst = &mut out[16 * half * blocks..16 * (half + 1) * blocks];
                store_key_major(&sums[..blocks], dst);
            }
        }
    }

    /// Sixteen keys' sums, one vector per block (lane = key), into `dst` key-major (`dst[j ·
    /// blocks + b]`): directly for one block, by permutes for two, through memory otherwise.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn store_key_major(sums: &[__m512i], dst: &mut [i32]) {
        let blocks = sums.len();
        match sums {
            [a] => {
                let d: &mut [i32; 16] = dst.try_into().expect("16 lanes");
                // SAFETY: `d` is 16 writable i32s; the store is unaligned.
                unsafe { _mm512_storeu_si512(d.as_mut_ptr().cast(), *a) };
            }
            [a, b] => {
                let lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
                let hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
                let d: &mut [i32; 32] = dst.try_into().expect("32 lanes");
                // SAFETY: `d` is 32 writable i32s; the stores are unaligned.
                unsafe {
                    _mm512_storeu_si512(
                        d.as_mut_ptr().cast(),
                        _mm512_permutex2var_epi32(*a, lo, *b),
                    );
                    _mm512_storeu_si512(
                        d.as_mut_ptr().add(16).cast(),
                        _mm512_permutex2var_epi32(*a, hi, *b),
                    );
                }
            }
            _ => {
                let mut lanes = [[0i32; 16]; super::MAX_QUERY_BLOCKS];
                for (l, s) in lanes.iter_mut().zip(sums) {
                    // SAFETY: `l` is 16 writable i32s; the store is unaligned.
                    unsafe { _mm512_storeu_si512(l.as_mut_ptr().cast(), *s) };
                }
                for (j, row) in dst.chunks_exact_mut(blocks).enumerate() {
                    for (b, o) in row.iter_mut().enumerate() {
                        *o = lanes[b][j];
                    }
                }
            }
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
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

    proptest! {
        #[test]
        fn interleaved_block_dots_are_their_definition(blocks in 1usize..=9, n in 0usize..4,
                                                       pad in 0usize..70, seed in any::<u64>(),
                                                       extreme in any::<bool>()) {
            let q = bytes(blocks * BLOCK, seed, extreme);
            let stride = BLOCK_ROWS * blocks * BLOCK + pad;
            // Keys as a cache holds them: no −128.
            let keys: Vec<i8> = bytes(n * stride + 3, seed ^ 1, extreme)
                .into_iter()
                .map(|x| x.max(-127))
                .collect();
            let len = n * BLOCK_ROWS * blocks;
            let mut fast = vec![i32::MIN; len];
            interleaved_block_dots(&q, &keys, stride, n, &mut fast);
            let mut slow = vec![0; len];
            interleaved_block_dots_scalar(&q, &keys, stride, n, &mut slow);
            prop_assert_eq!(&fast, &slow);
            // Each vector form on its own, whichever the dispatch picks on this CPU.
            #[cfg(target_arch = "x86_64")]
            {
                let mut each = vec![i32::MIN; len];
                if blocks <= MAX_QUERY_BLOCKS && has_avx2() {
                    // SAFETY: AVX2 was detected; the bounds hold by construction.
                    unsafe { avx2::interleaved_block_dots(&q, &keys, stride, n, &mut each) };
                    prop_assert_eq!(&each, &slow);
                }
                if avx512::takes_interleaved_dots(blocks) {
                    each.fill(i32::MIN);
                    // SAFETY: AVX-512 VNNI was detected; the bounds hold by construction.
                    unsafe { avx512::interleaved_block_dots(&q, &keys, stride, n, &mut each) };
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
        // A query of −128s against keys of −127s, each form's width of query.
        for blocks in [1, 2, 9] {
            let keys = vec![-127i8; BLOCK_ROWS * blocks * BLOCK];
            let mut out = vec![0; BLOCK_ROWS * blocks];
            interleaved_block_dots(&vec![-128; blocks * BLOCK], &keys, 0, 1, &mut out);
            assert!(out.iter().all(|&x| x == 32 * 128 * 127), "{blocks} blocks");
        }
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
