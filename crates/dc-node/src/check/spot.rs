//! Spot checks (docs/VERIFICATION.md): after a remote hop, the head's private coins draw, for
//! each layer, which of its parts to test (each weight product, the attention, the output),
//! tested at every row of the hop (one for a decode hop; a prompt chunk's rows all, so a lie in
//! one of them is caught like a lie in a decode hop); the stage reveals the rows those parts
//! need with their Merkle paths, and the head tests each drawn weight product by Freivalds'
//! test, recomputes the attention when drawn and the glue between. Cheap for everyone: the
//! stage sends what it kept, the head does O(k + n) work per product and row. The head asks
//! about a stage's drawn one-row hops [`REVEAL_BATCH`] at a time, in one exchange (on small
//! models a request's libp2p work costs the head more than the checks), and a prefill hop's
//! picks a layer and [`ROWS_PER_REVEAL`] rows per exchange, all sent at once.
//!
//! A failed check is not a proof; it sends the hop to the referee, who proves or clears it.
//! A stage that will not reveal a hop it was asked about (which an honest stage keeps) gets a
//! full replay audit instead.

use std::collections::HashMap;
use std::sync::Arc;

use dc_kernels::Domain;
use dc_model::attention::LayerCache;
use dc_model::{LayerChecker, LoadOptions, Model};
use dc_types::{
    GenerationId, LayerRange, Point, RevealPick, RevealRequest, RouteHop, StageRequest,
    StageResponse,
};
use futures::StreamExt;
use tracing::warn;

use super::audit::{audit, AuditSession};
use super::book::SpotTally;
use super::checks::Checks;
use super::log::StageLog;
use super::referee::referee;

/// The head's private coins for one remote hop: for each layer of `layers`, each of the
/// layer's checkable `parts` (`dc_model::check_parts`) drawn with probability `rate`; a layer
/// with any part drawn is picked at every row of the hop's `rows` from `from` (a decode hop
/// has one; a prefill chunk's drawn parts are tested at each of its rows, so a lie confined
/// to one row of a chunk is caught with the same probability as a lie in a decode hop).
#[allow(clippy::too_many_arguments)]
pub fn picks(
    secret: &[u8; 32],
    g: &GenerationId,
    step: u64,
    layers: LayerRange,
    from: usize,
    rows: usize,
    parts: &[Point],
    rate: f32,
) -> Vec<RevealPick> {
    if rate <= 0.0 || rows == 0 {
        return Vec::new();
    }
    (layers.start..layers.end)
        .filter_map(|layer| {
            let mut h = blake3::Hasher::new_keyed(secret);
            h.update(b"spot check parts");
            h.update(&g.0);
            h.update(&step.to_le_bytes());
            h.update(&layer.to_le_bytes());
            let mut coins = h.finalize_xof();
            let mut word = || {
                let mut b = [0u8; 8];
                coins.fill(&mut b);
                u64::from_le_bytes(b)
            };
            let checks = dc_model::draw_checks(parts, rate as f64, || {
                (word() >> 11) as f64 / (1u64 << 53) as f64
            });
            (!checks.is_empty()).then_some(RevealPick {
                layer,
                position: from as u32,
                positions: rows as u32,
                cache_from: 0,
                checks,
            })
        })
        .collect()
}

impl Checks {
    /// [`picks`] with this head's secret coins.
    #[allow(clippy::too_many_arguments)]
    pub fn draw_picks(
        &self,
        g: &GenerationId,
        step: u64,
        layers: LayerRange,
        from: usize,
        rows: usize,
        parts: &[Point],
        rate: f32,
    ) -> Vec<RevealPick> {
        picks(&self.secret, g, step, layers, from, rows, parts, rate)
    }
}

/// The cache rows of one route stage's layers that earlier checks verified (from position 0),
/// per layer: a check asks only for the rows after them.
pub type KnownCaches = Arc<std::sync::Mutex<HashMap<usize, LayerCache>>>;

/// Hops of one stage a head asks about in one reveal exchange (the stage keeps more).
pub const REVEAL_BATCH: usize = dc_types::MAX_REVEAL_HOPS;

