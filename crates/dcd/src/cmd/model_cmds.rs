//! Commands that run a model in this process: generate, logits, perplexity, tokenize and
//! bench model.

use std::io::Write;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use dc_kernels::elementwise::log_sum_exp;
use dc_kernels::{Gemm, Kernel};
use dc_model::generate::{
    generate as run_generation, logits_commitment, GenerateRequest, LocalPipeline,
};
use dc_model::sampling::SamplingParams;
use dc_model::tokenizer::{load_for_model, StreamDecoder};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;

use super::local::{engine, load_model, model_path};
use crate::cli::{BenchModelArgs, GenerateArgs, Global, LogitsArgs, PerplexityArgs, TokenizeArgs};

pub fn generate(global: &Global, a: &GenerateArgs) -> Result<ExitCode> {
    let gemm = engine(global)?;
    let model = a.model.clone().context("give --model (or --api)")?;
    let l = load_model(&crate::cli::ModelArg { model })?;
    let prompt = match (&a.prompt, &a.prompt_ids) {
        (Some(text), _) => l.tokenizer()?.encode(text, false)?,
        (None, Some(ids)) => ids.clone(),
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    let req = GenerateRequest {
        prompt: prompt.clone(),
        max_new_tokens: a.max_new_tokens,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            seed: a.seed,
        },
        stop_tokens: if a.ignore_eos {
            Vec::new()
        } else {
            l.special.eos.clone()
        },
        chunk: a.chunk,
    };
    let mut pipeline = LocalPipeline::new(&l.model, a.stages)?;
    let mut decoder = l.tokenizer.as_ref().map(|t| StreamDecoder::new(t, true));
    let mut stdout = std::io::stdout().lock();
    let mut stream_err = None;
    let out = run_generation(&mut pipeline, &gemm, &req, |t| {
        if a.json || stream_err.is_some() {
            return;
        }
        // Without a tokenizer, stream the ids themselves.
        let piece = match decoder.as_mut() {
            Some(d) => d.push(t),
            None => Ok(format!("{t} ")),
        };
        match piece {
            Ok(text) => {
                let _ = write!(stdout, "{text}");
                let _ = stdout.flush();
            }
            Err(e) => stream_err = Some(e),
        }
    })?;
    if let Some(e) = stream_err {
        return Err(e.into());
    }
    let text = match &l.tokenizer {
        Some(t) => Some(t.decode(&out.tokens, true)?),
        None => None,
    };
    if a.json {
        println!(
            "{}",
            json!({
                "prompt_ids": prompt,
                "tokens": out.tokens,
                "text": text,
                "stop": out.stop,
                "final_logits": logits_commitment(pipeline.len() - 1, &out.final_logits).to_hex(),
            })
        );
    } else {
        let rest = match decoder.as_mut() {
            Some(d) => d.finish()?,
            None => String::new(),
        };
        writeln!(stdout, "{rest}")?;
    }
    Ok(ExitCode::SUCCESS)
}

pub fn logits(global: &Global, a: &LogitsArgs) -> Result<ExitCode> {
    let gemm = engine(global)?;
    let path = model_path(&a.model)?;
    let model = dc_model::Model::load(&path, &Default::default())?;
    let mut p = LocalPipeline::new(&model, a.stages)?;
    let logits = p.prefill_all(&gemm, &a.ids, 64)?;
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = TensorView::new(
        Dtype::F32,
        vec![a.ids.len(), model.config.vocab_size],
        &bytes,
    )
    .context("building the logits tensor")?;
    let file = safetensors::serialize([("logits", view)], None).context("serialising logits")?;
    std::fs::write(&a.out, file).with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!(
        "wrote logits [{}, {}] to {}",
        a.ids.len(),
        model.config.vocab_size,
        a.out.display()
    );
    Ok(ExitCode::SUCCESS)
}

