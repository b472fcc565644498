//! The node: what every part of the daemon shares and none of them owns. Its identity and
//! configuration, the model's shape and id, the network handle, what it serves, its state,
//! the peer table, counters, and the peers proven to lie or recently unusable. The stage, the
//! checks and the head each keep their own state in their own rooms and reach this through an
//! `Arc<Node>`; this file imports none of them.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use dc_kernels::Gemm;
use dc_model::json_output::{JsonOutput, TokenTexts};
use dc_model::json_schema::Schema;
use dc_model::tokenizer::{ChatTemplate, SpecialTokens, Tokenizer};
use dc_model::{Model, ModelConfig};
use dc_net::Client;
use dc_types::{Gossip, LayerRange, ModelId, OutputFormat, PeerState};
use libp2p::identity::Keypair;
use libp2p::Multiaddr;
use tokio::sync::Semaphore;
use tracing::{info, warn};

use super::config::NodeConfig;
use super::memory::{head_bytes, layer_bytes};
use super::view::{Participant, SwarmView};

/// Largest announcement (and any gossip message).
pub const MAX_ANNOUNCEMENT: usize = 64 << 10;
/// Most distinct messages `log_once` remembers having logged.
const MAX_LOGGED: usize = 1024;

/// What this daemon has loaded and serves.
#[derive(Debug)]
pub struct Serving {
    /// The loaded layers (and head weights, if held).
    pub model: Arc<Model>,
    /// Layers served.
    pub layers: LayerRange,
    /// Whether the head weights are loaded.
    pub head: bool,
}

/// Counters for status and metrics.
#[derive(Debug, Default)]
pub struct Stats {
    /// Hops served.
    pub hops: AtomicU64,
    /// Hops computed stacked with other generations' hops (one GEMM per product for all).
    pub stacked_hops: AtomicU64,
    /// Positions run through our layers.
    pub positions: AtomicU64,
    /// Tokens produced as head.
    pub tokens: AtomicU64,
    /// Generations being headed now.
    pub active_heads: AtomicU32,
    /// Generations started through the control API.
    pub requests: AtomicU64,
    /// Peers this daemon excluded on a proof.
    pub exclusions: AtomicU64,
    /// Tokens corrected after a liar was found.
    pub corrections: AtomicU64,
    /// Tokens guessed ahead as head (speculative decoding).
    pub guessed: AtomicU64,
    /// Guessed tokens the sampler then produced (each saved a lap).
    pub guesses_kept: AtomicU64,
    /// Attempts restarted without a peer whose answer to a hop could not be used.
    pub reroutes: AtomicU64,
    /// Route stages handed to another peer mid-generation, after a hop that could not be used.
    pub stages_replaced: AtomicU64,
    /// Positions replayed to audit other stages.
    pub audit_positions: AtomicU64,
    /// Generations this daemon asked for that moved to another head after theirs stopped
    /// answering.
    pub head_failovers: AtomicU64,
    /// Generations (and audit sessions) with a stage cache here, kept by the stage.
    pub stage_generations: AtomicU32,
}

