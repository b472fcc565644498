//! Audits, disputes and exclusion: which hops get re-run and by whom, the referee replay that
//! turns a disagreement into a fraud proof, and what happens to a peer proven to have lied
//! (excluded here at once, the proof gossiped, every peer that checks it excludes too).
//!
//! Nobody is excluded on a claim: a proof is checked against our own copy of the weights before
//! anything happens. An auditor's disagreement alone only triggers the referee replay.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use dc_kernels::{Commitment, Domain};
use dc_model::{Activations, LoadOptions, Model};
use dc_types::{
    AuditRequest, CacheRows, CacheRowsRequest, FraudProof, GenerationId, Gossip, HopRecord,
    HopTrace, LayerRange, RouteHop, Signed, StageRequest, StageResponse,
};
use serde_json::{json, Value};
use tracing::{info, warn};

use crate::node::Node;
use crate::verify::{build_proof, find_dispute, proof_id, proof_layer, verify_proof};
use crate::view::Participant;

/// Proofs kept to answer `GetProof` (the oldest go first).
const MAX_PROOFS: usize = 256;

/// Audit counters of one peer.
#[derive(Clone, Copy, Debug, Default)]
pub struct Tally {
    /// Audits run on its hops.
    pub run: u64,
    /// Audits that agreed.
    pub passed: u64,
    /// Audits that disagreed.
    pub failed: u64,
}

/// What this daemon knows about audits and liars.
#[derive(Debug, Default)]
pub struct AuditBook {
    per_peer: BTreeMap<String, Tally>,
    excluded: BTreeMap<String, (Commitment, Instant)>,
    proofs: HashMap<Commitment, FraudProof>,
    order: VecDeque<Commitment>,
    /// Audits the head wanted but could find no auditor for.
    pub unavailable: u64,
    /// Audits run from the audited stage's committed cache rows (one hop each, no replay).
    pub from_cache: u64,
    /// Bytes of cache rows those audits carried (received from the stage, sent on).
    pub from_cache_bytes: u64,
    /// Spot checks run by this head.
    pub spot: crate::spot::SpotTally,
}

impl AuditBook {
    /// Records an audit's outcome.
    pub fn record(&mut self, peer: &str, passed: bool) {
        let t = self.per_peer.entry(peer.to_string()).or_default();
        t.run += 1;
        if passed {
            t.passed += 1;
        } else {
            t.failed += 1;
        }
    }

    /// Whether `peer` has been proven to lie.
    pub fn is_excluded(&self, peer: &str) -> bool {
        self.excluded.contains_key(peer)
    }

    /// Excludes `peer` on `proof` (kept to answer others).
    pub fn exclude(&mut self, proof: FraudProof) -> (Commitment, bool) {
        let id = proof_id(&proof);
        let fresh = !self.excluded.contains_key(&proof.accused);
        self.excluded
            .entry(proof.accused.clone())
            .or_insert((id, Instant::now()));
        if !self.proofs.contains_key(&id) {
            if self.order.len() >= MAX_PROOFS {
                if let Some(old) = self.order.pop_front() {
                    self.proofs.remove(&old);
                }
            }
            self.order.push_back(id);
            self.proofs.insert(id, proof);
        }
        (id, fresh)
    }

    /// A proof we hold.
    pub fn proof(&self, id: &Commitment) -> Option<FraudProof> {
        self.proofs.get(id).cloned()
    }

