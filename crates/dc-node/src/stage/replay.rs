//! Audits of other stages' hops, replayed here: this daemon re-runs another stage's logged
//! inputs (or appends its committed cache rows and runs only the audited hop) in a session
//! cache of the auditing head's, and returns the trace the head compares.

use std::sync::Arc;

use dc_model::{Activations, KvCache};
use dc_types::{AuditRequest, CacheRows, GenerationId, HopTrace, LayerRange};

use super::queue::MAX_HOP_ROWS;
use super::server::Stage;
use crate::core::wire::from_wire;

impl Stage {
    /// Audits another stage's hop: replays the inputs into the cache kept for the audit's session
    /// (fresh when they start at position 0, else continuing it), in the same hops, and returns the
    /// trace of the audited (last) hop. The cache stays for the head's next audit of that stage.
    pub async fn serve_audit(
        self: &Arc<Self>,
        req: AuditRequest,
        from: &str,
    ) -> Result<HopTrace, String> {
        let node = &self.node;
        if req.model_id != node.model_id {
            return Err(format!(
                "this daemon serves model {}, not {}",
                node.model_id, req.model_id
            ));
        }
        let serving = node.serving().ok_or("still loading")?;
        if !serving.layers.covers(&req.layers) {
            return Err(format!(
                "this daemon serves layers {}, not {}",
                serving.layers, req.layers
            ));
        }
        let cfg = node.model_cfg.clone();
        let first = req.hops.first().map_or(0, |h| h.start as usize);
        let mut hops = Vec::with_capacity(req.hops.len());
        let (mut next, mut previous) = (first, None);
        for (k, w) in req.hops.into_iter().enumerate() {
            let x = from_wire(w, cfg.hidden_size, cfg.max_positions)
                .map_err(|e| format!("hop {k}: {e}"))?;
            // Continuing the hop before, or starting inside it after its first position (a
            // speculative guess that missed: the replay cuts the cache back as the stage did).
            let forward = previous.is_none_or(|p| x.start > p) && x.start <= next;
            if !forward || x.rows() > MAX_HOP_ROWS {
                return Err(format!(
                    "hop {k} does not continue the one before (at {}, by {next})",
                    x.start
                ));
            }
            previous = Some(x.start);
            next = x.start + x.rows();
            hops.push(x);
        }
        match hops.last() {
            Some(l) if l.start == req.from as usize => {}
            _ => return Err("the audited hop must be the last".into()),
        }
        if let Some(rows) = req.cache {
            return self
                .audit_from_cache(req.layers, req.session, from, rows, hops)
                .await;
        }
        let (mut cache, _permit) = self
            .session_cache(req.session, from, req.layers, first)
            .await?;
        let replayed = next - first;
        let n2 = node.clone();
        let ran = tokio::task::spawn_blocking(move || {
            let last = hops.len() - 1;
            let mut trace = None;
            for (k, x) in hops.into_iter().enumerate() {
                let done = if k < last {
                    serving.model.run_layers(&n2.gemm, x, &mut cache)
                } else {
                    let mut t = HopTrace::from_position(x.start);
                    let y = serving
                        .model
                        .run_layers_traced(&n2.gemm, x, &mut cache, Some(&mut t));
                    trace = Some(t);
                    y
                };
                if let Err(e) = done {
                    return (Err(e.to_string()), None);
                }
            }
            (trace.ok_or_else(|| "no hops".to_string()), Some(cache))
        })
        .await;
        let (trace, cache) = ran.unwrap_or_else(|e| (Err(e.to_string()), None));
        node.stats
            .audit_positions
            .fetch_add(replayed as u64, std::sync::atomic::Ordering::Relaxed);
        self.caches(|c| c.put(req.session, cache));
        trace
    }

    /// An audit that starts from the audited stage's committed cache rows (checked by the head):
    /// appends them to the session's cache (a fresh one when they start at 0) and runs only the
    /// audited hop. The cache stays for the head's next audit of that stage.
    async fn audit_from_cache(
        &self,
        layers: LayerRange,
        session: GenerationId,
        owner: &str,
        rows: CacheRows,
        hops: Vec<Activations>,
    ) -> Result<HopTrace, String> {
        let node = &self.node;
        let serving = node.serving().ok_or("still loading")?;
        let x = match <[Activations; 1]>::try_from(hops) {
            Ok([x]) => x,
            Err(h) => {
                return Err(format!(
                    "an audit from cache rows runs 1 hop, not {}",
                    h.len()
                ))
            }
        };
        let (mut cache, _permit) = self
            .session_cache(session, owner, layers, rows.from as usize)
            .await?;
        let n2 = node.clone();
        let rows_run = x.rows();
        let ran = tokio::task::spawn_blocking(move || {
            let run = || {
                // The session's cache may hold the rows of a guess past them.
                cache.truncate(rows.from as usize);
                cache
                    .extend_encoded(&rows.rows)
                    .map_err(|e| format!("cache rows: {e}"))?;
                if cache.len() != x.start {
                    return Err(format!(
                        "cache rows up to position {} for a hop at position {}",
                        cache.len(),
                        x.start
                    ));
                }
                let mut t = HopTrace::from_position(x.start);
                serving
                    .model
                    .run_layers_traced(&n2.gemm, x, &mut cache, Some(&mut t))
                    .map_err(|e| e.to_string())?;
                Ok(t)
            };
            let trace = run();
            let kept = trace.is_ok().then_some(cache);
            (trace, kept)
        })
        .await;
        let (trace, cache) = ran.unwrap_or_else(|e| (Err(e.to_string()), None));
        node.stats
            .audit_positions
            .fetch_add(rows_run as u64, std::sync::atomic::Ordering::Relaxed);
        self.caches(|c| c.put(session, cache));
        trace
    }

    /// An audit session's cache holding `from` positions (a fresh one for 0), and a compute permit
    /// to run on it.
    async fn session_cache(
        &self,
        session: GenerationId,
        owner: &str,
        layers: LayerRange,
        from: usize,
    ) -> Result<(KvCache, tokio::sync::OwnedSemaphorePermit), String> {
        let (cfg, max) = (&self.node.model_cfg, self.node.cfg.max_generations);
        let taken = self.caches(|c| c.take(session, owner, layers, from, cfg, max));
        let cache = taken.map_err(|(_, why)| format!("audit session: {why}"))?;
        match self.compute.clone().acquire_owned().await {
            Ok(permit) => Ok((cache, permit)),
            Err(_) => {
                self.caches(|c| c.put(session, None));
                Err("shutting down".into())
            }
        }
    }
}
