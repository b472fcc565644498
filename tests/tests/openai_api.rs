//! The OpenAI-compatible API and the metrics page of a real daemon serving SmolLM2: the
//! official `openai` Python client against `/v1` (tests/python/openai_client.py), malformed
//! and unsupported requests over raw HTTP (each an OpenAI-format error with the right status,
//! the daemon serving on afterwards), and `/metrics` as Prometheus text that counts the
//! tokens generated.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use dc_tests::*;
use serde_json::{json, Value};

/// The `openai` release CI installs (.ci/run); others work too.
const OPENAI_PIN: &str = "openai==3.57.0";
/// The independent JSON Schema validator the schema checks use (scripts/setup-tests.sh).
const JSONSCHEMA_PIN: &str = "jsonschema==4.26.0";

fn smollm2() -> PathBuf {
    dc_model::store::installed_smollm2()
        .expect("SmolLM2 is not installed: run scripts/fetch-model.sh")
}

/// An HTTP client that returns 4xx and 5xx answers instead of failing on them.
fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(600)))
        .build()
        .into()
}

/// Status and body (JSON, or the text as a JSON string when it is not JSON).
fn answer(r: Result<ureq::http::Response<ureq::Body>, ureq::Error>, what: &str) -> (u16, Value) {
    let mut r = r.unwrap_or_else(|e| panic!("{what}: no HTTP answer: {e}"));
    let status = r.status().as_u16();
    let text = r
        .body_mut()
        .with_config()
        .limit(64 << 20)
        .read_to_string()
        .unwrap();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, body)
}

fn post(api: &str, path: &str, content_type: Option<&str>, body: impl AsRef<[u8]>) -> (u16, Value) {
    let mut req = agent().post(format!("{api}{path}"));
    if let Some(ct) = content_type {
        req = req.header("Content-Type", ct);
    }
    answer(req.send(body.as_ref()), &format!("POST {path}"))
}

fn post_json(api: &str, path: &str, body: &Value) -> (u16, Value) {
    post(api, path, Some("application/json"), body.to_string())
}

fn get(api: &str, path: &str) -> (u16, Value) {
    answer(
        agent().get(format!("{api}{path}")).call(),
        &format!("GET {path}"),
    )
}

/// Asserts an OpenAI-format error with `status` (and `param` / `code` when given).
fn assert_error(
    what: &str,
    (status, body): (u16, Value),
    want: u16,
    param: Option<&str>,
    code: Option<&str>,
) {
    assert_eq!(status, want, "{what}: status; body {body}");
    let e = &body["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}: no error message in {body}"
    );
    assert!(e["type"].is_string(), "{what}: no error type in {body}");
    let keys: BTreeSet<&str> = e
        .as_object()
        .map(|o| o.keys().map(String::as_str).collect())
        .unwrap_or_default();
    assert_eq!(
        keys,
        BTreeSet::from(["message", "type", "param", "code"]),
        "{what}: OpenAI's error fields in {body}"
    );
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{what}: param in {body}");
    }
    if let Some(c) = code {
        assert_eq!(e["code"], c, "{what}: code in {body}");
    }
}

