//! A loaded model and its forward pass, cut into the pieces the swarm runs separately:
//! [`Model::embed`], [`Model::run_layers`] over any contiguous layer range with that range's
//! [`KvCache`], and [`Model::readout`].
//!
//! Every row (position) is computed independently except inside attention, and attention reads
//! the cache only through exact products, so splitting the layers, chunking the prefill or
//! decoding token by token never changes a bit (tested in `tests/exactness.rs`); nor does
//! running several generations' hops stacked ([`Model::run_hops_kept`]).

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use dc_kernels::elementwise::{gelu_tanh, layer_norm, rms_norm, silu_mul, RopeTable};
use dc_kernels::verify::commit::LeafBatch;
use dc_kernels::{Gemm, KernelError, QuantizedRows};

use crate::activations::Activations;
use crate::compute::{Compute, QueuedLayer, Stacked};
use crate::config::{Arch, ModelConfig};
use crate::error::{ModelError, Result};
use crate::kv_cache::KvCache;
use crate::open::open_source;
use crate::products::Products;
use crate::source::TensorSource;
use crate::stream::{LayerRef, Streamed};
use crate::trace::{HopTrace, Point};
use crate::verify::kept::{KeptHop, KeptLayer};
use crate::weight_cache::WeightCache;
use crate::weights::{check_range, load_head, load_layer, Head, Layer, Mlp, Norm};

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

/// One hop of [`Model::run_hops_kept`]: its input, its generation's cache and its trace.
#[derive(Debug)]
pub struct HopInput<'a> {
    /// The activations entering the stage.
    pub x: Activations,
    /// The generation's cache of the stage's layers.
    pub cache: &'a mut KvCache,
    /// Where the hop's commitments go (committing from `x.start`).
    pub trace: &'a mut HopTrace,
    /// Whether to keep what a reveal of the hop needs (a hop nobody will ask to reveal, such
    /// as a head's own, is only committed).
    pub keep: bool,
}

/// One hop as the forward pass runs it: traced and kept, or not.
struct HopRun<'a> {
    x: Activations,
    cache: &'a mut KvCache,
    trace: Option<&'a mut HopTrace>,
    keep: Option<&'a mut KeptHop>,
}

