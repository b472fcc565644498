//! Command implementations.

mod bench;
mod selftest;

use std::process::ExitCode;

use anyhow::Result;

use crate::cli::{BenchCommand, Cli, Command};

pub fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Selftest(a) => selftest::run(&cli.global, &a),
        Command::Bench(BenchCommand::Gemm(a)) => bench::gemm(&cli.global, &a),
    }
}

/// Cores available to us.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
