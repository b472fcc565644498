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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is the failure report

    use super::*;
    use crate::messages::RevealedRow;
    use crate::trace::Point;
    use dc_kernels::Commitment;
    use serde::Deserialize;

    /// `RevealedRow` as it was before its encoding travelled as one block of bytes.
    #[derive(Serialize, Deserialize)]
    struct ByteByByte {
        point: Point,
        cols: u32,
        unit: Option<i32>,
        encoding: Vec<u8>,
        root: Commitment,
        path: Vec<Commitment>,
    }

    fn row() -> RevealedRow {
        RevealedRow {
            point: Point::Down,
            cols: 3,
            unit: Some(-3),
            encoding: (0..=255u8).cycle().take(1000).collect(),
            root: Commitment([7; 32]),
            path: vec![Commitment([1; 32]), Commitment([2; 32])],
        }
    }

    #[test]
    fn byte_blocks_are_the_bytes_a_byte_sequence_was() {
        let r = row();
        let old = ByteByByte {
            point: r.point,
            cols: r.cols,
            unit: r.unit,
            encoding: r.encoding.clone(),
            root: r.root,
            path: r.path.clone(),
        };
        let bytes = encode(&r, 1 << 20).unwrap();
        assert_eq!(bytes, encode(&old, 1 << 20).unwrap());
        assert_eq!(decode::<RevealedRow>(&bytes, 1 << 20).unwrap(), r);
        let back: ByteByByte = decode(&bytes, 1 << 20).unwrap();
        assert_eq!(back.encoding, r.encoding);
    }

    #[test]
    fn a_byte_block_longer_than_its_message_is_refused() {
        let mut bytes = encode(&row(), 1 << 20).unwrap();
        // The encoding's length (a varint after the point and cols): claim 2⁴⁰ bytes.
        let at = bytes
            .windows(3)
            .position(|w| w == [251, 0xe8, 0x03])
            .unwrap();
        let huge = [253u8, 0, 0, 0, 0, 0, 1, 0, 0];
        bytes.splice(at..at + 3, huge);
        let err = decode::<RevealedRow>(&bytes, 1 << 20).unwrap_err();
        assert!(matches!(err, WireError::Malformed(_)), "{err}");
        bytes.truncate(at + 200);
        assert!(decode::<RevealedRow>(&bytes, 1 << 20).is_err());
    }
}
