//! Serving one hop: the checks that keep a hostile or confused peer from costing more than a
//! refusal (model, layers, state, shape, size, the cache's owner and position), then the layers
//! run on the compute pool by the stage's [`HopRunner`](super::runner::HopRunner), batched with
//! other generations' hops that wait at the same time (`queue.rs`), and a signed record of what
//! was computed, chained to the generation's earlier inputs.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use dc_model::{Activations, KvCache};
use dc_types::{Commitment, HopErrorKind, HopRecord, HopRequest, HopResponse, PeerState};

use super::queue::MAX_HOP_ROWS;
use super::runner::HopId;
use super::server::Stage;
use crate::core::wire::{from_wire, to_wire};
use crate::core::Serving;

fn refuse(kind: HopErrorKind, message: impl Into<String>) -> HopResponse {
    HopResponse::Refused {
        kind,
        message: message.into(),
    }
}

/// A hop that passed admission: what it runs on.
struct Admitted {
    serving: Arc<Serving>,
    x: Activations,
    cache: KvCache,
    /// The chain of inputs its record continues.
    previous: Commitment,
}

impl Stage {
    /// Runs one hop on this daemon's layers for the remote head `from`, keeping it for reveals.
    pub async fn serve_hop(self: &Arc<Self>, req: HopRequest, from: &str) -> HopResponse {
        self.run_hop(req, from, true).await
    }

    /// Runs one hop of a generation this daemon heads itself (nobody will ask it to reveal it).
    pub async fn serve_own_hop(self: &Arc<Self>, req: HopRequest) -> HopResponse {
        let local = self.node.local.clone();
        self.run_hop(req, &local, false).await
    }

    async fn run_hop(self: &Arc<Self>, req: HopRequest, from: &str, keep: bool) -> HopResponse {
        let (generation, step, layers) = (req.generation, req.step, req.layers);
        let start = req.activations.start as usize;
        let hop = HopId { generation, step };
        let Admitted {
            serving,
            x,
            cache,
            previous,
        } = match self.admit(req, from) {
            Ok(a) => a,
            Err((kind, why)) => return refuse(kind, why),
        };
        let input = x.commitment();
        let (out, trace, cache) = match self.queue.compute(serving, x, cache, (hop, keep)).await {
            Ok(done) => done,
            Err(e) => {
                self.caches(|c| c.put(generation, None));
                return refuse(HopErrorKind::Internal, format!("compute task failed: {e}"));
            }
        };
        let (y, kept) = match out {
            Ok(done) => done,
            Err(e) => {
                self.caches(|c| c.put(generation, None));
                return refuse(HopErrorKind::BadActivations, e.to_string());
            }
        };
        let record = HopRecord {
            generation,
            step,
            layers,
            input,
            output: y.commitment(),
            gemms: trace.root(),
            previous: self.runner.previous(previous, hop),
        };
        self.caches(|c| {
            if keep {
                c.keep(&generation, step, start, kept, &cache);
            }
            c.put_after(generation, cache, record.chain());
        });
        let trace = self.runner.sent_trace(trace, hop);
        let stats = &self.node.stats;
        stats.hops.fetch_add(1, Ordering::Relaxed);
        stats
            .positions
            .fetch_add(y.rows() as u64, Ordering::Relaxed);
        match dc_net::signing::sign(&self.node.keypair, dc_types::HOP_RECORD_KIND, record) {
            Ok(record) => HopResponse::Done {
                activations: to_wire(&y),
                record,
                trace,
            },
            Err(e) => refuse(HopErrorKind::Internal, format!("signing: {e}")),
        }
    }

    /// Checks hop `req` from `from` before anything runs, and takes its generation's cache.
    fn admit(&self, req: HopRequest, from: &str) -> Result<Admitted, (HopErrorKind, String)> {
        let node = &self.node;
        if req.model_id != node.model_id {
            return Err((
                HopErrorKind::WrongModel,
                format!(
                    "this daemon serves model {}, not {}",
                    node.model_id, req.model_id
                ),
            ));
        }
        let Some(serving) = node.serving() else {
            return Err((HopErrorKind::Overloaded, "still loading".into()));
        };
        if !serving.layers.covers(&req.layers) {
            return Err((
                HopErrorKind::WrongLayers,
                format!(
                    "this daemon serves layers {}, not {}",
                    serving.layers, req.layers
                ),
            ));
        }
        let starts = req.activations.start == 0;
        if node.paused() && starts {
            return Err((
                HopErrorKind::Overloaded,
                "paused: the machine is busy with other work".into(),
            ));
        }
        if node.state() == PeerState::Leaving && starts {
            return Err((
                HopErrorKind::Leaving,
                "this daemon is leaving and takes no new generations".into(),
            ));
        }
        let cfg = &node.model_cfg;
        let x = from_wire(req.activations, cfg.hidden_size, cfg.max_positions)
            .map_err(|e| (HopErrorKind::BadActivations, e))?;
        if x.rows() > MAX_HOP_ROWS {
            return Err((
                HopErrorKind::BadActivations,
                format!(
                    "{} positions in one hop exceed the limit of {MAX_HOP_ROWS}",
                    x.rows()
                ),
            ));
        }
        let max = node.cfg.max_generations;
        let (cache, previous) = self.caches(|c| {
            c.take(req.generation, from, req.layers, x.start, cfg, max)
                .map(|cache| (cache, c.chain(&req.generation)))
        })?;
        Ok(Admitted {
            serving,
            x,
            cache,
            previous,
        })
    }
}
