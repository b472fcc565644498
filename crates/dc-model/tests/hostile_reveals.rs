//! A reveal comes from the stage being checked, so a lying or broken stage chooses every byte
//! of it. Whatever it sends, the checker must answer with an error or a pass, never panic (a
//! panic in the head's checker would take the head down with the liar), and must never pass a
//! reveal that claims anything other than what the honest stage committed.
//!
//! Two kinds of damage, from a seeded generator so a failure replays: bytes of the encoded
//! reveal changed, cut or repeated (what a broken peer sends), and fields of the decoded reveal
//! set to edge values (what a hostile one crafts: counts and positions out of range, empty or
//! oversized rows and paths, a cache of the wrong length, activations of the wrong width).

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};

use common::*;
use dc_kernels::rng::SplitMix64;
use dc_kernels::verify::reveal::revealed_values;
use dc_kernels::{Commitment, Gemm, Kernel};
use dc_model::attention::LayerCache;
use dc_model::trace::HopTrace;
use dc_model::{
    check_parts, draw_checks, tested_parts, CacheLog, KvCache, LayerChecker, LoadOptions, Model,
};
use dc_types::{CheckSet, LayerReveal, RevealedRow};

/// Bytes a decoded reveal may take (the wire's cap is larger; this keeps the test quick).
const LIMIT: usize = 1 << 22;

/// One way a head checks a stage: the hops it has seen, the cache it verified before, the
/// parts drawn, the positions checked, and what the honest stage reveals for that.
struct Scenario<'a> {
    what: &'static str,
    hops: Vec<(&'a HopTrace, usize)>,
    known: LayerCache,
    checks: CheckSet,
    positions: usize,
    honest: LayerReveal,
}

/// What the checker says of `reveal` in `s`: `Ok(true)` it passed, `Ok(false)` refused, `Err`
/// it panicked (with the panic's message).
fn verdict(
    checker: &LayerChecker,
    model: &Model,
    s: &Scenario,
    reveal: &LayerReveal,
) -> Result<bool, String> {
    let mut cache = s.known.clone();
    catch_unwind(AssertUnwindSafe(|| {
        checker
            .check_rows_in_place(model, &s.hops, &mut cache, reveal, s.checks, s.positions)
            .is_ok()
    }))
    .map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
}

/// A decoded reveal's fields set to edge values, one change per case.
fn crafted(honest: &LayerReveal, rng: &mut SplitMix64) -> LayerReveal {
    let mut r = honest.clone();
    let pick = |rng: &mut SplitMix64, n: usize| (rng.next_u64() % n as u64) as usize;
    let edge_u32 = |rng: &mut SplitMix64| [0, 1, 2, u32::MAX, u32::MAX / 2, 1 << 20][pick(rng, 6)];
    let row = pick(rng, r.rows.len().max(1));
    match pick(rng, 16) {
        0 => r.layer = edge_u32(rng),
        1 => r.position = edge_u32(rng),
        2 => r.input.hidden = edge_u32(rng),
        3 => r.input.start = edge_u32(rng),
        4 => r.next.hidden = edge_u32(rng),
        5 => {
            let keep = pick(rng, r.input.data.len() + 1);
            r.input.data.truncate(keep);
        }
        6 => r
            .next
            .data
            .extend_from_slice(&[f32::NAN, f32::INFINITY, 1e30]),
        7 => {
            let keep = pick(rng, r.cache.len() + 1);
            r.cache.truncate(keep);
        }
        8 => r.cache.extend((0..pick(rng, 600)).map(|i| i as u8)),
        9 => {
            if !r.rows.is_empty() {
                r.rows.remove(row);
            }
        }
        10 => {
            if let Some(x) = r.rows.get(row).cloned() {
                r.rows.insert(row, x);
            }
        }
        11 => {
            if let Some(x) = r.rows.get_mut(row) {
                x.cols = edge_u32(rng);
            }
        }
        12 => {
            if let Some(x) = r.rows.get_mut(row) {
                x.unit = match x.unit {
                    Some(_) => [None, Some(i32::MIN), Some(i32::MAX), Some(-1)][pick(rng, 4)],
                    None => Some([0, i32::MIN, i32::MAX][pick(rng, 3)]),
                };
            }
        }
        13 => {
            if let Some(x) = r.rows.get_mut(row) {
                let keep = pick(rng, x.encoding.len() + 1);
                x.encoding.truncate(keep);
            }
        }
        14 => {
            if let Some(x) = r.rows.get_mut(row) {
                match pick(rng, 3) {
                    0 => x.path.clear(),
                    1 => x
                        .path
                        .extend(std::iter::repeat_n(Commitment::default(), 70)),
                    _ => x.root = Commitment([0xAB; 32]),
                }
            }
        }
        _ => r.rows.reverse(),
    }
    r
}

