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
use std::sync::Arc;

use dc_kernels::elementwise::{gelu_tanh, layer_norm, rms_norm, silu_mul, RopeTable};
use dc_kernels::verify::commit::LeafBatch;
use dc_kernels::{Commitment, Gemm, KernelError, QuantizedRows};

use crate::activations::Activations;
use crate::attention::{
    attend_with, queue_cache_rows, AttentionKernel, AttentionShape, LayerCache,
};
use crate::config::{Arch, ModelConfig};
use crate::error::{ModelError, Result};
use crate::kv_cache::KvCache;
use crate::open::open_source;
use crate::source::TensorSource;
use crate::stream::{LayerRef, Streamed};
use crate::trace::{HopTrace, Point};
use crate::verify::kept::{Kept, KeptHop, KeptLayer};
use crate::weight_cache::WeightCache;
use crate::weights::{
    check_range, load_head, load_layer, Head, KeptProduct, Layer, Mlp, Norm, RowLeaves,
};

/// Where a block's products come from: run on the weights (a stage), or revealed by a stage
/// and checked (a spot check). The glue between them is the same code either way, so a check
/// recomputes exactly what the stage computed.
pub(crate) trait Products {
    /// `x · W (+ bias)` of the weight product at `point`, into `out`.
    fn linear(&mut self, point: Point, x: &QuantizedRows, out: &mut Vec<f32>) -> Result<()>;
    /// The attention context (`rows × q_width`) of rows at `start..` from their projections
    /// (RoPE applied), the keys and values going into the cache first.
    fn attention(&mut self, q: &[f32], k: &[f32], v: &[f32], start: usize) -> Result<Vec<f32>>;
    /// The rows the next product takes, quantised, from `derived` (what the glue made of the
    /// products before it): the attention context as the output projection takes it
    /// (`Point::Context`) or the MLP's hidden rows as the down projection does
    /// (`Point::Hidden`). A stage commits them; a check tests the derived rows against the
    /// commitment when it tested what made them, and otherwise hands on the committed rows.
    fn quantized(&mut self, point: Point, derived: QuantizedRows) -> Result<QuantizedRows>;
    /// Whether the rest of the block is still wanted (a check stops once it has tested every
    /// part it drew; a stage never stops).
    fn more(&self) -> bool {
        true
    }
    /// What `quantized(point, …)` would hand on, `rows × k`, when it is certain before the
    /// glue derives anything there: a check that tests nothing from the block's start (for
    /// `Point::Context`) or from the MLP's input (for `Point::Hidden`) up to `point` takes the
    /// committed rows, or a stand-in nothing tested reads. The glue then skips deriving them:
    /// on a check of the down projection alone, the MLP's activation of stand-in first
    /// products was a quarter of the work. A stage always derives.
    fn instead_of_deriving(
        &mut self,
        _point: Point,
        _rows: usize,
        _k: usize,
    ) -> Option<QuantizedRows> {
        None
    }
}

/// A block's parameters outside its products: the norms and the MLP's kind.
pub(crate) struct Glue<'a> {
    pub attn_norm: &'a Norm,
    pub mlp_norm: &'a Norm,
    pub gelu: bool,
}

impl Glue<'_> {
    fn of(l: &Layer) -> Glue<'_> {
        Glue {
            attn_norm: &l.attn_norm,
            mlp_norm: &l.mlp_norm,
            gelu: matches!(l.mlp, Mlp::Gelu { .. }),
        }
    }
}

/// A stage's products: run on its weights and cache, committed into the trace and kept for
/// reveals when asked.
struct Compute<'a> {
    model: &'a Model,
    gemm: &'a Gemm,
    layer: &'a Layer,
    index: usize,
    cache: &'a mut LayerCache,
    /// `(first row's position, first committed position)` when committing.
    first: Option<(usize, usize)>,
    trace: Option<&'a mut HopTrace>,
    keep: Option<&'a mut KeptLayer>,
    /// Every leaf the layer commits (its products', cache rows' and attention rows'), hashed
    /// together while the next layer computes ([`QueuedLayer`]): a decode step's rows are too
    /// short to hash well one by one. Two batches take turns over a hop's layers, so their
    /// buffers are allocated once.
    batch: &'a mut LeafBatch,
    /// Per queued set, its trace entry and, when keeping, its place among the kept.
    queued: Vec<(usize, Option<usize>)>,
}

