//! The daemon's identity key, kept in the data directory (mode 0600) so a daemon keeps its
//! peer id across restarts.

use std::io::Write;
use std::path::Path;

use libp2p::identity::Keypair;

/// Loads the key at `path`, or creates a new Ed25519 key there.
pub fn load_or_create(path: &Path) -> Result<Keypair, String> {
    match std::fs::read(path) {
        Ok(bytes) => Keypair::from_protobuf_encoding(&bytes)
            .map_err(|e| format!("{}: not a valid identity key: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = Keypair::generate_ed25519();
            let bytes = key
                .to_protobuf_encoding()
                .map_err(|e| format!("encoding a new identity key: {e}"))?;
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            }
            let mut opts = std::fs::OpenOptions::new();
            opts.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
            let mut f = opts
                .open(path)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            f.write_all(&bytes)
                .and_then(|_| f.sync_all())
                .map_err(|e| format!("{}: {e}", path.display()))?;
            Ok(key)
        }
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_persists_with_private_permissions() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub").join("identity.key");
        let a = load_or_create(&p).unwrap();
        let b = load_or_create(&p).unwrap();
        assert_eq!(a.public().to_peer_id(), b.public().to_peer_id());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
        }
        std::fs::write(&p, b"junk").unwrap();
        assert!(load_or_create(&p)
            .unwrap_err()
            .contains("not a valid identity key"));
    }
}
