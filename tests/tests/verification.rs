//! Verification end to end with real daemons: each kind of lie is caught by an audit, proven,
//! and the liar excluded by the head and by every peer that checks the gossiped proof; the
//! client's tokens end up equal to the local run (corrected if needed); `--verify all` never
//! releases a wrong token; honest swarms never fail an audit; `dcd verify-proof` accepts the
//! proof and rejects forgeries.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::path::Path;
use std::time::Duration;

use dc_tests::*;
use serde_json::Value;

/// The test prompt: it repeats itself, so the head's prompt-lookup guesses come into play.
const PROMPT: &str = "5,17,99,3,5,17,99,3,5,17,99";

/// Every kind of lie the test-only faulty peer tells (`hide` has its own test).
const LIES: [&str; 5] = [
    "flip-bit",
    "skip-layer",
    "other-weights",
    "stale:0.5",
    "attention",
];

/// `dcd generate` of the test prompt with `source` (`--model M` or `--api URL`) and `extra`.
fn run(source: &[&str], extra: &[&str], max_new: &str, seed: &str, t: &str) -> Value {
    let mut args = source.to_vec();
    args.extend_from_slice(&[
        "--prompt-ids",
        PROMPT,
        "--max-new-tokens",
        max_new,
        "--ignore-eos",
        "--seed",
        seed,
        "--temperature",
        t,
    ]);
    args.extend_from_slice(extra);
    generate_json(&args)
}

fn local(model: &Path, max_new: &str, seed: &str, t: &str) -> Value {
    run(&["--model", model.to_str().unwrap()], &[], max_new, seed, t)
}

fn through(api: &str, extra: &[&str], max_new: &str, seed: &str, t: &str) -> Value {
    run(&["--api", api], extra, max_new, seed, t)
}

