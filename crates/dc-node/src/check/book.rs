//! The checks' ledger: audit and spot-check counters per peer, and the fraud proofs this
//! daemon holds (bounded) to answer peers that fetch them. Plain data; no I/O.

use std::collections::{BTreeMap, HashMap, VecDeque};

use dc_kernels::Commitment;
use dc_types::FraudProof;
use serde_json::{json, Value};

use super::proof::proof_id;

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
    proofs: HashMap<Commitment, FraudProof>,
    order: VecDeque<Commitment>,
    /// Audits the head wanted but could find no auditor for.
    pub unavailable: u64,
    /// Audits run from the audited stage's committed cache rows (one hop each, no replay).
    pub from_cache: u64,
    /// Bytes of cache rows those audits carried (received from the stage, sent on).
    pub from_cache_bytes: u64,
    /// Spot checks run by this head.
    pub spot: SpotTally,
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

    /// Keeps `proof` (checked) to answer others; returns its id.
    pub fn keep_proof(&mut self, proof: FraudProof) -> Commitment {
        let id = proof_id(&proof);
        if !self.proofs.contains_key(&id) {
            if self.order.len() >= MAX_PROOFS {
                if let Some(old) = self.order.pop_front() {
                    self.proofs.remove(&old);
                }
            }
            self.order.push_back(id);
            self.proofs.insert(id, proof);
        }
        id
    }

    /// A proof we hold.
    pub fn proof(&self, id: &Commitment) -> Option<FraudProof> {
        self.proofs.get(id).cloned()
    }

    /// The status section: the audits, and the `excluded` peers with their proofs' ids.
    pub fn status(&self, excluded: &[(String, Commitment)]) -> (Value, Value) {
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
        let excluded: Vec<Value> = excluded
            .iter()
            .map(|(p, id)| json!({"peer_id": p, "proof_id": id.to_hex()}))
            .collect();
        (audits, Value::Array(excluded))
    }
}

/// Spot-check counters of this head.
#[derive(Clone, Copy, Debug, Default)]
pub struct SpotTally {
    /// Hops checked.
    pub run: u64,
    /// Checks that passed.
    pub passed: u64,
    /// Checks that failed (each sent to the referee).
    pub failed: u64,
    /// Reveals refused or lost.
    pub unavailable: u64,
    /// (layer, row) pairs checked.
    pub layers: u64,
    /// Parts of those layers tested (weight products, attention products, outputs).
    pub parts: u64,
    /// Of those layers, the ones whose attention was recomputed.
    pub attention: u64,
    /// Bytes of revealed rows and activations received.
    pub bytes: u64,
    /// Reveal exchanges with stages (each asks about up to `REVEAL_BATCH` hops).
    pub exchanges: u64,
}
