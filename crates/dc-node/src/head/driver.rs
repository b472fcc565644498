//! The head's driver for one generation, as a state machine:
//!
//! ```text
//! route ──▶ laps (prefill) ──▶ sample ──▶ stream ──▶ lap ──▶ sample ──▶ … ──▶ end
//!   ▲                                                                          │
//!   └──────────── recompute without a proven liar or an unusable peer ◀────────┘
//! ```
//!
//! Each attempt plans a route (`plan.rs`), runs the prompt and then one token per lap through
//! it (`attempt.rs`, each hop checked by `hop.rs`), with a guess of the tokens after it when
//! the request speculates (the next lap starts where the sampler stopped agreeing with the
//! guess), samples with the request's seeded sampler, and streams each new token to the
//! client. At its end the attempt's spot checks and audits
//! are awaited: a lie they prove still changes what the client gets. Tokens the client already
//! holds are recomputed silently on a later attempt; if they come out differently, one
//! `Corrected` event says so.
//!
//! A generation taken over from a head that died arrives with the tokens the client holds
//! (`GenerationRequest::resume`). They are fed with the prompt as prefill, in chunks, and the
//! logits of every row from the prompt's last on re-derive each of them with the same seeded
//! sampler before anything new is streamed: prefill in any chunking gives the bits that one
//! token per lap gives, so the taken-over generation goes on exactly as the undisturbed one
//! would, at prefill speed. A token that does not re-derive sends the generation back to one
//! token per lap, and the client is corrected.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use dc_model::generate::{draft_room, logits_commitment, GenerateRequest, Next, TokenLoop};
use dc_model::sampling::logprobs as token_logprobs;
use dc_model::speculative::Speculator;
use dc_model::Activations;
use dc_types::{GenerationEvent, GenerationRequest, TokenLogprobs, VerifyMode, MAX_TOP_LOGPROBS};
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::attempt::Attempt;
use super::plan::{attempt_id, plan, sampling, PlanError};
use super::stop::{leave_out, Avoided, Stop};
use crate::core::SpotRate;
use crate::daemon::Daemon;

/// Most events queued towards a slow client before the head waits for it.
pub const EVENT_QUEUE: usize = 64;
/// How long the end of a generation waits for its pending audits.
const AUDIT_WAIT: Duration = Duration::from_secs(120);
/// Recomputations after proven lies before giving up.
const MAX_ATTEMPTS: usize = 4;

/// Heads `req`: streams [`GenerationEvent`]s into `tx` until `Done` or `Failed`.
pub async fn run_as_head(d: Daemon, req: GenerationRequest, tx: mpsc::Sender<GenerationEvent>) {
    d.node.stats.active_heads.fetch_add(1, Ordering::Relaxed);
    let result = drive(&d, &req, &tx).await;
    d.node.stats.active_heads.fetch_sub(1, Ordering::Relaxed);
    let ev = match result {
        Ok(ev) => ev,
        Err(message) => {
            warn!("generation {} failed: {message}", req.generation);
            GenerationEvent::Failed { message }
        }
    };
    let _ = tx.send(ev).await;
}

