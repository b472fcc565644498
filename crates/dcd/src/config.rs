//! Configuration resolution: command-line flags, then `DCD_*` environment variables, then the
//! config file, then the defaults, resolved once into one [`Settings`] value that remembers
//! where each value came from.
//!
//! [`resolve`] is a pure function of (flags, environment map, file text) so precedence and
//! error messages are unit-tested here; [`load`] is the thin impure shell that reads the
//! process environment and the file. The defaults are not restated here: they are
//! `dc_node::NodeConfig::new`'s, and a test holds `config/dcd.toml`'s documented defaults to
//! them. Every `DCD_*` variable mirrors a key (`DCD_MAX_MEMORY` ↔ `max_memory`).

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use dc_kernels::Kernel;
use dc_model::speculative::Speculation;
use dc_net::Multiaddr;
use dc_node::{LayerChoice, NodeConfig, SpotRate};

/// Every setting, in the order `dcd config show` and `config/dcd.toml` list them, with a line
/// of help.
pub const KEYS: &[(&str, &str)] = &[
    (
        "model",
        "model to serve: a Hugging Face folder, a GGUF file or an installed model's name",
    ),
    ("layers", "layers to serve: a half-open range A..B, or auto"),
    (
        "head",
        "hold the head weights (embeddings, final norm, output projection)",
    ),
    (
        "kernel",
        "GEMM kernel: auto, scalar, avx2, avx512 or avx512-ifma (all give the same bits)",
    ),
    ("threads", "compute threads: auto (all cores) or a number"),
    ("data_dir", "identity key, installed models and caches"),
    (
        "api",
        "control API address HOST:PORT (loopback unless api_token is set)",
    ),
    ("api_token", "bearer token the control API requires"),
    ("listen", "peer-to-peer listen addresses (multiaddrs)"),
    ("bootstrap", "peers to dial at start (multiaddrs)"),
    ("mdns", "discover peers on the local network"),
    (
        "swarm_key",
        "pre-shared key file of a private swarm (TCP only; dcd swarm-key new FILE writes one)",
    ),
    (
        "relay_service",
        "relay for peers behind NAT once this daemon is found publicly reachable",
    ),
    (
        "reachability",
        "auto (AutoNAT finds out), private (behind NAT: use relays at once) or public",
    ),
    (
        "autonat_global_only",
        "trust and serve reachability probes only from global IP addresses",
    ),
    (
        "max_connections",
        "established connections at most (1 to 65536)",
    ),
    (
        "max_connections_per_peer",
        "established connections at most with one peer (1 to 64)",
    ),
    (
        "max_memory",
        "memory budget for weights and caches (bytes, or 4GiB, 512MB, ...)",
    ),
    ("max_generations", "generations served at once (1 to 1024)"),
    (
        "announce_secs",
        "seconds between announcements (0.05 to 3600)",
    ),
    (
        "rebalance_secs",
        "seconds between shard re-checks with auto layers (0.05 to 3600)",
    ),
    (
        "idle_only",
        "serve only while the machine is otherwise idle",
    ),
    (
        "idle_threshold",
        "other processes' CPU share (0.01 to 1, of all cores) that pauses new work",
    ),
    (
        "max_message_bytes",
        "largest stage message accepted or sent (64KiB to 1GiB)",
    ),
    ("selftest", "run the numeric self-test before serving"),
    (
        "speculative",
        "guess tokens ahead and check them in the same pass, in dcd generate and the \
         generations this daemon heads: prompt-lookup or off (the tokens are the same)",
    ),
    (
        "audit_rate",
        "share of hops this peer audits when it heads a generation (0 to 1)",
    ),
    (
        "spot_check_rate",
        "chance each part of each layer of a remote hop is spot-checked when this peer heads \
         (0 to 1, or auto: per stage, the rate that meets the detection goal)",
    ),
];

/// `DCD_*` variables that are not settings (so they are not reported as unknown).
/// (`DCD_FAULT` drives the test-only fault injection of `dc-node`.)
const NOT_SETTINGS: &[&str] = &["DCD_LOG", "DCD_FAULT"];

/// The environment variable that mirrors `key`.
pub fn env_name(key: &str) -> String {
    format!("DCD_{}", key.to_ascii_uppercase())
}

/// Where a value came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// A command-line flag (its spelling, e.g. `--max-memory`).
    Flag(String),
    /// An environment variable.
    Env(String),
    /// The config file.
    File(PathBuf),
    /// The built-in default.
    Default,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Flag(flag) => write!(f, "flag {flag}"),
            Source::Env(var) => write!(f, "env {var}"),
            Source::File(path) => write!(f, "file {}", path.display()),
            Source::Default => f.write_str("default"),
        }
    }
}

/// A setting that could not be resolved: the key, where the bad value came from, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The key (or the file, for a file that does not parse).
    pub key: String,
    /// Where the offending value came from.
    pub source: Source,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.key, self.source, self.message)
    }
}

impl std::error::Error for ConfigError {}

/// The resolved configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// Model to serve (no default).
    pub model: Option<String>,
    /// Layers to serve.
    pub layers: LayerChoice,
    /// Hold the head weights.
    pub head: bool,
    /// Kernel name as given (`auto` or a kernel this CPU runs).
    pub kernel: String,
    /// Compute threads (`None`: all cores).
    pub threads: Option<usize>,
    /// Data directory (`None`: the platform data directory).
    pub data_dir: Option<PathBuf>,
    /// Control API address.
    pub api: SocketAddr,
    /// Control API bearer token.
    pub api_token: Option<String>,
    /// Listen addresses.
    pub listen: Vec<Multiaddr>,
    /// Bootstrap peers.
    pub bootstrap: Vec<Multiaddr>,
    /// Local-network discovery.
    pub mdns: bool,
    /// A private swarm's key file (`None`: the open swarm).
    pub swarm_key: Option<PathBuf>,
    /// Relay for peers behind NAT.
    pub relay_service: bool,
    /// Reachability the operator knows (`None`: AutoNAT finds out).
    pub reachability: Option<dc_net::Reachability>,
    /// AutoNAT trusts and serves only global IP addresses.
    pub autonat_global_only: bool,
    /// Established connections at most.
    pub max_connections: u32,
    /// Established connections at most with one peer.
    pub max_connections_per_peer: u32,
    /// Memory budget, bytes (`None`: no budget).
    pub max_memory: Option<u64>,
    /// Generations served at once.
    pub max_generations: usize,
    /// Seconds between announcements.
    pub announce_secs: f64,
    /// Seconds between shard re-checks.
    pub rebalance_secs: f64,
    /// Serve only while the machine is otherwise idle.
    pub idle_only: bool,
    /// Other processes' CPU share above which new work pauses.
    pub idle_threshold: f32,
    /// Largest stage message, bytes.
    pub max_message_bytes: usize,
    /// Run the self-test before serving.
    pub selftest: bool,
    /// Share of hops audited by replay when this peer heads a generation.
    pub audit_rate: f64,
    /// Chance each part of each layer of a remote hop is spot-checked when this peer heads a
    /// generation (`auto`: per stage, the rate that meets the detection goal).
    pub spot_check_rate: SpotRate,
    /// Whether `dcd generate` guesses tokens ahead.
    pub speculative: Speculation,
}