    /// The status section.
    pub fn status(&self) -> (Value, Value) {
        let (mut run, mut passed, mut failed) = (0, 0, 0);
        let mut per = serde_json::Map::new();
        for (p, t) in &self.per_peer {
            run += t.run;
            passed += t.passed;
            failed += t.failed;
            per.insert(
                p.clone(),
                json!({"run": t.run, "passed": t.passed, "failed": t.failed}),
            );
        }
        let s = &self.spot;
        let spot = json!({"run": s.run, "passed": s.passed, "failed": s.failed,
            "unavailable": s.unavailable, "layers": s.layers, "parts": s.parts,
            "attention": s.attention, "bytes": s.bytes, "exchanges": s.exchanges});
        let audits = json!({"run": run, "passed": passed, "failed": failed, "unavailable": self.unavailable, "from_cache": self.from_cache,
            "from_cache_bytes": self.from_cache_bytes, "per_peer": per, "spot_checks": spot});
        let excluded: Vec<Value> = self
            .excluded
            .iter()
            .map(|(p, (id, _))| json!({"peer_id": p, "proof_id": id.to_hex()}))
            .collect();
        (audits, Value::Array(excluded))
    }
}

/// The head's private coin: whether to audit this hop. Unpredictable to the stage, which cannot
/// know the head's secret when it commits.
pub fn should_audit(
    node: &Node,
    g: &dc_types::GenerationId,
    step: u64,
    seg: usize,
    rate: f32,
) -> bool {
    if rate <= 0.0 {
        return false;
    }
    let mut h = blake3::Hasher::new_keyed(&node.audit_secret);
    h.update(&g.0);
    h.update(&step.to_le_bytes());
    h.update(&(seg as u64).to_le_bytes());
    let x = u64::from_le_bytes(h.finalize().as_bytes()[..8].try_into().unwrap_or([0; 8]));
    ((x >> 11) as f64 / (1u64 << 53) as f64) < rate as f64
}

/// A peer (not `accused`, not excluded) whose layers cover `layers`; ourselves if we do. Peers
/// whose hops recently could not be used (see [`Node::recently_unusable`]) only if no other.
pub fn pick_auditor(node: &Node, layers: LayerRange, accused: &str, salt: &[u8]) -> Option<String> {
    let recent = node.recently_unusable();
    pick_peer(&node.participants(), &recent, layers, accused, salt)
}

/// A peer of `participants` (not `accused`) whose layers cover `layers`, chosen by `salt`; one
/// of `last_resort` only if no other qualifies.
pub fn pick_peer(
    participants: &[Participant],
    last_resort: &[String],
    layers: LayerRange,
    accused: &str,
    salt: &[u8],
) -> Option<String> {
    let qualifies = |p: &&Participant| p.peer != accused && p.layers.covers(&layers);
    let by_salt = |p: &&Participant| {
        let mut h = blake3::Hasher::new();
        h.update(salt);
        h.update(p.peer.as_bytes());
        *h.finalize().as_bytes()
    };
    let usable = participants
        .iter()
        .filter(qualifies)
        .filter(|p| !last_resort.contains(&p.peer))
        .max_by_key(by_salt);
    usable
        .or_else(|| participants.iter().filter(qualifies).max_by_key(by_salt))
        .map(|p| p.peer.clone())
}

/// Everything the head kept about one route stage in one generation. The inputs and traces
/// are shared, not copied, when the log is cloned: every hop's spot check and audit takes the
/// log so far, and copying it whole would make a generation's checks quadratic in its length.
#[derive(Clone, Debug, Default)]
pub struct StageLog {
    /// Inputs of each hop, in order.
    pub inputs: Vec<Arc<Activations>>,
    /// The signed records.
    pub records: Vec<Signed<HopRecord>>,
    /// Their traces.
    pub traces: Vec<Arc<HopTrace>>,
}

/// A head's audits of one stage in one attempt: which peer audits it and how many positions
/// that auditor's session cache already holds, so each input (or committed cache row) is sent
/// and each position computed once.
#[derive(Debug)]
pub struct AuditSession {
    /// The auditor's cache id (derived from the head's secret: no one else can address it).
    pub id: GenerationId,
    /// The auditor, once chosen.
    pub auditor: Option<String>,
    /// Positions its cache holds.
    pub held: usize,
}

