//! Hop commitments are part of the wire contract: a stage's trace root for a given model and
//! input must never change, whatever kernel, thread count or code path computes it. Any change
//! of bytes fails. The pins are protocol 7's, where the attention context commits as the output
//! projection takes it, quantised, like the MLP's hidden row as the down projection takes it
//! (`Point::Hidden`); the MLP's first products commit through the hidden row, the attention
//! scores through the context, k and v through the cache rows, and every other product's row
//! leaf hashes its f32 outputs. They replaced protocol 6's (the context's f32 rows), which had
//! replaced protocol 5's (the first products' own f32 rows), which had replaced protocol 4's (leaves over the exact accumulators'
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
            "ded40898ec58105235e639d1db0793f292dc18fc3f79d766e926a20694f80249",
            "38f2add93208873e25cf40dfbe0bd3c44ea975d2c85decdbbda910fcc92bbf32",
            "e14ecc2afc52508766ef4df747eb761fdd9984cb0e0e5219287e2a801406a9ff",
            "321d42d7cedef093d8d84c5660018f949fa89e15900647532c5c9a9e6c790e6c",
            "968a7f744fe24b5934c07e5bc8e70a7e7e69627d4a97970ac7adab368a6fbac9",
            "e61fbe61d8204e02fcc55336b41db55fe29e808584df1491ade511e9b8d73d54",
        ],
    ),
    (
        "llama",
        [
            "789f7d20c6bc4f8c57c75761369b83cc27da129d50527e43427cd25799b06bf5",
            "2b9ee69f8dcfa360f493b01b77a8f43e527d0639e704a51e154e16062161abf4",
            "56a4c7d8bbbf7340252f3623812ab127197be14b5ab989906745b16fc4aaf146",
            "0d2d4ea2bb4caea6cd1348042db8adbe49a5a82379555fa9a56c826bd81cc464",
            "e60dac06bc0a6aa9bcdeab06f00b39b6e1a40a1ec3984f7f72d6a6216bccf8c5",
            "f2679e36e527e69de71bf89ddaf99c0ec996a9cc2d71e0a0bf7eaf7e43de658e",
        ],
    ),
    (
        "qwen2",
        [
            "10d5f0926b99a8c601634060cab62eacd1259aaad658225f04b9b22b354a3673",
            "8d38bb367bc8e6a58732da9ecca0f3e8621363b19c8c7b774bfc4270ffe7ae39",
            "f1428b74faddd5b65e0730f17a05490ed754b0ed417fbcfa0ecff88104b5ad97",
            "04552abe50195f0e74fc8f13adce3580054849f05241dc516415465a968410b0",
            "093c424f6524edb98d906a8686a9b8b0ca2df4e77bcf01313568398f424d85f1",
            "f7b3e03874ad30886760372e6002018dcb66f4c981f0f6c4711efe8587d0054e",
        ],
    ),
    (
        "mistral",
        [
            "04aaf1bef149de2988bb793bfecbc714805959c77018923147275d7e1e551176",
            "63636c9efac09c8c0a79155f87f319b7765d2a1e4c8ba8d2d111e4edf8412fd9",
            "7125d65b8095b43bd53a290d45b6732538581920b3b322d71b699ce6e8f04c83",
            "903231cae61767b03fdd476655d9779dd5dddbf38aab33f343f973b21322e7b4",
            "14e1a1f2b023bcd3185ace4a99fb325562ced83ba033ae438e12ba7dd9f8427b",
            "eb69d8a0acb82b980822ea09730efc821ca2d448e91174081a1a0a3e70c0d766",
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
