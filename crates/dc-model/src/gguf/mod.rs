//! GGUF files, the single-file checkpoints llama.cpp users have
//! (format: <https://github.com/ggml-org/ggml/blob/master/docs/gguf.md>).
//!
//! This module owns reading a GGUF file and presenting it the way the rest of the runtime
//! expects a checkpoint: tensors under Hugging Face names and shapes, converted to f32 exactly
//! as gguf-py does it (see [`dequant`]), llama.cpp's Q/K row permutation undone, a Hugging
//! Face `config.json` and `tokenizer.json` synthesised from the metadata.
//!
//! It must never trust the file: [`reader`] validates every count, length and offset before
//! use, so a truncated or hostile file is an error naming the file and the bad value, never a
//! panic or an unbounded allocation. A file is refused whole at [`GgufFile::open`] when its
//! architecture or any tensor name is one we cannot map: no caller ever sees half a model.

pub mod dequant;
mod reader;
pub mod value;
mod vocab;

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde_json::{json, Value as Json};

use crate::error::{ModelError, Result};
use crate::row_table::{RowEncoding, RowTable};
use crate::source::{table_shape, TensorInfo, TensorSource};

pub use dequant::{bf16_to_f32, dequantize, f16_to_f32, DequantError, GgmlType};
pub use reader::{GgufTensorInfo, MAGIC};
pub use value::{GgufArray, GgufType, GgufValue};

// Limits on what a file may declare. Real files are far below each of them; they exist so a
// hostile header cannot make us loop or allocate without bound before the size checks bite.

/// Most tensors a file may list (a 405B Llama has about 1,100).
pub const MAX_TENSOR_COUNT: u64 = 1 << 16;
/// Most metadata entries (real files have 20–50).
pub const MAX_KV_COUNT: u64 = 1 << 16;
/// Longest metadata key in bytes (the spec's own limit, 2^16 − 1).
pub const MAX_KEY_LEN: u64 = (1 << 16) - 1;
/// Longest metadata string (chat templates are a few KiB).
pub const MAX_STRING_LEN: u64 = 1 << 24;
/// Most elements in one metadata array (vocabularies and merge lists are below 2^18).
pub const MAX_ARRAY_LEN: u64 = 1 << 24;
/// Deepest nesting of metadata arrays.
pub const MAX_ARRAY_DEPTH: usize = 8;
/// Longest tensor name (ggml's own limit is 63 bytes; some tools write longer ones).
pub const MAX_TENSOR_NAME_LEN: u64 = 256;
/// Most dimensions of a tensor (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;
/// Largest `general.alignment` accepted.
pub const MAX_ALIGNMENT: u64 = 1 << 20;
/// Alignment of tensor data when the file does not say (the spec's default).
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// How an architecture stores its attention projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// llama.cpp's converter permuted Q and K rows (weights and biases) for its interleaved
    /// RoPE; Hugging Face Llama uses rotate-half, so we undo it.
    PermutedQk,
    /// Stored in Hugging Face order.
    Plain,
}

/// Architectures whose tensors map one-to-one onto Hugging Face names.
fn layout_of(arch: &str) -> Option<Layout> {
    match arch {
        "llama" => Some(Layout::PermutedQk),
        "qwen2" => Some(Layout::Plain),
        _ => None,
    }
}

/// One tensor as the rest of the runtime sees it.
#[derive(Clone, Debug)]
struct Mapped {
    hf_name: String,
    /// Hugging Face shape: the GGUF dims reversed.
    shape: Vec<usize>,
    /// Index into the GGUF tensor directory.
    index: usize,
    /// `Some(true)` for Q (heads = head_count), `Some(false)` for K (head_count_kv) when the
    /// rows must be un-permuted.
    unpermute: Option<bool>,
}

