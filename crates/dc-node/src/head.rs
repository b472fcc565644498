//! Heading a generation: choosing the route, running prefill and one token per lap through the
//! stages (local ones in this process, remote ones over the network), checking every stage's
//! signed record and trace, auditing hops (or, with `VerifyMode::All`, running every hop twice),
//! sampling, streaming the tokens back — and, when a stage is proven to have lied, recomputing
//! the generation without it and telling the client which tokens changed.

use std::sync::Arc;
use std::time::Duration;

use dc_model::generate::{logits_commitment, GenerateRequest, Next, TokenLoop};
use dc_model::sampling::SamplingParams;
use dc_model::Activations;
use dc_types::{
    Commitment, FraudProof, GenerationEvent, GenerationId, GenerationRequest, HopRecord,
    HopRequest, HopResponse, HopTrace, ProofKind, RouteHop, Signed, StageRequest, StageResponse,
    VerifyMode,
};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::audit::{accept_proof, audit, pick_peer, referee, should_audit, AuditSession, StageLog};
use crate::node::Node;
use crate::spot;
use crate::stage::{from_wire, serve_own_hop, to_wire};
use crate::verify::check_consistency;
use crate::view::plan_route;

/// Most events queued towards a slow client before the head waits for it.
pub const EVENT_QUEUE: usize = 64;
/// How long the end of a generation waits for its pending audits.
const AUDIT_WAIT: Duration = Duration::from_secs(120);
/// Recomputations after proven lies before giving up.
const MAX_ATTEMPTS: usize = 4;

fn sampling(req: &GenerationRequest) -> SamplingParams {
    SamplingParams {
        temperature: req.sampling.temperature,
        top_k: (req.sampling.top_k > 0).then_some(req.sampling.top_k as usize),
        top_p: (req.sampling.top_p < 1.0).then_some(req.sampling.top_p),
        seed: req.sampling.seed,
    }
}

/// Why an attempt stopped.
enum Stop {
    /// A stage was proven to lie: recompute without it.
    Liar(String),
    /// A peer's answer to a hop could not be used (it failed, refused, went away, or broke the
    /// protocol in a way no proof can show): recompute without it, excluding no one.
    Unusable {
        /// The peer.
        peer: String,
        /// What was wrong, for the logs and the final error.
        why: String,
        /// Whether later generations should avoid the peer for a while too (not when it was
        /// only busy).
        remember: bool,
    },
    /// Anything else ends the generation.
    Failed(String),
}

/// The answer of `peer` could not be used because of `why`.
fn unusable(peer: &str, why: String) -> Stop {
    Stop::Unusable {
        peer: peer.to_string(),
        why,
        remember: true,
    }
}

/// Peers a generation goes on without, each with why.
type Avoided = Vec<(String, String)>;

/// Whether `peer` is among the `avoid`ed.
fn avoided(avoid: &[(String, String)], peer: &str) -> bool {
    avoid.iter().any(|(p, _)| p == peer)
}

/// Leaves `peer` out of the rest of the generation and, if `remember`, out of this head's
/// routes for a while (where others serve its layers).
fn leave_out(node: &Node, avoid: &mut Avoided, peer: &str, why: String, remember: bool) {
    if remember && peer != node.local {
        node.mark_unusable(peer);
    }
    if !avoided(avoid, peer) {
        avoid.push((peer.to_string(), why));
    }
}

impl From<String> for Stop {
    fn from(s: String) -> Stop {
        Stop::Failed(s)
    }
}

/// A stage's answer to one hop, checked.
struct HopResult {
    output: Activations,
    record: Signed<HopRecord>,
    trace: HopTrace,
}

