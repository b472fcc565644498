//! Accuracy against Hugging Face fp32 on the tiny fixture models (tolerances from the fixtures
//! README, applied per sequence). These outputs were made by `transformers`, not by us.

#![allow(clippy::unwrap_used)] // test helpers: a panic is the failure report

mod common;

use common::*;
use dc_kernels::{Gemm, Kernel};
use dc_model::generate::LocalPipeline;
use dc_model::{LoadOptions, Model};

fn check(model_name: &str) {
    let dir = fixtures().join(model_name);
    let model = Model::load(&dir, &LoadOptions::default()).unwrap();
    let gemm = Gemm::new(Kernel::best(), 2).unwrap();
    let vocab = model.config.vocab_size;
    let (kl_mean_max, kl_any_max, cos_min, tau) = tolerance(model_name);
    for (ids, reference) in expected_logits(model_name) {
        let mut p = LocalPipeline::new(&model, 1).unwrap();
        let ours = p.prefill_all(&gemm, &ids, 64).unwrap();
        let (kl_mean, kl_max, cos, bad, gated) = measure(&reference, &ours, vocab, tau);
        eprintln!("{model_name} N={}: KL mean {kl_mean:.2e} max {kl_max:.2e}, centred cosine ≥ {cos:.5}, top-1 misses {bad}/{gated}", ids.len());
        assert!(
            kl_mean <= kl_mean_max,
            "{model_name} N={}: mean KL {kl_mean}",
            ids.len()
        );
        assert!(
            kl_max <= kl_any_max,
            "{model_name} N={}: max KL {kl_max}",
            ids.len()
        );
        assert!(
            cos >= cos_min,
            "{model_name} N={}: centred cosine {cos}",
            ids.len()
        );
        assert_eq!(
            bad,
            0,
            "{model_name} N={}: top-1 differs where the margin is ≥ {tau}",
            ids.len()
        );
    }
    // Teacher-forced on the greedy continuation HF produced.
    let gen: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("expected_generation.json")).unwrap(),
    )
    .unwrap();
    let full: Vec<u32> = gen["full_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let generated: Vec<u32> = gen["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let margins: Vec<f64> = gen["generated_top1_margins"]
        .as_array()
        .map(|a| a.iter().map(|v| v.as_f64().unwrap()).collect())
        .unwrap_or_default();
    let prompt_len = full.len() - generated.len();
    let mut p = LocalPipeline::new(&model, 1).unwrap();
    let ours = p.prefill_all(&gemm, &full, 64).unwrap();
    let mut checked = 0;
    for (s, &want) in generated.iter().enumerate() {
        let pos = prompt_len - 1 + s;
        let margin = margins.get(s).copied().unwrap_or(f64::INFINITY);
        if margin >= tau {
            checked += 1;
            assert_eq!(
                argmax(&ours[pos * vocab..(pos + 1) * vocab]) as u32,
                want,
                "{model_name}: step {s} (margin {margin})"
            );
        }
    }
    eprintln!(
        "{model_name}: {checked}/{} teacher-forced greedy steps checked",
        generated.len()
    );
}

#[test]
fn gpt2_matches_transformers() {
    check("gpt2");
}

#[test]
fn llama_matches_transformers() {
    check("llama");
}

#[test]
fn qwen2_matches_transformers() {
    check("qwen2");
}

#[test]
fn mistral_matches_transformers() {
    check("mistral");
}
