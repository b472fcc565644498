//! Commands that talk to the swarm: `join` runs the daemon, `status` reads a daemon's status,
//! `generate --api` generates through a daemon's control API.

use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::client;
use super::timing::TokenClock;
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
    // A model id: the model's files come from peers into the store folder of that id.
    let fetch = dc_kernels::Commitment::from_hex(model).map(dc_types::ModelId);
    let model = match fetch {
        Some(id) => dc_model::store::models_dir(&data_dir).join(id.0.to_hex()),
        None => dc_model::store::resolve_model(model, &data_dir)?,
    };
    let mut cfg = s
        .node_config(model, data_dir)
        .map_err(|e| anyhow::anyhow!(e))?;
    cfg.fetch = fetch;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(dc_node::run(cfg))
        .map_err(|e| anyhow::anyhow!(e))?;
    Ok(ExitCode::SUCCESS)
}

pub fn status(a: &StatusArgs, r: &Resolved) -> Result<ExitCode> {
    let api = match &a.api {
        Some(u) if u.contains("://") => u.clone(),
        Some(addr) => format!("http://{addr}"),
        None => crate::config::api_url(r.settings.api),
    };
    let token = r.settings.api_token.as_deref();
    let s = client::fetch_status_as(&api, token, Duration::from_secs(10))?;
    if a.json {
        println!("{s}");
        return Ok(ExitCode::SUCCESS);
    }
    let once = a.once || !std::io::IsTerminal::is_terminal(&std::io::stdout());
    super::dashboard::run(&api, token, s, once)
}

