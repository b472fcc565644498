//! The daemon's resolved configuration (the command line resolves flags, environment and the
//! config file into this one value).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use dc_kernels::Kernel;
use dc_types::LayerRange;
use libp2p::Multiaddr;

/// Which layers to serve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerChoice {
    /// Exactly these.
    Fixed(LayerRange),
    /// The least-served window that fits the memory budget, re-checked periodically.
    Auto,
}

/// How a head draws the parts of a remote hop's layers for spot checks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SpotRate {
    /// Each stage at the rate that meets the detection goal for its layer count
    /// (`dc_model::goal_rate`): a stage corrupting 1 % of its GEMMs in a 256-token generation
    /// escapes with probability at most 10⁻⁶, however many layers it serves (a prefill chunk's
    /// drawn parts are tested at every row).
    Goal,
    /// Every part of every stage with this probability (0 to 1).
    Fixed(f32),
}

impl SpotRate {
    /// The probability each part of a stage over `layers` layers of `model` is drawn with.
    pub fn for_stage(self, model: &dc_model::ModelConfig, layers: usize) -> f32 {
        match self {
            SpotRate::Goal => dc_model::goal_rate(model, layers) as f32,
            SpotRate::Fixed(c) => c.clamp(0.0, 1.0),
        }
    }
}

impl std::fmt::Display for SpotRate {
    /// `auto` or the rate, as the config file and `--spot-check-rate` take it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SpotRate::Goal => f.write_str("auto"),
            SpotRate::Fixed(c) => write!(f, "{c}"),
        }
    }
}

impl std::str::FromStr for SpotRate {
    type Err = String;

    /// `auto` (any case) or a number from 0 to 1.
    fn from_str(s: &str) -> Result<SpotRate, String> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("auto") {
            return Ok(SpotRate::Goal);
        }
        match s.parse::<f32>() {
            Ok(c) if (0.0..=1.0).contains(&c) => Ok(SpotRate::Fixed(c)),
            _ => Err(format!(
                "{s:?} is neither \"auto\" nor a number from 0 to 1"
            )),
        }
    }
}

/// Everything `dcd join` needs.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// Model path (HF folder or GGUF file); with `fetch`, the store folder its files go to.
    pub model: PathBuf,
    /// The id of a model to fetch from peers into the folder `model`: its manifest and headers
    /// at start unless the folder holds them, then the pieces of the layers chosen.
    pub fetch: Option<dc_types::ModelId>,
    /// Layers to serve.
    pub layers: LayerChoice,
    /// Whether to hold the head weights.
    pub head: bool,
    /// Listen addresses.
    pub listen: Vec<Multiaddr>,
    /// Bootstrap peers.
    pub bootstrap: Vec<Multiaddr>,
    /// Local-network discovery.
    pub mdns: bool,
    /// Data directory (identity key, caches).
    pub data_dir: PathBuf,
    /// Control API address.
    pub api: SocketAddr,
    /// Bearer token the control API requires (required when not bound to loopback).
    pub api_token: Option<String>,
    /// Memory budget for weights and caches, bytes.
    pub max_memory: Option<u64>,
    /// GEMM kernel.
    pub kernel: Kernel,
    /// Compute threads.
    pub threads: usize,
    /// Generations served at once (as head or stage).
    pub max_generations: usize,
    /// Announcement period.
    pub announce_every: Duration,
    /// Shard re-check period (auto layers).
    pub rebalance_every: Duration,
    /// A peer not heard from for this long is gone.
    pub peer_timeout: Duration,
    /// With auto layers: how long to listen for announcements before choosing.
    pub discovery_wait: Duration,
    /// A generation's KV cache idle for this long is dropped.
    pub generation_idle_timeout: Duration,
    /// Timeout of one stage request.
    pub request_timeout: Duration,
    /// Largest stage message (request or response), bytes.
    pub max_message_bytes: usize,
    /// Prefill chunk (positions per hop).
    pub chunk: usize,
    /// Whether the generations this daemon heads guess tokens ahead (unless a request says).
    pub speculative: dc_types::Speculation,
    /// Run the numeric self-test before serving.
    pub selftest: bool,
    /// Serve only while the machine is otherwise idle (pause new work when other processes
    /// keep the CPU busy).
    pub idle_only: bool,
    /// CPU use by other processes (0 to 1, share of all cores) above which new work pauses.
    pub idle_threshold: f32,
    /// Probability that a head audits one remote hop (generations may ask for more).
    pub audit_rate: f32,
    /// Probability that a head tests each part (weight product, attention, output) of each
    /// layer of a remote hop by a spot check (Freivalds on revealed rows), per stage.
    pub spot_check_rate: SpotRate,
    /// The pre-shared key of a private swarm (`--swarm-key FILE`); `None`: the open swarm.
    /// A private swarm runs over TCP only (pnet cannot wrap QUIC).
    pub swarm_key: Option<dc_net::SwarmKey>,
    /// Relay for peers behind NAT once AutoNAT finds us publicly reachable
    /// (`--no-relay-service` turns it off).
    pub relay_service: bool,
    /// NAT traversal: AutoNAT, relay reservations, hole punching.
    pub nat: dc_net::NatConfig,
    /// Established connections at most, all peers together.
    pub max_connections: u32,
    /// Established connections at most with one peer.
    pub max_connections_per_peer: u32,
}

impl NodeConfig {
    /// Defaults for everything but the model.
    pub fn new(model: PathBuf, data_dir: PathBuf) -> NodeConfig {
        NodeConfig {
            model,
            fetch: None,
            layers: LayerChoice::Auto,
            head: true,
            listen: vec![
                "/ip4/0.0.0.0/tcp/7371".parse().expect("valid multiaddr"),
                "/ip4/0.0.0.0/udp/7371/quic-v1"
                    .parse()
                    .expect("valid multiaddr"),
            ],
            bootstrap: Vec::new(),
            mdns: true,
            data_dir,
            api: "127.0.0.1:7370".parse().expect("valid socket address"),
            api_token: None,
            max_memory: None,
            kernel: Kernel::best(),
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            max_generations: 8,
            announce_every: Duration::from_secs(2),
            rebalance_every: Duration::from_secs(10),
            peer_timeout: Duration::from_secs(10),
            discovery_wait: Duration::from_secs(3),
            generation_idle_timeout: Duration::from_secs(300),
            request_timeout: Duration::from_secs(120),
            max_message_bytes: 64 << 20,
            chunk: 64,
            speculative: dc_types::Speculation::default(),
            selftest: true,
            idle_only: false,
            idle_threshold: 0.5,
            audit_rate: 0.01,
            spot_check_rate: SpotRate::Goal,
            swarm_key: None,
            relay_service: true,
            nat: dc_net::NatConfig::default(),
            max_connections: dc_net::config::DEFAULT_MAX_CONNECTIONS,
            max_connections_per_peer: dc_net::config::DEFAULT_MAX_CONNECTIONS_PER_PEER,
        }
    }
}
