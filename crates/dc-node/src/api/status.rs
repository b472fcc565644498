//! The daemon's status as one JSON document (`GET /status`, `dcd status --json`): this peer,
//! the peers it knows, layer coverage and counters.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Instant;

use dc_net::{ConnectionInfo, ConnectionKind};

use serde_json::{json, Value};

use crate::core::view::{coverage, uncovered};
use crate::daemon::Daemon;

/// How we reach each connected peer: `"direct"` when any of its connections is direct (a
/// hole punch leaves the relayed one open beside it for a while), else `"relayed"`.
fn links(connections: &[ConnectionInfo]) -> HashMap<String, &'static str> {
    let mut links = HashMap::new();
    for c in connections {
        let kind = match c.kind {
            ConnectionKind::Direct => "direct",
            ConnectionKind::Relayed => "relayed",
        };
        let e = links.entry(c.peer.to_string()).or_insert(kind);
        if kind == "direct" {
            *e = kind;
        }
    }
    links
}

/// The status document; `connections` are the network's open connections.
pub fn status(d: &Daemon, connections: &[ConnectionInfo]) -> Value {
    let links = links(connections);
    let node = &d.node;
    let serving = node.serving();
    let now = Instant::now();
    let view = node.view.lock().unwrap_or_else(|e| e.into_inner());
    let peers: Vec<Value> = view
        .peers()
        .map(|(id, p)| {
            let a = &p.announcement;
            json!({
                "peer_id": id,
                "layers": a.layers.map(|l| l.to_string()),
                "head": a.head,
                "state": a.state.name(),
                "throughput": a.throughput,
                "free_memory": a.free_memory,
                "active_generations": a.active_generations,
                "software": a.software,
                "connection": links.get(id).copied().unwrap_or("none"),
                "last_seen_ms": now.duration_since(p.last_seen).as_millis() as u64,
            })
        })
        .collect();
    drop(view);
    let n = node.model_cfg.num_layers as u32;
    let (audits, excluded) = d.checks.status();
    let cov = coverage(n, &node.participants());
    json!({
        "peer_id": node.local,
        "listen_addrs": node.listen_addrs().iter().map(|a| format!("{a}/p2p/{}", node.local)).collect::<Vec<_>>(),
        "software": format!("dcd {}", env!("CARGO_PKG_VERSION")),
        "reachability": node.reachability().to_string(),
        "private_swarm": node.cfg.swarm_key.map(|k| k.fingerprint()),
        "connections": {
            "open": connections.len(),
            "relayed": connections.iter().filter(|c| c.kind == ConnectionKind::Relayed).count(),
            "max": node.cfg.max_connections,
        },
        "model": node.cfg.model.display().to_string(),
        "model_id": node.model_id.to_string(),
        "num_layers": n,
        "layers": serving.as_ref().map(|s| s.layers.to_string()),
        "head": serving.as_ref().is_some_and(|s| s.head),
        "state": node.state().name(),
        "fetched_model": d.weights.is_fetched(),
        "fetch": d.weights.status(),
        "paused": node.paused(),
        "idle_only": node.cfg.idle_only,
        "uptime_s": node.started.elapsed().as_secs(),
        "throughput": node.throughput(),
        "kernel": node.gemm.kernel().name(),
        "threads": node.gemm.threads(),
        "memory": {
            "budget": node.cfg.max_memory,
            "weights": node.weights_bytes(),
            "streamed_layers": serving.as_ref().map_or(0, |s| s.model.stream_stats().layers.len()),
            "layer_reads": serving.as_ref().map_or(0, |s| s.model.stream_stats().reads),
            "kv_caches": d.stage.cache_bytes(),
        },
        "generations": {
            "active": node.active_generations(),
            "max": node.cfg.max_generations,
            "requests": node.stats.requests.load(Ordering::Relaxed),
        },
        "reveals_peak": d.stage.reveals_peak(),
        "hops_served": node.stats.hops.load(Ordering::Relaxed),
        "hops_stacked": node.stats.stacked_hops.load(Ordering::Relaxed),
        "positions_served": node.stats.positions.load(Ordering::Relaxed),
        "audit_positions_replayed": node.stats.audit_positions.load(Ordering::Relaxed),
        "tokens_generated": node.stats.tokens.load(Ordering::Relaxed),
        "uncovered": uncovered(&cov).iter().map(|g| g.to_string()).collect::<Vec<_>>(),
        "coverage": cov,
        "audits": audits,
        "excluded_peers": excluded,
        "corrections": node.stats.corrections.load(Ordering::Relaxed),
        "tokens_guessed": node.stats.guessed.load(Ordering::Relaxed),
        "guesses_kept": node.stats.guesses_kept.load(Ordering::Relaxed),
        "reroutes": node.stats.reroutes.load(Ordering::Relaxed),
        "stages_replaced": node.stats.stages_replaced.load(Ordering::Relaxed),
        "head_failovers": node.stats.head_failovers.load(Ordering::Relaxed),
        "peers": peers,
    })
}
