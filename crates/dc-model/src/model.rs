//! A loaded model and its forward pass, cut into the pieces the swarm runs separately:
//! [`Model::embed`], [`Model::run_layers`] over any contiguous layer range with that range's
//! [`KvCache`], and [`Model::readout`].
//!
//! Every row (position) is computed independently except inside attention, and attention reads
//! the cache only through exact products, so splitting the layers, chunking the prefill or
//! decoding token by token never changes a bit (tested in `tests/exactness.rs`).

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use dc_kernels::elementwise::{gelu_tanh, layer_norm, rms_norm, silu, RopeTable};
use dc_kernels::{Commitment, Domain, Gemm, QuantizedRows};

use crate::attention::{attend_committed, AttentionShape, LayerCache};
use crate::config::{Arch, ModelConfig};
use crate::error::{ModelError, Result};
use crate::hf::{read_json, SafetensorsSource};
use crate::source::TensorSource;
use crate::trace::{HopTrace, Point};
use crate::weight_cache::WeightCache;
use crate::weights::{check_range, load_head, load_layer, Head, Layer, Mlp, Norm};

/// Activations crossing a stage boundary: `rows` consecutive positions starting at `start`,
/// each a `hidden`-wide f32 row.
#[derive(Clone, Debug, PartialEq)]
pub struct Activations {
    /// Absolute position of the first row.
    pub start: usize,
    /// Width of a row.
    pub hidden: usize,
    /// Row-major values, `rows × hidden`.
    pub data: Vec<f32>,
}

impl Activations {
    /// Number of rows (positions).
    pub fn rows(&self) -> usize {
        self.data.len() / self.hidden.max(1)
    }

    /// The positions covered.
    pub fn positions(&self) -> Range<usize> {
        self.start..self.start + self.rows()
    }

    /// The last row.
    pub fn last_row(&self) -> Activations {
        let r = self.rows();
        Activations {
            start: self.start + r - 1,
            hidden: self.hidden,
            data: self.data[(r - 1) * self.hidden..].to_vec(),
        }
    }

    /// The rows at positions `from..` (all rows if `from` is before the first).
    pub fn rows_from(&self, from: usize) -> Activations {
        let skip = from.saturating_sub(self.start).min(self.rows());
        Activations {
            start: self.start + skip,
            hidden: self.hidden,
            data: self.data[skip * self.hidden..].to_vec(),
        }
    }

    /// Canonical commitment to the activations (position, width, little-endian f32 bytes).
    pub fn commitment(&self) -> Commitment {
        let mut bytes = Vec::with_capacity(16 + self.data.len() * 4);
        bytes.extend_from_slice(&(self.start as u64).to_le_bytes());
        bytes.extend_from_slice(&(self.hidden as u64).to_le_bytes());
        for v in &self.data {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        Domain::Activations.hash(&bytes)
    }

    /// Refuses NaN and infinities, naming where they are.
    pub fn check_finite(&self, stage: &str, layer: &str) -> Result<()> {
        if let Some(i) = self.data.iter().position(|v| !v.is_finite()) {
            return Err(ModelError::NonFinite {
                stage: stage.into(),
                layer: layer.into(),
                detail: format!(
                    "value {} at position {}, channel {}",
                    self.data[i],
                    self.start + i / self.hidden,
                    i % self.hidden
                ),
            });
        }
        Ok(())
    }
}

/// The KV cache of one stage for one generation: one [`LayerCache`] per layer of the range.
#[derive(Clone, Debug)]
pub struct KvCache {
    layers: Range<usize>,
    caches: Vec<LayerCache>,
}

impl KvCache {
    /// An empty cache for `layers` of a model.
    pub fn new(cfg: &ModelConfig, layers: Range<usize>) -> KvCache {
        KvCache {
            caches: layers
                .clone()
                .map(|_| LayerCache::new(cfg.num_kv_heads, cfg.head_dim))
                .collect(),
            layers,
        }
    }

    /// Positions held (the same in every layer).
    pub fn len(&self) -> usize {
        self.caches.first().map_or(0, LayerCache::len)
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.caches.iter().map(LayerCache::bytes).sum()
    }

