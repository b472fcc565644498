//! The DaisyChain model runtime: loads Hugging Face folders and GGUF files, quantises weights
//! once into the kernel layout, and runs any contiguous range of layers as a stage with its own
//! KV cache. One process can run a whole generation, cut into stages exactly as the swarm cuts
//! it. No network code lives here.

#![deny(missing_docs)]

pub mod activations;
pub mod attention;
mod compute;
pub mod config;
pub mod error;
pub mod fetched;
pub mod generate;
pub mod gguf;
pub mod hf;
pub mod identity;
pub mod json_output;
pub mod json_schema;
pub mod kv_cache;
pub mod manifest;
pub mod model;
pub mod open;
mod products;
pub mod progress;
pub mod row_table;
pub mod sampling;
pub mod source;
pub mod speculative;
pub mod store;
pub mod stream;
pub mod tokenizer;
pub mod verify;
pub mod weight_cache;
/// What a stage commits to for one hop (defined in `dc-types`, shared with the network).
pub use dc_types::trace;
pub mod weights;

pub use activations::Activations;
pub use config::{Arch, ModelConfig};
pub use error::{ModelError, Result};
pub use kv_cache::KvCache;
pub use model::{HopInput, LoadOptions, Model};
pub use source::{TensorInfo, TensorSource};
pub use verify::{
    check_cache_rows, check_parts, check_picks, draw_checks, gemms_per_layer, goal_rate,
    rows_needed, tested_parts, CacheLog, KeptHop, LayerChecker, Needs, Pick,
};
