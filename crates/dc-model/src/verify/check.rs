//! The check of what a stage revealed of one layer: every revealed row opened against its
//! commitment, every weight product's row tested by Freivalds, the attention and the glue
//! recomputed on the revealed rows, and the layer's output compared bit for bit; and many picks
//! of one hop checked in parallel.

use std::borrow::Cow;

use dc_kernels::verify::freivalds::FreivaldsKey;
use dc_kernels::verify::reveal::{decode_for_check, decode_units_for_check, Decode, Opening};
use dc_kernels::{Commitment, QuantizedRows};
use dc_types::{CheckSet, HopTrace, LayerReveal, Point, RevealedRow, WireActivations};

use super::cache_log::check_cache_rows;
use super::checker::LayerChecker;
use super::hashes::{Hashes, Message, Want};
use super::plan::{rows_needed, tested_parts, KEY_VALUE, MLP_FIRST, WEIGHT_PRODUCTS};
use super::revealed::{CommittedRow, Revealed, RevealedValues};
use crate::activations::Activations;
use crate::attention::{AttentionShape, LayerCache};
use crate::model::{Glue, Model};

impl LayerChecker {
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
        // The cache rows of positions `known..` the end of the hop, as the cache held them.
        let revealed = match checks.attention() {
            // Every revealed cache row checked against its hop's commitment, and the cache
            // extended to the first checked position.
            true => self.cache_rows(cfg, hops, cache, reveal)?,
            false if !reveal.cache.is_empty() => {
                return Err(format!(
                    "layer {l}: cache rows revealed that were not asked for"
                ))
            }
            false => Cow::Borrowed(&[][..]),
        };
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
                true => &revealed[(at - known) * rb..(at - known + 1) * rb],
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
            .extend_encoded(&revealed[later])
            .map_err(|e| format!("layer {l}: {e}"))
    }

    /// Checks the revealed `rows` of one position `pos` of `hop` (the cache holding `0..pos`
    /// and, when the attention is recomputed, `cache_row` the revealed row of `pos`). In the
    /// order a reveal's faults are named: the committed rows opened, the uncommitted sources
    /// decoded, the reveal's rows accounted for, then the block rerun on them.
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
        let l = self.layer as u32;
        let needed = rows_needed(checks).rows;
        let mut opened = self.open_committed(
            model,
            hop,
            cache.row_bytes(),
            product_rows,
            pos,
            checks,
            hashes,
        )?;
        // Every row opened above, and the first row's revealed activations, open their
        // commitments (hashed together).
        hashes.verify(l, pos, &opened.values)?;
        self.decode_sources(
            product_rows,
            needed,
            tested_parts(checks),
            &mut opened.values,
        )?;
        self.account_for(&opened, product_rows.len(), needed)?;
        self.rerun_block(model, hop, cache, cache_row, pos, checks, opened)
    }

    /// Every product the checks need that the trace commits for this layer, once, opened
    /// against its commitment (the hashes gathered into `hashes`, verified by the caller); the
    /// attention products' rows and the MLP's hidden row are recomputed, so only their
    /// openings are taken here (but for the context's values when they are the output
    /// projection's input, and the hidden row's when they are the down projection's).
    #[allow(clippy::too_many_arguments)]
    fn open_committed<'a>(
        &self,
        model: &Model,
        hop: HopRows<'a>,
        cache_row_bytes: usize,
        product_rows: &'a [RevealedRow],
        pos: usize,
        checks: CheckSet,
        hashes: &mut Hashes<'a>,
    ) -> std::result::Result<Opened<'a>, String> {
        let cfg = &model.config;
        let l = self.layer as u32;
        let HopRows { trace, rows, .. } = hop;
        let needs = rows_needed(checks);
        let mut opened = Opened::default();
        for e in trace.entries.iter().filter(|e| e.layer == l) {
            if matches!(e.point, Point::Input | Point::Output) || !needs.rows.contains(e.point) {
                continue;
            }
            let (cols, key) = match e.point {
                Point::KvCache => (cache_row_bytes, None),
                Point::Context => (cfg.q_width(), None),
                Point::Hidden => (cfg.intermediate_size, None),
                p => {
                    let (key, _) = self.key(p).ok_or_else(|| {
                        format!("layer {l}: the trace commits a {p:?} product this layer lacks")
                    })?;
                    (key.cols(), Some(key))
                }
            };
            let row = the_row(product_rows, l, e.point)?;
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
            // Every field of a row is read, so a reveal says one thing only.
            if row.cols as usize != cols {
                return Err(format!(
                    "layer {l}: the {:?} row at position {pos} does not open its commitment",
                    e.point
                ));
            }
            if e.point == Point::KvCache {
                // The row k and v make is recomputed; only its opening travels.
                if row.unit.is_some() || !row.encoding.is_empty() {
                    return Err(format!(
                        "layer {l}: the cache row carries values, but only its opening travels"
                    ));
                }
                opened.kv_row = Some(opening);
                continue;
            }
            if matches!(e.point, Point::Context | Point::Hidden) {
                let committed =
                    committed_quantized(l, e.point, row, opening, needs.values(e.point), hashes)?;
                match e.point {
                    Point::Context => opened.context = Some(committed),
                    _ => opened.hidden = Some(committed),
                }
                continue;
            }
            // Every opened row's rounded values (its leaf hashes them, and the glue computes
            // on them), and a tested product's side of Freivalds' test.
            let key = key.ok_or_else(|| format!("layer {l}: {:?} is not a product", e.point))?;
            let (rounded, output_side) = decode_product_row(row, key, checks.contains(e.point))
                .map_err(|why| format!("layer {l}: the {:?} row: {why}", e.point))?;
            hashes.push(
                Message::ProductRow(opened.values.len()),
                Want::Opens(opening, e.point),
            );
            opened.values.push(RevealedValues {
                point: e.point,
                rounded,
                output_side,
            });
        }
        Ok(opened)
    }

    /// The MLP's first products, which have no commitment of their own, decoded into `values`:
    /// each one `needed`, tested when in `tests` (its row then made into the hidden row, which
    /// must open the committed one).
    fn decode_sources(
        &self,
        product_rows: &[RevealedRow],
        needed: CheckSet,
        tests: CheckSet,
        values: &mut Vec<RevealedValues>,
    ) -> std::result::Result<(), String> {
        let l = self.layer as u32;
        for &(point, ref key, _) in &self.products {
            if point.output_committed() || !needed.contains(point) {
                continue;
            }
            let row = the_row(product_rows, l, point)?;
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
        Ok(())
    }

    /// That every row the checks need that the layer has was committed and revealed, and that
    /// the reveal's `revealed` rows are those and no more.
    fn account_for(
        &self,
        opened: &Opened<'_>,
        revealed: usize,
        needed: CheckSet,
    ) -> std::result::Result<(), String> {
        let l = self.layer as u32;
        let found = opened
            .values
            .iter()
            .map(|v| v.point)
            .chain(opened.context.as_ref().map(|_| Point::Context))
            .chain(opened.hidden.as_ref().map(|_| Point::Hidden))
            .chain(opened.kv_row.as_ref().map(|_| Point::KvCache))
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
        if revealed
            != opened.values.len()
                + opened.context.is_some() as usize
                + opened.hidden.is_some() as usize
                + opened.kv_row.is_some() as usize
        {
            return Err(format!(
                "layer {l}: rows revealed that the trace does not commit or the check does \
                 not need"
            ));
        }
        Ok(())
    }

    /// Reruns the layer's block at `pos` on the `opened` rows (the very glue a stage runs,
    /// [`Revealed`] supplying the products): every drawn part must be tested inside it, and,
    /// when the output is drawn, the block's output must be the revealed one bit for bit.
    #[allow(clippy::too_many_arguments)]
    fn rerun_block(
        &self,
        model: &Model,
        hop: HopRows<'_>,
        cache: &mut LayerCache,
        cache_row: &[u8],
        pos: usize,
        checks: CheckSet,
        opened: Opened<'_>,
    ) -> std::result::Result<(), String> {
        let cfg = &model.config;
        let l = self.layer as u32;
        let HopRows {
            trace, input, next, ..
        } = hop;
        let index = pos - trace.from;
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
        let mut tests = tested_parts(checks);
        if !tests.intersection(MLP_FIRST).is_empty() {
            tests = tests.with(Point::Hidden);
        }
        if !tests.intersection(KEY_VALUE).is_empty() {
            tests = tests.with(Point::KvCache);
        }
        let Opened {
            values,
            context,
            hidden,
            kv_row,
        } = opened;
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

    /// Checks the revealed cache rows against every hop's `KvCache` commitment, extends
    /// `cache` (the rows known so far) to the positions before the checked one (each checked
    /// row then takes its own revealed row and appends it), and returns the rows the cache held
    /// from its known end to the end of the hop.
    fn cache_rows<'r>(
        &self,
        cfg: &crate::ModelConfig,
        hops: &[(&HopTrace, usize)],
        cache: &mut LayerCache,
        reveal: &'r LayerReveal,
    ) -> std::result::Result<Cow<'r, [u8]>, String> {
        let (l, pos, from) = (self.layer, reveal.position as usize, cache.len());
        let end = hops.last().map_or(0, |(t, n)| t.from + n);
        let rows = check_cache_rows(cfg, l, hops, from, end, &reveal.cache)?;
        let rb = cache.row_bytes();
        if pos < from || (cache.kv_heads(), cache.head_dim()) != (cfg.num_kv_heads, cfg.head_dim) {
            return Err(format!(
                "layer {l}: the known cache does not fit position {pos}"
            ));
        }
        cache
            .extend_encoded(&rows[..(pos - from) * rb])
            .map_err(|e| format!("layer {l}: {e}"))?;
        Ok(rows)
    }
}