/// The encoded reveal with a few bytes changed, cut short or a stretch of it repeated.
fn damaged(bytes: &[u8], rng: &mut SplitMix64) -> Vec<u8> {
    let mut b = bytes.to_vec();
    let at = |rng: &mut SplitMix64, len: usize| (rng.next_u64() % len.max(1) as u64) as usize;
    match rng.next_u64() % 4 {
        0 => {
            for _ in 0..1 + rng.next_u64() % 4 {
                let i = at(rng, b.len());
                b[i] ^= 1 << (rng.next_u64() % 8);
            }
        }
        1 => {
            let i = at(rng, b.len());
            b[i] = [0x00, 0xFF, 0xFB, 0xFC, 0xFD][(rng.next_u64() % 5) as usize];
        }
        2 => b.truncate(at(rng, b.len())),
        _ => {
            let i = at(rng, b.len());
            let j = (i + 1 + at(rng, 64)).min(b.len());
            let stretch = b[i..j].to_vec();
            b.splice(i..i, stretch);
        }
    }
    b
}

/// Whether `r` claims what `honest` does: equal but for the order of its rows, a row
/// repeated, or the exact sums of a product row the checks do not test that round to the same
/// values (only the rounded row is committed and used; a tested row's sums are the claim).
fn same_claims(r: &LayerReveal, honest: &LayerReveal, c: &LayerChecker, checks: CheckSet) -> bool {
    let (mut x, mut y) = (r.clone(), honest.clone());
    (x.rows, y.rows) = (Vec::new(), Vec::new());
    let rounded = |row: &RevealedRow| {
        let units = c.col_units(row.point)?;
        let values = revealed_values(row.unit, &row.encoding, units).ok()?;
        values
            .iter()
            .map(|v| v.to_f32())
            .collect::<Option<Vec<f32>>>()
    };
    let same_row = |a: &RevealedRow, b: &RevealedRow| {
        a == b
            || (!tested_parts(checks).contains(a.point)
                && (a.point, a.cols, a.root, &a.path) == (b.point, b.cols, b.root, &b.path)
                && rounded(a).is_some_and(|v| Some(v) == rounded(b)))
    };
    x == y
        && r.rows
            .iter()
            .all(|a| honest.rows.iter().any(|b| same_row(a, b)))
        && honest
            .rows
            .iter()
            .all(|b| r.rows.iter().any(|a| same_row(a, b)))
}

/// What differs between two reveals, field by field (a reveal is too long to print whole).
fn differences(a: &LayerReveal, b: &LayerReveal) -> String {
    let mut out = Vec::new();
    let fields = |r: &LayerReveal| {
        [
            ("layer", format!("{}", r.layer)),
            ("position", format!("{}", r.position)),
            (
                "input",
                format!(
                    "{} {} {:?}",
                    r.input.start,
                    r.input.hidden,
                    r.input.data.len()
                ),
            ),
            (
                "next",
                format!("{} {} {:?}", r.next.start, r.next.hidden, r.next.data.len()),
            ),
            ("cache", format!("{} bytes", r.cache.len())),
            ("rows", format!("{}", r.rows.len())),
        ]
    };
    for ((name, x), (_, y)) in fields(a).into_iter().zip(fields(b)) {
        if x != y {
            out.push(format!("{name}: {x} -> {y}"));
        }
    }
    if a.input.data != b.input.data || a.next.data != b.next.data || a.cache != b.cache {
        out.push("activation or cache values".into());
    }
    for (i, (x, y)) in a.rows.iter().zip(&b.rows).enumerate() {
        if x != y {
            out.push(format!(
                "row {i}: {:?} cols {} unit {:?} {} bytes {} path -> {:?} cols {} unit {:?} {} bytes {} path{}",
                x.point, x.cols, x.unit, x.encoding.len(), x.path.len(),
                y.point, y.cols, y.unit, y.encoding.len(), y.path.len(),
                if x.root != y.root { ", another root" } else { "" },
            ));
        }
    }
    out.join("; ")
}

