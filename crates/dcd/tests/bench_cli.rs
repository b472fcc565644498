//! `dcd bench model --spot-check` through the real binary on a fixture model: every spot check
//! it runs is an honest one, so a bench that hands a checker the wrong hop, the wrong cache
//! rows or the wrong reveal fails instead of printing a figure.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn llama_fixture() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/llama");
    assert!(p.is_dir(), "fixture model not found at {}", p.display());
    p
}

/// At rate 1 every layer's every part is drawn on every hop, so each batch of reveals holds
/// attention picks of every layer in turn, each asking for the cache rows after the batch's
/// earlier hop; 11 decode hops end on a short batch.
#[test]
fn the_spot_check_bench_checks_every_drawn_hop_in_batches_and_every_check_passes() {
    let out = Command::new(env!("CARGO_BIN_EXE_dcd"))
        .env(
            "XDG_CONFIG_HOME",
            std::env::temp_dir().join("dcd-bench-cli-no-config"),
        )
        .args(["bench", "model", "--model"])
        .arg(llama_fixture())
        .args(["--commit", "--spot-check", "--spot-check-rate", "1"])
        .args([
            "--thread-counts",
            "1",
            "--prompt-tokens",
            "4",
            "--decode-tokens",
            "11",
        ])
        .arg("--json")
        .output()
        .expect("runs");
    assert!(
        out.status.success(),
        "dcd bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let spot = &v["results"][0]["spot_check"];
    // Every one of the fixture's four layers picked on every hop.
    assert_eq!(spot["rate_layers_per_hop"].as_f64(), Some(4.0), "{v}");
    assert!(spot["rate_bytes_per_hop"].as_f64() > Some(0.0), "{v}");
    assert!(spot["rate_share_of_decode"].as_f64() > Some(0.0), "{v}");
    // The stage's reveals are part of the policy's time, never all of it (the checks run too).
    let reveals = spot["rate_reveal_share_of_decode"]
        .as_f64()
        .expect("a reveal share");
    assert!(
        reveals > 0.0 && Some(reveals) < spot["rate_share_of_decode"].as_f64(),
        "{v}"
    );
}
