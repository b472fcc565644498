//! The daemon itself: start-up (self-test, model id, identity, network, layer choice, loading),
//! the tasks that run while it serves (network events, announcements, shard re-checks, cache
//! expiry, generation streams, the control API) and the graceful exit on SIGINT/SIGTERM.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use dc_kernels::{Gemm, Kernel};
use dc_model::tokenizer::{load_for_model, ChatTemplate, SpecialTokens, Tokenizer};
use dc_model::{LoadOptions, Model, ModelConfig};
use dc_net::{Client, NetConfig, NetEvent};
use dc_types::{
    Announcement, GenerationEvent, GenerationRequest, Gossip, LayerRange, ModelId, PeerState,
    StageRequest, StageResponse, PROTOCOL_VERSION,
};
use futures::StreamExt;
use libp2p::identity::Keypair;
use libp2p::Multiaddr;
use tokio::sync::{mpsc, watch, Semaphore};
use tracing::{info, warn};

use crate::claims::{Claim, ClaimQueue, IGNORE_FALSE_CLAIMANT};
use crate::config::{LayerChoice, NodeConfig};
use crate::head::{run_as_head, EVENT_QUEUE};
use crate::memory::{head_bytes, layer_bytes, layers_that_fit};
use crate::relay::EventBounds;
use crate::stage::{serve_hop, StageCaches};
use crate::view::{coverage, least_served_window, should_move, Participant, SwarmView};

/// Largest generation request or event on a generation stream.
const MAX_GENERATION_MESSAGE: usize = 4 << 20;
/// Largest announcement.
const MAX_ANNOUNCEMENT: usize = 64 << 10;
/// Most distinct messages `log_once` remembers having logged.
const MAX_LOGGED: usize = 1024;
/// How long a proof's holder has to send it (a lookup on its side; the proof is within the
/// message limit).
const PROOF_FETCH_TIMEOUT: Duration = Duration::from_secs(60);

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
    /// Attempts restarted without a peer whose answer to a hop could not be used.
    pub reroutes: AtomicU64,
    /// Route stages handed to another peer mid-generation, after a hop that could not be used.
    pub stages_replaced: AtomicU64,
    /// Positions replayed to audit other stages.
    pub audit_positions: AtomicU64,
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
    /// KV caches of generations we serve.
    pub caches: Mutex<StageCaches>,
    /// The product engine.
    pub gemm: Gemm,
    /// Bounds the hops computing at once.
    pub compute: Arc<Semaphore>,
    /// Bounds the generations started here at once.
    pub generations: Arc<Semaphore>,
    /// Bounds the generations other peers asked us to head at once (those of our own API are
    /// bounded by `generations`; every stage cache, ours included, by `caches`).
    pub headed: Arc<Semaphore>,
    /// Counters.
    pub stats: Stats,
    seq: AtomicU64,
    logged: Mutex<HashSet<String>>,
    /// The tokenizer, if the model has one.
    pub tokenizer: Option<Tokenizer>,
    /// The model's chat template, if it has one.
    pub chat: Option<ChatTemplate>,
    /// Set while new work is paused (idle-only mode and the machine is busy).
    paused: std::sync::atomic::AtomicBool,
    /// Special tokens (end-of-sequence ids).
    pub special: SpecialTokens,
    /// When the daemon started.
    pub started: Instant,
    listen_addrs: Mutex<Vec<Multiaddr>>,
    throughput: Mutex<f32>,
    /// Where the control API listens (once bound).
    pub api_addr: Mutex<Option<std::net::SocketAddr>>,
    /// Audits run, outcomes, proven liars and their proofs.
    pub audits: Mutex<crate::audit::AuditBook>,
    /// Layers loaded on demand to referee disputes and check proofs.
    pub referee: tokio::sync::Mutex<Option<(LayerRange, Arc<Model>)>>,
    /// Held for a whole refereeing, so concurrent failed audits of one liar referee it once.
    pub referee_gate: tokio::sync::Mutex<()>,
    /// Secret of the head's audit coin (never leaves this process).
    pub audit_secret: [u8; 32],
    /// Spot-check keys (`W · r`, biases, norms) of the layers this head has checked.
    pub checkers: tokio::sync::Mutex<HashMap<usize, Arc<dc_model::LayerChecker>>>,
    /// Gossiped proof claims being fetched and checked, and those waiting their turn.
    claims: Mutex<ClaimQueue>,
    /// Peers whose hops a generation headed here could not use, and when (see
    /// [`Node::recently_unusable`]).
    unusable: Mutex<HashMap<String, Instant>>,
}

