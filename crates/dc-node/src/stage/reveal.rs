//! Reveals: rows of the hops this stage kept, and its committed KV cache rows, for the head
//! that started the generation (spot checks and audits from cache rows), each answer bounded
//! by half the message limit before anything is assembled, and at most
//! [`super::server::REVEALS_AT_ONCE`] assembled at once.

use dc_types::{
    CacheRowsRequest, LayerReveal, RevealRequest, MAX_REVEAL_HOPS, MAX_REVEAL_PICKS,
    MAX_REVEAL_ROWS,
};

use std::sync::Arc;

use dc_model::{CacheLog, KeptHop};

use super::server::Stage;

impl Stage {
    /// Reveals rows of a hop this daemon served (a head's spot check): the hop must still be kept,
    /// and `from` must be the generation's head.
    pub async fn serve_reveal(
        &self,
        req: RevealRequest,
        from: &str,
    ) -> Result<Vec<LayerReveal>, String> {
        let found = self.kept_hop(&req, from);
        let _slot = self.reveal_slot().await?;
        let limit = self.node.cfg.max_message_bytes / 2;
        self.reveal_within(req, found, limit).await.map(|(r, _)| r)
    }

    /// Reveals rows of several hops this daemon served, one answer per hop; together they stay
    /// within half the message limit (a hop that would take them past it is refused alone).
    pub async fn serve_reveal_hops(
        &self,
        reqs: Vec<RevealRequest>,
        from: &str,
    ) -> Result<Vec<Result<Vec<LayerReveal>, String>>, String> {
        if reqs.is_empty() || reqs.len() > MAX_REVEAL_HOPS {
            return Err(format!(
                "{} hops: expected 1 to {MAX_REVEAL_HOPS}",
                reqs.len()
            ));
        }
        // Every hop taken out of the kept ones on arrival (shared, not copied): newer hops may
        // push them out while this waits for its turn.
        let found: Vec<_> = reqs.iter().map(|r| self.kept_hop(r, from)).collect();
        let _slot = self.reveal_slot().await?;
        let mut left = self.node.cfg.max_message_bytes / 2;
        let mut out = Vec::with_capacity(reqs.len());
        for (req, found) in reqs.into_iter().zip(found) {
            out.push(
                self.reveal_within(req, found, left)
                    .await
                    .map(|(r, bytes)| {
                        left -= bytes;
                        r
                    }),
            );
        }
        Ok(out)
    }

    /// The hop `req` asks about, with the generation's cache rows, if kept for `from`.
    fn kept_hop(
        &self,
        req: &RevealRequest,
        from: &str,
    ) -> Result<(Arc<KeptHop>, CacheLog), String> {
        self.caches(|c| c.kept(&req.generation, req.step, from))
            .ok_or_else(|| {
                format!(
                    "step {} of generation {} is not kept here for {from}",
                    req.step, req.generation
                )
            })
    }

    /// [`serve_reveal`] of the `found` hop within `limit` bytes of rows and activations; also
    /// returns the bytes.
    async fn reveal_within(
        &self,
        req: RevealRequest,
        found: Result<(Arc<KeptHop>, CacheLog), String>,
        limit: usize,
    ) -> Result<(Vec<LayerReveal>, usize), String> {
        if req.picks.is_empty() || req.picks.len() > MAX_REVEAL_PICKS {
            return Err(format!(
                "{} picks: expected 1 to {MAX_REVEAL_PICKS}",
                req.picks.len()
            ));
        }
        if !self.runner.reveals() {
            return Err("not revealing anything (fault: hide)".into());
        }
        if let Some(p) = req
            .picks
            .iter()
            .find(|p| p.positions as usize > MAX_REVEAL_ROWS)
        {
            return Err(format!(
                "{} positions in one pick: at most {MAX_REVEAL_ROWS}",
                p.positions
            ));
        }
        let mut layers: Vec<u32> = req.picks.iter().map(|p| p.layer).collect();
        layers.sort_unstable();
        if let Some(w) = layers.windows(2).find(|w| w[0] == w[1]) {
            return Err(format!("layer {} is picked twice", w[0]));
        }
        let (kept, log) = found?;
        tokio::task::spawn_blocking(move || {
            // Pick by pick, stopping at the limit: what a request makes this stage assemble stays
            // within the limit and one pick.
            let (mut reveals, mut bytes) = (Vec::with_capacity(req.picks.len()), 0);
            for p in &req.picks {
                let (layer, position) = (p.layer as usize, p.position as usize);
                let (positions, from) = (p.positions as usize, p.cache_from as usize);
                let r = kept.reveal_rows(layer, position, positions, p.checks, from, &log)?;
                bytes += r.payload_bytes();
                if bytes > limit {
                    return Err(format!(
                        "the reveal would carry at least {bytes} bytes, over the {limit} bytes left of \
                         half the message limit"
                    ));
                }
                reveals.push(r);
            }
            Ok((reveals, bytes))
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// Reveals this daemon's KV cache rows of a generation it serves (every layer it runs it for,
    /// positions `0..end`), for an audit that starts from them; `from` must be its head.
    pub async fn serve_cache_rows(
        &self,
        req: CacheRowsRequest,
        from: &str,
    ) -> Result<Vec<Vec<u8>>, String> {
        let _slot = self.reveal_slot().await?;
        if !self.runner.reveals() {
            return Err("not revealing anything (fault: hide)".into());
        }
        let (layers, log) = self
            .caches(|c| c.log(&req.generation, from))
            .ok_or_else(|| {
                format!(
                    "no cache rows of generation {} here for {from}",
                    req.generation
                )
            })?;
        let (from, end) = (req.from as usize, req.end as usize);
        if from > end {
            return Err(format!("positions {from}..{end} are backwards"));
        }
        if end > log.len() {
            return Err(format!(
                "the layers hold fewer than {end} positions here ({})",
                log.len()
            ));
        }
        // Sized before anything is copied (each hop's rows whole, the cut ones too).
        let bytes = log
            .hop_rows_count(from, end)
            .saturating_mul(log.row_bytes())
            .saturating_mul(layers.as_range().len());
        let limit = self.node.cfg.max_message_bytes / 2;
        if bytes > limit {
            return Err(format!(
                "{bytes} bytes of cache rows: over half the {} byte message limit",
                limit * 2
            ));
        }
        let rows = layers
            .as_range()
            .map(|l| {
                log.hop_rows(l, from, end).ok_or_else(|| {
                    format!("layer {l} holds no hops from position {from} up to {end} here")
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }
}
