//! The HTTP client of a daemon's control API: the agent, URLs, the bearer token and the
//! `/status` document. It only speaks HTTP and JSON; what a command prints is the command's
//! business, so this module imports no other command module.

use std::io::{BufRead, BufReader, Read};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// An HTTP agent that hands back error statuses as answers (the caller reads the daemon's
/// error body) and waits at most `timeout` for a whole exchange.
pub fn agent(timeout: Option<Duration>) -> ureq::Agent {
    ureq::config::Config::builder()
        .http_status_as_error(false)
        .timeout_global(timeout)
        .build()
        .new_agent()
}

/// `path` on the control API at `base` (with or without a trailing slash).
pub fn url(base: &str, path: &str) -> String {
    format!("{}{path}", base.trim_end_matches('/'))
}

/// `req` with the `DCD_API_TOKEN` bearer token, when one is set.
pub fn with_token<B>(req: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
    match std::env::var("DCD_API_TOKEN") {
        Ok(t) if !t.is_empty() => req.header("Authorization", &format!("Bearer {t}")),
        _ => req,
    }
}

/// GETs the status document with `token` (if any), waiting at most `timeout`.
pub fn fetch_status_as(api: &str, token: Option<&str>, timeout: Duration) -> Result<Value> {
    let url = url(api, "/status");
    let mut req = agent(Some(timeout)).get(&url);
    if let Some(t) = token.filter(|t| !t.is_empty()) {
        req = req.header("Authorization", &format!("Bearer {t}"));
    }
    let mut resp = req.call().with_context(|| {
        format!("no daemon answers at {api}; start one with `dcd join --model <model>`")
    })?;
    let text = resp
        .body_mut()
        .read_to_string()
        .context("reading the status")?;
    if !resp.status().is_success() {
        bail!("{url}: {} {text}", resp.status());
    }
    serde_json::from_str(&text).context("the status is not JSON")
}

/// POSTs the JSON `body` to `path` and hands back the answer's stream of lines. No timeout:
/// a generation streams for as long as it runs. An error status becomes an error carrying
/// the daemon's own message when its body has one.
pub fn post_stream(api: &str, path: &str, body: &Value) -> Result<impl BufRead> {
    let url = url(api, path);
    let resp = with_token(
        agent(None)
            .post(&url)
            .header("Content-Type", "application/json"),
    )
    .send(body.to_string())
    .with_context(|| format!("no daemon answers at {api}"))?;
    let status = resp.status();
    let mut reader = BufReader::new(resp.into_body().into_reader());
    if !status.is_success() {
        let mut text = String::new();
        reader.read_to_string(&mut text)?;
        let msg = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
            .unwrap_or(text);
        bail!("{url}: {status}: {msg}");
    }
    Ok(reader)
}
