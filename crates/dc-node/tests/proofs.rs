//! Fraud proofs without a network: a stage that lies in each of the ways a faulty peer can,
//! the referee replay that finds where, and the proof every third party can check by re-running
//! one layer; forged proofs (altered record, altered input, wrong signer) are rejected, and an
//! honest stage can never be proven wrong.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::path::PathBuf;

use dc_kernels::{Gemm, Kernel};
use dc_model::{Activations, KvCache, LoadOptions, Model};
use dc_node::check::proof::{build_proof, check_consistency, find_dispute, verify_proof};
use dc_types::{
    FraudProof, GenerationId, HopRecord, HopTrace, LayerRange, ModelId, Point, ProofKind, Signed,
};
use libp2p::identity::Keypair;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/fixtures")
        .join(name)
}

/// What the head keeps about one stage: its inputs, signed records and traces.
struct Log {
    inputs: Vec<Activations>,
    records: Vec<Signed<HopRecord>>,
    traces: Vec<HopTrace>,
}

/// Runs 1 prefill hop of 9 positions and 6 decode hops through `layers`, lying on hop
/// `lie_at` with `lie` (which may change the output and the trace, keeping them consistent).
fn run_stage(
    model: &Model,
    key: &Keypair,
    layers: LayerRange,
    lie_at: usize,
    lie: impl Fn(&mut Activations, &mut HopTrace),
) -> Log {
    run_stage_on(model, key, layers, 3, lie_at, lie)
}

/// [`run_stage`] on the tokens `(i * 37 + first) % 500` (one run of generation 5 per `first`).
fn run_stage_on(
    model: &Model,
    key: &Keypair,
    layers: LayerRange,
    first: u32,
    lie_at: usize,
    lie: impl Fn(&mut Activations, &mut HopTrace),
) -> Log {
    let gemm = Gemm::new(Kernel::best(), 2).unwrap();
    let g = GenerationId([5; 16]);
    let mut head_cache = KvCache::new(&model.config, 0..layers.start as usize);
    let mut cache = KvCache::new(&model.config, layers.as_range());
    let mut log = Log {
        inputs: vec![],
        records: vec![],
        traces: vec![],
    };
    let ids: Vec<u32> = (0..15).map(|i| (i * 37 + first) % 500).collect();
    let (mut pos, mut previous) = (0, HopRecord::FIRST);
    for (step, len) in [9usize, 1, 1, 1, 1, 1, 1].into_iter().enumerate() {
        let mut x = model.embed(&ids[pos..pos + len], pos).unwrap();
        if layers.start > 0 {
            x = model.run_layers(&gemm, x, &mut head_cache).unwrap();
        }
        let mut t = HopTrace::from_position(pos);
        let mut y = model
            .run_layers_traced(&gemm, x.clone(), &mut cache, Some(&mut t))
            .unwrap();
        if step == lie_at {
            lie(&mut y, &mut t);
        }
        let record = HopRecord {
            generation: g,
            step: step as u64,
            layers,
            input: x.commitment(),
            output: y.commitment(),
            gemms: t.root(),
            previous,
        };
        previous = record.chain();
        log.records
            .push(dc_net::signing::sign(key, dc_types::HOP_RECORD_KIND, record).unwrap());
        log.inputs.push(x);
        log.traces.push(t);
        pos += len;
    }
    log
}

fn set_output(t: &mut HopTrace, y: &Activations) {
    let c = y.rows_from(t.from).commitment();
    t.entries.last_mut().unwrap().commitment = c;
}

fn prove(model: &Model, key: &Keypair, layers: LayerRange, log: &Log) -> FraudProof {
    let gemm = Gemm::new(Kernel::best(), 1).unwrap();
    let d = find_dispute(model, &gemm, layers, &log.inputs, &log.traces)
        .unwrap()
        .expect("the lie is found");
    build_proof(
        ModelId::default(),
        &key.public().to_peer_id().to_string(),
        &d,
        &log.records,
        &log.traces,
    )
}

