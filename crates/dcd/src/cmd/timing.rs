//! When a generation's tokens came, for `generate --json`: the time to the first token (the
//! prompt's prefill, and through a daemon the request and route too) and the decode rate
//! after it. Measured inside one generation, so a benchmark needs no second run to subtract.

use std::time::Instant;

use serde_json::{json, Value};

/// Counts a generation's tokens as they come.
pub struct TokenClock {
    start: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    tokens: u64,
}

impl TokenClock {
    /// A clock started now, as the generation is asked for.
    pub fn start() -> TokenClock {
        TokenClock {
            start: Instant::now(),
            first: None,
            last: None,
            tokens: 0,
        }
    }

    /// A token came now.
    pub fn token(&mut self) {
        let now = Instant::now();
        self.first.get_or_insert(now);
        self.last = Some(now);
        self.tokens += 1;
    }

    /// `{"first_token_ms", "decode_tokens_per_s"}`: null where no token (or one) came.
    pub fn json(&self) -> Value {
        let first_ms = self.first.map(|f| (f - self.start).as_secs_f64() * 1e3);
        let decode = match (self.first, self.last) {
            (Some(f), Some(l)) if self.tokens > 1 && l > f => {
                Some((self.tokens - 1) as f64 / (l - f).as_secs_f64())
            }
            _ => None,
        };
        json!({ "first_token_ms": first_ms, "decode_tokens_per_s": decode })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_decode_rate_counts_the_tokens_after_the_first() {
        let mut clock = TokenClock::start();
        assert_eq!(clock.json()["first_token_ms"], Value::Null);
        clock.token();
        assert!(clock.json()["first_token_ms"].as_f64().is_some());
        assert_eq!(clock.json()["decode_tokens_per_s"], Value::Null);
        std::thread::sleep(std::time::Duration::from_millis(20));
        clock.token();
        clock.token();
        // Two tokens after the first in at least 20 ms: at most 100 per second.
        let rate = clock.json()["decode_tokens_per_s"]
            .as_f64()
            .unwrap_or(f64::NAN);
        assert!(rate > 0.0 && rate <= 100.0, "{rate}");
    }
}
