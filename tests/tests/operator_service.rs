//! The system service: `config/dcd.service` has the settings the daemon relies on (notify,
//! state directory, a stop timeout longer than the drain, the sandbox), passes
//! `systemd-analyze verify` where that exists, and `scripts/install-service.sh --dry-run`
//! prints every install / uninstall action without doing any of them.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use dc_tests::dcd;
use serde_json::Value;

/// How long the daemon drains its generations after SIGTERM (`dc_node::run`).
const DRAIN_SECS: u64 = 15;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn unit_text() -> String {
    std::fs::read_to_string(repo().join("config/dcd.service")).unwrap()
}

/// Every value of `key` in the unit (directives may repeat).
fn values(unit: &str, key: &str) -> Vec<String> {
    unit.lines()
        .filter_map(|l| l.trim().strip_prefix(&format!("{key}=")))
        .map(str::to_string)
        .collect()
}

fn one(unit: &str, key: &str) -> String {
    let v = values(unit, key);
    assert_eq!(v.len(), 1, "{key}= should appear once: {v:?}");
    v[0].clone()
}

fn script(args: &[&str]) -> Output {
    Command::new("bash")
        .arg(repo().join("scripts/install-service.sh"))
        .args(args)
        .output()
        .unwrap()
}

fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "install-service.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_unit_runs_join_as_a_sandboxed_notify_service() {
    let u = unit_text();
    let exec = one(&u, "ExecStart");
    assert!(exec.starts_with("/usr/local/bin/dcd "), "{exec}");
    assert!(exec.contains("--config /etc/dcd/dcd.toml"), "{exec}");
    assert!(exec.ends_with(" join"), "{exec}");
    for (key, want) in [
        ("Type", "notify"),
        ("User", "dcd"),
        ("Group", "dcd"),
        ("StateDirectory", "dcd"),
        ("ConfigurationDirectory", "dcd"),
        ("Environment", "DCD_DATA_DIR=/var/lib/dcd"),
        ("Restart", "on-failure"),
        ("KillSignal", "SIGTERM"),
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("PrivateDevices", "yes"),
        ("ProtectKernelTunables", "yes"),
        ("ProtectKernelModules", "yes"),
        ("ProtectControlGroups", "yes"),
        ("RestrictNamespaces", "yes"),
        ("LockPersonality", "yes"),
        ("MemoryDenyWriteExecute", "yes"),
        ("CapabilityBoundingSet", ""),
        ("WantedBy", "multi-user.target"),
    ] {
        assert_eq!(one(&u, key), want, "{key}");
    }
    let families: Vec<String> = one(&u, "RestrictAddressFamilies")
        .split_whitespace()
        .map(str::to_string)
        .collect();
    assert_eq!(families, ["AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"]);
    assert!(values(&u, "SystemCallFilter").contains(&"@system-service".to_string()));
    // Idle-only mode reads /proc/stat: a pid-only /proc would blind it.
    assert!(values(&u, "ProcSubset").is_empty());
    // The stop timeout outlasts the daemon's drain.
    let stop = one(&u, "TimeoutStopSec");
    let secs: u64 = stop.trim_end_matches('s').parse().unwrap();
    assert!(secs > DRAIN_SECS + 5, "TimeoutStopSec={stop}");
}