/// Runs one hop on `peer` (ourselves or remote) and checks the answer: signature, fields, input
/// and output commitments, the chain of inputs (`previous`: what the stage's last record of
/// this generation chains to), and the trace against the record. A record that contradicts its
/// own trace is a proof by itself: the peer is excluded on the spot.
async fn hop_on(
    node: &Arc<Node>,
    peer: &str,
    layers: dc_types::LayerRange,
    g: GenerationId,
    step: u64,
    x: &Activations,
    previous: Commitment,
) -> Result<HopResult, Stop> {
    let req = HopRequest {
        model_id: node.model_id,
        generation: g,
        step,
        layers,
        activations: to_wire(x),
    };
    let resp = if peer == node.local {
        serve_own_hop(node.clone(), req).await
    } else {
        let p: libp2p::PeerId = peer
            .parse()
            .map_err(|e| unusable(peer, format!("route peer {peer}: {e}")))?;
        match node.client.stage_request(p, StageRequest::Hop(req)).await {
            Ok(StageResponse::Hop(r)) => *r,
            Ok(_) => {
                return Err(unusable(
                    peer,
                    format!("peer {peer} answered a hop with something else"),
                ))
            }
            Err(e) => {
                return Err(unusable(
                    peer,
                    format!("hop to {peer} (layers {layers}) failed: {e}"),
                ))
            }
        }
    };
    let (activations, record, trace) = match resp {
        HopResponse::Done {
            activations,
            record,
            trace,
        } => (activations, record, trace),
        HopResponse::Refused { kind, message } => {
            return Err(Stop::Unusable {
                peer: peer.to_string(),
                why: format!("peer {peer} refused layers {layers}: {kind:?}: {message}"),
                remember: kind != dc_types::HopErrorKind::Overloaded,
            })
        }
    };
    let signer = dc_net::signing::verify(dc_types::HOP_RECORD_KIND, &record)
        .map_err(|e| unusable(peer, format!("peer {peer}: bad hop record: {e}")))?;
    if signer.to_string() != peer {
        return Err(unusable(
            peer,
            format!("peer {peer} sent a record signed by {signer}"),
        ));
    }
    let y = from_wire(
        activations,
        node.model_cfg.hidden_size,
        node.model_cfg.max_positions,
    )
    .map_err(|e| unusable(peer, format!("peer {peer}: {e}")))?;
    let r = &record.body;
    if r.generation != g || r.step != step || r.layers != layers {
        return Err(unusable(
            peer,
            format!("peer {peer}: the record is for another hop"),
        ));
    }
    if r.input != x.commitment() {
        return Err(unusable(
            peer,
            format!("peer {peer}: the record commits to other input activations"),
        ));
    }
    // A record off the chain could never be part of a proof, so a lie in its hop would go
    // unpunished: the hop is not used (the generation goes on without this peer). Nor does it
    // prove anything against the stage: only this head knows what the chain should be.
    if r.previous != previous {
        return Err(unusable(
            peer,
            format!("peer {peer}: the record does not continue the generation's chain of inputs"),
        ));
    }
    if r.output != y.commitment() || y.start != x.start || y.rows() != x.rows() {
        return Err(unusable(
            peer,
            format!("peer {peer}: the activations do not match its record"),
        ));
    }
    if let Err(e) = check_consistency(r, &trace) {
        let proof = FraudProof {
            model_id: node.model_id,
            accused: peer.to_string(),
            kind: ProofKind::Inconsistent,
            records: vec![record.clone()],
            traces: vec![trace.clone()],
            layer_inputs: Vec::new(),
        };
        warn!("peer {peer} signed a record that contradicts its trace: {e}");
        if accept_proof(node.clone(), proof, true).await {
            return Err(Stop::Liar(peer.to_string()));
        }
        return Err(unusable(peer, format!("peer {peer}: {e}")));
    }
    Ok(HopResult {
        output: y,
        record,
        trace,
    })
}

/// The chain of inputs a stage's next record must continue: its last record's in the log.
fn chain(log: &StageLog) -> Commitment {
    log.records
        .last()
        .map_or(HopRecord::FIRST, |r| r.body.chain())
}

/// The generation id a second peer uses for the same work (its own caches).
fn shadow_id(g: &GenerationId) -> GenerationId {
    let h = blake3::hash(&[&g.0[..], b"shadow"].concat());
    let mut out = [0u8; 16];
    out.copy_from_slice(&h.as_bytes()[..16]);
    GenerationId(out)
}

