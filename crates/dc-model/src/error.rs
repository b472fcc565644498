//! Typed errors of the model runtime. Each names the file, tensor or value that was wrong.

use std::path::PathBuf;

use thiserror::Error;

/// Everything that can go wrong loading or running a model.
#[derive(Debug, Error)]
pub enum ModelError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A file is not in the format it claims (truncated, corrupt, wrong magic, bad offsets).
    #[error("{path}: {detail}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What was wrong, with the offending values.
        detail: String,
    },
    /// A model configuration value is missing or invalid.
    #[error("config: {key}: {detail}")]
    Config {
        /// The configuration key.
        key: String,
        /// What was wrong.
        detail: String,
    },
    /// An architecture, dtype or tensor type we do not support.
    #[error("unsupported {what}: {value}")]
    Unsupported {
        /// The kind of thing (architecture, dtype, GGUF tensor type, …).
        what: &'static str,
        /// The value found.
        value: String,
    },
    /// A tensor the architecture needs is not in the checkpoint.
    #[error("missing tensor {name} in {path}")]
    MissingTensor {
        /// The tensor's name.
        name: String,
        /// Where it was looked for.
        path: PathBuf,
    },
    /// A tensor has a different shape than the configuration implies.
    #[error("tensor {name} has shape {got:?}, expected {expected:?}")]
    Shape {
        /// The tensor's name.
        name: String,
        /// The shape the configuration implies.
        expected: Vec<usize>,
        /// The shape in the file.
        got: Vec<usize>,
    },
    /// A tokenizer could not be built or used.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Bad input to a running model (token ids, positions, activations).
    #[error("{0}")]
    Input(String),
    /// Non-finite values at a stage boundary.
    #[error("non-finite activation in stage {stage}, layer {layer}: {detail}")]
    NonFinite {
        /// The stage (layer range) that saw them.
        stage: String,
        /// The layer whose output (or input) was non-finite.
        layer: String,
        /// Where in the activations.
        detail: String,
    },
    /// An error from the numeric core.
    #[error(transparent)]
    Kernel(#[from] dc_kernels::KernelError),
}

/// Result alias for the model crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

impl ModelError {
    /// A format error for `path`.
    pub fn format(path: impl Into<PathBuf>, detail: impl Into<String>) -> ModelError {
        ModelError::Format {
            path: path.into(),
            detail: detail.into(),
        }
    }

    /// An I/O error for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> ModelError {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }
}
