//! The OpenAI-compatible HTTP API under `/v1`: `GET /v1/models`, `GET /v1/models/{model}`,
//! `POST /v1/completions` and `POST /v1/chat/completions`, answered as JSON or streamed as
//! Server-Sent Events, so that OpenAI client libraries and tools work against a daemon.
//!
//! This module owns the translation both ways: an OpenAI request (fields checked one by one so
//! that an error names its parameter) into a [`GenerationRequest`], and the head's
//! [`GenerationEvent`]s back into OpenAI's response shapes. `stop` strings are matched here,
//! on the decoded text: the head only knows stop *tokens*. Every error is answered in OpenAI's
//! format `{"error": {"message", "type", "param", "code"}}` with a fitting status.
//!
//! It must never panic on a request, and must give a generation up as soon as nobody wants its
//! tokens (a stop string matched, or the client went away): dropping the event receiver is
//! the signal, the head notices it at its next token, ends the generation and frees the
//! route's KV caches.
//!
//! Defaults, where OpenAI's do not fit a swarm of CPUs, are the constants below.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use dc_model::sampling::{Penalties, SamplingParams};
use dc_model::tokenizer::{ChatMessage, StreamDecoder, Tokenizer};
use dc_types::{
    GenerationEvent, GenerationId, GenerationRequest, OutputFormat, TokenLogprobs, MAX_TOP_LOGPROBS,
};
use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, OwnedSemaphorePermit};

use super::served::{model_name, Served};
use crate::core::Node;
use crate::daemon::Daemon;
use crate::head::start_generation;

/// `max_tokens` when a request gives none. OpenAI's chat API then runs to the end of the
/// context; on a swarm of CPUs that can take many minutes, so a request that forgot the bound
/// gets a modest one (and `finish_reason: "length"` to tell it so).
pub const DEFAULT_MAX_TOKENS: u32 = 256;
/// `temperature` when a request gives none: OpenAI's default, so that a client relying on it
/// samples as it would there. Greedy decoding is `temperature: 0`.
pub const DEFAULT_TEMPERATURE: f64 = 1.0;
/// Highest `temperature` (OpenAI's range is 0 to 2).
pub const MAX_TEMPERATURE: f64 = 2.0;
/// Most `stop` strings in one request (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;
/// Longest `stop` string, in bytes. Bounds the text held back from a stream while it might
/// still turn into a stop string.
pub const MAX_STOP_BYTES: usize = 256;
/// Most messages in one chat request. The body limit bounds their text; this bounds the
/// per-message work of the chat template.
pub const MAX_MESSAGES: usize = 4096;
/// Server-sent events queued towards a slow client before the generation waits for it.
const SSE_QUEUE: usize = 16;
/// What `GET /v1/models` says owns the model.
const OWNED_BY: &str = "daisychain";
/// Seconds a client told to retry (429, 503) should wait.
const RETRY_AFTER_SECS: &str = "1";

/// An error as OpenAI reports it: an HTTP status and
/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// OpenAI's error `type` (`invalid_request_error`, `rate_limit_error`, `server_error`).
    pub kind: &'static str,
    /// What went wrong, for a human.
    pub message: String,
    /// The request parameter at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code, if there is one.
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// A 400 about the request as a whole.
    fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// A 400 about parameter `param`.
    fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::bad_request(message).param(param)
    }

    /// A 400 for a parameter this server cannot honour.
    fn unsupported(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::invalid(param, message).code("unsupported_parameter")
    }

    fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    fn unavailable(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message).code(code)
    }

    fn param(mut self, param: impl Into<String>) -> ApiError {
        self.param = Some(param.into());
        self
    }

    fn code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let retry = matches!(
            self.status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        );
        let mut r = (self.status, Json(self.body())).into_response();
        if retry {
            // OpenAI's clients honour Retry-After when they retry 429s and 503s.
            r.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECS),
            );
        }
        r
    }
}

/// Turns axum's JSON rejection into OpenAI's format, keeping its status where it is right.
fn from_rejection(e: &JsonRejection) -> ApiError {
    match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body is too large: {}", e.body_text()),
        )
        .code("request_too_large"),
        // A browser page can POST text/plain to a loopback port without asking first;
        // insisting on JSON makes it ask (a CORS preflight), which this API never grants.
        StatusCode::UNSUPPORTED_MEDIA_TYPE => ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            "send the body as JSON with the header Content-Type: application/json",
        ),
        s if s.is_client_error() => {
            ApiError::bad_request(format!("the body is not valid JSON: {}", e.body_text()))
        }
        _ => ApiError::internal(format!("reading the request body: {}", e.body_text())),
    }
}

/// A request body's fields, taken one at a time so that a wrong type names its parameter.
/// `null` counts as absent, as OpenAI treats it. Fields nobody takes are ignored: clients send
/// parameters that do not change the output (`user`, `metadata`, `store`, …) and OpenAI adds
/// new ones often.
#[derive(Debug)]
struct Fields(Map<String, Value>);

impl Fields {
    fn new(body: Value) -> Result<Fields, ApiError> {
        match body {
            Value::Object(m) => Ok(Fields(m)),
            other => Err(ApiError::bad_request(format!(
                "the body must be a JSON object, not {}",
                kind_of(&other)
            ))),
        }
    }

    fn take<T: DeserializeOwned>(&mut self, name: &str) -> Result<Option<T>, ApiError> {
        match self.0.remove(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => serde_json::from_value(v)
                .map(Some)
                .map_err(|e| ApiError::invalid(name, format!("{name}: {e}"))),
        }
    }

    /// Refuses parameter `name` unless it is absent, null or `harmless` (a value that asks for
    /// nothing this server does not do, such as `n: 1`).
    fn refuse(
        &mut self,
        name: &str,
        harmless: impl Fn(&Value) -> bool,
        why: &str,
    ) -> Result<(), ApiError> {
        match self.0.remove(name) {
            Some(v) if !v.is_null() && !harmless(&v) => Err(ApiError::unsupported(
                name,
                format!("{name} = {v} is not supported: {why}"),
            )),
            _ => Ok(()),
        }
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn is_empty(v: &Value) -> bool {
    v.as_array().is_some_and(Vec::is_empty) || v.as_object().is_some_and(Map::is_empty)
}

fn never(_: &Value) -> bool {
    false
}

/// Which endpoint a generation answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completion,
}

impl Endpoint {
    fn object(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat.completion",
            Endpoint::Completion => "text_completion",
        }
    }

    fn chunk_object(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completion => "text_completion",
        }
    }

    fn id_prefix(self) -> &'static str {
        match self {
            Endpoint::Chat => "chatcmpl-",
            Endpoint::Completion => "cmpl-",
        }
    }
}

