//! Choosing the next token at the head: penalties on tokens seen before, then greedy or
//! temperature with top-k, top-p and min-p, with one seeded uniform draw per absolute position.
//!
//! Everything here is deterministic on every machine (f32 penalties applied token by token,
//! f64 arithmetic in a fixed order, `libm` for `exp`), so any peer can replay a choice from the
//! logits, the settings, the tokens so far and the position. The draw at position p depends
//! only on (seed, p): a longer or shorter draft never moves a later draw.

use dc_types::{TokenLogprobs, WireSampling};
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
    /// Keep only the tokens at least `min_p` times as likely as the most likely one.
    pub min_p: Option<f32>,
    /// Penalties on the tokens seen before (they apply to greedy decoding too).
    pub penalties: Penalties,
    /// Seed of the per-position draws.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            min_p: None,
            penalties: Penalties::default(),
            seed: 0,
        }
    }
}

/// Penalties on the logits of tokens that appeared before the position being sampled.
///
/// For a token j, with `seen` whether j is in the prompt or the new tokens and `count` how
/// often it is among the new tokens, the logit l becomes (in f32, in this order)
/// `l / repetition` if l > 0 or `l * repetition` otherwise (when `seen`; the CTRL penalty
/// Hugging Face's `repetition_penalty` and llama.cpp's `repeat_penalty` apply), then
/// `l - count * frequency - presence` (when count > 0; OpenAI's definition).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Penalties {
    /// Over the prompt and the new tokens; 1: off.
    pub repetition: f32,
    /// Subtracted once from every token already generated; 0: off.
    pub presence: f32,
    /// Subtracted per earlier occurrence among the generated tokens; 0: off.
    pub frequency: f32,
}

impl Default for Penalties {
    fn default() -> Self {
        Penalties {
            repetition: 1.0,
            presence: 0.0,
            frequency: 0.0,
        }
    }
}

impl Penalties {
    /// Whether these penalties change nothing.
    pub fn is_off(&self) -> bool {
        *self == Penalties::default()
    }

    /// Applies the penalties to `logits` for a position after `prompt` and `generated`.
    /// Token ids beyond the vocabulary are ignored.
    pub fn apply(&self, logits: &mut [f32], prompt: &[u32], generated: &[u32]) {
        if self.is_off() {
            return;
        }
        // Per token: 0 unseen, 1 seen in the prompt only, 2 + n generated n times. Each
        // token's logit changes on its own, so the order of the loop cannot matter.
        let mut state = vec![0u32; logits.len()];
        for &t in prompt {
            if let Some(s) = state.get_mut(t as usize) {
                *s = (*s).max(1);
            }
        }
        for &t in generated {
            if let Some(s) = state.get_mut(t as usize) {
                *s = if *s < 2 { 3 } else { *s + 1 };
            }
        }
        for (l, &s) in logits.iter_mut().zip(&state) {
            if s == 0 {
                continue;
            }
            if self.repetition != 1.0 {
                *l = if *l > 0.0 {
                    *l / self.repetition
                } else {
                    *l * self.repetition
                };
            }
            if s >= 2 {
                *l = *l - (s - 2) as f32 * self.frequency - self.presence;
            }
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
        if let Some(p) = self.min_p {
            if !(0.0..=1.0).contains(&p) {
                return Err(ModelError::Input(format!("min_p {p} must be in [0, 1]")));
            }
        }
        let r = self.penalties.repetition;
        if !(r > 0.0 && r <= 10.0) {
            return Err(ModelError::Input(format!(
                "repetition_penalty {r} must be in (0, 10]"
            )));
        }
        for (name, v) in [
            ("presence_penalty", self.penalties.presence),
            ("frequency_penalty", self.penalties.frequency),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(ModelError::Input(format!(
                    "{name} {v} must be between -2 and 2"
                )));
            }
        }
        Ok(())
    }

