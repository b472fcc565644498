//! The model's files through the swarm: real `dcd join` processes on loopback, some started
//! with only a model id. They fetch the manifest and exactly the pieces of their layers from
//! their peers, check each piece, and then serve and head generations whose bits equal
//! `dcd generate --local` on the original file. A peer that sends corrupt pieces is named and
//! avoided, and an interrupted fetch resumes from the pieces it holds.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use dc_model::fetched::{FetchedModel, HELD_FILE};
use dc_tests::*;

fn smollm2() -> PathBuf {
    dc_model::store::installed_smollm2()
        .expect("SmolLM2 is not installed: run scripts/fetch-model.sh")
}

/// Greedy and seeded generations through `api` equal the local run on `model`, bit for bit.
fn assert_same_as_local(model: &Path, api: &str, prompt: &str) {
    for (t, seed) in [("0", "0"), ("0.9", "3")] {
        let args = [
            "--prompt-ids",
            prompt,
            "--max-new-tokens",
            "8",
            "--temperature",
            t,
            "--seed",
            seed,
            "--ignore-eos",
        ];
        let swarm = generate_json(&[&["--api", api][..], &args].concat());
        let local =
            generate_json(&[&["--model", model.to_str().unwrap(), "--local"][..], &args].concat());
        assert_eq!(swarm["tokens"], local["tokens"], "temperature {t}");
        assert_eq!(
            swarm["final_logits"], local["final_logits"],
            "temperature {t}"
        );
    }
}

/// The fetched folder of `id` in daemon `d`'s store.
fn fetched(d: &Daemon, id: &str) -> FetchedModel {
    FetchedModel::open(&d.data.join("models").join(id)).unwrap()
}

fn printed(d: &Daemon, prefix: &str) -> Option<String> {
    d.out
        .lock()
        .unwrap()
        .iter()
        .find(|l| l.starts_with(prefix))
        .cloned()
}

/// A stage `b` serving `layers` without the head, started with only the model id of `a`,
/// whom it bootstraps to; and that id.
fn fetching_stage(dir: &Path, a: &Daemon, layers: &str) -> (Daemon, String) {
    let id = a.status()["model_id"].as_str().unwrap().to_string();
    let args = ["--layers", layers, "--no-head", "--bootstrap", &a.addr];
    (Daemon::start(dir, "b", Path::new(&id), &args), id)
}

/// The held pieces of a fetched model, as its list on disk says.
fn held(f: &FetchedModel) -> BTreeSet<u32> {
    let all: Vec<u32> = (0..f.manifest().pieces.len() as u32).collect();
    let missing: BTreeSet<u32> = f.missing(&all).into_iter().collect();
    all.into_iter().filter(|i| !missing.contains(i)).collect()
}

#[test]
fn daemons_with_only_the_model_id_fetch_their_layers_and_give_the_same_bits() {
    let model = smollm2();
    let dir = tempfile::tempdir().unwrap();
    let a = Daemon::start(dir.path(), "a", &model, &["--layers", "15..30"]);
    // A stage with no file at all: it fetches layers 0..15 and nothing of the head.
    let (b, id) = fetching_stage(dir.path(), &a, "0..15");
    let f = fetched(&b, &id);
    let wanted: BTreeSet<u32> = f.manifest().needed(0..15, false).into_iter().collect();
    assert_eq!(
        held(&f),
        wanted,
        "b holds exactly the pieces of its layers and the headers"
    );
    let line = printed(&b, "fetching layers 0..15 from peers: ").expect("b says what it fetches");
    assert!(
        line.contains(&format!(
            "{} pieces",
            wanted.len() - f.manifest().meta_pieces().len()
        )),
        "{line}"
    );
    // The rest of the file was never written: it takes less than half its length on disk.
    let gguf = f.model_path();
    let meta = std::fs::metadata(&gguf).unwrap();
    assert_eq!(meta.len(), std::fs::metadata(&model).unwrap().len());
    assert!(
        meta.blocks() * 512 < meta.len() / 2,
        "{} blocks of {}",
        meta.blocks(),
        meta.len()
    );
    let s = b.status();
    assert_eq!(s["model_id"], id.as_str());
    assert_eq!(s["fetched_model"], true);
    assert_eq!(s["fetch"]["finished"], true);
    assert_eq!(s["fetch"]["done_bytes"], s["fetch"]["total_bytes"]);
    assert_eq!(s["fetch"]["corrupt_peers"].as_array().unwrap().len(), 0);

    wait_until("a to see b serving", Duration::from_secs(30), || {
        a.sees_serving(1)
    });
    assert_same_as_local(&model, &a.api, "1,504,3575,282,4649,314");
    assert!(
        b.status()["hops_served"].as_u64().unwrap() > 0,
        "b served no hop"
    );

    // A head with no file either: it fetches every layer and the head's tensors, partly from
    // b, which serves the pieces it fetched.
    let c = Daemon::start(
        dir.path(),
        "c",
        Path::new(&id),
        &["--layers", "0..30", "--bootstrap", &b.addr],
    );
    let f = fetched(&c, &id);
    assert_eq!(held(&f).len(), f.manifest().pieces.len());
    assert_eq!(c.status()["head"], true);
    assert_same_as_local(&model, &c.api, "1,9690,314,253,2726");
}