/// A running daemon.
pub struct Node {
    /// Configuration.
    pub cfg: NodeConfig,
    /// The model's configuration.
    pub model_cfg: ModelConfig,
    /// The model's id.
    pub model_id: ModelId,
    /// Network handle.
    pub client: Client,
    /// Our peer id (base58).
    pub local: String,
    /// Our identity key (signs hop records).
    pub keypair: Keypair,
    serving: RwLock<Option<Arc<Serving>>>,
    state: Mutex<PeerState>,
    /// What we know of the other peers.
    pub view: Mutex<SwarmView>,
    /// The product engine.
    pub gemm: Gemm,
    /// Bounds the generations started here at once.
    pub generations: Arc<Semaphore>,
    /// Bounds the generations other peers asked us to head at once (those of our own API are
    /// bounded by `generations`; every stage cache, ours included, by the stage's own limit).
    pub headed: Arc<Semaphore>,
    /// Counters.
    pub stats: Stats,
    seq: AtomicU64,
    logged: Mutex<HashSet<String>>,
    /// The tokenizer, if the model has one.
    pub tokenizer: Option<Tokenizer>,
    /// Every token's text, read from the tokenizer the first time JSON output is asked for.
    token_texts: std::sync::OnceLock<Arc<TokenTexts>>,
    /// The model's chat template, if it has one.
    pub chat: Option<ChatTemplate>,
    /// Set while new work is paused (idle-only mode and the machine is busy).
    paused: std::sync::atomic::AtomicBool,
    /// Special tokens (end-of-sequence ids).
    pub special: SpecialTokens,
    /// When the daemon started.
    pub started: Instant,
    listen_addrs: Mutex<Vec<Multiaddr>>,
    /// Whether we are reachable from outside, as AutoNAT last found.
    reachability: Mutex<dc_net::Reachability>,
    throughput: Mutex<f32>,
    /// Where the control API listens (once bound).
    pub api_addr: Mutex<Option<std::net::SocketAddr>>,
    /// Peers proven to lie, with the id of the proof (the proofs themselves are the checks').
    excluded: Mutex<std::collections::BTreeMap<String, dc_kernels::Commitment>>,
    /// Peers whose hops a generation headed here could not use, and when (see
    /// [`Node::recently_unusable`]).
    unusable: Mutex<HashMap<String, Instant>>,
}

/// How long routes avoid a peer whose hop could not be used, when they can.
pub const UNUSABLE_FOR: Duration = Duration::from_secs(600);
/// Most such peers remembered (the oldest is forgotten first).
const MAX_UNUSABLE: usize = 256;

/// The sequence number of a node's first announcement: the wall clock in microseconds, so that
/// a daemon restarted with the same identity announces above what peers kept of its last run
/// (they ignore announcements older than the newest they have).
fn first_seq() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_micros() as u64)
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Node({})", self.local)
    }
}

/// What a node is made of at start-up (the rest it learns while it runs).
#[derive(Debug)]
pub struct NodeParts {
    /// Configuration.
    pub cfg: NodeConfig,
    /// The model's configuration.
    pub model_cfg: ModelConfig,
    /// The model's id.
    pub model_id: ModelId,
    /// Network handle.
    pub client: Client,
    /// Our identity key.
    pub keypair: Keypair,
    /// The product engine.
    pub gemm: Gemm,
    /// The tokenizer, if the model has one.
    pub tokenizer: Option<Tokenizer>,
    /// The model's chat template, if it has one.
    pub chat: Option<ChatTemplate>,
    /// Special tokens.
    pub special: SpecialTokens,
}

impl Node {
    /// What JSON output `format` asks for needs (none: free text).
    pub fn json_output(&self, format: &OutputFormat) -> Result<Option<JsonOutput>, String> {
        let Some(schema) = Schema::for_format(format).map_err(|e| e.to_string())? else {
            return Ok(None);
        };
        JsonOutput::new(self.token_texts()?, Arc::new(schema))
            .map(Some)
            .map_err(|e| e.to_string())
    }

    /// Every token's text, for JSON output (read from the tokenizer once).
    pub fn token_texts(&self) -> Result<Arc<TokenTexts>, String> {
        if let Some(t) = self.token_texts.get() {
            return Ok(t.clone());
        }
        let tok = self
            .tokenizer
            .as_ref()
            .ok_or("JSON output needs the model's tokenizer, and this model has none")?;
        let texts = Arc::new(TokenTexts::new(tok).map_err(|e| e.to_string())?);
        Ok(self.token_texts.get_or_init(|| texts).clone())
    }

