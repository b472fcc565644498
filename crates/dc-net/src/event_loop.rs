//! The event loop: the one owner of the libp2p swarm. It turns swarm events into
//! [`NetEvent`]s for the daemon and the daemon's [`Command`]s into swarm calls, and keeps the
//! pending outbound requests keyed by request id. No heavy work ever runs here.

use std::collections::HashMap;
use std::time::Duration;

use dc_types::{StageRequest, StageResponse};
use futures::StreamExt;
use libp2p::identity::Keypair;
use libp2p::request_response::{self, OutboundRequestId, ProtocolSupport, ResponseChannel};
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::SwarmEvent;
use libp2p::{
    gossipsub, identify, kad, mdns, noise, ping, tcp, yamux, Multiaddr, PeerId, StreamProtocol,
    Swarm,
};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use crate::behaviour::{Behaviour, BehaviourEvent, IDENTIFY_VERSION, KAD_PROTOCOL, STAGE_PROTOCOL};
use crate::client::{Client, Command, NetError};
use crate::codec::FrameCodec;

/// How the network is set up.
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
}

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
    /// We listen on a new address.
    ListenAddr(Multiaddr),
}

/// The loop that owns the swarm.
pub struct EventLoop {
    swarm: Swarm<Behaviour>,
    commands: mpsc::Receiver<Command>,
    events: mpsc::Sender<NetEvent>,
    pending: HashMap<OutboundRequestId, oneshot::Sender<Result<StageResponse, NetError>>>,
    topic: gossipsub::IdentTopic,
    bootstrap: Vec<Multiaddr>,
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

/// Builds the swarm and starts listening. Returns the handle, the event stream and the loop
/// (spawn [`EventLoop::run`]).
pub fn start(cfg: NetConfig) -> Result<(Client, mpsc::Receiver<NetEvent>, EventLoop), String> {
    let local = cfg.keypair.public().to_peer_id();
    let streams = libp2p_stream::Behaviour::new();
    let control = streams.new_control();
    let mut streams_slot = Some(streams);
    let swarm_cfg = cfg.clone();
    let mut swarm = libp2p::SwarmBuilder::with_existing_identity(cfg.keypair.clone())
        .with_tokio()
        .with_tcp(
            tcp::Config::default().nodelay(true),
            noise::Config::new,
            yamux::Config::default,
        )
        .map_err(|e| format!("TCP transport: {e}"))?
        .with_quic()
        .with_behaviour(|key| {
            let gossip_cfg = gossipsub::ConfigBuilder::default()
                .heartbeat_interval(Duration::from_millis(500))
                .validation_mode(gossipsub::ValidationMode::Strict)
                .max_transmit_size(swarm_cfg.max_gossip_bytes)
                .build()
                .map_err(|e| format!("gossipsub config: {e}"))?;
            let gossipsub = gossipsub::Behaviour::new(
                gossipsub::MessageAuthenticity::Signed(key.clone()),
                gossip_cfg,
            )
            .map_err(|e| format!("gossipsub: {e}"))?;
            let mut kad_cfg = kad::Config::new(StreamProtocol::new(KAD_PROTOCOL));
            kad_cfg.set_query_timeout(Duration::from_secs(30));
            let mut kad =
                kad::Behaviour::with_config(local, kad::store::MemoryStore::new(local), kad_cfg);
            kad.set_mode(Some(kad::Mode::Server));
            let mdns = if swarm_cfg.mdns {
                Some(
                    mdns::tokio::Behaviour::new(mdns::Config::default(), local)
                        .map_err(|e| format!("mDNS: {e}"))?,
                )
            } else {
                None
            };
            let stage = request_response::Behaviour::with_codec(
                FrameCodec::new(swarm_cfg.max_request_bytes, swarm_cfg.max_response_bytes),
                [(StreamProtocol::new(STAGE_PROTOCOL), ProtocolSupport::Full)],
                request_response::Config::default()
                    .with_request_timeout(swarm_cfg.request_timeout)
                    .with_max_concurrent_streams(64),
            );
            Ok(Behaviour {
                identify: identify::Behaviour::new(
                    identify::Config::new(IDENTIFY_VERSION.into(), key.public())
                        .with_agent_version(swarm_cfg.agent.clone()),
                ),
                ping: ping::Behaviour::default(),
                kad,
                gossipsub,
                mdns: Toggle::from(mdns),
                stage,
                streams: streams_slot.take().expect("the behaviour is built once"),
            })
        })
        .map_err(|e| format!("network behaviour: {e}"))?
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(300)))
        .build();
    let topic = gossipsub::IdentTopic::new(cfg.topic.clone());
    swarm
        .behaviour_mut()
        .gossipsub
        .subscribe(&topic)
        .map_err(|e| format!("subscribing to {}: {e}", cfg.topic))?;
    for addr in &cfg.listen {
        swarm
            .listen_on(addr.clone())
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
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
    };
    Ok((client, ev_rx, ev))
}