/// A request body translated into the generation to run and how to answer it.
#[derive(Debug)]
pub struct Translated {
    /// The endpoint asked.
    pub endpoint: Endpoint,
    /// The model's name, as the answer gives it.
    pub model: String,
    /// The generation (its id fresh).
    pub request: GenerationRequest,
    /// `stop` strings, matched on the decoded text.
    pub stop: Vec<String>,
    /// Whether to stream the answer as server-sent events.
    pub stream: bool,
    /// Whether a stream ends with a usage chunk.
    pub include_usage: bool,
}

/// Translates a request body of `endpoint`: every field checked, the prompt tokenized (or
/// rendered with the chat template) and checked against the model. An error names the
/// parameter at fault; nothing a body holds may panic here.
pub fn translate(served: &Served, endpoint: Endpoint, body: Value) -> Result<Translated, ApiError> {
    let mut f = Fields::new(body)?;
    let model = check_model(served, &mut f)?;
    let tok = tokenizer(served)?;
    refuse_unsupported(&mut f, endpoint)?;
    let p = params(served, &mut f, endpoint)?;
    let (prompt, param) = match endpoint {
        Endpoint::Completion => (
            completion_prompt(tok, f.take::<Value>("prompt")?)?,
            "prompt",
        ),
        Endpoint::Chat => (
            chat_prompt(served, tok, f.take::<Value>("messages")?)?,
            "messages",
        ),
    };
    let request = request(served, GenerationId::new_random(), prompt, &p, param)?;
    Ok(Translated {
        endpoint,
        model,
        request,
        stop: p.stop,
        stream: p.stream,
        include_usage: p.include_usage,
    })
}

/// Refuses the parameters asking for what this server does not do (more than one choice,
/// logit biases, tools, structured output, …): ignoring them would silently
/// give the client something else than it asked for.
fn refuse_unsupported(f: &mut Fields, endpoint: Endpoint) -> Result<(), ApiError> {
    f.refuse(
        "n",
        |v| v.as_u64() == Some(1),
        "only one choice per request (n = 1); send several requests",
    )?;
    f.refuse("logit_bias", is_empty, "logit_bias is not implemented")?;
    match endpoint {
        Endpoint::Chat => {
            f.refuse("tools", is_empty, "this server does no tool calling")?;
            f.refuse(
                "functions",
                is_empty,
                "this server does no function calling",
            )?;
            let no_call = |v: &Value| v == "none" || v == "auto";
            f.refuse("tool_choice", no_call, "this server does no tool calling")?;
            f.refuse(
                "function_call",
                no_call,
                "this server does no function calling",
            )?;
            f.refuse("modalities", |v| v == &json!(["text"]), "only text output")?;
            f.refuse("audio", never, "only text output")?;
            f.refuse("prediction", never, "predicted outputs are not implemented")?;
            f.refuse("web_search_options", never, "this server does not search")?;
        }
        Endpoint::Completion => {
            f.refuse("echo", |v| v == &json!(false), "the prompt is not echoed")?;
            f.refuse("suffix", |v| v == "", "insertion is not implemented")?;
            f.refuse(
                "best_of",
                |v| v.as_u64() == Some(1),
                "only one candidate per request",
            )?;
        }
    }
    Ok(())
}

/// What both generation endpoints take besides the prompt.
#[derive(Debug)]
struct Params {
    max_tokens: u32,
    sampling: SamplingParams,
    top_logprobs: Option<u8>,
    output: OutputFormat,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
    ignore_eos: bool,
}

/// Reads the sampling and output parameters. `top_k`, `min_p`, `repetition_penalty` and
/// `ignore_eos` (keep going past end-of-sequence tokens, for benchmarks) are extensions vLLM
/// takes too; a missing `seed` is
/// drawn at random, so that two identical requests without one differ as they do at OpenAI
/// (with `temperature: 0` the seed does not matter).
fn params(served: &Served, f: &mut Fields, endpoint: Endpoint) -> Result<Params, ApiError> {
    let max_positions = served.max_positions;
    // Chat's newer name wins over the deprecated one, as at OpenAI.
    let (name, max_tokens) = match endpoint {
        Endpoint::Chat => match f.take::<u32>("max_completion_tokens")? {
            Some(m) => {
                f.0.remove("max_tokens");
                ("max_completion_tokens", Some(m))
            }
            None => ("max_tokens", f.take::<u32>("max_tokens")?),
        },
        Endpoint::Completion => ("max_tokens", f.take::<u32>("max_tokens")?),
    };
    let max_tokens = max_tokens
        .unwrap_or(DEFAULT_MAX_TOKENS.min(u32::try_from(max_positions).unwrap_or(u32::MAX)));
    if max_tokens == 0 || max_tokens as usize > max_positions {
        return Err(ApiError::invalid(
            name,
            format!(
                "{name} = {max_tokens}: it must be 1 to {max_positions} (the model's positions)"
            ),
        ));
    }
    let temperature = f.take::<f64>("temperature")?.unwrap_or(DEFAULT_TEMPERATURE);
    if !(0.0..=MAX_TEMPERATURE).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature",
            format!("temperature = {temperature}: it must be 0 to {MAX_TEMPERATURE}"),
        ));
    }
    let top_p = f.take::<f64>("top_p")?;
    if let Some(p) = top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("top_p = {p}: it must be above 0 and at most 1 (use temperature 0 for greedy decoding)"),
            ));
        }
    }
    let top_k = f.take::<u32>("top_k")?;
    let min_p = bounded(f, "min_p", 0.0..=1.0)?;
    let defaults = Penalties::default();
    let penalties = Penalties {
        repetition: match bounded(f, "repetition_penalty", 0.0..=10.0)? {
            Some(r) if r <= 0.0 => {
                return Err(ApiError::invalid(
                    "repetition_penalty",
                    format!("repetition_penalty = {r}: it must be above 0 (1 is off)"),
                ))
            }
            r => r.unwrap_or(defaults.repetition),
        },
        presence: bounded(f, "presence_penalty", -2.0..=2.0)?.unwrap_or(defaults.presence),
        frequency: bounded(f, "frequency_penalty", -2.0..=2.0)?.unwrap_or(defaults.frequency),
    };
    let seed = match f.take::<serde_json::Number>("seed")? {
        None => random_seed(),
        // OpenAI's seeds are 64-bit signed: a negative one is taken as its two's complement.
        Some(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u,
            (None, Some(i)) => i as u64,
            _ => {
                return Err(ApiError::invalid(
                    "seed",
                    format!("seed = {n}: it must be a 64-bit integer"),
                ))
            }
        },
    };
    let top_logprobs = logprobs_asked(f, endpoint)?;
    let output = output_asked(f.take::<Value>("response_format")?)?;
    super::check_output_budget(&output, max_tokens, name)
        .map_err(|e| ApiError::invalid(name, e))?;
    let stop = stop_strings(f.take::<Value>("stop")?)?;
    let stream = f.take::<bool>("stream")?.unwrap_or(false);
    let ignore_eos = f.take::<bool>("ignore_eos")?.unwrap_or(false);
    let include_usage = f
        .take::<Value>("stream_options")?
        .map(|o| match o.get("include_usage") {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => Err(ApiError::invalid(
                "stream_options",
                format!(
                    "stream_options.include_usage must be a boolean, not {}",
                    kind_of(other)
                ),
            )),
        })
        .transpose()?
        .unwrap_or(false);
    let sampling = SamplingParams {
        temperature: temperature as f32,
        top_k: top_k.filter(|&k| k > 0).map(|k| k as usize),
        top_p: top_p.map(|p| p as f32),
        min_p,
        penalties,
        seed,
    };
    sampling
        .validate()
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(Params {
        max_tokens,
        sampling,
        top_logprobs,
        output,
        stop,
        stream,
        include_usage,
        ignore_eos,
    })
}

