//! The AVX2 kernel: `vpsignb` + `vpmaddubsw` + `vpmaddwd` integer dot products over tiles of
//! 4 rows × one 16-column panel (prefill) or one row × one panel (decode), combined across
//! blocks exactly in 64-bit lanes, then rounded with vector instructions.
//!
//! Exactness argument, per block and column:
//! - `vpmaddubsw(|x|, sign(w, x))` multiplies magnitudes up to 127 by signed values up to 127
//!   and adds pairs: at most 2 · 127² = 32258 < 2^15, so the i16 never saturates (this is why
//!   the quantiser never produces −128).
//! - `vpmaddwd` with the column's scale mantissa `m_w` (≤ 255) in both halves of each lane
//!   multiplies and adds pairs into i32: the block total `D · m_w` stays below 2^27.
//! - `vpmuldq` by the row's `m_x · 2^(e_x - e_min)` (< 2^31) and `vpsllvq` by the column's
//!   `e_w - e_min` give the block's term in i64; the row and panel bounds checked before the
//!   tile guarantee every partial sum stays below 2^63 (else the row takes the exact fallback).
//! - The sums are rounded once, by [`finish_row`] (see there) or [`Sink::put_i64`].
//!
//! So the i64 sum is the exact accumulator, and the result is independent of tiling, rows in
//! the tile, block chunking and threads.
//!
//! Why it is written the way it is (measured on Zen 3, see `bench.rs`): the kernel is bound by
//! vector ALU throughput, four instructions per 32 multiply-accumulates plus the block
//! epilogue. With 16 ymm registers, a 4-row tile needs all of them for the block sums and
//! operands, so the i64 accumulators live in memory on purpose (one `vpaddq` with a memory
//! operand and one store per vector and block), and the block loop is inline assembly: the
//! compiler, given the same code as intrinsics, reassociated the additions and spilled the
//! block sums, and `_mm256_sllv_epi64` costs five extra instructions (a `count < 64` guard).
//! Decode streams each panel once; the one-row path keeps its accumulators in registers and
//! prefetches ahead.

use std::arch::x86_64::*;
use std::ops::Range;

use super::reference;
use super::sink::Sink;
use crate::error::Result;
use crate::pack::{PackedWeights, PANEL, RECORD};
use crate::quant::{QuantizedRows, BLOCK};

/// Rows per tile.
const MR: usize = 4;
/// Blocks per pass of the 4-row tiles: the panel's records for one pass (16 · 544 bytes) stay
/// in the L1 cache while every tile of the row chunk uses them.
const KC: usize = 16;
/// How far ahead (bytes) the one-row path prefetches the panel it streams: two records
/// (measured: one to four records are alike and clearly better than none, more is worse).
const PREFETCH: usize = 2 * RECORD;

/// Whether row `row` against panel `panel` can take the i64 path.
#[inline]
pub(crate) fn fast_pair(x: &QuantizedRows, row: usize, w: &PackedWeights, panel: usize) -> bool {
    let (rm, pm) = (x.meta(row), w.panel_meta(panel));
    rm.fast && pm.fast && (rm.bound as u128) * (pm.bound as u128) < (1u128 << 63)
}

/// Rows processed per pass over the panels, so that their quantised elements (signed and
/// absolute) stay in the L2 cache while every panel of the task streams past them.
pub(crate) fn row_chunk(blocks: usize, mr: usize) -> usize {
    let per_row = blocks * BLOCK * 2;
    ((128 << 10) / per_row.max(1)).max(mr) / mr * mr
}

pub(crate) fn run(
    x: &QuantizedRows,
    w: &PackedWeights,
    panels: Range<usize>,
    sink: &Sink,
) -> Result<()> {
    assert!(is_x86_feature_detected!("avx2"), "dispatch checked AVX2");
    // SAFETY: AVX2 is present (checked above).
    unsafe { run_avx2(x, w, panels, sink) }
}