    /// A node that is loading: serving nothing yet, knowing no peers.
    pub fn new(parts: NodeParts) -> Node {
        let NodeParts {
            cfg,
            model_cfg,
            model_id,
            client,
            keypair,
            gemm,
            tokenizer,
            chat,
            special,
        } = parts;
        Node {
            local: keypair.public().to_peer_id().to_string(),
            model_cfg,
            model_id,
            client,
            keypair,
            serving: RwLock::new(None),
            state: Mutex::new(PeerState::Loading),
            view: Mutex::new(SwarmView::default()),
            gemm,
            generations: Arc::new(Semaphore::new(cfg.max_generations.max(1))),
            headed: Arc::new(Semaphore::new(cfg.max_generations.max(1))),
            stats: Stats::default(),
            seq: AtomicU64::new(first_seq()),
            logged: Mutex::new(HashSet::new()),
            tokenizer,
            token_texts: std::sync::OnceLock::new(),
            chat,
            paused: std::sync::atomic::AtomicBool::new(false),
            special,
            started: Instant::now(),
            listen_addrs: Mutex::new(Vec::new()),
            reachability: Mutex::new(dc_net::Reachability::Unknown),
            throughput: Mutex::new(0.0),
            api_addr: Mutex::new(None),
            excluded: Mutex::new(std::collections::BTreeMap::new()),
            unusable: Mutex::new(HashMap::new()),
            cfg,
        }
    }

    /// What we serve, once loaded.
    pub fn serving(&self) -> Option<Arc<Serving>> {
        self.serving
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Starts serving what `serving` holds (replacing what was served before).
    pub fn set_serving(&self, serving: Serving) {
        *self.serving.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(serving));
    }

    /// Whether new work is paused (idle-only mode while the machine is busy).
    pub fn paused(&self) -> bool {
        self.paused.load(Ordering::Relaxed)
    }

    /// Pauses or resumes taking new work.
    pub fn set_paused(&self, p: bool) {
        self.paused.store(p, Ordering::Relaxed);
    }

    /// Our state.
    pub fn state(&self) -> PeerState {
        *self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets our state (loading, serving, leaving).
    pub fn set_state(&self, s: PeerState) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = s;
    }

