//! `dcd bench gemm`: the machine's int8 peak and memory bandwidth, then the exact product at
//! decode and prefill shapes, each as a fraction of what was measured in the same run.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use dc_kernels::bench::{int8_peak_gops, read_bandwidth_gbs, time_commitment, time_gemm};
use dc_kernels::{Gemm, Kernel};
use serde_json::json;

use crate::cli::{BenchGemmArgs, Global};

/// Decode shapes (one token): memory-bound, judged against bandwidth.
const DECODE: [(usize, usize, usize); 3] = [(1, 576, 1536), (1, 2048, 5632), (1, 2048, 32000)];
/// Prefill shapes: compute-bound, judged against the int8 peak.
const PREFILL: [(usize, usize, usize); 3] =
    [(128, 576, 1536), (128, 2048, 2048), (512, 2048, 5632)];
/// Bandwidth buffer and cold-weight working set: far beyond any last-level cache.
pub(super) const COLD_BYTES: usize = 512 << 20;

fn parse_shape(s: &str) -> Result<(usize, usize, usize)> {
    let parts: Vec<&str> = s.split(['x', '×']).collect();
    let [m, k, n] = parts.as_slice() else {
        bail!("shape {s:?}: expected MxKxN, for example 1x2048x5632");
    };
    let p = |v: &str| -> Result<usize> {
        let n: usize = v
            .trim()
            .parse()
            .with_context(|| format!("shape {s:?}: {v:?} is not a number"))?;
        if n == 0 || n > 1 << 20 {
            bail!("shape {s:?}: dimensions must be 1 to 1048576");
        }
        Ok(n)
    };
    Ok((p(m)?, p(k)?, p(n)?))
}

pub fn gemm(global: &Global, args: &BenchGemmArgs) -> Result<ExitCode> {
    if !(0.05..=60.0).contains(&args.seconds) {
        bail!(
            "--seconds must be between 0.05 and 60, got {}",
            args.seconds
        );
    }
    let time = Duration::from_secs_f64(args.seconds);
    let thread_counts = thread_counts(global, args)?;
    let kernels: Vec<Kernel> = match &args.kernels {
        Some(names) => names
            .iter()
            .map(|n| Kernel::parse(n))
            .collect::<Result<_, _>>()?,
        None => Kernel::supported(),
    };
    let explicit_kernels = args.kernels.is_some();
    let shapes: Vec<(usize, usize, usize)> = match &args.shapes {
        Some(s) => s.iter().map(|s| parse_shape(s)).collect::<Result<_>>()?,
        None => DECODE.iter().chain(PREFILL.iter()).copied().collect(),
    };

    let log = |s: String| {
        if !args.json && !global.quiet {
            eprintln!("{s}");
        }
    };
    let (peak, bandwidth) = machine(&thread_counts, time, &log);

    let mut results = Vec::new();
    for &kernel in &kernels {
        for &t in &thread_counts {
            let g = Gemm::new(kernel, t)?;
            let against = (peak[&t], bandwidth[&t]);
            for &shape in &shapes {
                // The scalar reference is ~100× slower; by default only time it on decode.
                if kernel == Kernel::Scalar && !explicit_kernels && shape.0 > 1 {
                    continue;
                }
                results.push(product(&g, shape, against, args.commit, time, &log)?);
            }
        }
    }
    let top = *thread_counts.last().expect("at least one thread count");
    if args.json {
        let v = json!({
            "peak_gops": peak[&top],
            "bandwidth_gbs": bandwidth[&top],
            "peak_gops_by_threads": peak.iter().map(|(t, p)| (t.to_string(), json!(p))).collect::<serde_json::Map<_, _>>(),
            "bandwidth_gbs_by_threads": bandwidth.iter().map(|(t, b)| (t.to_string(), json!(b))).collect::<serde_json::Map<_, _>>(),
            "results": results,
        });
        println!("{v}");
    } else if !global.quiet {
        println!("fractions are against the peak and bandwidth measured with the same thread count in this run");
    }
    Ok(ExitCode::SUCCESS)
}