/// Rows in chunks that stay in L2; per chunk, full tiles of 4 fast rows, and the rows left
/// over one at a time; per panel, the tiles in passes of [`KC`] blocks.
#[target_feature(enable = "avx2")]
unsafe fn run_avx2(
    x: &QuantizedRows,
    w: &PackedWeights,
    panels: Range<usize>,
    sink: &Sink,
) -> Result<()> {
    let rows = x.rows();
    let nb = w.blocks();
    if rows < MR {
        // SAFETY: AVX2 present (this function's own feature).
        return unsafe { run_decode(x, w, panels, sink) };
    }
    let chunk = row_chunk(nb, MR);
    let mut mults: Vec<i32> = Vec::new();
    let mut accs: Vec<__m256i> = Vec::new();
    let mut ok: Vec<bool> = Vec::new();
    let mut r0 = 0;
    while r0 < rows {
        let r1 = (r0 + chunk).min(rows);
        let fast: Vec<usize> = (r0..r1).filter(|&r| x.meta(r).fast).collect();
        let tiles: Vec<[usize; MR]> = if nb == 0 {
            Vec::new()
        } else {
            fast.chunks_exact(MR)
                .map(|c| [c[0], c[1], c[2], c[3]])
                .collect()
        };
        let rest = &fast[tiles.len() * MR..];
        let slow: Vec<usize> = (r0..r1).filter(|&r| !x.meta(r).fast).collect();
        // With the chunk's largest row bound, one test per panel usually clears every row.
        let max_bound = fast.iter().map(|&r| x.meta(r).bound).max().unwrap_or(0);
        tile_multipliers(x, &tiles, nb, &mut mults);
        accs.clear();
        accs.resize(tiles.len() * MR * 4, _mm256_setzero_si256());
        for p in panels.clone() {
            for &row in &slow {
                reference::fallback(x, row, w, p, sink)?;
            }
            for &row in rest {
                if fast_pair(x, row, w, p) {
                    // SAFETY: AVX2 present; the row is in range and fast against the panel.
                    unsafe { row1(x, row, w, p, sink)? };
                } else {
                    reference::fallback(x, row, w, p, sink)?;
                }
            }
            let pm = w.panel_meta(p);
            ok.clear();
            if pm.fast && (max_bound as u128) * (pm.bound as u128) < 1 << 63 {
                // Every fast row's bound is at most `max_bound`: all pass `fast_pair`.
                ok.resize(tiles.len(), true);
            } else {
                ok.extend(
                    tiles
                        .iter()
                        .map(|t| t.iter().all(|&r| fast_pair(x, r, w, p))),
                );
            }
            accs.fill(_mm256_setzero_si256());
            // SAFETY: AVX2 present; `mults` and `accs` are sized for `tiles` above.
            unsafe { tile_passes(x, w, p, &tiles, &ok, &mults, &mut accs) };
            // SAFETY: AVX2 present; `accs` holds the passes' sums of every tile marked `ok`.
            unsafe { finish_tiles(x, w, p, &tiles, &ok, &accs, sink)? };
        }
        r0 = r1;
    }
    Ok(())
}

// The pieces of [`run_avx2`] below are apart only so that it reads as its steps; each has one
// caller, is `#[inline]` with the caller's own `avx2` feature (Rust refuses `inline(always)`
// with `target_feature`), and so compiles into it as before (checked: no symbol of them is
// left in the library).

/// Decode (fewer rows than a tile): no tile to fill, nothing to set up; each panel streams
/// past the rows once.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn run_decode(
    x: &QuantizedRows,
    w: &PackedWeights,
    panels: Range<usize>,
    sink: &Sink,
) -> Result<()> {
    for p in panels {
        for row in 0..x.rows() {
            if fast_pair(x, row, w, p) {
                // SAFETY: AVX2 present; the row is in range and fast against the panel.
                unsafe { row1(x, row, w, p, sink)? };
            } else {
                reference::fallback(x, row, w, p, sink)?;
            }
        }
    }
    Ok(())
}

/// The `tiles`' row multipliers into `mults`, block-major, so the assembly reads one pointer.
#[inline]
#[target_feature(enable = "avx2")]
fn tile_multipliers(x: &QuantizedRows, tiles: &[[usize; MR]], nb: usize, mults: &mut Vec<i32>) {
    mults.clear();
    mults.resize(tiles.len() * nb * MR, 0);
    for (t, tile) in tiles.iter().enumerate() {
        for (r, &row) in tile.iter().enumerate() {
            for (b, &m) in x.row_mult(row).iter().enumerate() {
                mults[(t * nb + b) * MR + r] = m;
            }
        }
    }
}

