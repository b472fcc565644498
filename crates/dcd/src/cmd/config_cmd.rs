//! `dcd config show`: the resolved configuration and where each value came from. It prints;
//! resolving is `crate::config`'s job.

use std::process::ExitCode;

use anyhow::Result;
use serde_json::{json, Map, Value};

use crate::cli::ConfigShowArgs;
use crate::config::{Resolved, Source, KEYS};

/// What a value looks like in the output: the token is never printed.
fn shown(r: &Resolved, key: &str) -> Option<toml::Value> {
    match (key, r.settings.value(key)) {
        ("api_token", Some(_)) => Some(toml::Value::String("(set, hidden)".into())),
        ("data_dir", None) => dc_model::store::data_dir()
            .ok()
            .map(|d| toml::Value::String(d.display().to_string())),
        (_, v) => v,
    }
}

fn source_text(r: &Resolved, key: &str) -> String {
    match (key, r.source(key)) {
        ("data_dir", Source::Default) => "default (platform data directory)".into(),
        ("threads", Source::Default) => {
            format!("default (all {} cores)", crate::config::default_threads())
        }
        (_, s) => s.to_string(),
    }
}

fn file_text(r: &Resolved) -> String {
    match (&r.file, &r.default_file) {
        (Some(f), _) => f.display().to_string(),
        (None, Some(d)) => format!("none ({} does not exist)", d.display()),
        (None, None) => "none".into(),
    }
}

pub fn show(a: &ConfigShowArgs, r: &Resolved) -> Result<ExitCode> {
    if a.json {
        let mut settings = Map::new();
        for (key, _) in KEYS {
            let value = shown(r, key)
                .map(|v| serde_json::to_value(v).unwrap_or(Value::Null))
                .unwrap_or(Value::Null);
            settings.insert(
                key.to_string(),
                json!({"value": value, "source": source_text(r, key)}),
            );
        }
        let out = json!({
            "config_file": r.file.as_ref().map(|f| f.display().to_string()),
            "default_config_file": r.default_file.as_ref().map(|f| f.display().to_string()),
            "settings": settings,
            "ignored_env": r.unknown_env,
        });
        println!("{out}");
        return Ok(ExitCode::SUCCESS);
    }
    println!("# config file: {}", file_text(r));
    println!("# precedence: flags, then DCD_* environment, then the config file, then defaults");
    let rows: Vec<(String, String)> = KEYS
        .iter()
        .map(|(key, _)| {
            let v = match shown(r, key) {
                Some(v) => format!("{key} = {v}"),
                None => format!("# {key} (unset)"),
            };
            (v, source_text(r, key))
        })
        .collect();
    let w = rows
        .iter()
        .map(|(v, _)| v.chars().count())
        .max()
        .unwrap_or(0);
    for (v, src) in rows {
        println!("{v:<w$}  # {src}");
    }
    for warning in r.warnings() {
        eprintln!("dcd: warning: {warning}");
    }
    Ok(ExitCode::SUCCESS)
}
