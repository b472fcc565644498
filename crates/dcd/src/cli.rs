//! The command line, as clap types. Only parsing: resolving settings and doing work happens in
//! `cmd`.

use clap::{Args, Parser, Subcommand};

/// DaisyChain: run large language models across volunteers' machines, exactly.
#[derive(Debug, Parser)]
#[command(name = "dcd", version, about, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// Options every command takes.
#[derive(Debug, Args)]
pub struct Global {
    /// GEMM kernel: auto, scalar, avx2 or avx512 (every kernel gives the same bits).
    #[arg(long, global = true, env = "DCD_KERNEL", default_value = "auto")]
    pub kernel: String,
    /// Worker threads for the maths (default: all cores).
    #[arg(long, global = true, env = "DCD_THREADS")]
    pub threads: Option<usize>,
    /// More log output.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Less output.
    #[arg(short, long, global = true)]
    pub quiet: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Check the numeric core on this CPU: golden vectors and every kernel against the
    /// scalar reference, bit for bit.
    Selftest(SelftestArgs),
    /// Measure this machine.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Debug, Args)]
pub struct SelftestArgs {
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// int8 peak, memory bandwidth and the exact GEMM at decode and prefill shapes.
    Gemm(BenchGemmArgs),
}

#[derive(Debug, Args)]
pub struct BenchGemmArgs {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Thread counts to measure (default: 1 and all cores).
    #[arg(long, value_delimiter = ',')]
    pub thread_counts: Option<Vec<usize>>,
    /// Kernels to measure (default: every supported SIMD kernel; scalar on decode shapes only).
    #[arg(long, value_delimiter = ',')]
    pub kernels: Option<Vec<String>>,
    /// Seconds to spend on each measurement.
    #[arg(long, default_value_t = 1.0)]
    pub seconds: f64,
    /// Only these shapes, as MxKxN (default: the standard decode and prefill shapes).
    #[arg(long, value_delimiter = ',')]
    pub shapes: Option<Vec<String>>,
}
