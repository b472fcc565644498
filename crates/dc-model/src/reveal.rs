//! Spot checks of a stage's products (docs/VERIFICATION.md): what a stage keeps of a hop so it
//! can reveal any row of it afterwards, and the checker's side — Freivalds' test for every
//! weight product, the row's attention recomputed on the revealed KV cache, and the very glue
//! code a stage runs for everything between the products.
//!
//! A check needs no weights beyond `W · r` per product and the layer's norms: the stage reveals
//! the row of each product at one position (tied to its signed commitments by Merkle paths),
//! the activations entering and leaving the layer, and the layer's cache rows (tied to the
//! `KvCache` commitment of the hop that produced each). The checker re-derives every product's
//! input from those, tests each weight product's row in O(k + n), recomputes the row's
//! attention exactly (its inputs are the revealed cache rows and the row's own keys and
//! values), and recomputes the layer's output.

use std::sync::Arc;

use dc_kernels::commit::{
    product_row_leaf, quantized_row_leaf, row_leaf_at, LeafBatch, MerkleTree,
};
use dc_kernels::freivalds::FreivaldsKey;
use dc_kernels::reveal::{
    decode_for_check, decode_units_for_check, row_for_reveal, Decode, Opening,
};
use dc_kernels::{Accumulators, BlockScale, Commitment, Domain, QuantizedRows, BLOCK};
use dc_types::{CheckSet, HopTrace, LayerReveal, Point, RevealedRow, WireActivations};

use crate::attention::{attend, cache_row_leaf, queue_cache_rows, AttentionShape, LayerCache};
use crate::error::{ModelError, Result};
use crate::model::{Activations, Glue, KvCache, Model, Products};
use crate::weights::{add_bias, KeptProduct, Mlp, Norm, RowLeaves};

/// A product a stage kept.
pub(crate) enum Kept {
    /// A weight product's exact accumulators and its rows' leaves.
    Gemm(KeptProduct),
    /// A weight product whose rows commit only through what is made of them (the MLP's first
    /// products through `Hidden`, k and v through `KvCache`): its exact accumulators, revealed
    /// with no opening.
    Source(Accumulators),
    /// Only the rows' Merkle leaves (the context, the cache rows and the MLP's hidden rows: a
    /// checker recomputes their rows, so a reveal carries just the root and the path), and for
    /// the context and the hidden rows each row's encoding (`rows`, one after another,
    /// `row_bytes` each; empty for the cache rows: both quantised as the next product takes
    /// them), revealed when a check takes the row as the next product's input instead of
    /// recomputing it.
    Leaves {
        cols: usize,
        leaves: RowLeaves,
        rows: Vec<u8>,
        row_bytes: usize,
    },
}

impl Kept {
    fn bytes(&self) -> usize {
        match self {
            Kept::Gemm(k) => k.acc.bytes() + k.leaves.len() * 32,
            Kept::Source(acc) => acc.bytes(),
            Kept::Leaves { leaves, rows, .. } => leaves.len() * 32 + rows.len(),
        }
    }

    /// The Merkle tree of the product's rows, for a product whose first row is at `first`
    /// (`None` for a source, which has none): built once for every row a reveal opens.
    fn tree(&self, first: usize) -> Option<MerkleTree> {
        match self {
            // The leaves the commitment hashed, when it covered every row of the hop (it
            // always does for a stage's own hop); otherwise hashed again.
            Kept::Gemm(KeptProduct { acc, leaves }) => Some(match leaves.len() == acc.rows {
                true => MerkleTree::new(leaves),
                false => MerkleTree::new(
                    &(0..acc.rows)
                        .map(|r| row_leaf_at(acc, r, first))
                        .collect::<Vec<_>>(),
                ),
            }),
            Kept::Leaves { leaves, .. } => Some(MerkleTree::new(leaves)),
            Kept::Source(_) => None,
        }
    }

    /// The row at `index` with its path in `tree` ([`Kept::tree`]; a product kept as leaves
    /// with its encoding only if `values` and it was kept; a source with its encoding and no
    /// path).
    fn reveal(
        &self,
        point: Point,
        index: usize,
        values: bool,
        tree: Option<&MerkleTree>,
    ) -> Option<RevealedRow> {
        let (cols, (unit, encoding)) = match self {
            Kept::Gemm(KeptProduct { acc, .. }) if index < acc.rows => {
                (acc.cols, row_for_reveal(acc, index))
            }
            Kept::Source(acc) if index < acc.rows => {
                let (unit, encoding) = row_for_reveal(acc, index);
                return Some(RevealedRow {
                    point,
                    cols: acc.cols as u32,
                    unit,
                    encoding,
                    root: Commitment::default(),
                    path: Vec::new(),
                });
            }
            Kept::Leaves {
                cols,
                leaves,
                rows,
                row_bytes,
            } if index < leaves.len() => {
                let encoding = match values {
                    true => rows
                        .get(index * row_bytes..(index + 1) * row_bytes)?
                        .to_vec(),
                    false => Vec::new(),
                };
                (*cols, (None, encoding))
            }
            _ => return None,
        };
        let tree = tree?;
        Some(RevealedRow {
            point,
            cols: cols as u32,
            unit,
            encoding,
            root: tree.root(),
            path: tree.proof(index),
        })
    }
}

/// Positions per chunk of a layer's [`CacheLog`].
const LOG_CHUNK: usize = 64;

/// The KV cache rows a stage produced in a generation, per layer, in canonical encoding: what
/// it reveals so a checker can recompute attention. Kept apart from the live cache, which a
/// running hop holds while a reveal of the previous hop may be asked for.
#[derive(Clone, Debug, Default)]
pub struct CacheLog {
    first_layer: usize,
    /// Per layer, the rows of positions `0..` in chunks of [`LOG_CHUNK`] positions, each
    /// shared with reveals in flight: a clone of the log copies no rows, and an append copies
    /// at most the chunk it writes into, if a reveal still holds that (with the layer's rows in
    /// one block, an append during a reveal copied all of them: a cost that grew with the
    /// generation).
    rows: Vec<Vec<Arc<Vec<u8>>>>,
    row_bytes: usize,
    len: usize,
}

impl CacheLog {
    /// Appends what `cache` holds beyond the positions logged so far.
    pub fn record(&mut self, cache: &KvCache) {
        let layers = cache.layers();
        if self.rows.is_empty() {
            self.first_layer = layers.start;
            self.rows = layers.clone().map(|_| Vec::new()).collect();
        }
        let end = cache.len();
        for (l, chunks) in layers.zip(self.rows.iter_mut()) {
            if let Some(c) = cache.layer(l) {
                let rb = c.row_bytes();
                self.row_bytes = rb;
                for pos in self.len..end {
                    let full = |chunk: &Arc<Vec<u8>>| chunk.len() >= LOG_CHUNK * rb;
                    if chunks.last().is_none_or(full) {
                        chunks.push(Arc::new(Vec::with_capacity(LOG_CHUNK * rb)));
                    }
                    if let Some(last) = chunks.last_mut() {
                        c.encode_row(pos, Arc::make_mut(last));
                    }
                }
            }
        }
        self.len = self.len.max(end);
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.rows.iter().flatten().map(|c| c.len()).sum()
    }

    /// Bytes of one position's row in one layer (0 before anything is logged).
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The rows of `layer` at positions `0..end`, if logged.
    pub fn rows(&self, layer: usize, end: usize) -> Option<Vec<u8>> {
        self.rows_between(layer, 0, end)
    }

