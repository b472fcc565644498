//! Serving hops: the KV caches this daemon keeps for other heads' generations, and the checks
//! that keep a hostile or confused peer from costing more than a refusal.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::collections::VecDeque;

use dc_model::{Activations, CacheLog, KeptHop, KvCache};
use dc_types::{
    AuditRequest, CacheRows, CacheRowsRequest, Commitment, GenerationId, HopErrorKind, HopRecord,
    HopRequest, HopResponse, HopTrace, LayerRange, LayerReveal, PeerState, RevealRequest,
    WireActivations, MAX_REVEAL_HOPS, MAX_REVEAL_PICKS, MAX_REVEAL_ROWS,
};

use crate::node::Node;

/// Most positions one hop may carry (bounds the compute one request can demand).
pub const MAX_HOP_ROWS: usize = 2048;

/// Hops kept per generation for reveals: a head asks about up to [`MAX_REVEAL_HOPS`] of a
/// stage's hops at once, right after the last of them, so one more suffices even when the next
/// hop has already arrived.
pub const KEPT_HOPS: usize = MAX_REVEAL_HOPS + 1;

/// Bytes of kept hops this daemon holds at most, over all generations; a hop that does not fit
/// is not kept (a reveal of it is refused, which a head only holds against a one-row hop).
pub const KEPT_BYTES: usize = 256 << 20;

/// One generation's cache in this daemon.
#[derive(Debug)]
struct Entry {
    /// The peer that started it (its head, or the head whose audit session it is): no other
    /// peer may run, restart, end or read it.
    owner: String,
    /// `None` while a hop is using it.
    cache: Option<KvCache>,
    layers: LayerRange,
    last_used: Instant,
    /// The last hops, by step, kept to reveal rows of them.
    kept: VecDeque<(u64, Arc<KeptHop>)>,
    /// The cache rows of the generation, for reveals (only when hops are kept).
    log: CacheLog,
    /// The chain of the inputs that built the cache ([`HopRecord::chain`]), which the next
    /// hop's record names.
    chain: Commitment,
}

/// The KV caches this daemon holds, one per generation, bounded in number and dropped when
/// idle. Each belongs to the peer that started it: a generation id is known to every stage of
/// its route, and without an owner any of them could end another head's generation, start it
/// over (the stage would sign a second run under the id) or read its kept hops.
#[derive(Debug, Default)]
pub struct StageCaches {
    entries: HashMap<GenerationId, Entry>,
}

impl StageCaches {
    /// Generations with a cache here.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no cache is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes held by caches not in use.
    pub fn bytes(&self) -> usize {
        self.entries
            .values()
            .filter_map(|e| e.cache.as_ref().map(|c| c.bytes() + e.log.bytes()))
            .sum()
    }

    /// Drops the cache of a finished generation, if `owner` started it.
    pub fn end(&mut self, g: &GenerationId, owner: &str) -> bool {
        self.owned(g, owner).is_some() && self.entries.remove(g).is_some()
    }

    /// The entry of `g` if `owner` started it.
    fn owned(&self, g: &GenerationId, owner: &str) -> Option<&Entry> {
        self.entries.get(g).filter(|e| e.owner == owner)
    }

    /// Drops caches idle for longer than `idle`; returns how many.
    pub fn expire(&mut self, now: Instant, idle: Duration) -> usize {
        let before = self.entries.len();
        self.entries
            .retain(|_, e| e.cache.is_none() || now.duration_since(e.last_used) <= idle);
        before - self.entries.len()
    }

