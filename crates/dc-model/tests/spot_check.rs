//! Spot checks: a stage that keeps a hop can reveal any (layer, position) of it, and a checker
//! holding only `W · r`, the norms and the signed traces accepts every honest reveal and
//! refuses every lie — a wrong product row (even one the stage committed to consistently), an
//! attention computed on other keys or values than the committed cache (with everything after
//! it consistent), a wrong output, a reveal that does not open the commitments.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use dc_kernels::verify::commit::{exact_row_leaf, gemm_commitment, product_row_leaf};
use dc_kernels::verify::reveal::{decode_row, revealed_values, values_encoding};
use dc_kernels::{Exact, Gemm, Kernel};
use dc_model::attention::LayerCache;
use dc_model::trace::{HopTrace, Point};
use dc_model::{
    check_cache_rows, check_parts, draw_checks, rows_needed, Activations, CacheLog, KeptHop,
    KvCache, LayerChecker, LoadOptions, Model,
};
use dc_types::{CheckSet, LayerReveal, RevealedRow};

type Hop = (HopTrace, usize, KeptHop);

/// A stage over `stage` runs hops of these lengths, keeping each; returns (trace, rows, kept)
/// per hop and the log of its cache rows.
fn stage_hops(
    model: &Model,
    gemm: &Gemm,
    stage: std::ops::Range<usize>,
    ids: &[u32],
    lens: &[usize],
) -> (Vec<Hop>, CacheLog) {
    stage_hops_tampered(model, gemm, stage, ids, lens, None)
}

/// [`stage_hops`], the last hop computed on a cache whose value at `(layer, position, byte)`
/// is changed first (and restored after): a stage lying only in its attention, consistently
/// from there on, that logs and commits its cache rows honestly.
fn stage_hops_tampered(
    model: &Model,
    gemm: &Gemm,
    stage: std::ops::Range<usize>,
    ids: &[u32],
    lens: &[usize],
    tamper: Option<(usize, usize, usize)>,
) -> (Vec<Hop>, CacheLog) {
    let mut log = CacheLog::default();
    let mut head_cache = KvCache::new(&model.config, 0..stage.start);
    let mut cache = KvCache::new(&model.config, stage.clone());
    let mut plain = KvCache::new(&model.config, stage);
    let mut out = Vec::new();
    let mut pos = 0;
    for &len in lens {
        let mut x = model.embed(&ids[pos..pos + len], pos).unwrap();
        if !head_cache.layers().is_empty() {
            x = model.run_layers(gemm, x, &mut head_cache).unwrap();
        }
        let last = pos + len == lens.iter().sum::<usize>();
        let honest = match tamper.filter(|_| last) {
            Some((layer, at, byte)) => {
                let c = cache.layer(layer).unwrap();
                let (kvh, hd) = (model.config.num_kv_heads, model.config.head_dim);
                let mut bytes = c.encode_rows(0..c.len());
                let b = &mut bytes[at * c.row_bytes() + byte];
                *b = if (*b as i8) < 100 { *b + 20 } else { *b - 20 };
                let tampered = LayerCache::from_encoded(kvh, hd, &bytes).unwrap();
                Some((
                    layer,
                    std::mem::replace(cache.layer_mut(layer).unwrap(), tampered),
                ))
            }
            None => None,
        };
        let mut t = HopTrace::from_position(pos);
        let (y, kept) = model
            .run_layers_kept(gemm, x.clone(), &mut cache, &mut t)
            .unwrap();
        if let Some((layer, mut c)) = honest {
            // The honest cache again, with the rows this hop added.
            let new = cache.layer(layer).unwrap();
            let rows = new.encode_rows(pos..new.len());
            let (kvh, hd) = (model.config.num_kv_heads, model.config.head_dim);
            let mut all = c.encode_rows(0..c.len());
            all.extend_from_slice(&rows);
            c = LayerCache::from_encoded(kvh, hd, &all).unwrap();
            *cache.layer_mut(layer).unwrap() = c;
        }
        log.record(&cache);
        // Keeping changes nothing the stage commits or sends.
        let mut t2 = HopTrace::from_position(pos);
        let y2 = model
            .run_layers_traced(gemm, x, &mut plain, Some(&mut t2))
            .unwrap();
        if tamper.is_none() {
            assert_eq!(t.entries, t2.entries);
            assert_eq!(y, y2);
        }
        out.push((t, len, kept));
        pos += len;
    }
    (out, log)
}

/// The fixture `name`, an engine of `threads` threads and the fixture's prompt.
fn fixture(name: &str, threads: usize) -> (Model, Gemm, Vec<u32>) {
    let model = Model::load(&fixtures().join(name), &LoadOptions::default()).unwrap();
    let gemm = Gemm::new(Kernel::best(), threads).unwrap();
    (model, gemm, expected_logits(name).pop().unwrap().0)
}

/// Every part of a layer: the full check.
fn every(model: &Model) -> CheckSet {
    CheckSet::of(&check_parts(&model.config))
}

/// A cache holding nothing (a layer's first check).
fn empty(model: &Model) -> LayerCache {
    LayerCache::new(model.config.num_kv_heads, model.config.head_dim)
}

/// The checker's view of the hops up to and including hop `k`.
fn views(hops: &[Hop], k: usize) -> Vec<(&HopTrace, usize)> {
    hops[..=k].iter().map(|(t, n, _)| (t, *n)).collect()
}

fn checkers(model: &Model, layers: std::ops::Range<usize>, secret: u8) -> Vec<LayerChecker> {
    layers
        .map(|l| LayerChecker::new(model, l, &[secret; 32]).unwrap())
        .collect()
}

