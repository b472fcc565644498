//! Activations crossing a stage boundary: the one value that travels between stages, with its
//! canonical commitment. A plain value type below the forward pass, so the pass, what a stage
//! keeps for reveals and the checker all use it without importing one another.

use std::ops::Range;

use dc_kernels::verify::commit::activations_commitment;
use dc_kernels::Commitment;

use crate::error::{ModelError, Result};

/// Activations crossing a stage boundary: `rows` consecutive positions starting at `start`,
/// each a `hidden`-wide f32 row.
#[derive(Clone, Debug, PartialEq)]
pub struct Activations {
    /// Absolute position of the first row.
    pub start: usize,
    /// Width of a row.
    pub hidden: usize,
    /// Row-major values, `rows × hidden`.
    pub data: Vec<f32>,
}

impl Activations {
    /// Number of rows (positions).
    pub fn rows(&self) -> usize {
        self.data.len() / self.hidden.max(1)
    }

    /// The positions covered.
    pub fn positions(&self) -> Range<usize> {
        self.start..self.start + self.rows()
    }

    /// The last row.
    pub fn last_row(&self) -> Activations {
        let r = self.rows();
        Activations {
            start: self.start + r - 1,
            hidden: self.hidden,
            data: self.data[(r - 1) * self.hidden..].to_vec(),
        }
    }

    /// The rows at positions `from..` (all rows if `from` is before the first).
    pub fn rows_from(&self, from: usize) -> Activations {
        let skip = from.saturating_sub(self.start).min(self.rows());
        Activations {
            start: self.start + skip,
            hidden: self.hidden,
            data: self.data[skip * self.hidden..].to_vec(),
        }
    }

    /// Canonical commitment to the activations (position, width, little-endian f32 bytes).
    pub fn commitment(&self) -> Commitment {
        activations_commitment(self.start, self.hidden, &self.data)
    }

    /// Refuses NaN and infinities, naming where they are.
    pub fn check_finite(&self, stage: &str, layer: &str) -> Result<()> {
        if let Some(i) = self.data.iter().position(|v| !v.is_finite()) {
            return Err(ModelError::NonFinite {
                stage: stage.into(),
                layer: layer.into(),
                detail: format!(
                    "value {} at position {}, channel {}",
                    self.data[i],
                    self.start + i / self.hidden,
                    i % self.hidden
                ),
            });
        }
        Ok(())
    }
}
