//! Verification, as one subsystem: what a stage commits to, how one revealed row of a product
//! is tied back to that commitment, and how a checker tests the row without the weights.
//! NUMERICS.md §5–6 is the contract; docs/VERIFICATION.md the protocol built on it.
//!
//! - **What a stage commits.** Each product's output rows — its exact accumulators rounded once
//!   to f32, bit for bit what the product hands on — are the leaves of a Merkle tree, and the
//!   product's commitment hashes the tree's root with its shape. Every hash is blake3 keyed by
//!   one [`Domain`], so a leaf of one kind can never stand for another.
//! - **How a reveal is checked.** Asked for one row, a stage sends the row's exact accumulators
//!   (in units form, or in canonical encoding where a value is too wide) with its Merkle path.
//!   The checker decodes them, refusing malformed bytes from a peer that may lie, rounds them
//!   as the stage rounded them, and accepts the row only if that leaf and the path give the
//!   signed commitment.
//! - **What Freivalds does.** The checker holds `u = W · r` for a secret random `r` per weight
//!   matrix; a revealed row `c` of `x · W` passes iff `c · r == x · u` modulo the prime
//!   `2^61 − 1`. Every value is a dyadic rational, which maps exactly into that field, so an
//!   honest row always passes and a wrong one with probability at most about `4·10⁻¹⁹`, in
//!   O(k + n) per row instead of re-running the O(k · n) product.
//!
//! Who owns what (imports run one way: `reveal` over `commit` and `freivalds`, `commit` over
//! `hash_many`; all of them over the product in `gemm`, which knows nothing of hashing):
//! - `commit.rs`: [`Commitment`], [`Domain`], row leaves, Merkle trees and the product
//!   commitments (also the [`Gemm`](crate::Gemm) methods that commit a product's output).
//! - `hash_many.rs`: keyed BLAKE3 of many short messages at once in SIMD lanes, the same bytes
//!   as `blake3::keyed_hash` for each (row leaves are short; this is what makes them cheap).
//! - `reveal.rs`: a revealed row's bytes — making them from the accumulators, decoding them
//!   for a check, and opening them against a commitment.
//! - `freivalds.rs`: the residues modulo `2^61 − 1` and the checker's key for one matrix.

pub mod commit;
pub mod freivalds;
pub mod hash_many;
pub mod reveal;

pub use commit::{Commitment, Domain};