impl AuditSession {
    /// A session for route stage `seg` of generation `g`.
    pub fn new(node: &Node, g: &GenerationId, seg: usize) -> AuditSession {
        let mut h = blake3::Hasher::new_keyed(&node.audit_secret);
        h.update(b"audit session");
        h.update(&g.0);
        h.update(&(seg as u64).to_le_bytes());
        let mut id = [0u8; 16];
        id.copy_from_slice(&h.finalize().as_bytes()[..16]);
        AuditSession {
            id: GenerationId(id),
            auditor: None,
            held: 0,
        }
    }

    /// Frees the auditor's cache.
    pub fn end(&self, node: &Arc<Node>) {
        match self.auditor.as_deref() {
            Some(a) if a == node.local => {
                node.caches
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .end(&self.id, &node.local);
            }
            Some(a) => {
                if let Ok(peer) = a.parse() {
                    let (client, generation) = (node.client.clone(), self.id);
                    tokio::spawn(async move {
                        let _ = client
                            .stage_request(peer, StageRequest::End { generation })
                            .await;
                    });
                }
            }
            None => {}
        }
    }
}

/// Runs one audit of the last hop in `log` (served by `accused` for `seg.layers`) in `session`;
/// on disagreement, referees and, if proven, excludes. Returns whether the accused was proven
/// to lie.
pub async fn audit(
    node: Arc<Node>,
    seg: RouteHop,
    log: StageLog,
    session: Arc<tokio::sync::Mutex<AuditSession>>,
) -> bool {
    let Some(last) = log.inputs.last() else {
        return false;
    };
    // A peer already proven to lie is out: every step it served is recomputed elsewhere, so
    // replaying one of its hops (a reveal it no longer answers, an audit coin drawn before the
    // proof) would only spend an auditor's time.
    if node.is_excluded(&seg.peer) {
        return false;
    }
    // One audit of a stage at a time: they share the auditor's cache.
    let mut session = session.lock().await;
    let keep = session.auditor.clone().filter(|a| {
        node.participants()
            .iter()
            .any(|p| &p.peer == a && p.peer != seg.peer && p.layers.covers(&seg.layers))
    });
    let auditor = match keep {
        Some(a) => a,
        None => {
            session.end(&node);
            session.held = 0;
            session.auditor = pick_auditor(&node, seg.layers, &seg.peer, &session.id.0);
            match session.auditor.clone() {
                Some(a) => a,
                None => {
                    node.audits
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .unavailable += 1;
                    return false;
                }
            }
        }
    };
    // Continue the auditor's cache; if it lost it, start over once from position 0. An audit
    // of a hop the cache has already passed (audits of one stage can start out of order)
    // starts from 0 at once.
    let resume = if session.held <= last.start {
        session.held
    } else {
        0
    };
    if let Some(trace) = audit_from_cache(&node, &seg, &log, &auditor, &session, resume).await {
        session.held = last.start + last.rows();
        drop(session);
        return judge(node, seg, log, &auditor, trace).await;
    }
    let mut theirs = Err(String::new());
    let tries: &[usize] = if resume > 0 { &[resume, 0] } else { &[0] };
    for &held in tries {
        let skip = log.inputs.iter().take_while(|x| x.start < held).count();
        let req = AuditRequest {
            model_id: node.model_id,
            layers: seg.layers,
            from: last.start as u32,
            session: session.id,
            hops: log.inputs[skip..]
                .iter()
                .map(|x| crate::verify::wire(x))
                .collect(),
            cache: None,
        };
        theirs = if auditor == node.local {
            crate::stage::serve_audit(node.clone(), req, &node.local).await
        } else {
            let Ok(peer) = auditor.parse() else {
                return false;
            };
            match node
                .client
                .stage_request(peer, StageRequest::Audit(req))
                .await
            {
                Ok(StageResponse::Audit(r)) => r,
                Ok(_) => Err("unexpected answer".into()),
                Err(e) => Err(e.to_string()),
            }
        };
        if theirs.is_ok() {
            break;
        }
    }
    let trace = match theirs {
        Ok(t) => {
            session.held = last.start + last.rows();
            t
        }
        Err(e) => {
            warn!(
                "audit by {auditor} of {} (layers {}) could not run: {e}",
                seg.peer, seg.layers
            );
            session.held = 0;
            node.audits
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .unavailable += 1;
            return false;
        }
    };
    drop(session);
    judge(node, seg, log, &auditor, trace).await
}

