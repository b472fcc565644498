//! The AVX-512 VNNI kernel: `vpdpbusd` over a tile of rows × one 16-column panel (one zmm of
//! i32 lanes), the same packed layout as AVX2, combined across blocks exactly in 64-bit lanes.
//!
//! Exactness argument, per block and column:
//! - `vpdpbusd` multiplies unsigned bytes by signed ones and adds groups of four into i32. In
//!   a tile of rows the weights go in as the unsigned `w + 128` (one `vpxord` with 0x80, shared
//!   by the tile's rows) and the activations as they are, so the sum is `D + 128 · Σ x`; it
//!   starts at the row's `−128 · Σ x` for the block (`QuantizedRows::row_offset_sums`) and ends
//!   at `D`. Every partial sum is below `128 · 32 · 127 + 32 · 255 · 127 < 2^21`. A single row
//!   (decode) instead negates the weights where the activation is negative and multiplies `|x|`
//!   by them. Either way nothing saturates or wraps, and `|D| <= 32 · 127² < 2^19`;
//! - `vpmulld` by the column's `m_w` keeps `D · m_w < 2^27`;
//! - `vpmuldq` by the row's `m_x · 2^(e_x - e_min)` (< 2^31) and `vpsllvq` by the column's
//!   `e_w - e_min` give the exact block term in i64, and the bounds checked before the tile keep
//!   every partial sum below 2^63 (rows that fail take the exact fallback).
//!
//! Why the tiles take that form: their inner loop is one broadcast load and one `vpdpbusd` per
//! row and group of four, where the sign form needs a sign mask and a masked subtract per row
//! as well; what is left per block is the exact combination (8 vector instructions per row and
//! block against 8 `vpdpbusd`), which is what bounds the kernel at prefill shapes.
//!
//! The IFMA variant ([`Kernel::Avx512Ifma`](super::Kernel::Avx512Ifma)) combines a tile more
//! cheaply when its sums are narrow: when every row's bound times the panel's is below 2^51
//! (checked per tile), each column's sum `S` satisfies `|S| < 2^51`. The tile then forms
//! `D · rm` exactly with `vpmuldq` (`< 2^50`), and `vpmadd52luq` adds the low 52 bits of its
//! product with the column's `m_w · 2^shift` (`< 2^48`, shifts being at most
//! `COL_SPAN_FAST`) to a 64-bit lane. Two's complement makes every step exact modulo 2^52, so
//! the lane holds `S mod 2^52`, and as `|S| < 2^51` sign-extending its low 52 bits gives `S`.
//! That is 5 instructions per row and block where the i64 form takes 8 (and its `vpmulld` is
//! two micro-operations on Intel cores): about 10–25 % more prefill on a 1B Llama and 6–12 %
//! on Qwen2.5-1.5B (Intel Xeon, `dcd bench model`, the two kernels in alternation). Tiles that
//! are not narrow take the i64 form; decode rows keep the sign form.

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx2::{fast_pair, finish_row, row_chunk};
use super::reference;
use super::sink::Sink;
use crate::error::Result;
use crate::pack::{PackedWeights, PANEL, RECORD, RECORD_Q};
use crate::quant::{QuantizedRows, BLOCK};

/// Rows per tile. Measured against 5, 6 and 8 (`dcd bench gemm`, prefill shapes, AMD EPYC
/// with AVX-512): 4 is as fast or faster, because past it the 2 × rows i64 accumulators, the
/// block sums and the epilogue's operands no longer fit the 32 registers and spill.
const MR: usize = 4;

/// How far ahead (bytes) the one-row path prefetches the panel it streams: sixteen records,
/// about two 4 KiB pages, so the stream runs on past the page boundaries where the hardware
/// prefetcher stops. Measured on an Intel Xeon (Emerald Rapids) with `dcd bench gemm` and
/// `dcd bench model` at decode: 1.15–1.3× the weight bandwidth of no prefetch with 1 and 2
/// threads; four to thirty-two records are alike within the noise, two are clearly worse.
const PREFETCH: usize = 16 * RECORD;