/// Every tile marked `ok` against panel `p`, its sums added into its own accumulators in
/// `accs` (zeroed by the caller), in passes of at most [`KC`] blocks.
///
/// # Safety
/// AVX2 must be present; `mults` and `accs` must be sized for `tiles` ([`tile_multipliers`],
/// `MR * 4` vectors a tile), and `ok` hold one flag a tile.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn tile_passes(
    x: &QuantizedRows,
    w: &PackedWeights,
    p: usize,
    tiles: &[[usize; MR]],
    ok: &[bool],
    mults: &[i32],
    accs: &mut [__m256i],
) {
    let nb = w.blocks();
    let recs = &w.data()[p * nb * RECORD..(p + 1) * nb * RECORD];
    // Passes of at most KC blocks, of equal length (18 blocks: 9 + 9, not 16 + 2).
    let passes = nb.div_ceil(KC);
    let mut b0 = 0;
    for pass in 0..passes {
        let len = (pass + 1) * nb / passes - b0;
        // The first tile of a pass prefetches the records that follow it in memory
        // (the next pass, or the next panel's first), which the other tiles of the
        // chunk then find in L1 instead of waiting on L3 or memory.
        let mut pf = len * RECORD;
        for (t, tile) in tiles.iter().enumerate() {
            if !ok[t] {
                continue;
            }
            // SAFETY: AVX2; the record, row and multiplier spans start at block b0
            // and hold `len >= 1` more blocks; the accumulators are this tile's own.
            unsafe {
                asm_tile4(
                    recs.as_ptr().add(b0 * RECORD),
                    tile.map(|r| x.row_q(r).as_ptr().add(b0 * BLOCK)),
                    nb * BLOCK,
                    mults.as_ptr().add((t * nb + b0) * MR),
                    accs.as_mut_ptr().add(t * MR * 4),
                    len,
                    pf,
                )
            };
            pf = 0;
        }
        b0 += len;
    }
}

/// Every row of the `tiles` against panel `p` into `sink`: a tile marked `ok` from its sums in
/// `accs` ([`tile_passes`]), any other row by row.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn finish_tiles(
    x: &QuantizedRows,
    w: &PackedWeights,
    p: usize,
    tiles: &[[usize; MR]],
    ok: &[bool],
    accs: &[__m256i],
    sink: &Sink,
) -> Result<()> {
    for (t, tile) in tiles.iter().enumerate() {
        for (r, &row) in tile.iter().enumerate() {
            if !ok[t] {
                // A tile with a row too wide for this panel: row by row.
                if fast_pair(x, row, w, p) {
                    // SAFETY: AVX2 present; the row is in range and fast against the panel.
                    unsafe { row1(x, row, w, p, sink)? };
                } else {
                    reference::fallback(x, row, w, p, sink)?;
                }
                continue;
            }
            let a = &accs[(t * MR + r) * 4..(t * MR + r + 1) * 4];
            let ex = x.meta(row).exp_min;
            // SAFETY: AVX2 present.
            unsafe { finish_row(sink, row, w, p, ex, [a[0], a[1], a[2], a[3]])? };
        }
    }
    Ok(())
}