/// The generation id of attempt `n` (fresh caches at every stage after a recomputation).
fn attempt_id(g: &GenerationId, n: usize) -> GenerationId {
    if n == 0 {
        return *g;
    }
    let h = blake3::hash(&[&g.0[..], b"attempt", &(n as u64).to_le_bytes()].concat());
    let mut out = [0u8; 16];
    out.copy_from_slice(&h.as_bytes()[..16]);
    GenerationId(out)
}

/// The second peer for each hop of a route under `--verify all` (`None` for the head's own).
type Shadows = Vec<Option<String>>;

/// One attempt's state: the route, the second peers (verify all: one per remote hop; the
/// head's own hops need none), what was logged per stage, and the audits running.
struct Attempt {
    g: GenerationId,
    route: Vec<RouteHop>,
    shadows: Option<Shadows>,
    logs: Vec<StageLog>,
    shadow_logs: Vec<StageLog>,
    audits: Vec<JoinHandle<bool>>,
    /// Per route stage: its auditor and what that auditor's replay cache holds.
    sessions: Vec<Arc<tokio::sync::Mutex<AuditSession>>>,
    /// Per route stage: the cache rows spot checks verified.
    known: Vec<spot::KnownCaches>,
    /// Per route stage: its hops drawn for spot checks and not yet asked about (up to
    /// [`spot::REVEAL_BATCH`] go in one exchange).
    pending: Vec<Vec<spot::HopPicks>>,
    rate: f32,
    spot_rate: crate::SpotRate,
    /// Peers whose answers this generation could not use, and why (kept across attempts).
    avoid: Avoided,
    /// Peers that served route stages before another took their layers over, with their
    /// audit sessions: still audited, still liable, told when the attempt ends.
    retired: Vec<(String, Arc<tokio::sync::Mutex<AuditSession>>)>,
    /// Where route changes are told to the client.
    tx: mpsc::Sender<GenerationEvent>,
}

impl Attempt {
    /// Runs every stage of the route over `x`.
    async fn lap(
        &mut self,
        node: &Arc<Node>,
        step: u64,
        mut x: Activations,
    ) -> Result<Activations, Stop> {
        for i in 0..self.route.len() {
            let h = self.route[i].clone();
            let input = Arc::new(x.clone());
            self.logs[i].inputs.push(input.clone());
            if let Some(shadow) = self.shadows.as_ref().and_then(|s| s[i].clone()) {
                self.shadow_logs[i].inputs.push(input);
                let (a, b) = tokio::join!(
                    hop_on(
                        node,
                        &h.peer,
                        h.layers,
                        self.g,
                        step,
                        &x,
                        chain(&self.logs[i])
                    ),
                    hop_on(
                        node,
                        &shadow,
                        h.layers,
                        shadow_id(&self.g),
                        step,
                        &x,
                        chain(&self.shadow_logs[i])
                    )
                );
                let (a, b) = (a?, b?);
                let (ta, tb) = (Arc::new(a.trace), Arc::new(b.trace));
                self.logs[i].records.push(a.record);
                self.logs[i].traces.push(ta.clone());
                self.shadow_logs[i].records.push(b.record);
                self.shadow_logs[i].traces.push(tb.clone());
                if ta.entries == tb.entries && a.output == b.output {
                    x = a.output;
                    continue;
                }
                // They disagree: referee both from our own copy of the weights.
                warn!(
                    "{} and {shadow} disagree on layers {} at step {step}: refereeing",
                    h.peer, h.layers
                );
                if referee(node.clone(), &h.peer, h.layers, &self.logs[i]).await {
                    return Err(Stop::Liar(h.peer.clone()));
                }
                if referee(node.clone(), &shadow, h.layers, &self.shadow_logs[i]).await {
                    return Err(Stop::Liar(shadow));
                }
                return Err(Stop::Failed(format!(
                    "{} and {shadow} disagree and the referee could not decide",
                    h.peer
                )));
            }
            let previous = chain(&self.logs[i]);
            let r = match hop_on(node, &h.peer, h.layers, self.g, step, &x, previous).await {
                Err(stop @ Stop::Unusable { .. }) => self.replace(node, i, step, stop).await?,
                r => r?,
            };
            self.checks_after(node, i, step, &x, r.record, r.trace);
            x = r.output;
        }
        // A liar proven by a finished audit: recompute without it.
        if let Some(l) = self.proven_liar(node) {
            return Err(Stop::Liar(l));
        }
        Ok(x)
    }

