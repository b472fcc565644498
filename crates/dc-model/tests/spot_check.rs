//! Spot checks: a stage that keeps a hop can reveal any (layer, position) of it, and a checker
//! holding only `W · r`, the norms and the signed trace accepts every honest reveal and refuses
//! every lie — a wrong product row (even one the stage committed to consistently), a wrong
//! output, a reveal that does not open the commitments.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use dc_kernels::commit::gemm_commitment;
use dc_kernels::reveal::{decode_row, leaf_of_encoding, values_encoding};
use dc_kernels::{Exact, Gemm, Kernel};
use dc_model::trace::{HopTrace, Point};
use dc_model::{Activations, KeptHop, KvCache, LayerChecker, LoadOptions, Model};
use dc_types::LayerReveal;

/// A stage over `stage` runs hops of these lengths, keeping each; returns (trace, rows, kept).
fn stage_hops(
    model: &Model,
    gemm: &Gemm,
    stage: std::ops::Range<usize>,
    ids: &[u32],
    lens: &[usize],
) -> Vec<(HopTrace, usize, KeptHop)> {
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
        let mut t = HopTrace::from_position(pos);
        let (y, kept) = model
            .run_layers_kept(gemm, x.clone(), &mut cache, &mut t)
            .unwrap();
        // Keeping changes nothing the stage commits or sends.
        let mut t2 = HopTrace::from_position(pos);
        let y2 = model
            .run_layers_traced(gemm, x, &mut plain, Some(&mut t2))
            .unwrap();
        assert_eq!(t.entries, t2.entries);
        assert_eq!(y, y2);
        out.push((t, len, kept));
        pos += len;
    }
    out
}

fn checkers(model: &Model, layers: std::ops::Range<usize>, secret: u8) -> Vec<LayerChecker> {
    layers
        .map(|l| LayerChecker::new(model, l, &[secret; 32]).unwrap())
        .collect()
}

#[test]
fn honest_reveals_pass_for_every_layer_and_row() {
    for name in TINY {
        let model = Model::load(&fixtures().join(name), &LoadOptions::default()).unwrap();
        let gemm = Gemm::new(Kernel::best(), 2).unwrap();
        let ids = expected_logits(name).pop().unwrap().0;
        let n = model.config.num_layers;
        let stage = 1..n;
        let hops = stage_hops(&model, &gemm, stage.clone(), &ids, &[17, 9, 1, 1, 1]);
        for secret in [1u8, 2] {
            let checkers = checkers(&model, stage.clone(), secret);
            for (trace, rows, kept) in &hops {
                for c in &checkers {
                    for index in [0, rows / 2, rows - 1] {
                        let reveal = kept.reveal(c.layer(), trace.from + index).unwrap();
                        c.check(&model, trace, *rows, &reveal).unwrap_or_else(|e| {
                            panic!("{name}: layer {} row {index}: {e}", c.layer())
                        });
                        // The attention scores are never revealed (a check does not use them).
                        assert!(reveal.rows.iter().all(|r| r.point != Point::Scores));
                    }
                }
            }
        }
        // What is not in the hop cannot be revealed.
        let (trace, rows, kept) = &hops[1];
        assert!(
            kept.reveal(0, trace.from).is_err(),
            "{name}: layer outside the stage"
        );
        assert!(
            kept.reveal(1, trace.from + rows).is_err(),
            "{name}: row outside the hop"
        );
    }
}

/// Replaces the revealed row of `point` by `values` and re-commits it in `trace`, as a stage
/// lying consistently about that product would (a one-row hop: the leaf is the root).
fn recommit(trace: &mut HopTrace, reveal: &mut LayerReveal, point: Point, values: &[Exact]) {
    let row = reveal.rows.iter_mut().find(|r| r.point == point).unwrap();
    row.encoding = values_encoding(values);
    row.root = leaf_of_encoding(reveal.position as usize, values.len(), &row.encoding);
    let c = gemm_commitment(1, values.len(), &row.root);
    let e = trace
        .entries
        .iter_mut()
        .find(|e| e.layer == reveal.layer && e.point == point)
        .unwrap();
    e.commitment = c;
}

#[test]
fn lies_in_a_reveal_are_refused() {
    for name in TINY {
        let model = Model::load(&fixtures().join(name), &LoadOptions::default()).unwrap();
        let gemm = Gemm::new(Kernel::best(), 1).unwrap();
        let ids = expected_logits(name).pop().unwrap().0;
        let stage = 0..model.config.num_layers;
        let hops = stage_hops(&model, &gemm, stage.clone(), &ids, &[5, 1]);
        let (trace, rows, kept) = &hops[1];
        let c = &checkers(&model, stage.clone(), 7)[stage.len() - 1];
        let pos = trace.from;
        let honest = kept.reveal(c.layer(), pos).unwrap();
        c.check(&model, trace, *rows, &honest).unwrap();
        let points: Vec<Point> = honest.rows.iter().map(|r| r.point).collect();
        for point in points {
            // A consistent lie about one product: committed, opened, and wrong in one value
            // (a weight product's by one unit in the last place; the context's by its sign, as
            // a change its rounding hides would be harmless).
            let (mut t, mut r) = (trace.clone(), honest.clone());
            let row = r.rows.iter().find(|x| x.point == point).unwrap();
            let mut values = decode_row(&row.encoding, row.cols as usize).unwrap();
            let i = values.iter().position(|v| !v.is_zero()).unwrap();
            values[i] = match values[i] {
                Exact::Small { mant, exp } if point == Point::Context => {
                    Exact::from_i64(-mant, exp)
                }
                Exact::Small { mant, exp } => Exact::from_i64(mant.wrapping_add(2), exp),
                ref w => w.clone(),
            };
            recommit(&mut t, &mut r, point, &values);
            let err = c.check(&model, &t, *rows, &r).unwrap_err();
            let want = if point == Point::Context {
                "O row"
            } else {
                "Freivalds"
            };
            assert!(err.contains(want), "{name} {point:?}: {err}");
            // The honest row against a commitment it does not open.
            let mut r = honest.clone();
            let row = r.rows.iter_mut().find(|x| x.point == point).unwrap();
            row.encoding[0] ^= 1;
            let err = c.check(&model, trace, *rows, &r).unwrap_err();
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
        let err = c.check(&model, &t, *rows, &r).unwrap_err();
        assert!(
            err.contains("not what the revealed products give"),
            "{name}: {err}"
        );
        // Revealed activations that are not the committed ones; a missing or repeated row.
        let mut r = honest.clone();
        r.input.data[0] += 1.0;
        assert!(c.check(&model, trace, *rows, &r).is_err());
        let mut r = honest.clone();
        r.rows.pop();
        assert!(c.check(&model, trace, *rows, &r).is_err());
        let mut r = honest.clone();
        r.rows.push(r.rows[0].clone());
        assert!(c.check(&model, trace, *rows, &r).is_err());
        // A reveal of another layer or position than the checker's.
        let other = kept.reveal(c.layer() - 1, pos).unwrap();
        assert!(c.check(&model, trace, *rows, &other).is_err());
    }
}
