//! The transport stack, built by hand so that a private swarm's `pnet` handshake sits under
//! noise on every path a connection can take:
//!
//! - TCP: `tcp → [pnet] → noise → yamux`;
//! - circuit relay v2 (a connection relayed by a third peer): `circuit → [pnet] → noise → yamux`
//!   (the hops to and from the relay are TCP connections, so they carry the key too);
//! - QUIC (`quic-v1`), only in an open swarm: pnet cannot wrap QUIC, whose encryption is its own.

use futures::future::Either;
use futures::{AsyncRead, AsyncWrite};
use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::{Boxed, Transport};
use libp2p::core::upgrade::Version;
use libp2p::identity::Keypair;
use libp2p::pnet::PnetConfig;
use libp2p::{noise, quic, relay, tcp, yamux, PeerId};

use crate::swarm_key::SwarmKey;

/// Every transport a daemon uses, secured and multiplexed.
pub(crate) type DcTransport = Boxed<(PeerId, StreamMuxerBox)>;

/// Noise and yamux over any byte stream.
fn secure<T>(transport: T, keypair: &Keypair) -> Result<DcTransport, noise::Error>
where
    T: Transport + Send + Unpin + 'static,
    T::Output: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    T::Error: Send + Sync + 'static,
    T::Dial: Send + 'static,
    T::ListenerUpgrade: Send + 'static,
{
    Ok(transport
        .upgrade(Version::V1Lazy)
        .authenticate(noise::Config::new(keypair)?)
        .multiplex(yamux::Config::default())
        .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer)))
        .boxed())
}

/// `pnet` (when the swarm is private), then noise and yamux.
fn private_or_open<T>(
    transport: T,
    keypair: &Keypair,
    key: Option<SwarmKey>,
) -> Result<DcTransport, noise::Error>
where
    T: Transport + Send + Unpin + 'static,
    T::Output: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    T::Error: Send + Sync + 'static,
    T::Dial: Send + 'static,
    T::ListenerUpgrade: Send + 'static,
{
    match key {
        Some(key) => {
            let psk = key.to_psk();
            secure(
                transport.and_then(move |socket, _| PnetConfig::new(psk).handshake(socket)),
                keypair,
            )
        }
        None => secure(transport, keypair),
    }
}

/// The whole stack: relayed circuits, TCP, and QUIC when the swarm is open.
pub(crate) fn build(
    keypair: &Keypair,
    key: Option<SwarmKey>,
    relay: relay::client::Transport,
) -> Result<DcTransport, noise::Error> {
    let tcp = tcp::tokio::Transport::new(tcp::Config::default().nodelay(true));
    let relayed = private_or_open(relay, keypair, key)?;
    let tcp = private_or_open(tcp, keypair, key)?;
    let stack = relayed
        .or_transport(tcp)
        .map(|either, _| either.into_inner());
    if key.is_some() {
        return Ok(stack.boxed());
    }
    let quic = quic::tokio::Transport::new(quic::Config::new(keypair))
        .map(|(peer, conn), _| (peer, StreamMuxerBox::new(conn)));
    Ok(stack
        .or_transport(quic)
        .map(|either, _| match either {
            Either::Left(out) => out,
            Either::Right(out) => out,
        })
        .boxed())
}
