//! A model's manifest: its files and how they cut into pieces (each small file whole, each
//! weights file's header, each tensor's bytes as stored), with the hash of every piece. The
//! model id is the hash of the manifest's encoding, so a daemon that knows only the id can take
//! the manifest from any peer, check it against the id, then fetch exactly the pieces its
//! layers need from any peers and check each piece against the manifest.
//!
//! A GGUF model is one file: its header (metadata, vocabulary, tensor directory) is one piece,
//! each tensor one more. A Hugging Face folder is its small files (configuration, tokenizer,
//! chat template) and its safetensors shards, each cut into its header and its tensors. Bytes
//! no piece covers (alignment padding, tensors no architecture reads) are never fetched.
//!
//! Tensors keep their stored form (bf16, Q8_0 blocks, …): a fetched file is the original file
//! with the pieces a daemon does not need left out, and it loads through the same code.

use std::collections::HashSet;
use std::ops::Range;
use std::path::{Path, PathBuf};

use dc_kernels::{Commitment, Domain};
use memmap2::Mmap;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::hf::SafetensorsSource;
use crate::source::TensorSource;
use crate::store::is_store_name;

/// Bumped whenever what a manifest says (or how it is encoded) changes.
pub const MANIFEST_VERSION: u32 = 1;
/// Largest encoded manifest (a 7B model's is about 60 KiB).
pub const MAX_MANIFEST_BYTES: usize = 8 << 20;
/// Most files a manifest may list.
const MAX_FILES: usize = 256;
/// Most pieces a manifest may list.
const MAX_PIECES: usize = 1 << 16;
/// Largest small file (configuration, tokenizer) a folder's manifest takes whole.
const MAX_SMALL_FILE: u64 = 64 << 20;
/// Largest file a manifest may list.
const MAX_FILE_LEN: u64 = 1 << 40;
/// Longest tensor name or dtype.
const MAX_NAME: usize = 256;
/// Most dimensions of a tensor.
const MAX_DIMS: usize = 8;
/// Extensions of the small files a Hugging Face folder's manifest takes.
const SMALL_FILE_EXTENSIONS: [&str; 4] = ["json", "jinja", "txt", "model"];

/// What a model is made of.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_VERSION`].
    pub version: u32,
    /// The files, in name order.
    pub files: Vec<ManifestFile>,
    /// The pieces, file by file, each file's in offset order.
    pub pieces: Vec<Piece>,
}

/// One file of a model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestFile {
    /// Its name inside the model's folder (no path).
    pub name: String,
    /// Its length in bytes.
    pub len: u64,
}

/// A byte range of one file, fetched and checked as a whole.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    /// Index into [`Manifest::files`].
    pub file: u32,
    /// First byte.
    pub offset: u64,
    /// Length in bytes (never zero).
    pub len: u64,
    /// [`piece_hash`] of the bytes.
    pub hash: [u8; 32],
    /// The tensor these bytes hold; `None` for a header or a small file.
    pub tensor: Option<PieceTensor>,
}

/// The tensor a piece holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PieceTensor {
    /// Its Hugging Face name.
    pub name: String,
    /// How it is stored (`BF16`, `Q8_0`, …).
    pub dtype: String,
    /// Its Hugging Face shape, outermost first.
    pub shape: Vec<u64>,
    /// The layer it belongs to (`None` for the head's tensors: embeddings, final norm, output).
    pub layer: Option<u32>,
}

/// The hash of one piece's bytes.
pub fn piece_hash(bytes: &[u8]) -> [u8; 32] {
    Domain::Piece.hash(bytes).0
}

/// A piece hash computed over bytes that arrive in parts.
pub fn piece_hasher() -> blake3::Hasher {
    Domain::Piece.hasher()
}