/// An open GGUF file: its metadata, its tensor directory, and its bytes memory-mapped.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    version: u32,
    alignment: u64,
    data_start: u64,
    metadata: Vec<(String, GgufValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    arch: String,
    mapped: Vec<Mapped>,
    by_hf_name: HashMap<String, usize>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("architecture", &self.arch)
            .field("metadata_entries", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("file_bytes", &self.mmap.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens, memory-maps and validates a GGUF v2 or v3 file.
    ///
    /// Fails on anything malformed ([`ModelError::Format`]), on an architecture other than
    /// `llama` / `qwen2`, and on a tensor type or tensor name we cannot handle
    /// ([`ModelError::Unsupported`]).
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        let len = file.metadata().map_err(|e| ModelError::io(path, e))?.len();
        // Magic, version and the two counts: anything shorter cannot be a GGUF file (and
        // an empty file cannot be mapped on every platform).
        if len < 24 {
            return Err(ModelError::format(
                path,
                format!("{len} bytes is too short for a GGUF header (24 bytes)"),
            ));
        }
        // SAFETY: the map is read-only and no reference into it outlives `self`. As with every
        // memory-mapped file, another process truncating or rewriting the file while we hold it
        // is undefined behaviour: model files must be installed once and then only read
        // (replaced, if ever, by writing a new file and renaming it over the old one).
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let container = reader::parse(&mmap).map_err(|e| match e {
            reader::ParseError::Format(detail) => ModelError::format(path, detail),
            reader::ParseError::Unsupported { what, value } => ModelError::Unsupported {
                what,
                value: format!("{value} in {}", path.display()),
            },
        })?;
        let metadata_index = reader::index_metadata(&container.metadata);
        let mut g = GgufFile {
            path: path.to_path_buf(),
            mmap,
            version: container.version,
            alignment: container.alignment,
            data_start: container.data_start,
            metadata: container.metadata,
            metadata_index,
            tensors: container.tensors,
            arch: String::new(),
            mapped: Vec::new(),
            by_hf_name: HashMap::new(),
        };
        g.arch = g.require_str("general.architecture")?.to_string();
        let layout = layout_of(&g.arch).ok_or_else(|| ModelError::Unsupported {
            what: "GGUF architecture",
            value: format!(
                "{} in {} (supported: llama, qwen2)",
                g.arch,
                g.path.display()
            ),
        })?;
        g.map_tensors(layout)?;
        Ok(g)
    }

    /// The file's path.
    pub fn file_path(&self) -> &Path {
        &self.path
    }

    /// GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of tensor data (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset where the data section starts.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> &str {
        &self.arch
    }

    /// Every metadata entry, in file order.
    pub fn metadata_entries(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    /// One metadata value.
    pub fn metadata(&self, key: &str) -> Option<&GgufValue> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn wrong_type(&self, key: &str, want: &str, v: &GgufValue) -> ModelError {
        ModelError::format(
            &self.path,
            format!("metadata {key}: expected {want}, found {}", v.describe()),
        )
    }

    fn missing(&self, key: &str) -> ModelError {
        ModelError::Config {
            key: key.to_string(),
            detail: format!("missing from GGUF metadata of {}", self.path.display()),
        }
    }

    /// An integer of any width that fits in u64; `Ok(None)` if absent, an error naming the
    /// key if it holds something else.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.metadata(key)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| self.wrong_type(key, "a non-negative integer", v))
            })
            .transpose()
    }

    /// An integer of any width that fits in i64.
    pub fn get_i64(&self, key: &str) -> Result<Option<i64>> {
        self.metadata(key)
            .map(|v| {
                v.as_i64()
                    .ok_or_else(|| self.wrong_type(key, "an integer", v))
            })
            .transpose()
    }

    /// A float (f32 widened exactly) or an integer exactly representable as f64.
    pub fn get_f64(&self, key: &str) -> Result<Option<f64>> {
        self.metadata(key)
            .map(|v| {
                v.as_f64()
                    .ok_or_else(|| self.wrong_type(key, "a number", v))
            })
            .transpose()
    }

    /// A boolean.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        self.metadata(key)
            .map(|v| v.as_bool().ok_or_else(|| self.wrong_type(key, "a bool", v)))
            .transpose()
    }

    /// A string.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        self.metadata(key)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.wrong_type(key, "a string", v))
            })
            .transpose()
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Option<&[String]>> {
        self.metadata(key)
            .map(|v| {
                v.as_array()
                    .and_then(GgufArray::as_strings)
                    .ok_or_else(|| self.wrong_type(key, "an array of strings", v))
            })
            .transpose()
    }

    /// An array of integers of any width, as i64.
    pub fn get_i64_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        self.metadata(key)
            .map(|v| {
                v.as_array()
                    .and_then(GgufArray::to_i64_vec)
                    .ok_or_else(|| self.wrong_type(key, "an array of integers", v))
            })
            .transpose()
    }

    /// An array of floats, widened to f64.
    pub fn get_f64_array(&self, key: &str) -> Result<Option<Vec<f64>>> {
        self.metadata(key)
            .map(|v| {
                v.as_array()
                    .and_then(GgufArray::to_f64_vec)
                    .ok_or_else(|| self.wrong_type(key, "an array of floats", v))
            })
            .transpose()
    }

    /// Like [`get_u64`](Self::get_u64) but absence is a [`ModelError::Config`] error.
    pub fn require_u64(&self, key: &str) -> Result<u64> {
        self.get_u64(key)?.ok_or_else(|| self.missing(key))
    }

    /// Like [`get_str`](Self::get_str) but absence is a [`ModelError::Config`] error.
    pub fn require_str(&self, key: &str) -> Result<&str> {
        self.get_str(key)?.ok_or_else(|| self.missing(key))
    }

    /// The tensor directory, in file order, with GGUF names and dims.
    pub fn gguf_tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// The GGUF directory entry behind a Hugging Face tensor name.
    pub fn gguf_tensor(&self, hf_name: &str) -> Option<&GgufTensorInfo> {
        self.by_hf_name
            .get(hf_name)
            .map(|&i| &self.tensors[self.mapped[i].index])
    }

    /// The raw bytes of a tensor, by GGUF name (for callers that use a GGUF block format
    /// directly instead of converting to f32).
    pub fn tensor_bytes(&self, gguf_name: &str) -> Option<&[u8]> {
        let t = self.tensors.iter().find(|t| t.name == gguf_name)?;
        self.bytes_of(t)
    }

    fn bytes_of(&self, t: &GgufTensorInfo) -> Option<&[u8]> {
        // The range was checked against the file length when the file was opened.
        let start = usize::try_from(t.file_offset).ok()?;
        let end = start.checked_add(usize::try_from(t.n_bytes).ok()?)?;
        self.mmap.get(start..end)
    }

    /// `tokenizer.chat_template`, if the file carries one.
    pub fn chat_template(&self) -> Option<String> {
        self.metadata("tokenizer.chat_template")
            .and_then(GgufValue::as_str)
            .map(str::to_string)
    }

    /// A Hugging Face `tokenizer.json` synthesised from the `tokenizer.ggml.*` metadata.
    ///
    /// Supports `tokenizer.ggml.model == "gpt2"` (byte-level BPE) with the pre-tokenizers
    /// `smollm`, `gpt-2`, `llama-bpe` / `llama3` and `qwen2` (and their llama.cpp aliases);
    /// anything else is [`ModelError::Unsupported`].
    pub fn tokenizer_json(&self) -> Result<String> {
        vocab::tokenizer_json(self)
    }

    fn map_tensors(&mut self, layout: Layout) -> Result<()> {
        let block_count = self.get_u64(&format!("{}.block_count", self.arch))?;
        let mut mapped = Vec::with_capacity(self.tensors.len());
        for (index, t) in self.tensors.iter().enumerate() {
            let (hf_name, qk) = hf_name(&t.name).ok_or_else(|| ModelError::Unsupported {
                what: "GGUF tensor",
                value: format!(
                    "{} in {} (architecture {}): {}",
                    t.name,
                    self.path.display(),
                    self.arch,
                    unmapped_reason(&t.name)
                ),
            })?;
            if let (Some(layer), Some(n)) = (layer_of(&t.name), block_count) {
                if layer >= n {
                    return Err(ModelError::format(
                        &self.path,
                        format!(
                            "tensor {}: layer {layer} but {}.block_count is {n}",
                            t.name, self.arch
                        ),
                    ));
                }
            }
            let shape = t
                .dims
                .iter()
                .rev()
                .map(|&d| usize::try_from(d))
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|_| {
                    ModelError::format(
                        &self.path,
                        format!("tensor {}: dims {:?} too large", t.name, t.dims),
                    )
                })?;
            let unpermute = match layout {
                Layout::PermutedQk => qk,
                Layout::Plain => None,
            };
            mapped.push(Mapped {
                hf_name,
                shape,
                index,
                unpermute,
            });
        }
        self.by_hf_name = mapped
            .iter()
            .enumerate()
            .map(|(i, m)| (m.hf_name.clone(), i))
            .collect();
        self.mapped = mapped;
        Ok(())
    }

    /// Number of heads the Q (`true`) or K (`false`) rows are grouped in.
    fn heads(&self, q: bool) -> Result<u64> {
        let head_count = format!("{}.attention.head_count", self.arch);
        let n_head = self.require_u64(&head_count)?;
        let n = if q {
            n_head
        } else {
            self.get_u64(&format!("{}.attention.head_count_kv", self.arch))?
                .unwrap_or(n_head)
        };
        Ok(n)
    }

    /// A Hugging Face style `config.json` built from the metadata, with the keys of the
    /// reference converter (`shared/fixtures/tools/gguf_to_hf_numpy.py`).
    pub fn hf_config(&self) -> Result<Json> {
        let arch = self.arch.as_str();
        let key = |k: &str| format!("{arch}.{k}");
        let config_err = |k: &str, detail: String| ModelError::Config {
            key: k.to_string(),
            detail: format!("{detail} (in {})", self.path.display()),
        };

        let hidden = self.require_u64(&key("embedding_length"))?;
        let n_head = self.require_u64(&key("attention.head_count"))?;
        let n_kv = self
            .get_u64(&key("attention.head_count_kv"))?
            .unwrap_or(n_head);
        if n_head == 0 || n_kv == 0 || !n_head.is_multiple_of(n_kv) {
            return Err(config_err(
                &key("attention.head_count_kv"),
                format!("{n_kv} kv heads cannot serve {n_head} attention heads"),
            ));
        }
        let head_dim = match self.get_u64(&key("attention.key_length"))? {
            Some(d) => d,
            None if hidden.is_multiple_of(n_head) => hidden / n_head,
            None => {
                return Err(config_err(
                    &key("embedding_length"),
                    format!("{hidden} is not divisible by {n_head} heads"),
                ))
            }
        };
        let intermediate = self.require_u64(&key("feed_forward_length"))?;
        let layers = self.require_u64(&key("block_count"))?;
        let context = self.require_u64(&key("context_length"))?;
        // The reference rounds through f32 (`float(np.float32(eps))`): the value llama.cpp uses.
        let eps_key = key("attention.layer_norm_rms_epsilon");
        let eps = self
            .get_f64(&eps_key)?
            .ok_or_else(|| self.missing(&eps_key))? as f32;
        let rope_theta = self.get_f64(&key("rope.freq_base"))?.unwrap_or(10000.0);
        if let Some(kind) = self.get_str(&key("rope.scaling.type"))? {
            if kind != "none" {
                return Err(ModelError::Unsupported {
                    what: "RoPE scaling",
                    value: format!("{kind} in {}", self.path.display()),
                });
            }
        }
        let embed = self
            .by_hf_name
            .get("model.embed_tokens.weight")
            .map(|&i| &self.mapped[i])
            .ok_or_else(|| ModelError::MissingTensor {
                name: "model.embed_tokens.weight (token_embd.weight)".into(),
                path: self.path.clone(),
            })?;
        let vocab = embed.shape[0];
        if embed.shape.len() != 2 || embed.shape[1] as u64 != hidden {
            return Err(ModelError::Shape {
                name: embed.hf_name.clone(),
                expected: vec![vocab, hidden as usize],
                got: embed.shape.clone(),
            });
        }
        let tied = !self.by_hf_name.contains_key("lm_head.weight");
        let token_id = |k: &str| -> Result<Json> {
            Ok(match self.get_u64(k)? {
                Some(v) => json!(v),
                None => Json::Null,
            })
        };

        let mut cfg = json!({
            "architectures": [if arch == "llama" { "LlamaForCausalLM" } else { "Qwen2ForCausalLM" }],
            "model_type": arch,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": intermediate,
            "num_hidden_layers": layers,
            "num_attention_heads": n_head,
            "num_key_value_heads": n_kv,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": context,
            "rms_norm_eps": f64::from(eps),
            "rope_theta": rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
            "tie_word_embeddings": tied,
            "bos_token_id": token_id("tokenizer.ggml.bos_token_id")?,
            "eos_token_id": token_id("tokenizer.ggml.eos_token_id")?,
            "torch_dtype": "float32",
            "dtype": "float32",
        });
        if let Some(obj) = cfg.as_object_mut() {
            if arch == "llama" {
                // llama-architecture files may carry q/k/v biases (the converter writes them
                // when the checkpoint has them); SmolLM2 and Llama do not.
                let bias = self
                    .by_hf_name
                    .contains_key("model.layers.0.self_attn.q_proj.bias");
                obj.insert("attention_bias".into(), json!(bias));
                obj.insert("mlp_bias".into(), json!(false));
            } else {
                obj.insert("use_sliding_window".into(), json!(false));
                obj.insert("sliding_window".into(), Json::Null);
            }
        }
        Ok(cfg)
    }
}