/// Rounds and stores one row's 16 sums of a panel. `acc` holds i64 lanes for columns
/// [0,2,4,6], [1,3,5,7], [8,..,14], [9,..,15]; the value of column `c` is
/// `sum · 2^(ex + col_exp_min(c))`.
///
/// The vector path handles sums below 2^51 in magnitude (all of them, in practice): such a sum
/// becomes an f64 exactly (written into the mantissa of 1.5 · 2^52 and subtracted back), the
/// product with `2^exp` is exact (`|exp| <= 800` by `quant::EXP_FAST`, so neither the power
/// nor the product leaves f64's normal range), and the one conversion to f32 rounds to
/// nearest even, as `round_i64_fast` does (it too rounds the exact value, once, from an f64).
/// When the exact accumulators are wanted, the same sums are put in canonical form by
/// [`store_slots`]. Anything else (a larger sum, an overflow to infinity, a partial panel)
/// goes element by element through [`Sink::put_i64`].
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn finish_row(
    sink: &Sink,
    row: usize,
    w: &PackedWeights,
    panel: usize,
    ex: i32,
    acc: [__m256i; 4],
) -> Result<()> {
    let col0 = panel * PANEL;
    if let Some(run) = sink.run(row, col0, PANEL) {
        let lim = _mm256_set1_epi64x(1 << 51);
        let big = acc
            .map(|a| _mm256_srli_epi64::<52>(_mm256_add_epi64(a, lim)))
            .into_iter()
            .fold(_mm256_setzero_si256(), |m, v| _mm256_or_si256(m, v));
        if _mm256_testz_si256(big, big) == 1 {
            let ce = &w.col_exp_mins()[col0..col0 + PANEL];
            // SAFETY: ce is 16 i32s.
            let (c0, c1) = unsafe {
                (
                    _mm256_loadu_si256(ce.as_ptr() as _),
                    _mm256_loadu_si256(ce.as_ptr().add(8) as _),
                )
            };
            let bias = _mm256_set1_epi32(ex + 1023);
            let (e0, e1) = (_mm256_add_epi32(c0, bias), _mm256_add_epi32(c1, bias));
            // 2^exp as f64 bits, in the lane order of `acc`: even i32 lanes are in the low
            // halves of the i64 lanes, odd ones in the high halves.
            let p = [
                _mm256_slli_epi64::<52>(e0),
                _mm256_slli_epi64::<52>(_mm256_srli_epi64::<32>(e0)),
                _mm256_slli_epi64::<52>(e1),
                _mm256_slli_epi64::<52>(_mm256_srli_epi64::<32>(e1)),
            ];
            let magic = _mm256_set1_epi64x(0x4338_0000_0000_0000);
            let f = |i: usize| {
                let v = _mm256_sub_pd(
                    _mm256_castsi256_pd(_mm256_add_epi64(acc[i], magic)),
                    _mm256_castsi256_pd(magic),
                );
                _mm256_cvtpd_ps(_mm256_mul_pd(v, _mm256_castsi256_pd(p[i])))
            };
            let (a0, a1, a2, a3) = (f(0), f(1), f(2), f(3));
            let lo = _mm256_set_m128(_mm_unpackhi_ps(a0, a1), _mm_unpacklo_ps(a0, a1));
            let hi = _mm256_set_m128(_mm_unpackhi_ps(a2, a3), _mm_unpacklo_ps(a2, a3));
            // Rounded out of the f32 range: ±inf; the slow path reports the overflow.
            let mag = _mm256_set1_epi32(0x7fff_ffff);
            let inf = _mm256_set1_epi32(0x7f80_0000);
            let ovf = _mm256_or_si256(
                _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(lo), mag), inf),
                _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(hi), mag), inf),
            );
            if _mm256_testz_si256(ovf, ovf) == 1 {
                // SAFETY: `run` gave 16 writable elements (and slots) owned by this task.
                unsafe {
                    _mm256_storeu_ps(run.out, lo);
                    _mm256_storeu_ps(run.out.add(8), hi);
                    if let Some(slots) = run.slots {
                        store_sums(slots, acc);
                        run.slots_written();
                    }
                }
                return Ok(());
            }
        }
    }
    let mut lanes = [[0i64; 4]; 4];
    for (q, l) in lanes.iter_mut().enumerate() {
        // SAFETY: l is 32 bytes.
        unsafe { _mm256_storeu_si256(l.as_mut_ptr() as _, acc[q]) };
    }
    for c in 0..PANEL {
        let col = col0 + c;
        if col >= w.n() {
            break;
        }
        let (half, cc) = (c / 8, c % 8);
        let sum = lanes[half * 2 + cc % 2][cc / 2];
        sink.put_i64(row, col, sum, ex + w.col_exp_min(col))?;
    }
    Ok(())
}

/// Stores one row's 16 sums of a panel (lanes as in [`finish_row`]) as its slots, in column
/// order: the sums are already in the units the accumulators keep (see
/// [`Accumulators`](super::Accumulators)), so keeping them is a shuffle and four stores.
///
/// # Safety
/// AVX2; `slots` points at 16 writable (possibly uninitialised) slots owned by the caller's
/// task.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn store_sums(slots: *mut i64, acc: [__m256i; 4]) {
    for h in 0..2 {
        // Columns 8h + [0, 2, 4, 6] and 8h + [1, 3, 5, 7]: pairs [0, 1 | 4, 5], [2, 3 | 6, 7].
        let (even, odd) = (acc[2 * h], acc[2 * h + 1]);
        let (p01_45, p23_67) = (
            _mm256_unpacklo_epi64(even, odd),
            _mm256_unpackhi_epi64(even, odd),
        );
        let first = _mm256_permute2x128_si256::<0x20>(p01_45, p23_67);
        let second = _mm256_permute2x128_si256::<0x31>(p01_45, p23_67);
        // Non-temporal: the sums are read, if ever, hops later, long after the weights
        // streaming through have evicted them, and the pool's buffers they land in have gone
        // cold; an ordinary store first reads each line in. (`movnti` takes any 8-byte
        // aligned address; the buffers are `Vec<i64>`s. [`Kernel::run`] fences them.)
        // SAFETY: two 256-bit vectors are eight i64s, any bits a valid i64.
        let lanes: [[i64; 4]; 2] = unsafe { std::mem::transmute([first, second]) };
        for (q, four) in lanes.iter().enumerate() {
            for (i, &v) in four.iter().enumerate() {
                // SAFETY: per the contract, slots[0..16] are ours.
                unsafe { _mm_stream_si64(slots.add(8 * h + 4 * q + i), v) };
            }
        }
    }
}

// ---- The block loops, in inline assembly. ----
//
// Register plan of a block (16 ymm): d{r}{h} are the i32 block sums of row r, columns
// 8h..8h+8; mw0/mw1 the block's m_w of columns 0..8 and 8..16, in both 16-bit halves of each
// lane; s0..s5 scratch: w0 w1 xs xb p0 p1 in the k loop, then the four shift vectors, the row
// multiplier and a temporary in the epilogue. The first group of four k writes the block sums
// instead of adding to them.

