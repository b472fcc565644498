//! `dcd bench stream`: prefill and decode of a model when a memory budget holds only some of
//! its layers and the rest are streamed from the weight cache (`dc_model::stream`), at several
//! budgets, each against every layer in memory measured in the same run; and how fast the
//! streamed layers were read (the bound streaming puts on a hop).

use std::process::ExitCode;

use anyhow::{bail, Result};
use dc_model::stream::WINDOW;
use dc_model::Model;
use serde_json::json;

use super::bench_model::plain_rates;
use super::local::{cached_load_options, engine, model_path};
use crate::cli::{BenchStreamArgs, Global};

pub fn bench_stream(global: &Global, a: &BenchStreamArgs) -> Result<ExitCode> {
    let gemm = engine(global)?;
    let (kernel, threads) = (gemm.kernel(), gemm.threads());
    let path = model_path(&a.model)?;
    let opts = cached_load_options()?;
    let (config, _) = dc_model::open::open_source(&path)?;
    let n = config.num_layers;
    let vocab = config.vocab_size as u64;
    let prompt: Vec<u32> = (0..a.prompt_tokens as u64)
        .map(|i| ((i * 7919 + 13) % vocab) as u32)
        .collect();
    if prompt.is_empty() || a.prompt_tokens + a.decode_tokens > config.max_positions {
        bail!(
            "--prompt-tokens plus --decode-tokens must be 1 to {}",
            config.max_positions
        );
    }
    let layer_mb = dc_node::core::memory::layer_bytes(&config) as f64 / 1e6;
    let mut rows = Vec::new();
    let mut first: Option<(f64, f64)> = None;
    for &budget in &a.budgets {
        if !(0.0..=1.0).contains(&budget) {
            bail!("budget {budget}: expected a fraction of the layers' size, 0 to 1");
        }
        let fit = (budget * n as f64).floor() as usize;
        let model = if fit >= n {
            Model::load(&path, &opts)?
        } else if fit < WINDOW {
            bail!("budget {budget} holds {fit} of {n} layers; streaming needs room for {WINDOW}");
        } else {
            Model::load_streaming(&path, &opts, fit - WINDOW)?
        };
        let (pre, dec) = plain_rates(&model, &gemm, &prompt, a.decode_tokens)?;
        let s = model.stream_stats();
        let read_mb_s = (s.read_seconds > 0.0).then(|| s.reads as f64 * layer_mb / s.read_seconds);
        let base = *first.get_or_insert((pre, dec));
        rows.push(json!({
            "budget": budget, "layers": n, "streamed": s.layers.len(),
            "prefill_tokens_per_s": pre, "decode_tokens_per_s": dec,
            "prefill_vs_first": pre / base.0, "decode_vs_first": dec / base.1,
            "layer_reads": s.reads, "read_mb_per_s": read_mb_s,
        }));
    }
    if a.json {
        println!(
            "{}",
            json!({"model": path, "kernel": kernel.name(), "threads": threads, "results": rows})
        );
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{} threads {threads}, {} prompt tokens, {} decoded; ratios against the first budget",
        kernel.name(),
        prompt.len(),
        a.decode_tokens
    );
    println!("| budget | streamed layers | prefill tok/s | decode tok/s | prefill ratio | decode ratio | layer reads | read MB/s |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {:.0} % | {} of {} | {:.1} | {:.2} | {:.2} | {:.2} | {} | {} |",
            r["budget"].as_f64().unwrap_or(0.0) * 100.0,
            r["streamed"],
            r["layers"],
            r["prefill_tokens_per_s"].as_f64().unwrap_or(0.0),
            r["decode_tokens_per_s"].as_f64().unwrap_or(0.0),
            r["prefill_vs_first"].as_f64().unwrap_or(0.0),
            r["decode_vs_first"].as_f64().unwrap_or(0.0),
            r["layer_reads"],
            r["read_mb_per_s"]
                .as_f64()
                .map_or("-".into(), |v| format!("{v:.0}")),
        );
    }
    Ok(ExitCode::SUCCESS)
}
