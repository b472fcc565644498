//! How the network is set up ([`NetConfig`]) and what can stop it from starting
//! ([`StartError`]).

use std::time::Duration;

use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use libp2p::Multiaddr;
use thiserror::Error;

use crate::nat::NatConfig;
use crate::swarm_key::SwarmKey;

/// How the network is set up. [`NetConfig::new`] gives every setting a default; set the
/// fields that differ with struct update syntax:
///
/// ```
/// # let keypair = libp2p::identity::Keypair::generate_ed25519();
/// let cfg = dc_net::NetConfig {
///     listen: vec!["/ip4/0.0.0.0/tcp/4001".parse().unwrap()],
///     max_connections: 128,
///     ..dc_net::NetConfig::new(keypair, "daisychain/announce/1/abc".into())
/// };
/// ```
#[derive(Clone, Debug)]
pub struct NetConfig {
    /// The identity.
    pub keypair: Keypair,
    /// Addresses to listen on.
    pub listen: Vec<Multiaddr>,
    /// Peers to dial at start.
    pub bootstrap: Vec<Multiaddr>,
    /// Local-network discovery.
    pub mdns: bool,
    /// The gossip topic of announcements (one per model).
    pub topic: String,
    /// Largest stage request accepted or sent.
    pub max_request_bytes: usize,
    /// Largest stage response accepted or sent.
    pub max_response_bytes: usize,
    /// Largest gossip message.
    pub max_gossip_bytes: usize,
    /// Timeout of one stage request.
    pub request_timeout: Duration,
    /// Software version reported to peers.
    pub agent: String,
    /// The pre-shared key of a private swarm (libp2p `pnet`), or `None` for the open swarm
    /// (the default). With a key, every TCP connection (and every relayed circuit) starts with
    /// the pnet handshake under noise, so a peer without the key, or with another one, cannot
    /// connect, learn our peers or see our gossip. pnet works over TCP only: a private swarm
    /// runs no QUIC, and [`crate::start`] refuses UDP listen or bootstrap addresses
    /// (`/udp/…/quic-v1`) with [`StartError::UdpInPrivateSwarm`].
    pub swarm_key: Option<SwarmKey>,
    /// Established connections at most, all peers and directions together (default 256).
    /// Connections over the limit are closed as soon as they are established.
    pub max_connections: u32,
    /// Established connections at most with one peer (default 4: a direct one, a relayed one,
    /// a hole punch and an AutoNAT dial-back fit).
    pub max_connections_per_peer: u32,
    /// Incoming connections at most still in their handshake (default 64): a flood of
    /// half-open connections cannot take all of them.
    pub max_pending_incoming: u32,
    /// Offer the circuit relay v2 service to private peers (default true), within
    /// [`NatConfig::relay_limits`], once AutoNAT finds this daemon publicly reachable.
    pub relay_service: bool,
    /// NAT traversal: AutoNAT, relay reservations, hole punching.
    pub nat: NatConfig,
}

impl NetConfig {
    /// A configuration with this identity and gossip topic and defaults for the rest: no
    /// listen or bootstrap address, no mDNS, 64 MiB requests and responses, 64 KiB gossip,
    /// 120 s request timeout, the open swarm, 256 connections (4 per peer, 64 pending
    /// incoming), the relay service on, [`NatConfig::default`].
    pub fn new(keypair: Keypair, topic: String) -> Self {
        Self {
            keypair,
            listen: Vec::new(),
            bootstrap: Vec::new(),
            mdns: false,
            topic,
            max_request_bytes: 64 << 20,
            max_response_bytes: 64 << 20,
            max_gossip_bytes: 64 << 10,
            request_timeout: Duration::from_secs(120),
            agent: format!("dc-net/{}", env!("CARGO_PKG_VERSION")),
            swarm_key: None,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_peer: DEFAULT_MAX_CONNECTIONS_PER_PEER,
            max_pending_incoming: DEFAULT_MAX_PENDING_INCOMING,
            relay_service: true,
            nat: NatConfig::default(),
        }
    }

    /// Checks what [`crate::start`] cannot work with.
    pub(crate) fn check(&self) -> Result<(), StartError> {
        for (field, value) in [
            ("max_connections", self.max_connections),
            ("max_connections_per_peer", self.max_connections_per_peer),
            ("max_pending_incoming", self.max_pending_incoming),
        ] {
            if value == 0 {
                return Err(StartError::ZeroLimit { field });
            }
        }
        if self.swarm_key.is_some() {
            for addr in self.listen.iter().chain(&self.bootstrap) {
                if addr.iter().any(|p| matches!(p, Protocol::Udp(_))) {
                    return Err(StartError::UdpInPrivateSwarm { addr: addr.clone() });
                }
            }
        }
        Ok(())
    }
}

/// Default of [`NetConfig::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: u32 = 256;
/// Default of [`NetConfig::max_connections_per_peer`].
pub const DEFAULT_MAX_CONNECTIONS_PER_PEER: u32 = 4;
/// Default of [`NetConfig::max_pending_incoming`].
pub const DEFAULT_MAX_PENDING_INCOMING: u32 = 64;

/// Why the network could not start.
#[derive(Debug, Error)]
pub enum StartError {
    /// A private swarm was given a UDP (QUIC) address.
    #[error(
        "{addr}: a private swarm (swarm key) runs over TCP only; pnet cannot protect QUIC or \
         other UDP transports, use a /tcp/ address"
    )]
    UdpInPrivateSwarm {
        /// The address.
        addr: Multiaddr,
    },
    /// A connection limit of zero would refuse every peer.
    #[error("{field} is 0: no peer could connect; it must be at least 1")]
    ZeroLimit {
        /// The setting.
        field: &'static str,
    },
    /// The transport could not be built.
    #[error("transport: {0}")]
    Transport(String),
    /// A protocol could not be set up.
    #[error("{protocol}: {reason}")]
    Behaviour {
        /// The protocol.
        protocol: &'static str,
        /// Why.
        reason: String,
    },
    /// Cannot subscribe to the gossip topic.
    #[error("subscribing to {topic}: {reason}")]
    Subscribe {
        /// The topic.
        topic: String,
        /// Why.
        reason: String,
    },
    /// Cannot listen on an address.
    #[error("cannot listen on {addr}: {reason}")]
    Listen {
        /// The address.
        addr: Multiaddr,
        /// Why.
        reason: String,
    },
}

/// So that callers which report errors as text (`Result<_, String>`) can keep using `?`.
impl From<StartError> for String {
    fn from(e: StartError) -> String {
        e.to_string()
    }
}