/// What `response_format` asks for: `{"type": "text"}` (the default), `{"type":
/// "json_object"}` (one JSON object) or `{"type": "json_schema", "json_schema": {"name": ...,
/// "schema": {...}}}` (a document of that schema). Completions take it too, as vLLM's do.
fn output_asked(format: Option<Value>) -> Result<OutputFormat, ApiError> {
    let Some(format) = format.filter(|v| !v.is_null()) else {
        return Ok(OutputFormat::Text);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(OutputFormat::Text),
        Some("json_object") => Ok(OutputFormat::JsonObject),
        Some("json_schema") => {
            let schema = format
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "response_format",
                        "response_format.json_schema.schema is missing: {\"type\": \"json_schema\", \
                         \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                    )
                })?;
            super::json_schema_output(schema).map_err(|e| ApiError::invalid("response_format", e))
        }
        _ => Err(ApiError::invalid(
            "response_format",
            "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or \
             {\"type\": \"json_schema\", ...}",
        )),
    }
}

/// How many alternatives per token the request wants log-probabilities of (none: no
/// log-probabilities): chat's `logprobs: true` with `top_logprobs` (0 to 20), the legacy
/// completions' `logprobs` (0 to 5).
fn logprobs_asked(f: &mut Fields, endpoint: Endpoint) -> Result<Option<u8>, ApiError> {
    let (name, n, max) = match endpoint {
        Endpoint::Chat => {
            let on = f.take::<bool>("logprobs")?.unwrap_or(false);
            let top = f.take::<u32>("top_logprobs")?;
            if top.is_some() && !on {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "top_logprobs needs logprobs: true",
                ));
            }
            if !on {
                return Ok(None);
            }
            (
                "top_logprobs",
                top.unwrap_or(0),
                u32::from(MAX_TOP_LOGPROBS),
            )
        }
        Endpoint::Completion => match f.take::<u32>("logprobs")? {
            None => return Ok(None),
            Some(n) => ("logprobs", n, 5),
        },
    };
    if n > max {
        return Err(ApiError::invalid(
            name,
            format!("{name} = {n}: it must be 0 to {max}"),
        ));
    }
    Ok(Some(n as u8))
}

/// Takes the number `name`, which must lie in `range`.
fn bounded(
    f: &mut Fields,
    name: &str,
    range: std::ops::RangeInclusive<f64>,
) -> Result<Option<f32>, ApiError> {
    match f.take::<f64>(name)? {
        Some(v) if !range.contains(&v) => Err(ApiError::invalid(
            name,
            format!(
                "{name} = {v}: it must be {} to {}",
                range.start(),
                range.end()
            ),
        )),
        v => Ok(v.map(|v| v as f32)),
    }
}

fn random_seed() -> u64 {
    // A generation id is 16 fresh bytes; they are unique, which is all a default seed needs.
    let mut b = [0u8; 8];
    b.copy_from_slice(&GenerationId::new_random().0[..8]);
    u64::from_le_bytes(b)
}

/// `stop`: a string or an array of strings.
fn stop_strings(v: Option<Value>) -> Result<Vec<String>, ApiError> {
    let list = match v {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(items)) => items
            .into_iter()
            .map(|i| match i {
                Value::String(s) => Ok(s),
                other => Err(ApiError::invalid(
                    "stop",
                    format!("stop must hold strings, not {}", kind_of(&other)),
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "stop must be a string or an array of strings, not {}",
                    kind_of(&other)
                ),
            ))
        }
    };
    if list.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "{} stop strings: at most {MAX_STOP_STRINGS} are allowed",
                list.len()
            ),
        ));
    }
    if let Some(s) = list
        .iter()
        .find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "stop string {s:?}: it must be 1 to {MAX_STOP_BYTES} bytes long ({} given)",
                s.len()
            ),
        ));
    }
    Ok(list)
}

/// Checks the `model` field. A request without one gets the served model (there is only one).
fn check_model(served: &Served, f: &mut Fields) -> Result<String, ApiError> {
    match f.take::<String>("model")? {
        Some(m) if !served.is(&m) => Err(model_not_found(&served.name, &m)),
        _ => Ok(served.name.clone()),
    }
}

fn model_not_found(ours: &str, requested: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("the model {requested:?} does not exist here: this daemon serves {ours:?}"),
    )
    .param("model")
    .code("model_not_found")
}

/// The model as `GET /v1/models` lists it. `created` is the model file's modification time
/// (stable across restarts); `model_id` is the DaisyChain model id, which every peer of the
/// swarm serving this model shares.
fn model_object(node: &Node) -> Value {
    let created = std::fs::metadata(&node.cfg.model)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_secs());
    json!({
        "id": model_name(node),
        "object": "model",
        "created": created,
        "owned_by": OWNED_BY,
        "model_id": node.model_id.to_string(),
        "max_model_len": node.model_cfg.max_positions,
        "num_layers": node.model_cfg.num_layers,
    })
}

fn tokenizer<'a>(served: &Served<'a>) -> Result<&'a Tokenizer, ApiError> {
    served.tokenizer.ok_or_else(|| {
        ApiError::bad_request(
            "this model has no tokenizer, and the OpenAI API needs one to return text: use POST /generate with prompt_ids",
        )
        .code("no_tokenizer")
    })
}

