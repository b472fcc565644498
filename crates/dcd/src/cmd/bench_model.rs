//! `dcd bench model`: prefill and decode rates of a model in this process at each thread
//! count, decode also as the weights' share of the read bandwidth measured around it; with
//! `--commit`, what committing to every product costs; with `--spot-check`, what keeping hops,
//! revealing and checking them costs, one layer at a time and at the daemon's spot-check rate.
//! It measures and prints; the stage and checker code it times is the daemon's own.

use std::collections::VecDeque;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use dc_kernels::bench::read_bandwidth_gbs;
use dc_kernels::{Gemm, Kernel};
use dc_model::attention::LayerCache;
use dc_model::generate::LocalPipeline;
use dc_model::sampling::SamplingParams;
use dc_model::trace::HopTrace;
use dc_model::{CacheLog, KeptHop, KvCache, LayerChecker, Model};
use dc_types::{CheckSet, Point};
use serde_json::{json, Value};

use super::bench::COLD_BYTES;
use super::local::model_path;
use crate::cli::{BenchModelArgs, Global};

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
    let quiet = a.json || global.quiet;
    let mut results = Vec::new();
    for &t in &counts {
        let gemm = Gemm::new(kernel, t)?;
        let bandwidth_before = read_bandwidth_gbs(t, COLD_BYTES, Duration::from_secs(1));
        let (pre, dec) = plain_rates(&model, &gemm, &prompt, a.decode_tokens)?;
        // Decode streams every weight once per token: its rate against the read bandwidth
        // measured around it, with as many threads, is how close it comes to the machine's
        // bound. The larger of the two measurements, so a noisy moment cannot flatter it.
        let bandwidth =
            bandwidth_before.max(read_bandwidth_gbs(t, COLD_BYTES, Duration::from_secs(1)));
        let weight_gbs = dec * model.decode_bytes() as f64 / 1e9;
        let committed = if a.commit {
            Some(committed_rates(&model, &gemm, &prompt, a.decode_tokens)?)
        } else {
            None
        };
        if let (Some(rates), false) = (committed, quiet) {
            print_committed(kernel, t, rates);
        }
        let spot = if a.spot_check {
            let rate = spot_rate(a, &path, &model)?;
            Some(spot_costs(&model, &gemm, &prompt, a.decode_tokens, rate)?)
        } else {
            None
        };
        if let (Some(c), false) = (&spot, quiet) {
            c.print(kernel, t, prompt.len());
        }
        if !quiet {
            println!(
                "{} threads {t}: prefill {pre:.1} tokens/s ({} tokens), decode {dec:.1} \
                 tokens/s ({:.1} ms/token, weights at {weight_gbs:.1} GB/s: {:.1} % of the \
                 read bandwidth, {bandwidth:.1} GB/s)",
                kernel.name(),
                prompt.len(),
                1e3 / dec,
                100.0 * weight_gbs / bandwidth
            );
        }
        results.push(json!({
            "kernel": kernel.name(), "threads": t,
            "prefill_tokens_per_s": pre, "decode_tokens_per_s": dec,
            "decode_weight_bytes": model.decode_bytes(), "read_bandwidth_gbs": bandwidth,
            "decode_share_of_bandwidth": weight_gbs / bandwidth,
            "layers_prefill_tokens_per_s": committed.map(|c| c[0].0),
            "committed_prefill_tokens_per_s": committed.map(|c| c[0].1),
            "layers_decode_tokens_per_s": committed.map(|c| c[1].0),
            "committed_decode_tokens_per_s": committed.map(|c| c[1].1),
            "spot_check": spot.as_ref().map(SpotCosts::json),
            "prompt_tokens": prompt.len(), "decode_tokens": a.decode_tokens,
        }));
    }
    if a.json {
        println!("{}", json!({"model": path, "results": results}));
    }
    Ok(ExitCode::SUCCESS)
}