/// The generation, attempt after attempt, until one ends it.
async fn drive(
    d: &Daemon,
    req: &GenerationRequest,
    tx: &mpsc::Sender<GenerationEvent>,
) -> Result<GenerationEvent, String> {
    check_resume(d, req)?;
    if let Some(n) = req.top_logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
        return Err(format!(
            "the request asks for {n} top log-probabilities; at most {MAX_TOP_LOGPROBS}"
        ));
    }
    // What the client holds: a later attempt recomputes it silently, a taken-over generation's
    // first attempt re-derives it from prefill.
    let mut delivered = Delivered {
        tokens: req.resume.clone(),
        logprobs: vec![None; req.resume.len()],
    };
    let mut fast_forward = !delivered.tokens.is_empty();
    // Peers whose answers this generation could not use, and why: later attempts go without
    // them. Not an exclusion (nothing is proven, and other generations still use them).
    let mut avoid: Avoided = Vec::new();
    for n in 0..MAX_ATTEMPTS {
        // Route.
        let mut at = start_attempt(d, req, n, std::mem::take(&mut avoid), tx).await?;
        // Laps, sampling and streaming.
        let outcome = run_attempt(d, req, &mut at, tx, &mut delivered, fast_forward).await;
        fast_forward = false;
        // End: the attempt's checks, then its caches freed everywhere.
        let liar = end_attempt(d, &mut at, &outcome).await;
        avoid = std::mem::take(&mut at.avoid);
        match (outcome, liar) {
            (_, Some(l)) => {
                warn!(
                    "generation {}: {l} was proven to lie; recomputing without it",
                    req.generation
                );
            }
            (
                Err(Stop::Unusable {
                    peer,
                    why,
                    remember,
                }),
                None,
            ) => {
                warn!(
                    "generation {}: recomputing without {peer}: {why}",
                    req.generation
                );
                d.node.stats.reroutes.fetch_add(1, Ordering::Relaxed);
                leave_out(&d.node, &mut avoid, &peer, why, remember);
            }
            (Err(Stop::Diverged), None) => {
                warn!(
                    "generation {}: the tokens it was taken over with are not what this head \
                     derives; recomputing token by token",
                    req.generation
                );
            }
            (Ok(ev), None) => return Ok(ev),
            (Err(Stop::Failed(m)), None) | (Err(Stop::Liar(m)), None) => return Err(m),
        }
    }
    let why: String = avoid.iter().map(|(_, why)| format!("; {why}")).collect();
    Err(format!(
        "gave up after {MAX_ATTEMPTS} attempts: too many peers lied or failed{why}"
    ))
}

/// How long a generation waits for layers no one serves to be covered before it fails: three
/// peer timeouts (30 s by default), enough for a daemon to notice the loss and move.
fn coverage_wait(d: &Daemon) -> Duration {
    d.node.cfg.peer_timeout * 3
}

/// Refuses a taken-over generation whose transcript could not be this generation's.
fn check_resume(d: &Daemon, req: &GenerationRequest) -> Result<(), String> {
    let cfg = &d.node.model_cfg;
    let n = req.resume.len();
    if n > req.max_new_tokens as usize {
        return Err(format!(
            "the request resumes from {n} tokens of at most {}",
            req.max_new_tokens
        ));
    }
    if req.prompt.len() + n > cfg.max_positions {
        return Err(format!(
            "the prompt and the {n} tokens resumed from exceed the model's {} positions",
            cfg.max_positions
        ));
    }
    match req.resume.iter().find(|&&t| t as usize >= cfg.vocab_size) {
        Some(t) => Err(format!(
            "resumed token {t} is beyond the vocabulary of {}",
            cfg.vocab_size
        )),
        None => Ok(()),
    }
}

/// Plans attempt `n` without the `avoid`ed peers and tells the client its route.
/// Peers we reach only through a relay (slower: routes take them last).
async fn relayed_peers(d: &Daemon) -> HashSet<String> {
    let Ok(Ok(connections)) =
        tokio::time::timeout(Duration::from_secs(1), d.node.client.connections()).await
    else {
        return HashSet::new();
    };
    let direct: HashSet<String> = connections
        .iter()
        .filter(|c| c.kind == dc_net::ConnectionKind::Direct)
        .map(|c| c.peer.to_string())
        .collect();
    connections
        .iter()
        .map(|c| c.peer.to_string())
        .filter(|p| !direct.contains(p))
        .collect()
}

