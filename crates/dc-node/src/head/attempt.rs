//! One attempt at a generation: its route, what the head logged of every stage, and the
//! checks it started. A lap runs every stage of the route over one step's activations; under
//! `--verify all` each remote hop runs on two peers at once and they must agree. A stage whose
//! hop cannot be used is handed to another peer serving its layers, which replays the stage's
//! logged inputs first (each output checked against what the first peer signed).

use std::sync::Arc;

use dc_model::Activations;
use dc_types::{
    Commitment, GenerationEvent, GenerationId, HopRecord, HopTrace, RouteHop, Signed, StageRequest,
};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::warn;

use super::hop::{hop_on, HopResult};
use super::stop::{avoided, leave_out, Avoided, Stop};
use crate::check::audit::{audit, pick_peer, should_audit};
use crate::check::referee::referee;
use crate::check::spot;
use crate::check::{AuditSession, StageLog};
use crate::core::{Node, SpotRate};
use crate::daemon::Daemon;

/// The chain of inputs a stage's next record must continue: its last record's in the log.
pub(super) fn chain(log: &StageLog) -> Commitment {
    log.records
        .last()
        .map_or(HopRecord::FIRST, |r| r.body.chain())
}

/// The generation id a second peer uses for the same work (its own caches).
pub(super) fn shadow_id(g: &GenerationId) -> GenerationId {
    let h = blake3::hash(&[&g.0[..], b"shadow"].concat());
    let mut out = [0u8; 16];
    out.copy_from_slice(&h.as_bytes()[..16]);
    GenerationId(out)
}

/// The second peer for each hop of a route under `--verify all` (`None` for the head's own).
pub(super) type Shadows = Vec<Option<String>>;

/// One attempt's state: the route, the second peers (verify all: one per remote hop; the
/// head's own hops need none), what was logged per stage, and the audits running.
pub(super) struct Attempt {
    pub(super) g: GenerationId,
    pub(super) route: Vec<RouteHop>,
    pub(super) shadows: Option<Shadows>,
    pub(super) logs: Vec<StageLog>,
    pub(super) shadow_logs: Vec<StageLog>,
    pub(super) audits: Vec<JoinHandle<bool>>,
    /// Per route stage: its auditor and what that auditor's replay cache holds.
    pub(super) sessions: Vec<Arc<tokio::sync::Mutex<AuditSession>>>,
    /// Per route stage: the cache rows spot checks verified.
    pub(super) known: Vec<spot::KnownCaches>,
    /// Per route stage: its hops drawn for spot checks and not yet asked about (up to
    /// [`spot::REVEAL_BATCH`] go in one exchange).
    pub(super) pending: Vec<Vec<spot::HopPicks>>,
    pub(super) rate: f32,
    pub(super) spot_rate: SpotRate,
    /// Peers whose answers this generation could not use, and why (kept across attempts).
    pub(super) avoid: Avoided,
    /// Peers that served route stages before another took their layers over, with their
    /// audit sessions: still audited, still liable, told when the attempt ends.
    pub(super) retired: Vec<(String, Arc<tokio::sync::Mutex<AuditSession>>)>,
    /// Where route changes are told to the client.
    pub(super) tx: mpsc::Sender<GenerationEvent>,
}

impl Attempt {
    /// Attempt `g` over `route` (with `--verify all`'s `shadows`), auditing at `rates` (audits,
    /// spot checks), going without the `avoid`ed peers, telling route changes to `tx`.
    pub(super) fn new(
        d: &Daemon,
        g: GenerationId,
        route: Vec<RouteHop>,
        shadows: Option<Shadows>,
        rates: (f32, SpotRate),
        avoid: Avoided,
        tx: mpsc::Sender<GenerationEvent>,
    ) -> Attempt {
        let n = route.len();
        Attempt {
            g,
            logs: vec![StageLog::default(); n],
            shadow_logs: vec![StageLog::default(); n],
            route,
            shadows,
            audits: Vec::new(),
            sessions: (0..n)
                .map(|i| {
                    let session = AuditSession::new(&d.checks, &g, i);
                    Arc::new(tokio::sync::Mutex::new(session))
                })
                .collect(),
            known: (0..n).map(|_| Default::default()).collect(),
            pending: (0..n).map(|_| Vec::new()).collect(),
            rate: rates.0,
            spot_rate: rates.1,
            avoid,
            retired: Vec::new(),
            tx,
        }
    }

