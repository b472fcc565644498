//! The AVX-512 VNNI kernel: `vpdpbusd` over a tile of rows × one 16-column panel (one zmm of
//! i32 lanes), the same packed layout as AVX2, combined across blocks exactly in 64-bit lanes.
//!
//! Exactness argument, per block and column:
//! - the weights are negated where the activation is negative (masked byte subtract), and
//!   `vpdpbusd` multiplies `|x|` (≤ 127, unsigned) by them and adds groups of four into i32
//!   without saturation: the block's `|D| <= 32 · 127² < 2^19`;
//! - `vpmulld` by the column's `m_w` keeps `D · m_w < 2^27`;
//! - `vpmuldq` by the row's `m_x · 2^(e_x - e_min)` (< 2^31) and `vpsllvq` by the column's
//!   `e_w - e_min` give the exact block term in i64, and the bounds checked before the tile keep
//!   every partial sum below 2^63 (rows that fail take the exact fallback).

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx2::{fast_pair, finish_row, row_chunk};
use super::reference;
use super::sink::Sink;
use crate::error::Result;
use crate::pack::{PackedWeights, PANEL, RECORD, RECORD_Q};
use crate::quant::{QuantizedRows, BLOCK};

/// Rows per tile (AVX-512 has 32 vector registers).
const MR: usize = 8;

/// Whether this CPU can run the kernel.
pub(crate) fn supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
}

pub(crate) fn run(
    x: &QuantizedRows,
    w: &PackedWeights,
    panels: Range<usize>,
    sink: &Sink,
) -> Result<()> {
    assert!(supported(), "dispatch checked AVX-512 VNNI");
    // SAFETY: the features are present (checked above).
    unsafe { run_avx512(x, w, panels, sink) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn run_avx512(
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
                    // SAFETY: features present; rows in range and fast against this panel.
                    unsafe { tile8(x, &pending, w, p, sink)? };
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

// Written as a macro over literal row indices so the per-row accumulators stay in registers
// (see the AVX2 kernel for why a loop over rows is slow).
macro_rules! tile_fn {
    ($name:ident, $rows:literal, [$($r:literal),+]) => {
        /// One tile of rows × one panel, all blocks. Rows must be fast against the panel.
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
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
            let xa: [*const u8; $rows] = rows.map(|r| x.row_abs(r).as_ptr() as *const u8);
            let xm: [*const i32; $rows] = rows.map(|r| x.row_mult(r).as_ptr());
            let zero = _mm512_setzero_si512();
            let mut acc = [[zero; 2]; $rows];
            for b in 0..nb {
                // SAFETY (all pointer arithmetic below): `base` spans nb records of RECORD
                // bytes, the row pointers span nb · 32 bytes (nb for the multipliers), and every
                // offset stays inside those spans.
                let rec = unsafe { base.add(b * RECORD) };
                let mw = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(rec.add(RECORD_Q) as _) });
                let mut d = [zero; $rows];
                for kg in 0..BLOCK / 4 {
                    let wv = unsafe { _mm512_loadu_si512(rec.add(kg * 64) as _) };
                    let off = b * BLOCK + kg * 4;
                    $(
                        let xs = _mm512_set1_epi32(unsafe { (xq[$r].add(off) as *const i32).read_unaligned() });
                        let xb = _mm512_set1_epi32(unsafe { (xa[$r].add(off) as *const i32).read_unaligned() });
                        let neg = _mm512_movepi8_mask(xs);
                        let ws = _mm512_mask_sub_epi8(wv, neg, zero, wv);
                        d[$r] = _mm512_dpbusd_epi32(d[$r], xb, ws);
                    )+
                }
                let sh = unsafe { rec.add(RECORD_Q + PANEL) };
                let se = _mm512_cvtepu8_epi64(unsafe { _mm_loadl_epi64(sh as _) });
                let so = _mm512_cvtepu8_epi64(unsafe { _mm_loadl_epi64(sh.add(8) as _) });
                $(
                    let dm = _mm512_mullo_epi32(d[$r], mw);
                    let rm = _mm512_set1_epi64(unsafe { *xm[$r].add(b) } as i64);
                    let te = _mm512_sllv_epi64(_mm512_mul_epi32(dm, rm), se);
                    let to = _mm512_sllv_epi64(_mm512_mul_epi32(_mm512_srli_epi64::<32>(dm), rm), so);
                    acc[$r][0] = _mm512_add_epi64(acc[$r][0], te);
                    acc[$r][1] = _mm512_add_epi64(acc[$r][1], to);
                )+
            }
            for r in 0..$rows {
                // The AVX2 epilogue's lane order: columns [0,2,4,6], [1,3,5,7], [8,..,14],
                // [9,..,15] (the even columns' sums are `acc[r][0]`, the odd ones' `acc[r][1]`).
                let (even, odd) = (acc[r][0], acc[r][1]);
                let lanes = [
                    _mm512_castsi512_si256(even),
                    _mm512_castsi512_si256(odd),
                    _mm512_extracti64x4_epi64::<1>(even),
                    _mm512_extracti64x4_epi64::<1>(odd),
                ];
                let ex = x.meta(rows[r]).exp_min;
                // SAFETY: AVX-512F implies AVX2.
                unsafe { finish_row(sink, rows[r], w, panel, ex, lanes)? };
            }
            Ok(())
        }
    };
}

tile_fn!(tile8, 8, [0, 1, 2, 3, 4, 5, 6, 7]);
tile_fn!(tile1, 1, [0]);
