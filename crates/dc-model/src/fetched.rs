//! A model fetched from peers, as it lies in the store: a folder holding the manifest
//! (`dcd-manifest.bin`), the model's files at their full length with only the fetched pieces
//! written, and the list of pieces fetched and checked (`dcd-held.txt`).
//!
//! The files are sparse: bytes never fetched read as zeros, so nothing may read a piece the
//! list does not hold. [`HeldOnly`] is the tensor source of such a folder, and it refuses every
//! tensor not fetched by name, so a missing piece is an error, never a layer of zeros. A piece
//! enters the list only after its bytes are on disk and match the manifest's hash, so an
//! interrupted fetch resumes from the pieces it holds.

use std::collections::{BTreeSet, HashSet};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use dc_kernels::Commitment;

use crate::error::{ModelError, Result};
use crate::manifest::Manifest;
use crate::row_table::RowTable;
use crate::source::{TensorInfo, TensorSource};

/// The manifest inside a fetched folder.
pub const MANIFEST_FILE: &str = "dcd-manifest.bin";
/// The pieces a fetched folder holds, one index per line.
pub const HELD_FILE: &str = "dcd-held.txt";

/// The fetched folder `model` lies in, if it is one: `model` itself, or a file's folder.
pub fn fetched_folder(model: &Path) -> Option<PathBuf> {
    let dir = crate::manifest::model_root(model);
    dir.join(MANIFEST_FILE).is_file().then_some(dir)
}

/// A fetched (or being fetched) model in the store.
#[derive(Debug)]
pub struct FetchedModel {
    dir: PathBuf,
    manifest: Manifest,
    bytes: Vec<u8>,
    held: Mutex<BTreeSet<u32>>,
}

impl FetchedModel {
    /// Opens the fetched folder `dir`: its manifest and the pieces it holds.
    pub fn open(dir: &Path) -> Result<FetchedModel> {
        let path = dir.join(MANIFEST_FILE);
        let bytes = std::fs::read(&path).map_err(|e| ModelError::io(&path, e))?;
        let manifest =
            Manifest::decode(&bytes).map_err(|e| ModelError::format(&path, e.to_string()))?;
        let held = read_held(dir, &manifest)?;
        Ok(FetchedModel {
            dir: dir.to_path_buf(),
            manifest,
            bytes,
            held: Mutex::new(held),
        })
    }

    /// Makes `dir` the fetched folder of the manifest `bytes` (already checked against the
    /// model id): writes the manifest and creates every file at its full length. A folder that
    /// already holds this manifest is opened as it is (the fetch resumes).
    pub fn create(dir: &Path, bytes: &[u8]) -> Result<FetchedModel> {
        let manifest = Manifest::decode(bytes)?;
        if let Ok(existing) = FetchedModel::open(dir) {
            if existing.bytes == bytes {
                return Ok(existing);
            }
        }
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        for f in &manifest.files {
            let p = dir.join(&f.name);
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&p)
                .map_err(|e| ModelError::io(&p, e))?;
            file.set_len(f.len).map_err(|e| ModelError::io(&p, e))?;
        }
        let held = dir.join(HELD_FILE);
        write_atomically(&held, b"")?;
        write_atomically(&dir.join(MANIFEST_FILE), bytes)?;
        FetchedModel::open(dir)
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The manifest's encoding (what peers are sent).
    pub fn manifest_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The model id.
    pub fn id(&self) -> Commitment {
        Manifest::id_of(&self.bytes)
    }

    /// Where the model is opened from.
    pub fn model_path(&self) -> PathBuf {
        self.manifest.model_path(&self.dir)
    }

