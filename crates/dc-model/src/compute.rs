//! A stage's products: [`Compute`] runs one hop's weight products on the layer's weights and
//! its generation's cache, commits them into the hop's trace and keeps what a reveal needs;
//! [`Stacked`] runs several hops' blocks at once (different generations at one stage), each
//! weight product one GEMM over all their rows, everything else hop by hop.
//!
//! Stacking changes no bit: outside attention every row is computed alone (the activations are
//! quantised row by row, and the exact product of a row does not depend on the rows beside
//! it), and attention, RoPE, the cache and every commitment stay each hop's own. What it saves
//! is reading the weights: a decode step's products are bound by memory, so four generations'
//! rows cost about what one costs.

use dc_kernels::verify::commit::LeafBatch;
use dc_kernels::{Accumulators, Commitment, Gemm, QuantizedRows};

use crate::activations::Activations;
use crate::attention::{
    attend_with, queue_cache_rows, AttentionKernel, AttentionShape, LayerCache,
};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::products::Products;
use crate::trace::{HopTrace, Point};
use crate::verify::kept::{Kept, KeptHop, KeptLayer};
use crate::weights::{add_bias, KeptProduct, Layer, Linear, RowLeaves};

/// A stage's products: run on its weights and cache, committed into the trace and kept for
/// reveals when asked.
pub(crate) struct Compute<'a> {
    pub config: &'a ModelConfig,
    pub gemm: &'a Gemm,
    pub layer: &'a Layer,
    pub index: usize,
    pub cache: &'a mut LayerCache,
    /// `(first row's position, first committed position)` when committing.
    pub first: Option<(usize, usize)>,
    pub trace: Option<&'a mut HopTrace>,
    pub keep: Option<&'a mut KeptLayer>,
    /// Every leaf the layer commits (its products', cache rows' and attention rows'), hashed
    /// together while the next layer computes ([`QueuedLayer`]): a decode step's rows are too
    /// short to hash well one by one. Two batches take turns over a hop's layers, so their
    /// buffers are allocated once.
    pub batch: &'a mut LeafBatch,
    /// Per queued set, its trace entry and, when keeping, its place among the kept.
    pub queued: Vec<(usize, Option<usize>)>,
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
    pub fn queue_input(&mut self, x: &Activations) {
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
pub(crate) struct QueuedLayer {
    /// Per queued set, its trace entry and, when keeping, its place among the kept.
    pub sets: Vec<(usize, Option<usize>)>,
    /// Whether the batch is worth the engine's threads: a prefill's rows are; a decode step's
    /// dozen messages (one per product, cache and attention row, and the layer's input) are
    /// not: split between threads they fill the lanes half as well, for a hand-off that costs
    /// about what it saves.
    pub many: bool,
    pub kept: Option<KeptLayer>,
}

impl QueuedLayer {
    /// Puts each set's commitment into its trace entry and its leaves with what was kept of
    /// it, then the kept layer into the hop (`hashed`: `None` when nothing was queued).
    pub fn record(
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

impl<'a> Compute<'a> {
    /// The layer's product at `point`.
    fn product_at(&self, point: Point) -> Result<&'a Linear> {
        let layer: &'a Layer = self.layer;
        layer.linear(point).ok_or_else(|| {
            ModelError::Input(format!("layer {} has no {point:?} product", self.index))
        })
    }

    /// Whether this hop keeps its products' accumulators (only a committed hop does).
    fn keeps(&self) -> bool {
        self.first.is_some() && self.keep.is_some()
    }

    /// Commits and keeps this hop's rows of the product at `point`: `out` (`rows × n`, before
    /// the bias) and their exact accumulators `acc` when keeping.
    fn take_product(&mut self, point: Point, out: &[f32], n: usize, acc: Option<Accumulators>) {
        let Some((first, from)) = self.first else {
            return;
        };
        if !point.output_committed() {
            // Products that commit through the row the next glue step makes of them (k and v
            // the cache row, the MLP's first products the hidden row); a stage keeping the hop
            // keeps their accumulators to reveal (and a check to test) them.
            if let (Some(k), Some(acc)) = (self.keep.as_deref_mut(), acc) {
                k.keep(point, Kept::Source(acc));
            }
            return;
        }
        self.batch
            .queue(out, (out.len() / n.max(1), n), first, from);
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
    }

    /// Commits and keeps this hop's rows `rows` of `derived`, the quantised rows the product
    /// after `point` takes.
    fn take_quantized(
        &mut self,
        point: Point,
        derived: &QuantizedRows,
        rows: std::ops::Range<usize>,
    ) {
        let Some((start, from)) = self.first else {
            return;
        };
        self.batch
            .queue_quantized_rows(derived, rows.clone(), start, from);
        let k = derived.k();
        let skip = from.saturating_sub(start).min(rows.len());
        self.queue_entry(point, |kept| {
            let row_bytes = QuantizedRows::encoded_row_bytes(k);
            let mut bytes = Vec::with_capacity((rows.len() - skip) * row_bytes);
            for r in rows.start + skip..rows.end {
                derived.encode_row(r, &mut bytes);
            }
            debug_assert_eq!(bytes.len(), (rows.len() - skip) * row_bytes);
            Some(kept.keep(
                point,
                Kept::Leaves {
                    cols: k,
                    leaves: RowLeaves::default(),
                    rows: bytes,
                    row_bytes,
                },
            ))
        });
    }
}

impl Products for Compute<'_> {
    fn linear(&mut self, point: Point, x: &QuantizedRows, out: &mut Vec<f32>) -> Result<()> {
        let lin = self.product_at(point)?;
        let acc = lin.product(self.gemm, x, out, self.keeps())?;
        let (n, bias) = (lin.w.n(), lin.bias.as_deref());
        self.take_product(point, out, n, acc);
        add_bias(bias, out);
        Ok(())
    }

    fn quantized(&mut self, point: Point, derived: QuantizedRows) -> Result<QuantizedRows> {
        self.take_quantized(point, &derived, 0..derived.rows());
        Ok(derived)
    }

    fn attention(&mut self, q: &[f32], k: &[f32], v: &[f32], start: usize) -> Result<Vec<f32>> {
        let cfg = self.config;
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

/// Several hops' products at once, their rows stacked in hop order: each weight product is
/// one GEMM over every hop's rows, cut back into each hop's commitments and accumulators;
/// attention runs hop by hop on each hop's own cache. Every hop runs the same layer.
pub(crate) struct Stacked<'h, 'a> {
    /// The hops, in the order of their rows.
    pub hops: &'h mut [Compute<'a>],
    /// Each hop's number of rows.
    pub rows: Vec<usize>,
    /// Each stacked row's position in its own hop's generation.
    pub positions: Vec<usize>,
}

/// Each of `hops` with the range of its stacked rows (`rows` each).
fn spans<'s, 'a>(
    hops: &'s mut [Compute<'a>],
    rows: &'s [usize],
) -> impl Iterator<Item = (&'s mut Compute<'a>, std::ops::Range<usize>)> + 's {
    let mut at = 0;
    hops.iter_mut().zip(rows).map(move |(h, &r)| {
        at += r;
        (h, at - r..at)
    })
}