/// `prompt`: a string, an array of token ids, or a one-element array of either. A plain-text
/// prompt gets the tokenizer's special tokens (a BOS for the models that want one), as
/// `transformers`, vLLM and llama.cpp give it.
fn completion_prompt(tok: &Tokenizer, v: Option<Value>) -> Result<Vec<u32>, ApiError> {
    let encode = |text: &str| {
        tok.encode(text, true)
            .map_err(|e| ApiError::invalid("prompt", format!("tokenizing the prompt: {e}")))
    };
    let ids = |items: &[Value]| {
        items
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| ApiError::invalid("prompt", format!("{t} is not a token id")))
            })
            .collect::<Result<Vec<u32>, _>>()
    };
    match v {
        None => Err(ApiError::invalid("prompt", "prompt is required")),
        Some(Value::String(s)) => encode(&s),
        Some(Value::Array(items)) => match items.as_slice() {
            [] => Err(ApiError::invalid("prompt", "the prompt is empty")),
            [Value::String(s)] => encode(s),
            [Value::Array(inner)] => ids(inner),
            items if items.iter().all(Value::is_number) => ids(items),
            _ => Err(ApiError::unsupported(
                "prompt",
                "several prompts in one request are not supported (or the array mixes types): send one request per prompt",
            )),
        },
        Some(other) => Err(ApiError::invalid(
            "prompt",
            format!(
                "prompt must be a string or an array of token ids, not {}",
                kind_of(&other)
            ),
        )),
    }
}

/// `messages`, rendered with the model's chat template (with the assistant's turn opened) and
/// tokenized without added special tokens: the template writes those itself.
fn chat_prompt(served: &Served, tok: &Tokenizer, v: Option<Value>) -> Result<Vec<u32>, ApiError> {
    let template = served.chat.ok_or_else(|| {
        ApiError::bad_request(
            "this model has no chat template: use /v1/completions with a prompt you format yourself",
        )
        .param("messages")
        .code("no_chat_template")
    })?;
    let list = match v {
        None => return Err(ApiError::invalid("messages", "messages is required")),
        Some(Value::Array(list)) => list,
        Some(other) => {
            return Err(ApiError::invalid(
                "messages",
                format!("messages must be an array, not {}", kind_of(&other)),
            ))
        }
    };
    if list.is_empty() || list.len() > MAX_MESSAGES {
        return Err(ApiError::invalid(
            "messages",
            format!("{} messages: give 1 to {MAX_MESSAGES}", list.len()),
        ));
    }
    let messages = list
        .into_iter()
        .enumerate()
        .map(|(i, m)| message(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    let text = template.render(&messages, true).map_err(|e| {
        ApiError::invalid(
            "messages",
            format!("the model's chat template refused the conversation: {e}"),
        )
    })?;
    tok.encode(&text, false)
        .map_err(|e| ApiError::internal(format!("tokenizing the rendered conversation: {e}")))
}

/// One chat message: `role` and `content` (a string or an array of text parts).
fn message(i: usize, m: Value) -> Result<ChatMessage, ApiError> {
    let at = format!("messages[{i}]");
    let Value::Object(mut m) = m else {
        return Err(ApiError::invalid(
            &at,
            format!("{at} must be an object with role and content"),
        ));
    };
    let role = match m.remove("role") {
        Some(Value::String(r)) => r,
        _ => {
            return Err(ApiError::invalid(
                format!("{at}.role"),
                format!("{at}.role must be a string"),
            ))
        }
    };
    let role = match role.as_str() {
        "system" | "user" | "assistant" => role,
        // OpenAI's newer name for system instructions; chat templates know "system".
        "developer" => "system".to_string(),
        "tool" | "function" => {
            return Err(ApiError::unsupported(
                format!("{at}.role"),
                format!(
                    "{at}: {role} messages are not supported: this server does no tool calling"
                ),
            ))
        }
        other => {
            return Err(ApiError::invalid(
                format!("{at}.role"),
                format!("{at}: unknown role {other:?}: use system, user or assistant"),
            ))
        }
    };
    for key in ["tool_calls", "function_call", "audio"] {
        if m.get(key).is_some_and(|v| !v.is_null() && !is_empty(v)) {
            return Err(ApiError::unsupported(
                format!("{at}.{key}"),
                format!("{at}.{key} is not supported: this server does no tool calling and only handles text"),
            ));
        }
    }
    let content = match m.remove("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s,
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => texts.push(t.as_str()),
                    _ => {
                        return Err(ApiError::unsupported(
                            format!("{at}.content[{j}]"),
                            format!("{at}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": …}}) are supported"),
                        ))
                    }
                }
            }
            // Joined with newlines, as vLLM joins them for templates that take strings.
            texts.join("\n")
        }
        Some(other) => {
            return Err(ApiError::invalid(
                format!("{at}.content"),
                format!(
                    "{at}.content must be a string or an array of text parts, not {}",
                    kind_of(&other)
                ),
            ))
        }
    };
    Ok(ChatMessage::new(role, content))
}

/// Checks the prompt against the model and builds the generation request.
fn request(
    served: &Served,
    generation: GenerationId,
    prompt: Vec<u32>,
    p: &Params,
    param: &str,
) -> Result<GenerationRequest, ApiError> {
    let max = served.max_positions;
    if prompt.is_empty() {
        return Err(ApiError::invalid(param, "the prompt is empty"));
    }
    if prompt.len() >= max {
        return Err(ApiError::invalid(
            param,
            format!(
                "the prompt has {} tokens; this model has {max} positions, so at most {} fit with room for one new token",
                prompt.len(),
                max - 1
            ),
        )
        .code("context_length_exceeded"));
    }
    let vocab = served.vocab_size;
    if let Some(t) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid(
            param,
            format!("token id {t} is out of range (vocabulary of {vocab})"),
        ));
    }
    Ok(GenerationRequest {
        model_id: served.model_id,
        generation,
        prompt,
        max_new_tokens: p.max_tokens,
        sampling: p.sampling.to_wire(),
        stop_tokens: if p.ignore_eos {
            Vec::new()
        } else {
            served.eos.to_vec()
        },
        chunk: (served.chunk as u32).clamp(1, crate::stage::MAX_HOP_ROWS as u32),
        verify: dc_types::VerifyMode::Sampled(served.audit_rate),
        resume: Vec::new(),
        top_logprobs: p.top_logprobs,
        output: p.output.clone(),
        speculative: served.speculative,
    })
}

/// A started generation: one of the `--max-generations` permits and the head's events.
/// Dropping it drops the receiver, which the head notices at its next token: it then ends the
/// generation and frees the route's caches.
#[derive(Debug)]
struct Running {
    _permit: OwnedSemaphorePermit,
    events: mpsc::Receiver<GenerationEvent>,
    /// The event read while waiting for the start, handed out first.
    pending: Option<GenerationEvent>,
}

