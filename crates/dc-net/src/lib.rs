//! The DaisyChain network layer on rust-libp2p: TCP + noise + yamux and QUIC, identify, ping,
//! Kademlia, gossipsub, optional mDNS, a request/response protocol for stage work with size
//! caps and timeouts, and raw streams for generation token streams. Optionally a private
//! swarm (a pre-shared key, libp2p `pnet`, TCP only); always connection limits; NAT traversal
//! with AutoNAT, circuit relay v2 (server and client) and DCUtR hole punching.
//!
//! One [`EventLoop`] owns the swarm; everything else talks to it through a cloneable
//! [`Client`] and receives [`NetEvent`]s on a bounded channel. This crate knows nothing of
//! models: it moves typed messages and checks signatures.

#![deny(missing_docs)]

mod behaviour;
pub mod client;
pub mod codec;
pub mod config;
pub mod event_loop;
pub mod frames;
pub mod identity;
pub mod nat;
pub mod signing;
pub mod swarm_key;
mod transport;

pub use client::{Client, NetError};
pub use config::StartError;
pub use event_loop::{start, EventLoop, NetConfig, NetEvent};
pub use libp2p::multiaddr::Protocol;
pub use libp2p::{Multiaddr, PeerId};
pub use nat::{ConnectionInfo, ConnectionKind, NatConfig, Reachability, RelayLimits};
pub use swarm_key::{KeyFormatError, SwarmKey, SwarmKeyError};