async fn start_attempt(
    d: &Daemon,
    req: &GenerationRequest,
    n: usize,
    avoid: Avoided,
    tx: &mpsc::Sender<GenerationEvent>,
) -> Result<Attempt, String> {
    let g = attempt_id(&req.generation, n);
    // Layers no one serves now may be covered soon (a daemon with room moves to them): wait.
    let deadline = Instant::now() + coverage_wait(d);
    let relayed = relayed_peers(d).await;
    let (route, shadows) = loop {
        match plan(d, req, &g, &avoid, &relayed) {
            Ok(planned) => break planned,
            Err(e @ PlanError::Uncovered(..)) if Instant::now() < deadline => {
                d.node.log_once(format!("wait:{g}"), || {
                    format!("generation {g} waits for coverage: {e}")
                });
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => return Err(e.to_string()),
        }
    };
    info!(
        "heading generation {g}: route {}",
        route
            .iter()
            .map(|h| format!("{}@{}", h.layers, &h.peer[h.peer.len().saturating_sub(6)..]))
            .collect::<Vec<_>>()
            .join(" → ")
    );
    let _ = tx
        .send(GenerationEvent::Started {
            head: d.node.local.clone(),
            route: route.clone(),
        })
        .await;
    let (rate, spot_rate) = match req.verify {
        VerifyMode::Sampled(r) => (r.clamp(0.0, 1.0), d.node.cfg.spot_check_rate),
        VerifyMode::All => (0.0, SpotRate::Fixed(0.0)),
    };
    Ok(Attempt::new(
        d,
        g,
        route,
        shadows,
        (rate, spot_rate),
        avoid,
        tx.clone(),
    ))
}

/// Ends an attempt: starts its last spot checks, waits for every check (a lie they prove
/// still changes what the client gets), frees its caches at every stage and auditor, and
/// returns the peer proven to lie, if any.
async fn end_attempt(
    d: &Daemon,
    at: &mut Attempt,
    outcome: &Result<GenerationEvent, Stop>,
) -> Option<String> {
    // The last hops' spot checks, fewer than a batch.
    for i in 0..at.route.len() {
        at.check_pending(d, i);
    }
    let pending = std::mem::take(&mut at.audits);
    let proven = tokio::time::timeout(AUDIT_WAIT, futures::future::join_all(pending)).await;
    at.end(d).await;
    match (outcome, proven) {
        (Err(Stop::Liar(l)), _) => Some(l.clone()),
        (_, Ok(results)) if results.iter().any(|r| matches!(r, Ok(true))) => {
            at.proven_liar(&d.node)
        }
        _ => None,
    }
}

/// What the client holds: the tokens, and beside each its log-probabilities when they were
/// asked for and sent from here (not for the tokens a generation was taken over with).
struct Delivered {
    tokens: Vec<u32>,
    logprobs: Vec<Option<TokenLogprobs>>,
}

impl Delivered {
    /// The first position where `tokens` (with `logprobs`, when asked for) differ from what
    /// the client holds: a lie that left the tokens alone still changed their probabilities.
    fn first_difference(&self, tokens: &[u32], logprobs: &[TokenLogprobs]) -> Option<usize> {
        let held = self.tokens.iter().zip(&self.logprobs);
        held.zip(tokens)
            .enumerate()
            .position(|(i, ((a, lp), b))| {
                a != b || lp.as_ref().is_some_and(|lp| logprobs.get(i) != Some(lp))
            })
            .or((self.tokens.len() != tokens.len()).then_some(self.tokens.len().min(tokens.len())))
    }
}

/// One pass over the generation: the prompt's laps, then sample → stream → lap until the
/// sampler stops. Tokens already `delivered` by an earlier attempt are recomputed silently;
/// if the new ones differ, one `Corrected` event carries them. With `fast_forward` they are
/// fed as prefill with the prompt and re-derived from its rows' logits instead.
async fn run_attempt(
    d: &Daemon,
    req: &GenerationRequest,
    at: &mut Attempt,
    tx: &mpsc::Sender<GenerationEvent>,
    delivered: &mut Delivered,
    fast_forward: bool,
) -> Result<GenerationEvent, Stop> {
    let greq = local_request(d, req)?;
    let mut tl =
        TokenLoop::new(&greq, d.node.model_cfg.max_positions).map_err(|e| e.to_string())?;
    let replay = delivered.tokens.len();
    let known: Vec<u32> = if fast_forward {
        delivered.tokens.clone()
    } else {
        Vec::new()
    };
    // Prefill: the logits of the rows that sample the first token and re-derive the known ones.
    let fed = [&greq.prompt[..], &known[..]].concat();
    let mut derived = prefill(
        d,
        at,
        &fed,
        greq.chunk,
        greq.prompt.len(),
        !known.is_empty(),
    )
    .await?;
    let mut step = fed.chunks(greq.chunk).len() as u64;
    let (mut at_pos, mut logits) = derived
        .pop_front()
        .ok_or_else(|| Stop::Failed("an empty prompt".into()))?;
    // Guesses of the tokens ahead (speculative.rs): each lap runs the token just sampled and a
    // guess after it, and `derived` holds the rows of the guessed positions not sampled yet.
    let mut spec = Speculator::new(greq.speculative, &greq.prompt);
    // The log-probabilities of every token produced, when asked for (a correction resends
    // them with its tokens).
    let mut logprobs: Vec<TokenLogprobs> = Vec::new();
    let why = loop {
        // Sample.
        let (t, done) = match tl.next(&logits).map_err(|e| e.to_string())? {
            Next::Feed(t) => (Some(t), None),
            Next::Last(t, why) => (Some(t), Some(why)),
            Next::Done(why) => (None, Some(why)),
        };
        let produced = tl.tokens.len();
        if t.is_some() && produced <= known.len() && tl.tokens[produced - 1] != known[produced - 1]
        {
            return Err(Stop::Diverged);
        }
        // A token the lap did not guess: the rows it ran after the guess are not this text's.
        if t.is_some_and(|t| !spec.produced(t)) {
            derived.clear();
        }
        if let (Some(t), Some(n)) = (t, req.top_logprobs) {
            logprobs.push(token_logprobs(&logits, t, n as usize));
        }
        // Stream what the client does not hold yet.
        if let (Some(t), true) = (t, produced > replay) {
            d.node.stats.tokens.fetch_add(1, Ordering::Relaxed);
            delivered.tokens.push(t);
            delivered.logprobs.push(logprobs.last().cloned());
            let ev = GenerationEvent::Token {
                index: produced as u32 - 1,
                id: t,
                logprobs: logprobs.last().cloned(),
            };
            if tx.send(ev).await.is_err() {
                return Err(Stop::Failed("the client went away".into()));
            }
        }
        // The recomputation has caught up with what the client holds: say what changed.
        if produced == replay || (done.is_some() && produced < replay) {
            correct(d, tx, delivered, &tl.tokens, &logprobs).await?;
        }
        if let Some(why) = done {
            let s = spec.stats;
            d.node
                .stats
                .guessed
                .fetch_add(s.drafted as u64, Ordering::Relaxed);
            d.node
                .stats
                .guesses_kept
                .fetch_add(s.accepted as u64, Ordering::Relaxed);
            break why;
        }
        // The next logits: re-derived from prefill, guessed in the last lap, or a new lap.
        (at_pos, logits) = match derived.pop_front() {
            Some(row) => row,
            None => {
                let left = greq.max_new_tokens - tl.tokens.len();
                derived = guessing_lap(d, at, step, &mut spec, at_pos, left).await?;
                step += 1;
                derived
                    .pop_front()
                    .ok_or_else(|| Stop::Failed("no logits".into()))?
            }
        };
    };
    let stop = serde_json::to_value(why)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    Ok(GenerationEvent::Done {
        tokens: tl.tokens.clone(),
        stop,
        final_logits: logits_commitment(at_pos, &logits),
    })
}

/// `req` as the sampling loop takes it (the one a local run uses).
fn local_request(d: &Daemon, req: &GenerationRequest) -> Result<GenerateRequest, Stop> {
    Ok(GenerateRequest {
        prompt: req.prompt.clone(),
        max_new_tokens: req.max_new_tokens as usize,
        sampling: sampling(req),
        stop_tokens: req.stop_tokens.clone(),
        chunk: req.chunk.max(1) as usize,
        json: d.node.json_output(&req.output).map_err(Stop::Failed)?,
        speculative: req.speculative,
    })
}

/// Runs `fed` (the prompt, then any tokens the client holds) through the route in chunks of
/// `chunk`, and returns the logits, with their positions, of the rows that sample: the last
/// row only, or with `every_row` every row from the prompt's last (`prompt_len - 1`) on.
async fn prefill(
    d: &Daemon,
    at: &mut Attempt,
    fed: &[u32],
    chunk: usize,
    prompt_len: usize,
    every_row: bool,
) -> Result<VecDeque<(usize, Vec<f32>)>, Stop> {
    let mut rows = VecDeque::new();
    let mut pos = 0;
    for (step, c) in fed.chunks(chunk).enumerate() {
        let end = pos + c.len();
        let from = match every_row {
            true => prompt_len.saturating_sub(1).max(pos),
            false => end - 1,
        };
        let got = lap(
            d,
            at,
            step as u64,
            c.to_vec(),
            pos,
            from.min(end - 1),
            false,
        )
        .await?;
        if !every_row {
            rows.clear();
        }
        rows.extend(got.into_iter().filter(|(p, _)| *p >= from));
        pos = end;
    }
    Ok(rows)
}

/// Lap `step`: the token just sampled from the row at `at_pos`, at the position after it, and
/// `spec`'s guess of the tokens after that (with `left` tokens still to produce); the logits
/// of every row, each with its position.
async fn guessing_lap(
    d: &Daemon,
    at: &mut Attempt,
    step: u64,
    spec: &mut Speculator,
    at_pos: usize,
    left: usize,
) -> Result<VecDeque<(usize, Vec<f32>)>, Stop> {
    let room = draft_room(left, d.node.model_cfg.max_positions, at_pos);
    let tokens = spec.next_pass(room);
    let guessed = tokens.len() > 1;
    lap(d, at, step, tokens, at_pos + 1, at_pos + 1, guessed).await
}

/// Embeds `tokens` at `pos`, runs them through the route as hop `step` (`guessed`: tokens
/// after the first are a guess), and reads out the logits of the rows from position `from` on,
/// each with its position.
async fn lap(
    d: &Daemon,
    at: &mut Attempt,
    step: u64,
    tokens: Vec<u32>,
    pos: usize,
    from: usize,
    guessed: bool,
) -> Result<VecDeque<(usize, Vec<f32>)>, Stop> {
    let x = embed(d, tokens, pos).await?;
    let y = at.lap(d, step, x, guessed).await?;
    Ok(readout(d, y.rows_from(from)).await?)
}

/// Embeds `tokens` at `start` (head weights, compute pool).
async fn embed(d: &Daemon, tokens: Vec<u32>, start: usize) -> Result<Activations, String> {
    let serving = d.node.serving().ok_or("not serving yet")?;
    tokio::task::spawn_blocking(move || {
        serving
            .model
            .embed(&tokens, start)
            .map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Logits of every row of `x`, each with its position.
async fn readout(d: &Daemon, x: Activations) -> Result<VecDeque<(usize, Vec<f32>)>, String> {
    let serving = d.node.serving().ok_or("not serving yet")?;
    let (gemm, vocab) = (d.node.gemm.clone(), d.node.model_cfg.vocab_size);
    tokio::task::spawn_blocking(move || {
        let logits = serving
            .model
            .readout(&gemm, &x)
            .map_err(|e| e.to_string())?;
        Ok(logits
            .chunks(vocab.max(1))
            .enumerate()
            .map(|(i, row)| (x.start + i, row.to_vec()))
            .collect())
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Compares the recomputed tokens with what the client holds and sends the correction.
async fn correct(
    d: &Daemon,
    tx: &mpsc::Sender<GenerationEvent>,
    delivered: &mut Delivered,
    new: &[u32],
    logprobs: &[TokenLogprobs],
) -> Result<(), Stop> {
    let Some(from) = delivered.first_difference(new, logprobs) else {
        return Ok(());
    };
    let liar = d.checks.last_excluded().unwrap_or_default();
    d.node.stats.corrections.fetch_add(1, Ordering::Relaxed);
    let ev = GenerationEvent::Corrected {
        from: from as u32,
        tokens: new[from..].to_vec(),
        logprobs: logprobs.get(from..).map_or_else(Vec::new, <[_]>::to_vec),
        liar,
    };
    delivered.tokens = new.to_vec();
    delivered.logprobs = (0..new.len()).map(|i| logprobs.get(i).cloned()).collect();
    tx.send(ev)
        .await
        .map_err(|_| Stop::Failed("the client went away".into()))
}