impl EventLoop {
    /// Runs until every [`Client`] is dropped.
    pub async fn run(mut self) {
        for addr in std::mem::take(&mut self.bootstrap) {
            if let Err(e) = self.swarm.dial(addr.clone()) {
                warn!("cannot dial bootstrap peer {addr}: {e}");
            }
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
                }
            }
        }
        debug!("network event loop stopped");
    }

    async fn emit(&mut self, e: NetEvent) {
        // A closed receiver means the daemon is shutting down; nothing to do.
        let _ = self.events.send(e).await;
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
                let _ = reply.send(self.swarm.listeners().cloned().collect());
            }
            Command::ConnectedPeers { reply } => {
                let _ = reply.send(self.swarm.connected_peers().copied().collect());
            }
        }
    }

    async fn on_swarm_event(&mut self, ev: SwarmEvent<BehaviourEvent>) {
        match ev {
            SwarmEvent::NewListenAddr { address, .. } => {
                info!("listening on {address}");
                self.emit(NetEvent::ListenAddr(address)).await;
            }
            SwarmEvent::ConnectionEstablished {
                peer_id,
                num_established,
                ..
            } if num_established.get() == 1 => {
                self.emit(NetEvent::Connected(peer_id)).await;
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                num_established: 0,
                ..
            } => {
                self.emit(NetEvent::Disconnected(peer_id)).await;
            }
            SwarmEvent::Behaviour(BehaviourEvent::Identify(identify::Event::Received {
                peer_id,
                info,
                ..
            })) => {
                if info.protocol_version != IDENTIFY_VERSION {
                    info!(
                        "ignoring peer {peer_id}: protocol {:?}, we speak {IDENTIFY_VERSION:?}",
                        info.protocol_version
                    );
                    let _ = self.swarm.disconnect_peer_id(peer_id);
                    return;
                }
                for addr in info.listen_addrs {
                    self.swarm.behaviour_mut().kad.add_address(&peer_id, addr);
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Mdns(mdns::Event::Discovered(list))) => {
                for (peer, addr) in list {
                    self.swarm
                        .behaviour_mut()
                        .kad
                        .add_address(&peer, addr.clone());
                    if !self.swarm.is_connected(&peer) {
                        let _ = self.swarm.dial(addr);
                    }
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(gossipsub::Event::Message {
                message,
                ..
            })) => {
                if let Some(from) = message.source {
                    self.emit(NetEvent::Gossip {
                        from,
                        data: message.data,
                    })
                    .await;
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Stage(request_response::Event::Message {
                peer,
                message,
                ..
            })) => match message {
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
            SwarmEvent::Behaviour(BehaviourEvent::Stage(
                request_response::Event::OutboundFailure {
                    peer,
                    request_id,
                    error,
                    ..
                },
            )) => {
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
            SwarmEvent::Behaviour(BehaviourEvent::Stage(
                request_response::Event::InboundFailure { peer, error, .. },
            )) => {
                warn!("refused a stage request from {peer}: {error}");
            }
            SwarmEvent::OutgoingConnectionError { peer_id, error, .. } => {
                debug!("connection to {peer_id:?} failed: {error}");
            }
            _ => {}
        }
    }
}