    /// Runs every stage of the route over `x` (`guessed`: its rows after the first are a
    /// guess, which the next lap may cut off).
    pub(super) async fn lap(
        &mut self,
        d: &Daemon,
        step: u64,
        mut x: Activations,
        guessed: bool,
    ) -> Result<Activations, Stop> {
        // The stages' cache rows of this lap that stand for the laps after it.
        let holds = match guessed {
            true => x.start,
            false => x.start + x.rows(),
        };
        for i in 0..self.route.len() {
            let h = self.route[i].clone();
            let input = Arc::new(x.clone());
            self.logs[i].inputs.push(input.clone());
            if let Some(shadow) = self.shadows.as_ref().and_then(|s| s[i].clone()) {
                self.shadow_logs[i].inputs.push(input);
                let (a, b) = tokio::join!(
                    hop_on(d, &h.peer, h.layers, self.g, step, &x, chain(&self.logs[i])),
                    hop_on(
                        d,
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
                if referee(&d.checks, &h.peer, h.layers, &self.logs[i]).await {
                    return Err(Stop::Liar(h.peer.clone()));
                }
                if referee(&d.checks, &shadow, h.layers, &self.shadow_logs[i]).await {
                    return Err(Stop::Liar(shadow));
                }
                return Err(Stop::Failed(format!(
                    "{} and {shadow} disagree and the referee could not decide",
                    h.peer
                )));
            }
            let previous = chain(&self.logs[i]);
            let r = match hop_on(d, &h.peer, h.layers, self.g, step, &x, previous).await {
                Err(stop @ Stop::Unusable { .. }) => self.replace(d, i, step, stop).await?,
                r => r?,
            };
            self.checks_after(d, i, step, &x, holds, r.record, r.trace);
            x = r.output;
        }
        // A liar proven by a finished audit: recompute without it.
        if let Some(l) = self.proven_liar(&d.node) {
            return Err(Stop::Liar(l));
        }
        Ok(x)
    }

    /// A peer of this attempt (serving a route stage now or before) proven to lie, if any.
    pub(super) fn proven_liar(&self, node: &Node) -> Option<String> {
        let route = self.route.iter().map(|h| &h.peer);
        let retired = self.retired.iter().map(|(p, _)| p);
        route.chain(retired).find(|p| node.is_excluded(p)).cloned()
    }

    /// Logs route stage `i`'s answer to hop `step` (input `x`, whose cache rows stand up to
    /// `holds`) and starts its checks: an audit if the coin says so, and the hop's spot-check
    /// picks (batched).
    #[allow(clippy::too_many_arguments)]
    fn checks_after(
        &mut self,
        d: &Daemon,
        i: usize,
        step: u64,
        x: &Activations,
        holds: usize,
        record: Signed<HopRecord>,
        trace: HopTrace,
    ) {
        let h = self.route[i].clone();
        let remote = h.peer != d.node.local;
        self.logs[i].records.push(record);
        self.logs[i].traces.push(Arc::new(trace));
        if remote && should_audit(&d.checks, &self.g, step, i, self.rate) {
            let (checks, log) = (d.checks.clone(), self.logs[i].clone());
            let session = self.sessions[i].clone();
            self.audits
                .push(tokio::spawn(audit(checks, h.clone(), log, session)));
        }
        let picks = match remote {
            true => d.checks.draw_picks(
                &self.g,
                step,
                h.layers,
                x.start,
                x.rows(),
                &dc_model::check_parts(&d.node.model_cfg),
                self.spot_rate
                    .for_stage(&d.node.model_cfg, h.layers.len() as usize),
            ),
            false => Vec::new(),
        };
        if !picks.is_empty() {
            self.pending[i].push(spot::HopPicks {
                log: self.logs[i].clone(),
                step,
                picks,
                holds,
            });
            // A prompt's hop at once: its picks take several exchanges, and the stage keeps
            // only its last few hops.
            if self.pending[i].len() >= spot::REVEAL_BATCH || x.rows() > spot::BATCHED_ROWS {
                self.check_pending(d, i);
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
        d: &Daemon,
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
        let mut candidates = d.node.participants();
        candidates.retain(|p| !in_route.contains(&p.peer) && !avoided(&self.avoid, &p.peer));
        let recent = d.node.recently_unusable();
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
        leave_out(&d.node, &mut self.avoid, &peer, why, remember);
        d.node
            .stats
            .stages_replaced
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // The first peer's drawn hops are asked about now (failing that, its checks replay).
        self.check_pending(d, i);
        let old = std::mem::take(&mut self.logs[i]);
        // A session of its own (another id at the auditor), so the first peer's audits, still
        // running, keep theirs.
        let session = AuditSession::new(
            &d.checks,
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
                head: d.node.local.clone(),
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
            let r = hop_on(d, &next, layers, self.g, k, input, previous).await?;
            if r.record.body.output != signed.body.output {
                warn!(
                    "generation {}: {next} and {peer} disagree on layers {layers} at step {k}",
                    self.g
                );
                return Err(stop);
            }
            // The hop after it is logged: its rows stand up to where that one started.
            let holds = old
                .inputs
                .get(k as usize + 1)
                .map_or(input.start, |n| n.start);
            self.checks_after(d, i, k, input, holds, r.record, r.trace);
        }
        let Some(x) = old.inputs.get(step as usize) else {
            return Err(stop);
        };
        self.logs[i].inputs.push(x.clone());
        let previous = chain(&self.logs[i]);
        hop_on(d, &next, layers, self.g, step, x, previous).await
    }

    /// Starts the spot checks of route stage `i`'s hops drawn so far, in one reveal exchange.
    pub(super) fn check_pending(&mut self, d: &Daemon, i: usize) {
        let hops = std::mem::take(&mut self.pending[i]);
        if hops.is_empty() {
            return;
        }
        let (session, known) = (self.sessions[i].clone(), self.known[i].clone());
        let check = spot::spot_check(
            d.checks.clone(),
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
    pub(super) async fn end(&self, d: &Daemon) {
        for s in self
            .sessions
            .iter()
            .chain(self.retired.iter().map(|(_, s)| s))
        {
            s.lock().await.end(&d.checks);
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
            if peer == d.node.local {
                d.stage.end(&g, &d.node.local);
            } else if let Ok(p) = peer.parse() {
                let client = d.node.client.clone();
                tokio::spawn(async move {
                    let _ = client
                        .stage_request(p, StageRequest::End { generation: g })
                        .await;
                });
            }
        }
    }
}