    /// Whether piece `i` is held.
    pub fn holds(&self, i: u32) -> bool {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&i)
    }

    /// The pieces of `wanted` not held yet.
    pub fn missing(&self, wanted: &[u32]) -> Vec<u32> {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        wanted
            .iter()
            .copied()
            .filter(|i| !held.contains(i))
            .collect()
    }

    /// Opens piece `i`'s file for writing, positioned at the piece's first byte.
    pub fn piece_writer(&self, i: u32) -> Result<std::fs::File> {
        let p = self.piece(i)?;
        let path = self.dir.join(&self.manifest.files[p.file as usize].name);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(|e| ModelError::io(&path, e))?;
        f.seek(SeekFrom::Start(p.offset))
            .map_err(|e| ModelError::io(&path, e))?;
        Ok(f)
    }

    /// Records piece `i` as held: its bytes were written through `file` and matched the
    /// manifest. The data reaches the disk before the list names it.
    pub fn mark_held(&self, i: u32, file: std::fs::File) -> Result<()> {
        self.piece(i)?;
        file.sync_data().map_err(|e| ModelError::io(&self.dir, e))?;
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.insert(i);
        let text: String = held.iter().map(|i| format!("{i}\n")).collect();
        write_atomically(&self.dir.join(HELD_FILE), text.as_bytes())
    }

    fn piece(&self, i: u32) -> Result<&crate::manifest::Piece> {
        self.manifest.pieces.get(i as usize).ok_or_else(|| {
            ModelError::Input(format!(
                "piece {i}: the manifest has {}",
                self.manifest.pieces.len()
            ))
        })
    }
}

fn read_held(dir: &Path, manifest: &Manifest) -> Result<BTreeSet<u32>> {
    let path = dir.join(HELD_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(ModelError::io(&path, e)),
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            l.trim()
                .parse::<u32>()
                .ok()
                .filter(|&i| (i as usize) < manifest.pieces.len())
                .ok_or_else(|| {
                    ModelError::format(&path, format!("{l:?} is not a piece of the manifest"))
                })
        })
        .collect()
}

/// Writes `bytes` to `path` through a temporary file and a rename (a crash never leaves half a
/// file), synced.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
    f.write_all(bytes).map_err(|e| ModelError::io(&tmp, e))?;
    f.sync_data().map_err(|e| ModelError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| ModelError::io(path, e))
}

/// The tensors of a fetched folder: those of its files, but only the ones fetched.
pub struct HeldOnly {
    inner: Box<dyn TensorSource>,
    held: HashSet<String>,
}

impl std::fmt::Debug for HeldOnly {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HeldOnly({}, {} tensors held)",
            self.inner.path().display(),
            self.held.len()
        )
    }
}

impl HeldOnly {
    /// Wraps `inner`, the source opened on the fetched folder `dir`.
    pub fn new(inner: Box<dyn TensorSource>, dir: &Path) -> Result<HeldOnly> {
        let fetched = FetchedModel::open(dir)?;
        let held_pieces = fetched.held.into_inner().unwrap_or_else(|e| e.into_inner());
        let held = held_pieces
            .iter()
            .filter_map(|&i| fetched.manifest.pieces[i as usize].tensor.as_ref())
            .map(|t| t.name.clone())
            .collect();
        Ok(HeldOnly { inner, held })
    }

    /// `Err` naming `name` unless its bytes were fetched and checked.
    fn check_held(&self, name: &str) -> Result<()> {
        if self.held.contains(name) {
            return Ok(());
        }
        Err(ModelError::Input(format!(
            "tensor {name} of {} was not fetched from peers (a fetched model holds only the layers its daemon serves)",
            self.inner.path().display()
        )))
    }
}

impl TensorSource for HeldOnly {
    fn tensors(&self) -> Vec<TensorInfo> {
        self.inner.tensors()
    }

    fn info(&self, name: &str) -> Option<TensorInfo> {
        self.inner.info(name)
    }

    fn load_f32(&self, name: &str) -> Result<Vec<f32>> {
        self.check_held(name)?;
        self.inner.load_f32(name)
    }

    fn load_row_table(&self, name: &str) -> Result<RowTable> {
        self.check_held(name)?;
        self.inner.load_row_table(name)
    }