    /// The layers this cache serves.
    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// A copy of the caches of `layers` (a sub-range of ours).
    pub fn sub(&self, layers: Range<usize>) -> Option<KvCache> {
        if layers.start < self.layers.start || layers.end > self.layers.end || layers.is_empty() {
            return None;
        }
        let a = layers.start - self.layers.start;
        Some(KvCache {
            caches: self.caches[a..a + layers.len()].to_vec(),
            layers,
        })
    }
}

/// What to load.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// The layers to load (a stage's range).
    pub layers: Option<Range<usize>>,
    /// Whether to load the head weights (embeddings, final norm, output projection).
    pub head: bool,
    /// The data directory whose weight cache to use (`None`: quantise without caching).
    pub cache_in: Option<PathBuf>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            layers: None,
            head: true,
            cache_in: None,
        }
    }
}

/// A model (or the part of it one stage serves), ready to run.
pub struct Model {
    /// The configuration.
    pub config: ModelConfig,
    path: PathBuf,
    layers: BTreeMap<usize, Layer>,
    head: Option<Head>,
    rope: Option<RopeTable>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("path", &self.path)
            .field("arch", &self.config.arch)
            .field("layers", &self.layers.keys().collect::<Vec<_>>())
            .field("head", &self.head.is_some())
            .finish()
    }
}

/// Opens a model's tensors and configuration: a Hugging Face folder or a GGUF file.
pub fn open_source(path: &Path) -> Result<(ModelConfig, Box<dyn TensorSource>)> {
    if path.is_dir() {
        let cfg = ModelConfig::from_hf_json(&read_json(&path.join("config.json"))?)?;
        let src = SafetensorsSource::open_dir(path)?;
        Ok((cfg, Box::new(src)))
    } else if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        open_gguf(path)
    } else {
        Err(ModelError::Input(format!(
            "{}: expected a Hugging Face folder (with config.json) or a .gguf file",
            path.display()
        )))
    }
}

/// Opens a GGUF file: its metadata becomes a Hugging Face style configuration.
fn open_gguf(path: &Path) -> Result<(ModelConfig, Box<dyn TensorSource>)> {
    let g = crate::gguf::GgufFile::open(path)?;
    let cfg = ModelConfig::from_hf_json(&g.hf_config()?)?;
    Ok((cfg, Box::new(g)))
}

impl Model {
    /// Loads the layers and head weights `opts` asks for.
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Model> {
        let (config, src) = open_source(path)?;
        let cache = match &opts.cache_in {
            Some(data_dir) => Some(WeightCache::for_model(path, data_dir)?),
            None => None,
        };
        Self::from_source_cached(config, src.as_ref(), cache.as_ref(), opts)
    }

    /// Loads from an already opened source (without the weight cache).
    pub fn from_source(
        config: ModelConfig,
        src: &dyn TensorSource,
        opts: &LoadOptions,
    ) -> Result<Model> {
        Self::from_source_cached(config, src, None, opts)
    }

    /// Loads from an already opened source, packings through `cache` when given.
    pub fn from_source_cached(
        config: ModelConfig,
        src: &dyn TensorSource,
        cache: Option<&WeightCache>,
        opts: &LoadOptions,
    ) -> Result<Model> {
        let range = opts.layers.clone().unwrap_or(0..config.num_layers);
        check_range(&config, &range)?;
        let progress = crate::progress::bar(
            range.len() as u64 + opts.head as u64,
            "loading and quantising",
        );
        let mut layers = BTreeMap::new();
        for i in range {
            layers.insert(i, load_layer(&config, src, cache, i)?);
            progress.inc(1);
        }
        let head = if opts.head {
            let h = load_head(&config, src, cache)?;
            progress.inc(1);
            Some(h)
        } else {
            None
        };
        progress.finish_and_clear();
        let rope = match config.arch {
            Arch::Gpt2 => None,
            _ => Some(RopeTable::new(
                config.head_dim,
                config.rope_theta,
                config.max_positions,
            )),
        };
        Ok(Model {
            path: src.path().to_path_buf(),
            config,
            layers,
            head,
            rope,
        })
    }

    /// The layers loaded.
    pub fn loaded_layers(&self) -> Vec<usize> {
        self.layers.keys().copied().collect()
    }

    /// Whether the head weights are loaded.
    pub fn has_head(&self) -> bool {
        self.head.is_some()
    }

    fn head(&self) -> Result<&Head> {
        self.head
            .as_ref()
            .ok_or_else(|| ModelError::Input("this stage does not hold the head weights".into()))
    }