fn check(p: &FraudProof) -> Result<(), String> {
    let path = fixture("llama");
    let (cfg, _) = dc_model::open::open_source(&path).unwrap();
    let layer = dc_node::check::proof::proof_layer(p).unwrap();
    // A third party loads only the layer the proof names.
    let one = Model::load(
        &path,
        &LoadOptions {
            layers: Some(layer as usize..layer as usize + 1),
            head: false,
            cache_in: None,
        },
    )
    .unwrap();
    verify_proof(
        p,
        ModelId::default(),
        &cfg,
        Some(&one),
        &Gemm::new(Kernel::best(), 1).unwrap(),
    )
}

#[test]
fn every_kind_of_lie_yields_a_proof_that_checks() {
    let model = Model::load(&fixture("llama"), &LoadOptions::default()).unwrap();
    let key = Keypair::generate_ed25519();
    let layers = LayerRange { start: 1, end: 4 };
    // flip-bit: one bit of one output value, record and trace consistent with it.
    let flip = |y: &mut Activations, t: &mut HopTrace| {
        y.data[3] = f32::from_bits(y.data[3].to_bits() ^ (1 << 12));
        set_output(t, y);
    };
    // A wrong product in the middle: the cache row layer 2's key and value projections make,
    // committed wrongly.
    let wrong_gemm = |_: &mut Activations, t: &mut HopTrace| {
        let e = t
            .entries
            .iter_mut()
            .find(|e| e.layer == 2 && e.point == Point::KvCache)
            .unwrap();
        e.commitment.0[0] ^= 1;
    };
    // stale: the output of the previous hop.
    for (what, lie_at) in [
        ("flip-bit", 4usize),
        ("wrong product", 2),
        ("flip-bit in prefill", 0),
    ] {
        let log = if what == "wrong product" {
            run_stage(&model, &key, layers, lie_at, wrong_gemm)
        } else {
            run_stage(&model, &key, layers, lie_at, flip)
        };
        for (r, t) in log.records.iter().zip(&log.traces) {
            check_consistency(&r.body, t).unwrap();
        }
        let p = prove(&model, &key, layers, &log);
        assert_eq!(
            p.records.len(),
            lie_at + 1,
            "{what}: the proof stops at the lie"
        );
        let expected_layer = if what == "wrong product" { 2 } else { 3 };
        assert_eq!(
            p.kind,
            ProofKind::Recompute {
                layer: expected_layer
            },
            "{what}"
        );
        check(&p).unwrap_or_else(|e| panic!("{what}: a true proof must check: {e}"));
        // Serialises for `dcd verify-proof`.
        let json = serde_json::to_string(&p).unwrap();
        let back: FraudProof = serde_json::from_str(&json).unwrap();
        check(&back).unwrap();
    }
}

