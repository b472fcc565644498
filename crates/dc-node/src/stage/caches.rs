//! The KV caches this daemon keeps for the generations it serves as a stage (and for the audit
//! sessions it replays for other heads): one per generation, owned by the peer that started
//! it, bounded in number, dropped when idle, with the last hops kept for reveals.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dc_model::{CacheLog, KeptHop, KvCache};
use dc_types::{Commitment, GenerationId, HopErrorKind, HopRecord, LayerRange, MAX_REVEAL_HOPS};
use tracing::warn;

/// Hops kept per generation for reveals: a head asks about up to [`MAX_REVEAL_HOPS`] of a
/// stage's hops at once, right after the last of them, so one more would suffice if its
/// request always came before the next hop but one; a batch's worth more leaves room for a head
/// whose checks lag its laps (a busy machine, a head guessing several tokens a lap).
pub const KEPT_HOPS: usize = 2 * MAX_REVEAL_HOPS + 1;

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
    /// The first position of the last hop taken: a hop may start inside it (a speculative
    /// guess missed), but not at or before it.
    last_start: usize,
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
    pub(super) fn take(
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
            if self.entries.len() >= max && !self.make_room_for(owner, max) {
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
                    last_start: 0,
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
        // A hop continues where the cache ends, or starts inside the last hop after its first
        // position: the guess of a speculative pass missed there, and the model cuts the
        // cache back to `start` before running (as every replay of the hops does).
        let held = cache.len();
        if start > held || (start < held && start <= e.last_start) {
            e.cache = Some(cache);
            return Err((
                HopErrorKind::BadActivations,
                format!(
                    "activations start at position {start} but the cache holds {held} and its \
                     last hop started at {}",
                    e.last_start
                ),
            ));
        }
        e.last_start = start;
        Ok(cache)
    }

    /// Full, and `owner` asks for one more generation: frees a slot if another peer holds more
    /// than its fair share (the slots split evenly among the peers holding them, `owner`
    /// included), by dropping that peer's longest-idle cache that no hop is using. So one
    /// peer that starts generations and never finishes them cannot lock the others out, and a
    /// lone head still gets every slot while nobody else needs one. Returns whether a slot
    /// was freed; `owner` at or over its own share is refused.
    fn make_room_for(&mut self, owner: &str, max: usize) -> bool {
        let mut held: HashMap<&str, usize> = HashMap::new();
        for e in self.entries.values() {
            *held.entry(e.owner.as_str()).or_default() += 1;
        }
        let owners = held.len() + usize::from(!held.contains_key(owner));
        let share = max.div_ceil(owners).max(1);
        if held.get(owner).copied().unwrap_or(0) >= share {
            return false;
        }
        let Some((&hog, _)) = held
            .iter()
            .filter(|(o, n)| **o != owner && **n > share)
            .max_by_key(|(o, n)| (**n, std::cmp::Reverse(**o)))
        else {
            return false;
        };
        let hog = hog.to_string();
        let victim = self
            .entries
            .iter()
            .filter(|(_, e)| e.owner == hog && e.cache.is_some())
            .min_by_key(|(g, e)| (e.last_used, g.0))
            .map(|(g, _)| *g);
        match victim {
            Some(g) => {
                warn!("dropping generation {g} of {hog}, which holds more than its share of {share} stage caches");
                self.entries.remove(&g);
                true
            }
            None => false,
        }
    }

    /// Keeps hop `step` of `g` for reveals, dropping its older hops beyond [`KEPT_HOPS`]; not
    /// kept when it would take the daemon past [`KEPT_BYTES`]. The cache rows the hop added
    /// are logged either way (they are revealed for later hops too).
    pub(super) fn keep(
        &mut self,
        g: &GenerationId,
        step: u64,
        start: usize,
        hop: KeptHop,
        cache: &KvCache,
    ) {
        if let Some(e) = self.entries.get_mut(g) {
            // `take` let only a hop the log can follow run; should one not fit, nothing is
            // revealed of the generation any more (a head audits the hops instead).
            if e.log.record_hop(start, cache).is_err() {
                e.log = CacheLog::default();
                e.kept.clear();
                return;
            }
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
    pub(super) fn log(&self, g: &GenerationId, owner: &str) -> Option<(LayerRange, CacheLog)> {
        let e = self.owned(g, owner)?;
        Some((e.layers, e.log.clone()))
    }

    /// A kept hop, with the generation's cache rows (shared, not copied), for its owner.
    pub(super) fn kept(
        &self,
        g: &GenerationId,
        step: u64,
        owner: &str,
    ) -> Option<(Arc<KeptHop>, CacheLog)> {
        let e = self.owned(g, owner)?;
        let hop = e
            .kept
            .iter()
            .find(|(s, _)| *s == step)
            .map(|(_, k)| k.clone())?;
        Some((hop, e.log.clone()))
    }

    /// The chain of the inputs that built `g`'s cache ([`HopRecord::FIRST`] for none).
    pub(super) fn chain(&self, g: &GenerationId) -> Commitment {
        self.entries.get(g).map_or(HopRecord::FIRST, |e| e.chain)
    }

    /// Returns `g`'s cache after a hop that succeeded, with the chain of the inputs that built
    /// it now.
    pub(super) fn put_after(&mut self, g: GenerationId, cache: KvCache, chain: Commitment) {
        self.put(g, Some(cache));
        if let Some(e) = self.entries.get_mut(&g) {
            e.chain = chain;
        }
    }

    /// Returns a cache after a hop (successful or not: a failed hop leaves it unchanged only if
    /// the model refused before touching it, so failures drop it).
    pub(super) fn put(&mut self, g: GenerationId, cache: Option<KvCache>) {
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is the failure report

    use super::*;

    /// Appends `n` positions to every layer of `cache`.
    fn grow(cfg: &dc_model::ModelConfig, cache: &mut KvCache, n: usize) {
        let w = cfg.kv_width();
        for l in cache.layers() {
            for i in 0..n {
                let row: Vec<f32> = (0..w).map(|j| ((i + j) % 7) as f32 - 3.0).collect();
                cache.layer_mut(l).unwrap().append(&row, &row).unwrap();
            }
        }
    }

    #[test]
    fn a_hop_continues_the_cache_or_starts_inside_the_last_hop_after_its_start() {
        let cfg = config();
        let (g, layers) = (GenerationId([9; 16]), LayerRange::new(0, 2).unwrap());
        let mut caches = StageCaches::default();
        let mut cache = caches.take(g, "head", layers, 0, &cfg, 4).unwrap();
        grow(&cfg, &mut cache, 6);
        caches.put(g, Some(cache));
        // Past the cache's end: refused, and the cache stays.
        let (_, why) = caches.take(g, "head", layers, 7, &cfg, 4).unwrap_err();
        assert!(why.contains("holds 6"), "{why}");
        let mut cache = caches.take(g, "head", layers, 6, &cfg, 4).unwrap();
        grow(&cfg, &mut cache, 3);
        caches.put(g, Some(cache));
        // At or before the last hop's start (6): refused; inside it, after its start: taken,
        // whole (the model cuts it back to where the hop starts).
        // (Position 0 would start the generation over.)
        for start in [4, 6] {
            let (_, why) = caches.take(g, "head", layers, start, &cfg, 4).unwrap_err();
            assert!(why.contains("last hop started at 6"), "{start}: {why}");
        }
        let cache = caches.take(g, "head", layers, 8, &cfg, 4).unwrap();
        assert_eq!(cache.len(), 9);
        caches.put(g, Some(cache));
        // The next one must start after 8.
        assert!(caches.take(g, "head", layers, 8, &cfg, 4).is_err());
        assert!(caches.take(g, "head", layers, 9, &cfg, 4).is_ok());
    }

    fn config() -> dc_model::ModelConfig {
        let fixture =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/llama");
        dc_model::open::open_source(&fixture).unwrap().0
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

    #[test]
    fn a_peer_hoarding_generations_makes_room_for_others_but_a_lone_head_gets_every_slot() {
        let cfg = config();
        let layers = LayerRange::new(0, 2).unwrap();
        let mut caches = StageCaches::default();
        let id = |n: u8| GenerationId([n; 16]);
        // A lone peer gets every slot.
        for n in 0..4 {
            let c = caches.take(id(n), "hoarder", layers, 0, &cfg, 4).unwrap();
            caches.put(id(n), Some(c));
        }
        let (kind, _) = caches
            .take(id(9), "hoarder", layers, 0, &cfg, 4)
            .unwrap_err();
        assert_eq!(kind, HopErrorKind::Overloaded);
        // Another peer gets a slot: the hoarder's longest-idle cache goes.
        let c = caches.take(id(10), "head", layers, 0, &cfg, 4).unwrap();
        caches.put(id(10), Some(c));
        assert_eq!(caches.len(), 4);
        assert!(
            caches.log(&id(0), "hoarder").is_none(),
            "the oldest was dropped"
        );
        assert!(caches.log(&id(1), "hoarder").is_some());
        // And a second one: the hoarder still holds 3 > its share of 2.
        let c = caches.take(id(11), "head", layers, 0, &cfg, 4).unwrap();
        caches.put(id(11), Some(c));
        // Now both hold their share: neither takes the other's.
        assert_eq!(
            caches
                .take(id(12), "head", layers, 0, &cfg, 4)
                .unwrap_err()
                .0,
            HopErrorKind::Overloaded
        );
        // A cache in use by a hop is never dropped.
        let mut busy = StageCaches::default();
        for n in 0..4 {
            busy.take(id(n), "hoarder", layers, 0, &cfg, 4).unwrap();
        }
        assert_eq!(
            busy.take(id(10), "head", layers, 0, &cfg, 4).unwrap_err().0,
            HopErrorKind::Overloaded
        );
    }
}