#[test]
fn the_unit_passes_systemd_analyze_verify() {
    let Ok(v) = Command::new("systemd-analyze").arg("--version").output() else {
        eprintln!("systemd-analyze is not installed: skipping the unit check");
        return;
    };
    if !v.status.success() {
        eprintln!("systemd-analyze does not run here: skipping the unit check");
        return;
    }
    // verify wants the binary to exist: point ExecStart at the one just built.
    let dir = tempfile::tempdir().unwrap();
    let unit = unit_text().replace(
        "ExecStart=/usr/local/bin/dcd ",
        &format!("ExecStart={} ", dcd().display()),
    );
    let path = dir.path().join("dcd.service");
    std::fs::write(&path, unit).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "systemd-analyze verify: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The file a dry run would write to `path`: the `|   `-prefixed lines after its header.
fn written(out: &str, path: &str) -> String {
    let header = format!("+ write {path} ");
    let mut lines = out.lines().skip_while(|l| !l.starts_with(&header));
    assert!(lines.next().is_some(), "no write of {path} in:\n{out}");
    lines
        .take_while(|l| l.starts_with('|'))
        .map(|l| l.strip_prefix("|   ").unwrap_or(l.trim_start_matches('|')))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn install_dry_run_prints_every_action_and_does_none() {
    let bin = dcd();
    let bin_s = bin.to_str().unwrap();
    let before = Path::new("/etc/systemd/system/dcd.service").exists();
    let out = ok(script(&[
        "--dry-run",
        "--binary",
        bin_s,
        "--model",
        "smollm2-135m",
    ]));
    let expected = [
        format!("+ install -m 0755 {bin_s} /usr/local/bin/dcd"),
        "+ useradd --system --home-dir /var/lib/dcd".into(),
        "+ install -d -m 0750 -o dcd -g dcd /var/lib/dcd /var/lib/dcd/models".into(),
        "+ install -d -m 0755 /etc/dcd".into(),
        "+ runuser -u dcd -- env HOME=/var/lib/dcd DCD_DATA_DIR=/var/lib/dcd bash ".into(),
        "+ write /etc/dcd/dcd.toml (mode 0640, owner root:dcd):".into(),
        "+ write /etc/systemd/system/dcd.service (mode 0644, owner root:root):".into(),
        "+ systemctl daemon-reload".into(),
        "+ systemctl enable --now dcd.service".into(),
    ];
    let mut at = 0;
    for e in &expected {
        let pos = out[at..]
            .find(e.as_str())
            .unwrap_or_else(|| panic!("{e:?} missing (or out of order) in:\n{out}"));
        at += pos + e.len();
    }
    // Every action line is a printed command, never a real one's output.
    for l in out.lines() {
        assert!(
            l.starts_with("+ ") || l.starts_with("|") || l.starts_with("# "),
            "unexpected line {l:?}"
        );
    }
    assert_eq!(
        Path::new("/etc/systemd/system/dcd.service").exists(),
        before,
        "a dry run must not install the unit"
    );

    // The unit it would write is ours; the config it would write parses and sets the model.
    assert_eq!(
        written(&out, "/etc/systemd/system/dcd.service").trim(),
        unit_text().trim()
    );
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("dcd.toml");
    std::fs::write(&cfg, written(&out, "/etc/dcd/dcd.toml")).unwrap();
    let shown = Command::new(&bin)
        .arg("--config")
        .arg(&cfg)
        .args(["config", "show", "--json"])
        .env("XDG_CONFIG_HOME", dir.path())
        .env_remove("DCD_MODEL")
        .output()
        .unwrap();
    assert!(
        shown.status.success(),
        "{}",
        String::from_utf8_lossy(&shown.stderr)
    );
    let v: Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(v["settings"]["model"]["value"], "smollm2-135m");
}

#[test]
fn install_dry_run_copies_a_model_path_into_the_store() {
    let bin = dcd();
    let model = dc_tests::fixtures().join("llama");
    let out = ok(script(&[
        "--dry-run",
        "--binary",
        bin.to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
    ]));
    assert!(
        out.contains(&format!(
            "+ cp -r {}/. /var/lib/dcd/models/llama/",
            model.display()
        )),
        "{out}"
    );
    assert!(
        out.contains("+ chown -R dcd:dcd /var/lib/dcd/models/llama"),
        "{out}"
    );
    assert!(
        written(&out, "/etc/dcd/dcd.toml").contains("\nmodel = \"llama\"\n"),
        "{out}"
    );
    assert!(!out.contains("+ runuser"), "no fetch for a path: {out}");
}

#[test]
fn uninstall_dry_run_reverses_the_install() {
    let out = ok(script(&["--uninstall", "--dry-run"]));
    for e in [
        "+ systemctl disable --now dcd.service",
        "+ rm -f /etc/systemd/system/dcd.service",
        "+ systemctl daemon-reload",
        "+ rm -f /usr/local/bin/dcd",
        "+ userdel dcd",
    ] {
        assert!(out.contains(e), "{e:?} missing in:\n{out}");
    }
    assert!(out.contains("keeping /etc/dcd and /var/lib/dcd"), "{out}");
    assert!(!out.contains("rm -rf"), "{out}");
    let out = ok(script(&["--uninstall", "--purge", "--dry-run"]));
    assert!(out.contains("+ rm -rf /etc/dcd /var/lib/dcd"), "{out}");
}

#[test]
fn install_refuses_bad_arguments() {
    let out = script(&["--dry-run", "--binary", dcd().to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("give --model"));
    let out = script(&["--dry-run", "--model", "m", "--binary", "/nonexistent/dcd"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not an executable"));
    let out = script(&["--frobnicate"]);
    assert_eq!(out.status.code(), Some(2));
}