#[test]
fn forged_proofs_are_rejected_and_honest_stages_cannot_be_accused() {
    let model = Model::load(&fixture("llama"), &LoadOptions::default()).unwrap();
    let key = Keypair::generate_ed25519();
    let layers = LayerRange { start: 0, end: 2 };
    let log = run_stage(&model, &key, layers, 3, |y, t| {
        y.data[0] += 1.0;
        set_output(t, y);
    });
    let p = prove(&model, &key, layers, &log);
    check(&p).unwrap();

    // Altered record: the signature no longer matches.
    let mut f = p.clone();
    f.records.last_mut().unwrap().body.step += 1;
    assert!(check(&f).unwrap_err().contains("signature"));
    // Altered input: not what the accused committed to.
    let mut f = p.clone();
    f.layer_inputs[0].data[0] += 0.5;
    assert!(check(&f)
        .unwrap_err()
        .contains("not what the accused committed to"));
    // Records signed under another protocol's commitments (kind "hop", protocol 4 and
    // before): an honest peer's old records must not pass as lies against this protocol's
    // leaves, so they do not verify at all.
    let mut f = p.clone();
    for r in &mut f.records {
        *r = dc_net::signing::sign(&key, "hop", r.body.clone()).unwrap();
    }
    assert!(check(&f).unwrap_err().contains("signature"));
    // Wrong signer: the records are someone else's.
    let mut f = p.clone();
    f.accused = Keypair::generate_ed25519()
        .public()
        .to_peer_id()
        .to_string();
    assert!(check(&f).unwrap_err().contains("not the accused"));
    // A claim about a layer the accused computed correctly.
    let mut f = p.clone();
    f.kind = ProofKind::Recompute { layer: 0 };
    let inputs0: Vec<_> = log.inputs[..=3]
        .iter()
        .map(dc_node::core::wire::to_wire)
        .collect();
    f.layer_inputs = inputs0;
    assert!(check(&f).unwrap_err().contains("correct"));

    // An honest stage: the replay finds nothing, and a proof built anyway does not hold.
    let honest = run_stage(&model, &key, layers, 99, |_, _| {});
    let gemm = Gemm::new(Kernel::best(), 1).unwrap();
    assert!(
        find_dispute(&model, &gemm, layers, &honest.inputs, &honest.traces)
            .unwrap()
            .is_none()
    );
    let mut fake = p.clone();
    fake.records = honest.records[..=3].to_vec();
    fake.traces = honest.traces[..=3].to_vec();
    let err = check(&fake).unwrap_err();
    assert!(err.contains("correct"), "{err}");
}

#[test]
fn records_of_two_honest_runs_of_one_generation_cannot_be_spliced_into_a_proof() {
    // A head that runs one generation id twice with other tokens (or a stage that forgot it,
    // restarting) holds two honest runs signed under one id. Spliced — the first run's
    // prompt hop, the second's decode hops — re-running the layer from the first run's cache
    // gives other commitments than the second run honestly signed.
    let model = Model::load(&fixture("llama"), &LoadOptions::default()).unwrap();
    let key = Keypair::generate_ed25519();
    let layers = LayerRange { start: 1, end: 4 };
    let a = run_stage_on(&model, &key, layers, 3, 99, |_, _| {});
    let b = run_stage_on(&model, &key, layers, 11, 99, |_, _| {});
    let spliced = Log {
        inputs: vec![a.inputs[0].clone(), b.inputs[1].clone()],
        records: vec![a.records[0].clone(), b.records[1].clone()],
        traces: vec![a.traces[0].clone(), b.traces[1].clone()],
    };
    let p = prove(&model, &key, layers, &spliced);
    let err = check(&p).unwrap_err();
    assert!(err.contains("chain"), "{err}");
    // Each run alone is honest: no dispute in either.
    let gemm = Gemm::new(Kernel::best(), 1).unwrap();
    for run in [&a, &b] {
        let d = find_dispute(&model, &gemm, layers, &run.inputs, &run.traces).unwrap();
        assert!(d.is_none());
    }
}

#[test]
fn a_record_that_contradicts_its_trace_is_a_proof_by_itself() {
    let model = Model::load(&fixture("llama"), &LoadOptions::default()).unwrap();
    let key = Keypair::generate_ed25519();
    let layers = LayerRange { start: 2, end: 4 };
    // Output changed but the trace left honest: the signed record contradicts its trace.
    let log = run_stage(&model, &key, layers, 1, |y, _| y.data[1] -= 2.0);
    let (r, t) = (&log.records[1], &log.traces[1]);
    assert!(check_consistency(&r.body, t).is_err());
    let p = FraudProof {
        model_id: ModelId::default(),
        accused: key.public().to_peer_id().to_string(),
        kind: ProofKind::Inconsistent,
        records: vec![r.clone()],
        traces: vec![t.clone()],
        layer_inputs: vec![],
    };
    let (cfg, _) = dc_model::open::open_source(&fixture("llama")).unwrap();
    let gemm = Gemm::new(Kernel::best(), 1).unwrap();
    verify_proof(&p, ModelId::default(), &cfg, None, &gemm).unwrap();
    // The same claim against a consistent record does not hold.
    let mut q = p.clone();
    q.records = vec![log.records[0].clone()];
    q.traces = vec![log.traces[0].clone()];
    assert!(verify_proof(&q, ModelId::default(), &cfg, None, &gemm).is_err());
    // Nor does an honest record paired with a trace it does not sign (anyone can make one:
    // the trace is not signed, only its root): one commitment changed, or the entries cut.
    let mut other = log.traces[0].clone();
    other.entries[3].commitment.0[0] ^= 1;
    let mut cut = log.traces[0].clone();
    cut.entries.truncate(4);
    for t in [other, cut] {
        let mut f = q.clone();
        f.traces = vec![t];
        let err = verify_proof(&f, ModelId::default(), &cfg, None, &gemm).unwrap_err();
        assert!(err.contains("not the one"), "{err}");
    }
}

