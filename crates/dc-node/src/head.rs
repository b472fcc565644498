//! Heading a generation: electing the head, choosing the route, running prefill and one token
//! per lap through the stages (local ones in this process, remote ones over the network),
//! checking every stage's signed record, sampling, and streaming the tokens back.

use std::sync::Arc;

use dc_model::generate::{logits_commitment, GenerateRequest, Next, TokenLoop};
use dc_model::sampling::SamplingParams;
use dc_model::Activations;
use dc_types::{
    GenerationEvent, GenerationId, GenerationRequest, HopRequest, HopResponse, RouteHop,
    StageRequest, StageResponse,
};
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::node::Node;
use crate::stage::{from_wire, serve_hop, to_wire};
use crate::view::plan_route;

/// Most events queued towards a slow client before the head waits for it.
pub const EVENT_QUEUE: usize = 64;

fn sampling(req: &GenerationRequest) -> SamplingParams {
    SamplingParams {
        temperature: req.sampling.temperature,
        top_k: (req.sampling.top_k > 0).then_some(req.sampling.top_k as usize),
        top_p: (req.sampling.top_p < 1.0).then_some(req.sampling.top_p),
        seed: req.sampling.seed,
    }
}

/// Runs one hop: locally when the route says this daemon, else over the network, checking the
/// stage's signed record against what we sent and what came back.
async fn hop(
    node: &Arc<Node>,
    h: &RouteHop,
    g: GenerationId,
    step: u64,
    x: Activations,
) -> Result<Activations, String> {
    let req = HopRequest {
        model_id: node.model_id,
        generation: g,
        step,
        layers: h.layers,
        activations: to_wire(&x),
    };
    let resp = if h.peer == node.local {
        serve_hop(node.clone(), req).await
    } else {
        let peer: libp2p::PeerId = h
            .peer
            .parse()
            .map_err(|e| format!("route peer {}: {e}", h.peer))?;
        match node
            .client
            .stage_request(peer, StageRequest::Hop(req))
            .await
        {
            Ok(StageResponse::Hop(r)) => *r,
            Ok(StageResponse::Ack) => {
                return Err(format!("peer {} answered a hop with an ack", h.peer))
            }
            Err(e) => {
                return Err(format!(
                    "hop to {} (layers {}) failed: {e}",
                    h.peer, h.layers
                ))
            }
        }
    };
    match resp {
        HopResponse::Done {
            activations,
            record,
        } => {
            let signer = dc_net::signing::verify("hop", &record)
                .map_err(|e| format!("peer {}: bad hop record: {e}", h.peer))?;
            if signer.to_string() != h.peer {
                return Err(format!("peer {} sent a record signed by {signer}", h.peer));
            }
            let y = from_wire(
                activations,
                node.model_cfg.hidden_size,
                node.model_cfg.max_positions,
            )
            .map_err(|e| format!("peer {}: {e}", h.peer))?;
            let r = &record.body;
            if r.generation != g || r.step != step || r.layers != h.layers {
                return Err(format!("peer {}: the record is for another hop", h.peer));
            }
            if r.input != x.commitment() {
                return Err(format!(
                    "peer {}: the record commits to other input activations",
                    h.peer
                ));
            }
            if r.output != y.commitment() || y.start != x.start || y.rows() != x.rows() {
                return Err(format!(
                    "peer {}: the activations do not match its record",
                    h.peer
                ));
            }
            Ok(y)
        }
        HopResponse::Refused { kind, message } => Err(format!(
            "peer {} refused layers {}: {kind:?}: {message}",
            h.peer, h.layers
        )),
    }
}

/// Runs every stage of the route over `x`.
async fn lap(
    node: &Arc<Node>,
    route: &[RouteHop],
    g: GenerationId,
    step: u64,
    mut x: Activations,
) -> Result<Activations, String> {
    for h in route {
        x = hop(node, h, g, step, x).await?;
    }
    Ok(x)
}

