//! Fetching the model from peers. First the skeleton, before the daemon knows anything but the
//! model id: the manifest from the first peer whose manifest hashes to that id, then every
//! header and small file (what opening the model reads). Then, once the daemon has chosen its
//! layers, the pieces of those layers (and of the head, if it heads).
//!
//! Each piece comes whole from one peer, in chunks, and is checked against the manifest's
//! hash before it counts: a peer that sends wrong bytes is named and never asked again, and
//! the piece comes from another. Pieces are fetched a few at a time from peers in turn; a peer
//! that cannot answer is passed over for the next. Only checked pieces are recorded, so a
//! fetch interrupted and started again goes on from the pieces it holds.

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use dc_model::fetched::FetchedModel;
use dc_model::manifest::{piece_hasher, Manifest};
use dc_net::{Client, NetEvent};
use dc_types::{LayerRange, ModelId, PieceRequest, StageRequest, StageResponse, MAX_PIECE_CHUNK};
use futures::StreamExt;
use libp2p::PeerId;
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{FetchStatus, Weights};

/// Pieces fetched at once.
const PIECES_AT_ONCE: usize = 4;
/// How long a fetch waits for some peer to send a piece before it gives up.
const PATIENCE: Duration = Duration::from_secs(120);
/// Pause before asking the peers again when none could send a piece.
const RETRY_PAUSE: Duration = Duration::from_secs(2);

/// Why one peer could not give a piece.
enum Failure {
    /// It sent bytes that do not hash to the manifest's: it lies or its files are damaged.
    Corrupt(String),
    /// It could not answer (does not hold the piece, timed out, refused).
    Unavailable(String),
    /// Our own disk failed: no other peer helps.
    Local(String),
}

/// One fetch: where pieces go and whom to avoid.
struct Fetch<'a> {
    client: &'a Client,
    model: &'a FetchedModel,
    model_id: ModelId,
    chunk: u32,
    avoided: &'a Mutex<HashSet<String>>,
    status: &'a Mutex<Option<FetchStatus>>,
}

