//! Detection rates of sampled audits and of spot checks, measured with real daemons and set
//! against the policy's analysis. A liar serving layers 2..4 of the Llama fixture lies
//! (`flip-bit`: one bit of one output row) on a fraction `f` of its hops.
//!
//! - Audits only: the head audits each remote hop with probability `p`. For a generation with
//!   `H` hops on the liar, docs/VERIFICATION.md predicts detection with probability
//!   `1 − (1 − f·p)^H`.
//! - Spot checks only: the head draws each part of each layer of each remote hop (its weight
//!   products, both attention products, its output) with probability `c`, and checks a layer
//!   with any part drawn at one random row. The flipped output shows in a check of the last
//!   layer that draws its output (the only check that reads the activations leaving it), so a
//!   lying hop is caught with probability `s = c`: `1 − (1 − f·c)^H`.
//!
//! Each counts how often the liar is actually proven and excluded.
//!
//! `DETECTION_FAULT=attention` makes the liar lie in its last layer's attention instead (it
//! attends over a key and a value other than the committed ones and stays consistent after
//! that): no weight product is wrong, only a check that recomputes the attention sees it — one
//! that draws the scores or the context, `s = 1 − (1 − c)^2`. It cannot lie on its first hop
//! (nothing is cached yet), so `H − 1` hops count.
//!
//! ```text
//! cargo bench -p dc-tests --bench detection            # DETECTION_TRIALS=N (default 40)
//! DETECTION_ONLY=spot cargo bench -p dc-tests --bench detection   # or audit: one kind of row
//! ```

#![allow(clippy::unwrap_used)] // a benchmark: a panic is the failure report

use std::path::Path;

use dc_tests::*;

const TOKENS: &str = "16";

struct Swarm {
    _dir: tempfile::TempDir,
    head: Daemon,
    _honest: Daemon,
    liar: Daemon,
}

fn swarm(model: &Path, kind: &str, f: f64, spot_rate: f64) -> Swarm {
    let dir = tempfile::tempdir().unwrap();
    let spot = spot_rate.to_string();
    let head_extra = ["--spot-check-rate", spot.as_str()];
    let fault = format!("{kind}:{f}");
    let (head, honest, liar) = swarm_with_liar(dir.path(), model, &head_extra, &fault);
    Swarm {
        _dir: dir,
        head,
        _honest: honest,
        liar,
    }
}

fn hops(d: &Daemon) -> u64 {
    d.status()["hops_served"].as_u64().unwrap()
}

fn main() {
    let trials: usize = std::env::var("DETECTION_TRIALS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let model = fixtures().join("llama");
    println!("{trials} generations of {TOKENS} tokens per row that the liar took part in");
    println!(
        "   f  audit p  spot c  hops H   predicted   measured (caught/trials)   checks run, unavailable   (generations skipped)"
    );
    let rows = [
        (0.1, 0.1, 0.0),
        (0.3, 0.1, 0.0),
        (0.1, 0.3, 0.0),
        (0.3, 0.3, 0.0),
        (1.0, 0.1, 0.0),
        (0.3, 0.0, 0.3),
        (1.0, 0.0, 0.06),
        (0.1, 0.0, 1.0),
    ];
    let only = std::env::var("DETECTION_ONLY").unwrap_or_default();
    let kind = std::env::var("DETECTION_FAULT").unwrap_or_else(|_| "flip-bit".into());
    println!("liar: --fault {kind}:f");
    for (f, p, c) in rows {
        if (only == "spot" && c == 0.0) || (only == "audit" && p == 0.0) {
            continue;
        }
        let mut caught = 0;
        let (mut audits, mut unavailable) = (0, 0);
        let mut full_hops = Vec::new();
        let mut s: Option<Swarm> = None;
        // Only generations the liar took part in count: the head may route a generation
        // through the honest stage instead.
        let (mut counted, mut skipped, mut t) = (0, 0, 0);
        while counted < trials && t < trials * 5 {
            let sw = s.get_or_insert_with(|| swarm(&model, &kind, f, c));
            let before = hops(&sw.liar);
            let seed = t.to_string();
            t += 1;
            let rate = p.to_string();
            generate_json(&[
                "--api",
                &sw.head.api,
                "--prompt-ids",
                "5,17,99,3,250,41,7,0,12",
                "--max-new-tokens",
                TOKENS,
                "--ignore-eos",
                "--seed",
                &seed,
                "--temperature",
                "0.8",
                "--audit-rate",
                &rate,
            ]);
            let served = hops(&sw.liar) - before;
            let status = sw.head.status();
            let excluded = !status["excluded_peers"].as_array().unwrap().is_empty();
            if served == 0 && !excluded {
                skipped += 1;
                continue;
            }
            counted += 1;
            if excluded || counted == trials {
                let a = &status["audits"];
                let spot = &a["spot_checks"];
                audits += a["run"].as_u64().unwrap() + spot["run"].as_u64().unwrap();
                unavailable +=
                    a["unavailable"].as_u64().unwrap() + spot["unavailable"].as_u64().unwrap();
            }
            if excluded {
                caught += 1;
                s = None; // a fresh swarm (and liar) for the next trial
            } else {
                full_hops.push(served);
            }
        }
        // H: the liar's hops in a generation it was not caught in (all of them).
        let h = full_hops.iter().copied().max().unwrap_or(16) as f64;
        let lying = if kind == "attention" { h - 1.0 } else { h };
        // A lying hop's spot check sees the lie when it draws the last layer's output
        // (flip-bit) or one of its two attention products (attention).
        let parts = if kind == "attention" { 2 } else { 1 };
        let s = 1.0 - (1.0 - c).powi(parts);
        let predicted = 1.0 - (1.0 - f * p).powf(lying) * (1.0 - f * s).powf(lying);
        println!(
            "{f:5.2} {p:8.2} {c:7.2} {h:7.0} {predicted:11.3} {:10.3} ({caught}/{counted})   {audits}, {unavailable}   ({skipped} without the liar)",
            caught as f64 / counted.max(1) as f64
        );
    }
}