/// Embeds `tokens` at `start` (head weights, compute pool).
async fn embed(node: &Arc<Node>, tokens: Vec<u32>, start: usize) -> Result<Activations, String> {
    let serving = node.serving().ok_or("not serving yet")?;
    tokio::task::spawn_blocking(move || {
        serving
            .model
            .embed(&tokens, start)
            .map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Logits of the last row.
async fn readout(node: &Arc<Node>, x: Activations) -> Result<Vec<f32>, String> {
    let serving = node.serving().ok_or("not serving yet")?;
    let n2 = node.clone();
    tokio::task::spawn_blocking(move || {
        serving
            .model
            .readout(&n2.gemm, &x.last_row())
            .map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Heads `req`: streams [`GenerationEvent`]s into `tx` until `Done` or `Failed`.
pub async fn run_as_head(
    node: Arc<Node>,
    req: GenerationRequest,
    tx: mpsc::Sender<GenerationEvent>,
) {
    let g = req.generation;
    let route = match plan(&node, &req) {
        Ok(r) => r,
        Err(message) => {
            let _ = tx.send(GenerationEvent::Failed { message }).await;
            return;
        }
    };
    node.stats
        .active_heads
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    info!(
        "heading generation {g}: route {}",
        route
            .iter()
            .map(|h| format!("{}@{}", h.layers, &h.peer[h.peer.len().saturating_sub(6)..]))
            .collect::<Vec<_>>()
            .join(" → ")
    );
    let _ = tx
        .send(GenerationEvent::Started {
            head: node.local.clone(),
            route: route.clone(),
        })
        .await;
    let result = drive(&node, &req, &route, &tx).await;
    node.stats
        .active_heads
        .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    // Free every stage's cache; remote ends are best effort (caches also expire when idle).
    for h in &route {
        if h.peer == node.local {
            node.caches
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .end(&g);
        } else if let Ok(peer) = h.peer.parse() {
            let client = node.client.clone();
            tokio::spawn(async move {
                let _ = client
                    .stage_request(peer, StageRequest::End { generation: g })
                    .await;
            });
        }
    }
    let ev = match result {
        Ok(ev) => ev,
        Err(message) => {
            warn!("generation {g} failed: {message}");
            GenerationEvent::Failed { message }
        }
    };
    let _ = tx.send(ev).await;
}

fn plan(node: &Arc<Node>, req: &GenerationRequest) -> Result<Vec<RouteHop>, String> {
    if req.model_id != node.model_id {
        return Err(format!(
            "this daemon serves model {}, not {}",
            node.model_id, req.model_id
        ));
    }
    let serving = node.serving().ok_or("this daemon is still loading")?;
    if !serving.head {
        return Err("this daemon does not hold the head weights".into());
    }
    plan_route(
        &req.generation,
        node.model_cfg.num_layers as u32,
        &node.local,
        &node.participants(),
    )
}

async fn drive(
    node: &Arc<Node>,
    req: &GenerationRequest,
    route: &[RouteHop],
    tx: &mpsc::Sender<GenerationEvent>,
) -> Result<GenerationEvent, String> {
    let g = req.generation;
    let greq = GenerateRequest {
        prompt: req.prompt.clone(),
        max_new_tokens: req.max_new_tokens as usize,
        sampling: sampling(req),
        stop_tokens: req.stop_tokens.clone(),
        chunk: req.chunk.max(1) as usize,
    };
    let mut tl = TokenLoop::new(&greq, node.model_cfg.max_positions).map_err(|e| e.to_string())?;
    let mut step = 0u64;
    let mut logits = Vec::new();
    let mut pos = 0usize;
    for chunk in greq.prompt.chunks(greq.chunk) {
        let x = embed(node, chunk.to_vec(), pos).await?;
        let y = lap(node, route, g, step, x).await?;
        step += 1;
        pos += chunk.len();
        logits = readout(node, y).await?;
    }
    let stop = loop {
        let next = tl.next(&logits).map_err(|e| e.to_string())?;
        let (t, done) = match next {
            Next::Feed(t) => (Some(t), None),
            Next::Last(t, why) => (Some(t), Some(why)),
            Next::Done(why) => (None, Some(why)),
        };
        if let Some(t) = t {
            node.stats
                .tokens
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let ev = GenerationEvent::Token {
                index: tl.tokens.len() as u32 - 1,
                id: t,
            };
            if tx.send(ev).await.is_err() {
                return Err("the client went away".into());
            }
        }
        if let Some(why) = done {
            break why;
        }
        let t = tl.tokens[tl.tokens.len() - 1];
        let x = embed(node, vec![t], pos).await?;
        let y = lap(node, route, g, step, x).await?;
        step += 1;
        pos += 1;
        logits = readout(node, y).await?;
    };
    let stop = serde_json::to_value(stop)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    Ok(GenerationEvent::Done {
        tokens: tl.tokens.clone(),
        stop,
        final_logits: logits_commitment(pos.saturating_sub(1), &logits),
    })
}
