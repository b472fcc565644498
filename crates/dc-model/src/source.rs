//! Where weights come from: a [`TensorSource`] names tensors the way Hugging Face checkpoints
//! do and hands each one over as f32, whatever the file stores (f32, f16, bf16, GGUF blocks).
//!
//! Architectures only ever see Hugging Face names and shapes (`[out, in]` for linear layers), so
//! a GGUF file and a safetensors folder of the same model load through the same code.

use std::path::Path;

use crate::error::{ModelError, Result};
use crate::row_table::RowTable;

/// One tensor's name and shape (outermost dimension first, as PyTorch prints it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Hugging Face name, for example `model.layers.3.self_attn.q_proj.weight`.
    pub name: String,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
}

impl TensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A checkpoint's tensors, readable one at a time (only what a stage needs is ever read).
pub trait TensorSource: Send + Sync {
    /// Every tensor, in a stable order.
    fn tensors(&self) -> Vec<TensorInfo>;
    /// One tensor's info, if present.
    fn info(&self, name: &str) -> Option<TensorInfo> {
        self.tensors().into_iter().find(|t| t.name == name)
    }
    /// Reads one tensor converted to f32, row-major in the order of its shape.
    fn load_f32(&self, name: &str) -> Result<Vec<f32>>;
    /// Reads a two-dimensional tensor as a table to convert a row at a time, in its stored
    /// encoding where the source can keep it (by default, as f32).
    fn load_row_table(&self, name: &str) -> Result<RowTable> {
        let (rows, cols) = table_shape(self, name)?;
        RowTable::from_f32(self.load_f32(name)?, rows, cols)
    }
    /// The file (or folder) this source reads, for error messages.
    fn path(&self) -> &Path;
}

/// The `[rows, cols]` shape of the two-dimensional tensor `name` of `src`.
pub fn table_shape<S: TensorSource + ?Sized>(src: &S, name: &str) -> Result<(usize, usize)> {
    let info = src.info(name).ok_or_else(|| ModelError::MissingTensor {
        name: name.into(),
        path: src.path().to_path_buf(),
    })?;
    match info.shape[..] {
        [rows, cols] => Ok((rows, cols)),
        _ => Err(ModelError::Input(format!(
            "tensor {name} of shape {:?} is not a table of rows",
            info.shape
        ))),
    }
}