impl TensorSource for GgufFile {
    fn tensors(&self) -> Vec<TensorInfo> {
        self.mapped
            .iter()
            .map(|m| TensorInfo {
                name: m.hf_name.clone(),
                shape: m.shape.clone(),
            })
            .collect()
    }

    fn info(&self, name: &str) -> Option<TensorInfo> {
        self.by_hf_name.get(name).map(|&i| TensorInfo {
            name: self.mapped[i].hf_name.clone(),
            shape: self.mapped[i].shape.clone(),
        })
    }

    fn load_row_table(&self, name: &str) -> Result<RowTable> {
        let (rows, cols) = table_shape(self, name)?;
        let m = self.by_hf_name.get(name).map(|&i| &self.mapped[i]);
        // Un-permuted tensors (Q and K) move rows about: those come as f32.
        if let Some(m) = m.filter(|m| m.unpermute.is_none()) {
            let t = &self.tensors[m.index];
            if let Some(bytes) = self.bytes_of(t) {
                let encoding = RowEncoding::Ggml(t.ggml_type);
                if let Some(table) = RowTable::encoded(encoding, bytes.to_vec(), rows, cols) {
                    return Ok(table);
                }
            }
        }
        RowTable::from_f32(self.load_f32(name)?, rows, cols)
    }