    /// The settings a generation request carries over the wire.
    pub fn to_wire(&self) -> WireSampling {
        WireSampling {
            temperature: self.temperature,
            top_k: self.top_k.map_or(0, |k| k.min(u32::MAX as usize) as u32),
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.penalties.repetition,
            presence_penalty: self.penalties.presence,
            frequency_penalty: self.penalties.frequency,
            seed: self.seed,
        }
    }

    /// The settings of a request received over the wire (check them with
    /// [`SamplingParams::validate`]).
    pub fn from_wire(w: &WireSampling) -> SamplingParams {
        SamplingParams {
            temperature: w.temperature,
            top_k: (w.top_k > 0).then_some(w.top_k as usize),
            top_p: (w.top_p < 1.0).then_some(w.top_p),
            min_p: (w.min_p > 0.0).then_some(w.min_p),
            penalties: Penalties {
                repetition: w.repetition_penalty,
                presence: w.presence_penalty,
                frequency: w.frequency_penalty,
            },
            seed: w.seed,
        }
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

/// The log-probabilities of `chosen` and of the `top` most likely tokens in one row of
/// logits: the log-softmax in f64, summed in index order (`libm`), so every peer gets the
/// same values.
pub fn logprobs(logits: &[f32], chosen: u32, top: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut sum = 0f64;
    for &l in logits {
        sum += libm::exp(l as f64 - max);
    }
    let lse = max + libm::log(sum);
    let lp = |i: u32| {
        logits
            .get(i as usize)
            .map_or(f32::NEG_INFINITY, |&l| (l as f64 - lse) as f32)
    };
    // The `top` best by (logit descending, id ascending), kept sorted while scanning.
    let mut best: Vec<u32> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &l) in logits.iter().enumerate() {
            let at = best.partition_point(|&b| logits[b as usize] >= l);
            if at < top {
                best.insert(at, i as u32);
                best.truncate(top);
            }
        }
    }
    TokenLogprobs {
        logprob: lp(chosen),
        top: best.into_iter().map(|i| (i, lp(i))).collect(),
    }
}

/// Chooses the token at absolute position `pos` from one row of logits, after `prompt` and
/// the new tokens `generated` (the penalties' history).
pub fn sample_after(
    logits: &[f32],
    params: &SamplingParams,
    pos: usize,
    prompt: &[u32],
    generated: &[u32],
) -> Result<u32> {
    sample_constrained(logits, params, pos, prompt, generated, None)
}

/// Like [`sample_after`], among the tokens `allowed` marks only (all when `None`): the others
/// are removed before anything else, as if the vocabulary had only the allowed ones.
pub fn sample_constrained(
    logits: &[f32],
    params: &SamplingParams,
    pos: usize,
    prompt: &[u32],
    generated: &[u32],
    allowed: Option<&[bool]>,
) -> Result<u32> {
    if params.penalties.is_off() {
        return sample_among(logits, params, pos, allowed);
    }
    let mut penalised = logits.to_vec();
    params.penalties.apply(&mut penalised, prompt, generated);
    sample_among(&penalised, params, pos, allowed)
}

/// Chooses the token at absolute position `pos` from one row of logits (penalties are not
/// applied: see [`sample_after`]).
pub fn sample(logits: &[f32], params: &SamplingParams, pos: usize) -> Result<u32> {
    sample_among(logits, params, pos, None)
}