/// Compares the auditor's trace of the last hop in `log` with the stage's; on disagreement,
/// referees. Returns whether the stage was proven to lie.
async fn judge(
    node: Arc<Node>,
    seg: RouteHop,
    log: StageLog,
    auditor: &str,
    trace: HopTrace,
) -> bool {
    let agreed = log.traces.last().map(|t| &**t) == Some(&trace);
    node.audits
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .record(&seg.peer, agreed);
    if agreed {
        return false;
    }
    info!(
        "audit by {auditor} disagrees with {} on layers {}: refereeing",
        seg.peer, seg.layers
    );
    referee(node, &seg.peer, seg.layers, &log).await
}

/// An audit of the last hop in `log` that starts from the audited stage's own KV cache rows
/// instead of replaying its generation: the stage reveals its rows of the positions after the
/// `held` ones the auditor's session cache already holds, the head checks them against the
/// `KvCache` commitments of the hops that made them, and `auditor` appends them to its session
/// cache and runs only the audited hop (one hop of compute; each cache row travels once per
/// stage and generation). A lie in an earlier hop's cache rows is that hop's lie, seen when
/// that hop is checked. `None` when this cannot run — the hop starts at position 0, the stage
/// does not reveal, its rows do not match its commitments, they are too large for a message,
/// the auditor fails — and the caller replays.
async fn audit_from_cache(
    node: &Arc<Node>,
    seg: &RouteHop,
    log: &StageLog,
    auditor: &str,
    session: &AuditSession,
    held: usize,
) -> Option<HopTrace> {
    let (last, record) = (log.inputs.last()?, log.records.last()?);
    if last.start == 0 {
        return None;
    }
    let request = StageRequest::CacheRows(CacheRowsRequest {
        generation: record.body.generation,
        from: held as u32,
        end: last.start as u32,
    });
    let rows = match node
        .client
        .stage_request(seg.peer.parse().ok()?, request)
        .await
    {
        Ok(StageResponse::CacheRows(Ok(rows))) => rows,
        other => {
            let why = match other {
                Ok(StageResponse::CacheRows(Err(e))) => e,
                Ok(_) => "an unexpected answer".into(),
                Err(e) => e.to_string(),
            };
            info!(
                "{} did not reveal its cache rows ({why}): replaying",
                seg.peer
            );
            return None;
        }
    };
    let n = log.inputs.len() - 1;
    let hops: Vec<(Arc<HopTrace>, usize)> = log.traces[..n]
        .iter()
        .cloned()
        .zip(log.inputs[..n].iter().map(|x| x.rows()))
        .collect();
    let (cfg, layers) = (node.model_cfg.clone(), seg.layers);
    let checked = tokio::task::spawn_blocking(move || {
        let views: Vec<_> = hops.iter().map(|(t, n)| (&**t, *n)).collect();
        if rows.len() != layers.as_range().len() {
            return Err(format!("rows of {} layers for {layers}", rows.len()));
        }
        for (l, bytes) in layers.as_range().zip(&rows) {
            dc_model::check_cache_rows(&cfg, l, &views, held, bytes)?;
        }
        Ok(rows)
    })
    .await
    .unwrap_or_else(|e| Err(e.to_string()));
    let rows = match checked {
        Ok(rows) => rows,
        Err(why) => {
            warn!(
                "{} revealed cache rows it did not commit ({why}): replaying",
                seg.peer
            );
            return None;
        }
    };
    let bytes: usize = rows.iter().map(Vec::len).sum();
    let req = AuditRequest {
        model_id: node.model_id,
        layers: seg.layers,
        from: last.start as u32,
        session: session.id,
        hops: vec![crate::verify::wire(last)],
        cache: Some(CacheRows {
            from: held as u32,
            rows,
        }),
    };
    let answer = if auditor == node.local {
        crate::stage::serve_audit(node.clone(), req, &node.local).await
    } else {
        match node
            .client
            .stage_request(auditor.parse().ok()?, StageRequest::Audit(req))
            .await
        {
            Ok(StageResponse::Audit(r)) => r,
            Ok(_) => Err("unexpected answer".into()),
            Err(e) => Err(e.to_string()),
        }
    };
    match answer {
        Ok(trace) => {
            let mut book = node.audits.lock().unwrap_or_else(|e| e.into_inner());
            book.from_cache += 1;
            book.from_cache_bytes += bytes as u64;
            Some(trace)
        }
        Err(e) => {
            info!("audit from cache rows by {auditor} could not run ({e}): replaying");
            None
        }
    }
}