impl Settings {
    /// The defaults: `NodeConfig::new`'s, plus the command line's own (`auto` kernel and
    /// threads, the platform data directory, no model).
    pub fn defaults() -> Settings {
        let d = NodeConfig::new(PathBuf::new(), PathBuf::new());
        Settings {
            model: None,
            layers: d.layers,
            head: d.head,
            kernel: "auto".into(),
            threads: None,
            data_dir: None,
            api: d.api,
            api_token: d.api_token,
            listen: d.listen,
            bootstrap: d.bootstrap,
            mdns: d.mdns,
            swarm_key: None,
            relay_service: d.relay_service,
            reachability: d.nat.reachability,
            autonat_global_only: d.nat.autonat_only_global_ips,
            max_connections: d.max_connections,
            max_connections_per_peer: d.max_connections_per_peer,
            max_memory: d.max_memory,
            max_generations: d.max_generations,
            announce_secs: d.announce_every.as_secs_f64(),
            rebalance_secs: d.rebalance_every.as_secs_f64(),
            idle_only: d.idle_only,
            idle_threshold: d.idle_threshold,
            max_message_bytes: d.max_message_bytes,
            selftest: d.selftest,
            // Through the shortest decimal, so 0.1 shows as 0.1 rather than f32's widening.
            audit_rate: d.audit_rate.to_string().parse().unwrap_or(0.01),
            spot_check_rate: d.spot_check_rate,
            speculative: d.speculative,
        }
    }

    /// The value of `key` as TOML (`None` when unset), the form `config show` prints and the
    /// config file takes.
    pub fn value(&self, key: &str) -> Option<toml::Value> {
        use toml::Value as V;
        let strings =
            |v: &[Multiaddr]| V::Array(v.iter().map(|a| V::String(a.to_string())).collect());
        Some(match key {
            "model" => V::String(self.model.clone()?),
            "layers" => V::String(match self.layers {
                LayerChoice::Auto => "auto".into(),
                LayerChoice::Fixed(r) => r.to_string(),
            }),
            "head" => V::Boolean(self.head),
            "kernel" => V::String(self.kernel.clone()),
            "threads" => match self.threads {
                None => V::String("auto".into()),
                Some(n) => V::Integer(n as i64),
            },
            "data_dir" => V::String(self.data_dir.as_ref()?.display().to_string()),
            "api" => V::String(self.api.to_string()),
            "api_token" => V::String(self.api_token.clone()?),
            "listen" => strings(&self.listen),
            "bootstrap" => strings(&self.bootstrap),
            "mdns" => V::Boolean(self.mdns),
            "swarm_key" => V::String(self.swarm_key.as_ref()?.display().to_string()),
            "relay_service" => V::Boolean(self.relay_service),
            "reachability" => V::String(match self.reachability {
                Some(r) => r.to_string(),
                None => "auto".into(),
            }),
            "autonat_global_only" => V::Boolean(self.autonat_global_only),
            "max_connections" => V::Integer(i64::from(self.max_connections)),
            "max_connections_per_peer" => V::Integer(i64::from(self.max_connections_per_peer)),
            "max_memory" => V::Integer(i64::try_from(self.max_memory?).ok()?),
            "max_generations" => V::Integer(self.max_generations as i64),
            "announce_secs" => V::Float(self.announce_secs),
            "rebalance_secs" => V::Float(self.rebalance_secs),
            "idle_only" => V::Boolean(self.idle_only),
            "idle_threshold" => V::Float(f64::from(self.idle_threshold)),
            "max_message_bytes" => V::Integer(self.max_message_bytes as i64),
            "selftest" => V::Boolean(self.selftest),
            "speculative" => V::String(self.speculative.to_string()),
            "audit_rate" => V::Float(self.audit_rate),
            "spot_check_rate" => match self.spot_check_rate {
                SpotRate::Goal => V::String("auto".into()),
                // Through the shortest decimal, as `audit_rate` above.
                SpotRate::Fixed(c) => V::Float(c.to_string().parse().unwrap_or(f64::from(c))),
            },
            _ => return None,
        })
    }

    /// The daemon's configuration for `model` (already resolved to a path) in `data_dir`.
    pub fn node_config(&self, model: PathBuf, data_dir: PathBuf) -> Result<NodeConfig, String> {
        let mut cfg = NodeConfig::new(model, data_dir);
        cfg.layers = self.layers;
        cfg.head = self.head;
        cfg.listen = self.listen.clone();
        cfg.bootstrap = self.bootstrap.clone();
        cfg.mdns = self.mdns;
        self.network(&mut cfg)?;
        cfg.api = self.api;
        cfg.api_token = self.api_token.clone();
        cfg.max_memory = self.max_memory;
        cfg.kernel = Kernel::parse(&self.kernel).map_err(|e| format!("kernel: {e}"))?;
        cfg.threads = self.threads.unwrap_or_else(default_threads);
        cfg.max_generations = self.max_generations;
        cfg.announce_every = Duration::from_secs_f64(self.announce_secs);
        // A peer is gone after five missed announcements; an auto daemon listens for one
        // announcement period (and a little) before it chooses its layers.
        cfg.peer_timeout = cfg.announce_every * 5;
        cfg.discovery_wait = cfg.announce_every + Duration::from_millis(500);
        cfg.rebalance_every = Duration::from_secs_f64(self.rebalance_secs);
        cfg.idle_only = self.idle_only;
        cfg.idle_threshold = self.idle_threshold;
        cfg.max_message_bytes = self.max_message_bytes;
        cfg.selftest = self.selftest;
        cfg.speculative = self.speculative;
        cfg.audit_rate = self.audit_rate as f32;
        cfg.spot_check_rate = self.spot_check_rate;
        Ok(cfg)
    }