/// Most rows of a hop revealed in a batch with others: a decode lap, with the head's guess of
/// the tokens after its first. Longer hops (a prompt's) are revealed one layer at a time, at
/// once.
pub const BATCHED_ROWS: usize = 1 + dc_model::speculative::MAX_DRAFT;

/// Most rows of a prefill hop one reveal asks for, one picked layer at a time (all a stage
/// reveals in one pick).
pub const ROWS_PER_REVEAL: usize = dc_types::MAX_REVEAL_ROWS;

/// A prefill hop's reveal exchanges in flight at once, ahead of the checks: enough for every
/// picked layer of a usual chunk to be asked at once (the stage keeps only its last few hops;
/// a check of the first ones can take longer than a few tokens), while bounding what the head
/// holds (each answer is at most half the message limit; a few MB in practice).
const PREFILL_IN_FLIGHT: usize = 16;

/// One hop's draws, waiting to be revealed with the stage's next hops.
#[derive(Clone, Debug)]
pub struct HopPicks {
    /// The stage's log of the generation up to and including the hop.
    pub log: StageLog,
    /// The hop's step.
    pub step: u64,
    /// What the head's coins drew of it.
    pub picks: Vec<RevealPick>,
    /// Where the cache rows that stand after the hop end: its end, or its start for a
    /// speculative pass (the next hop may start inside it, overwriting its guessed rows). A
    /// check of it keeps the verified rows only up to here for the checks after it.
    pub holds: usize,
}

impl HopPicks {
    /// The request revealing this hop's picks of generation `g`.
    fn request(&self, g: GenerationId) -> RevealRequest {
        RevealRequest {
            generation: g,
            step: self.step,
            picks: self.picks.clone(),
        }
    }

    /// The hop's rows.
    fn rows(&self) -> usize {
        self.log.inputs.last().map_or(0, |x| x.rows())
    }

    /// A prefill hop's picks one layer and at most [`ROWS_PER_REVEAL`] rows at a time, in
    /// order (each its own reveal: together they would pass the message limit on big models).
    fn by_rows(self) -> Vec<HopPicks> {
        let mut parts = Vec::new();
        for p in &self.picks {
            let (first, end) = (p.position, p.position + p.positions);
            for at in (first..end).step_by(ROWS_PER_REVEAL) {
                parts.push(HopPicks {
                    log: self.log.clone(),
                    step: self.step,
                    holds: self.holds,
                    picks: vec![RevealPick {
                        position: at,
                        positions: (end - at).min(ROWS_PER_REVEAL as u32),
                        ..*p
                    }],
                });
            }
        }
        parts
    }
}

