//! `dcd`: the DaisyChain daemon and command line. Parsing lives here; every command's work
//! lives in the library crates, and each command module only wires them together and prints.

mod cli;
mod cmd;
mod config;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    match cmd::run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("dcd: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
