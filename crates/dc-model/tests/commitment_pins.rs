//! Hop commitments are part of the wire contract: a stage's trace root for a given model and
//! input must never change, whatever kernel, thread count or code path computes it. These pins
//! were computed by the original (byte-by-byte) commitment code; any change of bytes fails.

#![allow(clippy::unwrap_used)] // test: a panic is the failure report

mod common;

use common::*;
use dc_kernels::{Gemm, Kernel};
use dc_model::trace::HopTrace;
use dc_model::{KvCache, LoadOptions, Model};

/// Trace roots of: a 40-token prefill committing every position, the same prefill committing
/// positions 13 on (an audit's replay), and two decoded tokens after it.
fn roots(model: &Model, gemm: &Gemm, ids: &[u32]) -> [String; 3] {
    let layers = 0..model.config.num_layers;
    let mut out = Vec::new();
    for from in [0, 13] {
        let mut cache = KvCache::new(&model.config, layers.clone());
        let mut t = HopTrace::from_position(from);
        let x = model.embed(ids, 0).unwrap();
        model
            .run_layers_traced(gemm, x, &mut cache, Some(&mut t))
            .unwrap();
        out.push(t.root().to_hex());
        if from == 0 {
            continue;
        }
        let mut t = HopTrace::from_position(ids.len());
        for (i, &tok) in ids[..2].iter().enumerate() {
            let x = model.embed(&[tok], ids.len() + i).unwrap();
            model
                .run_layers_traced(gemm, x, &mut cache, Some(&mut t))
                .unwrap();
        }
        out.push(t.root().to_hex());
    }
    out.try_into().unwrap()
}

const PINNED: [(&str, [&str; 3]); 4] = [
    (
        "gpt2",
        [
            "0ca8fc231937d9bccf9195baa5bbf9abd59a5ffe318f2e43cc79526868741c80",
            "dd1ea7fb2b0e3be4710e9050e84c7448f8e59eb6805f4eb118fba287abc41865",
            "19e2c9555faaf959c9c8988bb9a4d9a7ccc0eabb250405db01d901501cf3a1d8",
        ],
    ),
    (
        "llama",
        [
            "54a7b06282dce34741ea9fdcfaa51a82ddc9c7b7d60ebe415ca4dc6beb67c8b2",
            "20e6dd1e93cfb04e9547453e3b481674352b6938a73facf959b2c81fa127c5e2",
            "a9f5ef98fe2dfb9c87f3b921edb0e8bfb14ca5018438099e651e99431fff9659",
        ],
    ),
    (
        "qwen2",
        [
            "8a00d12207854aedfcacb2497a9e8a735de4b4c42401a071c7f406c7477b6300",
            "451e284298f6cda23805b989e5d7c83727790030ffd7bad0dfda6dd66da0891a",
            "683f5d08770ad6181e1195bff1860f3937f95953a74cf0a296c5d273db432e7d",
        ],
    ),
    (
        "mistral",
        [
            "98b1ecbdd262d4c4de08b11bf536bbb4e89d83ff821b8748232d04cfef4cc61f",
            "a621694f0b9115dd88045f3d625a19ab7fed5350d59bfe5852040a34157050c0",
            "dbcc25ed62574131a25232a05e907e58fa9ded1995cfcda44bb892f675f9404e",
        ],
    ),
];

#[test]
fn hop_trace_roots_are_pinned_bit_for_bit() {
    for (name, want) in PINNED {
        let model = Model::load(&fixtures().join(name), &LoadOptions::default()).unwrap();
        let ids = expected_logits(name).pop().unwrap().0;
        for kernel in Kernel::supported() {
            for threads in [1, 2] {
                let gemm = Gemm::new(kernel, threads).unwrap();
                let got = roots(&model, &gemm, &ids);
                assert_eq!(got, want.map(String::from), "{name}: {kernel} × {threads}");
            }
        }
    }
}
