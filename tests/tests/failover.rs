//! A head that dies mid-generation (SIGKILL, as a volunteer's machine switching off): the
//! daemon that asked for the generation notices, the next peer in the rendezvous order takes
//! it over from the tokens the client holds, and the client's stream goes on with no duplicate
//! and no missing token, bit-identical to an undisturbed run — through the control API and
//! through the OpenAI API, streamed and not.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dc_tests::*;
use serde_json::{json, Value};

fn smollm2() -> PathBuf {
    dc_model::store::installed_smollm2()
        .expect("SmolLM2 is not installed: run scripts/fetch-model.sh")
}

/// A requester without the head weights and two daemons that can head, each serving every
/// layer (so a route is its head alone, and killing the head loses every stage it ran).
fn swarm(dir: &Path, model: &Path) -> (Daemon, Vec<Daemon>) {
    let requester = Daemon::start(dir, "requester", model, &["--no-head"]);
    let heads: Vec<Daemon> = ["b", "c"]
        .iter()
        .map(|n| Daemon::start(dir, n, model, &["--bootstrap", &requester.addr]))
        .collect();
    wait_until("everyone to see everyone", Duration::from_secs(60), || {
        requester.sees_serving(2) && heads.iter().all(|h| h.sees_serving(2))
    });
    (requester, heads)
}

/// Kills (SIGKILL) the daemon with peer id `peer`; returns its index.
fn kill(heads: &mut [Daemon], peer: &str) -> usize {
    let i = heads
        .iter()
        .position(|h| h.peer_id == peer)
        .unwrap_or_else(|| panic!("the head {peer} is not one of the heads"));
    heads[i].child.kill().unwrap();
    heads[i].child.wait().unwrap();
    i
}

/// How long each daemon's log is now.
fn log_lengths(heads: &[Daemon]) -> Vec<usize> {
    heads.iter().map(|h| h.log_text().len()).collect()
}