#[test]
fn honest_reveals_pass_for_every_layer_and_row() {
    for name in TINY {
        let (model, gemm, ids) = fixture(name, 2);
        let n = model.config.num_layers;
        let stage = 1..n;
        let (hops, log) = stage_hops(&model, &gemm, stage.clone(), &ids, &[17, 9, 1, 1, 1]);
        for secret in [1u8, 2] {
            let checkers = checkers(&model, stage.clone(), secret);
            for (k, (trace, rows, kept)) in hops.iter().enumerate() {
                for c in &checkers {
                    for index in [0, rows / 2, rows - 1] {
                        let reveal = kept
                            .reveal(c.layer(), trace.from + index, every(&model), 0, &log)
                            .unwrap();
                        let full = c
                            .check(
                                &model,
                                &views(&hops, k),
                                &empty(&model),
                                &reveal,
                                every(&model),
                            )
                            .unwrap_or_else(|e| {
                                panic!("{name}: layer {} row {index}: {e}", c.layer())
                            });
                        // The verified cache is the stage's, up to the end of the hop.
                        let end = trace.from + rows;
                        assert_eq!(
                            full.encode_rows(0..full.len()),
                            log.rows(c.layer(), end).unwrap()
                        );
                        // Holding what an earlier check verified (up to an earlier hop's end),
                        // the checker is sent only the rest, and ends with the same cache.
                        for (held, _, _) in &hops[..=k] {
                            let held = held.from;
                            let mut known = full.clone();
                            known.truncate(held);
                            let r = kept
                                .reveal(c.layer(), trace.from + index, every(&model), held, &log)
                                .unwrap();
                            assert_eq!(r.cache.len(), (end - held) * full.row_bytes());
                            let again = c
                                .check(&model, &views(&hops, k), &known, &r, every(&model))
                                .unwrap();
                            assert_eq!(
                                again.encode_rows(0..again.len()),
                                full.encode_rows(0..full.len()),
                                "{name}: held {held}"
                            );
                        }
                        // The attention products' rows travel without values (the checker
                        // recomputes them); the cache up to the end of the hop does.
                        assert!(reveal
                            .rows
                            .iter()
                            .filter(|r| matches!(r.point, Point::Scores | Point::Context))
                            .all(|r| r.encoding.is_empty()));
                        assert_eq!(
                            reveal.cache.len(),
                            (trace.from + rows)
                                * LayerCache::new(model.config.num_kv_heads, model.config.head_dim)
                                    .row_bytes()
                        );
                    }
                }
            }
        }
        // What is not in the hop cannot be revealed.
        let (trace, rows, kept) = &hops[1];
        assert!(
            kept.reveal(0, trace.from, every(&model), 0, &log).is_err(),
            "{name}: layer outside the stage"
        );
        assert!(
            kept.reveal(1, trace.from + rows, every(&model), 0, &log)
                .is_err(),
            "{name}: row outside the hop"
        );
        // Without the earlier hops' commitments, or with a hop missing, the cache cannot be
        // tied to them.
        let c = &checkers(&model, stage.clone(), 1)[0];
        let reveal = kept
            .reveal(c.layer(), trace.from, every(&model), 0, &log)
            .unwrap();
        let err = c
            .check(
                &model,
                &views(&hops, 1)[1..],
                &empty(&model),
                &reveal,
                every(&model),
            )
            .unwrap_err();
        assert!(err.contains("do not cover"), "{name}: {err}");
        // Cache rows from inside a hop cannot be tied to its commitment (nor does a stage
        // reveal them); from past the hop's start they are not revealed.
        let mut known = c
            .check(
                &model,
                &views(&hops, 1),
                &empty(&model),
                &reveal,
                every(&model),
            )
            .unwrap();
        known.truncate(3);
        assert!(kept
            .reveal(c.layer(), trace.from, every(&model), 3, &log)
            .is_err());
        let mut r = reveal.clone();
        r.cache = log.rows_between(c.layer(), 3, trace.from + rows).unwrap();
        let err = c
            .check(&model, &views(&hops, 1), &known, &r, every(&model))
            .unwrap_err();
        assert!(err.contains("no hop starts at position 3"), "{name}: {err}");
        assert!(kept
            .reveal(c.layer(), trace.from, every(&model), trace.from + 1, &log)
            .is_err());
    }
}

/// The exact values of a revealed product row, in whichever form it travelled.
fn values_of(c: &LayerChecker, row: &RevealedRow) -> Vec<Exact> {
    revealed_values(row.unit, &row.encoding, c.col_units(row.point).unwrap()).unwrap()
}

/// Makes the row's first nonzero value wrong by two units of its last place, in the form the
/// row travelled in (a lie too small to move most roundings); returns the row's values, the
/// lie included.
fn nudge(c: &LayerChecker, row: &mut RevealedRow) -> Vec<Exact> {
    match row.unit {
        Some(_) => {
            let at = 8 * row
                .encoding
                .chunks_exact(8)
                .position(|b| b != [0; 8])
                .unwrap();
            let sum = i64::from_le_bytes(row.encoding[at..at + 8].try_into().unwrap());
            row.encoding[at..at + 8].copy_from_slice(&(sum + 2).to_le_bytes());
        }
        None => {
            let mut values = decode_row(&row.encoding, row.cols as usize).unwrap();
            let i = values.iter().position(|v| !v.is_zero()).unwrap();
            if let Exact::Small { mant, exp } = values[i] {
                values[i] = Exact::from_i64(mant.wrapping_add(2), exp);
            }
            row.encoding = values_encoding(&values);
        }
    }
    values_of(c, row)
}

/// Re-commits the revealed row of `point` (holding `values`) in `trace`, as a stage lying
/// consistently about that product would (a one-row hop: the leaf is the root).
fn recommit(trace: &mut HopTrace, reveal: &mut LayerReveal, point: Point, values: &[Exact]) {
    let row = reveal.rows.iter_mut().find(|r| r.point == point).unwrap();
    row.root = exact_row_leaf(reveal.position as usize, values);
    let c = gemm_commitment(1, values.len(), &row.root);
    let e = trace
        .entries
        .iter_mut()
        .find(|e| e.layer == reveal.layer && e.point == point)
        .unwrap();
    e.commitment = c;
}

