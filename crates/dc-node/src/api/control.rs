//! The local control API (loopback by default): `GET /status` and `POST /generate`, which
//! streams newline-delimited JSON events. Bound to a non-loopback address it requires a bearer
//! token.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dc_model::sampling::{Penalties, SamplingParams};
use dc_model::tokenizer::StreamDecoder;
use dc_types::{
    GenerationEvent, GenerationId, GenerationRequest, OutputFormat, VerifyMode, MAX_TOP_LOGPROBS,
};
use serde::Deserialize;
use serde_json::json;

use super::served::Served;
use crate::daemon::Daemon;
use crate::head::start_generation;

/// Largest request body.
const MAX_BODY: usize = 1 << 20;

/// A generation request as the control API takes it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateBody {
    /// Prompt text (needs the model's tokenizer).
    pub prompt: Option<String>,
    /// Prompt token ids.
    pub prompt_ids: Option<Vec<u32>>,
    /// Upper bound on new tokens.
    #[serde(default = "default_max_new_tokens")]
    pub max_new_tokens: u32,
    /// 0: greedy.
    #[serde(default)]
    pub temperature: f32,
    /// Top-k.
    pub top_k: Option<u32>,
    /// Top-p.
    pub top_p: Option<f32>,
    /// Min-p.
    pub min_p: Option<f32>,
    /// Repetition penalty over the prompt and the new tokens (1: off).
    pub repetition_penalty: Option<f32>,
    /// Presence penalty over the new tokens (0: off).
    pub presence_penalty: Option<f32>,
    /// Frequency penalty over the new tokens (0: off).
    pub frequency_penalty: Option<f32>,
    /// Seed of the per-position draws.
    #[serde(default)]
    pub seed: u64,
    /// Keep going past end-of-sequence tokens.
    #[serde(default)]
    pub ignore_eos: bool,
    /// Constrain the output to one JSON object.
    #[serde(default)]
    pub json_output: bool,
    /// Constrain the output to one JSON document of this schema (JSON output implied).
    pub json_schema: Option<serde_json::Value>,
    /// Prefill chunk size.
    pub chunk: Option<u32>,
    /// `"prompt-lookup"` or `"off"` (default: the daemon's `speculative`).
    pub speculative: Option<dc_types::Speculation>,
    /// `"all"`: every hop re-run by a second peer before its token is released; `"sample"`
    /// (default): random audits.
    pub verify: Option<String>,
    /// Probability of auditing each remote hop in `"sample"` mode (default: the daemon's).
    pub audit_rate: Option<f32>,
    /// With every token, its log-probability and those of this many most likely tokens.
    pub top_logprobs: Option<u8>,
}

fn default_max_new_tokens() -> u32 {
    128
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({"error": {"message": message.into()}}))).into_response()
}

async fn status(State(d): State<Daemon>) -> Response {
    // A stopped network loop shows as no connections rather than no status.
    let connections = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        d.node.client.connections(),
    )
    .await
    .ok()
    .and_then(Result::ok)
    .unwrap_or_default();
    Json(super::status::status(&d, &connections)).into_response()
}

/// Validates a body into a generation request.
pub fn to_request(served: &Served, b: GenerateBody) -> Result<GenerationRequest, String> {
    let prompt = match (b.prompt, b.prompt_ids) {
        (Some(_), Some(_)) => return Err("give either prompt or prompt_ids, not both".into()),
        (None, None) => return Err("give prompt or prompt_ids".into()),
        (None, Some(ids)) => ids,
        (Some(text), None) => served
            .tokenizer
            .ok_or("this model has no tokenizer: give prompt_ids")?
            .encode(&text, false)
            .map_err(|e| e.to_string())?,
    };
    let max = served.max_positions;
    if prompt.is_empty() || prompt.len() >= max {
        return Err(format!(
            "the prompt has {} tokens; it must have 1 to {}",
            prompt.len(),
            max - 1
        ));
    }
    if let Some(t) = prompt.iter().find(|&&t| t as usize >= served.vocab_size) {
        return Err(format!(
            "token id {t} is out of range (vocabulary of {})",
            served.vocab_size
        ));
    }
    if b.max_new_tokens as usize > max {
        return Err(format!(
            "max_new_tokens {} exceeds the model's {max} positions",
            b.max_new_tokens
        ));
    }
    let defaults = Penalties::default();
    let sampling = SamplingParams {
        temperature: b.temperature,
        top_k: b.top_k.map(|k| k as usize),
        top_p: b.top_p,
        min_p: b.min_p,
        penalties: Penalties {
            repetition: b.repetition_penalty.unwrap_or(defaults.repetition),
            presence: b.presence_penalty.unwrap_or(defaults.presence),
            frequency: b.frequency_penalty.unwrap_or(defaults.frequency),
        },
        seed: b.seed,
    };
    sampling.validate().map_err(|e| e.to_string())?;
    let verify = match b.verify.as_deref() {
        Some("all") => VerifyMode::All,
        None | Some("sample") => {
            let rate = b.audit_rate.unwrap_or(served.audit_rate);
            if !(0.0..=1.0).contains(&rate) {
                return Err(format!("audit_rate {rate} must be between 0 and 1"));
            }
            VerifyMode::Sampled(rate)
        }
        Some(other) => return Err(format!("verify {other:?}: expected \"all\" or \"sample\"")),
    };
    if let Some(n) = b.top_logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
        return Err(format!(
            "top_logprobs {n} is too many: at most {MAX_TOP_LOGPROBS}"
        ));
    }
    let output = match (&b.json_schema, b.json_output) {
        (Some(schema), _) => super::json_schema_output(schema)?,
        (None, true) => OutputFormat::JsonObject,
        (None, false) => OutputFormat::Text,
    };
    super::check_output_budget(&output, b.max_new_tokens, "max_new_tokens")?;
    Ok(GenerationRequest {
        model_id: served.model_id,
        generation: GenerationId::new_random(),
        prompt,
        max_new_tokens: b.max_new_tokens,
        sampling: sampling.to_wire(),
        stop_tokens: if b.ignore_eos {
            Vec::new()
        } else {
            served.eos.to_vec()
        },
        chunk: b
            .chunk
            .unwrap_or(served.chunk as u32)
            .clamp(1, crate::stage::MAX_HOP_ROWS as u32),
        verify,
        resume: Vec::new(),
        top_logprobs: b.top_logprobs,
        output,
        speculative: b.speculative.unwrap_or(served.speculative),
    })
}