/// Prefill and decode rates of the whole pipeline, tokens per second (medians of three runs,
/// each decoding `decode` tokens sampled from the logits).
pub(super) fn plain_rates(
    model: &Model,
    gemm: &Gemm,
    prompt: &[u32],
    decode: usize,
) -> Result<(f64, f64)> {
    let (mut pre, mut dec) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let mut p = LocalPipeline::new(model, 1)?;
        let s = Instant::now();
        let logits = p.prefill(gemm, prompt, 128)?;
        pre.push(prompt.len() as f64 / s.elapsed().as_secs_f64());
        let mut tok =
            dc_model::sampling::sample(&logits, &SamplingParams::default(), prompt.len())?;
        let s = Instant::now();
        for i in 0..decode {
            let l = p.forward(gemm, &[tok], false)?;
            tok = dc_model::sampling::sample(&l, &SamplingParams::default(), prompt.len() + i + 1)?;
        }
        dec.push(decode as f64 / s.elapsed().as_secs_f64());
    }
    Ok((median(&mut pre), median(&mut dec)))
}

/// `committed_rates`' figures as one line.
fn print_committed(kernel: Kernel, t: usize, [(pp, cp), (pd, cd)]: [(f64, f64); 2]) {
    println!(
        "{} threads {t} with commitments (the layers alone, plain and committing taking \
         turns hop by hop): prefill {cp:.1} tokens/s against {pp:.1} ({:.1} % slower), \
         decode {cd:.1} tokens/s against {pd:.1} ({:.1} % slower)",
        kernel.name(),
        100.0 * (pp / cp - 1.0),
        100.0 * (pd / cd - 1.0)
    );
}

/// The spot-check rate to measure: `--spot-check-rate`, else the daemon's default, for a
/// stage serving every layer. It goes through the shortest decimal so 0.06 stays 0.06 rather
/// than f32's widening.
fn spot_rate(a: &BenchModelArgs, path: &std::path::Path, model: &Model) -> Result<f64> {
    let daemon = dc_node::NodeConfig::new(path.to_path_buf(), std::env::temp_dir());
    Ok(a.spot_check_rate
        .unwrap_or(daemon.spot_check_rate)
        .for_stage(&model.config, model.config.num_layers)
        .to_string()
        .parse()?)
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

impl SpotCosts {
    /// The three lines `bench model --spot-check` prints for thread count `t`.
    fn print(&self, kernel: Kernel, t: usize, prompt_len: usize) {
        let c = self;
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
            prompt_len,
            c.prefill_layers,
            c.prefill_bytes,
            100.0 * c.prefill_share
        );
    }

    /// The `spot_check` object of a `--json` result.
    fn json(&self) -> Value {
        let c = self;
        json!({
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
        })
    }
}

/// Tokens between two checks of one layer in the spot-check benchmark (as at a rate of 0.1).
const SPOT_GAP: usize = 10;

/// What every spot check of the benchmark reads: the model and engine, each layer's checker,
/// the parts a check can test (and all of them at once), and where decoding starts.
struct Checking<'a> {
    model: &'a Model,
    gemm: &'a Gemm,
    checkers: Vec<LayerChecker>,
    parts: Vec<Point>,
    every: CheckSet,
    prompt_len: usize,
}

/// The per-token samples of the decode hops, seconds and wire bytes.
#[derive(Default)]
struct Samples {
    committed: Vec<f64>,
    kept: Vec<f64>,
    reveal: Vec<f64>,
    check: Vec<f64>,
    bytes: Vec<f64>,
    first_check: Vec<f64>,
    first_bytes: Vec<f64>,
}

impl Samples {
    /// One layer check's reveal and check seconds and wire bytes; a layer's first check
    /// (its whole cache revealed) is counted apart.
    fn checked(&mut self, first: bool, revealed: f64, checked: f64, size: f64) {
        if first {
            self.first_check.push(checked);
            self.first_bytes.push(size);
        } else {
            self.reveal.push(revealed);
            self.check.push(checked);
            self.bytes.push(size);
        }
    }
}

/// The policy's totals: reveal-and-check seconds (and of them the stage's reveals), wire
/// bytes and picked layers.
#[derive(Default)]
struct PolicyTally {
    seconds: f64,
    reveal_seconds: f64,
    bytes: f64,
    layers: usize,
}

/// A drawn hop waiting for its batch: its position and each picked layer's checks.
type Pending = (usize, Vec<(usize, CheckSet)>);