    /// The private swarm, NAT traversal and connection limits of `cfg`.
    fn network(&self, cfg: &mut NodeConfig) -> Result<(), String> {
        if let Some(path) = &self.swarm_key {
            cfg.swarm_key = Some(dc_net::SwarmKey::read(path).map_err(|e| e.to_string())?);
            // pnet cannot wrap QUIC: the default listen addresses lose their QUIC one (an
            // explicit UDP address stays, and the network refuses it with a clear error).
            if self.listen == Settings::defaults().listen {
                cfg.listen
                    .retain(|a| !a.iter().any(|p| matches!(p, dc_net::Protocol::Udp(_))));
            }
        }
        cfg.relay_service = self.relay_service;
        cfg.nat.reachability = self.reachability;
        cfg.nat.autonat_only_global_ips = self.autonat_global_only;
        cfg.max_connections = self.max_connections;
        cfg.max_connections_per_peer = self.max_connections_per_peer;
        Ok(())
    }

    /// Sets `key` from one value; the error says what is wrong with it (the caller adds the key
    /// and the source).
    fn set(&mut self, key: &str, v: Input<'_>) -> Result<(), String> {
        match key {
            "model" => self.model = Some(nonempty(v)?),
            "layers" => {
                let s = nonempty(v)?;
                self.layers = if s.trim() == "auto" {
                    LayerChoice::Auto
                } else {
                    LayerChoice::Fixed(s.parse()?)
                };
            }
            "head" => self.head = boolean(v)?,
            "kernel" => {
                let s = string(v)?.trim().to_ascii_lowercase();
                let k = Kernel::parse(&s).map_err(|e| e.to_string())?;
                self.kernel = if s == "auto" || s.is_empty() {
                    "auto".into()
                } else {
                    k.name().into()
                };
            }
            "threads" => {
                let auto = match v {
                    Input::Toml(toml::Value::String(s)) => s.trim().eq_ignore_ascii_case("auto"),
                    Input::Text(s) => s.trim().eq_ignore_ascii_case("auto"),
                    Input::Toml(_) => false,
                };
                self.threads = if auto {
                    None
                } else {
                    Some(integer(v, 1, 1024)? as usize)
                };
            }
            "data_dir" => self.data_dir = Some(PathBuf::from(nonempty(v)?)),
            "api" => self.api = socket_addr(&nonempty(v)?)?,
            "api_token" => self.api_token = Some(string(v)?).filter(|t| !t.is_empty()),
            "listen" => {
                self.listen = multiaddrs(v)?;
                if self.listen.is_empty() {
                    return Err("needs at least one address".into());
                }
            }
            "bootstrap" => self.bootstrap = multiaddrs(v)?,
            "mdns" => self.mdns = boolean(v)?,
            "swarm_key" => self.swarm_key = Some(PathBuf::from(nonempty(v)?)),
            "relay_service" => self.relay_service = boolean(v)?,
            "reachability" => {
                self.reachability = match nonempty(v)?.trim().to_ascii_lowercase().as_str() {
                    "auto" => None,
                    "private" => Some(dc_net::Reachability::Private),
                    "public" => Some(dc_net::Reachability::Public),
                    other => return Err(format!("{other:?} is not auto, private or public")),
                }
            }
            "autonat_global_only" => self.autonat_global_only = boolean(v)?,
            "max_connections" => self.max_connections = integer(v, 1, 65536)? as u32,
            "max_connections_per_peer" => self.max_connections_per_peer = integer(v, 1, 64)? as u32,
            "max_memory" => self.max_memory = Some(size(v, 1, u64::MAX)?),
            "max_generations" => self.max_generations = integer(v, 1, 1024)? as usize,
            "announce_secs" => self.announce_secs = float(v, 0.05, 3600.0)?,
            "rebalance_secs" => self.rebalance_secs = float(v, 0.05, 3600.0)?,
            "idle_only" => self.idle_only = boolean(v)?,
            "idle_threshold" => self.idle_threshold = float(v, 0.01, 1.0)? as f32,
            "max_message_bytes" => self.max_message_bytes = size(v, 1 << 16, 1 << 30)? as usize,
            "selftest" => self.selftest = boolean(v)?,
            "speculative" => self.speculative = nonempty(v)?.trim().parse()?,
            "audit_rate" => self.audit_rate = float(v, 0.0, 1.0)?,
            "spot_check_rate" => {
                self.spot_check_rate = match v {
                    Input::Toml(toml::Value::String(s)) => s.parse()?,
                    Input::Text(s) => s.parse()?,
                    _ => SpotRate::Fixed(float(v, 0.0, 1.0)? as f32),
                }
            }
            _ => return Err("not a setting".into()),
        }
        Ok(())
    }
}

