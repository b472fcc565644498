//! Which gossiped proof claims this daemon fetches and checks, and when. A claim ("I hold a
//! proof, id X, that peer Y lied") is work any peer can force on us: fetching the proof and
//! checking it may re-run a layer over a whole context. Peers are cheap to make, so claims are
//! bounded: a few fetches at once, one per claimant; the rest wait their turn in a bounded
//! line, one per claimant; and a claimant whose claim came to nothing is not heard again for a
//! while. Yet a real proof must get through: a claim that finds every slot taken waits instead
//! of being dropped, so silent claimants can only delay it until their fetches time out.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use dc_kernels::Commitment;

/// Most claims fetched and checked at once.
pub const MAX_RUNNING: usize = 4;
/// Most claims waiting for a slot (the oldest stay; later ones are dropped).
pub const MAX_WAITING: usize = 64;
/// How long a claimant whose claim came to nothing (no proof, a proof that does not hold, no
/// answer in time) is not heard.
pub const IGNORE_FALSE_CLAIMANT: Duration = Duration::from_secs(600);
/// Most claimants ignored at once (the one ignored longest is forgotten first).
const MAX_IGNORED: usize = 1024;

/// One claim: a proof id, the peer that gossiped it (and is asked for it), and the accused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    /// The proof's id.
    pub id: Commitment,
    /// The claimant (the gossip message's signed author).
    pub from: String,
    /// The peer the proof accuses.
    pub accused: String,
}

/// The claims running and waiting, and the claimants not heard for now.
#[derive(Debug, Default)]
pub struct ClaimQueue {
    running: Vec<Claim>,
    waiting: VecDeque<Claim>,
    ignored: HashMap<String, Instant>,
}

impl ClaimQueue {
    /// A claim heard at `now`: returns it if it is to be fetched at once; otherwise it waits
    /// or, if it repeats a claim held, comes from a claimant ignored for now, or finds the line
    /// full, is dropped.
    pub fn offer(&mut self, claim: Claim, now: Instant) -> Option<Claim> {
        if self.is_ignored(&claim.from, now) {
            return None;
        }
        let claimant_busy = self.running.iter().any(|c| c.from == claim.from);
        if !claimant_busy && self.running.len() < MAX_RUNNING {
            self.running.push(claim.clone());
            return Some(claim);
        }
        // One place per claimant in the line: a flood from one peer holds one.
        let claimant_waits = self.waiting.iter().any(|c| c.from == claim.from);
        let held = self.running.contains(&claim);
        if !claimant_waits && !held && self.waiting.len() < MAX_WAITING {
            self.waiting.push_back(claim);
        }
        None
    }

    /// The fetch of `claim` ended at `now`; `held` says whether its proof held. Returns the
    /// waiting claims to fetch now, skipping (and dropping) those `settled` says need no fetch
    /// any more (their accused already excluded).
    pub fn finish(
        &mut self,
        claim: &Claim,
        held: bool,
        now: Instant,
        settled: impl Fn(&Claim) -> bool,
    ) -> Vec<Claim> {
        self.running.retain(|c| c != claim);
        if !held {
            self.ignore(&claim.from, now);
        }
        let mut start = Vec::new();
        let mut kept = VecDeque::with_capacity(self.waiting.len());
        while let Some(c) = self.waiting.pop_front() {
            if settled(&c) || self.is_ignored(&c.from, now) {
                continue;
            }
            let claimant_busy = self.running.iter().any(|r| r.from == c.from);
            if !claimant_busy && self.running.len() < MAX_RUNNING {
                self.running.push(c.clone());
                start.push(c);
            } else {
                kept.push_back(c);
            }
        }
        self.waiting = kept;
        start
    }