impl Fetch<'_> {
    /// Fetches `pieces`, each from the first peer of `peers(connected)` (rotated per piece)
    /// that sends it whole and right.
    async fn pieces(
        &self,
        pieces: Vec<u32>,
        peers: impl Fn(Vec<PeerId>) -> Vec<PeerId>,
    ) -> Result<(), String> {
        let manifest = self.model.manifest();
        let total = manifest.bytes_of(&pieces);
        let mut corrupt: Vec<String> = self
            .avoided
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect();
        corrupt.sort();
        *self.status.lock().unwrap_or_else(|e| e.into_inner()) = Some(FetchStatus {
            total_bytes: total,
            total_pieces: pieces.len(),
            corrupt_peers: corrupt,
            ..FetchStatus::default()
        });
        let bar = dc_model::progress::bar(total, "fetching from peers");
        let started = Instant::now();
        let results: Vec<Result<(), String>> = futures::stream::iter(pieces.iter().copied())
            .map(|i| {
                let peers = &peers;
                let bar = &bar;
                async move {
                    self.piece(i, peers).await?;
                    let len = manifest.pieces[i as usize].len;
                    bar.inc(len);
                    if let Some(s) = self
                        .status
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .as_mut()
                    {
                        s.done_bytes += len;
                        s.done_pieces += 1;
                    }
                    Ok(())
                }
            })
            .buffer_unordered(PIECES_AT_ONCE)
            .collect()
            .await;
        bar.finish_and_clear();
        if let Some(s) = self
            .status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            s.finished = true;
        }
        results.into_iter().collect::<Result<(), String>>()?;
        if !pieces.is_empty() {
            println!(
                "fetched {} pieces ({:.1} MB) from peers in {:.1} s",
                pieces.len(),
                total as f64 / 1e6,
                started.elapsed().as_secs_f64()
            );
        }
        Ok(())
    }

    /// Fetches piece `i` from the peers in turn until one sends it right.
    async fn piece(
        &self,
        i: u32,
        peers: &impl Fn(Vec<PeerId>) -> Vec<PeerId>,
    ) -> Result<(), String> {
        let deadline = Instant::now() + PATIENCE;
        let mut last = String::from("no peer to ask");
        loop {
            let connected = self.client.connected_peers().await.unwrap_or_default();
            let mut candidates: Vec<PeerId> = {
                let avoided = self.avoided.lock().unwrap_or_else(|e| e.into_inner());
                peers(connected)
                    .into_iter()
                    .filter(|p| !avoided.contains(&p.to_string()))
                    .collect()
            };
            if !candidates.is_empty() {
                // Spread the pieces over the peers.
                let n = candidates.len();
                candidates.rotate_left(i as usize % n);
            }
            for peer in candidates {
                match self.piece_from(peer, i).await {
                    Ok(()) => return Ok(()),
                    Err(Failure::Corrupt(why)) => {
                        warn!(
                            "peer {peer} sent a corrupt copy of {}: {why}; not asking it again",
                            self.describe(i)
                        );
                        println!("peer {peer} sent a corrupt piece: fetching it elsewhere");
                        self.avoided
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(peer.to_string());
                        if let Some(s) = self
                            .status
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .as_mut()
                        {
                            s.corrupt_peers.push(peer.to_string());
                        }
                    }
                    Err(Failure::Unavailable(why)) => {
                        last = format!("{peer}: {why}");
                        tracing::debug!("piece {i} from {last}");
                    }
                    Err(Failure::Local(why)) => return Err(why),
                }
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "no peer sent {} within {} s (last: {last})",
                    self.describe(i),
                    PATIENCE.as_secs()
                ));
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
    }

    fn describe(&self, i: u32) -> String {
        match &self.model.manifest().pieces[i as usize].tensor {
            Some(t) => format!("tensor {}", t.name),
            None => format!("piece {i} (a header or small file)"),
        }
    }

    /// Fetches piece `i` whole from `peer`, writing it in place and checking its hash.
    async fn piece_from(&self, peer: PeerId, i: u32) -> Result<(), Failure> {
        let p = &self.model.manifest().pieces[i as usize];
        let mut file = self
            .model
            .piece_writer(i)
            .map_err(|e| Failure::Local(e.to_string()))?;
        let mut hasher = piece_hasher();
        let mut offset = 0u64;
        while offset < p.len {
            let len = (p.len - offset).min(u64::from(self.chunk)) as u32;
            let request = StageRequest::Piece(PieceRequest {
                model_id: self.model_id,
                piece: i,
                offset,
                len,
            });
            let bytes = match self.client.stage_request(peer, request).await {
                Ok(StageResponse::Piece(Ok(bytes))) => bytes,
                Ok(StageResponse::Piece(Err(why))) => return Err(Failure::Unavailable(why)),
                Ok(_) => return Err(Failure::Unavailable("answered something else".into())),
                Err(e) => return Err(Failure::Unavailable(e.to_string())),
            };
            if bytes.len() != len as usize {
                return Err(Failure::Corrupt(format!(
                    "{} bytes where {len} were asked for",
                    bytes.len()
                )));
            }
            hasher.update(&bytes);
            file.write_all(&bytes).map_err(|e| {
                Failure::Local(format!("writing {}: {e}", self.model.dir().display()))
            })?;
            offset += u64::from(len);
        }
        if *hasher.finalize().as_bytes() != p.hash {
            return Err(Failure::Corrupt("its hash is not the manifest's".into()));
        }
        self.model
            .mark_held(i, file)
            .map_err(|e| Failure::Local(e.to_string()))
    }
}

/// Chunk size for a daemon whose messages are capped at `max_message_bytes`.
fn chunk_for(max_message_bytes: usize) -> u32 {
    let room = max_message_bytes.saturating_sub(4096) as u64;
    room.clamp(4096, u64::from(MAX_PIECE_CHUNK)) as u32
}

/// Most network events kept back while the skeleton is fetched.
const MAX_HELD_BACK: usize = 256;

/// Fetches the skeleton of model `model_id` into `dir`: the manifest from the first connected
/// peer that has it (checked against the id), then every header and small file. The network's
/// events are drained meanwhile (its loop waits when nobody reads them): listen addresses and
/// reachability are kept in `held_back` for the daemon, the rest dropped (gossip repeats; a
/// stage request left unanswered fails at its sender while we load).
pub async fn fetch_skeleton(
    client: &Client,
    events: &mut mpsc::Receiver<NetEvent>,
    held_back: &mut Vec<NetEvent>,
    model_id: ModelId,
    dir: &Path,
    max_message_bytes: usize,
    wait: Duration,
) -> Result<Skeleton, String> {
    let work = skeleton(client, model_id, dir, max_message_bytes, wait);
    tokio::pin!(work);
    loop {
        tokio::select! {
            done = &mut work => return done,
            ev = events.recv() => match ev {
                Some(ev @ (NetEvent::ListenAddr(_)
                    | NetEvent::ListenAddrExpired(_)
                    | NetEvent::Reachability(_))) if held_back.len() < MAX_HELD_BACK => {
                    held_back.push(ev);
                }
                Some(_) => {}
                None => return Err("the network stopped".into()),
            },
        }
    }
}

