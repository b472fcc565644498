//! A model's identity: blake3 over its configuration and every weight tensor as loaded (f32
//! values, tensors in name order), so peers can tell they serve the same model: two files give
//! the same id exactly when they load to the same configuration and the same values.
//!
//! Hashing reads every tensor once; the result is cached in the data directory keyed by the
//! files' size and modification time, so a restart does not redo it.

use std::path::Path;

use dc_kernels::{Commitment, Domain};
use rayon::prelude::*;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::source::TensorSource;

/// The model id of `cfg` and every tensor of `src`.
pub fn model_id(cfg: &ModelConfig, src: &dyn TensorSource) -> Result<Commitment> {
    let mut infos = src.tensors();
    infos.sort_by(|a, b| a.name.cmp(&b.name));
    let leaves: Vec<Result<Commitment>> = infos
        .par_iter()
        .map(|t| {
            let v = src.load_f32(&t.name)?;
            let mut h = Domain::Tensor.hasher();
            h.update(&(t.name.len() as u64).to_le_bytes());
            h.update(t.name.as_bytes());
            h.update(&(t.shape.len() as u64).to_le_bytes());
            for d in &t.shape {
                h.update(&(*d as u64).to_le_bytes());
            }
            let mut buf = Vec::with_capacity(v.len().min(1 << 16) * 4);
            for chunk in v.chunks(1 << 16) {
                buf.clear();
                for x in chunk {
                    buf.extend_from_slice(&x.to_le_bytes());
                }
                h.update(&buf);
            }
            Ok(Commitment(*h.finalize().as_bytes()))
        })
        .collect();
    let config = serde_json::to_vec(cfg).map_err(|e| ModelError::Config {
        key: "model id".into(),
        detail: e.to_string(),
    })?;
    let mut h = Domain::Model.hasher();
    h.update(&(config.len() as u64).to_le_bytes());
    h.update(&config);
    for l in leaves {
        h.update(&l?.0);
    }
    Ok(Commitment(*h.finalize().as_bytes()))
}

/// A fingerprint of the files behind a model (paths, sizes, modification times): the cache key
/// of its id and of its quantised weights.
pub fn source_fingerprint(path: &Path) -> Result<Commitment> {
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

/// The model id of the model at `path`, cached under `data_dir/model-ids/`.
pub fn cached_model_id(path: &Path, data_dir: &Path) -> Result<Commitment> {
    let key = source_fingerprint(path)?;
    let dir = data_dir.join("model-ids");
    let file = dir.join(key.to_hex());
    if let Ok(text) = std::fs::read_to_string(&file) {
        if let Some(c) = Commitment::from_hex(text.trim()) {
            return Ok(c);
        }
    }
    let (cfg, src) = crate::open::open_source(path)?;
    let id = model_id(&cfg, src.as_ref())?;
    // The cache is an optimisation: failing to write it is not an error.
    if std::fs::create_dir_all(&dir).is_ok() {
        let _ = std::fs::write(&file, id.to_hex());
    }
    Ok(id)
}