/// How long routes avoid a peer whose hop could not be used, when they can.
pub const UNUSABLE_FOR: Duration = Duration::from_secs(600);
/// Most such peers remembered (the oldest is forgotten first).
const MAX_UNUSABLE: usize = 256;

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Node({})", self.local)
    }
}

impl Node {
    /// What we serve, once loaded.
    pub fn serving(&self) -> Option<Arc<Serving>> {
        self.serving
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
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

    fn set_state(&self, s: PeerState) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = s;
    }

    /// Addresses we listen on.
    pub fn listen_addrs(&self) -> Vec<Multiaddr> {
        self.listen_addrs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Measured throughput of our layers (tokens per second at decode).
    pub fn throughput(&self) -> f32 {
        *self.throughput.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The throughput we announce: the measured one (a lying test daemon claims far more, as a
    /// real liar wanting traffic would).
    fn announced_throughput(&self) -> f32 {
        #[cfg(feature = "fault-injection")]
        if crate::fault::configured().is_some() {
            return self.throughput() * 1000.0 + 1e6;
        }
        self.throughput()
    }

    /// The memory our weights take (estimate).
    pub fn weights_bytes(&self) -> u64 {
        self.serving().map_or(0, |s| {
            s.layers.len() as u64 * layer_bytes(&self.model_cfg)
                + if s.head {
                    head_bytes(&self.model_cfg)
                } else {
                    0
                }
        })
    }

    /// Logs `msg` once per `key` (once per [`MAX_LOGGED`] keys: the keys come from peers'
    /// messages, so the set of those logged is forgotten when it fills).
    fn log_once(&self, key: String, msg: impl FnOnce() -> String) {
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
        self.audits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_excluded(peer)
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
        let caches = self.caches.lock().unwrap_or_else(|e| e.into_inner()).len() as u32;
        caches.max(self.stats.active_heads.load(Ordering::Relaxed))
    }

    fn announcement(&self) -> Announcement {
        let s = self.serving();
        let free = self
            .cfg
            .max_memory
            .map_or(0, |m| m.saturating_sub(self.weights_bytes()));
        Announcement {
            protocol_version: PROTOCOL_VERSION,
            software: format!("dcd {}", env!("CARGO_PKG_VERSION")),
            model_id: self.model_id,
            layers: s.as_ref().map(|s| s.layers),
            head: s.as_ref().is_some_and(|s| s.head),
            throughput: self.announced_throughput(),
            free_memory: free,
            state: self.state(),
            active_generations: self.active_generations(),
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
            listen_addrs: self.listen_addrs().iter().map(|a| a.to_string()).collect(),
        }
    }

    /// Publishes our announcement now.
    pub async fn announce(&self) {
        self.gossip(&Gossip::Announcement(self.announcement()))
            .await;
    }

    fn on_gossip(self: &Arc<Self>, from: &str, data: &[u8]) {
        match dc_types::decode::<Gossip>(data, MAX_ANNOUNCEMENT) {
            Ok(Gossip::Announcement(a)) => self.on_announcement(from, a),
            Ok(Gossip::Proof { id, accused }) => self.on_proof_announced(from, id, accused),
            Err(e) => self.log_once(format!("bad:{from}"), || {
                format!("ignoring peer {from}: malformed gossip: {e}")
            }),
        }
    }

    /// A peer says it holds a proof: fetch it, check it ourselves, exclude if it holds (in
    /// turn: see [`ClaimQueue`]).
    fn on_proof_announced(
        self: &Arc<Self>,
        from: &str,
        id: dc_kernels::Commitment,
        accused: String,
    ) {
        if self.is_excluded(&accused) || accused == self.local {
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
        let node = self.clone();
        tokio::spawn(async move {
            let held = match claim.from.parse::<libp2p::PeerId>() {
                Ok(peer) => {
                    let request = StageRequest::GetProof { id: claim.id };
                    let got = tokio::time::timeout(
                        PROOF_FETCH_TIMEOUT,
                        node.client.stage_request(peer, request),
                    )
                    .await;
                    match got {
                        Ok(Ok(StageResponse::Proof(p))) => match *p {
                            Some(p)
                                if crate::verify::proof_id(&p) == claim.id
                                    && p.accused == claim.accused =>
                            {
                                crate::audit::accept_proof(node.clone(), p, true).await
                            }
                            _ => false,
                        },
                        _ => false,
                    }
                }
                Err(_) => false,
            };
            if !held {
                info!(
                    "ignoring {}'s claim against {} (and its claims for {} s): no valid proof",
                    claim.from,
                    claim.accused,
                    IGNORE_FALSE_CLAIMANT.as_secs()
                );
            }
            let next = node
                .claims
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .finish(&claim, held, Instant::now(), |c| {
                    node.is_excluded(&c.accused)
                });
            for c in next {
                node.fetch_claim(c);
            }
        });
    }

    fn on_announcement(&self, from: &str, ann: Announcement) {
        let addrs: Vec<Multiaddr> = ann
            .listen_addrs
            .iter()
            .take(crate::view::MAX_PEER_ADDRS)
            .filter_map(|a| a.parse().ok())
            .collect();
        let res = self.view.lock().unwrap_or_else(|e| e.into_inner()).update(
            from,
            ann,
            &self.model_id,
            Instant::now(),
        );
        match res {
            Ok(()) => {
                // Only a peer of our swarm is worth dialling back, at a few addresses.
                if let (Ok(peer), false) = (from.parse(), addrs.is_empty()) {
                    let client = self.client.clone();
                    tokio::spawn(async move {
                        for addr in addrs {
                            let _ = client.add_address(peer, addr).await;
                        }
                    });
                }
            }
            Err(crate::view::Ignored::Stale) => {}
            Err(crate::view::Ignored::Protocol(v)) => self.log_once(format!("proto:{from}:{v}"), || {
                format!("ignoring peer {from}: it speaks protocol version {v}, we speak {PROTOCOL_VERSION}")
            }),
            Err(crate::view::Ignored::Model(m)) => self.log_once(format!("model:{from}:{m}"), || {
                format!("ignoring peer {from}: it serves model {}, we serve {}", m.short(), self.model_id.short())
            }),
        }
    }
}

/// Loads `layers` (and the head weights if `head`) on the compute pool.
async fn load(node: &Node, layers: LayerRange, head: bool) -> Result<Serving, String> {
    let (path, data_dir) = (node.cfg.model.clone(), node.cfg.data_dir.clone());
    tokio::task::spawn_blocking(move || {
        let model = Model::load(
            &path,
            &LoadOptions {
                layers: Some(layers.as_range()),
                head,
                cache_in: Some(data_dir),
            },
        )
        .map_err(|e| format!("loading layers {layers}: {e}"))?;
        Ok(Serving {
            model: Arc::new(model),
            layers,
            head,
        })
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Decode tokens per second of our layers (a few single-position laps on random activations).
async fn measure_throughput(node: &Arc<Node>) -> f32 {
    let Some(s) = node.serving() else { return 0.0 };
    let n2 = node.clone();
    tokio::task::spawn_blocking(move || {
        let cfg = &n2.model_cfg;
        let mut cache = dc_model::KvCache::new(cfg, s.layers.as_range());
        let steps = 4.min(cfg.max_positions);
        let start = Instant::now();
        for p in 0..steps {
            let x = dc_model::Activations {
                start: p,
                hidden: cfg.hidden_size,
                data: (0..cfg.hidden_size)
                    .map(|i| ((i * 7 + p) % 13) as f32 / 13.0 - 0.5)
                    .collect(),
            };
            if s.model.run_layers(&n2.gemm, x, &mut cache).is_err() {
                return 0.0;
            }
        }
        steps as f32 / start.elapsed().as_secs_f32().max(1e-6)
    })
    .await
    .unwrap_or(0.0)
}

/// Runs the numeric self-test (golden vectors, every kernel against the reference).
fn selftest() -> Result<(), String> {
    let kernels = Kernel::supported();
    let gold = dc_kernels::golden::run(&kernels);
    let conf = dc_kernels::conformance::sweep(&kernels, &[1, 2], 0xDA15_7C4A_1100_0001);
    if !gold.failures.is_empty() || !conf.failures.is_empty() {
        return Err(format!(
            "self-test failed: {}",
            gold.failures
                .iter()
                .chain(&conf.failures)
                .take(3)
                .cloned()
                .collect::<Vec<_>>()
                .join("; ")
        ));
    }
    Ok(())
}

/// Starts the daemon and runs it until SIGINT or SIGTERM.
pub async fn run(cfg: NodeConfig) -> Result<(), String> {
    if cfg.selftest {
        selftest()?;
        println!("self-test passed ({} kernels)", Kernel::supported().len());
    }
    let (model_cfg, _) = dc_model::model::open_source(&cfg.model).map_err(|e| e.to_string())?;
    let model_id = ModelId(
        dc_model::identity::cached_model_id(&cfg.model, &cfg.data_dir)
            .map_err(|e| e.to_string())?,
    );
    let keypair = dc_net::identity::load_or_create(&cfg.data_dir.join("identity.key"))?;
    let local = keypair.public().to_peer_id();
    let (tokenizer, chat, special) = match load_for_model(&cfg.model) {
        Ok((t, c, s)) => (Some(t), c, s),
        Err(_) => (
            None,
            None,
            SpecialTokens {
                bos: model_cfg.bos_token_id,
                eos: model_cfg.eos_token_ids.clone(),
                ..SpecialTokens::default()
            },
        ),
    };
    let net = NetConfig {
        keypair: keypair.clone(),
        listen: cfg.listen.clone(),
        bootstrap: cfg.bootstrap.clone(),
        mdns: cfg.mdns,
        topic: format!(
            "daisychain/announce/{PROTOCOL_VERSION}/{}",
            model_id.short()
        ),
        max_request_bytes: cfg.max_message_bytes,
        max_response_bytes: cfg.max_message_bytes,
        max_gossip_bytes: MAX_ANNOUNCEMENT,
        request_timeout: cfg.request_timeout,
        agent: format!("dcd/{}", env!("CARGO_PKG_VERSION")),
    };
    let (client, mut events, event_loop) = dc_net::start(net)?;
    tokio::spawn(event_loop.run());
    let gemm = Gemm::new(cfg.kernel, cfg.threads).map_err(|e| e.to_string())?;
    let node = Arc::new(Node {
        model_cfg,
        model_id,
        client: client.clone(),
        local: local.to_string(),
        keypair,
        serving: RwLock::new(None),
        state: Mutex::new(PeerState::Loading),
        view: Mutex::new(SwarmView::default()),
        caches: Mutex::new(StageCaches::default()),
        gemm,
        compute: Arc::new(Semaphore::new(cfg.threads.max(1) * 2)),
        generations: Arc::new(Semaphore::new(cfg.max_generations.max(1))),
        headed: Arc::new(Semaphore::new(cfg.max_generations.max(1))),
        stats: Stats::default(),
        seq: AtomicU64::new(1),
        logged: Mutex::new(HashSet::new()),
        tokenizer,
        chat,
        paused: std::sync::atomic::AtomicBool::new(false),
        special,
        started: Instant::now(),
        listen_addrs: Mutex::new(Vec::new()),
        throughput: Mutex::new(0.0),
        api_addr: Mutex::new(None),
        audits: Mutex::new(crate::audit::AuditBook::default()),
        referee: tokio::sync::Mutex::new(None),
        referee_gate: tokio::sync::Mutex::new(()),
        audit_secret: crate::audit::new_secret(local.to_bytes().as_slice()),
        checkers: tokio::sync::Mutex::new(HashMap::new()),
        claims: Mutex::new(ClaimQueue::default()),
        unusable: Mutex::new(HashMap::new()),
        cfg,
    });
    println!("peer id {local}");
    println!(
        "model {} (model id {})",
        node.cfg.model.display(),
        node.model_id
    );

    // Network events.
    {
        let node = node.clone();
        tokio::spawn(async move {
            while let Some(ev) = events.recv().await {
                on_net_event(&node, ev).await;
            }
        });
    }
    // Generation streams forwarded to us as head.
    {
        let node = node.clone();
        let mut incoming = client
            .accept_generation_streams()
            .map_err(|e| e.to_string())?;
        tokio::spawn(async move {
            while let Some((peer, stream)) = incoming.next().await {
                tokio::spawn(serve_generation_stream(
                    node.clone(),
                    peer.to_string(),
                    stream,
                ));
            }
        });
    }
    // Control API.
    let api = crate::api::serve(node.clone()).await?;
    *node.api_addr.lock().unwrap_or_else(|e| e.into_inner()) = Some(api);
    println!("control API on http://{api}");

    // Choose and load our layers.
    let layers = match node.cfg.layers {
        LayerChoice::Fixed(r) => {
            if r.end as usize > node.model_cfg.num_layers {
                return Err(format!(
                    "--layers {r}: the model has {} layers",
                    node.model_cfg.num_layers
                ));
            }
            r
        }
        LayerChoice::Auto => {
            tokio::time::sleep(node.cfg.discovery_wait).await;
            choose_auto(&node)?
        }
    };
    let fits_head = node.cfg.head
        && node.cfg.max_memory.is_none_or(|m| {
            head_bytes(&node.model_cfg) + layers.len() as u64 * layer_bytes(&node.model_cfg) <= m
        });
    if node.cfg.head && !fits_head {
        println!("the head weights do not fit the memory budget: serving without them");
    }
    let serving = load(&node, layers, fits_head).await?;
    *node.serving.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(serving));
    let tps = measure_throughput(&node).await;
    *node.throughput.lock().unwrap_or_else(|e| e.into_inner()) = tps;
    node.set_state(PeerState::Serving);
    println!(
        "serving layers {layers} of {}{}",
        node.model_cfg.num_layers,
        if fits_head {
            " with the head weights"
        } else {
            ""
        }
    );
    node.announce().await;
    sd_notify("READY=1");

    // Idle-only mode watches the machine's load.
    if node.cfg.idle_only {
        crate::idle::spawn(node.clone());
    }
    // Periodic work.
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(periodic(node.clone(), stop_rx));

    wait_for_signal().await;
    println!("leaving: finishing what we serve");
    sd_notify("STOPPING=1");
    node.set_state(PeerState::Leaving);
    node.announce().await;
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline && node.active_generations() > 0 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    node.announce().await;
    // Give the gossip a moment to leave the machine.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = stop_tx.send(true);
    println!("left");
    Ok(())
}

/// Tells systemd about our state when run as a `Type=notify` service (no-op otherwise).
fn sd_notify(state: &str) {
    #[cfg(unix)]
    if let Some(path) = std::env::var_os("NOTIFY_SOCKET") {
        let sock = match std::os::unix::net::UnixDatagram::unbound() {
            Ok(s) => s,
            Err(_) => return,
        };
        let path = std::path::PathBuf::from(path);
        let _ = sock.send_to(state.as_bytes(), &path);
    }
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            let _ = tokio::signal::ctrl_c().await;
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The window an auto daemon takes now.
fn choose_auto(node: &Arc<Node>) -> Result<LayerRange, String> {
    let n = node.model_cfg.num_layers as u32;
    let fit = layers_that_fit(&node.model_cfg, node.cfg.max_memory, node.cfg.head);
    let fit = if fit == 0 {
        // The head does not fit next to even one layer: serve layers only.
        layers_that_fit(&node.model_cfg, node.cfg.max_memory, false)
    } else {
        fit
    };
    if fit == 0 {
        return Err("--max-memory is too small for even one layer".into());
    }
    let others = node
        .view
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .serving();
    let cov = coverage(n, &others);
    let w = least_served_window(n, fit, &cov);
    info!("auto layers: coverage {cov:?}, taking {w}");
    Ok(w)
}

async fn on_net_event(node: &Arc<Node>, ev: NetEvent) {
    match ev {
        NetEvent::Gossip { from, data } => node.on_gossip(&from.to_string(), &data),
        NetEvent::StageRequest {
            from,
            request,
            channel,
        } => {
            let node = node.clone();
            tokio::spawn(async move {
                // Who asks: a generation's caches and kept hops are its head's alone.
                let from = from.to_string();
                let response = match request {
                    StageRequest::Hop(h) => {
                        StageResponse::Hop(Box::new(serve_hop(node.clone(), h, &from).await))
                    }
                    StageRequest::End { generation } => {
                        node.caches
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .end(&generation, &from);
                        StageResponse::Ack
                    }
                    StageRequest::Audit(a) => StageResponse::Audit(
                        crate::stage::serve_audit(node.clone(), a, &from).await,
                    ),
                    StageRequest::Reveal(r) => StageResponse::Reveal(
                        crate::stage::serve_reveal(node.clone(), r, &from).await,
                    ),
                    StageRequest::RevealHops(r) => StageResponse::RevealHops(
                        crate::stage::serve_reveal_hops(node.clone(), r, &from).await,
                    ),
                    StageRequest::CacheRows(r) => StageResponse::CacheRows(
                        crate::stage::serve_cache_rows(node.clone(), r, &from).await,
                    ),
                    StageRequest::GetProof { id } => StageResponse::Proof(Box::new(
                        node.audits
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .proof(&id),
                    )),
                };
                if node.client.respond_stage(channel, response).await.is_err() {
                    warn!("could not answer {from}: the network loop stopped");
                }
            });
        }
        NetEvent::ListenAddr(a) => {
            println!("listening on {a}/p2p/{}", node.local);
            node.listen_addrs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(a);
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

/// Announcements, peer expiry, cache expiry and (auto layers) shard re-checks.
async fn periodic(node: Arc<Node>, mut stop: watch::Receiver<bool>) {
    let mut announce = tokio::time::interval(node.cfg.announce_every);
    // Jitter so that auto daemons seeing the same gap do not all move at once.
    let jitter = Duration::from_millis(
        u64::from(node.local.bytes().fold(0u8, |a, b| a.wrapping_add(b))) * 20,
    );
    let mut rebalance = tokio::time::interval_at(
        tokio::time::Instant::now() + node.cfg.rebalance_every / 2 + jitter,
        node.cfg.rebalance_every,
    );
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = announce.tick() => {
                let now = Instant::now();
                for p in node.view.lock().unwrap_or_else(|e| e.into_inner()).expire(now, node.cfg.peer_timeout) {
                    info!("peer {p} timed out");
                }
                node.caches.lock().unwrap_or_else(|e| e.into_inner()).expire(now, node.cfg.generation_idle_timeout);
                node.announce().await;
            }
            _ = rebalance.tick() => {
                if node.cfg.layers == LayerChoice::Auto && node.state() == PeerState::Serving {
                    if let Err(e) = rebalance_once(&node).await {
                        warn!("shard re-check: {e}");
                    }
                }
            }
        }
    }
}

/// Moves to a better window if the swarm's weakest layer gains and nothing is left uncovered.
async fn rebalance_once(node: &Arc<Node>) -> Result<(), String> {
    let Some(current) = node.serving() else {
        return Ok(());
    };
    if node.active_generations() > 0 {
        return Ok(());
    }
    let n = node.model_cfg.num_layers as u32;
    let others = node
        .view
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .serving();
    let cov = coverage(n, &others);
    let proposed = least_served_window(n, current.layers.len(), &cov);
    if !should_move(current.layers, proposed, &cov) {
        return Ok(());
    }
    info!(
        "moving from layers {} to {proposed} (coverage without us: {cov:?})",
        current.layers
    );
    println!("moving from layers {} to {proposed}", current.layers);
    // Keep serving the old range while the new one loads: nothing is uncovered meanwhile.
    let serving = load(node, proposed, current.head).await?;
    *node.serving.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(serving));
    node.announce().await;
    println!("serving layers {proposed} of {n}");
    Ok(())
}

/// Serves a generation forwarded to us (we are its elected head): read the request, run it,
/// stream the events back.
async fn serve_generation_stream(node: Arc<Node>, peer: String, mut stream: libp2p::Stream) {
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
    tokio::spawn({
        let node = node.clone();
        async move {
            let _permit = permit;
            run_as_head(node, req, tx).await
        }
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
    node: Arc<Node>,
    req: GenerationRequest,
) -> Result<mpsc::Receiver<GenerationEvent>, String> {
    let participants = node.participants();
    let head = crate::view::elect_head(&req.generation, &participants)
        .ok_or("no healthy peer holds the head weights")?
        .peer
        .clone();
    let (tx, rx) = mpsc::channel(EVENT_QUEUE);
    if head == node.local {
        tokio::spawn(run_as_head(node, req, tx));
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
