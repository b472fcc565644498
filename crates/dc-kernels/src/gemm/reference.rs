//! The scalar reference kernel: the contract written out plainly, one output at a time.
//!
//! Every block's exact int32 dot product becomes a term `D · m_x · m_w · 2^(e_x + e_w)`
//! (`|D| < 2^19`, so the term is below 2^35); the terms are summed exactly by
//! [`exact_sum`], whatever their exponent span. Every other kernel is tested against this one.

use std::ops::Range;

use super::sink::Sink;
use crate::error::Result;
use crate::exact::{exact_sum, Exact};
use crate::pack::{PackedWeights, PANEL};
use crate::quant::QuantizedRows;

/// The exact value of output `(row, col)` of `x · w`.
pub fn exact_element(x: &QuantizedRows, row: usize, w: &PackedWeights, col: usize) -> Exact {
    let mut terms = Vec::with_capacity(x.blocks());
    element_terms(x, row, w, col, &mut terms);
    exact_sum(&terms)
}

/// The block terms of output `(row, col)`: `(D · m_x · m_w, e_x + e_w)` per block.
pub fn element_terms(
    x: &QuantizedRows,
    row: usize,
    w: &PackedWeights,
    col: usize,
    terms: &mut Vec<(i64, i32)>,
) {
    terms.clear();
    for b in 0..x.blocks() {
        let xq = x.block(row, b);
        let wq = w.column_block(col, b);
        let d: i32 = xq
            .iter()
            .zip(wq.iter())
            .map(|(&a, &c)| a as i32 * c as i32)
            .sum();
        let (sx, sw) = (x.scale(row, b), w.scale(col, b));
        terms.push((
            d as i64 * sx.m as i64 * sw.m as i64,
            sx.e as i32 + sw.e as i32,
        ));
    }
}

pub(crate) fn run(
    x: &QuantizedRows,
    w: &PackedWeights,
    panels: Range<usize>,
    sink: &Sink,
) -> Result<()> {
    let mut terms = Vec::with_capacity(x.blocks());
    for p in panels {
        for row in 0..x.rows() {
            for col in p * PANEL..((p + 1) * PANEL).min(w.n()) {
                element_terms(x, row, w, col, &mut terms);
                sink.put_exact(row, col, exact_sum(&terms))?;
            }
        }
    }
    Ok(())
}

/// Computes one panel's columns for one row with the reference path (the fallback of the fast
/// kernels when a row or panel's exponent span is too wide for 64 bits).
pub(crate) fn fallback(
    x: &QuantizedRows,
    row: usize,
    w: &PackedWeights,
    panel: usize,
    sink: &Sink,
) -> Result<()> {
    let mut terms = Vec::with_capacity(x.blocks());
    for col in panel * PANEL..((panel + 1) * PANEL).min(w.n()) {
        element_terms(x, row, w, col, &mut terms);
        sink.put_exact(row, col, exact_sum(&terms))?;
    }
    Ok(())
}