    /// Addresses we listen on.
    pub fn listen_addrs(&self) -> Vec<Multiaddr> {
        self.listen_addrs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Notes a new address we listen on.
    pub fn add_listen_addr(&self, addr: Multiaddr) {
        let mut addrs = self.listen_addrs.lock().unwrap_or_else(|e| e.into_inner());
        if !addrs.contains(&addr) {
            addrs.push(addr);
        }
    }

    /// We no longer listen on an address (a relay reservation ended): stop announcing it.
    pub fn remove_listen_addr(&self, addr: &Multiaddr) {
        let mut addrs = self.listen_addrs.lock().unwrap_or_else(|e| e.into_inner());
        addrs.retain(|a| a != addr);
    }

    /// Whether we are reachable from outside, as AutoNAT last found.
    pub fn reachability(&self) -> dc_net::Reachability {
        *self.reachability.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records what AutoNAT found.
    pub fn set_reachability(&self, r: dc_net::Reachability) {
        *self.reachability.lock().unwrap_or_else(|e| e.into_inner()) = r;
    }

    /// Sets the measured throughput of our layers.
    pub fn set_throughput(&self, tokens_per_second: f32) {
        *self.throughput.lock().unwrap_or_else(|e| e.into_inner()) = tokens_per_second;
    }

    /// The sequence number of our next announcement (peers keep the newest).
    pub fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Measured throughput of our layers (tokens per second at decode).
    pub fn throughput(&self) -> f32 {
        *self.throughput.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The memory our weights take (estimate).
    pub fn weights_bytes(&self) -> u64 {
        self.serving().map_or(0, |s| {
            // Streamed layers take memory only while in the window.
            let streamed = s.model.stream_stats().layers.len();
            let held = s.layers.len() as usize - streamed + streamed.min(dc_model::stream::WINDOW);
            held as u64 * layer_bytes(&self.model_cfg)
                + if s.head {
                    head_bytes(&self.model_cfg)
                } else {
                    0
                }
        })
    }

    /// Logs `msg` once per `key` (once per [`MAX_LOGGED`] keys: the keys come from peers'
    /// messages, so the set of those logged is forgotten when it fills).
    pub fn log_once(&self, key: String, msg: impl FnOnce() -> String) {
        let mut logged = self.logged.lock().unwrap_or_else(|e| e.into_inner());
        if logged.len() >= MAX_LOGGED {
            logged.clear();
        }
        if logged.insert(key) {
            info!("{}", msg());
        }
    }

    /// Notes that a hop of `peer` could not be used (it failed, or broke the protocol in a way
    /// nothing proves).
    pub fn mark_unusable(&self, peer: &str) {
        let mut m = self.unusable.lock().unwrap_or_else(|e| e.into_inner());
        m.retain(|_, at| at.elapsed() < UNUSABLE_FOR);
        if m.len() >= MAX_UNUSABLE && !m.contains_key(peer) {
            if let Some(oldest) = m.iter().min_by_key(|(_, at)| **at).map(|(p, _)| p.clone()) {
                m.remove(&oldest);
            }
        }
        m.insert(peer.to_string(), Instant::now());
    }

    /// Peers whose hops could not be used in the last [`UNUSABLE_FOR`]: a head routes around
    /// them when it can, and through them when nothing else serves their layers (this is not
    /// an exclusion: nothing is proven, and an honest peer can fail once).
    pub fn recently_unusable(&self) -> Vec<String> {
        let m = self.unusable.lock().unwrap_or_else(|e| e.into_inner());
        m.iter()
            .filter(|(_, at)| at.elapsed() < UNUSABLE_FOR)
            .map(|(p, _)| p.clone())
            .collect()
    }

    /// Whether `peer` was proven to lie.
    pub fn is_excluded(&self, peer: &str) -> bool {
        self.excluded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(peer)
    }

    /// Excludes `peer` on the proof `proof_id` (checked by the caller); whether it is news.
    pub fn exclude(&self, peer: &str, proof_id: dc_kernels::Commitment) -> bool {
        let mut excluded = self.excluded.lock().unwrap_or_else(|e| e.into_inner());
        if excluded.contains_key(peer) {
            return false;
        }
        excluded.insert(peer.to_string(), proof_id);
        true
    }

    /// The peers proven to lie, each with the id of its proof.
    pub fn excluded(&self) -> Vec<(String, dc_kernels::Commitment)> {
        let excluded = self.excluded.lock().unwrap_or_else(|e| e.into_inner());
        excluded.iter().map(|(p, id)| (p.clone(), *id)).collect()
    }

    /// Publishes a gossip message.
    pub async fn gossip(&self, g: &Gossip) {
        match dc_types::encode(g, MAX_ANNOUNCEMENT) {
            Ok(bytes) => {
                let _ = self.client.publish(bytes).await;
            }
            Err(e) => warn!("cannot encode a gossip message: {e}"),
        }
    }

    /// Ourselves plus every healthy serving peer, as planning sees them.
    pub fn participants(&self) -> Vec<Participant> {
        let mut ps = self
            .view
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .serving();
        ps.retain(|p| !self.is_excluded(&p.peer));
        if let (Some(s), PeerState::Serving) = (self.serving(), self.state()) {
            ps.push(Participant {
                peer: self.local.clone(),
                layers: s.layers,
                head: s.head,
                throughput: self.throughput(),
                active: self.active_generations(),
            });
        }
        ps
    }

    /// Generations we serve now (as head or stage).
    pub fn active_generations(&self) -> u32 {
        let staged = self.stats.stage_generations.load(Ordering::Relaxed);
        staged.max(self.stats.active_heads.load(Ordering::Relaxed))
    }
}