async fn generate(
    State(d): State<Daemon>,
    body: Result<Json<GenerateBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let node = &d.node;
    let Json(body) = match body {
        Ok(b) => b,
        Err(e) => return error(e.status(), e.body_text()),
    };
    let req = match to_request(&Served::of(node), body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    if node.paused() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "paused: the machine is busy with other work",
        );
    }
    let Ok(permit) = node.generations.clone().try_acquire_owned() else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "already running {} generations; try again later",
                node.cfg.max_generations
            ),
        );
    };
    node.stats.requests.fetch_add(1, Ordering::Relaxed);
    let generation = req.generation;
    let prompt_ids = req.prompt.clone();
    let mut events = match start_generation(d.clone(), req).await {
        Ok(rx) => rx,
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e),
    };
    let mut decoder = node.tokenizer.as_ref().map(|t| StreamDecoder::new(t, true));
    let tokenizer = node.tokenizer.clone();
    let mut tokens_so_far: Vec<u32> = Vec::new();
    let stream = async_stream(move |tx| async move {
        let _permit = permit;
        while let Some(ev) = events.recv().await {
            let line = match ev {
                GenerationEvent::Started { head, route } => json!({
                    "event": "started",
                    "generation": generation.to_string(),
                    "prompt_ids": prompt_ids,
                    "head": head,
                    "route": route.iter().map(|h| json!({"peer": h.peer, "layers": h.layers.to_string()})).collect::<Vec<_>>(),
                }),
                GenerationEvent::Token {
                    index,
                    id,
                    logprobs,
                } => {
                    tokens_so_far.push(id);
                    let text = decoder.as_mut().and_then(|d| d.push(id).ok());
                    let mut line =
                        json!({"event": "token", "index": index, "id": id, "text": text});
                    if let Some(lp) = logprobs {
                        line["logprobs"] = json!(lp);
                    }
                    line
                }
                GenerationEvent::Corrected {
                    from,
                    tokens,
                    logprobs,
                    liar,
                } => {
                    // Restart the text stream from the corrected sequence.
                    tokens_so_far.truncate(from as usize);
                    tokens_so_far.extend_from_slice(&tokens);
                    decoder = tokenizer.as_ref().map(|t| StreamDecoder::new(t, true));
                    if let Some(d) = decoder.as_mut() {
                        for &t in &tokens_so_far {
                            let _ = d.push(t);
                        }
                    }
                    let text = tokenizer
                        .as_ref()
                        .and_then(|t| t.decode(&tokens_so_far, true).ok());
                    let mut line = json!({"event": "corrected", "from": from, "tokens": tokens, "liar": liar, "text": text});
                    if !logprobs.is_empty() {
                        line["logprobs"] = json!(logprobs);
                    }
                    line
                }
                GenerationEvent::Done {
                    tokens,
                    stop,
                    final_logits,
                } => {
                    let text = tokenizer
                        .as_ref()
                        .and_then(|t| t.decode(&tokens, true).ok());
                    json!({"event": "done", "tokens": tokens, "text": text, "stop": stop, "final_logits": final_logits.to_hex()})
                }
                GenerationEvent::Failed { message } => {
                    json!({"event": "error", "message": message})
                }
            };
            let last = matches!(line["event"].as_str(), Some("done" | "error"));
            if tx.send(Ok(Bytes::from(format!("{line}\n")))).await.is_err() || last {
                break;
            }
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "response"))
}

/// A stream fed by a task through a bounded channel.
fn async_stream<F, Fut>(f: F) -> impl futures::Stream<Item = Result<Bytes, Infallible>>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<Bytes, Infallible>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(f(tx));
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
}

async fn require_token(State(d): State<Daemon>, req: Request, next: Next) -> Response {
    let node = &d.node;
    if let Some(token) = &node.cfg.api_token {
        let ok = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|t| t == token);
        if !ok {
            return error(StatusCode::UNAUTHORIZED, "missing or wrong bearer token");
        }
    }
    next.run(req).await
}

/// The router.
pub fn router(d: Daemon) -> Router {
    Router::new()
        .route("/status", get(status))
        .route("/generate", post(generate))
        .route("/metrics", get(super::metrics::handler))
        .merge(super::openai::router())
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(middleware::from_fn_with_state(d.clone(), require_token))
        .with_state(d)
}

/// Binds the control API and serves it in the background; returns the bound address.
pub async fn serve(d: Daemon) -> Result<SocketAddr, String> {
    let node = &d.node;
    let addr = node.cfg.api;
    if !addr.ip().is_loopback() && node.cfg.api_token.is_none() {
        return Err(format!(
            "the control API on {addr} is not loopback: set a bearer token (DCD_API_TOKEN)"
        ));
    }
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("control API on {addr}: {e}"))?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    let app = router(d.clone());
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!("control API stopped: {e}");
        }
    });
    Ok(bound)
}
