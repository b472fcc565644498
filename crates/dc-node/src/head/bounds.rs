//! What a daemon accepts from the head of a generation it asked another peer to head: events
//! in order and within the request's bounds. The head is any peer that won the election, so a
//! hostile one could otherwise stream tokens (or corrections of a million tokens each) for as
//! long as it liked, holding the client's generation slot and growing its buffers.

use dc_types::{GenerationEvent, TokenLogprobs};

/// Most `Started` events a generation may carry: the first route, and one per stage handed to
/// another peer or per recomputation. An honest head sends a handful (it makes at most four
/// attempts, each over a route of a few stages).
pub const MAX_ROUTE_CHANGES: u32 = 64;

/// The bounds a head's events must keep for one generation.
#[derive(Debug)]
pub struct EventBounds {
    max_new_tokens: u32,
    /// Tokens the client has now (after every token and correction so far).
    sent: u32,
    starts: u32,
    /// The alternatives asked for per token (none: no log-probabilities).
    top_logprobs: Option<u8>,
}

impl EventBounds {
    /// Bounds for a generation asking for at most `max_new_tokens` new tokens and, with
    /// `top_logprobs`, their log-probabilities.
    pub fn new(max_new_tokens: u32, top_logprobs: Option<u8>) -> Self {
        EventBounds {
            max_new_tokens,
            sent: 0,
            starts: 0,
            top_logprobs,
        }
    }

    /// Log-probabilities of a request that asked for them, as many alternatives as it asked.
    fn admit_logprobs(&self, lp: &TokenLogprobs) -> Result<(), String> {
        let Some(n) = self.top_logprobs else {
            return Err("it sent log-probabilities nobody asked for".into());
        };
        if lp.top.len() > usize::from(n) {
            return Err(format!(
                "it sent {} top log-probabilities of at most {n}",
                lp.top.len()
            ));
        }
        Ok(())
    }

