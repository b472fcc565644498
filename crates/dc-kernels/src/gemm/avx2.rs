//! The AVX2 kernel: `vpsignb` + `vpmaddubsw` + `vpmaddwd` integer dot products over a tile of
//! `MR` rows × one 16-column panel, combined across blocks exactly in 64-bit lanes.
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
//!
//! So the i64 sum is the exact accumulator, and the result is independent of tiling, rows in
//! the tile and threads.

use std::arch::x86_64::*;
use std::ops::Range;

use super::reference;
use super::sink::Sink;
use crate::error::Result;
use crate::pack::{PackedWeights, PANEL, RECORD, RECORD_Q};
use crate::quant::{QuantizedRows, BLOCK};

/// Rows per tile.
const MR: usize = 4;
/// How far ahead (bytes) the kernel prefetches the panel it streams: four records.
const PREFETCH_AHEAD: usize = 4 * RECORD;

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

#[target_feature(enable = "avx2")]
unsafe fn run_avx2(
    x: &QuantizedRows,
    w: &PackedWeights,
    panels: Range<usize>,
    sink: &Sink,
) -> Result<()> {
    let rows = x.rows();
    let chunk = row_chunk(x.blocks(), MR);
    let mut r0 = 0;
    while r0 < rows {
        let r1 = (r0 + chunk).min(rows);
        for p in panels.clone() {
            let mut pending = [0usize; MR];
            let mut n = 0;
            for row in r0..r1 {
                if !fast_pair(x, row, w, p) {
                    reference::fallback(x, row, w, p, sink)?;
                    continue;
                }
                pending[n] = row;
                n += 1;
                if n == MR {
                    // SAFETY: AVX2 present; rows are in range and fast against this panel.
                    unsafe { tile4(x, &pending, w, p, sink)? };
                    n = 0;
                }
            }
            for &row in &pending[..n] {
                // SAFETY: as above.
                unsafe { tile1(x, &[row], w, p, sink)? };
            }
        }
        r0 = r1;
    }
    Ok(())
}

/// Loads 4 bytes as the low lane of an xmm register.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load4(p: *const u8) -> __m128i {
    // SAFETY: the caller guarantees 4 readable bytes.
    _mm_cvtsi32_si128(unsafe { (p as *const i32).read_unaligned() })
}

