//! The daemon's view of the swarm: who serves which layers, who is healthy, who heads a
//! generation, and which route covers every layer. Pure functions over a peer table, so all of
//! it is tested without a network.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use dc_types::{
    Announcement, GenerationId, LayerRange, ModelId, PeerState, RouteHop, PROTOCOL_VERSION,
};

/// Most peers the table holds: announcements from fresh identities cost nothing to make, so
/// past this the peer heard from least recently is forgotten for the newcomer.
pub const MAX_PEERS: usize = 4096;
/// Most of a peer's announced addresses kept (an honest daemon lists a few).
pub const MAX_PEER_ADDRS: usize = 8;
/// Longest software version string kept, in bytes.
const MAX_SOFTWARE: usize = 64;

/// What we know of one peer.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    /// Its latest announcement.
    pub announcement: Announcement,
    /// When we last heard from it.
    pub last_seen: Instant,
}

/// The peer table (other peers only; the daemon adds itself when planning).
#[derive(Debug, Default)]
pub struct SwarmView {
    peers: BTreeMap<String, PeerInfo>,
}

/// Why an announcement was ignored (logged once per peer and reason).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ignored {
    /// Another protocol version.
    Protocol(u32),
    /// Another model.
    Model(ModelId),
    /// Older than one we already have.
    Stale,
}

/// A participant as planning sees it: a peer or ourselves.
#[derive(Clone, Debug, PartialEq)]
pub struct Participant {
    /// Peer id (base58).
    pub peer: String,
    /// Layers served.
    pub layers: LayerRange,
    /// Holds the head weights.
    pub head: bool,
    /// Throughput (tokens/s).
    pub throughput: f32,
    /// Generations it serves now.
    pub active: u32,
}

impl SwarmView {
    /// Records an announcement from `peer`, unless it is for another model or protocol.
    pub fn update(
        &mut self,
        peer: &str,
        mut ann: Announcement,
        model: &ModelId,
        now: Instant,
    ) -> Result<(), Ignored> {
        if ann.protocol_version != PROTOCOL_VERSION {
            return Err(Ignored::Protocol(ann.protocol_version));
        }
        if ann.model_id != *model {
            return Err(Ignored::Model(ann.model_id));
        }
        if let Some(old) = self.peers.get(peer) {
            if old.announcement.seq > ann.seq {
                return Err(Ignored::Stale);
            }
        } else if self.peers.len() >= MAX_PEERS {
            let oldest = self
                .peers
                .iter()
                .min_by_key(|(_, p)| p.last_seen)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                self.peers.remove(&k);
            }
        }
        ann.listen_addrs.truncate(MAX_PEER_ADDRS);
        if ann.software.len() > MAX_SOFTWARE {
            let mut end = MAX_SOFTWARE;
            while !ann.software.is_char_boundary(end) {
                end -= 1;
            }
            ann.software.truncate(end);
        }
        self.peers.insert(
            peer.to_string(),
            PeerInfo {
                announcement: ann,
                last_seen: now,
            },
        );
        Ok(())
    }

    /// Forgets a peer (it left or its connection closed for good).
    pub fn remove(&mut self, peer: &str) {
        self.peers.remove(peer);
    }

    /// Drops peers not heard from within `timeout`.
    pub fn expire(&mut self, now: Instant, timeout: Duration) -> Vec<String> {
        let gone: Vec<String> = self
            .peers
            .iter()
            .filter(|(_, p)| now.duration_since(p.last_seen) > timeout)
            .map(|(k, _)| k.clone())
            .collect();
        for g in &gone {
            self.peers.remove(g);
        }
        gone
    }

    /// Every known peer.
    pub fn peers(&self) -> impl Iterator<Item = (&String, &PeerInfo)> {
        self.peers.iter()
    }

    /// One peer.
    pub fn get(&self, peer: &str) -> Option<&PeerInfo> {
        self.peers.get(peer)
    }

    /// Peers that serve layers now (state Serving, layers known).
    pub fn serving(&self) -> Vec<Participant> {
        self.peers
            .iter()
            .filter(|(_, p)| p.announcement.state == PeerState::Serving)
            .filter_map(|(id, p)| {
                Some(Participant {
                    peer: id.clone(),
                    layers: p.announcement.layers?,
                    head: p.announcement.head,
                    throughput: p.announcement.throughput,
                    active: p.announcement.active_generations,
                })
            })
            .collect()
    }
}

/// Rendezvous weight of `peer` for generation `g`: blake3(generation ‖ peer).
fn weight(g: &GenerationId, peer: &str) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(&g.0);
    h.update(peer.as_bytes());
    *h.finalize().as_bytes()
}

