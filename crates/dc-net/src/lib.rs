//! The DaisyChain network layer on rust-libp2p: TCP + noise + yamux and QUIC, identify, ping,
//! Kademlia, gossipsub, optional mDNS, a request/response protocol for stage work with size
//! caps and timeouts, and raw streams for generation token streams.
//!
//! One [`EventLoop`] owns the swarm; everything else talks to it through a cloneable
//! [`Client`] and receives [`NetEvent`]s on a bounded channel. This crate knows nothing of
//! models: it moves typed messages and checks signatures.

#![deny(missing_docs)]

mod behaviour;
pub mod client;
pub mod codec;
pub mod event_loop;
pub mod frames;
pub mod identity;
pub mod signing;

pub use client::{Client, NetError};
pub use event_loop::{start, EventLoop, NetConfig, NetEvent};
pub use libp2p::{Multiaddr, PeerId};