/// Asks `seg.peer` to reveal the picks of its hops in `hops` (consecutive hops of generation
/// `g`, oldest first, each still kept by the stage) in one exchange, and checks them hop by
/// hop. Returns whether the stage was proven to lie (by the referee a failed check calls, or by
/// the audit a refused reveal of a one-row hop calls).
pub async fn spot_check(
    checks: Arc<Checks>,
    seg: RouteHop,
    g: GenerationId,
    mut hops: Vec<HopPicks>,
    session: Arc<tokio::sync::Mutex<AuditSession>>,
    known: KnownCaches,
) -> bool {
    hops.retain(|h| !h.picks.is_empty() && !h.log.inputs.is_empty());
    let Ok(peer) = seg.peer.parse() else {
        return false;
    };
    if hops.is_empty() {
        return false;
    }
    let mut held = take_verified(&checks, &mut hops, &known);
    // Decode laps (up to BATCHED_ROWS rows) in one exchange, sent at once; each prefill hop's picks one layer and at
    // most ROWS_PER_REVEAL rows per exchange, PREFILL_IN_FLIGHT at a time ahead of the checks
    // (bounded memory; the stage keeps only its last few hops, so they go early). Checked in
    // hop order.
    let (mut batched, mut alone) = (Vec::new(), Vec::new());
    let mut order = Vec::new();
    for h in hops {
        match h.rows() > BATCHED_ROWS {
            true => {
                for part in h.by_rows() {
                    alone.push(part);
                    order.push(false);
                }
            }
            false => {
                batched.push(h);
                order.push(true);
            }
        }
    }
    let batch = batched.iter().map(|h| h.request(g)).collect::<Vec<_>>();
    let mut batch_task = (!batch.is_empty()).then(|| {
        let checks = checks.clone();
        tokio::spawn(async move { ask(&checks, peer, batch).await })
    });
    let asker = checks.clone();
    let mut alone = futures::stream::iter(alone)
        .map(move |h| {
            let checks = asker.clone();
            async move {
                let answer = ask(&checks, peer, vec![h.request(g)]).await.remove(0);
                (h, answer)
            }
        })
        .buffered(PREFILL_IN_FLIGHT);
    let (mut batched, mut batch_answers) = (batched.into_iter(), Vec::new().into_iter());
    // Prefill hops with a refused part: the first refusal has the hop replayed, which checks
    // every row of every layer; the hop's other refused parts need nothing more.
    let mut replayed = std::collections::HashSet::new();
    let mut proven = false;
    for in_batch in order {
        if !in_batch {
            let Some((part, answer)) = alone.next().await else {
                break;
            };
            if answer.is_err() && !replayed.insert(part.step) {
                tally(&checks, |t| t.unavailable += 1);
                continue;
            }
            proven = check_hop(&checks, &seg, part, answer, &session, &mut held).await;
        } else {
            let Some(h) = batched.next() else {
                break;
            };
            if let Some(task) = batch_task.take() {
                batch_answers = task.await.unwrap_or_default().into_iter();
            }
            let answer = batch_answers
                .next()
                .unwrap_or_else(|| Err("no answer for the hop".into()));
            // Attention picks whose cache rows would start past what is verified (an earlier
            // hop of the batch that recomputed the same layer went unrevealed or unchecked)
            // are asked again, alone, from where the verified rows end.
            let (h, answer, behind) = split_behind(h, answer, &held);
            proven = check_hop(&checks, &seg, h, answer, &session, &mut held).await;
            if let (false, Some(b)) = (proven, behind) {
                let answer = ask(&checks, peer, vec![b.request(g)]).await.remove(0);
                proven = check_hop(&checks, &seg, b, answer, &session, &mut held).await;
            }
        }
        if proven {
            break;
        }
    }
    let mut k = known.lock().unwrap_or_else(|e| e.into_inner());
    for (layer, cache) in held {
        if k.get(&layer).is_none_or(|c| c.len() < cache.len()) {
            k.insert(layer, cache);
        }
    }
    proven
}

/// The verified cache rows of every layer a pick of `hops` recomputes the attention of, taken
/// out of `known` (moved, not copied; given back, extended, when the checks end), and each
/// such pick's `cache_from` set to where the rows it needs begin.
fn take_verified(
    checks: &Checks,
    hops: &mut [HopPicks],
    known: &KnownCaches,
) -> HashMap<usize, LayerCache> {
    // The verified cache rows of every layer a pick recomputes the attention of, taken out
    // of `known` (moved, not copied) and given back, extended, at the end.
    let mut held: HashMap<usize, LayerCache> = HashMap::new();
    {
        let mut k = known.lock().unwrap_or_else(|e| e.into_inner());
        let cfg = &checks.node.model_cfg;
        let first = hops[0].log.inputs.last().map_or(0, |x| x.start);
        for p in hops.iter().flat_map(|h| &h.picks) {
            if p.checks.attention() {
                held.entry(p.layer as usize).or_insert_with(|| {
                    let mut c = k
                        .remove(&(p.layer as usize))
                        .unwrap_or_else(|| LayerCache::new(cfg.num_kv_heads, cfg.head_dim));
                    // Rows a check of a later hop verified are no use here.
                    c.truncate(first);
                    c
                });
            }
        }
    }
    // Only a check that recomputes the attention reads the cache: it asks for the rows after
    // those verified before the batch, or after the end of the batch's last earlier hop that
    // recomputes the same layer's attention (whose check comes first and extends the cache).
    let mut verified_to: HashMap<usize, usize> = held.iter().map(|(l, c)| (*l, c.len())).collect();
    for h in hops.iter_mut() {
        let (start, end) = h
            .log
            .inputs
            .last()
            .map_or((0, 0), |x| (x.start, x.start + x.rows()));
        for p in h.picks.iter_mut().filter(|p| p.checks.attention()) {
            let to = verified_to.entry(p.layer as usize).or_default();
            p.cache_from = (*to).min(start) as u32;
            *to = h.holds.min(end);
        }
    }
    held
}