/// What a peer makes of a proof it was handed, as `accept_proof` does it: the named layer
/// loaded (a layer beyond the model refused), then checked. `Err` if checking panicked.
fn judge(
    p: &FraudProof,
    cfg: &dc_model::ModelConfig,
    layers: &mut std::collections::HashMap<u32, Model>,
) -> std::thread::Result<Result<(), String>> {
    let model = match dc_node::check::proof::proof_layer(p) {
        Some(l) if l < cfg.num_layers as u32 => Some(layers.entry(l).or_insert_with(|| {
            let only = Some(l as usize..l as usize + 1);
            let opts = LoadOptions {
                layers: only,
                head: false,
                cache_in: None,
            };
            Model::load(&fixture("llama"), &opts).unwrap()
        }) as &Model),
        Some(l) => return Ok(Err(format!("layer {l} is beyond the model"))),
        None => None,
    };
    let gemm = Gemm::new(Kernel::best(), 1).unwrap();
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        verify_proof(p, ModelId::default(), cfg, model, &gemm)
    }))
}

/// A proof with one field set to an edge value or one list cut, repeated or reordered.
fn crafted(p: &FraudProof, rng: &mut dc_kernels::rng::SplitMix64) -> FraudProof {
    let mut f = p.clone();
    let mut pick = |n: usize| (rng.next_u64() % n.max(1) as u64) as usize;
    let edge = [0, 1, 2, 3, 4, u32::MAX, u32::MAX / 2][pick(7)];
    let (k, e) = (pick(f.traces.len()), pick(64));
    match pick(12) {
        0 => f.kind = ProofKind::Recompute { layer: edge },
        1 => f.kind = ProofKind::Inconsistent,
        2 => f.records.swap(0, k),
        3 => {
            f.records.remove(k);
        }
        4 => f.traces.truncate(k),
        5 => {
            if let Some(t) = f.traces.get_mut(k) {
                match t.entries.get_mut(e) {
                    Some(x) => x.layer = edge,
                    None => t.entries.clear(),
                }
            }
        }
        6 => {
            if let Some(t) = f.traces.get_mut(k) {
                t.from = edge as usize;
            }
        }
        7 => f.layer_inputs.truncate(k),
        8 => {
            if let Some(w) = f.layer_inputs.get_mut(k) {
                w.start = edge;
            }
        }
        9 => {
            if let Some(w) = f.layer_inputs.get_mut(k) {
                w.hidden = edge;
            }
        }
        10 => {
            if let Some(w) = f.layer_inputs.get_mut(k) {
                match w.data.get_mut(e) {
                    Some(v) => *v = [f32::NAN, f32::INFINITY, 1e30, -0.0][e % 4],
                    None => w.data.truncate(e),
                }
            }
        }
        _ => f.accused = "12D3KooWnot-a-peer-id".into(),
    }
    f
}