    /// A peer of this attempt (serving a route stage now or before) proven to lie, if any.
    fn proven_liar(&self, node: &Node) -> Option<String> {
        let route = self.route.iter().map(|h| &h.peer);
        let retired = self.retired.iter().map(|(p, _)| p);
        route.chain(retired).find(|p| node.is_excluded(p)).cloned()
    }

    /// Logs route stage `i`'s answer to hop `step` (input `x`) and starts its checks: an
    /// audit if the coin says so, and the hop's spot-check picks (batched).
    fn checks_after(
        &mut self,
        node: &Arc<Node>,
        i: usize,
        step: u64,
        x: &Activations,
        record: Signed<HopRecord>,
        trace: HopTrace,
    ) {
        let h = self.route[i].clone();
        let remote = h.peer != node.local;
        self.logs[i].records.push(record);
        self.logs[i].traces.push(Arc::new(trace));
        if remote && should_audit(node, &self.g, step, i, self.rate) {
            let (node2, log) = (node.clone(), self.logs[i].clone());
            let session = self.sessions[i].clone();
            self.audits
                .push(tokio::spawn(audit(node2, h.clone(), log, session)));
        }
        let picks = match remote {
            true => spot::picks(
                &node.audit_secret,
                &self.g,
                step,
                h.layers,
                x.start,
                x.rows(),
                &dc_model::check_parts(&node.model_cfg),
                self.spot_rate
                    .for_stage(&node.model_cfg, h.layers.len() as usize),
            ),
            false => Vec::new(),
        };
        if !picks.is_empty() {
            self.pending[i].push(spot::HopPicks {
                log: self.logs[i].clone(),
                step,
                picks,
            });
            // A prefill hop at once: its picks take several exchanges, and the stage keeps
            // only its last few hops.
            if self.pending[i].len() >= spot::REVEAL_BATCH || x.rows() > 1 {
                self.check_pending(node, i);
            }
        }
    }

    /// Route stage `i`'s peer could not serve hop `step` (`stop` says why): hands the stage's
    /// layers to another peer serving them, which first replays the stage's logged inputs (one
    /// hop per step, each checked as any hop is), then runs hop `step`. Only that stage's work
    /// is redone, and the tokens already sent stand. `stop` comes back (and the generation is
    /// recomputed without the peer) when no other peer serves the layers, under `--verify
    /// all`, or when a replayed output is not what the first peer signed: one of the two lied,
    /// and the checks of both may tell which.
    async fn replace(
        &mut self,
        node: &Arc<Node>,
        i: usize,
        step: u64,
        stop: Stop,
    ) -> Result<HopResult, Stop> {
        let (peer, why, remember) = match &stop {
            Stop::Unusable {
                peer,
                why,
                remember,
            } => (peer.clone(), why.clone(), *remember),
            _ => return Err(stop),
        };
        let layers = self.route[i].layers;
        let in_route: Vec<String> = self.route.iter().map(|h| h.peer.clone()).collect();
        let mut candidates = node.participants();
        candidates.retain(|p| !in_route.contains(&p.peer) && !avoided(&self.avoid, &p.peer));
        let recent = node.recently_unusable();
        let salt = [&self.g.0[..], &step.to_le_bytes()].concat();
        let next = pick_peer(&candidates, &recent, layers, &peer, &salt);
        let Some(next) = next.filter(|_| self.shadows.is_none()) else {
            return Err(stop);
        };
        warn!(
            "generation {}: layers {layers} go from {peer} to {next}, which replays {step} hops \
             first: {why}",
            self.g
        );
        leave_out(node, &mut self.avoid, &peer, why, remember);
        node.stats
            .stages_replaced
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // The first peer's drawn hops are asked about now (failing that, its checks replay).
        self.check_pending(node, i);
        let old = std::mem::take(&mut self.logs[i]);
        // A session of its own (another id at the auditor), so the first peer's audits, still
        // running, keep theirs.
        let session = AuditSession::new(
            node,
            &self.g,
            i + self.route.len() * (self.retired.len() + 1),
        );
        let session = std::mem::replace(
            &mut self.sessions[i],
            Arc::new(tokio::sync::Mutex::new(session)),
        );
        self.retired.push((peer.clone(), session));
        self.known[i] = Default::default();
        self.route[i].peer = next.clone();
        let _ = self
            .tx
            .send(GenerationEvent::Started {
                head: node.local.clone(),
                route: self.route.clone(),
            })
            .await;
        for k in 0..step {
            let (Some(input), Some(signed)) =
                (old.inputs.get(k as usize), old.records.get(k as usize))
            else {
                return Err(stop);
            };
            self.logs[i].inputs.push(input.clone());
            let previous = chain(&self.logs[i]);
            let r = hop_on(node, &next, layers, self.g, k, input, previous).await?;
            if r.record.body.output != signed.body.output {
                warn!(
                    "generation {}: {next} and {peer} disagree on layers {layers} at step {k}",
                    self.g
                );
                return Err(stop);
            }
            self.checks_after(node, i, k, input, r.record, r.trace);
        }
        let Some(x) = old.inputs.get(step as usize) else {
            return Err(stop);
        };
        self.logs[i].inputs.push(x.clone());
        let previous = chain(&self.logs[i]);
        hop_on(node, &next, layers, self.g, step, x, previous).await
    }