    /// The rows of `layer` at positions `from..end`, if logged.
    pub fn rows_between(&self, layer: usize, from: usize, end: usize) -> Option<Vec<u8>> {
        let chunks = self.rows.get(layer.checked_sub(self.first_layer)?)?;
        let rb = self.row_bytes;
        let held: usize = chunks.iter().map(|c| c.len()).sum();
        if from > end || end.checked_mul(rb)? > held {
            return None;
        }
        let mut out = Vec::with_capacity((end - from) * rb);
        let mut pos = from;
        // (Nothing to copy when no row has bytes.)
        while pos < end && rb > 0 {
            // Every chunk but the last is full, so position `pos` is in chunk `pos / LOG_CHUNK`.
            let (chunk, at) = (pos / LOG_CHUNK, pos % LOG_CHUNK);
            let take = (LOG_CHUNK - at).min(end - pos);
            out.extend_from_slice(&chunks[chunk][at * rb..(at + take) * rb]);
            pos += take;
        }
        Some(out)
    }
}

/// Parts a layer keeps at most: q, k, v, the cache rows, the context, o, the MLP's first
/// products (one for GPT-2), its hidden row and down.
const KEPT_PARTS: usize = 10;

/// What a stage kept of one layer of a hop.
pub(crate) struct KeptLayer {
    layer: usize,
    input: Activations,
    products: Vec<(Point, Kept)>,
}

impl KeptLayer {
    pub(crate) fn new(layer: usize, input: Activations) -> KeptLayer {
        KeptLayer {
            layer,
            input,
            // Every part a layer keeps, allocated once rather than grown push by push.
            products: Vec::with_capacity(KEPT_PARTS),
        }
    }

    /// Keeps one product's parts; returns its place, for [`KeptLayer::set_leaves`].
    pub(crate) fn keep(&mut self, point: Point, kept: Kept) -> usize {
        self.products.push((point, kept));
        self.products.len() - 1
    }

    /// The leaves of the product kept at `at`, once its rows are hashed.
    pub(crate) fn set_leaves(&mut self, at: usize, leaves: &[Commitment]) {
        match self.products.get_mut(at) {
            Some((_, Kept::Gemm(p))) => p.leaves = leaves.into(),
            Some((_, Kept::Leaves { leaves: l, .. })) => *l = leaves.into(),
            Some((_, Kept::Source(_))) | None => {}
        }
    }
}

/// What a stage kept of one hop: enough to reveal any row of any product it committed.
#[derive(Default)]
pub struct KeptHop {
    pub(crate) layers: Vec<KeptLayer>,
    pub(crate) output: Option<Activations>,
}

impl std::fmt::Debug for KeptHop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "KeptHop({} layers, {} bytes)",
            self.layers.len(),
            self.bytes()
        )
    }
}

fn wire(a: &Activations) -> WireActivations {
    WireActivations {
        start: a.start as u32,
        hidden: a.hidden as u32,
        data: a.data.clone(),
    }
}

impl KeptHop {
    /// Replaces the output the hop keeps for reveals (a test-only liar that keeps its lie
    /// consistent with what it signed, so only a recomputation of the lying row shows it).
    pub fn set_output(&mut self, y: Activations) {
        self.output = Some(y);
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        let acts = |a: &Activations| a.data.len() * 4;
        self.layers
            .iter()
            .map(|l| acts(&l.input) + l.products.iter().map(|(_, k)| k.bytes()).sum::<usize>())
            .sum::<usize>()
            + self.output.as_ref().map_or(0, acts)
    }

    /// Reveals what a check of `checks` needs of `layer` at `position` ([`rows_needed`]): the
    /// activations entering and leaving the layer (if needed: otherwise no rows), the row at
    /// that position of each product needed (the context, cache and hidden rows by root and
    /// path only, but for the context's and the hidden row's values when a check takes them as
    /// the next product's input), and, when the attention is recomputed, the layer's cache rows
    /// from `cache_from` (at most the hop's first position) to the end of the hop, from `log`.
    pub fn reveal(
        &self,
        layer: usize,
        position: usize,
        checks: CheckSet,
        cache_from: usize,
        log: &CacheLog,
    ) -> std::result::Result<LayerReveal, String> {
        self.reveal_rows(layer, position, 1, checks, cache_from, log)
    }