/// Replays the accused's hops ourselves (loading its layers from our own model file), finds the
/// first difference, builds the proof, checks it, and excludes the accused if it holds.
pub async fn referee(node: Arc<Node>, accused: &str, layers: LayerRange, log: &StageLog) -> bool {
    // One refereeing at a time: several audits of one generation often fail together, and
    // once the first has proven the lie the others have nothing left to do.
    let gate_holder = node.clone();
    let _gate = gate_holder.referee_gate.lock().await;
    if node.is_excluded(accused) {
        return true;
    }
    let model = match referee_model(&node, layers).await {
        Ok(m) => m,
        Err(e) => {
            warn!("cannot referee layers {layers}: {e}");
            return false;
        }
    };
    let (n2, log2) = (node.clone(), log.clone());
    let found = tokio::task::spawn_blocking(move || {
        find_dispute(&model, &n2.gemm, layers, &log2.inputs, &log2.traces)
    })
    .await;
    let dispute = match found {
        Ok(Ok(Some(d))) => d,
        Ok(Ok(None)) => {
            info!("referee: {accused}'s hops on layers {layers} are correct");
            return false;
        }
        Ok(Err(e)) => {
            warn!("referee replay failed: {e}");
            return false;
        }
        Err(e) => {
            warn!("referee replay failed: {e}");
            return false;
        }
    };
    let proof = build_proof(node.model_id, accused, &dispute, &log.records, &log.traces);
    accept_proof(node, proof, true).await
}

/// Loads (or reuses) a model holding `layers` for refereeing and proof checks.
async fn referee_model(node: &Arc<Node>, layers: LayerRange) -> Result<Arc<Model>, String> {
    if let Some(s) = node.serving() {
        if s.layers.covers(&layers) {
            return Ok(s.model.clone());
        }
    }
    let mut slot = node.referee.lock().await;
    if let Some((r, m)) = slot.as_ref() {
        if r.covers(&layers) {
            return Ok(m.clone());
        }
    }
    let path = node.cfg.model.clone();
    let data_dir = node.cfg.data_dir.clone();
    let m = tokio::task::spawn_blocking(move || {
        Model::load(
            &path,
            &LoadOptions {
                layers: Some(layers.as_range()),
                head: false,
                cache_in: Some(data_dir),
            },
        )
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| e.to_string())?;
    let m = Arc::new(m);
    *slot = Some((layers, m.clone()));
    Ok(m)
}

/// Checks a proof against our weights; if it holds, excludes the accused and (when `gossip`)
/// announces the proof. Returns whether it held.
pub async fn accept_proof(node: Arc<Node>, proof: FraudProof, gossip: bool) -> bool {
    if node
        .audits
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .is_excluded(&proof.accused)
    {
        return true;
    }
    let model = match proof_layer(&proof) {
        Some(l) if l < node.model_cfg.num_layers as u32 => match referee_model(
            &node,
            LayerRange {
                start: l,
                end: l + 1,
            },
        )
        .await
        {
            Ok(m) => Some(m),
            Err(e) => {
                warn!("cannot check a proof against {}: {e}", proof.accused);
                return false;
            }
        },
        Some(l) => {
            warn!("a proof names layer {l}, beyond the model");
            return false;
        }
        None => None,
    };
    let (n2, p2) = (node.clone(), proof.clone());
    let checked = tokio::task::spawn_blocking(move || {
        verify_proof(&p2, n2.model_id, &n2.model_cfg, model.as_deref(), &n2.gemm)
    })
    .await;
    match checked {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            warn!("a proof against {} does not hold: {e}", proof.accused);
            return false;
        }
        Err(e) => {
            warn!("checking a proof failed: {e}");
            return false;
        }
    }
    let accused = proof.accused.clone();
    let json = serde_json::to_vec(&proof).ok();
    let (id, fresh) = node
        .audits
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .exclude(proof);
    // Keep the proof where operators find it (`dcd verify-proof <file>` checks it anywhere).
    if let (true, Some(bytes)) = (fresh, json) {
        let dir = node.cfg.data_dir.join("proofs");
        if std::fs::create_dir_all(&dir).is_ok() {
            let _ = std::fs::write(dir.join(format!("{}.json", id.to_hex())), bytes);
        }
    }
    if fresh {
        println!("excluded peer {accused}: proof {id}");
        warn!("excluded peer {accused}: fraud proof {id}");
        node.stats.exclusions.fetch_add(1, Ordering::Relaxed);
    }
    if gossip {
        node.gossip(&Gossip::Proof { id, accused }).await;
    }
    true
}

