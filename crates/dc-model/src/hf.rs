//! Hugging Face checkpoints: `config.json` plus `*.safetensors`, single or sharded (with
//! `model.safetensors.index.json`), memory-mapped so a stage reads only the tensors it needs.
//! f32, f16 and bf16 tensors are converted to f32 exactly.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Metadata, SafeTensors};
use safetensors::Dtype;
use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::row_table::{RowEncoding, RowTable};
use crate::source::{table_shape, TensorInfo, TensorSource};

/// One memory-mapped safetensors file with its parsed (and validated) header.
struct Shard {
    path: PathBuf,
    map: Mmap,
    data_start: usize,
    meta: Metadata,
}

/// One safetensors file's layout (see [`SafetensorsSource::layout`]).
#[derive(Clone, Debug)]
pub struct ShardLayout {
    /// The file.
    pub path: PathBuf,
    /// Bytes before the data section.
    pub header_len: u64,
    /// Its tensors, in name order.
    pub tensors: Vec<ShardTensor>,
}

/// One tensor of a safetensors file.
#[derive(Clone, Debug)]
pub struct ShardTensor {
    /// Its name.
    pub name: String,
    /// Its dtype as safetensors spells it (`BF16`, `F32`, …).
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// First byte in the file.
    pub start: u64,
    /// One past its last byte.
    pub end: u64,
}

/// The tensors of a Hugging Face folder.
pub struct SafetensorsSource {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// Tensor name → shard index.
    index: HashMap<String, usize>,
    infos: Vec<TensorInfo>,
}

impl std::fmt::Debug for SafetensorsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SafetensorsSource({}, {} tensors)",
            self.dir.display(),
            self.infos.len()
        )
    }
}

/// Reads and parses a JSON file.
pub fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| ModelError::format(path, format!("invalid JSON: {e}")))
}

impl SafetensorsSource {
    /// Opens every safetensors file of a Hugging Face folder.
    pub fn open_dir(dir: &Path) -> Result<SafetensorsSource> {
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.is_file() {
            let idx = read_json(&index_path)?;
            let map = idx
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| ModelError::format(&index_path, "no \"weight_map\" object"))?;
            let mut files: Vec<String> = Vec::new();
            for (name, f) in map {
                let f = f.as_str().ok_or_else(|| {
                    ModelError::format(
                        &index_path,
                        format!("weight_map[{name:?}] is not a file name"),
                    )
                })?;
                if f.contains('/') || f.contains("..") {
                    return Err(ModelError::format(
                        &index_path,
                        format!("weight_map[{name:?}] = {f:?} leaves the folder"),
                    ));
                }
                if !files.iter().any(|x| x == f) {
                    files.push(f.to_string());
                }
            }
            files.sort();
            files.into_iter().map(|f| dir.join(f)).collect()
        } else if dir.join("model.safetensors").is_file() {
            // Only the weights: a folder may hold other safetensors files (test outputs, …).
            vec![dir.join("model.safetensors")]
        } else {
            let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| ModelError::io(dir, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.extension().is_some_and(|x| x == "safetensors")
                        && p.file_name()
                            .is_some_and(|n| n.to_string_lossy().starts_with("model"))
                })
                .collect();
            files.sort();
            files
        };
        if files.is_empty() {
            return Err(ModelError::format(
                dir,
                "no model.safetensors (or model.safetensors.index.json with its shards)",
            ));
        }
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        let mut infos = Vec::new();
        for path in files {
            let file = File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            // SAFETY: the mapping is read-only; a checkpoint being rewritten underneath a running
            // daemon is outside what any loader can defend against.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?;
            let (header, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
                ModelError::format(&path, format!("not a valid safetensors file: {e}"))
            })?;
            let shard_idx = shards.len();
            let mut names: Vec<(String, Vec<usize>)> = meta
                .tensors()
                .into_iter()
                .map(|(n, i)| (n, i.shape.clone()))
                .collect();
            names.sort();
            for (name, shape) in names {
                if index.insert(name.clone(), shard_idx).is_some() {
                    return Err(ModelError::format(
                        &path,
                        format!("tensor {name} appears in two files"),
                    ));
                }
                infos.push(TensorInfo { name, shape });
            }
            shards.push(Shard {
                path,
                map,
                data_start: 8 + header,
                meta,
            });
        }
        infos.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(SafetensorsSource {
            dir: dir.to_path_buf(),
            shards,
            index,
            infos,
        })
    }

    /// Every file this source reads (for cache keys).
    pub fn files(&self) -> Vec<PathBuf> {
        self.shards.iter().map(|s| s.path.clone()).collect()
    }

    /// Where each shard's bytes lie: its path, the length of its header (the 8-byte length and
    /// the JSON), and every tensor's name, dtype, shape and absolute byte range, in name order.
    pub fn layout(&self) -> Vec<ShardLayout> {
        self.shards
            .iter()
            .map(|s| {
                let mut tensors: Vec<ShardTensor> = s
                    .meta
                    .tensors()
                    .into_iter()
                    .map(|(name, i)| ShardTensor {
                        name,
                        dtype: format!("{:?}", i.dtype),
                        shape: i.shape.clone(),
                        start: (s.data_start + i.data_offsets.0) as u64,
                        end: (s.data_start + i.data_offsets.1) as u64,
                    })
                    .collect();
                tensors.sort_by(|a, b| a.name.cmp(&b.name));
                ShardLayout {
                    path: s.path.clone(),
                    header_len: s.data_start as u64,
                    tensors,
                }
            })
            .collect()
    }
}

