//! Commands that talk to the swarm: `join` runs the daemon, `status` reads a daemon's status,
//! `generate --api` generates through a daemon's control API.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use dc_kernels::Kernel;
use dc_node::{LayerChoice, NodeConfig};
use serde_json::{json, Value};

use super::{default_threads, model_path};
use crate::cli::{GenerateArgs, Global, JoinArgs, ModelArg, StatusArgs};

fn init_logging(global: &Global) {
    let level = match (global.quiet, global.verbose) {
        (true, _) => "warn",
        (false, 0) => "info,libp2p=warn,libp2p_gossipsub=error",
        (false, 1) => "debug,libp2p=info",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("DCD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

fn secs(v: f64, what: &str) -> Result<Duration> {
    if !(0.05..=3600.0).contains(&v) {
        bail!("{what} must be between 0.05 and 3600 seconds, got {v}");
    }
    Ok(Duration::from_secs_f64(v))
}

pub fn join(global: &Global, a: &JoinArgs) -> Result<ExitCode> {
    init_logging(global);
    let model = model_path(&ModelArg {
        model: a.model.model.clone(),
    })?;
    let data_dir = match &a.data_dir {
        Some(d) => d.clone(),
        None => dc_model::store::data_dir()?,
    };
    let mut cfg = NodeConfig::new(model, data_dir);
    cfg.layers = if a.layers.trim() == "auto" {
        LayerChoice::Auto
    } else {
        LayerChoice::Fixed(
            a.layers
                .parse()
                .map_err(|e: String| anyhow::anyhow!("--layers: {e}"))?,
        )
    };
    cfg.head = !a.no_head;
    if !a.listen.is_empty() {
        cfg.listen = a
            .listen
            .iter()
            .map(|s| {
                s.parse()
                    .with_context(|| format!("--listen {s:?} is not a multiaddr"))
            })
            .collect::<Result<_>>()?;
    }
    cfg.bootstrap = a
        .bootstrap
        .iter()
        .map(|s| {
            s.parse()
                .with_context(|| format!("--bootstrap {s:?} is not a multiaddr"))
        })
        .collect::<Result<_>>()?;
    cfg.mdns = !a.no_mdns;
    cfg.api = a.api;
    cfg.api_token = a.api_token.clone().filter(|t| !t.is_empty());
    cfg.max_memory = match &a.max_memory {
        Some(s) => {
            Some(dc_node::memory::parse_size(s).map_err(|e| anyhow::anyhow!("--max-memory: {e}"))?)
        }
        None => None,
    };
    cfg.kernel = Kernel::parse(&global.kernel).context("--kernel / DCD_KERNEL")?;
    cfg.threads = global.threads.unwrap_or_else(default_threads);
    if a.max_generations == 0 || a.max_generations > 1024 {
        bail!("--max-generations must be 1 to 1024");
    }
    cfg.max_generations = a.max_generations;
    cfg.announce_every = secs(a.announce_secs, "--announce-secs")?;
    cfg.peer_timeout = cfg.announce_every * 5;
    cfg.discovery_wait = cfg.announce_every + Duration::from_millis(500);
    cfg.rebalance_every = secs(a.rebalance_secs, "--rebalance-secs")?;
    cfg.selftest = !a.no_selftest;
    if !(1 << 16..=1 << 30).contains(&a.max_message_bytes) {
        bail!("--max-message-bytes must be between 64 KiB and 1 GiB");
    }
    cfg.max_message_bytes = a.max_message_bytes;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(dc_node::run(cfg))
        .map_err(|e| anyhow::anyhow!(e))?;
    Ok(ExitCode::SUCCESS)
}

fn agent(timeout: Option<Duration>) -> ureq::Agent {
    ureq::config::Config::builder()
        .http_status_as_error(false)
        .timeout_global(timeout)
        .build()
        .new_agent()
}

fn api_url(base: &str, path: &str) -> String {
    format!("{}{path}", base.trim_end_matches('/'))
}

fn with_token<B>(req: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
    match std::env::var("DCD_API_TOKEN") {
        Ok(t) if !t.is_empty() => req.header("Authorization", &format!("Bearer {t}")),
        _ => req,
    }
}

/// GETs the status document.
pub fn fetch_status(api: &str) -> Result<Value> {
    let url = api_url(api, "/status");
    let mut resp = with_token(agent(Some(Duration::from_secs(10))).get(&url))
        .call()
        .with_context(|| {
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

pub fn status(a: &StatusArgs) -> Result<ExitCode> {
    let s = fetch_status(&a.api)?;
    if a.json {
        println!("{s}");
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "peer {} ({})",
        s["peer_id"].as_str().unwrap_or("?"),
        s["state"].as_str().unwrap_or("?")
    );
    println!(
        "model {} (id {})",
        s["model"].as_str().unwrap_or("?"),
        s["model_id"].as_str().unwrap_or("?")
    );
    println!(
        "layers {} of {}, head: {}",
        s["layers"].as_str().unwrap_or("-"),
        s["num_layers"],
        s["head"]
    );
    println!("coverage {}", s["coverage"]);
    for p in s["peers"].as_array().into_iter().flatten() {
        println!(
            "  peer {} layers {} head {} {}",
            p["peer_id"].as_str().unwrap_or("?"),
            p["layers"].as_str().unwrap_or("-"),
            p["head"],
            p["state"].as_str().unwrap_or("?")
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub fn generate_api(a: &GenerateArgs, api: &str) -> Result<ExitCode> {
    let mut body = json!({
        "max_new_tokens": a.max_new_tokens,
        "temperature": a.temperature,
        "seed": a.seed,
        "ignore_eos": a.ignore_eos,
        "chunk": a.chunk,
    });
    match (&a.prompt, &a.prompt_ids) {
        (Some(p), _) => body["prompt"] = json!(p),
        (None, Some(ids)) => body["prompt_ids"] = json!(ids),
        (None, None) => bail!("give --prompt or --prompt-ids"),
    }
    if let Some(k) = a.top_k {
        body["top_k"] = json!(k);
    }
    if let Some(p) = a.top_p {
        body["top_p"] = json!(p);
    }
    let url = api_url(api, "/generate");
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
    let mut stdout = std::io::stdout().lock();
    let mut prompt_ids = a
        .prompt_ids
        .clone()
        .map(|v| json!(v))
        .unwrap_or(Value::Null);
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            bail!("the daemon closed the stream before the generation finished");
        }
        let ev: Value =
            serde_json::from_str(line.trim()).with_context(|| format!("bad event {line:?}"))?;
        match ev["event"].as_str() {
            Some("started") => {
                if let Some(p) = ev.get("prompt_ids") {
                    prompt_ids = p.clone();
                }
            }
            Some("token") if !a.json => {
                match ev["text"].as_str() {
                    Some(t) => write!(stdout, "{t}")?,
                    None => write!(stdout, "{} ", ev["id"])?,
                }
                stdout.flush()?;
            }
            Some("token") => {}
            Some("done") => {
                if a.json {
                    let out = json!({
                        "prompt_ids": prompt_ids,
                        "tokens": ev["tokens"],
                        "text": ev["text"],
                        "stop": ev["stop"],
                        "final_logits": ev["final_logits"],
                    });
                    writeln!(stdout, "{out}")?;
                } else {
                    writeln!(stdout)?;
                }
                return Ok(ExitCode::SUCCESS);
            }
            Some("error") => bail!(
                "generation failed: {}",
                ev["message"].as_str().unwrap_or("?")
            ),
            _ => bail!("unexpected event {line:?}"),
        }
    }
}
