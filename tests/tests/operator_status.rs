//! `dcd status` against a real daemon (the tiny `llama` fixture): the JSON snapshot carries
//! what `join` was configured with (flags, config file), the text dashboard renders it, the
//! control API token is taken from the configuration, and without a daemon `dcd status` fails
//! with a message that says how to start one.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::process::{Command, Output};

use dc_tests::*;
use serde_json::Value;

/// `dcd <args>` without inherited `DCD_*` variables or a user config file.
fn dcd_clean(home: &std::path::Path, args: &[&str]) -> Command {
    let mut c = Command::new(dcd());
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("DCD_") {
            c.env_remove(k);
        }
    }
    c.env("XDG_CONFIG_HOME", home).args(args);
    c
}

fn stdout(out: Output) -> String {
    assert!(
        out.status.success(),
        "dcd failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn status_json_and_dashboard_describe_a_real_daemon() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    // The config file sets what the flags do not; the flag --max-memory beats its value.
    let cfg = dir.path().join("dcd.toml");
    std::fs::write(
        &cfg,
        "max_generations = 3\nidle_only = true\nidle_threshold = 0.95\n\
         max_memory = \"2GiB\"\napi_token = \"sekrit\"\n",
    )
    .unwrap();
    let cfg_s = cfg.to_str().unwrap();
    let model = fixtures().join("llama");
    let d = Daemon::start(
        dir.path(),
        "a",
        &model,
        &["--config", cfg_s, "--max-memory", "1GiB"],
    );

    // Without the token the API refuses; the token comes from the config file.
    let out = dcd_clean(&home, &["status", "--json", "--api", &d.api])
        .output()
        .unwrap();
    assert!(!out.status.success(), "the API should want its token");
    let s: Value = serde_json::from_str(
        stdout(
            dcd_clean(
                &home,
                &["--config", cfg_s, "status", "--json", "--api", &d.api],
            )
            .output()
            .unwrap(),
        )
        .trim(),
    )
    .unwrap();
    assert_eq!(s["peer_id"], Value::from(d.peer_id.clone()));
    assert_eq!(s["state"], "serving");
    assert_eq!(s["num_layers"], 4);
    assert_eq!(s["layers"], "0..4");
    assert_eq!(s["head"], true);
    assert_eq!(s["coverage"], serde_json::json!([1, 1, 1, 1]));
    assert_eq!(s["peers"], serde_json::json!([]));
    assert_eq!(s["threads"], 1, "--threads 1 from the test harness");
    assert_eq!(s["memory"]["budget"], 1u64 << 30, "the flag beats the file");
    assert!(s["memory"]["weights"].as_u64().unwrap() > 0);
    assert_eq!(s["generations"]["max"], 3, "from the config file");
    assert_eq!(s["generations"]["active"], 0);
    assert_eq!(s["idle_only"], true, "from the config file");
    assert!(s["paused"].is_boolean());
    assert!(s["kernel"].as_str().is_some_and(|k| !k.is_empty()));
    assert!(s["uptime_s"].is_u64());
    let addrs = s["listen_addrs"].as_array().unwrap();
    assert!(
        addrs.iter().any(|a| a == &Value::from(d.addr.clone())),
        "{addrs:?}"
    );

    // The same through DCD_API and DCD_API_TOKEN, given as HOST:PORT.
    let hostport = d.api.trim_start_matches("http://");
    let s2: Value = serde_json::from_str(
        stdout(
            dcd_clean(&home, &["status", "--json"])
                .env("DCD_API", hostport)
                .env("DCD_API_TOKEN", "sekrit")
                .output()
                .unwrap(),
        )
        .trim(),
    )
    .unwrap();
    assert_eq!(s2["peer_id"], s["peer_id"]);

    // The dashboard, once, as text (stdout is not a terminal here).
    let text = stdout(
        dcd_clean(&home, &["--config", cfg_s, "status", "--api", &d.api])
            .env("COLUMNS", "140")
            .output()
            .unwrap(),
    );
    for needle in [
        d.peer_id.as_str(),
        "serving",
        "layers 0..4 of 4 · head weights",
        "1 thread ·",
        "budget 1.0 GiB",
        "3 generations at once",
        "idle-only: on",
        "every layer is served (at least 1 replica)",
        "Swarm: no other peers seen yet",
    ] {
        assert!(text.contains(needle), "{needle:?} not in:\n{text}");
    }
    let once = stdout(
        dcd_clean(
            &home,
            &["--config", cfg_s, "status", "--once", "--api", &d.api],
        )
        .output()
        .unwrap(),
    );
    assert!(once.contains(&d.peer_id), "{once}");
    d.leave();
}

#[test]
fn status_without_a_daemon_says_how_to_start_one() {
    let home = tempfile::tempdir().unwrap();
    // A port nobody listens on: bind one, then let it go.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let api = format!("http://127.0.0.1:{port}");
    for args in [
        vec!["status", "--api", api.as_str()],
        vec!["status", "--json", "--api", api.as_str()],
    ] {
        let out = dcd_clean(home.path(), &args).output().unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!("no daemon answers at {api}")),
            "{args:?}: {err}"
        );
        assert!(err.contains("dcd join --model <model>"), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
    // The address also comes from the `api` setting.
    let out = dcd_clean(home.path(), &["status"])
        .env("DCD_API", format!("127.0.0.1:{port}"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("no daemon answers at {api}")),
        "{err}"
    );
}
