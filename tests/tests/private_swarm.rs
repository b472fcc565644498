//! Private swarms: daemons holding the same pre-shared key (`--swarm-key`, libp2p pnet) form a
//! swarm and generate bit-identical tokens; a daemon without the key, or with another one,
//! cannot connect, never learns the swarm's peers, and the members log its attempts once, not
//! per attempt. Bad key files and QUIC addresses in a private swarm are refused with errors
//! that name them.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use dc_tests::*;

const ARGS: [&str; 8] = [
    "--prompt-ids",
    "1,2,3,4,5",
    "--max-new-tokens",
    "6",
    "--temperature",
    "0.8",
    "--seed",
    "11",
];

fn new_key(path: &Path) -> String {
    run_dcd(&["swarm-key", "new", path.to_str().unwrap()])
}

/// How many lines of `d`'s log contain `needle`.
fn log_lines(d: &Daemon, needle: &str) -> usize {
    d.log_text().lines().filter(|l| l.contains(needle)).count()
}

fn peers(d: &Daemon) -> usize {
    d.status()["peers"].as_array().unwrap().len()
}

#[test]
fn members_generate_and_outsiders_cannot_join() {
    let model = fixtures().join("llama");
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("swarm.key");
    let said = new_key(&key);
    assert!(said.contains("fingerprint"), "{said}");
    let text = std::fs::read_to_string(&key).unwrap();
    assert!(
        text.starts_with("/key/swarm/psk/1.0.0/\n/base16/\n"),
        "{text}"
    );
    // A key file is never overwritten.
    let again = Command::new(dcd())
        .args(["swarm-key", "new"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
    assert_eq!(std::fs::read_to_string(&key).unwrap(), text);

    let k = key.to_str().unwrap();
    let head = Daemon::start(
        dir.path(),
        "head",
        &model,
        &["--layers", "0..2", "--swarm-key", k],
    );
    let stage = Daemon::start(
        dir.path(),
        "stage",
        &model,
        &[
            "--layers",
            "2..4",
            "--no-head",
            "--swarm-key",
            k,
            "--bootstrap",
            &head.addr,
        ],
    );
    wait_until(
        "the members to see each other",
        Duration::from_secs(30),
        || head.sees_serving(1) && stage.sees_serving(1),
    );
    let status = head.status();
    assert!(status["private_swarm"].is_string(), "{status}");
    assert_eq!(status["peers"][0]["connection"], "direct", "{status}");

    // An outsider without the key, and one with another key, both bootstrapping to the head.
    let other = dir.path().join("other.key");
    new_key(&other);
    let outsider = Daemon::start(
        dir.path(),
        "outsider",
        &model,
        &["--layers", "2..4", "--no-head", "--bootstrap", &head.addr],
    );
    let stranger = Daemon::start(
        dir.path(),
        "stranger",
        &model,
        &[
            "--layers",
            "2..4",
            "--no-head",
            "--swarm-key",
            other.to_str().unwrap(),
            "--bootstrap",
            &head.addr,
        ],
    );
    // Ten announcement periods: long enough to have learnt of everyone in an open swarm.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(peers(&outsider), 0, "{}", outsider.status());
    assert_eq!(peers(&stranger), 0, "{}", stranger.status());
    assert_eq!(peers(&head), 1, "{}", head.status());
    assert_eq!(peers(&stage), 1, "{}", stage.status());
    assert_eq!(head.status()["connections"]["open"], 1);

    // The members still generate, bit-identical to a local run.
    let mut args = vec!["--api", head.api.as_str()];
    args.extend_from_slice(&ARGS);
    let swarm = generate_json(&args);
    let mut local_args = vec!["--model", model.to_str().unwrap(), "--local"];
    local_args.extend_from_slice(&ARGS);
    let local = generate_json(&local_args);
    assert_eq!(swarm["tokens"], local["tokens"]);
    assert_eq!(swarm["final_logits"], local["final_logits"]);
    let route = swarm["routes"].to_string();
    assert!(route.contains(&stage.peer_id), "{route}");

    // An intruder dialling again and again is logged once.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (client, _events) = bare_node("intruder");
        for _ in 0..6 {
            let _ = client.dial(head.addr.parse().unwrap()).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(client.connected_peers().await.unwrap().is_empty());
    });
    // A handshake with the wrong key fails at once or hangs on bytes that never come (it
    // depends on the random nonces), so the head may see a failure only when the intruder
    // goes away and its half-open connections close.
    drop(rt);
    let needle = "does not hold our swarm key";
    wait_until(
        "the head to log the intruder",
        Duration::from_secs(30),
        || log_lines(&head, needle) > 0,
    );
    std::thread::sleep(Duration::from_secs(1));
    let logged = log_lines(&head, needle);
    assert_eq!(logged, 1, "{}", head.log_text());
    assert_eq!(peers(&head), 1);
}

#[test]
fn bad_key_files_and_quic_in_a_private_swarm_are_refused() {
    let model = fixtures().join("llama");
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.key");
    std::fs::write(&bad, "/key/swarm/psk/1.0.0/\n/base16/\nnot-hex\n").unwrap();
    let join = |extra: &[&str]| {
        let out = Command::new(dcd())
            .args(["join", "--model"])
            .arg(&model)
            .args(["--no-mdns", "--api", "127.0.0.1:0", "--data-dir"])
            .arg(dir.path().join("data"))
            .args(extra)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let err = join(&["--swarm-key", bad.to_str().unwrap()]);
    assert!(err.contains("bad.key"), "{err}");
    let missing = dir.path().join("missing.key");
    let err = join(&["--swarm-key", missing.to_str().unwrap()]);
    assert!(err.contains("missing.key"), "{err}");

    let key = dir.path().join("swarm.key");
    new_key(&key);
    let err = join(&[
        "--swarm-key",
        key.to_str().unwrap(),
        "--listen",
        "/ip4/127.0.0.1/udp/0/quic-v1",
    ]);
    assert!(err.contains("TCP only"), "{err}");
}
