//! The one network behaviour: every protocol a daemon speaks, side by side, behind the
//! connection limits.

use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::NetworkBehaviour;
use libp2p::{
    autonat, connection_limits, dcutr, gossipsub, identify, kad, mdns, ping, relay,
    request_response,
};

use crate::codec::FrameCodec;
use dc_types::{StageRequest, StageResponse};

/// Protocol name of stage work (hops and cache ends).
pub(crate) const STAGE_PROTOCOL: &str = "/daisychain/stage/1";
/// Protocol name of generation token streams.
pub const GENERATION_PROTOCOL: &str = "/daisychain/generation/1";
/// Kademlia protocol name (our own DHT, not the public IPFS one).
pub(crate) const KAD_PROTOCOL: &str = "/daisychain/kad/1";
/// identify's protocol version string: peers with another are not ours.
pub(crate) const IDENTIFY_VERSION: &str = "/daisychain/1";

#[derive(NetworkBehaviour)]
pub(crate) struct Behaviour {
    /// First, so that a connection over the limits is refused before any protocol sees it.
    pub limits: connection_limits::Behaviour,
    pub identify: identify::Behaviour,
    pub ping: ping::Behaviour,
    pub kad: kad::Behaviour<kad::store::MemoryStore>,
    pub gossipsub: gossipsub::Behaviour,
    pub mdns: Toggle<mdns::tokio::Behaviour>,
    pub stage: request_response::Behaviour<FrameCodec<StageRequest, StageResponse>>,
    pub streams: libp2p_stream::Behaviour,
    /// Learns whether we are publicly reachable, and answers others' probes.
    pub autonat: autonat::v1::Behaviour,
    /// Relays for others (circuit relay v2 server), unless `NetConfig::relay_service` is off.
    pub relay: Toggle<relay::Behaviour>,
    /// Reserves slots on relays and dials through them (circuit relay v2 client).
    pub relay_client: relay::client::Behaviour,
    /// Upgrades relayed connections to direct ones by hole punching.
    pub dcutr: dcutr::Behaviour,
}