impl Running {
    /// Starts `req`, refusing while paused or full, and waits until the head has accepted it,
    /// so that a generation that cannot start is an HTTP error rather than a 200 with an
    /// error inside.
    async fn start(d: &Daemon, req: GenerationRequest) -> Result<Running, ApiError> {
        let node = &d.node;
        if node.paused() {
            return Err(ApiError::unavailable(
                "paused",
                "paused: the machine is busy with other work; try again later",
            ));
        }
        let Ok(permit) = node.generations.clone().try_acquire_owned() else {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                format!(
                    "already running {} generations; try again later",
                    node.cfg.max_generations
                ),
            )
            .code("too_many_generations"));
        };
        node.stats.requests.fetch_add(1, Ordering::Relaxed);
        let mut events = start_generation(d.clone(), req)
            .await
            .map_err(|e| ApiError::unavailable("no_route", e))?;
        let pending = match events.recv().await {
            Some(GenerationEvent::Failed { message }) => {
                return Err(ApiError::unavailable("no_route", message))
            }
            Some(GenerationEvent::Started { .. }) => None,
            Some(other) => Some(other),
            None => return Err(ApiError::internal("the generation ended before it started")),
        };
        Ok(Running {
            _permit: permit,
            events,
            pending,
        })
    }

    async fn next(&mut self) -> Option<GenerationEvent> {
        match self.pending.take() {
            Some(ev) => Some(ev),
            None => self.events.recv().await,
        }
    }
}

/// Finds the first stop string in text that arrives in pieces. It holds back the tail that
/// might still become a stop string, so streamed text never shows part of one.
///
/// Why searching only the held-back tail is enough: the tail kept is the *longest* suffix that
/// is a prefix of some stop string, so a match starting before it would have had a longer
/// such suffix (or would lie wholly in text already searched). The tail is shorter than the
/// longest stop string, so the memory is bounded by [`MAX_STOP_BYTES`] plus one piece.
#[derive(Debug, Default)]
struct StopScan {
    stops: Vec<String>,
    pending: String,
}

impl StopScan {
    fn new(stops: Vec<String>) -> StopScan {
        StopScan {
            stops,
            pending: String::new(),
        }
    }

    /// Adds a piece of text. Returns the text now safe to pass on and whether a stop string
    /// completed (the text then ends just before the earliest one; the rest is dropped).
    fn push(&mut self, piece: &str) -> (String, bool) {
        self.pending.push_str(piece);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        let keep = self.hold_back();
        let out = self.pending[..self.pending.len() - keep].to_string();
        self.pending.drain(..out.len());
        (out, false)
    }

    /// Bytes at the end of `pending` that are a proper prefix of some stop string (the
    /// longest such suffix, on a character boundary).
    fn hold_back(&self) -> usize {
        let text = &self.pending;
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let max = longest.saturating_sub(1).min(text.len());
        (1..=max)
            .rev()
            .find(|&k| {
                let at = text.len() - k;
                text.is_char_boundary(at) && self.stops.iter().any(|s| s.starts_with(&text[at..]))
            })
            .unwrap_or(0)
    }

    /// The held-back text, once the generation ended without completing a stop string.
    fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Why a choice ended, in OpenAI's words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached or the model's positions ran out.
    Length,
}

