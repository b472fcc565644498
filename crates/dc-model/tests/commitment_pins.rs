//! Hop commitments are part of the wire contract: a stage's trace root for a given model and
//! input must never change, whatever kernel, thread count or code path computes it. Any change
//! of bytes fails. The pins are protocol 5's, where a product's row leaf hashes its f32
//! outputs (they replaced protocol 4's, whose leaves hashed the exact accumulators' encodings;
//! those, for the traces without `KvCache` entries, had been computed by the original
//! byte-by-byte commitment code, and adding the cache entries had changed no other one).

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
            "bed28e46a2e933367cb308f65c938e345b5690e9239d833cd400d73f8f14668c",
            "6cbbaeb97848cd5d106dfcfc4ccb2abee55c429287e65c0d28ce4463d9118d2a",
            "e380c81ed006005627259886f9bb4aba0af4c827b2718f1e917ccf6b76921ffb",
            "b4847bcefcceec59cf0bdac3d1f58d9f71395c9721259bb90939388dea0048a3",
            "8f93d323768d709c064c6466806fd537eaeceef658d82a928ab5921d9959d2c6",
            "2232d43bf8474cfd75d98993df15c01b6bde659eea1ec9acc4cece941e9b2e09",
        ],
    ),
    (
        "llama",
        [
            "3cd9ea38d966946d65340aaecbad6a4cfc8855cb4170eb3c011b60f4212adb6b",
            "5fb7256eb5d03ca76c3a71b73bcc10cd863565576b8c76af1aad411108b9da06",
            "fc5d731ff0c3ae8660d0816ad027f03e454ac0e03be0481fbd52ece3d985fc1b",
            "62410fdb2b49681770e205b42bbbf0a52dd39b3c83a1d14c08b6a201e17bed24",
            "9d226ceac87e9a35d4f2c19e9083c473390b0460f3b2b73bea6c202deb879c67",
            "fcad8065a04186f7ecd933d498e8a096f8511524b56a45638a4da475013d05d5",
        ],
    ),
    (
        "qwen2",
        [
            "36a8b3f5685ff7ee84a3126bf0b1e45db5d7ee058bec95d6e81ad5ef9d26e5e7",
            "c876386e5582e0713f9c46d0101aee2ac7746fb9e5f7d607d685e682e8500cc8",
            "cfb0b083690a8ec780fc609396e29113a2fdcc7dbca03f043f2182605740ed60",
            "c6581ffeaa19d58742948998c49f07f1547e16d60ab7cd7a89288329947fee35",
            "6e5df306b68cb98eb07891992d4042db190017f30c0e732274ba1fc86d3b331c",
            "624970f2ec99c65ce05c82295b872956548dfcdc777426a2cfc7cc9d34f3010b",
        ],
    ),
    (
        "mistral",
        [
            "adbe39fa1a7e35952426d8175d4ab8c25a3b8e0cabbf3cd10b10225b6d85c202",
            "a0b5a66e91ebba62e9e4b379abdc5820dc97ab933a28c886cbb6e352a86ee788",
            "eb9df902d82a36cc79d6e991ac0f0d391ebaf2da429633ff566e7e8d9d826ac6",
            "f042a7dc90fccff3ef48964c25b5527c0c6d167212369a14287bd1e6d86903fe",
            "5f89702a32aa65bd83ae144327426208815c2484e6b8eedda53b3953f8cbddad",
            "b4b1bf8d5d772abd34e3b97618b97b78c86f9f88b43a15631ea6ef6c103322f5",
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