    /// Takes the cache of `g` for `owner`'s hop at position `start` over `layers`, creating it
    /// for a new generation (start 0). At most `max` generations are held.
    fn take(
        &mut self,
        g: GenerationId,
        owner: &str,
        layers: LayerRange,
        start: usize,
        cfg: &dc_model::ModelConfig,
        max: usize,
    ) -> Result<KvCache, (HopErrorKind, String)> {
        if self.entries.get(&g).is_some_and(|e| e.owner != owner) {
            return Err((
                HopErrorKind::BadActivations,
                format!("generation {g} was started here by another peer"),
            ));
        }
        if start == 0 {
            if self.entries.get(&g).is_some_and(|e| e.cache.is_none()) {
                return Err((
                    HopErrorKind::BadActivations,
                    format!("generation {g} is already running a hop here"),
                ));
            }
            self.entries.remove(&g);
            if self.entries.len() >= max {
                return Err((
                    HopErrorKind::Overloaded,
                    format!("already serving {max} generations"),
                ));
            }
            self.entries.insert(
                g,
                Entry {
                    owner: owner.to_string(),
                    cache: None,
                    layers,
                    last_used: Instant::now(),
                    kept: VecDeque::new(),
                    log: CacheLog::default(),
                    chain: HopRecord::FIRST,
                },
            );
            return Ok(KvCache::new(cfg, layers.as_range()));
        }
        let e = self.entries.get_mut(&g).ok_or((
            HopErrorKind::BadActivations,
            format!("no cache for generation {g} (it expired or never started here)"),
        ))?;
        if e.layers != layers {
            return Err((
                HopErrorKind::WrongLayers,
                format!("generation {g} runs layers {} here, not {layers}", e.layers),
            ));
        }
        let cache = e.cache.take().ok_or((
            HopErrorKind::BadActivations,
            format!("generation {g} is already running a hop here"),
        ))?;
        if cache.len() != start {
            let held = cache.len();
            e.cache = Some(cache);
            return Err((
                HopErrorKind::BadActivations,
                format!("activations start at position {start} but the cache holds {held}"),
            ));
        }
        Ok(cache)
    }

    /// Keeps hop `step` of `g` for reveals, dropping its older hops beyond [`KEPT_HOPS`]; not
    /// kept when it would take the daemon past [`KEPT_BYTES`]. The cache rows the hop added
    /// are logged either way (they are revealed for later hops too).
    fn keep(&mut self, g: &GenerationId, step: u64, hop: KeptHop, cache: &KvCache) {
        if let Some(e) = self.entries.get_mut(g) {
            e.log.record(cache);
            while e.kept.len() >= KEPT_HOPS {
                e.kept.pop_front();
            }
        }
        let held: usize = self
            .entries
            .values()
            .flat_map(|e| e.kept.iter().map(|(_, k)| k.bytes()))
            .sum();
        if let Some(e) = self.entries.get_mut(g) {
            if held + hop.bytes() <= KEPT_BYTES {
                e.kept.push_back((step, Arc::new(hop)));
            }
        }
    }

    /// The layers `g` runs here and its logged cache rows (shared, not copied), for its owner.
    fn log(&self, g: &GenerationId, owner: &str) -> Option<(LayerRange, CacheLog)> {
        let e = self.owned(g, owner)?;
        Some((e.layers, e.log.clone()))
    }

    /// A kept hop, with the generation's cache rows (shared, not copied), for its owner.
    fn kept(&self, g: &GenerationId, step: u64, owner: &str) -> Option<(Arc<KeptHop>, CacheLog)> {
        let e = self.owned(g, owner)?;
        let hop = e
            .kept
            .iter()
            .find(|(s, _)| *s == step)
            .map(|(_, k)| k.clone())?;
        Some((hop, e.log.clone()))
    }

    /// The chain of the inputs that built `g`'s cache ([`HopRecord::FIRST`] for none).
    fn chain(&self, g: &GenerationId) -> Commitment {
        self.entries.get(g).map_or(HopRecord::FIRST, |e| e.chain)
    }

    /// Returns `g`'s cache after a hop that succeeded, with the chain of the inputs that built
    /// it now.
    fn put_after(&mut self, g: GenerationId, cache: KvCache, chain: Commitment) {
        self.put(g, Some(cache));
        if let Some(e) = self.entries.get_mut(&g) {
            e.chain = chain;
        }
    }

    /// Returns a cache after a hop (successful or not: a failed hop leaves it unchanged only if
    /// the model refused before touching it, so failures drop it).
    fn put(&mut self, g: GenerationId, cache: Option<KvCache>) {
        match (self.entries.get_mut(&g), cache) {
            (Some(e), Some(c)) => {
                e.cache = Some(c);
                e.last_used = Instant::now();
            }
            _ => {
                self.entries.remove(&g);
            }
        }
    }
}

/// Converts wire activations, checking their shape.
pub fn from_wire(
    w: WireActivations,
    hidden: usize,
    max_positions: usize,
) -> Result<Activations, String> {
    if w.hidden as usize != hidden {
        return Err(format!(
            "activations are {} wide, the model is {hidden}",
            w.hidden
        ));
    }
    if w.data.is_empty() || !w.data.len().is_multiple_of(hidden) {
        return Err(format!(
            "{} values are not whole rows of {hidden}",
            w.data.len()
        ));
    }
    let rows = w.data.len() / hidden;
    if w.start as usize + rows > max_positions {
        return Err(format!(
            "positions {}..{} exceed the model's {max_positions}",
            w.start,
            w.start as usize + rows
        ));
    }
    if let Some(i) = w.data.iter().position(|v| !v.is_finite()) {
        return Err(format!(
            "non-finite value {} at position {}, channel {}",
            w.data[i],
            w.start as usize + i / hidden,
            i % hidden
        ));
    }
    Ok(Activations {
        start: w.start as usize,
        hidden,
        data: w.data,
    })
}

