//! Prompt-lookup speculative decoding: the head guesses the next few tokens by finding the
//! text's last few tokens earlier in the prompt or the output and copying what followed them,
//! runs the guess through the stages in one pass with the token just sampled, and keeps the
//! longest run of guesses the ordinary sampler agrees with.
//!
//! Nothing here samples. Every token still comes from [`TokenLoop::next`] on the logits of the
//! position before it, with the same seeded per-position draw; a guess only decides which
//! positions a pass runs ahead of time. The logits of a position are the same bits whether it
//! runs alone or among others (rows are quantised one by one), so the accepted tokens are
//! exactly those of plain decoding, with any seed. What a wrong guess costs is the rows it
//! added to one pass, and the positions it wrote into the KV caches, which the next pass
//! overwrites (it starts where the agreement ended: see [`KvCache::truncate`]).
//!
//! [`TokenLoop::next`]: crate::generate::TokenLoop::next
//! [`KvCache::truncate`]: crate::kv_cache::KvCache::truncate

use std::collections::VecDeque;

use serde::Serialize;

pub use dc_types::Speculation;

/// Longest n-gram matched: a longer match is a better predictor, tried first.
const MAX_NGRAM: usize = 4;
/// Shortest n-gram matched. One or two tokens repeat too often by chance in free text to be
/// worth a guess (a pass of two rows costs about 1.3 of one on SmolLM2: `dcd bench
/// speculative` prints the cost of each size).
const MIN_NGRAM: usize = 3;
/// Most tokens guessed in one pass.
pub const MAX_DRAFT: usize = 8;
/// How long the first guess may be (a guess of more rows costs more when it misses: start
/// short, and double after each full hit).
const FIRST_DRAFT: usize = 2;
/// Most passes without a guess after guesses that missed at once.
const MAX_COOLDOWN: usize = 16;

/// Guesses the tokens after `history` by the most recent earlier occurrence of its last
/// `MAX_NGRAM` (else fewer, down to `MIN_NGRAM`) tokens: the up to `limit` tokens that followed
/// it. Empty when nothing matches.
pub fn prompt_lookup(history: &[u32], limit: usize) -> Vec<u32> {
    if limit == 0 {
        return Vec::new();
    }
    for n in (MIN_NGRAM..=MAX_NGRAM).rev() {
        if history.len() <= n {
            continue;
        }
        let tail = &history[history.len() - n..];
        // The latest start before the tail itself; what follows must exist.
        let found = (0..history.len() - n)
            .rev()
            .find(|&s| &history[s..s + n] == tail);
        if let Some(s) = found {
            let from = s + n;
            let to = (from + limit).min(history.len());
            return history[from..to].to_vec();
        }
    }
    Vec::new()
}

/// How the guesses of one generation went.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SpeculationStats {
    /// Passes after the prompt's (each runs the token just sampled and its guess, if any).
    pub passes: usize,
    /// Tokens guessed.
    pub drafted: usize,
    /// Guessed tokens the sampler produced (each saved a pass).
    pub accepted: usize,
}

/// The guesses of one generation: what the pass in flight ran ahead of the sampler.
#[derive(Clone, Debug)]
pub struct Speculator {
    mode: Speculation,
    /// The prompt and every token produced.
    history: Vec<u32>,
    /// Guessed tokens the last pass ran, not yet compared with what the sampler produced.
    ahead: VecDeque<u32>,
    /// How long the next guess may be: halved after a miss, doubled after a full hit.
    length: usize,
    /// Guessed tokens of the pass in flight the sampler produced so far.
    hits: usize,
    /// Passes to run without a guess, after a guess missed at its first token: one, then
    /// twice as many after each such miss in a row (up to [`MAX_COOLDOWN`]), none after a hit.
    /// So a text that does not repeat itself costs few extra rows.
    cooldown: usize,
    /// Passes left before guessing again.
    skip: usize,
    /// How it went.
    pub stats: SpeculationStats,
}

impl Speculator {
    /// Guesses for a generation from `prompt`.
    pub fn new(mode: Speculation, prompt: &[u32]) -> Speculator {
        Speculator {
            mode,
            history: prompt.to_vec(),
            ahead: VecDeque::new(),
            length: FIRST_DRAFT,
            hits: 0,
            cooldown: 0,
            skip: 0,
            stats: SpeculationStats::default(),
        }
    }