/// One row's part of one group of four k: `d += madd(maddubs(|x|, sign(w, x)), m_w)`
/// (`first`: `d = ...`). `s0`/`s1` hold the weights of columns 0..8 and 8..16.
#[rustfmt::skip]
macro_rules! kg_row {
    (first, $kg:literal, $r:literal) => { concat!(
        "vpbroadcastd {s2}, dword ptr [{q", $r, "} + ", $kg, "*4]\n",
        "vpbroadcastd {s3}, dword ptr [{q", $r, "} + {wd} + ", $kg, "*4]\n",
        "vpsignb {s4}, {s0}, {s2}\n",
        "vpsignb {s5}, {s1}, {s2}\n",
        "vpmaddubsw {s4}, {s3}, {s4}\n",
        "vpmaddubsw {s5}, {s3}, {s5}\n",
        "vpmaddwd {d", $r, "0}, {s4}, {mw0}\n",
        "vpmaddwd {d", $r, "1}, {s5}, {mw1}\n",
    ) };
    (next, $kg:literal, $r:literal) => { concat!(
        "vpbroadcastd {s2}, dword ptr [{q", $r, "} + ", $kg, "*4]\n",
        "vpbroadcastd {s3}, dword ptr [{q", $r, "} + {wd} + ", $kg, "*4]\n",
        "vpsignb {s4}, {s0}, {s2}\n",
        "vpsignb {s5}, {s1}, {s2}\n",
        "vpmaddubsw {s4}, {s3}, {s4}\n",
        "vpmaddubsw {s5}, {s3}, {s5}\n",
        "vpmaddwd {s4}, {s4}, {mw0}\n",
        "vpmaddwd {s5}, {s5}, {mw1}\n",
        "vpaddd {d", $r, "0}, {d", $r, "0}, {s4}\n",
        "vpaddd {d", $r, "1}, {d", $r, "1}, {s5}\n",
    ) };
}

/// One group of four k for every row of the tile.
#[rustfmt::skip]
macro_rules! kg_all {
    ($which:tt, $kg:literal, [$($r:literal),+]) => { concat!(
        "vmovdqu {s0}, ymmword ptr [{rec} + ", $kg, "*64]\n",
        "vmovdqu {s1}, ymmword ptr [{rec} + ", $kg, "*64 + 32]\n",
        $( kg_row!($which, $kg, $r), )+
    ) };
}

/// The block's `m_w` (bytes 512..528 of the record) into `mw0`/`mw1`, in both 16-bit halves
/// of each lane, so that `vpmaddwd` multiplies both pair sums of a column by it.
#[rustfmt::skip]
macro_rules! load_mw {
    () => { concat!(
        "vpmovzxbd {mw0}, qword ptr [{rec} + 512]\n",
        "vpmovzxbd {mw1}, qword ptr [{rec} + 520]\n",
        "vpslld {s0}, {mw0}, 16\n",
        "vpslld {s1}, {mw1}, 16\n",
        "vpor {mw0}, {mw0}, {s0}\n",
        "vpor {mw1}, {mw1}, {s1}\n",
    ) };
}

/// The block's column shifts (bytes 528..544: even columns, then odd ones) as i64 lanes in the
/// order of the accumulators: `s0` [0,2,4,6], `s1` [1,3,5,7], `s2` [8,..,14], `s3` [9,..,15].
#[rustfmt::skip]
macro_rules! load_shifts {
    () => { concat!(
        "vpmovzxbq {s0}, dword ptr [{rec} + 528]\n",
        "vpmovzxbq {s1}, dword ptr [{rec} + 536]\n",
        "vpmovzxbq {s2}, dword ptr [{rec} + 532]\n",
        "vpmovzxbq {s3}, dword ptr [{rec} + 540]\n",
    ) };
}

