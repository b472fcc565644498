//! Model files: a GGUF file, a safetensors checkpoint and a Hugging Face `config.json`, opened
//! and loaded the way `dcd` opens a model it was pointed at (the bytes written to a scratch
//! folder first: the loaders map files, as they must for models of many gigabytes).

use std::path::Path;

use dc_model::config::ModelConfig;
use dc_model::generate::LocalPipeline;
use dc_model::{LoadOptions, Model};

fn write(path: &Path, data: &[u8]) {
    std::fs::write(path, data).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

/// Opens and loads the model at `path` as `dcd generate` would: configuration, tokenizer and
/// chat template, then every weight.
fn open_and_load(path: &Path) {
    let Ok((cfg, source)) = dc_model::open::open_source(path) else {
        return;
    };
    let _ = (cfg.group_size(), cfg.q_width(), cfg.kv_width());
    for t in source.tensors() {
        let _ = source.info(&t.name);
    }
    let _ = dc_model::tokenizer::load_for_model(path);
    let opts = LoadOptions {
        layers: None,
        head: true,
        cache_in: None,
    };
    let Ok(model) = Model::load(path, &opts) else {
        return;
    };
    assert_eq!(model.loaded_layers().len(), model.config.num_layers);
    assert!(model.has_head());
    // One token through every layer: weights that load must compute (or refuse) cleanly.
    if let Ok(mut pipeline) = LocalPipeline::new(&model, 1) {
        if let Ok(logits) = pipeline.forward(crate::gemm(), &[0], false) {
            assert_eq!(logits.len(), model.config.vocab_size);
        }
    }
}

/// A GGUF file.
pub fn gguf(data: &[u8]) {
    let path = crate::scratch().join("model.gguf");
    write(&path, data);
    open_and_load(&path);
}

/// A safetensors checkpoint beside the tiny Llama fixture's `config.json`.
pub fn safetensors(data: &[u8]) {
    let dir = crate::scratch().join("hf");
    if !dir.join("config.json").is_file() {
        std::fs::create_dir_all(&dir).expect("a scratch model folder");
        let config = crate::fixtures().join("llama/config.json");
        std::fs::copy(&config, dir.join("config.json"))
            .unwrap_or_else(|e| panic!("copying {}: {e}", config.display()));
    }
    write(&dir.join("model.safetensors"), data);
    open_and_load(&dir);
}

/// A Hugging Face `config.json`.
pub fn model_config(data: &[u8]) {
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    if let Ok(cfg) = ModelConfig::from_hf_json(&json) {
        let _ = (cfg.group_size(), cfg.q_width(), cfg.kv_width());
    }
}