/// Converts activations for the wire.
pub fn to_wire(a: &Activations) -> WireActivations {
    WireActivations {
        start: a.start as u32,
        hidden: a.hidden as u32,
        data: a.data.clone(),
    }
}

fn refuse(kind: HopErrorKind, message: impl Into<String>) -> HopResponse {
    HopResponse::Refused {
        kind,
        message: message.into(),
    }
}

/// Runs one hop on this daemon's layers for the remote head `from`, keeping it for reveals.
pub async fn serve_hop(node: Arc<Node>, req: HopRequest, from: &str) -> HopResponse {
    run_hop(node, req, from, true).await
}

/// Runs one hop of a generation this daemon heads itself (nobody will ask it to reveal it).
pub async fn serve_own_hop(node: Arc<Node>, req: HopRequest) -> HopResponse {
    let local = node.local.clone();
    run_hop(node, req, &local, false).await
}

async fn run_hop(node: Arc<Node>, req: HopRequest, from: &str, keep: bool) -> HopResponse {
    if req.model_id != node.model_id {
        return refuse(
            HopErrorKind::WrongModel,
            format!(
                "this daemon serves model {}, not {}",
                node.model_id, req.model_id
            ),
        );
    }
    let Some(serving) = node.serving() else {
        return refuse(HopErrorKind::Overloaded, "still loading");
    };
    if !serving.layers.covers(&req.layers) {
        return refuse(
            HopErrorKind::WrongLayers,
            format!(
                "this daemon serves layers {}, not {}",
                serving.layers, req.layers
            ),
        );
    }
    if node.paused() && req.activations.start == 0 {
        return refuse(
            HopErrorKind::Overloaded,
            "paused: the machine is busy with other work",
        );
    }
    if node.state() == PeerState::Leaving && req.activations.start == 0 {
        return refuse(
            HopErrorKind::Leaving,
            "this daemon is leaving and takes no new generations",
        );
    }
    let cfg = &node.model_cfg;
    let x = match from_wire(req.activations, cfg.hidden_size, cfg.max_positions) {
        Ok(x) => x,
        Err(e) => return refuse(HopErrorKind::BadActivations, e),
    };
    if x.rows() > MAX_HOP_ROWS {
        return refuse(
            HopErrorKind::BadActivations,
            format!(
                "{} positions in one hop exceed the limit of {MAX_HOP_ROWS}",
                x.rows()
            ),
        );
    }
    let taken = {
        let mut caches = node.caches.lock().unwrap_or_else(|e| e.into_inner());
        caches
            .take(
                req.generation,
                from,
                req.layers,
                x.start,
                cfg,
                node.cfg.max_generations,
            )
            .map(|cache| (cache, caches.chain(&req.generation)))
    };
    let (mut cache, previous) = match taken {
        Ok(c) => c,
        Err((kind, msg)) => return refuse(kind, msg),
    };
    let input = x.commitment();
    let Ok(_permit) = node.compute.clone().acquire_owned().await else {
        return refuse(HopErrorKind::Internal, "shutting down");
    };
    let (n2, s2) = (node.clone(), serving.clone());
    let (generation, step) = (req.generation, req.step);
    let result = tokio::task::spawn_blocking(move || {
        let mut trace = HopTrace::from_position(x.start);
        #[cfg(feature = "fault-injection")]
        let out = crate::fault::run(&n2, &s2.model, x, &mut cache, &mut trace, generation, step);
        #[cfg(not(feature = "fault-injection"))]
        let out = s2
            .model
            .run_layers_kept(&n2.gemm, x, &mut cache, &mut trace);
        let _ = (generation, step);
        (out.map(|(y, kept)| (y, kept, trace)), cache)
    })
    .await;
    let (out, cache) = match result {
        Ok(r) => r,
        Err(e) => {
            node.caches
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .put(req.generation, None);
            return refuse(HopErrorKind::Internal, format!("compute task failed: {e}"));
        }
    };
    #[cfg(feature = "fault-injection")]
    let previous = crate::fault::previous(previous, &req.generation, req.step);
    match out {
        Ok((y, kept, trace)) => {
            let record = HopRecord {
                generation: req.generation,
                step: req.step,
                layers: req.layers,
                input,
                output: y.commitment(),
                gemms: trace.root(),
                previous,
            };
            {
                let mut caches = node.caches.lock().unwrap_or_else(|e| e.into_inner());
                if keep {
                    caches.keep(&req.generation, req.step, kept, &cache);
                }
                caches.put_after(req.generation, cache, record.chain());
            }
            #[cfg(feature = "fault-injection")]
            let trace = crate::fault::sent_trace(trace, &req.generation, req.step);
            node.stats
                .hops
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            node.stats
                .positions
                .fetch_add(y.rows() as u64, std::sync::atomic::Ordering::Relaxed);
            match dc_net::signing::sign(&node.keypair, dc_types::HOP_RECORD_KIND, record) {
                Ok(record) => HopResponse::Done {
                    activations: to_wire(&y),
                    record,
                    trace,
                },
                Err(e) => refuse(HopErrorKind::Internal, format!("signing: {e}")),
            }
        }
        Err(e) => {
            node.caches
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .put(req.generation, None);
            refuse(HopErrorKind::BadActivations, e.to_string())
        }
    }
}

