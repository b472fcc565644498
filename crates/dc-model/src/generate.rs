//! Running a whole generation in one process, cut into stages exactly as the swarm cuts it:
//! the head embeds and samples, each stage runs its layer range with its own KV cache.
//! The swarm runs the same steps with a network hop between stages.

use std::collections::VecDeque;
use std::ops::Range;

use dc_kernels::Gemm;
use serde::Serialize;

use crate::error::{ModelError, Result};
use crate::json_output::{JsonConstraint, JsonOutput};
use crate::kv_cache::KvCache;
use crate::model::Model;
use crate::sampling::{sample_constrained, SamplingParams};
use crate::speculative::{Speculation, SpeculationStats, Speculator};

/// Splits `layers` layers into `stages` contiguous ranges of near-equal size.
pub fn split_layers(layers: usize, stages: usize) -> Result<Vec<Range<usize>>> {
    if stages == 0 || stages > layers {
        return Err(ModelError::Input(format!(
            "cannot cut {layers} layers into {stages} stages"
        )));
    }
    Ok((0..stages)
        .map(|s| (s * layers / stages)..((s + 1) * layers / stages))
        .collect())
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Upper bound on new tokens.
    pub max_new_tokens: usize,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// Tokens that end the generation (included in the output).
    pub stop_tokens: Vec<u32>,
    /// Prefill chunk size (positions per pass through the stages).
    pub chunk: usize,
    /// Constrain the output to one JSON document of a schema (none: free text).
    pub json: Option<JsonOutput>,
    /// Whether to guess tokens ahead (the tokens are the same either way).
    pub speculative: Speculation,
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// A stop token was produced.
    Stop,
    /// `max_new_tokens` was reached.
    Length,
    /// The model's positions ran out.
    Context,
}

/// A finished generation.
#[derive(Clone, Debug)]
pub struct Generation {
    /// New tokens.
    pub tokens: Vec<u32>,
    /// Logits of the last position run (the one the last token was sampled from).
    pub final_logits: Vec<f32>,
    /// Why it ended.
    pub stop: StopReason,
    /// How the guesses went.
    pub speculation: SpeculationStats,
}

/// A model cut into stages, each with its own KV cache for one generation.
#[derive(Debug)]
pub struct LocalPipeline<'m> {
    model: &'m Model,
    caches: Vec<KvCache>,
}

impl<'m> LocalPipeline<'m> {
    /// A pipeline of `stages` near-equal stages over all layers.
    pub fn new(model: &'m Model, stages: usize) -> Result<LocalPipeline<'m>> {
        let ranges = split_layers(model.config.num_layers, stages)?;
        Ok(Self::with_ranges(model, &ranges))
    }

    /// A pipeline with explicit stage ranges (contiguous, covering every layer).
    pub fn with_ranges(model: &'m Model, ranges: &[Range<usize>]) -> LocalPipeline<'m> {
        LocalPipeline {
            model,
            caches: ranges
                .iter()
                .map(|r| KvCache::new(&model.config, r.clone()))
                .collect(),
        }
    }

    /// Positions held in the caches.
    pub fn len(&self) -> usize {
        self.caches.first().map_or(0, KvCache::len)
    }

    /// Whether nothing has run yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps only the first `len` positions (a pass that starts there overwrites the rest).
    pub fn rewind(&mut self, len: usize) {
        for c in &mut self.caches {
            c.truncate(len);
        }
    }

    /// Runs `tokens` (continuing at the current position) through every stage; returns the
    /// logits of every row when `all_rows`, else of the last row only.
    pub fn forward(&mut self, gemm: &Gemm, tokens: &[u32], all_rows: bool) -> Result<Vec<f32>> {
        let mut x = self.model.embed(tokens, self.len())?;
        for cache in &mut self.caches {
            x = self.model.run_layers(gemm, x, cache)?;
        }
        let x = if all_rows { x } else { x.last_row() };
        self.model.readout(gemm, &x)
    }

    /// Runs `tokens` in chunks of `chunk` positions; returns the logits of every row.
    pub fn prefill_all(&mut self, gemm: &Gemm, tokens: &[u32], chunk: usize) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(tokens.len() * self.model.config.vocab_size);
        for c in tokens.chunks(chunk.max(1)) {
            out.extend(self.forward(gemm, c, true)?);
        }
        Ok(out)
    }

    /// Runs `tokens` in chunks; returns the logits of the last row.
    pub fn prefill(&mut self, gemm: &Gemm, tokens: &[u32], chunk: usize) -> Result<Vec<f32>> {
        let mut last = Vec::new();
        for c in tokens.chunks(chunk.max(1)) {
            last = self.forward(gemm, c, false)?;
        }
        Ok(last)
    }
}

/// What to do after a row of logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Emit this token and run it through the stages for the next logits.
    Feed(u32),
    /// Emit this token; the generation is over.
    Last(u32, StopReason),
    /// The generation is over without another token.
    Done(StopReason),
}

/// The sampling loop of a generation, shared by the local pipeline and the swarm's head so
/// both stop, sample and count positions identically.
#[derive(Clone, Debug)]
pub struct TokenLoop {
    prompt: Vec<u32>,
    max_new_tokens: usize,
    max_positions: usize,
    sampling: SamplingParams,
    stop_tokens: Vec<u32>,
    json: Option<JsonConstraint>,
    /// New tokens so far.
    pub tokens: Vec<u32>,
}

