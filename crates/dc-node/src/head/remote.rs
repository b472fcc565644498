//! Generations across daemons: the requester's side (elect the generation's head by
//! rendezvous hashing — maybe ourselves — forward the request, and relay the head's events,
//! each checked by [`EventBounds`]) and the elected head's side (serve a request forwarded to
//! us, bounded by the daemon's slots for other peers' generations).

use std::time::Duration;

use dc_types::{GenerationEvent, GenerationRequest};
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::bounds::EventBounds;
use super::driver::{run_as_head, EVENT_QUEUE};
use crate::core::view::elect_head;
use crate::daemon::Daemon;

/// Largest generation request or event on a generation stream.
const MAX_GENERATION_MESSAGE: usize = 4 << 20;

/// Serves a generation forwarded to us (we are its elected head): read the request, run it,
/// stream the events back.
pub async fn serve_generation_stream(d: Daemon, peer: String, mut stream: libp2p::Stream) {
    let node = d.node.clone();
    let timeout = node.cfg.request_timeout;
    let req: GenerationRequest =
        match dc_net::frames::recv(&mut stream, MAX_GENERATION_MESSAGE, Duration::from_secs(30))
            .await
        {
            Ok(r) => r,
            Err(e) => {
                warn!("bad generation request from {peer}: {e}");
                return;
            }
        };
    let permit = if node.paused() {
        Err("paused: the machine is busy with other work".to_string())
    } else {
        node.headed.clone().try_acquire_owned().map_err(|_| {
            format!(
                "already heading {} generations for other peers; try again later",
                node.cfg.max_generations
            )
        })
    };
    let permit = match permit {
        Ok(p) => p,
        Err(message) => {
            info!("not heading a generation for {peer}: {message}");
            let ev = GenerationEvent::Failed { message };
            let _ = dc_net::frames::send(&mut stream, &ev, MAX_GENERATION_MESSAGE, timeout).await;
            let _ = futures::AsyncWriteExt::close(&mut stream).await;
            return;
        }
    };
    let (tx, mut rx) = mpsc::channel(EVENT_QUEUE);
    // The slot is held as long as the head runs, even if the requester has gone.
    tokio::spawn(async move {
        let _permit = permit;
        run_as_head(d, req, tx).await
    });
    while let Some(ev) = rx.recv().await {
        let last = matches!(
            ev,
            GenerationEvent::Done { .. } | GenerationEvent::Failed { .. }
        );
        if let Err(e) =
            dc_net::frames::send(&mut stream, &ev, MAX_GENERATION_MESSAGE, timeout).await
        {
            warn!("generation stream to {peer} broke: {e}");
            return;
        }
        if last {
            break;
        }
    }
    let _ = futures::AsyncWriteExt::close(&mut stream).await;
}

/// Starts a generation from the control API: elects the head (maybe ourselves) and returns the
/// stream of its events.
pub async fn start_generation(
    d: Daemon,
    req: GenerationRequest,
) -> Result<mpsc::Receiver<GenerationEvent>, String> {
    let node = d.node.clone();
    let participants = node.participants();
    let head = elect_head(&req.generation, &participants)
        .ok_or("no healthy peer holds the head weights")?
        .peer
        .clone();
    let (tx, rx) = mpsc::channel(EVENT_QUEUE);
    if head == node.local {
        tokio::spawn(run_as_head(d, req, tx));
        return Ok(rx);
    }
    let peer: libp2p::PeerId = head.parse().map_err(|e| format!("head {head}: {e}"))?;
    let mut stream = node
        .client
        .open_generation_stream(peer)
        .await
        .map_err(|e| format!("cannot reach the head {head}: {e}"))?;
    dc_net::frames::send(
        &mut stream,
        &req,
        MAX_GENERATION_MESSAGE,
        Duration::from_secs(30),
    )
    .await
    .map_err(|e| format!("sending the request to the head {head}: {e}"))?;
    let timeout = node.cfg.request_timeout;
    let mut bounds = EventBounds::new(req.max_new_tokens);
    tokio::spawn(async move {
        loop {
            let ev: GenerationEvent =
                match dc_net::frames::recv(&mut stream, MAX_GENERATION_MESSAGE, timeout).await {
                    Ok(ev) => match bounds.admit(&ev) {
                        Ok(()) => ev,
                        Err(e) => GenerationEvent::Failed {
                            message: format!("the head {head} broke the protocol: {e}"),
                        },
                    },
                    Err(e) => GenerationEvent::Failed {
                        message: format!("the head {head} stopped answering: {e}"),
                    },
                };
            let last = matches!(
                ev,
                GenerationEvent::Done { .. } | GenerationEvent::Failed { .. }
            );
            if tx.send(ev).await.is_err() || last {
                break;
            }
        }
    });
    Ok(rx)
}
