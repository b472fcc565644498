//! Command implementations.

mod bench;
mod config_cmd;
mod dashboard;
mod model_cmds;
mod selftest;
mod swarm;
mod swarm_key;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use dc_kernels::{Gemm, Kernel};
use dc_model::tokenizer::{load_for_model, ChatTemplate, SpecialTokens, Tokenizer};
use dc_model::{store, LoadOptions, Model};

use crate::cli::{BenchCommand, Cli, Command, ConfigCommand, Global, ModelArg, SwarmKeyCommand};

pub fn run(mut cli: Cli) -> Result<ExitCode> {
    // Flags, DCD_* environment, config file and defaults resolve once, here.
    let resolved = crate::config::load(cli.global.config.as_deref(), &crate::config::flags(&cli))?;
    cli.global.kernel = resolved.settings.kernel.clone();
    cli.global.threads = resolved.settings.threads;
    let g = &cli.global;
    match &cli.command {
        Command::Selftest(a) => selftest::run(g, a),
        Command::Bench(BenchCommand::Gemm(a)) => bench::gemm(g, a),
        Command::Bench(BenchCommand::Model(a)) => model_cmds::bench_model(g, a),
        Command::Generate(a) => model_cmds::generate(g, a),
        Command::Logits(a) => model_cmds::logits(g, a),
        Command::Perplexity(a) => model_cmds::perplexity(g, a),
        Command::Tokenize(a) => model_cmds::tokenize(a),
        Command::Join(a) => {
            if let Some(spec) = &a.fault {
                dc_node::inject_fault(spec).map_err(anyhow::Error::msg)?;
            }
            swarm::join(g, &resolved)
        }
        Command::VerifyProof(a) => swarm::verify_proof(g, a),
        Command::SwarmKey(SwarmKeyCommand::New(a)) => swarm_key::new(a),
        Command::Status(a) => swarm::status(a, &resolved),
        Command::Config(ConfigCommand::Show(a)) => config_cmd::show(a, &resolved),
    }
}

/// Cores available to us.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

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
    let opts = LoadOptions {
        cache_in: Some(store::data_dir()?),
        ..LoadOptions::default()
    };
    let model = Model::load(&path, &opts).with_context(|| format!("loading {}", path.display()))?;
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