pub fn generate_api(a: &GenerateArgs, api: &str) -> Result<ExitCode> {
    let mut clock = TokenClock::start();
    let mut events = client::post_stream(api, "/generate", &generate_body(a)?)?;
    let mut stdout = std::io::stdout().lock();
    let mut seen = Transcript {
        prompt_ids: a
            .prompt_ids
            .clone()
            .map(|v| json!(v))
            .unwrap_or(Value::Null),
        corrections: Vec::new(),
        routes: Vec::new(),
        logprobs: a.top_logprobs.map(|_| Vec::new()),
    };
    let mut line = String::new();
    loop {
        line.clear();
        if events.read_line(&mut line)? == 0 {
            bail!("the daemon closed the stream before the generation finished");
        }
        let ev: Value =
            serde_json::from_str(line.trim()).with_context(|| format!("bad event {line:?}"))?;
        match ev["event"].as_str() {
            Some("started") => seen.started(&ev, a.json),
            Some("token") if !a.json => {
                clock.token();
                match ev["text"].as_str() {
                    Some(t) => write!(stdout, "{t}")?,
                    None => write!(stdout, "{} ", ev["id"])?,
                }
                stdout.flush()?;
            }
            Some("token") => {
                clock.token();
                seen.token(&ev);
            }
            Some("corrected") => {
                if !a.json {
                    print_correction(&mut stdout, &ev)?;
                }
                seen.corrected(&ev);
            }
            Some("done") => {
                if a.json {
                    let mut answer = seen.done_json(&ev);
                    answer["timing"] = clock.json();
                    writeln!(stdout, "{answer}")?;
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

/// The `/generate` request body for `generate --api`'s arguments.
fn generate_body(a: &GenerateArgs) -> Result<Value> {
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
    if let Some(p) = a.min_p {
        body["min_p"] = json!(p);
    }
    if a.repetition_penalty != 1.0 {
        body["repetition_penalty"] = json!(a.repetition_penalty);
    }
    if a.presence_penalty != 0.0 {
        body["presence_penalty"] = json!(a.presence_penalty);
    }
    if a.frequency_penalty != 0.0 {
        body["frequency_penalty"] = json!(a.frequency_penalty);
    }
    if let Some(n) = a.top_logprobs {
        body["top_logprobs"] = json!(n);
    }
    if let Some(s) = a.speculative {
        body["speculative"] = json!(s);
    }
    if a.json_output {
        body["json_output"] = json!(true);
    }
    if let Some(schema) = super::model_cmds::read_json_schema(a)? {
        body["json_schema"] = schema;
    }
    if let Some(v) = &a.verify {
        body["verify"] = json!(v);
    }
    if let Some(r) = a.audit_rate {
        body["audit_rate"] = json!(r);
    }
    Ok(body)
}

/// What a `generate --api` stream told us before `done`, for the `--json` answer.
struct Transcript {
    prompt_ids: Value,
    corrections: Vec<Value>,
    /// Every route the head tried: more than one when it recomputed without a peer.
    routes: Vec<Value>,
    /// Each token's log-probabilities, when asked for (`--top-logprobs`).
    logprobs: Option<Vec<Value>>,
}

impl Transcript {
    /// A `started` event: the head's prompt ids and route (announced on stderr when it is
    /// not the first, unless the answer is `--json`).
    fn started(&mut self, ev: &Value, json: bool) {
        if let Some(p) = ev.get("prompt_ids") {
            self.prompt_ids = p.clone();
        }
        self.routes.push(ev["route"].clone());
        // A later route: the head went on without a peer it could not use (handing its
        // layers to another, or recomputing the generation) or without a proven liar;
        // tokens already sent come again only if they change.
        if self.routes.len() > 1 && !json {
            eprintln!("[the route changed: {}]", route_text(&ev["route"]));
        }
    }

    /// A `token` event: keeps its log-probabilities.
    fn token(&mut self, ev: &Value) {
        if let Some(all) = &mut self.logprobs {
            all.push(ev["logprobs"].clone());
        }
    }

    /// A `corrected` event: the tokens from `from` on were replaced, and so were their
    /// log-probabilities.
    fn corrected(&mut self, ev: &Value) {
        if let Some(all) = &mut self.logprobs {
            all.truncate(ev["from"].as_u64().unwrap_or(0) as usize);
            all.extend(ev["logprobs"].as_array().into_iter().flatten().cloned());
        }
        self.corrections.push(ev.clone());
    }

    /// The `--json` answer once the `done` event `ev` came.
    fn done_json(&self, ev: &Value) -> Value {
        let mut answer = json!({
            "prompt_ids": self.prompt_ids,
            "tokens": ev["tokens"],
            "text": ev["text"],
            "stop": ev["stop"],
            "final_logits": ev["final_logits"],
            "corrections": self.corrections,
            "routes": self.routes,
        });
        if let Some(all) = &self.logprobs {
            answer["logprobs"] = json!(all);
        }
        answer
    }
}

/// A route as "layers@peer → layers@peer".
fn route_text(route: &Value) -> String {
    let hops: Vec<String> = route
        .as_array()
        .into_iter()
        .flatten()
        .map(|h| {
            let (layers, peer) = (h["layers"].as_str(), h["peer"].as_str());
            format!("{}@{}", layers.unwrap_or("?"), peer.unwrap_or("?"))
        })
        .collect();
    hops.join(" → ")
}

/// A `corrected` event as text: who was proven to lie, then the corrected tokens.
fn print_correction(out: &mut impl Write, ev: &Value) -> Result<()> {
    writeln!(out)?;
    writeln!(
        out,
        "[peer {} was proven to lie; corrected from token {}:]",
        ev["liar"].as_str().unwrap_or("?"),
        ev["from"]
    )?;
    match ev["text"].as_str() {
        Some(t) => write!(out, "{t}")?,
        None => write!(out, "{}", ev["tokens"])?,
    }
    Ok(())
}

pub fn verify_proof(global: &Global, a: &crate::cli::VerifyProofArgs) -> Result<ExitCode> {
    use dc_model::{LoadOptions, Model};
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading {}", a.file.display()))?;
    let proof: dc_types::FraudProof = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a fraud proof", a.file.display()))?;
    let path = super::local::model_path(&crate::cli::ModelArg {
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
    let gemm = super::local::engine(global)?;
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