#[test]
fn product_rows_travel_in_units_and_either_form_is_checked() {
    for name in TINY {
        let (model, gemm, ids) = fixture(name, 1);
        let stage = 0..model.config.num_layers;
        let (hops, log) = stage_hops(&model, &gemm, stage.clone(), &ids, &[5, 1]);
        let (trace, _, kept) = &hops[1];
        let view = views(&hops, 1);
        let c = &checkers(&model, stage.clone(), 3)[0];
        let honest = kept
            .reveal(c.layer(), trace.from, every(&model), 0, &log)
            .unwrap();
        let mut products = 0;
        for row in &honest.rows {
            match c.col_units(row.point) {
                // A weight product's row: its unit and 8 bytes a value.
                Some(units) => {
                    assert!(row.unit.is_some(), "{name} {:?}", row.point);
                    assert_eq!(
                        row.encoding.len(),
                        8 * units.len(),
                        "{name} {:?}",
                        row.point
                    );
                    products += 1;
                }
                None => assert_eq!(row.unit, None, "{name} {:?}", row.point),
            }
        }
        assert!(products >= 6, "{name}: {products} product rows");
        // The same values sent canonically pass too.
        let mut canonical = honest.clone();
        for row in canonical.rows.iter_mut().filter(|r| r.unit.is_some()) {
            row.encoding = values_encoding(&values_of(c, row));
            row.unit = None;
        }
        c.check(&model, &view, &empty(&model), &canonical, every(&model))
            .unwrap();
        // Malformed: a units row one value short, a unit claimed for a quantised row.
        let mut short = honest.clone();
        let row = short.rows.iter_mut().find(|r| r.unit.is_some()).unwrap();
        row.encoding.truncate(row.encoding.len() - 8);
        let err = c
            .check(&model, &view, &empty(&model), &short, every(&model))
            .unwrap_err();
        assert!(err.contains("bytes in units form"), "{name}: {err}");
        let mut claimed = honest.clone();
        let row = claimed
            .rows
            .iter_mut()
            .find(|r| r.point == Point::Hidden)
            .unwrap();
        row.unit = Some(0);
        let err = c
            .check(&model, &view, &empty(&model), &claimed, every(&model))
            .unwrap_err();
        assert!(err.contains("carries a product's unit"), "{name}: {err}");
    }
}