    /// [`Self::reveal`] at the `positions` consecutive rows from `position` (a check of every
    /// row of a prefill hop): the products' rows position by position, each position's in
    /// computation order; the activations and cache rows once.
    pub fn reveal_rows(
        &self,
        layer: usize,
        position: usize,
        positions: usize,
        checks: CheckSet,
        cache_from: usize,
        log: &CacheLog,
    ) -> std::result::Result<LayerReveal, String> {
        let i = self
            .layers
            .iter()
            .position(|l| l.layer == layer)
            .ok_or_else(|| format!("layer {layer} is not in this hop"))?;
        let l = &self.layers[i];
        let first = l.input.start;
        let index = position
            .checked_sub(first)
            .filter(|&r| r < l.input.rows())
            .ok_or_else(|| format!("position {position} is not in this hop"))?;
        if positions == 0 || positions > l.input.rows() - index {
            return Err(format!(
                "{positions} positions from {position} are not rows of this hop"
            ));
        }
        let next = match self.layers.get(i + 1) {
            Some(n) => &n.input,
            None => self.output.as_ref().ok_or("the hop did not finish")?,
        };
        let needs = rows_needed(checks);
        // Each needed product's tree once, whatever the rows opened in it.
        let needed: Vec<(Point, &Kept, Option<MerkleTree>)> = l
            .products
            .iter()
            .filter(|(p, _)| needs.rows.contains(*p))
            .map(|(p, k)| (*p, k, k.tree(first)))
            .collect();
        let rows = (index..index + positions)
            .flat_map(|index| {
                needed.iter().map(move |(p, k, tree)| {
                    k.reveal(*p, index, needs.values(*p), tree.as_ref())
                        .ok_or("a kept product is short")
                })
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let end = first + l.input.rows();
        if cache_from > first {
            return Err(format!(
                "cache rows from {cache_from} start past the hop's first position {first}"
            ));
        }
        let cache = match checks.attention() {
            true => log.rows_between(layer, cache_from, end).ok_or_else(|| {
                format!("the cache rows of layer {layer} up to {end} are not kept")
            })?,
            false => Vec::new(),
        };
        // Activations a check does not need travel as no rows.
        let wire_if = |a: &Activations, needed: bool| match needed {
            true => wire(a),
            false => WireActivations {
                start: a.start as u32,
                hidden: a.hidden as u32,
                data: Vec::new(),
            },
        };
        Ok(LayerReveal {
            layer: layer as u32,
            position: position as u32,
            input: wire_if(&l.input, needs.input),
            next: wire_if(next, needs.next),
            rows,
            cache,
        })
    }
}

/// What a check needs revealed ([`rows_needed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Needs {
    /// The rows of these products (those the layer has).
    pub rows: CheckSet,
    /// Whether the context row carries its values (the output projection's input).
    pub context_values: bool,
    /// Whether the MLP's hidden row carries its values (the down projection's input).
    pub hidden_values: bool,
    /// Whether the activations entering the layer are needed (the first products' input, the
    /// residuals).
    pub input: bool,
    /// Whether the activations leaving it are (the output's check).
    pub next: bool,
}

impl Needs {
    /// Whether the revealed row of `point` carries its values (a weight product's always do;
    /// the context's and the hidden row's only when a check takes them as the next product's
    /// input).
    pub fn values(&self, point: Point) -> bool {
        match point {
            Point::KvCache => false,
            Point::Context => self.context_values,
            Point::Hidden => self.hidden_values,
            _ => true,
        }
    }
}

/// Every weight product a layer may have.
const WEIGHT_PRODUCTS: CheckSet = CheckSet::of(&[
    Point::Q,
    Point::K,
    Point::V,
    Point::O,
    Point::Gate,
    Point::Up,
    Point::Fc,
    Point::Down,
]);

/// The MLP's first products: their rows commit only through the hidden row made of them.
const MLP_FIRST: CheckSet = CheckSet::of(&[Point::Gate, Point::Up, Point::Fc]);

/// The key and value projections: their rows commit only through the cache row made of them.
const KEY_VALUE: CheckSet = CheckSet::of(&[Point::K, Point::V]);

/// The parts a check of `checks` tests: the drawn ones, and with either of a pair whose rows
/// commit together both of them — k and v (as the cache row attention reads) and the SwiGLU
/// MLP's gate and up (as the hidden row `silu(gate) · up`). A check of one takes the other as
/// its source: were that source untested, a stage lying in it could reveal a made-up row of
/// the drawn one's partner that, with the true drawn row, still makes the committed row.
pub fn tested_parts(checks: CheckSet) -> CheckSet {
    [KEY_VALUE, CheckSet::of(&[Point::Gate, Point::Up])]
        .into_iter()
        .fold(checks, |tests, pair| {
            match checks.intersection(pair).is_empty() {
                true => tests,
                false => tests.union(pair),
            }
        })
}

/// What a check of `checks` needs revealed. A tested weight product needs its own row and the
/// rows its input is made from: q, k and v the layer's input; the output projection the
/// attention context (taken as committed unless the attention is recomputed); the MLP's first
/// products (both of a pair, [`tested_parts`]) the layer's input, the output projection and the
/// hidden row's opening (the row they make must be the committed one); the down projection the
/// committed hidden row, with its values, unless the first products are tested and make it.
/// k and v (both of the pair) need the layer's input and, unless the attention is recomputed
/// (which verifies the whole cache), the opening of the cache row they make. The attention
/// (either of its products: the scores commit through the context they make) needs q, the
/// cache rows (the row's own among them) and the context row's opening; the layer's output
/// needs its input, the output and down projections and the activations leaving it.
pub fn rows_needed(checks: CheckSet) -> Needs {
    use Point::*;
    let checks = tested_parts(checks);
    let first_tested = !checks.intersection(MLP_FIRST).is_empty();
    let mut rows = checks.intersection(WEIGHT_PRODUCTS);
    // The context is recomputed only when the attention is drawn (and opens the committed
    // row); otherwise, when the output projection is tested, its committed row (with values)
    // is its input. Likewise the hidden row for the down projection.
    let context_values = checks.contains(O) && !checks.attention();
    let hidden_values = checks.contains(Down) && !first_tested;
    if checks.attention() {
        rows = rows.with(Q);
    }
    if !checks.intersection(KEY_VALUE).is_empty() && !checks.attention() {
        rows = rows.with(KvCache);
    }
    if checks.attention() || context_values {
        rows = rows.with(Context);
    }
    if first_tested || checks.contains(Output) {
        rows = rows.with(O);
    }
    if first_tested || hidden_values {
        rows = rows.with(Hidden);
    }
    if checks.contains(Output) {
        rows = rows.with(Down);
    }
    let input = [Q, K, V, Output].iter().any(|&p| checks.contains(p)) || first_tested;
    Needs {
        rows,
        context_values,
        hidden_values,
        input,
        next: checks.contains(Output),
    }
}

/// The parts of a layer of `config` a spot check can test: each weight product, both attention
/// products and the output (see [`CheckSet`]).
pub fn check_parts(config: &crate::ModelConfig) -> Vec<Point> {
    use Point::*;
    let mlp: &[Point] = match config.arch == crate::config::Arch::Gpt2 {
        true => &[Fc, Down],
        false => &[Gate, Up, Down],
    };
    [&[Q, K, V, Scores, Context, O][..], mlp, &[Output]].concat()
}

/// The detection goal the default spot-check rate is set for (issue 5): a stage that corrupts
/// at least `GOAL_PERCENT` % of the GEMMs it runs in the decode hops of a `GOAL_TOKENS`-token
/// generation escapes every spot check with probability at most `GOAL_ESCAPE`.
pub const GOAL_PERCENT: usize = 1;
/// See [`GOAL_PERCENT`].
pub const GOAL_TOKENS: usize = 256;
/// See [`GOAL_PERCENT`].
pub const GOAL_ESCAPE: f64 = 1e-6;

/// The GEMMs of one layer of `config` in one decode hop: the parts of [`check_parts`] but the
/// output (which is glue, not a product).
pub fn gemms_per_layer(config: &crate::ModelConfig) -> usize {
    check_parts(config)
        .iter()
        .filter(|&&p| p != Point::Output)
        .count()
}

/// The per-part rate that meets the goal ([`GOAL_PERCENT`]) for a stage of `layers` layers of
/// `config`. The fewest lies that are the goal's share of the stage's
/// `GOAL_TOKENS · gemms_per_layer · layers` GEMMs are `N` (rounded up), and each corrupted GEMM
/// is drawn with probability `c` on its own coin, so the liar escapes with `(1 − c)^N`; the
/// rate is the least `c` with `(1 − c)^N ≤ GOAL_ESCAPE`, `1 − GOAL_ESCAPE^(1/N)`. A stage of
/// fewer layers runs fewer GEMMs, so its share is fewer lies and it takes a higher rate (0.44
/// for one Llama layer, 0.058 for ten, 0.018 for 32).
pub fn goal_rate(config: &crate::ModelConfig, layers: usize) -> f64 {
    let gemms = GOAL_TOKENS * gemms_per_layer(config) * layers;
    let lies = (gemms * GOAL_PERCENT).div_ceil(100).max(1);
    // 1 − e^(ln(escape) / N), without the cancellation of computing the power first.
    -(GOAL_ESCAPE.ln() / lies as f64).exp_m1()
}

/// The parts a check tests when each of `parts` is drawn independently with probability
/// `rate` (`unit` gives the draws, uniform in `[0, 1)`; a rate of 1 or more takes every part).
/// Drawing parts rather than whole layers is what makes the guarantee independent of how a
/// liar places its lies: each corrupted product is tested with probability `rate`, whether the
/// liar spreads its lies over many layers or packs them into a few (docs/VERIFICATION.md).
pub fn draw_checks(parts: &[Point], rate: f64, mut unit: impl FnMut() -> f64) -> CheckSet {
    parts
        .iter()
        .filter(|_| rate >= 1.0 || unit() < rate)
        .fold(CheckSet::EMPTY, |s, &p| s.with(p))
}

/// A checker's secrets and parameters for one layer: `W · r` of each weight product (with `r`
/// kept from every stage), the biases and the norms.
pub struct LayerChecker {
    layer: usize,
    products: Vec<(Point, FreivaldsKey, Option<Vec<f32>>)>,
    attn_norm: Norm,
    mlp_norm: Norm,
    gelu: bool,
}

impl std::fmt::Debug for LayerChecker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LayerChecker(layer {})", self.layer)
    }
}