fn sample_among(
    logits: &[f32],
    params: &SamplingParams,
    pos: usize,
    allowed: Option<&[bool]>,
) -> Result<u32> {
    if logits.is_empty() {
        return Err(ModelError::Input("no logits to sample from".into()));
    }
    if let Some(i) = logits.iter().position(|v| !v.is_finite()) {
        return Err(ModelError::Input(format!("logit {i} is {}", logits[i])));
    }
    let ok = |i: usize| allowed.is_none_or(|a| a.get(i).copied().unwrap_or(false));
    if !(0..logits.len()).any(ok) {
        return Err(ModelError::Input("no token is allowed here".into()));
    }
    if params.temperature == 0.0 {
        // First index of the maximum among the allowed.
        let mut best: Option<usize> = None;
        for (i, &v) in logits.iter().enumerate() {
            if ok(i) && best.is_none_or(|b| v > logits[b]) {
                best = Some(i);
            }
        }
        return Ok(best.unwrap_or(0) as u32);
    }
    // Candidates, most likely first; ties by lower id, so the order is total.
    let mut idx: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| ok(i as usize))
        .collect();
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
    // min-p keeps a prefix of the sorted candidates (the first weight is exp(0) = 1), and so
    // does top-p: the kept set is the shorter prefix, whichever is applied first.
    if let Some(m) = params.min_p {
        keep = weights
            .iter()
            .take_while(|&&w| w >= m as f64)
            .count()
            .max(1);
    }
    if let Some(p) = params.top_p {
        let mut acc = 0f64;
        for (i, w) in weights.iter().enumerate() {
            acc += w;
            if acc / total >= p as f64 {
                keep = keep.min(i + 1);
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
    fn only_allowed_tokens_are_chosen() {
        let logits = [3.0, 1.0, 2.0, 2.0];
        let allowed = [false, true, true, true];
        let greedy = SamplingParams::default();
        assert_eq!(
            sample_constrained(&logits, &greedy, 0, &[], &[], Some(&allowed)).unwrap(),
            2
        );
        let hot = SamplingParams {
            temperature: 1.0,
            seed: 9,
            ..SamplingParams::default()
        };
        for pos in 0..200 {
            let t = sample_constrained(&logits, &hot, pos, &[], &[], Some(&allowed)).unwrap();
            assert_ne!(t, 0, "position {pos}");
        }
        // All allowed is the same as no constraint.
        for pos in 0..50 {
            assert_eq!(
                sample_constrained(&logits, &hot, pos, &[], &[], Some(&[true; 4])).unwrap(),
                sample(&logits, &hot, pos).unwrap()
            );
        }
        assert!(sample_constrained(&logits, &hot, 0, &[], &[], Some(&[false; 4])).is_err());
    }

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
                seed: 3,
                ..Default::default()
            };
            let t = sample(&logits, &p, pos).unwrap();
            assert!(t == 0 || t == 4, "{t}");
            let p = SamplingParams {
                temperature: 1.0,
                top_p: Some(0.01),
                seed: 3,
                ..Default::default()
            };
            assert_eq!(sample(&logits, &p, pos).unwrap(), 0);
        }
    }

    #[test]
    fn penalties_follow_their_definitions() {
        let pen = Penalties {
            repetition: 2.0,
            presence: 0.5,
            frequency: 0.25,
        };
        // Token 0 unseen, 1 in the prompt only, 2 generated twice, 3 in the prompt and
        // generated once, 4 beyond the vocabulary (ignored).
        let mut logits = [1.0f32, 3.0, -1.0, 4.0];
        pen.apply(&mut logits, &[1, 3, 9], &[2, 3, 2, 9]);
        assert_eq!(logits, [1.0, 1.5, -2.0 - 0.5 - 0.5, 2.0 - 0.25 - 0.5]);
        let mut untouched = [1.0f32, 3.0];
        Penalties::default().apply(&mut untouched, &[0, 1], &[1]);
        assert_eq!(untouched, [1.0, 3.0]);
    }

    #[test]
    fn penalties_steer_greedy_decoding_and_are_off_by_default() {
        let logits = [0.0f32, 2.0, 1.9];
        let plain = SamplingParams::default();
        assert_eq!(sample_after(&logits, &plain, 5, &[1], &[1, 1]).unwrap(), 1);
        let rep = SamplingParams {
            penalties: Penalties {
                repetition: 1.1,
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(sample_after(&logits, &rep, 5, &[1], &[]).unwrap(), 2);
        let freq = SamplingParams {
            penalties: Penalties {
                frequency: 0.06,
                ..Default::default()
            },
            ..Default::default()
        };
        // One earlier 1 costs 0.06 (still ahead), two cost 0.12 (behind 1.9).
        assert_eq!(sample_after(&logits, &freq, 5, &[], &[1]).unwrap(), 1);
        assert_eq!(sample_after(&logits, &freq, 5, &[], &[1, 1]).unwrap(), 2);
        // A prompt token is no generated token: presence leaves it alone.
        let pres = SamplingParams {
            penalties: Penalties {
                presence: 1.0,
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(sample_after(&logits, &pres, 5, &[1], &[]).unwrap(), 1);
        assert_eq!(sample_after(&logits, &pres, 5, &[], &[1]).unwrap(), 2);
    }

    #[test]
    fn min_p_keeps_the_tokens_near_the_best() {
        // Weights at temperature 1: 1, e^-0.5 ≈ 0.61, e^-3 ≈ 0.05.
        let logits = [5.0f32, 4.5, 2.0];
        let mut seen = [false; 3];
        for pos in 0..400 {
            let p = SamplingParams {
                temperature: 1.0,
                min_p: Some(0.5),
                seed: 9,
                ..Default::default()
            };
            seen[sample(&logits, &p, pos).unwrap() as usize] = true;
        }
        assert_eq!(seen, [true, true, false]);
        let all = SamplingParams {
            temperature: 1.0,
            min_p: Some(0.0),
            seed: 9,
            ..Default::default()
        };
        let none = SamplingParams {
            min_p: None,
            ..all.clone()
        };
        for pos in 0..100 {
            assert_eq!(
                sample(&logits, &all, pos).unwrap(),
                sample(&logits, &none, pos).unwrap()
            );
        }
        // min-p and top-p together keep the shorter prefix.
        let both = SamplingParams {
            temperature: 1.0,
            min_p: Some(0.01),
            top_p: Some(0.01),
            seed: 9,
            ..Default::default()
        };
        assert!((0..100).all(|pos| sample(&logits, &both, pos).unwrap() == 0));
    }

    #[test]
    fn settings_survive_the_wire() {
        let p = SamplingParams {
            temperature: 0.7,
            top_k: Some(40),
            top_p: Some(0.9),
            min_p: Some(0.05),
            penalties: Penalties {
                repetition: 1.2,
                presence: -0.5,
                frequency: 0.75,
            },
            seed: 77,
        };
        assert_eq!(SamplingParams::from_wire(&p.to_wire()), p);
        let d = SamplingParams::default();
        assert_eq!(SamplingParams::from_wire(&d.to_wire()), d);
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_the_best_first() {
        let logits = [1.0f32, 3.0, 3.0, -2.0, 0.5];
        let lp = logprobs(&logits, 4, 3);
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let want = |i: usize| ((logits[i] as f64).exp() / z).ln() as f32;
        assert!((lp.logprob - want(4)).abs() < 1e-6);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 2, 0]);
        for (i, v) in &lp.top {
            assert!((v - want(*i as usize)).abs() < 1e-6);
        }
        assert!(logprobs(&logits, 0, 0).top.is_empty());
        assert_eq!(logprobs(&logits, 0, 9).top.len(), logits.len());
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
        for (p, name) in [
            (
                SamplingParams {
                    min_p: Some(1.5),
                    ..Default::default()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    penalties: Penalties {
                        repetition: 0.0,
                        ..Default::default()
                    },
                    ..Default::default()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    penalties: Penalties {
                        presence: 2.5,
                        ..Default::default()
                    },
                    ..Default::default()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    penalties: Penalties {
                        frequency: f32::NAN,
                        ..Default::default()
                    },
                    ..Default::default()
                },
                "frequency_penalty",
            ),
        ] {
            assert!(
                p.validate().unwrap_err().to_string().contains(name),
                "{name}"
            );
        }
        assert!(sample(&[f32::NAN], &SamplingParams::default(), 0).is_err());
    }
}