    /// Starts the spot checks of route stage `i`'s hops drawn so far, in one reveal exchange.
    fn check_pending(&mut self, node: &Arc<Node>, i: usize) {
        let hops = std::mem::take(&mut self.pending[i]);
        if hops.is_empty() {
            return;
        }
        let (session, known) = (self.sessions[i].clone(), self.known[i].clone());
        let check = spot::spot_check(
            node.clone(),
            self.route[i].clone(),
            self.g,
            hops,
            session,
            known,
        );
        self.audits.push(tokio::spawn(check));
    }

    /// Tells every stage and auditor the attempt is over (caches freed; they also expire when
    /// idle).
    async fn end(&self, node: &Arc<Node>) {
        for s in self
            .sessions
            .iter()
            .chain(self.retired.iter().map(|(_, s)| s))
        {
            s.lock().await.end(node);
        }
        let mut peers: Vec<(String, GenerationId)> = self
            .route
            .iter()
            .map(|h| &h.peer)
            .chain(self.retired.iter().map(|(p, _)| p))
            .map(|p| (p.clone(), self.g))
            .collect();
        if let Some(s) = &self.shadows {
            peers.extend(s.iter().flatten().map(|p| (p.clone(), shadow_id(&self.g))));
        }
        for (peer, g) in peers {
            if peer == node.local {
                node.caches
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .end(&g, &node.local);
            } else if let Ok(p) = peer.parse() {
                let client = node.client.clone();
                tokio::spawn(async move {
                    let _ = client
                        .stage_request(p, StageRequest::End { generation: g })
                        .await;
                });
            }
        }
    }
}