/// One reveal exchange with `peer` about `requests` (one hop each, at least one): one answer
/// per request, in order.
async fn ask(
    checks: &Arc<Checks>,
    peer: libp2p::PeerId,
    mut requests: Vec<RevealRequest>,
) -> Vec<Result<Vec<dc_types::LayerReveal>, String>> {
    let n = requests.len();
    let request = match n {
        1 => StageRequest::Reveal(requests.remove(0)),
        _ => StageRequest::RevealHops(requests),
    };
    tally(checks, |t| t.exchanges += 1);
    match checks.node.client.stage_request(peer, request).await {
        Ok(StageResponse::Reveal(r)) if n == 1 => vec![r],
        Ok(StageResponse::RevealHops(Ok(r))) if r.len() == n => r,
        Ok(StageResponse::RevealHops(Err(e))) => vec![Err(e); n],
        Ok(_) => vec![Err("an unexpected or incomplete answer".to_string()); n],
        Err(e) => vec![Err(e.to_string()); n],
    }
}

/// Splits from a revealed hop the attention picks whose `cache_from` is past the rows `held`
/// has verified (with their reveals, dropped): returned as a hop of their own, each asking
/// from where the verified rows end.
#[allow(clippy::type_complexity)]
fn split_behind(
    mut h: HopPicks,
    answer: Result<Vec<dc_types::LayerReveal>, String>,
    held: &HashMap<usize, LayerCache>,
) -> (
    HopPicks,
    Result<Vec<dc_types::LayerReveal>, String>,
    Option<HopPicks>,
) {
    let start = h.log.inputs.last().map_or(0, |x| x.start);
    let verified = |p: &RevealPick| {
        held.get(&(p.layer as usize))
            .map_or(0, |c| c.len().min(start))
    };
    let reveals = match answer {
        Ok(r) if r.len() == h.picks.len() => r,
        other => return (h, other, None),
    };
    let (mut keep, mut kept, mut behind) = (Vec::new(), Vec::new(), Vec::new());
    for (p, r) in std::mem::take(&mut h.picks).into_iter().zip(reveals) {
        match p.checks.attention() && (p.cache_from as usize) > verified(&p) {
            true => behind.push(RevealPick {
                cache_from: verified(&p) as u32,
                ..p
            }),
            false => {
                keep.push(p);
                kept.push(r);
            }
        }
    }
    let retry = (!behind.is_empty()).then(|| HopPicks {
        log: h.log.clone(),
        step: h.step,
        holds: h.holds,
        picks: behind,
    });
    h.picks = keep;
    (h, Ok(kept), retry)
}