    /// Takes the head's next event, or says how it broke the protocol.
    pub fn admit(&mut self, ev: &GenerationEvent) -> Result<(), String> {
        let max = self.max_new_tokens;
        match ev {
            GenerationEvent::Started { .. } => {
                self.starts += 1;
                if self.starts > MAX_ROUTE_CHANGES {
                    return Err(format!(
                        "it changed the route more than {MAX_ROUTE_CHANGES} times"
                    ));
                }
            }
            GenerationEvent::Token {
                index, logprobs, ..
            } => {
                if let Some(lp) = logprobs {
                    self.admit_logprobs(lp)?;
                }
                if *index != self.sent {
                    return Err(format!(
                        "it sent token {index} when the next was {}",
                        self.sent
                    ));
                }
                if *index >= max {
                    return Err(format!("it sent token {index} of at most {max}"));
                }
                self.sent += 1;
            }
            GenerationEvent::Corrected {
                from,
                tokens,
                logprobs,
                ..
            } => {
                if !logprobs.is_empty() && logprobs.len() != tokens.len() {
                    return Err(format!(
                        "its correction of {} tokens carries {} log-probabilities",
                        tokens.len(),
                        logprobs.len()
                    ));
                }
                for lp in logprobs {
                    self.admit_logprobs(lp)?;
                }
                if *from > self.sent {
                    return Err(format!(
                        "it corrected from token {from}, after the {} sent",
                        self.sent
                    ));
                }
                let now = u64::from(*from) + tokens.len() as u64;
                if now > u64::from(max) {
                    return Err(format!(
                        "its correction makes {now} tokens of at most {max}"
                    ));
                }
                self.sent = now as u32;
            }
            GenerationEvent::Done { tokens, .. } => {
                if tokens.len() as u64 > u64::from(max) {
                    return Err(format!(
                        "it ended with {} tokens of at most {max}",
                        tokens.len()
                    ));
                }
            }
            GenerationEvent::Failed { .. } => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(index: u32) -> GenerationEvent {
        GenerationEvent::Token {
            index,
            id: 7,
            logprobs: None,
        }
    }

    fn corrected(from: u32, n: usize) -> GenerationEvent {
        GenerationEvent::Corrected {
            from,
            tokens: vec![1; n],
            logprobs: vec![],
            liar: "x".into(),
        }
    }

    fn started() -> GenerationEvent {
        GenerationEvent::Started {
            head: "h".into(),
            route: vec![],
        }
    }

    #[test]
    fn log_probabilities_only_as_asked() {
        let lp = |n: usize| TokenLogprobs {
            logprob: -1.0,
            top: vec![(3, -0.5); n],
        };
        let with = |n: usize| GenerationEvent::Token {
            index: 0,
            id: 3,
            logprobs: Some(lp(n)),
        };
        EventBounds::new(4, Some(2)).admit(&with(2)).unwrap();
        let e = EventBounds::new(4, Some(2)).admit(&with(3)).unwrap_err();
        assert!(e.contains("3 top log-probabilities of at most 2"), "{e}");
        let e = EventBounds::new(4, None).admit(&with(0)).unwrap_err();
        assert!(e.contains("nobody asked"), "{e}");
        let mut b = EventBounds::new(4, Some(1));
        b.admit(&with(1)).unwrap();
        let bad = GenerationEvent::Corrected {
            from: 0,
            tokens: vec![1, 2],
            logprobs: vec![lp(1)],
            liar: "x".into(),
        };
        assert!(b.admit(&bad).unwrap_err().contains("carries 1"));
    }

    #[test]
    fn an_honest_stream_passes() {
        let mut b = EventBounds::new(4, None);
        for ev in [started(), token(0), token(1), started(), corrected(1, 2)] {
            b.admit(&ev).unwrap();
        }
        b.admit(&token(3)).unwrap();
        let done = GenerationEvent::Done {
            tokens: vec![1; 4],
            stop: "length".into(),
            final_logits: Default::default(),
        };
        b.admit(&done).unwrap();
    }

    #[test]
    fn tokens_beyond_the_request_are_refused() {
        let mut b = EventBounds::new(2, None);
        b.admit(&token(0)).unwrap();
        b.admit(&token(1)).unwrap();
        let e = b.admit(&token(2)).unwrap_err();
        assert!(e.contains("token 2 of at most 2"), "{e}");
    }

    #[test]
    fn tokens_out_of_order_are_refused() {
        let mut b = EventBounds::new(8, None);
        b.admit(&token(0)).unwrap();
        assert!(b.admit(&token(0)).is_err(), "a repeat");
        let mut b = EventBounds::new(8, None);
        assert!(b.admit(&token(1)).is_err(), "a gap");
    }

    #[test]
    fn corrections_stay_within_the_request() {
        let mut b = EventBounds::new(4, None);
        b.admit(&token(0)).unwrap();
        let e = b.admit(&corrected(0, 5)).unwrap_err();
        assert!(e.contains("5 tokens of at most 4"), "{e}");
        assert!(
            b.admit(&corrected(2, 1)).is_err(),
            "from after what was sent"
        );
        // A correction may shorten the sequence; the next token continues from it.
        b.admit(&corrected(0, 0)).unwrap();
        b.admit(&token(0)).unwrap();
    }

    #[test]
    fn route_changes_are_bounded() {
        let mut b = EventBounds::new(1, None);
        for _ in 0..MAX_ROUTE_CHANGES {
            b.admit(&started()).unwrap();
        }
        assert!(b.admit(&started()).is_err());
    }

    #[test]
    fn a_done_longer_than_the_request_is_refused() {
        let mut b = EventBounds::new(1, None);
        let done = GenerationEvent::Done {
            tokens: vec![1; 2],
            stop: "length".into(),
            final_logits: Default::default(),
        };
        assert!(b.admit(&done).is_err());
    }
}
