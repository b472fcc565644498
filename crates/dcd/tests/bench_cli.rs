//! `dcd bench model --spot-check` through the real binary on a fixture model: every spot check
//! it runs is an honest one, so a bench that hands a checker the wrong hop, the wrong cache
//! rows or the wrong reveal fails instead of printing a figure. Its decode share of the read
//! bandwidth must count exactly the weights the model streams.

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
    let r = &v["results"][0];
    // Decode is judged by the weights it streams per token: every layer's products and the
    // output projection, packed (16-column panels of 32-row blocks, 544 bytes a record).
    assert_eq!(
        r["decode_weight_bytes"].as_u64(),
        Some(llama_fixture_packed_bytes()),
        "{v}"
    );
    let bandwidth = r["read_bandwidth_gbs"].as_f64().expect("a bandwidth");
    let share = r["decode_share_of_bandwidth"].as_f64().expect("a share");
    let streamed = r["decode_tokens_per_s"].as_f64().expect("a rate")
        * llama_fixture_packed_bytes() as f64
        / 1e9;
    assert!(bandwidth > 0.0, "{v}");
    assert!(
        (share - streamed / bandwidth).abs() < 1e-9 * share.max(1.0),
        "{v}"
    );
    let spot = &r["spot_check"];
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

/// The llama fixture's packed weight bytes, from its config: hidden 64, 4 query and 2 key-value
/// heads of 16, FFN 176, 4 layers, vocabulary 512, untied output.
fn llama_fixture_packed_bytes() -> u64 {
    let packed = |k: u64, n: u64| n.div_ceil(16) * k.div_ceil(32) * 544;
    let (h, kv, ffn) = (64, 32, 176);
    let layer = 2 * packed(h, h) + 2 * packed(h, kv) + 2 * packed(h, ffn) + packed(ffn, h);
    4 * layer + packed(h, 512)
}