fn spot_costs(
    model: &Model,
    gemm: &Gemm,
    prompt: &[u32],
    decode: usize,
    rate: f64,
) -> Result<SpotCosts> {
    let n = model.config.num_layers;
    let parts = dc_model::check_parts(&model.config);
    let every = CheckSet::of(&parts);
    let mut coins = dc_kernels::rng::SplitMix64::new(7);
    let mut policy = PolicyTally::default();
    let layers = 0..n;
    let s = Instant::now();
    let checkers = layers
        .clone()
        .map(|l| LayerChecker::new(model, l, &[9; 32]))
        .collect::<dc_model::Result<Vec<_>>>()?;
    let build = s.elapsed().as_secs_f64() / n as f64;
    let cx = Checking {
        model,
        gemm,
        checkers,
        parts,
        every,
        prompt_len: prompt.len(),
    };
    let gap = SPOT_GAP.min(n);
    let mut samples = Samples::default();
    // What the checker verified of each layer's cache so far.
    let mut known: Vec<_> = layers
        .clone()
        .map(|_| LayerCache::new(model.config.num_kv_heads, model.config.head_dim))
        .collect();
    let mut policy_known = known.clone();
    // Two stages over the same positions, one committing and one also keeping, taking turns
    // token by token so the machine's drift hits both alike.
    let mut caches = [0, 1].map(|_| KvCache::new(&model.config, layers.clone()));
    // The keeping stage's hops and cache rows: a check ties the revealed cache to every hop.
    let mut log = CacheLog::default();
    let (prefill_s, prefill_kept, prefill_trace) = prefill_both(model, gemm, prompt, &mut caches)?;
    let mut hops = vec![(prefill_trace, prompt.len())];
    log.record(&caches[1]);
    let prefill = prefill_policy(&cx, &prefill_kept, &hops, &log, rate)?;
    drop(prefill_kept);
    let mut window = VecDeque::with_capacity(dc_node::stage::KEPT_HOPS);
    // The policy's drawn hops not yet revealed and checked: a head asks about a batch at once.
    let mut pending: Vec<Pending> = Vec::with_capacity(dc_node::check::spot::REVEAL_BATCH);
    for i in 0..decode {
        let pos = prompt.len() + i;
        let (plain_s, kept_s, t, hop) =
            decode_turn(&cx, &mut caches, &mut log, &mut window, pos, i % 2 == 1)?;
        samples.committed.push(plain_s);
        samples.kept.push(kept_s);
        hops.push((t, 1));
        // SPOT_GAP layers spread over the model take turns (every layer, if it has fewer).
        let l = (i % gap) * n / gap;
        let first = known[l].is_empty();
        let (revealed, checked, size) = check_layer(&cx, &hop, l, pos, &mut known[l], &log, &hops)?;
        // The policy, as a head runs it: each layer's parts drawn on every hop as a head
        // draws them, then every `REVEAL_BATCH` hops the stage revealing the batch's picks in
        // one go and the head checking them hop by hop. So the memory each side finds is a
        // daemon's: the kept hops up to a batch old when revealed, the checks' code warm after
        // the batch's first hop.
        let picks: Vec<_> = layers
            .clone()
            .map(|l| (l, dc_model::draw_checks(&cx.parts, rate, || coins.unit())))
            .filter(|(_, checks)| !checks.is_empty())
            .collect();
        window.push_back(hop);
        pending.push((pos, picks));
        if pending.len() == dc_node::check::spot::REVEAL_BATCH || i + 1 == decode {
            policy_batch(
                &cx,
                &mut policy_known,
                &window,
                &pending,
                &hops,
                &log,
                &mut policy,
            )?;
            pending.clear();
        }
        samples.checked(first, revealed, checked, size);
    }
    if samples.check.is_empty() {
        anyhow::bail!("--spot-check needs more than {gap} --decode-tokens");
    }
    let s = &mut samples;
    let committed_s: f64 = s.committed.iter().sum();
    let committed = median(&mut s.committed);
    Ok(SpotCosts {
        rate,
        policy_share: policy.seconds / committed_s,
        policy_reveal_share: policy.reveal_seconds / committed_s,
        prefill_share: prefill.0 / prefill_s,
        prefill_bytes: prefill.1,
        prefill_layers: prefill.2,
        policy_bytes: policy.bytes / decode as f64,
        policy_layers: policy.layers as f64 / decode as f64,
        committed: 1.0 / committed,
        kept: 1.0 / median(&mut s.kept),
        layer: committed / n as f64,
        gap,
        reveal: median(&mut s.reveal),
        check: median(&mut s.check),
        bytes: median(&mut s.bytes),
        first_check: median(&mut s.first_check),
        first_bytes: median(&mut s.first_bytes),
        build,
    })
}

