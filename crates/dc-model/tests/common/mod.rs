//! Shared helpers for the model tests: fixture locations, reading the Hugging Face reference
//! outputs, and the accuracy measures of the fixtures README.

#![allow(clippy::unwrap_used)] // test helpers: a panic is the failure report
#![allow(dead_code)]

use std::path::PathBuf;

use safetensors::SafeTensors;

/// `../shared/fixtures` next to the repository.
pub fn fixtures() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures");
    assert!(p.is_dir(), "shared fixtures not found at {}", p.display());
    p
}

/// The tiny fixture models.
pub const TINY: [&str; 4] = ["gpt2", "llama", "qwen2", "mistral"];

/// Reads an int64 or f32/f16 tensor from a safetensors file.
pub fn read_tensor(file: &std::path::Path, name: &str) -> (Vec<usize>, Vec<f64>) {
    let bytes = std::fs::read(file).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st
        .tensor(name)
        .unwrap_or_else(|_| panic!("{name} in {}", file.display()));
    let data = t.data();
    let v: Vec<f64> = match t.dtype() {
        safetensors::Dtype::I64 => data
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        safetensors::Dtype::F32 => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        safetensors::Dtype::F16 => data
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        d => panic!("unexpected dtype {d:?}"),
    };
    (t.shape().to_vec(), v)
}

/// `(input ids, reference logits row-major N × vocab)` for N in 1, 7, 40.
pub fn expected_logits(model: &str) -> Vec<(Vec<u32>, Vec<f64>)> {
    let f = fixtures().join(model).join("expected_logits.safetensors");
    [1, 7, 40]
        .iter()
        .map(|n| {
            let (_, ids) = read_tensor(&f, &format!("input_ids_{n}"));
            let (_, logits) = read_tensor(&f, &format!("logits_{n}"));
            (ids.iter().map(|&x| x as u32).collect(), logits)
        })
        .collect()
}

fn log_softmax(x: &[f64]) -> Vec<f64> {
    let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let s: f64 = x.iter().map(|v| (v - m).exp()).sum();
    let l = m + s.ln();
    x.iter().map(|v| v - l).collect()
}

/// KL(softmax(reference) ‖ softmax(ours)) of one position.
pub fn kl(reference: &[f64], ours: &[f32]) -> f64 {
    let lp = log_softmax(reference);
    let lq = log_softmax(&ours.iter().map(|&v| v as f64).collect::<Vec<_>>());
    lp.iter().zip(&lq).map(|(p, q)| p.exp() * (p - q)).sum()
}

/// Cosine similarity after subtracting each vector's mean.
pub fn centred_cosine(reference: &[f64], ours: &[f32]) -> f64 {
    let ma = reference.iter().sum::<f64>() / reference.len() as f64;
    let mb = ours.iter().map(|&v| v as f64).sum::<f64>() / ours.len() as f64;
    let (mut ab, mut aa, mut bb) = (0.0, 0.0, 0.0);
    for (a, &b) in reference.iter().zip(ours) {
        let (a, b) = (a - ma, b as f64 - mb);
        ab += a * b;
        aa += a * a;
        bb += b * b;
    }
    ab / (aa.sqrt() * bb.sqrt())
}

/// Index of the largest value (first on ties) and the gap to the runner-up.
pub fn top1_margin(x: &[f64]) -> (usize, f64) {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    let second = x
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != best)
        .map(|(_, &v)| v)
        .fold(f64::NEG_INFINITY, f64::max);
    (best, x[best] - second)
}

/// Argmax of our logits.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

/// Per-fixture tolerances from the fixtures README: (KL mean, KL max, centred cosine, τ).
pub fn tolerance(model: &str) -> (f64, f64, f64, f64) {
    match model {
        "gpt2" => (1.7e-3, 2.0e-3, 0.997, 0.2),
        "llama" => (3.1e-3, 9.0e-3, 0.986, 0.4),
        "qwen2" => (3.9e-3, 7.0e-3, 0.990, 0.3),
        "mistral" => (3.1e-3, 9.0e-3, 0.987, 0.4),
        "smollm2-135m" => (0.07, 0.31, 0.962, 2.5),
        _ => panic!("no tolerance for {model}"),
    }
}

/// Measures one sequence: returns (KL mean, KL max, min centred cosine, top-1 failures where
/// the reference margin is at least τ, positions checked for top-1).
pub fn measure(
    reference: &[f64],
    ours: &[f32],
    vocab: usize,
    tau: f64,
) -> (f64, f64, f64, usize, usize) {
    let n = reference.len() / vocab;
    let (mut kl_sum, mut kl_max, mut cos_min, mut bad, mut gated) = (0.0, 0.0f64, 1.0f64, 0, 0);
    for i in 0..n {
        let r = &reference[i * vocab..(i + 1) * vocab];
        let o = &ours[i * vocab..(i + 1) * vocab];
        let k = kl(r, o);
        kl_sum += k;
        kl_max = kl_max.max(k);
        cos_min = cos_min.min(centred_cosine(r, o));
        let (t, margin) = top1_margin(r);
        if margin >= tau {
            gated += 1;
            if argmax(o) != t {
                bad += 1;
            }
        }
    }
    (kl_sum / n as f64, kl_max, cos_min, bad, gated)
}
