//! The short chaos run: `scripts/chaos.sh` with real daemons on loopback, generations running
//! without pause while five random daemons (heads included) are killed with SIGKILL and
//! restarted. Every generation must complete, bit-identical to its local reference.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::process::Command;

use dc_tests::*;
use serde_json::Value;

#[test]
fn generations_survive_five_kills_unchanged() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("bash")
        .arg(root.join("scripts/chaos.sh"))
        .arg("5")
        .arg(fixtures().join("llama"))
        .env("DCD", dcd())
        .env("TOKENS", "120")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stdout.lines().last().unwrap_or_default();
    let report: Value = serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("no report ({e}); stdout: {stdout}; stderr: {stderr}"));
    eprintln!("{report}");
    assert_eq!(report["kills"], 5);
    assert_eq!(report["failed"], 0, "{stderr}");
    assert_eq!(report["different"], 0, "{stderr}");
    assert!(report["completed"].as_u64().unwrap() >= 10, "{report}");
    assert!(out.status.success(), "{stderr}");
}
