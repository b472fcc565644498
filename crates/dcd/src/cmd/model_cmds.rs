//! Commands that run a model in this process: generate, logits, perplexity and tokenize
//! (`bench model` measures one, in `bench_model`).

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use dc_kernels::elementwise::log_sum_exp;
use dc_model::generate::{
    generate as run_generation, logits_commitment, GenerateRequest, LocalPipeline,
};
use dc_model::json_output::{JsonOutput, TokenTexts};
use dc_model::json_schema::{Schema, MAX_SCHEMA_BYTES};
use dc_model::sampling::{logprobs, Penalties, SamplingParams};
use dc_model::tokenizer::{load_for_model, StreamDecoder};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;

use super::local::{engine, load_model, model_path};
use super::timing::TokenClock;
use crate::cli::{GenerateArgs, Global, LogitsArgs, PerplexityArgs, TokenizeArgs};

/// The JSON schema `--json-schema` names, read and parsed (none without the flag).
pub(crate) fn read_json_schema(a: &GenerateArgs) -> Result<Option<serde_json::Value>> {
    let Some(path) = &a.json_schema else {
        return Ok(None);
    };
    let text = std::fs::read(path)
        .with_context(|| format!("--json-schema {}: reading it", path.display()))?;
    if text.len() > MAX_SCHEMA_BYTES {
        bail!(
            "--json-schema {}: {} bytes, at most {MAX_SCHEMA_BYTES}",
            path.display(),
            text.len()
        );
    }
    serde_json::from_slice(&text)
        .map(Some)
        .with_context(|| format!("--json-schema {}: not JSON", path.display()))
}

pub fn generate(global: &Global, a: &GenerateArgs) -> Result<ExitCode> {
    let gemm = engine(global)?;
    let model = a.model.clone().context("give --model (or --api)")?;
    let l = load_model(&crate::cli::ModelArg { model })?;
    let prompt = match (&a.prompt, &a.prompt_ids) {
        (Some(text), _) => l.tokenizer()?.encode(text, false)?,
        (None, Some(ids)) => ids.clone(),
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    let req = GenerateRequest {
        prompt: prompt.clone(),
        max_new_tokens: a.max_new_tokens,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            min_p: a.min_p,
            penalties: Penalties {
                repetition: a.repetition_penalty,
                presence: a.presence_penalty,
                frequency: a.frequency_penalty,
            },
            seed: a.seed,
        },
        stop_tokens: if a.ignore_eos {
            Vec::new()
        } else {
            l.special.eos.clone()
        },
        chunk: a.chunk,
        json: match (read_json_schema(a)?, a.json_output) {
            (None, false) => None,
            (schema, _) => {
                let schema = match schema {
                    Some(v) => Schema::parse(&v)?,
                    None => Schema::any_object(),
                };
                let texts = Arc::new(TokenTexts::new(l.tokenizer()?)?);
                Some(JsonOutput::new(texts, Arc::new(schema))?)
            }
        },
        speculative: global.speculative,
    };
    let mut pipeline = LocalPipeline::new(&l.model, a.stages)?;
    let mut decoder = l.tokenizer.as_ref().map(|t| StreamDecoder::new(t, true));
    let mut stdout = std::io::stdout().lock();
    let mut stream_err = None;
    let mut token_logprobs = Vec::new();
    let mut clock = TokenClock::start();
    let out = run_generation(&mut pipeline, &gemm, &req, |t, row| {
        clock.token();
        if let Some(n) = a.top_logprobs {
            token_logprobs.push(logprobs(row, t, n as usize));
        }
        if a.json || stream_err.is_some() {
            return;
        }
        // Without a tokenizer, stream the ids themselves.
        let piece = match decoder.as_mut() {
            Some(d) => d.push(t),
            None => Ok(format!("{t} ")),
        };
        match piece {
            Ok(text) => {
                let _ = write!(stdout, "{text}");
                let _ = stdout.flush();
            }
            Err(e) => stream_err = Some(e),
        }
    })?;
    if let Some(e) = stream_err {
        return Err(e.into());
    }
    let text = match &l.tokenizer {
        Some(t) => Some(t.decode(&out.tokens, true)?),
        None => None,
    };
    if a.json {
        let mut answer = json!({
            "prompt_ids": prompt,
            "tokens": out.tokens,
            "text": text,
            "stop": out.stop,
            "final_logits": logits_commitment(pipeline.len() - 1, &out.final_logits).to_hex(),
        });
        if a.top_logprobs.is_some() {
            answer["logprobs"] = json!(token_logprobs);
        }
        answer["speculation"] = json!(out.speculation);
        answer["timing"] = clock.json();
        println!("{answer}");
    } else {
        let rest = match decoder.as_mut() {
            Some(d) => d.finish()?,
            None => String::new(),
        };
        writeln!(stdout, "{rest}")?;
    }
    Ok(ExitCode::SUCCESS)
}

pub fn logits(global: &Global, a: &LogitsArgs) -> Result<ExitCode> {
    let gemm = engine(global)?;
    let path = model_path(&a.model)?;
    let model = dc_model::Model::load(&path, &Default::default())?;
    let mut p = LocalPipeline::new(&model, a.stages)?;
    let logits = p.prefill_all(&gemm, &a.ids, 64)?;
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = TensorView::new(
        Dtype::F32,
        vec![a.ids.len(), model.config.vocab_size],
        &bytes,
    )
    .context("building the logits tensor")?;
    let file = safetensors::serialize([("logits", view)], None).context("serialising logits")?;
    std::fs::write(&a.out, file).with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!(
        "wrote logits [{}, {}] to {}",
        a.ids.len(),
        model.config.vocab_size,
        a.out.display()
    );
    Ok(ExitCode::SUCCESS)
}

pub fn perplexity(global: &Global, a: &PerplexityArgs) -> Result<ExitCode> {
    let gemm = engine(global)?;
    let l = load_model(&a.model)?;
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading {}", a.file.display()))?;
    // Like the reference measurements: the text is stripped, no BOS is added.
    let ids = l.tokenizer()?.encode(text.trim(), false)?;
    if ids.len() < 2 {
        bail!(
            "{}: fewer than two tokens, nothing to predict",
            a.file.display()
        );
    }
    // Non-overlapping windows of the model's context, every position after a window's first
    // predicting the next token (as llama-perplexity does with its context size).
    let ctx = l.model.config.max_positions;
    let vocab = l.model.config.vocab_size;
    let (mut nll, mut count) = (0f64, 0usize);
    for window in ids.chunks(ctx) {
        let mut p = LocalPipeline::new(&l.model, 1)?;
        let logits = p.prefill_all(&gemm, window, 128)?;
        for i in 0..window.len() - 1 {
            let row = &logits[i * vocab..(i + 1) * vocab];
            nll += log_sum_exp(row) - row[window[i + 1] as usize] as f64;
            count += 1;
        }
    }
    let ppl = (nll / count as f64).exp();
    if a.json {
        println!(
            "{}",
            json!({"tokens": ids.len(), "predictions": count, "mean_nll": nll / count as f64, "ppl": ppl})
        );
    } else {
        println!(
            "{} tokens, {count} predictions, perplexity {ppl:.4}",
            ids.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub fn tokenize(a: &TokenizeArgs) -> Result<ExitCode> {
    let path = model_path(&a.model)?;
    let (tok, _, _) = load_for_model(&path)?;
    let ids = tok.encode(&a.text, a.add_special_tokens)?;
    if a.json {
        println!("{}", json!({ "ids": ids }));
    } else {
        println!(
            "{}",
            ids.iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
    }
    Ok(ExitCode::SUCCESS)
}