impl FinishReason {
    /// The reason for the head's `stop` ("stop": an end-of-sequence token or a complete JSON
    /// document; "length" or "context": out of room).
    fn of_head(stop: &str) -> FinishReason {
        if stop == "stop" {
            FinishReason::Stop
        } else {
            FinishReason::Length
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What one event means for the client.
#[derive(Debug)]
enum Step {
    /// More text (maybe empty).
    Text(String),
    /// The last text and why the choice ended.
    Finished(String, FinishReason),
    /// The whole text, which replaces all sent before (a correction changed tokens already
    /// decoded), and why the choice ended.
    Rewritten(String, FinishReason),
    /// The generation failed.
    Failed(String),
}

/// Turns the head's events into text: incremental detokenisation (special tokens skipped),
/// stop strings, the count of generated tokens and their log-probabilities.
#[derive(Debug)]
struct Output {
    tokenizer: Tokenizer,
    decoder: StreamDecoder,
    stops: StopScan,
    /// Whether the head corrected tokens it had sent (a proven liar's work).
    corrected: bool,
    completion_tokens: usize,
    /// Every token's log-probabilities so far, when asked for, and how many were handed out.
    logprobs: Vec<(u32, TokenLogprobs)>,
    logprobs_taken: usize,
    /// Where the next token's text starts in the choice's text (completions' `text_offset`).
    text_offset: usize,
}

impl Output {
    fn new(tok: &Tokenizer, stops: Vec<String>) -> Output {
        Output {
            tokenizer: tok.clone(),
            decoder: StreamDecoder::new(tok, true),
            stops: StopScan::new(stops),
            corrected: false,
            completion_tokens: 0,
            logprobs: Vec::new(),
            logprobs_taken: 0,
            text_offset: 0,
        }
    }

    /// The log-probabilities of the tokens not handed out yet, in `endpoint`'s shape (none
    /// when the request did not ask for them).
    fn take_logprobs(&mut self, endpoint: Endpoint, asked: bool) -> Option<Value> {
        if !asked {
            return None;
        }
        let new = &self.logprobs[self.logprobs_taken.min(self.logprobs.len())..];
        self.logprobs_taken = self.logprobs.len();
        Some(match endpoint {
            Endpoint::Chat => super::logprobs::chat(&self.tokenizer, new),
            Endpoint::Completion => {
                super::logprobs::completion(&self.tokenizer, new, &mut self.text_offset)
            }
        })
    }

    /// The whole text of the final `tokens` (the head's `stop` reason), cut at the first stop
    /// string.
    fn rewrite(&self, tokens: &[u32], stop: &str) -> Step {
        let full = match self.tokenizer.decode(tokens, true) {
            Ok(t) => t,
            Err(e) => return Step::Failed(format!("decoding the corrected tokens: {e}")),
        };
        let mut scan = StopScan::new(self.stops.stops.clone());
        match scan.push(&full) {
            (text, true) => Step::Rewritten(text, FinishReason::Stop),
            (mut text, false) => {
                text.push_str(&scan.flush());
                Step::Rewritten(text, FinishReason::of_head(stop))
            }
        }
    }

    fn on_event(&mut self, ev: GenerationEvent) -> Step {
        match ev {
            GenerationEvent::Started { .. } => Step::Text(String::new()),
            // OpenAI's protocol cannot take back streamed text (nor the log-probabilities sent
            // with it); the final `Done` carries the corrected tokens, and a non-streaming
            // answer is rewritten from them.
            GenerationEvent::Corrected {
                from,
                logprobs,
                tokens,
                ..
            } => {
                self.corrected = true;
                if logprobs.len() == tokens.len() && !logprobs.is_empty() {
                    self.logprobs.truncate(from as usize);
                    self.logprobs.extend(tokens.into_iter().zip(logprobs));
                }
                Step::Text(String::new())
            }
            GenerationEvent::Token { id, logprobs, .. } => {
                self.completion_tokens += 1;
                if let Some(lp) = logprobs {
                    self.logprobs.push((id, lp));
                }
                match self.decoder.push(id) {
                    Ok(piece) => match self.stops.push(&piece) {
                        (text, true) => Step::Finished(text, FinishReason::Stop),
                        (text, false) => Step::Text(text),
                    },
                    Err(e) => Step::Failed(format!("decoding token {id}: {e}")),
                }
            }
            GenerationEvent::Done { tokens, stop, .. } => {
                self.completion_tokens = tokens.len();
                if self.corrected {
                    return self.rewrite(&tokens, &stop);
                }
                let rest = match self.decoder.finish() {
                    Ok(r) => r,
                    Err(e) => return Step::Failed(format!("decoding the last tokens: {e}")),
                };
                let (mut text, hit) = self.stops.push(&rest);
                if hit {
                    return Step::Finished(text, FinishReason::Stop);
                }
                text.push_str(&self.stops.flush());
                Step::Finished(text, FinishReason::of_head(&stop))
            }
            GenerationEvent::Failed { message } => Step::Failed(message),
        }
    }
}

/// What every response and chunk of one generation repeats.
#[derive(Debug, Clone)]
struct Meta {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    fingerprint: String,
    prompt_tokens: usize,
    /// Whether the request asked for log-probabilities.
    logprobs: bool,
}

impl Meta {
    fn usage(&self, completion_tokens: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        })
    }

    fn response(
        &self,
        text: String,
        reason: FinishReason,
        completion_tokens: usize,
        logprobs: Option<Value>,
    ) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": reason.as_str(),
            }),
            Endpoint::Completion => json!({
                "index": 0,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": reason.as_str(),
            }),
        };
        json!({
            "id": self.id,
            "object": self.endpoint.object(),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": [choice],
            "usage": self.usage(completion_tokens),
        })
    }

    /// A streamed chunk: `delta` is the chat delta or the completion text, `logprobs` those
    /// of the tokens it carries.
    fn chunk(&self, delta: Value, reason: Option<FinishReason>, logprobs: Option<Value>) -> Event {
        let reason = reason.map(FinishReason::as_str);
        let choice = match self.endpoint {
            Endpoint::Chat => {
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason})
            }
            Endpoint::Completion => {
                json!({"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": reason})
            }
        };
        self.event(json!([choice]), None)
    }

    fn text_chunk(&self, text: String, logprobs: Option<Value>) -> Event {
        match self.endpoint {
            Endpoint::Chat => self.chunk(json!({"content": text}), None, logprobs),
            Endpoint::Completion => self.chunk(json!(text), None, logprobs),
        }
    }

    fn event(&self, choices: Value, usage: Option<Value>) -> Event {
        let mut v = json!({
            "id": self.id,
            "object": self.endpoint.chunk_object(),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        Event::default().data(v.to_string())
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Runs a generation and answers it, whole or streamed.
async fn generate(d: Daemon, t: Translated) -> Result<Response, ApiError> {
    let tok = tokenizer(&Served::of(&d.node))?.clone();
    let generation = t.request.generation;
    let prompt_tokens = t.request.prompt.len();
    let logprobs = t.request.top_logprobs.is_some();
    let run = Running::start(&d, t.request).await?;
    let meta = Meta {
        endpoint: t.endpoint,
        id: format!("{}{generation}", t.endpoint.id_prefix()),
        created: unix_now(),
        model: t.model,
        // OpenAI's field for "the backend configuration that affects determinism".
        fingerprint: format!(
            "dcd-{}-{}",
            env!("CARGO_PKG_VERSION"),
            d.node.model_id.short()
        ),
        prompt_tokens,
        logprobs,
    };
    let mut out = Output::new(&tok, t.stop);
    if t.stream {
        return Ok(stream(meta, run, out, t.include_usage));
    }
    let (text, reason, completion_tokens) = collect(run, &mut out).await?;
    let logprobs = out.take_logprobs(meta.endpoint, meta.logprobs);
    Ok(Json(meta.response(text, reason, completion_tokens, logprobs)).into_response())
}

/// Reads events until the choice ends. Returning drops `run`: a generation cut by a stop
/// string ends there.
async fn collect(
    mut run: Running,
    out: &mut Output,
) -> Result<(String, FinishReason, usize), ApiError> {
    let mut text = String::new();
    loop {
        let Some(ev) = run.next().await else {
            return Err(ApiError::internal(
                "the generation stopped without a result",
            ));
        };
        match out.on_event(ev) {
            Step::Text(t) => text.push_str(&t),
            Step::Finished(t, reason) => {
                text.push_str(&t);
                return Ok((text, reason, out.completion_tokens));
            }
            Step::Rewritten(t, reason) => return Ok((t, reason, out.completion_tokens)),
            Step::Failed(m) => return Err(ApiError::internal(m)),
        }
    }
}

/// Streams the choice as server-sent events: chunks, a last chunk with `finish_reason`, a
/// usage chunk when asked for, then `data: [DONE]`. A failure after the 200 went out is sent as
/// `data: {"error": …}`, which OpenAI's clients raise.
fn stream(meta: Meta, mut run: Running, mut out: Output, include_usage: bool) -> Response {
    let (tx, rx) = mpsc::channel::<Event>(SSE_QUEUE);
    tokio::spawn(async move {
        // Each send fails once the client went away; returning then drops `run`.
        if meta.endpoint == Endpoint::Chat
            && tx
                .send(meta.chunk(json!({"role": "assistant", "content": ""}), None, None))
                .await
                .is_err()
        {
            return;
        }
        loop {
            let step = match run.next().await {
                Some(ev) => out.on_event(ev),
                None => Step::Failed("the generation stopped without a result".into()),
            };
            // What was streamed stays: a stream cannot take text back.
            let rewritten = matches!(step, Step::Rewritten(..));
            match step {
                Step::Text(t) if t.is_empty() => {}
                // A chunk carries the log-probabilities of the tokens since the last one (text
                // held back for a possible stop string holds them back too).
                Step::Text(t) => {
                    let lp = out.take_logprobs(meta.endpoint, meta.logprobs);
                    if tx.send(meta.text_chunk(t, lp)).await.is_err() {
                        return;
                    }
                }
                Step::Finished(t, reason) | Step::Rewritten(t, reason) => {
                    let t = if rewritten { String::new() } else { t };
                    drop(run);
                    let lp = out.take_logprobs(meta.endpoint, meta.logprobs);
                    let last = match meta.endpoint {
                        Endpoint::Chat => meta.chunk(json!({}), Some(reason), lp),
                        Endpoint::Completion => meta.chunk(json!(""), Some(reason), lp),
                    };
                    if !t.is_empty() && tx.send(meta.text_chunk(t, None)).await.is_err() {
                        return;
                    }
                    if tx.send(last).await.is_err() {
                        return;
                    }
                    if include_usage {
                        let usage = meta.event(json!([]), Some(meta.usage(out.completion_tokens)));
                        if tx.send(usage).await.is_err() {
                            return;
                        }
                    }
                    let _ = tx.send(Event::default().data("[DONE]")).await;
                    return;
                }
                Step::Failed(m) => {
                    drop(run);
                    let body = ApiError::internal(m).body();
                    let _ = tx.send(Event::default().data(body.to_string())).await;
                    return;
                }
            }
        }
    });
    let events = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx))
    });
    // Keep-alive comments hold idle proxies open through a long prefill.
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