/// The daemon still answers: the models list and a two-token greedy completion.
fn assert_serving(api: &str, model: &str, after: &str) {
    let (status, body) = get(api, "/v1/models");
    assert_eq!(status, 200, "after {after}: GET /v1/models: {body}");
    let (status, body) = post_json(
        api,
        "/v1/completions",
        &json!({"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(status, 200, "after {after}: a completion: {body}");
    assert!(
        body["usage"]["completion_tokens"].as_u64() > Some(0),
        "{body}"
    );
}

/// A sample's labels and value.
type Sample = (BTreeMap<String, String>, f64);

/// One parsed exposition: samples by name, each with its labels.
#[derive(Debug, Default)]
struct Metrics {
    samples: BTreeMap<String, Vec<Sample>>,
    types: BTreeMap<String, String>,
}

impl Metrics {
    /// The value of an unlabelled sample.
    fn value(&self, name: &str) -> f64 {
        let s = self
            .samples
            .get(name)
            .unwrap_or_else(|| panic!("no sample {name}"));
        assert_eq!(s.len(), 1, "{name}: one sample expected, got {s:?}");
        s[0].1
    }
}

/// Parses the Prometheus text format strictly: `# HELP` / `# TYPE` lines, then samples
/// `name{label="value",…} number`, every sample of a declared family.
fn parse_metrics(text: &str) -> Metrics {
    let mut m = Metrics::default();
    let mut helped = BTreeSet::new();
    for line in text.lines() {
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').expect("HELP name text");
            assert!(!help.is_empty(), "empty help: {line}");
            helped.insert(name.to_string());
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("TYPE name kind");
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                "bad type: {line}"
            );
            m.types.insert(name.to_string(), kind.to_string());
            continue;
        }
        assert!(!line.starts_with('#'), "unknown comment line: {line}");
        let name_end = line
            .find(['{', ' '])
            .unwrap_or_else(|| panic!("no value: {line}"));
        let name = &line[..name_end];
        assert!(
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
                && !name.starts_with(|c: char| c.is_ascii_digit()),
            "bad metric name: {line}"
        );
        let mut rest = &line[name_end..];
        let mut labels = BTreeMap::new();
        if let Some(r) = rest.strip_prefix('{') {
            rest = r;
            loop {
                if let Some(r) = rest.strip_prefix('}') {
                    rest = r;
                    break;
                }
                let (key, r) = rest
                    .split_once("=\"")
                    .unwrap_or_else(|| panic!("label: {line}"));
                assert!(
                    key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                    "bad label name: {line}"
                );
                let mut value = String::new();
                let mut chars = r.char_indices();
                let end = loop {
                    match chars.next() {
                        Some((_, '\\')) => match chars.next() {
                            Some((_, 'n')) => value.push('\n'),
                            Some((_, c @ ('\\' | '"'))) => value.push(c),
                            other => panic!("bad escape {other:?}: {line}"),
                        },
                        Some((i, '"')) => break i,
                        Some((_, c)) => value.push(c),
                        None => panic!("unterminated label value: {line}"),
                    }
                };
                labels.insert(key.to_string(), value);
                rest = &r[end + 1..];
                rest = rest.strip_prefix(',').unwrap_or(rest);
            }
        }
        let value = rest
            .strip_prefix(' ')
            .unwrap_or_else(|| panic!("no space before the value: {line}"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            "NaN" => f64::NAN,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("value {v:?} is not a number: {line}")),
        };
        assert!(
            m.types.contains_key(name) && helped.contains(name),
            "sample of an undeclared family: {line}"
        );
        m.samples
            .entry(name.to_string())
            .or_default()
            .push((labels, value));
    }
    m
}

fn metrics(api: &str) -> Metrics {
    let mut r = agent().get(format!("{api}/metrics")).call().unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let ct = r
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    assert!(ct.starts_with("text/plain"), "content type {ct}");
    let text = r.body_mut().read_to_string().unwrap();
    parse_metrics(&text)
}

fn check_metrics_shape(m: &Metrics, num_layers: usize) {
    for (name, kind) in [
        ("dcd_tokens_generated_total", "counter"),
        ("dcd_hops_served_total", "counter"),
        ("dcd_positions_served_total", "counter"),
        ("dcd_generation_requests_total", "counter"),
        ("dcd_active_generations", "gauge"),
        ("dcd_peers", "gauge"),
        ("dcd_layers_served", "gauge"),
        ("dcd_layer_coverage", "gauge"),
        ("dcd_weights_bytes", "gauge"),
        ("dcd_kv_cache_bytes", "gauge"),
        ("dcd_memory_budget_bytes", "gauge"),
        ("dcd_uptime_seconds", "gauge"),
        ("dcd_paused", "gauge"),
    ] {
        assert_eq!(m.types.get(name).map(String::as_str), Some(kind), "{name}");
    }
    for name in m.types.keys() {
        assert!(name.starts_with("dcd_"), "{name} is not prefixed dcd_");
    }
    assert_eq!(m.value("dcd_layers_served"), num_layers as f64);
    assert_eq!(m.value("dcd_paused"), 0.0);
    assert!(m.value("dcd_weights_bytes") > 0.0);
    assert!(m.value("dcd_uptime_seconds") >= 0.0);
    let coverage = &m.samples["dcd_layer_coverage"];
    let layers: BTreeSet<String> = coverage.iter().map(|(l, _)| l["layer"].clone()).collect();
    assert_eq!(
        layers,
        (0..num_layers)
            .map(|l| l.to_string())
            .collect::<BTreeSet<_>>()
    );
    assert!(
        coverage.iter().all(|(_, v)| *v == 1.0),
        "one daemon covers every layer once: {coverage:?}"
    );
    let peers: BTreeSet<String> = m.samples["dcd_peers"]
        .iter()
        .map(|(l, _)| l["state"].clone())
        .collect();
    assert_eq!(
        peers,
        BTreeSet::from(["loading", "serving", "moving", "leaving"].map(String::from))
    );
    // No budget was set: the family is declared without a sample.
    assert!(!m.samples.contains_key("dcd_memory_budget_bytes"));
}

/// Runs the Python client checks; returns its summary.
fn run_python_client(api: &str, model_name: &str, model: &Path) -> Value {
    let have = Command::new("python3")
        .args(["-c", "import openai, jsonschema"])
        .output()
        .expect("python3 is needed for this test");
    assert!(
        have.status.success(),
        "the Python packages openai and jsonschema are needed: scripts/setup-tests.sh installs \
         {OPENAI_PIN} and {JSONSCHEMA_PIN} ({})",
        String::from_utf8_lossy(&have.stderr).trim()
    );
    // The chat prompt as the model's own template renders it, so that the script can compare
    // a chat completion with a completion of these exact ids.
    let messages = json!([
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]);
    let (tok, chat, _) = dc_model::tokenizer::load_for_model(model).unwrap();
    let chat_msgs: Vec<_> = messages
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            dc_model::tokenizer::ChatMessage::new(
                m["role"].as_str().unwrap(),
                m["content"].as_str().unwrap(),
            )
        })
        .collect();
    let rendered = chat
        .expect("SmolLM2 has a chat template")
        .render(&chat_msgs, true)
        .unwrap();
    let ids = tok.encode(&rendered, false).unwrap();
    let cfg = json!({
        "api": api,
        "model": model_name,
        "chat_messages": messages,
        "chat_prompt_ids": ids,
    });
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/openai_client.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(cfg.to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let summary: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!(
            "{} printed no JSON summary ({e}; {}): stdout {stdout}; stderr {stderr}",
            script.display(),
            out.status
        )
    });
    let failed: Vec<&Value> = summary["checks"]
        .as_array()
        .map(|c| c.iter().filter(|c| c["ok"] != true).collect())
        .unwrap_or_default();
    assert!(
        out.status.success() && summary["ok"] == true && failed.is_empty(),
        "the openai client checks failed ({}): {}\nstderr: {stderr}",
        out.status,
        serde_json::to_string_pretty(&failed).unwrap()
    );
    summary
}

