//! Checking stages: a hop record against its own trace, a replay that finds where a stage's
//! commitments first leave the honest computation, and fraud proofs that anyone with the
//! weights checks by re-running at most one layer.
//!
//! Everything here is exact: honest computation gives the same commitments on every machine,
//! so a difference is never noise, and a proof that checks out is a lie proven.

use std::borrow::Borrow;

use dc_kernels::{Commitment, Domain, Gemm};
use dc_model::{Activations, KvCache, Model, ModelConfig};
use dc_types::{FraudProof, HopRecord, HopTrace, LayerRange, ModelId, Point, ProofKind, Signed};

use crate::core::wire::{from_wire, to_wire};

/// Checks that a record and its trace agree: the trace is well formed for the record's layers,
/// its root is the record's `gemms`, and its first input and last output are the record's.
/// A failure here is provable from the signed record and the trace alone.
pub fn check_consistency(record: &HopRecord, trace: &HopTrace) -> Result<(), String> {
    if !trace.is_well_formed(record.layers) {
        return Err(format!(
            "the trace is not the list of products of layers {}",
            record.layers
        ));
    }
    if trace.root() != record.gemms {
        return Err("the trace's root is not the one signed in the record".into());
    }
    if trace.get(record.layers.start, Point::Input) != Some(record.input) {
        return Err("the trace's input is not the record's".into());
    }
    if trace.get(record.layers.end - 1, Point::Output) != Some(record.output) {
        return Err("the trace's output is not the record's".into());
    }
    Ok(())
}

/// The id of a proof: blake3 over its canonical encoding.
pub fn proof_id(p: &FraudProof) -> Commitment {
    match dc_types::encode(p, usize::MAX) {
        Ok(bytes) => Domain::FraudProof.hash(&bytes),
        Err(_) => Commitment::default(),
    }
}

/// Where a replay first left the accused's commitments.
#[derive(Debug, Clone)]
pub struct Dispute {
    /// Index of the hop (step) with the first difference.
    pub step: usize,
    /// The layer whose computation first differs.
    pub layer: u32,
    /// The activations entering that layer, for every hop up to `step`.
    pub layer_inputs: Vec<Activations>,
}

/// Replays `hops` (the inputs the accused received, in order, positions from 0) through
/// `layers` with `model` (which must hold them), recording every hop's trace, and returns the
/// first place where the accused's traces differ from the honest ones.
pub fn find_dispute(
    model: &Model,
    gemm: &Gemm,
    layers: LayerRange,
    hops: &[impl Borrow<Activations>],
    accused: &[impl Borrow<HopTrace>],
) -> Result<Option<Dispute>, String> {
    let cfg = &model.config;
    let mut caches: Vec<KvCache> = layers
        .as_range()
        .map(|i| KvCache::new(cfg, i..i + 1))
        .collect();
    let mut inputs: Vec<Vec<Activations>> = vec![Vec::new(); layers.len() as usize];
    for (k, hop) in hops.iter().enumerate() {
        let hop: &Activations = hop.borrow();
        let mut honest = HopTrace::from_position(hop.start);
        let mut x = hop.clone();
        for (li, cache) in caches.iter_mut().enumerate() {
            inputs[li].push(x.clone());
            let mut t = HopTrace::from_position(hop.start);
            x = model
                .run_layers_traced(gemm, x, cache, Some(&mut t))
                .map_err(|e| format!("replaying hop {k}: {e}"))?;
            t.entries.pop(); // this layer's own Output: only the hop's last one is recorded
            honest.entries.extend(t.entries);
        }
        honest.push(
            layers.end as usize - 1,
            Point::Output,
            x.rows_from(hop.start).commitment(),
        );
        let Some(theirs) = accused.get(k) else { break };
        if let Some(d) = honest.first_difference(theirs.borrow()) {
            let e = honest
                .entries
                .get(d)
                .or(honest.entries.last())
                .ok_or("empty trace")?;
            let layer = match e.point {
                // Entering layer l differently means layer l-1 computed differently.
                Point::Input if e.layer > layers.start => e.layer - 1,
                _ => e.layer,
            };
            let li = (layer - layers.start) as usize;
            return Ok(Some(Dispute {
                step: k,
                layer,
                layer_inputs: inputs[li][..=k].to_vec(),
            }));
        }
    }
    Ok(None)
}

/// Builds the proof for a dispute.
pub fn build_proof(
    model_id: ModelId,
    accused: &str,
    dispute: &Dispute,
    records: &[Signed<HopRecord>],
    traces: &[impl Borrow<HopTrace>],
) -> FraudProof {
    FraudProof {
        model_id,
        accused: accused.to_string(),
        kind: ProofKind::Recompute {
            layer: dispute.layer,
        },
        records: records[..=dispute.step].to_vec(),
        traces: traces[..=dispute.step]
            .iter()
            .map(|t| t.borrow().clone())
            .collect(),
        layer_inputs: dispute.layer_inputs.iter().map(to_wire).collect(),
    }
}

/// The layer a proof asks to re-run, if any.
pub fn proof_layer(p: &FraudProof) -> Option<u32> {
    match p.kind {
        ProofKind::Inconsistent => None,
        ProofKind::Recompute { layer } => Some(layer),
    }
}

