//! NAT traversal with libp2p's own protocols: what a daemon is told about it and how it is
//! tuned ([`NatConfig`], [`RelayLimits`], [`Reachability`], [`ConnectionInfo`]), and the
//! bookkeeping of relay reservations ([`Reservations`]).
//!
//! How the pieces fit:
//! - **AutoNAT** (v1) asks connected peers to dial us back and reports [`Reachability`]. A
//!   confirmed public address becomes an external address of the swarm.
//! - **Circuit relay v2, server side**: a daemon with a confirmed external address offers to
//!   relay for others (unless `NetConfig::relay_service` is off), within [`RelayLimits`].
//! - **Circuit relay v2, client side**: a daemon that is private (AutoNAT says so, or
//!   [`NatConfig::reachability`] says so) reserves a slot on up to [`NatConfig::max_reservations`]
//!   connected peers that advertise the relay hop protocol, by listening on
//!   `<relay addr>/p2p/<relay>/p2p-circuit`. The relayed address is then reported as a
//!   [`crate::NetEvent::ListenAddr`] like any other listen address, so the daemon announces it.
//! - **DCUtR**: once two peers are connected through a relay, they try to hole-punch a direct
//!   connection; [`crate::Client::connections`] shows which connections are relayed.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use libp2p::core::transport::ListenerId;
use libp2p::core::ConnectedPoint;
use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};

/// Whether this daemon can be dialled from outside, as AutoNAT last found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reachability {
    /// Peers dialled us back on an address: we are publicly reachable.
    Public,
    /// Dial-backs failed: we are behind a NAT or firewall and need a relay to be reached.
    Private,
    /// Not known yet (no peer has probed us, or results disagree).
    Unknown,
}

impl std::fmt::Display for Reachability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Reachability::Public => "public",
            Reachability::Private => "private",
            Reachability::Unknown => "unknown",
        })
    }
}

/// How a connection reaches its peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionKind {
    /// A direct connection (dialled, accepted or hole-punched).
    Direct,
    /// A circuit through a relay (its address contains `/p2p-circuit`). Relays bound how
    /// long such a circuit lives and how many bytes it carries ([`RelayLimits`]); it is the
    /// way in until DCUtR punches a direct connection.
    Relayed,
}

/// One open connection, as [`crate::Client::connections`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionInfo {
    /// The peer.
    pub peer: PeerId,
    /// Direct or relayed.
    pub kind: ConnectionKind,
    /// The peer's address on this connection (for a relayed connection we accepted this is
    /// only `/p2p/<peer>`: the relay does not tell where the peer is).
    pub remote_addr: Multiaddr,
    /// Whether we dialled it (false: the peer dialled us).
    pub outbound: bool,
}

impl ConnectionInfo {
    pub(crate) fn new(peer: PeerId, endpoint: &ConnectedPoint) -> Self {
        Self {
            peer,
            kind: if endpoint.is_relayed() {
                ConnectionKind::Relayed
            } else {
                ConnectionKind::Direct
            },
            remote_addr: endpoint.get_remote_address().clone(),
            outbound: endpoint.is_dialer(),
        }
    }
}

/// Limits of the relay service this daemon offers others (circuit relay v2 server).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayLimits {
    /// Reservations held at once, all peers together.
    pub max_reservations: usize,
    /// Reservations one peer may hold at once.
    pub max_reservations_per_peer: usize,
    /// How long a reservation lasts before the peer must renew it.
    pub reservation_duration: Duration,
    /// Circuits relayed at once, all peers together.
    pub max_circuits: usize,
    /// Circuits at once with one peer at either end.
    pub max_circuits_per_peer: usize,
    /// How long one circuit may live.
    pub max_circuit_duration: Duration,
    /// Bytes one circuit may carry (both directions), after which the relay closes it.
    pub max_circuit_bytes: u64,
}

impl Default for RelayLimits {
    /// 64 reservations (2 per peer) of an hour; 16 circuits (4 per peer), each at most
    /// 10 minutes and 16 MiB: enough for gossip, the DHT and the hole punch, and for a few
    /// stage hops while a hole punch fails; not enough to make a volunteer's uplink a free
    /// proxy. libp2p's own per-peer and per-IP rate limits on new reservations and circuits
    /// apply on top.
    fn default() -> Self {
        Self {
            max_reservations: 64,
            max_reservations_per_peer: 2,
            reservation_duration: Duration::from_secs(60 * 60),
            max_circuits: 16,
            max_circuits_per_peer: 4,
            max_circuit_duration: Duration::from_secs(10 * 60),
            max_circuit_bytes: 16 << 20,
        }
    }
}

