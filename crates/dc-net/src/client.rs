//! The handle the rest of the daemon uses to talk to the network: cloneable, every call bounded
//! in time, every answer delivered through a oneshot.

use std::time::Duration;

use dc_types::{StageRequest, StageResponse};
use libp2p::request_response::ResponseChannel;
use libp2p::{Multiaddr, PeerId, StreamProtocol};
use thiserror::Error;
use tokio::sync::{mpsc, oneshot};

use crate::behaviour::GENERATION_PROTOCOL;
use crate::nat::{ConnectionInfo, Reachability};

/// What can go wrong talking to peers.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum NetError {
    /// The event loop has stopped.
    #[error("the network event loop has stopped")]
    Stopped,
    /// No answer in time.
    #[error("timed out")]
    Timeout,
    /// Could not reach the peer or the request failed on the way.
    #[error("request to {peer} failed: {reason}")]
    Request {
        /// The peer.
        peer: String,
        /// Why.
        reason: String,
    },
    /// A stream failed.
    #[error("stream: {0}")]
    Io(String),
    /// The peer sent something that is not our protocol.
    #[error("protocol violation: {0}")]
    Protocol(String),
}

/// Commands from the daemon to the event loop.
#[derive(Debug)]
pub(crate) enum Command {
    Publish {
        data: Vec<u8>,
    },
    SendStage {
        peer: PeerId,
        request: StageRequest,
        reply: oneshot::Sender<Result<StageResponse, NetError>>,
    },
    RespondStage {
        channel: ResponseChannel<StageResponse>,
        response: StageResponse,
    },
    Dial {
        addr: Multiaddr,
    },
    AddAddress {
        peer: PeerId,
        addr: Multiaddr,
    },
    ListenAddrs {
        reply: oneshot::Sender<Vec<Multiaddr>>,
    },
    ConnectedPeers {
        reply: oneshot::Sender<Vec<PeerId>>,
    },
    Connections {
        reply: oneshot::Sender<Vec<ConnectionInfo>>,
    },
    Reachability {
        reply: oneshot::Sender<Reachability>,
    },
}

/// A cloneable handle to the network.
#[derive(Clone)]
pub struct Client {
    pub(crate) sender: mpsc::Sender<Command>,
    pub(crate) streams: libp2p_stream::Control,
    pub(crate) local: PeerId,
    pub(crate) request_timeout: Duration,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Client({})", self.local)
    }
}

impl Client {
    /// This daemon's peer id.
    pub fn local_peer_id(&self) -> PeerId {
        self.local
    }

    async fn send(&self, c: Command) -> Result<(), NetError> {
        self.sender.send(c).await.map_err(|_| NetError::Stopped)
    }

    /// Gossips an announcement (already encoded).
    pub async fn publish(&self, data: Vec<u8>) -> Result<(), NetError> {
        self.send(Command::Publish { data }).await
    }

    /// Sends a stage request and waits for the answer (bounded by the protocol's timeout).
    pub async fn stage_request(
        &self,
        peer: PeerId,
        request: StageRequest,
    ) -> Result<StageResponse, NetError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::SendStage {
            peer,
            request,
            reply,
        })
        .await?;
        // The behaviour enforces its own timeout; this one only guards a lost reply.
        match tokio::time::timeout(self.request_timeout + Duration::from_secs(5), rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(NetError::Stopped),
            Err(_) => Err(NetError::Timeout),
        }
    }

    /// Answers a stage request received as a [`crate::NetEvent::StageRequest`].
    pub async fn respond_stage(
        &self,
        channel: ResponseChannel<StageResponse>,
        response: StageResponse,
    ) -> Result<(), NetError> {
        self.send(Command::RespondStage { channel, response }).await
    }

    /// Dials an address (a bootstrap peer).
    pub async fn dial(&self, addr: Multiaddr) -> Result<(), NetError> {
        self.send(Command::Dial { addr }).await
    }

    /// Tells the routing table where a peer can be reached.
    pub async fn add_address(&self, peer: PeerId, addr: Multiaddr) -> Result<(), NetError> {
        self.send(Command::AddAddress { peer, addr }).await
    }

    /// The addresses we listen on.
    pub async fn listen_addrs(&self) -> Result<Vec<Multiaddr>, NetError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::ListenAddrs { reply }).await?;
        rx.await.map_err(|_| NetError::Stopped)
    }

    /// Peers we are connected to.
    pub async fn connected_peers(&self) -> Result<Vec<PeerId>, NetError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::ConnectedPeers { reply }).await?;
        rx.await.map_err(|_| NetError::Stopped)
    }

    /// Every open connection: its peer, whether it is direct or relayed, its remote address
    /// and direction. A peer may have several (e.g. a relayed one and the direct one DCUtR
    /// punched next to it).
    pub async fn connections(&self) -> Result<Vec<ConnectionInfo>, NetError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Connections { reply }).await?;
        rx.await.map_err(|_| NetError::Stopped)
    }

    /// Whether this daemon is publicly reachable, as last found (the same value as the last
    /// [`crate::NetEvent::Reachability`]; `Unknown` before the first finding).
    pub async fn reachability(&self) -> Result<Reachability, NetError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Reachability { reply }).await?;
        rx.await.map_err(|_| NetError::Stopped)
    }

    /// Opens a generation stream to `peer`.
    pub async fn open_generation_stream(&self, peer: PeerId) -> Result<libp2p::Stream, NetError> {
        let mut c = self.streams.clone();
        let proto = StreamProtocol::new(GENERATION_PROTOCOL);
        match tokio::time::timeout(self.request_timeout, c.open_stream(peer, proto)).await {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(e)) => Err(NetError::Request {
                peer: peer.to_string(),
                reason: e.to_string(),
            }),
            Err(_) => Err(NetError::Timeout),
        }
    }

    /// Accepts incoming generation streams (call once).
    pub fn accept_generation_streams(&self) -> Result<libp2p_stream::IncomingStreams, NetError> {
        let mut c = self.streams.clone();
        c.accept(StreamProtocol::new(GENERATION_PROTOCOL))
            .map_err(|e| NetError::Protocol(e.to_string()))
    }
}
