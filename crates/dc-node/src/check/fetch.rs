//! Proofs heard of in gossip: a peer says it holds a proof against another; this daemon
//! fetches it from that peer and checks it itself (in turn, bounded: see
//! [`ClaimQueue`](super::claims::ClaimQueue)), and excludes the accused only if it holds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dc_kernels::Commitment;
use dc_types::{StageRequest, StageResponse};
use tracing::info;

use super::checks::Checks;
use super::claims::{Claim, IGNORE_FALSE_CLAIMANT};
use super::proof::proof_id;
use super::referee::accept_proof;

/// How long a proof's holder has to send it (a lookup on its side; the proof is within the
/// message limit).
const PROOF_FETCH_TIMEOUT: Duration = Duration::from_secs(60);

impl Checks {
    /// `from` gossiped that it holds proof `id` against `accused`: fetch and check it, in turn.
    pub fn on_proof_announced(self: &Arc<Self>, from: &str, id: Commitment, accused: String) {
        let node = &self.node;
        if node.is_excluded(&accused) || accused == node.local {
            return;
        }
        let claim = Claim {
            id,
            from: from.to_string(),
            accused,
        };
        let start = self
            .claims
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .offer(claim, Instant::now());
        if let Some(claim) = start {
            self.fetch_claim(claim);
        }
    }

    /// Fetches and checks the proof of `claim`, then starts the claims waiting for its slot.
    fn fetch_claim(self: &Arc<Self>, claim: Claim) {
        let checks = self.clone();
        tokio::spawn(async move {
            let held = checks.fetch_and_check(&claim).await;
            if !held {
                info!(
                    "ignoring {}'s claim against {} (and its claims for {} s): no valid proof",
                    claim.from,
                    claim.accused,
                    IGNORE_FALSE_CLAIMANT.as_secs()
                );
            }
            let node = checks.node.clone();
            let next = checks
                .claims
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .finish(&claim, held, Instant::now(), |c| {
                    node.is_excluded(&c.accused)
                });
            for c in next {
                checks.fetch_claim(c);
            }
        });
    }

    /// Whether the claimant sent, in time, the proof it claimed, and it held.
    async fn fetch_and_check(self: &Arc<Self>, claim: &Claim) -> bool {
        let Ok(peer) = claim.from.parse::<libp2p::PeerId>() else {
            return false;
        };
        let request = StageRequest::GetProof { id: claim.id };
        let got = tokio::time::timeout(
            PROOF_FETCH_TIMEOUT,
            self.node.client.stage_request(peer, request),
        )
        .await;
        match got {
            Ok(Ok(StageResponse::Proof(p))) => match *p {
                Some(p) if proof_id(&p) == claim.id && p.accused == claim.accused => {
                    accept_proof(self, p, true).await
                }
                _ => false,
            },
            _ => false,
        }
    }
}
