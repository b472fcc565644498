//! Opening a model on disk: a Hugging Face folder (`config.json` and safetensors) or a GGUF
//! file, as its configuration and a [`TensorSource`]. Below both the model's loading and its
//! identity (which fingerprints the same source), so neither has to import the other.

use std::path::Path;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::hf::{read_json, SafetensorsSource};
use crate::source::TensorSource;

/// Opens a model's tensors and configuration: a Hugging Face folder or a GGUF file. A model
/// fetched from peers offers only the tensors it fetched.
pub fn open_source(path: &Path) -> Result<(ModelConfig, Box<dyn TensorSource>)> {
    let (cfg, src) = open_files(path)?;
    match crate::fetched::fetched_folder(path) {
        Some(dir) => Ok((cfg, Box::new(crate::fetched::HeldOnly::new(src, &dir)?))),
        None => Ok((cfg, src)),
    }
}

fn open_files(path: &Path) -> Result<(ModelConfig, Box<dyn TensorSource>)> {
    if path.is_dir() {
        let cfg = ModelConfig::from_hf_json(&read_json(&path.join("config.json"))?)?;
        let src = SafetensorsSource::open_dir(path)?;
        Ok((cfg, Box::new(src)))
    } else if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        open_gguf(path)
    } else {
        Err(ModelError::Input(format!(
            "{}: expected a Hugging Face folder (with config.json) or a .gguf file",
            path.display()
        )))
    }
}

/// Opens a GGUF file: its metadata becomes a Hugging Face style configuration.
fn open_gguf(path: &Path) -> Result<(ModelConfig, Box<dyn TensorSource>)> {
    let g = crate::gguf::GgufFile::open(path)?;
    let cfg = ModelConfig::from_hf_json(&g.hf_config()?)?;
    Ok((cfg, Box::new(g)))
}
