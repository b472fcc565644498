//! Command implementations: this module only resolves the configuration and dispatches each
//! subcommand to the module that owns it. Imports point one way, down: the command modules
//! (`swarm`, `model_cmds`, `bench`, ...) over `dashboard`, over `client`, `local` and `timing`, over
//! `crate::config`; nothing below imports from above.

mod bench;
mod bench_model;
mod bench_speculative;
mod bench_stack;
mod bench_stream;
mod client;
mod config_cmd;
mod dashboard;
mod local;
mod model_cmds;
mod selftest;
mod swarm;
mod swarm_key;
mod timing;

use std::process::ExitCode;

use anyhow::Result;

use crate::cli::{BenchCommand, Cli, Command, ConfigCommand, SwarmKeyCommand};

pub fn run(mut cli: Cli) -> Result<ExitCode> {
    // Flags, DCD_* environment, config file and defaults resolve once, here.
    let resolved = crate::config::load(cli.global.config.as_deref(), &crate::config::flags(&cli))?;
    cli.global.kernel = resolved.settings.kernel.clone();
    cli.global.threads = resolved.settings.threads;
    cli.global.speculative = resolved.settings.speculative;
    let g = &cli.global;
    match &cli.command {
        Command::Selftest(a) => selftest::run(g, a),
        Command::Bench(BenchCommand::Gemm(a)) => bench::gemm(g, a),
        Command::Bench(BenchCommand::Model(a)) => bench_model::bench_model(g, a),
        Command::Bench(BenchCommand::Speculative(a)) => bench_speculative::bench_speculative(g, a),
        Command::Bench(BenchCommand::Stream(a)) => bench_stream::bench_stream(g, a),
        Command::Bench(BenchCommand::Stack(a)) => bench_stack::bench_stack(g, a),
        // Through a daemon's control API when `--api` is given, else in this process.
        Command::Generate(a) => match &a.api {
            Some(api) => swarm::generate_api(a, api),
            None => model_cmds::generate(g, a),
        },
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
