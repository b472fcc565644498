//! Planning an attempt: its generation id (fresh caches at every stage after a
//! recomputation), its route among the healthy peers (leaving out those this generation could
//! not use, and preferring those that did not fail recently and those connected directly), the second peers of
//! `--verify all`, and the request's sampling settings.

use std::collections::HashSet;

use dc_model::sampling::SamplingParams;
use dc_types::{GenerationId, GenerationRequest, LayerRange, RouteHop, VerifyMode};

use super::attempt::Shadows;
use super::stop::avoided;
use crate::check::audit::pick_peer;
use crate::core::view::{coverage, plan_route, uncovered};
use crate::daemon::Daemon;

/// The sampler's settings for `req`.
pub fn sampling(req: &GenerationRequest) -> SamplingParams {
    SamplingParams::from_wire(&req.sampling)
}

/// The generation id of attempt `n` (fresh caches at every stage after a recomputation).
pub(super) fn attempt_id(g: &GenerationId, n: usize) -> GenerationId {
    if n == 0 {
        return *g;
    }
    let h = blake3::hash(&[&g.0[..], b"attempt", &(n as u64).to_le_bytes()].concat());
    let mut out = [0u8; 16];
    out.copy_from_slice(&h.as_bytes()[..16]);
    GenerationId(out)
}

/// Why no route could be planned.
pub(super) enum PlanError {
    /// No healthy peer serves these layers (a generation may wait for them to be covered).
    Uncovered(Vec<LayerRange>, String),
    /// Anything else.
    Other(String),
}

impl From<String> for PlanError {
    fn from(s: String) -> PlanError {
        PlanError::Other(s)
    }
}

impl From<&str> for PlanError {
    fn from(s: &str) -> PlanError {
        PlanError::Other(s.into())
    }
}

impl std::fmt::Display for PlanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PlanError::Uncovered(gaps, left_out) => {
                let gaps: Vec<String> = gaps.iter().map(|g| g.to_string()).collect();
                write!(
                    f,
                    "layers {} are not served by any healthy peer{left_out}",
                    gaps.join(", ")
                )
            }
            PlanError::Other(why) => f.write_str(why),
        }
    }
}

/// Plans attempt `g`'s route (and `--verify all`'s second peers) among the participants, leaving
/// out the peers in `avoid` (whose answers this generation could not use).
pub(super) fn plan(
    d: &Daemon,
    req: &GenerationRequest,
    g: &GenerationId,
    avoid: &[(String, String)],
    relayed: &HashSet<String>,
) -> Result<(Vec<RouteHop>, Option<Shadows>), PlanError> {
    if req.model_id != d.node.model_id {
        return Err(PlanError::Other(format!(
            "this daemon serves model {}, not {}",
            d.node.model_id, req.model_id
        )));
    }
    let serving = d.node.serving().ok_or("this daemon is still loading")?;
    if !serving.head {
        return Err("this daemon does not hold the head weights".into());
    }
    let mut participants = d.node.participants();
    participants.retain(|p| !avoided(avoid, &p.peer));
    let left_out = || {
        avoid
            .iter()
            .map(|(_, why)| format!("; left out: {why}"))
            .collect::<String>()
    };
    // Peers whose hops recently could not be used are a last resort.
    let recent = d.node.recently_unusable();
    let mut preferred = participants.clone();
    preferred.retain(|p| !recent.contains(&p.peer));
    let layers = d.node.model_cfg.num_layers as u32;
    let gaps = uncovered(&coverage(layers, &participants));
    if !gaps.is_empty() {
        return Err(PlanError::Uncovered(gaps, left_out()));
    }
    // Peers reached only through a relay carry activations slower: a route takes them only
    // where no directly connected peer serves the layers.
    let mut direct = preferred.clone();
    direct.retain(|p| !relayed.contains(&p.peer));
    let route = plan_route(g, layers, &d.node.local, &direct)
        .or_else(|_| plan_route(g, layers, &d.node.local, &preferred))
        .or_else(|_| plan_route(g, layers, &d.node.local, &participants))
        .map_err(|e| e + &left_out())?;
    let shadows = match req.verify {
        VerifyMode::All => Some(
            route
                .iter()
                .map(|h| {
                    if h.peer == d.node.local {
                        // The head trusts its own arithmetic.
                        return Ok(None);
                    }
                    pick_peer(&participants, &recent, h.layers, &h.peer, &g.0)
                        .map(Some)
                        .ok_or_else(|| {
                            format!(
                                "--verify all needs a second peer serving layers {} (only {} does){}",
                                h.layers,
                                h.peer,
                                left_out()
                            )
                        })
                })
                .collect::<Result<Vec<_>, String>>()?,
        ),
        VerifyMode::Sampled(_) => None,
    };
    Ok((route, shadows))
}
