//! `dcd bench stack`: what stacking several generations' hops at a stage saves. A stage of
//! every layer decodes one token for each of G generations, committing and keeping each hop as
//! a stage does for a signed record, first hop after hop, then all G stacked into one pass
//! (`Model::run_hops_kept`: each weight product one GEMM over the G rows), the two taking
//! turns step by step. Both give the same bits; the ratio is what the stage gains.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Result};
use dc_model::trace::HopTrace;
use dc_model::{HopInput, KvCache, Model};
use serde_json::json;

use super::local::{cached_load_options, engine, model_path};
use crate::cli::{BenchStackArgs, Global};

pub fn bench_stack(global: &Global, a: &BenchStackArgs) -> Result<ExitCode> {
    let gemm = engine(global)?;
    let (kernel, threads) = (gemm.kernel(), gemm.threads());
    let path = model_path(&a.model)?;
    let opts = cached_load_options()?;
    let model = Model::load(&path, &opts)?;
    let cfg = &model.config;
    if a.generations.iter().any(|&g| g == 0 || g > 64) {
        bail!("--generations: each count must be 1 to 64");
    }
    if a.prompt_tokens == 0 || a.prompt_tokens + a.decode_tokens > cfg.max_positions {
        bail!(
            "--prompt-tokens (at least 1) plus --decode-tokens must be at most {}",
            cfg.max_positions
        );
    }
    let vocab = cfg.vocab_size as u64;
    let token =
        |g: usize, pos: usize| ((g as u64 * 7919 + pos as u64 * 104_729 + 13) % vocab) as u32;
    let mut rows = Vec::new();
    for &g in &a.generations {
        // Two sets of caches, one per mode, each prefilled with the same prompts.
        let mut caches: [Vec<KvCache>; 2] = Default::default();
        for set in caches.iter_mut() {
            for i in 0..g {
                let mut cache = KvCache::new(cfg, 0..cfg.num_layers);
                let prompt: Vec<u32> = (0..a.prompt_tokens).map(|p| token(i, p)).collect();
                model.run_layers(&gemm, model.embed(&prompt, 0)?, &mut cache)?;
                set.push(cache);
            }
        }
        let (mut alone, mut stacked) = (0.0, 0.0);
        for step in 0..a.decode_tokens {
            let pos = a.prompt_tokens + step;
            let [one, all] = &mut caches;
            let s = Instant::now();
            for (i, cache) in one.iter_mut().enumerate() {
                let mut trace = HopTrace::from_position(pos);
                let x = model.embed(&[token(i, pos)], pos)?;
                model.run_layers_kept(&gemm, x, cache, &mut trace)?;
            }
            alone += s.elapsed().as_secs_f64();
            let mut traces: Vec<HopTrace> = (0..g).map(|_| HopTrace::from_position(pos)).collect();
            let hops = all
                .iter_mut()
                .zip(traces.iter_mut())
                .enumerate()
                .map(|(i, (cache, trace))| {
                    Ok(HopInput {
                        x: model.embed(&[token(i, pos)], pos)?,
                        cache,
                        trace,
                        keep: true,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let s = Instant::now();
            model.run_hops_kept(&gemm, hops)?;
            stacked += s.elapsed().as_secs_f64();
        }
        let tokens = (g * a.decode_tokens) as f64;
        rows.push(json!({
            "generations": g,
            "alone_tokens_per_s": tokens / alone,
            "stacked_tokens_per_s": tokens / stacked,
            "ratio": alone / stacked,
        }));
    }
    if a.json {
        println!(
            "{}",
            json!({"model": path, "kernel": kernel.name(), "threads": threads,
                   "prompt_tokens": a.prompt_tokens, "decode_tokens": a.decode_tokens,
                   "results": rows})
        );
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{} threads {threads}, a stage of all {} layers, committing and keeping every hop; \
         {} prompt tokens, {} decode steps per generation",
        kernel.name(),
        cfg.num_layers,
        a.prompt_tokens,
        a.decode_tokens
    );
    println!("| generations | hop after hop, tokens/s | stacked, tokens/s | ratio |");
    println!("|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {:.1} | {:.1} | {:.2} |",
            r["generations"],
            r["alone_tokens_per_s"].as_f64().unwrap_or(0.0),
            r["stacked_tokens_per_s"].as_f64().unwrap_or(0.0),
            r["ratio"].as_f64().unwrap_or(0.0),
        );
    }
    Ok(ExitCode::SUCCESS)
}