impl Compute<'_> {
    /// Records `point`'s entry for the set just queued, its commitment to come when the layer's
    /// leaves are hashed; `keep` keeps its parts when the stage keeps the hop and says where.
    fn queue_entry(&mut self, point: Point, keep: impl FnOnce(&mut KeptLayer) -> Option<usize>) {
        let Some(t) = self.trace.as_deref_mut() else {
            return;
        };
        t.push(self.index, point, Commitment::default());
        let entry = t.entries.len() - 1;
        let kept = self.keep.as_deref_mut().and_then(keep);
        self.queued.push((entry, kept));
    }

    /// Queues the commitment of the layer's input `x`, from the trace's first position on
    /// (what [`Activations::commitment`] of those rows gives), as its trace entry.
    fn queue_input(&mut self, x: &Activations) {
        let Some(t) = self.trace.as_deref() else {
            return;
        };
        let skip = t.from.saturating_sub(x.start).min(x.rows());
        self.batch
            .activations(x.start + skip, x.hidden, &x.data[skip * x.hidden..]);
        self.queue_entry(Point::Input, |_| None);
    }
}

/// A layer whose leaves are queued in its batch, to be hashed while the next layer computes.
struct QueuedLayer {
    /// Per queued set, its trace entry and, when keeping, its place among the kept.
    sets: Vec<(usize, Option<usize>)>,
    /// Whether the batch is worth the engine's threads: a prefill's rows are; a decode step's
    /// dozen messages (one per product, cache and attention row, and the layer's input) are
    /// not: split between threads they fill the lanes half as well, for a hand-off that costs
    /// about what it saves.
    many: bool,
    kept: Option<KeptLayer>,
}

impl QueuedLayer {
    /// Puts each set's commitment into its trace entry and its leaves with what was kept of
    /// it, then the kept layer into the hop (`hashed`: `None` when nothing was queued).
    fn record(
        mut self,
        hashed: Option<dc_kernels::verify::commit::FinishedSets>,
        trace: Option<&mut HopTrace>,
        keep: Option<&mut KeptHop>,
    ) {
        if let Some(done) = hashed {
            let mut trace = trace;
            for (set, &(entry, kept)) in self.sets.iter().enumerate() {
                if let Some(t) = trace.as_deref_mut() {
                    t.entries[entry].commitment = done.commitments[set];
                }
                if let (Some(k), Some(at)) = (self.kept.as_mut(), kept) {
                    k.set_leaves(at, done.leaves_of(set));
                }
            }
        }
        if let (Some(k), Some(l)) = (keep, self.kept) {
            k.layers.push(l);
        }
    }
}