/// Settings given on the command line, already mapped to keys.
#[derive(Clone, Debug, Default)]
pub struct Flags(Vec<(&'static str, String, toml::Value)>);

impl Flags {
    /// Records that `flag` set `key` to `value` (a flag given twice: the last wins).
    pub fn set(&mut self, key: &'static str, flag: &str, value: impl Into<toml::Value>) {
        self.0.push((key, flag.to_string(), value.into()));
    }
}

/// The settings given as flags: the global ones, and `join`'s.
pub fn flags(cli: &crate::cli::Cli) -> Flags {
    let mut f = Flags::default();
    let g = &cli.global;
    if let Some(k) = &g.kernel_flag {
        f.set("kernel", "--kernel", k.as_str());
    }
    if let Some(n) = g.threads {
        f.set("threads", "--threads", n as i64);
    }
    if let crate::cli::Command::Generate(a) = &cli.command {
        if let Some(s) = a.speculative {
            f.set("speculative", "--speculative", s.to_string());
        }
    }
    let crate::cli::Command::Join(a) = &cli.command else {
        return f;
    };
    let strings = |v: &[String]| toml::Value::Array(v.iter().map(|s| s.as_str().into()).collect());
    if let Some(m) = &a.model {
        f.set("model", "--model", m.as_str());
    }
    if let Some(l) = &a.layers {
        f.set("layers", "--layers", l.as_str());
    }
    if !a.listen.is_empty() {
        f.set("listen", "--listen", strings(&a.listen));
    }
    if !a.bootstrap.is_empty() {
        f.set("bootstrap", "--bootstrap", strings(&a.bootstrap));
    }
    if a.no_mdns {
        f.set("mdns", "--no-mdns", false);
    }
    if let Some(k) = &a.swarm_key {
        f.set("swarm_key", "--swarm-key", k.display().to_string());
    }
    if a.no_relay_service {
        f.set("relay_service", "--no-relay-service", false);
    }
    if let Some(r) = &a.reachability {
        f.set("reachability", "--reachability", r.as_str());
    }
    if a.no_head {
        f.set("head", "--no-head", false);
    }
    if let Some(d) = &a.data_dir {
        f.set("data_dir", "--data-dir", d.display().to_string());
    }
    if let Some(api) = &a.api {
        f.set("api", "--api", api.as_str());
    }
    if let Some(t) = &a.api_token {
        f.set("api_token", "--api-token", t.as_str());
    }
    if let Some(m) = &a.max_memory {
        f.set("max_memory", "--max-memory", m.as_str());
    }
    if let Some(n) = a.max_generations {
        f.set("max_generations", "--max-generations", n as i64);
    }
    if let Some(x) = a.announce_secs {
        f.set("announce_secs", "--announce-secs", x);
    }
    if let Some(x) = a.rebalance_secs {
        f.set("rebalance_secs", "--rebalance-secs", x);
    }
    if a.no_selftest {
        f.set("selftest", "--no-selftest", false);
    }
    if let Some(m) = &a.max_message_bytes {
        f.set("max_message_bytes", "--max-message-bytes", m.as_str());
    }
    if a.idle_only {
        f.set("idle_only", "--idle-only", true);
    }
    if let Some(x) = a.idle_threshold {
        f.set("idle_threshold", "--idle-threshold", x);
    }
    if let Some(x) = a.audit_rate {
        f.set("audit_rate", "--audit-rate", x);
    }
    if let Some(x) = a.spot_check_rate {
        f.set("spot_check_rate", "--spot-check-rate", x.to_string());
    }
    f
}

/// The config file to read: its path and text.
#[derive(Clone, Debug)]
pub struct ConfigFile {
    /// Where it was read from.
    pub path: PathBuf,
    /// Its text.
    pub text: String,
}

/// The configuration and where each value came from.
#[derive(Clone, Debug)]
pub struct Resolved {
    /// The values.
    pub settings: Settings,
    /// The source of every key.
    pub sources: BTreeMap<&'static str, Source>,
    /// The config file read, if any.
    pub file: Option<PathBuf>,
    /// The default config file path when none was read (absent is fine).
    pub default_file: Option<PathBuf>,
    /// `DCD_*` variables that are not settings (probably typos).
    pub unknown_env: Vec<String>,
}

impl Resolved {
    /// Where `key` came from.
    pub fn source(&self, key: &str) -> &Source {
        self.sources.get(key).unwrap_or(&Source::Default)
    }

    /// Warnings worth printing (unknown `DCD_*` variables).
    pub fn warnings(&self) -> Vec<String> {
        self.unknown_env
            .iter()
            .map(|name| {
                let key = name.trim_start_matches("DCD_").to_ascii_lowercase();
                match closest(&key) {
                    Some(k) => format!(
                        "{name} is not a setting (did you mean {}?); it is ignored",
                        env_name(k)
                    ),
                    None => format!("{name} is not a setting; it is ignored"),
                }
            })
            .collect()
    }
}

/// A value as a source gives it: typed TOML (file, flags) or text (environment).
#[derive(Clone, Copy, Debug)]
enum Input<'a> {
    Toml(&'a toml::Value),
    Text(&'a str),
}

/// Resolves flags over environment over file over defaults. `env` holds the process
/// environment (other variables than `DCD_*` are ignored); `file` is the config file's text.
pub fn resolve(
    flags: &Flags,
    env: &BTreeMap<String, String>,
    file: Option<&ConfigFile>,
) -> Result<Resolved, ConfigError> {
    let mut s = Settings::defaults();
    let mut sources = BTreeMap::new();
    if let Some(f) = file {
        let source = Source::File(f.path.clone());
        let table: toml::Table = f.text.parse().map_err(|e: toml::de::Error| ConfigError {
            key: "config file".into(),
            source: source.clone(),
            message: e.to_string().trim_end().to_string(),
        })?;
        for (k, v) in &table {
            let key = known(k).ok_or_else(|| unknown(k, source.clone()))?;
            s.set(key, Input::Toml(v)).map_err(|message| ConfigError {
                key: key.into(),
                source: source.clone(),
                message,
            })?;
            sources.insert(key, source.clone());
        }
    }
    let mut unknown_env = Vec::new();
    for (name, value) in env {
        let Some(rest) = name.strip_prefix("DCD_") else {
            continue;
        };
        let Some(key) = known(&rest.to_ascii_lowercase()).filter(|k| env_name(k) == *name) else {
            if !NOT_SETTINGS.contains(&name.as_str()) {
                unknown_env.push(name.clone());
            }
            continue;
        };
        // An empty variable is an unset one (the shell convention), not an empty value.
        if value.is_empty() {
            continue;
        }
        let source = Source::Env(name.clone());
        s.set(key, Input::Text(value))
            .map_err(|message| ConfigError {
                key: key.into(),
                source: source.clone(),
                message,
            })?;
        sources.insert(key, source);
    }
    for (key, flag, value) in &flags.0 {
        let source = Source::Flag(flag.clone());
        s.set(key, Input::Toml(value))
            .map_err(|message| ConfigError {
                key: (*key).into(),
                source: source.clone(),
                message,
            })?;
        sources.insert(key, source);
    }
    Ok(Resolved {
        settings: s,
        sources,
        file: file.map(|f| f.path.clone()),
        default_file: None,
        unknown_env,
    })
}

/// The default config file: `<platform config dir>/dcd.toml` (`~/.config/dcd/dcd.toml` on
/// Linux).
pub fn default_file() -> Option<PathBuf> {
    directories::ProjectDirs::from("org", "DaisyChain", "dcd")
        .map(|p| p.config_dir().join("dcd.toml"))
}

/// Reads the config file: `explicit` (`--config`) must exist; the default file may be absent.
pub fn read_file(explicit: Option<&Path>) -> anyhow::Result<Option<ConfigFile>> {
    use anyhow::Context;
    if let Some(path) = explicit {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--config {}: cannot read the config file", path.display()))?;
        return Ok(Some(ConfigFile {
            path: path.to_path_buf(),
            text,
        }));
    }
    let Some(path) = default_file() else {
        return Ok(None);
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => Ok(Some(ConfigFile { path, text })),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading the config file {}", path.display())),
    }
}

/// The process's `DCD_*` environment.
pub fn process_env() -> anyhow::Result<BTreeMap<String, String>> {
    let mut env = BTreeMap::new();
    for (name, value) in std::env::vars_os() {
        let Some(name) = name.to_str().filter(|n| n.starts_with("DCD_")) else {
            continue;
        };
        let value = value
            .into_string()
            .map_err(|_| anyhow::anyhow!("{name} is not valid UTF-8"))?;
        env.insert(name.to_string(), value);
    }
    Ok(env)
}

/// Resolves the process's configuration: `flags` over the `DCD_*` environment over the config
/// file (`--config`, else the default file) over the defaults.
pub fn load(explicit: Option<&Path>, flags: &Flags) -> anyhow::Result<Resolved> {
    let env = process_env()?;
    let file = read_file(explicit)?;
    let mut r = resolve(flags, &env, file.as_ref())?;
    if r.file.is_none() {
        r.default_file = default_file();
    }
    Ok(r)
}

/// The default for `threads`: every core available to us (the one default not taken from
/// `NodeConfig::new`, because the commands that run in this process need it too).
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The control API URL a client uses to reach a daemon bound to `addr` (an unspecified bind
/// address is reached on loopback).
pub fn api_url(addr: SocketAddr) -> String {
    let ip = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}", SocketAddr::new(ip, addr.port()))
}

fn known(k: &str) -> Option<&'static str> {
    KEYS.iter().map(|(key, _)| *key).find(|key| *key == k)
}

fn unknown(k: &str, source: Source) -> ConfigError {
    let hint = match closest(k) {
        Some(c) => format!("; did you mean `{c}`?"),
        None => String::new(),
    };
    ConfigError {
        key: k.into(),
        source,
        message: format!("unknown setting{hint} (`dcd config show` lists them all)"),
    }
}

/// The key nearest to `k` by edit distance, if it is near enough to be a typo.
fn closest(k: &str) -> Option<&'static str> {
    KEYS.iter()
        .map(|(key, _)| (edit_distance(k, key), *key))
        .min()
        .filter(|(d, key)| *d <= 2.max(key.len() / 4))
        .map(|(_, key)| key)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != *cb))
                .min(prev[j + 1] + 1)
                .min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

