//! Hop commitments are part of the wire contract: a stage's trace root for a given model and
//! input must never change, whatever kernel, thread count or code path computes it. The pins
//! of the traces without their `KvCache` entries were computed by the original (byte-by-byte)
//! commitment code, before traces committed the cache rows; adding those entries changed no
//! other one. Any change of bytes fails.

#![allow(clippy::unwrap_used)] // test: a panic is the failure report

mod common;

use common::*;
use dc_kernels::{Gemm, Kernel};
use dc_model::trace::{HopTrace, Point};
use dc_model::{KvCache, LoadOptions, Model};

/// Trace roots of: a 40-token prefill committing every position, the same prefill committing
/// positions 13 on (an audit's replay), and two decoded tokens after it; then the same three
/// roots over the traces without their `KvCache` entries.
fn roots(model: &Model, gemm: &Gemm, ids: &[u32]) -> [String; 6] {
    let layers = 0..model.config.num_layers;
    let mut out = Vec::new();
    for from in [0, 13] {
        let mut cache = KvCache::new(&model.config, layers.clone());
        let mut t = HopTrace::from_position(from);
        let x = model.embed(ids, 0).unwrap();
        model
            .run_layers_traced(gemm, x, &mut cache, Some(&mut t))
            .unwrap();
        out.push(t);
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
        out.push(t);
    }
    let without_cache = out.iter().map(|t| {
        let mut t = t.clone();
        t.entries.retain(|e| e.point != Point::KvCache);
        t
    });
    let all: Vec<String> = out
        .iter()
        .cloned()
        .chain(without_cache)
        .map(|t| t.root().to_hex())
        .collect();
    all.try_into().unwrap()
}

const PINNED: [(&str, [&str; 6]); 4] = [
    (
        "gpt2",
        [
            "2cfc88508868fa243defcb05b59dcdf4fe07c1c3476327ed5dea1810e6986506",
            "33ca3c51fddc826d62705c034dfba53b4907560c3de3bc5caf0f4302dc0834ea",
            "7e723b4501d8eea570ba4ffd77f9f50bc99ab629f2cf6b1302547cd0ed0c67d7",
            "0ca8fc231937d9bccf9195baa5bbf9abd59a5ffe318f2e43cc79526868741c80",
            "dd1ea7fb2b0e3be4710e9050e84c7448f8e59eb6805f4eb118fba287abc41865",
            "19e2c9555faaf959c9c8988bb9a4d9a7ccc0eabb250405db01d901501cf3a1d8",
        ],
    ),
    (
        "llama",
        [
            "6017492c4abde67d658e27e0c81cb4d9586ca14eba3cf7a91d784849c655cbaa",
            "11c6a38a2890a11457dedeb45c9b45a79ab92ce44f86620793662aca3e2fc2cd",
            "ca353a22c307615fc1da9f14aa5f01054948c9179a484ed5f47d74b6ba1e0f7f",
            "54a7b06282dce34741ea9fdcfaa51a82ddc9c7b7d60ebe415ca4dc6beb67c8b2",
            "20e6dd1e93cfb04e9547453e3b481674352b6938a73facf959b2c81fa127c5e2",
            "a9f5ef98fe2dfb9c87f3b921edb0e8bfb14ca5018438099e651e99431fff9659",
        ],
    ),
    (
        "qwen2",
        [
            "adbea8828ece4a45bb2210f30594a094b1626671c303837e768d0c4daab5813a",
            "8baec05ccd5a3b5e8d8d8cf3f22fb6ffa647517327ef88222c83c168b8d477e9",
            "a08a64429e067814789cc9a9ecee3f49d69310d963d52b91c95e137c7943cbae",
            "8a00d12207854aedfcacb2497a9e8a735de4b4c42401a071c7f406c7477b6300",
            "451e284298f6cda23805b989e5d7c83727790030ffd7bad0dfda6dd66da0891a",
            "683f5d08770ad6181e1195bff1860f3937f95953a74cf0a296c5d273db432e7d",
        ],
    ),
    (
        "mistral",
        [
            "435185498b7c8236ed3ebe72cf563785d6ea1b706023693f2ed40f3680900bff",
            "22de12b4cffffde5696ffab07fc4f5d518582e7e32e9bb410c4de0a78ce1cf9b",
            "4bea045cf462135b15273e73ca43ecf553c08c246dc557650110bf3791d97a3c",
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