/// Checks a proof. `model` must hold the layer the proof names (see [`proof_layer`]); an
/// `Inconsistent` proof needs no weights. `Ok(())` means the accused is proven to have signed a
/// wrong statement.
pub fn verify_proof(
    p: &FraudProof,
    model_id: ModelId,
    cfg: &ModelConfig,
    model: Option<&Model>,
    gemm: &Gemm,
) -> Result<(), String> {
    if p.model_id != model_id {
        return Err(format!(
            "the proof is about model {}, we serve {}",
            p.model_id.short(),
            model_id.short()
        ));
    }
    if p.records.is_empty() || p.records.len() != p.traces.len() {
        return Err("the proof needs one trace per record".into());
    }
    let first = &p.records[0].body;
    for r in &p.records {
        let signer = dc_net::signing::verify(dc_types::HOP_RECORD_KIND, r)
            .map_err(|e| format!("a record's signature: {e}"))?;
        if signer.to_string() != p.accused {
            return Err(format!(
                "a record is signed by {signer}, not the accused {}",
                p.accused
            ));
        }
        if r.body.generation != first.generation || r.body.layers != first.layers {
            return Err("the records are not of one generation and layer range".into());
        }
    }
    match p.kind {
        ProofKind::Inconsistent => verify_inconsistent(p),
        ProofKind::Recompute { layer } => verify_recompute(p, layer, cfg, model, gemm),
    }
}

/// An `Inconsistent` proof holds when the accused's last record disagrees with the trace it
/// signs.
fn verify_inconsistent(p: &FraudProof) -> Result<(), String> {
    let last = p.records.len() - 1;
    // The trace is not signed, only its root: a trace with another root is not the
    // accused's (anyone can pair an honest record with one), so it proves nothing.
    let (record, trace) = (&p.records[last].body, &p.traces[last]);
    if trace.root() != record.gemms {
        return Err("the trace is not the one the accused's record signs".into());
    }
    match check_consistency(record, trace) {
        Err(_) => Ok(()),
        Ok(()) => Err("the accused's record agrees with its trace".into()),
    }
}

/// A `Recompute` proof holds when re-running `layer` over the committed layer inputs of one
/// run of the generation gives other commitments than the accused's last hop.
fn verify_recompute(
    p: &FraudProof,
    layer: u32,
    cfg: &ModelConfig,
    model: Option<&Model>,
    gemm: &Gemm,
) -> Result<(), String> {
    let last = p.records.len() - 1;
    let layers = p.records[0].body.layers;
    if !layers.contains(layer) {
        return Err(format!(
            "layer {layer} is not in the accused's range {layers}"
        ));
    }
    if p.layer_inputs.len() != p.records.len() {
        return Err("the proof needs the layer's input for every hop".into());
    }
    // One run's records, from its first hop: a generation id run twice gives two
    // chains, and a replay of records spliced from both would fault an honest stage.
    let mut previous = HopRecord::FIRST;
    for (k, r) in p.records.iter().enumerate() {
        if r.body.previous != previous {
            return Err(format!(
                "record {k} does not continue the chain of the records before it (not \
                 one run of the generation from its first hop)"
            ));
        }
        previous = r.body.chain();
    }
    for (r, t) in p.records.iter().zip(&p.traces) {
        // A record that disagrees with its own trace would be a proof by itself; here
        // we require consistency so the comparison below means what it says.
        check_consistency(&r.body, t).map_err(|e| format!("hop {}: {e}", r.body.step))?;
    }
    let model = model.ok_or("re-running the layer needs the model's weights")?;
    let mut cache = KvCache::new(cfg, layer as usize..layer as usize + 1);
    // Each input continues where the one before ended, or starts inside it (after its first
    // position: a speculative guess that missed, cut from the cache as every replay cuts it).
    let (mut next, mut previous_start) = (0usize, None);
    for (k, w) in p.layer_inputs.iter().enumerate() {
        let x = from_wire(w.clone(), cfg.hidden_size, cfg.max_positions)
            .map_err(|e| format!("layer input {k}: {e}"))?;
        if x.start > next || previous_start.is_some_and(|f| x.start <= f) {
            return Err(format!(
                "layer input {k} starts at {}: not by {next}, or not after the one before",
                x.start
            ));
        }
        previous_start = Some(x.start);
        next = x.start + x.rows();
        if Some(x.commitment()) != p.traces[k].get(layer, Point::Input) {
            return Err(format!(
                "layer input {k} is not what the accused committed to"
            ));
        }
        if k < last {
            model
                .run_layers(gemm, x, &mut cache)
                .map_err(|e| format!("re-running layer {layer}: {e}"))?;
            continue;
        }
        let mut t = HopTrace::from_position(x.start);
        model
            .run_layers_traced(gemm, x, &mut cache, Some(&mut t))
            .map_err(|e| format!("re-running layer {layer}: {e}"))?;
        return differs_from_accused(&t, &p.traces[last], layer, layers);
    }
    Err("no layer inputs".into())
}

/// `Ok` when the honest trace `ours` of `layer` differs from the accused's trace `theirs` in
/// any product of the layer or its output.
fn differs_from_accused(
    ours: &HopTrace,
    theirs: &HopTrace,
    layer: u32,
    layers: LayerRange,
) -> Result<(), String> {
    let their_output = if layer + 1 < layers.end {
        theirs.get(layer + 1, Point::Input)
    } else {
        theirs.get(layer, Point::Output)
    };
    for e in &ours.entries {
        let claimed = match e.point {
            Point::Input => continue,
            Point::Output => their_output,
            p => theirs.get(layer, p),
        };
        if claimed != Some(e.commitment) {
            return Ok(());
        }
    }
    Err(format!(
        "the accused's commitments for layer {layer} are correct"
    ))
}
