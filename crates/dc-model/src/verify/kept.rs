//! What a stage keeps of one hop so that it can reveal any row of any product it committed,
//! and the reveal itself. Filled by the forward pass as it runs (so it sits below it and
//! imports nothing of it); it never checks anything.

use dc_kernels::verify::commit::{row_leaf_at, MerkleTree};
use dc_kernels::verify::reveal::row_for_reveal;
use dc_kernels::{Accumulators, Commitment};
use dc_types::{CheckSet, LayerReveal, Point, RevealedRow, WireActivations};

use super::cache_log::CacheLog;
use super::plan::rows_needed;
use crate::activations::Activations;
use crate::weights::{KeptProduct, RowLeaves};

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
    /// of every hop from the one starting at `cache_from` (at most this hop's first position)
    /// through this one, each hop's whole (its cut tail too), from `log`.
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
            // Every row of the hops from `cache_from` through this one, each whole.
            true => log.hop_rows(layer, cache_from, first + 1).ok_or_else(|| {
                format!(
                    "the cache rows of layer {layer} from {cache_from} up to {end} are not kept"
                )
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
