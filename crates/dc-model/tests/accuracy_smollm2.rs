//! Accuracy of the real SmolLM2-135M (the GGUF that `scripts/fetch-model.sh` installs) against
//! Hugging Face fp32 on the fixture texts: mean KL ≤ 0.006, same top-1 on ≥ 93 % of positions,
//! perplexity within 2 % of the reference (fixtures README). These reference outputs were made
//! by `transformers` on the same dequantised weights.

#![allow(clippy::unwrap_used)] // test helpers: a panic is the failure report

mod common;

use common::*;
use dc_kernels::{Gemm, Kernel};
use dc_model::generate::LocalPipeline;
use dc_model::tokenizer::load_for_model;
use dc_model::{store, LoadOptions, Model};

fn smollm2() -> std::path::PathBuf {
    store::installed_smollm2().expect("SmolLM2-135M is not installed: run scripts/fetch-model.sh")
}

#[test]
fn text_fixture_kl_top1_and_perplexity() {
    let path = smollm2();
    let model = Model::load(&path, &LoadOptions::default()).unwrap();
    let (tok, _, _) = load_for_model(&path).unwrap();
    let dir = fixtures().join("smollm2-135m/text");
    let text = std::fs::read_to_string(dir.join("text.txt")).unwrap();
    let ids = tok.encode(text.trim(), false).unwrap();
    let f = dir.join("reference_logits.safetensors");
    let (_, ref_ids) = read_tensor(&f, "input_ids");
    assert_eq!(
        ids,
        ref_ids.iter().map(|&x| x as u32).collect::<Vec<_>>(),
        "tokenizer"
    );
    let (shape, reference) = read_tensor(&f, "logits");
    let vocab = shape[1];
    let gemm = Gemm::new(Kernel::best(), 2).unwrap();
    let ours = LocalPipeline::new(&model, 1)
        .unwrap()
        .prefill_all(&gemm, &ids, 64)
        .unwrap();
    let n = ids.len();
    // With τ = 0 every position is gated, so the gated misses are all top-1 disagreements.
    let (kl_mean, kl_max, cos_min, misses, _) = measure(&reference, &ours, vocab, 0.0);
    let top1 = (n - misses) as f64 / n as f64;
    let nll: f64 = (0..n - 1)
        .map(|i| {
            let o = &ours[i * vocab..(i + 1) * vocab];
            dc_kernels::elementwise::log_sum_exp(o) - o[ids[i + 1] as usize] as f64
        })
        .sum();
    let ppl = (nll / (n - 1) as f64).exp();
    let reference_ppl = 26.007338923632464;
    eprintln!(
        "SmolLM2 text ({n} tokens): mean KL {kl_mean:.5}, max KL {kl_max:.4}, min centred cosine {cos_min:.4}, same top-1 {:.1} %, perplexity {ppl:.3} (reference {reference_ppl:.3}, {:+.2} %)",
        100.0 * top1,
        100.0 * (ppl / reference_ppl - 1.0)
    );
    assert!(kl_mean <= 0.006, "mean KL {kl_mean}");
    assert!(kl_max <= 0.15, "max KL {kl_max}");
    assert!(cos_min >= 0.985, "centred cosine {cos_min}");
    assert!(top1 >= 0.93, "same top-1 {top1}");
    assert!(
        (ppl / reference_ppl - 1.0).abs() <= 0.02,
        "perplexity {ppl}"
    );
}

#[test]
fn prompt_fixtures_within_tolerance() {
    let path = smollm2();
    let model = Model::load(&path, &LoadOptions::default()).unwrap();
    let gemm = Gemm::new(Kernel::best(), 2).unwrap();
    let dir = fixtures().join("smollm2-135m");
    let gen: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("expected_generation.json")).unwrap(),
    )
    .unwrap();
    let f = dir.join("expected_logits.safetensors");
    let st_bytes = std::fs::read(&f).unwrap();
    let names: Vec<String> = safetensors::SafeTensors::deserialize(&st_bytes)
        .unwrap()
        .names()
        .into_iter()
        .map(|s| s.to_string())
        .collect();
    let (kl_mean_max, kl_any_max, cos_min, tau) = tolerance("smollm2-135m");
    let mut checked = 0;
    for case in gen["cases"].as_array().unwrap() {
        let prompt: Vec<u32> = case["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let n = prompt.len();
        let name = names
            .iter()
            .find(|s| s.starts_with("logits") && s.ends_with(&format!("_{n}")))
            .unwrap_or_else(|| panic!("no logits for N={n} in {names:?}"));
        let (shape, reference) = read_tensor(&f, name);
        let vocab = shape[shape.len() - 1];
        let ours = LocalPipeline::new(&model, 3)
            .unwrap()
            .prefill_all(&gemm, &prompt, 4)
            .unwrap();
        let (kl_mean, kl_max, cos, bad, gated) = measure(&reference, &ours, vocab, tau);
        eprintln!("SmolLM2 prompt N={n}: KL mean {kl_mean:.4} max {kl_max:.4}, cosine ≥ {cos:.4}, top-1 misses {bad}/{gated}");
        assert!(kl_mean <= kl_mean_max && kl_max <= kl_any_max && cos >= cos_min && bad == 0);
        checked += 1;
    }
    assert_eq!(checked, 2);
}
