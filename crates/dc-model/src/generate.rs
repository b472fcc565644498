//! Running a whole generation in one process, cut into stages exactly as the swarm cuts it:
//! the head embeds and samples, each stage runs its layer range with its own KV cache.
//! The swarm runs the same steps with a network hop between stages.

use std::ops::Range;

use dc_kernels::Gemm;
use serde::Serialize;

use crate::error::{ModelError, Result};
use crate::model::{KvCache, Model};
use crate::sampling::{sample, SamplingParams};

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

/// Generates from `req` through `pipeline` (which must be empty), calling `on_token` for every
/// new token as soon as it is chosen.
pub fn generate(
    pipeline: &mut LocalPipeline<'_>,
    gemm: &Gemm,
    req: &GenerateRequest,
    mut on_token: impl FnMut(u32),
) -> Result<Generation> {
    req.sampling.validate()?;
    if req.prompt.is_empty() {
        return Err(ModelError::Input("the prompt is empty".into()));
    }
    if !pipeline.is_empty() {
        return Err(ModelError::Input(
            "the pipeline already holds a generation".into(),
        ));
    }
    let max_pos = pipeline.model.config.max_positions;
    if req.prompt.len() > max_pos {
        return Err(ModelError::Input(format!(
            "the prompt has {} tokens but the model has {} positions",
            req.prompt.len(),
            max_pos
        )));
    }
    let mut logits = pipeline.prefill(gemm, &req.prompt, req.chunk)?;
    let mut tokens = Vec::new();
    let stop = loop {
        if tokens.len() >= req.max_new_tokens {
            break StopReason::Length;
        }
        // The token sampled here takes absolute position `pos`.
        let pos = req.prompt.len() + tokens.len();
        let t = sample(&logits, &req.sampling, pos)?;
        tokens.push(t);
        on_token(t);
        if req.stop_tokens.contains(&t) {
            break StopReason::Stop;
        }
        if tokens.len() >= req.max_new_tokens {
            break StopReason::Length;
        }
        if pos + 1 > max_pos - 1 + 1 || pipeline.len() >= max_pos {
            break StopReason::Context;
        }
        logits = pipeline.forward(gemm, &[t], false)?;
    };
    Ok(Generation {
        tokens,
        final_logits: logits,
        stop,
    })
}
