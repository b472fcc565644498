//! Bad checkpoints and bad requests are clear errors naming the file, tensor or value, never
//! panics.

#![allow(clippy::unwrap_used)] // test helpers: a panic is the failure report

mod common;

use std::path::Path;

use common::fixtures;
use dc_kernels::{Gemm, Kernel};
use dc_model::generate::LocalPipeline;
use dc_model::{LoadOptions, Model, ModelError};

/// A copy of a fixture folder in a temporary directory.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures().join(name).join(f), dir.path().join(f)).unwrap();
    }
    dir
}

/// Rewrites `dir`'s `model.safetensors` with tensor `name` replaced by what `f` makes of its
/// shape and bytes: `(dtype, shape, bytes)`.
fn replace_tensor(
    dir: &Path,
    name: &str,
    f: impl FnOnce(&[usize], &[u8]) -> (safetensors::Dtype, Vec<usize>, Vec<u8>),
) {
    let src = dir.join("model.safetensors");
    let bytes = std::fs::read(&src).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let view = st.tensor(name).unwrap();
    let (dtype, shape, data) = f(view.shape(), view.data());
    let mut tensors: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != name)
        .collect();
    let new = safetensors::tensor::TensorView::new(dtype, shape, &data).unwrap();
    tensors.push((name.to_string(), new));
    std::fs::write(&src, safetensors::serialize(tensors, None).unwrap()).unwrap();
}

fn load_err(dir: &Path) -> String {
    match Model::load(dir, &LoadOptions::default()) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
}

#[test]
fn unsupported_architecture_is_named() {
    let d = copy_fixture("llama");
    edit_config(d.path(), |v| {
        v["model_type"] = "falcon".into();
        v["architectures"] = serde_json::json!(["FalconForCausalLM"]);
    });
    let e = load_err(d.path());
    assert!(
        e.contains("unsupported architecture") && e.contains("falcon"),
        "{e}"
    );
}

#[test]
fn misshapen_and_missing_tensors_are_named() {
    let d = copy_fixture("llama");
    edit_config(d.path(), |v| v["intermediate_size"] = 200.into());
    let e = load_err(d.path());
    assert!(
        e.contains("model.layers.0.mlp.gate_proj.weight") && e.contains("[176, 64]"),
        "{e}"
    );

    let d = copy_fixture("llama");
    edit_config(d.path(), |v| v["num_hidden_layers"] = 5.into());
    let e = load_err(d.path());
    assert!(e.contains("missing tensor model.layers.4"), "{e}");

    let d = copy_fixture("llama");
    edit_config(d.path(), |v| v["tie_word_embeddings"] = true.into());
    // Tied: lm_head.weight is ignored, the model still loads.
    assert!(Model::load(d.path(), &LoadOptions::default()).is_ok());
}

#[test]
fn truncated_and_corrupt_safetensors_are_refused() {
    let d = copy_fixture("gpt2");
    let f = d.path().join("model.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    for cut in [0, 7, 8, 100, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&f, &bytes[..cut]).unwrap();
        let e = load_err(d.path());
        assert!(e.contains("model.safetensors"), "cut at {cut}: {e}");
    }
    let mut bad = bytes.clone();
    bad[8..16].copy_from_slice(b"{garbage");
    std::fs::write(&f, &bad).unwrap();
    assert!(load_err(d.path()).contains("not a valid safetensors file"));
    // A huge header length.
    let mut bad = bytes.clone();
    bad[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&f, &bad).unwrap();
    assert!(load_err(d.path()).contains("model.safetensors"));
}

#[test]
fn unknown_dtype_is_named() {
    // A safetensors file with one int32 tensor where a float is expected.
    let d = copy_fixture("gpt2");
    replace_tensor(d.path(), "transformer.ln_f.weight", |shape, data| {
        (safetensors::Dtype::I32, shape.to_vec(), data.to_vec())
    });
    let e = load_err(d.path());
    assert!(
        e.contains("I32") && e.contains("transformer.ln_f.weight"),
        "{e}"
    );
}

