//! Signing and checking [`dc_types::Signed`] messages with libp2p identity keys.

use dc_types::Signed;
use libp2p::identity::{Keypair, PublicKey};
use libp2p::PeerId;
use serde::Serialize;

/// Domain separation for signatures: a signature over one kind of message can never be
/// replayed as another.
const SIGNING_CONTEXT: &[u8] = b"DaisyChain signed message v1\0";

fn message(kind: &str, bytes: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(SIGNING_CONTEXT.len() + kind.len() + 1 + bytes.len());
    m.extend_from_slice(SIGNING_CONTEXT);
    m.extend_from_slice(kind.as_bytes());
    m.push(0);
    m.extend_from_slice(bytes);
    m
}

/// Signs `body` (its canonical bincode encoding) as a message of kind `kind`.
pub fn sign<T: Serialize>(key: &Keypair, kind: &str, body: T) -> Result<Signed<T>, String> {
    let bytes = dc_types::encode(&body, usize::MAX).map_err(|e| e.to_string())?;
    let signature = key
        .sign(&message(kind, &bytes))
        .map_err(|e| e.to_string())?;
    Ok(Signed {
        body,
        public_key: key.public().encode_protobuf(),
        signature,
    })
}

/// Checks a signed message of kind `kind`; returns the signer's peer id.
pub fn verify<T: Serialize>(kind: &str, signed: &Signed<T>) -> Result<PeerId, String> {
    let pk = PublicKey::try_decode_protobuf(&signed.public_key)
        .map_err(|e| format!("invalid public key: {e}"))?;
    let bytes = dc_types::encode(&signed.body, usize::MAX).map_err(|e| e.to_string())?;
    if pk.verify(&message(kind, &bytes), &signed.signature) {
        Ok(pk.to_peer_id())
    } else {
        Err("signature does not match".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_bind_body_kind_and_signer() {
        let k = Keypair::generate_ed25519();
        let s = sign(&k, "hop", (1u32, "x".to_string())).unwrap();
        assert_eq!(verify("hop", &s).unwrap(), k.public().to_peer_id());
        assert!(verify("proof", &s).is_err());
        let mut t = s.clone();
        t.body.0 = 2;
        assert!(verify("hop", &t).is_err());
        let other = Keypair::generate_ed25519();
        let mut u = s;
        u.public_key = other.public().encode_protobuf();
        assert!(verify("hop", &u).is_err());
    }
}
