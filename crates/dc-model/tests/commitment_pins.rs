//! Hop commitments are part of the wire contract: a stage's trace root for a given model and
//! input must never change, whatever kernel, thread count or code path computes it. Any change
//! of bytes fails. The pins are protocol 6's, where the MLP's first products commit through
//! its hidden row as the down projection takes it, quantised (`Point::Hidden`), the attention
//! scores through the context, k and v through the cache rows, and every other product's row
//! leaf hashes its f32 outputs. They replaced protocol 5's (the first products'
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
            "74fbef599c63d37a89634b4fa1583f3a3fcbcd4a722e7011a9b6fa4018c9d05d",
            "0d97445a8d05ffdb9aad2aecf4adb2d18604b90b9cf067e90025c472f8640b94",
            "34ce49768064441b5f401b33e1b80b11b57c23eb643cc31c40907811c578e769",
            "a0154c3fd1fe1cbff57f2b2c848d1d46b7903cbd0c46cb2fd4b573b44ba55c31",
            "eec8640e87b7bd446b10f4fe575321e767e14fd06517d5a7c91a1c7908f8bc19",
            "b30e0a9c2c6420c9f29cd982efd19064588c119bbdabc19dff3ad7c589926199",
        ],
    ),
    (
        "llama",
        [
            "f3d292388bf0caa1be0cf5ddda4053c60ed7cd10e7c2852e6e8caf56c3f00d74",
            "7c3f8a218464474b595f10dcbe265543530eacd08f8f5ba64686e53665b0afeb",
            "709d8d8f14b1d557d9e445d46ea88e614ef9a823e5ab23260249bcd7a0554f23",
            "2873efa043c0e3fd36a1f4d4a07c4219ad3435cc86ea1511f54e5b05386b5365",
            "204b6a6048e96dc049f0721134314e617b09c3d0f3e016d6b3535bf8db9cfa90",
            "24a856f0d4558d19a834e24bef6e22f689916054f658e4b3576382b12b7370f0",
        ],
    ),
    (
        "qwen2",
        [
            "914ad698c7bd99a9121009e09fef26f24c001de12a7105e4414cf7f4389a6ba5",
            "57ff646b644df48286842744d246e39f58fbc4062b4dd4587172f817c7972942",
            "ca3773b664c3c03bc54d5e3017dbff4ae418cf33f928d22d1cdc22709f458d73",
            "523b99e36f97a279d532114d27fdd04b8d90c4ee517043d6ba3371b857a3213f",
            "75deb884cbcee3b1ef71021988a751fbde30752b80d3a4debf8272f765e317bf",
            "35bcc4b8080eb11f5540969cfbabf0d70ed5b5494d5164d71cb958e3b84758e7",
        ],
    ),
    (
        "mistral",
        [
            "3494ffd269f9e72a52bd0e3bf4b7d894d46ae46f249326413f7754a098ec0852",
            "0d78b12fa3ab1356938b277f7064081e77be435bc8753f2525a789bb287e7c11",
            "d4cb343179ad319a551e9de33c6a2b36c1f89ff0ffcdba415341c2ffa35ab7d0",
            "b51a2db62ad399ddc75f43e96b55926998acbc57c0d6f0100f31c01b66463d6d",
            "f2c06fc76460bc463b921b7ac97b16c3198516fc3b88f85829af1c0aeb9bc745",
            "059f278db0fee2540830a58731db11d3ed7c6684d66d987e01b8eb1b4687f5b0",
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
