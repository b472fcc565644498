//! The swarm end to end: real `dcd join` processes on loopback (bootstrap addresses, mDNS off)
//! serving different layer ranges, generations through them compared bit for bit with
//! `dcd generate --local`, a daemon with `--layers auto` filling a gap, a graceful leave
//! re-covered before the next generation.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::path::Path;
use std::time::Duration;

use dc_tests::*;
use serde_json::Value;

/// A memory budget that fits exactly `layers` layers of `model` (no head weights).
fn budget_for(model: &Path, layers: u64) -> String {
    let (cfg, _) = dc_model::open::open_source(model).unwrap();
    let per = dc_node::core::memory::layer_bytes(&cfg);
    // layers_that_fit keeps a tenth for caches; land in the middle of the interval.
    ((per * layers + per / 2) * 10 / 9).to_string()
}

/// Compares generations through `api` with local ones for greedy and seeded sampling, with and
/// without min-p and penalties (which must reach the head: they change the tokens).
fn assert_same_as_local(model: &Path, api: &str, prompt: &str, max_new: &str) {
    let m = model.to_str().unwrap();
    let penalised = [
        "--min-p",
        "0.02",
        // Below 1 and negative, so that even a few tokens change: prompt tokens and
        // repeats are favoured.
        "--repetition-penalty",
        "0.6",
        "--presence-penalty",
        "-1",
        "--frequency-penalty",
        "0.5",
    ];
    let (mut plain_local, mut changed) = (Vec::new(), false);
    for (t, seed, extra) in [
        ("0", "0", &[][..]),
        ("0.9", "1", &[][..]),
        ("1.3", "7", &[][..]),
        ("0", "0", &penalised[..]),
        ("0.9", "1", &penalised[..]),
    ] {
        let mut args = vec![
            "--prompt-ids",
            prompt,
            "--max-new-tokens",
            max_new,
            "--temperature",
            t,
            "--top-k",
            "50",
            "--seed",
            seed,
            "--ignore-eos",
            "--top-logprobs",
            "3",
        ];
        args.extend_from_slice(extra);
        let what = format!("{m}: temperature {t}, seed {seed}, {extra:?}");
        let mut swarm_args = vec!["--api", api];
        swarm_args.extend_from_slice(&args);
        let mut local_args = vec!["--model", m, "--local"];
        local_args.extend_from_slice(&args);
        let swarm = generate_json(&swarm_args);
        let local = generate_json(&local_args);
        assert_eq!(swarm["tokens"], local["tokens"], "{what}");
        assert_eq!(swarm["final_logits"], local["final_logits"], "{what}");
        assert_eq!(swarm["logprobs"], local["logprobs"], "{what}");
        let n = max_new.parse::<usize>().unwrap();
        assert_eq!(swarm["tokens"].as_array().unwrap().len(), n);
        // Both say when the tokens came: the first after some time, then a decode rate.
        for timed in [&swarm, &local] {
            let t = &timed["timing"];
            assert!(t["first_token_ms"].as_f64() > Some(0.0), "{what}: {t}");
            assert!(t["decode_tokens_per_s"].as_f64() > Some(0.0), "{what}: {t}");
        }
        let logprobs = swarm["logprobs"].as_array().expect("logprobs");
        assert_eq!(logprobs.len(), n, "{what}");
        for lp in logprobs {
            assert!(lp["logprob"].as_f64() <= Some(0.0), "{what}: {lp}");
            assert_eq!(lp["top"].as_array().map(Vec::len), Some(3), "{what}: {lp}");
        }
        if extra.is_empty() {
            plain_local.push(local["tokens"].clone());
        } else {
            // The first two plain runs had the same temperature and seed.
            changed |= local["tokens"] != plain_local[if t == "0" { 0 } else { 1 }];
        }
    }
    assert!(changed, "{m}: the penalties changed no token");
}

