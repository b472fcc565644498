//! Generations across daemons: the requester's side (elect the generation's head by
//! rendezvous hashing — maybe ourselves — forward the request, and relay the head's events,
//! each checked by [`EventBounds`]; when the head stops answering, the next peer in the
//! rendezvous order takes the generation over from the transcript the requester holds: the
//! request itself, whose seed and sampling settings make every draw reproducible, and the
//! tokens the client already has) and the elected head's side (serve a request forwarded to
//! us, bounded by the daemon's slots for other peers' generations).

use std::sync::atomic::Ordering;
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

/// Most times a generation moves on to the next head after its head stopped answering.
pub const MAX_HEAD_FAILOVERS: usize = 3;

/// Starts a generation from the control API: elects the head (maybe ourselves) and returns the
/// stream of its events. If a remote head stops answering mid-generation, the next peer in the
/// rendezvous order takes the generation over from the tokens the client holds.
pub async fn start_generation(
    d: Daemon,
    req: GenerationRequest,
) -> Result<mpsc::Receiver<GenerationEvent>, String> {
    let (tx, rx) = mpsc::channel(EVENT_QUEUE);
    // An elected head that cannot be reached (it died and the view does not know yet) is
    // passed over like one that stops answering later.
    let mut failed = Vec::new();
    match next_head(&d, &req, &mut failed).await? {
        None => {
            tokio::spawn(run_as_head(d, req, tx));
        }
        Some((head, stream)) => {
            tokio::spawn(relay(d, req, head, stream, tx, failed));
        }
    }
    Ok(rx)
}

/// The next head of `req` that answers, leaving out the `failed` ones (and adding those that
/// cannot be reached now): `None` when it is ourselves, else the head and the stream to it
/// with the request sent. At most [`MAX_HEAD_FAILOVERS`] heads are passed over.
async fn next_head(
    d: &Daemon,
    req: &GenerationRequest,
    failed: &mut Vec<String>,
) -> Result<Option<(String, libp2p::Stream)>, String> {
    loop {
        if failed.len() > MAX_HEAD_FAILOVERS {
            return Err(format!("gave up after {} heads", failed.len()));
        }
        let Some(next) = elect(d, req, failed) else {
            return Err(if failed.is_empty() {
                "no healthy peer holds the head weights".into()
            } else {
                "no other healthy peer holds the head weights".into()
            });
        };
        if next == d.node.local {
            return Ok(None);
        }
        match open(d, &next, req).await {
            Ok(s) => return Ok(Some((next, s))),
            Err(e) => {
                warn!("generation {}: {e}", req.generation);
                failed.push(next);
            }
        }
    }
}

/// The head of `req` among the healthy peers with the head weights, leaving out `failed` ones.
fn elect(d: &Daemon, req: &GenerationRequest, failed: &[String]) -> Option<String> {
    let mut participants = d.node.participants();
    participants.retain(|p| !failed.contains(&p.peer));
    elect_head(&req.generation, &participants).map(|p| p.peer.clone())
}

/// Opens a generation stream to `head` and sends it `req`.
async fn open(d: &Daemon, head: &str, req: &GenerationRequest) -> Result<libp2p::Stream, String> {
    let peer: libp2p::PeerId = head.parse().map_err(|e| format!("head {head}: {e}"))?;
    let mut stream = d
        .node
        .client
        .open_generation_stream(peer)
        .await
        .map_err(|e| format!("cannot reach the head {head}: {e}"))?;
    dc_net::frames::send(
        &mut stream,
        req,
        MAX_GENERATION_MESSAGE,
        Duration::from_secs(30),
    )
    .await
    .map_err(|e| format!("sending the request to the head {head}: {e}"))?;
    Ok(stream)
}

/// How following one head ended.
enum Followed {
    /// The generation ended (done, failed, the head broke the protocol, or the client left).
    Ended,
    /// The head stopped answering, for this reason.
    Lost(String),
}

/// Relays the events of `req`'s remote `head` to `tx`; when a head stops answering, hands the
/// generation to the next head with the tokens the client holds (at most
/// [`MAX_HEAD_FAILOVERS`] times).
async fn relay(
    d: Daemon,
    mut req: GenerationRequest,
    mut head: String,
    mut stream: libp2p::Stream,
    tx: mpsc::Sender<GenerationEvent>,
    mut failed: Vec<String>,
) {
    let mut bounds = EventBounds::new(req.max_new_tokens, req.top_logprobs);
    let mut held: Vec<u32> = Vec::new();
    loop {
        let why = match follow(&d, &head, &mut stream, &mut bounds, &mut held, &tx).await {
            Followed::Ended => return,
            Followed::Lost(why) => why,
        };
        failed.push(head.clone());
        req.resume = held.clone();
        let next = next_head(&d, &req, &mut failed).await;
        let taker = match &next {
            Ok(Some((p, _))) => p.clone(),
            Ok(None) => d.node.local.clone(),
            Err(e) => {
                let message = format!("the head {head} stopped answering: {why}; {e}");
                let _ = tx.send(GenerationEvent::Failed { message }).await;
                return;
            }
        };
        warn!(
            "generation {}: the head {head} stopped answering ({why}); {taker} takes it over \
             from token {}",
            req.generation,
            held.len()
        );
        d.node.stats.head_failovers.fetch_add(1, Ordering::Relaxed);
        match next {
            Ok(Some((p, s))) => (head, stream) = (p, s),
            _ => {
                // We hold the head weights: head it here, on the same stream to the client.
                run_as_head(d, req, tx).await;
                return;
            }
        }
    }
}

/// Relays `head`'s events on `stream` to `tx`, each within `bounds`, keeping the tokens the
/// client `held`.
async fn follow(
    d: &Daemon,
    head: &str,
    stream: &mut libp2p::Stream,
    bounds: &mut EventBounds,
    held: &mut Vec<u32>,
    tx: &mpsc::Sender<GenerationEvent>,
) -> Followed {
    let timeout = d.node.cfg.request_timeout;
    loop {
        let ev: GenerationEvent =
            match dc_net::frames::recv(stream, MAX_GENERATION_MESSAGE, timeout).await {
                Ok(ev) => match bounds.admit(&ev) {
                    Ok(()) => ev,
                    Err(e) => GenerationEvent::Failed {
                        message: format!("the head {head} broke the protocol: {e}"),
                    },
                },
                Err(e) => return Followed::Lost(e.to_string()),
            };
        match &ev {
            GenerationEvent::Token { id, .. } => held.push(*id),
            GenerationEvent::Corrected { from, tokens, .. } => {
                held.truncate(*from as usize);
                held.extend_from_slice(tokens);
            }
            _ => {}
        }
        let last = matches!(
            ev,
            GenerationEvent::Done { .. } | GenerationEvent::Failed { .. }
        );
        if tx.send(ev).await.is_err() || last {
            return Followed::Ended;
        }
    }
}