/// Runs a swarm with a liar (`fault`) whose head checks as `head_extra` says; the lie must be
/// caught, proven, and the liar excluded by the head and by the honest peer, with the client
/// ending with the honest tokens. Returns the head's status `audits` section.
fn lie_is_caught(model: &Path, head_extra: &[&str], fault: &str) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, l) = swarm_with_liar(dir.path(), model, head_extra, fault);
    // 24 tokens: a liar on half its hops (stale:0.5) lies at least once but with
    // probability 2^-23 (its fault coins are per generation, so this is random).
    // With log-probabilities: a correction must replace those of the tokens it replaces.
    let logprobs = ["--top-logprobs", "2"];
    // Greedy: these random-weight models repeat themselves then (not when sampled), so the
    // head's prompt-lookup guesses are both kept and missed, and the lie is in laps of several
    // positions that stages cut back.
    let want = run(
        &["--model", model.to_str().unwrap()],
        &logprobs,
        "24",
        "3",
        "0",
    );
    let got = through(&a.api, &logprobs, "24", "3", "0");
    // The client ends with the honest tokens, final logits and log-probabilities.
    assert_eq!(got["tokens"], want["tokens"], "{fault}");
    assert_eq!(got["final_logits"], want["final_logits"], "{fault}");
    assert_eq!(got["logprobs"], want["logprobs"], "{fault}");
    assert_eq!(
        got["logprobs"].as_array().map(Vec::len),
        Some(24),
        "{fault}"
    );
    assert_eq!(
        a.excluded(),
        vec![l.peer_id.clone()],
        "{fault}: the head excludes the liar"
    );
    // The honest stage fetches the gossiped proof, checks it itself, and excludes too.
    wait_until(
        "the honest peer to exclude the liar",
        Duration::from_secs(30),
        || b.excluded() == vec![l.peer_id.clone()],
    );
    let status = a.status();
    let audits = status["audits"].clone();
    // The head guessed tokens ahead, kept some guesses and dropped others: the lie was in laps
    // of several positions, and stages cut their caches back past the guesses that missed.
    let (guessed, kept) = (&status["tokens_guessed"], &status["guesses_kept"]);
    assert!(
        kept.as_u64() > Some(0) && guessed.as_u64() > kept.as_u64(),
        "{fault}: {guessed} guessed, {kept} kept"
    );
    // The liar is out of every route: the next generation never touches it.
    let hops_before = l.status()["hops_served"].as_u64().unwrap();
    let again = through(&a.api, &[], "6", "1", "0");
    assert_eq!(again["tokens"], local(model, "6", "1", "0")["tokens"]);
    assert_eq!(
        l.status()["hops_served"].as_u64().unwrap(),
        hops_before,
        "{fault}: routes avoid the liar"
    );
    // The proof file verifies with anyone's copy of the weights.
    let proofs: Vec<_> = std::fs::read_dir(a.data.join("proofs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(proofs.len(), 1, "{fault}");
    let out = run_dcd(&[
        "verify-proof",
        proofs[0].to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
    ]);
    assert!(out.starts_with("valid"), "{fault}: {out}");
    audits
}

#[test]
fn every_kind_of_lie_is_caught_proven_and_excluded() {
    let model = fixtures().join("llama");
    for fault in LIES {
        let extra = ["--audit-rate", "1", "--spot-check-rate", "0"];
        let audits = lie_is_caught(&model, &extra, fault);
        assert!(audits["failed"].as_u64().unwrap() >= 1, "{fault}: {audits}");
        assert_eq!(audits["spot_checks"]["run"], 0, "{fault}: {audits}");
    }
}

#[test]
fn spot_checks_alone_catch_every_kind_of_lie() {
    // No replay audits: only revealed rows, Freivalds' test, the attention and the glue
    // recomputed.
    let model = fixtures().join("qwen2");
    for fault in LIES {
        let extra = ["--audit-rate", "0", "--spot-check-rate", "1"];
        let audits = lie_is_caught(&model, &extra, fault);
        let spot = &audits["spot_checks"];
        assert!(spot["failed"].as_u64().unwrap() >= 1, "{fault}: {audits}");
        assert_eq!(audits["run"], 0, "{fault}: no replay audit ran: {audits}");
    }
}

#[test]
fn a_lie_in_one_prompt_row_is_caught_by_spot_checks_alone() {
    // The liar flips one bit of the last row of its prefill hop's output, keeping and revealing
    // it as signed, and serves every decode hop honestly: only a check that recomputes that
    // row sees it, and a prefill hop's drawn parts are checked at every row (a check of one
    // random row would miss it eight times in nine).
    let model = fixtures().join("qwen2");
    let extra = ["--audit-rate", "0", "--spot-check-rate", "1"];
    let audits = lie_is_caught(&model, &extra, "prompt");
    assert!(
        audits["spot_checks"]["failed"].as_u64().unwrap() >= 1,
        "{audits}"
    );
    assert_eq!(audits["run"], 0, "no replay audit ran: {audits}");
}

#[test]
fn a_liar_that_reveals_nothing_is_audited_by_replay() {
    // Spot checks only, and the liar refuses every reveal and cache-row request: a refused
    // one-row reveal makes the head audit the hop, and with no cache rows the audit replays.
    let model = fixtures().join("qwen2");
    let extra = ["--audit-rate", "0", "--spot-check-rate", "1"];
    let audits = lie_is_caught(&model, &extra, "hide");
    let spot = &audits["spot_checks"];
    assert!(spot["unavailable"].as_u64().unwrap() >= 1, "{audits}");
    // Only the honest stage's reveals were checked (once the liar is out, it serves 2..4).
    assert_eq!(spot["failed"], 0, "the liar answered no reveal: {audits}");
    assert!(audits["failed"].as_u64().unwrap() >= 1, "{audits}");
    assert_eq!(
        audits["from_cache"], 0,
        "no cache rows were revealed: {audits}"
    );
}

/// The peers of one route, as `dcd generate --json` lists it.
fn route_peers(route: &Value) -> Vec<String> {
    route
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["peer"].as_str().unwrap().to_string())
        .collect()
}