impl TensorSource for SafetensorsSource {
    fn tensors(&self) -> Vec<TensorInfo> {
        self.infos.clone()
    }

    fn info(&self, name: &str) -> Option<TensorInfo> {
        let shard = &self.shards[*self.index.get(name)?];
        let i = shard.meta.info(name)?;
        Some(TensorInfo {
            name: name.into(),
            shape: i.shape.clone(),
        })
    }

    fn load_f32(&self, name: &str) -> Result<Vec<f32>> {
        let (shard, info, bytes) = self.stored(name)?;
        let numel: usize = info.shape.iter().product();
        let out: Vec<f32> = match info.dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => {
                return Err(ModelError::Unsupported {
                    what: "safetensors dtype",
                    value: format!("{other:?} (tensor {name} in {})", shard.path.display()),
                })
            }
        };
        if out.len() != numel {
            return Err(ModelError::format(
                &shard.path,
                format!(
                    "tensor {name}: {} values for shape {:?}",
                    out.len(),
                    info.shape
                ),
            ));
        }
        Ok(out)
    }

    fn load_row_table(&self, name: &str) -> Result<RowTable> {
        let (rows, cols) = table_shape(self, name)?;
        let (_, info, bytes) = self.stored(name)?;
        let encoding = match info.dtype {
            Dtype::F16 => Some(RowEncoding::F16),
            Dtype::BF16 => Some(RowEncoding::Bf16),
            _ => None,
        };
        match encoding.and_then(|e| RowTable::encoded(e, bytes.to_vec(), rows, cols)) {
            Some(table) => Ok(table),
            None => RowTable::from_f32(self.load_f32(name)?, rows, cols),
        }
    }

    fn path(&self) -> &Path {
        &self.dir
    }
}

impl SafetensorsSource {
    /// The shard holding tensor `name`, its entry there and its stored bytes.
    fn stored(&self, name: &str) -> Result<(&Shard, &safetensors::tensor::TensorInfo, &[u8])> {
        let shard =
            &self.shards[*self
                .index
                .get(name)
                .ok_or_else(|| ModelError::MissingTensor {
                    name: name.into(),
                    path: self.dir.clone(),
                })?];
        let info = shard
            .meta
            .info(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.into(),
                path: shard.path.clone(),
            })?;
        let (a, b) = info.data_offsets;
        // read_metadata validated that the offsets tile the data section exactly.
        Ok((
            shard,
            info,
            &shard.map[shard.data_start + a..shard.data_start + b],
        ))
    }
}