/// A hop's state across its layers.
struct HopState<'a> {
    cache: &'a mut KvCache,
    trace: Option<&'a mut HopTrace>,
    keep: Option<&'a mut KeptHop>,
    batches: [LeafBatch; 2],
    /// The last layer, its leaves hashed while the next one computes.
    waiting: Option<QueuedLayer>,
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

    /// Bytes of packed weights a decode step streams through this process: every weight
    /// product of the layers held in memory, and the output projection when the head is
    /// loaded. Decode reads each of them once per token, so this over the read bandwidth is
    /// the bound on its rate.
    pub fn decode_bytes(&self) -> usize {
        let layers: usize = self.layers.values().map(Layer::packed_bytes).sum();
        layers + self.head.as_ref().map_or(0, |h| h.lm_head.packed_bytes())
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
            let at = data.len();
            head.embed.push_row(t, &mut data)?;
            let row = &mut data[at..];
            // A table kept as stored is converted here, so its values are checked here too.
            if row.iter().any(|x| !x.is_finite()) {
                return Err(ModelError::Input(format!(
                    "the embedding of token {t} holds a non-finite value"
                )));
            }
            if let Some(p) = &head.positions {
                let pos = &p[(start + i) * h..(start + i + 1) * h];
                row.iter_mut().zip(pos).for_each(|(a, b)| *a += b);
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
        trace: Option<&mut HopTrace>,
        keep: Option<&mut KeptHop>,
    ) -> Result<Activations> {
        let hop = HopRun {
            x,
            cache,
            trace,
            keep,
        };
        let mut out = self.run_hops(gemm, vec![hop])?;
        Ok(out.remove(0))
    }

    /// [`Model::run_layers_kept`] for several hops over the same layers at once (different
    /// generations at one stage): their rows are stacked so each weight product is one GEMM
    /// over all of them, the weights read from memory once (see `compute.rs`). Every bit of
    /// every hop's output, trace and kept rows is what the hop alone would give (tested in
    /// `tests/exactness.rs`).
    ///
    /// A hop not asked to `keep` comes back with an empty [`KeptHop`].
    ///
    /// An error fails every hop of the batch and leaves their caches and traces part-way; each
    /// hop can then be run alone on the same cache (a run first cuts its cache back to where
    /// its input starts) with a fresh trace, which is how a stage finds the hop to blame.
    pub fn run_hops_kept(
        &self,
        gemm: &Gemm,
        hops: Vec<HopInput<'_>>,
    ) -> Result<Vec<(Activations, KeptHop)>> {
        if let Some(h) = hops.iter().find(|h| h.trace.from != h.x.start) {
            return Err(ModelError::Input(format!(
                "a hop from position {} that commits only from {} cannot keep its rows",
                h.x.start, h.trace.from
            )));
        }
        let mut kept: Vec<KeptHop> = hops.iter().map(|_| KeptHop::default()).collect();
        let keeps: Vec<bool> = hops.iter().map(|h| h.keep).collect();
        let runs = hops
            .into_iter()
            .zip(kept.iter_mut())
            .map(|(h, k)| HopRun {
                x: h.x,
                cache: h.cache,
                trace: Some(h.trace),
                keep: h.keep.then_some(k),
            })
            .collect();
        let ys = self.run_hops(gemm, runs)?;
        Ok(ys
            .into_iter()
            .zip(kept)
            .zip(keeps)
            .map(|((y, mut k), keep)| {
                if keep {
                    k.output = Some(y.clone());
                }
                (y, k)
            })
            .collect())
    }

    /// Checks hop `h`'s input against its cache and the model, and cuts its cache back to
    /// where the input starts.
    fn admit_hop(&self, h: &mut HopRun<'_>) -> Result<()> {
        let (x, range) = (&h.x, h.cache.layers());
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
        if x.start > h.cache.len() {
            return Err(ModelError::Input(format!(
                "{stage}: activations start at position {} but the cache holds {} positions",
                x.start,
                h.cache.len()
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
        h.cache.truncate(x.start);
        Ok(())
    }

    /// Runs the hops' layers (every hop's cache covers the same ones), stacked when there are
    /// several (see [`Model::run_hops_kept`]).
    fn run_hops(&self, gemm: &Gemm, hops: Vec<HopRun<'_>>) -> Result<Vec<Activations>> {
        let range = hops[0].cache.layers();
        if let Some(h) = hops.iter().find(|h| h.cache.layers() != range) {
            let other = h.cache.layers();
            return Err(ModelError::Input(format!(
                "hops over layers {}..{} and {}..{} cannot run together",
                range.start, range.end, other.start, other.end
            )));
        }
        let stage = format!("layers {}..{}", range.start, range.end);
        let mut hops = hops;
        for h in hops.iter_mut() {
            self.admit_hop(h)?;
            if let Some(k) = h.keep.as_deref_mut() {
                k.layers.reserve(range.len());
            }
        }
        let mut xs: Vec<Activations> = Vec::with_capacity(hops.len());
        let mut states: Vec<HopState<'_>> = hops
            .into_iter()
            .map(|h| {
                xs.push(h.x);
                HopState {
                    cache: h.cache,
                    trace: h.trace,
                    keep: h.keep,
                    // Two batches taking turns: a layer's leaves are hashed while the next
                    // layer computes (side by side when the engine has threads to spare),
                    // each batch's buffers reused.
                    batches: [LeafBatch::default(), LeafBatch::default()],
                    waiting: None,
                }
            })
            .collect();
        for (ci, i) in range.clone().enumerate() {
            let layer = self.layer(i).ok_or_else(|| {
                ModelError::Input(format!("layer {i} is not loaded in this stage"))
            })??;
            // The next streamed layer is read while this one computes.
            if let Some(s) = self.streamed.as_ref().filter(|_| i + 1 < range.end) {
                s.read_ahead(i + 1);
            }
            let layer = &*layer;
            let mut kept: Vec<Option<KeptLayer>> = states
                .iter()
                .zip(&xs)
                .map(|(s, x)| s.keep.is_some().then(|| KeptLayer::new(i, x.clone())))
                .collect();
            let mut computes = Vec::with_capacity(states.len());
            let mut before = Vec::with_capacity(states.len());
            for ((s, kept), x) in states.iter_mut().zip(kept.iter_mut()).zip(&xs) {
                let [even, odd] = &mut s.batches;
                let (now, earlier) = if ci % 2 == 0 {
                    (even, odd)
                } else {
                    (odd, even)
                };
                let mut products = Compute {
                    config: &self.config,
                    gemm,
                    layer,
                    index: i,
                    cache: &mut s.cache.caches[ci],
                    first: s.trace.as_deref().map(|t| (x.start, t.from)),
                    trace: s.trace.as_deref_mut(),
                    keep: kept.as_mut(),
                    batch: now,
                    queued: Vec::new(),
                };
                products.queue_input(x);
                computes.push(products);
                // (`None`: nothing to hash, an untraced hop.)
                let previous = s
                    .waiting
                    .as_ref()
                    .and_then(|w| (!w.sets.is_empty()).then_some(w.many));
                before.push((earlier, previous));
            }
            let glue = Glue::of(layer);
            let (y, hashed) = gemm.join(
                || self.stacked_block(&glue, i, &mut xs, &mut computes),
                || {
                    before
                        .into_iter()
                        .map(|(b, previous)| previous.map(|many| gemm.finish_leaves(b, many)))
                        .collect::<Vec<_>>()
                },
            );
            let queued: Vec<_> = computes
                .into_iter()
                .map(|c| (c.queued, c.batch.rows() > 32))
                .collect();
            for (((s, (sets, many)), kept), hashed) in
                states.iter_mut().zip(queued).zip(kept).zip(hashed)
            {
                if let Some(w) = s.waiting.take() {
                    w.record(hashed, s.trace.as_deref_mut(), s.keep.as_deref_mut());
                }
                s.waiting = Some(QueuedLayer { sets, many, kept });
            }
            // A stage's products never stop a block early.
            xs = y?.ok_or_else(|| ModelError::Input(format!("layer {i} stopped early")))?;
            for x in &xs {
                x.check_finite(&stage, &i.to_string())?;
            }
        }
        for s in states.iter_mut() {
            if let Some(w) = s.waiting.take() {
                let last = &mut s.batches[(range.len() - 1) % 2];
                let hashed = (!w.sets.is_empty()).then(|| gemm.finish_leaves(last, w.many));
                w.record(hashed, s.trace.as_deref_mut(), s.keep.as_deref_mut());
            }
        }
        for (s, x) in states.iter_mut().zip(&xs) {
            if let Some(t) = s.trace.as_deref_mut() {
                t.push(
                    range.end - 1,
                    Point::Output,
                    x.rows_from(t.from).commitment(),
                );
            }
        }
        Ok(xs)
    }

    /// Layer `i`'s block over every hop's rows `xs` (taken, and left empty), one hop's
    /// products or several stacked; the hops' outputs, or `None` if the block stopped early.
    fn stacked_block(
        &self,
        glue: &Glue,
        i: usize,
        xs: &mut Vec<Activations>,
        computes: &mut [Compute<'_>],
    ) -> Result<Option<Vec<Activations>>> {
        let xs = std::mem::take(xs);
        if let [products] = computes {
            let x = xs.into_iter().next().expect("one hop, one input");
            return Ok(self.block(glue, i, x, products)?.map(|y| vec![y]));
        }
        let hidden = self.config.hidden_size;
        let rows: Vec<usize> = xs.iter().map(Activations::rows).collect();
        let positions = xs.iter().flat_map(Activations::positions).collect();
        let starts: Vec<usize> = xs.iter().map(|x| x.start).collect();
        let data = xs.into_iter().flat_map(|x| x.data).collect();
        let x = Activations {
            start: 0,
            hidden,
            data,
        };
        let mut stacked = Stacked {
            hops: computes,
            rows: rows.clone(),
            positions,
        };
        let Some(y) = self.block(glue, i, x, &mut stacked)? else {
            return Ok(None);
        };
        let mut at = 0;
        Ok(Some(
            rows.iter()
                .zip(starts)
                .map(|(&r, start)| {
                    at += r;
                    Activations {
                        start,
                        hidden,
                        data: y.data[(at - r) * hidden..at * hidden].to_vec(),
                    }
                })
                .collect(),
        ))
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
                    rope.apply(head, products.position(start, t));
                }
            }
            for (t, row) in k.chunks_exact_mut(cfg.kv_width()).enumerate() {
                for head in row.chunks_exact_mut(hd) {
                    rope.apply(head, products.position(start, t));
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