/// Runs a generation through a swarm whose stage for 2..4 that attracts the route (the faulty
/// peer) misbehaves as `fault` in a way nothing can prove: the head must not use its hop and
/// must hand the layers to the honest peer, which replays the stage's inputs so far, without
/// redoing any other stage's work; the client ends with the honest tokens, nothing to
/// correct, and no one is excluded. Returns the swarm.
fn goes_on_without(fault: &str) -> (tempfile::TempDir, Daemon, Daemon, Daemon) {
    let model = fixtures().join("llama");
    let dir = tempfile::tempdir().unwrap();
    // Every hop audited and spot-checked: the replayed hops are checked like any other, and an
    // honest replay never fails a check.
    let every = ["--audit-rate", "1", "--spot-check-rate", "1"];
    let (head, honest, faulty) = swarm_with_liar(dir.path(), &model, &every, fault);
    let want = local(&model, "8", "5", "0.8");
    let got = through(&head.api, &[], "8", "5", "0.8");
    assert_eq!(got["tokens"], want["tokens"], "{fault}");
    assert_eq!(got["final_logits"], want["final_logits"], "{fault}");
    assert_eq!(got["corrections"], serde_json::json!([]), "{fault}: {got}");
    let routes = got["routes"].as_array().unwrap();
    assert_eq!(
        routes.len(),
        2,
        "{fault}: one attempt without the peer: {got}"
    );
    assert!(route_peers(&routes[0]).contains(&faulty.peer_id), "{got}");
    let last = route_peers(&routes[1]);
    assert!(
        !last.contains(&faulty.peer_id) && last.contains(&honest.peer_id),
        "{got}"
    );
    let status = head.status();
    assert_eq!(status["stages_replaced"], 1, "{fault}");
    assert_eq!(status["reroutes"], 0, "{fault}: nothing recomputed whole");
    // The head's own stage ran every step once, as the honest peer did (replayed, then on).
    assert_eq!(
        status["hops_served"],
        honest.status()["hops_served"],
        "{fault}"
    );
    assert!(head.excluded().is_empty() && honest.excluded().is_empty());
    let audits = &status["audits"];
    // Each of the honest peer's 8 hops was audited, or found its auditor (the faulty peer, the
    // only other one serving 2..4) gone.
    let audited = audits["per_peer"][&honest.peer_id]["run"]
        .as_u64()
        .unwrap_or(0)
        + audits["unavailable"].as_u64().unwrap();
    assert!(audited >= 8, "{fault}: {audits}");
    assert_eq!(audits["failed"], 0, "{fault}: {audits}");
    let spot = &audits["spot_checks"];
    assert!(spot["run"].as_u64().unwrap() > 0, "{fault}: {audits}");
    assert_eq!(spot["failed"], 0, "{fault}: {audits}");
    // The head remembers: the next generation goes around the peer from the start.
    let again = through(&head.api, &[], "8", "5", "0.8");
    assert_eq!(again["tokens"], want["tokens"], "{fault}");
    let routes = again["routes"].as_array().unwrap();
    assert_eq!(routes.len(), 1, "{fault}: {again}");
    assert!(
        !route_peers(&routes[0]).contains(&faulty.peer_id),
        "{again}"
    );
    (dir, head, honest, faulty)
}

#[test]
fn a_record_off_the_chain_is_not_used_and_proves_nothing() {
    // The peer computes honestly but signs its records off the generation's chain of inputs,
    // so no proof could include them: a lie in its hop would go unpunished.
    let (_dir, head, _honest, faulty) = goes_on_without("chain");
    assert!(
        head.log_text()
            .contains("does not continue the generation's chain"),
        "the head names why"
    );
    assert!(faulty.excluded().is_empty());
}

#[test]
fn a_trace_other_than_the_signed_one_is_not_used_and_proves_nothing() {
    // The peer signs honestly but sends another trace: a proof needs the signed one.
    let (_dir, head, _honest, _faulty) = goes_on_without("trace");
    assert!(
        head.log_text()
            .contains("the trace's root is not the one signed in the record"),
        "the head names why"
    );
}

#[test]
fn a_stage_that_leaves_mid_generation_is_replaced_exactly() {
    // The peer quits at its first one-row hop, after the client holds the first token: the
    // recomputation on the honest peer gives the same bits, so nothing is corrected.
    let (_dir, _head, _honest, mut faulty) = goes_on_without("leave");
    assert_eq!(
        faulty.child.try_wait().unwrap().and_then(|s| s.code()),
        Some(3),
        "the faulty peer left"
    );
}