impl LayerChecker {
    /// Builds the checker of `layer` (which `model` must hold) for the secret `secret`; each
    /// product gets its own `r`. Costs one pass over the layer's weights; afterwards the
    /// weights can be dropped.
    pub fn new(model: &Model, layer: usize, secret: &[u8; 32]) -> Result<LayerChecker> {
        let l = model
            .layer(layer)
            .ok_or_else(|| ModelError::Input(format!("layer {layer} is not loaded")))?;
        let products = l
            .linear_points()
            .iter()
            .filter_map(|&p| l.linear(p).map(|lin| (p, lin)))
            .map(|(p, lin)| {
                let mut h = Domain::HopRecord.hasher();
                h.update(b"freivalds r");
                h.update(secret);
                h.update(&(layer as u64).to_le_bytes());
                h.update(&[p as u8]);
                let key = FreivaldsKey::new(&lin.w, h.finalize().as_bytes());
                (p, key, lin.bias.clone())
            })
            .collect();
        Ok(LayerChecker {
            layer,
            products,
            attn_norm: l.attn_norm.clone(),
            mlp_norm: l.mlp_norm.clone(),
            gelu: matches!(l.mlp, Mlp::Gelu { .. }),
        })
    }

    /// The layer checked.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// The unit exponents of `point`'s columns, with which a row of it revealed in units form
    /// is read (for tools and tests that read or rewrite revealed rows); `None` if the layer
    /// has no such product.
    pub fn col_units(&self, point: Point) -> Option<&[i32]> {
        self.key(point).map(|(k, _)| k.col_units())
    }

    /// Checks what a stage revealed of this layer in the last of `hops` — every hop the stage
    /// served in the generation, in order from position 0, each as its signed trace and its
    /// number of rows: every revealed row opens its commitment, the revealed cache rows (from
    /// `known.len()` on: `known` holds the rows an earlier check already verified, from 0) are
    /// the ones each hop committed, every weight product passes Freivalds' test on the input
    /// the glue derives, the row's attention recomputed on the cache opens the context's
    /// commitment, the cache and hidden rows the tested pairs make open theirs, and the
    /// layer's output at that position is what all of it gives. Returns
    /// the verified cache up to the end of the hop (for the next check of the layer); `Err`
    /// says what failed.
    pub fn check(
        &self,
        model: &Model,
        hops: &[(&HopTrace, usize)],
        known: &LayerCache,
        reveal: &LayerReveal,
        checks: CheckSet,
    ) -> std::result::Result<LayerCache, String> {
        let mut cache = known.clone();
        self.check_in_place(model, hops, &mut cache, reveal, checks)?;
        Ok(cache)
    }

    /// [`Self::check`] extending `cache` (the rows verified so far) in place instead of copying
    /// it: on success it holds the verified rows up to the end of the hop (when the check
    /// recomputes the attention; otherwise it is left as it was); on an error it is left as it
    /// was.
    pub fn check_in_place(
        &self,
        model: &Model,
        hops: &[(&HopTrace, usize)],
        cache: &mut LayerCache,
        reveal: &LayerReveal,
        checks: CheckSet,
    ) -> std::result::Result<(), String> {
        self.check_rows_in_place(model, hops, cache, reveal, checks, 1)
    }

    /// [`Self::check_in_place`] of a reveal of the `positions` consecutive rows from
    /// `reveal.position` ([`KeptHop::reveal_rows`]; `positions` is what the checker asked for,
    /// not what the stage says): every row checked as a reveal of it alone would be, in order,
    /// the attention of each against the cache rows verified before it.
    pub fn check_rows_in_place(
        &self,
        model: &Model,
        hops: &[(&HopTrace, usize)],
        cache: &mut LayerCache,
        reveal: &LayerReveal,
        checks: CheckSet,
        positions: usize,
    ) -> std::result::Result<(), String> {
        let held = cache.len();
        let checked = self.check_extending(model, hops, cache, reveal, checks, positions);
        if checked.is_err() {
            cache.truncate(held);
        }
        checked
    }

    fn check_extending(
        &self,
        model: &Model,
        hops: &[(&HopTrace, usize)],
        cache: &mut LayerCache,
        reveal: &LayerReveal,
        checks: CheckSet,
        positions: usize,
    ) -> std::result::Result<(), String> {
        let cfg = &model.config;
        let (l, pos) = (self.layer as u32, reveal.position as usize);
        let &(trace, rows) = hops.last().ok_or("no hop to check")?;
        if checks.is_empty() {
            return Err("nothing to check".into());
        }
        let needs = rows_needed(checks);
        let has = self.products.iter().map(|(p, _, _)| *p);
        let lacks = checks
            .intersection(WEIGHT_PRODUCTS)
            .difference(has.fold(CheckSet::EMPTY, CheckSet::with));
        if !lacks.is_empty() {
            return Err(format!(
                "layer {l}: a drawn part is not one of this layer's products, so it is not tested"
            ));
        }
        if reveal.layer != l {
            return Err(format!("layer {} revealed for layer {l}", reveal.layer));
        }
        pos.checked_sub(trace.from)
            .filter(|&i| i < rows && positions >= 1 && positions <= rows - i)
            .ok_or_else(|| format!("{positions} positions from {pos} are not rows of the hop"))?;
        if !reveal.rows.len().is_multiple_of(positions) {
            return Err(format!(
                "layer {l}: {} rows revealed for {positions} positions",
                reveal.rows.len()
            ));
        }
        let h = cfg.hidden_size;
        let input = hop_rows(&reveal.input, trace.from, rows, h, needs.input)?;
        let next = hop_rows(&reveal.next, trace.from, rows, h, needs.next)?;
        // The revealed activations' hashes are taken with the first row's openings.
        let mut hashes = Hashes::default();
        if needs.input {
            hashes.push(
                Message::Activations(&input),
                Want::Input(trace.get(l, Point::Input)),
            );
        }
        // Looked up only when needed, where it is (the hop's output after its last layer, the
        // next layer's input otherwise) first: a lookup that misses scans the whole trace.
        let next_commitment = || {
            let (output, input) = (
                || trace.get(l, Point::Output),
                || trace.get(l + 1, Point::Input),
            );
            match trace.entries.last().is_some_and(|e| e.layer == l) {
                true => output().or_else(input),
                false => input().or_else(output),
            }
        };
        if needs.next {
            hashes.push(Message::Activations(&next), Want::Output(next_commitment()));
        }
        let known = cache.len();
        if checks.attention() {
            // Every revealed cache row checked against its hop's commitment, and the cache
            // extended to the first checked position.
            self.cache_rows(cfg, hops, cache, reveal)?;
        } else if !reveal.cache.is_empty() {
            return Err(format!(
                "layer {l}: cache rows revealed that were not asked for"
            ));
        }
        let rb = cache.row_bytes();
        let per = reveal.rows.len() / positions;
        let hop = HopRows {
            trace,
            rows,
            input: &input,
            next: &next,
        };
        // Every asked position is checked, whatever was revealed (no rows: each check finds
        // the rows it needs missing).
        for i in 0..positions {
            let (product_rows, at) = (&reveal.rows[i * per..(i + 1) * per], pos + i);
            // The cache holds 0..at: the rows before the first position from the reveal, each
            // later one appended (and compared with the revealed row) by the row before it.
            let cache_row = match checks.attention() {
                true => &reveal.cache[(at - known) * rb..(at - known + 1) * rb],
                false => &[][..],
            };
            self.check_row(
                model,
                hop,
                cache,
                cache_row,
                product_rows,
                at,
                checks,
                &mut hashes,
            )?;
        }
        if !checks.attention() {
            return Ok(());
        }
        // The cache now holds 0..pos + positions; the hop's later rows were verified above.
        let end = trace.from + rows;
        let later = (pos + positions - known) * rb..(end - known) * rb;
        cache
            .extend_encoded(&reveal.cache[later])
            .map_err(|e| format!("layer {l}: {e}"))
    }