/// The head of generation `g` among `candidates` (head-capable, healthy): the highest
/// rendezvous weight, so every daemon with the same view picks the same head without a vote,
/// and the load spreads across heads.
pub fn elect_head<'a>(
    g: &GenerationId,
    candidates: impl IntoIterator<Item = &'a Participant>,
) -> Option<&'a Participant> {
    candidates
        .into_iter()
        .filter(|p| p.head)
        .max_by(|a, b| weight(g, &a.peer).cmp(&weight(g, &b.peer)))
}

/// A route covering layers `0..num_layers`: at each uncovered layer, the participant whose
/// range reaches furthest; ties prefer the head itself (no network hop), then the less busy,
/// then the faster, then the rendezvous weight. Errors name the first uncovered layer.
pub fn plan_route(
    g: &GenerationId,
    num_layers: u32,
    head: &str,
    participants: &[Participant],
) -> Result<Vec<RouteHop>, String> {
    let mut route = Vec::new();
    let mut at = 0u32;
    while at < num_layers {
        let best = participants
            .iter()
            .filter(|p| p.layers.contains(at))
            .max_by(|a, b| {
                a.layers
                    .end
                    .cmp(&b.layers.end)
                    .then((a.peer == head).cmp(&(b.peer == head)))
                    .then(b.active.cmp(&a.active))
                    .then(a.throughput.total_cmp(&b.throughput))
                    .then(weight(g, &a.peer).cmp(&weight(g, &b.peer)))
            })
            .ok_or_else(|| format!("layer {at} is not served by any healthy peer"))?;
        let end = best.layers.end.min(num_layers);
        route.push(RouteHop {
            peer: best.peer.clone(),
            layers: LayerRange { start: at, end },
        });
        at = end;
    }
    Ok(route)
}

/// Replicas serving each layer.
pub fn coverage(num_layers: u32, participants: &[Participant]) -> Vec<u32> {
    let mut c = vec![0u32; num_layers as usize];
    for p in participants {
        for l in p.layers.start..p.layers.end.min(num_layers) {
            c[l as usize] += 1;
        }
    }
    c
}

/// The ranges of layers no one serves, given each layer's replicas.
pub fn uncovered(coverage: &[u32]) -> Vec<LayerRange> {
    let mut gaps: Vec<LayerRange> = Vec::new();
    for (l, _) in coverage.iter().enumerate().filter(|(_, &c)| c == 0) {
        let l = l as u32;
        match gaps.last_mut() {
            Some(g) if g.end == l => g.end = l + 1,
            _ => gaps.push(LayerRange {
                start: l,
                end: l + 1,
            }),
        }
    }
    gaps
}

/// The window of `len` layers a joining daemon should serve: the one whose layers have the
/// fewest replicas in total (so a gap is filled first); ties go to the earlier window.
pub fn least_served_window(num_layers: u32, len: u32, coverage: &[u32]) -> LayerRange {
    let len = len.clamp(1, num_layers);
    // Fewest covered layers first (a gap is filled before anything is doubled), then fewest
    // replicas in total; `min_by_key` keeps the earliest of equal windows.
    let start = (0..=(num_layers - len))
        .min_by_key(|&s| {
            let w = &coverage[s as usize..(s + len) as usize];
            (
                w.iter().filter(|&&c| c > 0).count(),
                w.iter().map(|&c| c as u64).sum::<u64>(),
            )
        })
        .unwrap_or(0);
    LayerRange {
        start,
        end: start + len,
    }
}