#[test]
fn lies_in_a_reveal_are_refused() {
    for name in TINY {
        let (model, gemm, ids) = fixture(name, 1);
        let stage = 0..model.config.num_layers;
        let (hops, log) = stage_hops(&model, &gemm, stage.clone(), &ids, &[5, 1]);
        let (trace, _, kept) = &hops[1];
        let view = views(&hops, 1);
        let c = &checkers(&model, stage.clone(), 7)[stage.len() - 1];
        let pos = trace.from;
        let honest = kept.reveal(c.layer(), pos, every(&model), 0, &log).unwrap();
        c.check(&model, &view, &empty(&model), &honest, every(&model))
            .unwrap();
        fn with_trace<'a>(
            view: &[(&'a HopTrace, usize)],
            t: &'a HopTrace,
        ) -> Vec<(&'a HopTrace, usize)> {
            let mut v = view.to_vec();
            v[1].0 = t;
            v
        }
        let points: Vec<Point> = honest.rows.iter().map(|r| r.point).collect();
        for point in points {
            let (mut t, mut r) = (trace.clone(), honest.clone());
            if !point.output_committed() {
                // A lie about one of the MLP's first products (no commitment of its own: the
                // hidden row made of it is the stage's): wrong in one value by two units in
                // the last place.
                nudge(c, r.rows.iter_mut().find(|x| x.point == point).unwrap());
                let err = c
                    .check(&model, &view, &empty(&model), &r, every(&model))
                    .unwrap_err();
                assert!(err.contains("Freivalds"), "{name} {point:?}: {err}");
                continue;
            }
            if matches!(point, Point::Context | Point::Hidden) {
                // A context row other than the recomputed one, or a hidden row other than the
                // one the first products make, committed consistently.
                let row = r.rows.iter_mut().find(|x| x.point == point).unwrap();
                row.root = product_row_leaf(pos, &[7.0]);
                let cols = row.cols as usize;
                let root = row.root;
                set(&mut t, c.layer(), point, gemm_commitment(1, cols, &root));
                let err = c
                    .check(
                        &model,
                        &with_trace(&view, &t),
                        &empty(&model),
                        &r,
                        every(&model),
                    )
                    .unwrap_err();
                let want = match point {
                    Point::Context => "recomputed from the revealed cache",
                    _ => "not what its first products give",
                };
                assert!(err.contains(want), "{name} {point:?}: {err}");
                continue;
            }
            // A consistent lie about one weight product: committed, opened, and wrong in one
            // value by two units in the last place.
            let values = nudge(c, r.rows.iter_mut().find(|x| x.point == point).unwrap());
            recommit(&mut t, &mut r, point, &values);
            let err = c
                .check(
                    &model,
                    &with_trace(&view, &t),
                    &empty(&model),
                    &r,
                    every(&model),
                )
                .unwrap_err();
            assert!(err.contains("Freivalds"), "{name} {point:?}: {err}");
            // Checked in place, the failure comes after the cache was extended to the row,
            // and the cache is left as it was.
            let mut cache = empty(&model);
            let err = c
                .check_in_place(
                    &model,
                    &with_trace(&view, &t),
                    &mut cache,
                    &r,
                    every(&model),
                )
                .unwrap_err();
            assert!(err.contains("Freivalds"), "{name} {point:?}: {err}");
            assert!(
                cache.is_empty(),
                "{name} {point:?}: {} rows left",
                cache.len()
            );
            // Another row against the honest commitment: one value's sign changed, so its
            // rounding (what the leaf hashes) changes. (A change too small to move a rounding
            // opens the commitment and fails Freivalds' test: the consistent lie above.)
            let mut r = honest.clone();
            // (Sent canonically: a checker reads either form.)
            let row = r.rows.iter_mut().find(|x| x.point == point).unwrap();
            let mut values = values_of(c, row);
            let i = values.iter().position(|v| !v.is_zero()).unwrap();
            if let Exact::Small { mant, exp } = values[i] {
                values[i] = Exact::from_i64(-mant, exp);
            }
            row.unit = None;
            row.encoding = values_encoding(&values);
            let err = c
                .check(&model, &view, &empty(&model), &r, every(&model))
                .unwrap_err();
            assert!(err.contains("does not open"), "{name} {point:?}: {err}");
        }
        // A flipped bit of the output, committed consistently.
        let mut r = honest.clone();
        r.next.data[1] = f32::from_bits(r.next.data[1].to_bits() ^ 1 << 12);
        let mut t = trace.clone();
        let next = Activations {
            start: pos,
            hidden: model.config.hidden_size,
            data: r.next.data.clone(),
        };
        t.entries
            .iter_mut()
            .find(|e| e.point == Point::Output)
            .unwrap()
            .commitment = next.commitment();
        let err = c
            .check(
                &model,
                &with_trace(&view, &t),
                &empty(&model),
                &r,
                every(&model),
            )
            .unwrap_err();
        assert!(
            err.contains("not what the revealed products give"),
            "{name}: {err}"
        );
        // Revealed cache rows other than the committed ones, of an earlier hop and of this one.
        for at in [2, pos] {
            let mut r = honest.clone();
            let rb = r.cache.len() / (pos + 1);
            r.cache[at * rb + 1] ^= 1;
            let err = c
                .check(&model, &view, &empty(&model), &r, every(&model))
                .unwrap_err();
            assert!(err.contains("not the committed ones"), "{name} {at}: {err}");
        }
        // Too few cache rows.
        let mut r = honest.clone();
        r.cache.pop();
        assert!(c
            .check(&model, &view, &empty(&model), &r, every(&model))
            .is_err());
        // Revealed activations that are not the committed ones; a missing or repeated row.
        let mut r = honest.clone();
        r.input.data[0] += 1.0;
        assert!(c
            .check(&model, &view, &empty(&model), &r, every(&model))
            .is_err());
        let mut r = honest.clone();
        r.rows.pop();
        assert!(c
            .check(&model, &view, &empty(&model), &r, every(&model))
            .is_err());
        let mut r = honest.clone();
        r.rows.push(r.rows[0].clone());
        assert!(c
            .check(&model, &view, &empty(&model), &r, every(&model))
            .is_err());
        // A reveal of another layer or position than the checker's.
        let other = kept
            .reveal(c.layer() - 1, pos, every(&model), 0, &log)
            .unwrap();
        assert!(c
            .check(&model, &view, &empty(&model), &other, every(&model))
            .is_err());
    }
}

/// Sets the commitment of `(layer, point)` in `trace`.
fn set(trace: &mut HopTrace, layer: usize, point: Point, c: dc_kernels::Commitment) {
    let e = trace
        .entries
        .iter_mut()
        .find(|e| e.layer == layer as u32 && e.point == point)
        .unwrap();
    e.commitment = c;
}

#[test]
fn an_attention_lie_kept_consistent_is_caught() {
    // The stage computes one hop's attention on a key or a value other than the one it
    // committed (and logged) for an earlier position, and everything after the attention
    // honestly from there: every weight product passes Freivalds' test, every commitment
    // opens, and only the recomputed attention shows the lie.
    for name in TINY {
        let (model, gemm, ids) = fixture(name, 1);
        let stage = 0..model.config.num_layers;
        let layer = stage.end - 1;
        let c = &checkers(&model, stage.clone(), 3)[layer];
        let shape = LayerCache::new(model.config.num_kv_heads, model.config.head_dim);
        let hb = model.config.head_dim.div_ceil(32);
        // The first key value of head 0, then its first value value.
        for (what, byte) in [("key", 0), ("value", hb * 35)] {
            assert!(byte < shape.row_bytes());
            let (hops, log) = stage_hops_tampered(
                &model,
                &gemm,
                stage.clone(),
                &ids,
                &[5, 1],
                Some((layer, 3, byte)),
            );
            let (trace, _, kept) = &hops[1];
            let reveal = kept
                .reveal(layer, trace.from, every(&model), 0, &log)
                .unwrap();
            let err = c
                .check(
                    &model,
                    &views(&hops, 1),
                    &empty(&model),
                    &reveal,
                    every(&model),
                )
                .unwrap_err();
            assert!(
                err.contains("recomputed from the revealed cache"),
                "{name} {what}: {err}"
            );
        }
    }
}

#[test]
fn partial_checks_pass_honest_reveals_and_reveal_only_what_they_need() {
    for name in TINY {
        let (model, gemm, ids) = fixture(name, 1);
        let n = model.config.num_layers;
        let (hops, log) = stage_hops(&model, &gemm, 0..n, &ids, &[9, 1, 1]);
        let parts = check_parts(&model.config);
        let c = &checkers(&model, 0..n, 5)[n - 1];
        // Each part alone, some draws, and everything.
        let mut coins = dc_kernels::rng::SplitMix64::new(11);
        let mut sets: Vec<CheckSet> = parts.iter().map(|&p| CheckSet::of(&[p])).collect();
        sets.extend((0..12).map(|_| draw_checks(&parts, 0.3, || coins.unit())));
        sets.push(every(&model));
        for (k, (trace, rows, kept)) in hops.iter().enumerate().skip(1) {
            for &checks in sets.iter().filter(|s| !s.is_empty()) {
                let pos = trace.from + rows - 1;
                let r = kept.reveal(c.layer(), pos, checks, 0, &log).unwrap();
                // Exactly the rows the parts need, the context's values only as the output
                // projection's input, the cache only for the attention.
                let needs = rows_needed(checks);
                let needed = needs.rows;
                // Activations only when needed.
                assert_eq!(r.input.data.is_empty(), !needs.input, "{name} {checks:?}");
                assert_eq!(r.next.data.is_empty(), !needs.next, "{name} {checks:?}");
                let got = CheckSet::of(&r.rows.iter().map(|x| x.point).collect::<Vec<_>>());
                let has = CheckSet::of(&parts)
                    .with(Point::Hidden)
                    .with(Point::KvCache);
                assert_eq!(got, needed.intersection(has), "{name} {checks:?}");
                // Either of the SwiGLU MLP's first products reveals (and tests) both; the down
                // projection takes the committed hidden row unless they make it. Likewise k
                // and v, with the opening of the cache row they make unless the attention
                // (which verifies the cache rows) is recomputed.
                let swiglu = CheckSet::of(&[Point::Gate, Point::Up]);
                if !checks.intersection(swiglu).is_empty() && has.contains(Point::Gate) {
                    assert_eq!(got.intersection(swiglu), swiglu, "{name} {checks:?}");
                }
                let kv = CheckSet::of(&[Point::K, Point::V]);
                if !checks.intersection(kv).is_empty() {
                    assert_eq!(got.intersection(kv), kv, "{name} {checks:?}");
                    assert_eq!(
                        got.contains(Point::KvCache),
                        !checks.attention(),
                        "{name} {checks:?}"
                    );
                }
                assert_eq!(
                    needs.hidden_values,
                    checks.contains(Point::Down)
                        && [Point::Gate, Point::Up, Point::Fc]
                            .iter()
                            .all(|&p| !checks.contains(p)),
                    "{name} {checks:?}"
                );
                for x in &r.rows {
                    let carries = !x.encoding.is_empty();
                    let wants = match x.point {
                        // As the output projection's input, when the attention is not
                        // recomputed.
                        Point::Context => checks.contains(Point::O) && !checks.attention(),
                        Point::Hidden => needs.hidden_values,
                        Point::KvCache => false,
                        _ => true,
                    };
                    assert_eq!(carries, wants, "{name} {checks:?} {:?}", x.point);
                }
                assert_eq!(r.cache.is_empty(), !checks.attention(), "{name} {checks:?}");
                let mut cache = empty(&model);
                c.check_in_place(&model, &views(&hops, k), &mut cache, &r, checks)
                    .unwrap_or_else(|e| panic!("{name} {checks:?}: {e}"));
                // The verified cache grows only when the attention was recomputed, and then to
                // the stage's rows.
                match checks.attention() {
                    true => assert_eq!(
                        cache.encode_rows(0..cache.len()),
                        log.rows(c.layer(), trace.from + rows).unwrap()
                    ),
                    false => assert!(cache.is_empty(), "{name} {checks:?}"),
                }
                // A check asks for what it needs: fewer rows, or cache rows it did not ask
                // for, are refused.
                if r.rows.len() > 1 {
                    let mut short = r.clone();
                    short.rows.pop();
                    assert!(c
                        .check(&model, &views(&hops, k), &empty(&model), &short, checks)
                        .is_err());
                }
                if !needs.input {
                    let mut extra = r.clone();
                    extra.input.data = vec![0.0; rows * model.config.hidden_size];
                    let err = c
                        .check(&model, &views(&hops, k), &empty(&model), &extra, checks)
                        .unwrap_err();
                    assert!(err.contains("the check needs"), "{name}: {err}");
                }
                if !checks.attention() {
                    let mut extra = r.clone();
                    extra.cache = log.rows(c.layer(), trace.from + rows).unwrap().to_vec();
                    let err = c
                        .check(&model, &views(&hops, k), &empty(&model), &extra, checks)
                        .unwrap_err();
                    assert!(err.contains("not asked for"), "{name}: {err}");
                }
            }
        }
        // Nothing to check is refused, not passed.
        let (_, _, kept) = &hops[1];
        let r = kept
            .reveal(c.layer(), hops[1].0.from, CheckSet::EMPTY, 0, &log)
            .unwrap();
        let err = c
            .check(
                &model,
                &views(&hops, 1),
                &empty(&model),
                &r,
                CheckSet::EMPTY,
            )
            .unwrap_err();
        assert!(err.contains("nothing to check"), "{name}: {err}");
        // A trace without a product the check tests cannot pass it.
        let (trace, _, kept) = &hops[1];
        let checks = CheckSet::of(&[Point::Down]);
        let r = kept.reveal(c.layer(), trace.from, checks, 0, &log).unwrap();
        let mut t = trace.clone();
        t.entries
            .retain(|e| !(e.layer == c.layer() as u32 && e.point == Point::Down));
        let mut v = views(&hops, 1);
        v[1].0 = &t;
        let err = c.check(&model, &v, &empty(&model), &r, checks).unwrap_err();
        assert!(err.contains("lacks a row"), "{name}: {err}");
        // A part the layer does not have (the other MLP's) is never tested, so the check is
        // refused rather than passed: a check passes only when every drawn part was tested
        // (it may stop the block once they are).
        let other = match model.config.arch == dc_model::config::Arch::Gpt2 {
            true => Point::Gate,
            false => Point::Fc,
        };
        let checks = CheckSet::of(&[other]);
        let r = kept.reveal(c.layer(), trace.from, checks, 0, &log).unwrap();
        let err = c
            .check(&model, &views(&hops, 1), &empty(&model), &r, checks)
            .unwrap_err();
        assert!(err.contains("not tested"), "{name}: {err}");
    }
}

#[test]
fn a_lie_in_any_part_is_caught_by_a_check_of_that_part_alone() {
    for name in TINY {
        let (model, gemm, ids) = fixture(name, 1);
        let n = model.config.num_layers;
        let (hops, log) = stage_hops(&model, &gemm, 0..n, &ids, &[5, 1]);
        let (trace, _, kept) = &hops[1];
        let c = &checkers(&model, 0..n, 9)[n - 1];
        let pos = trace.from;
        let view = views(&hops, 1);
        for part in check_parts(&model.config) {
            let checks = CheckSet::of(&[part]);
            let honest = kept.reveal(c.layer(), pos, checks, 0, &log).unwrap();
            let (mut t, mut r) = (trace.clone(), honest.clone());
            let want = match part {
                Point::Scores | Point::Context => {
                    // A context row other than the recomputed one (what wrong scores or a
                    // wrong context make), committed consistently.
                    let row = r.rows.iter_mut().find(|x| x.point == Point::Context);
                    let row = row.unwrap();
                    row.root = product_row_leaf(pos, &[7.0]);
                    let (cols, root) = (row.cols as usize, row.root);
                    set(
                        &mut t,
                        c.layer(),
                        Point::Context,
                        gemm_commitment(1, cols, &root),
                    );
                    "recomputed from the revealed cache"
                }
                Point::Output => {
                    // A flipped bit of the output, committed consistently.
                    r.next.data[1] = f32::from_bits(r.next.data[1].to_bits() ^ 1 << 12);
                    let next = Activations {
                        start: pos,
                        hidden: model.config.hidden_size,
                        data: r.next.data.clone(),
                    };
                    let e = t.entries.iter_mut().find(|e| e.point == Point::Output);
                    e.unwrap().commitment = next.commitment();
                    "not what the revealed products give"
                }
                _ => {
                    // A consistent lie about the product: wrong in one value by two units in
                    // the last place (an MLP first product's row has no commitment of its
                    // own to redo: the hidden row made of it is the stage's).
                    let values = nudge(c, r.rows.iter_mut().find(|x| x.point == part).unwrap());
                    if part.output_committed() {
                        recommit(&mut t, &mut r, part, &values);
                    }
                    "Freivalds"
                }
            };
            let mut v = view.clone();
            v[1].0 = &t;
            let err = c.check(&model, &v, &empty(&model), &r, checks).unwrap_err();
            assert!(err.contains(want), "{name} {part:?}: {err}");
        }
        // The output projection tested alone takes the committed context as its input: a
        // context row that does not open its commitment is refused.
        let checks = CheckSet::of(&[Point::O]);
        let mut r = kept.reveal(c.layer(), pos, checks, 0, &log).unwrap();
        let row = r
            .rows
            .iter_mut()
            .find(|x| x.point == Point::Context)
            .unwrap();
        row.encoding[0] ^= 1;
        let err = c
            .check(&model, &view, &empty(&model), &r, checks)
            .unwrap_err();
        assert!(err.contains("does not open"), "{name}: {err}");
        // Likewise the down projection tested alone takes the committed hidden row: one that
        // does not open its commitment, or is not a quantised row, is refused.
        let checks = CheckSet::of(&[Point::Down]);
        let honest = kept.reveal(c.layer(), pos, checks, 0, &log).unwrap();
        let at = honest
            .rows
            .iter()
            .position(|x| x.point == Point::Hidden)
            .unwrap();
        let mut r = honest.clone();
        // The first element's second bit (past the blocks' 3-byte scales).
        let blocks = (r.rows[at].cols as usize).div_ceil(32);
        r.rows[at].encoding[3 * blocks] ^= 2;
        let err = c
            .check(&model, &view, &empty(&model), &r, checks)
            .unwrap_err();
        assert!(err.contains("does not open"), "{name}: {err}");
        let mut r = honest.clone();
        r.rows[at].encoding.pop();
        let err = c
            .check(&model, &view, &empty(&model), &r, checks)
            .unwrap_err();
        assert!(err.contains("hidden row"), "{name}: {err}");
        // A layer input that is not finite, committed consistently, is refused by a check of
        // the output alone, which derives nothing from it before adding the products' rows
        // (the committed context and hidden rows stand in): the stage itself would have
        // refused to run it.
        let checks = CheckSet::of(&[Point::Output]);
        let mut r = kept.reveal(c.layer(), pos, checks, 0, &log).unwrap();
        let mut t = trace.clone();
        r.input.data[3] = f32::INFINITY;
        let input = Activations {
            start: pos,
            hidden: model.config.hidden_size,
            data: r.input.data.clone(),
        };
        set(&mut t, c.layer(), Point::Input, input.commitment());
        let mut v = view.clone();
        v[1].0 = &t;
        let err = c.check(&model, &v, &empty(&model), &r, checks).unwrap_err();
        assert!(err.contains("non-finite"), "{name}: {err}");
        // The glue between the MLP's first products and the down projection: a stage that
        // computes them right but commits (and computes the down projection on) another hidden
        // row is caught by a check of any first product alone. Likewise k and v and the cache
        // row they make (logged and committed, so attention reads it as committed).
        let hidden = (Point::Hidden, "not what its first products give");
        let cache_row = (Point::KvCache, "not the row's keys and values");
        for (part, (made, why)) in [
            (Point::Gate, hidden),
            (Point::Up, hidden),
            (Point::Fc, hidden),
            (Point::K, cache_row),
            (Point::V, cache_row),
        ] {
            let checks = CheckSet::of(&[part]);
            if !check_parts(&model.config).contains(&part) {
                continue;
            }
            let mut r = kept.reveal(c.layer(), pos, checks, 0, &log).unwrap();
            let mut t = trace.clone();
            let row = r.rows.iter_mut().find(|x| x.point == made).unwrap();
            row.root = product_row_leaf(pos, &[7.0]);
            let (cols, root) = (row.cols as usize, row.root);
            set(&mut t, c.layer(), made, gemm_commitment(1, cols, &root));
            let mut v = view.clone();
            v[1].0 = &t;
            let err = c.check(&model, &v, &empty(&model), &r, checks).unwrap_err();
            assert!(err.contains(why), "{name} {part:?}: {err}");
        }
        // Either of a pair drawn alone tests the other too: a lie in the up projection is
        // caught by a check of the gate alone (with the up projection untested, its revealed
        // row could be any that makes the committed hidden row with the gate's); likewise k
        // and v.
        for (drawn, lying) in [
            (Point::Gate, Point::Up),
            (Point::Up, Point::Gate),
            (Point::K, Point::V),
            (Point::V, Point::K),
        ] {
            if check_parts(&model.config).contains(&drawn) {
                let checks = CheckSet::of(&[drawn]);
                let mut r = kept.reveal(c.layer(), pos, checks, 0, &log).unwrap();
                nudge(c, r.rows.iter_mut().find(|x| x.point == lying).unwrap());
                let err = c
                    .check(&model, &view, &empty(&model), &r, checks)
                    .unwrap_err();
                assert!(err.contains("Freivalds"), "{name} {drawn:?}: {err}");
                assert!(
                    err.contains(&format!("{lying:?}")),
                    "{name} {drawn:?}: {err}"
                );
            }
        }
    }
}

#[test]
fn parts_are_drawn_independently_at_the_rate() {
    let parts = [
        Point::Q,
        Point::K,
        Point::V,
        Point::O,
        Point::Down,
        Point::Output,
    ];
    assert_eq!(draw_checks(&parts, 1.0, || 0.99), CheckSet::of(&parts));
    assert!(draw_checks(&parts, 0.0, || 0.0).is_empty());
    let mut coins = dc_kernels::rng::SplitMix64::new(3);
    let (draws, rate) = (20_000, 0.06);
    let mut hits = [0usize; 6];
    let mut both = 0;
    for _ in 0..draws {
        let s = draw_checks(&parts, rate, || coins.unit());
        for (h, p) in hits.iter_mut().zip(parts) {
            *h += s.contains(p) as usize;
        }
        both += (s.contains(Point::Q) && s.contains(Point::Down)) as usize;
    }
    // Five standard deviations either way.
    let (mean, sd) = (
        draws as f64 * rate,
        (draws as f64 * rate * (1.0 - rate)).sqrt(),
    );
    for (h, p) in hits.iter().zip(parts) {
        assert!((*h as f64 - mean).abs() < 5.0 * sd, "{p:?}: {h} of {draws}");
    }
    let pair = draws as f64 * rate * rate;
    assert!(
        (both as f64 - pair).abs() < 5.0 * pair.sqrt(),
        "together: {both}"
    );
}

#[test]
fn the_goal_rate_is_the_least_that_meets_the_goal() {
    for (name, gemms) in [("gpt2", 8), ("llama", 9)] {
        let config = fixture(name, 1).0.config;
        assert_eq!(dc_model::gemms_per_layer(&config), gemms, "{name}");
        let mut last = 1.0;
        for layers in 1..=96 {
            let c = dc_model::goal_rate(&config, layers);
            // The fewest lies that are 1 % of the stage's GEMMs in 256 decode hops.
            let lies = (256 * gemms * layers).div_ceil(100) as f64;
            let escape = |c: f64| (1.0 - c).powf(lies);
            assert!(escape(c) <= 1e-6 * (1.0 + 1e-9), "{name} {layers}: {c}");
            assert!(
                escape(c * (1.0 - 1e-6)) > 1e-6,
                "{name} {layers}: {c} is not the least"
            );
            assert!(c < last, "{name} {layers}: {c} after {last}");
            last = c;
        }
    }
    let llama = fixture("llama", 1).0.config;
    // The figures docs/VERIFICATION.md gives: 24 lies for one layer, 231 for ten, 738 for 32.
    for (layers, rate) in [(1, 0.43766), (10, 0.05805), (32, 0.01855)] {
        let c = dc_model::goal_rate(&llama, layers);
        assert!((c - rate).abs() < 1e-5, "{layers} layers: {c}");
    }
}

#[test]
fn a_lie_in_one_row_of_a_prefill_hop_is_caught_by_a_check_of_every_row() {
    use dc_kernels::verify::commit::{merkle_proof, merkle_root};
    for name in TINY {
        let (model, gemm, ids) = fixture(name, 1);
        let n = model.config.num_layers;
        // One 9-row prefill hop.
        let (hops, log) = stage_hops(&model, &gemm, 0..n, &ids, &[9]);
        let (trace, rows, kept) = &hops[0];
        let (rows, from) = (*rows, trace.from);
        let c = &checkers(&model, 0..n, 5)[n - 1];
        let view = views(&hops, 0);
        let all = |checks| {
            kept.reveal_rows(c.layer(), from, rows, checks, 0, &log)
                .unwrap()
        };
        // Honest: every row passes, and the verified cache is the stage's to the end of the hop.
        let mut cache = empty(&model);
        c.check_rows_in_place(
            &model,
            &view,
            &mut cache,
            &all(every(&model)),
            every(&model),
            rows,
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            cache.encode_rows(0..cache.len()),
            log.rows(c.layer(), rows).unwrap()
        );
        // A reveal of fewer rows than asked for, or of none, is refused, and the cache left as
        // it was.
        let one = kept
            .reveal(c.layer(), from, every(&model), 0, &log)
            .unwrap();
        let mut none = all(every(&model));
        none.rows.clear();
        for short in [one, none] {
            let mut cache = empty(&model);
            let err = c
                .check_rows_in_place(&model, &view, &mut cache, &short, every(&model), rows)
                .unwrap_err();
            assert!(cache.is_empty(), "{name}: {err}");
        }
        // A lie in the down projection of the hop's last row alone, committed consistently (a
        // new Merkle root over the hop's rows).
        let checks = CheckSet::of(&[Point::Down]);
        let mut r = all(checks);
        let per = r.rows.len() / rows;
        let at = |r: &LayerReveal, i: usize| {
            (i * per..(i + 1) * per)
                .find(|&k| r.rows[k].point == Point::Down)
                .unwrap()
        };
        let bad = at(&r, rows - 1);
        let cols = r.rows[bad].cols as usize;
        nudge(c, &mut r.rows[bad]);
        let leaves: Vec<_> = (0..rows)
            .map(|i| exact_row_leaf(from + i, &values_of(c, &r.rows[at(&r, i)])))
            .collect();
        let root = merkle_root(&leaves);
        for i in 0..rows {
            let k = at(&r, i);
            r.rows[k].root = root;
            r.rows[k].path = merkle_proof(&leaves, i);
        }
        let mut t = trace.clone();
        set(
            &mut t,
            c.layer(),
            Point::Down,
            gemm_commitment(rows, cols, &root),
        );
        let v = vec![(&t, rows)];
        // A check of one other row (what a prefill hop got before) passes...
        let first_only = LayerReveal {
            rows: r.rows[..per].to_vec(),
            ..r.clone()
        };
        c.check(&model, &v, &empty(&model), &first_only, checks)
            .unwrap_or_else(|e| panic!("{name}: the first row alone: {e}"));
        // ... and the check of every row catches the lie.
        let mut cache = empty(&model);
        let err = c
            .check_rows_in_place(&model, &v, &mut cache, &r, checks, rows)
            .unwrap_err();
        assert!(err.contains("Freivalds"), "{name}: {err}");
    }
}

/// A stage runs hops at these `(start, rows)`, each starting inside or at the end of the one
/// before (a speculative pass whose guess missed is followed by a hop that starts inside it), on
/// the token ids `ids` shifted by `salt` at each rewound hop so that its rows differ from the
/// ones they overwrite; returns (trace, rows, kept) per hop, the log, and per hop every layer's
/// cache rows as the cache held them after it.
#[allow(clippy::type_complexity)]
fn overlapping_hops(
    model: &Model,
    gemm: &Gemm,
    stage: std::ops::Range<usize>,
    ids: &[u32],
    hops: &[(usize, usize)],
) -> (Vec<Hop>, CacheLog, Vec<Vec<Vec<u8>>>) {
    let mut log = CacheLog::default();
    let mut head_cache = KvCache::new(&model.config, 0..stage.start);
    let mut cache = KvCache::new(&model.config, stage.clone());
    let (mut out, mut after) = (Vec::new(), Vec::new());
    let vocab = model.config.vocab_size as u32;
    for (k, &(pos, len)) in hops.iter().enumerate() {
        let tokens: Vec<u32> = ids[pos..pos + len]
            .iter()
            .map(|&t| (t + k as u32 * 7) % vocab)
            .collect();
        let mut x = model.embed(&tokens, pos).unwrap();
        if !head_cache.layers().is_empty() {
            x = model.run_layers(gemm, x, &mut head_cache).unwrap();
        }
        let mut t = HopTrace::from_position(pos);
        let (_, kept) = model.run_layers_kept(gemm, x, &mut cache, &mut t).unwrap();
        log.record_hop(pos, &cache).unwrap();
        after.push(
            stage
                .clone()
                .map(|l| {
                    let c = cache.layer(l).unwrap();
                    c.encode_rows(0..c.len())
                })
                .collect(),
        );
        out.push((t, len, kept));
    }
    (out, log, after)
}

#[test]
fn hops_that_start_inside_the_one_before_are_revealed_whole_and_checked() {
    // Prefill, a guess of 3 (1 kept), a guess of 4 (none kept), decode, a guess of 2 (all kept).
    let plan = [(0, 9), (9, 4), (11, 5), (12, 1), (13, 3), (16, 1)];
    for name in TINY {
        let (model, gemm, ids) = fixture(name, 2);
        let n = model.config.num_layers;
        let stage = 1..n;
        let (hops, log, after) = overlapping_hops(&model, &gemm, stage.clone(), &ids, &plan);
        let rb = empty(&model).row_bytes();
        let checkers = checkers(&model, stage.clone(), 3);
        for (k, (trace, rows, kept)) in hops.iter().enumerate() {
            let (start, end) = (trace.from, trace.from + rows);
            for (i, c) in checkers.iter().enumerate() {
                let l = c.layer();
                // What the cache held after the hop, row for row, whoever checks from where.
                for (from, _) in plan[..=k].iter().filter(|(s, _)| *s <= start) {
                    let known = LayerCache::from_encoded(
                        model.config.num_kv_heads,
                        model.config.head_dim,
                        &after[k][i][..from * rb],
                    )
                    .unwrap();
                    for index in [0, rows - 1] {
                        let r = kept
                            .reveal(l, start + index, every(&model), *from, &log)
                            .unwrap();
                        let whole: usize = plan[..=k]
                            .iter()
                            .filter(|(s, _)| s >= from)
                            .map(|(_, n)| n)
                            .sum();
                        assert_eq!(r.cache.len(), whole * rb, "{name}: hops from {from} whole");
                        let got = c
                            .check(&model, &views(&hops, k), &known, &r, every(&model))
                            .unwrap_or_else(|e| panic!("{name}: hop {k}, layer {l}: {e}"));
                        assert_eq!(got.encode_rows(0..got.len()), after[k][i][..end * rb]);
                    }
                }
                // An audit's view: the rows before the hop, as the cache held them then.
                if k > 0 {
                    let from = plan[k - 1].0;
                    let bytes = log.hop_rows(l, from, start).unwrap();
                    let cfg = &model.config;
                    let rows = check_cache_rows(cfg, l, &views(&hops, k - 1), from, start, &bytes)
                        .unwrap_or_else(|e| panic!("{name}: before hop {k}: {e}"));
                    assert_eq!(&rows[..], &after[k - 1][i][from * rb..start * rb]);
                    // A cut row that was not the one committed is refused.
                    let mut bad = bytes.clone();
                    let last = bad.len() - 1;
                    bad[last] ^= 1;
                    assert!(
                        check_cache_rows(cfg, l, &views(&hops, k - 1), from, start, &bad).is_err()
                    );
                }
            }
        }
        // Hops must go forward: a trace that starts at or before the one before it is refused.
        let views = views(&hops, hops.len() - 1);
        let mut swapped = views.clone();
        swapped.swap(3, 4);
        let l = stage.start;
        assert!(check_cache_rows(&model.config, l, &swapped, 0, 17, &[]).is_err());
    }
}