#[test]
fn a_liar_that_leaves_is_still_caught_and_its_lie_not_built_on() {
    // The peer lies on the prompt hop, then leaves. The honest peer taking its layers over
    // replays that hop and gets another output than the one signed: the head must not go on
    // from the lie but recompute the generation, and the audit of the prompt hop proves it.
    let model = fixtures().join("llama");
    let dir = tempfile::tempdir().unwrap();
    let every = ["--audit-rate", "1"];
    let (head, honest, faulty) = swarm_with_liar(dir.path(), &model, &every, "flip-leave");
    let want = local(&model, "8", "5", "0.8");
    let got = through(&head.api, &[], "8", "5", "0.8");
    assert_eq!(got["tokens"], want["tokens"]);
    assert_eq!(got["final_logits"], want["final_logits"]);
    assert!(
        head.log_text().contains(&format!(
            "{} and {} disagree",
            honest.peer_id, faulty.peer_id
        )),
        "the replay's disagreement is logged"
    );
    assert_eq!(head.status()["stages_replaced"], 1);
    assert_eq!(head.excluded(), vec![faulty.peer_id.clone()]);
    let routes = got["routes"].as_array().unwrap();
    let last = route_peers(routes.last().unwrap());
    assert!(
        !last.contains(&faulty.peer_id) && last.contains(&honest.peer_id),
        "{got}"
    );
}