fn type_name(v: &toml::Value) -> &'static str {
    v.type_str()
}

fn string(v: Input<'_>) -> Result<String, String> {
    match v {
        Input::Text(s) => Ok(s.to_string()),
        Input::Toml(toml::Value::String(s)) => Ok(s.clone()),
        Input::Toml(other) => Err(format!("expected a string, got {}", type_name(other))),
    }
}

fn nonempty(v: Input<'_>) -> Result<String, String> {
    let s = string(v)?;
    if s.trim().is_empty() {
        return Err("must not be empty".into());
    }
    Ok(s)
}

fn boolean(v: Input<'_>) -> Result<bool, String> {
    match v {
        Input::Toml(toml::Value::Boolean(b)) => Ok(*b),
        Input::Text(s) => match s.trim().to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => Ok(true),
            "0" | "false" | "no" | "off" => Ok(false),
            _ => Err(format!(
                "{s:?} is not a boolean (true/false, 1/0, yes/no, on/off)"
            )),
        },
        Input::Toml(other) => Err(format!("expected true or false, got {}", type_name(other))),
    }
}

fn integer(v: Input<'_>, min: u64, max: u64) -> Result<u64, String> {
    let n: i128 = match v {
        Input::Toml(toml::Value::Integer(n)) => i128::from(*n),
        Input::Text(s) => s
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not a whole number"))?,
        Input::Toml(other) => {
            return Err(format!("expected a whole number, got {}", type_name(other)))
        }
    };
    if n < i128::from(min) || n > i128::from(max) {
        return Err(format!("{n} is out of range ({min} to {max})"));
    }
    Ok(n as u64)
}

fn float(v: Input<'_>, min: f64, max: f64) -> Result<f64, String> {
    let x = match v {
        Input::Toml(toml::Value::Float(x)) => *x,
        Input::Toml(toml::Value::Integer(n)) => *n as f64,
        Input::Text(s) => s
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not a number"))?,
        Input::Toml(other) => return Err(format!("expected a number, got {}", type_name(other))),
    };
    if !(min..=max).contains(&x) {
        return Err(format!("{x} is out of range ({min} to {max})"));
    }
    Ok(x)
}

/// A byte count: a whole number, or a string with a unit (`4GiB`, `512MB`).
fn size(v: Input<'_>, min: u64, max: u64) -> Result<u64, String> {
    let n = match v {
        Input::Toml(toml::Value::Integer(_)) => integer(v, 0, u64::MAX)?,
        Input::Toml(toml::Value::String(s)) => dc_node::core::memory::parse_size(s)?,
        Input::Text(s) => dc_node::core::memory::parse_size(s)?,
        Input::Toml(other) => {
            return Err(format!(
                "expected a size (bytes, or a string like \"4GiB\"), got {}",
                type_name(other)
            ))
        }
    };
    if n < min || n > max {
        return Err(format!("{n} bytes is out of range ({min} to {max})"));
    }
    Ok(n)
}

fn socket_addr(s: &str) -> Result<SocketAddr, String> {
    let t = s.trim();
    let t = t.strip_prefix("http://").unwrap_or(t).trim_end_matches('/');
    t.parse().map_err(|_| {
        format!("{s:?} is not an address HOST:PORT with a numeric host, like 127.0.0.1:7370")
    })
}

