//! `dcd`: the DaisyChain daemon and command line. Parsing lives in the library half
//! (`lib.rs`); every command's work lives in the library crates, and each command module only
//! wires them together and prints.

mod cmd;

use std::process::ExitCode;

use clap::Parser;
use dcd::{cli, config};

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