/// The rows of one position a check opened against the trace's commitments
/// ([`LayerChecker::open_committed`]), handed to the block's rerun.
#[derive(Default)]
struct Opened<'a> {
    /// Weight products' rows (and then the uncommitted sources'), decoded.
    values: Vec<RevealedValues>,
    /// The context row, when the check needs it.
    context: Option<CommittedRow<'a>>,
    /// The MLP's hidden row, when the check needs it.
    hidden: Option<CommittedRow<'a>>,
    /// The opening of the position's cache row, when k and v are tested without the attention.
    kv_row: Option<Opening<'a>>,
}

/// The one row of `point` among a position's revealed rows (two of one point would let a
/// reveal say two things).
fn the_row(
    rows: &[RevealedRow],
    l: u32,
    point: Point,
) -> std::result::Result<&RevealedRow, String> {
    let mut found = rows.iter().filter(|r| r.point == point);
    match (found.next(), found.next()) {
        (Some(row), None) => Ok(row),
        _ => Err(format!("layer {l}: not exactly one {point:?} row revealed")),
    }
}

/// A committed quantised row of layer `l` (the context or the hidden row at `point`) as a check
/// takes it: with its values, decoded and its leaf gathered into `hashes`, when `with_values`
/// (it is the next product's input as committed); as its opening alone otherwise (what the
/// check recomputes must open it).
fn committed_quantized<'a>(
    l: u32,
    point: Point,
    row: &'a RevealedRow,
    opening: Opening<'a>,
    with_values: bool,
    hashes: &mut Hashes<'a>,
) -> std::result::Result<CommittedRow<'a>, String> {
    if row.unit.is_some() {
        return Err(format!(
            "layer {l}: the {point:?} row carries a product's unit"
        ));
    }
    let cols = opening.cols;
    match with_values {
        true => {
            let what = match point {
                Point::Context => "context",
                _ => "hidden",
            };
            let decoded = QuantizedRows::decode_row(&row.encoding, cols)
                .map_err(|why| format!("layer {l}: the {what} row: {why}"))?;
            hashes.push(
                Message::QuantizedRow(cols, &row.encoding),
                Want::Opens(opening, point),
            );
            Ok(CommittedRow::Revealed(decoded))
        }
        false if !row.encoding.is_empty() => Err(format!(
            "layer {l}: the {point:?} row carries values no check takes"
        )),
        false => Ok(CommittedRow::Opening(opening)),
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