    fn load_f32(&self, name: &str) -> Result<Vec<f32>> {
        let m = self
            .by_hf_name
            .get(name)
            .map(|&i| &self.mapped[i])
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                path: self.path.clone(),
            })?;
        let t = &self.tensors[m.index];
        if !t.ggml_type.can_dequantize() {
            return Err(ModelError::Unsupported {
                what: "GGML tensor type",
                value: format!(
                    "{} (tensor {} in {})",
                    t.ggml_type,
                    t.name,
                    self.path.display()
                ),
            });
        }
        let bytes = self.bytes_of(t).ok_or_else(|| {
            ModelError::format(
                &self.path,
                format!("tensor {}: data range not addressable", t.name),
            )
        })?;
        // Opening checked numel against the file size, so this allocation is bounded by it.
        let numel = usize::try_from(t.numel()).map_err(|_| {
            ModelError::format(&self.path, format!("tensor {}: too many elements", t.name))
        })?;
        let mut out = vec![0f32; numel];
        dequantize(t.ggml_type, bytes, &mut out)
            .map_err(|e| ModelError::format(&self.path, format!("tensor {}: {e}", t.name)))?;
        if let Some(q) = m.unpermute {
            let heads = self.heads(q)?;
            out = unpermute_rows(&out, &m.shape, heads).map_err(|detail| ModelError::Config {
                key: format!(
                    "{}.attention.{}",
                    self.arch,
                    if q { "head_count" } else { "head_count_kv" }
                ),
                detail: format!("tensor {}: {detail}", t.name),
            })?;
        }
        Ok(out)
    }

    fn path(&self) -> &Path {
        &self.path
    }
}