#[test]
fn damaged_and_crafted_reveals_are_refused_without_panicking() {
    for (name, seed) in TINY.iter().zip(1u64..) {
        let model = Model::load(&fixtures().join(name), &LoadOptions::default()).unwrap();
        let gemm = Gemm::new(Kernel::best(), 1).unwrap();
        let ids = expected_logits(name).pop().unwrap().0;
        let n = model.config.num_layers;
        // A stage of every layer runs a 4-row prompt hop, then a decode hop, keeping both.
        let mut cache = KvCache::new(&model.config, 0..n);
        let mut log = CacheLog::default();
        let mut hops = Vec::new();
        for (from, len) in [(0, 4), (4, 1)] {
            let x = model.embed(&ids[from..from + len], from).unwrap();
            let mut t = HopTrace::from_position(from);
            let (_, kept) = model.run_layers_kept(&gemm, x, &mut cache, &mut t).unwrap();
            log.record(&cache);
            hops.push((t, len, kept));
        }
        let parts = check_parts(&model.config);
        let every = CheckSet::of(&parts);
        let layer = n - 1;
        let checker = LayerChecker::new(&model, layer, &[3; 32]).unwrap();
        let nothing = LayerCache::new(model.config.num_kv_heads, model.config.head_dim);
        let prompt = vec![(&hops[0].0, 4)];
        let both = vec![(&hops[0].0, 4), (&hops[1].0, 1)];
        let mut coins = SplitMix64::new(seed);
        let some = loop {
            let c = draw_checks(&parts, 0.4, || coins.unit());
            if !c.is_empty() && c != every {
                break c;
            }
        };
        let reveal = |hop: usize, pos, rows, checks, from| {
            hops[hop]
                .2
                .reveal_rows(layer, pos, rows, checks, from, &log)
                .unwrap()
        };
        let mut scenarios = vec![
            Scenario {
                what: "every part of the decode hop, no cache verified before",
                hops: both.clone(),
                known: nothing.clone(),
                checks: every,
                positions: 1,
                honest: reveal(1, 4, 1, every, 0),
            },
            Scenario {
                what: "every part of every row of the prompt hop",
                hops: prompt,
                known: nothing.clone(),
                checks: every,
                positions: 4,
                honest: reveal(0, 0, 4, every, 0),
            },
            Scenario {
                what: "some parts of the decode hop",
                hops: both.clone(),
                known: nothing,
                checks: some,
                positions: 1,
                honest: reveal(1, 4, 1, some, 0),
            },
        ];
        // The prompt's cache rows verified by its check, then the decode hop's from there.
        let mut verified = scenarios[1].known.clone();
        let s = &scenarios[1];
        checker
            .check_rows_in_place(&model, &s.hops, &mut verified, &s.honest, every, 4)
            .unwrap();
        scenarios.push(Scenario {
            what: "every part of the decode hop, the prompt's cache verified before",
            hops: both,
            known: verified,
            checks: every,
            positions: 1,
            honest: reveal(1, 4, 1, every, 4),
        });

        let mut rng = SplitMix64::new(seed);
        for s in &scenarios {
            let what = format!("{name}, {}", s.what);
            assert_eq!(verdict(&checker, &model, s, &s.honest), Ok(true), "{what}");
            let bytes = dc_types::encode(&s.honest, LIMIT).unwrap();
            let (mut decoded, mut refused) = (0, 0);
            for case in 0..1000 {
                let r = if case % 2 == 0 {
                    crafted(&s.honest, &mut rng)
                } else {
                    match dc_types::decode::<LayerReveal>(&damaged(&bytes, &mut rng), LIMIT) {
                        Ok(r) => {
                            decoded += 1;
                            r
                        }
                        // Refused by the wire: nothing reaches the checker.
                        Err(_) => continue,
                    }
                };
                if same_claims(&r, &s.honest, &checker, s.checks) {
                    continue;
                }
                match verdict(&checker, &model, s, &r) {
                    Err(panic) => panic!(
                        "{what}, case {case}: the checker panicked: {panic}\n{}",
                        differences(&s.honest, &r)
                    ),
                    Ok(passed) => assert!(
                        !passed,
                        "{what}, case {case}: a reveal other than the honest one passed: {}",
                        differences(&s.honest, &r)
                    ),
                }
                refused += 1;
            }
            // The damage reached the checker often enough to mean something.
            assert!(
                refused >= 150 && decoded >= 15,
                "{what}: {refused} refused, {decoded} decoded"
            );
        }
    }
}