/// Every check the script must have run (a script that skipped some would pass otherwise).
const PYTHON_CHECKS: &[&str] = &[
    "models.list names the model",
    "model has owned_by",
    "model has the DaisyChain model id",
    "chat greedy is deterministic",
    "chat stream equals non-streaming",
    "chat stream usage",
    "chat equals completion of the rendered template",
    "completion greedy is deterministic",
    "completion stream equals non-streaming",
    "completion usage adds up",
    "max_tokens gives finish_reason length",
    "max_tokens bounds completion_tokens",
    "stop cuts the text",
    "stop gives finish_reason stop",
    "stop while streaming",
    "chat stop",
    "seed reproduces",
    "seed reproduces when streaming",
    "different seeds sample differently",
    "penalties reproduce when streaming",
    "penalties change a repetitive text",
    "chat logprobs change nothing else",
    "chat logprobs: one per token",
    "chat logprobs are log-probabilities",
    "chat top_logprobs are sorted",
    "greedy picks the best of top_logprobs",
    "chat logprobs when streaming",
    "completion logprobs: one per token",
    "completion logprobs spell the text",
    "completion logprobs are log-probabilities",
    "completion text_offset",
    "json_object: every answer is one JSON object",
    "json_object: a tight budget still closes the document",
    "json_object when streaming",
    "json_schema: every answer validates",
    "json_schema: within max_tokens",
    "json_schema when streaming",
    "json_schema: what cannot be enforced is refused",
    "json_schema: a budget too small for any document is refused",
    "n=2 is refused",
    "unknown model is refused",
    "tools are refused",
    "hang up mid-stream",
    "serves after a hang-up",
];