impl TokenLoop {
    /// A loop for `req` on a model with `max_positions` positions (checks the request).
    pub fn new(req: &GenerateRequest, max_positions: usize) -> Result<TokenLoop> {
        req.sampling.validate()?;
        if req.prompt.is_empty() {
            return Err(ModelError::Input("the prompt is empty".into()));
        }
        if req.prompt.len() > max_positions {
            return Err(ModelError::Input(format!(
                "the prompt has {} tokens but the model has {} positions",
                req.prompt.len(),
                max_positions
            )));
        }
        if let Some(need) = req.json.as_ref().map(JsonOutput::shortest_document_len) {
            if need > req.max_new_tokens {
                return Err(ModelError::Input(format!(
                    "JSON output: {} new tokens cannot hold the shortest document ({need} \
                     characters, which may need one token each)",
                    req.max_new_tokens
                )));
            }
        }
        Ok(TokenLoop {
            prompt: req.prompt.clone(),
            max_new_tokens: req.max_new_tokens,
            max_positions,
            sampling: req.sampling.clone(),
            stop_tokens: req.stop_tokens.clone(),
            json: req.json.clone().map(JsonConstraint::new),
            tokens: Vec::new(),
        })
    }

    /// Chooses what follows the logits of the last position run.
    pub fn next(&mut self, logits: &[f32]) -> Result<Next> {
        if self.tokens.len() >= self.max_new_tokens {
            return Ok(Next::Done(StopReason::Length));
        }
        // The token sampled here takes absolute position `pos`.
        let pos = self.prompt.len() + self.tokens.len();
        // JSON output: only tokens that keep the document valid and closable in the tokens
        // left after this one (the new ones and the model's positions, whichever ends first).
        let allowed = match &self.json {
            Some(c) => {
                let left = (self.max_new_tokens - self.tokens.len() - 1)
                    .min(self.max_positions.saturating_sub(pos + 1));
                Some(c.allowed(logits.len(), left)?)
            }
            None => None,
        };
        let t = sample_constrained(
            logits,
            &self.sampling,
            pos,
            &self.prompt,
            &self.tokens,
            allowed.as_deref(),
        )?;
        self.tokens.push(t);
        let json_done = match &mut self.json {
            Some(c) => {
                c.push(t)?;
                c.is_complete()
            }
            None => false,
        };
        Ok(if self.stop_tokens.contains(&t) || json_done {
            Next::Last(t, StopReason::Stop)
        } else if self.tokens.len() >= self.max_new_tokens {
            Next::Last(t, StopReason::Length)
        } else if pos + 1 >= self.max_positions {
            // Running t would need position `pos`, the model's last; there is no room to
            // sample after it.
            Next::Last(t, StopReason::Context)
        } else {
            Next::Feed(t)
        })
    }
}

/// Commitment to a row of logits at position `pos` (compares runs bit for bit).
pub fn logits_commitment(pos: usize, logits: &[f32]) -> dc_kernels::Commitment {
    crate::activations::Activations {
        start: pos,
        hidden: logits.len(),
        data: logits.to_vec(),
    }
    .commitment()
}

/// Generates from `req` through `pipeline` (which must be empty), calling `on_token` for every
/// new token as soon as it is chosen, with the row of logits it was chosen from.
pub fn generate(
    pipeline: &mut LocalPipeline<'_>,
    gemm: &Gemm,
    req: &GenerateRequest,
    mut on_token: impl FnMut(u32, &[f32]),
) -> Result<Generation> {
    if !pipeline.is_empty() {
        return Err(ModelError::Input(
            "the pipeline already holds a generation".into(),
        ));
    }
    let max_positions = pipeline.model.config.max_positions;
    let mut tl = TokenLoop::new(req, max_positions)?;
    let mut spec = Speculator::new(req.speculative, &req.prompt);
    let vocab = pipeline.model.config.vocab_size;
    // The rows of logits not sampled from yet, each with its position: the prompt's last, then
    // those of the last pass (one per token it ran).
    let mut rows: VecDeque<(usize, Vec<f32>)> = VecDeque::new();
    rows.push_back((
        req.prompt.len() - 1,
        pipeline.prefill(gemm, &req.prompt, req.chunk)?,
    ));
    let (mut at, mut logits): (usize, Vec<f32>);
    let stop = loop {
        (at, logits) = rows
            .pop_front()
            .ok_or_else(|| ModelError::Input("a pass returned no logits".into()))?;
        match tl.next(&logits)? {
            Next::Feed(t) => {
                on_token(t, &logits);
                if spec.produced(t) && !rows.is_empty() {
                    continue;
                }
                // `t` takes position `at + 1`; anything the caches hold past it was a guess.
                pipeline.rewind(at + 1);
                let room = draft_room(req.max_new_tokens - tl.tokens.len(), max_positions, at);
                let pass = spec.next_pass(room);
                let out = pipeline.forward(gemm, &pass, true)?;
                rows = out
                    .chunks(vocab)
                    .enumerate()
                    .map(|(i, r)| (at + 1 + i, r.to_vec()))
                    .collect();
            }
            Next::Last(t, why) => {
                on_token(t, &logits);
                break why;
            }
            Next::Done(why) => break why,
        }
    };
    // The caches end at the position the final logits came from, as without guesses.
    pipeline.rewind(at + 1);
    Ok(Generation {
        tokens: tl.tokens,
        final_logits: logits,
        stop,
        speculation: spec.stats,
    })
}

/// How many tokens a pass may guess after the one just sampled (at position `at + 1`), with
/// `left` tokens still to produce: a guess is worth running only if the token after it may be
/// sampled, and every position it takes must exist.
pub fn draft_room(left: usize, max_positions: usize, at: usize) -> usize {
    left.saturating_sub(1)
        .min(max_positions.saturating_sub(at + 3))
}