impl RelayLimits {
    pub(crate) fn to_config(&self) -> libp2p::relay::Config {
        libp2p::relay::Config {
            max_reservations: self.max_reservations,
            max_reservations_per_peer: self.max_reservations_per_peer,
            reservation_duration: self.reservation_duration,
            max_circuits: self.max_circuits,
            max_circuits_per_peer: self.max_circuits_per_peer,
            max_circuit_duration: self.max_circuit_duration,
            max_circuit_bytes: self.max_circuit_bytes,
            // libp2p's default rate limiters (per peer and per IP).
            ..libp2p::relay::Config::default()
        }
    }
}

/// NAT traversal settings. `NatConfig::default()` is what a daemon on the internet wants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatConfig {
    /// The reachability the operator knows, whatever AutoNAT finds (`None`, the default: let
    /// AutoNAT find out). `Private`: reserve relay slots as soon as a relay is connected (for a
    /// daemon behind a NAT, and for tests on loopback, where every dial-back succeeds).
    /// `Public`: every listen address is an external address at once, and the relay service
    /// (if on) starts without waiting for AutoNAT's probes. `Unknown` is taken as `None`.
    pub reachability: Option<Reachability>,
    /// AutoNAT only trusts, and only serves, peers at global IP addresses (true, the default,
    /// on the internet). Set false in a private network or test namespaces (10.x, 192.168.x,
    /// 127.x), where otherwise no probe ever runs and reachability stays unknown.
    pub autonat_only_global_ips: bool,
    /// Delay before the first AutoNAT probe (default 15 s; the peers must be connected and
    /// identified first).
    pub autonat_boot_delay: Duration,
    /// Delay between probes while reachability is uncertain (default 90 s).
    pub autonat_retry_interval: Duration,
    /// Delay between probes once reachability is certain (default 15 min).
    pub autonat_refresh_interval: Duration,
    /// Relays this daemon reserves a slot on at most, when private (default 2: one can fail).
    pub max_reservations: usize,
    /// Limits of the relay service offered to others (when `NetConfig::relay_service`).
    pub relay_limits: RelayLimits,
}

impl Default for NatConfig {
    fn default() -> Self {
        Self {
            reachability: None,
            autonat_only_global_ips: true,
            autonat_boot_delay: Duration::from_secs(15),
            autonat_retry_interval: Duration::from_secs(90),
            autonat_refresh_interval: Duration::from_secs(15 * 60),
            max_reservations: 2,
            relay_limits: RelayLimits::default(),
        }
    }
}

impl NatConfig {
    pub(crate) fn autonat_config(&self) -> libp2p::autonat::v1::Config {
        libp2p::autonat::v1::Config {
            boot_delay: self.autonat_boot_delay,
            retry_interval: self.autonat_retry_interval,
            refresh_interval: self.autonat_refresh_interval,
            only_global_ips: self.autonat_only_global_ips,
            ..libp2p::autonat::v1::Config::default()
        }
    }
}

/// Relays remembered at most (peers that advertise the hop protocol).
const MAX_RELAY_CANDIDATES: usize = 64;
/// A relay that refused us or failed is not asked again for this long.
const RETRY_RELAY_AFTER: Duration = Duration::from_secs(5 * 60);

/// The relay client's bookkeeping: which connected peers can relay, where we hold or asked
/// for a reservation, and which relays failed recently. Everything is bounded.
#[derive(Debug, Default)]
pub(crate) struct Reservations {
    /// Relays we could reserve on, with an address to reach each (no `/p2p` at the end).
    candidates: HashMap<PeerId, Multiaddr>,
    /// Our listeners on relays (pending or accepted), at most `max` of them.
    active: HashMap<ListenerId, PeerId>,
    /// Relays that failed, and when.
    failed: HashMap<PeerId, Instant>,
}

impl Reservations {
    /// A connected peer advertises (or no longer advertises) the hop protocol.
    pub(crate) fn learn(&mut self, relay: PeerId, addr: Option<Multiaddr>, is_relay: bool) {
        match (is_relay, addr) {
            (true, Some(addr)) => {
                if self.candidates.len() >= MAX_RELAY_CANDIDATES
                    && !self.candidates.contains_key(&relay)
                {
                    return;
                }
                self.candidates.insert(relay, addr);
            }
            _ => {
                self.candidates.remove(&relay);
            }
        }
    }

    /// The last connection to a peer closed.
    pub(crate) fn forget(&mut self, peer: &PeerId) {
        self.candidates.remove(peer);
    }