/// Checks one hop's reveal against its picks, extending `held` with the cache rows its
/// attention checks verify. Returns whether the stage was proven to lie.
async fn check_hop(
    checks: &Arc<Checks>,
    seg: &RouteHop,
    h: HopPicks,
    answer: Result<Vec<dc_types::LayerReveal>, String>,
    session: &Arc<tokio::sync::Mutex<AuditSession>>,
    held: &mut HashMap<usize, LayerCache>,
) -> bool {
    let HopPicks {
        log,
        step,
        picks,
        holds,
    } = h;
    let Some((rows, start)) = log.inputs.last().map(|x| (x.rows(), x.start)) else {
        return false;
    };
    let reveals = match answer {
        Ok(r) if r.len() == picks.len() => r,
        other => {
            let why = match other {
                Err(e) => e,
                Ok(_) => "an incomplete answer".into(),
            };
            tally(checks, |t| t.unavailable += 1);
            // An honest stage keeps every hop a check asks about and can reveal any one layer
            // of it at [`ROWS_PER_REVEAL`] rows: a refusal gets the hop replayed instead, or a
            // liar could refuse the reveals of the hops it lied in.
            warn!(
                "{} would not reveal a {rows}-row hop ({why}): auditing it",
                seg.peer
            );
            return audit(checks.clone(), seg.clone(), log, session.clone()).await;
        }
    };
    if picks.is_empty() {
        return false;
    }
    let bytes: usize = reveals
        .iter()
        .map(dc_types::LayerReveal::payload_bytes)
        .sum();
    let layers: Vec<usize> = picks.iter().map(|p| p.layer as usize).collect();
    let parts: u64 = picks.iter().map(|p| p.checks.len() as u64).sum();
    let attention = picks.iter().filter(|p| p.checks.attention()).count() as u64;
    let (checkers, model) = match (checkers(checks, &layers).await, checks.node.serving()) {
        (Ok(c), Some(s)) => (c, s.model.clone()),
        (Err(e), _) => {
            warn!("cannot spot-check layers {}: {e}", seg.layers);
            tally(checks, |t| t.unavailable += 1);
            return false;
        }
        (_, None) => return false,
    };
    // Every hop of the stage in this generation up to this one: the check ties the revealed
    // cache rows to the commitments of the hops that produced them.
    let traces: Vec<_> = log
        .traces
        .iter()
        .cloned()
        .zip(log.inputs.iter().map(|x| x.rows()))
        .collect();
    // The attention picks' caches, truncated to where the pick's cache rows start (at most the
    // hop's start; moved, not copied): rows verified past it are revealed and checked again
    // (a prefill hop's later rows, when an earlier part of it extended the cache).
    let caches: Vec<LayerCache> = picks
        .iter()
        .map(|p| match p.checks.attention() {
            true => {
                let mut c = held.remove(&(p.layer as usize)).unwrap_or_else(|| {
                    LayerCache::new(
                        checks.node.model_cfg.num_kv_heads,
                        checks.node.model_cfg.head_dim,
                    )
                });
                c.truncate((p.cache_from as usize).min(start));
                c
            }
            false => LayerCache::new(
                checks.node.model_cfg.num_kv_heads,
                checks.node.model_cfg.head_dim,
            ),
        })
        .collect();
    let gemm = checks.node.gemm.clone();
    let checked = tokio::task::spawn_blocking(move || {
        // On the engine's threads, like every other product this peer computes.
        gemm.install(|| check_all(&model, &checkers, &traces, &picks, &reveals, caches))
    })
    .await
    .unwrap_or_else(|e| Err(e.to_string()));
    let checked = checked.map(|verified| {
        held.extend(verified.into_iter().map(|(l, mut c)| {
            c.truncate(holds.min(c.len()));
            (l, c)
        }))
    });
    let n = layers.len() as u64;
    tally(checks, |t| {
        t.run += 1;
        t.layers += n;
        t.parts += parts;
        t.attention += attention;
        t.bytes += bytes as u64;
        if checked.is_ok() {
            t.passed += 1;
        } else {
            t.failed += 1;
        }
    });
    match checked {
        Ok(()) => false,
        Err(why) => {
            warn!(
                "spot check of {} (layers {}, step {step}) failed: {why}; refereeing",
                seg.peer, seg.layers
            );
            referee(checks, &seg.peer, seg.layers, &log).await
        }
    }
}

fn tally(checks: &Checks, f: impl FnOnce(&mut SpotTally)) {
    f(&mut checks.book().spot);
}