/// JSON output through the swarm (`api`) equals a local run of `model`, and is one JSON
/// object, greedy and seeded, roomy and on a tight budget, any object or one of a schema.
fn assert_json_same_as_local(model: &Path, api: &str) {
    let m = model.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let schema_file = dir.path().join("cat.json");
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "colour": {"enum": ["black", "white", "ginger"]},
        },
        "required": ["name", "age", "colour"],
        "additionalProperties": false,
    });
    std::fs::write(&schema_file, schema.to_string()).unwrap();
    let schema_arg = schema_file.to_str().unwrap();
    for (t, seed, max_new, format) in [
        ("0", "0", "48", "--json-output"),
        ("0.8", "3", "48", "--json-output"),
        ("0", "0", "7", "--json-output"),
        ("0", "0", "64", "--json-schema"),
        ("0.8", "5", "40", "--json-schema"),
    ] {
        let format: &[&str] = match format {
            "--json-schema" => &["--json-schema", schema_arg],
            _ => &["--json-output"],
        };
        let args = [
            &[
                "--prompt",
                "Describe a cat as a JSON object with its name and age:",
                "--max-new-tokens",
                max_new,
                "--temperature",
                t,
                "--seed",
                seed,
            ][..],
            format,
        ]
        .concat();
        let what = format!("{m}: {format:?}, temperature {t}, seed {seed}, {max_new} tokens");
        let swarm = generate_json(&[&["--api", api], &args[..]].concat());
        let local = generate_json(&[&["--model", m], &args[..]].concat());
        assert_eq!(swarm["tokens"], local["tokens"], "{what}");
        assert_eq!(swarm["final_logits"], local["final_logits"], "{what}");
        let text = local["text"].as_str().expect("text");
        let doc: serde_json::Value = serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {text:?}"));
        assert!(doc.is_object(), "{what}: {text:?}");
        assert_eq!(
            local["stop"], "stop",
            "{what}: the document ends the generation"
        );
        if format[0] == "--json-schema" {
            let keys: Vec<&str> = doc
                .as_object()
                .unwrap()
                .keys()
                .map(|k| k.as_str())
                .collect();
            assert_eq!(keys.len(), 3, "{what}: exactly the listed keys: {text:?}");
            assert!(doc["name"].is_string(), "{what}: {text:?}");
            assert!(doc["age"].is_i64(), "{what}: {text:?}");
            assert!(
                ["black", "white", "ginger"].contains(&doc["colour"].as_str().unwrap_or("")),
                "{what}: {text:?}"
            );
        }
    }
}

fn coverage_complete(d: &Daemon, layers: usize) -> bool {
    let s = d.status();
    s["coverage"]
        .as_array()
        .is_some_and(|c| c.len() == layers && c.iter().all(|v| v.as_u64() > Some(0)))
}

/// Three fixed daemons leave a gap; a fourth with `--layers auto` fills it; generations through
/// the swarm equal the local ones bit for bit.
fn three_daemons_and_an_auto_one(
    model: &Path,
    ranges: [&str; 3],
    gap: &str,
    auto_layers: u64,
    prompt: &str,
    json: bool,
) {
    let dir = tempfile::tempdir().unwrap();
    let a = Daemon::start(dir.path(), "a", model, &["--layers", ranges[0]]);
    let b = Daemon::start(
        dir.path(),
        "b",
        model,
        &["--layers", ranges[1], "--no-head", "--bootstrap", &a.addr],
    );
    let c = Daemon::start(
        dir.path(),
        "c",
        model,
        &["--layers", ranges[2], "--bootstrap", &a.addr],
    );
    wait_until(
        "the three daemons to see each other",
        Duration::from_secs(30),
        || a.status()["peers"].as_array().is_some_and(|p| p.len() == 2),
    );
    let budget = budget_for(model, auto_layers);
    let d = Daemon::start(
        dir.path(),
        "d",
        model,
        &[
            "--layers",
            "auto",
            "--no-head",
            "--max-memory",
            &budget,
            "--bootstrap",
            &a.addr,
        ],
    );
    assert_eq!(d.layers(), gap, "the auto daemon takes the uncovered range");
    let n = a.status()["num_layers"].as_u64().unwrap() as usize;
    wait_until("full coverage", Duration::from_secs(30), || {
        coverage_complete(&a, n) && coverage_complete(&b, n)
    });
    // Through a daemon without the head weights: the request is forwarded to the elected head.
    assert_same_as_local(model, &b.api, prompt, "12");
    assert_same_as_local(model, &d.api, prompt, "5");
    if json {
        assert_json_same_as_local(model, &b.api);
    }
    for (name, x) in [("b", &b), ("c", &c), ("d", &d)] {
        assert!(
            x.status()["hops_served"].as_u64().unwrap() > 0,
            "{name} served no hop"
        );
    }
    drop((a, b, c, d));
}

#[test]
fn gpt2_swarm_equals_local() {
    three_daemons_and_an_auto_one(
        &fixtures().join("gpt2"),
        ["0..1", "1..2", "3..4"],
        "2..3",
        1,
        "5,17,99,3,250,41,7,0,12",
        false,
    );
}

#[test]
fn llama_swarm_equals_local() {
    three_daemons_and_an_auto_one(
        &fixtures().join("llama"),
        ["0..1", "2..3", "3..4"],
        "1..2",
        1,
        "1,2,3,4,5,6,7",
        false,
    );
}

#[test]
fn mistral_swarm_with_sliding_window_equals_local() {
    // 30 prompt tokens: past the window of 16.
    let prompt = (1..=30)
        .map(|i| ((i * 37) % 500).to_string())
        .collect::<Vec<_>>()
        .join(",");
    three_daemons_and_an_auto_one(
        &fixtures().join("mistral"),
        ["0..1", "2..3", "3..4"],
        "1..2",
        1,
        &prompt,
        false,
    );
}

