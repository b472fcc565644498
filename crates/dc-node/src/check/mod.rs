//! Checking: everything this daemon does to hold other peers to their word, in one room.
//!
//! **What a stage commits to.** For every hop it serves, a stage signs a [`HopRecord`]: the
//! generation, step and layers, blake3 of its input and output activations, the root of its
//! per-GEMM accumulator commitments (the trace, sent alongside), and the chain of the
//! generation's earlier inputs. The commitments are built in dc-kernels' `verify` module; what a
//! stage keeps and reveals for a check is dc-model's `verify` module.
//!
//! **What a head checks** (this room):
//! - every record and trace as it arrives: signature, fields, chain, and that the record and
//!   trace agree (a contradiction is a proof by itself) — `proof.rs::check_consistency`;
//! - spot checks: private coins draw parts of layers; the stage reveals the rows they need and
//!   the head tests weight products by Freivalds' test, recomputes attention and glue —
//!   `spot.rs`;
//! - audits: another peer serving the same layers replays a drawn hop and the traces must be
//!   equal — `audit.rs`.
//!
//! **How a proof is judged.** A failed check or audit is not a proof: the referee replays the
//! accused's hops from its own weights, finds the first product that differs and builds a
//! [`FraudProof`]; any peer checks a proof by re-running at most one layer
//! (`proof.rs::verify_proof`), and only then excludes the accused and gossips the proof —
//! `referee.rs`. Proofs heard of in gossip are fetched and checked in turn, bounded —
//! `fetch.rs`, `claims.rs`. Counters and the proofs held are the ledger — `book.rs`; the
//! room's state is one [`Checks`] — `checks.rs`.
//!
//! [`HopRecord`]: dc_types::HopRecord
//! [`FraudProof`]: dc_types::FraudProof

pub mod audit;
pub mod book;
pub mod checks;
pub mod claims;
pub mod fetch;
pub mod log;
pub mod proof;
pub mod referee;
pub mod spot;

pub use audit::AuditSession;
pub use checks::Checks;
pub use log::StageLog;
