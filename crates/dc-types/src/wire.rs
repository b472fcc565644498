//! The binary encoding of every message: bincode (standard configuration) with a hard size
//! limit, so a hostile peer can never make us allocate more than the cap.

use serde::de::DeserializeOwned;
use serde::Serialize;
use thiserror::Error;

/// Why a message could not be encoded or decoded.
#[derive(Debug, Error)]
pub enum WireError {
    /// The message is larger than the cap.
    #[error("message of {size} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The bytes are not a valid message.
    #[error("malformed message: {0}")]
    Malformed(String),
}

/// Encodes a message, refusing results larger than `limit` bytes.
pub fn encode<T: Serialize>(msg: &T, limit: usize) -> Result<Vec<u8>, WireError> {
    let bytes = bincode::serde::encode_to_vec(msg, bincode::config::standard())
        .map_err(|e| WireError::Malformed(e.to_string()))?;
    if bytes.len() > limit {
        return Err(WireError::TooLarge {
            size: bytes.len(),
            limit,
        });
    }
    Ok(bytes)
}

/// Decodes a message of at most `limit` bytes; trailing bytes are an error.
pub fn decode<T: DeserializeOwned>(bytes: &[u8], limit: usize) -> Result<T, WireError> {
    if bytes.len() > limit {
        return Err(WireError::TooLarge {
            size: bytes.len(),
            limit,
        });
    }
    // The decoder's own limit bounds every allocation it makes (vector lengths are checked
    // against the remaining budget, not trusted).
    let config = bincode::config::standard().with_limit::<{ 1 << 30 }>();
    let (msg, used) = bincode::serde::decode_from_slice(bytes, config)
        .map_err(|e| WireError::Malformed(e.to_string()))?;
    if used != bytes.len() {
        return Err(WireError::Malformed(format!(
            "{} trailing bytes after the message",
            bytes.len() - used
        )));
    }
    Ok(msg)
}
