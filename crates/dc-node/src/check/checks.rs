//! The checks' state: the ledger of audits, spot checks and held proofs, the head's secret
//! coin, the spot-check keys of the layers this head has checked, the model loaded to referee
//! layers it does not serve, and the line of gossiped proof claims. One [`Checks`] per daemon;
//! the audits (`audit.rs`), spot checks (`spot.rs`), refereeing (`referee.rs`) and claims
//! (`fetch.rs`) work on it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use dc_kernels::{Commitment, Domain};
use dc_model::{LayerChecker, Model};
use dc_types::{FraudProof, LayerRange};
use serde_json::Value;

use super::book::AuditBook;
use super::claims::ClaimQueue;
use crate::core::Node;
use crate::stage::Stage;
use crate::weights::Weights;

/// What this daemon checks, and what it knows from checking.
#[derive(Debug)]
pub struct Checks {
    /// The node's shared state.
    pub node: Arc<Node>,
    /// Our own stage (it replays audits this daemon runs for itself).
    pub stage: Arc<Stage>,
    /// The model's files (a fetched model fetches the layers it referees or checks).
    pub weights: Arc<Weights>,
    book: Mutex<AuditBook>,
    /// Layers loaded on demand to referee disputes and check proofs.
    pub(super) referee: tokio::sync::Mutex<Option<(LayerRange, Arc<Model>)>>,
    /// Held for a whole refereeing, so concurrent failed audits of one liar referee it once.
    pub(super) referee_gate: tokio::sync::Mutex<()>,
    /// Secret of the head's audit coin and spot-check draws (never leaves this process).
    pub(super) secret: [u8; 32],
    /// Spot-check keys (`W · r`, biases, norms) of the layers this head has checked.
    pub(super) checkers: tokio::sync::Mutex<HashMap<usize, Arc<LayerChecker>>>,
    /// Gossiped proof claims being fetched and checked, and those waiting their turn.
    pub(super) claims: Mutex<ClaimQueue>,
}

impl Checks {
    /// The checks of `node`, whose own audits replay on `stage`, loading layers it does not
    /// serve from `weights`.
    pub fn new(node: Arc<Node>, stage: Arc<Stage>, weights: Arc<Weights>) -> Checks {
        let secret = new_secret(node.local.as_bytes());
        Checks {
            node,
            stage,
            weights,
            book: Mutex::new(AuditBook::default()),
            referee: tokio::sync::Mutex::new(None),
            referee_gate: tokio::sync::Mutex::new(()),
            secret,
            checkers: tokio::sync::Mutex::new(HashMap::new()),
            claims: Mutex::new(ClaimQueue::default()),
        }
    }

    /// The ledger.
    pub(super) fn book(&self) -> MutexGuard<'_, AuditBook> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A proof this daemon holds (answers `GetProof`).
    pub fn proof(&self, id: &Commitment) -> Option<FraudProof> {
        self.book().proof(id)
    }

    /// The status sections: audits and spot checks, and the excluded peers with their proofs.
    pub fn status(&self) -> (Value, Value) {
        self.book().status(&self.node.excluded())
    }

    /// An excluded peer to name in a correction (the last by id), if any.
    pub fn last_excluded(&self) -> Option<String> {
        let (_, excluded) = self.status();
        let last = excluded.as_array()?.last()?;
        last["peer_id"].as_str().map(str::to_string)
    }
}

/// Domain-separated secret for the audit coin, from the time, the process and the identity.
fn new_secret(identity: &[u8]) -> [u8; 32] {
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
