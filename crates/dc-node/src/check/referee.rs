//! Refereeing and exclusion: when a check or an audit disagrees with a stage, this daemon
//! replays the stage's hops from its own copy of the weights, finds the first product where
//! the stage's commitments leave the honest computation, builds the fraud proof, and accepts
//! it like any proof: checked by re-running at most one layer, then the accused excluded, the
//! proof kept (and written to the data directory) and gossiped.
//!
//! Nobody is excluded on a claim: a proof is checked against our own weights first.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use dc_model::{LoadOptions, Model};
use dc_types::{FraudProof, Gossip, LayerRange};
use tracing::{info, warn};

use super::checks::Checks;
use super::log::StageLog;
use super::proof::{build_proof, find_dispute, proof_layer, verify_proof};

/// Replays the accused's hops ourselves (loading its layers from our own model file), finds the
/// first difference, builds the proof, checks it, and excludes the accused if it holds.
pub async fn referee(
    checks: &Arc<Checks>,
    accused: &str,
    layers: LayerRange,
    log: &StageLog,
) -> bool {
    // One refereeing at a time: several audits of one generation often fail together, and
    // once the first has proven the lie the others have nothing left to do.
    let _gate = checks.referee_gate.lock().await;
    let node = &checks.node;
    if node.is_excluded(accused) {
        return true;
    }
    let model = match referee_model(checks, layers).await {
        Ok(m) => m,
        Err(e) => {
            warn!("cannot referee layers {layers}: {e}");
            return false;
        }
    };
    let (n2, log2) = (node.clone(), log.clone());
    let found = tokio::task::spawn_blocking(move || {
        find_dispute(&model, &n2.gemm, layers, &log2.inputs, &log2.traces)
    })
    .await;
    let dispute = match found {
        Ok(Ok(Some(d))) => d,
        Ok(Ok(None)) => {
            info!("referee: {accused}'s hops on layers {layers} are correct");
            return false;
        }
        Ok(Err(e)) => {
            warn!("referee replay failed: {e}");
            return false;
        }
        Err(e) => {
            warn!("referee replay failed: {e}");
            return false;
        }
    };
    let proof = build_proof(node.model_id, accused, &dispute, &log.records, &log.traces);
    accept_proof(checks, proof, true).await
}

/// Loads (or reuses) a model holding `layers` for refereeing and proof checks.
async fn referee_model(checks: &Checks, layers: LayerRange) -> Result<Arc<Model>, String> {
    let node = &checks.node;
    if let Some(s) = node.serving() {
        if s.layers.covers(&layers) {
            return Ok(s.model.clone());
        }
    }
    let mut slot = checks.referee.lock().await;
    if let Some((r, m)) = slot.as_ref() {
        if r.covers(&layers) {
            return Ok(m.clone());
        }
    }
    checks.weights.ensure(layers, false).await?;
    let path = node.cfg.model.clone();
    let data_dir = node.cfg.data_dir.clone();
    let m = tokio::task::spawn_blocking(move || {
        Model::load(
            &path,
            &LoadOptions {
                layers: Some(layers.as_range()),
                head: false,
                cache_in: Some(data_dir),
            },
        )
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| e.to_string())?;
    let m = Arc::new(m);
    *slot = Some((layers, m.clone()));
    Ok(m)
}

/// Checks a proof against our weights; if it holds, excludes the accused and (when `gossip`)
/// announces the proof. Returns whether it held.
pub async fn accept_proof(checks: &Arc<Checks>, proof: FraudProof, gossip: bool) -> bool {
    let node = &checks.node;
    if node.is_excluded(&proof.accused) {
        return true;
    }
    let model = match proof_layer(&proof) {
        Some(l) if l < node.model_cfg.num_layers as u32 => match referee_model(
            checks,
            LayerRange {
                start: l,
                end: l + 1,
            },
        )
        .await
        {
            Ok(m) => Some(m),
            Err(e) => {
                warn!("cannot check a proof against {}: {e}", proof.accused);
                return false;
            }
        },
        Some(l) => {
            warn!("a proof names layer {l}, beyond the model");
            return false;
        }
        None => None,
    };
    let (n2, p2) = (node.clone(), proof.clone());
    let checked = tokio::task::spawn_blocking(move || {
        verify_proof(&p2, n2.model_id, &n2.model_cfg, model.as_deref(), &n2.gemm)
    })
    .await;
    match checked {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            warn!("a proof against {} does not hold: {e}", proof.accused);
            return false;
        }
        Err(e) => {
            warn!("checking a proof failed: {e}");
            return false;
        }
    }
    let accused = proof.accused.clone();
    let json = serde_json::to_vec(&proof).ok();
    let id = checks.book().keep_proof(proof);
    let fresh = node.exclude(&accused, id);
    // Keep the proof where operators find it (`dcd verify-proof <file>` checks it anywhere).
    if let (true, Some(bytes)) = (fresh, json) {
        let dir = node.cfg.data_dir.join("proofs");
        if std::fs::create_dir_all(&dir).is_ok() {
            let _ = std::fs::write(dir.join(format!("{}.json", id.to_hex())), bytes);
        }
    }
    if fresh {
        println!("excluded peer {accused}: proof {id}");
        warn!("excluded peer {accused}: fraud proof {id}");
        node.stats.exclusions.fetch_add(1, Ordering::Relaxed);
    }
    if gossip {
        node.gossip(&Gossip::Proof { id, accused }).await;
    }
    true
}