/// Checks each revealed layer against its pick, extending that layer's verified cache (`held`,
/// in pick order) when the pick recomputes the attention; returns the extended caches, or why
/// a check failed.
fn check_all(
    model: &Model,
    checkers: &HashMap<usize, Arc<LayerChecker>>,
    traces: &[(Arc<dc_types::HopTrace>, usize)],
    picks: &[RevealPick],
    reveals: &[dc_types::LayerReveal],
    mut held: Vec<LayerCache>,
) -> Result<Vec<(usize, LayerCache)>, String> {
    let hops: Vec<_> = traces.iter().map(|(t, n)| (&**t, *n)).collect();
    let mut jobs = Vec::with_capacity(picks.len());
    for ((pick, reveal), cache) in picks.iter().zip(reveals).zip(held.iter_mut()) {
        if (reveal.layer, reveal.position) != (pick.layer, pick.position) {
            return Err(format!(
                "asked for layer {} at {}, got layer {} at {}",
                pick.layer, pick.position, reveal.layer, reveal.position
            ));
        }
        let c = checkers
            .get(&(pick.layer as usize))
            .ok_or("no checker for a picked layer")?;
        jobs.push((&**c, reveal, pick.checks, pick.positions as usize, cache));
    }
    // The picks are of different layers: checked in parallel on the engine's threads, the
    // first failure in pick order reported.
    dc_model::check_picks(model, &hops, jobs)
        .into_iter()
        .collect::<Result<Vec<()>, String>>()?;
    Ok(picks
        .iter()
        .zip(held)
        .filter(|(pick, _)| pick.checks.attention())
        .map(|(pick, cache)| (pick.layer as usize, cache))
        .collect())
}