#[test]
fn a_peer_sending_corrupt_pieces_is_named_and_an_interrupted_fetch_resumes() {
    let model = smollm2();
    let dir = tempfile::tempdir().unwrap();
    let honest = Daemon::start(dir.path(), "honest", &model, &["--layers", "0..30"]);
    let liar = Daemon::start(
        dir.path(),
        "liar",
        &model,
        &[
            "--layers",
            "0..30",
            "--fault",
            "corrupt-pieces",
            "--bootstrap",
            &honest.addr,
        ],
    );
    let id = honest.status()["model_id"].as_str().unwrap().to_string();
    assert_eq!(liar.status()["model_id"], id.as_str());
    // It knows only the liar at first, so the liar is asked first.
    let args = ["--layers", "0..30", "--bootstrap", &liar.addr];
    let c = Daemon::start(dir.path(), "c", Path::new(&id), &args);
    let named = format!("peer {} sent a corrupt piece", liar.peer_id);
    assert!(printed(&c, &named).is_some(), "{:?}", c.out.lock().unwrap());
    let s = c.status();
    assert_eq!(
        s["fetch"]["corrupt_peers"],
        serde_json::json!([liar.peer_id])
    );
    assert_eq!(s["fetch"]["finished"], true);
    let f = fetched(&c, &id);
    assert_eq!(
        held(&f).len(),
        f.manifest().pieces.len(),
        "every piece fetched elsewhere"
    );
    assert_same_as_local(&model, &c.api, "1,504,3575,282,4649,314");

    // Stopped, with the last pieces it fetched not yet recorded (as if it had been cut off
    // while fetching them), it fetches only those again.
    c.leave();
    let list = f.dir().join(HELD_FILE);
    let text = std::fs::read_to_string(&list).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    let dropped = 5;
    lines.truncate(lines.len() - dropped);
    std::fs::write(&list, lines.join("\n") + "\n").unwrap();
    let c = Daemon::start(dir.path(), "c", Path::new(&id), &args);
    let line = printed(&c, "fetching layers 0..30 and the head from peers: ").expect("c resumes");
    assert!(line.contains(&format!(": {dropped} pieces")), "{line}");
    let f = fetched(&c, &id);
    assert_eq!(held(&f).len(), f.manifest().pieces.len());
    assert_same_as_local(&model, &c.api, "1,9690,314,253,2726");
}

#[test]
fn a_hugging_face_folder_is_fetched_as_well() {
    let model = fixtures().join("llama");
    let dir = tempfile::tempdir().unwrap();
    let a = Daemon::start(dir.path(), "a", &model, &["--layers", "2..4"]);
    let (b, id) = fetching_stage(dir.path(), &a, "0..2");
    let f = fetched(&b, &id);
    // The configuration and the safetensors header came whole; a folder model opens from
    // the folder.
    assert!(f.dir().join("config.json").is_file());
    assert_eq!(f.model_path(), f.dir());
    wait_until("a to see b serving", Duration::from_secs(30), || {
        a.sees_serving(1)
    });
    assert_same_as_local(&model, &a.api, "1,2,3,4,5,6,7");
}

#[test]
fn a_daemon_streams_the_layers_its_memory_does_not_hold_and_gives_the_same_bits() {
    let model = smollm2();
    let (cfg, _) = dc_model::open::open_source(&model).unwrap();
    let (layer, head) = (
        dc_node::core::memory::layer_bytes(&cfg),
        dc_node::core::memory::head_bytes(&cfg),
    );
    // Room for the head weights and 10 of the 30 layers (a tenth is kept for caches).
    let budget = ((head + 10 * layer + layer / 2) * 10 / 9).to_string();
    let dir = tempfile::tempdir().unwrap();
    let a = Daemon::start(
        dir.path(),
        "a",
        &model,
        &["--layers", "0..30", "--max-memory", &budget],
    );
    let window = dc_model::stream::WINDOW;
    let streamed = 30 - (10 - window);
    let line = printed(&a, "serving layers 0..30 of 30").unwrap();
    assert!(
        line.ends_with(&format!(
            "with the head weights ({streamed} streamed from the weight cache)"
        )),
        "{line}"
    );
    let m = &a.status()["memory"];
    assert_eq!(m["streamed_layers"], streamed);
    // What it holds: the resident layers, the window and the head, within the budget.
    let held = m["weights"].as_u64().unwrap();
    assert_eq!(held, (10 - window + window) as u64 * layer + head);
    assert!(held <= budget.parse::<u64>().unwrap());
    let reads = m["layer_reads"].as_u64().unwrap();
    assert_same_as_local(&model, &a.api, "1,504,3575,282,4649,314");
    let after = a.status()["memory"]["layer_reads"].as_u64().unwrap();
    assert!(
        after >= reads + streamed as u64,
        "{reads} then {after}: layers read as hops reach them"
    );
}