#[test]
fn smollm2_swarm_equals_local() {
    let model = dc_model::store::installed_smollm2()
        .expect("SmolLM2 is not installed: run scripts/fetch-model.sh");
    three_daemons_and_an_auto_one(
        &model,
        ["0..10", "10..20", "25..30"],
        "20..25",
        5,
        "504,3458,282,4649,314",
        true,
    );
}

#[test]
fn a_daemon_joins_and_one_leaves_gracefully() {
    let model = fixtures().join("llama");
    let dir = tempfile::tempdir().unwrap();
    let a = Daemon::start(dir.path(), "a", &model, &["--layers", "0..2"]);
    let b = Daemon::start(
        dir.path(),
        "b",
        &model,
        &["--layers", "2..4", "--bootstrap", &a.addr],
    );
    wait_until("a and b to see each other", Duration::from_secs(30), || {
        coverage_complete(&a, 4)
    });
    // Coverage is [1, 1, 1, 1]: the joining daemon takes the least-served window of the size
    // its budget allows (two layers), the earliest of equals.
    let c = Daemon::start(
        dir.path(),
        "c",
        &model,
        &[
            "--layers",
            "auto",
            "--no-head",
            "--max-memory",
            &budget_for(&model, 2),
            "--bootstrap",
            &a.addr,
        ],
    );
    assert_eq!(c.layers(), "0..2");
    wait_until("a to see c", Duration::from_secs(30), || {
        a.status()["coverage"] == serde_json::json!([2, 2, 1, 1])
    });
    // b leaves: it announces, finishes, exits cleanly; c moves to cover 2..4.
    let b_id = b.peer_id.clone();
    let out = b.leave();
    assert!(
        out.iter().any(|l| l.starts_with("leaving")) && out.iter().any(|l| l == "left"),
        "{out:?}"
    );
    wait_until("c to re-cover b's layers", Duration::from_secs(40), || {
        c.layers() == "2..4"
    });
    wait_until(
        "a to see full coverage again",
        Duration::from_secs(30),
        || coverage_complete(&a, 4),
    );
    assert!(c
        .out
        .lock()
        .unwrap()
        .iter()
        .any(|l| l.contains("moving from layers 0..2 to 2..4")));
    assert_same_as_local(&model, &c.api, "9,8,7,6,5", "8");
    let peers: Vec<Value> = a.status()["peers"].as_array().unwrap().clone();
    assert!(
        peers.iter().all(|p| p["peer_id"] != b_id.as_str()),
        "the leaver is forgotten"
    );
}

/// Generations that reach a stage together are stacked there (one GEMM per product for all
/// their rows), and each still gets exactly the bits of a local run: the tokens, logits and
/// log-probabilities, and commitments the head's spot checks find true.
#[test]
fn concurrent_generations_stacked_at_a_stage_equal_local_runs() {
    let model = dc_model::store::installed_smollm2()
        .expect("SmolLM2 is not installed: run scripts/fetch-model.sh");
    let m = model.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let a = Daemon::start(dir.path(), "a", &model, &["--layers", "0..15"]);
    let b = Daemon::start(
        dir.path(),
        "b",
        &model,
        &["--layers", "15..30", "--no-head", "--bootstrap", &a.addr],
    );
    wait_until("full coverage", Duration::from_secs(30), || {
        coverage_complete(&a, 30)
    });
    let args = |seed: usize| -> Vec<String> {
        [
            "--prompt-ids",
            "504,3458,282,4649,314",
            "--max-new-tokens",
            "24",
            "--temperature",
            "0.8",
            "--seed",
            &seed.to_string(),
            "--ignore-eos",
            "--top-logprobs",
            "2",
            "--speculative",
            "off",
        ]
        .map(String::from)
        .to_vec()
    };
    let api = a.api.clone();
    let swarm: Vec<Value> = std::thread::scope(|s| {
        let runs: Vec<_> = (0..6)
            .map(|seed| {
                let (api, args) = (&api, args(seed));
                s.spawn(move || {
                    let mut all = vec!["--api", api.as_str()];
                    all.extend(args.iter().map(String::as_str));
                    generate_json(&all)
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    for (seed, got) in swarm.iter().enumerate() {
        let args = args(seed);
        let mut local = vec!["--model", m, "--local"];
        local.extend(args.iter().map(String::as_str));
        let want = generate_json(&local);
        for key in ["tokens", "final_logits", "logprobs"] {
            assert_eq!(got[key], want[key], "seed {seed}: {key}");
        }
    }
    let (sa, sb) = (a.status(), b.status());
    assert!(
        sb["hops_stacked"].as_u64() > Some(0) && sa["hops_stacked"].as_u64() > Some(0),
        "six generations at once were never stacked: a {}, b {}",
        sa["hops_stacked"],
        sb["hops_stacked"]
    );
    let spot = &sa["audits"]["spot_checks"];
    assert!(spot["run"].as_u64() > Some(0), "{spot}");
    assert_eq!(spot["failed"], 0, "{spot}");
    assert_eq!(sa["excluded_peers"], serde_json::json!([]), "{sa}");
}
