//! What the commands that compute in this process share: the product engine the global
//! options ask for, and a model resolved from `--model` and loaded with its tokenizer. It sits
//! below every command module and imports none of them.

use std::path::PathBuf;

use anyhow::{Context, Result};
use dc_kernels::{Gemm, Kernel};
use dc_model::tokenizer::{load_for_model, ChatTemplate, SpecialTokens, Tokenizer};
use dc_model::{store, LoadOptions, Model};

use crate::cli::{Global, ModelArg};
use crate::config::default_threads;

/// The product engine the global options ask for.
pub fn engine(global: &Global) -> Result<Gemm> {
    let kernel = Kernel::parse(&global.kernel).context("--kernel / DCD_KERNEL")?;
    let threads = global.threads.unwrap_or_else(default_threads);
    Gemm::new(kernel, threads).context("--threads / DCD_THREADS")
}

/// Resolves `--model` to a path: a folder, a GGUF file, or an installed model's name.
pub fn model_path(arg: &ModelArg) -> Result<PathBuf> {
    let data = store::data_dir()?;
    Ok(store::resolve_model(&arg.model, &data)?)
}

/// Load options that read and fill the weight cache in the data directory.
pub fn cached_load_options() -> Result<LoadOptions> {
    Ok(LoadOptions {
        cache_in: Some(store::data_dir()?),
        ..LoadOptions::default()
    })
}

/// A model with its tokenizer (test checkpoints may come without one).
pub struct Loaded {
    pub model: Model,
    pub tokenizer: Option<Tokenizer>,
    pub special: SpecialTokens,
}

impl Loaded {
    /// The tokenizer, or an error saying the model has none.
    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer.as_ref().with_context(|| {
            format!(
                "{} has no tokenizer (no tokenizer.json); give token ids instead",
                self.model.path().display()
            )
        })
    }
}

/// Loads the whole model and, when it has one, its tokenizer.
pub fn load_model(arg: &ModelArg) -> Result<Loaded> {
    let path = model_path(arg)?;
    let model = Model::load(&path, &cached_load_options()?)
        .with_context(|| format!("loading {}", path.display()))?;
    let has_tokenizer = !path.is_dir() || path.join("tokenizer.json").is_file();
    let (tokenizer, special) = if has_tokenizer {
        let (t, _chat, s): (Tokenizer, Option<ChatTemplate>, SpecialTokens) =
            load_for_model(&path).with_context(|| format!("tokenizer of {}", path.display()))?;
        (Some(t), s)
    } else {
        let special = SpecialTokens {
            bos: model.config.bos_token_id,
            eos: model.config.eos_token_ids.clone(),
            ..SpecialTokens::default()
        };
        (None, special)
    };
    Ok(Loaded {
        model,
        tokenizer,
        special,
    })
}