/// Reveals rows of a hop this daemon served (a head's spot check): the hop must still be kept,
/// and `from` must be the generation's head.
pub async fn serve_reveal(
    node: Arc<Node>,
    req: RevealRequest,
    from: &str,
) -> Result<Vec<LayerReveal>, String> {
    let limit = node.cfg.max_message_bytes / 2;
    reveal_within(&node, req, from, limit).await.map(|(r, _)| r)
}

/// Reveals rows of several hops this daemon served, one answer per hop; together they stay
/// within half the message limit (a hop that would take them past it is refused alone).
pub async fn serve_reveal_hops(
    node: Arc<Node>,
    reqs: Vec<RevealRequest>,
    from: &str,
) -> Result<Vec<Result<Vec<LayerReveal>, String>>, String> {
    if reqs.is_empty() || reqs.len() > MAX_REVEAL_HOPS {
        return Err(format!(
            "{} hops: expected 1 to {MAX_REVEAL_HOPS}",
            reqs.len()
        ));
    }
    let mut left = node.cfg.max_message_bytes / 2;
    let mut out = Vec::with_capacity(reqs.len());
    for req in reqs {
        out.push(
            reveal_within(&node, req, from, left)
                .await
                .map(|(r, bytes)| {
                    left -= bytes;
                    r
                }),
        );
    }
    Ok(out)
}