    /// Token embeddings (plus learned positions) for `tokens` at positions `start..`.
    pub fn embed(&self, tokens: &[u32], start: usize) -> Result<Activations> {
        let head = self.head()?;
        let h = self.config.hidden_size;
        if tokens.is_empty() {
            return Err(ModelError::Input("no tokens to embed".into()));
        }
        if start + tokens.len() > self.config.max_positions {
            return Err(ModelError::Input(format!(
                "{} tokens from position {start} exceed the model's {} positions",
                tokens.len(),
                self.config.max_positions
            )));
        }
        let mut data = Vec::with_capacity(tokens.len() * h);
        for (i, &t) in tokens.iter().enumerate() {
            let t = t as usize;
            if t >= self.config.vocab_size {
                return Err(ModelError::Input(format!(
                    "token id {t} is out of range (vocabulary of {})",
                    self.config.vocab_size
                )));
            }
            let row = &head.embed[t * h..(t + 1) * h];
            match &head.positions {
                Some(p) => {
                    let pos = &p[(start + i) * h..(start + i + 1) * h];
                    data.extend(row.iter().zip(pos).map(|(a, b)| a + b));
                }
                None => data.extend_from_slice(row),
            }
        }
        Ok(Activations {
            start,
            hidden: h,
            data,
        })
    }

    /// Runs the layers of `cache.layers()` over `x`, appending the new positions to `cache`.
    /// `x` must start exactly where the cache ends.
    pub fn run_layers(
        &self,
        gemm: &Gemm,
        x: Activations,
        cache: &mut KvCache,
    ) -> Result<Activations> {
        self.run_layers_traced(gemm, x, cache, None)
    }

    /// [`Model::run_layers`], also recording every commitment of the hop into `trace`.
    pub fn run_layers_traced(
        &self,
        gemm: &Gemm,
        x: Activations,
        cache: &mut KvCache,
        mut trace: Option<&mut HopTrace>,
    ) -> Result<Activations> {
        let range = cache.layers();
        let stage = format!("layers {}..{}", range.start, range.end);
        if x.hidden != self.config.hidden_size
            || !x.data.len().is_multiple_of(x.hidden)
            || x.data.is_empty()
        {
            return Err(ModelError::Input(format!(
                "{stage}: activations of {} values are not rows of width {}",
                x.data.len(),
                self.config.hidden_size
            )));
        }
        if x.start != cache.len() {
            return Err(ModelError::Input(format!(
                "{stage}: activations start at position {} but the cache holds {} positions",
                x.start,
                cache.len()
            )));
        }
        if x.start + x.rows() > self.config.max_positions {
            return Err(ModelError::Input(format!(
                "{stage}: positions up to {} exceed the model's {}",
                x.start + x.rows(),
                self.config.max_positions
            )));
        }
        x.check_finite(&stage, &format!("{} (input)", range.start))?;
        let mut x = x;
        for (ci, i) in range.clone().enumerate() {
            let layer = self.layers.get(&i).ok_or_else(|| {
                ModelError::Input(format!("layer {i} is not loaded in this stage"))
            })?;
            if let Some(t) = trace.as_deref_mut() {
                t.push(i, Point::Input, x.rows_from(t.from).commitment());
            }
            x = self.block(
                gemm,
                layer,
                i,
                x,
                &mut cache.caches[ci],
                trace.as_deref_mut(),
            )?;
            x.check_finite(&stage, &i.to_string())?;
        }
        if let Some(t) = trace {
            t.push(
                range.end - 1,
                Point::Output,
                x.rows_from(t.from).commitment(),
            );
        }
        Ok(x)
    }

    fn norm(&self, n: &Norm, x: &[f32]) -> Vec<f32> {
        let h = self.config.hidden_size;
        let mut out = vec![0f32; x.len()];
        for (o, r) in out.chunks_exact_mut(h).zip(x.chunks_exact(h)) {
            match &n.bias {
                Some(b) => layer_norm(r, &n.weight, b, self.config.norm_eps, o),
                None => rms_norm(r, &n.weight, self.config.norm_eps, o),
            }
        }
        out
    }

