//! The checker's side of the glue a stage runs between its products ([`Products`]): each
//! product's row is the revealed one, tested by Freivalds; the attention is recomputed on the
//! revealed cache; the rows the tested products make must open their commitments.

use dc_kernels::verify::commit::quantized_row_leaf;
use dc_kernels::verify::reveal::Opening;
use dc_kernels::{BlockScale, QuantizedRows, BLOCK};
use dc_types::{CheckSet, Point};

use super::checker::LayerChecker;
use crate::attention::{attend, cache_row_leaf, AttentionShape, LayerCache};
use crate::error::{ModelError, Result};
use crate::products::Products;
use crate::weights::add_bias;

/// The checker's products: revealed rows, each weight product tested by Freivalds; the
/// attention recomputed on the revealed cache; the MLP's hidden row made of its tested first
/// products and compared with the committed one.
pub(super) struct Revealed<'a, 'c> {
    pub(super) checker: &'a LayerChecker,
    /// What is tested ([`tested_parts`] of the drawn parts, and the hidden row with the first
    /// products); a product outside it is only supplied (from its revealed row when some
    /// tested part needs it, as zeros otherwise: nothing tested depends on those).
    pub(super) tests: CheckSet,
    /// The checked row's position.
    pub(super) position: usize,
    pub(super) values: Vec<RevealedValues>,
    /// The MLP's hidden row, when the check needs it.
    pub(super) hidden: Option<CommittedRow<'a>>,
    /// The opening of the checked position's cache row, when k and v are tested without the
    /// attention (with it, `cache_row` is that row, verified against the commitments).
    pub(super) kv_row: Option<Opening<'a>>,
    /// The revealed cache of the positions before the checked one.
    pub(super) cache: &'c mut LayerCache,
    /// The revealed cache row of the checked position.
    pub(super) cache_row: &'a [u8],
    pub(super) shape: AttentionShape,
    /// The context row, when the check needs it: its opening when the attention is recomputed
    /// (the quantised row it makes must open it), the row itself as the output projection's
    /// input otherwise.
    pub(super) context: Option<CommittedRow<'a>>,
    /// The drawn parts tested so far: once every one is (and the output is not drawn),
    /// nothing the rest of the block computes is needed.
    pub(super) tested: CheckSet,
}

/// A committed quantised row a check needs (the attention context, the MLP's hidden row): its
/// opening, to test the row that what it tested makes, or the row itself (opened), as the next
/// product's input.
pub(super) enum CommittedRow<'a> {
    Opening(Opening<'a>),
    Revealed(QuantizedRows),
}

/// A revealed row of a product the check needs, opened against the commitment: its values
/// rounded as the stage's epilogue rounded them and, when the product is tested, its side of
/// Freivalds' test.
pub(super) struct RevealedValues {
    pub(super) point: Point,
    pub(super) rounded: Vec<f32>,
    /// `C_row · r`, computed from the exact values as they travelled.
    pub(super) output_side: Option<u64>,
}

impl Revealed<'_, '_> {
    /// The revealed row of `point`, if revealed.
    fn row(&self, point: Point) -> Option<&RevealedValues> {
        self.values.iter().find(|v| v.point == point)
    }
}

impl Products for Revealed<'_, '_> {
    fn linear(&mut self, point: Point, x: &QuantizedRows, out: &mut Vec<f32>) -> Result<()> {
        let layer = self.checker.layer;
        let (key, bias) = self
            .checker
            .key(point)
            .ok_or_else(|| ModelError::Input(format!("layer {layer} has no {point:?} product")))?;
        out.clear();
        let tested = match self.tests.contains(point) {
            true => self.tested.with(point),
            false => self.tested,
        };
        let needed_after = !self.tests.difference(tested).is_empty();
        let Some(row) = self.row(point) else {
            if self.tests.contains(point) {
                return Err(ModelError::Input(format!(
                    "layer {layer}: no {point:?} row"
                )));
            }
            // Not needed by anything tested: a stand-in.
            out.resize(key.cols(), 0.0);
            return Ok(());
        };
        let holds = |side: Option<u64>| side.is_some_and(|side| key.holds(x, 0, side));
        if self.tests.contains(point) && !holds(row.output_side) {
            return Err(ModelError::Input(format!(
                "layer {layer}: the {point:?} row is not its input times the weights \
                 (Freivalds' test)"
            )));
        }
        // Once every drawn part is tested nothing depends on this output: a stand-in.
        match needed_after {
            true => {
                out.extend_from_slice(&row.rounded);
                add_bias(bias, out);
            }
            false => out.resize(key.cols(), 0.0),
        }
        self.tested = tested;
        Ok(())
    }