impl Products for Compute<'_> {
    fn linear(&mut self, point: Point, x: &QuantizedRows, out: &mut Vec<f32>) -> Result<()> {
        let lin = self.layer.linear(point).ok_or_else(|| {
            ModelError::Input(format!("layer {} has no {point:?} product", self.index))
        })?;
        let keep = self.keep.is_some();
        // `first` is there exactly when the hop is traced.
        let Some(at) = self.first else {
            return lin
                .forward_queued(self.gemm, x, out, None, false)
                .map(|_| ());
        };
        if !point.output_committed() {
            // Products that commit through the row the next glue step makes of them (k and v
            // the cache row, the MLP's first products the hidden row); a stage keeping the hop
            // keeps their accumulators to reveal (and a check to test) them.
            let acc = lin.forward_queued(self.gemm, x, out, None, keep)?;
            if let (Some(k), Some(acc)) = (self.keep.as_deref_mut(), acc) {
                k.keep(point, Kept::Source(acc));
            }
            return Ok(());
        }
        let acc = lin.forward_queued(self.gemm, x, out, Some((at, &mut *self.batch)), keep)?;
        self.queue_entry(point, |k| {
            acc.map(|acc| {
                k.keep(
                    point,
                    Kept::Gemm(KeptProduct {
                        acc,
                        leaves: RowLeaves::default(),
                    }),
                )
            })
        });
        Ok(())
    }

    fn quantized(&mut self, point: Point, derived: QuantizedRows) -> Result<QuantizedRows> {
        let Some((start, from)) = self.first else {
            return Ok(derived);
        };
        self.batch.queue_quantized(&derived, start, from);
        let k = derived.k();
        let skip = from.saturating_sub(start).min(derived.rows());
        self.queue_entry(point, |kept| {
            let row_bytes = QuantizedRows::encoded_row_bytes(k);
            let mut rows = Vec::with_capacity((derived.rows() - skip) * row_bytes);
            for r in skip..derived.rows() {
                derived.encode_row(r, &mut rows);
            }
            debug_assert_eq!(rows.len(), (derived.rows() - skip) * row_bytes);
            Some(kept.keep(
                point,
                Kept::Leaves {
                    cols: k,
                    leaves: RowLeaves::default(),
                    rows,
                    row_bytes,
                },
            ))
        });
        Ok(derived)
    }

    fn attention(&mut self, q: &[f32], k: &[f32], v: &[f32], start: usize) -> Result<Vec<f32>> {
        let cfg = &self.model.config;
        self.cache.append(k, v)?;
        let mut ctx = vec![0f32; q.len()];
        let shape = AttentionShape {
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            window: cfg.sliding_window,
        };
        let (cache, index) = (&*self.cache, self.index);
        let kernel = AttentionKernel::Fast;
        self.gemm
            .install(|| attend_with(kernel, shape, cache, q, start, &mut ctx, index))?;
        let Some((_, from)) = self.first else {
            return Ok(ctx);
        };
        // The cache rows this hop appended (k and v commit through them): a set hashed with
        // the layer's products. The context commits as the output projection takes it
        // ([`Products::quantized`]), the scores through it.
        let rows = q.len() / cfg.q_width();
        let first = from.max(start);
        let row_bytes = cache.row_bytes();
        queue_cache_rows(
            self.batch,
            first,
            row_bytes,
            &cache.encode_rows(first..start + rows),
        );
        // Kept as leaves only: a check of k or v opens the row they make.
        self.queue_entry(Point::KvCache, |k| {
            Some(k.keep(
                Point::KvCache,
                Kept::Leaves {
                    cols: row_bytes,
                    leaves: RowLeaves::default(),
                    rows: Vec::new(),
                    row_bytes,
                },
            ))
        });
        Ok(ctx)
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
    /// Layers served from the weight cache instead of memory (see `stream.rs`).
    streamed: Option<Arc<Streamed>>,
    head: Option<Head>,
    rope: Option<RopeTable>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("path", &self.path)
            .field("arch", &self.config.arch)
            .field("layers", &self.layers.keys().collect::<Vec<_>>())
            .field("streamed", &self.streamed)
            .field("head", &self.head.is_some())
            .finish()
    }
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

    /// Loads like [`Model::load`], but keeps only the first `resident` layers of the range in
    /// memory; the others stay in the weight cache (which `opts.cache_in` must name) and are
    /// streamed from it as hops reach them, at most [`crate::stream::WINDOW`] at a time.
    pub fn load_streaming(path: &Path, opts: &LoadOptions, resident: usize) -> Result<Model> {
        let config = open_source(path)?.0;
        let range = opts.layers.clone().unwrap_or(0..config.num_layers);
        check_range(&config, &range)?;
        let data_dir = opts.cache_in.as_ref().ok_or_else(|| {
            ModelError::Input("streaming layers needs the weight cache (a data directory)".into())
        })?;
        let cache = WeightCache::for_model(path, data_dir)?;
        let keep = range.start..(range.start + resident).min(range.end);
        let (_, src) = open_source(path)?;
        let mut model = Self::from_source_cached(
            config.clone(),
            src.as_ref(),
            Some(&cache),
            &LoadOptions {
                layers: Some(keep.clone()),
                ..opts.clone()
            },
        )?;
        let streamed: std::collections::BTreeSet<usize> = (keep.end..range.end).collect();
        if !streamed.is_empty() {
            model.streamed = Some(Arc::new(Streamed::new(config, src, cache, streamed)?));
        }
        Ok(model)
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
            streamed: None,
            head,
            rope,
        })
    }

    /// The layers loaded (held in memory or streamed).
    pub fn loaded_layers(&self) -> Vec<usize> {
        let mut all: Vec<usize> = self.layers.keys().copied().collect();
        if let Some(s) = &self.streamed {
            all.extend(s.layers());
        }
        all.sort_unstable();
        all
    }

    /// The layers streamed from the weight cache, and the reads that took so far.
    pub fn stream_stats(&self) -> crate::stream::StreamStats {
        self.streamed
            .as_ref()
            .map_or_else(Default::default, |s| s.stats())
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
    /// `x` starts where the cache ends, or before: then the cache first keeps only the
    /// positions before `x.start` (the positions past it were a speculative guess that missed,
    /// and every peer replaying the hops cuts them the same way).
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
        trace: Option<&mut HopTrace>,
    ) -> Result<Activations> {
        self.run_range(gemm, x, cache, trace, None)
    }

    /// [`Model::run_layers_traced`] for a stage that keeps what it needs to reveal any row of
    /// the hop's products later (a spot check). The hop must commit all its rows.
    pub fn run_layers_kept(
        &self,
        gemm: &Gemm,
        x: Activations,
        cache: &mut KvCache,
        trace: &mut HopTrace,
    ) -> Result<(Activations, KeptHop)> {
        if trace.from != x.start {
            return Err(ModelError::Input(format!(
                "a hop from position {} that commits only from {} cannot keep its rows",
                x.start, trace.from
            )));
        }
        let mut kept = KeptHop::default();
        let y = self.run_range(gemm, x, cache, Some(trace), Some(&mut kept))?;
        kept.output = Some(y.clone());
        Ok((y, kept))
    }

    fn run_range(
        &self,
        gemm: &Gemm,
        x: Activations,
        cache: &mut KvCache,
        mut trace: Option<&mut HopTrace>,
        mut keep: Option<&mut KeptHop>,
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
        if x.start > cache.len() {
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
        cache.truncate(x.start);
        let mut x = x;
        // Two batches taking turns: a layer's leaves are hashed while the next layer computes
        // (side by side when the engine has threads to spare), each batch's buffers reused.
        let mut batches = [LeafBatch::default(), LeafBatch::default()];
        let mut waiting: Option<QueuedLayer> = None;
        if let Some(k) = keep.as_deref_mut() {
            k.layers.reserve(range.len());
        }
        for (ci, i) in range.clone().enumerate() {
            let layer = self.layer(i).ok_or_else(|| {
                ModelError::Input(format!("layer {i} is not loaded in this stage"))
            })??;
            // The next streamed layer is read while this one computes.
            if let Some(s) = self.streamed.as_ref().filter(|_| i + 1 < range.end) {
                s.read_ahead(i + 1);
            }
            let layer = &*layer;
            let [even, odd] = &mut batches;
            let (now, before) = if ci % 2 == 0 {
                (even, odd)
            } else {
                (odd, even)
            };
            let mut kept = keep.is_some().then(|| KeptLayer::new(i, x.clone()));
            let mut products = Compute {
                model: self,
                gemm,
                layer,
                index: i,
                cache: &mut cache.caches[ci],
                first: trace.as_deref().map(|t| (x.start, t.from)),
                trace: trace.as_deref_mut(),
                keep: kept.as_mut(),
                batch: now,
                queued: Vec::new(),
            };
            products.queue_input(&x);
            // (`None`: nothing to hash, an untraced hop.)
            let previous = waiting
                .as_ref()
                .and_then(|w| (!w.sets.is_empty()).then_some(w.many));
            let (y, hashed) = gemm.join(
                || self.block(&Glue::of(layer), i, x, &mut products),
                || previous.map(|many| gemm.finish_leaves(before, many)),
            );
            let queued = QueuedLayer {
                sets: std::mem::take(&mut products.queued),
                many: products.batch.rows() > 32,
                kept,
            };
            if let Some(w) = waiting.take() {
                w.record(hashed, trace.as_deref_mut(), keep.as_deref_mut());
            }
            // A stage's products never stop a block early.
            x = y?.ok_or_else(|| ModelError::Input(format!("layer {i} stopped early")))?;
            waiting = Some(queued);
            x.check_finite(&stage, &i.to_string())?;
        }
        if let Some(w) = waiting.take() {
            let last = &mut batches[(range.len() - 1) % 2];
            let hashed = (!w.sets.is_empty()).then(|| gemm.finish_leaves(last, w.many));
            w.record(hashed, trace.as_deref_mut(), keep);
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

    /// One transformer block: the glue (norms, quantisation, activations, residuals) around
    /// products that `products` supplies. `None` when `products` stopped it early (see
    /// [`Products::more`]).
    pub(crate) fn block(
        &self,
        glue: &Glue,
        i: usize,
        x: Activations,
        products: &mut dyn Products,
    ) -> Result<Option<Activations>> {
        let cfg = &self.config;
        let rows = x.rows();
        // What deriving refuses, refused where a check skips it: a row that is not finite.
        let finite = |x: &Activations, what: &str| match x.data.iter().position(|v| !v.is_finite())
        {
            Some(at) => Err(KernelError::NonFinite {
                tensor: format!("layer {i} {what}"),
                row: at / cfg.hidden_size,
                col: at % cfg.hidden_size,
                value: x.data[at],
            }),
            None => Ok(()),
        };
        // Attention.
        let qc = match products.instead_of_deriving(Point::Context, rows, cfg.q_width()) {
            Some(qc) => {
                finite(&x, "attention input")?;
                qc
            }
            None => match self.attention_context(glue, i, &x, products)? {
                Some(qc) => qc,
                None => return Ok(None),
            },
        };
        if !products.more() {
            return Ok(None);
        }
        let mut o = Vec::new();
        products.linear(Point::O, &qc, &mut o)?;
        if !products.more() {
            return Ok(None);
        }
        let mut x = x;
        for (a, b) in x.data.iter_mut().zip(&o) {
            *a += b;
        }
        // MLP.
        let qa = match products.instead_of_deriving(Point::Hidden, rows, cfg.intermediate_size) {
            Some(qa) => {
                finite(&x, "mlp input")?;
                qa
            }
            None => match self.mlp_hidden(glue, i, &x, products)? {
                Some(qa) => qa,
                None => return Ok(None),
            },
        };
        if !products.more() {
            return Ok(None);
        }
        let mut y = Vec::new();
        products.linear(Point::Down, &qa, &mut y)?;
        for (a, b) in x.data.iter_mut().zip(&y) {
            *a += b;
        }
        Ok(Some(x))
    }

    /// [`Self::block`]'s attention up to the context the output projection takes: the norm,
    /// q, k and v, RoPE, the attention and the context quantised, as `products` hands it on.
    /// Apart so the block reads as its two halves; `None` when `products` stopped early.
    fn attention_context(
        &self,
        glue: &Glue,
        i: usize,
        x: &Activations,
        products: &mut dyn Products,
    ) -> Result<Option<QuantizedRows>> {
        let cfg = &self.config;
        let (rows, start) = (x.rows(), x.start);
        let h1 = self.norm(glue.attn_norm, &x.data);
        let qx = quantize_in_layer(i, &h1, rows, cfg.hidden_size, "attention input")?;
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        products.linear(Point::Q, &qx, &mut q)?;
        products.linear(Point::K, &qx, &mut k)?;
        products.linear(Point::V, &qx, &mut v)?;
        if !products.more() {
            return Ok(None);
        }
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
        let ctx = products.attention(&q, &k, &v, start)?;
        if !products.more() {
            return Ok(None);
        }
        let qc = quantize_in_layer(i, &ctx, rows, cfg.q_width(), "attention context")?;
        Ok(Some(products.quantized(Point::Context, qc)?))
    }

    /// [`Self::block`]'s MLP up to the hidden rows the down projection takes: the norm, the
    /// first products (GELU's one or SwiGLU's gate and up) and their activation, quantised, as
    /// `products` hands them on. `None` when `products` stopped early.
    fn mlp_hidden(
        &self,
        glue: &Glue,
        i: usize,
        x: &Activations,
        products: &mut dyn Products,
    ) -> Result<Option<QuantizedRows>> {
        let cfg = &self.config;
        let rows = x.rows();
        let h2 = self.norm(glue.mlp_norm, &x.data);
        let qh = quantize_in_layer(i, &h2, rows, cfg.hidden_size, "mlp input")?;
        let mut a = Vec::new();
        if glue.gelu {
            products.linear(Point::Fc, &qh, &mut a)?;
            if !products.more() {
                return Ok(None);
            }
            for v in a.iter_mut() {
                *v = gelu_tanh(*v);
            }
        } else {
            let mut u = Vec::new();
            products.linear(Point::Gate, &qh, &mut a)?;
            products.linear(Point::Up, &qh, &mut u)?;
            if !products.more() {
                return Ok(None);
            }
            silu_mul(&mut a, &u);
        }
        let qa = quantize_in_layer(i, &a, rows, cfg.intermediate_size, "mlp hidden")?;
        Ok(Some(products.quantized(Point::Hidden, qa)?))
    }

    /// Layer `i`, if loaded: held, or streamed in (which may fail to read).
    pub(crate) fn layer(&self, i: usize) -> Option<Result<LayerRef<'_>>> {
        if let Some(l) = self.layers.get(&i) {
            return Some(Ok(LayerRef::Resident(l)));
        }
        let s = self.streamed.as_ref().filter(|s| s.has(i))?;
        Some(s.get(i).map(LayerRef::Streamed))
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

/// `rows` rows of `x`, `k` wide, quantised for a product of layer `i`; a non-finite value is
/// named with the layer. The tensor's name is formatted only for an error: formatting it for
/// every quantisation was an allocation, four per layer of every hop.
fn quantize_in_layer(
    i: usize,
    x: &[f32],
    rows: usize,
    k: usize,
    what: &str,
) -> std::result::Result<QuantizedRows, KernelError> {
    QuantizedRows::quantize(x, rows, k, what).map_err(|e| match e {
        KernelError::NonFinite {
            tensor,
            row,
            col,
            value,
        } => KernelError::NonFinite {
            tensor: format!("layer {i} {tensor}"),
            row,
            col,
            value,
        },
        e => e,
    })
}