/// A fetched model's skeleton, and the peers that sent corrupt pieces of it.
#[derive(Debug)]
pub struct Skeleton {
    /// The model's folder, with its manifest and headers.
    pub model: FetchedModel,
    /// Peers not to ask again.
    pub corrupt_peers: HashSet<String>,
}

async fn skeleton(
    client: &Client,
    model_id: ModelId,
    dir: &Path,
    max_message_bytes: usize,
    wait: Duration,
) -> Result<Skeleton, String> {
    println!("fetching the manifest of model {model_id} from peers");
    let deadline = Instant::now() + wait;
    let mut asked: HashSet<PeerId> = HashSet::new();
    let model = 'found: loop {
        let connected = client.connected_peers().await.unwrap_or_default();
        for p in connected {
            if !asked.insert(p) {
                continue;
            }
            match client
                .stage_request(p, StageRequest::Manifest { model_id })
                .await
            {
                Ok(StageResponse::Manifest(Ok(bytes))) => {
                    if ModelId(Manifest::id_of(&bytes)) != model_id {
                        warn!("peer {p} sent a manifest that is not model {model_id}'s");
                        continue;
                    }
                    info!("manifest of model {model_id} from {p}");
                    break 'found FetchedModel::create(dir, &bytes).map_err(|e| e.to_string())?;
                }
                Ok(StageResponse::Manifest(Err(why))) => info!("peer {p} has no manifest: {why}"),
                Ok(_) => info!("peer {p} answered the manifest request with something else"),
                Err(e) => info!("peer {p}: {e}"),
            }
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "no peer sent the manifest of model {model_id} within {} s: bootstrap to a \
                 daemon serving it (--bootstrap ADDR)",
                wait.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let skeleton = model.missing(&model.manifest().meta_pieces());
    let avoided = Mutex::new(HashSet::new());
    let status = Mutex::new(None);
    let fetch = Fetch {
        client,
        model: &model,
        model_id,
        chunk: chunk_for(max_message_bytes),
        avoided: &avoided,
        status: &status,
    };
    fetch.pieces(skeleton, |connected| connected).await?;
    Ok(Skeleton {
        model,
        corrupt_peers: avoided.into_inner().unwrap_or_else(|e| e.into_inner()),
    })
}

impl Weights {
    /// Makes sure the pieces of `layers` (and of the head if `head`) are here, fetching the
    /// missing ones from peers. A no-op for a daemon with the model's files.
    pub async fn ensure(&self, layers: LayerRange, head: bool) -> Result<(), String> {
        let Some(model) = &self.fetched else {
            return Ok(());
        };
        let _one = self.fetching.lock().await;
        let missing = model.missing(&self.manifest.needed(layers.as_range(), head));
        if missing.is_empty() {
            return Ok(());
        }
        println!(
            "fetching layers {layers}{} from peers: {} pieces, {:.1} MB",
            if head { " and the head" } else { "" },
            missing.len(),
            self.manifest.bytes_of(&missing) as f64 / 1e6
        );
        let fetch = Fetch {
            client: &self.node.client,
            model,
            model_id: self.node.model_id,
            chunk: chunk_for(self.node.cfg.max_message_bytes),
            avoided: &self.avoided,
            status: &self.status,
        };
        let node = &self.node;
        fetch
            .pieces(missing, |connected| sources(node, &connected))
            .await
    }
}

/// Whom to ask for pieces: the peers serving this model (those announcing layers first), then
/// every other connected peer; never a peer proven to lie.
fn sources(node: &crate::core::Node, connected: &[PeerId]) -> Vec<PeerId> {
    let mut out: Vec<PeerId> = node
        .participants()
        .into_iter()
        .filter_map(|p| p.peer.parse().ok())
        .collect();
    for p in connected {
        if !out.contains(p) {
            out.push(*p);
        }
    }
    out.retain(|p| p.to_string() != node.local && !node.is_excluded(&p.to_string()));
    out
}
