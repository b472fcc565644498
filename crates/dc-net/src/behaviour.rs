//! The one network behaviour: every protocol a daemon speaks, side by side.

use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::NetworkBehaviour;
use libp2p::{gossipsub, identify, kad, mdns, ping, request_response};

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
    pub identify: identify::Behaviour,
    pub ping: ping::Behaviour,
    pub kad: kad::Behaviour<kad::store::MemoryStore>,
    pub gossipsub: gossipsub::Behaviour,
    pub mdns: Toggle<mdns::tokio::Behaviour>,
    pub stage: request_response::Behaviour<FrameCodec<StageRequest, StageResponse>>,
    pub streams: libp2p_stream::Behaviour,
}