/// The prompt's prefill hop on both stages: the committing one timed, then the keeping one.
/// Returns the committing hop's seconds, the kept hop and the keeping stage's trace.
fn prefill_both(
    model: &Model,
    gemm: &Gemm,
    prompt: &[u32],
    caches: &mut [KvCache; 2],
) -> Result<(f64, KeptHop, HopTrace)> {
    let [plain_cache, kept_cache] = caches;
    let mut t = HopTrace::from_position(0);
    let x = model.embed(prompt, 0)?;
    let s = Instant::now();
    model.run_layers_traced(gemm, x, plain_cache, Some(&mut t))?;
    let prefill_s = s.elapsed().as_secs_f64();
    let mut t = HopTrace::from_position(0);
    let x = model.embed(prompt, 0)?;
    let (_, kept) = model.run_layers_kept(gemm, x, kept_cache, &mut t)?;
    Ok((prefill_s, kept, t))
}

/// The policy on the prefill hop (coins of their own, so the decode figures draw as before):
/// a picked layer's drawn parts at every row, from a checker holding no cache. Returns the
/// reveal-and-check seconds, wire bytes and picked layers.
fn prefill_policy(
    cx: &Checking<'_>,
    kept: &KeptHop,
    hops: &[(HopTrace, usize)],
    log: &CacheLog,
    rate: f64,
) -> Result<(f64, f64, usize)> {
    let (model, rows) = (cx.model, cx.prompt_len);
    let (mut seconds, mut bytes, mut layers) = (0.0, 0.0, 0);
    let mut coins = dc_kernels::rng::SplitMix64::new(11);
    let views: Vec<_> = hops.iter().map(|(t, n)| (t, *n)).collect();
    for l in 0..model.config.num_layers {
        let checks = dc_model::draw_checks(&cx.parts, rate, || coins.unit());
        if checks.is_empty() {
            continue;
        }
        let s = Instant::now();
        let r = kept
            .reveal_rows(l, 0, rows, checks, 0, log)
            .map_err(|e| anyhow::anyhow!("reveal: {e}"))?;
        let mut cache = LayerCache::new(model.config.num_kv_heads, model.config.head_dim);
        cx.gemm
            .install(|| {
                cx.checkers[l].check_rows_in_place(model, &views, &mut cache, &r, checks, rows)
            })
            .map_err(|e| anyhow::anyhow!("an honest prefill spot check failed: {e}"))?;
        seconds += s.elapsed().as_secs_f64();
        bytes += dc_types::encode(&r, usize::MAX)?.len() as f64;
        layers += 1;
    }
    Ok((seconds, bytes, layers))
}

/// One decode hop at `pos` on both stages. The two take turns going first (`kept_first`), so
/// that neither always finds the memory the other (or the checks) left. Returns the
/// committing hop's seconds, the keeping hop's seconds, its trace and the kept hop.
fn decode_turn(
    cx: &Checking<'_>,
    caches: &mut [KvCache; 2],
    log: &mut CacheLog,
    window: &mut VecDeque<KeptHop>,
    pos: usize,
    kept_first: bool,
) -> Result<(f64, f64, HopTrace, KeptHop)> {
    let (model, gemm) = (cx.model, cx.gemm);
    let x = model.embed(&[(pos % 100) as u32], pos)?;
    let [plain_cache, kept_cache] = caches;
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
    let (plain_s, (kept_s, t, hop)) = if kept_first {
        let k = run_kept()?;
        (run_committed()?, k)
    } else {
        (run_committed()?, run_kept()?)
    };
    Ok((plain_s, kept_s, t, hop))
}