/// The block epilogue of one row: each i32 block sum times the row multiplier into i64 (even
/// lanes, then odd lanes after a 32-bit shift), shifted by the column shift, added to the
/// accumulators in memory (`acc + 128 r`: [0,2,4,6], [1,3,5,7], [8,..,14], [9,..,15]).
#[rustfmt::skip]
macro_rules! epi_row {
    ($r:literal) => { concat!(
        "vpbroadcastd {s4}, dword ptr [{mul} + ", $r, "*4]\n",
        "vpmuldq {s5}, {d", $r, "0}, {s4}\n",
        "vpsllvq {s5}, {s5}, {s0}\n",
        "vpaddq {s5}, {s5}, ymmword ptr [{acc} + ", $r, "*128]\n",
        "vmovdqu ymmword ptr [{acc} + ", $r, "*128], {s5}\n",
        "vpsrlq {d", $r, "0}, {d", $r, "0}, 32\n",
        "vpmuldq {d", $r, "0}, {d", $r, "0}, {s4}\n",
        "vpsllvq {d", $r, "0}, {d", $r, "0}, {s1}\n",
        "vpaddq {d", $r, "0}, {d", $r, "0}, ymmword ptr [{acc} + ", $r, "*128 + 32]\n",
        "vmovdqu ymmword ptr [{acc} + ", $r, "*128 + 32], {d", $r, "0}\n",
        "vpmuldq {s5}, {d", $r, "1}, {s4}\n",
        "vpsllvq {s5}, {s5}, {s2}\n",
        "vpaddq {s5}, {s5}, ymmword ptr [{acc} + ", $r, "*128 + 64]\n",
        "vmovdqu ymmword ptr [{acc} + ", $r, "*128 + 64], {s5}\n",
        "vpsrlq {d", $r, "1}, {d", $r, "1}, 32\n",
        "vpmuldq {d", $r, "1}, {d", $r, "1}, {s4}\n",
        "vpsllvq {d", $r, "1}, {d", $r, "1}, {s3}\n",
        "vpaddq {d", $r, "1}, {d", $r, "1}, ymmword ptr [{acc} + ", $r, "*128 + 96]\n",
        "vmovdqu ymmword ptr [{acc} + ", $r, "*128 + 96], {d", $r, "1}\n",
    ) };
}

/// Prefetches the record `{pf}` bytes ahead of `{rec}`, every cache line of it.
#[rustfmt::skip]
macro_rules! prefetch_record {
    () => { concat!(
        "prefetcht0 byte ptr [{rec} + {pf}]\n",
        "prefetcht0 byte ptr [{rec} + {pf} + 64]\n",
        "prefetcht0 byte ptr [{rec} + {pf} + 128]\n",
        "prefetcht0 byte ptr [{rec} + {pf} + 192]\n",
        "prefetcht0 byte ptr [{rec} + {pf} + 256]\n",
        "prefetcht0 byte ptr [{rec} + {pf} + 320]\n",
        "prefetcht0 byte ptr [{rec} + {pf} + 384]\n",
        "prefetcht0 byte ptr [{rec} + {pf} + 448]\n",
        "prefetcht0 byte ptr [{rec} + {pf} + 512]\n",
    ) };
}

/// The loop over the blocks of a tile of rows `$r` (row pointers advance 32 bytes a block).
/// With `{pf}` non-zero, it also prefetches the records `{pf}` bytes ahead.
#[rustfmt::skip]
macro_rules! block_loop {
    ($mr:literal, [$($r:literal),+]) => { concat!(
        "2:\n",
        "test {pf}, {pf}\n",
        "jz 3f\n",
        prefetch_record!(),
        "3:\n",
        load_mw!(),
        kg_all!(first, 0, [$($r),+]),
        kg_all!(next, 1, [$($r),+]),
        kg_all!(next, 2, [$($r),+]),
        kg_all!(next, 3, [$($r),+]),
        kg_all!(next, 4, [$($r),+]),
        kg_all!(next, 5, [$($r),+]),
        kg_all!(next, 6, [$($r),+]),
        kg_all!(next, 7, [$($r),+]),
        load_shifts!(),
        $( epi_row!($r), )+
        "add {rec}, 544\n",
        $( "add {q", $r, "}, 32\n", )+
        "add {mul}, ", $mr, "*4\n",
        "dec {cnt}\n",
        "jnz 2b\n",
    ) };
}

