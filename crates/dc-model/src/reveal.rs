//! Spot checks of a stage's products (docs/VERIFICATION.md): what a stage keeps of a hop so it
//! can reveal any row of it afterwards, and the checker's side — Freivalds' test for every
//! weight product, and the very glue code a stage runs for everything between the products.
//!
//! A check needs no KV cache and no weights beyond `W · r` per product and the layer's norms:
//! the stage reveals the row of each product at one position (tied to its signed commitments by
//! Merkle paths) and the activations entering and leaving the layer. The checker re-derives
//! every product's input from those, tests each weight product's row in O(k + n), and recomputes
//! the layer's output. The attention products are taken as revealed (their inputs are other
//! positions' keys and values); replay audits cover them.

use dc_kernels::commit::{merkle_proof, merkle_root, row_leaf_at};
use dc_kernels::freivalds::FreivaldsKey;
use dc_kernels::reveal::{decode_row, leaf_of_encoding, rounded, row_encoding, Opening};
use dc_kernels::{Accumulators, Commitment, Domain, Exact, QuantizedRows};
use dc_types::{HopTrace, LayerReveal, Point, RevealedRow, WireActivations};

use crate::error::{ModelError, Result};
use crate::model::{Activations, Glue, Model, Products};
use crate::weights::{add_bias, Mlp, Norm};

/// A product a stage kept.
pub(crate) enum Kept {
    /// A weight product's exact accumulators.
    Gemm(Accumulators),
    /// Rows already in canonical encoding (the attention context), one per position.
    Rows { cols: usize, rows: Vec<Vec<u8>> },
}

impl Kept {
    fn bytes(&self) -> usize {
        match self {
            Kept::Gemm(a) => a.slots.len() * 16 + a.wide.len() * 64,
            Kept::Rows { rows, .. } => rows.iter().map(Vec::len).sum(),
        }
    }