async fn completions(
    State(d): State<Daemon>,
    body: Result<Json<Value>, JsonRejection>,
) -> Response {
    answer(d, Endpoint::Completion, body).await
}

async fn chat_completions(
    State(d): State<Daemon>,
    body: Result<Json<Value>, JsonRejection>,
) -> Response {
    answer(d, Endpoint::Chat, body).await
}

/// Answers a generation endpoint's request.
async fn answer(
    d: Daemon,
    endpoint: Endpoint,
    body: Result<Json<Value>, JsonRejection>,
) -> Response {
    async {
        let Json(body) = body.map_err(|e| from_rejection(&e))?;
        let t = translate(&Served::of(&d.node), endpoint, body)?;
        generate(d.clone(), t).await
    }
    .await
    .unwrap_or_else(IntoResponse::into_response)
}

async fn models(State(d): State<Daemon>) -> Response {
    Json(json!({"object": "list", "data": [model_object(&d.node)]})).into_response()
}

async fn model(State(d): State<Daemon>, Path(name): Path<String>) -> Response {
    let served = Served::of(&d.node);
    if served.is(&name) {
        Json(model_object(&d.node)).into_response()
    } else {
        model_not_found(&served.name, &name).into_response()
    }
}

async fn wrong_method() -> Response {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "this method is not allowed here: the models are read with GET, completions made with POST",
    )
    .into_response()
}

async fn unknown_endpoint(uri: axum::http::Uri) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!(
            "no endpoint {}: this server has /v1/models, /v1/completions and /v1/chat/completions",
            uri.path()
        ),
    )
    .code("unknown_url")
    .into_response()
}