pub fn perplexity(global: &Global, a: &PerplexityArgs) -> Result<ExitCode> {
    let gemm = engine(global)?;
    let l = load_model(&a.model)?;
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading {}", a.file.display()))?;
    // Like the reference measurements: the text is stripped, no BOS is added.
    let ids = l.tokenizer()?.encode(text.trim(), false)?;
    if ids.len() < 2 {
        bail!(
            "{}: fewer than two tokens, nothing to predict",
            a.file.display()
        );
    }
    // Non-overlapping windows of the model's context, every position after a window's first
    // predicting the next token (as llama-perplexity does with its context size).
    let ctx = l.model.config.max_positions;
    let vocab = l.model.config.vocab_size;
    let (mut nll, mut count) = (0f64, 0usize);
    for window in ids.chunks(ctx) {
        let mut p = LocalPipeline::new(&l.model, 1)?;
        let logits = p.prefill_all(&gemm, window, 128)?;
        for i in 0..window.len() - 1 {
            let row = &logits[i * vocab..(i + 1) * vocab];
            nll += log_sum_exp(row) - row[window[i + 1] as usize] as f64;
            count += 1;
        }
    }
    let ppl = (nll / count as f64).exp();
    if a.json {
        println!(
            "{}",
            json!({"tokens": ids.len(), "predictions": count, "mean_nll": nll / count as f64, "ppl": ppl})
        );
    } else {
        println!(
            "{} tokens, {count} predictions, perplexity {ppl:.4}",
            ids.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub fn tokenize(a: &TokenizeArgs) -> Result<ExitCode> {
    let path = model_path(&a.model)?;
    let (tok, _, _) = load_for_model(&path)?;
    let ids = tok.encode(&a.text, a.add_special_tokens)?;
    if a.json {
        println!("{}", json!({ "ids": ids }));
    } else {
        println!(
            "{}",
            ids.iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Prefill and decode rates of the stage path over every layer, plain and committing, taking
/// turns hop by hop (two caches over the same positions) so the machine's drift hits both
/// alike: `(plain, committed)` tokens per second for prefill, then for decode.
fn committed_rates(
    model: &dc_model::Model,
    gemm: &Gemm,
    prompt: &[u32],
    decode: usize,
) -> Result<[(f64, f64); 2]> {
    let layers = 0..model.config.num_layers;
    let (mut pre, mut dec) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
    // One hop through every layer, committing or not; seconds.
    let hop = |x: dc_model::Activations, cache: &mut dc_model::KvCache, commit: bool| {
        let mut t = dc_model::trace::HopTrace::from_position(x.start);
        let s = Instant::now();
        model.run_layers_traced(gemm, x, cache, commit.then_some(&mut t))?;
        Ok::<_, anyhow::Error>(s.elapsed().as_secs_f64())
    };
    for _ in 0..3 {
        let mut caches = [0, 1].map(|_| dc_model::KvCache::new(&model.config, layers.clone()));
        for (c, (cache, times)) in caches.iter_mut().zip(&mut pre).enumerate() {
            times.push(prompt.len() as f64 / hop(model.embed(prompt, 0)?, cache, c == 1)?);
        }
        for i in 0..decode {
            let pos = prompt.len() + i;
            for (c, (cache, times)) in caches.iter_mut().zip(&mut dec).enumerate() {
                let x = model.embed(&[(pos % 100) as u32], pos)?;
                times.push(1.0 / hop(x, cache, c == 1)?);
            }
        }
    }
    let [p0, p1] = &mut pre;
    let [d0, d1] = &mut dec;
    Ok([(median(p0), median(p1)), (median(d0), median(d1))])
}

/// What spot checks cost on decode hops over all layers (medians over the decoded tokens).
struct SpotCosts {
    /// Decode hops per second, committing (the baseline) and committing + keeping (the hop,
    /// its cache rows' log, and dropping the hop that leaves a stage's window of kept hops).
    committed: f64,
    kept: f64,
    /// One layer's share of a committed decode hop, seconds.
    layer: f64,
    /// Tokens between two checks of one layer: `SPOT_GAP`, or the layer count if smaller.
    gap: usize,
    /// Per checked layer: the stage's reveal and the checker's check, seconds; wire bytes
    /// (each layer checked every `gap` tokens, holding the cache rows it verified before).
    reveal: f64,
    check: f64,
    bytes: f64,
    /// The same for a layer's first check in the generation (the whole cache revealed).
    first_check: f64,
    first_bytes: f64,
    /// Building one layer's checker (once per head and layer), seconds.
    build: f64,
    /// The policy: every layer's parts drawn at `rate` on every decode hop, as a head draws
    /// them, revealed and checked a batch of hops at a time as a head asks about them.
    /// Reveals and checks as a share of the committed decode compute, in all; wire bytes and
    /// picked layers per hop, on average.
    rate: f64,
    policy_share: f64,
    /// Of `policy_share`, the stage's reveals (the rest is the head's checks).
    policy_reveal_share: f64,
    policy_bytes: f64,
    policy_layers: f64,
    /// The policy on the prompt's prefill hop: each picked layer's drawn parts checked at
    /// every row. Reveals and checks as a share of the committed prefill compute; wire bytes
    /// and picked layers.
    prefill_share: f64,
    prefill_bytes: f64,
    prefill_layers: usize,
}

/// Tokens between two checks of one layer in the spot-check benchmark (as at a rate of 0.1).
const SPOT_GAP: usize = 10;

fn spot_costs(
    model: &dc_model::Model,
    gemm: &Gemm,
    prompt: &[u32],
    decode: usize,
    rate: f64,
) -> Result<SpotCosts> {
    use dc_model::trace::HopTrace;
    let n = model.config.num_layers;
    let parts = dc_model::check_parts(&model.config);
    let every = dc_types::CheckSet::of(&parts);
    let mut coins = dc_kernels::rng::SplitMix64::new(7);
    let (mut policy_s, mut policy_bytes, mut policy_layers) = (0.0, 0.0, 0usize);
    let mut policy_reveal_s = 0.0;
    let layers = 0..n;
    let s = Instant::now();
    let checkers = layers
        .clone()
        .map(|l| dc_model::LayerChecker::new(model, l, &[9; 32]))
        .collect::<dc_model::Result<Vec<_>>>()?;
    let build = s.elapsed().as_secs_f64() / n as f64;
    let gap = SPOT_GAP.min(n);
    let (mut committed, mut kept) = (Vec::new(), Vec::new());
    let (mut reveal, mut check, mut bytes) = (Vec::new(), Vec::new(), Vec::new());
    let (mut first_check, mut first_bytes) = (Vec::new(), Vec::new());
    // What the checker verified of each layer's cache so far.
    let mut known: Vec<_> = layers
        .clone()
        .map(|_| {
            dc_model::attention::LayerCache::new(model.config.num_kv_heads, model.config.head_dim)
        })
        .collect();
    let mut policy_known = known.clone();
    // Two stages over the same positions, one committing and one also keeping, taking turns
    // token by token so the machine's drift hits both alike.
    let mut caches = [0, 1].map(|_| dc_model::KvCache::new(&model.config, layers.clone()));
    // The keeping stage's hops and cache rows: a check ties the revealed cache to every hop.
    let mut hops = Vec::new();
    let mut log = dc_model::CacheLog::default();
    let (mut prefill_s, mut prefill_kept) = (0.0, None);
    for (i, cache) in caches.iter_mut().enumerate() {
        let mut t = HopTrace::from_position(0);
        let x = model.embed(prompt, 0)?;
        if i == 0 {
            let s = Instant::now();
            model.run_layers_traced(gemm, x, cache, Some(&mut t))?;
            prefill_s = s.elapsed().as_secs_f64();
        } else {
            prefill_kept = Some(model.run_layers_kept(gemm, x, cache, &mut t)?.1);
        }
        hops = vec![(t, prompt.len())];
    }
    log.record(&caches[1]);
    // The policy on the prefill hop (coins of their own, so the decode figures draw as
    // before): a picked layer's drawn parts at every row, from a checker holding no cache.
    let (mut prefill_check_s, mut prefill_bytes, mut prefill_layers) = (0.0, 0.0, 0);
    if let Some(kept) = &prefill_kept {
        let mut coins = dc_kernels::rng::SplitMix64::new(11);
        let views: Vec<_> = hops.iter().map(|(t, n)| (t, *n)).collect();
        for l in layers.clone() {
            let checks = dc_model::draw_checks(&parts, rate, || coins.unit());
            if checks.is_empty() {
                continue;
            }
            let s = Instant::now();
            let r = kept
                .reveal_rows(l, 0, prompt.len(), checks, 0, &log)
                .map_err(|e| anyhow::anyhow!("reveal: {e}"))?;
            let mut cache = dc_model::attention::LayerCache::new(
                model.config.num_kv_heads,
                model.config.head_dim,
            );
            gemm.install(|| {
                checkers[l].check_rows_in_place(model, &views, &mut cache, &r, checks, prompt.len())
            })
            .map_err(|e| anyhow::anyhow!("an honest prefill spot check failed: {e}"))?;
            prefill_check_s += s.elapsed().as_secs_f64();
            prefill_bytes += dc_types::encode(&r, usize::MAX)?.len() as f64;
            prefill_layers += 1;
        }
    }
    drop(prefill_kept);
    let mut window = std::collections::VecDeque::with_capacity(dc_node::stage::KEPT_HOPS);
    // The policy's drawn hops not yet revealed and checked: a head asks about a batch at once.
    let mut pending = Vec::with_capacity(dc_node::check::spot::REVEAL_BATCH);
    for i in 0..decode {
        let pos = prompt.len() + i;
        let x = model.embed(&[(pos % 100) as u32], pos)?;
        let [plain_cache, kept_cache] = &mut caches;
        let mut run_committed = || -> Result<f64> {
            let mut t = HopTrace::from_position(pos);
            let s = Instant::now();
            model.run_layers_traced(gemm, x.clone(), plain_cache, Some(&mut t))?;
            Ok(s.elapsed().as_secs_f64())
        };
        let mut run_kept = || -> Result<_> {
            let mut t = HopTrace::from_position(pos);
            let s = Instant::now();
            let (_, hop) = model.run_layers_kept(gemm, x.clone(), kept_cache, &mut t)?;
            log.record(kept_cache);
            // As a stage keeps them: its last hops, the oldest dropped as a new one comes
            // (freeing memory long gone cold, part of what keeping costs).
            if window.len() == dc_node::stage::KEPT_HOPS {
                window.pop_front();
            }
            Ok((s.elapsed().as_secs_f64(), t, hop))
        };
        // The two take turns going first, so that neither always finds the memory the other
        // (or the checks) left.
        let (plain_s, (kept_s, t, hop)) = match i % 2 {
            0 => (run_committed()?, run_kept()?),
            _ => {
                let k = run_kept()?;
                (run_committed()?, k)
            }
        };
        committed.push(plain_s);
        kept.push(kept_s);
        hops.push((t, 1));
        // SPOT_GAP layers spread over the model take turns (every layer, if it has fewer).
        let l = (i % gap) * n / gap;
        let (c, first) = (&checkers[l], known[l].is_empty());
        let s = Instant::now();
        let r = hop
            .reveal(l, pos, every, known[l].len(), &log)
            .map_err(|e| anyhow::anyhow!("reveal: {e}"))?;
        let revealed = s.elapsed().as_secs_f64();
        let size = dc_types::encode(&r, usize::MAX)?.len() as f64;
        let s = Instant::now();
        let views: Vec<_> = hops.iter().map(|(t, n)| (t, *n)).collect();
        // On the engine's threads, as a head runs its checks.
        gemm.install(|| c.check_in_place(model, &views, &mut known[l], &r, every))
            .map_err(|e| anyhow::anyhow!("an honest spot check failed: {e}"))?;
        let checked = s.elapsed().as_secs_f64();
        // The policy, as a head runs it: each layer's parts drawn on every hop as a head
        // draws them, then every `REVEAL_BATCH` hops the stage revealing the batch's picks in
        // one go and the head checking them hop by hop, each hop's picks on its engine's
        // threads (one hand-over to the pool per hop). So the memory each side finds is a
        // daemon's: the kept hops up to a batch old when revealed, the checks' code warm after
        // the batch's first hop.
        let picks: Vec<_> = layers
            .clone()
            .map(|l| (l, dc_model::draw_checks(&parts, rate, || coins.unit())))
            .filter(|(_, checks)| !checks.is_empty())
            .collect();
        window.push_back(hop);
        pending.push((pos, picks));
        if pending.len() == dc_node::check::spot::REVEAL_BATCH || i + 1 == decode {
            let s = Instant::now();
            // Each attention pick asks for the cache rows after those verified before the
            // batch, or after its layer's earlier pick in the batch (which extends them).
            let mut verified_to: Vec<usize> = policy_known.iter().map(|c| c.len()).collect();
            let reveals = pending
                .iter()
                .map(|(pos, picks)| {
                    let hop = &window[window.len() - 1 - (prompt.len() + i - pos)];
                    picks
                        .iter()
                        .map(|&(l, checks)| {
                            let from = verified_to[l].min(*pos);
                            if checks.attention() {
                                verified_to[l] = pos + 1;
                            }
                            hop.reveal(l, *pos, checks, from, &log)
                        })
                        .collect::<std::result::Result<Vec<_>, _>>()
                })
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| anyhow::anyhow!("reveal: {e}"))?;
            policy_reveal_s += s.elapsed().as_secs_f64();
            for ((pos, picks), reveals) in pending.iter().zip(&reveals) {
                // The hops up to this one (a check takes the last as the hop it checks).
                let views = &views[..pos - prompt.len() + 2];
                // Picks are of different layers, in layer order: each takes its layer's cache.
                let mut wanted = picks.iter().zip(reveals).peekable();
                let mut jobs = Vec::with_capacity(picks.len());
                for (l, cache) in policy_known.iter_mut().enumerate() {
                    if let Some((&(_, checks), r)) = wanted.next_if(|((pl, _), _)| *pl == l) {
                        jobs.push((&checkers[l], r, checks, 1, cache));
                    }
                }
                let results = gemm.install(|| dc_model::check_picks(model, views, jobs));
                for (&(_, checks), done) in picks.iter().zip(results) {
                    done.map_err(|e| {
                        anyhow::anyhow!("an honest spot check of {checks:?} failed: {e}")
                    })?;
                }
                policy_layers += picks.len();
            }
            policy_s += s.elapsed().as_secs_f64();
            for r in reveals.iter().flatten() {
                policy_bytes += dc_types::encode(r, usize::MAX)?.len() as f64;
            }
            pending.clear();
        }
        if first {
            first_check.push(checked);
            first_bytes.push(size);
        } else {
            reveal.push(revealed);
            check.push(checked);
            bytes.push(size);
        }
    }
    if check.is_empty() {
        anyhow::bail!("--spot-check needs more than {gap} --decode-tokens");
    }
    let committed_s: f64 = committed.iter().sum();
    let committed = median(&mut committed);
    Ok(SpotCosts {
        rate,
        policy_share: policy_s / committed_s,
        policy_reveal_share: policy_reveal_s / committed_s,
        prefill_share: prefill_check_s / prefill_s,
        prefill_bytes,
        prefill_layers,
        policy_bytes: policy_bytes / decode as f64,
        policy_layers: policy_layers as f64 / decode as f64,
        committed: 1.0 / committed,
        kept: 1.0 / median(&mut kept),
        layer: committed / n as f64,
        gap,
        reveal: median(&mut reveal),
        check: median(&mut check),
        bytes: median(&mut bytes),
        first_check: median(&mut first_check),
        first_bytes: median(&mut first_bytes),
        build,
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn bench_model(global: &Global, a: &BenchModelArgs) -> Result<ExitCode> {
    let kernel = Kernel::parse(&global.kernel)?;
    let path = model_path(&a.model)?;
    let model = dc_model::Model::load(&path, &Default::default())?;
    let max_threads = global
        .threads
        .unwrap_or_else(crate::config::default_threads);
    let mut counts = a
        .thread_counts
        .clone()
        .unwrap_or_else(|| vec![1, max_threads]);
    counts.sort_unstable();
    counts.dedup();
    let vocab = model.config.vocab_size as u64;
    let prompt: Vec<u32> = (0..a.prompt_tokens as u64)
        .map(|i| ((i * 7919 + 13) % vocab) as u32)
        .collect();
    if prompt.is_empty() || a.prompt_tokens + a.decode_tokens > model.config.max_positions {
        bail!(
            "--prompt-tokens plus --decode-tokens must be 1 to {}",
            model.config.max_positions
        );
    }
    let mut results = Vec::new();
    for &t in &counts {
        let gemm = Gemm::new(kernel, t)?;
        let (mut pre, mut dec) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            let mut p = LocalPipeline::new(&model, 1)?;
            let s = Instant::now();
            let logits = p.prefill(&gemm, &prompt, 128)?;
            pre.push(prompt.len() as f64 / s.elapsed().as_secs_f64());
            let mut tok =
                dc_model::sampling::sample(&logits, &SamplingParams::default(), prompt.len())?;
            let s = Instant::now();
            for i in 0..a.decode_tokens {
                let l = p.forward(&gemm, &[tok], false)?;
                tok = dc_model::sampling::sample(
                    &l,
                    &SamplingParams::default(),
                    prompt.len() + i + 1,
                )?;
            }
            dec.push(a.decode_tokens as f64 / s.elapsed().as_secs_f64());
        }
        let (pre, dec) = (median(&mut pre), median(&mut dec));
        let committed = if a.commit {
            Some(committed_rates(&model, &gemm, &prompt, a.decode_tokens)?)
        } else {
            None
        };
        if let (Some([(pp, cp), (pd, cd)]), false) = (committed, a.json || global.quiet) {
            println!(
                "{} threads {t} with commitments (the layers alone, plain and committing taking \
                 turns hop by hop): prefill {cp:.1} tokens/s against {pp:.1} ({:.1} % slower), \
                 decode {cd:.1} tokens/s against {pd:.1} ({:.1} % slower)",
                kernel.name(),
                100.0 * (pp / cp - 1.0),
                100.0 * (pd / cd - 1.0)
            );
        }
        let spot = if a.spot_check {
            let daemon = dc_node::NodeConfig::new(path.clone(), std::env::temp_dir());
            // The bench's stage serves every layer; the rate goes through the shortest decimal
            // so 0.06 stays 0.06 rather than f32's widening.
            let rate = a
                .spot_check_rate
                .unwrap_or(daemon.spot_check_rate)
                .for_stage(&model.config, model.config.num_layers)
                .to_string()
                .parse()?;
            Some(spot_costs(&model, &gemm, &prompt, a.decode_tokens, rate)?)
        } else {
            None
        };
        if let (Some(c), false) = (&spot, a.json || global.quiet) {
            println!(
                "{} threads {t} spot checks: keeping decode hops {:.1} % slower than committing; \
                 per checked layer (each checked every {} tokens): reveal {:.0} µs + \
                 check {:.0} µs = {:.2} % of the layer's committed decode compute, {:.0} bytes \
                 on the wire; a layer's first check (its whole cache revealed): {:.0} µs, \
                 {:.0} bytes; checker built in {:.0} ms per layer (once)",
                kernel.name(),
                100.0 * (c.committed / c.kept - 1.0),
                c.gap,
                c.reveal * 1e6,
                c.check * 1e6,
                100.0 * (c.reveal + c.check) / c.layer,
                c.bytes,
                c.first_check * 1e6,
                c.first_bytes,
                c.build * 1e3
            );
            println!(
                "{} threads {t} spot checks at rate {}: {:.2} layers picked and {:.0} bytes on \
                 the wire per decode hop; revealed and checked {} hops at a time as a head \
                 does, reveals and checks {:.2} % of the committed decode compute (the \
                 stage's reveals {:.2} %, the head's checks {:.2} %)",
                kernel.name(),
                c.rate,
                c.policy_layers,
                c.policy_bytes,
                dc_node::check::spot::REVEAL_BATCH,
                100.0 * c.policy_share,
                100.0 * c.policy_reveal_share,
                100.0 * (c.policy_share - c.policy_reveal_share)
            );
            println!(
                "{} threads {t} spot checks at rate {} of the {}-row prefill hop: {} layers \
                 picked, each checked at every row; {:.0} bytes on the wire; reveals and checks \
                 {:.2} % of the committed prefill compute",
                kernel.name(),
                c.rate,
                prompt.len(),
                c.prefill_layers,
                c.prefill_bytes,
                100.0 * c.prefill_share
            );
        }
        if !a.json && !global.quiet {
            println!(
                "{} threads {t}: prefill {pre:.1} tokens/s ({} tokens), decode {dec:.1} tokens/s ({:.1} ms/token)",
                kernel.name(),
                prompt.len(),
                1e3 / dec
            );
        }
        results.push(json!({
            "kernel": kernel.name(), "threads": t,
            "prefill_tokens_per_s": pre, "decode_tokens_per_s": dec,
            "layers_prefill_tokens_per_s": committed.map(|c| c[0].0),
            "committed_prefill_tokens_per_s": committed.map(|c| c[0].1),
            "layers_decode_tokens_per_s": committed.map(|c| c[1].0),
            "committed_decode_tokens_per_s": committed.map(|c| c[1].1),
            "spot_check": spot.as_ref().map(|c| json!({
                "committed_decode_hops_per_s": c.committed, "kept_decode_hops_per_s": c.kept,
                "layer_decode_s": c.layer, "check_every_tokens": c.gap,
                "reveal_s": c.reveal, "check_s": c.check,
                "bytes_per_layer": c.bytes, "checker_build_s": c.build,
                "first_check_s": c.first_check, "first_bytes": c.first_bytes,
                "rate": c.rate, "rate_share_of_decode": c.policy_share,
                "rate_reveal_share_of_decode": c.policy_reveal_share,
                "rate_bytes_per_hop": c.policy_bytes, "rate_layers_per_hop": c.policy_layers,
                "rate_prefill_share": c.prefill_share, "rate_prefill_bytes": c.prefill_bytes,
                "rate_prefill_layers": c.prefill_layers,
            })),
            "prompt_tokens": prompt.len(), "decode_tokens": a.decode_tokens,
        }));
    }
    if a.json {
        println!("{}", json!({"model": path, "results": results}));
    }
    Ok(ExitCode::SUCCESS)
}
