//! Typed, capped, time-limited frames over raw libp2p streams (used for generation token
//! streams, which outlive a single request/response).

use std::time::Duration;

use futures::{AsyncRead, AsyncWrite};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::client::NetError;
use crate::codec::{read_frame, write_frame};

/// Sends one message.
pub async fn send<T: Serialize, S: AsyncWrite + Unpin>(
    stream: &mut S,
    msg: &T,
    max: usize,
    timeout: Duration,
) -> Result<(), NetError> {
    let bytes = dc_types::encode(msg, max).map_err(|e| NetError::Protocol(e.to_string()))?;
    tokio::time::timeout(timeout, write_frame(stream, &bytes))
        .await
        .map_err(|_| NetError::Timeout)?
        .map_err(|e| NetError::Io(e.to_string()))
}

/// Receives one message of at most `max` bytes within `timeout`.
pub async fn recv<T: DeserializeOwned, S: AsyncRead + Unpin>(
    stream: &mut S,
    max: usize,
    timeout: Duration,
) -> Result<T, NetError> {
    let bytes = tokio::time::timeout(timeout, read_frame(stream, max))
        .await
        .map_err(|_| NetError::Timeout)?
        .map_err(|e| NetError::Io(e.to_string()))?;
    dc_types::decode(&bytes, max).map_err(|e| NetError::Protocol(e.to_string()))
}
