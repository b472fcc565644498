//! A model's identity: the hash of its manifest (see `manifest.rs`), which lists every file
//! and the hash of every piece as stored. Peers serve the same model exactly when they hold
//! the same bytes, and a daemon that knows only the id can check a manifest a peer sends.
//!
//! Making a manifest hashes every byte of the model once; the manifest is cached in the data
//! directory keyed by the files' paths, sizes and modification times, so a restart does not
//! redo it. A fetched model carries its manifest in its folder.

use std::path::Path;

use dc_kernels::{Commitment, Domain};

use crate::error::{ModelError, Result};
use crate::fetched::{fetched_folder, FetchedModel};
use crate::manifest::{Manifest, MANIFEST_VERSION};

/// A fingerprint of the files behind a model (paths, sizes, modification times): the cache key
/// of its manifest and of its quantised weights. A fetched model's is its id: its files change
/// as pieces arrive, but every piece is the one the id names.
pub fn source_fingerprint(path: &Path) -> Result<Commitment> {
    if let Some(dir) = fetched_folder(path) {
        let id = FetchedModel::open(&dir)?.id();
        return Ok(Domain::CacheKey.hash_parts(&[b"fetched model", &id.0]));
    }
    let mut files: Vec<std::path::PathBuf> = if path.is_dir() {
        std::fs::read_dir(path)
            .map_err(|e| ModelError::io(path, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                let name = p
                    .file_name()
                    .map(|n| n.to_string_lossy().to_string())
                    .unwrap_or_default();
                (name.starts_with("model") && name.ends_with(".safetensors"))
                    || name.ends_with(".json")
                    || name.ends_with(".jinja")
            })
            .collect()
    } else {
        vec![path.to_path_buf()]
    };
    files.sort();
    let mut h = Domain::CacheKey.hasher();
    for f in files {
        let canon = f.canonicalize().map_err(|e| ModelError::io(&f, e))?;
        let meta = std::fs::metadata(&f).map_err(|e| ModelError::io(&f, e))?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        h.update(canon.to_string_lossy().as_bytes());
        h.update(&meta.len().to_le_bytes());
        h.update(&mtime.to_le_bytes());
    }
    Ok(Commitment(*h.finalize().as_bytes()))
}

/// The manifest of the model at `path` as encoded, and its id (the model id): a fetched
/// model's own, else from the cache under `data_dir/manifests/`, else made and cached.
pub fn model_manifest(path: &Path, data_dir: &Path) -> Result<(Vec<u8>, Commitment)> {
    if let Some(dir) = fetched_folder(path) {
        let f = FetchedModel::open(&dir)?;
        return Ok((f.manifest_bytes().to_vec(), f.id()));
    }
    let key = source_fingerprint(path)?;
    let dir = data_dir.join("manifests");
    let file = dir.join(format!("{}-v{MANIFEST_VERSION}", key.to_hex()));
    if let Ok(bytes) = std::fs::read(&file) {
        if Manifest::decode(&bytes).is_ok() {
            let id = Manifest::id_of(&bytes);
            return Ok((bytes, id));
        }
    }
    let bytes = Manifest::of_model(path)?.encode()?;
    // The cache is an optimisation: failing to write it is not an error.
    if std::fs::create_dir_all(&dir).is_ok() {
        let _ = crate::fetched::write_atomically(&file, &bytes);
    }
    let id = Manifest::id_of(&bytes);
    Ok((bytes, id))
}

/// The model id of the model at `path` (see [`model_manifest`]).
pub fn cached_model_id(path: &Path, data_dir: &Path) -> Result<Commitment> {
    Ok(model_manifest(path, data_dir)?.1)
}
