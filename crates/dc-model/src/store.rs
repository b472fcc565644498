//! The local data directory: where installed models, quantised-weight caches and the daemon's
//! identity live. `DCD_DATA_DIR` overrides the platform default (the `directories` crate:
//! `~/.local/share/dcd` on Linux).

use std::path::{Path, PathBuf};

use crate::error::{ModelError, Result};

/// Environment variable that overrides the data directory.
pub const DATA_DIR_ENV: &str = "DCD_DATA_DIR";

/// The data directory: `$DCD_DATA_DIR`, else the platform's data directory for `dcd`.
pub fn data_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os(DATA_DIR_ENV).filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d));
    }
    directories::ProjectDirs::from("org", "DaisyChain", "dcd")
        .map(|p| p.data_dir().to_path_buf())
        .ok_or_else(|| ModelError::Config {
            key: DATA_DIR_ENV.into(),
            detail: "no home directory to put data in; set DCD_DATA_DIR".into(),
        })
}

/// Where installed models live: `<data dir>/models/<name>/`.
pub fn models_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("models")
}

/// Whether `name` is a plausible store name (no paths sneaking in).
pub fn is_store_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        && !name.starts_with('.')
}

/// Resolves a model argument: an existing path (HF folder or GGUF file) as is, else an
/// `org/name` in the local Hugging Face hub cache, else the name of a model installed in the
/// store. A store entry (and a cached snapshot) is a folder holding either an HF checkpoint or
/// exactly one `.gguf` file.
pub fn resolve_model(arg: &str, data_dir: &Path) -> Result<PathBuf> {
    resolve_model_in(arg, data_dir, hf_hub_cache().as_deref())
}

/// [`resolve_model`] with the Hugging Face hub cache at `hub`.
pub fn resolve_model_in(arg: &str, data_dir: &Path, hub: Option<&Path>) -> Result<PathBuf> {
    let p = PathBuf::from(arg);
    if p.is_dir() {
        // A folder given by path follows the store's rule too (a store entry copied elsewhere).
        return model_in_folder(arg, p);
    }
    if p.exists() {
        return Ok(p);
    }
    if let Some((org, name)) = arg.split_once('/') {
        if is_store_name(org) && is_store_name(name) {
            if let Some(snapshot) = hub
                .map(|h| hf_snapshot(h, org, name))
                .transpose()?
                .flatten()
            {
                return model_in_folder(arg, snapshot);
            }
            return Err(ModelError::Input(format!(
                "model {arg:?}: no such file or folder, and not in the Hugging Face cache{} \
                 (dcd never downloads from the hub: fetch it there with `hf download {arg}`)",
                hub.map(|h| format!(" at {}", h.display()))
                    .unwrap_or_default()
            )));
        }
    }
    if !is_store_name(arg) {
        return Err(ModelError::Input(format!(
            "model {arg:?}: no such file or folder"
        )));
    }
    let dir = models_dir(data_dir).join(arg);
    if !dir.is_dir() {
        return Err(ModelError::Input(format!(
            "model {arg:?}: not a path and not installed in {} (scripts/fetch-model.sh installs smollm2-135m)",
            models_dir(data_dir).display()
        )));
    }
    model_in_folder(arg, dir)
}

/// The Hugging Face hub cache: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
/// `~/.cache/huggingface/hub` (where `huggingface_hub` puts what it downloads).
pub fn hf_hub_cache() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("HF_HUB_CACHE")
        .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| {
            directories::BaseDirs::new().map(|b| b.home_dir().join(".cache/huggingface/hub"))
        })
}

/// The snapshot of `org/name` in the hub cache `hub`: the one `refs/main` names, else the only
/// one, else the newest. `None` when the cache does not hold the model.
fn hf_snapshot(hub: &Path, org: &str, name: &str) -> Result<Option<PathBuf>> {
    let repo = hub.join(format!("models--{org}--{name}"));
    let snapshots = repo.join("snapshots");
    if !snapshots.is_dir() {
        return Ok(None);
    }
    if let Ok(rev) = std::fs::read_to_string(repo.join("refs").join("main")) {
        let rev = rev.trim();
        let dir = snapshots.join(rev);
        if is_store_name(rev) && dir.is_dir() {
            return Ok(Some(dir));
        }
    }
    let mut found: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(&snapshots)
        .map_err(|e| ModelError::io(&snapshots, e))?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .map(|e| {
            let t = e
                .metadata()
                .and_then(|m| m.modified())
                .unwrap_or(std::time::UNIX_EPOCH);
            (t, e.path())
        })
        .collect();
    found.sort();
    Ok(found.pop().map(|(_, p)| p))
}