/// A list of multiaddrs: a TOML array of strings, or text separated by commas or spaces.
fn multiaddrs(v: Input<'_>) -> Result<Vec<Multiaddr>, String> {
    let items: Vec<String> = match v {
        Input::Text(s) => s
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|p| !p.is_empty())
            .map(str::to_string)
            .collect(),
        Input::Toml(toml::Value::Array(a)) => a
            .iter()
            .map(|x| match x {
                toml::Value::String(s) => Ok(s.clone()),
                other => Err(format!("expected strings, got {}", type_name(other))),
            })
            .collect::<Result<_, _>>()?,
        Input::Toml(other) => {
            return Err(format!(
                "expected a list of multiaddrs like [\"/ip4/0.0.0.0/tcp/7371\"], got {}",
                type_name(other)
            ))
        }
    };
    items
        .iter()
        .map(|s| {
            s.parse()
                .map_err(|e| format!("{s:?} is not a multiaddr: {e}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn file(text: &str) -> ConfigFile {
        ConfigFile {
            path: PathBuf::from("/etc/dcd/dcd.toml"),
            text: text.into(),
        }
    }

    fn err(flags: &Flags, e: &BTreeMap<String, String>, f: Option<&ConfigFile>) -> String {
        resolve(flags, e, f).expect_err("should fail").to_string()
    }

    #[test]
    fn defaults_are_the_daemons() {
        let r = resolve(&Flags::default(), &BTreeMap::new(), None).unwrap();
        assert_eq!(r.settings, Settings::defaults());
        let d = NodeConfig::new(PathBuf::new(), PathBuf::new());
        assert_eq!(r.settings.max_generations, d.max_generations);
        assert_eq!(r.settings.listen, d.listen);
        assert!(KEYS.iter().all(|(k, _)| r.source(k) == &Source::Default));
    }

    #[test]
    fn flags_beat_env_beat_file_beat_defaults() {
        let f = file("max_memory = \"1GiB\"\nmax_generations = 3\nthreads = 3\nmdns = false\n");
        let e = env(&[
            ("DCD_MAX_MEMORY", "2GiB"),
            ("DCD_THREADS", "5"),
            ("PATH", "/bin"),
        ]);
        let mut flags = Flags::default();
        flags.set("threads", "--threads", 7i64);
        let r = resolve(&flags, &e, Some(&f)).unwrap();
        let s = &r.settings;
        assert_eq!(s.threads, Some(7));
        assert_eq!(r.source("threads"), &Source::Flag("--threads".into()));
        assert_eq!(s.max_memory, Some(2 << 30));
        assert_eq!(
            r.source("max_memory"),
            &Source::Env("DCD_MAX_MEMORY".into())
        );
        assert_eq!(s.max_generations, 3);
        assert_eq!(
            r.source("max_generations"),
            &Source::File("/etc/dcd/dcd.toml".into())
        );
        assert!(!s.mdns);
        assert_eq!(s.announce_secs, Settings::defaults().announce_secs);
        assert_eq!(r.source("announce_secs"), &Source::Default);
        assert_eq!(r.source("threads").to_string(), "flag --threads");
        assert_eq!(r.source("max_memory").to_string(), "env DCD_MAX_MEMORY");
        assert_eq!(
            r.source("max_generations").to_string(),
            "file /etc/dcd/dcd.toml"
        );
    }

    #[test]
    fn every_key_has_an_environment_variable() {
        for (key, _) in KEYS {
            let v = Settings::defaults()
                .value(key)
                .map(|v| match v {
                    toml::Value::String(s) => s,
                    toml::Value::Array(a) => a
                        .iter()
                        .filter_map(|x| x.as_str())
                        .collect::<Vec<_>>()
                        .join(","),
                    other => other.to_string(),
                })
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| match *key {
                    "model" => "m".into(),
                    "data_dir" => "/d".into(),
                    "api_token" => "t".into(),
                    "max_memory" => "4GiB".into(),
                    "bootstrap" => "/ip4/10.0.0.1/tcp/7371".into(),
                    "swarm_key" => "/etc/dcd/swarm.key".into(),
                    other => panic!("{other} has no default and no test value"),
                });
            let name = env_name(key);
            let r = resolve(&Flags::default(), &env(&[(&name, &v)]), None)
                .unwrap_or_else(|e| panic!("{name}={v}: {e}"));
            assert_eq!(r.source(key), &Source::Env(name.clone()), "{name}");
            assert!(r.unknown_env.is_empty());
        }
    }

    #[test]
    fn env_values_parse_by_type() {
        let e = env(&[
            (
                "DCD_LISTEN",
                "/ip4/127.0.0.1/tcp/0, /ip4/127.0.0.1/udp/0/quic-v1",
            ),
            ("DCD_BOOTSTRAP", ""),
            ("DCD_IDLE_ONLY", "yes"),
            ("DCD_IDLE_THRESHOLD", "0.25"),
            ("DCD_LAYERS", "0..2"),
            ("DCD_API", "http://0.0.0.0:9000/"),
            ("DCD_KERNEL", "SCALAR"),
            ("DCD_THREADS", "auto"),
            ("DCD_MAX_MESSAGE_BYTES", "1MiB"),
        ]);
        let r = resolve(&Flags::default(), &e, None).unwrap();
        let s = r.settings;
        assert_eq!(s.listen.len(), 2);
        assert!(s.bootstrap.is_empty());
        assert_eq!(
            r.sources.get("bootstrap"),
            None,
            "an empty variable is unset"
        );
        assert!(s.idle_only);
        assert_eq!(s.idle_threshold, 0.25);
        assert_eq!(s.layers, LayerChoice::Fixed("0..2".parse().unwrap()));
        assert_eq!(s.api, "0.0.0.0:9000".parse().unwrap());
        assert_eq!(api_url(s.api), "http://127.0.0.1:9000");
        assert_eq!(s.kernel, "scalar");
        assert_eq!(s.threads, None);
        assert_eq!(s.max_message_bytes, 1 << 20);
    }

    #[test]
    fn bad_values_name_the_key_and_the_source() {
        let none = BTreeMap::new();
        let e = err(&Flags::default(), &env(&[("DCD_MAX_MEMORY", "lots")]), None);
        assert!(e.starts_with("max_memory (env DCD_MAX_MEMORY): "), "{e}");
        let e = err(&Flags::default(), &none, Some(&file("max_generations = 0")));
        assert!(
            e.starts_with("max_generations (file /etc/dcd/dcd.toml): "),
            "{e}"
        );
        assert!(e.contains("out of range"), "{e}");
        let e = err(&Flags::default(), &none, Some(&file("mdns = \"maybe\"")));
        assert!(
            e.contains("mdns (file /etc/dcd/dcd.toml): expected true or false"),
            "{e}"
        );
        let e = err(&Flags::default(), &env(&[("DCD_IDLE_ONLY", "maybe")]), None);
        assert!(e.starts_with("idle_only (env DCD_IDLE_ONLY): "), "{e}");
        let e = err(
            &Flags::default(),
            &env(&[("DCD_LISTEN", "not-an-addr")]),
            None,
        );
        assert!(
            e.starts_with("listen (env DCD_LISTEN): \"not-an-addr\" is not a multiaddr"),
            "{e}"
        );
        let e = err(&Flags::default(), &env(&[("DCD_KERNEL", "gpu")]), None);
        assert!(e.starts_with("kernel (env DCD_KERNEL): "), "{e}");
        let e = err(&Flags::default(), &env(&[("DCD_ANNOUNCE_SECS", "0")]), None);
        assert!(
            e.starts_with("announce_secs (env DCD_ANNOUNCE_SECS): "),
            "{e}"
        );
        let e = err(
            &Flags::default(),
            &env(&[("DCD_IDLE_THRESHOLD", "1.5")]),
            None,
        );
        assert!(
            e.starts_with("idle_threshold (env DCD_IDLE_THRESHOLD): "),
            "{e}"
        );
        let e = err(&Flags::default(), &env(&[("DCD_API", "localhost")]), None);
        assert!(e.starts_with("api (env DCD_API): "), "{e}");
        let e = err(&Flags::default(), &env(&[("DCD_LAYERS", "3..1")]), None);
        assert!(e.starts_with("layers (env DCD_LAYERS): "), "{e}");
        let mut flags = Flags::default();
        flags.set("max_message_bytes", "--max-message-bytes", "2GiB");
        let e = err(&flags, &none, None);
        assert!(
            e.starts_with("max_message_bytes (flag --max-message-bytes): "),
            "{e}"
        );
    }

    #[test]
    fn speculation_is_prompt_lookup_unless_turned_off() {
        let none = BTreeMap::new();
        let mode = |flags: &Flags, e: &BTreeMap<String, String>, f: Option<&ConfigFile>| {
            resolve(flags, e, f).unwrap().settings.speculative
        };
        assert_eq!(
            mode(&Flags::default(), &none, None),
            Speculation::PromptLookup
        );
        let off = file("speculative = \"off\"");
        assert_eq!(mode(&Flags::default(), &none, Some(&off)), Speculation::Off);
        let e = env(&[("DCD_SPECULATIVE", "prompt-lookup")]);
        assert_eq!(
            mode(&Flags::default(), &e, Some(&off)),
            Speculation::PromptLookup
        );
        let mut flags = Flags::default();
        flags.set("speculative", "--speculative", "off");
        assert_eq!(mode(&flags, &e, None), Speculation::Off);
        let e = err(
            &Flags::default(),
            &none,
            Some(&file("speculative = \"always\"")),
        );
        assert!(
            e.starts_with("speculative (file /etc/dcd/dcd.toml): ") && e.contains("prompt-lookup"),
            "{e}"
        );
    }

    #[test]
    fn the_spot_check_rate_is_auto_or_a_rate() {
        let none = BTreeMap::new();
        let rate = |flags: &Flags, e: &BTreeMap<String, String>, f: Option<&ConfigFile>| {
            resolve(flags, e, f).unwrap().settings.spot_check_rate
        };
        assert_eq!(Settings::defaults().spot_check_rate, SpotRate::Goal);
        let auto = file("spot_check_rate = \"auto\"");
        assert_eq!(rate(&Flags::default(), &none, Some(&auto)), SpotRate::Goal);
        let fixed = file("spot_check_rate = 0.25");
        assert_eq!(
            rate(&Flags::default(), &none, Some(&fixed)),
            SpotRate::Fixed(0.25)
        );
        let one = file("spot_check_rate = 1");
        assert_eq!(
            rate(&Flags::default(), &none, Some(&one)),
            SpotRate::Fixed(1.0)
        );
        let e = env(&[("DCD_SPOT_CHECK_RATE", "AUTO")]);
        assert_eq!(rate(&Flags::default(), &e, Some(&fixed)), SpotRate::Goal);
        let mut flags = Flags::default();
        flags.set("spot_check_rate", "--spot-check-rate", "0.06");
        assert_eq!(rate(&flags, &e, Some(&auto)), SpotRate::Fixed(0.06));
        // As `config show` prints it and the file takes it back.
        let shown = |r: SpotRate| {
            let s = Settings {
                spot_check_rate: r,
                ..Settings::defaults()
            };
            s.value("spot_check_rate").unwrap().to_string()
        };
        assert_eq!(shown(SpotRate::Goal), "\"auto\"");
        assert_eq!(shown(SpotRate::Fixed(0.06)), "0.06");
        for bad in [
            "spot_check_rate = 1.5",
            "spot_check_rate = \"often\"",
            "spot_check_rate = true",
        ] {
            let e = err(&Flags::default(), &none, Some(&file(bad)));
            assert!(
                e.starts_with("spot_check_rate (file /etc/dcd/dcd.toml): "),
                "{bad}: {e}"
            );
        }
        let e = err(
            &Flags::default(),
            &env(&[("DCD_SPOT_CHECK_RATE", "-0.1")]),
            None,
        );
        assert!(
            e.contains("neither \"auto\" nor a number from 0 to 1"),
            "{e}"
        );
    }

    #[test]
    fn a_bad_file_value_is_an_error_even_when_a_flag_overrides_it() {
        let mut flags = Flags::default();
        flags.set("threads", "--threads", 2i64);
        let e = err(&flags, &BTreeMap::new(), Some(&file("threads = -1")));
        assert!(e.starts_with("threads (file /etc/dcd/dcd.toml)"), "{e}");
    }

    #[test]
    fn unknown_keys_are_errors_with_a_suggestion() {
        let e = err(
            &Flags::default(),
            &BTreeMap::new(),
            Some(&file("max_memroy = \"4GiB\"")),
        );
        assert!(
            e.starts_with("max_memroy (file /etc/dcd/dcd.toml): unknown setting"),
            "{e}"
        );
        assert!(e.contains("did you mean `max_memory`?"), "{e}");
        let e = err(
            &Flags::default(),
            &BTreeMap::new(),
            Some(&file("[node]\nthreads = 2")),
        );
        assert!(
            e.starts_with("node (file /etc/dcd/dcd.toml): unknown setting"),
            "{e}"
        );
    }

    #[test]
    fn a_file_that_is_not_toml_names_the_file() {
        let e = err(
            &Flags::default(),
            &BTreeMap::new(),
            Some(&file("threads = = 2")),
        );
        assert!(
            e.starts_with("config file (file /etc/dcd/dcd.toml): "),
            "{e}"
        );
    }

    #[test]
    fn unknown_environment_variables_are_reported_not_fatal() {
        let e = env(&[("DCD_MAX_MEMROY", "4GiB"), ("DCD_LOG", "debug")]);
        let r = resolve(&Flags::default(), &e, None).unwrap();
        assert_eq!(r.unknown_env, vec!["DCD_MAX_MEMROY".to_string()]);
        let w = r.warnings();
        assert_eq!(w.len(), 1);
        assert!(w[0].contains("did you mean DCD_MAX_MEMORY?"), "{}", w[0]);
        // Lower-case or mixed-case variables do not count as settings.
        let r = resolve(&Flags::default(), &env(&[("DCD_threads", "3")]), None).unwrap();
        assert_eq!(r.settings.threads, None);
    }

    #[test]
    fn settings_round_trip_through_their_toml_form() {
        let e = env(&[
            ("DCD_MODEL", "smollm2-135m"),
            ("DCD_MAX_MEMORY", "3GiB"),
            ("DCD_THREADS", "3"),
            ("DCD_LAYERS", "1..4"),
            ("DCD_BOOTSTRAP", "/ip4/10.0.0.1/tcp/7371"),
            ("DCD_IDLE_THRESHOLD", "0.3"),
        ]);
        let a = resolve(&Flags::default(), &e, None).unwrap().settings;
        let mut t = toml::Table::new();
        for (k, _) in KEYS {
            if let Some(v) = a.value(k) {
                t.insert(k.to_string(), v);
            }
        }
        let b = resolve(
            &Flags::default(),
            &BTreeMap::new(),
            Some(&file(&t.to_string())),
        )
        .unwrap()
        .settings;
        assert_eq!(a, b);
    }

    #[test]
    fn node_config_carries_every_setting() {
        let f = file(
            "model = \"m\"\nlayers = \"0..2\"\nhead = false\nkernel = \"scalar\"\nthreads = 3\n\
             api = \"127.0.0.1:9\"\napi_token = \"secret\"\nmax_memory = 1000000\n\
             max_generations = 4\nannounce_secs = 0.5\nrebalance_secs = 7\nidle_only = true\n\
             idle_threshold = 0.2\nmax_message_bytes = \"1MiB\"\nselftest = false\nmdns = false\n",
        );
        let s = resolve(&Flags::default(), &BTreeMap::new(), Some(&f))
            .unwrap()
            .settings;
        let c = s
            .node_config(PathBuf::from("/m"), PathBuf::from("/d"))
            .unwrap();
        assert_eq!(c.layers, LayerChoice::Fixed("0..2".parse().unwrap()));
        assert!(!c.head && !c.mdns && !c.selftest && c.idle_only);
        assert_eq!(c.kernel, Kernel::Scalar);
        assert_eq!(c.threads, 3);
        assert_eq!(c.api, "127.0.0.1:9".parse().unwrap());
        assert_eq!(c.api_token.as_deref(), Some("secret"));
        assert_eq!(c.max_memory, Some(1_000_000));
        assert_eq!(c.max_generations, 4);
        assert_eq!(c.announce_every, Duration::from_millis(500));
        assert_eq!(c.peer_timeout, Duration::from_millis(2500));
        assert_eq!(c.rebalance_every, Duration::from_secs(7));
        assert_eq!(c.idle_threshold, 0.2);
        assert_eq!(c.max_message_bytes, 1 << 20);
        assert_eq!(c.data_dir, PathBuf::from("/d"));
    }

    /// `config/dcd.toml` documents every setting once: `# key = default` for settings with a
    /// default (which must equal the code's), `# example: key = value` for settings without
    /// one (which must be unset by default). The file itself parses.
    #[test]
    fn the_documented_config_file_matches_the_defaults() {
        let text = include_str!("../../../config/dcd.toml");
        let as_is = resolve(&Flags::default(), &BTreeMap::new(), Some(&file(text))).unwrap();
        assert_eq!(
            as_is.settings,
            Settings::defaults(),
            "the shipped file must change nothing"
        );

        let mut defaults = String::new();
        let mut documented: BTreeMap<String, usize> = BTreeMap::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("# ") else {
                continue;
            };
            let (example, assignment) = match rest.strip_prefix("example: ") {
                Some(a) => (true, a),
                None => (false, rest),
            };
            let Some((key, value)) = assignment.split_once(" = ") else {
                continue;
            };
            if !key.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                continue;
            }
            assert!(
                known(key).is_some(),
                "config/dcd.toml documents unknown key {key:?}"
            );
            *documented.entry(key.to_string()).or_default() += 1;
            let one = format!("{key} = {value}\n");
            let r = resolve(&Flags::default(), &BTreeMap::new(), Some(&file(&one)))
                .unwrap_or_else(|e| panic!("config/dcd.toml: {line:?}: {e}"));
            if example {
                assert_eq!(
                    Settings::defaults().value(key),
                    None,
                    "{key} has a default in the code: document it as `# {key} = <default>`"
                );
                assert_ne!(r.settings.value(key), None);
            } else {
                defaults.push_str(&one);
            }
        }
        for (key, _) in KEYS {
            assert_eq!(
                documented.get(*key),
                Some(&1),
                "config/dcd.toml must document {key} once"
            );
        }
        let r = resolve(&Flags::default(), &BTreeMap::new(), Some(&file(&defaults))).unwrap();
        for (key, _) in KEYS {
            assert_eq!(
                r.settings.value(key),
                Settings::defaults().value(key),
                "config/dcd.toml documents a default for {key} that is not the code's"
            );
        }
        assert_eq!(r.settings, Settings::defaults());
    }
}
