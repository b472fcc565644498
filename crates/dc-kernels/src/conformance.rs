//! The conformance sweep: every kernel against the scalar reference, bit for bit, on
//! deterministic adversarial GEMMs (odd shapes, huge exponent spans, zero blocks, ties,
//! subnormals, overflow). Used by `dcd selftest` before a daemon serves anything, and by tests.

use crate::gemm::{Gemm, Kernel};
use crate::pack::{PackedWeights, WeightLayout};
use crate::quant::{quantize_block, quantize_element_reference, QuantizedRows, BLOCK};
use crate::rng::SplitMix64;

/// How a random matrix's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    /// Roughly normal values.
    Normal,
    /// Every block scaled by its own power of two in ±`span`/2: exercises the wide paths.
    Span(i32),
    /// A third of the blocks all zero, the rest normal.
    ZeroBlocks,
    /// Small integers and halves: many exact ties.
    Ties,
    /// Subnormal and tiny values.
    Tiny,
    /// Values near the top of the f32 range (products overflow).
    Huge,
}

/// A random `rows × k` matrix in the given style.
pub fn matrix(rng: &mut SplitMix64, rows: usize, k: usize, style: Style) -> Vec<f32> {
    let mut v = Vec::with_capacity(rows * k);
    for _ in 0..rows {
        let mut block_scale = 1f32;
        let mut zero = false;
        for i in 0..k {
            if i % BLOCK == 0 {
                zero = style == Style::ZeroBlocks && rng.below(3) == 0;
                block_scale = match style {
                    Style::Span(s) => {
                        let e = rng.below(s as u64 + 1) as i32 - s / 2;
                        2f32.powi(e)
                    }
                    _ => 1.0,
                };
            }
            let x = match style {
                _ if zero => 0.0,
                Style::Normal | Style::ZeroBlocks => rng.normal(),
                Style::Span(_) => rng.normal() * block_scale,
                Style::Ties => (rng.below(61) as f32 - 30.0) * 0.5,
                Style::Tiny => {
                    f32::from_bits(rng.below(1 << 23) as u32)
                        * if rng.below(2) == 0 { 1.0 } else { -1.0 }
                }
                Style::Huge => rng.normal() * 1e36,
            };
            v.push(x);
        }
    }
    v
}

/// What a sweep checked and what differed.
#[derive(Clone, Debug, Default)]
pub struct ConformanceReport {
    /// Products compared.
    pub gemms: usize,
    /// Output elements compared (per kernel and thread count).
    pub elements: usize,
    /// Quantised elements compared against the exact-integer reference quantiser.
    pub quantised: usize,
    /// One line per difference.
    pub failures: Vec<String>,
}

/// An `(m, k, n)` product shape.
pub type Shape = (usize, usize, usize);

/// The shapes of the sweep: m = 1 and more, k around block boundaries, n around panels.
pub const SHAPES: [Shape; 10] = [
    (1, 1, 1),
    (1, 33, 17),
    (1, 95, 31),
    (2, 64, 16),
    (3, 31, 5),
    (4, 96, 33),
    (5, 160, 49),
    (7, 300, 17),
    (9, 129, 65),
    (13, 257, 35),
];

/// Styles of the sweep, x style and w style.
pub const STYLES: [(Style, Style); 8] = [
    (Style::Normal, Style::Normal),
    (Style::Span(16), Style::Normal),
    (Style::Span(60), Style::Normal),
    (Style::Normal, Style::Span(80)),
    (Style::Span(240), Style::Span(200)),
    (Style::ZeroBlocks, Style::ZeroBlocks),
    (Style::Ties, Style::Ties),
    (Style::Tiny, Style::Normal),
];