    /// Checks the revealed `rows` of one position `pos` of `hop` (the cache holding `0..pos`
    /// and, when the attention is recomputed, `cache_row` the revealed row of `pos`).
    #[allow(clippy::too_many_arguments)]
    fn check_row<'a>(
        &self,
        model: &Model,
        hop: HopRows<'a>,
        cache: &mut LayerCache,
        cache_row: &[u8],
        product_rows: &'a [RevealedRow],
        pos: usize,
        checks: CheckSet,
        hashes: &mut Hashes<'a>,
    ) -> std::result::Result<(), String> {
        let cfg = &model.config;
        let l = self.layer as u32;
        let HopRows {
            trace,
            rows,
            input,
            next,
        } = hop;
        let index = pos - trace.from;
        let needs = rows_needed(checks);
        let needed = needs.rows;
        let tests = tested_parts(checks);
        let the_row = |point: Point| {
            let mut found = product_rows.iter().filter(|r| r.point == point);
            match (found.next(), found.next()) {
                (Some(row), None) => Ok(row),
                _ => Err(format!("layer {l}: not exactly one {point:?} row revealed")),
            }
        };
        // Every product the checks need, once, opened against its commitment; the attention
        // products' rows and the MLP's hidden row are recomputed, so only their openings are
        // taken here (but for the context's values when they are the output projection's
        // input, and the hidden row's when they are the down projection's).
        let mut values = Vec::new();
        let mut context = None;
        let mut hidden = None;
        let mut kv_row = None;
        for e in trace.entries.iter().filter(|e| e.layer == l) {
            if matches!(e.point, Point::Input | Point::Output) || !needed.contains(e.point) {
                continue;
            }
            let (cols, key) = match e.point {
                Point::KvCache => (cache.row_bytes(), None),
                Point::Context => (cfg.q_width(), None),
                Point::Hidden => (cfg.intermediate_size, None),
                p => {
                    let (key, _) = self.key(p).ok_or_else(|| {
                        format!("layer {l}: the trace commits a {p:?} product this layer lacks")
                    })?;
                    (key.cols(), Some(key))
                }
            };
            let row = the_row(e.point)?;
            let opening = Opening {
                commitment: &e.commitment,
                rows,
                first: trace.from,
                position: pos,
                cols,
                encoding: &row.encoding,
                root: &row.root,
                path: &row.path,
            };
            let opens = || {
                format!(
                    "layer {l}: the {:?} row at position {pos} does not open its commitment",
                    e.point
                )
            };
            // Every field of a row is read, so a reveal says one thing only.
            if row.cols as usize != cols {
                return Err(opens());
            }
            if e.point == Point::KvCache {
                // The row k and v make is recomputed; only its opening travels.
                if row.unit.is_some() || !row.encoding.is_empty() {
                    return Err(format!(
                        "layer {l}: the cache row carries values, but only its opening travels"
                    ));
                }
                kv_row = Some(opening);
                continue;
            }
            if matches!(e.point, Point::Context | Point::Hidden) {
                if row.unit.is_some() {
                    return Err(format!(
                        "layer {l}: the {:?} row carries a product's unit",
                        e.point
                    ));
                }
                let committed = match needs.values(e.point) {
                    // The next product's input as committed.
                    true => {
                        let what = match e.point {
                            Point::Context => "context",
                            _ => "hidden",
                        };
                        let decoded = QuantizedRows::decode_row(&row.encoding, cols)
                            .map_err(|why| format!("layer {l}: the {what} row: {why}"))?;
                        hashes.push(
                            Message::QuantizedRow(cols, &row.encoding),
                            Want::Opens(opening, e.point),
                        );
                        CommittedRow::Revealed(decoded)
                    }
                    false if !row.encoding.is_empty() => {
                        return Err(format!(
                            "layer {l}: the {:?} row carries values no check takes",
                            e.point
                        ))
                    }
                    false => CommittedRow::Opening(opening),
                };
                match e.point {
                    Point::Context => context = Some(committed),
                    _ => hidden = Some(committed),
                }
                continue;
            }
            // Every opened row's rounded values (its leaf hashes them, and the glue computes
            // on them), and a tested product's side of Freivalds' test.
            let key = key.ok_or_else(|| format!("layer {l}: {:?} is not a product", e.point))?;
            let (rounded, output_side) = decode_product_row(row, key, checks.contains(e.point))
                .map_err(|why| format!("layer {l}: the {:?} row: {why}", e.point))?;
            hashes.push(
                Message::ProductRow(values.len()),
                Want::Opens(opening, e.point),
            );
            values.push(RevealedValues {
                point: e.point,
                rounded,
                output_side,
            });
        }
        // Every row opened above, and the first row's revealed activations, open their
        // commitments (hashed together).
        hashes.verify(l, pos, &values)?;
        // The MLP's first products, which have no commitment of their own: each tested (its
        // row then made into the hidden row, which must open the committed one).
        for &(point, ref key, _) in &self.products {
            if point.output_committed() || !needed.contains(point) {
                continue;
            }
            let row = the_row(point)?;
            if row.cols as usize != key.cols() {
                return Err(format!(
                    "layer {l}: the {point:?} row has {} values",
                    row.cols
                ));
            }
            // Nothing to open, so no opening: a reveal says one thing only (a root or path
            // here would be bytes no check reads, a second form of the same reveal).
            if row.root != Commitment::default() || !row.path.is_empty() {
                return Err(format!(
                    "layer {l}: the {point:?} row carries an opening, but it has no commitment \
                     of its own"
                ));
            }
            let (rounded, output_side) = decode_product_row(row, key, tests.contains(point))
                .map_err(|why| format!("layer {l}: the {point:?} row: {why}"))?;
            values.push(RevealedValues {
                point,
                rounded,
                output_side,
            });
        }
        // Every row the checks need that the layer has was committed and revealed.
        let found = values
            .iter()
            .map(|v| v.point)
            .chain(context.as_ref().map(|_| Point::Context))
            .chain(hidden.as_ref().map(|_| Point::Hidden))
            .chain(kv_row.as_ref().map(|_| Point::KvCache))
            .fold(CheckSet::EMPTY, CheckSet::with);
        let has = self.products.iter().map(|(p, _, _)| *p).fold(
            CheckSet::of(&[Point::Context, Point::Hidden, Point::KvCache]),
            CheckSet::with,
        );
        if found != needed.intersection(has) {
            return Err(format!(
                "layer {l}: the trace or the reveal lacks a row the check needs"
            ));
        }
        if product_rows.len()
            != values.len()
                + context.is_some() as usize
                + hidden.is_some() as usize
                + kv_row.is_some() as usize
        {
            return Err(format!(
                "layer {l}: rows revealed that the trace does not commit or the check does \
                 not need"
            ));
        }
        let x = Activations {
            start: pos,
            hidden: cfg.hidden_size,
            data: input.data[index * cfg.hidden_size..(index + 1) * cfg.hidden_size].to_vec(),
        };
        let glue = Glue {
            attn_norm: &self.attn_norm,
            mlp_norm: &self.mlp_norm,
            gelu: self.gelu,
        };
        // The hidden row is tested too when the first products are, and the cache row when k
        // and v are: what they make must be it.
        let mut tests = tests;
        if !tests.intersection(MLP_FIRST).is_empty() {
            tests = tests.with(Point::Hidden);
        }
        if !tests.intersection(KEY_VALUE).is_empty() {
            tests = tests.with(Point::KvCache);
        }
        let mut revealed = Revealed {
            checker: self,
            tests,
            position: pos,
            values,
            hidden,
            kv_row,
            cache,
            cache_row,
            shape: AttentionShape {
                heads: cfg.num_heads,
                kv_heads: cfg.num_kv_heads,
                head_dim: cfg.head_dim,
                window: cfg.sliding_window,
            },
            context,
            tested: CheckSet::EMPTY,
        };
        let y = model
            .block(&glue, self.layer, x, &mut revealed)
            .map_err(|e| e.to_string())?;
        let tested = revealed.tested;
        // Every drawn part but the output (compared below) was tested inside the block.
        if !checks
            .difference(tested)
            .difference(CheckSet::of(&[Point::Output]))
            .is_empty()
        {
            return Err(format!("layer {l}: a drawn part was not tested"));
        }
        let want = &next.data[index * cfg.hidden_size..(index + 1) * cfg.hidden_size];
        let output_differs = |y: &Activations| {
            y.data
                .iter()
                .zip(want)
                .any(|(a, b)| a.to_bits() != b.to_bits())
        };
        if checks.contains(Point::Output) && y.as_ref().is_none_or(output_differs) {
            return Err(format!(
                "layer {l}: the output at position {pos} is not what the revealed products give"
            ));
        }
        Ok(())
    }

    /// Checks the revealed cache rows against every hop's `KvCache` commitment and extends
    /// `cache` (the rows known so far) to the positions before the checked one (each checked
    /// row then takes its own revealed row and appends it).
    fn cache_rows(
        &self,
        cfg: &crate::ModelConfig,
        hops: &[(&HopTrace, usize)],
        cache: &mut LayerCache,
        reveal: &LayerReveal,
    ) -> std::result::Result<(), String> {
        let (l, pos, from) = (self.layer, reveal.position as usize, cache.len());
        check_cache_rows(cfg, l, hops, from, &reveal.cache)?;
        let rb = cache.row_bytes();
        if pos < from || (cache.kv_heads(), cache.head_dim()) != (cfg.num_kv_heads, cfg.head_dim) {
            return Err(format!(
                "layer {l}: the known cache does not fit position {pos}"
            ));
        }
        cache
            .extend_encoded(&reveal.cache[..(pos - from) * rb])
            .map_err(|e| format!("layer {l}: {e}"))
    }

    fn key(&self, point: Point) -> Option<(&FreivaldsKey, Option<&[f32]>)> {
        self.products
            .iter()
            .find(|(p, _, _)| *p == point)
            .map(|(_, k, b)| (k, b.as_deref()))
    }
}