/// Kills whichever of `heads` logs, after the first `seen` bytes of its log, that it heads a
/// generation, once one does.
fn kill_the_head_when_it_starts(heads: &mut [Daemon], seen: &[usize]) -> String {
    let start = Instant::now();
    loop {
        let heading = heads.iter().zip(seen).find(|(h, &n)| {
            let log = h.log_text();
            log.get(n..)
                .is_some_and(|new| new.contains("heading generation"))
        });
        if let Some((h, _)) = heading {
            let peer = h.peer_id.clone();
            kill(heads, &peer);
            return peer;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no head started the generation"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

const PROMPT: &str = "1,4093,314,253,1345,28,665,436,253,1135,1183";

/// The undisturbed run, in one process.
fn local(model: &Path, max_new: &str) -> Value {
    generate_json(&[
        "--model",
        model.to_str().unwrap(),
        "--local",
        "--prompt-ids",
        PROMPT,
        "--max-new-tokens",
        max_new,
        "--temperature",
        "0.9",
        "--top-k",
        "50",
        "--seed",
        "7",
        "--ignore-eos",
    ])
}

#[test]
fn a_head_killed_mid_generation_is_taken_over_exactly() {
    let model = smollm2();
    let dir = tempfile::tempdir().unwrap();
    let (requester, mut heads) = swarm(dir.path(), &model);
    let body = json!({
        "prompt_ids": PROMPT.split(',').map(|t| t.parse::<u32>().unwrap()).collect::<Vec<_>>(),
        "max_new_tokens": 120, "temperature": 0.9, "top_k": 50, "seed": 7, "ignore_eos": true,
    });
    let resp = ureq::post(&format!("{}/generate", requester.api))
        .header("Content-Type", "application/json")
        .send(body.to_string())
        .unwrap();
    let lines = BufReader::new(resp.into_body().into_reader()).lines();
    let (mut killed, mut indices, mut ids, mut heads_seen) = (None, vec![], vec![], vec![]);
    let mut done = Value::Null;
    let mut died_at = None;
    let mut failover_wait = None;
    for line in lines {
        let ev: Value = serde_json::from_str(&line.unwrap()).unwrap();
        match ev["event"].as_str().unwrap() {
            "started" => heads_seen.push(ev["head"].as_str().unwrap().to_string()),
            "token" => {
                if let (Some(t), None) = (died_at, failover_wait) {
                    failover_wait = Some(Instant::now().duration_since(t));
                }
                indices.push(ev["index"].as_u64().unwrap());
                ids.push(ev["id"].clone());
                if killed.is_none() && indices.len() == 3 {
                    let head = heads_seen.last().unwrap().clone();
                    kill(&mut heads, &head);
                    died_at = Some(Instant::now());
                    killed = Some(head);
                }
            }
            "done" => {
                done = ev;
                break;
            }
            other => panic!("unexpected event {other}: {ev}"),
        }
    }
    let killed = killed.expect("the generation ended before its head could be killed");
    assert!(done.is_object(), "the stream ended without a done event");
    // Two heads: the killed one, then the next in the rendezvous order.
    assert_eq!(heads_seen.len(), 2, "{heads_seen:?}");
    assert_eq!(heads_seen[0], killed);
    assert_ne!(heads_seen[1], killed);
    // No duplicate, no missing token, and no correction.
    assert_eq!(indices, (0..120).collect::<Vec<u64>>());
    assert_eq!(Value::Array(ids), done["tokens"]);
    // Bit-identical to the undisturbed run: every token and the final logits.
    let reference = local(&model, "120");
    assert_eq!(done["tokens"], reference["tokens"]);
    assert_eq!(done["final_logits"], reference["final_logits"]);
    assert_eq!(requester.status()["head_failovers"], 1);
    let log = requester.log_text();
    assert!(
        log.contains("stopped answering") && log.contains("takes it over from token"),
        "{log}"
    );
    eprintln!(
        "the next token came {:?} after the head was killed",
        failover_wait.unwrap_or_default()
    );
}

/// The OpenAI completion `body` through the requester, its text and token count.
fn completion(api: &str, body: &Value) -> (String, u64) {
    let mut r = ureq::post(&format!("{api}/v1/completions"))
        .header("Content-Type", "application/json")
        .send(body.to_string())
        .unwrap();
    let v: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
    (
        v["choices"][0]["text"].as_str().unwrap().to_string(),
        v["usage"]["completion_tokens"].as_u64().unwrap(),
    )
}

/// The OpenAI completion `body` streamed: the text of its chunks, in order.
fn streamed(api: &str, body: &Value) -> String {
    let resp = ureq::post(&format!("{api}/v1/completions"))
        .header("Content-Type", "application/json")
        .send(body.to_string())
        .unwrap();
    let mut text = String::new();
    for line in BufReader::new(resp.into_body().into_reader()).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return text;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        assert!(chunk.get("error").is_none(), "{chunk}");
        text.push_str(chunk["choices"][0]["text"].as_str().unwrap_or_default());
    }
    panic!("the stream ended without [DONE]: {text:?}");
}

#[test]
fn the_openai_api_goes_on_through_a_head_killed_mid_generation() {
    let model = smollm2();
    let dir = tempfile::tempdir().unwrap();
    let (requester, mut heads) = swarm(dir.path(), &model);
    let mut models = ureq::get(&format!("{}/v1/models", requester.api))
        .call()
        .unwrap();
    let models: Value = serde_json::from_str(&models.body_mut().read_to_string().unwrap()).unwrap();
    let name = models["data"][0]["id"].clone();
    let body = json!({"model": name, "prompt": "Once upon a time, there was a little",
        "max_tokens": 120, "temperature": 0.9, "seed": 11, "ignore_eos": true});
    // Undisturbed, for reference.
    let (reference, n) = completion(&requester.api, &body);
    assert_eq!(n, 120);
    for stream in [false, true] {
        let seen = log_lengths(&heads);
        let api = requester.api.clone();
        let mut b = body.clone();
        b["stream"] = json!(stream);
        let run = std::thread::spawn(move || match stream {
            true => streamed(&api, &b),
            false => completion(&api, &b).0,
        });
        let killed = kill_the_head_when_it_starts(&mut heads, &seen);
        let text = run.join().unwrap();
        assert_eq!(
            text, reference,
            "stream {stream}: the killed head was {killed}"
        );
        // Bring the killed daemon back (same identity) for the next round.
        let i = heads.iter().position(|h| h.peer_id == killed).unwrap();
        let name = ["b", "c"][i];
        heads[i] = Daemon::start(dir.path(), name, &model, &["--bootstrap", &requester.addr]);
        wait_until(
            "the restarted head to be seen",
            Duration::from_secs(60),
            || requester.sees_serving(2) && heads[i].sees_serving(2),
        );
    }
    assert_eq!(requester.status()["head_failovers"], 2);
}