/// The layer of a Hugging Face tensor name: the number after a `layers` or `h` segment
/// (`model.layers.3.mlp…`, `transformer.h.3.attn…`).
pub fn layer_of(name: &str) -> Option<u32> {
    let mut parts = name.split('.');
    while let Some(p) = parts.next() {
        if p == "layers" || p == "h" {
            let n = parts.next()?;
            if n.is_empty()
                || !n.bytes().all(|b| b.is_ascii_digit())
                || (n.len() > 1 && n.starts_with('0'))
            {
                return None;
            }
            return n.parse().ok();
        }
    }
    None
}

/// The folder a model's files live in: the folder itself, or a file's folder.
pub fn model_root(model: &Path) -> PathBuf {
    if model.is_dir() {
        return model.to_path_buf();
    }
    match model.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

impl Manifest {
    /// The manifest of the model at `path` (a GGUF file or a Hugging Face folder), hashing
    /// every piece.
    pub fn of_model(path: &Path) -> Result<Manifest> {
        let mut m = if path.is_dir() {
            Self::of_folder(path)?
        } else {
            Self::of_gguf(path)?
        };
        let root = model_root(path);
        let maps = m
            .files
            .iter()
            .map(|f| {
                let p = root.join(&f.name);
                if f.len == 0 {
                    return Ok(None);
                }
                let file = std::fs::File::open(&p).map_err(|e| ModelError::io(&p, e))?;
                // SAFETY: read-only; a model rewritten underneath us is outside what any
                // loader defends against (the same rule as the loaders' own mappings).
                let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(&p, e))?;
                if map.len() as u64 != f.len {
                    return Err(ModelError::format(
                        &p,
                        "changed while its manifest was made",
                    ));
                }
                Ok(Some(map))
            })
            .collect::<Result<Vec<Option<Mmap>>>>()?;
        m.pieces.par_iter_mut().for_each(|p| {
            if let Some(map) = &maps[p.file as usize] {
                p.hash = piece_hash(&map[p.offset as usize..(p.offset + p.len) as usize]);
            }
        });
        m.check()?;
        Ok(m)
    }

    fn of_gguf(path: &Path) -> Result<Manifest> {
        let g = GgufFile::open(path)?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .filter(|n| is_store_name(n))
            .ok_or_else(|| {
                ModelError::Input(format!(
                    "{}: a model shared with peers needs a plain file name (letters, digits, - _ .)",
                    path.display()
                ))
            })?;
        let len = std::fs::metadata(path)
            .map_err(|e| ModelError::io(path, e))?
            .len();
        let mut pieces = vec![Piece {
            file: 0,
            offset: 0,
            len: g.data_start(),
            hash: [0; 32],
            tensor: None,
        }];
        let mut seen = HashSet::new();
        for info in g.tensors() {
            let Some(t) = g.gguf_tensor(&info.name) else {
                continue;
            };
            // Two names for one stored tensor share its bytes: one piece.
            if t.n_bytes == 0 || !seen.insert(t.file_offset) {
                continue;
            }
            pieces.push(Piece {
                file: 0,
                offset: t.file_offset,
                len: t.n_bytes,
                hash: [0; 32],
                tensor: Some(PieceTensor {
                    layer: layer_of(&info.name),
                    name: info.name,
                    dtype: t.ggml_type.to_string(),
                    shape: info.shape.iter().map(|&d| d as u64).collect(),
                }),
            });
        }
        pieces.sort_by_key(|p| p.offset);
        Ok(Manifest {
            version: MANIFEST_VERSION,
            files: vec![ManifestFile { name, len }],
            pieces,
        })
    }

    fn of_folder(dir: &Path) -> Result<Manifest> {
        let src = SafetensorsSource::open_dir(dir)?;
        let layout = src.layout();
        let shard_names: HashSet<PathBuf> = layout.iter().map(|s| s.path.clone()).collect();
        let mut files: Vec<(String, u64, Option<usize>)> = Vec::new();
        for (i, s) in layout.iter().enumerate() {
            let name = s
                .path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .filter(|n| is_store_name(n))
                .ok_or_else(|| ModelError::format(&s.path, "not a plain file name"))?;
            let len = std::fs::metadata(&s.path)
                .map_err(|e| ModelError::io(&s.path, e))?
                .len();
            files.push((name, len, Some(i)));
        }
        for e in std::fs::read_dir(dir).map_err(|e| ModelError::io(dir, e))? {
            let e = e.map_err(|e| ModelError::io(dir, e))?;
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            let small = SMALL_FILE_EXTENSIONS
                .iter()
                .any(|x| p.extension().is_some_and(|e| e == *x));
            if !small
                || shard_names.contains(&p)
                || !is_store_name(&name)
                || name.starts_with("dcd-")
            {
                continue;
            }
            let meta = e.metadata().map_err(|e| ModelError::io(&p, e))?;
            if !meta.is_file() {
                continue;
            }
            if meta.len() > MAX_SMALL_FILE {
                return Err(ModelError::format(
                    &p,
                    format!(
                        "{} bytes: larger than a configuration or tokenizer file may be",
                        meta.len()
                    ),
                ));
            }
            files.push((name, meta.len(), None));
        }
        files.sort();
        let mut pieces = Vec::new();
        for (i, (_, len, shard)) in files.iter().enumerate() {
            let file = i as u32;
            let Some(s) = shard.map(|s| &layout[s]) else {
                if *len > 0 {
                    pieces.push(Piece {
                        file,
                        offset: 0,
                        len: *len,
                        hash: [0; 32],
                        tensor: None,
                    });
                }
                continue;
            };
            pieces.push(Piece {
                file,
                offset: 0,
                len: s.header_len,
                hash: [0; 32],
                tensor: None,
            });
            let mut tensors: Vec<_> = s.tensors.iter().filter(|t| t.end > t.start).collect();
            tensors.sort_by_key(|t| t.start);
            for t in tensors {
                pieces.push(Piece {
                    file,
                    offset: t.start,
                    len: t.end - t.start,
                    hash: [0; 32],
                    tensor: Some(PieceTensor {
                        name: t.name.clone(),
                        dtype: t.dtype.clone(),
                        shape: t.shape.iter().map(|&d| d as u64).collect(),
                        layer: layer_of(&t.name),
                    }),
                });
            }
        }
        Ok(Manifest {
            version: MANIFEST_VERSION,
            files: files
                .into_iter()
                .map(|(name, len, _)| ManifestFile { name, len })
                .collect(),
            pieces,
        })
    }

    /// The manifest's encoding, whose hash is the model id.
    pub fn encode(&self) -> Result<Vec<u8>> {
        dc_types::encode(self, MAX_MANIFEST_BYTES)
            .map_err(|e| ModelError::Input(format!("manifest: {e}")))
    }

    /// A manifest from its encoding (from a peer or from disk), checked.
    pub fn decode(bytes: &[u8]) -> Result<Manifest> {
        let m: Manifest = dc_types::decode(bytes, MAX_MANIFEST_BYTES)
            .map_err(|e| ModelError::Input(format!("manifest: {e}")))?;
        m.check()?;
        Ok(m)
    }

    /// The model id of a manifest's encoding.
    pub fn id_of(bytes: &[u8]) -> Commitment {
        Domain::Manifest.hash(bytes)
    }

    /// Checks what a manifest from outside could get wrong: its version, bounds, file names,
    /// pieces inside their files and not overlapping, tensor names unique and each in the
    /// layer its name says.
    pub fn check(&self) -> Result<()> {
        let bad = |detail: String| Err(ModelError::Input(format!("manifest: {detail}")));
        if self.version != MANIFEST_VERSION {
            return bad(format!(
                "version {} (this dcd reads version {MANIFEST_VERSION})",
                self.version
            ));
        }
        if self.files.is_empty() || self.files.len() > MAX_FILES {
            return bad(format!("{} files (1 to {MAX_FILES})", self.files.len()));
        }
        if self.pieces.len() > MAX_PIECES {
            return bad(format!(
                "{} pieces (at most {MAX_PIECES})",
                self.pieces.len()
            ));
        }
        let mut names = HashSet::new();
        for f in &self.files {
            if !is_store_name(&f.name) || f.name.starts_with("dcd-") {
                return bad(format!("file name {:?}", f.name));
            }
            if !names.insert(f.name.as_str()) {
                return bad(format!("file {:?} listed twice", f.name));
            }
            if f.len > MAX_FILE_LEN {
                return bad(format!("file {:?} of {} bytes", f.name, f.len));
            }
        }
        let mut tensors = HashSet::new();
        let mut end_of_last = (u32::MAX, 0u64);
        for (i, p) in self.pieces.iter().enumerate() {
            let Some(f) = self.files.get(p.file as usize) else {
                return bad(format!("piece {i} names file {}", p.file));
            };
            let end = p.offset.checked_add(p.len);
            if p.len == 0 || end.is_none_or(|e| e > f.len) {
                return bad(format!(
                    "piece {i} ({} + {} bytes) outside {:?}",
                    p.offset, p.len, f.name
                ));
            }
            let in_order = match end_of_last {
                (file, _) if file == u32::MAX || p.file > file => true,
                (file, last) => p.file == file && p.offset >= last,
            };
            if !in_order {
                return bad(format!("piece {i} overlaps or precedes the one before it"));
            }
            end_of_last = (p.file, end.unwrap_or(0));
            if let Some(t) = &p.tensor {
                if t.name.is_empty() || t.name.len() > MAX_NAME || t.dtype.len() > MAX_NAME {
                    return bad(format!("piece {i}: tensor name or dtype of bad length"));
                }
                if t.shape.len() > MAX_DIMS {
                    return bad(format!("tensor {}: {} dimensions", t.name, t.shape.len()));
                }
                if t.layer != layer_of(&t.name) {
                    return bad(format!(
                        "tensor {} said to be in layer {:?}",
                        t.name, t.layer
                    ));
                }
                if !tensors.insert(t.name.as_str()) {
                    return bad(format!("tensor {} listed twice", t.name));
                }
            }
        }
        Ok(())
    }

    /// The pieces a daemon serving `layers` (and the head's tensors if `head`) needs: every
    /// header and small file, and those tensors.
    pub fn needed(&self, layers: Range<usize>, head: bool) -> Vec<u32> {
        (0..self.pieces.len() as u32)
            .filter(|&i| match &self.pieces[i as usize].tensor {
                None => true,
                Some(t) => match t.layer {
                    Some(l) => layers.contains(&(l as usize)),
                    None => head,
                },
            })
            .collect()
    }

    /// The headers and small files: what opening the model reads.
    pub fn meta_pieces(&self) -> Vec<u32> {
        (0..self.pieces.len() as u32)
            .filter(|&i| self.pieces[i as usize].tensor.is_none())
            .collect()
    }

    /// Bytes in `pieces`.
    pub fn bytes_of(&self, pieces: &[u32]) -> u64 {
        pieces
            .iter()
            .filter_map(|&i| self.pieces.get(i as usize))
            .map(|p| p.len)
            .sum()
    }

    /// Where file `file` of the model at `model` is.
    pub fn file_path(&self, model: &Path, file: u32) -> Option<PathBuf> {
        let f = self.files.get(file as usize)?;
        Some(model_root(model).join(&f.name))
    }

    /// Where the model of these files is opened from inside `dir`: the folder for a Hugging
    /// Face checkpoint, the one file for GGUF.
    pub fn model_path(&self, dir: &Path) -> PathBuf {
        if self.files.iter().any(|f| f.name == "config.json") {
            dir.to_path_buf()
        } else {
            dir.join(&self.files[0].name)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/fixtures")
            .join(name);
        assert!(p.is_dir(), "fixture {} missing", p.display());
        p
    }

    #[test]
    fn layers_are_read_from_names() {
        assert_eq!(layer_of("model.layers.3.mlp.up_proj.weight"), Some(3));
        assert_eq!(layer_of("transformer.h.11.attn.c_attn.weight"), Some(11));
        assert_eq!(layer_of("h.0.ln_1.weight"), Some(0));
        assert_eq!(layer_of("model.embed_tokens.weight"), None);
        assert_eq!(layer_of("lm_head.weight"), None);
        assert_eq!(layer_of("model.layers.03.x"), None);
        assert_eq!(layer_of("model.layers.x.y"), None);
    }

    #[test]
    fn a_folder_manifest_covers_every_tensor_and_checks() {
        let dir = fixture("llama");
        let m = Manifest::of_model(&dir).unwrap();
        let src = SafetensorsSource::open_dir(&dir).unwrap();
        let named: HashSet<&str> = m
            .pieces
            .iter()
            .filter_map(|p| p.tensor.as_ref().map(|t| t.name.as_str()))
            .collect();
        for t in src.tensors() {
            assert!(named.contains(t.name.as_str()), "{} missing", t.name);
        }
        assert!(m.files.iter().any(|f| f.name == "config.json"));
        let bytes = m.encode().unwrap();
        assert_eq!(Manifest::decode(&bytes).unwrap(), m);
        // Every header and small file is needed even by a stage of no layers.
        assert_eq!(m.needed(0..0, false), m.meta_pieces());
    }

    #[test]
    fn a_changed_byte_changes_the_id() {
        let dir = fixture("llama");
        let tmp = tempfile::tempdir().unwrap();
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_file() {
                std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
            }
        }
        let id = |d: &Path| Manifest::id_of(&Manifest::of_model(d).unwrap().encode().unwrap());
        let before = id(tmp.path());
        assert_eq!(before, id(&dir), "a copy has the same id");
        let m = Manifest::of_model(tmp.path()).unwrap();
        let p = m.pieces.iter().rfind(|p| p.tensor.is_some()).unwrap();
        let path = m.file_path(tmp.path(), p.file).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[(p.offset + p.len / 2) as usize] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        assert_ne!(before, id(tmp.path()));
    }

    type Spoil = Box<dyn Fn(&mut Manifest)>;

    #[test]
    fn hostile_manifests_are_refused() {
        let good = Manifest {
            version: MANIFEST_VERSION,
            files: vec![ManifestFile {
                name: "m.gguf".into(),
                len: 100,
            }],
            pieces: vec![
                Piece {
                    file: 0,
                    offset: 0,
                    len: 10,
                    hash: [0; 32],
                    tensor: None,
                },
                Piece {
                    file: 0,
                    offset: 10,
                    len: 90,
                    hash: [0; 32],
                    tensor: Some(PieceTensor {
                        name: "model.layers.0.x.weight".into(),
                        dtype: "Q8_0".into(),
                        shape: vec![9, 10],
                        layer: Some(0),
                    }),
                },
            ],
        };
        good.check().unwrap();
        let bad: Vec<(&str, Spoil)> = vec![
            ("version", Box::new(|m| m.version = 99)),
            ("file name", Box::new(|m| m.files[0].name = "../x".into())),
            (
                "file name",
                Box::new(|m| m.files[0].name = "dcd-manifest.bin".into()),
            ),
            ("outside", Box::new(|m| m.pieces[1].len = 91)),
            ("outside", Box::new(|m| m.pieces[1].offset = u64::MAX)),
            ("overlaps", Box::new(|m| m.pieces[1].offset = 9)),
            ("names file", Box::new(|m| m.pieces[1].file = 3)),
            (
                "said to be in layer",
                Box::new(|m| m.pieces[1].tensor.as_mut().unwrap().layer = None),
            ),
            (
                "dimensions",
                Box::new(|m| m.pieces[1].tensor.as_mut().unwrap().shape = vec![1; 9]),
            ),
        ];
        for (want, spoil) in bad {
            let mut m = good.clone();
            spoil(&mut m);
            let err = m.check().unwrap_err().to_string();
            assert!(err.contains(want), "{want}: {err}");
            // Through the wire too.
            let bytes = dc_types::encode(&m, MAX_MANIFEST_BYTES).unwrap();
            assert!(Manifest::decode(&bytes).is_err());
        }
        assert!(Manifest::decode(&[0xff; 64]).is_err());
    }
}
