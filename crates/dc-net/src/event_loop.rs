//! The event loop: the one owner of the libp2p swarm. It turns swarm events into
//! [`NetEvent`]s for the daemon and the daemon's [`Command`]s into swarm calls, and keeps the
//! pending outbound requests keyed by request id, the open connections, the reachability
//! AutoNAT found and the relay reservations ([`crate::nat`]). No heavy work ever runs here.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use dc_types::{StageRequest, StageResponse};
use futures::StreamExt;
use libp2p::connection_limits::{self, ConnectionLimits};
use libp2p::multiaddr::Protocol;
use libp2p::request_response::{self, OutboundRequestId, ProtocolSupport, ResponseChannel};
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::{ConnectionId, DialError, ListenError, SwarmEvent};
use libp2p::{
    autonat, dcutr, gossipsub, identify, kad, mdns, ping, relay, Multiaddr, PeerId, StreamProtocol,
    Swarm,
};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use crate::behaviour::{Behaviour, BehaviourEvent, IDENTIFY_VERSION, KAD_PROTOCOL, STAGE_PROTOCOL};
use crate::client::{Client, Command, NetError};
use crate::codec::FrameCodec;
pub use crate::config::{NetConfig, StartError};
use crate::nat::{self, ConnectionInfo, NatConfig, Reachability, Reservations};

/// What the network tells the daemon.
#[derive(Debug)]
pub enum NetEvent {
    /// A gossip message on our topic (the sender is authenticated by its signature).
    Gossip {
        /// The original publisher.
        from: PeerId,
        /// The message.
        data: Vec<u8>,
    },
    /// A peer asks for stage work; answer with [`Client::respond_stage`].
    StageRequest {
        /// The peer.
        from: PeerId,
        /// The request.
        request: StageRequest,
        /// Where the answer goes.
        channel: ResponseChannel<StageResponse>,
    },
    /// A connection to a peer opened.
    Connected(PeerId),
    /// The last connection to a peer closed.
    Disconnected(PeerId),
    /// We listen on a new address: one of ours, or a relayed one
    /// (`<relay addr>/p2p/<relay>/p2p-circuit`) once a relay accepted our reservation. Never
    /// ends with our own `/p2p/<peer id>`. Announce these.
    ListenAddr(Multiaddr),
    /// We no longer listen on an address (a relay reservation ended, an interface went away):
    /// stop announcing it.
    ListenAddrExpired(Multiaddr),
    /// AutoNAT's finding changed (or, with [`NatConfig::reachability`] set, that once at
    /// start).
    Reachability(Reachability),
}

/// The loop that owns the swarm.
pub struct EventLoop {
    swarm: Swarm<Behaviour>,
    commands: mpsc::Receiver<Command>,
    events: mpsc::Sender<NetEvent>,
    pending: HashMap<OutboundRequestId, oneshot::Sender<Result<StageResponse, NetError>>>,
    topic: gossipsub::IdentTopic,
    bootstrap: Vec<Multiaddr>,
    /// Open connections (bounded by the connection limits).
    connections: HashMap<ConnectionId, ConnectionInfo>,
    /// Whether this is a private swarm (TCP only, pnet).
    private_swarm: bool,
    nat: NatConfig,
    /// Whether we listen on an unspecified address (0.0.0.0 or ::): then the loopback
    /// addresses it yields are no address for other machines.
    listens_everywhere: bool,
    reachability: Reachability,
    reservations: Reservations,
    logged: LogOnce,
}

impl std::fmt::Debug for EventLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EventLoop({})", self.swarm.local_peer_id())
    }
}

/// Capacity of the command and event channels: enough for bursts, small enough that a stuck
/// consumer slows the producer down instead of growing memory.
const CHANNEL_CAPACITY: usize = 256;
/// Pending outbound stage requests at most.
const MAX_PENDING: usize = 1024;
/// Distinct once-logged messages remembered at most (then forgotten all at once).
const MAX_LOGGED: usize = 1024;

/// Remembers which messages were logged, so that a peer retrying forever is logged once.
#[derive(Debug, Default)]
struct LogOnce(HashSet<String>);

impl LogOnce {
    /// True the first time `key` is seen (and again after the set was full and cleared).
    fn first(&mut self, key: String) -> bool {
        if self.0.len() >= MAX_LOGGED {
            self.0.clear();
        }
        self.0.insert(key)
    }
}

