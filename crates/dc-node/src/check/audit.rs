//! Audits: which hops get re-run and by whom. The head's secret coin picks hops; another peer
//! serving the same layers replays each picked hop in a session cache (continuing it, or
//! starting from the audited stage's committed cache rows), and the head compares the traces.
//! An auditor's disagreement alone proves nothing: it sends the hop to the referee.

use std::sync::Arc;

use dc_types::{
    AuditRequest, CacheRows, CacheRowsRequest, GenerationId, HopTrace, LayerRange, RouteHop,
    StageRequest, StageResponse,
};
use tracing::{info, warn};

use super::checks::Checks;
use super::log::StageLog;
use super::referee::referee;
use crate::core::view::Participant;
use crate::core::wire::to_wire;
use crate::core::Node;

/// The head's private coin: whether to audit this hop. Unpredictable to the stage, which cannot
/// know the head's secret when it commits.
pub fn should_audit(
    checks: &Checks,
    g: &dc_types::GenerationId,
    step: u64,
    seg: usize,
    rate: f32,
) -> bool {
    if rate <= 0.0 {
        return false;
    }
    let mut h = blake3::Hasher::new_keyed(&checks.secret);
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
    /// The first position of the last hop its cache ran.
    pub last_start: usize,
}

impl AuditSession {
    /// A session for route stage `seg` of generation `g`.
    pub fn new(checks: &Checks, g: &GenerationId, seg: usize) -> AuditSession {
        let mut h = blake3::Hasher::new_keyed(&checks.secret);
        h.update(b"audit session");
        h.update(&g.0);
        h.update(&(seg as u64).to_le_bytes());
        let mut id = [0u8; 16];
        id.copy_from_slice(&h.finalize().as_bytes()[..16]);
        AuditSession {
            id: GenerationId(id),
            auditor: None,
            held: 0,
            last_start: 0,
        }
    }

    /// The positions of the auditor's cache that stand for the hops in `log`: all it holds,
    /// unless a hop after the last one it ran started inside that one (a speculative guess
    /// missed), whose rows from there on are not the generation's.
    fn usable(&self, log: &StageLog) -> usize {
        let next = log.inputs.iter().find(|x| x.start > self.last_start);
        next.map_or(self.held, |x| self.held.min(x.start))
    }

    /// The auditor's cache ran `last` as its last hop.
    fn ran(&mut self, last: &dc_model::Activations) {
        self.held = last.start + last.rows();
        self.last_start = last.start;
    }

    /// Frees the auditor's cache.
    pub fn end(&self, checks: &Checks) {
        let node = &checks.node;
        match self.auditor.as_deref() {
            Some(a) if a == node.local => {
                checks.stage.end(&self.id, &node.local);
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
    checks: Arc<Checks>,
    seg: RouteHop,
    log: StageLog,
    session: Arc<tokio::sync::Mutex<AuditSession>>,
) -> bool {
    let node = &checks.node;
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
            session.end(&checks);
            session.held = 0;
            session.auditor = pick_auditor(node, seg.layers, &seg.peer, &session.id.0);
            match session.auditor.clone() {
                Some(a) => a,
                None => {
                    checks.book().unavailable += 1;
                    return false;
                }
            }
        }
    };
    // Continue the auditor's cache; if it lost it, start over once from position 0. An audit
    // of a hop the cache has already passed (audits of one stage can start out of order)
    // starts from 0 at once.
    let usable = session.usable(&log);
    let resume = if usable <= last.start { usable } else { 0 };
    if let Some(trace) = audit_from_cache(&checks, &seg, &log, &auditor, &session, resume).await {
        session.ran(last);
        drop(session);
        return judge(&checks, seg, log, &auditor, trace).await;
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
            hops: log.inputs[skip..].iter().map(|x| to_wire(x)).collect(),
            cache: None,
        };
        theirs = if auditor == node.local {
            checks.stage.serve_audit(req, &node.local).await
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
            session.ran(last);
            t
        }
        Err(e) => {
            warn!(
                "audit by {auditor} of {} (layers {}) could not run: {e}",
                seg.peer, seg.layers
            );
            session.held = 0;
            checks.book().unavailable += 1;
            return false;
        }
    };
    drop(session);
    judge(&checks, seg, log, &auditor, trace).await
}

/// Compares the auditor's trace of the last hop in `log` with the stage's; on disagreement,
/// referees. Returns whether the stage was proven to lie.
async fn judge(
    checks: &Arc<Checks>,
    seg: RouteHop,
    log: StageLog,
    auditor: &str,
    trace: HopTrace,
) -> bool {
    let agreed = log.traces.last().map(|t| &**t) == Some(&trace);
    checks.book().record(&seg.peer, agreed);
    if agreed {
        return false;
    }
    info!(
        "audit by {auditor} disagrees with {} on layers {}: refereeing",
        seg.peer, seg.layers
    );
    referee(checks, &seg.peer, seg.layers, &log).await
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
    checks: &Arc<Checks>,
    seg: &RouteHop,
    log: &StageLog,
    auditor: &str,
    session: &AuditSession,
    held: usize,
) -> Option<HopTrace> {
    let node = &checks.node;
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
    let (cfg, layers, end) = (node.model_cfg.clone(), seg.layers, last.start);
    let checked = tokio::task::spawn_blocking(move || {
        let views: Vec<_> = hops.iter().map(|(t, n)| (&**t, *n)).collect();
        if rows.len() != layers.as_range().len() {
            return Err(format!("rows of {} layers for {layers}", rows.len()));
        }
        // Each hop's rows whole, kept as the cache held them before the audited hop.
        layers
            .as_range()
            .zip(&rows)
            .map(|(l, bytes)| {
                dc_model::check_cache_rows(&cfg, l, &views, held, end, bytes)
                    .map(|r| r.into_owned())
            })
            .collect::<Result<Vec<_>, _>>()
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
        hops: vec![to_wire(last)],
        cache: Some(CacheRows {
            from: held as u32,
            rows,
        }),
    };
    let answer = if auditor == node.local {
        checks.stage.serve_audit(req, &node.local).await
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
            let mut book = checks.book();
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