/// Four rows × one panel over blocks `[0, nb)` with the assembly block loop.
///
/// # Safety
/// AVX2; `rec` points at the panel's first record of `nb`; `q[r]` at row r's elements with
/// its magnitudes `wd` bytes further; `mul` at `nb × 4` row multipliers (block-major);
/// `acc` at 4 × 4 zeroed or running i64 vectors; `nb >= 1`. Prefetches (`pf` bytes ahead of
/// each record, none if `pf` is 0) may point past the records: they never fault.
#[target_feature(enable = "avx2")]
unsafe fn asm_tile4(
    rec: *const u8,
    q: [*const i8; 4],
    wd: usize,
    mul: *const i32,
    acc: *mut __m256i,
    nb: usize,
    pf: usize,
) {
    // The loop runs its body before testing the count: zero would wrap around.
    assert!(nb >= 1, "empty block range");
    // SAFETY: per the contract above; every access stays inside those spans.
    unsafe {
        std::arch::asm!(
            block_loop!(4, [0, 1, 2, 3]),
            rec = inout(reg) rec => _,
            q0 = inout(reg) q[0] => _,
            q1 = inout(reg) q[1] => _,
            q2 = inout(reg) q[2] => _,
            q3 = inout(reg) q[3] => _,
            wd = in(reg) wd,
            mul = inout(reg) mul => _,
            acc = in(reg) acc,
            cnt = inout(reg) nb => _,
            pf = in(reg) pf,
            d00 = out(ymm_reg) _, d01 = out(ymm_reg) _,
            d10 = out(ymm_reg) _, d11 = out(ymm_reg) _,
            d20 = out(ymm_reg) _, d21 = out(ymm_reg) _,
            d30 = out(ymm_reg) _, d31 = out(ymm_reg) _,
            mw0 = out(ymm_reg) _, mw1 = out(ymm_reg) _,
            s0 = out(ymm_reg) _, s1 = out(ymm_reg) _, s2 = out(ymm_reg) _,
            s3 = out(ymm_reg) _, s4 = out(ymm_reg) _, s5 = out(ymm_reg) _,
            options(nostack),
        );
    }
}

/// One row against one panel, blocks `[0, nb)`, with its accumulators in registers, for
/// decode (and the rows left over by the 4-row tiles). Streams the panel once, so it also
/// prefetches: every cache line of the record `pf` bytes ahead.
///
/// # Safety
/// AVX2; `rec` points at `nb >= 1` records; `q` at the row's elements with its magnitudes
/// `wd` bytes further; `mul` at the row's `nb` multipliers. Prefetches may point past the
/// records (they never fault and are not memory accesses).
#[target_feature(enable = "avx2")]
unsafe fn asm_row1(
    rec: *const u8,
    q: *const i8,
    wd: usize,
    mul: *const i32,
    nb: usize,
    pf: usize,
) -> [__m256i; 4] {
    let (a0, a1, a2, a3): (__m256i, __m256i, __m256i, __m256i);
    // The loop runs its body before testing the count: zero would wrap around.
    assert!(nb >= 1, "empty block range");
    // SAFETY: per the contract above.
    unsafe {
        std::arch::asm!(
            "vpxor {a0}, {a0}, {a0}",
            "vpxor {a1}, {a1}, {a1}",
            "vpxor {a2}, {a2}, {a2}",
            "vpxor {a3}, {a3}, {a3}",
            "2:",
            prefetch_record!(),
            load_mw!(),
            kg_all!(first, 0, [0]),
            kg_all!(next, 1, [0]),
            kg_all!(next, 2, [0]),
            kg_all!(next, 3, [0]),
            kg_all!(next, 4, [0]),
            kg_all!(next, 5, [0]),
            kg_all!(next, 6, [0]),
            kg_all!(next, 7, [0]),
            load_shifts!(),
            "vpbroadcastd {s4}, dword ptr [{mul}]",
            "vpmuldq {s5}, {d00}, {s4}",
            "vpsllvq {s5}, {s5}, {s0}",
            "vpaddq {a0}, {a0}, {s5}",
            "vpsrlq {d00}, {d00}, 32",
            "vpmuldq {d00}, {d00}, {s4}",
            "vpsllvq {d00}, {d00}, {s1}",
            "vpaddq {a1}, {a1}, {d00}",
            "vpmuldq {s5}, {d01}, {s4}",
            "vpsllvq {s5}, {s5}, {s2}",
            "vpaddq {a2}, {a2}, {s5}",
            "vpsrlq {d01}, {d01}, 32",
            "vpmuldq {d01}, {d01}, {s4}",
            "vpsllvq {d01}, {d01}, {s3}",
            "vpaddq {a3}, {a3}, {d01}",
            "add {rec}, 544",
            "add {q0}, 32",
            "add {mul}, 4",
            "dec {cnt}",
            "jnz 2b",
            rec = inout(reg) rec => _,
            q0 = inout(reg) q => _,
            wd = in(reg) wd,
            mul = inout(reg) mul => _,
            cnt = inout(reg) nb => _,
            pf = in(reg) pf,
            a0 = out(ymm_reg) a0, a1 = out(ymm_reg) a1,
            a2 = out(ymm_reg) a2, a3 = out(ymm_reg) a3,
            d00 = out(ymm_reg) _, d01 = out(ymm_reg) _,
            mw0 = out(ymm_reg) _, mw1 = out(ymm_reg) _,
            s0 = out(ymm_reg) _, s1 = out(ymm_reg) _, s2 = out(ymm_reg) _,
            s3 = out(ymm_reg) _, s4 = out(ymm_reg) _, s5 = out(ymm_reg) _,
            options(nostack, readonly),
        );
    }
    [a0, a1, a2, a3]
}

