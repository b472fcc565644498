//! What this daemon says to the swarm and hears from it on the gossip topic: its own
//! announcement (model, layers, head, throughput, free memory, state, listen addresses), the
//! peers' announcements (into the peer table, their addresses dialled back), and proof claims
//! (handed to the checks).

use std::time::Instant;

use dc_types::{Announcement, Gossip, PROTOCOL_VERSION};
use libp2p::Multiaddr;

use crate::core::view::{Ignored, MAX_PEER_ADDRS};
use crate::core::MAX_ANNOUNCEMENT;
use crate::daemon::Daemon;

/// Our announcement now.
fn announcement(d: &Daemon) -> Announcement {
    let node = &d.node;
    let s = node.serving();
    let free = node
        .cfg
        .max_memory
        .map_or(0, |m| m.saturating_sub(node.weights_bytes()));
    Announcement {
        protocol_version: PROTOCOL_VERSION,
        software: format!("dcd {}", env!("CARGO_PKG_VERSION")),
        model_id: node.model_id,
        layers: s.as_ref().map(|s| s.layers),
        head: s.as_ref().is_some_and(|s| s.head),
        throughput: d.stage.announced_throughput(node.throughput()),
        free_memory: free,
        state: node.state(),
        active_generations: node.active_generations(),
        seq: node.next_seq(),
        listen_addrs: node.listen_addrs().iter().map(|a| a.to_string()).collect(),
    }
}

/// Publishes our announcement now.
pub async fn announce(d: &Daemon) {
    d.node.gossip(&Gossip::Announcement(announcement(d))).await;
}

/// A gossip message `data` from `from`.
pub fn on_gossip(d: &Daemon, from: &str, data: &[u8]) {
    match dc_types::decode::<Gossip>(data, MAX_ANNOUNCEMENT) {
        Ok(Gossip::Announcement(a)) => on_announcement(d, from, a),
        Ok(Gossip::Proof { id, accused }) => d.checks.on_proof_announced(from, id, accused),
        Err(e) => d.node.log_once(format!("bad:{from}"), || {
            format!("ignoring peer {from}: malformed gossip: {e}")
        }),
    }
}

/// `from`'s announcement: into the peer table if it is of our swarm, its addresses dialled.
fn on_announcement(d: &Daemon, from: &str, ann: Announcement) {
    let node = &d.node;
    let addrs: Vec<Multiaddr> = ann
        .listen_addrs
        .iter()
        .take(MAX_PEER_ADDRS)
        .filter_map(|a| a.parse().ok())
        .collect();
    let res = node.view.lock().unwrap_or_else(|e| e.into_inner()).update(
        from,
        ann,
        &node.model_id,
        Instant::now(),
    );
    match res {
        Ok(()) => {
            // Only a peer of our swarm is worth dialling back, at a few addresses.
            if let (Ok(peer), false) = (from.parse(), addrs.is_empty()) {
                let client = node.client.clone();
                tokio::spawn(async move {
                    for addr in addrs {
                        let _ = client.add_address(peer, addr).await;
                    }
                });
            }
        }
        Err(Ignored::Stale) => {}
        Err(Ignored::Protocol(v)) => node.log_once(format!("proto:{from}:{v}"), || {
            format!(
                "ignoring peer {from}: it speaks protocol version {v}, we speak {PROTOCOL_VERSION}"
            )
        }),
        Err(Ignored::Model(m)) => node.log_once(format!("model:{from}:{m}"), || {
            format!(
                "ignoring peer {from}: it serves model {}, we serve {}",
                m.short(),
                node.model_id.short()
            )
        }),
    }
}