/// [`serve_reveal`] within `limit` bytes of rows and activations; also returns the bytes.
async fn reveal_within(
    node: &Arc<Node>,
    req: RevealRequest,
    from: &str,
    limit: usize,
) -> Result<(Vec<LayerReveal>, usize), String> {
    if req.picks.is_empty() || req.picks.len() > MAX_REVEAL_PICKS {
        return Err(format!(
            "{} picks: expected 1 to {MAX_REVEAL_PICKS}",
            req.picks.len()
        ));
    }
    #[cfg(feature = "fault-injection")]
    if crate::fault::hides() {
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
    let (kept, log) = node
        .caches
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .kept(&req.generation, req.step, from)
        .ok_or_else(|| {
            format!(
                "step {} of generation {} is not kept here for {from}",
                req.step, req.generation
            )
        })?;
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
    node: Arc<Node>,
    req: CacheRowsRequest,
    from: &str,
) -> Result<Vec<Vec<u8>>, String> {
    #[cfg(feature = "fault-injection")]
    if crate::fault::hides() {
        return Err("not revealing anything (fault: hide)".into());
    }
    let (layers, log) = {
        let caches = node.caches.lock().unwrap_or_else(|e| e.into_inner());
        caches.log(&req.generation, from).ok_or_else(|| {
            format!(
                "no cache rows of generation {} here for {from}",
                req.generation
            )
        })?
    };
    let (from, end) = (req.from as usize, req.end as usize);
    if from > end {
        return Err(format!("positions {from}..{end} are backwards"));
    }
    // Sized before anything is copied.
    let bytes = (end - from)
        .saturating_mul(log.row_bytes())
        .saturating_mul(layers.as_range().len());
    let limit = node.cfg.max_message_bytes / 2;
    if bytes > limit {
        return Err(format!(
            "{bytes} bytes of cache rows: over half the {} byte message limit",
            limit * 2
        ));
    }
    let rows = layers
        .as_range()
        .map(|l| {
            log.rows_between(l, from, end)
                .ok_or_else(|| format!("layer {l} holds fewer than {end} positions here"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// Audits another stage's hop: replays the inputs into the cache kept for the audit's session
/// (fresh when they start at position 0, else continuing it), in the same hops, and returns the
/// trace of the audited (last) hop. The cache stays for the head's next audit of that stage.
pub async fn serve_audit(
    node: Arc<Node>,
    req: AuditRequest,
    from: &str,
) -> Result<HopTrace, String> {
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
    let mut next = first;
    for (k, w) in req.hops.into_iter().enumerate() {
        let x = from_wire(w, cfg.hidden_size, cfg.max_positions)
            .map_err(|e| format!("hop {k}: {e}"))?;
        if x.start != next || x.rows() > MAX_HOP_ROWS {
            return Err(format!("hop {k} does not continue at position {next}"));
        }
        next = x.start + x.rows();
        hops.push(x);
    }
    match hops.last() {
        Some(l) if l.start == req.from as usize => {}
        _ => return Err("the audited hop must be the last".into()),
    }
    if let Some(rows) = req.cache {
        return audit_from_cache(node, req.layers, req.session, from, rows, hops).await;
    }
    let (mut cache, _permit) = session_cache(&node, req.session, from, req.layers, first).await?;
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
    node.caches
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .put(req.session, cache);
    trace
}

/// An audit that starts from the audited stage's committed cache rows (checked by the head):
/// appends them to the session's cache (a fresh one when they start at 0) and runs only the
/// audited hop. The cache stays for the head's next audit of that stage.
async fn audit_from_cache(
    node: Arc<Node>,
    layers: LayerRange,
    session: GenerationId,
    owner: &str,
    rows: CacheRows,
    hops: Vec<Activations>,
) -> Result<HopTrace, String> {
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
    let (mut cache, _permit) =
        session_cache(&node, session, owner, layers, rows.from as usize).await?;
    let n2 = node.clone();
    let rows_run = x.rows();
    let ran = tokio::task::spawn_blocking(move || {
        let run = || {
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
    node.caches
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .put(session, cache);
    trace
}

/// An audit session's cache holding `from` positions (a fresh one for 0), and a compute permit
/// to run on it.
async fn session_cache(
    node: &Arc<Node>,
    session: GenerationId,
    owner: &str,
    layers: LayerRange,
    from: usize,
) -> Result<(KvCache, tokio::sync::OwnedSemaphorePermit), String> {
    let taken = node.caches.lock().unwrap_or_else(|e| e.into_inner()).take(
        session,
        owner,
        layers,
        from,
        &node.model_cfg,
        node.cfg.max_generations,
    );
    let cache = taken.map_err(|(_, why)| format!("audit session: {why}"))?;
    match node.compute.clone().acquire_owned().await {
        Ok(permit) => Ok((cache, permit)),
        Err(_) => {
            node.caches
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .put(session, None);
            Err("shutting down".into())
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is the failure report

    use super::*;

    fn config() -> dc_model::ModelConfig {
        let fixture =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/llama");
        dc_model::model::open_source(&fixture).unwrap().0
    }

    #[test]
    fn a_generation_is_its_heads_alone_and_restarting_it_starts_its_chain_over() {
        let cfg = config();
        let (g, layers) = (GenerationId([7; 16]), LayerRange::new(0, 2).unwrap());
        let mut caches = StageCaches::default();
        let cache = caches.take(g, "head", layers, 0, &cfg, 4).unwrap();
        assert_eq!(caches.chain(&g), HopRecord::FIRST);
        let link = Commitment([1; 32]);
        caches.put_after(g, cache, link);
        assert_eq!(caches.chain(&g), link);
        // Another peer that learnt the id (a stage of the same route) can neither continue the
        // generation, nor start it over, nor end it, nor read it.
        for start in [0, 5] {
            let (_, why) = caches.take(g, "other", layers, start, &cfg, 4).unwrap_err();
            assert!(why.contains("another peer"), "{why}");
        }
        assert!(!caches.end(&g, "other"));
        assert!(caches.log(&g, "other").is_none() && caches.kept(&g, 0, "other").is_none());
        assert!(caches.log(&g, "head").is_some());
        assert_eq!(caches.chain(&g), link);
        // Its head may start it over: a new run, a new chain.
        let cache = caches.take(g, "head", layers, 0, &cfg, 4).unwrap();
        assert_eq!(caches.chain(&g), HopRecord::FIRST);
        caches.put(g, Some(cache));
        assert!(caches.end(&g, "head") && caches.is_empty());
    }
}