/// Layer `l`'s every part checked on the decode hop at `pos`, holding the cache rows
/// verified before (`known`, extended here). Returns the reveal's seconds, the check's
/// seconds and the reveal's wire bytes.
fn check_layer(
    cx: &Checking<'_>,
    hop: &KeptHop,
    l: usize,
    pos: usize,
    known: &mut LayerCache,
    log: &CacheLog,
    hops: &[(HopTrace, usize)],
) -> Result<(f64, f64, f64)> {
    let s = Instant::now();
    let r = hop
        .reveal(l, pos, cx.every, known.len(), log)
        .map_err(|e| anyhow::anyhow!("reveal: {e}"))?;
    let revealed = s.elapsed().as_secs_f64();
    let size = dc_types::encode(&r, usize::MAX)?.len() as f64;
    let s = Instant::now();
    let views: Vec<_> = hops.iter().map(|(t, n)| (t, *n)).collect();
    // On the engine's threads, as a head runs its checks.
    cx.gemm
        .install(|| cx.checkers[l].check_in_place(cx.model, &views, known, &r, cx.every))
        .map_err(|e| anyhow::anyhow!("an honest spot check failed: {e}"))?;
    Ok((revealed, s.elapsed().as_secs_f64(), size))
}

/// The policy's batch of `pending` hops, as a head asks about them: the stage reveals the
/// batch's picks in one go (from the kept hops in `window`, the last being the newest), then
/// the head checks them hop by hop, each hop's picks on the engine's threads (one hand-over
/// to the pool per hop). `known` is what the policy's checker verified of each layer's cache.
fn policy_batch(
    cx: &Checking<'_>,
    known: &mut [LayerCache],
    window: &VecDeque<KeptHop>,
    pending: &[Pending],
    hops: &[(HopTrace, usize)],
    log: &CacheLog,
    tally: &mut PolicyTally,
) -> Result<()> {
    // The newest hop's position (`window`'s last).
    let Some(&(now, _)) = pending.last() else {
        return Ok(());
    };
    let views: Vec<_> = hops.iter().map(|(t, n)| (t, *n)).collect();
    let s = Instant::now();
    // Each attention pick asks for the cache rows after those verified before the batch, or
    // after its layer's earlier pick in the batch (which extends them).
    let mut verified_to: Vec<usize> = known.iter().map(|c| c.len()).collect();
    let reveals = pending
        .iter()
        .map(|(pos, picks)| {
            let hop = &window[window.len() - 1 - (now - pos)];
            picks
                .iter()
                .map(|&(l, checks)| {
                    let from = verified_to[l].min(*pos);
                    if checks.attention() {
                        verified_to[l] = pos + 1;
                    }
                    hop.reveal(l, *pos, checks, from, log)
                })
                .collect::<std::result::Result<Vec<_>, _>>()
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("reveal: {e}"))?;
    tally.reveal_seconds += s.elapsed().as_secs_f64();
    for ((pos, picks), reveals) in pending.iter().zip(&reveals) {
        // The hops up to this one (a check takes the last as the hop it checks).
        let views = &views[..pos - cx.prompt_len + 2];
        // Picks are of different layers, in layer order: each takes its layer's cache.
        let mut wanted = picks.iter().zip(reveals).peekable();
        let mut jobs = Vec::with_capacity(picks.len());
        for (l, cache) in known.iter_mut().enumerate() {
            if let Some((&(_, checks), r)) = wanted.next_if(|((pl, _), _)| *pl == l) {
                jobs.push((&cx.checkers[l], r, checks, 1, cache));
            }
        }
        let results = cx
            .gemm
            .install(|| dc_model::check_picks(cx.model, views, jobs));
        for (&(_, checks), done) in picks.iter().zip(results) {
            done.map_err(|e| anyhow::anyhow!("an honest spot check of {checks:?} failed: {e}"))?;
        }
        tally.layers += picks.len();
    }
    tally.seconds += s.elapsed().as_secs_f64();
    for r in reveals.iter().flatten() {
        tally.bytes += dc_types::encode(r, usize::MAX)?.len() as f64;
    }
    Ok(())
}

pub(super) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
