//! One hop as the head sees it: the request to a stage (this daemon's own, or a peer's), and
//! every check of the answer before it is used — signature, fields, input and output
//! commitments, the chain of inputs, and the record against its trace (a contradiction is a
//! proof by itself, and the peer is excluded on the spot).

use dc_model::Activations;
use dc_types::{
    Commitment, FraudProof, GenerationId, HopRecord, HopRequest, HopResponse, HopTrace, ProofKind,
    Signed, StageRequest, StageResponse,
};
use tracing::warn;

use super::stop::{unusable, Stop};
use crate::check::proof::check_consistency;
use crate::check::referee::accept_proof;
use crate::core::wire::{from_wire, to_wire};
use crate::daemon::Daemon;

/// A stage's answer to one hop, checked.
pub(super) struct HopResult {
    pub output: Activations,
    pub record: Signed<HopRecord>,
    pub trace: HopTrace,
}

/// Runs one hop on `peer` (ourselves or remote) and checks the answer: signature, fields, input
/// and output commitments, the chain of inputs (`previous`: what the stage's last record of
/// this generation chains to), and the trace against the record. A record that contradicts its
/// own trace is a proof by itself: the peer is excluded on the spot.
pub(super) async fn hop_on(
    d: &Daemon,
    peer: &str,
    layers: dc_types::LayerRange,
    g: GenerationId,
    step: u64,
    x: &Activations,
    previous: Commitment,
) -> Result<HopResult, Stop> {
    let req = HopRequest {
        model_id: d.node.model_id,
        generation: g,
        step,
        layers,
        activations: to_wire(x),
    };
    let resp = if peer == d.node.local {
        d.stage.serve_own_hop(req).await
    } else {
        let p: libp2p::PeerId = peer
            .parse()
            .map_err(|e| unusable(peer, format!("route peer {peer}: {e}")))?;
        match d.node.client.stage_request(p, StageRequest::Hop(req)).await {
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
        d.node.model_cfg.hidden_size,
        d.node.model_cfg.max_positions,
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
            model_id: d.node.model_id,
            accused: peer.to_string(),
            kind: ProofKind::Inconsistent,
            records: vec![record.clone()],
            traces: vec![trace.clone()],
            layer_inputs: Vec::new(),
        };
        warn!("peer {peer} signed a record that contradicts its trace: {e}");
        if accept_proof(&d.checks, proof, true).await {
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
