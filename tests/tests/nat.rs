//! NAT traversal for real: `scripts/nat-test.sh` builds a public network with a relay daemon
//! and two homes behind their own MASQUERADE routers in network namespaces, and generates
//! through daemons in both homes, first through the relay (direct packets blocked), then with
//! the direct path open (hole punch tried). Both must equal a local run, and the first must
//! really be relayed.
//! Network namespaces need root, `ip` and `iptables` (`scripts/setup-tests.sh` installs them
//! as root); without them the test says so and does nothing.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::process::Command;

use dc_tests::*;
use serde_json::Value;

fn can_build_namespaces() -> Result<(), String> {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map_err(|e| e.to_string())?;
    if String::from_utf8_lossy(&root.stdout).trim() != "0" {
        return Err("not root".into());
    }
    for tool in ["ip", "iptables"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .status()
            .map_err(|e| e.to_string())?;
        if !found.success() {
            return Err(format!("no {tool}"));
        }
    }
    Ok(())
}

#[test]
fn a_generation_crosses_two_nats_through_the_relay() {
    if let Err(why) = can_build_namespaces() {
        eprintln!("SKIPPED: network namespaces need root, ip and iptables ({why})");
        return;
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("bash")
        .arg(root.join("scripts/nat-test.sh"))
        .arg(fixtures().join("llama"))
        .arg("24")
        .env("DCD", dcd())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stdout.lines().last().unwrap_or_default();
    let report: Value = serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("no report ({e}); stdout: {stdout}; stderr: {stderr}"));
    eprintln!("{report}");
    let phases = report["phases"].as_array().unwrap();
    assert_eq!(phases[0]["h1_to_h2"], "relayed", "{report}");
    for p in phases {
        assert_eq!(p["equal_to_local"], true, "{report}");
    }
    assert!(out.status.success(), "{stderr}");
}