    fn path(&self) -> &Path {
        self.inner.path()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn llama() -> PathBuf {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/llama");
        assert!(p.is_dir(), "fixture {} missing", p.display());
        p
    }

    /// Copies piece `i` from the original model into `f`, as a fetch would.
    fn copy_piece(f: &FetchedModel, original: &Path, i: u32) {
        let p = &f.manifest().pieces[i as usize];
        let src = f.manifest().file_path(original, p.file).unwrap();
        let mut bytes = vec![0u8; p.len as usize];
        let mut file = std::fs::File::open(src).unwrap();
        file.seek(SeekFrom::Start(p.offset)).unwrap();
        file.read_exact(&mut bytes).unwrap();
        let mut w = f.piece_writer(i).unwrap();
        w.write_all(&bytes).unwrap();
        f.mark_held(i, w).unwrap();
    }

    #[test]
    fn a_fetched_folder_offers_only_what_it_holds_and_keeps_it_across_opens() {
        let original = llama();
        let bytes = Manifest::of_model(&original).unwrap().encode().unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("m");
        let f = FetchedModel::create(&dir, &bytes).unwrap();
        assert_eq!(f.id(), Manifest::id_of(&bytes));
        assert_eq!(f.model_path(), dir, "a folder model opens from its folder");
        let wanted = f.manifest().needed(0..1, false);
        for &i in &wanted {
            copy_piece(&f, &original, i);
        }
        assert!(f.missing(&wanted).is_empty());
        // Opened again (a restart), it holds the same pieces; created again with the same
        // manifest, too (the fetch resumes instead of starting over).
        assert!(FetchedModel::open(&dir)
            .unwrap()
            .missing(&wanted)
            .is_empty());
        assert!(FetchedModel::create(&dir, &bytes)
            .unwrap()
            .missing(&wanted)
            .is_empty());
        assert_eq!(crate::fetched::fetched_folder(&dir), Some(dir.clone()));

        let (_, src) = crate::open::open_source(&dir).unwrap();
        let (_, orig) = crate::open::open_source(&original).unwrap();
        let name = "model.layers.0.self_attn.q_proj.weight";
        let a: Vec<u32> = src
            .load_f32(name)
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        let b: Vec<u32> = orig
            .load_f32(name)
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(a, b);
        // Every tensor is listed (shapes are known), but one not fetched is refused by name:
        // never a tensor of zeros.
        let other = "model.layers.1.self_attn.q_proj.weight";
        assert!(src.info(other).is_some());
        let err = src.load_f32(other).unwrap_err().to_string();
        assert!(err.contains(other) && err.contains("not fetched"), "{err}");
        let err = src
            .load_f32("model.embed_tokens.weight")
            .unwrap_err()
            .to_string();
        assert!(err.contains("not fetched"), "{err}");
        // Layer 0 loads as a stage; layers 0..2 do not.
        let opts = |layers| crate::LoadOptions {
            layers: Some(layers),
            head: false,
            cache_in: None,
        };
        crate::Model::load(&dir, &opts(0..1)).unwrap();
        assert!(crate::Model::load(&dir, &opts(0..2)).is_err());
    }

    #[test]
    fn a_damaged_list_of_pieces_is_an_error_naming_the_file() {
        let bytes = Manifest::of_model(&llama()).unwrap().encode().unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let f = FetchedModel::create(tmp.path(), &bytes).unwrap();
        let n = f.manifest().pieces.len();
        for bad in ["x\n", &format!("{n}\n"), "-1\n"] {
            std::fs::write(tmp.path().join(HELD_FILE), bad).unwrap();
            let err = FetchedModel::open(tmp.path()).unwrap_err().to_string();
            assert!(
                err.contains(HELD_FILE) && err.contains("not a piece"),
                "{bad:?}: {err}"
            );
        }
        std::fs::write(tmp.path().join(MANIFEST_FILE), b"\x01\x02").unwrap();
        let err = FetchedModel::open(tmp.path()).unwrap_err().to_string();
        assert!(err.contains(MANIFEST_FILE), "{err}");
    }
}