/// `vpsllvq`: shifts each 64-bit lane left by the matching lane of `count`.
///
/// Written as one instruction of inline assembly because the intrinsic is lowered to a
/// generic shift guarded by a `count < 64` select, which costs five extra instructions per
/// shift in the hottest part of the epilogue; our counts are always below 64.
#[inline]
#[target_feature(enable = "avx2")]
fn sllv(a: __m256i, count: __m256i) -> __m256i {
    let out: __m256i;
    // SAFETY: a register-only AVX2 instruction, and this function requires AVX2.
    unsafe {
        std::arch::asm!(
            "vpsllvq {out}, {a}, {count}",
            out = lateout(ymm_reg) out,
            a = in(ymm_reg) a,
            count = in(ymm_reg) count,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    out
}

// The tile is written once as a macro over literal row indices, so every per-row accumulator
// is a named register: a loop over rows would leave them in stack arrays, and the block sums
// would then carry their dependency through memory (measured: 4× slower).
macro_rules! tile_fn {
    ($name:ident, $rows:literal, [$($r:literal),+]) => {
        /// One tile of rows × one panel, all blocks. Rows must be fast against the panel.
        #[target_feature(enable = "avx2")]
        unsafe fn $name(
            x: &QuantizedRows,
            rows: &[usize; $rows],
            w: &PackedWeights,
            panel: usize,
            sink: &Sink,
        ) -> Result<()> {
            let nb = w.blocks();
            let base = w.data()[panel * nb * RECORD..(panel + 1) * nb * RECORD].as_ptr();
            let xq: [*const i8; $rows] = rows.map(|r| x.row_q(r).as_ptr());
            let xa: [*const u8; $rows] = rows.map(|r| x.row_abs(r).as_ptr());
            let xm: [*const i32; $rows] = rows.map(|r| x.row_mult(r).as_ptr());
            let zero = _mm256_setzero_si256();
            let mut acc = [[zero; 4]; $rows];
            for b in 0..nb {
                // SAFETY (all pointer arithmetic below): `base` spans nb records of RECORD
                // bytes, the row pointers span nb · 32 bytes (nb for the multipliers), and every
                // offset stays inside those spans.
                let rec = unsafe { base.add(b * RECORD) };
                let m0 = _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(rec.add(RECORD_Q) as _) });
                let m1 = _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(rec.add(RECORD_Q + 8) as _) });
                let mw0 = _mm256_or_si256(m0, _mm256_slli_epi32::<16>(m0));
                let mw1 = _mm256_or_si256(m1, _mm256_slli_epi32::<16>(m1));
                let mut d = [[zero; 2]; $rows];
                // Fetch a few records ahead: decode streams the panel once, and the hardware
                // prefetcher alone leaves about a third of the bandwidth unused here.
                _mm_prefetch::<_MM_HINT_T0>(unsafe { rec.add(PREFETCH_AHEAD) } as _);
                _mm_prefetch::<_MM_HINT_T0>(unsafe { rec.add(PREFETCH_AHEAD + 256) } as _);
                macro_rules! kgroup {
                    ($kg:literal) => {{
                        let w0 = unsafe { _mm256_loadu_si256(rec.add($kg * 64) as _) };
                        let w1 = unsafe { _mm256_loadu_si256(rec.add($kg * 64 + 32) as _) };
                        let off = b * BLOCK + $kg * 4;
                        $(
                            let xs = _mm256_set1_epi32(unsafe { (xq[$r].add(off) as *const i32).read_unaligned() });
                            let xb = _mm256_set1_epi32(unsafe { (xa[$r].add(off) as *const i32).read_unaligned() });
                            let p0 = _mm256_maddubs_epi16(xb, _mm256_sign_epi8(w0, xs));
                            let p1 = _mm256_maddubs_epi16(xb, _mm256_sign_epi8(w1, xs));
                            d[$r][0] = _mm256_add_epi32(d[$r][0], _mm256_madd_epi16(p0, mw0));
                            d[$r][1] = _mm256_add_epi32(d[$r][1], _mm256_madd_epi16(p1, mw1));
                        )+
                    }};
                }
                kgroup!(0);
                kgroup!(1);
                kgroup!(2);
                kgroup!(3);
                kgroup!(4);
                kgroup!(5);
                kgroup!(6);
                kgroup!(7);
                let sh = unsafe { rec.add(RECORD_Q + PANEL) };
                let s0e = _mm256_cvtepu8_epi64(unsafe { load4(sh) });
                let s1e = _mm256_cvtepu8_epi64(unsafe { load4(sh.add(4)) });
                let s0o = _mm256_cvtepu8_epi64(unsafe { load4(sh.add(8)) });
                let s1o = _mm256_cvtepu8_epi64(unsafe { load4(sh.add(12)) });
                $(
                    let rm = _mm256_set1_epi64x(unsafe { *xm[$r].add(b) } as i64);
                    let [d0, d1] = d[$r];
                    let t0e = sllv(_mm256_mul_epi32(d0, rm), s0e);
                    let t0o = sllv(_mm256_mul_epi32(_mm256_srli_epi64::<32>(d0), rm), s0o);
                    let t1e = sllv(_mm256_mul_epi32(d1, rm), s1e);
                    let t1o = sllv(_mm256_mul_epi32(_mm256_srli_epi64::<32>(d1), rm), s1o);
                    acc[$r][0] = _mm256_add_epi64(acc[$r][0], t0e);
                    acc[$r][1] = _mm256_add_epi64(acc[$r][1], t0o);
                    acc[$r][2] = _mm256_add_epi64(acc[$r][2], t1e);
                    acc[$r][3] = _mm256_add_epi64(acc[$r][3], t1o);
                )+
            }
            for r in 0..$rows {
                let mut lanes = [[0i64; 4]; 4];
                for (q, l) in lanes.iter_mut().enumerate() {
                    // SAFETY: l is 32 bytes.
                    unsafe { _mm256_storeu_si256(l.as_mut_ptr() as _, acc[r][q]) };
                }
                let ex = x.meta(rows[r]).exp_min;
                for c in 0..PANEL {
                    let col = panel * PANEL + c;
                    if col >= w.n() {
                        break;
                    }
                    // Lanes: [half 0 even, half 0 odd, half 1 even, half 1 odd], 4 columns each.
                    let (half, cc) = (c / 8, c % 8);
                    let sum = lanes[half * 2 + cc % 2][cc / 2];
                    sink.put_i64(rows[r], col, sum, ex + w.col_exp_min(col))?;
                }
            }
            Ok(())
        }
    };
}

tile_fn!(tile4, 4, [0, 1, 2, 3]);
tile_fn!(tile1, 1, [0]);
