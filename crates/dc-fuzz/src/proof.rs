//! Fraud proofs: a proof file (`dcd verify-proof`, JSON) or a proof fetched from a peer
//! (bincode), judged with the tiny Llama fixture's weights as a referee judges one.

use std::sync::OnceLock;

use dc_model::{LoadOptions, Model};
use dc_node::check::proof::{proof_id, proof_layer, verify_proof};
use dc_types::{FraudProof, ModelId, HOP_RECORD_KIND};
use libp2p::identity::Keypair;

/// The model id the judged proofs are made to name.
const MODEL: ModelId = ModelId(dc_types::Commitment([7; 32]));

/// The fixture's layers, one model per layer, as a referee loads the one it needs.
fn layers() -> &'static [Model] {
    static LAYERS: OnceLock<Vec<Model>> = OnceLock::new();
    LAYERS.get_or_init(|| {
        let path = crate::fixtures().join("llama");
        (0..4)
            .map(|l| {
                let opts = LoadOptions {
                    layers: Some(l..l + 1),
                    head: false,
                    cache_in: None,
                };
                Model::load(&path, &opts)
                    .unwrap_or_else(|e| panic!("the Llama fixture ({}): {e}", path.display()))
            })
            .collect()
    })
}

/// A proof judged twice: as it came, and as a hostile peer that signs whatever it likes would
/// have made it (every record re-signed by one key, the accused that key's peer, the model
/// ours), so that the checks behind the signatures run on the fuzzer's records too.
pub(crate) fn judge(p: &FraudProof) {
    let _ = proof_id(p);
    let verdict = |p: &FraudProof| {
        let model = proof_layer(p).and_then(|l| layers().get(l as usize));
        verify_proof(p, MODEL, &model_config(), model, crate::gemm())
    };
    let _ = verdict(p);
    static KEY: OnceLock<Keypair> = OnceLock::new();
    let key = KEY.get_or_init(|| Keypair::ed25519_from_bytes([9; 32]).expect("an ed25519 key"));
    let mut forged = p.clone();
    forged.model_id = MODEL;
    forged.accused = key.public().to_peer_id().to_string();
    for r in &mut forged.records {
        *r = dc_net::signing::sign(key, HOP_RECORD_KIND, r.body.clone())
            .expect("a decoded record signs");
    }
    let _ = verdict(&forged);
}

fn model_config() -> dc_model::ModelConfig {
    layers()[0].config.clone()
}

/// A proof as JSON (first byte even) or bincode (odd).
pub fn fraud_proof(data: &[u8]) {
    let (sel, rest) = crate::split_first(data);
    let proof = if sel & 1 == 0 {
        serde_json::from_slice::<FraudProof>(rest).ok()
    } else {
        crate::decode_and_reencode::<FraudProof>(rest)
    };
    if let Some(p) = proof {
        judge(&p);
    }
}