/// Whether a daemon serving `current` should move to `proposed`, given the replicas served by
/// everyone else: only if the swarm's weakest layer gains (hysteresis: a strict improvement of
/// the minimum, or fewer uncovered layers), and never if a layer only we serve would be left
/// uncovered.
pub fn should_move(current: LayerRange, proposed: LayerRange, others: &[u32]) -> bool {
    if proposed == current {
        return false;
    }
    let with = |r: LayerRange| -> Vec<u32> {
        others
            .iter()
            .enumerate()
            .map(|(l, &c)| c + r.contains(l as u32) as u32)
            .collect()
    };
    let (now, then) = (with(current), with(proposed));
    if then.contains(&0) && !now.contains(&0) {
        return false;
    }
    let gaps = |v: &[u32]| v.iter().filter(|&&c| c == 0).count();
    let min = |v: &[u32]| v.iter().copied().min().unwrap_or(0);
    gaps(&then) < gaps(&now) || (gaps(&then) == gaps(&now) && min(&then) > min(&now))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(id: &str, a: u32, b: u32, head: bool) -> Participant {
        Participant {
            peer: id.into(),
            layers: LayerRange { start: a, end: b },
            head,
            throughput: 1.0,
            active: 0,
        }
    }

    fn announcement(model: &ModelId, seq: u64) -> Announcement {
        Announcement {
            protocol_version: PROTOCOL_VERSION,
            software: "dcd 0.1.0".into(),
            model_id: *model,
            layers: Some(LayerRange { start: 0, end: 1 }),
            head: false,
            throughput: 1.0,
            free_memory: 0,
            state: PeerState::Serving,
            active_generations: 0,
            seq,
            listen_addrs: vec![],
        }
    }

    #[test]
    fn uncovered_layers_come_as_ranges() {
        let r = |start, end| LayerRange { start, end };
        assert_eq!(
            uncovered(&[1, 0, 0, 2, 0, 1, 0]),
            vec![r(1, 3), r(4, 5), r(6, 7)]
        );
        assert_eq!(uncovered(&[1, 1]), vec![]);
        assert_eq!(uncovered(&[0, 0]), vec![r(0, 2)]);
    }

    #[test]
    fn the_peer_table_is_bounded_and_forgets_the_least_recently_heard() {
        let model = ModelId::default();
        let mut view = SwarmView::default();
        let t0 = Instant::now();
        for i in 0..MAX_PEERS {
            let at = t0 + Duration::from_millis(i as u64);
            view.update(&format!("p{i}"), announcement(&model, 1), &model, at)
                .unwrap();
        }
        // p0, heard from first, speaks again: now p1 is the least recently heard.
        let later = t0 + Duration::from_secs(3600);
        view.update("p0", announcement(&model, 2), &model, later)
            .unwrap();
        let mut big = announcement(&model, 1);
        big.listen_addrs = vec!["/ip4/127.0.0.1/tcp/1".into(); 1000];
        big.software = "é".repeat(1000);
        view.update("new", big, &model, later).unwrap();
        assert_eq!(view.peers().count(), MAX_PEERS);
        assert!(view.get("p1").is_none(), "the least recently heard went");
        assert!(view.get("p0").is_some() && view.get("p2").is_some());
        let kept = &view.get("new").unwrap().announcement;
        assert_eq!(kept.listen_addrs.len(), MAX_PEER_ADDRS);
        assert!(kept.software.len() <= MAX_SOFTWARE && kept.software.starts_with('é'));
    }

    #[test]
    fn everyone_elects_the_same_head_and_load_spreads() {
        let ps = vec![p("a", 0, 2, true), p("b", 2, 4, true), p("c", 0, 4, false)];
        let mut counts = BTreeMap::new();
        for i in 0..200u8 {
            let g = GenerationId([i; 16]);
            let h1 = elect_head(&g, &ps).unwrap().peer.clone();
            let mut rev = ps.clone();
            rev.reverse();
            assert_eq!(
                h1,
                elect_head(&g, &rev).unwrap().peer,
                "order must not matter"
            );
            assert_ne!(h1, "c", "c holds no head weights");
            *counts.entry(h1).or_insert(0) += 1;
        }
        assert!(counts.values().all(|&c| c > 60), "{counts:?}");
    }

    #[test]
    fn routes_cover_every_layer_or_name_the_gap() {
        let g = GenerationId([1; 16]);
        let ps = vec![p("a", 0, 2, true), p("b", 1, 3, false), p("c", 3, 4, false)];
        let r = plan_route(&g, 4, "a", &ps).unwrap();
        let hops: Vec<_> = r
            .iter()
            .map(|h| (h.peer.as_str(), h.layers.start, h.layers.end))
            .collect();
        assert_eq!(hops, vec![("a", 0, 2), ("b", 2, 3), ("c", 3, 4)]);
        let gap = vec![p("a", 0, 2, true), p("c", 3, 4, false)];
        assert_eq!(
            plan_route(&g, 4, "a", &gap).unwrap_err(),
            "layer 2 is not served by any healthy peer"
        );
    }

    #[test]
    fn a_joining_daemon_fills_the_gap() {
        // Layers 0..6; 2 and 3 are uncovered.
        let cov = [2, 1, 0, 0, 1, 1];
        assert_eq!(
            least_served_window(6, 2, &cov),
            LayerRange { start: 2, end: 4 }
        );
        assert_eq!(
            least_served_window(6, 3, &cov),
            LayerRange { start: 1, end: 4 }
        );
        // No gap: the least replicated window.
        assert_eq!(
            least_served_window(4, 2, &[3, 3, 1, 1]),
            LayerRange { start: 2, end: 4 }
        );
        assert_eq!(
            least_served_window(4, 9, &[0, 0, 0, 0]),
            LayerRange { start: 0, end: 4 }
        );
    }

    #[test]
    fn moving_never_uncovers_and_needs_a_real_gain() {
        let r = |a, b| LayerRange { start: a, end: b };
        // Others cover 0..2 only; we serve 2..4. Moving to 0..2 would uncover 2..4.
        assert!(!should_move(r(2, 4), r(0, 2), &[1, 1, 0, 0]));
        // Others left 2..3 uncovered while we double 0..1: move.
        assert!(should_move(r(0, 1), r(2, 3), &[1, 1, 0, 1]));
        // No gain, no move.
        assert!(!should_move(r(0, 2), r(2, 4), &[1, 1, 1, 1]));
        assert!(!should_move(r(0, 2), r(0, 2), &[0, 0, 0, 0]));
    }
}