    /// The row at `index` with its Merkle path, for a product whose first row is at `first`.
    fn reveal(&self, point: Point, first: usize, index: usize) -> Option<RevealedRow> {
        let (cols, leaves, encoding) = match self {
            Kept::Gemm(acc) => {
                if index >= acc.rows {
                    return None;
                }
                let leaves: Vec<Commitment> =
                    (0..acc.rows).map(|r| row_leaf_at(acc, r, first)).collect();
                (acc.cols, leaves, row_encoding(acc, index))
            }
            Kept::Rows { cols, rows } => {
                let leaves: Vec<Commitment> = rows
                    .iter()
                    .enumerate()
                    .map(|(r, e)| leaf_of_encoding(first + r, *cols, e))
                    .collect();
                (*cols, leaves, rows.get(index)?.clone())
            }
        };
        Some(RevealedRow {
            point,
            cols: cols as u32,
            encoding,
            root: merkle_root(&leaves),
            path: merkle_proof(&leaves, index),
        })
    }
}

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
            products: Vec::new(),
        }
    }

    pub(crate) fn keep(&mut self, point: Point, kept: Kept) {
        self.products.push((point, kept));
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
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        let acts = |a: &Activations| a.data.len() * 4;
        self.layers
            .iter()
            .map(|l| acts(&l.input) + l.products.iter().map(|(_, k)| k.bytes()).sum::<usize>())
            .sum::<usize>()
            + self.output.as_ref().map_or(0, acts)
    }

    /// Reveals `layer` at `position`: the activations entering and leaving the layer and the
    /// row of each product at that position (the attention scores are not revealed: a check
    /// does not use them).
    pub fn reveal(
        &self,
        layer: usize,
        position: usize,
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
        let next = match self.layers.get(i + 1) {
            Some(n) => &n.input,
            None => self.output.as_ref().ok_or("the hop did not finish")?,
        };
        let rows = l
            .products
            .iter()
            .filter(|(p, _)| *p != Point::Scores)
            .map(|(p, k)| k.reveal(*p, first, index).ok_or("a kept product is short"))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(LayerReveal {
            layer: layer as u32,
            position: position as u32,
            input: wire(&l.input),
            next: wire(next),
            rows,
        })
    }
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

    /// Checks what a stage revealed of this layer in a hop of `rows` positions whose signed
    /// trace is `trace`: every revealed row opens its commitment, every weight product passes
    /// Freivalds' test on the input the glue derives, and the layer's output at that position
    /// is what those products give. `Err` says what failed.
    pub fn check(
        &self,
        model: &Model,
        trace: &HopTrace,
        rows: usize,
        reveal: &LayerReveal,
    ) -> std::result::Result<(), String> {
        let cfg = &model.config;
        let (l, pos) = (self.layer as u32, reveal.position as usize);
        if reveal.layer != l {
            return Err(format!("layer {} revealed for layer {l}", reveal.layer));
        }
        let index = pos
            .checked_sub(trace.from)
            .filter(|&i| i < rows)
            .ok_or_else(|| format!("position {pos} is not a row of the hop"))?;
        let input = hop_rows(&reveal.input, trace.from, rows, cfg.hidden_size)?;
        let next = hop_rows(&reveal.next, trace.from, rows, cfg.hidden_size)?;
        if trace.get(l, Point::Input) != Some(input.commitment()) {
            return Err(format!(
                "layer {l}: the revealed input is not the committed one"
            ));
        }
        let next_commitment = trace
            .get(l + 1, Point::Input)
            .or_else(|| trace.get(l, Point::Output));
        if next_commitment != Some(next.commitment()) {
            return Err(format!(
                "layer {l}: the revealed output is not the committed one"
            ));
        }
        // Every product of the layer but the scores, once, opened against its commitment.
        let mut values = Vec::new();
        for e in trace.entries.iter().filter(|e| e.layer == l) {
            if matches!(e.point, Point::Input | Point::Output | Point::Scores) {
                continue;
            }
            let cols = match e.point {
                Point::Context => cfg.q_width(),
                p => self.key(p).map(|(k, _)| k.cols()).ok_or_else(|| {
                    format!("layer {l}: the trace commits a {p:?} product this layer lacks")
                })?,
            };
            let mut found = reveal.rows.iter().filter(|r| r.point == e.point);
            let (Some(row), None) = (found.next(), found.next()) else {
                return Err(format!(
                    "layer {l}: not exactly one {:?} row revealed",
                    e.point
                ));
            };
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
            if row.cols as usize != cols || !opening.holds() {
                return Err(format!(
                    "layer {l}: the {:?} row at position {pos} does not open its commitment",
                    e.point
                ));
            }
            let decoded = decode_row(&row.encoding, cols)
                .map_err(|why| format!("layer {l}: the {:?} row: {why}", e.point))?;
            values.push((e.point, decoded));
        }
        if reveal.rows.len() != values.len() {
            return Err(format!(
                "layer {l}: rows revealed that the trace does not commit"
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
        let mut revealed = Revealed {
            checker: self,
            values,
        };
        let y = model
            .block(&glue, self.layer, x, &mut revealed)
            .map_err(|e| e.to_string())?;
        let want = &next.data[index * cfg.hidden_size..(index + 1) * cfg.hidden_size];
        if y.data
            .iter()
            .zip(want)
            .any(|(a, b)| a.to_bits() != b.to_bits())
        {
            return Err(format!(
                "layer {l}: the output at position {pos} is not what the revealed products give"
            ));
        }
        Ok(())
    }

    fn key(&self, point: Point) -> Option<(&FreivaldsKey, Option<&[f32]>)> {
        self.products
            .iter()
            .find(|(p, _, _)| *p == point)
            .map(|(_, k, b)| (k, b.as_deref()))
    }
}

/// Revealed activations of a hop: `rows` rows of `hidden` from `first`.
fn hop_rows(
    w: &WireActivations,
    first: usize,
    rows: usize,
    hidden: usize,
) -> std::result::Result<Activations, String> {
    if w.start as usize != first || w.hidden as usize != hidden || w.data.len() != rows * hidden {
        return Err(format!(
            "revealed activations cover {} values from position {}, not the hop's {rows} rows",
            w.data.len(),
            w.start
        ));
    }
    Ok(Activations {
        start: first,
        hidden,
        data: w.data.clone(),
    })
}

/// The checker's products: revealed rows, each weight product tested by Freivalds.
struct Revealed<'a> {
    checker: &'a LayerChecker,
    values: Vec<(Point, Vec<Exact>)>,
}

impl Revealed<'_> {
    /// The revealed exact values of `point`.
    fn values(&self, point: Point) -> Result<&[Exact]> {
        let layer = self.checker.layer;
        self.values
            .iter()
            .find(|(p, _)| *p == point)
            .map(|(_, v)| v.as_slice())
            .ok_or_else(|| ModelError::Input(format!("layer {layer}: no {point:?} row")))
    }

    /// Those values rounded to f32, as the stage's epilogue rounded them.
    fn rounded(&self, point: Point) -> Result<Vec<f32>> {
        let layer = self.checker.layer;
        self.values(point)?
            .iter()
            .map(|e| {
                rounded(e).ok_or_else(|| {
                    ModelError::Input(format!("layer {layer}: a {point:?} value overflows f32"))
                })
            })
            .collect()
    }
}

impl Products for Revealed<'_> {
    fn linear(&mut self, point: Point, x: &QuantizedRows, out: &mut Vec<f32>) -> Result<()> {
        let layer = self.checker.layer;
        let (key, bias) = self
            .checker
            .key(point)
            .ok_or_else(|| ModelError::Input(format!("layer {layer} has no {point:?} product")))?;
        if !key.check_values(x, 0, self.values(point)?) {
            return Err(ModelError::Input(format!(
                "layer {layer}: the {point:?} row is not its input times the weights \
                 (Freivalds' test)"
            )));
        }
        *out = self.rounded(point)?;
        add_bias(bias, out);
        Ok(())
    }

    fn attention(
        &mut self,
        _q: Vec<f32>,
        _k: Vec<f32>,
        _v: &[f32],
        _start: usize,
    ) -> Result<Vec<f32>> {
        self.rounded(Point::Context)
    }
}