/// `--thread-counts` (default: 1 and all cores), sorted and without repeats.
fn thread_counts(global: &Global, args: &BenchGemmArgs) -> Result<Vec<usize>> {
    let max_threads = global
        .threads
        .unwrap_or_else(crate::config::default_threads);
    let mut thread_counts = args
        .thread_counts
        .clone()
        .unwrap_or_else(|| vec![1, max_threads]);
    thread_counts.sort_unstable();
    thread_counts.dedup();
    if thread_counts.iter().any(|&t| t == 0 || t > 1024) {
        bail!("--thread-counts must be 1 to 1024");
    }
    Ok(thread_counts)
}

/// The machine's int8 peak (GOPS) and read bandwidth (GB/s) at each thread count: what every
/// product is judged against.
fn machine(
    thread_counts: &[usize],
    time: Duration,
    log: &impl Fn(String),
) -> (BTreeMap<usize, f64>, BTreeMap<usize, f64>) {
    let mut peak = BTreeMap::new();
    let mut bandwidth = BTreeMap::new();
    for &t in thread_counts {
        let p = int8_peak_gops(t, time).unwrap_or(f64::NAN);
        let b = read_bandwidth_gbs(t, COLD_BYTES, time);
        log(format!(
            "threads {t}: int8 peak {p:.1} GOPS, read bandwidth {b:.1} GB/s"
        ));
        peak.insert(t, p);
        bandwidth.insert(t, b);
    }
    (peak, bandwidth)
}

/// Times the exact product of one `(m, k, n)` shape on `g` (and, with `commit`, what a
/// commitment adds), judged against the `(peak, bandwidth)` of its thread count; its JSON row.
fn product(
    g: &Gemm,
    (m, k, n): (usize, usize, usize),
    (peak, bandwidth): (f64, f64),
    commit: bool,
    time: Duration,
    log: &impl Fn(String),
) -> Result<serde_json::Value> {
    let (kernel, t) = (g.kernel(), g.threads());
    let r = time_gemm(g, m, k, n, if m == 1 { COLD_BYTES } else { 0 }, time)?;
    let frac_peak = r.gops() / peak;
    let frac_bw = r.weight_gbs() / bandwidth;
    log(format!(
        "{:<7} threads {t}  {m:>4}×{k:>5}×{n:>6}  {:>8.1} GOPS  {:>6.1} GB/s  {:>5.1}% of peak  {:>5.1}% of bandwidth  (quantising x: {:.3} ms)",
        kernel.name(),
        r.gops(),
        r.weight_gbs(),
        100.0 * frac_peak,
        100.0 * frac_bw,
        r.quantise_seconds * 1e3,
    ));
    let mut row = json!({
        "kernel": kernel.name(), "threads": t, "m": m, "k": k, "n": n,
        "gops": r.gops(), "seconds": r.seconds,
        "weight_gbs": r.weight_gbs(),
        "fraction_of_peak": frac_peak,
        "fraction_of_bandwidth": frac_bw,
        "quantise_activations_seconds": r.quantise_seconds,
    });
    if commit {
        let c = time_commitment(g, m, k, n, time)?;
        log(format!(
            "{:<7} threads {t}  {m:>4}×{k:>5}×{n:>6}  committed: exact accumulators \
             {:+.1} %, hashing {:+.1} % of the plain product ({:.3} ms)",
            kernel.name(),
            100.0 * c.exact_share(),
            100.0 * c.hash_share(),
            c.plain * 1e3,
        ));
        row["commitment"] = json!({
            "plain_seconds": c.plain,
            "exact_seconds": c.exact,
            "committed_seconds": c.committed,
            "exact_share": c.exact_share(),
            "hash_share": c.hash_share(),
        });
    }
    Ok(row)
}