    /// The sampler produced `t`. True when the positions the last pass ran after it still hold
    /// (no guess was outstanding, or `t` is the guess); false when `t` differs from the guess,
    /// and the rest of the pass's rows must be dropped.
    pub fn produced(&mut self, t: u32) -> bool {
        self.history.push(t);
        match self.ahead.pop_front() {
            None => true,
            Some(guess) if guess == t => {
                self.stats.accepted += 1;
                self.hits += 1;
                self.cooldown = 0;
                if self.ahead.is_empty() {
                    self.length = (self.length * 2).min(MAX_DRAFT);
                }
                true
            }
            Some(_) => {
                self.ahead.clear();
                self.length = (self.length / 2).max(1);
                if self.hits == 0 {
                    self.cooldown = (self.cooldown * 2).clamp(1, MAX_COOLDOWN);
                    self.skip = self.cooldown;
                }
                false
            }
        }
    }

    /// The tokens of the next pass: the last token produced, then a guess of at most `room`
    /// tokens after it.
    pub fn next_pass(&mut self, room: usize) -> Vec<u32> {
        let last = self.history.last().copied().unwrap_or_default();
        let guess = match self.mode {
            Speculation::PromptLookup if self.skip == 0 => {
                prompt_lookup(&self.history, room.min(self.length))
            }
            Speculation::PromptLookup => {
                self.skip -= 1;
                Vec::new()
            }
            Speculation::Off => Vec::new(),
        };
        self.hits = 0;
        self.stats.passes += 1;
        self.stats.drafted += guess.len();
        self.ahead = guess.iter().copied().collect();
        std::iter::once(last).chain(guess).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_longest_match_is_copied() {
        // "5 6 7" occurs twice before the tail; the later one (followed by 9) wins over the
        // earlier (followed by 1).
        let h = [5, 6, 7, 1, 5, 6, 7, 9, 2, 5, 6, 7];
        assert_eq!(prompt_lookup(&h, 3), vec![9, 2, 5]);
        // A match of four tokens wins over a later one of three.
        let h = [1, 5, 6, 7, 8, 8, 3, 5, 6, 7, 9, 1, 5, 6, 7];
        assert_eq!(prompt_lookup(&h, 2), vec![8, 8]);
        // Bounded by the limit and by the history's end.
        assert_eq!(prompt_lookup(&[1, 2, 3, 4, 1, 2, 3], 10), vec![4, 1, 2, 3]);
        assert_eq!(prompt_lookup(&[1, 2, 3, 4, 1, 2, 3], 0), Vec::<u32>::new());
        // Two tokens repeated are not a match; nothing found is no guess.
        assert!(prompt_lookup(&[1, 2, 3, 4, 1, 2], 4).is_empty());
        assert!(prompt_lookup(&[1, 2], 4).is_empty());
    }

    #[test]
    fn a_miss_drops_the_rest_of_the_guess_and_shortens_the_next() {
        let mut s = Speculator::new(Speculation::PromptLookup, &[1, 2, 3, 4, 5, 1, 2, 3]);
        s.length = MAX_DRAFT;
        assert_eq!(s.next_pass(8), vec![3, 4, 5, 1, 2, 3]);
        assert!(s.produced(4) && s.produced(5));
        assert!(!s.produced(7), "the guess was 1");
        assert!(s.produced(9), "after a miss nothing is outstanding");
        assert_eq!(s.stats.accepted, 2);
        assert_eq!(s.stats.drafted, 5);
        assert_eq!(s.length, MAX_DRAFT / 2);
        assert_eq!(s.skip, 0, "a guess that hit first is tried again at once");
        // After "1 2 3" again: the latest match is followed by "4 5 7 9".
        for t in [1, 2, 3] {
            s.produced(t);
        }
        assert_eq!(s.next_pass(8), vec![3, 4, 5, 7, 9]);
        assert!(!s.produced(6), "missed at its first token");
        assert_eq!(s.skip, 1);
        for t in [1, 2, 3] {
            s.produced(t);
        }
        assert_eq!(s.next_pass(8), vec![3], "one pass without a guess");
        assert_eq!(
            s.next_pass(8),
            vec![3, 6, 1],
            "then a guess (its length halved twice)"
        );
        assert!(!s.produced(8));
        assert_eq!(s.skip, 2, "twice as long after a second miss in a row");
        let mut off = Speculator::new(Speculation::Off, &[1, 2, 3, 1, 2, 3]);
        assert_eq!(off.next_pass(8), vec![3]);
    }

    #[test]
    fn modes_parse_and_print() {
        for m in [Speculation::Off, Speculation::PromptLookup] {
            assert_eq!(m.to_string().parse::<Speculation>(), Ok(m));
        }
        assert!("on"
            .parse::<Speculation>()
            .unwrap_err()
            .contains("prompt-lookup"));
    }
}