    /// One transformer block.
    #[allow(clippy::too_many_arguments)]
    fn block(
        &self,
        gemm: &Gemm,
        l: &Layer,
        i: usize,
        x: Activations,
        cache: &mut LayerCache,
        mut trace: Option<&mut HopTrace>,
    ) -> Result<Activations> {
        let cfg = &self.config;
        let (rows, start) = (x.rows(), x.start);
        let name = |what: &str| format!("layer {i} {what}");
        let first = trace.as_deref().map(|t| (start, t.from));
        let mut record = |p: Point, c: Option<Commitment>| {
            if let (Some(t), Some(c)) = (trace.as_deref_mut(), c) {
                t.push(i, p, c);
            }
        };
        // Attention.
        let h1 = self.norm(&l.attn_norm, &x.data);
        let qx = QuantizedRows::quantize(&h1, rows, cfg.hidden_size, &name("attention input"))?;
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        record(Point::Q, l.q.forward_committed(gemm, &qx, &mut q, first)?);
        record(Point::K, l.k.forward_committed(gemm, &qx, &mut k, first)?);
        record(Point::V, l.v.forward_committed(gemm, &qx, &mut v, first)?);
        if let Some(rope) = &self.rope {
            let hd = cfg.head_dim;
            for (t, row) in q.chunks_exact_mut(cfg.q_width()).enumerate() {
                for head in row.chunks_exact_mut(hd) {
                    rope.apply(head, start + t);
                }
            }
            for (t, row) in k.chunks_exact_mut(cfg.kv_width()).enumerate() {
                for head in row.chunks_exact_mut(hd) {
                    rope.apply(head, start + t);
                }
            }
        }
        cache.append(&k, &v)?;
        let mut ctx = vec![0f32; rows * cfg.q_width()];
        let shape = AttentionShape {
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            window: cfg.sliding_window,
        };
        let att = gemm.install(|| {
            attend_committed(shape, cache, &q, start, &mut ctx, i, first.map(|f| f.1))
        })?;
        record(Point::Scores, att.map(|a| a.scores));
        record(Point::Context, att.map(|a| a.context));
        let qc = QuantizedRows::quantize(&ctx, rows, cfg.q_width(), &name("attention context"))?;
        let mut o = Vec::new();
        record(Point::O, l.o.forward_committed(gemm, &qc, &mut o, first)?);
        let mut x = x;
        for (a, b) in x.data.iter_mut().zip(&o) {
            *a += b;
        }
        // MLP.
        let h2 = self.norm(&l.mlp_norm, &x.data);
        let qh = QuantizedRows::quantize(&h2, rows, cfg.hidden_size, &name("mlp input"))?;
        let mut y = Vec::new();
        match &l.mlp {
            Mlp::Gelu { fc, proj } => {
                let mut a = Vec::new();
                record(Point::Fc, fc.forward_committed(gemm, &qh, &mut a, first)?);
                for v in a.iter_mut() {
                    *v = gelu_tanh(*v);
                }
                let qa =
                    QuantizedRows::quantize(&a, rows, cfg.intermediate_size, &name("mlp hidden"))?;
                record(
                    Point::Down,
                    proj.forward_committed(gemm, &qa, &mut y, first)?,
                );
            }
            Mlp::SwiGlu { gate, up, down } => {
                let (mut g, mut u) = (Vec::new(), Vec::new());
                record(
                    Point::Gate,
                    gate.forward_committed(gemm, &qh, &mut g, first)?,
                );
                record(Point::Up, up.forward_committed(gemm, &qh, &mut u, first)?);
                for (a, b) in g.iter_mut().zip(&u) {
                    *a = silu(*a) * b;
                }
                let qa =
                    QuantizedRows::quantize(&g, rows, cfg.intermediate_size, &name("mlp hidden"))?;
                record(
                    Point::Down,
                    down.forward_committed(gemm, &qa, &mut y, first)?,
                );
            }
        }
        for (a, b) in x.data.iter_mut().zip(&y) {
            *a += b;
        }
        Ok(x)
    }

    /// Final norm and output projection: logits for every row, `rows × vocab`.
    pub fn readout(&self, gemm: &Gemm, x: &Activations) -> Result<Vec<f32>> {
        let head = self.head()?;
        x.check_finite("readout", "final norm input")?;
        let h = self.norm(&head.final_norm, &x.data);
        let qh =
            QuantizedRows::quantize(&h, x.rows(), self.config.hidden_size, "final norm output")?;
        let mut logits = vec![0f32; x.rows() * self.config.vocab_size];
        gemm.matmul(&qh, &head.lm_head, &mut logits)?;
        Ok(logits)
    }

    /// The file or folder the model was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}
