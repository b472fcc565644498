//! The interface between a transformer block's glue (norms, RoPE, the MLP's activation, the
//! residual adds: `model.rs`) and its weight products, so that the same glue code runs on a
//! stage's weights (`compute.rs`) and on a stage's revealed rows under a check
//! (`verify/revealed.rs`), and a check recomputes exactly what the stage computed.

use dc_kernels::QuantizedRows;

use crate::error::Result;
use crate::trace::Point;

/// Where a block's products come from: run on the weights (a stage), or revealed by a stage
/// and checked (a spot check). The glue between them is the same code either way, so a check
/// recomputes exactly what the stage computed.
pub(crate) trait Products {
    /// `x · W (+ bias)` of the weight product at `point`, into `out`.
    fn linear(&mut self, point: Point, x: &QuantizedRows, out: &mut Vec<f32>) -> Result<()>;
    /// The attention context (`rows × q_width`) of rows at `start..` from their projections
    /// (RoPE applied), the keys and values going into the cache first.
    fn attention(&mut self, q: &[f32], k: &[f32], v: &[f32], start: usize) -> Result<Vec<f32>>;
    /// The rows the next product takes, quantised, from `derived` (what the glue made of the
    /// products before it): the attention context as the output projection takes it
    /// (`Point::Context`) or the MLP's hidden rows as the down projection does
    /// (`Point::Hidden`). A stage commits them; a check tests the derived rows against the
    /// commitment when it tested what made them, and otherwise hands on the committed rows.
    fn quantized(&mut self, point: Point, derived: QuantizedRows) -> Result<QuantizedRows>;
    /// Whether the rest of the block is still wanted (a check stops once it has tested every
    /// part it drew; a stage never stops).
    fn more(&self) -> bool {
        true
    }
    /// The position of row `row` of a block over rows from `start` (RoPE's angle): `start +
    /// row`, except where rows of several hops are stacked (`Stacked` in `compute.rs`).
    fn position(&self, start: usize, row: usize) -> usize {
        start + row
    }
    /// What `quantized(point, …)` would hand on, `rows × k`, when it is certain before the
    /// glue derives anything there: a check that tests nothing from the block's start (for
    /// `Point::Context`) or from the MLP's input (for `Point::Hidden`) up to `point` takes the
    /// committed rows, or a stand-in nothing tested reads. The glue then skips deriving them:
    /// on a check of the down projection alone, the MLP's activation of stand-in first
    /// products was a quarter of the work. A stage always derives.
    fn instead_of_deriving(
        &mut self,
        _point: Point,
        _rows: usize,
        _k: usize,
    ) -> Option<QuantizedRows> {
        None
    }
}
