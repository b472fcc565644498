//! Why an attempt at a generation stops, and the peers a generation goes on without.

use crate::core::Node;

/// Why an attempt stopped.
pub(super) enum Stop {
    /// A stage was proven to lie: recompute without it.
    Liar(String),
    /// A peer's answer to a hop could not be used (it failed, refused, went away, or broke the
    /// protocol in a way no proof can show): recompute without it, excluding no one.
    Unusable {
        /// The peer.
        peer: String,
        /// What was wrong, for the logs and the final error.
        why: String,
        /// Whether later generations should avoid the peer for a while too (not when it was
        /// only busy).
        remember: bool,
    },
    /// The tokens a taken-over generation's client holds are not what this head derives from
    /// them: recompute the generation token by token and correct the client.
    Diverged,
    /// Anything else ends the generation.
    Failed(String),
}

/// The answer of `peer` could not be used because of `why`.
pub(super) fn unusable(peer: &str, why: String) -> Stop {
    Stop::Unusable {
        peer: peer.to_string(),
        why,
        remember: true,
    }
}

/// Peers a generation goes on without, each with why.
pub(super) type Avoided = Vec<(String, String)>;

/// Whether `peer` is among the `avoid`ed.
pub(super) fn avoided(avoid: &[(String, String)], peer: &str) -> bool {
    avoid.iter().any(|(p, _)| p == peer)
}

/// Leaves `peer` out of the rest of the generation and, if `remember`, out of this head's
/// routes for a while (where others serve its layers).
pub(super) fn leave_out(node: &Node, avoid: &mut Avoided, peer: &str, why: String, remember: bool) {
    if remember && peer != node.local {
        node.mark_unusable(peer);
    }
    if !avoided(avoid, peer) {
        avoid.push((peer.to_string(), why));
    }
}

impl From<String> for Stop {
    fn from(s: String) -> Stop {
        Stop::Failed(s)
    }
}
