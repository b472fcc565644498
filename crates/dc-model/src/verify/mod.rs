//! Spot checks of a stage's products (docs/VERIFICATION.md): what a stage keeps of a hop so it
//! can reveal any row of it afterwards, and the checker's side — Freivalds' test for every
//! weight product, the row's attention recomputed on the revealed KV cache, and the very glue
//! code a stage runs for everything between the products.
//!
//! A check needs no weights beyond `W · r` per product and the layer's norms: the stage reveals
//! the row of each product at one position (tied to its signed commitments by Merkle paths),
//! the activations entering and leaving the layer, and the layer's cache rows (tied to the
//! `KvCache` commitment of the hop that produced each). The checker re-derives every product's
//! input from those, tests each weight product's row in O(k + n), recomputes the row's
//! attention exactly (its inputs are the revealed cache rows and the row's own keys and
//! values), and recomputes the layer's output.
//!
//! Who owns what, from the bottom up (imports run one way: the stage's side is below the
//! forward pass, which fills it; the checker's side is above it, as it reruns the pass's glue):
//! - `plan.rs`: what a check of some drawn parts tests and needs revealed, and the draw itself
//!   (the rate that meets the detection goal).
//! - `kept.rs`: what a stage keeps of a hop's products, and its reveal of any row of them.
//! - `cache_log.rs`: the KV cache rows a stage logs for reveals, and the check that revealed
//!   rows are the ones each hop committed.
//! - `checker.rs`: a checker's secrets for one layer (`W · r` per product, biases, norms).
//! - `revealed.rs`: the checker's products for the shared glue — revealed rows tested by
//!   Freivalds, the attention recomputed on the revealed cache.
//! - `hashes.rs`: the hashes a check takes of what was revealed, hashed together.
//! - `check.rs`: the check of a reveal, row by row, and of many picks of a hop in parallel.

mod cache_log;
mod check;
mod checker;
mod hashes;
pub(crate) mod kept;
mod plan;
mod revealed;

pub use cache_log::{check_cache_rows, CacheLog};
pub use check::{check_picks, Pick};
pub use checker::LayerChecker;
pub use kept::KeptHop;
pub use plan::{
    check_parts, draw_checks, gemms_per_layer, goal_rate, rows_needed, tested_parts, Needs,
    GOAL_ESCAPE, GOAL_PERCENT, GOAL_TOKENS,
};