/// One row × one panel with [`asm_row1`], then the rounding. The row must be fast against
/// the panel.
#[target_feature(enable = "avx2")]
unsafe fn row1(
    x: &QuantizedRows,
    row: usize,
    w: &PackedWeights,
    panel: usize,
    sink: &Sink,
) -> Result<()> {
    let nb = w.blocks();
    let acc = if nb == 0 {
        [_mm256_setzero_si256(); 4]
    } else {
        let recs = &w.data()[panel * nb * RECORD..(panel + 1) * nb * RECORD];
        // SAFETY: the spans match asm_row1's contract.
        unsafe {
            asm_row1(
                recs.as_ptr(),
                x.row_q(row).as_ptr(),
                nb * BLOCK,
                x.row_mult(row).as_ptr(),
                nb,
                PREFETCH,
            )
        }
    };
    // SAFETY: AVX2 present.
    unsafe { finish_row(sink, row, w, panel, x.meta(row).exp_min, acc) }
}

/// Multiply-accumulates per second of the 4-row tile alone (block loop and exact epilogue,
/// not the rounding) on L1-resident data, best of repeated runs over `time`: the ceiling the
/// prefill path can approach on this machine. `None` without AVX2.
pub(crate) fn tile_macs_per_second(time: std::time::Duration) -> Option<f64> {
    if !is_x86_feature_detected!("avx2") {
        return None;
    }
    let nb = KC;
    let recs = vec![0x55u8; nb * RECORD];
    let xq = vec![0x33i8; MR * 2 * nb * BLOCK];
    let mults = vec![1i32; nb * MR];
    let mut acc = vec![[0i64; 4]; MR * 4];
    let q: [*const i8; MR] = std::array::from_fn(|r| xq[r * 2 * nb * BLOCK..].as_ptr());
    let reps = 64;
    let mut best = 0f64;
    let start = std::time::Instant::now();
    while start.elapsed() < time {
        let t = std::time::Instant::now();
        for _ in 0..reps {
            // SAFETY: AVX2 detected; the spans match asm_tile4's contract (nb records, rows of
            // nb · 32 elements followed by as many magnitudes, nb · 4 multipliers, 16
            // accumulator vectors).
            unsafe {
                asm_tile4(
                    recs.as_ptr(),
                    q,
                    nb * BLOCK,
                    mults.as_ptr(),
                    acc.as_mut_ptr() as *mut __m256i,
                    nb,
                    0,
                )
            };
        }
        let macs = (reps * MR * PANEL * nb * BLOCK) as f64;
        best = best.max(macs / t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&acc);
    Some(best)
}

#[cfg(test)]
mod tests {
    use std::mem::MaybeUninit;

    use proptest::prelude::*;

    use super::*;

    /// Sums below 2^51 in magnitude (the vector path's range), with the edges and zeros.
    fn sum() -> impl Strategy<Value = i64> {
        const LIM: i64 = 1 << 51;
        prop_oneof![
            Just(0i64),
            Just(-LIM),
            Just(LIM - 1),
            Just(1),
            Just(-1),
            (0u32..51).prop_map(|b| 1i64 << b),
            (0u32..51).prop_map(|b| -(1i64 << b)),
            (-LIM..LIM),
            (-LIM..LIM, 0u32..40).prop_map(|(s, b)| (s >> b) << b),
        ]
    }

    proptest! {
        /// The vector store puts every lane's sum at its column.
        #[test]
        fn vector_slots_hold_each_column_s_sum(sums in proptest::array::uniform16(sum())) {
            if !is_x86_feature_detected!("avx2") {
                return Ok(());
            }
            // Lanes as the tile leaves them: [0,2,4,6], [1,3,5,7], [8,..,14], [9,..,15].
            let lanes: [[i64; 4]; 4] =
                std::array::from_fn(|q| std::array::from_fn(|i| sums[(q / 2) * 8 + q % 2 + 2 * i]));
            let mut got = [MaybeUninit::<i64>::uninit(); 16];
            // SAFETY: AVX2 detected; 16 slots to write.
            unsafe {
                let acc = lanes.map(|l| _mm256_loadu_si256(l.as_ptr() as _));
                store_sums(got.as_mut_ptr() as *mut i64, acc);
            }
            for c in 0..16 {
                // SAFETY: store_sums wrote all 16.
                let slot = unsafe { got[c].assume_init() };
                prop_assert_eq!(slot, sums[c], "column {}", c);
            }
        }
    }
}
