//! Choosing the next token at the head: greedy, temperature, top-k, top-p, with one seeded
//! uniform draw per absolute position.
//!
//! Everything here is deterministic on every machine (f64 arithmetic in a fixed order, `libm`
//! for `exp`), so any peer can replay a choice from the logits, the settings and the position.
//! The draw at position p depends only on (seed, p): a longer or shorter draft never moves a
//! later draw.

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// How to choose tokens.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy (argmax, lowest id on ties).
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 or none: all).
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches p.
    pub top_p: Option<f32>,
    /// Seed of the per-position draws.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Checks the settings, naming the bad one.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && (0.0..=100.0).contains(&self.temperature)) {
            return Err(ModelError::Input(format!(
                "temperature {} must be between 0 and 100",
                self.temperature
            )));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(ModelError::Input(format!("top_p {p} must be in (0, 1]")));
            }
        }
        Ok(())
    }
}

/// SplitMix64's finaliser: a good 64-bit mix.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The uniform draw in `[0, 1)` for absolute position `pos` under `seed`.
pub fn draw(seed: u64, pos: usize) -> f64 {
    let z = mix(mix(seed ^ 0x6a09_e667_f3bc_c909)
        .wrapping_add((pos as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)));
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// Chooses the token at absolute position `pos` from one row of logits.
pub fn sample(logits: &[f32], params: &SamplingParams, pos: usize) -> Result<u32> {
    if logits.is_empty() {
        return Err(ModelError::Input("no logits to sample from".into()));
    }
    if let Some(i) = logits.iter().position(|v| !v.is_finite()) {
        return Err(ModelError::Input(format!("logit {i} is {}", logits[i])));
    }
    if params.temperature == 0.0 {
        // First index of the maximum.
        let mut best = 0;
        for (i, &v) in logits.iter().enumerate() {
            if v > logits[best] {
                best = i;
            }
        }
        return Ok(best as u32);
    }
    // Candidates, most likely first; ties by lower id, so the order is total.
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    idx.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    if let Some(k) = params.top_k.filter(|&k| k > 0) {
        idx.truncate(k.min(idx.len()));
    }
    let t = params.temperature as f64;
    let top = logits[idx[0] as usize] as f64;
    let weights: Vec<f64> = idx
        .iter()
        .map(|&i| libm::exp((logits[i as usize] as f64 - top) / t))
        .collect();
    let mut total = 0f64;
    for w in &weights {
        total += w;
    }
    let mut keep = weights.len();
    if let Some(p) = params.top_p {
        let mut acc = 0f64;
        for (i, w) in weights.iter().enumerate() {
            acc += w;
            if acc / total >= p as f64 {
                keep = i + 1;
                break;
            }
        }
    }
    let mut kept_total = 0f64;
    for w in &weights[..keep] {
        kept_total += w;
    }
    let target = draw(params.seed, pos) * kept_total;
    let mut acc = 0f64;
    for (i, w) in weights[..keep].iter().enumerate() {
        acc += w;
        if target < acc {
            return Ok(idx[i]);
        }
    }
    Ok(idx[keep - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        let p = SamplingParams::default();
        assert_eq!(sample(&[0.1, 3.0, 3.0, -1.0], &p, 0).unwrap(), 1);
    }

    #[test]
    fn draws_depend_only_on_seed_and_position() {
        assert_eq!(draw(7, 100), draw(7, 100));
        assert_ne!(draw(7, 100), draw(7, 101));
        assert_ne!(draw(7, 100), draw(8, 100));
        let u: Vec<f64> = (0..1000).map(|p| draw(1, p)).collect();
        let mean = u.iter().sum::<f64>() / 1000.0;
        assert!((mean - 0.5).abs() < 0.05, "{mean}");
        assert!(u.iter().all(|&x| (0.0..1.0).contains(&x)));
    }

    #[test]
    fn top_k_and_top_p_restrict_the_choice() {
        let logits = [5.0f32, 4.0, 3.0, -10.0, 4.5];
        for pos in 0..200 {
            let p = SamplingParams {
                temperature: 1.0,
                top_k: Some(2),
                top_p: None,
                seed: 3,
            };
            let t = sample(&logits, &p, pos).unwrap();
            assert!(t == 0 || t == 4, "{t}");
            let p = SamplingParams {
                temperature: 1.0,
                top_k: None,
                top_p: Some(0.01),
                seed: 3,
            };
            assert_eq!(sample(&logits, &p, pos).unwrap(), 0);
        }
    }

    #[test]
    fn bad_settings_are_named() {
        let p = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        };
        assert!(p
            .validate()
            .unwrap_err()
            .to_string()
            .contains("temperature"));
        let p = SamplingParams {
            top_p: Some(1.5),
            ..Default::default()
        };
        assert!(p.validate().unwrap_err().to_string().contains("top_p"));
        assert!(sample(&[f32::NAN], &SamplingParams::default(), 0).is_err());
    }
}
