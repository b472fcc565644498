//! `dcd selftest`: golden vectors and the kernel conformance sweep, bit for bit.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::Result;
use dc_kernels::{conformance, golden, Kernel};
use serde_json::json;

use crate::cli::{Global, SelftestArgs};

/// Seed of the conformance sweep: fixed, so every machine checks the same cases.
const SWEEP_SEED: u64 = 0xDA15_7C4A_1100_0001;

pub fn run(global: &Global, args: &SelftestArgs) -> Result<ExitCode> {
    let start = Instant::now();
    let kernels = Kernel::supported();
    let threads = [
        1,
        global
            .threads
            .unwrap_or_else(crate::config::default_threads)
            .max(2),
    ];
    let gold = golden::run(&kernels);
    let conf = conformance::sweep(&kernels, &threads, SWEEP_SEED);
    let ok = gold.failures.is_empty() && conf.failures.is_empty() && gold.checks > 0;
    let secs = start.elapsed().as_secs_f64();
    let names: Vec<&str> = kernels.iter().map(|k| k.name()).collect();
    let amx = dc_kernels::cpu::Amx::detect();
    if args.json {
        let v = json!({
            "ok": ok,
            "kernels": names,
            "amx": format!("{amx:?}").to_lowercase(),
            "threads": threads,
            "golden": {"sets": gold.sets, "checks": gold.checks, "failures": gold.failures},
            "conformance": {
                "gemms": conf.gemms, "elements": conf.elements,
                "quantised": conf.quantised, "failures": conf.failures,
            },
            "seconds": secs,
        });
        println!("{v}");
    } else if !global.quiet {
        println!("kernels on this CPU: {}", names.join(", "));
        println!("AMX: {}", amx.describe());
        println!(
            "golden vectors: {} sets, {} values checked, {} failures",
            gold.sets,
            gold.checks,
            gold.failures.len()
        );
        println!(
            "conformance: {} products × {} kernels × threads {:?}: {} outputs and {} quantised elements compared with the scalar reference, {} failures",
            conf.gemms,
            kernels.len(),
            threads,
            conf.elements,
            conf.quantised,
            conf.failures.len()
        );
        for f in gold.failures.iter().chain(&conf.failures).take(20) {
            println!("  FAIL {f}");
        }
        println!(
            "{} in {secs:.2} s",
            if ok {
                "selftest passed"
            } else {
                "SELFTEST FAILED"
            }
        );
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