/// A revealed weight product's row decoded for a check, in whichever form it travelled
/// ([`row_for_reveal`]; in units form read with the checker's own column units): its values
/// rounded to f32, and when `tested` its side of Freivalds' test, `C_row · r`.
fn decode_product_row(
    row: &RevealedRow,
    key: &FreivaldsKey,
    tested: bool,
) -> std::result::Result<(Vec<f32>, Option<u64>), String> {
    let (decoded, side) = match row.unit {
        Some(unit) => {
            // The sums enter Freivalds' test as they travelled (the key holds `r` in the
            // columns' units): only their roundings are decoded, which also refuses a row
            // that is not one usual sum per column.
            let only_rounded = Decode {
                residues: false,
                rounded: true,
            };
            let d = decode_units_for_check(unit, &row.encoding, key.col_units(), only_rounded)?;
            let side = tested.then(|| key.output_side_of_units(unit, &row.encoding));
            (d, side)
        }
        None => {
            let want = Decode {
                residues: tested,
                rounded: true,
            };
            let d = decode_for_check(&row.encoding, key.cols(), want)?;
            let side = tested.then(|| key.output_side_of_residues(&d.residues));
            (d, side)
        }
    };
    let side = side
        .map(|s| s.ok_or("not one value per column"))
        .transpose()?;
    Ok((decoded.rounded, side))
}

/// The hashes a check takes of what was revealed (the activations entering and leaving the
/// layer, each opened row's leaf), gathered so that [`Hashes::verify`] can hash them together
/// where that pays (a decode check's few rows of a few KB each leave the hash lanes mostly idle
/// one at a time) and compare them in the order they were gathered, so the first mismatch is
/// the one named.
#[derive(Default)]
struct Hashes<'a> {
    gathered: Vec<(Message<'a>, Want<'a>)>,
}

/// A message a check hashes.
enum Message<'a> {
    /// Revealed activations (their commitment).
    Activations(&'a Activations),
    /// The leaf of the row at position `pos` of a product whose rounded values are
    /// `values[index]` of [`Hashes::verify`].
    ProductRow(usize),
    /// The leaf of a quantised row of `k` values at position `pos`, its canonical bytes.
    QuantizedRow(usize, &'a [u8]),
}

/// What a gathered hash must be.
enum Want<'a> {
    /// The commitment of the revealed input (`None`: the trace has none, which nothing
    /// matches).
    Input(Option<Commitment>),
    /// The same of the revealed output.
    Output(Option<Commitment>),
    /// The leaf of an opened row of a product or a quantised row.
    Opens(Opening<'a>, Point),
}

impl<'a> Hashes<'a> {
    fn push(&mut self, message: Message<'a>, want: Want<'a>) {
        self.gathered.push((message, want));
    }

    /// Hashes what was gathered and compares each hash with what it must be, in order (the
    /// rows being layer `l`'s at position `pos`, product rows' values in `values`); leaves
    /// nothing gathered.
    fn verify(
        &mut self,
        l: u32,
        pos: usize,
        values: &[RevealedValues],
    ) -> std::result::Result<(), String> {
        // Bytes of each message (its 16-byte head and its body), to see whether the lanes pay.
        let len = |m: &Message| match m {
            Message::Activations(a) => 16 + 4 * a.data.len(),
            Message::ProductRow(i) => 16 + 4 * values[*i].rounded.len(),
            Message::QuantizedRow(_, bytes) => 16 + bytes.len(),
        };
        let hashes: Vec<Commitment> =
            match dc_kernels::hash_many::lanes_pay(self.gathered.iter().map(|(m, _)| len(m))) {
                true => {
                    let mut batch = LeafBatch::default();
                    for (m, _) in &self.gathered {
                        match m {
                            Message::Activations(a) => {
                                batch.activations(a.start, a.hidden, &a.data)
                            }
                            Message::ProductRow(i) => {
                                batch.product_row_message(pos, &values[*i].rounded)
                            }
                            Message::QuantizedRow(k, bytes) => {
                                batch.quantized_row_message(pos, *k, bytes)
                            }
                        }
                    }
                    batch.finish_sets(false).commitments
                }
                false => self
                    .gathered
                    .iter()
                    .map(|(m, _)| match m {
                        Message::Activations(a) => a.commitment(),
                        Message::ProductRow(i) => product_row_leaf(pos, &values[*i].rounded),
                        Message::QuantizedRow(k, bytes) => quantized_row_leaf(pos, *k, bytes),
                    })
                    .collect(),
            };
        for ((_, want), hash) in self.gathered.drain(..).zip(hashes) {
            let error = match want {
                Want::Input(c) if c != Some(hash) => {
                    "the revealed input is not the committed one".into()
                }
                Want::Output(c) if c != Some(hash) => {
                    "the revealed output is not the committed one".into()
                }
                Want::Opens(opening, p) if !opening.holds_for(&hash) => {
                    format!("the {p:?} row at position {pos} does not open its commitment")
                }
                _ => continue,
            };
            return Err(format!("layer {l}: {error}"));
        }
        Ok(())
    }
}

/// The hop a check's rows belong to: its signed trace, its number of rows, and the revealed
/// activations entering and leaving the checked layer (every row, verified once).
#[derive(Clone, Copy)]
struct HopRows<'a> {
    trace: &'a HopTrace,
    rows: usize,
    input: &'a Activations,
    next: &'a Activations,
}

