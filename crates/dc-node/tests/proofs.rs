//! Fraud proofs without a network: a stage that lies in each of the ways a faulty peer can,
//! the referee replay that finds where, and the proof every third party can check by re-running
//! one layer; forged proofs (altered record, altered input, wrong signer) are rejected, and an
//! honest stage can never be proven wrong.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::path::PathBuf;

use dc_kernels::{Gemm, Kernel};
use dc_model::{Activations, KvCache, LoadOptions, Model};
use dc_node::verify::{build_proof, check_consistency, find_dispute, verify_proof};
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
    let gemm = Gemm::new(Kernel::best(), 2).unwrap();
    let g = GenerationId([5; 16]);
    let mut head_cache = KvCache::new(&model.config, 0..layers.start as usize);
    let mut cache = KvCache::new(&model.config, layers.as_range());
    let mut log = Log {
        inputs: vec![],
        records: vec![],
        traces: vec![],
    };
    let ids: Vec<u32> = (0..15).map(|i| (i * 37 + 3) % 500).collect();
    let mut pos = 0;
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
        };
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
    let (cfg, _) = dc_model::model::open_source(&path).unwrap();
    let layer = dc_node::verify::proof_layer(p).unwrap();
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
    let inputs0: Vec<_> = log.inputs[..=3].iter().map(dc_node::verify::wire).collect();
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
    let (cfg, _) = dc_model::model::open_source(&fixture("llama")).unwrap();
    let gemm = Gemm::new(Kernel::best(), 1).unwrap();
    verify_proof(&p, ModelId::default(), &cfg, None, &gemm).unwrap();
    // The same claim against a consistent record does not hold.
    let mut q = p.clone();
    q.records = vec![log.records[0].clone()];
    q.traces = vec![log.traces[0].clone()];
    assert!(verify_proof(&q, ModelId::default(), &cfg, None, &gemm).is_err());
}