/// Compares every kernel in `kernels` at every thread count in `threads` against the scalar
/// reference (one thread) on the sweep, and the fast quantiser against the exact one.
pub fn sweep(kernels: &[Kernel], threads: &[usize], seed: u64) -> ConformanceReport {
    let mut rep = ConformanceReport::default();
    let mut rng = SplitMix64::new(seed);
    let reference = match Gemm::new(Kernel::Scalar, 1) {
        Ok(g) => g,
        Err(e) => {
            rep.failures.push(format!("reference kernel: {e}"));
            return rep;
        }
    };
    let mut cases: Vec<(Shape, (Style, Style))> = Vec::new();
    for (i, &shape) in SHAPES.iter().enumerate() {
        for (j, &style) in STYLES.iter().enumerate() {
            if (i + j) % 2 == 0 || shape.0 == 1 {
                cases.push((shape, style));
            }
        }
    }
    cases.push(((3, 64, 20), (Style::Huge, Style::Huge)));
    for ((m, k, n), (sx, sw)) in cases {
        let x = matrix(&mut rng, m, k, sx);
        let w = matrix(&mut rng, n, k, sw);
        check_quantiser(&x, k, &mut rep);
        let (Ok(qx), Ok(qw)) = (
            QuantizedRows::quantize(&x, m, k, "x"),
            PackedWeights::quantize(&w, k, n, WeightLayout::NByK, "w"),
        ) else {
            rep.failures
                .push(format!("{m}×{k}×{n} {sx:?}/{sw:?}: quantisation failed"));
            continue;
        };
        check_rows(&x, k, &qx, &mut rep);
        let mut want = vec![0f32; m * n];
        let want_acc = reference.matmul_exact(&qx, &qw, &mut want);
        rep.gemms += 1;
        for &kernel in kernels {
            for &t in threads {
                let Ok(g) = Gemm::new(kernel, t) else {
                    rep.failures.push(format!("{kernel}×{t}: cannot start"));
                    continue;
                };
                let mut got = vec![0f32; m * n];
                let got_acc = g.matmul_exact(&qx, &qw, &mut got);
                rep.elements += m * n;
                let what = format!("{kernel}×{t} on {m}×{k}×{n} {sx:?}/{sw:?}");
                // Without exact accumulators a kernel may round in its own code: same bits.
                let mut plain = vec![0f32; m * n];
                let plain_res = g.matmul(&qx, &qw, &mut plain);
                match (&want_acc, &plain_res) {
                    (Ok(_), Ok(())) => {
                        if let Some(i) =
                            (0..m * n).find(|&i| want[i].to_bits() != plain[i].to_bits())
                        {
                            rep.failures.push(format!(
                                "{what} (matmul): y[{}, {}] = {:e}, reference {:e}",
                                i / n,
                                i % n,
                                plain[i],
                                want[i]
                            ));
                        }
                    }
                    (Err(a), Err(b)) if a == b => {}
                    (a, b) => rep
                        .failures
                        .push(format!("{what} (matmul): {b:?}, reference {a:?}")),
                }
                match (&want_acc, &got_acc) {
                    (Ok(a), Ok(b)) => {
                        if a != b {
                            rep.failures.push(format!("{what}: accumulators differ"));
                        }
                        if let Some(i) = (0..m * n).find(|&i| want[i].to_bits() != got[i].to_bits())
                        {
                            rep.failures.push(format!(
                                "{what}: y[{}, {}] = {:e}, reference {:e}",
                                i / n,
                                i % n,
                                got[i],
                                want[i]
                            ));
                        }
                    }
                    (Err(a), Err(b)) if a == b => {}
                    (a, b) => rep.failures.push(format!("{what}: {b:?}, reference {a:?}")),
                }
            }
        }
    }
    rep
}

/// The row quantiser (`QuantizedRows::quantize`, SIMD where available) against the block
/// quantiser's scales and the exact-integer element reference.
fn check_rows(x: &[f32], k: usize, qx: &QuantizedRows, rep: &mut ConformanceReport) {
    for (r, row) in x.chunks(k.max(1)).enumerate() {
        for (b, vals) in row.chunks(BLOCK).enumerate() {
            let mut q = [0i8; BLOCK];
            let s = quantize_block(vals, &mut q);
            if qx.scale(r, b) != s {
                rep.failures.push(format!(
                    "row quantiser: row {r} block {b} has scale {:?}, expected {s:?}",
                    qx.scale(r, b)
                ));
            }
            for (t, &v) in vals.iter().enumerate() {
                rep.quantised += 1;
                let want = quantize_element_reference(v, s);
                if qx.block(r, b)[t] != want {
                    rep.failures.push(format!(
                        "row quantiser: {v:e} with {s:?} gives {}, reference {want}",
                        qx.block(r, b)[t]
                    ));
                }
            }
        }
    }
}

fn check_quantiser(x: &[f32], k: usize, rep: &mut ConformanceReport) {
    for row in x.chunks(k) {
        for vals in row.chunks(BLOCK) {
            let mut q = [0i8; BLOCK];
            let s = quantize_block(vals, &mut q);
            for (t, &v) in vals.iter().enumerate() {
                rep.quantised += 1;
                let r = quantize_element_reference(v, s);
                if r != q[t] {
                    rep.failures.push(format!(
                        "quantiser: {v:e} with {s:?} gives {}, reference {r}",
                        q[t]
                    ));
                }
            }
        }
    }
}