/// The checkers of `layers`, building the missing ones from our own copy of the weights (one
/// layer loaded at a time, dropped once `W · r` is computed). The secret never leaves us.
async fn checkers(
    checks: &Arc<Checks>,
    layers: &[usize],
) -> Result<HashMap<usize, Arc<LayerChecker>>, String> {
    let mut held = checks.checkers.lock().await;
    let missing: Vec<usize> = layers
        .iter()
        .copied()
        .filter(|l| !held.contains_key(l))
        .collect();
    if !missing.is_empty() {
        // A fetched model fetches the layers it checks but does not serve.
        for &l in &missing {
            if let Some(one) = dc_types::LayerRange::new(l as u32, l as u32 + 1) {
                checks.weights.ensure(one, false).await?;
            }
        }
        let own_secret = checks.secret;
        let n2 = checks.node.clone();
        let built = tokio::task::spawn_blocking(move || -> Result<Vec<LayerChecker>, String> {
            let secret = Domain::HopRecord
                .hash(&[&b"freivalds"[..], &own_secret].concat())
                .0;
            let serving = n2.serving();
            let mut out = Vec::new();
            for l in missing {
                let own = serving
                    .as_ref()
                    .filter(|s| s.model.loaded_layers().contains(&l));
                let c = match own {
                    Some(s) => LayerChecker::new(&s.model, l, &secret),
                    None => Model::load(
                        &n2.cfg.model,
                        &LoadOptions {
                            layers: Some(l..l + 1),
                            head: false,
                            cache_in: Some(n2.cfg.data_dir.clone()),
                        },
                    )
                    .and_then(|m| LayerChecker::new(&m, l, &secret)),
                };
                out.push(c.map_err(|e| e.to_string())?);
            }
            Ok(out)
        })
        .await
        .map_err(|e| e.to_string())??;
        for c in built {
            held.insert(c.layer(), Arc::new(c));
        }
    }
    Ok(layers
        .iter()
        .filter_map(|l| held.get(l).map(|c| (*l, c.clone())))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use dc_types::CheckSet;

    const PARTS: [Point; 4] = [Point::Q, Point::Scores, Point::Down, Point::Output];

    fn draw(secret: u8, step: u64, rate: f32) -> Vec<RevealPick> {
        let layers = LayerRange { start: 4, end: 12 };
        picks(
            &[secret; 32],
            &GenerationId([1; 16]),
            step,
            layers,
            100,
            5,
            &PARTS,
            rate,
        )
    }

    #[test]
    fn every_part_at_rate_one_and_nothing_at_zero() {
        let all = draw(1, 0, 1.0);
        assert_eq!(all.len(), 8);
        for (p, layer) in all.iter().zip(4..) {
            assert_eq!((p.layer, p.checks), (layer, CheckSet::of(&PARTS)));
            assert!((100..105).contains(&p.position));
        }
        assert!(draw(1, 0, 0.0).is_empty());
    }

    #[test]
    fn attention_picks_past_the_verified_rows_are_asked_again_from_where_they_end() {
        // A hop at position 5; layer 3's verified rows end at 3 (the batch's earlier hop that
        // recomputed it went unchecked), layer 4's at 5.
        let log = StageLog {
            inputs: vec![Arc::new(dc_model::Activations {
                start: 5,
                hidden: 2,
                data: vec![0.5; 2],
            })],
            ..Default::default()
        };
        let cache = |rows: usize| {
            let mut c = LayerCache::new(1, 32);
            for _ in 0..rows {
                c.append(&[0.25; 32], &[0.5; 32]).unwrap();
            }
            c
        };
        let held: HashMap<usize, LayerCache> = [(3, cache(3)), (4, cache(5))].into();
        let pick = |layer: u32, cache_from: u32, parts: &[Point]| RevealPick {
            layer,
            position: 5,
            positions: 1,
            cache_from,
            checks: CheckSet::of(parts),
        };
        let picks = vec![
            pick(2, 0, &[Point::Q]),
            pick(3, 5, &[Point::Scores]),
            pick(4, 5, &[Point::Context, Point::Down]),
        ];
        let reveal = |layer: u32| dc_types::LayerReveal {
            layer,
            position: 5,
            input: dc_types::WireActivations {
                start: 5,
                hidden: 2,
                data: Vec::new(),
            },
            next: dc_types::WireActivations {
                start: 5,
                hidden: 2,
                data: Vec::new(),
            },
            rows: Vec::new(),
            cache: Vec::new(),
        };
        let hop = HopPicks {
            log: log.clone(),
            step: 7,
            picks: picks.clone(),
            holds: 6,
        };
        let answer = Ok(vec![reveal(2), reveal(3), reveal(4)]);
        let (kept, answer, retry) = split_behind(hop.clone(), answer, &held);
        assert_eq!(kept.picks, vec![picks[0], picks[2]]);
        let layers: Vec<u32> = answer.unwrap().iter().map(|r| r.layer).collect();
        assert_eq!(layers, vec![2, 4]);
        let retry = retry.expect("layer 3 asked again");
        assert_eq!(
            (retry.step, retry.picks.clone()),
            (7, vec![pick(3, 3, &[Point::Scores])])
        );
        // All caught up (or an answer that is no reveal): nothing to ask again.
        let held: HashMap<usize, LayerCache> = [(3, cache(5)), (4, cache(5))].into();
        let answer = Ok(vec![reveal(2), reveal(3), reveal(4)]);
        let (kept, _, retry) = split_behind(hop.clone(), answer, &held);
        assert_eq!((kept.picks, retry.is_none()), (picks.clone(), true));
        let (kept, answer, retry) = split_behind(hop, Err("no".into()), &held);
        assert_eq!(
            (kept.picks, answer, retry.is_none()),
            (picks, Err("no".into()), true)
        );
    }

    #[test]
    fn the_coins_are_the_heads_own_and_differ_by_hop() {
        // The same secret and hop give the same draws; another secret or step gives others.
        let a: Vec<_> = (0..50).map(|s| draw(1, s, 0.3)).collect();
        let again: Vec<_> = (0..50).map(|s| draw(1, s, 0.3)).collect();
        let other: Vec<_> = (0..50).map(|s| draw(2, s, 0.3)).collect();
        assert_eq!(a, again);
        assert_ne!(a, other);
        assert_ne!(a[0], a[1]);
        // Parts are drawn apart: layers with only some parts drawn are common.
        let partial = a
            .iter()
            .flatten()
            .filter(|p| p.checks != CheckSet::of(&PARTS))
            .count();
        assert!(partial > 50, "{partial}");
    }
}