/// Whether this CPU can run the kernel.
pub(crate) fn supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
}

/// Runs the kernel; with `ifma`, tiles whose sums stay narrow ([`narrow_tile`]) are combined
/// by IFMA (the caller checked the CPU has it).
pub(crate) fn run(
    x: &QuantizedRows,
    w: &PackedWeights,
    panels: Range<usize>,
    sink: &Sink,
    ifma: bool,
) -> Result<()> {
    assert!(supported(), "dispatch checked AVX-512 VNNI");
    assert!(
        !ifma || is_x86_feature_detected!("avx512ifma"),
        "dispatch checked IFMA"
    );
    // SAFETY: the features are present (checked above).
    unsafe { run_avx512(x, w, panels, sink, ifma) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn run_avx512(
    x: &QuantizedRows,
    w: &PackedWeights,
    panels: Range<usize>,
    sink: &Sink,
    ifma: bool,
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
                    if ifma && narrow_tile(x, &pending, w, p) {
                        // SAFETY: features present (IFMA checked by `run`); rows in range and
                        // narrow against this panel.
                        unsafe { tile4_ifma(x, &pending, w, p, sink)? };
                    } else {
                        // SAFETY: features present; rows in range and fast against this panel.
                        unsafe { tile4(x, &pending, w, p, sink)? };
                    }
                    n = 0;
                }
            }
            for &row in &pending[..n] {
                // SAFETY: as above.
                unsafe { row1(x, row, w, p, sink)? };
            }
        }
        r0 = r1;
    }
    Ok(())
}

// Written as a macro over literal row indices so the per-row accumulators stay in registers
// (see the AVX2 kernel for why a loop over rows is slow). `$form` is how a block's sums are
// combined: `i64` ([`add_block_term`]) or `ifma` (modulo 2^52, for narrow tiles).
macro_rules! tile_fn {
    ($name:ident, $features:literal, $form:ident, $rows:literal, [$($r:literal),+]) => {
        /// One tile of rows × one panel, all blocks. Rows must be fast against the panel (and
        /// narrow, [`narrow_tile`], for the IFMA form).
        #[target_feature(enable = $features)]
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
            let xo: [*const i32; $rows] = rows.map(|r| x.row_offset_sums(r).as_ptr());
            let xm: [*const i32; $rows] = rows.map(|r| x.row_mult(r).as_ptr());
            let zero = _mm512_setzero_si512();
            let to_unsigned = _mm512_set1_epi8(i8::MIN);
            let mut acc = [[zero; 2]; $rows];
            for b in 0..nb {
                // SAFETY (all pointer arithmetic below): `base` spans nb records of RECORD
                // bytes, the row pointers span nb · 32 bytes (nb for the multipliers), and every
                // offset stays inside those spans.
                let rec = unsafe { base.add(b * RECORD) };
                let mut d = [zero; $rows];
                $( d[$r] = _mm512_set1_epi32(unsafe { *xo[$r].add(b) }); )+
                for kg in 0..BLOCK / 4 {
                    let wv = unsafe { _mm512_loadu_si512(rec.add(kg * 64) as _) };
                    let wu = _mm512_xor_si512(wv, to_unsigned);
                    let off = b * BLOCK + kg * 4;
                    $(
                        let xs = _mm512_set1_epi32(unsafe { (xq[$r].add(off) as *const i32).read_unaligned() });
                        d[$r] = _mm512_dpbusd_epi32(d[$r], wu, xs);
                    )+
                }
                tile_fn!(@combine $form, acc, d, rec, xm, b, [$($r),+]);
            }
            for r in 0..$rows {
                let a = tile_fn!(@sums $form, acc[r]);
                // SAFETY: features present; the row is in range.
                unsafe { finish(sink, x, rows[r], w, panel, a)? };
            }
            Ok(())
        }
    };
    (@combine i64, $acc:ident, $d:ident, $rec:ident, $xm:ident, $b:ident, [$($r:literal),+]) => {
        let mw = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128($rec.add(RECORD_Q) as _) });
        // SAFETY: `rec` is the block's whole record.
        $( unsafe { add_block_term(&mut $acc[$r], $d[$r], mw, *$xm[$r].add($b), $rec) }; )+
    };
    (@combine ifma, $acc:ident, $d:ident, $rec:ident, $xm:ident, $b:ident, [$($r:literal),+]) => {
        // The columns' m_w · 2^shift, even and odd columns as 64-bit lanes (< 2^48); the
        // shifts' bytes are laid out even columns first (see `pack.rs`).
        let mw = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128($rec.add(RECORD_Q) as _) });
        let sh = unsafe { $rec.add(RECORD_Q + PANEL) };
        let se = _mm512_cvtepu8_epi64(unsafe { _mm_loadl_epi64(sh as _) });
        let so = _mm512_cvtepu8_epi64(unsafe { _mm_loadl_epi64(sh.add(8) as _) });
        let low = _mm512_set1_epi64(0xffff_ffff);
        let ce = _mm512_sllv_epi64(_mm512_and_si512(mw, low), se);
        let co = _mm512_sllv_epi64(_mm512_srli_epi64::<32>(mw), so);
        $(
            // (`vpmuldq` reads the low half of each 64-bit lane: a 32-bit broadcast from
            // memory serves, one load where a 64-bit one costs a shuffle.)
            let rm = _mm512_set1_epi32(unsafe { *$xm[$r].add($b) });
            let te = _mm512_mul_epi32($d[$r], rm);
            let to = _mm512_mul_epi32(_mm512_srli_epi64::<32>($d[$r]), rm);
            $acc[$r][0] = _mm512_madd52lo_epu64($acc[$r][0], te, ce);
            $acc[$r][1] = _mm512_madd52lo_epu64($acc[$r][1], to, co);
        )+
    };
    (@sums i64, $a:expr) => {
        $a
    };
    // The sums modulo 2^52, sign-extended: exact, as each is below 2^51 in magnitude.
    (@sums ifma, $a:expr) => {
        $a.map(|v| _mm512_srai_epi64::<12>(_mm512_slli_epi64::<12>(v)))
    };
}