/// The encoded proof with a few bits flipped, cut short or a stretch repeated.
fn damaged(bytes: &[u8], rng: &mut dc_kernels::rng::SplitMix64) -> Vec<u8> {
    let mut b = bytes.to_vec();
    let mut at = |len: usize| (rng.next_u64() % len.max(1) as u64) as usize;
    match at(3) {
        0 => {
            for _ in 0..1 + at(3) {
                let i = at(b.len());
                b[i] ^= 1 << at(8);
            }
        }
        1 => {
            let keep = at(b.len());
            b.truncate(keep);
        }
        _ => {
            let i = at(b.len());
            let j = (i + 1 + at(64)).min(b.len());
            let stretch = b[i..j].to_vec();
            b.splice(i..i, stretch);
        }
    }
    b
}

#[test]
fn damaged_or_crafted_proofs_never_hold_against_an_honest_stage_and_never_panic() {
    let model = Model::load(&fixture("llama"), &LoadOptions::default()).unwrap();
    let (cfg, _) = dc_model::open::open_source(&fixture("llama")).unwrap();
    let key = Keypair::generate_ed25519();
    let accused = key.public().to_peer_id().to_string();
    let layers = LayerRange { start: 0, end: 2 };
    let honest = run_stage(&model, &key, layers, 99, |_, _| {});
    // What a forger holding an honest stage's records would send: a replay claim about its
    // first layer over hops 0..=3 (whose inputs are the stage's), and a claim that a record
    // contradicts its trace.
    let replay = FraudProof {
        model_id: ModelId::default(),
        accused: accused.clone(),
        kind: ProofKind::Recompute { layer: 0 },
        records: honest.records[..=3].to_vec(),
        traces: honest.traces[..=3].to_vec(),
        layer_inputs: honest.inputs[..=3]
            .iter()
            .map(dc_node::core::wire::to_wire)
            .collect(),
    };
    let inconsistent = FraudProof {
        kind: ProofKind::Inconsistent,
        records: vec![honest.records[2].clone()],
        traces: vec![honest.traces[2].clone()],
        layer_inputs: Vec::new(),
        ..replay.clone()
    };
    let mut loaded = std::collections::HashMap::new();
    let mut rng = dc_kernels::rng::SplitMix64::new(41);
    for base in [&replay, &inconsistent] {
        assert!(judge(base, &cfg, &mut loaded).unwrap().is_err());
        let bytes = dc_types::encode(base, 1 << 24).unwrap();
        let mut judged = 0;
        for case in 0..300 {
            let f = match case % 2 {
                0 => crafted(base, &mut rng),
                _ => match dc_types::decode::<FraudProof>(&damaged(&bytes, &mut rng), 1 << 24) {
                    Ok(f) => f,
                    Err(_) => continue,
                },
            };
            match judge(&f, &cfg, &mut loaded) {
                Err(_) => panic!("case {case}: checking the proof panicked ({:?})", f.kind),
                Ok(verdict) => assert!(
                    verdict.is_err(),
                    "case {case}: a forged proof holds against an honest stage ({:?})",
                    f.kind
                ),
            }
            judged += 1;
        }
        assert!(judged >= 200, "only {judged} cases reached the checker");
    }

    // A peer may sign anything about itself: records of edge ranges, generations and chains,
    // re-signed. Whether such a proof holds (it proves the signer wrong), checking it must
    // neither panic nor take unbounded memory.
    let ranges = [
        (0, u32::MAX),
        (u32::MAX - 1, u32::MAX),
        (0, 1),
        (1, 2),
        (5, 9),
    ];
    for (case, (start, end)) in ranges.into_iter().enumerate() {
        for kind in [
            ProofKind::Inconsistent,
            ProofKind::Recompute { layer: start },
        ] {
            let mut f = replay.clone();
            f.kind = kind;
            for r in &mut f.records {
                let mut body = r.body.clone();
                body.layers = LayerRange { start, end };
                body.previous = dc_types::Commitment([case as u8; 32]);
                *r = dc_net::signing::sign(&key, dc_types::HOP_RECORD_KIND, body).unwrap();
            }
            assert!(
                judge(&f, &cfg, &mut loaded).is_ok(),
                "{start}..{end} {kind:?}"
            );
        }
    }
}
