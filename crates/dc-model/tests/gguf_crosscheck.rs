//! Dequantisation checked bit for bit against an independent implementation: gguf-py's
//! numpy code (`gguf.quants.dequantize`) plus the reference Q/K un-permutation, whose outputs
//! `tests/data/make_gguf_expected.py` (a dev-only tool; tests need no Python) stored as f32
//! bit patterns and blake3 hashes.
//!
//! - `gguf_dtypes.gguf`: seeded random blocks of F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K
//!   Q6_K, written by gguf-py's `GGUFWriter`.
//! - the installed SmolLM2-135M Q4_1 GGUF: a handful of real tensors (Q8_0 embedding, Q4_1
//!   projections including the un-permuted Q and K, F32 norms).

use std::path::{Path, PathBuf};

use dc_model::gguf::GgufFile;
use dc_model::TensorSource;
use serde_json::Value as Json;

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

fn expected(file: &str) -> serde_json::Map<String, Json> {
    let text = std::fs::read_to_string(data_dir().join(file)).expect("expected-values file");
    match serde_json::from_str(&text).expect("valid JSON") {
        Json::Object(m) => m,
        other => panic!("{file}: not an object: {other}"),
    }
}

fn u32s(v: &Json) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("u32") as u32)
        .collect()
}

/// Compares every tensor listed in `expected` with what `g` loads; returns the types seen.
fn check(g: &GgufFile, expected: &serde_json::Map<String, Json>) -> Vec<String> {
    let mut types = Vec::new();
    for (name, e) in expected {
        let info = g.info(name).unwrap_or_else(|| panic!("{name} not listed"));
        let shape: Vec<usize> = e["shape"]
            .as_array()
            .expect("shape")
            .iter()
            .map(|x| x.as_u64().expect("dim") as usize)
            .collect();
        assert_eq!(info.shape, shape, "{name}: shape");
        let gguf = g.gguf_tensor(name).expect("GGUF entry");
        assert_eq!(gguf.name, e["gguf_name"].as_str().expect("gguf_name"));
        let ty = e["ggml_type"].as_str().expect("type");
        assert_eq!(gguf.ggml_type.to_string(), ty, "{name}: GGML type");
        types.push(ty.to_string());

        let v = g
            .load_f32(name)
            .unwrap_or_else(|err| panic!("{name}: {err}"));
        assert_eq!(v.len(), info.numel(), "{name}: element count");
        let head: Vec<u32> = v.iter().take(64).map(|x| x.to_bits()).collect();
        assert_eq!(head, u32s(&e["head_bits"]), "{name}: first 64 values");
        let idx = e["sample_index"].as_array().expect("sample_index");
        let samples: Vec<u32> = idx
            .iter()
            .map(|i| v[i.as_u64().expect("index") as usize].to_bits())
            .collect();
        assert_eq!(samples, u32s(&e["sample_bits"]), "{name}: sampled values");
        let mut h = blake3::Hasher::new();
        for x in &v {
            h.update(&x.to_le_bytes());
        }
        assert_eq!(
            h.finalize().to_hex().as_str(),
            e["blake3_f32le"].as_str().expect("hash"),
            "{name}: blake3 of all values"
        );
    }
    types
}

#[test]
fn every_dtype_matches_gguf_py_bit_for_bit() {
    let g = GgufFile::open(&data_dir().join("gguf_dtypes.gguf")).expect("open test file");
    let exp = expected("gguf_dtypes_expected.json");
    assert_eq!(
        exp.len(),
        g.tensors().len(),
        "every tensor has expected values"
    );
    let mut types = check(&g, &exp);
    types.sort();
    types.dedup();
    assert_eq!(
        types,
        ["BF16", "F16", "F32", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"]
    );
}

/// The installed SmolLM2; a missing model is a failure, not a skip.
pub fn smollm2() -> PathBuf {
    dc_model::store::installed_smollm2().unwrap_or_else(|| {
        panic!(
            "SmolLM2-135M GGUF not installed (looked in {:?}): run scripts/fetch-model.sh",
            dc_model::store::data_dir().ok()
        )
    })
}

#[test]
fn smollm2_tensors_match_gguf_py_bit_for_bit() {
    let g = GgufFile::open(&smollm2()).expect("open SmolLM2");
    let exp = expected("smollm2_expected.json");
    assert!(exp.len() >= 8);
    let types = check(&g, &exp);
    assert!(types.iter().any(|t| t == "Q8_0"));
    assert!(types.iter().any(|t| t == "Q4_1"));
    assert!(types.iter().any(|t| t == "F32"));
}
