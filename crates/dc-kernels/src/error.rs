//! Typed errors of the kernel crate. Every error names the offending tensor, position or shape,
//! so a caller can report exactly what was wrong without re-deriving it.

use thiserror::Error;

/// Everything that can go wrong in quantisation, the exact product or the elementwise maths.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum KernelError {
    /// A NaN or infinity reached a quantiser; the contract forbids quantising it.
    #[error("non-finite value {value} in {tensor} at row {row}, column {col}")]
    NonFinite {
        /// What was being quantised (for example "activations" or "blk.3.attn_q").
        tensor: String,
        /// Row (for weights: the output column) of the bad element.
        row: usize,
        /// Position along the reduction dimension.
        col: usize,
        /// The value itself (NaN or ±inf).
        value: f32,
    },
    /// Two operands (or an operand and an output buffer) disagree on a dimension.
    #[error("shape mismatch in {op}: {detail}")]
    Shape {
        /// The operation that was asked for.
        op: &'static str,
        /// What did not fit, with the numbers.
        detail: String,
    },
    /// The exact result of a product does not fit in an f32 (the contract makes this an error).
    #[error("result of {op} at row {row}, column {col} is outside the f32 range")]
    Overflow {
        /// The operation.
        op: &'static str,
        /// Output row.
        row: usize,
        /// Output column.
        col: usize,
    },
    /// A kernel was requested that this CPU (or this build) cannot run.
    #[error("kernel {0} is not supported on this CPU")]
    Unsupported(&'static str),
    /// Stored packed weights (a cache file) that are not what [`crate::PackedWeights::to_bytes`]
    /// wrote.
    #[error("stored packed weights rejected: {0}")]
    Stored(String),
    /// A kernel or thread setting could not be parsed.
    #[error("invalid {what} {value:?}: {why}")]
    Invalid {
        /// Which setting.
        what: &'static str,
        /// The value given.
        value: String,
        /// What would have been accepted.
        why: &'static str,
    },
}

/// Result alias for the kernel crate.
pub type Result<T, E = KernelError> = std::result::Result<T, E>;