/// The model a folder holds: the folder itself for an HF checkpoint, else its one GGUF file.
fn model_in_folder(arg: &str, dir: PathBuf) -> Result<PathBuf> {
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    let ggufs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| ModelError::io(&dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    match ggufs.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(ModelError::Input(format!(
            "model {arg:?}: {} holds neither config.json nor a .gguf file",
            dir.display()
        ))),
        _ => Err(ModelError::Input(format!(
            "model {arg:?}: {} holds several .gguf files; name one by path",
            dir.display()
        ))),
    }
}

/// The installed SmolLM2-135M GGUF, if `scripts/fetch-model.sh` has run (used by tests and
/// benchmarks that need a real model).
pub fn installed_smollm2() -> Option<PathBuf> {
    let dir = data_dir().ok()?;
    resolve_model("smollm2-135m", &dir).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_folders_resolve_to_the_model_they_hold() {
        let data = tempfile::tempdir().unwrap();
        let entry = models_dir(data.path()).join("tiny");
        std::fs::create_dir_all(&entry).unwrap();
        let missing = resolve_model("tiny", data.path()).unwrap_err().to_string();
        assert!(
            missing.contains("neither config.json nor a .gguf"),
            "{missing}"
        );

        std::fs::write(entry.join("tiny.gguf"), b"").unwrap();
        let gguf = entry.join("tiny.gguf");
        assert_eq!(resolve_model("tiny", data.path()).unwrap(), gguf);
        // The same folder given by path, and the file itself.
        assert_eq!(
            resolve_model(entry.to_str().unwrap(), data.path()).unwrap(),
            gguf
        );
        assert_eq!(
            resolve_model(gguf.to_str().unwrap(), data.path()).unwrap(),
            gguf
        );

        std::fs::write(entry.join("other.gguf"), b"").unwrap();
        let several = resolve_model("tiny", data.path()).unwrap_err().to_string();
        assert!(several.contains("several .gguf"), "{several}");

        // An HF folder is itself the model.
        std::fs::write(entry.join("config.json"), b"{}").unwrap();
        assert_eq!(resolve_model("tiny", data.path()).unwrap(), entry);

        let absent = resolve_model("nothing-here", data.path())
            .unwrap_err()
            .to_string();
        assert!(absent.contains("not installed"), "{absent}");
        let bad = resolve_model("../escape", data.path())
            .unwrap_err()
            .to_string();
        assert!(bad.contains("no such file or folder"), "{bad}");
    }

    #[test]
    fn org_slash_name_is_found_in_the_hugging_face_cache() {
        let data = tempfile::tempdir().unwrap();
        let hub = tempfile::tempdir().unwrap();
        let repo = hub.path().join("models--acme--tiny-llm");
        let old = repo.join("snapshots/0123abc");
        let new = repo.join("snapshots/4567def");
        for d in [&old, &new] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("config.json"), b"{}").unwrap();
        }
        let find = |arg: &str| resolve_model_in(arg, data.path(), Some(hub.path()));
        // refs/main names the snapshot to use, whichever is newer.
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), "0123abc\n").unwrap();
        assert_eq!(find("acme/tiny-llm").unwrap(), old);
        // Without refs/main, the newest snapshot.
        std::fs::remove_file(repo.join("refs/main")).unwrap();
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(60);
        std::fs::File::open(&new)
            .unwrap()
            .set_modified(later)
            .unwrap();
        assert_eq!(find("acme/tiny-llm").unwrap(), new);
        // A GGUF repository's snapshot gives its one file.
        let g = hub.path().join("models--acme--tiny-gguf/snapshots/89ab");
        std::fs::create_dir_all(&g).unwrap();
        std::fs::write(g.join("tiny-q8_0.gguf"), b"").unwrap();
        assert_eq!(find("acme/tiny-gguf").unwrap(), g.join("tiny-q8_0.gguf"));
        // Not in the cache: an error that says where it looked and that nothing is downloaded.
        let absent = find("acme/absent").unwrap_err().to_string();
        assert!(absent.contains("not in the Hugging Face cache"), "{absent}");
        assert!(
            absent.contains(&hub.path().display().to_string()),
            "{absent}"
        );
        // Names that could leave the cache are refused before any lookup.
        let bad = find("../x").unwrap_err().to_string();
        assert!(bad.contains("no such file or folder"), "{bad}");
        assert!(find("acme/..").is_err());
    }
}