/// Embeds `tokens` at `start` (head weights, compute pool).
async fn embed(node: &Arc<Node>, tokens: Vec<u32>, start: usize) -> Result<Activations, String> {
    let serving = node.serving().ok_or("not serving yet")?;
    tokio::task::spawn_blocking(move || {
        serving
            .model
            .embed(&tokens, start)
            .map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Logits of the last row.
async fn readout(node: &Arc<Node>, x: Activations) -> Result<Vec<f32>, String> {
    let serving = node.serving().ok_or("not serving yet")?;
    let n2 = node.clone();
    tokio::task::spawn_blocking(move || {
        serving
            .model
            .readout(&n2.gemm, &x.last_row())
            .map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Plans attempt `g`'s route (and `--verify all`'s second peers) among the participants, leaving
/// out the peers in `avoid` (whose answers this generation could not use).
fn plan(
    node: &Arc<Node>,
    req: &GenerationRequest,
    g: &GenerationId,
    avoid: &[(String, String)],
) -> Result<(Vec<RouteHop>, Option<Shadows>), String> {
    if req.model_id != node.model_id {
        return Err(format!(
            "this daemon serves model {}, not {}",
            node.model_id, req.model_id
        ));
    }
    let serving = node.serving().ok_or("this daemon is still loading")?;
    if !serving.head {
        return Err("this daemon does not hold the head weights".into());
    }
    let mut participants = node.participants();
    participants.retain(|p| !avoided(avoid, &p.peer));
    let left_out = || {
        avoid
            .iter()
            .map(|(_, why)| format!("; left out: {why}"))
            .collect::<String>()
    };
    // Peers whose hops recently could not be used are a last resort.
    let recent = node.recently_unusable();
    let mut preferred = participants.clone();
    preferred.retain(|p| !recent.contains(&p.peer));
    let layers = node.model_cfg.num_layers as u32;
    let route = plan_route(g, layers, &node.local, &preferred)
        .or_else(|_| plan_route(g, layers, &node.local, &participants))
        .map_err(|e| e + &left_out())?;
    let shadows = match req.verify {
        VerifyMode::All => Some(
            route
                .iter()
                .map(|h| {
                    if h.peer == node.local {
                        // The head trusts its own arithmetic.
                        return Ok(None);
                    }
                    pick_peer(&participants, &recent, h.layers, &h.peer, &g.0)
                        .map(Some)
                        .ok_or_else(|| {
                            format!(
                                "--verify all needs a second peer serving layers {} (only {} does){}",
                                h.layers,
                                h.peer,
                                left_out()
                            )
                        })
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
        VerifyMode::Sampled(_) => None,
    };
    Ok((route, shadows))
}

/// Heads `req`: streams [`GenerationEvent`]s into `tx` until `Done` or `Failed`.
pub async fn run_as_head(
    node: Arc<Node>,
    req: GenerationRequest,
    tx: mpsc::Sender<GenerationEvent>,
) {
    node.stats
        .active_heads
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let result = drive(&node, &req, &tx).await;
    node.stats
        .active_heads
        .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    let ev = match result {
        Ok(ev) => ev,
        Err(message) => {
            warn!("generation {} failed: {message}", req.generation);
            GenerationEvent::Failed { message }
        }
    };
    let _ = tx.send(ev).await;
}

async fn drive(
    node: &Arc<Node>,
    req: &GenerationRequest,
    tx: &mpsc::Sender<GenerationEvent>,
) -> Result<GenerationEvent, String> {
    let mut delivered: Vec<u32> = Vec::new();
    // Peers whose answers this generation could not use, and why: later attempts go without
    // them. Not an exclusion (nothing is proven, and other generations still use them).
    let mut avoid: Avoided = Vec::new();
    for n in 0..MAX_ATTEMPTS {
        let g = attempt_id(&req.generation, n);
        let (route, shadows) = plan(node, req, &g, &avoid)?;
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
                head: node.local.clone(),
                route: route.clone(),
            })
            .await;
        let (rate, spot_rate) = match req.verify {
            VerifyMode::Sampled(r) => (r.clamp(0.0, 1.0), node.cfg.spot_check_rate),
            VerifyMode::All => (0.0, crate::SpotRate::Fixed(0.0)),
        };
        let route_len = route.len();
        let mut at = Attempt {
            g,
            logs: vec![StageLog::default(); route.len()],
            shadow_logs: vec![StageLog::default(); route.len()],
            route,
            shadows,
            audits: Vec::new(),
            sessions: (0..route_len)
                .map(|i| Arc::new(tokio::sync::Mutex::new(AuditSession::new(node, &g, i))))
                .collect(),
            known: (0..route_len).map(|_| Default::default()).collect(),
            pending: (0..route_len).map(|_| Vec::new()).collect(),
            rate,
            spot_rate,
            avoid: std::mem::take(&mut avoid),
            retired: Vec::new(),
            tx: tx.clone(),
        };
        let outcome = attempt(node, req, &mut at, tx, &mut delivered).await;
        avoid = std::mem::take(&mut at.avoid);
        // The last hops' spot checks, fewer than a batch.
        for i in 0..route_len {
            at.check_pending(node, i);
        }
        // Wait for this attempt's audits: a lie they prove still changes what the client gets.
        let pending = std::mem::take(&mut at.audits);
        let proven = tokio::time::timeout(AUDIT_WAIT, futures::future::join_all(pending)).await;
        at.end(node).await;
        let liar = match (&outcome, proven) {
            (Err(Stop::Liar(l)), _) => Some(l.clone()),
            (_, Ok(results)) if results.iter().any(|r| matches!(r, Ok(true))) => {
                at.proven_liar(node)
            }
            _ => None,
        };
        match (outcome, liar) {
            (_, Some(l)) => {
                warn!(
                    "generation {}: {l} was proven to lie; recomputing without it",
                    req.generation
                );
                continue;
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
                node.stats
                    .reroutes
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                leave_out(node, &mut avoid, &peer, why, remember);
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

/// One pass over the generation. Tokens already delivered by an earlier attempt are recomputed
/// silently; if the new ones differ, one `Corrected` event carries them.
async fn attempt(
    node: &Arc<Node>,
    req: &GenerationRequest,
    at: &mut Attempt,
    tx: &mpsc::Sender<GenerationEvent>,
    delivered: &mut Vec<u32>,
) -> Result<GenerationEvent, Stop> {
    let greq = GenerateRequest {
        prompt: req.prompt.clone(),
        max_new_tokens: req.max_new_tokens as usize,
        sampling: sampling(req),
        stop_tokens: req.stop_tokens.clone(),
        chunk: req.chunk.max(1) as usize,
    };
    let mut tl = TokenLoop::new(&greq, node.model_cfg.max_positions).map_err(|e| e.to_string())?;
    let replay = delivered.len();
    let mut step = 0u64;
    let mut logits = Vec::new();
    let mut pos = 0usize;
    for chunk in greq.prompt.chunks(greq.chunk) {
        let x = embed(node, chunk.to_vec(), pos).await?;
        let y = at.lap(node, step, x).await?;
        step += 1;
        pos += chunk.len();
        logits = readout(node, y).await?;
    }
    let stop = loop {
        let next = tl.next(&logits).map_err(|e| e.to_string())?;
        let (t, done) = match next {
            Next::Feed(t) => (Some(t), None),
            Next::Last(t, why) => (Some(t), Some(why)),
            Next::Done(why) => (None, Some(why)),
        };
        let produced = tl.tokens.len();
        if let Some(t) = t {
            if produced > replay {
                node.stats
                    .tokens
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                delivered.push(t);
                let ev = GenerationEvent::Token {
                    index: produced as u32 - 1,
                    id: t,
                };
                if tx.send(ev).await.is_err() {
                    return Err(Stop::Failed("the client went away".into()));
                }
            }
        }
        // The recomputation has caught up with what the client holds: say what changed.
        if produced == replay || (done.is_some() && produced < replay) {
            correct(node, tx, delivered, &tl.tokens).await?;
        }
        if let Some(why) = done {
            break why;
        }
        let t = tl.tokens[tl.tokens.len() - 1];
        let x = embed(node, vec![t], pos).await?;
        let y = at.lap(node, step, x).await?;
        step += 1;
        pos += 1;
        logits = readout(node, y).await?;
    };
    let stop = serde_json::to_value(stop)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    Ok(GenerationEvent::Done {
        tokens: tl.tokens.clone(),
        stop,
        final_logits: logits_commitment(pos.saturating_sub(1), &logits),
    })
}

/// Compares the recomputed tokens with what the client holds and sends the correction.
async fn correct(
    node: &Arc<Node>,
    tx: &mpsc::Sender<GenerationEvent>,
    delivered: &mut Vec<u32>,
    new: &[u32],
) -> Result<(), Stop> {
    let first = delivered
        .iter()
        .zip(new)
        .position(|(a, b)| a != b)
        .or((delivered.len() != new.len()).then_some(delivered.len().min(new.len())));
    let Some(from) = first else { return Ok(()) };
    let liar = node
        .audits
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .status()
        .1
        .as_array()
        .and_then(|a| a.last())
        .and_then(|v| v["peer_id"].as_str().map(str::to_string))
        .unwrap_or_default();
    node.stats
        .corrections
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let ev = GenerationEvent::Corrected {
        from: from as u32,
        tokens: new[from..].to_vec(),
        liar,
    };
    *delivered = new.to_vec();
    tx.send(ev)
        .await
        .map_err(|_| Stop::Failed("the client went away".into()))
}
