//! The network's events, each sent to the room that owns it: gossip to the gossip handling,
//! stage work to the stage, proof requests to the checks, the model's files to the weights,
//! generation streams to the head,
//! connection changes to the peer table.

use dc_net::NetEvent;
use dc_types::{PeerState, StageRequest, StageResponse};
use futures::StreamExt;
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::gossip::on_gossip;
use crate::daemon::Daemon;
use crate::head::serve_generation_stream;

/// Handles the network's events until the network loop stops.
pub fn spawn_event_handler(d: &Daemon, mut events: mpsc::Receiver<NetEvent>) {
    let d = d.clone();
    tokio::spawn(async move {
        while let Some(ev) = events.recv().await {
            on_net_event(&d, ev);
        }
    });
}

/// Serves the generations forwarded to us as their elected head.
pub fn spawn_generation_streams(d: &Daemon) -> Result<(), String> {
    let mut incoming = d
        .node
        .client
        .accept_generation_streams()
        .map_err(|e| e.to_string())?;
    let d = d.clone();
    tokio::spawn(async move {
        while let Some((peer, stream)) = incoming.next().await {
            tokio::spawn(serve_generation_stream(d.clone(), peer.to_string(), stream));
        }
    });
    Ok(())
}

pub(super) fn on_net_event(d: &Daemon, ev: NetEvent) {
    let node = &d.node;
    match ev {
        NetEvent::Gossip { from, data } => on_gossip(d, &from.to_string(), &data),
        NetEvent::StageRequest {
            from,
            request,
            channel,
        } => {
            let d = d.clone();
            tokio::spawn(async move {
                let from = from.to_string();
                let response = answer(&d, request, &from).await;
                if d.node
                    .client
                    .respond_stage(channel, response)
                    .await
                    .is_err()
                {
                    warn!("could not answer {from}: the network loop stopped");
                }
            });
        }
        NetEvent::ListenAddr(a) => {
            println!("listening on {a}/p2p/{}", node.local);
            node.add_listen_addr(a);
        }
        NetEvent::ListenAddrExpired(a) => node.remove_listen_addr(&a),
        NetEvent::Reachability(r) => {
            info!("reachability: {r}");
            node.set_reachability(r);
        }
        NetEvent::Connected(p) => info!("connected to {p}"),
        NetEvent::Disconnected(p) => {
            let p = p.to_string();
            let mut view = node.view.lock().unwrap_or_else(|e| e.into_inner());
            // A peer that said it was leaving and is now gone is forgotten at once.
            if view
                .get(&p)
                .is_some_and(|i| i.announcement.state == PeerState::Leaving)
            {
                view.remove(&p);
            }
        }
    }
}

/// The answer to `from`'s stage request. Who asks matters: a generation's caches and kept
/// hops are its head's alone.
async fn answer(d: &Daemon, request: StageRequest, from: &str) -> StageResponse {
    let stage = &d.stage;
    match request {
        StageRequest::Hop(h) => StageResponse::Hop(Box::new(stage.serve_hop(h, from).await)),
        StageRequest::End { generation } => {
            stage.end(&generation, from);
            StageResponse::Ack
        }
        StageRequest::Audit(a) => StageResponse::Audit(stage.serve_audit(a, from).await),
        StageRequest::Reveal(r) => StageResponse::Reveal(stage.serve_reveal(r, from).await),
        StageRequest::RevealHops(r) => {
            StageResponse::RevealHops(stage.serve_reveal_hops(r, from).await)
        }
        StageRequest::CacheRows(r) => {
            StageResponse::CacheRows(stage.serve_cache_rows(r, from).await)
        }
        StageRequest::GetProof { id } => StageResponse::Proof(Box::new(d.checks.proof(&id))),
        StageRequest::Manifest { model_id } => {
            StageResponse::Manifest(d.weights.serve_manifest(&model_id))
        }
        StageRequest::Piece(r) => StageResponse::Piece(d.weights.serve_piece(r).await),
    }
}