/// One pick of a hop to check: the layer's checker, what the stage revealed, the parts drawn,
/// the number of positions asked for (from the reveal's), and the layer's verified cache rows
/// (extended in place when the check recomputes the attention).
pub type Pick<'a> = (
    &'a LayerChecker,
    &'a LayerReveal,
    CheckSet,
    usize,
    &'a mut LayerCache,
);

/// [`LayerChecker::check_in_place`] of every pick of one hop (each of another layer), in
/// parallel on the rayon pool this is called from (on the calling thread outside one); the
/// results in pick order.
pub fn check_picks(
    model: &Model,
    hops: &[(&HopTrace, usize)],
    picks: Vec<Pick<'_>>,
) -> Vec<std::result::Result<(), String>> {
    use rayon::prelude::*;
    let one = |(c, reveal, checks, positions, cache): Pick<'_>| {
        c.check_rows_in_place(model, hops, cache, reveal, checks, positions)
    };
    match rayon::current_thread_index() {
        Some(_) => picks.into_par_iter().map(one).collect(),
        None => picks.into_iter().map(one).collect(),
    }
}

/// Checks that `bytes` are `layer`'s KV cache rows of the positions of `hops` from `from` on
/// — `hops` being all the hops a stage served in a generation, in order from position 0, as
/// (signed trace, rows), and `from` where one of them starts (or their end) — exactly as each
/// hop committed them.
pub fn check_cache_rows(
    cfg: &crate::ModelConfig,
    layer: usize,
    hops: &[(&HopTrace, usize)],
    from: usize,
    bytes: &[u8],
) -> std::result::Result<(), String> {
    let l = layer as u32;
    let rb = LayerCache::new(cfg.num_kv_heads, cfg.head_dim).row_bytes();
    let mut end = 0;
    for &(t, n) in hops {
        if t.from != end {
            return Err(format!(
                "the hops do not cover the generation: one starts at {} after {end}",
                t.from
            ));
        }
        end += n;
    }
    if from != end && hops.iter().all(|(t, _)| t.from != from) {
        return Err(format!("layer {l}: no hop starts at position {from}"));
    }
    if bytes.len() != (end - from.min(end)) * rb {
        return Err(format!(
            "layer {l}: {} bytes of cache rows revealed, not positions {from}..{end}",
            bytes.len()
        ));
    }
    // Every hop's rows hashed together (a decode hop's one row is too short to fill the hash
    // lanes alone), each hop's commitment then compared in order.
    let revealed: Vec<(&HopTrace, usize)> = hops
        .iter()
        .copied()
        .filter(|(t, _)| t.from >= from)
        .collect();
    let mut batch = LeafBatch::default();
    for &(t, n) in &revealed {
        let rows = &bytes[(t.from - from) * rb..(t.from - from + n) * rb];
        queue_cache_rows(&mut batch, t.from, rb, rows);
    }
    for (&(t, n), (commitment, _)) in revealed.iter().zip(batch.finish(false)) {
        if t.get(l, Point::KvCache) != Some(commitment) {
            return Err(format!(
                "layer {l}: the revealed cache rows of positions {}..{} are not the committed \
                 ones",
                t.from,
                t.from + n
            ));
        }
    }
    Ok(())
}

/// Revealed activations of a hop: `rows` rows of `hidden` from `first` if `needed`, none
/// otherwise (then zeros stand in: nothing checked depends on them).
fn hop_rows(
    w: &WireActivations,
    first: usize,
    rows: usize,
    hidden: usize,
    needed: bool,
) -> std::result::Result<Activations, String> {
    let len = if needed { rows * hidden } else { 0 };
    if w.start as usize != first || w.hidden as usize != hidden || w.data.len() != len {
        return Err(format!(
            "revealed activations cover {} values from position {}, not the {} rows the \
             check needs of the hop's {rows}",
            w.data.len(),
            w.start,
            len / hidden.max(1)
        ));
    }
    Ok(Activations {
        start: first,
        hidden,
        data: match needed {
            true => w.data.clone(),
            false => vec![0.0; rows * hidden],
        },
    })
}

/// The checker's products: revealed rows, each weight product tested by Freivalds; the
/// attention recomputed on the revealed cache; the MLP's hidden row made of its tested first
/// products and compared with the committed one.
struct Revealed<'a, 'c> {
    checker: &'a LayerChecker,
    /// What is tested ([`tested_parts`] of the drawn parts, and the hidden row with the first
    /// products); a product outside it is only supplied (from its revealed row when some
    /// tested part needs it, as zeros otherwise: nothing tested depends on those).
    tests: CheckSet,
    /// The checked row's position.
    position: usize,
    values: Vec<RevealedValues>,
    /// The MLP's hidden row, when the check needs it.
    hidden: Option<CommittedRow<'a>>,
    /// The opening of the checked position's cache row, when k and v are tested without the
    /// attention (with it, `cache_row` is that row, verified against the commitments).
    kv_row: Option<Opening<'a>>,
    /// The revealed cache of the positions before the checked one.
    cache: &'c mut LayerCache,
    /// The revealed cache row of the checked position.
    cache_row: &'a [u8],
    shape: AttentionShape,
    /// The context row, when the check needs it: its opening when the attention is recomputed
    /// (the quantised row it makes must open it), the row itself as the output projection's
    /// input otherwise.
    context: Option<CommittedRow<'a>>,
    /// The drawn parts tested so far: once every one is (and the output is not drawn),
    /// nothing the rest of the block computes is needed.
    tested: CheckSet,
}

/// A committed quantised row a check needs (the attention context, the MLP's hidden row): its
/// opening, to test the row that what it tested makes, or the row itself (opened), as the next
/// product's input.
enum CommittedRow<'a> {
    Opening(Opening<'a>),
    Revealed(QuantizedRows),
}

/// A revealed row of a product the check needs, opened against the commitment: its values
/// rounded as the stage's epilogue rounded them and, when the product is tested, its side of
/// Freivalds' test.
struct RevealedValues {
    point: Point,
    rounded: Vec<f32>,
    /// `C_row · r`, computed from the exact values as they travelled.
    output_side: Option<u64>,
}

impl Revealed<'_, '_> {
    /// The revealed row of `point`, if revealed.
    fn row(&self, point: Point) -> Option<&RevealedValues> {
        self.values.iter().find(|v| v.point == point)
    }
}