tile_fn!(tile4, "avx512f,avx512bw,avx512vnni", i64, 4, [0, 1, 2, 3]);
tile_fn!(
    tile4_ifma,
    "avx512f,avx512bw,avx512vnni,avx512ifma",
    ifma,
    4,
    [0, 1, 2, 3]
);

/// Whether every row of the tile, against the panel, sums below 2^51 in magnitude at every
/// step: then the IFMA tile's sums, kept modulo 2^52, are exact.
fn narrow_tile(x: &QuantizedRows, rows: &[usize; MR], w: &PackedWeights, panel: usize) -> bool {
    let pb = w.panel_meta(panel).bound as u128;
    rows.iter()
        .all(|&r| (x.meta(r).bound as u128) * pb < (1u128 << 51))
}

/// One row × one panel, all blocks: the decode shape, where each panel streams from memory
/// once. Here the weights stay signed and take the activation's sign (a sign mask and a masked
/// byte subtract, `vpdpbusd` of `|x|` by them): with one row nothing shares the weights' offset
/// to unsigned, and this form measured faster on decode (`perf` samples of the kernel on
/// SmolLM2 decode, AMD EPYC with AVX-512: about 10 % fewer than the tiles' form; on an Intel
/// Xeon the two are alike within the noise). It prefetches [`PREFETCH`] bytes ahead; the tiles
/// do not, as each tile of rows reads its panel from the cache (measured: no gain at prefill
/// shapes).
///
/// # Safety
/// The features must be present; the row must be in range and fast against the panel.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn row1(
    x: &QuantizedRows,
    row: usize,
    w: &PackedWeights,
    panel: usize,
    sink: &Sink,
) -> Result<()> {
    let nb = w.blocks();
    let base = w.data()[panel * nb * RECORD..(panel + 1) * nb * RECORD].as_ptr();
    let xq = x.row_q(row);
    let xm = x.row_mult(row);
    let zero = _mm512_setzero_si512();
    let mut acc = [zero; 2];
    for b in 0..nb {
        // SAFETY (pointer arithmetic): `base` spans nb records of RECORD bytes, the row nb · 32
        // elements, and every offset stays inside those spans.
        let rec = unsafe { base.add(b * RECORD) };
        // Prefetches never fault, so reading past the panel's end (into the next panel or
        // past the buffer) is harmless; `wrapping_add` keeps the pointer arithmetic defined.
        for line in 0..RECORD.div_ceil(64) {
            _mm_prefetch::<_MM_HINT_T0>(rec.wrapping_add(PREFETCH + line * 64) as *const i8);
        }
        let mut d = zero;
        for kg in 0..BLOCK / 4 {
            let wv = unsafe { _mm512_loadu_si512(rec.add(kg * 64) as _) };
            let at = b * BLOCK + kg * 4;
            let xs =
                _mm512_set1_epi32(unsafe { (xq.as_ptr().add(at) as *const i32).read_unaligned() });
            let xb = _mm512_abs_epi8(xs);
            let neg = _mm512_movepi8_mask(xs);
            let ws = _mm512_mask_sub_epi8(wv, neg, zero, wv);
            d = _mm512_dpbusd_epi32(d, xb, ws);
        }
        let mw = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(rec.add(RECORD_Q) as _) });
        // SAFETY: `rec` is the block's whole record.
        unsafe { add_block_term(&mut acc, d, mw, xm[b], rec) };
    }
    // SAFETY: features present; the row is in range.
    unsafe { finish(sink, x, row, w, panel, acc) }
}