    /// Claims being fetched now.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Claims waiting for a slot.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    fn is_ignored(&self, claimant: &str, now: Instant) -> bool {
        self.ignored
            .get(claimant)
            .is_some_and(|at| now.saturating_duration_since(*at) < IGNORE_FALSE_CLAIMANT)
    }

    fn ignore(&mut self, claimant: &str, now: Instant) {
        self.ignored
            .retain(|_, at| now.saturating_duration_since(*at) < IGNORE_FALSE_CLAIMANT);
        if self.ignored.len() >= MAX_IGNORED {
            if let Some(oldest) = self
                .ignored
                .iter()
                .min_by_key(|(_, at)| **at)
                .map(|(p, _)| p.clone())
            {
                self.ignored.remove(&oldest);
            }
        }
        self.ignored.insert(claimant.to_string(), now);
        // Its claims waiting are not heard either.
        self.waiting.retain(|c| c.from != claimant);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is the failure report

    use super::*;

    fn claim(id: u8, from: &str, accused: &str) -> Claim {
        Claim {
            id: Commitment([id; 32]),
            from: from.into(),
            accused: accused.into(),
        }
    }

    #[test]
    fn a_few_run_at_once_and_one_per_claimant() {
        let (mut q, now) = (ClaimQueue::default(), Instant::now());
        assert!(q.offer(claim(1, "a", "x"), now).is_some());
        // A second claim of the same claimant waits, even with slots free.
        assert!(q.offer(claim(2, "a", "x"), now).is_none());
        for (i, from) in ["b", "c", "d"].into_iter().enumerate() {
            assert!(q.offer(claim(3 + i as u8, from, "x"), now).is_some());
        }
        assert!(
            q.offer(claim(9, "e", "x"), now).is_none(),
            "all slots taken"
        );
        assert_eq!((q.running(), q.waiting()), (MAX_RUNNING, 2));
    }

    #[test]
    fn a_flood_from_one_claimant_holds_one_slot_and_one_place() {
        let (mut q, now) = (ClaimQueue::default(), Instant::now());
        for id in 0..200u8 {
            let _ = q.offer(claim(id, "flood", "x"), now);
        }
        assert_eq!((q.running(), q.waiting()), (1, 1));
        // Honest claimants still get the other slots.
        assert!(q.offer(claim(1, "honest", "x"), now).is_some());
    }

    #[test]
    fn a_real_claim_waits_out_silent_claimants_and_then_runs() {
        let (mut q, t0) = (ClaimQueue::default(), Instant::now());
        let silent: Vec<Claim> = (0..MAX_RUNNING)
            .map(|i| claim(i as u8, &format!("sybil{i}"), "honest-stage"))
            .collect();
        for c in &silent {
            assert!(q.offer(c.clone(), t0).is_some());
        }
        let real = claim(99, "head", "liar");
        assert!(q.offer(real.clone(), t0).is_none(), "every slot is taken");
        // The first silent fetch times out: the real claim takes its slot.
        let t1 = t0 + Duration::from_secs(125);
        assert_eq!(q.finish(&silent[0], false, t1, |_| false), vec![real]);
        // The claimant of a claim that came to nothing is not heard for a while...
        assert!(q.offer(claim(50, "sybil0", "x"), t1).is_none());
        assert_eq!(q.waiting(), 0);
        // ...and is heard again after.
        let t2 = t1 + IGNORE_FALSE_CLAIMANT;
        let _ = q.finish(&silent[1], false, t2, |_| false);
        assert!(q.offer(claim(51, "sybil0", "x"), t2).is_some());
    }

    #[test]
    fn a_claim_that_held_does_not_silence_its_claimant_and_settled_ones_are_dropped() {
        let (mut q, now) = (ClaimQueue::default(), Instant::now());
        let first = claim(1, "a", "liar");
        assert!(q.offer(first.clone(), now).is_some());
        for from in ["b", "c", "d"] {
            assert!(q.offer(claim(1, from, "liar"), now).is_some());
        }
        // The same proof from a fifth peer, and another from the first claimant, wait.
        assert!(q.offer(claim(1, "e", "liar"), now).is_none());
        assert!(q.offer(claim(2, "a", "other"), now).is_none());
        // The first fetch held: "liar" is excluded, so the waiting copy of its proof is
        // dropped, and the first claimant's other claim runs.
        let start = q.finish(&first, true, now, |c| c.accused == "liar");
        assert_eq!(start, vec![claim(2, "a", "other")]);
        assert_eq!(q.waiting(), 0);
    }

    #[test]
    fn the_line_is_bounded() {
        let (mut q, now) = (ClaimQueue::default(), Instant::now());
        for i in 0..(MAX_RUNNING + MAX_WAITING + 50) {
            let _ = q.offer(claim(i as u8, &format!("p{i}"), "x"), now);
        }
        assert_eq!((q.running(), q.waiting()), (MAX_RUNNING, MAX_WAITING));
    }
}