impl Products for Stacked<'_, '_> {
    fn linear(&mut self, point: Point, x: &QuantizedRows, out: &mut Vec<f32>) -> Result<()> {
        let (lin, gemm) = {
            let first = &self.hops[0];
            (first.product_at(point)?, first.gemm)
        };
        // The accumulators are kept when any hop keeps them; a hop that does not drops its
        // piece.
        let keep = self.hops.iter().any(Compute::keeps);
        let acc = lin.product(gemm, x, out, keep)?;
        let (n, bias) = (lin.w.n(), lin.bias.as_deref());
        let mut pieces = acc.map(|a| a.split_rows(&self.rows).into_iter());
        for (hop, rows) in spans(self.hops, &self.rows) {
            let acc = pieces.as_mut().and_then(|p| p.next());
            hop.take_product(point, &out[rows.start * n..rows.end * n], n, acc);
        }
        add_bias(bias, out);
        Ok(())
    }

    fn attention(&mut self, q: &[f32], k: &[f32], v: &[f32], _start: usize) -> Result<Vec<f32>> {
        let config = self.hops[0].config;
        let (qw, kw) = (config.q_width(), config.kv_width());
        let mut ctx = Vec::with_capacity(q.len());
        for (hop, rows) in spans(self.hops, &self.rows) {
            let at = |w: usize| rows.start * w..rows.end * w;
            let start = self.positions[rows.start];
            ctx.extend(hop.attention(&q[at(qw)], &k[at(kw)], &v[at(kw)], start)?);
        }
        Ok(ctx)
    }

    fn quantized(&mut self, point: Point, derived: QuantizedRows) -> Result<QuantizedRows> {
        for (hop, rows) in spans(self.hops, &self.rows) {
            hop.take_quantized(point, &derived, rows);
        }
        Ok(derived)
    }

    fn position(&self, _start: usize, row: usize) -> usize {
        self.positions[row]
    }
}
