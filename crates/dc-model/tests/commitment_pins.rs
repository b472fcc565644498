//! Hop commitments are part of the wire contract: a stage's trace root for a given model and
//! input must never change, whatever kernel, thread count or code path computes it. Any change
//! of bytes fails. The pins are protocol 6's, where the MLP's first products commit through
//! its hidden row as the down projection takes it, quantised (`Point::Hidden`), the attention
//! scores through the context, and every other product's row leaf hashes its f32 outputs. They replaced protocol 5's (the first products'
//! own f32 rows), which had replaced protocol 4's (leaves over the exact accumulators'
//! encodings; those, for the traces without `KvCache` entries, had been computed by the
//! original byte-by-byte commitment code, and adding the cache entries had changed no other
//! one).

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
            "33838ba805209bf536c9189858904f8cbe33bf7849f2f6bcb43171ce27bcf202",
            "f3af960f77e843299be18ae0c80acee621be8b46c2d91769e2d101615b5c5b93",
            "4ef92f569d3c38ab192ac499ebfdcfce831b8b5b35b8ce366b7178d1d6522336",
            "1418b9703c7d91bf1bf9a5dbcff054645507bcdf2cb66fe8d73b81027c2a37bc",
            "b2335375daea139d6f55fdb8c79acf3e1fede9aa1902a2a5c59968f2ea3ad230",
            "a9162e6c2e2ae9ef346e4c93a8706732eafc009a2aded3b5a1cd3474455f6eb9",
        ],
    ),
    (
        "llama",
        [
            "4a4de05d737a168884d1be97a1c751d19d0aa0b29fc4c4a17c6fb2b5779d0dc0",
            "64a4f934a1a8cbfa9ed10a9735b1c898f2e8b69a156c302f6e374831e29411da",
            "d75d5b5dca3c31cbe717d00a9ff6045f34e968325df9afb3660e76145fad0527",
            "642b92365490a0597b33600b3f552912994a3e7d4f2ddcdd25e5af3c644961f7",
            "2ce4ae0154bc717e4bc7418f6aa87d4d82f243143a844d65d2c71b8eaeef310d",
            "245908558af9e5998bd34c8e9ddbc8f77f0e98f94c7fb69345f83c9684588340",
        ],
    ),
    (
        "qwen2",
        [
            "0343563433a3e728114cab3debbc90170657cbc77ee8cb840f16d0ca2d91ad1a",
            "48f6d48987e28a980cf6e3ec168d781b03102785877736ffbbf13562b017cc0b",
            "b5cd41011d671a5cd6b52f86ee16a0d5653cdfb5a735e7ccac06297dc0a83157",
            "0ed575bcba3b3fbe58bd2ce6ed2244418e6a401072514455cabd34b9196591cc",
            "e9608a909e1abea893dd0f0f4b331ec6aabab74a478f196e88eaa45afc21e7d7",
            "ee609d1b5bed09f061a23f4884b626ab76e7b37e56dd2a03fa9a34ce5acb37df",
        ],
    ),
    (
        "mistral",
        [
            "18489f78c36c044d83e284fb212487136cd6c806336dc9d8b7fe505f0d4c5a39",
            "8dd5d76e529a0b7bb6cfa2849929564a532d5a34ea7cf9b78d4a6079ee351328",
            "8caa450dff541a4a51b875b9885a11347857afe431fac01833358848c029f77e",
            "2fc51ddd19baeaa0fd673ac78e42ed766fd4cd2f2bf7bdf1113044b92018f2ea",
            "228bea349d75e87178422d41b76a7d44f7acf39311bfc3247d52ede0da4c1b68",
            "50ef53d4b3a963e152fe661fdb06a5ff1f8b96cbf79af2504b3b5f4fcdfcf64d",
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
