//! `dcd bench speculative`: decode speed with and without prompt-lookup speculation on tasks
//! that repeat their prompt (editing code, summarising with quotes) and on free text, greedy
//! and seeded. The two modes take turns run by run, so the machine's drift hits both, and
//! every pair of runs must give the same tokens (the benchmark fails otherwise).

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Result};
use dc_model::generate::{generate, GenerateRequest, LocalPipeline};
use dc_model::sampling::SamplingParams;
use dc_model::speculative::{Speculation, SpeculationStats};
use serde_json::json;

use super::local::{engine, load_model};
use crate::cli::{BenchSpeculativeArgs, Global};

/// The tasks: a name and a prompt.
const TASKS: &[(&str, &str)] = &[
    (
        "edit code",
        "Here is a Python function:\n\n```python\ndef compute_total(items, tax_rate):\n    \
         total = 0\n    for item in items:\n        if item.price <= 0:\n            continue\n        \
         line = item.price * item.quantity\n        if item.discount:\n            line = line * \
         (1 - item.discount)\n        total = total + line\n    total = total * (1 + tax_rate)\n    \
         return round(total, 2)\n```\n\nThe same function with `compute_total` renamed to \
         `order_total` and `items` renamed to `lines`:\n\n```python\n",
    ),
    (
        "summarise with quotes",
        "The committee met on Tuesday to discuss the new library. \"We have waited ten years for \
         this building,\" said the chair, Maria Lopez. The library will open in March and hold \
         forty thousand books. \"Every child in the town will have a card by the summer,\" said \
         the head librarian, Tom Reed. The cost, twelve million pounds, was paid by the county \
         and by a gift from a local family.\n\nA short summary that quotes the chair and the \
         head librarian word for word:\n\n",
    ),
    (
        "free text",
        "Write a short story about a lighthouse keeper who finds a message in a bottle.\n\n",
    ),
];

pub fn bench_speculative(global: &Global, a: &BenchSpeculativeArgs) -> Result<ExitCode> {
    let gemm = engine(global)?;
    let l = load_model(&a.model)?;
    let tokenizer = l.tokenizer()?;
    let samplings = [
        ("greedy", SamplingParams::default()),
        (
            "seeded",
            SamplingParams {
                temperature: 0.7,
                top_p: Some(0.9),
                seed: 1,
                ..Default::default()
            },
        ),
    ];
    let mut results = Vec::new();
    for (task, text) in TASKS {
        let prompt = tokenizer.encode(text, false)?;
        for (how, sampling) in &samplings {
            let mut req = GenerateRequest {
                prompt: prompt.clone(),
                max_new_tokens: a.max_new_tokens,
                sampling: sampling.clone(),
                stop_tokens: l.special.eos.clone(),
                chunk: 64,
                json: None,
                speculative: Speculation::Off,
            };
            let (mut off, mut on) = (Vec::new(), Vec::new());
            let mut reference: Option<Vec<u32>> = None;
            let mut stats = SpeculationStats::default();
            for _ in 0..a.runs.max(1) {
                for mode in [Speculation::Off, Speculation::PromptLookup] {
                    req.speculative = mode;
                    let mut p = LocalPipeline::new(&l.model, 1)?;
                    let mut first: Option<Instant> = None;
                    let out = generate(&mut p, &gemm, &req, |_, _| {
                        first.get_or_insert_with(Instant::now);
                    })?;
                    let seconds = first.map_or(0.0, |f| f.elapsed().as_secs_f64());
                    // Tokens after the first (which comes from the prompt's pass) per second.
                    let rate = out.tokens.len().saturating_sub(1) as f64 / seconds.max(1e-9);
                    match &reference {
                        Some(r) if *r != out.tokens => bail!(
                            "{task}, {how}: speculation changed the tokens ({} against {})",
                            out.tokens.len(),
                            r.len()
                        ),
                        Some(_) => {}
                        None => reference = Some(out.tokens.clone()),
                    }
                    match mode {
                        Speculation::Off => off.push(rate),
                        Speculation::PromptLookup => {
                            on.push(rate);
                            stats = out.speculation;
                        }
                    }
                }
            }
            let (off, on) = (median(&mut off), median(&mut on));
            let tokens = reference.map_or(0, |r| r.len());
            let per_pass = (stats.passes + stats.accepted) as f64 / stats.passes.max(1) as f64;
            if !a.json {
                println!(
                    "{task:>22}, {how}: {tokens} tokens, {per_pass:.2} per pass \
                     ({} of {} guesses kept), decode {off:.1} → {on:.1} tokens/s ({:.2}×)",
                    stats.accepted,
                    stats.drafted,
                    on / off
                );
            }
            results.push(json!({
                "task": task, "sampling": how, "tokens": tokens,
                "passes": stats.passes, "drafted": stats.drafted, "accepted": stats.accepted,
                "tokens_per_pass": per_pass,
                "off_tokens_per_s": off, "prompt_lookup_tokens_per_s": on, "ratio": on / off,
            }));
        }
    }
    let costs = pass_costs(&l.model, &gemm, &tokenizer.encode(TASKS[0].1, false)?)?;
    if !a.json {
        let line: Vec<String> = costs
            .iter()
            .map(|(rows, ms)| format!("{rows} rows {ms:.2} ms ({:.2}×)", ms / costs[0].1))
            .collect();
        println!("a pass after the prompt: {}", line.join(", "));
    }
    if a.json {
        let costs: Vec<_> = costs
            .iter()
            .map(|(rows, ms)| json!({"rows": rows, "ms": ms}))
            .collect();
        println!(
            "{}",
            json!({"model": l.model.path(), "threads": gemm.threads(), "results": results,
                   "pass_costs": costs})
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// What a pass of 1 to `1 + MAX_DRAFT` rows costs after `prompt` (the token just sampled and
/// a guess of the rest): median milliseconds of 15, the passes of each size in turn.
fn pass_costs(
    model: &dc_model::Model,
    gemm: &dc_kernels::Gemm,
    prompt: &[u32],
) -> Result<Vec<(usize, f64)>> {
    let sizes = [1, 2, 3, 5, 1 + dc_model::speculative::MAX_DRAFT];
    let mut p = LocalPipeline::new(model, 1)?;
    p.prefill(gemm, prompt, 64)?;
    let at = p.len();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); sizes.len()];
    for _ in 0..15 {
        for (i, &rows) in sizes.iter().enumerate() {
            p.rewind(at);
            let s = Instant::now();
            p.forward(gemm, &prompt[..rows.min(prompt.len())], true)?;
            times[i].push(s.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(sizes
        .iter()
        .zip(&mut times)
        .map(|(&rows, t)| (rows, median(t)))
        .collect())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