impl Products for Revealed<'_, '_> {
    fn linear(&mut self, point: Point, x: &QuantizedRows, out: &mut Vec<f32>) -> Result<()> {
        let layer = self.checker.layer;
        let (key, bias) = self
            .checker
            .key(point)
            .ok_or_else(|| ModelError::Input(format!("layer {layer} has no {point:?} product")))?;
        out.clear();
        let tested = match self.tests.contains(point) {
            true => self.tested.with(point),
            false => self.tested,
        };
        let needed_after = !self.tests.difference(tested).is_empty();
        let Some(row) = self.row(point) else {
            if self.tests.contains(point) {
                return Err(ModelError::Input(format!(
                    "layer {layer}: no {point:?} row"
                )));
            }
            // Not needed by anything tested: a stand-in.
            out.resize(key.cols(), 0.0);
            return Ok(());
        };
        let holds = |side: Option<u64>| side.is_some_and(|side| key.holds(x, 0, side));
        if self.tests.contains(point) && !holds(row.output_side) {
            return Err(ModelError::Input(format!(
                "layer {layer}: the {point:?} row is not its input times the weights \
                 (Freivalds' test)"
            )));
        }
        // Once every drawn part is tested nothing depends on this output: a stand-in.
        match needed_after {
            true => {
                out.extend_from_slice(&row.rounded);
                add_bias(bias, out);
            }
            false => out.resize(key.cols(), 0.0),
        }
        self.tested = tested;
        Ok(())
    }

    fn quantized(&mut self, point: Point, derived: QuantizedRows) -> Result<QuantizedRows> {
        let layer = self.checker.layer;
        let (row, made_of, tested) = match point {
            Point::Context => (
                self.context.take(),
                "recomputed from the revealed cache",
                // The scores commit through the context they make: both are tested by it.
                CheckSet::of(&[Point::Scores, Point::Context]),
            ),
            _ => (
                self.hidden.take(),
                "what its first products give",
                CheckSet::of(&[Point::Hidden]),
            ),
        };
        match row {
            Some(CommittedRow::Opening(opening)) => {
                let mut bytes = Vec::new();
                derived.encode_row(0, &mut bytes);
                let leaf = quantized_row_leaf(self.position, derived.k(), &bytes);
                if derived.rows() != 1 || !opening.holds_for(&leaf) {
                    return Err(ModelError::Input(format!(
                        "layer {layer}: the {point:?} row at position {} is not {made_of}",
                        self.position
                    )));
                }
                self.tested = self.tested.union(tested);
                Ok(derived)
            }
            Some(CommittedRow::Revealed(row)) => Ok(row),
            None => Ok(derived),
        }
    }

    fn more(&self) -> bool {
        // The output is tested after the block, so a check drawing it never stops early.
        !self.tests.difference(self.tested).is_empty()
    }

    fn instead_of_deriving(
        &mut self,
        point: Point,
        rows: usize,
        k: usize,
    ) -> Option<QuantizedRows> {
        use Point::*;
        let (derives, row) = match point {
            Context => (
                CheckSet::of(&[Q, K, V, KvCache, Scores, Context]),
                &mut self.context,
            ),
            _ => (CheckSet::of(&[Gate, Up, Fc, Hidden]), &mut self.hidden),
        };
        if !self.tests.intersection(derives).is_empty() {
            return None;
        }
        match row.take() {
            // Nothing derived here is tested: the committed rows go to the next product.
            Some(CommittedRow::Revealed(committed)) => Some(committed),
            // Nor does anything tested read them (the next product is not tested): a stand-in.
            None => {
                let blocks = rows * k.div_ceil(BLOCK);
                let zeros = vec![0; blocks * BLOCK];
                let scales = vec![BlockScale::for_amax(0.0); blocks];
                Some(QuantizedRows::from_parts(rows, k, zeros, scales))
            }
            // An opening is there only to test what the glue derives.
            opening => {
                *row = opening;
                None
            }
        }
    }

    fn attention(&mut self, q: &[f32], k: &[f32], v: &[f32], start: usize) -> Result<Vec<f32>> {
        let layer = self.checker.layer;
        if self.tests.contains(Point::KvCache) {
            // The tested k and v must make the committed cache row: the revealed one, verified
            // against the hops' commitments, when the attention is recomputed; otherwise the
            // one the opening names.
            let mut one = LayerCache::new(self.shape.kv_heads, self.shape.head_dim);
            one.append(k, v)?;
            let mut mine = Vec::with_capacity(one.row_bytes());
            one.encode_row(0, &mut mine);
            let committed = match (self.tests.attention(), &self.kv_row) {
                (true, _) => mine == self.cache_row,
                (false, Some(o)) => o.holds_for(&cache_row_leaf(start, &mine)),
                (false, None) => false,
            };
            if !committed {
                return Err(ModelError::Input(format!(
                    "layer {layer}: the cache row at position {start} is not the row's keys \
                     and values"
                )));
            }
            self.tested = self.tested.with(Point::KvCache);
        }
        let mut ctx = vec![0f32; q.len()];
        if !self.tests.attention() {
            // A stand-in: the output projection, if tested, takes the committed context row
            // (`quantized`), and nothing else depends on it.
            return Ok(ctx);
        }
        // The row's own keys and values as committed (k and v have no commitment of their own).
        self.cache.extend_encoded(self.cache_row)?;
        attend(self.shape, self.cache, q, start, &mut ctx, layer)?;
        Ok(ctx)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is the failure report

    use super::*;
    use crate::config::ModelConfig;

    /// Appends positions `from..to` to both layers of `cache`, each row's values made from its
    /// position and layer.
    fn fill(cfg: &ModelConfig, cache: &mut KvCache, from: usize, to: usize) {
        let w = cfg.kv_width();
        for pos in from..to {
            for l in 0..2 {
                let value =
                    |i: usize, salt: usize| ((pos * 7 + i * 3 + l + salt) % 23) as f32 - 11.0;
                let k: Vec<f32> = (0..w).map(|i| value(i, 0)).collect();
                let v: Vec<f32> = (0..w).map(|i| value(i, 5)).collect();
                cache.layer_mut(l).unwrap().append(&k, &v).unwrap();
            }
        }
    }

    #[test]
    fn the_cache_log_reads_across_chunks_and_copies_only_the_chunk_it_writes_into() {
        let cfg = ModelConfig::from_hf_json(&serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 32, "max_position_embeddings": 512, "rms_norm_eps": 1e-5
        }))
        .unwrap();
        let mut cache = KvCache::new(&cfg, 0..2);
        let mut log = CacheLog::default();
        fill(&cfg, &mut cache, 0, 100);
        log.record(&cache);
        // A reveal in flight holds the log while the next hop appends.
        let held = log.clone();
        fill(&cfg, &mut cache, 100, 150);
        log.record(&cache);
        for l in 0..2 {
            let c = cache.layer(l).unwrap();
            for (a, b) in [
                (0, 150),
                (0, 64),
                (63, 65),
                (64, 128),
                (99, 101),
                (127, 150),
                (7, 7),
            ] {
                assert_eq!(
                    log.rows_between(l, a, b).unwrap(),
                    c.encode_rows(a..b),
                    "layer {l}, {a}..{b}"
                );
            }
            assert!(log.rows(l, 151).is_none() && log.rows_between(l, 5, 4).is_none());
            // The held log still reads what it held, and no more.
            assert_eq!(held.rows(l, 100).unwrap(), c.encode_rows(0..100));
            assert!(held.rows(l, 101).is_none());
            // The full chunk stays shared; the one written into was copied for the log alone.
            assert!(Arc::ptr_eq(&held.rows[l][0], &log.rows[l][0]));
            assert!(!Arc::ptr_eq(&held.rows[l][1], &log.rows[l][1]));
        }
        assert_eq!(log.bytes(), 2 * 150 * log.row_bytes());
        assert!(log.rows(2, 1).is_none(), "no such layer");
    }
}