    fn quantized(&mut self, point: Point, derived: QuantizedRows) -> Result<QuantizedRows> {
        let layer = self.checker.layer;
        let (row, made_of, tested) = match point {
            Point::Context => (
                self.context.take(),
                "recomputed from the revealed cache",
                // The scores commit through the context they make: both are tested by it.
                CheckSet::of(&[Point::Scores, Point::Context]),
            ),
            _ => (
                self.hidden.take(),
                "what its first products give",
                CheckSet::of(&[Point::Hidden]),
            ),
        };
        match row {
            Some(CommittedRow::Opening(opening)) => {
                let mut bytes = Vec::new();
                derived.encode_row(0, &mut bytes);
                let leaf = quantized_row_leaf(self.position, derived.k(), &bytes);
                if derived.rows() != 1 || !opening.holds_for(&leaf) {
                    return Err(ModelError::Input(format!(
                        "layer {layer}: the {point:?} row at position {} is not {made_of}",
                        self.position
                    )));
                }
                self.tested = self.tested.union(tested);
                Ok(derived)
            }
            Some(CommittedRow::Revealed(row)) => Ok(row),
            None => Ok(derived),
        }
    }

    fn more(&self) -> bool {
        // The output is tested after the block, so a check drawing it never stops early.
        !self.tests.difference(self.tested).is_empty()
    }

    fn instead_of_deriving(
        &mut self,
        point: Point,
        rows: usize,
        k: usize,
    ) -> Option<QuantizedRows> {
        use Point::*;
        let (derives, row) = match point {
            Context => (
                CheckSet::of(&[Q, K, V, KvCache, Scores, Context]),
                &mut self.context,
            ),
            _ => (CheckSet::of(&[Gate, Up, Fc, Hidden]), &mut self.hidden),
        };
        if !self.tests.intersection(derives).is_empty() {
            return None;
        }
        match row.take() {
            // Nothing derived here is tested: the committed rows go to the next product.
            Some(CommittedRow::Revealed(committed)) => Some(committed),
            // Nor does anything tested read them (the next product is not tested): a stand-in.
            None => {
                let blocks = rows * k.div_ceil(BLOCK);
                let zeros = vec![0; blocks * BLOCK];
                let scales = vec![BlockScale::for_amax(0.0); blocks];
                Some(QuantizedRows::from_parts(rows, k, zeros, scales))
            }
            // An opening is there only to test what the glue derives.
            opening => {
                *row = opening;
                None
            }
        }
    }

    fn attention(&mut self, q: &[f32], k: &[f32], v: &[f32], start: usize) -> Result<Vec<f32>> {
        let layer = self.checker.layer;
        if self.tests.contains(Point::KvCache) {
            // The tested k and v must make the committed cache row: the revealed one, verified
            // against the hops' commitments, when the attention is recomputed; otherwise the
            // one the opening names.
            let mut one = LayerCache::new(self.shape.kv_heads, self.shape.head_dim);
            one.append(k, v)?;
            let mut mine = Vec::with_capacity(one.row_bytes());
            one.encode_row(0, &mut mine);
            let committed = match (self.tests.attention(), &self.kv_row) {
                (true, _) => mine == self.cache_row,
                (false, Some(o)) => o.holds_for(&cache_row_leaf(start, &mine)),
                (false, None) => false,
            };
            if !committed {
                return Err(ModelError::Input(format!(
                    "layer {layer}: the cache row at position {start} is not the row's keys \
                     and values"
                )));
            }
            self.tested = self.tested.with(Point::KvCache);
        }
        let mut ctx = vec![0f32; q.len()];
        if !self.tests.attention() {
            // A stand-in: the output projection, if tested, takes the committed context row
            // (`quantized`), and nothing else depends on it.
            return Ok(ctx);
        }
        // The row's own keys and values as committed (k and v have no commitment of their own).
        self.cache.extend_encoded(self.cache_row)?;
        attend(self.shape, self.cache, q, start, &mut ctx, layer)?;
        Ok(ctx)
    }
}
