//! Commands that talk to the swarm: `join` runs the daemon, `status` reads a daemon's status,
//! `generate --api` generates through a daemon's control API.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::cli::{GenerateArgs, Global, StatusArgs};
use crate::config::Resolved;

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

pub fn join(global: &Global, r: &Resolved) -> Result<ExitCode> {
    init_logging(global);
    for w in r.warnings() {
        tracing::warn!("{w}");
    }
    let s = &r.settings;
    let model = s.model.as_deref().context(
        "no model to serve: give --model M, set DCD_MODEL, or put model = \"M\" in the config file",
    )?;
    let data_dir = match &s.data_dir {
        Some(d) => d.clone(),
        None => dc_model::store::data_dir()?,
    };
    let model = dc_model::store::resolve_model(model, &data_dir)?;
    let cfg = s
        .node_config(model, data_dir)
        .map_err(|e| anyhow::anyhow!(e))?;
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

/// GETs the status document with `token` (if any), waiting at most `timeout`.
pub fn fetch_status_as(api: &str, token: Option<&str>, timeout: Duration) -> Result<Value> {
    let url = api_url(api, "/status");
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

pub fn status(a: &StatusArgs, r: &Resolved) -> Result<ExitCode> {
    let api = match &a.api {
        Some(u) if u.contains("://") => u.clone(),
        Some(addr) => format!("http://{addr}"),
        None => crate::config::api_url(r.settings.api),
    };
    let token = r.settings.api_token.as_deref();
    let s = fetch_status_as(&api, token, Duration::from_secs(10))?;
    if a.json {
        println!("{s}");
        return Ok(ExitCode::SUCCESS);
    }
    let once = a.once || !std::io::IsTerminal::is_terminal(&std::io::stdout());
    super::dashboard::run(&api, token, s, once)
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
    if let Some(v) = &a.verify {
        body["verify"] = json!(v);
    }
    if let Some(r) = a.audit_rate {
        body["audit_rate"] = json!(r);
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
    let mut corrections: Vec<Value> = Vec::new();
    // Every route the head tried: more than one when it recomputed without a peer.
    let mut routes: Vec<Value> = Vec::new();
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
                routes.push(ev["route"].clone());
                // A later route: the head went on without a peer it could not use (handing its
                // layers to another, or recomputing the generation) or without a proven liar;
                // tokens already sent come again only if they change.
                if routes.len() > 1 && !a.json {
                    let hops: Vec<String> = ev["route"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|h| {
                            let (layers, peer) = (h["layers"].as_str(), h["peer"].as_str());
                            format!("{}@{}", layers.unwrap_or("?"), peer.unwrap_or("?"))
                        })
                        .collect();
                    eprintln!("[the route changed: {}]", hops.join(" → "));
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
            Some("corrected") => {
                if !a.json {
                    writeln!(stdout)?;
                    writeln!(
                        stdout,
                        "[peer {} was proven to lie; corrected from token {}:]",
                        ev["liar"].as_str().unwrap_or("?"),
                        ev["from"]
                    )?;
                    match ev["text"].as_str() {
                        Some(t) => write!(stdout, "{t}")?,
                        None => write!(stdout, "{}", ev["tokens"])?,
                    }
                }
                corrections.push(ev.clone());
            }
            Some("done") => {
                if a.json {
                    let out = json!({
                        "prompt_ids": prompt_ids,
                        "tokens": ev["tokens"],
                        "text": ev["text"],
                        "stop": ev["stop"],
                        "final_logits": ev["final_logits"],
                        "corrections": corrections,
                        "routes": routes,
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

pub fn verify_proof(global: &Global, a: &crate::cli::VerifyProofArgs) -> Result<ExitCode> {
    use dc_model::{LoadOptions, Model};
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading {}", a.file.display()))?;
    let proof: dc_types::FraudProof = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a fraud proof", a.file.display()))?;
    let path = super::model_path(&crate::cli::ModelArg {
        model: a.model.clone(),
    })?;
    let data = dc_model::store::data_dir()?;
    let model_id = dc_types::ModelId(dc_model::identity::cached_model_id(&path, &data)?);
    let (cfg, _) = dc_model::open::open_source(&path)?;
    let layer = dc_node::check::proof::proof_layer(&proof);
    let model = match layer {
        Some(l) if (l as usize) < cfg.num_layers => Some(Model::load(
            &path,
            &LoadOptions {
                layers: Some(l as usize..l as usize + 1),
                head: false,
                cache_in: Some(data.clone()),
            },
        )?),
        Some(l) => bail!(
            "the proof names layer {l}, but the model has {}",
            cfg.num_layers
        ),
        None => None,
    };
    let gemm = super::engine(global)?;
    let verdict =
        dc_node::check::proof::verify_proof(&proof, model_id, &cfg, model.as_ref(), &gemm);
    let id = dc_node::check::proof::proof_id(&proof);
    if a.json {
        println!(
            "{}",
            json!({"valid": verdict.is_ok(), "proof_id": id.to_hex(), "accused": proof.accused, "reason": verdict.as_ref().err()})
        );
    } else {
        match &verdict {
            Ok(()) => println!(
                "valid: peer {} signed a wrong statement (proof {id}{})",
                proof.accused,
                layer
                    .map(|l| format!(", re-ran layer {l}"))
                    .unwrap_or_default()
            ),
            Err(e) => println!("invalid: {e}"),
        }
    }
    Ok(if verdict.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