#[test]
fn the_client_is_told_when_the_route_changes() {
    let model = fixtures().join("llama");
    let dir = tempfile::tempdir().unwrap();
    let (head, honest, faulty) = swarm_with_liar(dir.path(), &model, &[], "trace");
    let out = std::process::Command::new(dcd())
        .args(["generate", "--api", &head.api, "--prompt-ids", PROMPT])
        .args(["--max-new-tokens", "4"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let said = err
        .lines()
        .find(|l| l.starts_with("[the route changed: "))
        .unwrap_or_else(|| panic!("nothing said: {err}"));
    assert!(
        said.contains(&format!("2..4@{}", honest.peer_id)) && !said.contains(&faulty.peer_id),
        "{said}"
    );
}

/// Starts a second honest peer for 2..4 in a [`swarm_with_liar`] and waits until `head` sees it.
fn second_honest(dir: &Path, model: &Path, head: &Daemon) -> Daemon {
    let peer = Daemon::start(
        dir,
        "honest2",
        model,
        &["--layers", "2..4", "--no-head", "--bootstrap", &head.addr],
    );
    wait_until("the second honest peer", Duration::from_secs(30), || {
        head.sees_serving(3)
    });
    peer
}

#[test]
fn verify_all_goes_on_without_a_peer_that_leaves() {
    // Under --verify all the peer that leaves is one of a hop's two; the recomputation pairs
    // the two honest peers instead, and releases the same tokens.
    let model = fixtures().join("llama");
    let dir = tempfile::tempdir().unwrap();
    let (head, honest, faulty) = swarm_with_liar(dir.path(), &model, &[], "leave");
    let honest2 = second_honest(dir.path(), &model, &head);
    let got = through(&head.api, &["--verify", "all"], "8", "5", "0.8");
    let want = local(&model, "8", "5", "0.8");
    assert_eq!(got["tokens"], want["tokens"]);
    assert_eq!(got["final_logits"], want["final_logits"]);
    assert_eq!(got["corrections"], serde_json::json!([]), "{got}");
    let routes = got["routes"].as_array().unwrap();
    assert_eq!(routes.len(), 2, "{got}");
    assert!(route_peers(&routes[0]).contains(&faulty.peer_id), "{got}");
    let last = route_peers(&routes[1]);
    assert!(!last.contains(&faulty.peer_id), "{got}");
    assert!(last.contains(&honest.peer_id) || last.contains(&honest2.peer_id));
    assert!(head.excluded().is_empty());
    assert_eq!(head.status()["reroutes"], 1);
}

#[test]
fn verify_all_releases_only_checked_tokens() {
    let model = fixtures().join("gpt2");
    let dir = tempfile::tempdir().unwrap();
    // Lying on half of 24 hops: it lies at all except with probability 2^-24.
    let (a, _b, l) = swarm_with_liar(dir.path(), &model, &["--audit-rate", "1"], "flip-bit:0.5");
    // A second honest peer for 2..4, so every hop still has a second peer once the liar is out.
    let b2 = second_honest(dir.path(), &model, &a);
    // Greedy on the prompt that repeats itself: the head guesses, and the paired recomputation
    // of every hop runs the guessed rows too.
    let got = through(&a.api, &["--verify", "all"], "24", "0", "0");
    assert_eq!(got["tokens"], local(&model, "24", "0", "0")["tokens"]);
    assert_eq!(got["corrections"], serde_json::json!([]), "{got}");
    let guessed = a.status()["tokens_guessed"].as_u64().unwrap();
    assert!(guessed > 0, "the head guessed no token under --verify all");
    let got = through(&a.api, &["--verify", "all"], "24", "9", "0.9");
    let want = local(&model, "24", "9", "0.9");
    assert_eq!(got["tokens"], want["tokens"]);
    assert_eq!(got["final_logits"], want["final_logits"]);
    // Nothing wrong was ever sent, so nothing needed correcting.
    assert_eq!(got["corrections"], serde_json::json!([]), "{got}");
    assert_eq!(a.excluded(), vec![l.peer_id.clone()]);
    drop(b2);
}

#[test]
fn honest_swarms_never_fail_an_audit() {
    let model = fixtures().join("mistral");
    let dir = tempfile::tempdir().unwrap();
    // Two heads, each with a twin for its own half and a remote other half: every hop a head
    // sends out has a second peer to audit it.
    let a = Daemon::start(
        dir.path(),
        "a",
        &model,
        &[
            "--layers",
            "0..2",
            "--audit-rate",
            "1",
            "--spot-check-rate",
            "1",
        ],
    );
    let b = Daemon::start(
        dir.path(),
        "b",
        &model,
        &[
            "--layers",
            "2..4",
            "--bootstrap",
            &a.addr,
            // Half the hops: audits that skip hops carry the cache rows in between. Parts
            // drawn at 0.3: checks that test only some parts, from only the rows they need.
            "--audit-rate",
            "0.5",
            "--spot-check-rate",
            "0.3",
        ],
    );
    let c = Daemon::start(
        dir.path(),
        "c",
        &model,
        &["--layers", "0..2", "--no-head", "--bootstrap", &a.addr],
    );
    let d = Daemon::start(
        dir.path(),
        "d",
        &model,
        &["--layers", "2..4", "--no-head", "--bootstrap", &a.addr],
    );
    wait_until("the swarm", Duration::from_secs(30), || {
        a.sees_serving(3) && b.sees_serving(3)
    });
    // Each generation's head is elected by rendezvous on its random id, so six generations
    // leave a or b heading none of them once in 32 runs: go on until each has headed two
    // (their checks are asserted below), at most 30 generations.
    let headed = |d: &Daemon| d.status()["tokens_generated"].as_u64().unwrap();
    for seed in 0..30 {
        if seed >= 6 && headed(&a) >= 2 * 21 && headed(&b) >= 2 * 21 {
            break;
        }
        let s = seed.to_string();
        // 30 positions: past Mistral's window of 16.
        let got = through(
            if seed % 2 == 0 { &a.api } else { &b.api },
            &[],
            "21",
            &s,
            "1.0",
        );
        assert_eq!(got["tokens"], local(&model, "21", &s, "1.0")["tokens"]);
    }
    // Greedy on a prompt that repeats itself: the heads guess tokens ahead, keep some guesses
    // and miss others, so stages cut their caches back, and every check and audit of those
    // laps must pass as well.
    for api in [&a.api, &b.api] {
        let args = |source: [&str; 2]| {
            let mut v = source.to_vec();
            v.extend_from_slice(&["--prompt-ids", "1,2,3,1,2,3,1,2,3"]);
            v.extend_from_slice(&[
                "--max-new-tokens",
                "30",
                "--ignore-eos",
                "--temperature",
                "0",
            ]);
            generate_json(&v)
        };
        let local = args(["--model", model.to_str().unwrap()]);
        assert_eq!(args(["--api", api])["tokens"], local["tokens"]);
    }
    let count = |key: &str| -> u64 {
        [&a, &b]
            .iter()
            .map(|d| d.status()[key].as_u64().unwrap())
            .sum()
    };
    let (guessed, kept) = (count("tokens_guessed"), count("guesses_kept"));
    assert!(kept > 0 && guessed > kept, "{guessed} guessed, {kept} kept");
    let (mut run, mut failed, mut spot_run, mut spot_failed) = (0, 0, 0, 0);
    // Every remote hop of a's generations and about half of b's were audited, yet each
    // auditor ran each position once (its session cache continues from the last audit):
    // no more positions than the stages served.
    let all = [&a, &b, &c, &d];
    let replayed: u64 = all
        .iter()
        .map(|x| x.status()["audit_positions_replayed"].as_u64().unwrap())
        .sum();
    let served: u64 = all
        .iter()
        .map(|x| x.status()["positions_served"].as_u64().unwrap())
        .sum();
    assert!(
        replayed > 0 && replayed <= served,
        "replayed {replayed}, served {served}"
    );
    let (mut from_cache, mut cache_bytes) = (0, 0);
    for d in [&a, &b] {
        let au = &d.status()["audits"];
        from_cache += au["from_cache"].as_u64().unwrap();
        cache_bytes += au["from_cache_bytes"].as_u64().unwrap();
        run += au["run"].as_u64().unwrap();
        failed += au["failed"].as_u64().unwrap();
        spot_run += au["spot_checks"]["run"].as_u64().unwrap();
        spot_failed += au["spot_checks"]["failed"].as_u64().unwrap();
        assert!(d.excluded().is_empty());
    }
    assert!(run > 20, "audits must actually run: {run}");
    // Every audit of a hop after the first starts from the stage's committed cache rows; only
    // the prefill hops (position 0) are replayed.
    assert!(
        from_cache > 10 && from_cache < run,
        "audits from cache rows: {from_cache} of {run}"
    );
    // Each cache row travels once per audited stage and generation: at most the positions
    // served times the stage's 2 layers times a row's bytes (sending the whole cache with
    // every audit would be about 10 times that).
    let cfg = dc_model::Model::load(&model, &Default::default())
        .unwrap()
        .config;
    let row = dc_model::attention::LayerCache::new(cfg.num_kv_heads, cfg.head_dim).row_bytes();
    assert!(
        cache_bytes > 0 && cache_bytes <= served * 2 * row as u64,
        "{cache_bytes} bytes of cache rows for {served} positions served"
    );
    assert_eq!(failed, 0, "an honest swarm never fails an audit");
    assert!(spot_run > 20, "spot checks must actually run: {spot_run}");
    // a draws every part of every hop: its checks of a stage's consecutive hops go in batches
    // of up to four per reveal exchange (the last batch of a generation may be short).
    let sa = &a.status()["audits"]["spot_checks"];
    let (a_run, a_exchanges) = (
        sa["run"].as_u64().unwrap(),
        sa["exchanges"].as_u64().unwrap(),
    );
    assert!(
        a_run <= 4 * a_exchanges && 2 * a_exchanges < a_run,
        "a's checks: {sa}"
    );
    // b draws parts at 0.3: its checks test some parts of a layer, not all ten, and recompute
    // the attention of only some layers.
    let bs = &b.status()["audits"]["spot_checks"];
    let (layers, parts, attention) = (
        bs["layers"].as_u64().unwrap(),
        bs["parts"].as_u64().unwrap(),
        bs["attention"].as_u64().unwrap(),
    );
    assert!(
        layers > 0 && parts > layers && parts < 10 * layers && attention < layers,
        "b's checks: {bs}"
    );
    assert_eq!(spot_failed, 0, "an honest swarm never fails a spot check");
    drop((c, d));
}