    /// Relay addresses to listen on now, to reach `max` reservations.
    pub(crate) fn wanted(&mut self, max: usize, now: Instant) -> Vec<(PeerId, Multiaddr)> {
        self.failed
            .retain(|_, at| now.saturating_duration_since(*at) < RETRY_RELAY_AFTER);
        let mut want = Vec::new();
        let mut free = max.saturating_sub(self.active.len());
        let mut candidates: Vec<_> = self.candidates.iter().collect();
        // Stable choice: the same relays every time, in peer id order.
        candidates.sort_by_key(|(p, _)| p.to_bytes());
        for (relay, addr) in candidates {
            if free == 0 {
                break;
            }
            if self.failed.contains_key(relay) || self.active.values().any(|r| r == relay) {
                continue;
            }
            want.push((
                *relay,
                addr.clone()
                    .with(Protocol::P2p(*relay))
                    .with(Protocol::P2pCircuit),
            ));
            free -= 1;
        }
        want
    }

    /// We listen on a relay (the reservation is pending until the relay accepts).
    pub(crate) fn listening(&mut self, listener: ListenerId, relay: PeerId) {
        self.active.insert(listener, relay);
    }

    /// A listen attempt on a relay could not even start.
    pub(crate) fn refused(&mut self, relay: PeerId, now: Instant) {
        self.failed.insert(relay, now);
        self.bound_failed();
    }

    /// A listener closed; returns the relay if it was one of ours. A failed one is not asked
    /// again for a while.
    pub(crate) fn closed(
        &mut self,
        listener: ListenerId,
        ok: bool,
        now: Instant,
    ) -> Option<PeerId> {
        let relay = self.active.remove(&listener)?;
        if !ok {
            self.failed.insert(relay, now);
            self.bound_failed();
        }
        Some(relay)
    }

    /// Every listener on a relay (to close them all once we are public).
    pub(crate) fn listeners(&self) -> Vec<ListenerId> {
        self.active.keys().copied().collect()
    }

    /// Whether this listener is one of ours on a relay.
    pub(crate) fn is_relay_listener(&self, listener: &ListenerId) -> bool {
        self.active.contains_key(listener)
    }

    fn bound_failed(&mut self) {
        if self.failed.len() > MAX_RELAY_CANDIDATES {
            self.failed.clear();
        }
    }
}

/// The address without a trailing `/p2p/<peer>`.
pub(crate) fn without_peer(mut addr: Multiaddr) -> Multiaddr {
    if matches!(addr.iter().last(), Some(Protocol::P2p(_))) {
        addr.pop();
    }
    addr
}

/// Whether the address goes through a relay.
pub(crate) fn is_relayed(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| matches!(p, Protocol::P2pCircuit))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> Multiaddr {
        s.parse().unwrap()
    }

    #[test]
    fn reservations_stay_within_the_maximum_and_retry_failed_relays_later() {
        let mut r = Reservations::default();
        let now = Instant::now();
        let relays: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
        for p in &relays {
            r.learn(*p, Some(addr("/ip4/10.0.0.1/tcp/4001")), true);
        }
        let want = r.wanted(2, now);
        assert_eq!(want.len(), 2);
        assert!(want[0].1.to_string().ends_with("/p2p-circuit"));
        let a = ListenerId::next();
        let b = ListenerId::next();
        r.listening(a, want[0].0);
        r.listening(b, want[1].0);
        assert!(r.wanted(2, now).is_empty());
        // One fails: the third relay is asked, not the failed one.
        let failed = r.closed(a, false, now).unwrap();
        let again = r.wanted(2, now);
        assert_eq!(again.len(), 1);
        assert_ne!(again[0].0, failed);
        // Later the failed one may be asked again.
        r.forget(&again[0].0);
        let later = r.wanted(2, now + RETRY_RELAY_AFTER + Duration::from_secs(1));
        assert_eq!(later.len(), 1);
        assert_eq!(later[0].0, failed);
        // A peer that stops advertising the hop protocol is no candidate.
        r.learn(failed, None, false);
        assert!(r
            .wanted(3, now + RETRY_RELAY_AFTER * 2)
            .iter()
            .all(|(p, _)| *p != failed));
    }

    #[test]
    fn candidates_are_bounded() {
        let mut r = Reservations::default();
        for _ in 0..MAX_RELAY_CANDIDATES * 2 {
            r.learn(PeerId::random(), Some(addr("/ip4/10.0.0.1/tcp/1")), true);
        }
        assert_eq!(r.candidates.len(), MAX_RELAY_CANDIDATES);
    }

    #[test]
    fn addresses_lose_their_peer_id() {
        let p = PeerId::random();
        let a = addr("/ip4/1.2.3.4/tcp/1/p2p-circuit").with(Protocol::P2p(p));
        assert_eq!(
            without_peer(a.clone()),
            addr("/ip4/1.2.3.4/tcp/1/p2p-circuit")
        );
        assert!(is_relayed(&a));
        assert!(!is_relayed(&addr("/ip4/1.2.3.4/tcp/1")));
    }
}