/// Proof id, for logs.
pub fn short(id: &Commitment) -> String {
    id.to_hex()[..12].to_string()
}

/// Domain-separated secret for the audit coin, from the time, the process and the identity.
pub fn new_secret(identity: &[u8]) -> [u8; 32] {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let mut b = Vec::new();
    b.extend_from_slice(&now.to_le_bytes());
    b.extend_from_slice(&std::process::id().to_le_bytes());
    b.extend_from_slice(identity);
    Domain::HopRecord.hash(&b).0
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is the failure report

    use super::*;

    fn participant(peer: &str, start: u32, end: u32) -> Participant {
        Participant {
            peer: peer.into(),
            layers: LayerRange { start, end },
            head: false,
            throughput: 1.0,
            active: 0,
        }
    }

    #[test]
    fn a_peer_is_picked_among_those_covering_the_layers_and_never_the_accused() {
        let ps = [
            participant("accused", 2, 4),
            participant("short", 2, 3),
            participant("a", 0, 4),
            participant("b", 2, 6),
        ];
        let layers = LayerRange { start: 2, end: 4 };
        let mut seen = std::collections::HashSet::new();
        for salt in 0u8..64 {
            let p = pick_peer(&ps, &[], layers, "accused", &[salt]).unwrap();
            assert!(p == "a" || p == "b", "{p}");
            // The same salt, the same peer.
            assert_eq!(pick_peer(&ps, &[], layers, "accused", &[salt]).unwrap(), p);
            seen.insert(p);
        }
        assert_eq!(seen.len(), 2, "salts spread the choice");
        let nobody = [participant("accused", 2, 4), participant("short", 2, 3)];
        assert_eq!(pick_peer(&nobody, &[], layers, "accused", b"s"), None);
    }

    #[test]
    fn a_last_resort_is_picked_only_when_no_other_qualifies() {
        let layers = LayerRange { start: 0, end: 2 };
        let ps = [participant("failed", 0, 2), participant("fine", 0, 2)];
        let last_resort = ["failed".to_string()];
        for salt in 0u8..64 {
            let p = pick_peer(&ps, &last_resort, layers, "x", &[salt]).unwrap();
            assert_eq!(p, "fine");
        }
        let only = [participant("failed", 0, 2), participant("fine", 0, 1)];
        assert_eq!(
            pick_peer(&only, &last_resort, layers, "x", b"s").as_deref(),
            Some("failed")
        );
    }
}