/// The IP address of an address (what "once per remote" counts: ports change per attempt).
fn ip_of(addr: &Multiaddr) -> String {
    addr.iter()
        .find_map(|p| match p {
            Protocol::Ip4(ip) => Some(IpAddr::V4(ip).to_string()),
            Protocol::Ip6(ip) => Some(IpAddr::V6(ip).to_string()),
            Protocol::Dns(h) | Protocol::Dns4(h) | Protocol::Dns6(h) => Some(h.to_string()),
            _ => None,
        })
        .unwrap_or_else(|| addr.to_string())
}

/// Whether an address is on the loopback interface.
fn is_loopback(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| match p {
        Protocol::Ip4(ip) => ip.is_loopback(),
        Protocol::Ip6(ip) => ip.is_loopback(),
        _ => false,
    })
}

/// Whether a transport error is a failure to reach the address at all (refused, unreachable,
/// timed out) rather than a failed handshake once connected.
fn is_unreachable(e: &(dyn std::error::Error + 'static)) -> bool {
    use std::io::ErrorKind::*;
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    // Bounded: error chains are short, but a cycle must not hang the loop.
    for _ in 0..16 {
        let Some(err) = cur else { break };
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if matches!(
                io.kind(),
                ConnectionRefused
                    | TimedOut
                    | HostUnreachable
                    | NetworkUnreachable
                    | AddrNotAvailable
                    | AddrInUse
            ) {
                return true;
            }
            if let Some(inner) = io.get_ref() {
                cur = Some(inner as &(dyn std::error::Error + 'static));
                continue;
            }
        }
        cur = err.source();
    }
    false
}

/// Builds the swarm and starts listening. Returns the handle, the event stream and the loop
/// (spawn [`EventLoop::run`]).
pub fn start(cfg: NetConfig) -> Result<(Client, mpsc::Receiver<NetEvent>, EventLoop), StartError> {
    cfg.check()?;
    let local = cfg.keypair.public().to_peer_id();
    let streams = libp2p_stream::Behaviour::new();
    let control = streams.new_control();
    let (relay_transport, relay_client) = relay::client::new(local);
    let transport = crate::transport::build(&cfg.keypair, cfg.swarm_key, relay_transport)
        .map_err(|e| StartError::Transport(e.to_string()))?;
    let behaviour = build_behaviour(&cfg, local, streams, relay_client)?;
    let mut swarm = Swarm::new(
        transport,
        behaviour,
        local,
        libp2p::swarm::Config::with_tokio_executor()
            .with_idle_connection_timeout(Duration::from_secs(300)),
    );
    if let Some(relay) = swarm.behaviour_mut().relay.as_mut() {
        // Not automatic: a relayed address of our own must not make us offer relaying.
        relay.set_status(Some(relay::Status::Disable));
    }
    let topic = gossipsub::IdentTopic::new(cfg.topic.clone());
    swarm
        .behaviour_mut()
        .gossipsub
        .subscribe(&topic)
        .map_err(|e| StartError::Subscribe {
            topic: cfg.topic.clone(),
            reason: e.to_string(),
        })?;
    for addr in &cfg.listen {
        swarm
            .listen_on(addr.clone())
            .map_err(|e| StartError::Listen {
                addr: addr.clone(),
                reason: e.to_string(),
            })?;
    }
    if let Some(key) = &cfg.swarm_key {
        info!(
            "private swarm: key fingerprint {} (TCP only)",
            key.fingerprint()
        );
    }
    let (cmd_tx, cmd_rx) = mpsc::channel(CHANNEL_CAPACITY);
    let (ev_tx, ev_rx) = mpsc::channel(CHANNEL_CAPACITY);
    let client = Client {
        sender: cmd_tx,
        streams: control,
        local,
        request_timeout: cfg.request_timeout,
    };
    let ev = EventLoop {
        swarm,
        commands: cmd_rx,
        events: ev_tx,
        pending: HashMap::new(),
        topic,
        bootstrap: cfg.bootstrap,
        connections: HashMap::new(),
        private_swarm: cfg.swarm_key.is_some(),
        listens_everywhere: cfg.listen.iter().any(|a| {
            a.iter().any(|p| match p {
                Protocol::Ip4(ip) => ip.is_unspecified(),
                Protocol::Ip6(ip) => ip.is_unspecified(),
                _ => false,
            })
        }),
        reachability: cfg.nat.reachability.unwrap_or(Reachability::Unknown),
        nat: cfg.nat,
        reservations: Reservations::default(),
        logged: LogOnce::default(),
    };
    Ok((client, ev_rx, ev))
}

fn build_behaviour(
    cfg: &NetConfig,
    local: PeerId,
    streams: libp2p_stream::Behaviour,
    relay_client: relay::client::Behaviour,
) -> Result<Behaviour, StartError> {
    let key = &cfg.keypair;
    let gossip_cfg = gossipsub::ConfigBuilder::default()
        .heartbeat_interval(Duration::from_millis(500))
        .validation_mode(gossipsub::ValidationMode::Strict)
        .max_transmit_size(cfg.max_gossip_bytes)
        .build()
        .map_err(|e| StartError::Behaviour {
            protocol: "gossipsub config",
            reason: e.to_string(),
        })?;
    let gossipsub = gossipsub::Behaviour::new(
        gossipsub::MessageAuthenticity::Signed(key.clone()),
        gossip_cfg,
    )
    .map_err(|e| StartError::Behaviour {
        protocol: "gossipsub",
        reason: e.to_string(),
    })?;
    let mut kad_cfg = kad::Config::new(StreamProtocol::new(KAD_PROTOCOL));
    kad_cfg.set_query_timeout(Duration::from_secs(30));
    let mut kad = kad::Behaviour::with_config(local, kad::store::MemoryStore::new(local), kad_cfg);
    kad.set_mode(Some(kad::Mode::Server));
    let mdns = if cfg.mdns {
        Some(
            mdns::tokio::Behaviour::new(mdns::Config::default(), local).map_err(|e| {
                StartError::Behaviour {
                    protocol: "mDNS",
                    reason: e.to_string(),
                }
            })?,
        )
    } else {
        None
    };
    let stage = request_response::Behaviour::with_codec(
        FrameCodec::new(cfg.max_request_bytes, cfg.max_response_bytes),
        [(StreamProtocol::new(STAGE_PROTOCOL), ProtocolSupport::Full)],
        request_response::Config::default()
            .with_request_timeout(cfg.request_timeout)
            .with_max_concurrent_streams(64),
    );
    let limits = ConnectionLimits::default()
        .with_max_established(Some(cfg.max_connections))
        .with_max_established_per_peer(Some(cfg.max_connections_per_peer))
        .with_max_pending_incoming(Some(cfg.max_pending_incoming));
    let relay = cfg
        .relay_service
        .then(|| relay::Behaviour::new(local, cfg.nat.relay_limits.to_config()));
    Ok(Behaviour {
        limits: connection_limits::Behaviour::new(limits),
        identify: identify::Behaviour::new(
            identify::Config::new(IDENTIFY_VERSION.into(), key.public())
                .with_agent_version(cfg.agent.clone()),
        ),
        ping: ping::Behaviour::default(),
        kad,
        gossipsub,
        mdns: Toggle::from(mdns),
        stage,
        streams,
        autonat: autonat::v1::Behaviour::new(local, cfg.nat.autonat_config()),
        relay: Toggle::from(relay),
        relay_client,
        dcutr: dcutr::Behaviour::new(local),
    })
}

impl EventLoop {
    /// Runs until every [`Client`] is dropped.
    pub async fn run(mut self) {
        for addr in std::mem::take(&mut self.bootstrap) {
            if let Err(e) = self.swarm.dial(addr.clone()) {
                warn!("cannot dial bootstrap peer {addr}: {e}");
            }
        }
        match self.nat.reachability {
            Some(Reachability::Private) => {
                info!("taking this daemon as private (not reachable from outside): relays will be used");
                self.emit(NetEvent::Reachability(Reachability::Private))
                    .await;
            }
            Some(Reachability::Public) => {
                info!("taking this daemon as publicly reachable at its listen addresses");
                if let Some(relay) = self.swarm.behaviour_mut().relay.as_mut() {
                    relay.set_status(Some(relay::Status::Enable));
                }
                self.emit(NetEvent::Reachability(Reachability::Public))
                    .await;
            }
            _ => {}
        }
        let mut kad_tick = tokio::time::interval(Duration::from_secs(30));
        loop {
            tokio::select! {
                ev = self.swarm.select_next_some() => self.on_swarm_event(ev).await,
                cmd = self.commands.recv() => match cmd {
                    Some(c) => self.on_command(c),
                    None => break,
                },
                _ = kad_tick.tick() => {
                    // Refreshes the routing table; fails harmlessly while we know no one.
                    let _ = self.swarm.behaviour_mut().kad.bootstrap();
                    // Retries relays that failed a while ago.
                    self.reserve_relays();
                }
            }
        }
        debug!("network event loop stopped");
    }

    async fn emit(&mut self, e: NetEvent) {
        // A closed receiver means the daemon is shutting down; nothing to do.
        let _ = self.events.send(e).await;
    }

    /// An address as the daemon sees it: without our own `/p2p/<id>` at the end.
    fn ours(&self, addr: Multiaddr) -> Multiaddr {
        match addr.iter().last() {
            Some(Protocol::P2p(p)) if p == *self.swarm.local_peer_id() => nat::without_peer(addr),
            _ => addr,
        }
    }

    /// Whether an address can carry a connection in this swarm (a private swarm is TCP only).
    fn usable(&self, addr: &Multiaddr) -> bool {
        !self.private_swarm || !addr.iter().any(|p| matches!(p, Protocol::Udp(_)))
    }

    fn on_command(&mut self, c: Command) {
        let b = self.swarm.behaviour_mut();
        match c {
            Command::Publish { data } => {
                if let Err(e) = b.gossipsub.publish(self.topic.clone(), data) {
                    // No subscribed peer yet is normal at start.
                    debug!("gossip not published: {e}");
                }
            }
            Command::SendStage {
                peer,
                request,
                reply,
            } => {
                if self.pending.len() >= MAX_PENDING {
                    let _ = reply.send(Err(NetError::Request {
                        peer: peer.to_string(),
                        reason: "too many requests in flight".into(),
                    }));
                    return;
                }
                let id = b.stage.send_request(&peer, request);
                self.pending.insert(id, reply);
            }
            Command::RespondStage { channel, response } => {
                if b.stage.send_response(channel, response).is_err() {
                    debug!("stage response dropped: the requester is gone");
                }
            }
            Command::Dial { addr } => {
                if let Err(e) = self.swarm.dial(addr.clone()) {
                    warn!("cannot dial {addr}: {e}");
                }
            }
            Command::AddAddress { peer, addr } => {
                b.kad.add_address(&peer, addr);
            }
            Command::ListenAddrs { reply } => {
                let addrs = self
                    .swarm
                    .listeners()
                    .cloned()
                    .collect::<Vec<_>>()
                    .into_iter()
                    .map(|a| self.ours(a))
                    .collect();
                let _ = reply.send(addrs);
            }
            Command::ConnectedPeers { reply } => {
                let _ = reply.send(self.swarm.connected_peers().copied().collect());
            }
            Command::Connections { reply } => {
                let _ = reply.send(self.connections.values().cloned().collect());
            }
            Command::Reachability { reply } => {
                let _ = reply.send(self.reachability);
            }
        }
    }

    /// Whether the operator fixed our reachability (AutoNAT's findings are then ignored).
    fn assumed(&self) -> bool {
        matches!(
            self.nat.reachability,
            Some(Reachability::Private | Reachability::Public)
        )
    }

    /// Reserves slots on relays while private, up to [`NatConfig::max_reservations`].
    fn reserve_relays(&mut self) {
        if self.reachability != Reachability::Private {
            return;
        }
        for (relay, addr) in self
            .reservations
            .wanted(self.nat.max_reservations, Instant::now())
        {
            match self.swarm.listen_on(addr.clone()) {
                Ok(id) => {
                    info!("asking relay {relay} for a reservation ({addr})");
                    self.reservations.listening(id, relay);
                }
                Err(e) => {
                    warn!("cannot listen through relay {addr}: {e}");
                    self.reservations.refused(relay, Instant::now());
                }
            }
        }
    }

    async fn on_reachability(&mut self, status: autonat::v1::NatStatus) {
        let found = match status {
            autonat::v1::NatStatus::Public(addr) => {
                info!("AutoNAT: publicly reachable at {addr}");
                Reachability::Public
            }
            autonat::v1::NatStatus::Private => {
                info!("AutoNAT: not reachable from outside (behind a NAT or firewall)");
                Reachability::Private
            }
            autonat::v1::NatStatus::Unknown => Reachability::Unknown,
        };
        if self.assumed() || found == self.reachability {
            return;
        }
        self.reachability = found;
        if let Some(relay) = self.swarm.behaviour_mut().relay.as_mut() {
            relay.set_status(Some(if found == Reachability::Public {
                relay::Status::Enable
            } else {
                relay::Status::Disable
            }));
        }
        if found == Reachability::Public {
            // Reachable directly: relayed addresses are no longer needed.
            for id in self.reservations.listeners() {
                self.swarm.remove_listener(id);
            }
        }
        self.emit(NetEvent::Reachability(found)).await;
        self.reserve_relays();
    }

    /// A peer's identify info: keep its addresses, and note whether it can relay for us.
    fn on_identify(&mut self, peer: PeerId, connection: ConnectionId, info: identify::Info) {
        let is_relay = info.protocols.contains(&relay::HOP_PROTOCOL_NAME);
        let conn = self.connections.get(&connection).cloned();
        let mut relay_addr = None;
        if let Some(c) = conn.filter(|c| c.kind == nat::ConnectionKind::Direct) {
            // An address we dialled reaches it; otherwise one it listens on.
            relay_addr = if c.outbound {
                Some(nat::without_peer(c.remote_addr))
            } else {
                info.listen_addrs
                    .iter()
                    .find(|a| !nat::is_relayed(a) && self.usable(a))
                    .cloned()
                    .map(nat::without_peer)
            };
            self.reservations.learn(peer, relay_addr.clone(), is_relay);
        }
        for addr in info.listen_addrs {
            if self.usable(&addr) {
                self.swarm.behaviour_mut().kad.add_address(&peer, addr);
            }
        }
        if is_relay && relay_addr.is_some() {
            self.reserve_relays();
        }
    }

    fn on_incoming_error(&mut self, from: &Multiaddr, error: &ListenError) {
        let ip = ip_of(from);
        match error {
            ListenError::Denied { cause } => {
                if self.logged.first(format!("denied:{ip}")) {
                    info!("refused a connection from {ip}: {cause} (logged once per address)");
                }
            }
            ListenError::Transport(e) if self.private_swarm => {
                if self.logged.first(format!("handshake-in:{ip}")) {
                    warn!(
                        "a connection from {ip} failed its handshake: it does not hold our \
                         swarm key, or holds another one ({e}; logged once per address)"
                    );
                }
            }
            e => debug!("incoming connection from {from} failed: {e}"),
        }
    }

    fn on_outgoing_error(&mut self, peer: Option<PeerId>, error: &DialError) {
        match error {
            DialError::Transport(errors) => {
                for (addr, e) in errors {
                    if self.private_swarm && !is_unreachable(e) {
                        if self.logged.first(format!("handshake-out:{}", ip_of(addr))) {
                            warn!(
                                "connecting to {addr} failed in the handshake: is it in our \
                                 private swarm, with the same swarm key? ({e}; logged once per \
                                 address)"
                            );
                        }
                    } else {
                        debug!("connection to {peer:?} at {addr} failed: {e}");
                    }
                }
            }
            DialError::Denied { cause } => {
                if self.logged.first(format!("denied-out:{peer:?}")) {
                    info!("not connecting to {peer:?}: {cause} (logged once per peer)");
                }
            }
            e => debug!("connection to {peer:?} failed: {e}"),
        }
    }

    async fn on_swarm_event(&mut self, ev: SwarmEvent<BehaviourEvent>) {
        match ev {
            SwarmEvent::NewListenAddr {
                listener_id,
                address,
            } => {
                let address = self.ours(address);
                if self.reservations.is_relay_listener(&listener_id) {
                    info!("reachable through a relay at {address}");
                } else {
                    info!("listening on {address}");
                    if self.nat.reachability == Some(Reachability::Public)
                        && !(self.listens_everywhere && is_loopback(&address))
                    {
                        // The relay service hands its external addresses to the peers it
                        // relays for: taken as public, our listen addresses are those (but
                        // not the loopback one of a wildcard listener: on another machine it
                        // names that machine).
                        self.swarm.add_external_address(address.clone());
                    }
                }
                self.emit(NetEvent::ListenAddr(address)).await;
            }
            SwarmEvent::ExpiredListenAddr { address, .. } => {
                let address = self.ours(address);
                info!("no longer listening on {address}");
                self.emit(NetEvent::ListenAddrExpired(address)).await;
            }
            SwarmEvent::ListenerClosed {
                listener_id,
                reason,
                addresses,
            } => {
                for address in addresses {
                    let address = self.ours(address);
                    self.emit(NetEvent::ListenAddrExpired(address)).await;
                }
                if let Some(relay) =
                    self.reservations
                        .closed(listener_id, reason.is_ok(), Instant::now())
                {
                    match reason {
                        Ok(()) => info!("reservation on relay {relay} ended"),
                        Err(e) => warn!("relay {relay} refused or dropped our reservation: {e}"),
                    }
                    self.reserve_relays();
                }
            }
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                endpoint,
                num_established,
                ..
            } => {
                self.connections
                    .insert(connection_id, ConnectionInfo::new(peer_id, &endpoint));
                if num_established.get() == 1 {
                    self.emit(NetEvent::Connected(peer_id)).await;
                }
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                connection_id,
                num_established,
                ..
            } => {
                self.connections.remove(&connection_id);
                if num_established == 0 {
                    self.reservations.forget(&peer_id);
                    self.emit(NetEvent::Disconnected(peer_id)).await;
                }
            }
            SwarmEvent::Behaviour(b) => self.on_behaviour(b).await,
            SwarmEvent::ExternalAddrConfirmed { address } => {
                info!("external address confirmed: {address}");
            }
            SwarmEvent::IncomingConnectionError {
                send_back_addr,
                error,
                ..
            } => self.on_incoming_error(&send_back_addr, &error),
            SwarmEvent::OutgoingConnectionError { peer_id, error, .. } => {
                self.on_outgoing_error(peer_id, &error)
            }
            _ => {}
        }
    }

    async fn on_behaviour(&mut self, ev: BehaviourEvent) {
        match ev {
            BehaviourEvent::Identify(identify::Event::Received {
                peer_id,
                connection_id,
                info,
            }) => {
                if info.protocol_version != IDENTIFY_VERSION {
                    info!(
                        "ignoring peer {peer_id}: protocol {:?}, we speak {IDENTIFY_VERSION:?}",
                        info.protocol_version
                    );
                    let _ = self.swarm.disconnect_peer_id(peer_id);
                    return;
                }
                self.on_identify(peer_id, connection_id, info);
            }
            BehaviourEvent::Mdns(mdns::Event::Discovered(list)) => {
                for (peer, addr) in list {
                    if !self.usable(&addr) {
                        continue;
                    }
                    self.swarm
                        .behaviour_mut()
                        .kad
                        .add_address(&peer, addr.clone());
                    if !self.swarm.is_connected(&peer) {
                        let _ = self.swarm.dial(addr);
                    }
                }
            }
            BehaviourEvent::Gossipsub(gossipsub::Event::Message { message, .. }) => {
                if let Some(from) = message.source {
                    self.emit(NetEvent::Gossip {
                        from,
                        data: message.data,
                    })
                    .await;
                }
            }
            BehaviourEvent::Stage(e) => self.on_stage(e).await,
            BehaviourEvent::Autonat(autonat::v1::Event::StatusChanged { new, .. }) => {
                self.on_reachability(new).await
            }
            BehaviourEvent::RelayClient(relay::client::Event::ReservationReqAccepted {
                relay_peer_id,
                renewal: false,
                ..
            }) => info!("relay {relay_peer_id} accepted our reservation"),
            BehaviourEvent::RelayClient(e) => debug!("relay client: {e:?}"),
            BehaviourEvent::Relay(e) => debug!("relay service: {e:?}"),
            BehaviourEvent::Dcutr(dcutr::Event {
                remote_peer_id,
                result,
            }) => match result {
                Ok(_) => info!("hole punched a direct connection to {remote_peer_id}"),
                Err(e) => {
                    if self.logged.first(format!("dcutr:{remote_peer_id}")) {
                        info!("no direct connection to {remote_peer_id}, staying relayed: {e}");
                    }
                }
            },
            _ => {}
        }
    }

    async fn on_stage(&mut self, ev: request_response::Event<StageRequest, StageResponse>) {
        match ev {
            request_response::Event::Message { peer, message, .. } => match message {
                request_response::Message::Request {
                    request, channel, ..
                } => {
                    self.emit(NetEvent::StageRequest {
                        from: peer,
                        request,
                        channel,
                    })
                    .await;
                }
                request_response::Message::Response {
                    request_id,
                    response,
                } => {
                    if let Some(reply) = self.pending.remove(&request_id) {
                        let _ = reply.send(Ok(response));
                    }
                }
            },
            request_response::Event::OutboundFailure {
                peer,
                request_id,
                error,
                ..
            } => {
                if let Some(reply) = self.pending.remove(&request_id) {
                    let _ = reply.send(Err(match error {
                        request_response::OutboundFailure::Timeout => NetError::Timeout,
                        e => NetError::Request {
                            peer: peer.to_string(),
                            reason: e.to_string(),
                        },
                    }));
                }
            }
            request_response::Event::InboundFailure { peer, error, .. } => {
                warn!("refused a stage request from {peer}: {error}");
            }
            _ => {}
        }
    }
}
