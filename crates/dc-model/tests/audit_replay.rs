//! An audit replays a stage's hop from the head's transcript: every earlier input of the stage,
//! one fresh prefill, commitments for the audited rows only. Its trace must equal the one the
//! stage produced incrementally, entry for entry, for every step (the property that makes an
//! audit an equality check).

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use dc_kernels::{Gemm, Kernel};
use dc_model::trace::HopTrace;
use dc_model::{Activations, KvCache, LoadOptions, Model};

#[test]
fn replayed_traces_equal_incremental_ones() {
    for name in TINY {
        let model = Model::load(&fixtures().join(name), &LoadOptions::default()).unwrap();
        let gemm = Gemm::new(Kernel::best(), 2).unwrap();
        let ids = expected_logits(name).pop().unwrap().0; // 40 tokens
        let stage = 1..3;
        // The stage's side: a prefill chunk of 17, a chunk of 9, then single positions.
        let mut head_cache = KvCache::new(&model.config, 0..1);
        let mut cache = KvCache::new(&model.config, stage.clone());
        let mut inputs: Vec<Activations> = Vec::new();
        let mut traces: Vec<HopTrace> = Vec::new();
        let mut outputs: Vec<Activations> = Vec::new();
        let mut pos = 0;
        for len in [17usize, 9, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1] {
            let x = model.embed(&ids[pos..pos + len], pos).unwrap();
            let x = model.run_layers(&gemm, x, &mut head_cache).unwrap();
            let mut t = HopTrace::from_position(pos);
            let y = model
                .run_layers_traced(&gemm, x.clone(), &mut cache, Some(&mut t))
                .unwrap();
            inputs.push(x);
            traces.push(t);
            outputs.push(y);
            pos += len;
        }
        // The auditor's side, for every step.
        for s in 0..traces.len() {
            let all: Vec<f32> = inputs[..=s]
                .iter()
                .flat_map(|a| a.data.iter().copied())
                .collect();
            let x = Activations {
                start: 0,
                hidden: model.config.hidden_size,
                data: all,
            };
            let mut t = HopTrace::from_position(inputs[s].start);
            let mut fresh = KvCache::new(&model.config, stage.clone());
            let y = model
                .run_layers_traced(&gemm, x, &mut fresh, Some(&mut t))
                .unwrap();
            assert_eq!(t.entries, traces[s].entries, "{name}: step {s}");
            assert_eq!(t.root(), traces[s].root());
            assert_eq!(
                y.rows_from(inputs[s].start),
                outputs[s],
                "{name}: step {s} output"
            );
        }
        // The trace names one entry per committed row: input, q, the cache rows (k and v
        // commit through them), the context (the scores commit through it), o, the MLP's
        // hidden row (its first products commit through it) and its down projection; then
        // the output.
        assert_eq!(traces[0].entries.len(), 7 * 2 + 1, "{name}");
        // A different input changes the trace from the first entry on.
        let mut other = inputs[3].clone();
        other.data[5] += 0.25;
        let mut c2 = KvCache::new(&model.config, stage.clone());
        let all: Vec<f32> = inputs[..3]
            .iter()
            .flat_map(|a| a.data.iter().copied())
            .chain(other.data.iter().copied())
            .collect();
        let mut t = HopTrace::from_position(inputs[3].start);
        model
            .run_layers_traced(
                &gemm,
                Activations {
                    start: 0,
                    hidden: model.config.hidden_size,
                    data: all,
                },
                &mut c2,
                Some(&mut t),
            )
            .unwrap();
        assert_eq!(traces[3].first_difference(&t), Some(0), "{name}");
    }
}

/// A hop hashes each layer's leaves in one of two batches taking turns, while the next layer
/// computes, the last layer's after the loop; every entry must still be the one the layer
/// commits alone: a hop over several layers (kept, as a stage keeps it for checks) equals as
/// many one-layer stages, entry for entry, for prompt chunks and decode rows alike. (That the
/// kept leaves open their entries: `spot_check`'s honest reveals of 17-row hops.)
#[test]
fn layer_commitments_equal_one_layer_stages() {
    for name in TINY {
        let model = Model::load(&fixtures().join(name), &LoadOptions::default()).unwrap();
        let gemm = Gemm::new(Kernel::best(), 1).unwrap();
        let ids = expected_logits(name).pop().unwrap().0;
        let layers = model.config.num_layers;
        let mut whole = KvCache::new(&model.config, 0..layers);
        let mut single: Vec<KvCache> = (0..layers)
            .map(|l| KvCache::new(&model.config, l..l + 1))
            .collect();
        let mut pos = 0;
        for len in [12usize, 1, 27] {
            let x = model.embed(&ids[pos..pos + len], pos).unwrap();
            let mut t = HopTrace::from_position(pos);
            let (y, _kept) = model
                .run_layers_kept(&gemm, x.clone(), &mut whole, &mut t)
                .unwrap();
            let mut entries = Vec::new();
            let mut h = x;
            for (l, cache) in single.iter_mut().enumerate() {
                let mut tl = HopTrace::from_position(pos);
                h = model
                    .run_layers_traced(&gemm, h, cache, Some(&mut tl))
                    .unwrap();
                let output = tl.entries.pop().unwrap();
                assert_eq!(
                    output.point,
                    dc_model::trace::Point::Output,
                    "{name}: layer {l}"
                );
                entries.extend(tl.entries);
            }
            assert_eq!(h, y, "{name}: {len} rows at {pos}");
            assert_eq!(
                t.entries[..t.entries.len() - 1],
                entries,
                "{name}: {len} rows at {pos}"
            );
            pos += len;
        }
    }
}