/// Bad requests over raw HTTP: each gets the right status and an OpenAI-format error, and the
/// daemon answers normally right after.
fn bad_requests(api: &str, model: &str, max_positions: usize) {
    let chat = "/v1/chat/completions";
    let comp = "/v1/completions";
    let msgs = json!([{"role": "user", "content": "hi"}]);

    let r = post(
        api,
        comp,
        Some("application/json"),
        "{\"model\": \"x\", \"prompt\": ",
    );
    assert_error("malformed JSON", r, 400, None, None);
    assert_serving(api, model, "malformed JSON");

    let r = post(api, chat, Some("application/json"), "[1, 2]");
    assert_error("a body that is not an object", r, 400, None, None);

    let r = post_json(api, comp, &json!({"prompt": "hi", "max_tokens": "ten"}));
    assert_error("max_tokens as a string", r, 400, Some("max_tokens"), None);
    let r = post_json(api, chat, &json!({"messages": "hi"}));
    assert_error("messages as a string", r, 400, Some("messages"), None);
    let r = post_json(api, chat, &json!({"messages": msgs, "temperature": "hot"}));
    assert_error("temperature as a string", r, 400, Some("temperature"), None);
    let r = post_json(
        api,
        chat,
        &json!({"messages": [{"role": "user", "content": 5}]}),
    );
    assert_error(
        "content as a number",
        r,
        400,
        Some("messages[0].content"),
        None,
    );
    let r = post_json(api, comp, &json!({"prompt": "hi", "stop": [1]}));
    assert_error("stop as numbers", r, 400, Some("stop"), None);
    assert_serving(api, model, "wrong types");

    let r = post_json(api, comp, &json!({"prompt": "hi", "temperature": 5}));
    assert_error(
        "temperature out of range",
        r,
        400,
        Some("temperature"),
        None,
    );
    for (body, param) in [
        (
            json!({"prompt": "hi", "presence_penalty": 2.5}),
            "presence_penalty",
        ),
        (
            json!({"prompt": "hi", "frequency_penalty": -3}),
            "frequency_penalty",
        ),
        (json!({"prompt": "hi", "min_p": 1.5}), "min_p"),
        (
            json!({"prompt": "hi", "repetition_penalty": 0}),
            "repetition_penalty",
        ),
        (
            json!({"prompt": "hi", "presence_penalty": "high"}),
            "presence_penalty",
        ),
    ] {
        let r = post_json(api, comp, &body);
        assert_error(&format!("{param} out of range"), r, 400, Some(param), None);
    }
    for (endpoint, body, param) in [
        (
            chat,
            json!({"messages": msgs, "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            chat,
            json!({"messages": msgs, "top_logprobs": 2}),
            "top_logprobs",
        ),
        (comp, json!({"prompt": "hi", "logprobs": 6}), "logprobs"),
    ] {
        let r = post_json(api, endpoint, &body);
        assert_error(&format!("{param} out of range"), r, 400, Some(param), None);
    }
    let r = post_json(api, comp, &json!({"prompt": "hi", "max_tokens": 0}));
    assert_error("max_tokens 0", r, 400, Some("max_tokens"), None);
    let r = post_json(api, comp, &json!({"prompt": []}));
    assert_error("an empty prompt", r, 400, Some("prompt"), None);
    let r = post_json(api, comp, &json!({"prompt": vec![1u32; max_positions]}));
    assert_error(
        "a prompt longer than the context",
        r,
        400,
        Some("prompt"),
        Some("context_length_exceeded"),
    );
    let r = post_json(api, comp, &json!({"prompt": [1, 99999999]}));
    assert_error("a token id out of range", r, 400, Some("prompt"), None);
    let r = post_json(api, chat, &json!({"messages": []}));
    assert_error("no messages", r, 400, Some("messages"), None);

    let r = post_json(api, comp, &json!({"model": "gpt-4o", "prompt": "hi"}));
    assert_error(
        "unknown model",
        r,
        404,
        Some("model"),
        Some("model_not_found"),
    );
    let r = get(api, "/v1/models/gpt-4o");
    assert_error(
        "unknown model by path",
        r,
        404,
        None,
        Some("model_not_found"),
    );
    assert_serving(api, model, "unknown model");

    // Over the 1 MiB body limit.
    let big = json!({"model": model, "prompt": "a".repeat(1_200_000)}).to_string();
    let r = post(api, comp, Some("application/json"), big);
    assert_error("an oversized body", r, 413, None, Some("request_too_large"));
    assert_serving(api, model, "an oversized body");

    for (body, param) in [
        (json!({"messages": msgs, "n": 2}), "n"),
        (
            json!({"messages": msgs, "prediction": {"type": "content", "content": "x"}}),
            "prediction",
        ),
        (
            json!({"messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tools",
        ),
        (
            json!({"messages": msgs, "logit_bias": {"42": 10}}),
            "logit_bias",
        ),
    ] {
        let r = post_json(api, chat, &body);
        assert_error(
            &format!("unsupported {param}"),
            r,
            400,
            Some(param),
            Some("unsupported_parameter"),
        );
    }
    let r = post_json(api, comp, &json!({"prompt": "hi", "n": 2}));
    assert_error(
        "completions n=2",
        r,
        400,
        Some("n"),
        Some("unsupported_parameter"),
    );
    let r = post_json(api, comp, &json!({"prompt": ["a", "b"]}));
    assert_error("batched prompts", r, 400, Some("prompt"), None);
    let r = post_json(
        api,
        chat,
        &json!({"messages": [{"role": "tool", "content": "x"}]}),
    );
    assert_error("a tool message", r, 400, Some("messages[0].role"), None);
    assert_serving(api, model, "unsupported parameters");

    let r = post(api, comp, None, json!({"prompt": "hi"}).to_string());
    assert_error("no content type", r, 415, None, None);
    let r = post(
        api,
        comp,
        Some("text/plain"),
        json!({"prompt": "hi"}).to_string(),
    );
    assert_error("text/plain", r, 415, None, None);
    let r = get(api, comp);
    assert_error("GET on a POST endpoint", r, 405, None, None);
    let r = post_json(api, "/v1/embeddings", &json!({"input": "hi"}));
    assert_error("an unknown endpoint", r, 404, None, None);
    assert_serving(api, model, "wrong methods and paths");
}

#[test]
fn openai_api_with_the_python_client_bad_requests_and_metrics() {
    let model = smollm2();
    let (cfg, _) = dc_model::open::open_source(&model).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "a", &model, &["--layers", "0..30"]);
    let api = d.api.clone();

    // The served model's name comes from the file name.
    let (status, models) = get(&api, "/v1/models");
    assert_eq!(status, 200, "{models}");
    let name = models["data"][0]["id"].as_str().unwrap().to_string();
    let stem = model.file_name().unwrap().to_str().unwrap();
    assert_eq!(name, stem.strip_suffix(".gguf").unwrap_or(stem));
    assert_eq!(
        models["data"][0]["model_id"],
        d.status()["model_id"],
        "{models}"
    );

    let before = metrics(&api);
    check_metrics_shape(&before, cfg.num_layers);

    let summary = run_python_client(&api, &name, &model);
    let ran: BTreeSet<&str> = summary["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    for want in PYTHON_CHECKS {
        assert!(ran.contains(want), "the script did not run check {want:?}");
    }

    // Counters moved by what the script generated; a last greedy completion of a known
    // length moves tokens by at least its count.
    let mid = metrics(&api);
    assert!(
        mid.value("dcd_tokens_generated_total") > before.value("dcd_tokens_generated_total"),
        "tokens generated did not increase"
    );
    let (status, body) = post_json(
        &api,
        "/v1/completions",
        &json!({"model": name, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 4, "{body}");
    let after = metrics(&api);
    check_metrics_shape(&after, cfg.num_layers);
    assert!(
        after.value("dcd_tokens_generated_total") >= mid.value("dcd_tokens_generated_total") + 4.0
    );
    assert!(
        after.value("dcd_generation_requests_total")
            > before.value("dcd_generation_requests_total")
    );
    assert!(after.value("dcd_hops_served_total") > before.value("dcd_hops_served_total"));
    assert!(after.value("dcd_positions_served_total") > before.value("dcd_positions_served_total"));

    bad_requests(&api, &name, cfg.max_positions);

    // Generations cut by a stop string or a client that hung up are over: nothing active, no
    // KV cache left.
    wait_until("generations to end", Duration::from_secs(30), || {
        let s = d.status();
        s["generations"]["active"] == 0 && s["memory"]["kv_caches"] == 0
    });
    let m = metrics(&api);
    assert_eq!(m.value("dcd_active_generations"), 0.0);
    assert_eq!(m.value("dcd_kv_cache_bytes"), 0.0);
    d.leave();
}

/// Opens a streamed completion on a raw connection and reads until its first text chunk; the
/// generation goes on while the connection is held.
fn open_stream(api: &str, body: &Value) -> BufReader<TcpStream> {
    let addr = api.strip_prefix("http://").unwrap();
    let mut conn = TcpStream::connect(addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    let body = body.to_string();
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reader = BufReader::new(conn);
    let mut head = String::new();
    reader.read_line(&mut head).unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "stream refused: {head}");
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "the stream ended early"
        );
        if line.starts_with("data: {") && line.contains("\"text\"") {
            return reader;
        }
    }
}

/// With every generation slot taken a request gets 429 (OpenAI's format, with Retry-After);
/// a streaming client that hangs up frees its slot and the generation ends everywhere.
#[test]
fn a_full_daemon_says_429_and_a_hung_up_stream_frees_its_slot() {
    let model = smollm2();
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(
        dir.path(),
        "busy",
        &model,
        &["--layers", "0..30", "--max-generations", "1"],
    );
    let api = d.api.clone();
    // Thousands of tokens past any end-of-sequence: it runs until the client hangs up.
    let long = json!({"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": true,
                      "temperature": 0, "stream": true});
    let small = json!({"prompt": "Hello", "max_tokens": 2, "temperature": 0});
    let stream = open_stream(&api, &long);

    let mut r = agent()
        .post(format!("{api}/v1/completions"))
        .header("Content-Type", "application/json")
        .send(small.to_string())
        .unwrap();
    let retry = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let status = r.status().as_u16();
    let body: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
    assert_error(
        "a request while the only slot is taken",
        (status, body.clone()),
        429,
        None,
        Some("too_many_generations"),
    );
    assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
    assert!(retry.is_some(), "429 without Retry-After");
    assert_eq!(d.status()["generations"]["active"], 1);

    drop(stream);
    wait_until(
        "the hung-up stream to free its slot",
        Duration::from_secs(30),
        || post_json(&api, "/v1/completions", &small).0 == 200,
    );
    wait_until("the generation to end", Duration::from_secs(30), || {
        let s = d.status();
        s["generations"]["active"] == 0 && s["memory"]["kv_caches"] == 0
    });
    // The abandoned generation stopped soon after the hang-up, far from its 4000 tokens.
    let tokens = metrics(&api).value("dcd_tokens_generated_total");
    assert!(tokens < 1000.0, "{tokens} tokens: the generation ran on");
    d.leave();
}