/// Undoes llama.cpp's Q/K permutation on a tensor of Hugging Face shape `[rows, cols…]`
/// (a bias is `[rows]`): `w.reshape(n_head, rows/n_head/2, 2, cols).swapaxes(1, 2)
/// .reshape(rows, cols)`. Output row `h·2·half + j·half + i` is input row
/// `h·2·half + 2·i + j` (i < half, j < 2). A pure row gather: no value changes.
pub fn unpermute_rows(
    w: &[f32],
    shape: &[usize],
    n_head: u64,
) -> std::result::Result<Vec<f32>, String> {
    let rows = shape.first().copied().unwrap_or(0);
    let cols: usize = shape.iter().skip(1).product();
    let n_head = usize::try_from(n_head).map_err(|_| format!("{n_head} heads"))?;
    if n_head == 0 || !rows.is_multiple_of(2 * n_head) {
        return Err(format!(
            "{rows} rows cannot be split into {n_head} heads of row pairs"
        ));
    }
    if w.len() != rows * cols {
        return Err(format!("{} values for shape {shape:?}", w.len()));
    }
    let half = rows / n_head / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..n_head {
        for j in 0..2 {
            for i in 0..half {
                let dst = h * 2 * half + j * half + i;
                let src = h * 2 * half + 2 * i + j;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    Ok(out)
}

/// The layer number of a `blk.N.…` name.
fn layer_of(name: &str) -> Option<u64> {
    let rest = name.strip_prefix("blk.")?;
    let (n, _) = rest.split_once('.')?;
    parse_layer(n)
}

/// A decimal layer number without sign or leading zeros (so each layer has one spelling).
fn parse_layer(n: &str) -> Option<u64> {
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) || (n.len() > 1 && n.starts_with('0'))
    {
        return None;
    }
    n.parse().ok()
}

/// The Hugging Face name of a llama.cpp tensor name, and whether it is a Q (`Some(true)`) or
/// K (`Some(false)`) projection that the llama converter permutes.
fn hf_name(gguf: &str) -> Option<(String, Option<bool>)> {
    match gguf {
        "token_embd.weight" => return Some(("model.embed_tokens.weight".into(), None)),
        "output_norm.weight" => return Some(("model.norm.weight".into(), None)),
        "output.weight" => return Some(("lm_head.weight".into(), None)),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (n, tail) = rest.split_once('.')?;
    let layer = parse_layer(n)?;
    let (hf, qk) = match tail {
        "attn_norm.weight" => ("input_layernorm.weight", None),
        "ffn_norm.weight" => ("post_attention_layernorm.weight", None),
        "attn_q.weight" => ("self_attn.q_proj.weight", Some(true)),
        "attn_q.bias" => ("self_attn.q_proj.bias", Some(true)),
        "attn_k.weight" => ("self_attn.k_proj.weight", Some(false)),
        "attn_k.bias" => ("self_attn.k_proj.bias", Some(false)),
        "attn_v.weight" => ("self_attn.v_proj.weight", None),
        "attn_v.bias" => ("self_attn.v_proj.bias", None),
        "attn_output.weight" => ("self_attn.o_proj.weight", None),
        "ffn_gate.weight" => ("mlp.gate_proj.weight", None),
        "ffn_up.weight" => ("mlp.up_proj.weight", None),
        "ffn_down.weight" => ("mlp.down_proj.weight", None),
        _ => return None,
    };
    Some((format!("model.layers.{layer}.{hf}"), qk))
}

/// Why a tensor name has no Hugging Face equivalent, for the error message.
fn unmapped_reason(name: &str) -> &'static str {
    if name == "rope_freqs.weight" {
        "per-dimension RoPE frequency factors (llama3-style RoPE scaling) are not supported"
    } else if name.contains("_norm") && name.starts_with("blk.") {
        "a normalisation this runtime's llama/qwen2 blocks do not have (e.g. Q/K norm)"
    } else {
        "no Hugging Face equivalent in the llama/qwen2 name map"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_like_the_reference_converter() {
        assert_eq!(
            hf_name("blk.12.attn_q.bias"),
            Some(("model.layers.12.self_attn.q_proj.bias".into(), Some(true)))
        );
        assert_eq!(
            hf_name("blk.0.ffn_down.weight"),
            Some(("model.layers.0.mlp.down_proj.weight".into(), None))
        );
        assert_eq!(hf_name("blk.01.ffn_down.weight"), None);
        assert_eq!(hf_name("blk.-1.ffn_down.weight"), None);
        assert_eq!(hf_name("blk.1.attn_q_norm.weight"), None);
        assert_eq!(hf_name("rope_freqs.weight"), None);
    }

    #[test]
    fn unpermute_matches_the_index_formula_and_inverts_the_converter() {
        // 2 heads × 6 rows, 3 columns; values encode (row, col).
        let (heads, rows, cols) = (2usize, 12usize, 3usize);
        let w: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let out = unpermute_rows(&w, &[rows, cols], heads as u64).unwrap();
        // llama.cpp's converter: permute(w) = w.reshape(h, 2, half, c).swapaxes(1, 2).
        let half = rows / heads / 2;
        let mut permuted = vec![0f32; w.len()];
        for h in 0..heads {
            for i in 0..half {
                for j in 0..2 {
                    let dst = h * 2 * half + 2 * i + j; // (h, i, j) after swapaxes
                    let src = h * 2 * half + j * half + i; // (h, j, i) before
                    for c in 0..cols {
                        permuted[dst * cols + c] = w[src * cols + c];
                    }
                }
            }
        }
        let back = unpermute_rows(&permuted, &[rows, cols], heads as u64).unwrap();
        assert_eq!(back, w);
        assert_ne!(out, w);
        assert!(unpermute_rows(&w, &[rows, cols], 5).is_err());
        assert!(unpermute_rows(&w, &[rows, cols], 0).is_err());
    }
}