/// Adds one block's exact term to a row's accumulators (the even columns' i64 sums, then the
/// odd ones'): `D · m_w` by the row's multiplier `rm`, shifted by each column's shift, both
/// read from the block's record `rec`.
///
/// # Safety
/// The features must be present and `rec` point at a whole record.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn add_block_term(acc: &mut [__m512i; 2], d: __m512i, mw: __m512i, rm: i32, rec: *const u8) {
    // SAFETY: `rec` is a whole record; its shifts are the 16 bytes after the 16 mantissas.
    let sh = unsafe { rec.add(RECORD_Q + PANEL) };
    let se = _mm512_cvtepu8_epi64(unsafe { _mm_loadl_epi64(sh as _) });
    let so = _mm512_cvtepu8_epi64(unsafe { _mm_loadl_epi64(sh.add(8) as _) });
    let dm = _mm512_mullo_epi32(d, mw);
    // (`vpmuldq` reads the low half of each 64-bit lane: a 32-bit broadcast serves.)
    let rm = _mm512_set1_epi32(rm);
    let te = _mm512_sllv_epi64(_mm512_mul_epi32(dm, rm), se);
    let to = _mm512_sllv_epi64(_mm512_mul_epi32(_mm512_srli_epi64::<32>(dm), rm), so);
    acc[0] = _mm512_add_epi64(acc[0], te);
    acc[1] = _mm512_add_epi64(acc[1], to);
}

/// Rounds and stores a row's sums against a panel, in the AVX2 epilogue's lane order: columns
/// [0,2,4,6], [1,3,5,7], [8,..,14], [9,..,15] (`acc[0]` holds the even columns, `acc[1]` the
/// odd ones).
///
/// # Safety
/// The features must be present and `row` be in range.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn finish(
    sink: &Sink,
    x: &QuantizedRows,
    row: usize,
    w: &PackedWeights,
    panel: usize,
    acc: [__m512i; 2],
) -> Result<()> {
    let [even, odd] = acc;
    let lanes = [
        _mm512_castsi512_si256(even),
        _mm512_castsi512_si256(odd),
        _mm512_extracti64x4_epi64::<1>(even),
        _mm512_extracti64x4_epi64::<1>(odd),
    ];
    // SAFETY: AVX-512F implies AVX2.
    unsafe { finish_row(sink, row, w, panel, x.meta(row).exp_min, lanes) }
}