/// The `/v1/...` routes.
pub fn router() -> Router<Daemon> {
    Router::new()
        .route("/v1/models", get(models).fallback(wrong_method))
        .route("/v1/models/{model}", get(model).fallback(wrong_method))
        .route("/v1/completions", post(completions).fallback(wrong_method))
        .route(
            "/v1/chat/completions",
            post(chat_completions).fallback(wrong_method),
        )
        .route("/v1/{*rest}", any(unknown_endpoint))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A word-level tokenizer of four words, whose decoding joins them with spaces.
    fn words() -> Tokenizer {
        Tokenizer::from_json(
            r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
                "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
                "post_processor": null, "decoder": null,
                "model": {"type": "WordLevel", "unk_token": "[UNK]",
                          "vocab": {"red": 0, "blue": 1, "green": 2, "[UNK]": 3}}}"#,
        )
        .expect("a word-level tokenizer")
    }

    /// The steps of `out` for tokens `sent`, a correction from index 1 to `corrected`, and the
    /// end.
    fn steps_with_a_correction(out: &mut Output, sent: &[u32], corrected: &[u32]) -> Vec<Step> {
        let lp = |id: u32| TokenLogprobs {
            logprob: -(id as f32),
            top: vec![(id, -(id as f32))],
        };
        let mut events: Vec<GenerationEvent> = sent
            .iter()
            .enumerate()
            .map(|(i, &id)| GenerationEvent::Token {
                index: i as u32,
                id,
                logprobs: Some(lp(id)),
            })
            .collect();
        events.push(GenerationEvent::Corrected {
            from: 1,
            tokens: corrected.to_vec(),
            logprobs: corrected.iter().map(|&id| lp(id)).collect(),
            liar: "liar".into(),
        });
        let mut all = vec![sent[0]];
        all.extend_from_slice(corrected);
        events.push(GenerationEvent::Done {
            tokens: all,
            stop: "length".into(),
            final_logits: Default::default(),
        });
        events.into_iter().map(|ev| out.on_event(ev)).collect()
    }

    #[test]
    fn a_correction_rewrites_the_answer_and_its_log_probabilities() {
        let tok = words();
        let mut out = Output::new(&tok, Vec::new());
        let steps = steps_with_a_correction(&mut out, &[0, 1], &[2, 0]);
        match steps.last() {
            Some(Step::Rewritten(text, FinishReason::Length)) => {
                assert_eq!(text, &tok.decode(&[0, 2, 0], true).unwrap());
            }
            other => panic!("not rewritten: {other:?}"),
        }
        assert_eq!(out.completion_tokens, 3);
        let ids: Vec<u32> = out.logprobs.iter().map(|(id, _)| *id).collect();
        assert_eq!(
            ids,
            [0, 2, 0],
            "the log-probabilities follow the correction"
        );
        // A stop string in the corrected text cuts the rewritten one.
        let mut out = Output::new(&tok, vec!["green".into()]);
        let steps = steps_with_a_correction(&mut out, &[0, 1], &[2, 0]);
        match steps.last() {
            Some(Step::Rewritten(text, FinishReason::Stop)) => assert_eq!(text, "red "),
            other => panic!("not cut at the stop string: {other:?}"),
        }
    }

    fn scan(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut s = StopScan::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (t, hit) = s.push(p);
            out.push_str(&t);
            if hit {
                return (out, true);
            }
        }
        out.push_str(&s.flush());
        (out, false)
    }

    #[test]
    fn stop_string_split_across_pieces() {
        assert_eq!(
            scan(&["END"], &["hello E", "N", "D more"]),
            ("hello ".into(), true)
        );
    }

    #[test]
    fn earliest_of_several_stop_strings_wins() {
        assert_eq!(scan(&["zz", "b"], &["a", "bzz"]), ("a".into(), true));
        assert_eq!(
            scan(&["\n\n", "x"], &["one\n", "\ntwo"]),
            ("one".into(), true)
        );
    }

    #[test]
    fn a_partial_stop_string_is_released_at_the_end() {
        assert_eq!(scan(&["END"], &["the E", "N"]), ("the EN".into(), false));
        assert_eq!(scan(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn held_back_text_is_not_streamed_early() {
        let mut s = StopScan::new(vec!["abc".into()]);
        assert_eq!(s.push("xxab"), ("xx".into(), false));
        assert_eq!(s.push("d"), ("abd".into(), false));
        assert_eq!(s.push("a"), ("".into(), false));
        assert_eq!(s.push("bc!"), ("".into(), true));
    }

    #[test]
    fn hold_back_respects_character_boundaries() {
        // "é" is two bytes; the stop string starts with it.
        let mut s = StopScan::new(vec!["éa".into()]);
        assert_eq!(s.push("xé"), ("x".into(), false));
        assert_eq!(s.push("b"), ("éb".into(), false));
    }

    #[test]
    fn stop_strings_are_checked() {
        assert_eq!(stop_strings(None).ok(), Some(vec![]));
        assert_eq!(
            stop_strings(Some(json!("a"))).ok(),
            Some(vec!["a".to_string()])
        );
        assert!(stop_strings(Some(json!(["a", 1]))).is_err());
        assert!(stop_strings(Some(json!([""]))).is_err());
        assert!(stop_strings(Some(json!(["a", "b", "c", "d", "e"]))).is_err());
        assert!(stop_strings(Some(json!(3))).is_err());
    }

    #[test]
    fn wrong_types_name_their_parameter() {
        let mut f = Fields::new(json!({"max_tokens": "ten", "x": null})).expect("an object");
        let e = f
            .take::<u32>("max_tokens")
            .expect_err("a string is not a u32");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert_eq!(f.take::<u32>("x").ok(), Some(None));
        assert!(Fields::new(json!([1])).is_err());
    }

    #[test]
    fn unsupported_values_are_refused_and_harmless_ones_pass() {
        let mut f =
            Fields::new(json!({"n": 1, "logprobs": false, "tools": [], "presence_penalty": 0}))
                .expect("an object");
        assert!(refuse_unsupported(&mut f, Endpoint::Chat).is_ok());
        for (body, param) in [
            (json!({"n": 2}), "n"),
            (json!({"prediction": {"type": "content"}}), "prediction"),
            (json!({"tools": [{"type": "function"}]}), "tools"),
            (json!({"logit_bias": {"15": 3}}), "logit_bias"),
        ] {
            let mut f = Fields::new(body).expect("an object");
            let e = refuse_unsupported(&mut f, Endpoint::Chat).expect_err("unsupported");
            assert_eq!(e.param.as_deref(), Some(param));
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
        }
        let mut f = Fields::new(json!({"echo": true})).expect("an object");
        assert!(refuse_unsupported(&mut f, Endpoint::Completion).is_err());
    }

    #[test]
    fn response_format_asks_for_text_an_object_or_a_schema() {
        assert_eq!(output_asked(None).ok(), Some(OutputFormat::Text));
        assert_eq!(
            output_asked(Some(Value::Null)).ok(),
            Some(OutputFormat::Text)
        );
        assert_eq!(
            output_asked(Some(json!({"type": "text"}))).ok(),
            Some(OutputFormat::Text)
        );
        assert_eq!(
            output_asked(Some(json!({"type": "json_object"}))).ok(),
            Some(OutputFormat::JsonObject)
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "string"}}});
        assert_eq!(
            output_asked(Some(
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
            ))
            .ok(),
            Some(OutputFormat::JsonSchema(schema.to_string()))
        );
        for (bad, says) in [
            (json!({"type": "xml"}), "must be"),
            (json!("json_object"), "must be"),
            (json!({}), "must be"),
            (
                json!({"type": "json_schema", "json_schema": {"name": "x"}}),
                "missing",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": {"type": "object", "oneOf": []}}}),
                "oneOf",
            ),
        ] {
            let e = output_asked(Some(bad)).expect_err("not a format");
            assert_eq!(e.param.as_deref(), Some("response_format"));
            assert!(e.body().to_string().contains(says), "{}", e.body());
        }
    }

    #[test]
    fn log_probabilities_are_asked_as_each_endpoint_spells_it() {
        let asked = |body: Value, endpoint| {
            let mut f = Fields::new(body).expect("an object");
            logprobs_asked(&mut f, endpoint).map_err(|e| e.param)
        };
        assert_eq!(asked(json!({}), Endpoint::Chat), Ok(None));
        assert_eq!(asked(json!({"logprobs": false}), Endpoint::Chat), Ok(None));
        assert_eq!(
            asked(json!({"logprobs": true}), Endpoint::Chat),
            Ok(Some(0))
        );
        assert_eq!(
            asked(
                json!({"logprobs": true, "top_logprobs": 20}),
                Endpoint::Chat
            ),
            Ok(Some(20))
        );
        for body in [
            json!({"logprobs": true, "top_logprobs": 21}),
            json!({"top_logprobs": 2}),
            json!({"logprobs": false, "top_logprobs": 2}),
        ] {
            assert_eq!(
                asked(body, Endpoint::Chat),
                Err(Some("top_logprobs".into()))
            );
        }
        assert_eq!(
            asked(json!({"logprobs": 2}), Endpoint::Chat),
            Err(Some("logprobs".into()))
        );
        assert_eq!(
            asked(json!({"logprobs": 5}), Endpoint::Completion),
            Ok(Some(5))
        );
        assert_eq!(
            asked(json!({"logprobs": null}), Endpoint::Completion),
            Ok(None)
        );
        assert_eq!(
            asked(json!({"logprobs": 6}), Endpoint::Completion),
            Err(Some("logprobs".into()))
        );
    }

    #[test]
    fn chat_messages_accept_text_parts_and_refuse_tools() {
        let m = message(0, json!({"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}))
            .expect("text parts");
        assert_eq!(m, ChatMessage::new("system", "a\nb"));
        let e = message(1, json!({"role": "tool", "content": "x"})).expect_err("tool role");
        assert_eq!(e.param.as_deref(), Some("messages[1].role"));
        let e = message(
            2,
            json!({"role": "user", "content": [{"type": "image_url"}]}),
        )
        .expect_err("image part");
        assert_eq!(e.param.as_deref(), Some("messages[2].content[0]"));
        assert!(message(3, json!("hi")).is_err());
    }

    #[test]
    fn error_body_has_openai_shape() {
        let e = ApiError::unsupported("n", "no");
        assert_eq!(
            e.body(),
            json!({"error": {"message": "no", "type": "invalid_request_error", "param": "n", "code": "unsupported_parameter"}})
        );
    }
}