#[test]
fn non_finite_weights_are_refused() {
    let d = copy_fixture("gpt2");
    replace_tensor(
        d.path(),
        "transformer.h.1.mlp.c_fc.weight",
        |shape, data| {
            let mut data = data.to_vec();
            data[40..44].copy_from_slice(&f32::NAN.to_le_bytes());
            (safetensors::Dtype::F32, shape.to_vec(), data)
        },
    );
    let e = load_err(d.path());
    assert!(
        e.contains("transformer.h.1.mlp.c_fc.weight") && e.contains("non-finite"),
        "{e}"
    );
}

#[test]
fn a_non_finite_embedding_kept_as_stored_is_refused_when_its_token_comes() {
    // Llama's untied embedding as bf16 (kept as stored, converted a row per token), with a
    // NaN in token 5's row: the model loads, token 5 is refused by name, the others embed.
    let d = copy_fixture("llama");
    replace_tensor(d.path(), "model.embed_tokens.weight", |shape, data| {
        let mut halves: Vec<u8> = data
            .chunks_exact(4)
            .flat_map(|c| {
                half::bf16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]])).to_le_bytes()
            })
            .collect();
        let at = (5 * shape[1] + 3) * 2;
        halves[at..at + 2].copy_from_slice(&half::bf16::NAN.to_le_bytes());
        (safetensors::Dtype::BF16, shape.to_vec(), halves)
    });
    let model = Model::load(d.path(), &LoadOptions::default()).unwrap();
    let e = model.embed(&[4, 5], 0).unwrap_err().to_string();
    assert!(e.contains("token 5") && e.contains("non-finite"), "{e}");
    assert_eq!(model.embed(&[4, 6], 0).unwrap().rows(), 2);
}

#[test]
fn bad_requests_are_errors() {
    let model = Model::load(&fixtures().join("llama"), &LoadOptions::default()).unwrap();
    let gemm = Gemm::new(Kernel::best(), 1).unwrap();
    let mut p = LocalPipeline::new(&model, 2).unwrap();
    let e = p.forward(&gemm, &[1, 2, 512], false).unwrap_err();
    assert!(
        e.to_string().contains("token id 512 is out of range"),
        "{e}"
    );
    let long: Vec<u32> = vec![1; 129];
    let e = LocalPipeline::new(&model, 1)
        .unwrap()
        .forward(&gemm, &long, false)
        .unwrap_err();
    assert!(
        e.to_string().contains("exceed the model's 128 positions"),
        "{e}"
    );
    assert!(
        LocalPipeline::new(&model, 5).is_err(),
        "5 stages of 4 layers"
    );
    // Activations with NaN at a stage boundary name the stage and the layer.
    let mut cache = dc_model::KvCache::new(&model.config, 2..4);
    let mut x = model.embed(&[1, 2, 3], 0).unwrap();
    x.data[70] = f32::NAN;
    match model.run_layers(&gemm, x, &mut cache) {
        Err(ModelError::NonFinite {
            stage,
            layer,
            detail,
        }) => {
            assert_eq!(stage, "layers 2..4");
            assert!(layer.contains('2'), "{layer}");
            assert!(detail.contains("position 1, channel 6"), "{detail}");
        }
        other => panic!("expected NonFinite, got {other:?}"),
    }
    // Wrong width and wrong start position.
    let x = dc_model::Activations {
        start: 0,
        hidden: 63,
        data: vec![0.0; 63],
    };
    assert!(model
        .run_layers(&gemm, x, &mut dc_model::KvCache::new(&model.config, 0..1))
        .is_err());
    let x = dc_model::Activations {
        start: 5,
        hidden: 64,
        data: vec![0.0; 64],
    };
    let e = model
        .run_layers(&gemm, x, &mut dc_model::KvCache::new(&model.config, 0..1))
        .unwrap_err();
    assert!(e.to_string().contains("start at position 5"), "{e}");
}
